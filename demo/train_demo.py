"""Train a small GPT-2-like model with cfsdp, then with torch's FSDP1, and compare.

Launch on 2 CPU ranks (gloo, one thread each)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 demo/train_demo.py

Both runs start from the same seeded weights and see the same data (a seeded
synthetic token stream, a different batch on each rank); both wrap one FSDP
unit per transformer block with ``use_orig_params=False``.  The only
difference is the import::

    from cfsdp import FullyShardedDataParallel                    # run 1
    from torch.distributed.fsdp import FullyShardedDataParallel   # run 2

Rank 0 prints the two loss curves side by side with per-step times, and a
final line saying whether the curves match (max |diff| <= ``--tol``).  The
exit code is 0 if they match, 1 if they do not (or if cfsdp cannot run).
"""

from __future__ import annotations

import argparse
import datetime
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
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from models import Block, GPTConfig, build_model  # noqa: E402

CFG = GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=8, d_model=256, batch_size=4)
SEED = 1234
LR = 3e-3
FOLLOW_P = 0.9  # probability that a token follows the hidden bigram rule


def make_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic batch for ``(rank, step)``: each next token is
    ``succ[prev]`` (a fixed seeded permutation) with probability ``FOLLOW_P``,
    else uniform.  Returns ``(inputs, targets)``, both ``(batch, seq)`` int64."""
    succ = torch.randperm(CFG.vocab_size, generator=torch.Generator().manual_seed(SEED))
    g = torch.Generator().manual_seed(SEED * 7919 + rank * 104_729 + step)
    shape = (CFG.batch_size, CFG.seq_len + 1)
    noise = torch.randint(0, CFG.vocab_size, shape, generator=g)
    follow = torch.rand(shape, generator=g) < FOLLOW_P
    tokens = noise.clone()
    for t in range(1, shape[1]):
        tokens[:, t] = torch.where(follow[:, t], succ[tokens[:, t - 1]], noise[:, t])
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(
    fsdp_cls: Callable[..., nn.Module], steps: int
) -> tuple[list[float], list[float]]:
    """Train ``steps`` steps with ``fsdp_cls`` wrapping a fresh model.

    Returns the per-step loss (mean over ranks: the global-batch loss) and the
    per-step time in ms (slowest rank; every step starts after a barrier).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = fsdp_cls(
        build_model(CFG, SEED),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=False,
        device_id=torch.device("cpu"),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, times = [], []
    for step in range(steps):
        x, y = make_batch(rank, step)
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    loss_t = torch.tensor(losses, dtype=torch.float64)
    time_t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(loss_t, op=dist.ReduceOp.SUM)
    dist.all_reduce(time_t, op=dist.ReduceOp.MAX)
    return (loss_t / world).tolist(), time_t.tolist()


def import_cfsdp() -> tuple[Any, str | None]:
    """``(cfsdp, None)`` if cfsdp has its wrapper, else ``(None, why not)``."""
    try:
        import cfsdp

        cfsdp.FullyShardedDataParallel  # noqa: B018 -- fail here, not mid-run
        return cfsdp, None
    except (ImportError, AttributeError) as e:
        return None, f"{type(e).__name__}: {e}"


def report(
    c_loss: list[float], t_loss: list[float], c_ms: list[float], t_ms: list[float], tol: float
) -> bool:
    """Print the side-by-side table and the verdict; True if the curves match."""
    diffs = [abs(a - b) for a, b in zip(c_loss, t_loss)]
    print("| step | cfsdp loss | torch FSDP1 loss | abs diff | cfsdp ms | torch ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, (a, b, d, ca, ta) in enumerate(zip(c_loss, t_loss, diffs, c_ms, t_ms)):
        print(f"| {i} | {a:.6f} | {b:.6f} | {d:.2e} | {ca:.1f} | {ta:.1f} |")
    c_med, t_med = statistics.median(c_ms[1:]), statistics.median(t_ms[1:])
    print(
        f"\nmedian step time (step 0 excluded): cfsdp {c_med:.1f} ms, "
        f"torch FSDP1 {t_med:.1f} ms, cfsdp / torch = {c_med / t_med:.2f}"
    )
    max_diff = max(diffs)
    print(f"max |loss diff| over {len(diffs)} steps: {max_diff:.3e}")
    match = max_diff <= tol
    verdict = "MATCH" if match else "MISMATCH"
    print(f"{verdict}: cfsdp and torch FSDP1 loss curves (max |diff| {max_diff:.3e} "
          f"{'<=' if match else '>'} {tol:g})", flush=True)
    return match


def run(steps: int, tol: float) -> int:
    """Both trainings and the report; the exit code (same on every rank)."""
    rank = dist.get_rank()
    cfsdp, why = import_cfsdp()  # the same answer on every rank
    if cfsdp is None:
        if rank == 0:
            print(f"cfsdp cannot run: {why}", file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        n_params = sum(p.numel() for p in build_model(CFG, SEED).parameters())
        print(f"cfsdp backend {cfsdp.backend}, torch {torch.__version__}\n"
              f"model {CFG} ({n_params:,} params), world {dist.get_world_size()}, "
              f"gloo, 1 thread/rank, AdamW lr {LR}, {steps} steps\n", flush=True)
    c_loss, c_ms = train(cfsdp.FullyShardedDataParallel, steps)
    t_loss, t_ms = train(TorchFSDP, steps)
    match = report(c_loss, t_loss, c_ms, t_ms, tol) if rank == 0 else True
    verdict = torch.tensor([int(match)])
    dist.broadcast(verdict, src=0)  # every rank exits with rank 0's verdict
    return 0 if verdict.item() else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tol", type=float, default=1e-5, help="max |loss diff| for a match")
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be at least 2 (step 0 is left out of the median)")
    if "RANK" not in os.environ:
        print("launch with: OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 "
              "demo/train_demo.py", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    code = run(args.steps, args.tol)
    # Tear down only on success (an exception exits and torchrun stops the other
    # ranks), and only once every rank got here.  The interpreter's exit is then
    # clean: cfsdp's atexit handler lets gloo's worker threads finish with Python
    # before it finalizes (torch 2.13 alone can abort a rank there: [Note: exit and
    # gloo workers] in python/cfsdp/_runtime/shutdown.py).
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
