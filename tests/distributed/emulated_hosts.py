"""N emulated hosts on one machine, and torchrun across them (needs root).

Each *host* is a network namespace with one interface ``eth0`` (address ``10.231.0.<i+1>/24``),
joined to the others by a bridge in a switch namespace of its own, so nothing touches the
machine's own network and all traffic goes to addresses of namespaces made here.  A launch
runs one ``torchrun --nnodes H --node_rank i`` per host inside ``ip netns exec <host>
unshare --mount --uts``: a private ``/dev/shm`` (a fresh tmpfs, mount options per host) and
its own host name, so two hosts share neither memory nor name unless asked (``hostnames``
may repeat a name: the "same host name, separate /dev/shm" case of containers with host
networking).  The boot id is the machine's on every host: it cannot be emulated.

Made by the creator process ``P`` under the names ``cfsdpeh-P-<n>-h<i>`` / ``cfsdpeh-P-<n>-sw``
(netns; the interfaces live and die inside them; the mounts live in the launches' own
mount namespaces and die with their processes).  ``close()`` kills what still runs in the
namespaces and deletes them; ``EmulatedHosts()`` first removes what a killed run of a dead
creator left (by that prefix), never another live run's.

Used by tests/distributed/test_hosts.py (the fixture) and benchmarks/bench_hosts.py; as a
script it runs a worker across emulated hosts (the README's recipe)::

    sudo .venv/bin/python tests/distributed/emulated_hosts.py --hosts 2 --nproc 2 \\
        demo/train_demo.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from launcher import REPO, RunResult, _descendants, worker_env  # noqa: E402

PREFIX = "cfsdpeh"
SUBNET = "10.231.0"
IFACE = "eth0"
MASTER_PORT = 29500  # private to the namespaces: no clash with any other run
DEFAULT_SHM = "size=1g"
_count = 0


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"emulated hosts: `{' '.join(cmd)}` failed ({res.returncode}): "
                           f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def missing_facilities() -> list[str]:
    """What this machine lacks for emulated hosts (empty: all there)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network and mount namespaces need it; run the tests as root)")
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command")
    return missing


