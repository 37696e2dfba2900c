"""The wrapper face: ``FullyShardedDataParallel``, torch FSDP1's API on cfsdp's runtime.

A wrapper owns at most one unit (the parameters of its module that no nested
wrapper manages and that are not ignored) and one ``UnitState``.  The first
wrapper whose forward runs becomes the root of every wrapper below it.  Names
follow torch FSDP1 exactly (see ``cfsdp._state_dict``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import os
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP
from torch.distributed.tensor import DTensor, Replicate as DReplicate, Shard as DShard
from torch.distributed.fsdp import wrap as _torch_wrap

from ._runtime import agree as _agree
from ._runtime import clip as _clip
from ._runtime.hooks import (
    BACKWARD_POST,
    BACKWARD_PRE,
    UnitState,
    cast_floating,
    check_can_summon,
    lazy_init_root,
)
from ._runtime.replaced import check_plain_param, replaced_fqn, taken_by_wrapper
from ._runtime.base import TrainingState, wrappers_in
from ._runtime.flat.layout import flatten_error, scalar_param_message
from ._runtime.flat.streams import FlatStreams
from ._runtime.flat.unit import Unit
from ._compile import dynamo_disable, dynamo_skip_frame
from ._docs import adopt_class_docs
from ._fqn import CHECKPOINT_WRAPPED_MODULE, FSDP_PREFIX, clean_tensor_name, full_name, join_fqn
from ._internals import FSDP1 as _FSDP1_INTERNALS
from ._internals import HANDLE, HANDLE_DEFAULT, no_torch_internal
from ._torch.fsdp1 import ActivationWrapper, init_intra_and_inter_node_groups, override_module_mixed_precision
from ._torch.fsdp1 import LOW_PRECISION_HOOKS as _LOW_PRECISION_HOOKS
from ._torch.fsdp1 import TrainingState as _TorchTrainingState
from . import _optim_state_dict as _osd
from . import _state_dict as _sd
from .api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = ["FullyShardedDataParallel"]

# Set while an auto-wrap policy creates the nested wrappers of one root: the
# root's ignored parameters (the children must not manage them either).
_AUTO_WRAP_IGNORED: contextvars.ContextVar[Optional[frozenset]] = contextvars.ContextVar(
    "cfsdp_auto_wrap_ignored", default=None
)
# ... and that root's module (errors in the nested units name FQNs from it)
_AUTO_WRAP_ROOT: contextvars.ContextVar[Optional[nn.Module]] = contextvars.ContextVar(
    "cfsdp_auto_wrap_root", default=None
)

class WrongTypeError(ValueError):
    """A wrong type in an argument's entries.  torch's FSDP1 raises ``ValueError``
    there (``_init_utils._get_ignored_modules`` / ``_get_ignored_params``), so this is
    one: code written against torch keeps catching it."""


class NoProcessGroupError(ValueError):
    """No default process group: torch raises ``ValueError`` (c10d's
    ``_get_default_group``), so this is one."""


class CallStateError(ValueError):
    """A method called in the wrong training state (``no_sync`` inside forward, backward
    or ``summon_full_params``): torch's ``_assert_state`` raises ``ValueError``, so this
    is one."""


class CommHookError(AssertionError):
    """``register_comm_hook`` on a non-root instance or a second time: torch raises
    ``AssertionError``, so this is one."""


class CommHookStrategyError(AssertionError):
    """``register_comm_hook`` with a hybrid strategy: torch raises ``AssertionError``,
    so this is one."""


def _torch_state_message(state: TrainingState) -> str:
    """torch FSDP1's ``_assert_state`` message for a call that needs IDLE, with cfsdp's
    state named as torch's (FORWARD_BACKWARD, SUMMON_FULL_PARAMS)."""
    if state is TrainingState.SUMMON:
        theirs = _TorchTrainingState.SUMMON_FULL_PARAMS
    elif state is TrainingState.IDLE:
        theirs = _TorchTrainingState.IDLE
    else:
        theirs = _TorchTrainingState.FORWARD_BACKWARD
    return f"expected to be in states {[_TorchTrainingState.IDLE]} but current state is {theirs}"


def _not_implemented(what: str, issue: int) -> NotImplementedError:
    return NotImplementedError(
        f"cfsdp.FullyShardedDataParallel: {what} is not implemented yet "
        f"(tracked in issue {issue}; see the compatibility table in README.md)."
    )


_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _default_group() -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise NoProcessGroupError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group. (cfsdp: FullyShardedDataParallel needs a process group: call "
            "torch.distributed.init_process_group(...) first (e.g. with backend='gloo' on CPU "
            "under torchrun), or pass process_group=.)"
        )
    return dist.distributed_c10d._get_default_group()


def _host_name(key: str) -> str:
    return key.split("|", 1)[0]


def _local_world_size(default: dist.ProcessGroup) -> int:
    """Ranks per host: torchrun's ``LOCAL_WORLD_SIZE``, else counted from every rank's
    host key (``_runtime.agree.host_key``, the transports' too).  Every rank must see the
    same count (homogeneous hosts, as torch assumes) and each host must hold consecutive
    ranks (the groups below are built that way)."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    hosts = _agree.agree(default, None, "HYBRID_SHARD: counting the ranks per host",
                         (_agree.host_key(), env))
    keys = [k for k, _ in hosts]
    counts = {k: keys.count(k) for k in keys}
    envs = {e for _, e in hosts}
    if len(envs) == 1 and None not in envs:
        per_node = int(envs.pop())
    elif len(set(counts.values())) == 1:
        per_node = next(iter(counts.values()))
    else:
        raise ValueError(
            "HYBRID_SHARD / _HYBRID_SHARD_ZERO2 with process_group=None needs the same number of "
            f"ranks on every host, but the ranks per host are "
            f"{ {_host_name(k): n for k, n in counts.items()} } (LOCAL_WORLD_SIZE "
            f"{sorted(map(str, envs))}). Pass process_group=(shard_group, replicate_group) or a "
            "2-D device_mesh."
        )
    blocks = [keys[i : i + per_node] for i in range(0, len(keys), per_node)]
    if default.size() % per_node or any(len(set(b)) != 1 for b in blocks) and len(set(keys)) > 1:
        raise ValueError(
            f"HYBRID_SHARD with process_group=None groups ranks [k*{per_node}, (k+1)*{per_node}) "
            f"as hosts, but the world of {default.size()} ranks is laid out as "
            f"{[_host_name(k) for k in keys]}. Launch "
            "the ranks of each host consecutively (torchrun does), or pass the groups."
        )
    return per_node


def _node_groups(device: torch.device) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """HYBRID_SHARD with process_group=None: shard inside a host, replicate across hosts,
    with torch's own group builder.  torch sizes a "node" by the accelerator count, which
    is 1 on CPU ranks: it then shards over one rank, switches to NO_SHARD and drops the
    cross-host all-reduce, so each rank trains alone (measured on torch 2.13).  cfsdp
    takes a CPU host's ranks as its node (``_local_world_size``)."""
    default = _default_group()
    per_node = torch.cuda.device_count() if device.type == "cuda" else _local_world_size(default)
    return init_intra_and_inter_node_groups(default, per_node)


