"""Optimizer state dicts of cfsdp.FullyShardedDataParallel against torch's FSDP1.

Run by tests/distributed/test_optim_state_dict.py under torchrun (gloo, CPU) at W=2 and W=4;
every subtest runs inside the one spawn (see _harness.py).

Oracle: torch FSDP1 on the same model, seed and data. Training is bitwise identical between the
two (worker_parity.py), so every optimizer state dict flavour is compared **bitwise**: keys and
their order, state names (and order, except where torch itself iterates a ``set``: the state
names of a flattened-for-loading entry), tensor types (Tensor / ShardedTensor), shapes, dtypes,
values (``step`` too) and param_groups. Loading is checked by its effect: a fresh model that
loads the model state dict and a converted optimizer state dict trains on with losses bitwise
equal to the uninterrupted run, including cross-loads (torch's saved dict into cfsdp, cfsdp's
into torch).

The model ``Net`` has: a nested unit (``body``), a frozen unit (``frozen``, no state), tied
parameters (``dec.weight`` is ``dec2.weight``), an ignored module (``ign``: its state is kept
as the optimizer has it) and sizes that need padding at W=2 and W=4. ``tf`` is the tiny
transformer auto-wrapped by ``ModuleWrapPolicy({Block})``.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
    FullStateDictConfig,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import _harness as h
import parity_common as pc

from cfsdp import FullyShardedDataParallel as CFSDP

CPU = torch.device("cpu")
WRAPPERS = (TorchFSDP, CFSDP)
PG = [None]  # the running subtest's process group (scatter_full_optim_state_dict's group)
TRAIN, MORE = 3, 2  # steps before saving, steps after loading
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(5, 6)
        self.body = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 6))
        self.frozen = nn.Linear(6, 6)
        self.dec = nn.Linear(6, 6)
        self.dec2 = nn.Linear(6, 6)
        self.dec2.weight = self.dec.weight  # tied
        self.ign = nn.Linear(6, 3)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        hid = self.body(torch.tanh(self.emb(x)))
        hid = hid + self.frozen(hid)
        return self.ign(self.dec2(torch.tanh(self.dec(hid))))


HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_GROUPS: dict = {}


def hybrid_groups():
    """(shard group, replicate group) of a 2 replicas x W/2 shards layout, made once per spawn
    (every rank creates every group, as new_group requires)."""
    if "groups" not in _GROUPS:
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        half = world // 2
        shard = [torch.distributed.new_group([r * half + i for i in range(half)]) for r in range(2)]
        rep = [torch.distributed.new_group([i, i + half]) for i in range(half)]
        _GROUPS["groups"] = (shard[rank // half], rep[rank % half])
    return _GROUPS["groups"]


def build(kind: str, wrapper, ctx, uop: bool, strategy: ShardingStrategy):
    torch.manual_seed(0)
    pg = hybrid_groups() if strategy in HYBRID else ctx.pg
    kw = dict(process_group=pg, use_orig_params=uop, device_id=CPU, sharding_strategy=strategy)
    if kind == "net":
        m = Net()
        m.body = wrapper(m.body, **kw)
        m.frozen = wrapper(m.frozen, **kw)
        return wrapper(m, ignored_modules=[m.ign], **kw)
    if kind == "strided":
        return pc.wrap_strided(wrapper, pc.Strided(), kw)
    m = pc.TinyTransformer(n_blocks=2, d=16)
    return wrapper(m, auto_wrap_policy=ModuleWrapPolicy({pc.Block}), **kw)


def batches(kind: str, world: int):
    if kind == "tf":
        return pc.make_batches("transformer", world, steps=TRAIN + MORE), pc.lm_loss
    if kind == "strided":
        return pc.make_batches("strided", world, steps=TRAIN + MORE), pc.mse_loss
    out = []
    for step in range(TRAIN + MORE):
        g = torch.Generator().manual_seed(77 + step)
        out.append([(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(world)])
    return out, F.mse_loss


def make_optim(name: str, model):
    ps = list(model.parameters())
    if name == "adam":
        return torch.optim.Adam(ps, lr=1e-2)
    if name == "adamw":
        # two param groups: param_groups are kept as given
        half = len(ps) // 2
        return torch.optim.AdamW([{"params": ps[:half]}, {"params": ps[half:], "lr": 5e-3}],
                                 lr=1e-2, weight_decay=0.01)
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def train(ctx, model, opt, data, loss_fn, steps) -> list[torch.Tensor]:
    losses = []
    for chunks in steps_of(data, steps):
        x, y = chunks[ctx.rank]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        sync_ignored(ctx, model)
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def sync_ignored(ctx, model) -> None:
    """Average the ignored module's gradients over ranks (FSDP leaves them local), so that
    its state is the same on every rank and rank-0-only loading restores it exactly."""
    for name, p in model.named_parameters():
        if "ign." in name and p.grad is not None:
            torch.distributed.all_reduce(p.grad, group=ctx.pg)
            p.grad.div_(ctx.world_size)


def steps_of(data, which):
    return [data[i] for i in which]


def clone_tree(x):
    """Deep copy of a state dict's plain tensors (torch's NO_SHARD dicts alias live state)."""
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clone_tree(v) for v in x]
    if torch.is_tensor(x):
        return x.detach().clone()
    return x


# --------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------


def compare_value(mm, what, c, t):
    if type(c) is not type(t):
        mm.add(f"{what}: type cfsdp {type(c).__name__} != torch {type(t).__name__}")
        return
    if isinstance(c, ShardedTensor):
        mm.check(c.size() == t.size(), f"{what}: ShardedTensor size {c.size()} != {t.size()}")
        cm, tm = c.metadata(), t.metadata()
        mm.check([(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in cm.shards_metadata]
                 == [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in tm.shards_metadata],
                 f"{what}: ShardedTensor metadata differs: {cm.shards_metadata} vs {tm.shards_metadata}")
        cl, tl = c.local_shards(), t.local_shards()
        mm.check(len(cl) == len(tl), f"{what}: {len(cl)} local shards != {len(tl)}")
        for i, (a, b) in enumerate(zip(cl, tl)):
            mm.check(a.metadata.shard_offsets == b.metadata.shard_offsets, f"{what}: shard offsets")
            mm.tensors(f"{what} local shard {i}", a.tensor, b.tensor)
    elif torch.is_tensor(c):
        mm.tensors(what, c, t)
        mm.check(c.device == t.device, f"{what}: device {c.device} != {t.device}")
    else:
        mm.check(c == t, f"{what}: {c!r} != {t!r}")


def compare_osd(mm, what, c: dict, t: dict, name_order: bool = True, key_order: bool = True):
    mm.check(list(c) == list(t), f"{what}: top-level keys {list(c)} != {list(t)}")
    cs, ts = c.get("state", {}), t.get("state", {})
    if key_order:
        mm.check(list(cs) == list(ts), f"{what}: state keys cfsdp {list(cs)} != torch {list(ts)}")
    else:
        mm.check(set(cs) == set(ts), f"{what}: state keys cfsdp {sorted(cs)} != torch {sorted(ts)}")
    for k in ts:
        if k not in cs:
            continue
        a, b = cs[k], ts[k]
        if name_order:
            mm.check(list(a) == list(b), f"{what}: state names of {k}: {list(a)} != {list(b)}")
        else:
            mm.check(sorted(a) == sorted(b), f"{what}: state names of {k}: {sorted(a)} != {sorted(b)}")
        for n in b:
            if n in a:
                compare_value(mm, f"{what}[{k}][{n}]", a[n], b[n])
    mm.check(c.get("param_groups") == t.get("param_groups"),
             f"{what}: param_groups cfsdp {c.get('param_groups')} != torch {t.get('param_groups')}")


# --------------------------------------------------------------------------------------------
# the flavours: (name, save(wrapper, model, opt), load(wrapper, model, opt, saved))
# --------------------------------------------------------------------------------------------


def with_type(wrapper, model, sd_type, cfg, ocfg, fn):
    with wrapper.state_dict_type(model, sd_type, cfg, ocfg):
        return fn()


def osd_api(sd_type, cfg, ocfg):
    def save(W, m, o):
        return with_type(W, m, sd_type, cfg, ocfg, lambda: W.optim_state_dict(m, o))

    def load(W, m, o, s):
        return with_type(W, m, sd_type, cfg, ocfg, lambda: W.optim_state_dict_to_load(m, o, s))

    return save, load


FULL = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())
FULL_R0 = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
           FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))
SHARDED = (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig())
LOCAL = (StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(), LocalOptimStateDictConfig())

FLAVOURS = {
    "osd_full": osd_api(*FULL),
    "osd_full_rank0": osd_api(*FULL_R0),
    "osd_sharded": osd_api(*SHARDED),
    "osd_local": osd_api(*LOCAL),
    "full_osd_all_ranks": (
        lambda W, m, o: W.full_optim_state_dict(m, o, rank0_only=False),
        lambda W, m, o, s: W.shard_full_optim_state_dict(s, m, optim=o),
    ),
    "full_osd_rank0_scatter": (
        lambda W, m, o: W.full_optim_state_dict(m, o),
        lambda W, m, o, s: W.scatter_full_optim_state_dict(s if s else None, m, optim=o, group=PG[0]),
    ),
    "sharded_osd": (
        lambda W, m, o: W.sharded_optim_state_dict(m, o),
        lambda W, m, o, s: W.flatten_sharded_optim_state_dict(s, m, o),
    ),
}


FULL_OFFLOADED = ("osd_full", "osd_full_rank0", "full_osd_all_ranks", "full_osd_rank0_scatter")


def torch_offload_bug(mm, name: str, t: dict, clean: dict) -> dict:
    """torch 2.13 bug (use_orig_params=True, sharded strategies, full dict with offload_to_cpu
    on a CPU device): ``_allgather_orig_param_states`` all-gathers every state of a unit into
    one reused buffer and "offloads" the views with ``.cpu()``, which on CPU is no copy, so
    every tensor state comes out with the values of the last one gathered (Adam's
    ``exp_avg`` reads ``exp_avg_sq``). The oracle for these values is torch's own dict without
    offload (cloned views); the bug's signature is asserted so a torch fix is noticed."""
    if not t:
        return t
    for k, st in t["state"].items():
        tensors = sorted(n for n, v in st.items() if torch.is_tensor(v) and v.dim() > 0)
        if k.startswith("ign.") or len(tensors) < 2:
            continue
        last = st[tensors[-1]]
        mm.check(all(torch.equal(st[n], last) for n in tensors),
                 f"{name}: torch's offload bug signature is gone for {k}: update the oracle")
        for n in tensors:
            st[n] = clean["state"][k][n].clone()
    return t


