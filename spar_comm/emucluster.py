"""An emulated multi-node cluster on one Linux machine (root only).

Each emulated host is a network namespace with its own host name, joined by
a veth pair to a bridge in the root namespace. Both ends of every veth are
shaped by ``tc`` (a token bucket at the link rate; ``netem`` adds the one-way
delay on the host's side), so a host's link carries ``rate`` each way.
MPICH's ``mpiexec`` starts one proxy per host through a launcher script that
enters the host's namespace; with the OFI netmod over TCP, ranks on different
hosts talk through the shaped links while ranks on one host share memory, and
``Split_type(COMM_TYPE_SHARED)`` finds the hosts by itself.
It needs MPICH's launcher (Hydra): Open MPI's ``prterun`` starts its daemons
another way and is refused with a message that says so.

Everything created carries one prefix (namespaces ``<prefix>-h<i>``, bridge
``<prefix>-br``, root-side veths ``<prefix>-v<i>``) and ``down`` removes it,
also when a previous run died half-way.

A run (``start``, ``wait_forwarding``) passes the signals its launcher gets
on to ``mpiexec``, which ends the job on SIGINT and SIGTERM and hands SIGUSR1
and SIGUSR2 to the ranks; ``mpiexec`` gets SIGTERM when the launcher dies,
even by SIGKILL; and once it has ended, whatever of the run is left in the
hosts' namespaces (marked in its environment) is killed.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .segments import mpi_segments, remove_orphaned_segments

PREFIX = "spc"
IFACE = "emu0"  # the interface name inside every host, so FI_TCP_IFACE is one value
STATE_ROOT = Path(os.environ.get("SPAR_COMM_EMU_STATE", "/run/spar_comm_emucluster"))
#: A tc rate, or "unshaped": no rate limit, so what is left of a call's time
#: is the CPU's (how bench_cluster.py measures contention between the ranks).
UNSHAPED = "unshaped"
RATE = re.compile(rf"^(\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)|{UNSHAPED})$")
DELAY = re.compile(r"^\d+(\.\d+)?(s|ms|us)$")
# MPICH: TCP between hosts over the shaped links, shared memory inside a host.
MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": IFACE}
#: Host addresses are .10 to .253 of the prefix's /24 subnet.
MAX_HOSTS = 244
#: Memory one rank may need: drivers/soak.py holding all six allreducers at
#: 2^22 floats, 16 hosts x 2, peaked at 432 MiB resident (the interpreter with
#: NumPy, Numba, h5py and mpi4py is ~180 MiB; the rest is buffers and the
#: node's shared-memory window, which /dev/shm takes from RAM too).
MEMORY_PER_RANK = 448 * 2**20
#: File descriptors a rank holds besides one TCP socket per peer (soak.py: 28).
FDS_PER_RANK = 64


class EmuClusterError(RuntimeError):
    """The emulated cluster cannot be made, used or removed; the message says why."""


@dataclass
class ClusterSpec:
    """What ``up`` builds: ``hosts`` namespaces of ``ranks_per_host`` slots each."""

    hosts: int
    ranks_per_host: int
    rate: str = "1gbit"
    delay: str = "0us"
    prefix: str = PREFIX
    addresses: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.hosts <= MAX_HOSTS:
            problems.append(f"hosts must be in 1..{MAX_HOSTS} (each takes an address .10 to .253 of one /24 "
                            f"subnet on the bridge), got {self.hosts}")
        if self.ranks_per_host < 1:
            problems.append(f"ranks per host must be >= 1, got {self.ranks_per_host}")
        if not RATE.match(self.rate):
            problems.append(f"rate {self.rate!r} is not a tc rate such as 100mbit, 1gbit, 10gbit, or {UNSHAPED!r}")
        if not DELAY.match(self.delay):
            problems.append(f"delay {self.delay!r} is not a tc time such as 0us, 50us, 1ms")
        if not re.match(r"^[a-z][a-z0-9]{0,5}$", self.prefix):
            problems.append(f"prefix {self.prefix!r} must be 1-6 lower-case letters or digits")
        if problems:
            raise ValueError("; ".join(problems))
        if not self.addresses:
            self.addresses = [f"{self.subnet}.{10 + i}" for i in range(self.hosts)]

    @property
    def subnet(self) -> str:
        """198.18.0.0/15 is set aside for network benchmarks (RFC 2544); each prefix
        takes its own /24 of it, so clusters of different prefixes can coexist."""
        return f"198.18.{zlib.crc32(self.prefix.encode()) % 254 + 1}"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def veth(self, i: int) -> str:
        return f"{self.prefix}-v{i}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.prefix


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise EmuClusterError(f"`{' '.join(command)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def check_privileges() -> None:
    """Refuse clearly when this machine cannot host an emulated cluster."""
    if os.geteuid() != 0:
        raise EmuClusterError("the emulated cluster needs root (network namespaces, veth, tc)")
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        raise EmuClusterError(f"missing tools: {', '.join(missing)} (Debian: apt-get install iproute2 util-linux)")


def capacity_problem(spec: ClusterSpec) -> Optional[str]:
    """Why this machine cannot run ``spec``'s ranks at once, or None.

    Memory binds first: every rank is a whole Python process with its own
    buffers (MEMORY_PER_RANK). Open files come next: the launcher and every
    rank hold a TCP socket to each peer besides their own files. The bridge
    takes up to 1024 ports, more than the addresses a prefix has.
    """
    ranks = spec.hosts * spec.ranks_per_host
    with open("/proc/meminfo") as meminfo:
        available_bytes = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    if ranks * MEMORY_PER_RANK > available_bytes:
        return (f"{ranks} ranks need about {ranks * MEMORY_PER_RANK / 2**30:.1f} GiB of memory "
                f"({MEMORY_PER_RANK >> 20} MiB a rank) and this machine has {available_bytes / 2**30:.1f} GiB available: "
                f"at most {available_bytes // MEMORY_PER_RANK} ranks; use fewer hosts or ranks per host")
    open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if ranks + FDS_PER_RANK > open_files:
        return (f"{ranks} ranks each hold a socket to every peer plus ~{FDS_PER_RANK} files, more than the "
                f"open-file limit of {open_files} (ulimit -n): raise it or use fewer ranks")
    return None


def available() -> Optional[str]:
    """None when an emulated cluster can be made here, else the reason it cannot."""
    try:
        check_privileges()
    except EmuClusterError as error:
        return str(error)
    probe = f"{PREFIX}probe{os.getpid() % 10000}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces do not work here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _shape(spec: ClusterSpec, i: int, verb: str = "add") -> None:
    """Shape both ends of host i's link: rate each way (none when unshaped), the
    delay on the host's side."""
    for where in (("ip", "netns", "exec", spec.namespace(i)), ()):
        dev = IFACE if where else spec.veth(i)
        base = (*where, "tc", "qdisc")
        _run(*base, "del", "dev", dev, "root", check=False)
        if where and _delay_seconds(spec.delay) > 0:
            netem = _run(*base, "add", "dev", dev, "root", "handle", "1:", "netem", "delay", spec.delay,
                         "limit", "100000", check=False)
            if netem.returncode != 0:
                raise EmuClusterError(
                    f"links cannot be given a delay: tc netem failed ({netem.stderr.strip()}); "
                    "this kernel may lack the sch_netem module. Use --delay 0us"
                )
            parent = ("parent", "1:", "handle", "2:")
        else:
            parent = ("root", "handle", "2:")
        if spec.rate != UNSHAPED:
            _run(*base, "add", "dev", dev, *parent, "tbf", "rate", spec.rate, "burst", str(_burst_bytes(spec.rate)),
                 "latency", "200ms")


