"""Optimizer state dicts for the wrapper face (torch FSDP1's eight static methods).

[Note: optimizer state-dict flavours]
The optimizer of a wrapped model holds one entry per parameter it sees: the
unit's ``flat_param`` (this rank's padded 1-D shard) with ``use_orig_params=False``,
or each original parameter (its 1-D slice of the shard, possibly empty, hence
possibly without state) with ``use_orig_params=True``.  Parameters no unit
manages (ignored ones) keep their own full state.  Saving turns this into a
dict keyed by the *original, clean* FQNs, as torch FSDP1 does:

* full (``full_optim_state_dict``, ``optim_state_dict`` with FULL_STATE_DICT):
  every tensor state with a positive dimension is all-gathered per unit (one
  collective per state name per unit) and cut into the original shapes;
  0-dim (``step``) and non-tensor states are copied.  ``rank0_only``: the
  other ranks take part in the collectives and get ``{}``.
* sharded (``sharded_optim_state_dict``, SHARDED/LOCAL state-dict types):
  the full value of each original parameter's state chunked along dim 0 over
  the unit's ranks, as a ``ShardedTensor`` (a ``DTensor`` with a device mesh).

With a ``device_mesh`` that is the dp slice of a 2-D (dp, tp) mesh (torch's DTensor
extension), a tensor-parallel parameter's state is its TP-local state: full dicts hold it
as a DTensor on the TP mesh, sharded ones hold every state as a DTensor on the (dp, tp)
mesh (``_state_dict.root_mesh_value``); loading takes DTensors on any mesh or whole
tensors and keeps this rank's TP part (``_load_value``).  ``rank0_only`` means rank 0 of
each dp group (each holds its TP part; torch keeps global rank 0's alone).

Entry order follows torch: with ``use_orig_params=False`` the optimizer's
parameter order (rank 0's), each flat parameter expanding to its original
parameters; state names as tensors, then 0-dim tensors, then the rest (each
sorted).  With ``use_orig_params=True`` the keys of all ranks are merged and
sorted; states of unmanaged parameters come first, then each unit's, state
names as non-tensors, 0-dim tensors, then tensors (each sorted).  NO_SHARD
with ``use_orig_params=True`` keeps the optimizer's own state-name order.

Loading (``optim_state_dict_to_load``, ``shard_full_optim_state_dict``,
``scatter_full_optim_state_dict``, ``flatten_sharded_optim_state_dict``) does
the reverse for this rank and re-keys the result by this rank's optimizer
parameter ids, so that ``optim.load_state_dict`` takes it.

Units are read only through ``_runtime.unit_view.UnitView`` ([Note: unit view]): one view per
unit per call, made in ``_View``, so ``e.unit`` is the same object for every entry of a unit.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._fqn import clean_tensor_name
from ._state_dict import as_tp_value, get_state_dict_type, root_mesh_value
from .api import OptimStateKeyType, StateDictType
from ._runtime import comm
from ._runtime.base import TrainingState, wrappers_in
from ._runtime.unit_view import ParamView, UnitView, unit_of
from ._runtime.views import as_tp
from ._torch.checkpoint import ShardedTensor, gather_state_dict
from ._torch.fsdp1 import create_chunk_dtensor, create_chunk_sharded_tensor

__all__ = [
    "optim_state_dict",
    "optim_state_dict_to_load",
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
    "rekey_optim_state_dict",
]


# ---------------------------------------------------------------------------
# the model as the optimizer sees it
# ---------------------------------------------------------------------------


@dataclass
class _Entry:
    """One parameter an optimizer of the model may hold."""

    param: nn.Parameter
    fqns: list[str]  # clean FQNs: all of a flat parameter's, else one
    unit: Optional[UnitView]  # None: no unit manages it (ignored)
    index: int = -1  # use_orig_params=True: the parameter's index in unit.infos


class _Key(NamedTuple):
    """A state entry across ranks: the FQNs it covers and whether a unit manages it."""

    fqns: tuple[str, ...]
    managed: bool


class _View:
    """The wrappers of ``model``, their units and the FQN of every parameter."""

    def __init__(self, model: nn.Module, group: Optional[dist.ProcessGroup], what: str):
        self.wrappers = wrappers_in(model)
        if not self.wrappers:
            raise ValueError(
                f"FullyShardedDataParallel.{what}: the model contains no FullyShardedDataParallel "
                "module; wrap it first (or use the optimizer's own state_dict())."
            )
        uops = {w._use_orig_params for w in self.wrappers}
        if len(uops) != 1:
            raise OptimStateDictError(
                "Not all FSDP modules have the same _use_orig_params value (cfsdp: "
                f"FullyShardedDataParallel.{what}: all wrappers of the model must share "
                "use_orig_params, but both True and False are used.)"
            )
        self.use_orig_params = uops.pop()
        for w in self.wrappers:
            if w._state.training_state is not TrainingState.IDLE:
                raise RuntimeError(
                    f"FullyShardedDataParallel.{what} was called while a wrapper is in "
                    f"{w._state.training_state} (inside forward/backward or summon_full_params); "
                    "call it between training steps, outside those contexts."
                )
        units = [u for u in (unit_of(w._state) for w in self.wrappers) if u is not None]
        groups = {id(u.group): u.group for u in units}
        if len(groups) > 1:
            raise NotImplementedError(
                f"FullyShardedDataParallel.{what}: wrappers with different process groups in one "
                "model are not supported by cfsdp's optimizer state dicts yet."
            )
        hybrid = any(u.replicate_group is not None for u in units)
        if hybrid:
            # As torch: each unit gathers over its shard group (the replicas hold the same
            # state), while the keys are agreed and rank0_only's rank 0 is taken over ``group``
            # (None: the default group), which spans the replicas too.
            self.group = group or dist.group.WORLD
        else:
            self.group = next(iter(groups.values())) if groups else (group or dist.group.WORLD)
            if group is not None and groups and group is not self.group:
                raise NotImplementedError(
                    f"FullyShardedDataParallel.{what}: group must be None or the wrappers' own "
                    "process group (the one passed as process_group); another group is not "
                    "supported."
                )
        self.rank = dist.get_rank(self.group)
        self.units = units
        self.mesh = next((w._device_mesh for w in self.wrappers if w._device_mesh is not None), None)
        # a (dp, tp) root mesh: sharded states are DTensors on it ([Note: optimizer state-dict
        # flavours])
        self.root = next((w._tp_root_mesh for w in self.wrappers if w._tp_root_mesh is not None), None)

        prefix = {m: clean_tensor_name(name + ".") if name else "" for name, m in model.named_modules()}
        managed: dict[nn.Parameter, _Entry] = {}
        for u in units:
            pre = prefix[u.module]
            names = [pre + clean_tensor_name(i.fqn) for i in u.infos]
            if self.use_orig_params:
                for idx, (i, n) in enumerate(zip(u.infos, names)):
                    managed[i.param] = _Entry(i.param, [n], u, idx)
            else:
                managed[u.flat_param] = _Entry(u.flat_param, names, u)
        # named_parameters() order (shared parameters once, at their first name), as torch
        self.entries: dict[nn.Parameter, _Entry] = {}
        for name, p in model.named_parameters():
            self.entries[p] = managed.get(p) or _Entry(p, [clean_tensor_name(name)], None)
        self.by_fqn: dict[str, _Entry] = {f: e for e in self.entries.values() for f in e.fqns}

    def entry(self, p: nn.Parameter, what: str) -> _Entry:
        e = self.entries.get(p)
        if e is None:
            raise ValueError(
                f"FullyShardedDataParallel.{what}: the optimizer holds a parameter of shape "
                f"{tuple(p.shape)} that is not a parameter of the model. Build the optimizer "
                "after wrapping, from the wrapped model's parameters()."
            )
        return e

    def param_of_key(self, optim: Optional[torch.optim.Optimizer], optim_input, what: str):
        """``{param id: entry}`` in the optimizer's order (or ``optim_input``'s, or the
        model's parameters() when neither is given, as torch)."""
        if optim is not None and optim_input is None:
            params = [p for g in optim.param_groups for p in g["params"]]
        else:
            params = _params_from_optim_input(list(self.entries), optim_input)
        return {pid: self.entry(p, what) for pid, p in enumerate(params)}