def same_states(a: dict, b: dict) -> bool:
    """Two optimizer state dicts (id-keyed) hold equal tensors under the same keys and names."""
    sa, sb = a.get("state", {}), b.get("state", {})
    if set(sa) != set(sb):
        return False
    for k in sb:
        if set(sa[k]) != set(sb[k]):
            return False
        for n, v in sb[k].items():
            if torch.is_tensor(v) and not torch.equal(sa[k][n], v):
                return False
    return True


def compare_loadable(mm, what, c: dict, t: dict):
    """Dicts for optim.load_state_dict: keyed by each rank's param ids; torch iterates a set
    for the state names of flattened entries, so their order is not compared."""
    compare_osd(mm, what, c, t, name_order=False, key_order=False)


@h.subtest(grid={
    "uop": [False, True],
    "strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD],
    "optim": ["adam", "adamw", "sgd"],
})
def parity_and_resume(ctx, uop, strategy, optim):
    run(ctx, "net", uop, strategy, optim)


@h.subtest(grid={"uop": [False, True]})
def shard_grad_op(ctx, uop):
    run(ctx, "net", uop, ShardingStrategy.SHARD_GRAD_OP, "adamw")


if torch.distributed.is_torchelastic_launched() and int(__import__("os").environ["WORLD_SIZE"]) == 4:
    @h.subtest(grid={"uop": [False, True], "strategy": list(HYBRID)})
    def hybrid(ctx, uop, strategy):
        """2 replicas x 2 shards (process_group=(shard, replicate)): every flavour, as torch."""
        run(ctx, "net", uop, strategy, "adamw")