def _netns_list() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_netns(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (until none is left) and delete it."""
    for _ in range(50):
        pids = _netns_pids(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _run("ip", "netns", "del", ns, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Delete the namespaces of emulated hosts whose creator process is gone; their names."""
    gone = []
    for ns in _netns_list():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-(?:h\d+|sw)", ns)
        if m and not _alive(int(m.group(1))):
            _kill_netns(ns)
            gone.append(ns)
    tmp = Path(tempfile.gettempdir())
    for d in tmp.glob(f"{PREFIX}-*"):
        m = re.match(rf"{PREFIX}-(\d+)-", d.name)
        if m and d.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(str(d))
    return gone


@dataclass
class Host:
    index: int
    ns: str
    addr: str
    hostname: str
    shm: str  # mount options of its /dev/shm tmpfs


class EmulatedHosts:
    """``n`` emulated hosts (see the module doc).  ``hostnames``: one per host (default
    ``cfsdp-host<i>``); ``shm``: the mount options of each host's ``/dev/shm`` (one string
    for all, or one per host); ``rate`` / ``delay``: shape every host's egress (tc: netem
    when the kernel has it, else tbf for the rate and no delay; ``shaping`` says what was
    applied).  Use as a context manager, or call ``close()``."""

    def __init__(self, n: int, hostnames: Optional[Sequence[str]] = None,
                 shm: str | Sequence[str] = DEFAULT_SHM, rate: Optional[str] = None,
                 delay: Optional[str] = None):
        global _count
        missing = missing_facilities()
        if missing:
            raise RuntimeError("emulated hosts need " + "; ".join(missing))
        if n < 1 or n > 200:
            raise ValueError(f"1 to 200 hosts, not {n}")
        clean_leftovers()
        _count += 1
        base = f"{PREFIX}-{os.getpid()}-{_count}"
        names = list(hostnames) if hostnames is not None else [f"cfsdp-host{i}" for i in range(n)]
        shms = [shm] * n if isinstance(shm, str) else list(shm)
        if len(names) != n or len(shms) != n:
            raise ValueError("one host name and one /dev/shm option string per host")
        self.switch = f"{base}-sw"
        self.hosts = [Host(i, f"{base}-h{i}", f"{SUBNET}.{i + 1}", names[i], shms[i])
                      for i in range(n)]
        self.shaping = "none"
        self._made: list[str] = []
        # each host sees this as /etc/hosts: the hosts' names resolve (c10d looks them up)
        self._etc = tempfile.mkdtemp(prefix=f"{base}-")
        with open(os.path.join(self._etc, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(
                f"{h.addr} {h.hostname}\n" for h in self.hosts))
        try:
            self._build(rate, delay)
        except BaseException:
            self.close()
            raise

    # -- set-up and tear-down ------------------------------------------------------------

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _build(self, rate: Optional[str], delay: Optional[str]) -> None:
        self._add_ns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            self._add_ns(h.ns)
            port = f"p{h.index}"
            _run("ip", "link", "add", IFACE, "netns", h.ns, "type", "veth", "peer", "name", port,
                 "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", IFACE)
            _run("ip", "-n", h.ns, "link", "set", IFACE, "up")
        if rate or delay:
            self.shaping = self._shape(rate, delay)

    def _shape(self, rate: Optional[str], delay: Optional[str]) -> str:
        netem = ["netem"] + (["delay", delay] if delay else []) + (["rate", rate] if rate else [])
        res = [_run("ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", IFACE, "root",
                    *netem, check=False) for h in self.hosts]
        if all(r.returncode == 0 for r in res):
            return f"netem {' '.join(netem[1:])} on every host's egress"
        if not any("unknown" in r.stderr for r in res):
            raise RuntimeError(f"emulated hosts: tc netem failed: {res[0].stderr.strip()}")
        if not rate:
            raise RuntimeError("emulated hosts: this kernel has no netem qdisc, so no delay can "
                               "be emulated")
        bps = _rate_bps(rate)
        burst = max(64 * 1024, bps // 8 // 100)  # 10 ms of traffic
        for h in self.hosts:
            _run("ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", IFACE, "root", "tbf",
                 "rate", rate, "burst", str(burst), "latency", "20ms")
        return (f"tbf rate {rate} on every host's egress (this kernel has no netem qdisc: "
                f"{'no added delay, ' + delay + ' not applied' if delay else 'no added delay'})")

    def close(self) -> None:
        """Kill every process left in the namespaces and delete them (idempotent)."""
        for ns in reversed(self._made):
            _kill_netns(ns)
        self._made = []
        shutil.rmtree(self._etc, ignore_errors=True)

    def __enter__(self) -> "EmulatedHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what runs on them ----------------------------------------------------------------

    def tx_bytes(self) -> list[int]:
        """Bytes each host has sent on its link (its eth0's counter): the bytes on the wire."""
        out = []
        for h in self.hosts:
            info = json.loads(_run("ip", "-n", h.ns, "-s", "-j", "link", "show", "dev",
                                   IFACE).stdout)
            out.append(int(info[0]["stats64"]["tx"]["bytes"]))
        return out

    def kill_host(self, i: int) -> None:
        """Pull the plug on host ``i``: SIGKILL every process running in it."""
        for pid in _netns_pids(self.hosts[i].ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def command(self, h: Host, nproc: int, script: str, args: Sequence[str], module: bool,
                nnodes: int) -> list[str]:
        """The command line that runs torchrun as host ``h`` (in its namespaces)."""
        setup = ('mount -t tmpfs -o "$1" cfsdp-shm /dev/shm && mount --bind "$3" /etc/hosts && '
                 'hostname "$2" && shift 3 && exec "$@"')
        return ["ip", "netns", "exec", h.ns, "unshare", "--mount", "--uts",
                "--propagation", "private", "--", "sh", "-c", setup, "sh", h.shm, h.hostname,
                os.path.join(self._etc, "hosts"),
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                "--node_rank", str(h.index), "--nproc_per_node", str(nproc),
                "--master_addr", self.hosts[0].addr, "--master_port", str(MASTER_PORT),
                "--max_restarts", "0", *(["-m"] if module else []), script, *args]

    def launch(self, script: str | os.PathLike, nproc: int, args: Sequence[str] = (),
               timeout: float = 240.0, env: Optional[dict] = None, module: bool = False,
               hosts: Optional[int] = None,
               on_line: Optional[Callable[[int, str], None]] = None) -> RunResult:
        """torchrun ``script`` with ``nproc`` ranks on each of the first ``hosts`` hosts
        (default all), host 0 the rendezvous; hang-proof as ``launcher.launch``: past
        ``timeout`` every process of the run is killed.  ``on_line(host, line)`` sees each
        output line as it comes (from a reader thread).  The output of every host, in
        order, is in the result."""
        if not module:
            script = Path(script)
            if not script.is_absolute():
                script = HERE / script
        hosts = len(self.hosts) if hosts is None else hosts
        extra = {"GLOO_SOCKET_IFNAME": IFACE, "TP_SOCKET_IFNAME": IFACE,
                 "CFSDP_EMULATED_HOSTS": str(hosts), **(env or {})}
        cmds = [self.command(h, nproc, str(script), args, module, hosts)
                for h in self.hosts[:hosts]]
        start = time.monotonic()
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=worker_env(extra),
                                  cwd=str(REPO), start_new_session=True) for c in cmds]
        outs: list[list[str]] = [[] for _ in procs]

        def read(i: int, p: subprocess.Popen) -> None:
            for raw in p.stdout:
                line = raw.decode(errors="replace")
                outs[i].append(line)
                if on_line is not None:
                    on_line(i, line)

        readers = [threading.Thread(target=read, args=(i, p), daemon=True)
                   for i, p in enumerate(procs)]
        for t in readers:
            t.start()
        timed_out = False
        try:
            for p in procs:
                left = timeout - (time.monotonic() - start)
                try:
                    p.wait(timeout=max(left, 0.01))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            if timed_out or any(p.poll() is None for p in procs):
                for h in self.hosts[:hosts]:
                    self.kill_host(h.index)
                for p in procs:
                    for pid in _descendants(p.pid) + [p.pid]:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    p.wait()
            for h in self.hosts[:hosts]:  # a worker that outlived its torchrun
                self.kill_host(h.index)
            for t in readers:
                t.join(timeout=15)
        output = "".join(f"==== host {i} ({self.hosts[i].hostname}, exit "
                         f"{procs[i].returncode}) ====\n" + "".join(o)
                         for i, o in enumerate(outs))
        codes = [p.returncode for p in procs]
        return RunResult(cmd=cmds[0], returncode=None if timed_out else
                         next((c for c in codes if c != 0), 0), output=output,
                         timed_out=timed_out, elapsed_s=time.monotonic() - start,
                         timeout_s=timeout)


def _rate_bps(rate: str) -> int:
    """bits per second of a tc rate ("10gbit", "1gbit", "500mbit")."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 10gbit, 1gbit, 500mbit")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=1, help="ranks per host")
    ap.add_argument("--same-hostname", action="store_true",
                    help="one host name for all (separate /dev/shm all the same)")
    ap.add_argument("--rate", default=None, help="shape each link, e.g. 1gbit")
    ap.add_argument("--delay", default=None, help="add delay to each link, e.g. 50us (netem)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    names = ["cfsdp-host"] * a.hosts if a.same_hostname else None
    with EmulatedHosts(a.hosts, hostnames=names, rate=a.rate, delay=a.delay) as eh:
        before = eh.tx_bytes()
        res = eh.launch(Path(a.script).resolve(), a.nproc, a.args, timeout=a.timeout,
                        on_line=lambda i, line: print(f"[host {i}] {line}", end="", flush=True))
        sent = [x - y for x, y in zip(eh.tx_bytes(), before)]
    print(f"emulated hosts: link shaping {eh.shaping}; bytes sent per host {sent}; exit "
          f"{res.returncode}{' (timed out)' if res.timed_out else ''} after "
          f"{res.elapsed_s:.1f} s")
    sys.exit(1 if res.timed_out else res.returncode)


if __name__ == "__main__":
    main()
