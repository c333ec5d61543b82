"""The mutation check's faults still apply to the package: each one's text
occurs exactly once where it patches, and its hint names a stage and test
files that exist. A refactoring that moves the patched code makes a fault
stale; this says so in the suite, not only when the check is next run."""
from __future__ import annotations

from conftest import ROOT
from mutation_check import FAULTS, stale


def test_every_fault_still_applies_to_the_package():
    assert stale(ROOT, FAULTS) == []
