"""argparse types shared by the drivers: a bad value becomes a usage message
and exit status 2, the same on every rank, before any MPI work starts."""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Callable, Type, TypeVar

Kind = TypeVar("Kind")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def density(text: str) -> float:
    """A fraction in (0, 1]: the share of a gradient selected."""
    value = positive_float(text) if text.strip() not in ("0", "0.0") else 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"density must be in (0, 1], got {text}")
    return value


def comma_list(kind: Callable, check: Callable[[object], bool], rule: str) -> Callable[[str], list]:
    """An argparse type for a comma-separated list whose every item passes ``check``."""

    def parse(text: str) -> list:
        try:
            items = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}s") from None
        bad = [item for item in items if not check(item)]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"every item must be {rule}, got {text!r}")
        return items

    return parse


def settings_from(args: argparse.Namespace, kind: Type[Kind]) -> Kind:
    """The dataclass ``kind`` with each field read from the flag of its name:
    the library takes its settings as a value, never a command line's namespace."""
    return kind(**{field.name: getattr(args, field.name) for field in dataclasses.fields(kind)})