class OptimStateDictError(AssertionError):
    """Bad input torch's FSDP1 rejects with an ``AssertionError`` (mixed
    ``use_orig_params``, a parameter group without ``"params"``, a bad key type);
    this is one."""


def _params_from_optim_input(model_params: list, optim_input) -> list:
    """torch's deprecated ``optim_input``: a list of parameters or of param groups;
    None means the model's ``parameters()``."""
    if optim_input is None:
        return model_params
    try:
        items = list(optim_input)
    except TypeError as e:
        raise TypeError(f"Optimizer input should be an iterable of Tensors or dicts, but got {optim_input}") from e
    if not items:
        raise ValueError("Optimizer input should not be empty")
    if all(isinstance(x, torch.Tensor) for x in items):
        return items
    if all(isinstance(x, dict) for x in items):
        out = []
        for g in items:
            if "params" not in g:
                raise OptimStateDictError(
                    'A parameter group should map "params" to a list of the parameters in the '
                    f"group (cfsdp: optim_input's group {g} has no \"params\".)"
                )
            out.extend(g["params"])
        return out
    raise TypeError("Optimizer input should be an iterable of Tensors or dicts")


def _warn_optim_input(optim_input) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
            "You may remove it from your code without changing its functionality.",
            FutureWarning,
            stacklevel=4,
        )


def _warn_legacy(curr: str, new: str) -> None:
    warnings.warn(
        f"``FullyShardedDataParallel.{curr}``is being deprecated and is replaced by "
        f"``FullyShardedDataParallel.{new}``. ``FullyShardedDataParallel.{curr}`` may be "
        "removed after PyTorch 2.2.",
        FutureWarning,
        stacklevel=4,
    )


def _is_pos_dim(v: Any) -> bool:
    return torch.is_tensor(v) and v.dim() > 0


def _is_zero_dim(v: Any) -> bool:
    return torch.is_tensor(v) and v.dim() == 0


