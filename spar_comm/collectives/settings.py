"""What an allreducer is made with, and what one call of it is given.

``Settings`` is a value: frozen, compared across ranks as a whole before
anything is built (every rank must make the same allreducer), and kept by
callers that rebuild allreducers (the torch ways in, per bucket). ``Call``
is one call's inputs beside the gradient, passed down to the pieces that use
them instead of being swapped into the allreducer's fields.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from .feedback import ErrorFeedback


@dataclass(frozen=True)
class Settings:
    """An allreducer's settings, apart from the ranks, the size and the dtype.

    ``density``: the fraction selected by default; ``max_density`` (default
    ``density``) the most a call may ask for, by which buffers are sized.
    ``selector`` and ``selector_options``: the top-k kernel. ``values`` and
    ``indices``: the codecs of the messages (``codecs.VALUES``,
    ``codecs.INDICES``). ``shared_buffer``: ``Allreducer.buffer`` in the
    node's shared memory where the algorithm can read it there. ``options``:
    the algorithm's own (``powersgd``: ``rank``, ``shapes``).
    """

    density: float = 0.001
    selector: str = "mstopk"
    error_feedback: bool = True
    average: bool = True
    selector_options: Mapping[str, Any] = field(default_factory=dict)
    shared_buffer: bool = False
    values: Optional[str] = None
    indices: Optional[str] = None
    max_density: Optional[float] = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def most_density(self) -> Any:
        """The largest density a call may ask for."""
        return self.density if self.max_density is None else self.max_density

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    def agreed(self) -> Dict[str, Any]:
        """The settings as plain values every rank must hold alike (``require_same``)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("selector_options", "options"):
            fields[name] = repr(sorted(dict(fields[name]).items()))
        return fields

    def to_dict(self) -> Dict[str, Any]:
        """As plain data, for a checkpoint (``torch.load(weights_only=True)`` reads it)."""
        return {f.name: (dict(getattr(self, f.name)) if f.name in ("selector_options", "options")
                         else getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class Call:
    """One allreduce call's inputs beside the gradient: the result array
    (``out``, None for a new one), error feedback on the residual it updates
    (the allreducer's own, or the caller's), and its density."""

    out: Any
    feedback: ErrorFeedback
    density: float

    def output_is(self, array: Any) -> bool:
        """Whether the result array is ``array`` itself (``out=grad``, as a
        training loop reduces in place): a selection that reads ``grad`` for
        the last time may then zero it as it goes, instead of a zero-fill
        pass of its own."""
        return self.out is array
