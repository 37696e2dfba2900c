"""What worker_shm.py shares with the emulated-hosts workers (worker_hosts*.py): per-rank data
(``data``, ``all_data``), the bitwise and tolerance checks against gloo (``same_bits``,
``close_to_gloo``), every collective checked on a group (``check_all_ops``), and training both
faces over the collectives (``train_faces``, ``assert_faces_match``, the ``_LM`` model).
``EXPECT_SHM``: whether the collectives must have taken shared memory (the emulated hosts set it
False).  Registers no subtest (tests/unit/test_harness_imports.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import parity_common as pc

import cfsdp
from cfsdp._ref import shm_reduce as ref_reduce
from cfsdp._runtime import comm


EXPECT_SHM = cfsdp.backend == "c" and os.environ.get("CFSDP_SHM", "1").strip() != "0"
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-9,
                 torch.float16: 2.0**-11}
SIZES = [1, 7, 1001, 9973]  # 9973 x 8 B spans many 4 KiB slot halves
SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def data(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dtype)


def all_data(seed: int, world: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [data(seed, r, n, dtype) for r in range(world)]


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.contiguous(), b.contiguous()
    if a.dtype != b.dtype or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        bad = (a != b).nonzero()
        raise AssertionError(f"{what}: not bitwise equal ({bad.numel()} differ, first at "
                             f"{bad[:1].tolist()})")


def close_to_gloo(got: torch.Tensor, gloo: torch.Tensor, inputs: list[torch.Tensor],
                  scale: float, what: str) -> None:
    w = len(inputs)
    mag = sum(x.double().abs() for x in inputs) * abs(scale)
    half = got.dtype in (torch.bfloat16, torch.float16)
    tol = (2 if half else 1) * (w + 1) * UNIT_ROUNDOFF[got.dtype] * mag + 1e-300
    err = (got.double() - gloo.double()).abs()
    if not bool((err <= tol).all()):
        i = int((err - tol).argmax())
        raise AssertionError(f"{what}: |shm - gloo| = {err[i].item():.3g} > tol "
                             f"{tol[i].item():.3g} at {i} (shm {got[i].item()}, gloo "
                             f"{gloo[i].item()})")


def check_all_ops(ctx, group, dtype, sizes, seed0=0) -> None:
    """Every op on `group` through comm (async, waited at once) against gloo (all-to-all with
    the whole counts matrix, drawn from the seed: every rank knows it)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    for i, n in enumerate(sizes):
        seed = seed0 + 10 * i
        # all-gather, input separate and as this rank's block of the output
        shard = data(seed, r, n, dtype)
        out, ref = torch.empty(W * n, dtype=dtype), torch.empty(W * n, dtype=dtype)
        comm.all_gather(out, shard, group, async_op=True).wait()
        dist.all_gather_into_tensor(ref, shard, group=group)
        same_bits(out, ref, f"all_gather {dtype} n={n}")
        out2 = torch.empty(W * n, dtype=dtype)
        out2[r * n:(r + 1) * n] = shard
        comm.all_gather(out2, out2[r * n:(r + 1) * n], group, async_op=False)
        same_bits(out2, ref, f"all_gather in place {dtype} n={n}")
        # reduce-scatter: SUM, AVG, SUM with a fused scale
        full = all_data(seed + 1, W, W * n, dtype)
        chunks = [x[r * n:(r + 1) * n] for x in full]
        for op, scale in ((SUM, None), (AVG, None), (SUM, 0.125)):
            eff = (1.0 if scale is None else scale) / (W if op == AVG else 1)
            out = torch.empty(n, dtype=dtype)
            comm.reduce_scatter(out, full[r], group, True, op=op, scale=scale).wait()
            ref = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(ref, full[r].clone(), op=op, group=group)
            if scale is not None:
                ref.mul_(scale)
            what = f"reduce_scatter {dtype} n={n} op={op} scale={scale}"
            close_to_gloo(out, ref, chunks, eff, what)
            if EXPECT_SHM:
                want = torch.empty(n, dtype=dtype)
                ref_reduce(want, chunks, eff)
                same_bits(out, want, what + " vs twin")
                if W == 2 and op == SUM and scale is None and dtype in (torch.float32,
                                                                         torch.float64):
                    same_bits(out, ref, what + " vs gloo")
        # all-reduce (in place), SUM and AVG
        ins = all_data(seed + 2, W, n, dtype)
        for op in (SUM, AVG):
            eff = 1.0 / W if op == AVG else 1.0
            t, ref = ins[r].clone(), ins[r].clone()
            comm.all_reduce(t, group, True, op=op).wait()
            dist.all_reduce(ref, op=op, group=group)
            what = f"all_reduce {dtype} n={n} op={op}"
            close_to_gloo(t, ref, ins, eff, what)
            if EXPECT_SHM:
                want = torch.empty(n, dtype=dtype)
                ref_reduce(want, ins, eff)
                same_bits(t, want, what + " vs twin")
        # broadcast from every root
        for root in range(W):
            t = data(seed + 3, r, n, dtype)
            ref = t.clone()
            comm.broadcast(t, root, group, async_op=True).wait()
            dist.broadcast(ref, group=group, group_src=root)
            same_bits(t, ref, f"broadcast {dtype} n={n} root={root}")
        check_all_to_all(group, dtype, n, seed + 4)