@h.subtest(grid={"uop": [False, True]})
def autowrap_transformer(ctx, uop):
    run(ctx, "tf", uop, ShardingStrategy.FULL_SHARD, "adam")


@h.subtest(grid={"uop_strategy": [(False, ShardingStrategy.FULL_SHARD), (False, ShardingStrategy.NO_SHARD),
                                  (True, ShardingStrategy.FULL_SHARD)]})
def strided_params(ctx, uop_strategy):
    """Parameters that are not row-major (worker_parity's ``Strided``: cfsdp's [Note: strided
    parameters]): their states go between the optimizer's flat shards and each parameter's shape
    in the parameter's memory order, as torch's.  torch 2.13 cannot save them in sharded
    dicts (a ShardedTensor takes only row-major local shards: "Only torch.contiguous_format
    memory_format is currently supported", on the ranks whose chunk is not row-major); cfsdp's
    are checked by resuming from them.  Nor load them: it flattens a loaded state row-major
    (``torch.flatten`` in ``_flatten_tensor_optim_state``, ``value.flatten()`` in
    ``_shard_orig_param_state``) into a flat parameter it laid out in memory order, so a
    transposed weight's states come back scrambled; cfsdp's dicts to load are compared with
    its optimizer's own state, and torch's scrambling is asserted.  Not NO_SHARD with use_orig_params=True, where torch trains
    them wrong (worker_parity's ``strided_params``)."""
    uop, strategy = uop_strategy
    run(ctx, "strided", uop, strategy, "adam", torch_refuses=("osd_sharded", "osd_local", "sharded_osd"),
        torch_loads_wrong=True)