def _delay_seconds(delay: str) -> float:
    number, unit = re.match(r"^([\d.]+)(\D+)$", delay).groups()
    return float(number) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def rate_bits_per_second(rate: str) -> float:
    """A tc rate such as ``1gbit`` or ``100mbps`` in bits per second (unshaped: inf)."""
    if rate == UNSHAPED:
        return float("inf")
    number, unit = re.match(r"^([\d.]+)(\D+)$", rate).groups()
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
             "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}[unit]
    return float(number) * scale


def _burst_bytes(rate: str) -> int:
    """A bucket that holds about 2 ms of traffic (at least 64 KiB): enough for
    the timer granularity, small enough to keep the rate honest."""
    return max(65536, int(rate_bits_per_second(rate) / 8 * 0.002))


def _launcher_script(spec: ClusterSpec) -> str:
    """The program mpiexec calls instead of ssh: ``SCRIPT -x HOST COMMAND...``.
    It runs the proxy command inside the namespace that owns HOST, under a host
    name of its own."""
    cases = "\n".join(
        f"  {address}) ns={spec.namespace(i)} name={spec.prefix}-host{i};;" for i, address in enumerate(spec.addresses)
    )
    return f"""#!/bin/sh
# Written by spar_comm.emucluster: mpiexec's launcher for the emulated hosts.
[ "$1" = "-x" ] && shift
host=$1; shift
case $host in
{cases}
  *) echo "emucluster: no emulated host has address $host" >&2; exit 1;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $name && exec $*"
"""


