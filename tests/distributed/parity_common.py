"""What the FSDP1 parity suites share (worker_parity.py's oracle and models, used by most workers).

The models (``TinyTransformer`` of ``Block``s, the ``odd`` nest with uneven shards, ``Strided``,
``seq``), their data and losses (``make_batches``, ``LOSSES``), the wrapping helpers
(``wrap_root``, ``wrap_odd``, ``make_policy``), the training loops (``train_fsdp`` for either
wrapper, ``train_ref`` for the single process) and ``run_parity``, which runs the three
contenders and compares them (see worker_parity.py's docstring for what and with which
tolerances); ``Mismatches`` collects a subtest's differences and raises them all at once;
``expect_same_error`` checks that torch and cfsdp reject a call alike.  Registers no subtest
(tests/unit/test_harness_imports.py).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import _harness as h

from cfsdp import FullyShardedDataParallel as CFSDP


CPU = torch.device("cpu")
STEPS = 10
REF_RTOL = 1e-5
REF_ATOL = 1e-6
FSDP_PREFIX = "_fsdp_wrapped_module."
BN_STATS = ("running_mean", "running_var", "num_batches_tracked")

# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------

VOCAB, SEQ, WIDTH, HEADS, BATCH = 32, 8, 32, 4, 4


class Attention(nn.Module):
    """Causal self-attention. The key projection has no bias: a key bias adds the same
    ``q . b_k`` to every score of a row, which softmax cancels, so its gradient is exactly 0
    in maths and rounding noise (~1e-10) in practice; AdamW divides that noise by its own
    square root and turns it into O(lr) updates of random sign, which no tolerance between
    two correct implementations can absorb."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, n_blocks: int = 3, d: int = WIDTH):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, HEADS) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)
        self.some_attr = "tiny-transformer"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def describe(self) -> str:
        return f"TinyTransformer({len(self.blocks)})"


def lm_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


class Odd(nn.Module):
    """Padding, parameters smaller than W, a 0-dim parameter on the root, buffers.

    Hand-nested units (see ``wrap_odd``) and their numels:
      root:  bn 14 + lin1 Linear(7, 5) 40 + scale (1,) 1 = 55  (odd: padded for W=2 and 4)
      seq:   Linear(5, 3) 18                                   (padded for W=4)
      seq.2: Linear(3, 1) 4, its bias has 1 element
      tiny:  Linear(1, 1) 2                                    (< W for W=4)
      one:   Linear(1, 1, bias=False) 1                        (< W: most ranks hold padding)
    """

    def __init__(self):
        super().__init__()
        # BatchNorm on the input, not after lin1: BN right after a Linear makes that Linear's
        # bias gradient exactly 0 (up to rounding noise), which AdamW amplifies (see Attention)
        self.bn = nn.BatchNorm1d(7)
        self.lin1 = nn.Linear(7, 5)
        self.seq = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))
        self.tiny = nn.Linear(1, 1)
        self.one = nn.Linear(1, 1, bias=False)
        self.scale = nn.Parameter(torch.tensor([1.5]))  # 1 element (torch FSDP1 rejects 0-dim)
        self.register_buffer("shift", torch.randn(7))
        self.some_attr = "odd"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hid = torch.relu(self.lin1(self.bn(x - self.shift)))
        y = self.seq(hid)
        y = y + self.tiny(y) * self.scale + self.one(y)
        return y.squeeze(-1)

    def describe(self) -> str:
        return "Odd"


def mse_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, tgt)


