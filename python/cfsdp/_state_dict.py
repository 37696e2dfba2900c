"""Model state dicts of the wrapper face: torch FSDP1's three types, its configs, and the
hooks that make every wrapper's ``state_dict`` / ``load_state_dict`` give and take them.

FQNs follow ``cfsdp._fqn`` (clean names, as torch).  A state-dict call keeps its own state
per wrapper in one object this module owns (``SDState``, ``w._sd``), and moves a wrapper's
unit into and out of the SUMMON state through the unit state's own methods.  It reads a unit
only through ``_runtime.unit_view.UnitView`` ([Note: unit view]).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from . import _core
from ._fqn import FLAT_PARAM, FSDP_PREFIX, clean_tensor_name, join_fqn
from ._torch.checkpoint import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    init_from_local_shards_and_global_metadata,
)
from ._runtime.base import TrainingState
from ._runtime.hooks import check_can_summon
from ._runtime.unit_view import UnitView, unit_of
from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardingStrategy,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

# ---------------------------------------------------------------------------
# state-dict types and their configs (torch FSDP1's rules)
# ---------------------------------------------------------------------------

_CONFIG_OF = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def default_settings() -> tuple[StateDictType, StateDictConfig, OptimStateDictConfig]:
    """A new wrapper's settings: FULL_STATE_DICT with default configs (as torch)."""
    return StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()


def set_state_dict_type(
    wrappers: list,
    state_dict_type: StateDictType,
    state_dict_config: Optional[StateDictConfig],
    optim_state_dict_config: Optional[OptimStateDictConfig],
) -> StateDictSettings:
    """Set every wrapper's type and configs; return the previous settings.

    As torch: a config of the wrong class for the type is a ``RuntimeError``
    (``None`` takes the type's default config), and the wrappers must agree on
    the previous type and config classes (``AssertionError``)."""
    if state_dict_type not in _CONFIG_OF:
        raise ValueError(
            f"state_dict_type must be a StateDictType (FULL_STATE_DICT, SHARDED_STATE_DICT or "
            f"LOCAL_STATE_DICT), got {state_dict_type!r}"
        )
    cfg_cls, optim_cfg_cls = _CONFIG_OF[state_dict_type]
    if state_dict_config is None:
        state_dict_config = cfg_cls()
    if optim_state_dict_config is None:
        optim_state_dict_config = optim_cfg_cls()
    if type(state_dict_config) is not cfg_cls:
        raise RuntimeError(
            f"Expected state_dict_config of type {cfg_cls} but got {type(state_dict_config)} "
            f"(state_dict_type={state_dict_type})"
        )
    if type(optim_state_dict_config) is not optim_cfg_cls:
        raise RuntimeError(
            f"Expected optim_state_dict_config of type {optim_cfg_cls} but got "
            f"{type(optim_state_dict_config)} (state_dict_type={state_dict_type})"
        )
    prev_type = prev_cfg = prev_optim_cfg = None
    for w in wrappers:
        if prev_type is None:
            prev_type, prev_cfg, prev_optim_cfg = (
                w._state_dict_type, w._state_dict_config, w._optim_state_dict_config
            )
        else:
            if w._state_dict_type != prev_type:
                raise AssertionError("All FSDP modules should have the same state_dict_type.")
            if not isinstance(w._state_dict_config, type(prev_cfg)):
                raise AssertionError("All FSDP modules must have the same type of state_dict_config.")
            if not isinstance(w._optim_state_dict_config, type(prev_optim_cfg)):
                raise AssertionError(
                    "All FSDP modules must have the same type of optim_state_dict_config."
                )
        w._state_dict_type = state_dict_type
        w._state_dict_config = state_dict_config
        w._optim_state_dict_config = optim_state_dict_config
    return StateDictSettings(prev_type, prev_cfg, prev_optim_cfg)


def check_mesh_settings(w, hook: bool = False) -> None:
    """A wrapper built with a ``device_mesh`` gives DTensors in sharded state dicts
    (torch turns ``_use_dtensor`` on) and has no LOCAL state dict.  In a state-dict hook
    (``hook``) a NO_SHARD wrapper is exempt: it gives a FULL state dict whatever the type,
    as torch's hooks do."""
    if getattr(w, "_device_mesh", None) is None:
        return
    if hook and w.sharding_strategy == ShardingStrategy.NO_SHARD:
        return
    if w._state_dict_type == StateDictType.LOCAL_STATE_DICT:
        raise RuntimeError(
            "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with "
            "LOCAL_STATE_DICT. Please set state_dict_type to SHARDED_STATE_DICT to get "
            "DTensor state_dict."
        )
    if w._state_dict_type == StateDictType.SHARDED_STATE_DICT:
        w._state_dict_config._use_dtensor = True
        w._optim_state_dict_config._use_dtensor = True


def get_state_dict_type(wrappers: list) -> Optional[StateDictSettings]:
    """The settings every wrapper shares (None without wrappers)."""
    settings: Optional[StateDictSettings] = None
    for w in wrappers:
        check_mesh_settings(w)
        mine = StateDictSettings(w._state_dict_type, w._state_dict_config, w._optim_state_dict_config)
        if settings is None:
            settings = mine
        elif mine != settings:
            raise AssertionError(
                f"All FSDP modules must have the same state dict settings.Got {mine} and {settings}. "
                "(cfsdp: call set_state_dict_type / state_dict_type on the root, which sets every "
                "wrapper below it.)"
            )
    return settings