def check_all_to_all(group, dtype, n: int, seed: int) -> None:
    """An all-to-all through comm against gloo's ``all_to_all_single``, bitwise: blocks of
    uneven sizes up to ``n`` (some empty, one exactly ``n``), the counts matrix drawn from
    ``seed`` (every rank draws the same)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, n + 1, (W, W), generator=g)
    counts[torch.rand(W, W, generator=g) < 0.2] = 0
    counts[0, W - 1] = n
    counts = counts.tolist()
    inp = data(seed + 1, r, sum(counts[r]), dtype)
    out = torch.empty(sum(row[r] for row in counts), dtype=dtype)
    ref = torch.empty_like(out)
    comm.all_to_all(out, inp, counts, group, async_op=True).wait()
    dist.all_to_all_single(ref, inp, [row[r] for row in counts], counts[r], group=group)
    same_bits(out, ref, f"all_to_all {dtype} n={n}")


def _train(model: torch.nn.Module, steps: int, seed: int, sgd: bool = False) -> list[float]:
    """``steps`` of AdamW (or SGD with momentum) on per-rank data; the losses."""
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if sgd else
           torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 100 + step * 10 + dist.get_rank())
        x = torch.randn(6, 13, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _mlp() -> torch.nn.Module:
    torch.manual_seed(7)  # odd sizes: uneven shards and padding at every world size
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 29),
                               torch.nn.Tanh(), torch.nn.Linear(29, 5))


def _full_params(model: torch.nn.Module, face: str) -> list[torch.Tensor]:
    if face == "fully_shard":
        return [p.full_tensor().detach().clone() for p in model.parameters()]
    with type(model).summon_full_params(model):  # cfsdp's or torch's FSDP class
        return [p.detach().clone() for p in model.parameters()]


class _LM(torch.nn.Module):
    """worker_parity's tiny transformer as a function of float inputs (``_train`` feeds
    ``randn(6, 13)``): the blocks are the units, as in the main parity tests."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.inp = torch.nn.Linear(13, pc.WIDTH)
        self.blocks = torch.nn.ModuleList(pc.Block(pc.WIDTH, pc.HEADS) for _ in range(2))
        self.out = torch.nn.Linear(pc.WIDTH, 5)

    def forward(self, x):
        h = self.inp(x).unsqueeze(0)
        for b in self.blocks:
            h = b(h)
        return self.out(h.squeeze(0))


def train_faces(ctx, face: str, kind: str) -> dict:
    """``face`` ("fsdp1", "fsdp1_orig_params", "fully_shard") of cfsdp and of torch on
    ``ctx.pg``, each on ``kind`` ("mlp" or "lm", the units its layers or blocks), trained 6
    steps: ``{"cfsdp": (losses, full params), "torch": (...)}``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    runs = {}
    for impl in ("cfsdp", "torch"):
        model = _mlp() if kind == "mlp" else _LM()
        units = ([model[0], model[2], model[4]] if kind == "mlp" else list(model.blocks))
        if face == "fully_shard":
            shard = cfsdp.fully_shard if impl == "cfsdp" else torch_fully_shard
            mesh = DeviceMesh.from_group(ctx.pg, "cpu")
            for m in units:
                shard(m, mesh=mesh)
            shard(model, mesh=mesh)
        else:
            cls = cfsdp.FullyShardedDataParallel if impl == "cfsdp" else TorchFSDP
            unit_cls = torch.nn.Linear if kind == "mlp" else type(units[0])
            model = cls(model, process_group=ctx.pg, device_id=torch.device("cpu"),
                        use_orig_params=face == "fsdp1_orig_params",
                        auto_wrap_policy=ModuleWrapPolicy({unit_cls}))
        # the transformer trains with SGD: AdamW divides by sqrt(v), which turns an fp32
        # rounding difference of a near-zero gradient into a different step (measured up
        # to 1.5e-4 relative in 6 steps at W=4); SGD keeps rounding differences at rounding
        losses = _train(model, 6, seed=3, sgd=kind == "lm")
        runs[impl] = (losses, _full_params(model, face))
    return runs


def assert_faces_match(ctx, runs: dict, face: str) -> None:
    """cfsdp's run against torch's: bitwise at W = 2 (every sum has two terms), within fp32
    rounding at W >= 3 (rtol 1e-5: cfsdp adds the ranks in its documented order, gloo in its
    ring's)."""
    (l_c, p_c), (l_t, p_t) = runs["cfsdp"], runs["torch"]
    if ctx.world_size == 2:
        assert l_c == l_t, (l_c, l_t)
        for a, b in zip(p_c, p_t):
            same_bits(a, b, f"{face} parameter after training")
    else:
        torch.testing.assert_close(torch.tensor(l_c), torch.tensor(l_t), rtol=1e-5, atol=0)
        for a, b in zip(p_c, p_t):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
