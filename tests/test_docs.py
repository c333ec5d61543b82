"""The README and docs/ as a reader meets them: every relative link and
anchor resolves, and the README's API example runs as printed."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, find_mpiexec

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped,
    spaces to hyphens, repeats numbered."""
    seen: dict = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list:
    """The link targets of a page, outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, broken


def test_the_docs_are_linked_from_the_readme_or_the_docs_index():
    reached = {(ROOT / "README.md").resolve()}
    for page in (ROOT / "README.md", ROOT / "docs" / "README.md"):
        reached |= {(page.parent / t.partition("#")[0]).resolve() for t in links(page) if t.partition("#")[0]}
    assert not [str(p) for p in PAGES if p.resolve() not in reached]


def test_the_anchor_rule_matches_github():
    """Anchors GitHub gives these headings: a slash, a comma, an apostrophe,
    dots and parentheses dropped."""
    assert {"jax--optax", "on-a-cluster"} <= anchors(ROOT / "README.md")
    assert {"which-ranks-and-which-transport"} <= anchors(ROOT / "docs" / "frameworks.md")
    assert {"the-sites-mpi"} <= anchors(ROOT / "docs" / "launchers.md")
    assert {"over-torchdistributed-2026-11-27"} <= anchors(ROOT / "docs" / "results" / "gpu-h200.md")


CHECKS = """
from mpi4py import MPI
comm = topo.world
raw = np.random.default_rng(comm.rank).standard_normal(grad.size, dtype=np.float32)
for result in (mean, grad):  # the same bits on every rank
    assert len(set(comm.allgather(result.tobytes()))) == 1
# Conservation over the two calls: what was applied plus what the residuals
# hold is what the ranks put in.
kept = comm.allreduce(ar.residual_full().astype(np.float64))
put_in = comm.allreduce(2 * raw.astype(np.float64))
assert np.allclose(comm.size * (mean.astype(np.float64) + grad) + kept, put_in, rtol=1e-5, atol=1e-4)
assert ar.last["k"] > 0 and span[1] > span[0] and len(values) == span[1] - span[0]
if comm.rank == 0:
    print("api example ok")
"""


@pytest.mark.slow
def test_the_readme_api_example_runs_on_two_emulated_nodes(tmp_path):
    block = re.search(r"<!-- api-example:.*?-->\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README lost its API example"
    script = tmp_path / "api.py"
    script.write_text(block.group(1) + CHECKS)
    run = subprocess.run([find_mpiexec(), "-n", "4", sys.executable, str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "api example ok" in run.stdout