def _by_kind(state: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """State names (sorted) split into positive-dim tensors, 0-dim tensors, the rest."""
    names = sorted(state)
    return (
        [n for n in names if _is_pos_dim(state[n])],
        [n for n in names if _is_zero_dim(state[n])],
        [n for n in names if not torch.is_tensor(state[n])],
    )


# ---------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------


class _Out:
    """How saved tensors are finished: full (cloned; CPU copies with offload) or
    sharded (dim-0 chunks as ShardedTensor / DTensor)."""

    def __init__(self, view: _View, shard: bool, offload: bool):
        self.view, self.shard, self.offload = view, shard, offload

    def finish(self, full: torch.Tensor, unit: UnitView, spec: Any = None) -> Any:
        """``full`` (a parameter's whole state; for a tensor-parallel parameter of TP spec
        ``spec``, its local whole state) as the state dict holds it."""
        if self.shard:
            return self._chunk(full, unit, spec)
        out = full.detach().clone() if full.device.type == "cpu" or not self.offload else full.detach()
        out = out.cpu() if self.offload else out
        return out if spec is None else as_tp(out, spec)

    def _chunk(self, full: torch.Tensor, unit: UnitView, spec: Any) -> Any:
        if self.view.root is not None:
            return root_mesh_value(self.view.root, full.detach(), spec, offload_to_cpu=self.offload)
        if self.view.mesh is not None:
            return create_chunk_dtensor(full, unit.rank, self.view.mesh)
        dev = full.device
        per_node = 1 if dev.type == "cpu" else getattr(torch, dev.type).device_count()
        # row-major: a ShardedTensor takes no other local shards (torch's own sharded dicts
        # raise for a strided parameter's states; [Note: strided parameters])
        return create_chunk_sharded_tensor(full.contiguous(), unit.rank, unit.world_size,
                                           per_node, unit.group)

    def plain(self, state: dict[str, Any]) -> dict[str, Any]:
        """An unmanaged parameter's state: its tensors copied (to CPU with offload; torch
        returns the live tensors there, which later optimizer steps would change)."""
        out = dict(state)
        for n, v in state.items():
            if torch.is_tensor(v):
                out[n] = v.detach().cpu() if (self.offload and v.device.type != "cpu") else v.detach().clone()
        return out


def _gather_flat(unit: UnitView, shard_state: torch.Tensor, fqn: str, name: str) -> torch.Tensor:
    """The unit's unpadded flat value of one state (all-gathered when sharded)."""
    lay = unit.layout
    want = lay.shard_numel if unit.sharded else lay.flat_numel
    if shard_state.dim() != 1 or shard_state.numel() != want:
        raise ValueError(
            f"optimizer state '{name}' of the flat parameter holding '{fqn}' has shape "
            f"{tuple(shard_state.shape)}, expected ({want},): was the optimizer built for this model?"
        )
    if not unit.sharded:
        return shard_state
    full = torch.empty(lay.padded_numel, dtype=shard_state.dtype, device=unit.device)
    comm.all_gather(full, shard_state.to(unit.device).contiguous(), unit.group, async_op=False)
    return full[: lay.flat_numel]


def _unit_views(unit: UnitView, flat: torch.Tensor) -> list[torch.Tensor]:
    return [i.view(flat[off : off + i.numel]) for off, i in zip(unit.layout.offsets, unit.infos)]


def _keys_everywhere(view: _View, local: list[_Key], merge: bool, what: str) -> list[_Key]:
    """All ranks' state keys: sorted union (``merge``), else rank 0's, checking
    that every rank has state for each of them."""
    world = dist.get_world_size(view.group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local, group=view.group)
    if merge:
        return sorted({k for ks in gathered for k in ks})
    first = gathered[0]
    for r, ks in enumerate(gathered):
        missing = [k.fqns for k in first if k not in set(ks)]
        if missing:
            raise RuntimeError(
                f"FullyShardedDataParallel.{what}: rank {r} has no optimizer state for the "
                f"parameters {list(missing[0])} that rank 0 has; every rank must step the "
                "optimizer on the same parameters before saving."
            )
    return first


def _save_flat_unit(unit: UnitView, fqns: list[str], state: dict[str, Any], out: _Out, to_save: bool) -> dict:
    """use_orig_params=False: one flat parameter's state, per original parameter."""
    tensors, zeros, others = _by_kind(state)
    per_param: list[dict[str, Any]] = [{} for _ in fqns]
    for name in tensors:
        flat = _gather_flat(unit, state[name], fqns[0], name)
        if not to_save:
            continue
        for d, v, info in zip(per_param, _unit_views(unit, flat), unit.infos):
            d[name] = out.finish(v, unit, info.tp_spec)
        del flat
    if not to_save:
        return {}
    for name in zeros:
        v = state[name].detach().clone()
        v = v.cpu() if out.offload else v
        for d in per_param:
            d[name] = v
    for name in others:
        for d in per_param:
            d[name] = state[name]
    return dict(zip(fqns, per_param))


def _save_orig_unit(unit: UnitView, fqns: list[str], idxs: list[int], states: list[Optional[dict]],
                    infos: list[dict], out: _Out, to_save: bool, what: str) -> dict:
    """use_orig_params=True: the states of one unit's original parameters.

    ``states[j]`` is this rank's state of ``fqns[j]`` (None without one);
    ``infos[r][fqn]`` what rank r holds: ``(pos-dim names -> dtype, 0-dim values, others)``."""
    if not unit.sharded or unit.world_size == 1:
        # torch hands these states over as the optimizer has them (full tensors even for
        # sharded dicts, the optimizer's state-name order); here as copies.  On a (dp, tp)
        # mesh (where torch fails at dp=1) as the flat path gives them: tensor-parallel
        # parameters' states as DTensors, DTensors on the root mesh in sharded dicts.
        if not to_save:
            return {}
        tp = out.view.root is not None
        return {
            f: {n: (out.finish(v, unit, unit.infos[i].tp_spec) if tp and _is_pos_dim(v) else
                    v.detach().clone() if torch.is_tensor(v) else v) for n, v in (s or {}).items()}
            for f, i, s in zip(fqns, idxs, states)
        }
    res: dict[str, dict[str, Any]] = {f: {} for f in fqns}
    names: dict[str, torch.dtype] = {}
    for r_info in infos:
        for f in fqns:
            got = r_info.get(f)
            if got is None:
                continue
            names.update(got[0])
            for n, v in got[2].items():
                res[f][n] = v
            for n, v in got[1].items():
                res[f][n] = v
    have = set(idxs)
    for idx, info in enumerate(unit.infos):
        if idx not in have and info.param.requires_grad:
            # torch's FSDP1 refuses it too (its message first), with the unit's names as
            # the model names them (the unit's own names behind the prefix of fqns[0])
            rel = unit.infos[idxs[0]].fqn
            prefix = fqns[0][: len(fqns[0]) - len(rel)] if fqns[0].endswith(rel) else ""
            unit_fqns = sorted(prefix + x.fqn for x in unit.infos)
            raise RuntimeError(
                f"{prefix + info.fqn} is not in the optimizer state. The FSDPParamInfo has the "
                f"param keys {unit_fqns} while the optimizer has the param keys "
                f"{sorted(fqns)}. (cfsdp: FullyShardedDataParallel.{what}: parameter "
                f"{prefix + info.fqn!r} of the unit holding {fqns[0]!r} is trainable but has "
                "no optimizer state on any rank, while other parameters of the unit have one. "
                "Every trainable parameter of a sharded unit needs its state in the optimizer "
                "given: step the optimizer on all of them first; with one optimizer per kind "
                "of parameter (Muon + AdamW), wrap so that each unit's trainable parameters go "
                "to one optimizer, e.g. an auto_wrap_policy putting the modules holding the "
                "matrices in units of their own, and give the others' units to AdamW.)"
            )
    lay = unit.layout
    pos = {i: j for j, i in enumerate(idxs)}
    for name in sorted(names):
        dtype = names[name]
        local = torch.zeros(lay.shard_numel, dtype=dtype, device=unit.device)
        for i, sl in enumerate(lay.slices[unit.rank]):
            j = pos.get(i)
            if sl.numel == 0 or j is None or states[j] is None or name not in states[j]:
                continue
            v = states[j][name]
            if v.numel() != sl.numel:
                raise ValueError(
                    f"optimizer state '{name}' of '{fqns[j]}' has {v.numel()} elements on rank "
                    f"{unit.rank}, expected its shard of {sl.numel}: was the optimizer built for "
                    "this model?"
                )
            local[sl.shard_offset : sl.shard_offset + sl.numel].copy_(v.reshape(-1))
        full = torch.empty(lay.padded_numel, dtype=dtype, device=unit.device)
        comm.all_gather(full, local, unit.group, async_op=False)
        if to_save:
            views = _unit_views(unit, full[: lay.flat_numel])
            for j, i in enumerate(idxs):
                res[fqns[j]][name] = out.finish(views[i], unit, unit.infos[i].tp_spec)
        del full
    return res if to_save else {}


def _state_info(state: dict[str, Any]) -> tuple[dict, dict, dict]:
    pos = {n: v.dtype for n, v in state.items() if _is_pos_dim(v) and v.numel() > 0}
    zero = {n: v.detach().cpu().clone() for n, v in sorted(state.items()) if _is_zero_dim(v)}
    other = {n: v for n, v in sorted(state.items()) if not torch.is_tensor(v)}
    return pos, zero, other


def _save(model, optim, osd: Optional[dict], group, *, shard: bool, rank0_only: bool,
          offload: bool, optim_input, what: str) -> dict[str, Any]:
    view = _View(model, group, what)
    if osd is None:
        osd = optim.state_dict()
    if "state" not in osd:
        raise ValueError(f"FullyShardedDataParallel.{what}: optim_state_dict has no 'state' key.")
    state = osd["state"]
    if any(isinstance(k, str) for k in state):
        raise NotImplementedError(
            f"FullyShardedDataParallel.{what}: optimizer state dicts keyed by names "
            "(NamedOptimizer / KeyedOptimizer) are not supported by cfsdp yet; use a "
            "torch.optim optimizer."
        )
    key_of = view.param_of_key(optim, optim_input, what)
    to_save = shard or not rank0_only or view.rank == 0
    uop = view.use_orig_params

    local: list[_Key] = []
    pid_of: dict[_Key, int] = {}
    for pid, e in key_of.items():
        if pid in state:
            k = _Key(tuple(e.fqns), e.unit is not None)
            local.append(k)
            pid_of[k] = pid
    keys = _keys_everywhere(view, local, merge=uop, what=what)
    out = _Out(view, shard, offload)
    result: dict[str, Any] = {}
    if uop:
        infos_local = {k.fqns[0]: _state_info(state[pid_of[k]]) for k in local if k.managed}
        infos: list[Any] = [None] * dist.get_world_size(view.group)
        dist.all_gather_object(infos, infos_local, group=view.group)
        per_unit: dict[int, list[_Key]] = {}
        order: list[UnitView] = []
        for k in keys:
            if k.managed:
                e = view.by_fqn[k.fqns[0]]
                if id(e.unit) not in per_unit:
                    per_unit[id(e.unit)] = []
                    order.append(e.unit)
                per_unit[id(e.unit)].append(k)
            elif to_save and k in pid_of:
                result[k.fqns[0]] = out.plain(state[pid_of[k]])
        for u in order:
            ks = per_unit[id(u)]
            fqns = [k.fqns[0] for k in ks]
            idxs = [view.by_fqn[f].index for f in fqns]
            states = [state.get(pid_of[k]) if k in pid_of else None for k in ks]
            result.update(_save_orig_unit(u, fqns, idxs, states, infos, out, to_save, what))
    else:
        for k in keys:
            s = state[pid_of[k]]
            if k.managed:
                e = view.by_fqn[k.fqns[0]]
                result.update(_save_flat_unit(e.unit, list(k.fqns), s, out, to_save))
            elif to_save:
                result[k.fqns[0]] = out.plain(s)
    if not to_save:
        return {}
    known = set(pid_of.values())
    for k, v in state.items():
        if k not in known and k not in key_of:
            warnings.warn(
                f"Found a optim state, {k}, that FSDP cannot process. FSDP will directly copy "
                "everything to the returned state_dict.",
                stacklevel=3,
            )
            result[k] = v
    osd_out: dict[str, Any] = {"state": result}
    if "param_groups" in osd:
        groups = []
        for g in osd["param_groups"]:
            g2 = copy.deepcopy({n: v for n, v in g.items() if n != "params"})
            names = [f for pid in g["params"] for f in key_of[pid].fqns]
            groups.append(_with_params(g, g2, names))
        osd_out["param_groups"] = groups
    return osd_out


def _with_params(orig: dict, rest: dict, params: list) -> dict:
    """``rest`` with ``params`` put back at the position ``orig`` had it."""
    out = {}
    for n in orig:
        out[n] = params if n == "params" else rest[n]
    return out


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------


def _to_full(v: Any, fqn: str, name: str) -> Any:
    """A ShardedTensor / DTensor state back to its full value (collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, (ShardedTensor, DTensor)):
        # over the tensor's own group (a hybrid unit's shard group, not the whole world)
        pg = v._process_group if isinstance(v, ShardedTensor) else None
        return gather_state_dict({name: v}, pg=pg)[name]
    return v


def _load_value(v: Any, fqn: str, name: str, info: Optional[ParamView]) -> Any:
    """A saved state value as the unit flattens it: whole (gathered when sharded), and for a
    tensor-parallel parameter its TP-local part ([Note: tensor-parallel wrapper units])."""
    v = _to_full(v, fqn, name)
    tp = info is not None and info.tp_spec is not None
    if tp and _is_pos_dim(v) and tuple(v.shape) == tuple(info.global_shape):
        v = as_tp_value(v, info.tp_spec).to_local()
    return v


def _check_shape(v: torch.Tensor, fqn: str, name: str, shape: torch.Size) -> None:
    if tuple(v.shape) != tuple(shape):
        raise ValueError(
            "Tensor optimizer state does not have same shape as its parameter: "
            f"{v.shape} {torch.Size(shape)} (cfsdp: optimizer state '{name}' of '{fqn}' has shape "
            f"{tuple(v.shape)} but the parameter has shape {tuple(shape)}: the optimizer state "
            "dict does not match this model.)"
        )


_NO_STATE = '`optim_state_dict` must have the keys "state"to be a valid optimizer state dict'  # torch's


class _BadOsd:
    """What rank 0 broadcasts instead of a state dict it cannot send: the error."""

    def __init__(self, message: str):
        self.message = message


def _broadcast_from_rank0(view: _View, osd: dict, what: str) -> dict:
    """rank0_only loading: rank 0's dict reaches every rank (small values as objects,
    positive-dim tensors one broadcast each)."""
    is0 = view.rank == 0
    if is0 and "state" not in osd:
        # every rank learns it through the broadcast (raising on rank 0 alone would leave
        # the others waiting in it until the process group's timeout)
        objs: list[Any] = [_BadOsd(_NO_STATE + f" (cfsdp: {what}: rank 0's optim_state_dict "
                                   "has no \"state\".)")]
    elif is0:
        meta = {
            "state": {
                k: ({n: (("T", tuple(v.shape), v.dtype) if _is_pos_dim(v) else v) for n, v in s.items()}
                    if isinstance(s, dict) else s)
                for k, s in osd["state"].items()
            },
            **{k: v for k, v in osd.items() if k != "state"},
        }
        objs: list[Any] = [meta]
    else:
        objs = [None]
    dist.broadcast_object_list(objs, group_src=0, group=view.group, device=torch.device("cpu"))
    meta = objs[0]
    if isinstance(meta, _BadOsd):
        raise ValueError(meta.message)
    src = dist.get_global_rank(view.group, 0)
    for k, s in meta["state"].items():
        if not isinstance(s, dict):
            continue
        for n, v in list(s.items()):
            if isinstance(v, tuple) and len(v) == 3 and v[0] == "T":
                dev = view.units[0].device if view.units else torch.device("cpu")
                if is0:
                    t = osd["state"][k][n]
                    # a tensor-parallel parameter's DTensor: sent whole (gathered over TP among the
                    # ranks 0 of the dp groups, which hold the dict); each rank takes its part
                    t = (t.full_tensor() if isinstance(t, DTensor) else t).to(dev).contiguous()
                else:
                    t = torch.empty(v[1], dtype=v[2], device=dev)
                dist.broadcast(t, src=src, group=view.group)
                s[n] = t
    return meta


def _flatten_flat(view: _View, e: _Entry, state: dict, what: str) -> dict[str, Any]:
    """use_orig_params=False: the states of a flat parameter's original parameters
    turned into this rank's flat shard state."""
    unit = e.unit
    have = [state.get(f) for f in e.fqns]
    gathered = [None if s is None else {n: _load_value(v, f, n, i) for n, v in s.items()}
                for f, s, i in zip(e.fqns, have, unit.infos)]
    names = None
    for f, s in zip(e.fqns, gathered):
        if s is None:
            continue
        if names is None:
            names = set(s)
        elif set(s) != names:
            raise ValueError(
                f"Differing optimizer state names for the unflattened parameters: {e.fqns} (cfsdp: "
                f"FullyShardedDataParallel.{what}: '{f}' has optimizer states {sorted(s)} but an "
                f"earlier parameter of its unit has {sorted(names)}; all parameters of a unit "
                "need the same state names.)"
            )
    out: dict[str, Any] = {}
    lay = unit.layout
    for name in sorted(names or ()):
        vals = [None if s is None else s[name] for s in gathered]
        present = [v for v in vals if v is not None]
        if not (all(_is_pos_dim(v) for v in present) or all(_is_zero_dim(v) for v in present)
                or all(not torch.is_tensor(v) for v in present)):
            raise ValueError(
                f"Differing optimizer state types for state {name}, values {present}, and "
                f"unflattened parameter names {e.fqns} (cfsdp: FullyShardedDataParallel.{what}: "
                "give every parameter of the unit the same kind of state.)"
            )
        if all(_is_pos_dim(v) for v in present):
            dtypes = {v.dtype for v in present}
            if len(dtypes) != 1:
                f, v = next((f, v) for f, v in zip(e.fqns, vals)
                            if v is not None and v.dtype != present[0].dtype)
                raise ValueError(
                    "All unflattened parameters comprising a single flat parameter must have "
                    f"positive-dimension tensor state with the same dtype but got dtypes {dtypes} "
                    f"for state {name} and unflattened parameter names {e.fqns} (cfsdp: optimizer "
                    f"state '{name}' of '{f}' is {v.dtype} but "
                    f"{present[0].dtype} for other parameters of its unit; one dtype per state and "
                    "unit is needed.)"
                )
            dtype = present[0].dtype
            flat = torch.zeros(lay.flat_numel, dtype=dtype, device=unit.device)
            for f, v, info, off in zip(e.fqns, vals, unit.infos, lay.offsets):
                if v is None:
                    continue
                _check_shape(v, f, name, info.shape)
                info.view(flat[off : off + info.numel]).copy_(v)
            if unit.sharded:
                lo, hi = lay.shard_range(unit.rank)
                shard = torch.zeros(lay.shard_numel, dtype=dtype, device=unit.device)
                hi2 = min(hi, lay.flat_numel)
                if hi2 > lo:
                    shard[: hi2 - lo].copy_(flat[lo:hi2])
                flat = shard
            out[name] = flat
        elif all(_is_zero_dim(v) for v in present):
            values = {None if v is None else v.item() for v in vals}
            dtypes = {None if v is None else v.dtype for v in vals}
            if len(present) != len(vals) or len(values) != 1 or len(dtypes) != 1:
                raise ValueError(
                    "All unflattened parameters comprising a single flat parameter must have "
                    f"scalar state with the same value and dtype but got values {values} and "
                    f"dtypes {dtypes} for state {name} and unflattened parameter names {e.fqns} "
                    f"(cfsdp: FullyShardedDataParallel.{what}: the parameters of one unit must "
                    f"share one value of '{name}'.)"
                )
            out[name] = torch.tensor(values.pop(), dtype=dtypes.pop())
        else:
            if len(present) != len(vals) or len(set(vals)) != 1:
                raise ValueError(
                    "All unflattened parameters comprising a single flat parameter must have "
                    f"scalar state with the same value and dtype but got values {set(vals)} for "
                    f"state {name} and  unflattened parameter names {e.fqns} (cfsdp: "
                    f"FullyShardedDataParallel.{what}: the parameters of one unit must share one "
                    f"value of '{name}'.)"
                )
            out[name] = present[0]
    return out