def _resolve_groups(
    process_group, device_mesh, strategy: ShardingStrategy, device: torch.device,
    auto_wrap: bool,
) -> tuple[dist.ProcessGroup, Optional[dist.ProcessGroup]]:
    """``(shard_group, replicate_group)``; the second is None unless hybrid."""
    if device_mesh is not None and process_group is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. Please just pass "
            "only one of them. (cfsdp: pass either process_group or device_mesh to "
            "FullyShardedDataParallel, not both.)"
        )
    hybrid = strategy in _HYBRID
    if device_mesh is not None:
        if hybrid:
            if device_mesh.ndim != 2:
                raise ValueError(
                    f"Expected device_mesh to have ndim=2 but got {device_mesh.ndim} (cfsdp: "
                    f"sharding_strategy={strategy} needs a 2-D device_mesh (replicate, shard).)"
                )
            return device_mesh.get_group(1), device_mesh.get_group(0)
        if device_mesh.ndim != 1:
            raise ValueError(
                f"sharding_strategy={strategy} needs a 1-D device_mesh, got "
                f"{device_mesh.ndim} dimensions; for hybrid sharding use HYBRID_SHARD."
            )
        return device_mesh.get_group(0), None
    if hybrid:
        if isinstance(process_group, tuple) and len(process_group) == 2 and all(
            isinstance(g, dist.ProcessGroup) for g in process_group
        ):
            return process_group[0], process_group[1]
        if process_group is None:
            if not auto_wrap:
                raise ValueError(
                    f"Manual wrapping with {strategy} requires explicit specification of "
                    "process group or device_mesh. (cfsdp: pass process_group=(shard_group, "
                    "replicate_group) or device_mesh=init_device_mesh(..., (replicas, shards)), "
                    "or wrap with an auto_wrap_policy, whose root builds the groups for all "
                    "units.)"
                )
            return _node_groups(device)
        raise ValueError(
            "Expected process_group to be passed in as either None or "
            f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)} (cfsdp: "
            f"sharding_strategy={strategy} expects process_group=(shard_group, "
            "replicate_group) or a 2-D device_mesh.)"
        )
    if isinstance(process_group, tuple):
        raise ValueError(
            "process_group=(shard_group, replicate_group) is only valid with "
            "sharding_strategy=HYBRID_SHARD or _HYBRID_SHARD_ZERO2."
        )
    if process_group is not None:
        return process_group, None
    return _default_group(), None


def _one_rank_no_shard(strategy: ShardingStrategy, group: dist.ProcessGroup,
                       replicate_group: Optional[dist.ProcessGroup]) -> tuple:
    """``(strategy, group, replicate_group)``: as torch, a strategy that shards over one rank
    is NO_SHARD (sharding is a no-op), over the replicate group if that has more ranks.  (The
    stream tests replace it to run the sharded path at world 1.)"""
    if group.size() == 1 and strategy is not ShardingStrategy.NO_SHARD:
        strategy = ShardingStrategy.NO_SHARD
        if replicate_group is not None and replicate_group.size() > 1:
            group, replicate_group = replicate_group, None
    return strategy, group, replicate_group