# ---------------------------------------------------------------------------
# model state dicts: hooks on every wrapper
# ---------------------------------------------------------------------------
#
# nn.Module.state_dict / load_state_dict recurse through the module tree and
# call each wrapper's hooks around its own subtree, so every wrapper handles
# its own unit and its own prefix, whatever holds it (another wrapper, a plain
# module, DDP).  Saving, per wrapper:
#
#   pre hook   FULL/SHARDED: all-gather the unit in full precision into a new
#              buffer (FULL: the state dict keeps it) or a pooled scratch buffer
#              (SHARDED), and expose full parameters as views of it, so the
#              subtree's state dict sees them; the unit's own buffers are untouched;
#   post hook  rename the subtree's keys (drop this wrapper's prefix), turn the
#              unit's entries into the requested type (views of the kept buffer,
#              dim-0 chunks as ShardedTensor/DTensor copied into one buffer per
#              unit, or the flat local shard), then restore the sharded views.
#
# A unit is thus gathered only while its own subtree is saved: the peak is the
# state dict itself plus the units on the path from the root being gathered
# (usually the root's and one block's), never a second copy of the model.
#
# Loading mirrors it: the outermost wrapper first checks the whole subtree's
# keys, shapes and dtypes against what its state dict would hold (nothing is
# written when something is wrong); each pre hook restores its prefix and, for
# SHARDED, gathers the chunks into full tensors; the post hook writes this
# rank's shard back and reshards.

# Computing what a state dict would hold, without communication (load checks).
_DRY: contextvars.ContextVar[bool] = contextvars.ContextVar("cfsdp_sd_dry", default=False)
# SHARDED_STATE_DICT: {(dtype, device): [free gather buffers]}, the pool shared by
# the units below the outermost wrapper of the call (set by its pre hook, reset by
# its post hook).
_SCRATCH: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("cfsdp_sd_scratch", default=None)
# The user's strict flag of the load in progress (nn.Module passes strict=True to
# every module's hook, whatever the user asked); None: not known (a plain module
# is loading a subtree that holds wrappers).
_LOAD_STRICT: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar(
    "cfsdp_sd_strict", default=None
)


@dataclass
class SDState:
    """What a state-dict call keeps per wrapper (``w._sd``), owned by this module."""

    active: bool = False  # inside a state-dict hook pair of this wrapper
    validated: bool = False  # the outermost load already checked the whole state dict
    shown: bool = False  # full parameters are exposed (params_as_full)
    copy: Optional[torch.Tensor] = None  # the gathered copy they view (FULL/SHARDED saving)
    kept: bool = False  # the unit was unsharded before saving: it stays so ([Note: kept unsharded units])
    scratch_token: Any = None  # this wrapper opened the SHARDED scratch pool
    scratch_buf: Optional[torch.Tensor] = None  # the pool buffer this wrapper holds
    skip_missing: set = field(default_factory=set)  # LOCAL + use_orig_params: not missing


def install_hooks(w: nn.Module) -> None:
    """Give one wrapper its state-dict state and register its state-dict hooks."""
    w._sd = SDState()
    w.register_state_dict_pre_hook(_pre_state_dict_hook)
    w._register_state_dict_hook(_post_state_dict_hook)
    w._register_load_state_dict_pre_hook(_pre_load_hook, with_module=True)
    w.register_load_state_dict_post_hook(_post_load_hook)


def _unit(w) -> Optional[UnitView]:
    """``w``'s unit as the state-dict code reads it ([Note: unit view]); None without one."""
    return unit_of(w._state)


def _rank(w) -> int:
    u = _unit(w)
    return u.rank if u is not None else w.rank


def _type_of(w) -> StateDictType:
    """The type ``w``'s unit is saved/loaded as: a NO_SHARD unit has no shards, so
    torch gives its full parameters (plain tensors) for every type, and so do we."""
    u = _unit(w)
    if u is not None and not u.sharded:
        return StateDictType.FULL_STATE_DICT
    return w._state_dict_type


def _expose_full(w) -> None:
    """Loading: all-gather ``w``'s unit in full precision into its own buffer and
    expose full parameters, which the load writes into (written back on exit)."""
    w._state.enter_summon()
    w._sd.shown = False
    u = _unit(w)
    if u is None:
        return
    u.drop_grad_if_orig_grads_cleared()
    if u.is_unsharded and not u.holds_full_precision:
        u.reshard()
    u.unshard(full_precision=True)
    u.params_as_full()
    w._sd.shown = True


def _claim_scratch(w, u) -> Optional[torch.Tensor]:
    """SHARDED_STATE_DICT: a gather buffer from the pool shared by the units below
    the outermost wrapper (None outside one).  A unit holds its buffer until its
    chunks are copied out; a unit nested inside it finds that one taken and gets
    another, so the pool holds one buffer per nesting level, each reused by every
    unit at that level."""
    pool = _SCRATCH.get()
    if pool is None:
        return None
    need = u.layout.padded_numel if u.sharded else u.layout.flat_numel
    free = pool.setdefault((u.dtype, u.device), [])
    fits = [b for b in free if b.numel() >= need]
    if fits:
        buf = taken = min(fits, key=torch.Tensor.numel)
    else:  # a larger one, which replaces the smallest free one (if any)
        buf = torch.empty(need, dtype=u.dtype, device=u.device)
        taken = min(free, key=torch.Tensor.numel) if free else None
    free[:] = [b for b in free if b is not taken]  # (tensors: compare by identity)
    w._sd.scratch_buf = buf
    return buf


