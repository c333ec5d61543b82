"""The steps and reports of drivers/gpu_check.py, the one command for a GPU
machine: a step runs one command under a time limit and keeps its whole
output, and the reports judge the performance targets from the
benchmarks' figures. Standard library only: the check's own process starts
no MPI and no CUDA."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional


class Step:
    """One command of the check: what it runs, its time limit, and the JSON it writes (if any)."""

    def __init__(self, name: str, command: List[str], limit: float, data: Optional[Path] = None):
        self.name, self.command, self.limit, self.data = name, command, limit, data
        self.result: Dict[str, Any] = {"name": name, "command": " ".join(map(str, command)), "status": "not run"}

    def run(self, env: Dict[str, str], remaining: float, log: Path, cwd: Optional[Path] = None) -> None:
        """Run the command in ``cwd`` within ``remaining`` seconds (at most its
        own limit): its whole output appended to ``log``, its status, last
        lines, summary and JSON in ``result``."""
        limit = min(self.limit, remaining)
        if limit < 5:
            self.result.update(status="skipped: no time left in the budget")
            return
        started = time.monotonic()
        try:
            done = subprocess.run([str(c) for c in self.command], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=limit, start_new_session=True)
            output, rc, status = clean(done.stdout + done.stderr), done.returncode, "passed" if done.returncode == 0 else "failed"
        except subprocess.TimeoutExpired as expired:
            output = clean(_text(expired.stdout) + _text(expired.stderr))
            rc, status = None, f"timed out after {limit:.0f} s"
        with log.open("a") as f:
            f.write(f"\n===== {self.name}: {status}\n$ {self.result['command']}\n{output}")
        lines = output.strip().splitlines()
        self.result.update(status=status, rc=rc, seconds=round(time.monotonic() - started, 1), tail=lines[-40:],
                           summary=_summary(lines))
        if self.data is not None and self.data.exists():
            self.result["data"] = json.loads(self.data.read_text())


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


#: Terminal colour codes (some images force pytest's colours on) and NULs
#: (Open MPI ends its library version with one): kept out of the reports.
_NOISE = re.compile(r"\x1b\[[0-9;]*m|\x00")


def clean(text: str) -> str:
    """``text`` without terminal colour codes and NULs."""
    return _NOISE.sub("", text)


def _summary(lines: List[str]) -> str:
    """The line that says how a step went: pytest's count, a driver's last line."""
    for line in reversed(lines):
        if re.search(r"\d+ (passed|failed)", line) or line.startswith(("done:", "wrote")):
            return line.strip("= ")
    return lines[-1].strip() if lines else ""


def topk_rows(records: List[Dict[str, Any]]) -> List[str]:
    """bench_topk.py's records as the rows of a Markdown table."""
    rows = ["| n | dtype | density | method | median ms | vs " + (records[0]["reference"] if records else "") +
            " | x one read | GB/s |", "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in records:
        rows.append(f"| 2^{r['n'].bit_length() - 1} | {r['dtype']} | {r['density']:g} | {r['method']} | "
                    f"{r['median_s'] * 1e3:.3f} | {r['speedup_vs_reference']:.2f}x | {r['floor_multiple']:.2f} | "
                    f"{r['read_gbps']:.1f} |")
    return rows


def targets(records: List[Dict[str, Any]]) -> List[str]:
    """The performance targets at the largest size, float32, density 0.001, each held or missed."""
    largest = [r for r in records if r["n"] == max(x["n"] for x in records) and r["dtype"] == "float32"
               and r["density"] == 0.001]
    by = {r["method"]: r for r in largest}
    exact = [r for r in largest if r.get("exact") and r.get("matches_reference")]
    if not exact or "torch.topk" not in by:
        return ["(no float32, density 0.001 figures with torch.topk to judge)"]
    best = min(exact, key=lambda r: r["median_s"])
    torch_s = by["torch.topk"]["median_s"]
    libraries = [r for name, r in by.items() if name in ("torch.topk", "cub.DeviceTopK", "cupy.argpartition")]

    def mark(held: bool) -> str:
        return "**held**" if held else "**missed**"

    lines = [f"- fastest exact selection at 2^{best['n'].bit_length() - 1}: `{best['method']}`, "
             f"{best['median_s'] * 1e3:.3f} ms (target at most 0.25 ms: {mark(best['median_s'] <= 0.25e-3)}), "
             f"{torch_s / best['median_s']:.2f}x torch.topk (target 6x: {mark(torch_s / best['median_s'] >= 6)}), "
             f"{best['floor_multiple']:.2f} reads of the vector",
             "- ahead of every library that ran (" + ", ".join(f"{r['method']} {r['median_s'] * 1e3:.3f} ms"
                                                        for r in libraries) + "): "
             + mark(all(best["median_s"] < r["median_s"] for r in libraries))]
    mstopk = [r for r in largest if r["method"].startswith("mstopk") and r.get("matches_reference")]
    if mstopk:
        fastest = min(mstopk, key=lambda r: r["median_s"])
        lines.append(f"- `{fastest['method']}`: {torch_s / fastest['median_s']:.2f}x torch.topk "
                     f"(target 2x: {mark(torch_s / fastest['median_s'] >= 2)})")
    wrong = sorted({r["method"] for r in records if r.get("exact") and r.get("matches_reference") is False})
    if wrong:
        lines.append(f"- **not the reference's positions**: {', '.join(wrong)}")
    return lines


def markdown(report: Dict[str, Any]) -> str:
    """The Markdown report: the machine, every step's status, the figures of the benchmarks, failures' output."""
    m = report["machine"]
    out = [f"# GPU check: {m['device']}", "", f"{report['created']}, {report['mode']} mode, on {m['host']}. "
           f"CUDA {m['cuda'] or '-'}; {m['mpi_library']}; Python {m['python']}.", "", f"Packages: {m['packages']}", "",
           "| step | status | seconds | summary |", "| --- | --- | ---: | --- |"]
    for s in report["steps"]:
        out.append(f"| {s['name']} | {s['status']} | {s.get('seconds', '')} | {s.get('summary', '').replace('|', '/')} |")
    for s in report["steps"]:
        data = s.get("data")
        if s["name"] == "bench_topk.py" and data:
            out += ["", "## Top-k selection (bench_topk.py)", "", *targets(data["records"]), "",
                    "Libraries: " + "; ".join(f"{name}: {said}" for name, said in data.get("libraries", {}).items()),
                    "", *topk_rows(data["records"])]
        if s["name"].startswith("bench_comm.py") and data:
            out += ["", "## Allreduce, 2 ranks sharing the GPU (bench_comm.py)", "", f"{data['meta']['device']}", "",
                    "| size | algorithm | median ms | bytes inter | bytes staged |", "| ---: | --- | ---: | ---: | ---: |"]
            out += [f"| {r['size']} | {r['algorithm']} | {r['time_median'] * 1e3:.3f} | {r['bytes_inter']} | "
                    f"{r.get('bytes_staged', '')} |" for r in data["results"]]
    failed = [s for s in report["steps"] if s["status"] != "passed"]
    for s in failed:
        out += ["", f"## {s['name']}: {s['status']}", "", "```", *s.get("tail", []), "```"]
    return "\n".join(out) + "\n"


def write_reports(out: Path, report: Dict[str, Any]) -> None:
    """gpu-check.json and gpu-check.md in ``out``, each replaced atomically."""
    for name, text in (("gpu-check.json", json.dumps(report, indent=1)), ("gpu-check.md", markdown(report))):
        temporary = out / (name + ".tmp")
        temporary.write_text(text)
        os.replace(temporary, out / name)


