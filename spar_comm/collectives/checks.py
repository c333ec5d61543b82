"""What an allreducer refuses, and how: its settings once, when it is built,
and every call's gradient, ``out`` and ``state``.

Each check returns a message or a bit code instead of raising, so that the
caller can gather every rank's verdict first and raise the same error on all
of them (``consensus.raise_if_any``, or the per-call Allgather of codes in
``Allreducer._check``): a rank that raised alone would leave the others
waiting in a collective.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
import numpy as np

from .. import kernels
from ..errors import ConfigError, GradientError, NonFiniteGradientError, SparCommError
from ..memory import HostMemory
from .codecs import INDICES, VALUES

#: Gradient dtypes; NumPy knows bfloat16 through ml_dtypes.
DTYPES = ("float32", "float64", "float16", "bfloat16")
#: Indices travel as int32 positions within a shard.
MAX_SHARD = 2**31 - 1
#: The algorithms whose messages travel through codecs, by setting: the values
#: of every message (``values=``), the positions of (index, value) pairs (``indices=``).
CODECS = {"values": ("dense", "hier_dense", "topka", "hitopk", "hitopk_leader"),
          "indices": ("topka", "hitopk", "hitopk_leader")}


def settings_problem(cls: Any, size: Any, dtype: Any, settings: Any, memory: HostMemory) -> Optional[str]:
    """A message for the first bad setting of an allreducer of class ``cls``, or
    None; ``settings.options`` are its own, merged with their defaults."""
    density, max_density, selector = settings.density, settings.max_density, settings.selector
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        return f"size must be a positive integer, got {size!r}"
    try:
        name = np.dtype(dtype).name
    except TypeError:
        return f"dtype {dtype!r} is not a NumPy dtype"
    if name not in DTYPES:
        return f"dtype must be one of {', '.join(DTYPES)}, got {name}"
    if name == "bfloat16" and not memory.in_host_memory:
        return "bfloat16 gradients are host arrays only (CuPy has no bfloat16); use float16 on the GPU"
    if not density_fits(density, 1):
        return f"density must be in (0, 1], got {density!r}"
    if max_density is not None and not (density_fits(max_density, 1) and max_density >= density):
        return f"max_density must be in [density, 1] = [{density:g}, 1], got {max_density!r}"
    if selector not in kernels.SELECTORS:
        return f"unknown selector {selector!r}; known: {', '.join(sorted(kernels.SELECTORS))}"
    if cls.sparse and size > MAX_SHARD:
        return f"size {size} exceeds {MAX_SHARD}: sparse indices travel as int32"
    try:  # built here on every rank, so that bad options are refused everywhere alike
        memory.selector(selector, dict(settings.selector_options))
    except (TypeError, ValueError) as error:
        return f"selector {selector!r} refused its options {dict(settings.selector_options)!r}: {error}"
    if not isinstance(settings.shared_buffer, bool):
        return f"shared_buffer must be True or False, got {settings.shared_buffer!r}"
    for setting, known in (("values", VALUES), ("indices", INDICES)):
        given = getattr(settings, setting)
        if given is not None and given not in known:
            return f"{setting} must be one of {', '.join(known)}, got {given!r}"
        if given is not None and cls.name not in CODECS[setting]:
            return (f"{setting}={given!r}: {cls.name} takes no {setting} codec; "
                    f"{setting} codecs apply to {', '.join(CODECS[setting])}")
    unknown = sorted(set(settings.options) - set(cls.options))
    if unknown:
        return (f"{cls.name} takes no option {', '.join(map(repr, unknown))} "
                f"(its options: {', '.join(cls.options) or 'none'})")
    return cls.check_options(int(size), dict(settings.options))


# The per-call check: each problem is a bit, gathered from every rank.
PROBLEMS = {
    1: "not {kind}",
    2: "not 1-D (allreduce takes the flat fused buffer)",
    4: "wrong length",
    8: "wrong dtype",
    16: "not contiguous",
    32: "non-finite values (NaN or Inf)",
    64: "out is not a 1-D contiguous array of the gradient's length and dtype",
    128: "the residual is not a Residual of this rank's span, length and dtype (see residual_state)",
    256: "density= is not in (0, max_density] = (0, {max_density:g}]",
}
NON_FINITE = 32
BAD_OUT = 64
BAD_RESIDUAL = 128
BAD_DENSITY = 256


def density_fits(density: Any, most: float) -> bool:
    """Whether ``density`` is a number in (0, ``most``]."""
    return not isinstance(density, bool) and isinstance(density, (int, float, np.floating)) and 0 < density <= most


def problems_of(grad: Any, out: Any, size: int, dtype: np.dtype, memory: HostMemory,
                finite: Optional[bool] = None) -> int:
    """The problems of a gradient and ``out`` already adopted by ``memory`` (None
    where that failed), as bits of ``PROBLEMS``; ``finite``: whether the
    gradient holds no NaN or Inf, where the caller knows (else a pass finds out)."""
    if grad is None:
        return 1
    code = 0
    if out is not None and not (
        memory.is_array(out) and out.shape == (size,) and out.dtype == dtype and out.flags.c_contiguous
        and getattr(out.flags, "writeable", True)  # CuPy arrays are always writable
    ):
        code |= BAD_OUT
    if grad.ndim != 1:
        code |= 2
    elif grad.size != size:
        code |= 4
    if grad.dtype != dtype:
        code |= 8
    if not grad.flags.c_contiguous:
        code |= 16
    if code == 0 and not (memory.all_finite(grad) if finite is None else finite):
        code |= NON_FINITE
    return code


def refusal(algorithm: str, codes: Sequence[int], kind: str, dtype: np.dtype, size: int,
            max_density: float = 1.0) -> SparCommError:
    """The error every rank raises for every rank's codes (some nonzero):
    ConfigError for a residual of another rank or layout or a density out of range,
    NonFiniteGradientError where NaN or Inf is the only problem, GradientError otherwise."""
    codes = np.asarray(codes)
    parts = [f"rank {rank}: " + ", ".join(text.format(kind=kind, max_density=max_density)
                                          for bit, text in PROBLEMS.items() if code & bit)
             for rank, code in enumerate(codes.tolist()) if code]
    if (codes & (BAD_RESIDUAL | BAD_DENSITY)).any():
        error = ConfigError
    elif (codes | NON_FINITE).max() == NON_FINITE:  # the values alone: say so, and nothing of shapes
        return NonFiniteGradientError(f"{algorithm} allreduce refused the gradient, nothing was changed: "
                                      + "; ".join(parts))
    else:
        error = GradientError
    return error(f"{algorithm} allreduce refused the gradient (expected 1-D contiguous {dtype.name} of length "
                 f"{size}; nothing was changed): " + "; ".join(parts))