def up(spec: ClusterSpec) -> ClusterSpec:
    """Build the cluster; on any failure (or Ctrl-C) remove whatever was made."""
    check_privileges()
    problem = capacity_problem(spec)
    if problem:
        raise EmuClusterError(f"cannot host {spec.hosts} x {spec.ranks_per_host} ranks here: {problem}")
    if existing(spec.prefix):
        raise EmuClusterError(f"an emulated cluster with prefix {spec.prefix!r} is up already: run `down` first")
    if f" {spec.subnet}.1/" in _run("ip", "-o", "addr", "show", check=False).stdout:
        raise EmuClusterError(f"{spec.subnet}.0/24 is in use already; choose another --prefix")
    try:
        _run("ip", "link", "add", spec.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{spec.subnet}.1/24", "dev", spec.bridge)
        _run("ip", "link", "set", spec.bridge, "up")
        for i, address in enumerate(spec.addresses):
            ns = spec.namespace(i)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", spec.veth(i), "type", "veth", "peer", "name", f"{spec.prefix}-p{i}")
            _run("ip", "link", "set", f"{spec.prefix}-p{i}", "netns", ns)
            _run("ip", "-n", ns, "link", "set", f"{spec.prefix}-p{i}", "name", IFACE)
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", IFACE)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "set", spec.veth(i), "master", spec.bridge)
            _run("ip", "link", "set", spec.veth(i), "up")
            _shape(spec, i)
        spec.state_dir.mkdir(parents=True, exist_ok=True)
        script = spec.state_dir / "launch.sh"
        script.write_text(_launcher_script(spec))
        script.chmod(0o755)
        (spec.state_dir / "cluster.json").write_text(json.dumps(asdict(spec), indent=1))
    except BaseException:
        down(spec.prefix)
        raise
    return spec


def reshape(spec: ClusterSpec, rate: str, delay: str) -> ClusterSpec:
    """Change every link's rate and delay in place."""
    spec = ClusterSpec(spec.hosts, spec.ranks_per_host, rate, delay, spec.prefix, spec.addresses)
    for i in range(spec.hosts):
        _shape(spec, i)
    (spec.state_dir / "cluster.json").write_text(json.dumps(asdict(spec), indent=1))
    return spec


def existing(prefix: str = PREFIX) -> Dict[str, List[str]]:
    """What carries the prefix now: namespaces and links (empty when nothing)."""
    found: Dict[str, List[str]] = {}
    namespaces = [line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines() if line]
    found_ns = [ns for ns in namespaces if ns.startswith(prefix + "-")]
    links = re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", "show", check=False).stdout, re.M)
    found_links = [link for link in links if link.startswith(prefix + "-")]
    if found_ns:
        found["namespaces"] = sorted(found_ns)
    if found_links:
        found["links"] = sorted(found_links)
    return found


def down(prefix: str = PREFIX) -> List[str]:
    """Remove every namespace and link with the prefix, and the state; returns what went."""
    removed: List[str] = []
    for _ in range(50):  # namespace deletion frees its veth asynchronously
        found = existing(prefix)
        if not found:
            break
        for ns in found.get("namespaces", []):
            if _run("ip", "netns", "del", ns, check=False).returncode == 0:
                removed.append(ns)
        for link in found.get("links", []):
            if _run("ip", "link", "del", link, check=False).returncode == 0:
                removed.append(link)
        time.sleep(0.1)
    left = existing(prefix)
    shutil.rmtree(STATE_ROOT / prefix, ignore_errors=True)
    if left:
        raise EmuClusterError(f"could not remove {left}")
    return removed


def load(prefix: str = PREFIX) -> ClusterSpec:
    """The cluster that ``up`` made, from its state file."""
    path = STATE_ROOT / prefix / "cluster.json"
    if not path.exists():
        raise EmuClusterError(f"no emulated cluster with prefix {prefix!r} is up (no {path}): run `up` first")
    return ClusterSpec(**json.loads(path.read_text()))


def link_counters(spec: ClusterSpec) -> List[Dict[str, int]]:
    """Bytes each host sent and received on its link, from the interface counters."""
    counters = []
    for i in range(spec.hosts):
        stats = json.loads(_run("ip", "-n", spec.namespace(i), "-j", "-s", "link", "show", IFACE).stdout)[0]
        counters.append({"tx_bytes": stats["stats64"]["tx"]["bytes"], "rx_bytes": stats["stats64"]["rx"]["bytes"]})
    return counters


def mpiexec_command(spec: ClusterSpec, command: Sequence[str], mpiexec: Optional[str] = None,
                    ranks: Optional[int] = None) -> List[str]:
    """``mpiexec`` across the emulated hosts, ``ranks_per_host`` on each by default.
    EmuClusterError when ``mpiexec`` is not MPICH's."""
    mpiexec = mpiexec or default_mpiexec()
    require_hydra(mpiexec)
    hosts = ",".join(f"{address}:{spec.ranks_per_host}" for address in spec.addresses)
    env = [arg for name, value in MPI_ENV.items() for arg in ("-genv", name, value)]
    return [
        mpiexec, "-launcher", "ssh", "-launcher-exec", str(spec.state_dir / "launch.sh"),
        "-hosts", hosts, "-iface", spec.bridge, "-n", str(ranks or spec.hosts * spec.ranks_per_host),
        *env, *command,
    ]


#: The variable that marks a run's processes: the launcher's pid and a count.
RUN_MARK = "SPAR_COMM_EMU_RUN"
#: Signals a run's launcher passes on to mpiexec.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1
#: Seconds mpiexec has to end its job after a forwarded SIGINT or SIGTERM.
STOP_GRACE_S = 10.0
_started = itertools.count()


def _die_with_parent() -> None:
    """In mpiexec, before it starts: SIGTERM when its parent dies, by any signal."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Run:
    """A job under mpiexec across the hosts: the launcher's process, and the
    mark every process of the job carries in its environment."""

    spec: ClusterSpec
    process: subprocess.Popen
    mark: str
    segments: set  # MPI's files in /dev/shm before it started

    def left(self) -> List[int]:
        """The job's processes still alive in the hosts' namespaces."""
        needle = f"{RUN_MARK}={self.mark}".encode()
        found = []
        for i in range(self.spec.hosts):
            for pid in _run("ip", "netns", "pids", self.spec.namespace(i), check=False).stdout.split():
                try:
                    with open(f"/proc/{pid}/environ", "rb") as environ:
                        if needle in environ.read().split(b"\0"):
                            found.append(int(pid))
                except OSError:
                    continue
        return found

    def kill(self) -> None:
        """SIGKILL the launcher's session and what is left of the job in the
        hosts; then remove the MPI shared-memory files its ranks left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in self.left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        gone_by = time.monotonic() + 2
        while self.left() and time.monotonic() < gone_by:  # the killed still map their files
            time.sleep(0.05)
        remove_orphaned_segments(self.segments)

    def wait_forwarding(self) -> int:
        """Wait for the job, passing ``FORWARDED`` signals on to mpiexec; then
        kill what is left of it. After SIGINT or SIGTERM mpiexec has
        ``STOP_GRACE_S`` to end the job (it waits for ever for a host it cannot
        reach). Its exit status (128 + n for a signal n)."""
        stopping: List[float] = []

        def forward(number: int, _: Any) -> None:
            self.process.send_signal(number)
            if number in (signal.SIGINT, signal.SIGTERM):
                stopping.append(time.monotonic())

        held = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.process.wait(timeout=0.5)
                    break
                if stopping and time.monotonic() > stopping[0] + STOP_GRACE_S:
                    self.kill()
                    code = self.process.wait()
                    break
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)
            self.kill()
        return code if code >= 0 else 128 - code