class Strided(nn.Module):
    """Parameters that are not row-major, between row-major ones (cfsdp's [Note: strided
    parameters]): a channels-last convolution weight (3, 2, 3, 3), a transposed Linear
    weight (9, 12) with stride (1, 9), and a (9, 1) column made by a transpose (stride
    (1, 9): row-major for ``is_contiguous``, not for torch FSDP1's last-stride test).  A
    module computes with the strides it holds: a row-major copy of these weights changes
    the losses in the 7th digit."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.conv.weight = nn.Parameter(self.conv.weight.detach().to(memory_format=torch.channels_last))
        self.w1 = nn.Parameter((torch.randn(12, 9) * 0.3).t())
        self.b1 = nn.Parameter(torch.zeros(9))
        self.col = nn.Parameter(torch.randn(1, 9).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.tanh(F.linear(h, self.w1, self.b1))
        return (h @ self.col).squeeze(-1)


def wrap_strided(wrapper: Callable[..., nn.Module], model: Strided, kw: dict) -> nn.Module:
    """The convolution in a unit of its own, the rest in the root's."""
    model.conv = wrapper(model.conv, **kw)
    return wrapper(model, **kw)


def make_seq() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 3))


def seq_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, tgt)


# --------------------------------------------------------------------------------------------
# data: every rank generates the global batch of each step; rank r trains on chunk r
# --------------------------------------------------------------------------------------------


def make_batches(kind: str, world: int, steps: int = STEPS, seed: int = 1234):
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        chunks = []
        for _ in range(world):
            if kind == "transformer":
                x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
                y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            elif kind == "odd":
                x = torch.randn(BATCH, 7, generator=g)
                y = torch.randn(BATCH, generator=g)
            elif kind == "seq":
                x = torch.randn(BATCH, 6, generator=g)
                y = torch.randn(BATCH, 3, generator=g)
            elif kind == "strided":
                x = torch.randn(BATCH, 2, 4, 4, generator=g)
                y = torch.randn(BATCH, generator=g)
            else:
                raise AssertionError(kind)
            chunks.append((x, y))
        out.append(chunks)
    return out


LOSSES = {"transformer": lm_loss, "odd": mse_loss, "seq": seq_loss, "strided": mse_loss}


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "transformer":
        return TinyTransformer()
    if kind == "odd":
        return Odd()
    if kind == "seq":
        return make_seq()
    if kind == "strided":
        return Strided()
    raise AssertionError(kind)


def make_policy(name: str):
    if name == "module":
        return ModuleWrapPolicy({Block})
    if name == "transformer":
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if name == "size":
        # per block: wraps mlp.0 (4224 numel), mlp.2 (4128), attn (4160 left), not the LayerNorms
        return functools.partial(size_based_auto_wrap_policy, min_num_params=2000)
    if name == "lambda":
        return functools.partial(
            lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, (Block, nn.LayerNorm))
        )
    if name == "none":
        return None
    raise AssertionError(name)


def wrap_odd(wrapper: Callable[..., nn.Module], model: Odd, **kw) -> nn.Module:
    """Hand-nested units, innermost first; root keeps lin1, bn and the 1-element ``scale``."""
    model.seq[2] = wrapper(model.seq[2], **kw)
    model.seq = wrapper(model.seq, **kw)
    model.tiny = wrapper(model.tiny, **kw)
    model.one = wrapper(model.one, **kw)
    return wrapper(model, **kw)


def make_optim(name: str, params) -> torch.optim.Optimizer:
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise AssertionError(name)


# --------------------------------------------------------------------------------------------
# comparison helpers: collect every mismatch, raise once with all of them
# --------------------------------------------------------------------------------------------