def _flatten_orig(e: _Entry, state: dict) -> dict[str, Any]:
    """use_orig_params=True: this rank's slice of one original parameter's state
    ({} when the rank holds none of it)."""
    unit = e.unit
    info = unit.infos[e.index]
    fqn = e.fqns[0]
    full = {n: _load_value(v, fqn, n, info) for n, v in state.items()}
    for n, v in full.items():
        if _is_pos_dim(v):
            _check_shape(v, fqn, n, info.shape)
    if not state:
        return {}
    if not unit.sharded:
        return full
    sl = unit.layout.slices[unit.rank][e.index]
    if sl.numel == 0:
        return {}
    return {
        n: (info.flat(v)[sl.param_start : sl.param_start + sl.numel].to(unit.device).clone()
            if _is_pos_dim(v) else v)
        for n, v in full.items()
    }


def _load(osd: dict, model, optim, optim_input, *, rank0_only: bool, group, what: str) -> dict:
    view = _View(model, group, what)
    if rank0_only:
        osd = _broadcast_from_rank0(view, osd if view.rank == 0 else {}, what)
    if "state" not in osd:
        raise ValueError(
            _NO_STATE + f' (cfsdp: FullyShardedDataParallel.{what}: the optimizer state dict has '
            'no "state".)'
        )
    state = osd["state"]
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise ValueError(
            f"FullyShardedDataParallel.{what}: optimizer state keys must be parameter FQNs, got "
            f"{bad[0]!r}. Convert an id-keyed dict with rekey_optim_state_dict(..., "
            "OptimStateKeyType.PARAM_NAME, model) first."
        )
    unknown = [k for k in state if k not in view.by_fqn]
    if unknown:
        raise ValueError(
            f"FullyShardedDataParallel.{what}: the optimizer state dict has state for "
            f"'{unknown[0]}', which is not a parameter of the model (expected names such as "
            f"{list(view.by_fqn)[:4]}). Was it saved from a different model?"
        )
    key_of = view.param_of_key(optim, optim_input, what)
    id_of = {id(e.param): pid for pid, e in key_of.items()}
    known_in_groups = {f for g in osd.get("param_groups", []) for f in g["params"]}
    missing = [f for e in key_of.values() for f in e.fqns if f not in known_in_groups]
    if "param_groups" in osd and missing:
        raise ValueError(
            f"FullyShardedDataParallel.{what}: the optimizer holds '{missing[0]}', which no "
            "param_group of the optimizer state dict lists; the state dict was saved for a "
            "different model or optimizer."
        )
    for f in known_in_groups:
        if f not in view.by_fqn:
            raise ValueError(
                f"FullyShardedDataParallel.{what}: a param_group of the optimizer state dict "
                f"lists '{f}', which is not a parameter of the model."
            )

    flat_state: dict[Any, Any] = {}
    for p, e in view.entries.items():
        if e.fqns[0] not in state:
            continue
        if e.unit is None:
            # copies: the optimizer keeps what it loads and steps it in place
            s = {n: v.detach().clone() if torch.is_tensor(v) else v for n, v in state[e.fqns[0]].items()}
            for n, v in s.items():
                if _is_pos_dim(v):
                    _check_shape(v, e.fqns[0], n, p.shape)
        elif view.use_orig_params:
            s = _flatten_orig(e, state[e.fqns[0]])
            if not s:
                continue
        else:
            s = _flatten_flat(view, e, state, what)
        pid = id_of.get(id(p))
        if pid is not None:
            flat_state[pid] = s
    groups_out = []
    name_to_pid = {f: pid for pid, e in key_of.items() for f in e.fqns}
    for g in osd.get("param_groups", []):
        g2 = copy.deepcopy({n: v for n, v in g.items() if n != "params"})
        pids = sorted({name_to_pid[f] for f in g["params"] if f in name_to_pid})
        groups_out.append(_with_params(g, g2, pids))
    res: dict[str, Any] = {"state": flat_state}
    if "param_groups" in osd:
        res["param_groups"] = groups_out
    return res