def start(spec: ClusterSpec, command: Sequence[str], mpiexec: Optional[str] = None, ranks: Optional[int] = None,
          capture: bool = False) -> Run:
    """``command`` under mpiexec across the hosts, in a session of its own (a
    terminal's Ctrl-C reaches it once, through ``wait_forwarding``), ending
    with this process and marked in its environment (``RUN_MARK``)."""
    mark, segments = f"{os.getpid()}-{next(_started)}", mpi_segments()
    pipe = subprocess.PIPE if capture else None
    process = subprocess.Popen(mpiexec_command(spec, command, mpiexec, ranks), start_new_session=True, text=True,
                               env=dict(os.environ, **{RUN_MARK: mark}), preexec_fn=_die_with_parent,
                               stdout=pipe, stderr=pipe)
    return Run(spec, process, mark, segments)


def default_mpiexec() -> str:
    """The launcher beside this Python (the mpich wheel's), else ``mpiexec`` on PATH."""
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"


def require_hydra(mpiexec: str) -> None:
    """EmuClusterError unless ``mpiexec`` is MPICH's Hydra, the only launcher
    that takes the namespaces' launch script (``-launcher-exec``)."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EmuClusterError(f"cannot run the MPI launcher {mpiexec!r}: {error}") from None
    if "HYDRA" in version:
        return
    kind = "Open MPI's" if "Open MPI" in version else "not MPICH's"
    raise EmuClusterError(
        f"the emulated cluster needs MPICH's mpiexec (Hydra), and {mpiexec} is {kind}: "
        "run it from an environment with the mpich wheel (pip install 'spar_comm[mpich]') "
        "or name MPICH's launcher with --mpiexec")


def run(spec: ClusterSpec, command: Sequence[str], timeout: Optional[float] = None,
        capture: bool = True) -> subprocess.CompletedProcess:
    """``command`` under mpiexec across the hosts. On a time-out the launcher's
    session and every process of the run left in the hosts' namespaces are
    killed, so nothing of the run survives it."""
    job = start(spec, command, capture=capture)
    try:
        stdout, stderr = job.process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        job.process.communicate()
        raise
    return subprocess.CompletedProcess(job.process.args, job.process.returncode, stdout, stderr)