class Mismatches:
    def __init__(self, ctx: h.Context):
        self.ctx = ctx
        self.items: list[str] = []
        self.worst_ref = 0.0  # max over inexact checks of |a-b| / (atol + rtol*|b|); <= 1 passes

    def add(self, msg: str) -> None:
        self.items.append(msg)

    def check(self, cond: bool, msg: str) -> None:
        if not cond:
            self.add(msg)

    def tensors(self, what: str, a: torch.Tensor | None, b: torch.Tensor | None,
                exact: bool = True, a_name: str = "cfsdp", b_name: str = "torch",
                rtol: float = REF_RTOL, atol: float = REF_ATOL) -> None:
        """Bitwise (``exact``) or ``|a - b| <= atol + rtol * |b|`` elementwise."""
        if a is None or b is None:
            if not (a is None and b is None):
                self.add(f"{what}: {a_name} is {'None' if a is None else 'a tensor'}, "
                         f"{b_name} is {'None' if b is None else 'a tensor'}")
            return
        if a.shape != b.shape:
            self.add(f"{what}: shape {a_name} {tuple(a.shape)} != {b_name} {tuple(b.shape)}")
            return
        if a.dtype != b.dtype:
            self.add(f"{what}: dtype {a_name} {a.dtype} != {b_name} {b.dtype}")
            return
        a, b = a.detach(), b.detach()
        if not exact and a.is_floating_point() and a.numel():
            ratio = ((a - b).abs() / (atol + rtol * b.abs())).max().item()
            self.worst_ref = max(self.worst_ref, ratio)
        ok = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=rtol, atol=atol)
        if not ok:
            if a.is_floating_point() and a.numel():
                diff = (a - b).abs()
                i = int(diff.flatten().argmax())
                detail = (f"max |diff| {diff.max().item():.3e} at flat index {i}: "
                          f"{a_name}={a.flatten()[i].item()!r} {b_name}={b.flatten()[i].item()!r}")
            else:
                detail = f"{a_name}={a.flatten()[:8].tolist()} {b_name}={b.flatten()[:8].tolist()}"
            self.add(f"{what}: {'not bitwise equal' if exact else 'not close'} ({detail})")

    def raise_if_any(self) -> None:
        if self.items:
            shown = self.items[:25]
            more = f"\n  ... and {len(self.items) - 25} more" if len(self.items) > 25 else ""
            raise AssertionError(
                f"{len(self.items)} mismatch(es) on rank {self.ctx.rank}:\n  "
                + "\n  ".join(shown) + more
            )


def clean(name: str) -> str:
    return name.replace(FSDP_PREFIX, "")


def names_shapes(pairs) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(t.shape)) for n, t in pairs]


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------


def train_fsdp(model: nn.Module, opt, batches, loss_fn, rank: int):
    """Returns (per-step local losses, {name: grad} after the last backward, torch flat grads)."""
    losses = []
    grads: dict[str, torch.Tensor | None] = {}
    for step, chunks in enumerate(batches):
        x, y = chunks[rank]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if step == len(batches) - 1:
            grads = {n: (None if p.grad is None else p.grad.detach().clone())
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach().clone())
    return losses, grads