def _release_scratch(w) -> None:
    buf, w._sd.scratch_buf = w._sd.scratch_buf, None
    pool = _SCRATCH.get()
    if buf is not None and pool is not None:
        pool.setdefault((buf.dtype, buf.device), []).append(buf)


def _expose_full_copy(w) -> None:
    """Expose full parameters that are views of a gathered copy: for FULL a new
    one, which the state dict keeps (on rank 0 only with ``rank0_only``: the other
    ranks take part in the all-gather and drop it); for SHARDED, below the
    outermost wrapper, a scratch buffer shared by the units (their chunks are
    copied out before the next unit is gathered)."""
    w._state.enter_summon()
    w._sd.shown, w._sd.copy = False, None
    u = _unit(w)
    if u is None:
        return
    cfg = w._state_dict_config
    sharded = _type_of(w) == StateDictType.SHARDED_STATE_DICT
    w._sd.kept = u.is_unsharded
    copy = u.gather_full_copy(_claim_scratch(w, u) if sharded else None)
    if getattr(cfg, "rank0_only", False) and u.rank != 0:
        return
    if getattr(cfg, "offload_to_cpu", False) and copy.device.type != "cpu":
        copy = copy.cpu()  # device-generic path (no GPU here)
    u.params_as_full(copy)
    w._sd.shown, w._sd.copy = True, copy


def _hide_full(w, writeback: bool) -> None:
    """Undo :func:`_expose_full` / :func:`_expose_full_copy` (writing this rank's
    shard back if asked)."""
    u = _unit(w)
    try:
        if u is not None and w._sd.shown:
            u.params_as_sharded(writeback)
        if u is not None and not w._sd.kept:  # a kept unit keeps its buffer, as torch's
            u.reshard()
    finally:
        w._sd.shown, w._sd.copy, w._sd.kept = False, None, False
        w._state.leave_summon()


@contextlib.contextmanager
def saving(wrappers: list):
    """Around a wrapper's ``state_dict()``: nothing runs during a step, and a failure
    part-way leaves every unit sharded and idle (``abort``)."""
    check_can_summon([x._state for x in wrappers])
    try:
        yield
    except BaseException:
        abort(wrappers)
        raise


@contextlib.contextmanager
def loading(w, wrappers: list, state_dict, strict: bool):
    """Around a wrapper's ``load_state_dict()``: the outermost wrapper checks the whole
    state dict first (``validate``; nothing is written if it fails), the user's
    ``strict`` reaches every wrapper's hooks, and a failure part-way leaves every unit
    sharded and idle."""
    check_can_summon([x._state for x in wrappers])
    token = _LOAD_STRICT.set(bool(strict))
    try:
        if not w._cfsdp_has_outer:
            validate(w, state_dict, "", bool(strict))
            w._sd.validated = True
        yield
    except BaseException:
        abort(wrappers)
        raise
    finally:
        w._sd.validated = False
        _LOAD_STRICT.reset(token)


def abort(wrappers: list) -> None:
    """After an exception mid-way through a state-dict call: reshard every unit
    left unsharded (discarding any partial write) and return to IDLE."""
    for w in reversed(wrappers):  # innermost first: scratch tokens are reset in order
        _end_scratch(w)
    for w in wrappers:
        if w._state.training_state is TrainingState.SUMMON and w._sd.active:
            _hide_full(w, writeback=False)
        w._sd.active = False


def _pre_state_dict_hook(w, prefix: str, keep_vars: bool) -> None:
    if _DRY.get():
        return
    check_can_summon([w._state])
    check_mesh_settings(w, hook=True)
    w._sd.active = True
    t = _type_of(w)
    if t == StateDictType.LOCAL_STATE_DICT:
        return
    _expose_full_copy(w)
    if _SCRATCH.get() is None and w._state_dict_type == StateDictType.SHARDED_STATE_DICT:
        w._sd.scratch_token = _SCRATCH.set({})  # for the units below this one


def _subtree(state_dict, prefix: str) -> list[str]:
    return [k for k in state_dict if k.startswith(prefix)]


def _clean_under(prefix: str, key: str) -> str:
    return prefix + clean_tensor_name(key[len(prefix):])


def _plain_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and not isinstance(v, (ShardedTensor, DTensor)) and v.device.type != "meta"


def _storage_ptr(t: torch.Tensor) -> int:
    return _core.storage_address(t)


def _unit_entry(v, full_ptr: Optional[int]) -> Optional[tuple]:
    """A state-dict entry that is one of the unit's full parameters (a view of the gathered
    buffer at ``full_ptr``): ``(its local full value, its TP spec or None)``; a TP
    parameter's is a DTensor over the view ([Note: tensor-parallel wrapper units])."""
    if full_ptr is None:
        return None
    if isinstance(v, DTensor):
        local = v._local_tensor
        return (local.detach(), v._spec) if _storage_ptr(local) == full_ptr else None
    return (v.detach(), None) if _plain_tensor(v) and _storage_ptr(v) == full_ptr else None


def _tp_shards_dim0(spec) -> bool:
    """Does tensor parallelism shard the parameter of ``spec`` (None: a plain one) on dim 0?"""
    return spec is not None and any(pl.is_shard(0) for pl in spec.placements)