def _check_args(module, sharding_strategy, mixed_precision, param_init_fn,
                backward_prefetch) -> ShardingStrategy:
    """Types of the constructor's arguments (never silently ignored); the strategy."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}"
        )
    if isinstance(module, _TorchFSDP):
        raise ValueError(
            "cfsdp.FullyShardedDataParallel cannot wrap torch's FullyShardedDataParallel; "
            "use one implementation for the whole model."
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a MixedPrecision or None, got {type(mixed_precision).__name__}"
        )
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(
            f"Expected {param_init_fn} to be callable but got {type(param_init_fn)} (cfsdp: "
            "param_init_fn must be callable (module -> None); checked even when no parameter "
            "is on the meta device.)"
        )
    if backward_prefetch not in (None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST):
        raise ValueError(f"backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}")
    strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(
            f"sharding_strategy must be a ShardingStrategy, got {type(strategy).__name__}"
        )
    return strategy


# torch FSDP1's warning (``_init_utils._warn_cpu_init``) for a module left on the CPU on a
# machine with an accelerator and no device_id: the compute device is the current CUDA device
_CPU_INIT_WARNING = (
    "The passed-in `module` is on CPU and will thus have FSDP's sharding initialization run "
    "on CPU, which may be slower than on GPU. We recommend passing in the `device_id` "
    "argument for FSDP to move `module` to GPU for the sharding initialization. `module` "
    "must also be on GPU device to work with the `sync_module_states=True` flag since that "
    "requires GPU communication.")


def _resolve_device(module: nn.Module, device_id) -> tuple[torch.device, Optional[torch.device]]:
    """``(compute device, where to move the module's CPU states)``, as torch FSDP1
    (``_get_device_from_device_id``, ``_move_module_to_device``, ``_get_compute_device``):
    with ``device_id`` the compute device is that device (CUDA without an index: the
    current one, with torch's warning) and the module's CPU parameters and buffers move
    there; without it, the device of the first parameter not on the CPU (nor meta), else
    the current CUDA device when CUDA is available (nothing moves: torch warns, and a
    parameter still on the CPU is then an error naming it, ``_validate_params``), else the
    CPU."""
    if device_id is None:
        for p in module.parameters():
            if p.device.type not in ("meta", "cpu"):
                return p.device, None
        if torch.cuda.is_available():
            if any(p.device.type == "cpu" for p in module.parameters()):
                warnings.warn(_CPU_INIT_WARNING, stacklevel=3)
            return torch.device("cuda", torch.cuda.current_device()), None
        return torch.device("cpu"), None
    device = _device_of_id(device_id)
    return device, device


def _device_of_id(device_id) -> torch.device:
    if isinstance(device_id, int):
        device = torch.device("cuda", device_id)
    elif isinstance(device_id, (str, torch.device)):
        device = torch.device(device_id)
    else:
        raise TypeError(
            f"device_id must be an int, a torch.device or None, got {type(device_id).__name__}"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device_id={device_id!r} asks for CUDA, but CUDA is not available on this "
            "machine. Pass device_id=torch.device('cpu') (or leave it None) for CPU ranks."
        )
    if device.type == "cuda" and device.index is None:
        current = torch.device("cuda", torch.cuda.current_device())
        warnings.warn(  # torch's words (_get_device_from_device_id)
            f"FSDP got the argument `device_id` {device_id} on rank {_rank_or_0()}, which "
            f"does not have an explicit index. FSDP will use the current device "
            f"{current.index}. If this is incorrect, please explicitly call "
            f"`torch.cuda.set_device()` before FSDP initialization or pass in the explicit "
            f"device index as the `device_id` argument.", stacklevel=4)
        device = current
    if device.type != "cpu" and device.type != "cuda":
        raise ValueError(
            f"device_id={device_id!r}: cfsdp runs on 'cpu' or 'cuda' devices."
        )
    if device.type == "cpu":
        # every spelling of the one CPU ("cpu", "cpu:0", torch.device("cpu", 0)) is the
        # device CPU tensors are on (torch's FSDP1 rejects the indexed ones; accelerate
        # passes "cpu:0")
        return torch.device("cpu")
    return device


def _ignored_params_and_modules(
    module: nn.Module, ignored_modules, ignored_states
) -> tuple[set[nn.Parameter], set[nn.Module]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just "
            "pass ignored_states. (cfsdp: ignored_states takes modules too.)"
        )
    mods: list[nn.Module] = []
    params: set[nn.Parameter] = set()
    submodules = set(module.modules())
    all_params = set(module.parameters())
    if ignored_modules is not None:
        entries = list(ignored_modules)
        for i, m in enumerate(entries):
            if not isinstance(m, nn.Module):
                raise WrongTypeError(
                    "ignored_modules expects nn.Module list elements but got types "
                    f"{_sorted_types(entries)} (cfsdp: entry {i} is a {type(m).__name__})"
                )
            mods.append(m)
    if ignored_states is not None:
        states = list(ignored_states)
        if states and all(isinstance(s, nn.Parameter) for s in states):
            for s in states:
                if s not in all_params:
                    raise ValueError(
                        "ignored_states contains a parameter of shape "
                        f"{tuple(s.shape)} that is not a parameter of the wrapped module."
                    )
                params.add(s)
        elif all(isinstance(s, nn.Module) for s in states):
            mods.extend(states)
        else:
            raise WrongTypeError(
                "ignored_states expects all nn.Parameter or all nn.Module list elements but got "
                f"types {_sorted_types(states)} (cfsdp: pass only parameters or only modules; "
                "the modules' parameters are ignored with them.)"
            )
    for i, m in enumerate(mods):
        if isinstance(m, (FullyShardedDataParallel, _TorchFSDP)):
            raise ValueError(
                "`ignored_modules` should not include FSDP modules (cfsdp: ignored module "
                f"{i} is a {type(m).__name__}; ignore the module it wraps instead.)"
            )
        if m not in submodules:
            raise ValueError(
                f"ignored module {i} ({type(m).__name__}) is not a submodule of the module "
                f"being wrapped ({type(module).__name__}). Pass only its own submodules."
            )
    ignored_mods = {c for m in mods for c in m.modules()}
    for m in ignored_mods:
        params.update(m.parameters(recurse=False))
    return params, ignored_mods


def _sorted_types(entries: list) -> list[type]:
    """The entries' types as torch's FSDP1 lists them in its messages."""
    return sorted({type(e) for e in entries}, key=repr)


def _materialize(module, param_init_fn, ignored_params, ignored_mods, device,
                 use_orig_params: bool) -> None:
    """Deferred initialisation, torch's rules: if this unit's parameters (or
    any buffer outside ignored modules) are on the meta device, materialise the
    modules of this unit (breadth first, stopping at nested units and ignored
    modules) with ``param_init_fn(module)``, or else ``to_empty`` +
    ``reset_parameters()`` on each module that holds state directly.  With
    auto-wrapping, inner units are materialised and sharded first, so the peak
    is about one unit at full size plus the shards."""
    managed = [
        p for p in module.parameters()
        if p not in ignored_params and not getattr(p, "_cfsdp_flattened", False)
    ]
    is_meta = any(p.is_meta for p in managed) or any(
        b.is_meta for m in module.modules() if m not in ignored_mods for b in m.buffers(recurse=False)
    )
    if not is_meta:
        return
    order = [module]
    seen = {module}
    i = 0
    while i < len(order):
        for child in order[i].children():
            if child not in seen and not isinstance(child, FullyShardedDataParallel) and child not in ignored_mods:
                seen.add(child)
                order.append(child)
        i += 1
    names = {m: n for n, m in module.named_modules()}
    with torch.no_grad():
        for m in order:
            if param_init_fn is not None:
                param_init_fn(m)
                continue
            if not any(True for _ in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False))):
                continue
            if not callable(getattr(m, "reset_parameters", None)):
                raise ValueError(
                    f"Module '{clean_tensor_name(names.get(m, ''))}' ({type(m).__name__}) is on the "
                    "meta device but has no reset_parameters() to initialise it after "
                    "to_empty(). Give it one, or pass param_init_fn=."
                )
            m.to_empty(device=device, recurse=False)
            m.reset_parameters()
    for name, p in module.named_parameters():
        if p.is_meta and p not in ignored_params:
            detail = (
                f"'{clean_tensor_name(name)}' is still on the meta device after deferred "
                "initialisation; param_init_fn must materialise every parameter of the module "
                "it is given (e.g. module.to_empty(device=..., recurse=False))."
            )
            # torch fails later, building the flat parameter over meta and real tensors
            now = [q for q in module.parameters()
                   if q not in ignored_params and not getattr(q, "_cfsdp_flattened", False)]
            err = flatten_error(now, use_orig_params)
            if err is not None and err[0].startswith("Must flatten tensors on the same device"):
                raise ValueError(f"{err[0]} (cfsdp: parameter {detail})")
            raise ValueError(f"Parameter {detail}")


def _check_not_shared_with_other_units(module: nn.Module, ignored: set) -> None:
    """A parameter already managed by another (earlier-wrapped) unit that this
    unit's own modules also use: torch's FSDP supports tied parameters only
    within one unit, so say which and what to do rather than train wrongly (torch's
    FSDP1 fails in forward: a shape error, or freed storage)."""
    stack = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        # use_orig_params=False: the other unit left views of its flat parameter in the
        # module's __dict__ where its parameters were
        shared = taken_by_wrapper(mod)
        for name, p in mod._parameters.items():
            if p is None or p in ignored or name == "_flat_param":
                continue
            if replaced_fqn(p) is not None or getattr(p, "_cfsdp_flattened", False):
                shared.append(name)
        if shared:
            raise ValueError(
                f"Parameter '{clean_tensor_name(join_fqn(prefix, shared[0]))}' of "
                f"{type(mod).__name__} (in the {type(module).__name__} being wrapped) is shared "
                "with a module that another FullyShardedDataParallel unit already manages (tied "
                "weights across units). Tied parameters must live in one unit: wrap their "
                "lowest common ancestor instead (e.g. leave the embedding and the output head "
                "to the root unit)."
            )
        for cname, child in mod._modules.items():
            if child is not None and not isinstance(child, FullyShardedDataParallel):
                stack.append((join_fqn(prefix, cname), child))


def tp_root_mesh(device_mesh, strategy: ShardingStrategy):
    """The 2-D (dp, tp) mesh ``device_mesh`` is the dp slice of (its first dimension), for a
    strategy that shards over it alone; else None.  torch FSDP1 turns its DTensor extension
    on for any sliced ``device_mesh``: tensor-parallel parameters are then flattened through
    their local tensors and sharded state dicts hold DTensors on this root mesh."""
    if device_mesh is None or strategy in _HYBRID or device_mesh.ndim != 1:
        return None
    root = device_mesh._get_root_mesh()
    if root is device_mesh or root.ndim != 2 or root.mesh_dim_names is None:
        return None
    if device_mesh.mesh_dim_names != root.mesh_dim_names[:1]:
        return None
    return root


def _check_tp_param(p: DTensor, fqn: str, device_mesh, strategy: ShardingStrategy) -> None:
    """A tensor-parallel parameter the wrapper can shard ([Note: tensor-parallel wrapper units]
    in ``_runtime/flat/unit.py``): ``device_mesh`` is the dp slice of a 2-D (dp, tp) mesh whose tp
    slice the parameter lives on, with Shard/Replicate placements, materialised."""
    what = (f"FullyShardedDataParallel: parameter '{fqn}' is a DTensor (placements {p.placements} "
            f"on {p.device_mesh}), e.g. from tensor parallelism (parallelize_module)")
    if strategy in _HYBRID:
        raise NotImplementedError(
            f"{what}; cfsdp's wrapper does not combine {strategy} with tensor parallelism. Use "
            "FULL_SHARD or SHARD_GRAD_OP with device_mesh=mesh['dp'], or fully_shard on a 3-D "
            "mesh (replicate, shard, tp) for HSDP x TP.")
    root = tp_root_mesh(device_mesh, strategy)
    if root is None:
        raise NotImplementedError(
            f"{what}. The wrapper shards tensor-parallel parameters as torch's FSDP1 does: with "
            "device_mesh=mesh['dp'], the dp slice of the 2-D DeviceMesh (dp, tp) whose "
            "mesh['tp'] the model was parallelized on (got "
            f"{'process_group=' if device_mesh is None else f'device_mesh={device_mesh}'}). "
            "Pass that device_mesh instead.")
    tp = p.device_mesh
    if tp.ndim != 1 or tp._get_root_mesh() != root or tp.mesh_dim_names != root.mesh_dim_names[1:]:
        raise ValueError(
            f"{what}, which is not the tp slice {root.mesh_dim_names[1:]} of the wrapper's mesh "
            f"{root}. Take both from one DeviceMesh: mesh['dp'] for the wrapper and mesh['tp'] "
            "for parallelize_module.")
    for pl in p.placements:
        if type(pl) not in (DShard, DReplicate):
            raise NotImplementedError(
                f"{what}; cfsdp's wrapper shards tensor-parallel parameters placed Shard(d) or "
                f"Replicate() on the TP mesh, not {pl}.")
    if p._local_tensor.is_meta:
        raise NotImplementedError(
            f"{what} on the meta device; deferred initialisation of tensor-parallel parameters "
            "is not supported by cfsdp's wrapper. Materialise the model (to_empty + "
            "reset_parameters) before wrapping it.")


def _rank_or_0() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _states_to_move(module: nn.Module, ignored_params: set, ignored_mods) -> tuple[list, list]:
    """The CPU parameters and buffers of ``module`` a ``device_id`` moves (torch FSDP1's
    ``_move_module_to_device``: breadth first, not into wrappers already nested inside,
    whose own ``device_id`` moved them), except the ignored ones; states on another device
    stay (and are an error naming them, ``_validate_params``)."""
    ignored_bufs = {id(b) for m in ignored_mods for b in m.buffers()}
    queue, params, bufs = [module], [], []
    while queue:
        m = queue.pop(0)
        params += [p for p in m.parameters(recurse=False)
                   if p.device.type == "cpu" and p not in ignored_params]
        bufs += [b for b in m.buffers(recurse=False)
                 if b.device.type == "cpu" and id(b) not in ignored_bufs]
        queue += [c for c in m.children() if not isinstance(c, FullyShardedDataParallel)]
    return params, bufs


def _move_states(module: nn.Module, ignored_params: set, ignored_mods, device: torch.device
                 ) -> None:
    """``_states_to_move`` moved to ``device`` as ``nn.Module.to`` moves them (``.data``, the
    gradients too: torch's ``_move_states_to_device``)."""
    if device.type == "cpu":
        return
    params, bufs = _states_to_move(module, ignored_params, ignored_mods)
    with torch.no_grad():
        for p in params:
            p.data = p.to(device)
            if p.grad is not None:
                p.grad.data = p.grad.to(device)
    for b in bufs:
        b.data = b.to(device)


def _validate_params(module: nn.Module, ignored: set, device: torch.device, device_mesh,
                     strategy: ShardingStrategy) -> None:
    """Check every parameter the wrapper tree will shard, naming it by FQN."""
    for name, p in module.named_parameters():
        if p in ignored or getattr(p, "_cfsdp_flattened", False):
            continue
        fqn = clean_tensor_name(name)
        if isinstance(p, DTensor):
            _check_tp_param(p, fqn, device_mesh, strategy)
        check_plain_param(p, fqn, "FullyShardedDataParallel", tp_ok=isinstance(p, DTensor))
        if p.device.type == "meta":
            continue  # materialised unit by unit (deferred initialisation)
        # scalar and non-floating parameters: checked unit by unit, as torch (_init_param_handle)
        if p.device != device:
            raise ValueError(  # torch's words first (_check_flat_params_on_expected_device)
                f"An FSDP-managed module unexpectedly has parameters on {p.device}. Make sure "
                f"to move the module to {device} before training. Parameter '{fqn}' is on "
                f"{p.device} but FSDP runs on {device}: move the module to {device} before "
                f"wrapping, or pass device_id={device} so FSDP moves it."
            )


def _check_not_scalar(module: nn.Module, managed: list[nn.Parameter]) -> None:
    """torch's ``_verify_managed_params``, at its point (after deferred initialisation,
    before ``sync_module_states``): a 0-dim parameter of this unit is named relative to
    the module being wrapped."""
    for p in managed:
        if p.dim() == 0:
            name = next(n for n, q in module.named_parameters() if q is p)
            root = _AUTO_WRAP_ROOT.get() or module
            fqn = next((n for n, q in root.named_parameters() if q is p), name)
            raise ValueError(scalar_param_message(name, full_name(root, fqn, known=fqn)))


def _annotate_modules_for_dynamo(
    module: nn.Module, ignored_modules: set[nn.Module], use_orig_params: bool
) -> None:
    """Mark every module of ``module``'s tree but the ignored ones as FSDP-managed,
    exactly as torch's FSDP1 does before auto-wrapping (so the root wrapper itself
    and wrappers an auto-wrap policy creates are not marked; hand-nested inner
    wrappers are).  torch.compile (Dynamo) reads ``_is_fsdp_managed_module`` to
    trace these modules as unspecialized (parameters as graph inputs, re-read on
    every call, so the per-forward parameter views are used) and
    ``_fsdp_use_orig_params`` to accept only ``use_orig_params=True``."""
    for sub in module.modules():
        if sub not in ignored_modules:
            sub._is_fsdp_managed_module = True  # type: ignore[assignment]
            sub._fsdp_use_orig_params = use_orig_params  # type: ignore[assignment]


class FlatParamHandle:
    """``wrapper._handle``: the members of torch FSDP1's ``FlatParamHandle`` that mean
    something for a cfsdp unit (README.md, "torch's private FSDP names").  Any other is an
    ``AttributeError`` naming it and what to use instead (``cfsdp/_internals.py``)."""

    __slots__ = ("_wrapper",)

    def __init__(self, wrapper: "FullyShardedDataParallel"):
        self._wrapper = wrapper

    @property
    def _unit(self) -> Unit:
        return self._wrapper._state.unit

    @property
    def flat_param(self) -> nn.Parameter:
        """The wrapper's flat parameter (``wrapper._flat_param``): this rank's shard
        between steps, its ``_fqns`` the original parameters' names, as torch's."""
        return self._unit.flat_param

    @property
    def _offload_params(self) -> bool:
        return bool(self._wrapper.cpu_offload.offload_params)

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        """The dtype of the unit's parameters (its shard)."""
        return self._unit.dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, dtype: torch.dtype) -> None:
        """accelerate's upcast of a low-precision model: it sets ``flat_param.data =
        flat_param.data.to(torch.float32)``, then this to float32.  The unit takes the flat
        parameter's new data over as its shard (what the optimizer steps), and keeps
        computing and reducing in the dtypes it has (the mixed-precision ones given, else the
        parameters' dtype before the upcast), as torch's FSDP1 does: its lazy initialisation
        refreshes those only when the flat parameter's dtype differs from
        ``_orig_param_dtype``, which accelerate has just made equal."""
        w, u = self._wrapper, self._unit
        if w._state.training_state is not TrainingState.IDLE:
            raise CallStateError(
                f"{_torch_state_message(w._state.training_state)} (cfsdp: _handle."
                f"_orig_param_dtype set while {w._state.name}'s unit is inside forward/backward "
                "or summon_full_params; set it between training steps.)")
        u.adopt_flat_data(keep_dtypes=True)
        if dtype != u.dtype:
            raise ValueError(
                f"cfsdp: _handle._orig_param_dtype = {dtype}, but {w._state.name}'s flat "
                f"parameter holds {u.dtype}: set flat_param.data to a {dtype} tensor first "
                "(as accelerate does), or convert the model with model.to(dtype).")

    def reshard(self, free_unsharded_flat_param: bool) -> None:
        """torch's ``FlatParamHandle.reshard``: the parameters point at this rank's shard
        again (verl calls it on the root after a ``no_grad`` forward, where torch keeps the
        root's full parameters; cfsdp already resharded it).  cfsdp always frees the
        unsharded buffer (torch keeps its memory with ``False``; the numbers are the same)."""
        w = self._wrapper
        if w._state.training_state is not TrainingState.IDLE:
            raise CallStateError(
                f"{_torch_state_message(w._state.training_state)} (cfsdp: _handle.reshard() "
                f"called while {w._state.name}'s unit is inside forward/backward or "
                "summon_full_params; call it between training steps.)")
        self._unit.reshard()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise no_torch_internal(type(self).__name__, name, "FlatParamHandle",
                                HANDLE.get(name, HANDLE_DEFAULT))


class FullyShardedDataParallel(nn.Module):
    """Drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel``.

    Same constructor, same names, same numbers.  See the README's compatibility
    table for which arguments are implemented; the others raise
    ``NotImplementedError`` naming the argument.
    """

    _cfsdp_is_wrapper = True  # found by base.wrappers_in (base.WRAPPER_CLASS_MARK)

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload: Optional[CPUOffload] = None,
        auto_wrap_policy=None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Optional[MixedPrecision] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id=None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states=None,
        device_mesh=None,
    ):
        super().__init__()
        # The phases of torch's FSDP1 constructor (_init_utils), in its order.
        strategy = _check_args(module, sharding_strategy, mixed_precision, param_init_fn,
                               backward_prefetch)
        device, move_to = _resolve_device(module, device_id)
        strategy, group, replicate_group, process_group = self._init_process_group(
            process_group, device_mesh, strategy, device, cpu_offload, auto_wrap_policy)
        ignored_params, ignored_mods = self._init_ignored_states(
            module, ignored_modules, ignored_states, device, move_to, use_orig_params, device_mesh,
            strategy)
        self._init_core_state(module, strategy, group, replicate_group, device, device_mesh,
                              mixed_precision, cpu_offload, backward_prefetch, forward_prefetch,
                              limit_all_gathers, use_orig_params)
        if auto_wrap_policy is not None:
            self._auto_wrap(
                module,
                auto_wrap_policy,
                ignored_params,
                ignored_mods,
                dict(
                    process_group=process_group,
                    sharding_strategy=sharding_strategy,
                    cpu_offload=cpu_offload,
                    backward_prefetch=backward_prefetch,
                    mixed_precision=mixed_precision,
                    param_init_fn=param_init_fn,
                    device_id=device_id,
                    sync_module_states=sync_module_states,
                    forward_prefetch=forward_prefetch,
                    limit_all_gathers=limit_all_gathers,
                    use_orig_params=use_orig_params,
                    device_mesh=device_mesh,
                ),
            )
        self._init_param_handle(module, param_init_fn, sync_module_states, mixed_precision)
        self._init_state_dict_state(module)

    # ----------------------------------------------------------------- init
    def _init_process_group(self, process_group, device_mesh, strategy: ShardingStrategy,
                            device: torch.device, cpu_offload, auto_wrap_policy):
        """The shard and replicate groups (a strategy over one rank becomes NO_SHARD), and
        the ``process_group`` auto-wrapping passes to the units it creates: the groups a
        hybrid root built itself, as torch shares them, else the argument."""
        group, replicate_group = _resolve_groups(process_group, device_mesh, strategy, device,
                                                 auto_wrap_policy is not None)
        if strategy in _HYBRID and process_group is None and device_mesh is None:
            process_group = (group, replicate_group)
        if cpu_offload is not None and cpu_offload.offload_params and device.type != "cpu":
            # On a CPU compute device the shards and gradients already live on the
            # CPU and the optimizer steps there, which is all offloading means.
            raise _not_implemented(
                f"cpu_offload=CPUOffload(offload_params=True) with compute device {device} "
                "(the GPU path cannot be tested here)",
                3,
            )
        strategy, group, replicate_group = _one_rank_no_shard(strategy, group, replicate_group)
        return strategy, group, replicate_group, process_group

    def _init_ignored_states(self, module: nn.Module, ignored_modules, ignored_states,
                             device: torch.device, move_to: Optional[torch.device],
                             use_orig_params: bool, device_mesh, strategy: ShardingStrategy):
        """Ignored parameters and modules: the arguments', an auto-wrapping root's
        (inherited) and those of wrappers already nested inside; the parameters are
        validated (by the outermost wrapper) and the managed modules annotated."""
        ignored_params, ignored_mods = _ignored_params_and_modules(
            module, ignored_modules, ignored_states
        )
        inherited = _AUTO_WRAP_IGNORED.get()
        if inherited is not None:
            own = set(module.parameters())
            ignored_params |= {p for p in inherited if p in own}
        nested = wrappers_in(module)
        for sub in nested:  # nested wrappers' ignored parameters stay ignored
            ignored_params |= sub._ignored_params
        if move_to is not None:
            _move_states(module, ignored_params, ignored_mods, move_to)
        if inherited is None:
            _validate_params(module, ignored_params, device, device_mesh, strategy)
        self._ignored_modules: set[nn.Module] = set(ignored_mods)
        for sub in nested:
            self._ignored_modules |= sub._ignored_modules
        _annotate_modules_for_dynamo(module, self._ignored_modules, use_orig_params)
        self._ignored_params: set[nn.Parameter] = ignored_params
        return ignored_params, ignored_mods

    def _init_core_state(self, module, strategy, group, replicate_group, device, device_mesh,
                         mixed_precision, cpu_offload, backward_prefetch, forward_prefetch,
                         limit_all_gathers, use_orig_params) -> None:
        """The wrapper's settings, under torch's attribute names."""
        self._use_orig_params = use_orig_params
        self._backward_prefetch = backward_prefetch
        self._forward_prefetch = forward_prefetch
        self._limit_all_gathers = limit_all_gathers  # only meaningful with CUDA streams
        self._process_group = group
        self._replicate_group = replicate_group
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.cpu_offload = cpu_offload or CPUOffload()
        self._device_mesh = device_mesh
        # the (dp, tp) mesh when device_mesh is its dp slice (torch's DTensor extension)
        self._tp_root_mesh = tp_root_mesh(device_mesh, strategy)
        # state-dict settings (torch's attribute names; set_state_dict_type changes them)
        (
            self._state_dict_type,
            self._state_dict_config,
            self._optim_state_dict_config,
        ) = _sd.default_settings()
        # original dtypes of the buffers (clean names), restored in state dicts
        self._buffer_orig_dtypes = {
            clean_tensor_name(n): b.dtype for n, b in module.named_buffers()
        }
        self.sharding_strategy = strategy
        self.compute_device = device
        self.rank = group.rank()
        self.world_size = group.size()

    def _init_param_handle(self, module: nn.Module, param_init_fn, sync_module_states: bool,
                           mixed_precision) -> None:
        """Materialise (deferred initialisation), sync from rank 0 if asked, and build
        the unit of the parameters no nested wrapper manages (torch's flat-param handle)."""
        ignored_params, ignored_mods = self._ignored_params, self._ignored_modules
        device, strategy = self.compute_device, self.sharding_strategy
        _materialize(module, param_init_fn, ignored_params, ignored_mods, device, self._use_orig_params)
        _check_not_shared_with_other_units(module, ignored_params)
        managed = [
            p
            for p in dict.fromkeys(module.parameters())
            if p not in ignored_params and not getattr(p, "_cfsdp_flattened", False)
        ]
        _check_not_scalar(module, managed)
        if sync_module_states:
            self._sync_module_states(module, managed, ignored_mods)
        self._fsdp_wrapped_module = module
        # The flat parameter lives on the module ``self.module`` returns: inside an
        # activation-checkpoint wrapper, on the module it wraps (as torch's FSDP1).
        flat_owner = (
            getattr(module, CHECKPOINT_WRAPPED_MODULE)
            if isinstance(module, ActivationWrapper)
            else module
        )
        unit = (
            Unit(
                flat_owner,
                managed,
                self._process_group,
                self._use_orig_params,
                device,
                type(module).__name__,
                sharded=strategy is not ShardingStrategy.NO_SHARD,
                replicate_group=self._replicate_group,
                mixed_precision=mixed_precision,
            )
            if managed
            else None
        )
        if unit is not None:  # torch's FlatParameter._fqns, relative to ``module`` (accelerate reads it)
            prefix = CHECKPOINT_WRAPPED_MODULE if flat_owner is not module else ""
            unit.flat_param._fqns = tuple(join_fqn(prefix, i.fqn) for i in unit.infos)
        reshard_after_forward = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        self._state = UnitState(unit, type(module).__name__, reshard_after_forward)
        # [Note: kept unsharded units] in _runtime/flat/lifecycle.py
        self._state.keeps_views_for_backward = strategy in (
            ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)

    def _init_state_dict_state(self, module: nn.Module) -> None:
        """Wrappers below this one are not outermost; the state-dict hooks of this one."""
        self._cfsdp_has_outer = False
        for sub in wrappers_in(module):
            sub._cfsdp_has_outer = True
        _sd.install_hooks(self)

    @staticmethod
    def _auto_wrap(module, policy, ignored_params, ignored_mods, kwargs) -> None:
        for name, sub in module.named_modules():
            if isinstance(sub, (FullyShardedDataParallel, _TorchFSDP)):
                raise ValueError(
                    "FSDP auto wrapping requires modules to not already have FSDP applied but "
                    f"found {name} in\n{module} (cfsdp: '{clean_tensor_name(name)}' is already "
                    "wrapped; either wrap by hand or pass the unwrapped module with the policy.)"
                )
        token = _AUTO_WRAP_IGNORED.set(frozenset(ignored_params))
        root_token = _AUTO_WRAP_ROOT.set(module)
        mp = kwargs.get("mixed_precision")
        try:
            if mp is not None:
                # as torch: modules of these classes (BatchNorm by default) become
                # their own units without mixed precision, run in fp32
                overridden = override_module_mixed_precision(module, mp._module_classes_to_ignore)
                if overridden:
                    warnings.warn(
                        "Both mixed precision and an auto_wrap_policy were given to "
                        f"FullyShardedDataParallel; submodules of type {overridden} are wrapped "
                        "as separate units with mixed precision disabled.",
                        stacklevel=3,
                    )
            if isinstance(policy, _torch_wrap._Policy):
                targets = policy._run_policy(module, ignored_mods, dict(kwargs, auto_wrap_policy=None))
                if mp is not None:
                    targets = _torch_wrap._run_mixed_precision_override_policy(
                        module, mp._module_classes_to_ignore, ignored_mods,
                        dict(kwargs, auto_wrap_policy=None), targets,
                    )
                wrap_fn = _torch_wrap._construct_wrap_fn(module, targets, FullyShardedDataParallel)
                _torch_wrap._post_order_apply(module, wrap_fn)
            elif callable(policy):
                if mp is not None:
                    policy = functools.partial(
                        _torch_wrap._or_policy,
                        policies=[
                            policy,
                            functools.partial(
                                _torch_wrap._wrap_module_cls_individually,
                                module_classes=mp._module_classes_to_ignore,
                            ),
                        ],
                    )
                _torch_wrap._recursive_wrap(
                    module,
                    auto_wrap_policy=policy,
                    wrapper_cls=FullyShardedDataParallel,
                    ignored_modules=ignored_mods,
                    ignored_params=set(ignored_params),
                    only_wrap_children=True,
                    **kwargs,
                )
            else:
                raise TypeError(
                    "auto_wrap_policy must be a torch.distributed.fsdp.wrap policy object or "
                    f"a callable, got {type(policy).__name__}"
                )
        finally:
            _AUTO_WRAP_IGNORED.reset(token)
            _AUTO_WRAP_ROOT.reset(root_token)

    def _sync_module_states(self, module, managed, ignored_mods) -> None:
        """Broadcast rank 0's managed parameters and buffers (torch's semantics): with a
        hybrid strategy over the replicate group first (to each shard group's rank 0), then
        over the shard group, as torch, so every replica starts from rank 0's values."""
        groups = [self._process_group] if self._process_group.size() > 1 else []
        if self._replicate_group is not None and self._replicate_group.size() > 1:
            groups.insert(0, self._replicate_group)  # (a one-rank group: nothing to send)
        with torch.no_grad():
            for group in groups:
                for p in managed:  # a tensor-parallel parameter: its local tensor
                    local = p._local_tensor if isinstance(p, DTensor) else p
                    dist.broadcast(local.detach(), group=group, group_src=0)
                for mod in module.modules():
                    if mod in ignored_mods:
                        continue
                    for b in mod._buffers.values():
                        if b is not None:
                            dist.broadcast(b, group=group, group_src=0)

    # ------------------------------------------------------------ plumbing
    @property
    def module(self) -> nn.Module:
        """The wrapped module; when it is an activation-checkpoint (or offload)
        wrapper, the module inside it, as torch's FSDP1 returns."""
        inner = self._fsdp_wrapped_module
        if isinstance(inner, ActivationWrapper):
            return getattr(inner, CHECKPOINT_WRAPPED_MODULE)
        return inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        try:
            return getattr(self._fsdp_wrapped_module, name)
        except AttributeError:
            answer = _FSDP1_INTERNALS.get(name)
            if answer is None:
                raise
        raise no_torch_internal(type(self).__name__, name, "FullyShardedDataParallel", answer)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    # ------------------ torch FSDP1's private names that mean something here (_internals.py)
    @property
    def _flat_param(self):
        u = self._state.unit
        return u.flat_param if u is not None else None

    @property
    def _has_params(self) -> bool:
        """Whether this wrapper manages parameters (torch's: whether it has a ``_handle``)."""
        return self._state.unit is not None

    @property
    def _is_root(self) -> Optional[bool]:
        """torch's ``_is_root``: None until lazy initialisation (the first forward, a
        ``summon_full_params`` or a state dict), then whether this wrapper is the root.  As
        torch's it may be set: ``False`` on a wrapper that a ``summon_full_params`` on it
        made a root before the model's first forward (verl does), ``None`` to initialise
        again at the next forward through it."""
        return self._state.is_root

    @_is_root.setter
    def _is_root(self, value: Optional[bool]) -> None:
        if not (value is None or value is True or value is False):
            raise TypeError(f"_is_root must be None, True or False, got {value!r}")
        self._state.is_root = value

    @property
    def _handle(self) -> Optional["FlatParamHandle"]:
        """torch's ``FlatParamHandle`` of this wrapper, or None when it manages no parameters:
        cfsdp's :class:`FlatParamHandle`, the members of torch's that mean something for its
        unit."""
        if self._state.unit is None:
            return None
        handle = self.__dict__.get("_cfsdp_handle")
        if handle is None:
            handle = self.__dict__["_cfsdp_handle"] = FlatParamHandle(self)
        return handle

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group this wrapper shards over (with hybrid strategies, the shard group), as torch."""
        return self._process_group

    @property
    def training_state(self) -> TrainingState:
        return self._state.training_state

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Return all nested FSDP instances.

        This possibly includes ``module`` itself and only includes FSDP root modules if
        ``root_only=True``.

        Args:
            module (torch.nn.Module): Root module, which may or may not be an ``FSDP`` module.
            root_only (bool): Whether to return only FSDP root modules. (Default: ``False``)

        Returns:
            List[FullyShardedDataParallel]: FSDP modules that are nested in the input ``module``.
        """
        mods = wrappers_in(module)
        if not root_only:
            return mods
        roots = []
        for m in mods:
            m._lazy_init()
            if m._state.is_root:
                roots.append(m)
        return roots

    def check_is_root(self) -> bool:
        """Whether this instance is a root (initialising lazily, as torch does)."""
        self._lazy_init()
        return bool(self._state.is_root)

    @dynamo_disable
    def _lazy_init(self) -> None:
        st = self._state
        if st.is_root is not None:
            return
        tree = [m._state for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        prefetch = {
            BackwardPrefetch.BACKWARD_PRE: BACKWARD_PRE,
            BackwardPrefetch.BACKWARD_POST: BACKWARD_POST,
            None: None,
        }[self._backward_prefetch]
        lazy_init_root(st, tree, prefetch, self._forward_prefetch)
        # torch FSDP1's streams, shared by the root's units: [Note: FSDP1 streams]
        units = [s.unit for s in tree if s.unit is not None]
        ctx = FlatStreams(st, self.compute_device, self._limit_all_gathers,
                          any(u.replicate_group is not None and u.sharded for u in units))
        st.root.streams = ctx
        for u in units:
            u._comm = ctx
        self._cast_buffers_for_compute()

    def _cast_buffers_for_compute(self) -> None:
        """Root lazy init: cast every buffer to its owning unit's
        ``mixed_precision.buffer_dtype`` (the innermost unit wins), as torch."""
        visited: set = set()
        for w in reversed(FullyShardedDataParallel.fsdp_modules(self)):
            dtype = w.mixed_precision.buffer_dtype
            for mod in w.modules():
                for name, b in list(mod._buffers.items()):
                    if b is None or b in visited:
                        continue
                    visited.add(b)
                    if dtype is not None and b.is_floating_point() and b.dtype != dtype:
                        b.data = b.to(dtype)

    # ------------------------------------------------------------- forward
    @dynamo_skip_frame
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._pre_forward(args, kwargs)
        out = self._fsdp_wrapped_module(*args, **kwargs)
        return self._state.post_forward(out)

    @dynamo_disable
    def _pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        st = self._state
        if st.training_state is not TrainingState.IDLE:
            if st.training_state is TrainingState.SUMMON:
                raise RuntimeError(
                    "FullyShardedDataParallel forward was called inside summon_full_params; "
                    "leave the summon_full_params context first."
                )
        mp = self.mixed_precision
        if mp.param_dtype is not None and (
            mp.cast_forward_inputs or (st.is_root and mp.cast_root_forward_inputs)
        ):
            args, kwargs = cast_floating(mp.param_dtype, (args, kwargs))
        if st.is_root and st.training_state is TrainingState.IDLE:
            st.root.streams.begin_forward()
        st.pre_forward()
        return args, kwargs

    # ---------------------------------------------------- names and states
    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        clean = self._state.training_state is TrainingState.SUMMON
        for name, p in super().named_parameters(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), p

    def named_buffers(self, *args, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
        clean = self._state.training_state is TrainingState.SUMMON
        for name, b in super().named_buffers(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), b

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ):
        """Expose full parameters inside the context (torch FSDP1's semantics).

        * ``recurse=False``: only ``module``'s own unit (nothing if ``module``
          is not a FullyShardedDataParallel).
        * ``writeback=False``: changes to parameters (and, with ``with_grads``,
          gradients) made inside are discarded on exit.
        * ``rank0_only=True``: only rank 0 sees full parameters; the other ranks
          take part in the all-gather, free the result at once and keep seeing
          their shards (flat ``_flat_param`` with ``use_orig_params=False``,
          1-D shard views of the original parameters with ``True``).  Needs
          ``writeback=False``.
        * ``offload_to_cpu=True``: the full parameters the user sees live in CPU
          memory; on a CPU device they are the unsharded buffer itself (no
          copy), and writes are written back like any other.
        * ``with_grads=True`` (``use_orig_params=True`` only): each original
          parameter's ``.grad`` is its full gradient (None if no rank has one).

        Must be called between steps (not during forward/backward) and not
        inside another ``summon_full_params`` of the same units.
        """
        if recurse:
            wrappers = FullyShardedDataParallel.fsdp_modules(module)
        else:
            wrappers = [module] if isinstance(module, FullyShardedDataParallel) else []
        for w in wrappers:
            _validate_summon_args(w, writeback, rank0_only, offload_to_cpu, with_grads)
        if offload_to_cpu and not rank0_only and wrappers:
            warnings.warn(
                "offload_to_cpu=True and rank0_only=False may result in the unsharded "
                "parameters being redundantly copied to CPU memory for GPUs sharing the same "
                "CPU memory, which risks CPU OOM. We recommend using offload_to_cpu=True "
                "with rank0_only=True.",
                stacklevel=3,
            )
        for w in wrappers:
            w._lazy_init()  # as torch: the outermost wrapper becomes the root
        with _summoned(wrappers, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``nn.Module.apply`` with this unit's full parameters visible and written back,
        before and after the first forward (as torch: each nested wrapper's ``apply``, called
        by ``nn.Module.apply``, summons its own unit). torch lazily initialises ``self`` for
        it and resets that if ``self`` was not yet initialised; cfsdp summons without it."""
        with _summoned([self], writeback=True):
            return super().apply(fn)

    def _apply(self, *args, **kwargs):
        """``nn.Module._apply`` (``to(dtype)``, ``double()``, ``half()``, ``bfloat16()``...)
        converts this unit's flat parameter (its shard), as torch's FSDP1 arranges, and the
        unit then trains in the new dtype (``Unit.adopt_flat_data``); nested units convert
        their own.  torch takes the new dtype only before the first forward (its lazy
        initialisation reads it; afterwards it keeps its old buffers and fails), cfsdp at any
        time between steps."""
        st = self.__dict__.get("_state")  # None while the constructor runs
        u = st.unit if st is not None else None
        if u is None:
            return super()._apply(*args, **kwargs)
        if st.training_state is not TrainingState.IDLE:
            raise CallStateError(
                f"{_torch_state_message(st.training_state)} (cfsdp: nn.Module._apply (to / "
                f"double / half ...) on {st.name}'s unit inside forward/backward or "
                "summon_full_params; call it between training steps.)")
        with u.flat_param_registered():
            out = super()._apply(*args, **kwargs)
        u.adopt_flat_data()
        return out

    def state_dict(self, *args, **kwargs):
        """``nn.Module.state_dict`` of the type set by ``state_dict_type`` (default
        FULL_STATE_DICT): see ``cfsdp._state_dict`` for what each type holds."""
        with _sd.saving(FullyShardedDataParallel.fsdp_modules(self)):
            return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state dict of the type set by ``state_dict_type``.  The whole
        state dict is checked first (keys when ``strict``, shapes): on a mismatch
        nothing is loaded and the error names the first offending FQN.  Values of
        another dtype are cast, as ``nn.Module.load_state_dict`` does."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"Expected state_dict to be dict-like, got {type(state_dict)}. Pass the "
                "dict that state_dict() returned (or that torch.load gave back for it)."
            )
        if assign:
            raise _not_implemented("load_state_dict(assign=True)", 4)
        with _sd.loading(self, FullyShardedDataParallel.fsdp_modules(self), state_dict, strict):
            return super().load_state_dict(state_dict, strict=strict)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (unsharded, unreduced) inside the context;
        the first backward after it reduces the sum.  Root only, as torch."""
        self._lazy_init()
        if not self._state.is_root:
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` "
                "on root FSDP module. (cfsdp: no_sync() on the root applies to every unit "
                "below it.)"
            )
        if self._state.training_state is not TrainingState.IDLE:
            raise CallStateError(
                f"{_torch_state_message(self._state.training_state)} (cfsdp: no_sync() must be "
                "entered between steps, not during forward/backward or inside "
                "summon_full_params.)"
            )
        wrappers = FullyShardedDataParallel.fsdp_modules(self)
        old = [(w, w._state.sync_gradients) for w in wrappers]
        for w in wrappers:
            w._state.sync_gradients = False
        try:
            yield
        finally:
            for w, flag in old:
                w._state.sync_gradients = flag

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replace gradient reduction with ``hook`` on every unit of this root
        (torch's contract: ``hook(state, grad, output)`` for sharded strategies,
        ``hook(state, grad)`` for NO_SHARD; e.g. the hooks of
        ``torch.distributed.algorithms._comm_hooks.default_hooks``).  Call it on
        the root, before the first forward."""
        if not callable(hook):
            raise ValueError(
                f"The communication hook must be callable but got {hook} (cfsdp: pass a "
                "function hook(state, grad[, output]), e.g. from "
                "torch.distributed.algorithms._comm_hooks.default_hooks.)"
            )
        if not self.check_is_root():
            raise CommHookError(
                "register_comm_hook can only be called on a root instance. (cfsdp: call it on "
                "the outermost FullyShardedDataParallel wrapper; it applies to every unit.)"
            )
        low = hook in _LOW_PRECISION_HOOKS
        wrappers = FullyShardedDataParallel.fsdp_modules(self)
        for w in wrappers:
            if w.sharding_strategy in _HYBRID:
                raise CommHookStrategyError(
                    "Communication hook is not supported for hybrid strategies: "
                    f"{w.sharding_strategy} (cfsdp: use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD "
                    "with a communication hook.)"
                )
            u = w._state.unit
            if u is not None and u.comm_hook is not None:
                raise CommHookError(
                    "A communication hook is already registered (cfsdp: on this model; register "
                    "one hook, once, on the root.)"
                )
        for w in wrappers:
            u = w._state.unit
            if u is not None:
                u.comm_hook, u.comm_hook_state, u.comm_hook_low_precision = hook, state, low
    # ------------------------------------------------------ grad clipping
    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clip the gradient norm of all parameters, as torch's FSDP1 does.

        The norm is over all gradients viewed as one vector (sharded flat gradients summed
        over ranks, non-sharded ones such as ignored parameters' counted once per rank);
        gradients are multiplied in place by ``min(1, max_norm / (total_norm + 1e-6))``.
        Returns the total norm in the gradients' promoted dtype (float32, with a warning,
        when this rank has no gradients).  Call it on the root, on every rank, between
        backward and the optimizer step.  See ``cfsdp._runtime.clip`` for the numerics.
        """
        self._lazy_init()
        st = self._state
        if not st.is_root:
            raise RuntimeError("`clip_grad_norm_()` should only be called on the root FSDP instance")
        if st.training_state is not TrainingState.IDLE:
            raise ValueError(
                f"{_torch_state_message(st.training_state)} (cfsdp: call clip_grad_norm_() after "
                "backward, outside forward, backward and summon_full_params.)"
            )
        root = st.root
        if root is None:
            raise AssertionError("cfsdp: root without RootState after lazy init")
        units = [s.unit for s in root.states if s.unit is not None]
        tp = next((i for u in units for i in u.infos if i.tp_spec is not None), None)
        if tp is not None:
            # torch's FSDP1 sums the local norms over the dp group only: each TP rank gets
            # another norm (measured: 0.517 and 0.525 at (1, 2)), and the TP replicas of
            # replicated parameters are scaled differently and drift apart
            raise NotImplementedError(
                f"FullyShardedDataParallel.clip_grad_norm_ with tensor-parallel parameters (e.g. "
                f"'{tp.fqn}' of {type(tp.module).__name__}) is not supported by cfsdp: a norm over "
                "the TP-local gradients differs between TP ranks (torch's FSDP1 computes it so, "
                "and its TP replicas then drift apart). Clip with fully_shard and "
                "torch.nn.utils.clip_grad_norm_, which reduce DTensor gradients over both meshes.")
        # parameters no unit manages (ignored ones): torch's `self.parameters()` minus the
        # managed ones (flat params, or the original params with use_orig_params=True)
        nonsharded = [
            p.grad
            for p in self.parameters()
            if not getattr(p, "_cfsdp_flattened", False) and p.grad is not None
        ]
        res = _clip.clip_grad_norm_(
            units, nonsharded, max_norm, norm_type, self._process_group, self.compute_device
        )
        if res.num_grads == 0:
            warnings.warn(
                f"Called FSDP.clip_grad_norm_() on rank {self.rank} with no gradients -- "
                f"returning the total norm in the default dtype {res.total_norm.dtype}",
                stacklevel=2,
            )
        return res.total_norm

    # ------------------------------------------------- state-dict types
    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Optional[StateDictConfig] = None,
        optim_state_dict_config: Optional[OptimStateDictConfig] = None,
    ) -> StateDictSettings:
        """Set the state-dict type and configs of every wrapper under ``module``
        (which need not be a wrapper); returns the previous settings (torch's contract)."""
        return _sd.set_state_dict_type(
            FullyShardedDataParallel.fsdp_modules(module),
            state_dict_type,
            state_dict_config,
            optim_state_dict_config,
        )

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> Optional[StateDictSettings]:
        """The settings shared by every wrapper under ``module`` (None if there is
        no wrapper); ``AssertionError`` if they differ, as torch."""
        return _sd.get_state_dict_type(FullyShardedDataParallel.fsdp_modules(module))

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Optional[StateDictConfig] = None,
        optim_state_dict_config: Optional[OptimStateDictConfig] = None,
    ):
        """``set_state_dict_type`` for the duration of the context (restored on exit)."""
        prev = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module, prev.state_dict_type, prev.state_dict_config, prev.optim_state_dict_config
            )

    # -------------------------------------------- optimizer state dicts
    # torch FSDP1's signatures; the work is in cfsdp._optim_state_dict.
    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None) -> dict[str, Any]:
        return _osd.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model, optim, optim_state_dict, is_named_optimizer: bool = False,
        load_directly: bool = False, group=None,
    ) -> dict[str, Any]:
        return _osd.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    @staticmethod
    def full_optim_state_dict(
        model, optim, optim_input=None, rank0_only: bool = True, group=None
    ) -> dict[str, Any]:
        return _osd.full_optim_state_dict(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(model, optim, group=None) -> dict[str, Any]:
        return _osd.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict, model, optim_input=None, optim=None
    ) -> dict[str, Any]:
        return _osd.shard_full_optim_state_dict(full_optim_state_dict, model, optim_input, optim)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim) -> dict[str, Any]:
        return _osd.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict, model, optim_input=None, optim=None, group=None
    ) -> dict[str, Any]:
        return _osd.scatter_full_optim_state_dict(
            full_optim_state_dict, model, optim_input, optim, group
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict, optim_state_key_type, model, optim_input=None, optim=None
    ) -> dict[str, Any]:
        return _osd.rekey_optim_state_dict(
            optim_state_dict, optim_state_key_type, model, optim_input, optim
        )


def _validate_summon_args(
    w: FullyShardedDataParallel, writeback: bool, rank0_only: bool, offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    """The argument combinations torch's FSDP1 rejects, with the same error kind."""
    if with_grads and (offload_to_cpu or not w._use_orig_params):
        raise NotImplementedError(
            f"with_grads={with_grads}, use_orig_params={w._use_orig_params}, "
            f"offload_to_cpu={offload_to_cpu} is not supported yet (cfsdp: "
            "summon_full_params(with_grads=True) needs use_orig_params=True on every wrapper "
            "and offload_to_cpu=False.)"
        )
    if writeback and rank0_only:
        raise NotImplementedError(
            "writeback=True and rank0_only=True is not supported yet (cfsdp: only rank 0 would "
            "see the changes. Pass writeback=False with rank0_only=True, or rank0_only=False "
            "to write changes back on every rank.)"
        )


@contextlib.contextmanager
def _summoned(
    wrappers: list[FullyShardedDataParallel],
    writeback: bool,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
):
    """Unshard ``wrappers`` with full ``nn.Parameter`` s; reshard on exit.

    Per unit, as torch's FSDP1 ``_unshard_fsdp_state_params``: all-gather
    (and, with ``with_grads``, all-gather the gradient); on a rank other than
    0 with ``rank0_only``, reshard at once and expose nothing; else expose the
    full parameters (views of the unsharded buffer, or of a CPU copy for
    ``offload_to_cpu`` on a non-CPU device) and, on exit, write this rank's
    shard back if ``writeback``, then reshard.
    """
    check_can_summon([w._state for w in wrappers])
    # unit -> (full grad or None, CPU copy or None); only for units shown full
    shown: dict[int, tuple] = {}
    done: list[FullyShardedDataParallel] = []
    try:
        for w in wrappers:
            u = w._state.unit
            if u is not None:
                u.drop_grad_if_orig_grads_cleared()
                if u.is_unsharded and not u.holds_full_precision:
                    u.reshard()  # summon shows full precision, as torch
                u.unshard(full_precision=True)
                full_grad = u.unshard_grad() if with_grads else None
                if rank0_only and u.rank != 0:
                    u.reshard()
                else:
                    buf = None
                    if offload_to_cpu and u.unsharded.device.type != "cpu":
                        buf = u.unsharded.to("cpu")  # device-generic path, not run on CPU CI
                    u.params_as_full(buf)
                    if with_grads:
                        u.grads_as_full(full_grad)
                    shown[id(u)] = (full_grad, buf)
            w._state.enter_summon()
            done.append(w)
        yield
    finally:
        for w in reversed(done):
            u = w._state.unit
            if u is not None and id(u) in shown:
                full_grad, buf = shown[id(u)]
                if with_grads:
                    u.grads_as_sharded(full_grad, writeback)
                if buf is not None:
                    u.unsharded.copy_(buf)
                u.params_as_sharded(writeback)
                if with_grads:
                    u.orig_grads_as_shard_views()
                u.reshard()
            w._state.leave_summon()


# help() shows torch's documentation of every method cfsdp mirrors, then cfsdp's notes
adopt_class_docs(FullyShardedDataParallel, _TorchFSDP)