# ---------------------------------------------------------------------------
# the eight methods
# ---------------------------------------------------------------------------


def _settings(model):
    return get_state_dict_type(wrappers_in(model))


def optim_state_dict(model, optim, optim_state_dict=None, group=None) -> dict[str, Any]:
    """The optimizer state dict of ``model`` keyed by original FQNs, following the
    model's ``optim_state_dict_config`` (torch FSDP1's contract): FULL_STATE_DICT
    gives full tensors (``rank0_only``: other ranks get ``{}``; ``offload_to_cpu``:
    CPU copies); SHARDED_STATE_DICT and LOCAL_STATE_DICT give dim-0 chunks as
    ``ShardedTensor`` (``DTensor`` with a device mesh).  Collective over the
    wrappers' process group."""
    settings = _settings(model)
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    cfg = settings.optim_state_dict_config
    return _save(
        model, optim, optim_state_dict, group, shard=not full,
        rank0_only=full and getattr(cfg, "rank0_only", False),
        offload=getattr(cfg, "offload_to_cpu", True), optim_input=None, what="optim_state_dict",
    )


def optim_state_dict_to_load(
    model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None
) -> dict[str, Any]:
    """Convert a dict from :func:`optim_state_dict` (of any cfsdp or torch FSDP1 model
    with the same FQNs, full or sharded per the model's settings) to what ``optim``
    loads; with ``load_directly`` also load it.  Collective."""
    if is_named_optimizer:
        raise NotImplementedError(
            "FullyShardedDataParallel.optim_state_dict_to_load(is_named_optimizer=True) "
            "(NamedOptimizer / KeyedOptimizer) is not supported by cfsdp yet."
        )
    settings = _settings(model)
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    rank0_only = full and getattr(settings.optim_state_dict_config, "rank0_only", False)
    res = _load(optim_state_dict, model, optim, None, rank0_only=rank0_only, group=group,
                what="optim_state_dict_to_load")
    if load_directly:
        optim.load_state_dict(res)
    return res