def run(ctx, kind, uop, strategy, optim, torch_refuses: tuple = (), torch_loads_wrong: bool = False):
    """Every flavour saved and loaded by both, compared bitwise, and resumed from.  A flavour in
    ``torch_refuses`` (torch's save raises on some ranks): cfsdp's is checked by resuming.
    ``torch_loads_wrong``: cfsdp's dicts to load are compared with its optimizer's own state
    instead of torch's (and torch's differing from torch's own state is asserted); torch does
    not resume from cfsdp's dicts."""
    """Every flavour saved and loaded by both, compared bitwise, and resumed from.  A flavour in
    ``torch_refuses`` (torch's save raises on some ranks): cfsdp's is checked by resuming."""
    mm = pc.Mismatches(ctx)
    PG[0] = ctx.pg
    data, loss_fn = batches(kind, ctx.world_size)
    models = {W: build(kind, W, ctx, uop, strategy) for W in WRAPPERS}
    opts = {W: make_optim(optim, m) for W, m in models.items()}
    for W in WRAPPERS:
        train(ctx, models[W], opts[W], data, loss_fn, range(TRAIN))
    model_sd = clone_tree(models[CFSDP].state_dict())
    ref_osd = clone_tree(opts[CFSDP].state_dict())

    # torch's full dict without offload (not affected by the bug torch_offload_bug handles)
    no_offload = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig(offload_to_cpu=False))
    torch_clean = clone_tree(osd_api(*no_offload)[0](TorchFSDP, models[TorchFSDP], opts[TorchFSDP]))
    saved = {}
    t_own_osd = clone_tree(opts[TorchFSDP].state_dict())
    torch_misloads = []
    for name, (save, load) in FLAVOURS.items():
        if name in torch_refuses:  # (not run: ranks whose chunks are row-major go on into
            # collectives the others, which raised, never join)
            out = {CFSDP: save(CFSDP, models[CFSDP], opts[CFSDP])}
        else:
            out = {W: save(W, models[W], opts[W]) for W in WRAPPERS}
            out[TorchFSDP] = clone_tree(out[TorchFSDP])
            if uop and strategy != ShardingStrategy.NO_SHARD and name in FULL_OFFLOADED:
                out[TorchFSDP] = torch_offload_bug(mm, name, out[TorchFSDP], torch_clean)
            compare_osd(mm, f"{name} save", out[CFSDP], out[TorchFSDP])
        loadable = {W: load(W, models[W], opts[W], out[W]) for W in out}
        if torch_loads_wrong:
            compare_loadable(mm, f"{name} to-load (vs the optimizer's own)", loadable[CFSDP], ref_osd)
            if TorchFSDP in out:
                torch_misloads.append(not same_states(loadable[TorchFSDP], t_own_osd))
        else:
            compare_loadable(mm, f"{name} to-load", loadable[CFSDP], loadable[TorchFSDP])
        saved[name] = out
    if torch_loads_wrong:
        mm.check(any(torch_misloads), f"torch now loads back its own dicts right ({torch_misloads}): "
                                      "make it the oracle of loading here")

    # rekey the full dict (by name -> by id -> by name); torch's result is the oracle
    if uop:
        full = saved["full_osd_all_ranks"]
        rekeyed = {}
        for W in WRAPPERS:
            by_id = W.rekey_optim_state_dict(full[W], OptimStateKeyType.PARAM_ID, models[W], optim=opts[W])
            back = W.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, models[W], optim=opts[W])
            rekeyed[W] = (by_id, back)
        compare_osd(mm, "rekey PARAM_ID", rekeyed[CFSDP][0], rekeyed[TorchFSDP][0])
        compare_osd(mm, "rekey PARAM_ID->PARAM_NAME", rekeyed[CFSDP][1], rekeyed[TorchFSDP][1])

    # the uninterrupted run
    expected = train(ctx, models[CFSDP], opts[CFSDP], data, loss_fn, range(TRAIN, TRAIN + MORE))
    t_expected = train(ctx, models[TorchFSDP], opts[TorchFSDP], data, loss_fn, range(TRAIN, TRAIN + MORE))
    for a, b in zip(expected, t_expected):
        mm.tensors("uninterrupted losses cfsdp vs torch", a, b)

    def resume(W, name, from_saved):
        m = build(kind, W, ctx, uop, strategy)
        o = make_optim(optim, m)
        m.load_state_dict(model_sd)
        # a copy: loading keeps an ignored parameter's state tensors (torch: the very ones
        # of the dict), and training on would change the dict under the next resume
        o.load_state_dict(FLAVOURS[name][1](W, m, o, clone_tree(from_saved)))
        if W is CFSDP:
            compare_loadable(mm, f"optimizer state after loading {name}", clone_tree(o.state_dict()), ref_osd)
        got = train(ctx, m, o, data, loss_fn, range(TRAIN, TRAIN + MORE))
        for i, (a, b) in enumerate(zip(got, expected)):
            mm.tensors(f"resume {name} {W.__name__} step {TRAIN + i} loss", a, b,
                       a_name="resumed", b_name="uninterrupted")

    for name in FLAVOURS:
        resume(CFSDP, name, saved[name][CFSDP])
    # cross-loads: torch's dict into cfsdp, cfsdp's into torch
    for name in ("osd_full", "osd_sharded", "full_osd_all_ranks"):
        if name in torch_refuses:
            continue
        resume(CFSDP, name, saved[name][TorchFSDP])
        if not torch_loads_wrong:
            resume(TorchFSDP, name, saved[name][CFSDP])
    # load_directly=True loads into the optimizer
    m = build(kind, CFSDP, ctx, uop, strategy)
    o = make_optim(optim, m)
    m.load_state_dict(model_sd)
    CFSDP.optim_state_dict_to_load(m, o, clone_tree(saved["osd_full"][CFSDP]), load_directly=True)
    got = train(ctx, m, o, data, loss_fn, range(TRAIN, TRAIN + MORE))
    for a, b in zip(got, expected):
        mm.tensors("resume load_directly loss", a, b)
    mm.raise_if_any()


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def expect(mm, what, fn, exc, *needles):
    try:
        fn()
    except exc as e:
        for n in needles:
            mm.check(n in str(e), f"{what}: message lacks {n!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        mm.add(f"{what}: raised {type(e).__name__} ({e}), expected {exc.__name__}")
        return
    mm.add(f"{what}: no error, expected {exc.__name__}")


@h.subtest(grid={"uop": [False, True]})
def bad_input(ctx, uop):
    mm = pc.Mismatches(ctx)
    data, loss_fn = batches("net", ctx.world_size)
    m = build("net", CFSDP, ctx, uop, ShardingStrategy.FULL_SHARD)
    o = make_optim("adam", m)
    train(ctx, m, o, data, loss_fn, range(1))
    full = CFSDP.full_optim_state_dict(m, o, rank0_only=False)

    bad = copy.deepcopy(full)
    bad["state"]["nope.weight"] = bad["state"]["emb.weight"]
    expect(mm, "unknown FQN", lambda: CFSDP.optim_state_dict_to_load(m, o, bad), ValueError, "'nope.weight'")

    # rank 0's dict without "state": every rank raises at once (torch leaves the others waiting
    # in the broadcast until the process group's timeout)
    import time

    t0 = time.monotonic()
    expect(mm, "scatter without state",
           lambda: CFSDP.scatter_full_optim_state_dict({"param_groups": []} if ctx.rank == 0 else None,
                                                       m, optim=o, group=ctx.pg),
           ValueError, '"state"')
    mm.check(time.monotonic() - t0 < 20, "the ranks did not all fail at once")

    bad = copy.deepcopy(full)
    bad["param_groups"][0]["params"].remove("emb.bias")
    expect(mm, "missing FQN", lambda: CFSDP.optim_state_dict_to_load(m, o, bad), ValueError, "'emb.bias'")

    bad = copy.deepcopy(full)
    bad["state"]["body.0.weight"]["exp_avg"] = torch.zeros(3, 3)
    expect(mm, "wrong shape", lambda: CFSDP.optim_state_dict_to_load(m, o, bad), ValueError,
           "'body.0.weight'", "(3, 3)", "(7, 6)")

    stray = nn.Parameter(torch.zeros(2))
    o2 = torch.optim.Adam(list(m.parameters()) + [stray])
    expect(mm, "foreign param", lambda: CFSDP.optim_state_dict(m, o2), ValueError, "not a parameter of the model")

    expect(mm, "named optimizer", lambda: CFSDP.optim_state_dict_to_load(m, o, full, is_named_optimizer=True),
           NotImplementedError, "is_named_optimizer")
    other = torch.distributed.new_group(backend="gloo")
    expect(mm, "other group", lambda: CFSDP.optim_state_dict(m, o, group=other), NotImplementedError, "group")

    # inside forward: rejected before any collective, on every rank
    seen = []

    def hook(mod, args):
        expect(mm, "inside forward", lambda: CFSDP.optim_state_dict(m, o), RuntimeError, "forward")
        seen.append(1)

    handle = m.body.module.register_forward_pre_hook(hook)
    x, y = data[0][ctx.rank]
    loss_fn(m(x), y).backward()
    handle.remove()
    mm.check(seen == [1], "the forward hook did not run")
    mm.raise_if_any()


if __name__ == "__main__":
    h.main()
