"""More than one host: cfsdp's step and bytes on the wire against torch's FSDP on gloo.

Run as root (it builds emulated hosts: network namespaces joined by a bridge, a private
/dev/shm and host name each, see tests/distributed/emulated_hosts.py)::

    sudo OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hosts.py \\
        --out benchmarks/out/hosts.json

For each link (``--rates``, default ``10gbit,1gbit``, with ``--delay`` 50us) it builds
``--hosts`` (2) emulated hosts whose egress is shaped with tc (netem delay and rate; where
the kernel has no netem, tbf for the rate and no delay: the JSON and the table say which),
and for each strategy (``--strategies full,hybrid``) launches one torchrun per host with
``--nproc`` (2) ranks running this file as the worker.  The worker runs bench_fsdp.py's
contenders one after another on the same model, seed and data:

* ``cfsdp`` / ``cfsdp_fs`` -- cfsdp's two faces (two levels across the hosts in ``full``);
* ``cfsdp_flat`` (``full`` only) -- the wrapper with ``CFSDP_SHM=host`` on its own group:
  shared memory only inside a host, gloo's flat collectives across hosts (torch's path), to
  separate what the two levels bring from the rest of cfsdp;
* ``fsdp1`` / ``fsdp2`` -- torch's FSDP1 wrapper and fully_shard on gloo.

``hybrid`` is HSDP with one shard group per host (a ``(hosts, nproc)`` mesh: shared memory
inside each host for cfsdp, replicate groups across hosts on the process group for all).
A step is bench_fsdp's (forward, cross-entropy, backward, AdamW, zero_grad; cfsdp's
contenders with cfsdp.optim.AdamW); its time is the slowest rank's, a contender's the
median over the timed steps.  **Bytes on the wire** are the sum over hosts of each host's
link counter (``/sys/class/net/eth0/statistics/tx_bytes`` inside its namespace) across the
timed steps, per step: everything that crossed between hosts, barriers included.

Rank 0 of each launch writes its results to a file the driver collects; the driver prints
one markdown table per (link, strategy) and writes everything, with the machine, versions,
link shaping and command, to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "distributed"))

CONTENDERS = {"full": ("cfsdp", "cfsdp_flat", "fsdp1", "cfsdp_fs", "fsdp2"),
              "hybrid": ("cfsdp", "fsdp1", "cfsdp_fs", "fsdp2")}
VERSUS = {"cfsdp": "fsdp1", "cfsdp_flat": "fsdp1", "cfsdp_fs": "fsdp2"}
DEFAULT_SET = ["n_layer=4"]


# ------------------------------------------------------------------------------ worker


def _link_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import bench_fsdp as bf

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    first_of_host = int(os.environ["LOCAL_RANK"]) == 0
    cfg = bf.MODELS[args.model]
    for kv in args.set:
        key, value = kv.split("=", 1)
        cfg = bf.dataclasses.replace(cfg, **{key: type(getattr(cfg, key))(value)})
    setup = bf.Setup(strategy=args.strategy)
    if args.strategy == "hybrid":
        setup.mesh = init_device_mesh("cpu", (world // per_host, per_host),
                                      mesh_dim_names=("replicate", "shard"))
    flat_group = dist.new_group(backend="gloo")  # cfsdp_flat's own group (its own set-up)

    def wrap_flat(model, cfg_, setup_):
        import cfsdp

        return cfsdp.FullyShardedDataParallel(
            model, process_group=flat_group, auto_wrap_policy=bf._wrap_policy(cfg_),
            use_orig_params=False, device_id=torch.device("cpu"))

    wrappers = {**bf.WRAPPERS, "cfsdp_flat": wrap_flat}
    results: dict[str, Any] = {}
    for name in args.contenders.split(","):
        if name == "cfsdp_flat":
            os.environ["CFSDP_SHM"] = "host"  # read at the group's set-up, in its first collective
        opt_name = "cfsdp" if name == "cfsdp_flat" else name
        model = wrappers[name](bf.build_model(cfg, bf.SEED), cfg, setup)
        optim = bf.make_optim(opt_name, model, setup)
        times, losses = [], []
        sent = torch.zeros(1, dtype=torch.int64)
        for step in range(args.warmup + args.iters):
            x, y = bf.make_batch(cfg, bf.SEED, rank, step)
            if step == args.warmup:
                dist.barrier()
                before = _link_bytes()
                dist.barrier()
            dist.barrier()
            t0 = time.perf_counter()
            loss = bf.train_step(model, optim, x, y)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        dist.barrier()
        time.sleep(0.3)  # the counter's last packets
        sent[0] = _link_bytes() - before if first_of_host else 0
        dist.all_reduce(sent)
        step_t = torch.tensor(times[args.warmup:], dtype=torch.float64)
        dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
        transport = ""
        if name.startswith("cfsdp"):
            from cfsdp._runtime import comm

            if setup.mesh is not None:
                transport = (f"shard groups: {comm.describe(setup.mesh.get_group(1))}; "
                             f"replicate groups: {comm.describe(setup.mesh.get_group(0))}")
            else:
                transport = comm.describe(flat_group if name == "cfsdp_flat" else None)
        results[name] = {"step_ms": statistics.median(step_t.tolist()) * 1e3,
                         "steps_ms": [t * 1e3 for t in step_t.tolist()],
                         "wire_bytes_per_step": int(sent[0]) / args.iters,
                         "losses": losses, "transport": transport}
        os.environ["CFSDP_SHM"] = "1"
        del model, optim
        bf.release_memory()
    if rank == 0:
        info = {**bf.machine_info_basic(), "model": bf.config_dict(cfg),
                "strategy": args.strategy, "per_host": per_host, "hosts": world // per_host,
                "warmup": args.warmup, "iters": args.iters}
        Path(args.result).write_text(json.dumps({"info": info, "results": results}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ driver


def table(run: dict) -> str:
    res = run["results"]
    lines = ["| contender | step ms | step / torch's | wire MB / step | wire / torch's | "
             "max rel loss diff vs torch's | transport (cfsdp) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, r in res.items():
        ref = res.get(VERSUS.get(name, ""))
        ratio_t = f"{r['step_ms'] / ref['step_ms']:.2f}" if ref else ""
        ratio_b = f"{r['wire_bytes_per_step'] / ref['wire_bytes_per_step']:.2f}" if ref else ""
        diff = (max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
                if ref else None)
        lines.append(f"| {name} | {r['step_ms']:.0f} | {ratio_t} | "
                     f"{r['wire_bytes_per_step'] / 1e6:.1f} | {ratio_b} | "
                     f"{'' if diff is None else f'{diff:.1e}'} | {r['transport']} |")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> None:
    from emulated_hosts import EmulatedHosts

    runs = []
    with tempfile.TemporaryDirectory(prefix="cfsdp-bench-hosts-") as tmp:
        for rate in args.rates.split(","):
            with EmulatedHosts(args.hosts, rate=rate, delay=args.delay or None) as eh:
                for strategy in args.strategies.split(","):
                    result = Path(tmp) / f"{rate}-{strategy}.json"
                    wargs = ["--worker", "--result", str(result), "--strategy", strategy,
                             "--model", args.model, "--warmup", str(args.warmup),
                             "--iters", str(args.iters),
                             "--contenders", ",".join(CONTENDERS[strategy])]
                    for kv in args.set:
                        wargs += ["--set", kv]
                    t0 = time.monotonic()
                    res = eh.launch(Path(__file__), args.nproc, wargs, timeout=args.timeout,
                                    env={"CFSDP_IMPL": "c", "CFSDP_SHM": "1"})
                    if res.returncode != 0 or not result.exists():
                        sys.exit(f"{rate} {strategy}: the launch failed "
                                 f"(exit {res.returncode}, timed out {res.timed_out}):\n"
                                 f"{res.output[-6000:]}")
                    run = json.loads(result.read_text())
                    run["info"].update(link=rate, delay=args.delay, shaping=eh.shaping,
                                       launch_s=time.monotonic() - t0,
                                       command=" ".join([sys.executable, *sys.argv]))
                    runs.append(run)
                    print(f"\n### {args.hosts} hosts x {args.nproc} ranks, {strategy}, link "
                          f"{rate} ({eh.shaping})\n\n{table(run)}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(runs, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="full", help=argparse.SUPPRESS)
    p.add_argument("--contenders", default=",".join(CONTENDERS["full"]),
                   help=argparse.SUPPRESS)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks per host")
    p.add_argument("--rates", default="10gbit,1gbit")
    p.add_argument("--delay", default="50us")
    p.add_argument("--strategies", default="full,hybrid")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--set", action="append", default=None,
                   help=f"model config override (default {DEFAULT_SET})")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--timeout", type=float, default=1500.0, help="per launch, seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.set is None:
        args.set = list(DEFAULT_SET)
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
