"""The steps of ``tools/gpu_check.sh`` (issue 26's one prepared GPU check), one per
subcommand, each run by the shell under its own time limit:

* ``parity``  (torchrun, 1 rank, NCCL, ``TORCH_CUDA_SANITIZER=1``): both faces train the
  small-unit model a few steps beside torch's own (the wrapper against FSDP1, ``fully_shard``
  against FSDP2) from the same weights on the same batches; losses compared bit for bit.
* ``probe``   (torchrun, 2 ranks, gloo): the collectives of ``gloo2`` on CUDA tensors, once.
* ``gloo2``   (torchrun, 2 ranks sharing the GPU over gloo with CUDA tensors; NCCL refuses
  two ranks on one GPU): the same comparison at world size 2.
* ``bench``   (torchrun, 1 rank, NCCL): step time (median of timed steps, CUDA-synchronised)
  and peak memory (``torch.cuda.max_memory_allocated``) of both faces and of FSDP1/FSDP2 on
  the 64-small-unit model and the GPT-2-like model; ratios against FSDP2 (and FSDP1).
* ``profile`` (torchrun, 1 rank, NCCL): a ``torch.profiler`` trace of ``fully_shard`` steps;
  which stream each collective kernel ran on and how much of each all-gather kernel's time
  overlapped a compute kernel on another stream.
* ``report``: the JSON files of the steps as one Markdown report.

Every step writes ``<dir>/<step>.json`` (rank 0) and never claims what it did not measure:
a step that failed or timed out has no file, and the report says so.  ``--dry-run`` runs
the same code on the CPU with gloo and tiny sizes (this machine's check of the script's
plumbing; its numbers say nothing about a GPU and the report is marked so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "benchmarks")]

import cfsdp  # noqa: E402
from models import GPTConfig, SmallConfig, build_model, make_batch, wrap_unit_class  # noqa: E402

SEED = 0


def _device(dry: bool) -> torch.device:
    if dry:
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _init(backend: str, dry: bool) -> torch.device:
    device = _device(dry)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend if not dry else "gloo")
    return device


def _configs(dry: bool) -> dict[str, Any]:
    if dry:
        return {"small": SmallConfig(n_blocks=8, width=16, n_classes=16, seq_len=4, batch_size=2),
                "gpt2": GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)}
    return {"small": SmallConfig(), "gpt2": GPTConfig()}


def _wrap(face: str, model: nn.Module, cfg: Any, device: torch.device) -> nn.Module:
    """``face``'s model on ``device``: cfsdp / FSDP1 wrap each unit class with a policy,
    cfsdp_fs / FSDP2 shard each unit then the root (torch's way)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    unit = wrap_unit_class(cfg)
    if face in ("cfsdp", "fsdp1"):
        cls = cfsdp.FullyShardedDataParallel if face == "cfsdp" else FSDP1
        return cls(model, auto_wrap_policy=ModuleWrapPolicy({unit}), device_id=device)
    shard = cfsdp.fully_shard if face == "cfsdp_fs" else fsdp2_shard
    model.to(device)
    for m in model.modules():
        if isinstance(m, unit):
            shard(m)
    shard(model)
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
          ) -> torch.Tensor:
    logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _train(face: str, cfg: Any, device: torch.device, steps: int) -> list[float]:
    model = _wrap(face, build_model(cfg, SEED), cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    losses = []
    for s in range(steps):
        x, y = (t.to(device) for t in make_batch(cfg, SEED, rank, s))
        losses.append(_step(model, opt, x, y))
    return [float(v) for v in torch.stack(losses).cpu()]


def _write(args: argparse.Namespace, name: str, data: dict) -> None:
    if dist.get_rank() == 0:
        data.update(torch=torch.__version__, dry_run=args.dry_run,
                    device=torch.cuda.get_device_name() if not args.dry_run else "cpu (dry run)")
        (Path(args.dir) / f"{name}.json").write_text(json.dumps(data, indent=1))


def _compare(args: argparse.Namespace, name: str, steps: int, backend: str) -> int:
    """Both faces against torch's, losses bit for bit; rc 1 on a mismatch."""
    device = _init(backend, args.dry_run)
    cfg = _configs(args.dry_run)["small"]
    out: dict = {"world_size": dist.get_world_size(), "steps": steps, "pairs": {}}
    bad = 0
    for mine, ref in (("cfsdp", "fsdp1"), ("cfsdp_fs", "fsdp2")):
        a, b = _train(mine, cfg, device, steps), _train(ref, cfg, device, steps)
        same = a == b
        bad += not same
        out["pairs"][f"{mine} vs {ref}"] = {"bitwise": same, "losses": a, "torch_losses": b}
    out["sanitizer"] = os.environ.get("TORCH_CUDA_SANITIZER") == "1"
    _write(args, name, out)
    dist.destroy_process_group()
    return 1 if bad else 0


def _timed(face: str, cfg: Any, device: torch.device, warmup: int, iters: int) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = _wrap(face, build_model(cfg, SEED), cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for s in range(warmup + iters):
        x, y = (t.to(device) for t in make_batch(cfg, SEED, dist.get_rank(), s))
        sync()
        t0 = time.perf_counter()
        _step(model, opt, x, y)
        sync()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, opt
    return {"step_ms": 1e3 * statistics.median(times), "peak_bytes": peak}


def probe(args: argparse.Namespace) -> int:
    """gloo with CUDA tensors (2 ranks on one GPU): the collectives the faces use, once
    each; the shell gives it 30 s and skips ``gloo2`` if it fails or hangs."""
    device = _init("gloo", args.dry_run)
    w = dist.get_world_size()
    t = torch.ones(4 * w, device=device)
    dist.all_reduce(t)
    out = torch.empty(4 * w * w, device=device)
    dist.all_gather_into_tensor(out, t)
    part = torch.empty(4, device=device)
    dist.reduce_scatter_tensor(part, t)
    dist.broadcast(t, 0)
    ok = bool(torch.equal(part, torch.full((4,), float(w * w), device=device)))
    dist.destroy_process_group()
    return 0 if ok else 1


def bench(args: argparse.Namespace) -> int:
    device = _init("nccl", args.dry_run)
    out: dict = {"models": {}}
    warmup, iters = (1, 3) if args.dry_run else (5, 20)
    for name, cfg in _configs(args.dry_run).items():
        res = {face: _timed(face, cfg, device, warmup, iters)
               for face in ("fsdp2", "cfsdp_fs", "fsdp1", "cfsdp")}
        ratios = {
            "cfsdp_fs / fsdp2 step": res["cfsdp_fs"]["step_ms"] / res["fsdp2"]["step_ms"],
            "cfsdp / fsdp1 step": res["cfsdp"]["step_ms"] / res["fsdp1"]["step_ms"],
            "cfsdp / fsdp2 step": res["cfsdp"]["step_ms"] / res["fsdp2"]["step_ms"],
        }
        if res["fsdp2"]["peak_bytes"]:
            ratios["cfsdp_fs / fsdp2 peak"] = res["cfsdp_fs"]["peak_bytes"] / res["fsdp2"]["peak_bytes"]
            ratios["cfsdp / fsdp2 peak"] = res["cfsdp"]["peak_bytes"] / res["fsdp2"]["peak_bytes"]
        out["models"][name] = {"results": res, "ratios": ratios, "warmup": warmup, "iters": iters}
    _write(args, "bench", out)
    dist.destroy_process_group()
    return 0


def _kernel_streams(prof: Any) -> tuple[dict, list]:
    """(collective name -> streams its kernels ran on, [(start, end, stream, is_comm)]) from
    the profiler's device kernel events."""
    spans, streams = [], {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name
        comm = "nccl" in name.lower()
        stream = getattr(ev, "device_resource_id", None)
        start = ev.time_range.start
        spans.append((start, ev.time_range.end, stream, comm, name))
        if comm:
            streams.setdefault(name.split("(")[0][:60], set()).add(stream)
    return {k: sorted(v) for k, v in streams.items()}, spans


def profile(args: argparse.Namespace) -> int:
    device = _init("nccl", args.dry_run)
    cfg = _configs(args.dry_run)["small"]
    model = _wrap("cfsdp_fs", build_model(cfg, SEED), cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(3):  # warm up
        x, y = (t.to(device) for t in make_batch(cfg, SEED, 0, s))
        _step(model, opt, x, y)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for s in range(3, 6):
            x, y = (t.to(device) for t in make_batch(cfg, SEED, 0, s))
            _step(model, opt, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
    streams, spans = _kernel_streams(prof)
    ag = [s for s in spans if s[3] and "allgather" in s[4].lower().replace("_", "")]
    compute = [s for s in spans if not s[3]]
    overlap = []
    for a0, a1, st, _, _ in ag:
        busy = sum(max(0, min(a1, c1) - max(a0, c0)) for c0, c1, cst, _, _ in compute
                   if cst != st)
        overlap.append(min(1.0, busy / max(a1 - a0, 1)))
    _write(args, "profile", {
        "collective_streams": streams,
        "all_gather_kernels": len(ag),
        "all_gather_overlap_fraction_median": statistics.median(overlap) if overlap else None,
        "note": "world size 1: NCCL all-gathers of one rank are copies; overlap is what the "
                "stream protocol allows, not a multi-GPU measurement"})
    dist.destroy_process_group()
    return 0


def report(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    lines = ["# gpu_check report", ""]
    parts = {n: (json.loads((d / f"{n}.json").read_text()) if (d / f"{n}.json").exists() else None)
             for n in ("parity", "gloo2", "bench", "profile")}
    any_part = next((p for p in parts.values() if p), None)
    if any_part:
        lines += [f"torch {any_part['torch']}, device {any_part['device']}"
                  + (" -- DRY RUN on the CPU: these numbers say nothing about a GPU"
                     if any_part["dry_run"] else ""), ""]
    for n in ("parity", "gloo2"):
        p = parts[n]
        title = {"parity": "world 1, NCCL, TORCH_CUDA_SANITIZER=1",
                 "gloo2": "world 2 sharing the GPU over gloo (CUDA tensors)"}[n]
        lines.append(f"## {n}: {title}")
        if p is None:
            lines += ["not measured (the step failed, timed out or was skipped: see the log)", ""]
            continue
        for pair, r in p["pairs"].items():
            lines.append(f"- {pair}: {'bitwise equal' if r['bitwise'] else 'DIFFERENT'} "
                         f"losses over {p['steps']} steps")
        lines.append("")
    lines.append("## bench: step time (median, ms) and peak memory, world 1")
    b = parts["bench"]
    if b is None:
        lines += ["not measured", ""]
    else:
        for model, m in b["models"].items():
            lines.append(f"### {model} ({m['iters']} timed steps after {m['warmup']})")
            lines.append("| face | step ms | peak MiB |")
            lines.append("|---|---|---|")
            for face, r in m["results"].items():
                peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
                lines.append(f"| {face} | {r['step_ms']:.2f} | {peak} |")
            lines += [""] + [f"- {k}: {v:.3f}" for k, v in m["ratios"].items()] + [""]
    lines.append("## profile: streams and all-gather overlap (fully_shard, world 1)")
    p = parts["profile"]
    if p is None:
        lines += ["not measured", ""]
    else:
        lines += [f"- collective kernels by stream: {p['collective_streams']}",
                  f"- all-gather kernels: {p['all_gather_kernels']}, median fraction "
                  f"overlapped by compute on another stream: "
                  f"{p['all_gather_overlap_fraction_median']}", f"- {p['note']}", ""]
    text = "\n".join(lines)
    (d / "gpu_check_report.md").write_text(text + "\n")
    print(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=["probe", "parity", "gloo2", "bench", "profile", "report"])
    ap.add_argument("--dir", required=True, help="where the step's JSON goes")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes")
    args = ap.parse_args()
    steps: dict[str, Callable[[argparse.Namespace], int]] = {
        "parity": lambda a: _compare(a, "parity", 2 if a.dry_run else 4, "nccl"),
        "gloo2": lambda a: _compare(a, "gloo2", 2, "gloo"),
        "probe": probe,
        "bench": bench, "profile": profile, "report": report}
    return steps[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
