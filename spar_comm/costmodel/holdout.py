"""The cost model fitted to benchmark files with some sizes held out
(``predict.py fit``), and scored on them: how well it predicts what it has
not seen, which the error on the rows it was fitted to cannot tell."""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Dict, List, Sequence, Tuple

from ..errors import ConfigError
from .calibrate import Measurement, fit, measurements, read, relative_errors, topk_rates
from .machine import Machine, beta_to_gbps


@dataclass(frozen=True)
class HeldOutFit:
    """The fitted ``machine``, the rows it was fitted to and those held out,
    each with its predicted time and relative error."""

    machine: Machine
    fitted: List[Tuple[Measurement, float, float]]
    held: List[Tuple[Measurement, float, float]]

    def summary(self) -> dict:
        """The figures, the sizes on either side and the median errors, and every held-out row."""
        return {
            "machine": self.machine.to_dict(),
            "fit_sizes": sorted({r.size for r, *_ in self.fitted}),
            "holdout_sizes": sorted({r.size for r, *_ in self.held}),
            "fit_median_relative_error": median(e for *_, e in self.fitted),
            "holdout_median_relative_error": median(e for *_, e in self.held) if self.held else None,
            "holdout": [{"algorithm": r.algorithm, "size": r.size, "measured_s": r.seconds, "predicted_s": p,
                         "relative_error": e} for r, p, e in self.held],
        }

    def report(self) -> str:
        """The fitted figures, the error on the fitted rows, and a line for every held-out row."""
        summary = self.summary()
        lines = [figures(self.machine),
                 f"fitted on {len(self.fitted)} rows at sizes {', '.join(map(str, summary['fit_sizes']))}: "
                 f"median |pred-meas|/meas {summary['fit_median_relative_error']:.1%}"]
        if self.held:
            lines.append(f"{'size':>10} {'algorithm':<14} {'measured ms':>11} {'predicted ms':>12} {'error':>7}")
            lines += [f"{r.size:>10} {r.algorithm:<14} {r.seconds * 1e3:11.3f} {p * 1e3:12.3f} {e:7.1%}"
                      for r, p, e in self.held]
            lines.append(f"held-out sizes {', '.join(map(str, summary['holdout_sizes']))}: "
                         f"median |pred-meas|/meas {summary['holdout_median_relative_error']:.1%} "
                         f"over {len(self.held)} rows")
        return "\n".join(lines)


def fit_files(paths: Sequence[str], holdout_sizes: Sequence[int], base: Machine) -> HeldOutFit:
    """Fit to the bench_comm.py rows of ``paths`` at sizes not in
    ``holdout_sizes``, with the selection figures of their bench_topk.py
    files, ``base`` for what they cannot determine. CalibrationError for a
    file that cannot be used; ConfigError where a calibration is given, or
    no rows are left on either side."""
    rows: List[Measurement] = []
    rates: Dict[str, Tuple[float, float]] = {}
    for path in paths:
        kind, document = read(path)
        if kind == "bench_comm":
            rows.extend(measurements(document, path))
        elif kind == "bench_topk":
            rates.update(topk_rates(document, path))
        else:
            raise ConfigError(f"{path} is already a calibration; fit reads bench_comm.py/bench_topk.py output")
    fitted_rows = [r for r in rows if r.size not in holdout_sizes]
    held_rows = [r for r in rows if r.size in holdout_sizes]
    if not fitted_rows:
        raise ConfigError("no bench_comm rows left to fit (give bench_comm.py output; check --holdout-sizes)")
    if holdout_sizes and not held_rows:
        raise ConfigError("no bench_comm rows at the --holdout-sizes")
    machine = fit(fitted_rows, base, rates)
    return HeldOutFit(machine, relative_errors(machine, fitted_rows), relative_errors(machine, held_rows))


def figures(machine: Machine) -> str:
    """A machine's figures in three lines: per call and memory, the links, selection."""
    return "\n".join([
        f"overhead {machine.overhead * 1e6:.1f} µs per call; memory pass {machine.gamma * 1e12:.1f} ps/byte",
        f"intra: alpha {machine.alpha_intra * 1e6:.1f} µs, {beta_to_gbps(machine.beta_intra):.3g} Gbit/s; "
        f"inter: alpha {machine.alpha_inter * 1e6:.1f} µs, {beta_to_gbps(machine.beta_inter):.3g} Gbit/s",
        "selection: " + ", ".join(f"{name} {call * 1e6:.0f} µs + {element * 1e9:.3g} ns/element"
                                  for name, (call, element) in sorted(machine.select.items()))])