def _buffer_dtype_out(w, t: StateDictType, name: str) -> Optional[torch.dtype]:
    """The dtype a buffer ``name`` (clean, under ``w``) leaves in, or None for its own: as
    torch, its dtype at wrapping when ``w`` casts buffers for compute (``buffer_dtype``) and
    the state dict unshards (FULL, SHARDED; not LOCAL).  Without buffer mixed precision a
    buffer leaves as it is, e.g. in float64 after ``model.to(torch.float64)``."""
    if w.mixed_precision.buffer_dtype is None or t == StateDictType.LOCAL_STATE_DICT:
        return None
    return w._buffer_orig_dtypes.get(name)


def _post_state_dict_hook(w, state_dict, prefix: str, local_metadata) -> None:
    if _DRY.get():
        _dry_entries(w, state_dict, prefix)
        return
    try:
        t = _type_of(w)
        cfg = w._state_dict_config
        u = _unit(w)
        keys = _subtree(state_dict, prefix)
        items = [(k, state_dict.pop(k)) for k in keys]
        if t == StateDictType.FULL_STATE_DICT and getattr(cfg, "rank0_only", False) and _rank(w) != 0:
            items = []  # as torch: the other ranks get nothing of this subtree
        full_ptr = None
        if u is not None and w._sd.shown:
            full_ptr = _storage_ptr(w._sd.copy) if w._sd.copy is not None else u.full_storage_ptr()
        shard_ptr = _storage_ptr(u.shard) if u is not None else None
        flat_key = prefix + FLAT_PARAM
        flat_done = False
        # the unit's own entries: index -> (local full value, TP spec or None)
        own = {i: e for i, (_, v) in enumerate(items) if (e := _unit_entry(v, full_ptr)) is not None}
        chunks = {}
        if t == StateDictType.SHARDED_STATE_DICT and own:
            mine = [i for i, (v, spec) in own.items() if not _tp_shards_dim0(spec)]
            locals_ = _local_chunks(u, [own[i][0] for i in mine], cfg.offload_to_cpu)
            chunks = dict(zip(mine, locals_))
        for i, (k, v) in enumerate(items):
            ck = _clean_under(prefix, k)
            if i in own:
                if t == StateDictType.SHARDED_STATE_DICT:
                    local, spec = own[i]
                    state_dict[ck] = _chunked_value(w, u, local, chunks.get(i), cfg, spec)
                else:  # a view of the gathered copy (already on the CPU if asked)
                    state_dict[ck] = v.detach()
                continue
            if not _plain_tensor(v):  # extra state, or an inner wrapper's converted entry
                state_dict[ck] = v
                continue
            ptr = _storage_ptr(v)
            if t == StateDictType.LOCAL_STATE_DICT and u is not None and ptr == shard_ptr:
                # the flat parameter (use_orig_params=False), or one of the original
                # parameters' shard views (True): one flat local shard for the unit
                if not flat_done and not u.use_orig_params:
                    state_dict[flat_key] = _local_flat_value(w, u)
                flat_done = True
                continue
            orig = _buffer_dtype_out(w, t, ck[len(prefix):])
            if orig is not None and v.dtype != orig and v.is_floating_point():
                v = v.detach().to(orig)  # buffers leave in their own dtype (mixed precision)
            state_dict[ck] = v
        if flat_done and u.use_orig_params:  # as torch: after the subtree's other entries
            state_dict[flat_key] = _local_flat_value(w, u)
        _clean_metadata(state_dict, prefix)
    finally:
        if _type_of(w) != StateDictType.LOCAL_STATE_DICT:
            _hide_full(w, writeback=False)
        w._sd.active = False
        _end_scratch(w)


def _end_scratch(w) -> None:
    _release_scratch(w)
    token = w._sd.scratch_token
    if token is not None:
        w._sd.scratch_token = None
        _SCRATCH.reset(token)


def _clean_metadata(state_dict, prefix: str) -> None:
    """The version metadata of the subtree's modules, under clean module names."""
    meta = getattr(state_dict, "_metadata", None)
    if meta is None:
        return
    for k in [k for k in meta if k.startswith(prefix) and k != prefix[:-1]]:
        rest = clean_tensor_name(k[len(prefix):] + ".")[:-1]
        v = meta.pop(k)
        meta.setdefault(prefix + rest if rest else prefix[:-1], v)


# ------------------------------------------------------------------ values
def _placement(group, r: int, device: torch.device) -> str:
    g = dist.get_global_rank(group, r)
    if device.type == "cpu":
        return f"rank:{g}/cpu"
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    return f"rank:{g}/{device.type}:{g % max(count, 1)}"


def _sharded_tensor(local: Optional[torch.Tensor], shards, full_shape, dtype, group, rank, device,
                    requires_grad: bool = False):
    """A ShardedTensor of shape ``full_shape`` made of ``shards`` (``(rank, offsets,
    sizes)`` for each rank of ``group`` that holds one, in rank order), with ``local``
    as this rank's (if it holds one).  No communication."""
    metas = {r: ShardMetadata(list(off), list(size), _placement(group, r, device)) for r, off, size in shards}
    local_shards = [Shard(local, metas[rank])] if (local is not None and rank in metas) else []
    props = TensorProperties(
        dtype=dtype, layout=torch.strided, requires_grad=requires_grad,
        memory_format=torch.contiguous_format, pin_memory=False,
    )
    md = ShardedTensorMetadata(
        shards_metadata=list(metas.values()), size=torch.Size(full_shape), tensor_properties=props
    )
    return init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=md, process_group=group
    )


