"""Step-time and memory benchmark: cfsdp against torch's FSDP1, FSDP2 and DDP.

Launch with torchrun (gloo, CPU), e.g.::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \\
        benchmarks/bench_fsdp.py --model all --warmup 3 --iters 10 \\
        --out benchmarks/out/bench.json

One invocation runs every contender, one after another, on the same model,
seed and data:

* ``local`` -- a plain single-process step on the per-rank batch (no
  communication): the floor.  Run first, in the cleanest process (later
  contenders start from a higher RSS, see Memory below).
* ``cfsdp`` -- ``cfsdp.FullyShardedDataParallel``, one unit per block.
* ``fsdp1`` -- ``torch.distributed.fsdp.FullyShardedDataParallel``, same wrapping.
* ``fsdp2`` -- ``torch.distributed.fsdp.fully_shard`` on each block, then the root.
* ``ddp``   -- ``DistributedDataParallel``; the loss reference.

A step is forward, cross-entropy, backward, AdamW step, zero_grad.  Each step
is timed on every rank after a ``dist.barrier()``; a step's time is the max
over ranks; a contender's time is the median over the timed steps.

Memory: before each contender, garbage is collected, freed heap is trimmed
(``malloc_trim``) and the RSS high-water mark is reset (write ``5`` to
``/proc/self/clear_refs``).  Peak RSS is VmHWM after the contender (build and
wrap included: the full model exists on every rank before it is sharded);
growth is that peak minus the RSS at the contender's start (the process keeps
some memory from earlier contenders, so later ones start higher).  RSS also
counts freed memory the allocator keeps, so the table adds the bytes of live
tensor storages (params, grads, optimizer state) after the last step, less
those alive at the contender's start (torch's FSDP1 leaves its sharded flat
params alive after the model is deleted).  All are max over ranks; the JSON
also has the peak RSS over the timed steps alone.

Rank 0 prints a markdown table per model and writes everything (per-step
times and losses included) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import (  # noqa: E402
    GPTConfig,
    ModelConfig,
    SmallConfig,
    build_model,
    config_dict,
    make_batch,
    wrap_unit_class,
)

CONTENDERS = ("local", "cfsdp", "fsdp1", "fsdp2", "ddp")
SHARDED = ("cfsdp", "fsdp1", "fsdp2")
MODELS: dict[str, ModelConfig] = {"gpt2": GPTConfig(), "small": SmallConfig()}
LOSS_RTOL = 1e-4  # sharded contenders vs DDP, relative, on every step
SEED = 0
LR = 1e-3


# --------------------------------------------------------------------------
# process memory


def _read_status_kib(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (e.g. ``VmHWM``), in KiB."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key} field")
    return int(match.group(1))


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark; False if the kernel refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def live_tensor_bytes() -> int:
    """Bytes of the distinct tensor storages reachable from Python objects.

    Counts parameters, gradients, optimizer state and buffers a wrapper keeps
    as Python attributes; misses memory held only in C++ and the allocator's
    retained free memory (which RSS includes).
    """
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): no __class__ lookup, no warnings
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor)
                continue
    storages.pop(0, None)  # freed (resized-to-zero) storages
    return sum(storages.values())


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# --------------------------------------------------------------------------
# contenders


def _cfsdp_module() -> Any:
    """Import cfsdp lazily: it may be missing or not built yet."""
    import cfsdp

    return cfsdp


def _wrap_policy(cfg: ModelConfig) -> ModuleWrapPolicy:
    """One FSDP unit per block (plus the root's own unit)."""
    return ModuleWrapPolicy({wrap_unit_class(cfg)})


def wrap_cfsdp(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    return _cfsdp_module().FullyShardedDataParallel(
        model,
        auto_wrap_policy=_wrap_policy(cfg),
        use_orig_params=False,
        device_id=torch.device("cpu"),
    )


def wrap_fsdp1(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    return TorchFSDP(
        model,
        auto_wrap_policy=_wrap_policy(cfg),
        use_orig_params=False,
        device_id=torch.device("cpu"),  # torch refuses a CPU-only machine without it
    )


def wrap_fsdp2(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    for module in model.modules():
        if isinstance(module, wrap_unit_class(cfg)):
            fully_shard(module)
    return fully_shard(model)


def wrap_ddp(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    return DistributedDataParallel(model)


def wrap_local(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    return model


# contender name -> wrap(fresh model, config) -> the module to train
WRAPPERS: dict[str, Callable[[nn.Module, ModelConfig], nn.Module]] = {
    "local": wrap_local,
    "cfsdp": wrap_cfsdp,
    "fsdp1": wrap_fsdp1,
    "fsdp2": wrap_fsdp2,
    "ddp": wrap_ddp,
}


def check_preconditions(name: str) -> None:
    """Raise here, before any collective, what would otherwise fail mid-step."""
    if name == "cfsdp":
        cfsdp = _cfsdp_module()
        if not hasattr(cfsdp, "FullyShardedDataParallel"):
            raise ImportError(
                f"cfsdp {cfsdp_version()} ({cfsdp.__file__}) has no FullyShardedDataParallel"
            )


# --------------------------------------------------------------------------
# one contender


@dataclass
class Outcome:
    """What one rank measured for one contender (before the cross-rank reduce)."""

    wrap_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # timed steps only
    losses: list[float] = field(default_factory=list)  # every step, warmup included
    start_rss_kib: int = 0  # RSS right after the high-water mark was reset
    peak_rss_kib: int = 0  # high-water mark over the whole contender
    steps_rss_kib: int = 0  # high-water mark over the timed steps only
    live_bytes: int = 0  # tensor storages after the last step minus those at the start
    error: str | None = None


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Forward, cross-entropy, backward, optimizer step, zero_grad."""
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


def run_contender(name: str, cfg: ModelConfig, warmup: int, iters: int) -> Outcome:
    """Build, wrap, warm up and time one contender on this rank."""
    out = Outcome()
    rank = dist.get_rank()
    release_memory()
    reset_peak_rss()
    out.start_rss_kib = _read_status_kib("VmRSS")
    start_live_bytes = live_tensor_bytes()  # tensors earlier contenders left behind
    try:
        check_preconditions(name)
        model = build_model(cfg, SEED)
        dist.barrier()
        t0 = time.perf_counter()
        model = WRAPPERS[name](model, cfg)
        out.wrap_s = time.perf_counter() - t0
        optim = torch.optim.AdamW(model.parameters(), lr=LR)
        setup_peak_kib = 0
        for step in range(warmup + iters):
            if step == warmup:  # set-up peak (build, wrap, warmup) apart from steady state
                setup_peak_kib = _read_status_kib("VmHWM")
                reset_peak_rss()
            x, y = make_batch(cfg, SEED, rank, step)
            dist.barrier()
            t0 = time.perf_counter()
            loss = train_step(model, optim, x, y)
            dt = time.perf_counter() - t0
            out.losses.append(loss.item())
            if step >= warmup:
                out.step_s.append(dt)
        out.steps_rss_kib = _read_status_kib("VmHWM")
        out.peak_rss_kib = max(setup_peak_kib, out.steps_rss_kib)
        out.live_bytes = live_tensor_bytes() - start_live_bytes
        del model, optim
    except Exception as e:  # recorded, the run goes on with the next contender
        out.error = f"{type(e).__name__}: {e}"
        print(f"[rank {rank}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    release_memory()
    return out


def reduce_outcome(out: Outcome, warmup: int, iters: int, rss_reset: bool) -> dict[str, Any]:
    """Combine all ranks' outcomes into one result (same on every rank).

    A failure on any rank fails the contender everywhere, so every rank takes
    the same branch (and issues the same collectives) from here on.
    """
    world = dist.get_world_size()
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, out.error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        return {"error": "; ".join(f"rank {r}: {e}" for r, e in failed)}
    step_s = torch.tensor(out.step_s, dtype=torch.float64)
    losses = torch.tensor(out.losses, dtype=torch.float64)
    scalars = torch.tensor(
        [
            out.wrap_s,
            out.start_rss_kib,
            out.peak_rss_kib,
            out.steps_rss_kib,
            out.peak_rss_kib - out.start_rss_kib,
            out.live_bytes,
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # per step: the slowest rank
    dist.all_reduce(scalars, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    losses /= world  # per step: the mean loss over the global batch
    return {
        "step_ms": statistics.median(step_s.tolist()) * 1e3,
        "step_ms_all": [t * 1e3 for t in step_s.tolist()],
        "wrap_s": scalars[0].item(),
        "start_rss_mib": scalars[1].item() / 1024,
        "peak_rss_mib": scalars[2].item() / 1024,
        "steps_peak_rss_mib": scalars[3].item() / 1024,
        "rss_growth_mib": scalars[4].item() / 1024,
        "live_tensor_mib": scalars[5].item() / 2**20,
        "rss_reset": rss_reset,
        "losses": losses.tolist(),
        "final_loss": losses[-1].item(),
        "warmup": warmup,
        "iters": iters,
    }


def add_ratios(results: dict[str, dict[str, Any]]) -> list[str]:
    """Fill overhead and ratios in place; return warnings on loss disagreement."""
    ok = {k: v for k, v in results.items() if "error" not in v}
    local = ok.get("local", {}).get("step_ms")
    fsdp2 = ok.get("fsdp2", {}).get("step_ms")
    for res in ok.values():
        res["overhead_ms"] = res["step_ms"] - local if local is not None else None
        res["ratio_vs_fsdp2"] = res["step_ms"] / fsdp2 if fsdp2 else None
    fsdp2_over = ok.get("fsdp2", {}).get("overhead_ms")
    for res in ok.values():
        over = res.get("overhead_ms")
        usable = over is not None and fsdp2_over is not None and fsdp2_over > 0
        res["overhead_ratio_vs_fsdp2"] = over / fsdp2_over if usable else None

    warnings: list[str] = []
    ref = ok.get("ddp", {}).get("losses")
    for name in SHARDED:
        if name not in ok:
            continue
        if ref is None:
            warnings.append(f"WARNING: no DDP reference; {name}'s losses are unchecked")
            continue
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ok[name]["losses"], ref))
        ok[name]["max_rel_loss_diff_vs_ddp"] = rel
        if rel > LOSS_RTOL:
            warnings.append(
                f"WARNING: {name} losses differ from DDP's by up to {rel:.3e} "
                f"relative (> {LOSS_RTOL:g})"
            )
    return warnings


# --------------------------------------------------------------------------
# reporting


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per contender; failed contenders show their error."""
    head = (
        "| contender | step ms (median) | overhead ms (step - local) | step / fsdp2 "
        "| overhead / fsdp2 overhead | peak RSS MiB | peak - start RSS MiB "
        "| live tensors MiB | wrap s | final loss | max rel loss diff vs ddp |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [head]
    for name, res in results.items():
        if "error" in res:
            error = res["error"].replace("|", "\\|").replace("\n", " ")
            rows.append(f"| {name} | error: {error} ||||||||||")
            continue
        flag = "" if res["rss_reset"] else " (*)"
        rows.append(
            f"| {name} | {res['step_ms']:.1f} | {_fmt(res.get('overhead_ms'), '.1f')} "
            f"| {_fmt(res.get('ratio_vs_fsdp2'), '.2f')} "
            f"| {_fmt(res.get('overhead_ratio_vs_fsdp2'), '.2f')} "
            f"| {res['peak_rss_mib']:.0f}{flag} | {res['rss_growth_mib']:.0f}{flag} "
            f"| {res['live_tensor_mib']:.1f} "
            f"| {res['wrap_s']:.3f} | {res['final_loss']:.6f} "
            f"| {_fmt(res.get('max_rel_loss_diff_vs_ddp'), '.1e')} |"
        )
    return "\n".join(rows)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        return match.group(1).strip() if match else "unknown"
    except OSError:
        return "unknown"


def cfsdp_version() -> str:
    """``<version> (backend <c|python>)`` of the installed cfsdp, or why not."""
    try:
        cfsdp = _cfsdp_module()
    except Exception as e:
        return f"not importable ({type(e).__name__}: {e})"
    try:
        from importlib.metadata import version

        ver = version("cfsdp")
    except Exception:
        ver = getattr(cfsdp, "__version__", "unknown")
    return f"{ver} (backend {getattr(cfsdp, 'backend', 'unknown')})"


def machine_info(args: argparse.Namespace, rss_reset: bool) -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cfsdp": cfsdp_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads_per_rank": torch.get_num_threads(),
        "rss_reset": rss_reset,
        "command": "torchrun --standalone --nproc_per_node "
        f"{dist.get_world_size()} " + " ".join(sys.argv),
        "warmup": args.warmup,
        "iters": args.iters,
    }


# --------------------------------------------------------------------------
# main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated subset of {','.join(CONTENDERS)} (run in that order)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, s")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/bench.json"))
    args = p.parse_args()
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        p.error(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    args.contenders = [c for c in CONTENDERS if c in names]
    if args.iters < 1:
        p.error("--iters must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    rss_reset = reset_peak_rss()
    if rank == 0 and not rss_reset:
        print(
            "NOTE: /proc/self/clear_refs is not writable: peak RSS is the process-lifetime "
            "peak (flagged (*)), not the contender's own",
            flush=True,
        )
    report: dict[str, Any] = {"machine": machine_info(args, rss_reset), "models": {}}
    model_names = list(MODELS) if args.model == "all" else [args.model]
    for model_name in model_names:
        cfg = MODELS[model_name]
        results: dict[str, dict[str, Any]] = {}
        for name in args.contenders:
            if rank == 0:
                print(f"[{model_name}] {name} ...", flush=True)
            out = run_contender(name, cfg, args.warmup, args.iters)
            results[name] = reduce_outcome(out, args.warmup, args.iters, rss_reset)
            if rank == 0 and "error" in results[name]:
                print(f"[{model_name}] {name} error: {results[name]['error']}", flush=True)
        warnings = add_ratios(results)
        n_params = sum(p.numel() for p in build_model(cfg, SEED).parameters())
        report["models"][model_name] = {
            "config": {**config_dict(cfg), "n_params": n_params},
            "contenders": results,
            "warnings": warnings,
        }
        if rank == 0:
            print(f"\n### {model_name}: {config_dict(cfg)}, {n_params:,} params\n")
            print(markdown_table(results))
            for line in warnings:
                print(line)
            if not rss_reset:
                print("(*) process-lifetime peak: /proc/self/clear_refs was not writable")
            print(flush=True)
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
