"""Collective throughput: cfsdp's shared-memory path against gloo, and memcpy.

Launch with torchrun (gloo, CPU), e.g.::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \\
        benchmarks/bench_collectives.py --out benchmarks/out/collectives.json

For each dtype (fp32, bf16) and op (all-gather, reduce-scatter, all-reduce, all-to-all;
``--ops`` picks some) on a full buffer of ``--mib`` MiB (64 by default), both contenders run on
the same gloo group and the same data: ``shm`` is ``cfsdp._runtime.comm`` (shared memory; the
run fails if the group does not take that path) and ``gloo`` is ``torch.distributed`` itself.
Every iteration starts after a barrier; its time is the max over ranks; a contender's time is
the median over ``--iters`` timed iterations after ``--warmup`` untimed ones.

Throughput = bytes of the full buffer / time, for every op and contender alike: the
all-gather's output, the reduce-scatter's input, the all-reduce's buffer, the all-to-all's
input (``--mib`` MiB: each rank sends every rank, itself included, 1/W of it; ``shm`` is
``comm.all_to_all`` with that counts matrix, ``gloo`` ``all_to_all_single`` with even splits).

The memcpy bandwidth of this machine is measured in the same run, on every rank at once
(as the collectives run): ``torch copy_`` of a ``--mib`` MiB tensor and a plain single-
thread memcpy through the C core (``cfsdp._C.shm_memcpy``), same definition (bytes copied
/ time, median, max over ranks).  Each rank uses one thread (``torch.set_num_threads(1)``;
run with ``OMP_NUM_THREADS=1``).  Rank 0 prints a table with the ratios and writes JSON to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

import cfsdp
from cfsdp import _core
from cfsdp._runtime import comm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn, warmup: int, iters: int) -> list[float]:
    """Per-iteration times (max over ranks) of fn()."""
    out = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            out.append(float(dt))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64, help="full buffer size in MiB")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--ops", default="all_gather,reduce_scatter,all_reduce,all_to_all")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if not comm.uses_shm(group):
        raise SystemExit("the shared-memory path is off (CFSDP_IMPL=c and CFSDP_SHM!=0 needed)")
    nbytes = args.mib << 20
    results: dict = {"memcpy": {}, "ops": []}

    # memcpy bandwidth: torch copy_ and the C core's single-thread memcpy
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    for name, fn in (("torch_copy_", lambda: dst.copy_(src)),
                     ("c_memcpy", lambda: _core._C.shm_memcpy(dst.data_ptr(), src.data_ptr(),
                                                              nbytes, 1))):
        ts = timed(fn, args.warmup, args.iters)
        results["memcpy"][name] = {"median_s": statistics.median(ts), "times_s": ts,
                                   "GBps": nbytes / statistics.median(ts) / 1e9}
    src = dst = None  # free them before the collectives
    memcpy_gbps = max(v["GBps"] for v in results["memcpy"].values())

    g = torch.Generator().manual_seed(rank)
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        n = nbytes // torch.empty((), dtype=dtype).element_size()
        n -= n % world
        full = torch.randn(n, generator=g).to(dtype)
        shard = full[: n // world].clone()
        out_full = torch.empty(n, dtype=dtype)
        out_shard = torch.empty(n // world, dtype=dtype)
        even = [[n // world] * world for _ in range(world)]
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        contenders = {
            "all_gather": {
                "shm": lambda: comm.all_gather(out_full, shard, group, False),
                "gloo": lambda: ag(out_full, shard, group=group),
            },
            "reduce_scatter": {
                "shm": lambda: comm.reduce_scatter(out_shard, full, group, False),
                "gloo": lambda: rs(out_shard, full, group=group),
            },
            "all_reduce": {
                "shm": lambda: comm.all_reduce(out_full, group, False),
                "gloo": lambda: dist.all_reduce(out_full, group=group),
            },
            "all_to_all": {
                "shm": lambda: comm.all_to_all(out_full, full, even, group, False),
                "gloo": lambda: dist.all_to_all_single(out_full, full, group=group),
            },
        }
        for op, fns in contenders.items():
            if op not in args.ops.split(","):
                continue
            row = {"op": op, "dtype": dname, "bytes": n * full.element_size()}
            for who, fn in fns.items():
                if op == "all_reduce":
                    out_full.copy_(full)
                ts = timed(fn, args.warmup, args.iters)
                med = statistics.median(ts)
                row[who] = {"median_s": med, "times_s": ts, "GBps": row["bytes"] / med / 1e9}
            row["shm_over_gloo"] = row["shm"]["GBps"] / row["gloo"]["GBps"]
            row["shm_over_memcpy"] = row["shm"]["GBps"] / memcpy_gbps
            results["ops"].append(row)

    if rank == 0:
        meta = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "world_size": world, "mib": args.mib, "warmup": args.warmup, "iters": args.iters,
            "torch": torch.__version__, "cfsdp_backend": cfsdp.backend,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "threads_per_rank": torch.get_num_threads(),
            "slot_bytes": comm._slot_bytes(),
            "throughput": "bytes of the full buffer / median time (max over ranks)",
        }
        results["meta"] = meta
        lines = [f"\ncollectives, {world} ranks, {args.mib} MiB full buffer, 1 thread/rank "
                 f"(torch {torch.__version__})",
                 "memcpy: " + ", ".join(f"{k} {v['GBps']:.2f} GB/s"
                                        for k, v in results["memcpy"].items()),
                 "", "| op | dtype | shm GB/s | gloo GB/s | shm/gloo | shm/memcpy |",
                 "|---|---|---|---|---|---|"]
        for r in results["ops"]:
            lines.append(f"| {r['op']} | {r['dtype']} | {r['shm']['GBps']:.2f} | "
                         f"{r['gloo']['GBps']:.3f} | {r['shm_over_gloo']:.1f}x | "
                         f"{r['shm_over_memcpy']:.2f} |")
        print("\n".join(lines), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    comm.release(group)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