def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
    """Deprecated in torch for :func:`optim_state_dict`: the full optimizer state dict
    (CPU tensors), on rank 0 only unless ``rank0_only=False``.  ``optim_input``
    (deprecated) gives the parameter order instead of ``optim``."""
    _warn_legacy("full_optim_state_dict", "optim_state_dict")
    _warn_optim_input(optim_input)
    return _save(model, optim, None, group, shard=False, rank0_only=rank0_only, offload=True,
                 optim_input=optim_input, what="full_optim_state_dict")


def sharded_optim_state_dict(model, optim, group=None):
    """Deprecated in torch for :func:`optim_state_dict`: the sharded optimizer state
    dict (dim-0 chunks as ShardedTensor) whatever the state-dict type."""
    _warn_legacy("sharded_optim_state_dict", "optim_state_dict")
    return _save(model, optim, None, group, shard=True, rank0_only=False, offload=True,
                 optim_input=None, what="sharded_optim_state_dict")


def shard_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None):
    """Deprecated in torch for :func:`optim_state_dict_to_load`: this rank's part of a
    full optimizer state dict (every rank holds it), keyed by ``optim``'s ids (or
    ``optim_input``'s, or the model's ``parameters()`` order)."""
    _warn_legacy("shard_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    return _load(full_optim_state_dict, model, optim, optim_input, rank0_only=False, group=None,
                 what="shard_full_optim_state_dict")


def flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim):
    """Deprecated in torch for :func:`optim_state_dict_to_load`: this rank's part of a
    sharded optimizer state dict from :func:`sharded_optim_state_dict`."""
    _warn_legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    return _load(sharded_optim_state_dict, model, optim, None, rank0_only=False, group=None,
                 what="flatten_sharded_optim_state_dict")


def scatter_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None, group=None):
    """Deprecated in torch for :func:`optim_state_dict_to_load`: as
    :func:`shard_full_optim_state_dict` but only rank 0 needs the full dict (others
    may pass None); it is broadcast over ``group``."""
    _warn_legacy("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    return _load(full_optim_state_dict, model, optim, optim_input, rank0_only=True, group=group,
                 what="scatter_full_optim_state_dict")


def rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, optim_input=None, optim=None):
    """Re-key an optimizer state dict by parameter names (``OptimStateKeyType.PARAM_NAME``)
    or by ids (``PARAM_ID``) of ``optim`` (or ``optim_input``, or ``model.parameters()``),
    as torch FSDP1; works for wrapped and unwrapped models, without communication."""
    if optim_state_key_type not in (OptimStateKeyType.PARAM_NAME, OptimStateKeyType.PARAM_ID):
        raise OptimStateDictError(
            "Expected optim_state_key_type to be PARAM_NAME or PARAM_ID, got "
            f"{optim_state_key_type} (cfsdp: pass OptimStateKeyType.PARAM_NAME or "
            "OptimStateKeyType.PARAM_ID.)"
        )
    _warn_optim_input(optim_input)
    osd = optim_state_dict
    kinds = {type(k) for k in osd["state"]}
    if len(kinds) > 1 or (kinds and not kinds <= {str, int}):
        raise ValueError(f"Invalid parameter keys: {osd['state'].keys()}")
    if (optim_state_key_type == OptimStateKeyType.PARAM_NAME and kinds == {str}) or (
        optim_state_key_type == OptimStateKeyType.PARAM_ID and kinds == {int}
    ):
        return osd
    names = _param_names(model)
    if optim is not None and optim_input is None:
        params = [p for g in optim.param_groups for p in g["params"]]
    else:
        params = _params_from_optim_input(list(names), optim_input)
    for p in params:
        if p not in names:
            raise ValueError(
                f"rekey_optim_state_dict: the optimizer holds a parameter of shape "
                f"{tuple(p.shape)} that is not a parameter of the model."
            )
    out: dict[str, Any] = {}
    if optim_state_key_type == OptimStateKeyType.PARAM_NAME:
        id_to_name = [names[p] for p in params]
        for k in osd["state"]:
            if not 0 <= k < len(id_to_name):
                raise ValueError(
                    f"rekey_optim_state_dict: state key {k} is not a parameter id of the optimizer "
                    f"(it has {len(id_to_name)} parameters)."
                )
        out["state"] = {id_to_name[k]: v for k, v in osd["state"].items()}
        convert = lambda ps: sorted(id_to_name[k] for k in ps)  # noqa: E731
    else:
        name_to_id = {names[p]: i for i, p in enumerate(params)}
        for k in list(osd["state"]) + [n for g in osd.get("param_groups", []) for n in g["params"]]:
            if k not in name_to_id:
                raise ValueError(
                    f"rekey_optim_state_dict: '{k}' is not the name of a parameter the optimizer "
                    f"holds (names: {list(name_to_id)[:4]}...)."
                )
        out["state"] = {name_to_id[k]: v for k, v in osd["state"].items()}
        convert = lambda ps: sorted(name_to_id[k] for k in ps)  # noqa: E731
    if "param_groups" in osd:
        groups = []
        for g in osd["param_groups"]:
            g2 = copy.deepcopy({n: v for n, v in g.items() if n != "params"})
            groups.append(_with_params(g, g2, convert(g["params"])))
        out["param_groups"] = groups
    return out


def _param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's first clean FQN (a flat parameter: its first original one)."""
    if wrappers_in(model):
        return {p: e.fqns[0] for p, e in _View(model, None, "rekey_optim_state_dict").entries.items()}
    return {p: clean_tensor_name(n) for n, p in model.named_parameters()}
