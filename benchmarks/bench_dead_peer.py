"""How long the other ranks take to fail when one rank is killed mid-collective.

A driver, not a torchrun script: each kill ends a job, so it launches ``torchrun
--standalone`` once per trial (``--trials`` per world size and transport) and runs this
file as the worker (``--worker``)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_dead_peer.py \\
        --worlds 2,3 --trials 7 --out benchmarks/out/dead_peer.json

Worker: a gloo group with a long timeout (``--timeout``, 300 s by default: the detection
must not depend on it), one all-reduce to set up the transport, then every rank starts an
all-reduce of ``--mib`` MiB (float32, through the transport's pieces) and rank 0,
``--delay`` seconds later, SIGKILLs the last rank (mid-collective) and notes
``time.monotonic()`` right after.  Each survivor notes the ``time.monotonic()`` at which its
collective raised (and the message); both are printed only after they are taken.  CLOCK_MONOTONIC is one clock for every process of the machine, so a survivor's
*detection time* is its time minus the victim's.  Transports: ``shm`` (cfsdp's shared
memory, ``CFSDP_SHM=1``: its liveness probe) and ``gloo`` (``CFSDP_SHM=0``: the same call
through the process group, which learns of the death from its broken TCP connections),
for comparison.  A trial whose survivors do not all fail (or fail without naming the dead
rank, for ``shm``) is reported as such.

Per (transport, world size): median, min and max of the detection times over every
survivor of every trial.  The workers print only those lines; the driver prints the table
and writes JSON (machine, versions, date, every time) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent


def say(line: str) -> None:
    os.write(1, (line.replace("\n", " ") + "\n").encode())


def worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from cfsdp._runtime import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # report before torchrun's SIGKILL
    t = torch.ones(1024)
    comm.all_reduce(t, None, False)
    say(f"TRANSPORT rank={rank} {comm.describe(None)}")
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()
    big = torch.ones(args.mib << 18)
    pending = comm.all_reduce(big, None, async_op=True)
    if rank == 0:
        time.sleep(args.delay)
        os.kill(pids[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        say(f"KILL rank={world - 1} at={killed_at:.6f}")
    try:
        pending.wait()
        comm.all_reduce(t, None, False)  # in case the big one ended before the kill
        msg = "NO ERROR"
    except RuntimeError as e:
        msg = "error=" + str(e)
    at = time.monotonic()
    say(f"SURVIVOR rank={rank} at={at:.6f} {msg}")
    os._exit(0)


def trial(world: int, transport: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CFSDP_IMPL="c",
               CFSDP_SHM="1" if transport == "shm" else "0", LOGLEVEL="WARNING")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(world), "--max_restarts", "0", str(Path(__file__).resolve()), "--worker",
           "--timeout", str(args.timeout), "--mib", str(args.mib), "--delay", str(args.delay)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                             timeout=args.timeout + 120).stdout
    except subprocess.TimeoutExpired as e:  # its output so far (bytes, whatever text= says)
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else ""
    kill = re.findall(r"KILL rank=(\d+) at=([\d.]+)", out)
    lines = re.findall(r"SURVIVOR rank=(\d+) at=([\d.]+) (.*)", out)
    transports = sorted(set(re.findall(r"TRANSPORT rank=\d+ (.*)", out)))
    if len(kill) != 1:
        return {"ok": False, "why": "no kill", "output": out[-4000:]}
    dead, at = int(kill[0][0]), float(kill[0][1])
    times, bad = [], []
    for r, t, msg in lines:
        named = f"rank {dead} (global rank {dead})" in msg or transport == "gloo"
        if msg.startswith("error=") and named:
            times.append(float(t) - at)
        else:
            bad.append((int(r), msg[:300]))
    ok = len(times) == world - 1 and not bad
    return {"ok": ok, "times": times, "bad": bad, "transport": transports,
            **({} if ok else {"output": out[-4000:]})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--transports", default="shm,gloo")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout (s)")
    ap.add_argument("--mib", type=int, default=64, help="size of the collective killed (MiB)")
    ap.add_argument("--delay", type=float, default=0.3, help="kill this long after it starts")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    results = []
    for transport in args.transports.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            runs = [trial(world, transport, args) for _ in range(args.trials)]
            times = [t for r in runs for t in r.get("times", [])]
            row = {"transport": transport, "world": world, "trials": len(runs),
                   "failed_trials": sum(not r["ok"] for r in runs), "times_s": times,
                   "runs": runs}
            if times:
                row.update(median_s=statistics.median(times), min_s=min(times),
                           max_s=max(times))
            results.append(row)
            print(f"{transport:5s} W={world}: {len(times)} survivors of {len(runs)} trials "
                  f"({row['failed_trials']} failed trials): median "
                  f"{row.get('median_s', float('nan')):.3f} s, min "
                  f"{row.get('min_s', float('nan')):.3f}, max "
                  f"{row.get('max_s', float('nan')):.3f}", flush=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "timeout_s": args.timeout, "mib": args.mib, "delay_s": args.delay,
            "load_avg": os.getloadavg()}
    print(json.dumps(meta))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