def _dim0_chunks(d0: int, world: int) -> list[tuple[int, int]]:
    """``(start, rows)`` of each of ``torch.chunk``'s dim-0 chunks (there may be fewer than ``world``)."""
    rows = -(-d0 // world) if d0 else 0
    if rows == 0:
        return [(0, 0)]
    return [(s, min(rows, d0 - s)) for s in range(0, d0, rows)]


_OWN_CHUNK = object()  # root_mesh_value: take this rank's dp chunk of ``full`` itself


def root_mesh_value(root: DeviceMesh, full: torch.Tensor, spec, local: Any = _OWN_CHUNK,
                    offload_to_cpu: bool = False) -> DTensor:
    """A sharded state-dict value of a wrapper whose ``device_mesh`` is the dp slice of the 2-D
    (dp, tp) mesh ``root`` (torch FSDP1's DTensor extension is then on): a DTensor on ``root``
    placed ``(Shard(0), <TP placement>)`` for a tensor-parallel parameter of spec ``spec``
    (``full``: its local full value), ``(Shard(0), Replicate())`` for a plain one (``full``:
    its full value), holding what DTensor's placements say this rank holds.

    ``local`` (this rank's dim-0 chunk of ``full`` over dp, None for none; by default cut here)
    is used as it is unless TP shards dim 0 too: then rows move between TP ranks (the dp
    chunk is taken of the whole tensor first), so the whole tensor is gathered over TP and
    cut on both mesh dims, through DTensor's own redistribution.  torch's FSDP1 redistributes
    the local value from ``(Replicate(), Shard(0))`` directly, which aborts gloo on uneven TP
    shards (an 11-row embedding on 2 TP ranks, measured on torch 2.13); this path gives the
    same values where torch runs and works there too.  Collective over the TP group in that
    case only."""
    if spec is None:
        placements, shape, stride = (DShard(0), Replicate()), full.shape, full.stride()
    else:
        placements, shape, stride = (DShard(0), *spec.placements), spec.shape, spec.stride
    if _tp_shards_dim0(spec):
        whole = DTensor.from_local(full, root, (Replicate(), *spec.placements), run_check=False,
                                   shape=shape, stride=stride)
        whole = whole.redistribute(root, (Replicate(), Replicate()))
        local = whole.redistribute(root, placements).to_local()
        local = local.to("cpu", copy=True) if offload_to_cpu else local.clone()
    else:
        if local is _OWN_CHUNK:
            chunks = _dim0_chunks(full.shape[0], root.size(0))
            r = root.get_local_rank(0)
            local = full[chunks[r][0] : sum(chunks[r])] if r < len(chunks) else None
            if local is not None:
                local = local.to("cpu", copy=True) if offload_to_cpu else local.clone()
        if local is None:
            local = full.new_empty((0, *full.shape[1:]), device="cpu" if offload_to_cpu else full.device)
    return DTensor.from_local(local, root, placements, run_check=False, shape=shape, stride=stride)


def as_tp_value(v, spec) -> DTensor:
    """A TP parameter's state-dict value ``v`` (a DTensor on any mesh, or the whole tensor)
    as a DTensor with the parameter's own ``spec`` (TP mesh, placements), which is what its
    summoned parameter takes; collective over ``v``'s mesh unless it is one already."""
    if isinstance(v, DTensor) and v.device_mesh == spec.mesh and v.placements == spec.placements:
        return v
    whole = v.full_tensor() if isinstance(v, DTensor) else v
    rep = DTensor.from_local(whole, spec.mesh, (Replicate(),) * spec.mesh.ndim, run_check=False)
    return rep.redistribute(spec.mesh, spec.placements)


def _mesh_of(w, u):
    mesh = getattr(w, "_device_mesh", None)
    if mesh is None:
        mesh = DeviceMesh.from_group(u.group, u.device.type)
    return mesh


def _local_chunks(u, fulls: list, offload_to_cpu: bool) -> list:
    """This rank's dim-0 chunk of each full tensor in ``fulls`` (None where it holds
    none), copied into one new buffer: one allocation per unit rather than one per
    parameter, so gathering unit after unit does not fragment the heap."""
    spans, total = [], 0
    for full in fulls:
        chunks = _dim0_chunks(full.shape[0], u.world_size)
        if u.rank < len(chunks):
            s, n = chunks[u.rank]
            spans.append((s, n, total))
            total += n * (full.numel() // max(full.shape[0], 1))
        else:
            spans.append(None)
    device = torch.device("cpu") if offload_to_cpu else u.device
    store = torch.empty(total, dtype=u.dtype, device=device)
    out = []
    for full, span in zip(fulls, spans):
        if span is None:
            out.append(None)
            continue
        s, n, at = span
        src = full[s : s + n]
        local = store[at : at + src.numel()].view(src.shape)
        local.copy_(src)
        out.append(local)
    return out


def _chunked_value(w, u, full: torch.Tensor, local: Optional[torch.Tensor], cfg, spec=None):
    """SHARDED_STATE_DICT: ``local`` (this rank's dim-0 chunk of the full parameter
    ``full``, or None) wrapped as torch does: a ShardedTensor over the unit's group,
    or a DTensor ``Shard(0)`` (with a 2-D hybrid mesh ``(Replicate(), Shard(0))``), or
    with a (dp, tp) root mesh a DTensor on it (:func:`root_mesh_value`; ``full`` is then a TP
    parameter's local full value when ``spec`` is its TP spec)."""
    root = getattr(w, "_tp_root_mesh", None)
    if root is not None:
        return root_mesh_value(root, full, spec, local, cfg.offload_to_cpu)
    chunks = _dim0_chunks(full.shape[0], u.world_size)
    if cfg._use_dtensor or getattr(w, "_device_mesh", None) is not None:
        mesh = _mesh_of(w, u)
        if local is None:
            local = full.new_empty((0, *full.shape[1:]))
        placements = [Replicate()] * (mesh.ndim - 1) + [DShard(0)]
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
    rest = [0] * (full.dim() - 1)
    shards = [(r, [s, *rest], [n, *full.shape[1:]]) for r, (s, n) in enumerate(chunks)]
    device = local.device if local is not None else full.device
    return _sharded_tensor(local, shards, full.shape, full.dtype, u.group, u.rank, device)


def _local_shards(u) -> list:
    """LOCAL_STATE_DICT: ``(rank, [offset], [numel])`` of each rank's part of the
    unpadded flat parameter; ranks holding only padding hold none (as torch)."""
    lay = u.layout
    sizes = [max(0, min(lay.shard_numel, lay.flat_numel - r * lay.shard_numel)) for r in range(u.world_size)]
    return [(r, [r * lay.shard_numel], [n]) for r, n in enumerate(sizes) if n > 0]


def _local_flat_value(w, u):
    """LOCAL_STATE_DICT: the unit's flat parameter as a ShardedTensor of its
    unpadded size, this rank holding its shard without the padding (as torch)."""
    lay = u.layout
    shards = _local_shards(u)
    mine = next((size[0] for r, _, size in shards if r == u.rank), 0)
    # this rank's live shard, flagged like the flat parameter (torch's metadata says
    # requires_grad); a detached leaf, so no autograd view of the flat parameter is made
    local = u.shard.detach()[:mine]
    if w._state_dict_config.offload_to_cpu:
        local = local.to("cpu", copy=True)
    local.requires_grad_(u.flat_param.requires_grad)
    return _sharded_tensor(
        local, shards, (lay.flat_numel,), u.dtype, u.group, u.rank, local.device,
        requires_grad=u.flat_param.requires_grad,
    )


# ------------------------------------------------------ expected entries
def _meta_like(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _dry_entries(w, state_dict, prefix: str) -> None:
    """Post hook in dry mode: the subtree's entries as meta tensors of the shape
    and dtype the real state dict (of ``w._state_dict_type``) would hold."""
    u = _unit(w)
    t = _type_of(w)
    shard_ptr = _storage_ptr(u.shard) if u is not None else None
    items = [(k, state_dict.pop(k)) for k in _subtree(state_dict, prefix)]
    unit_done = False
    for k, v in items:
        ck = _clean_under(prefix, k)
        if u is not None and _plain_tensor(v) and _storage_ptr(v) == shard_ptr:
            if not unit_done:
                unit_done = True
                if t == StateDictType.LOCAL_STATE_DICT:
                    flat = _meta_like((u.layout.flat_numel,), u.dtype)
                    flat._cfsdp_shards = [(off, size) for _, off, size in _local_shards(u)]
                    state_dict[prefix + FLAT_PARAM] = flat
                else:
                    for info in list(u.infos) + list(u.shared):
                        shape = info.global_shape
                        e = _meta_like(shape, u.dtype)
                        if t == StateDictType.SHARDED_STATE_DICT:
                            rest = [0] * (len(shape) - 1)
                            e._cfsdp_shards = [
                                ([s, *rest], [n, *shape[1:]])
                                for s, n in _dim0_chunks(shape[0], u.world_size)
                            ]
                        state_dict[prefix + clean_tensor_name(info.fqn)] = e
            continue
        if _plain_tensor(v):
            orig = _buffer_dtype_out(w, t, ck[len(prefix):])
            dtype = orig if (orig is not None and v.is_floating_point()) else v.dtype
            v = _meta_like(v.shape, dtype)
        state_dict[ck] = v


def expected_entries(w, prefix: str = "") -> "OrderedDict[str, Any]":
    """What ``w``'s state dict (its current type) holds, as meta tensors; no communication."""
    token = _DRY.set(True)
    try:
        return nn.Module.state_dict(w, prefix=prefix, keep_vars=True)
    finally:
        _DRY.reset(token)


def _global_shape(v) -> Optional[torch.Size]:
    if isinstance(v, ShardedTensor):
        return v.size()
    if isinstance(v, torch.Tensor):
        return v.shape
    return None


def _describe(v) -> str:
    kind = type(v).__name__ if isinstance(v, (ShardedTensor, DTensor)) else "tensor"
    return f"a {str(v.dtype).replace('torch.', '')} {kind} of shape {tuple(_global_shape(v))}"


class MissingFlatParamError(AssertionError):
    """A LOCAL_STATE_DICT without a wrapper's ``_flat_param``: torch raises
    ``AssertionError`` (``_local_pre_load_state_dict_hook``), so this is one."""


def _raw_keys(w) -> dict[str, str]:
    """Each clean module prefix under ``w`` (``"a.b."``, ``""`` for ``w``) -> the raw one
    (wrapper and checkpoint-wrapper prefixes kept) of the deepest module with that clean
    name, which is where ``nn.Module.load_state_dict`` looks up that module's entries."""
    raw: dict[str, str] = {}
    for name, _ in w.named_modules():
        full = name + "." if name else ""
        raw[clean_tensor_name(full) if full else ""] = full
    return raw


def _load_order(raw: dict[str, str], keys: list[str]) -> list[str]:
    """``keys`` in the order ``nn.Module.load_state_dict`` reports them: by the module that
    checks each (the deepest module of the model whose prefix it has, in pre-order), then
    in the order given (``expected_entries`` lists a module's parameters before its
    buffers, as the module holds them)."""
    pos = {m: i for i, m in enumerate(raw)}

    def owner(k: str) -> int:
        mod = k
        while mod:
            mod = mod.rpartition(".")[0]
            if mod + "." in pos:
                return pos[mod + "."]
        return pos.get("", 0)

    return sorted(keys, key=owner)


def _torch_key(raw: dict[str, str], key: str) -> str:
    """The raw key ``nn.Module.load_state_dict`` names in a size mismatch for clean ``key``."""
    mod, _, leaf = key.rpartition(".")
    return raw.get(mod + "." if mod else "", mod + "." if mod else "") + leaf


def validate(w, state_dict, prefix: str, strict: Optional[bool]) -> None:
    """Check ``state_dict``'s entries under ``prefix`` against ``w``'s own before
    anything is written: missing and unexpected keys (when ``strict``), shapes (always).
    Another dtype is no error: values are cast on copy, as ``nn.Module.load_state_dict``
    does.  Raises ``RuntimeError`` naming the first offending FQN, with the message
    torch's FSDP1 gives for the same state dict (``nn.Module.load_state_dict``'s, through
    the root wrapper) first when ``w`` is the root of the load."""
    expected = expected_entries(w, prefix)
    given = [k for k in state_dict if k.startswith(prefix)]
    raw = _raw_keys(w)
    missing = _load_order(raw, [k for k in expected if k not in state_dict]) if strict else []
    unexpected = _load_order(raw, [k for k in given if k not in expected]) if strict else []
    errors: list[str] = [f"missing key '{k}' (expected {_describe(expected[k])})" for k in missing]
    errors += [f"unexpected key '{k}' (the model has no parameter or buffer of that name)"
               for k in unexpected]
    theirs: list[str] = []  # torch's lines for what torch checks the same way
    for k in _load_order(raw, [k for k in expected if k in state_dict]):
        want, got = expected[k], state_dict[k]
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
            continue
        if _global_shape(got) != want.shape:
            errors.append(f"'{k}' has shape {tuple(_global_shape(got))}, expected {tuple(want.shape)}")
            if not hasattr(want, "_cfsdp_shards"):  # a full parameter or a buffer: as torch
                theirs.append(
                    f"size mismatch for {_torch_key(raw, k)}: copying a param with shape "
                    f"{_global_shape(got)} from checkpoint, the shape in current model is {want.shape}."
                )
        elif isinstance(got, ShardedTensor) and hasattr(want, "_cfsdp_shards"):
            have = sorted((list(m.shard_offsets), list(m.shard_sizes)) for m in got.metadata().shards_metadata)
            if have != sorted((list(o), list(z)) for o, z in want._cfsdp_shards):
                errors.append(
                    f"'{k}' is sharded as {have}, this model as {sorted(want._cfsdp_shards)} (another "
                    "world size?): save and load through torch.distributed.checkpoint, which reshards"
                )
    if not errors:
        return
    more = f" ({len(errors) - 1} more: " + "; ".join(errors[1:]) + ")" if len(errors) > 1 else ""
    ours = (
        f"{errors[0]}{more}. Nothing was loaded. Check that the state dict comes from the same "
        "model and the same state_dict_type"
        + ("; pass strict=False to load only the matching keys." if strict else ".")
    )
    local = w._state_dict_type == StateDictType.LOCAL_STATE_DICT
    if local and any(k.rpartition(".")[2] == FLAT_PARAM for k in missing):
        # torch's LOCAL pre-load hook says so, before nn.Module's checks
        raise MissingFlatParamError(
            "No `FlatParameter` in `state_dict` for this FSDP instance but it has parameters "
            f"(cfsdp: {w._state_dict_type.name}: {ours})"
        )
    if missing:
        theirs.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if unexpected:
        theirs.insert(1 if missing else 0,
                      "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    if theirs and not prefix:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(w).__name__}:\n\t" + "\n\t".join(theirs)
            + f" (cfsdp: {w._state_dict_type.name}: {ours})"
        )
    raise RuntimeError(
        f"Error(s) in loading state_dict for FullyShardedDataParallel "
        f"({w._state_dict_type.name}): {ours}"
    )


# ------------------------------------------------------------- loading
def _full_from_chunks(v, u, fqn: str) -> torch.Tensor:
    """The full tensor of a SHARDED_STATE_DICT entry (collective over the unit's group)."""
    if isinstance(v, DTensor):
        return v.full_tensor()
    if not isinstance(v, ShardedTensor):
        return v  # already full
    full_shape = v.size()
    chunks = _dim0_chunks(full_shape[0], u.world_size)
    metas = v.metadata().shards_metadata
    want = [([s] + [0] * (len(full_shape) - 1), [n, *full_shape[1:]]) for s, n in chunks]
    have = sorted((list(m.shard_offsets), list(m.shard_sizes)) for m in metas)
    if have != sorted(want):
        raise NotImplementedError(
            f"'{fqn}': a ShardedTensor sharded other than in dim-0 chunks over the unit's "
            f"{u.world_size} ranks (shards {have}) cannot be loaded; load it through "
            "torch.distributed.checkpoint (dcp.load into this model's own sharded state dict), "
            "which reshards it."
        )
    rows = chunks[0][1]
    inp = torch.zeros((rows, *full_shape[1:]), dtype=v.dtype, device=u.device)
    local = v.local_shards()
    if local:
        t = local[0].tensor
        inp[: t.shape[0]].copy_(t)
    out = torch.empty((rows * u.world_size, *full_shape[1:]), dtype=v.dtype, device=u.device)
    dist.all_gather_into_tensor(out, inp, group=u.group)
    return out[: full_shape[0]]


def _load_local_flat(w, u, state_dict, prefix: str) -> None:
    key = prefix + FLAT_PARAM
    if key not in state_dict:
        return
    v = state_dict[key]
    if isinstance(v, ShardedTensor):
        shards = v.local_shards()
        local = shards[0].tensor if shards else u.shard.new_empty(0)
    else:  # a plain tensor: the whole unpadded flat parameter
        lo = u.layout.shard_range(u.rank)[0]
        local = v.reshape(-1)[lo : lo + u.shard.numel()]
    padded = torch.zeros_like(u.shard)
    padded[: local.numel()].copy_(local.reshape(-1))
    if u.use_orig_params:  # no flat parameter registered: write the shard directly
        del state_dict[key]
        with torch.no_grad():
            u.shard.copy_(padded)
    else:
        state_dict[key] = padded


def _pre_load_hook(w, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs) -> None:
    check_can_summon([w._state])
    check_mesh_settings(w, hook=True)
    if not w._cfsdp_has_outer and not w._sd.validated:
        validate(w, state_dict, prefix, _LOAD_STRICT.get())
    w._sd.validated = False
    w._sd.active = True
    t = _type_of(w)
    u = _unit(w)
    w._sd.skip_missing = set()
    if u is not None and t != StateDictType.LOCAL_STATE_DICT:
        for info in list(u.infos) + list(u.shared):
            k = prefix + clean_tensor_name(info.fqn)
            if k not in state_dict:
                continue
            if t == StateDictType.SHARDED_STATE_DICT:
                state_dict[k] = _full_from_chunks(state_dict[k], u, k)
            if info.tp_spec is not None:  # loaded into a DTensor on the TP mesh
                state_dict[k] = as_tp_value(state_dict[k], info.tp_spec)
    if u is not None and t == StateDictType.LOCAL_STATE_DICT:
        _load_local_flat(w, u, state_dict, prefix)
        if u.use_orig_params:
            w._sd.skip_missing = {
                clean_tensor_name(prefix + FSDP_PREFIX + i.fqn) for i in list(u.infos) + list(u.shared)
            }
    if t != StateDictType.LOCAL_STATE_DICT:
        _expose_full(w)
    inner = prefix + FSDP_PREFIX
    for k in _subtree(state_dict, prefix):
        if not k.startswith(inner):
            state_dict[inner + k[len(prefix):]] = state_dict.pop(k)


def _post_load_hook(w, incompatible_keys) -> None:
    try:
        if _type_of(w) != StateDictType.LOCAL_STATE_DICT:
            _hide_full(w, writeback=True)
    finally:
        w._sd.active = False
    skip = w._sd.skip_missing
    missing = [clean_tensor_name(k) for k in incompatible_keys.missing_keys]
    incompatible_keys.missing_keys[:] = [k for k in missing if k not in skip]
    incompatible_keys.unexpected_keys[:] = [clean_tensor_name(k) for k in incompatible_keys.unexpected_keys]


# ---------------------------------------------------------------------------
# parameters as an optimizer sees them -> the clean FQNs they hold
# ---------------------------------------------------------------------------


def optimizer_param_fqns(model, wrappers: list) -> dict:
    """``{parameter: [clean FQN, ...]}`` for every parameter ``model.parameters()`` yields.

    A flat parameter (``use_orig_params=False``) maps to the FQNs of the original parameters
    it holds, in layout order (torch's ``FlatParameter._fqns``); an original parameter
    (``use_orig_params=True``) and a parameter no unit manages (ignored) map to their own
    clean name.  Tied occurrences of a parameter are not listed again (as
    ``named_parameters()`` and torch's FSDP1 optimizer state dicts)."""
    module_names = {id(m): n for n, m in model.named_modules()}
    out: dict = {}
    for w in wrappers:
        unit = unit_of(w._state)
        if unit is None:
            continue
        prefix = module_names[id(unit.module)]
        fqns = [clean_tensor_name(join_fqn(prefix, i.fqn)) for i in unit.infos]
        if unit.use_orig_params:
            for info, fqn in zip(unit.infos, fqns):
                out[info.param] = [fqn]
        else:
            out[unit.flat_param] = fqns
    for name, p in model.named_parameters():
        out.setdefault(p, [clean_tensor_name(name)])
    return out