def train_ref(model: nn.Module, opt, batches, loss_fn):
    """Per-rank chunk losses each step; grads (full, by FQN) after the last backward."""
    losses = []
    grads: dict[str, torch.Tensor | None] = {}
    for step, chunks in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        per_rank = [loss_fn(model(x), y) for x, y in chunks]
        total = torch.stack(per_rank).mean()
        total.backward()
        if step == len(batches) - 1:
            grads = {n: (None if p.grad is None else p.grad.detach().clone())
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append([l.detach().clone() for l in per_rank])
    return losses, grads


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in the order torch FSDP1 flattens them: memory order for a tensor
    that is not row-major (its ``_flatten_tensors``), as a parameter's gradient is laid out
    like the parameter."""
    if t.stride(-1) == 1 and t.is_contiguous():
        return t.flatten()
    return t.as_strided((t.numel(),), (1,))


def torch_sharded_grad_vs_ref(mm: Mismatches, torch_model: nn.Module, ref_grads: dict,
                              use_orig_params: bool) -> None:
    """Map every element of torch FSDP1's local gradient shard to the full reference gradient.

    Uses torch's own flat-parameter metadata (``_fqns``, ``_shard_param_infos``): the sharded
    flat grad (use_orig_params=False) or each original parameter's sharded grad view (True).
    """
    for mod_name, mod in torch_model.named_modules():
        if not isinstance(mod, TorchFSDP) or mod._handle is None:
            continue
        fp = mod._handle.flat_param
        prefix = clean(mod_name)
        for i, (fqn, info) in enumerate(zip(fp._fqns, fp._shard_param_infos)):
            full = clean(f"{prefix}.{fqn}" if prefix else fqn)
            if not info.in_shard:
                continue
            ref = memory_order(ref_grads[full])[info.intra_param_start_idx: info.intra_param_end_idx + 1]
            if use_orig_params:
                g = fp._params[i].grad
                g = None if g is None else g.flatten()
            else:
                g = None if fp.grad is None else fp.grad[info.offset_in_shard: info.offset_in_shard + info.numel_in_shard]
            mm.tensors(f"torch-vs-ref grad {full} (local shard)", g, ref, exact=False,
                       a_name="torch", b_name="ref")


# --------------------------------------------------------------------------------------------
# the parity check shared by the subtests
# --------------------------------------------------------------------------------------------


def run_parity(ctx: h.Context, kind: str, use_orig_params: bool, optim: str,
               wrap: Callable[[Callable[..., nn.Module], nn.Module, dict], nn.Module],
               fsdp_kwargs: dict | None = None, cfsdp_kwargs: dict | None = None,
               with_ref: bool = True, steps: int = STEPS) -> None:
    """Train torch FSDP1, cfsdp and (optionally) the single-process ref; compare everything."""
    rank, world = ctx.rank, ctx.world_size
    base = build(kind)
    ref = copy.deepcopy(base)
    kw = dict(process_group=ctx.pg, use_orig_params=use_orig_params, device_id=CPU)
    kw.update(fsdp_kwargs or {})
    ckw = dict(kw)
    ckw.update(cfsdp_kwargs or {})

    tmodel = wrap(TorchFSDP, copy.deepcopy(base), kw)
    cmodel = wrap(CFSDP, copy.deepcopy(base), ckw)
    mm = Mismatches(ctx)

    # -- structure: names and shapes the user sees, before any training --
    t_np = names_shapes(tmodel.named_parameters())
    c_np = names_shapes(cmodel.named_parameters())
    mm.check(c_np == t_np, f"named_parameters() names/shapes differ:\n    cfsdp {c_np}\n    torch {t_np}")
    c_params = list(cmodel.parameters())
    t_params = list(tmodel.parameters())
    mm.check([tuple(p.shape) for p in c_params] == [tuple(p.shape) for p in t_params],
             f"parameters(): count/shapes cfsdp {[tuple(p.shape) for p in c_params]} "
             f"!= torch {[tuple(p.shape) for p in t_params]}")
    for (n, p), (_, q) in zip(cmodel.named_parameters(), tmodel.named_parameters()):
        mm.tensors(f"initial local param {n}", p, q)
    t_sd0 = tmodel.state_dict()
    c_sd0 = cmodel.state_dict()
    t_keys = [(k, tuple(v.shape)) for k, v in t_sd0.items()]
    c_keys = [(k, tuple(v.shape)) for k, v in c_sd0.items()]
    mm.check(c_keys == t_keys, f"state_dict() keys/shapes (in order) differ:\n    cfsdp {c_keys}\n    torch {t_keys}")
    mm.check(list(c_sd0.keys()) == list(ref.state_dict().keys()),
             f"state_dict() keys {list(c_sd0.keys())} != unwrapped model's {list(ref.state_dict().keys())}")
    for k in t_sd0:
        if k in c_sd0:
            mm.tensors(f"initial state_dict[{k}]", c_sd0[k], t_sd0[k])
    del t_sd0, c_sd0
    mm.raise_if_any()  # no point training models that already differ

    # -- training --
    batches = make_batches(kind, world, steps)
    loss_fn = LOSSES[kind]
    t_losses, t_grads = train_fsdp(tmodel, make_optim(optim, tmodel.parameters()), batches, loss_fn, rank)
    c_losses, c_grads = train_fsdp(cmodel, make_optim(optim, cmodel.parameters()), batches, loss_fn, rank)

    for s, (cl, tl) in enumerate(zip(c_losses, t_losses)):
        mm.tensors(f"loss at step {s}", cl, tl)
    mm.check(list(c_grads) == list(t_grads),
             f"grad names after last backward: cfsdp {list(c_grads)} != torch {list(t_grads)}")
    for n in t_grads:
        if n in c_grads:
            mm.tensors(f"grad {n} (local shard) after last backward", c_grads[n], t_grads[n])
    for (n, p), (_, q) in zip(cmodel.named_parameters(), tmodel.named_parameters()):
        mm.tensors(f"local param {n} after {steps} steps", p, q)
    # full parameters, gathered by summon_full_params (names are the original FQNs inside it)
    with TorchFSDP.summon_full_params(tmodel):
        t_full = [(n, p.detach().clone()) for n, p in tmodel.named_parameters()]
    try:
        with CFSDP.summon_full_params(cmodel):
            c_full = [(n, p.detach().clone()) for n, p in cmodel.named_parameters()]
    except Exception as e:  # noqa: BLE001 - report it with the other mismatches
        mm.add(f"summon_full_params raised {type(e).__name__}: {e}")
    else:
        mm.check([n for n, _ in c_full] == [n for n, _ in t_full],
                 f"names under summon_full_params: cfsdp {[n for n, _ in c_full]} != torch {[n for n, _ in t_full]}")
        for (n, p), (_, q) in zip(c_full, t_full):
            mm.tensors(f"full param {n} (summon_full_params) after {steps} steps", p, q)
    t_sd = tmodel.state_dict()
    c_sd = cmodel.state_dict()
    mm.check(list(c_sd) == list(t_sd), f"state_dict() keys after training: cfsdp {list(c_sd)} != torch {list(t_sd)}")
    for k in t_sd:
        if k in c_sd:
            mm.tensors(f"state_dict[{k}] after {steps} steps", c_sd[k], t_sd[k])

    # -- the oracle's oracle: torch FSDP1 against the single-process model --
    if with_ref:
        r_losses, r_grads = train_ref(ref, make_optim(optim, ref.parameters()), batches, loss_fn)
        for s, (tl, rl) in enumerate(zip(t_losses, r_losses)):
            mm.tensors(f"torch-vs-ref loss at step {s}", tl, rl[rank], exact=False, a_name="torch", b_name="ref")
        torch_sharded_grad_vs_ref(mm, tmodel, r_grads, use_orig_params)
        r_sd = ref.state_dict()
        for k, v in r_sd.items():
            if k.rsplit(".", 1)[-1] in BN_STATS:
                continue  # per-rank under FSDP (buffers are not synced), per-chunk sequence in ref
            mm.tensors(f"torch-vs-ref state_dict[{k}] after {steps} steps", t_sd.get(k), v,
                       exact=False, a_name="torch", b_name="ref")
        if ctx.rank == 0:
            ctx.log(f"torch-vs-ref: worst |diff|/(atol+rtol*|ref|) = {mm.worst_ref:.3f} (passes if <= 1)")
    mm.raise_if_any()


def wrap_root(wrapper, model, kw):
    return wrapper(model, **kw)


def expect_same_error(mm: Mismatches, what: str, fns: dict[str, Callable[[], Any]],
                      exc: type[BaseException], *needles: str) -> None:
    """Every callable raises ``exc`` (torch's kind); cfsdp's message contains ``needles``."""
    for name, fn in fns.items():
        try:
            fn()
        except exc as e:
            if name == "cfsdp":
                for nd in needles:
                    mm.check(nd in str(e), f"{what}: cfsdp message lacks {nd!r}: {e}")
        except Exception as e:  # noqa: BLE001
            mm.add(f"{what}: {name} raised {type(e).__name__} ({e}), expected {exc.__name__}")
        else:
            mm.add(f"{what}: {name} raised nothing, expected {exc.__name__}")
