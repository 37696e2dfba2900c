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
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP
from torch.distributed.fsdp import wrap as _torch_wrap
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from ._runtime.hooks import BACKWARD_POST, BACKWARD_PRE, UnitState, lazy_init_root
from ._runtime.unit import TrainingState, Unit
from ._state_dict import CHECKPOINT_WRAPPED_MODULE, FSDP_PREFIX, FSDP_WRAPPED_MODULE, clean_tensor_name, join_fqn
from .api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)

__all__ = ["FullyShardedDataParallel"]

# Set while an auto-wrap policy creates the nested wrappers of one root: the
# root's ignored parameters (the children must not manage them either).
_AUTO_WRAP_IGNORED: contextvars.ContextVar[Optional[frozenset]] = contextvars.ContextVar(
    "cfsdp_auto_wrap_ignored", default=None
)
# Set while a state dict is built or loaded, so nested wrappers' state_dict()
# defer to nn.Module's (the outermost call does the FQN cleaning).
_IN_STATE_DICT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cfsdp_in_state_dict", default=False
)

_STALE_HOOK_INSTALLED = False


class WrongTypeError(TypeError, ValueError):
    """A wrong type in an argument's entries.  torch's FSDP1 raises ``ValueError``
    there, so this is both: code written against torch keeps catching it."""


def _not_implemented(what: str, issue: int) -> NotImplementedError:
    return NotImplementedError(
        f"cfsdp.FullyShardedDataParallel: {what} is not implemented yet "
        f"(tracked in issue {issue}; see the compatibility table in README.md)."
    )


def _check_optimizer_params(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: reject parameters that wrapping replaced."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = getattr(p, "_cfsdp_stale_fqn", None)
            if fqn is not None:
                raise RuntimeError(
                    f"The optimizer holds parameter '{fqn}', which FullyShardedDataParallel "
                    "replaced by a flat sharded parameter when it wrapped the module "
                    "(use_orig_params=False), so stepping it would train nothing. Build "
                    "the optimizer after wrapping, from the wrapped model's parameters()."
                )


def _install_stale_optimizer_check() -> None:
    global _STALE_HOOK_INSTALLED
    if not _STALE_HOOK_INSTALLED:
        register_optimizer_step_pre_hook(_check_optimizer_params)
        _STALE_HOOK_INSTALLED = True


def _resolve_group(process_group, device_mesh) -> dist.ProcessGroup:
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError(
                "Pass either process_group or device_mesh to FullyShardedDataParallel, not both."
            )
        if device_mesh.ndim != 1:
            raise _not_implemented(
                f"device_mesh with {device_mesh.ndim} dimensions (hybrid sharding)", 3
            )
        return device_mesh.get_group(0)
    if isinstance(process_group, tuple):
        raise _not_implemented("process_group=(shard_group, replicate_group) (hybrid sharding)", 3)
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel needs a process group, but the default process group "
            "is not initialized. Call torch.distributed.init_process_group(...) first (e.g. "
            "with backend='gloo' on CPU under torchrun), or pass process_group=."
        )
    return dist.distributed_c10d._get_default_group()


def _resolve_device(module: nn.Module, device_id) -> torch.device:
    if device_id is None:
        for p in module.parameters():
            if p.device.type != "meta":
                return p.device
        return torch.device("cpu")
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
    if device.type != "cpu" and device.type != "cuda":
        raise ValueError(
            f"device_id={device_id!r}: cfsdp runs on 'cpu' or 'cuda' devices."
        )
    return device


def _ignored_params_and_modules(
    module: nn.Module, ignored_modules, ignored_states
) -> tuple[set[nn.Parameter], set[nn.Module]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states to "
            "FullyShardedDataParallel; pass only ignored_states."
        )
    mods: list[nn.Module] = []
    params: set[nn.Parameter] = set()
    submodules = set(module.modules())
    all_params = set(module.parameters())
    if ignored_modules is not None:
        for i, m in enumerate(ignored_modules):
            if not isinstance(m, nn.Module):
                raise WrongTypeError(
                    f"ignored_modules must contain nn.Module instances, but entry {i} is a "
                    f"{type(m).__name__}"
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
                "ignored_states must contain only nn.Parameter or only nn.Module entries; "
                "pass parameters and modules in two separate FSDP calls, or only modules."
            )
    for i, m in enumerate(mods):
        if isinstance(m, (FullyShardedDataParallel, _TorchFSDP)):
            raise ValueError("ignored_modules must not include FSDP modules.")
        if m not in submodules:
            raise ValueError(
                f"ignored module {i} ({type(m).__name__}) is not a submodule of the module "
                f"being wrapped ({type(module).__name__}). Pass only its own submodules."
            )
    ignored_mods = {c for m in mods for c in m.modules()}
    for m in ignored_mods:
        params.update(m.parameters(recurse=False))
    return params, ignored_mods


def _validate_params(module: nn.Module, ignored: set, device: torch.device) -> None:
    """Check every parameter the wrapper tree will shard, naming it by FQN."""
    for name, p in module.named_parameters():
        if p in ignored or getattr(p, "_cfsdp_flattened", False):
            continue
        fqn = clean_tensor_name(name)
        if p.device.type == "meta":
            raise _not_implemented(
                f"deferred initialisation (parameter '{fqn}' is on the meta device; "
                "param_init_fn / meta-device modules)",
                3,
            )
        if p.dim() == 0:
            raise ValueError(
                f"FSDP does not shard scalar (0-dim) parameters, but '{fqn}' is one. Make it "
                "a 1-D tensor with one element (e.g. nn.Parameter(torch.tensor([v]))), or "
                "pass it in ignored_states."
            )
        if not p.is_floating_point():
            raise ValueError(
                f"FSDP can only shard floating-point parameters, but '{fqn}' has dtype "
                f"{p.dtype}. Register it as a buffer, or pass it in ignored_states (or "
                "its module in ignored_modules)."
            )
        if p.device != device:
            raise ValueError(
                f"Parameter '{fqn}' is on {p.device} but FSDP runs on {device}. Move the "
                f"module to {device} before wrapping, or pass the matching device_id."
            )


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


class FullyShardedDataParallel(nn.Module):
    """Drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel``.

    Same constructor, same names, same numbers.  See the README's compatibility
    table for which arguments are implemented; the others raise
    ``NotImplementedError`` naming the argument.
    """

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
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}"
            )
        if isinstance(module, _TorchFSDP):
            raise ValueError(
                "cfsdp.FullyShardedDataParallel cannot wrap torch's FullyShardedDataParallel; "
                "use one implementation for the whole model."
            )
        # --- arguments not implemented yet: never silently ignored
        if sharding_strategy not in (None, ShardingStrategy.FULL_SHARD):
            raise _not_implemented(f"sharding_strategy={sharding_strategy}", 3)
        if cpu_offload is not None and cpu_offload.offload_params:
            raise _not_implemented("cpu_offload=CPUOffload(offload_params=True)", 3)
        if mixed_precision is not None:
            raise _not_implemented(f"mixed_precision={mixed_precision}", 3)
        if param_init_fn is not None:
            raise _not_implemented("param_init_fn (deferred initialisation)", 3)
        if backward_prefetch not in (None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST):
            raise ValueError(f"backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}")

        group = _resolve_group(process_group, device_mesh)
        device = _resolve_device(module, device_id)
        ignored_params, ignored_mods = _ignored_params_and_modules(
            module, ignored_modules, ignored_states
        )
        inherited = _AUTO_WRAP_IGNORED.get()
        if inherited is not None:
            ignored_params |= {p for p in inherited if p in set(module.parameters())}
        for sub in module.modules():  # nested wrappers' ignored parameters stay ignored
            if isinstance(sub, FullyShardedDataParallel):
                ignored_params |= sub._ignored_params
        if inherited is None:
            _validate_params(module, ignored_params, device)
        if device.type == "cuda":
            module.to(device)  # device-generic path (not exercised on CPU-only CI)
        self._ignored_modules: set[nn.Module] = set(ignored_mods)
        for sub in module.modules():
            if isinstance(sub, FullyShardedDataParallel):
                self._ignored_modules |= sub._ignored_modules
        _annotate_modules_for_dynamo(module, self._ignored_modules, use_orig_params)

        self._ignored_params: set[nn.Parameter] = ignored_params
        self._use_orig_params = use_orig_params
        self._backward_prefetch = backward_prefetch
        self._forward_prefetch = forward_prefetch
        self._limit_all_gathers = limit_all_gathers  # only meaningful with CUDA streams
        self._process_group = group
        self.compute_device = device
        self.rank = group.rank()
        self.world_size = group.size()

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

        managed = [
            p
            for p in dict.fromkeys(module.parameters())
            if p not in ignored_params and not getattr(p, "_cfsdp_flattened", False)
        ]
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
            Unit(flat_owner, managed, group, use_orig_params, device, type(module).__name__)
            if managed
            else None
        )
        self._state = UnitState(unit, type(module).__name__, reshard_after_forward=True)
        _install_stale_optimizer_check()

    # ----------------------------------------------------------------- init
    @staticmethod
    def _auto_wrap(module, policy, ignored_params, ignored_mods, kwargs) -> None:
        for name, sub in module.named_modules():
            if isinstance(sub, (FullyShardedDataParallel, _TorchFSDP)):
                raise ValueError(
                    "An auto_wrap_policy needs a module with no FSDP units inside, but "
                    f"'{clean_tensor_name(name)}' is already wrapped. Either wrap by hand "
                    "or pass the unwrapped module with the policy."
                )
        token = _AUTO_WRAP_IGNORED.set(frozenset(ignored_params))
        try:
            if isinstance(policy, _torch_wrap._Policy):
                targets = policy._run_policy(module, ignored_mods, dict(kwargs, auto_wrap_policy=None))
                wrap_fn = _torch_wrap._construct_wrap_fn(module, targets, FullyShardedDataParallel)
                _torch_wrap._post_order_apply(module, wrap_fn)
            elif callable(policy):
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

    def _sync_module_states(self, module, managed, ignored_mods) -> None:
        """Broadcast rank 0's managed parameters and buffers (torch's semantics)."""
        group = self._process_group
        with torch.no_grad():
            for p in managed:
                dist.broadcast(p.detach(), group=group, group_src=0)
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
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    @property
    def _flat_param(self):
        u = self._state.unit
        return u.flat_param if u is not None else None

    @property
    def training_state(self) -> TrainingState:
        return self._state.training_state

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every FullyShardedDataParallel in ``module``'s tree (only roots if asked)."""
        mods = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
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

    # ------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        st = self._state
        if st.training_state is not TrainingState.IDLE:
            if st.training_state is TrainingState.SUMMON:
                raise RuntimeError(
                    "FullyShardedDataParallel forward was called inside summon_full_params; "
                    "leave the summon_full_params context first."
                )
        st.pre_forward()
        out = self._fsdp_wrapped_module(*args, **kwargs)
        return st.post_forward(out)

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
        """``nn.Module.apply`` with this unit's full parameters visible (as torch)."""
        uninitialized = self._state.is_root is None
        ctx = _summoned([self], writeback=True) if uninitialized else contextlib.nullcontext()
        with ctx:
            return super().apply(fn)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """FULL_STATE_DICT (torch's default): full tensors under clean FQNs."""
        if args:
            raise TypeError("state_dict() takes keyword arguments only (destination, prefix, keep_vars)")
        if _IN_STATE_DICT.get():
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        wrappers = FullyShardedDataParallel.fsdp_modules(self)
        token = _IN_STATE_DICT.set(True)
        try:
            with _summoned(wrappers, writeback=False):
                raw = super().state_dict(prefix=prefix, keep_vars=True)
                storages = {
                    w._state.unit.unsharded.untyped_storage().data_ptr()
                    for w in wrappers
                    if w._state.unit is not None
                }
                out: "OrderedDict[str, Any]" = OrderedDict() if destination is None else destination
                for k, v in raw.items():
                    if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in storages:
                        v = v.detach().clone()
                    elif isinstance(v, torch.Tensor) and not keep_vars:
                        v = v.detach()
                    out[clean_tensor_name(k)] = v
                meta = getattr(raw, "_metadata", None)
                if meta is not None:
                    out_meta = getattr(out, "_metadata", None)
                    if out_meta is None:
                        out_meta = OrderedDict()
                        out._metadata = out_meta  # type: ignore[attr-defined]
                    for k, v in meta.items():
                        out_meta[clean_tensor_name(k + ".")[:-1] if k else k] = v
        finally:
            _IN_STATE_DICT.reset(token)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a FULL state dict (clean FQNs, full tensors) into the shards."""
        if assign:
            raise _not_implemented("load_state_dict(assign=True)", 4)
        wrappers = FullyShardedDataParallel.fsdp_modules(self)
        token = _IN_STATE_DICT.set(True)
        try:
            with _summoned(wrappers, writeback=True):
                raw_keys = list(super().state_dict(keep_vars=True).keys())
                to_raw = {clean_tensor_name(k): k for k in raw_keys}
                if strict:
                    missing = [k for k in to_raw if k not in state_dict]
                    unexpected = [k for k in state_dict if k not in to_raw]
                    if missing or unexpected:
                        raise RuntimeError(
                            "Error(s) in loading state_dict for FullyShardedDataParallel: "
                            f"missing keys {missing}, unexpected keys {unexpected}. Nothing "
                            "was loaded; pass strict=False to load the matching keys only."
                        )
                mapped = OrderedDict((to_raw.get(k, k), v) for k, v in state_dict.items())
                meta = getattr(state_dict, "_metadata", None)
                if meta is not None:
                    mod_to_raw = {clean_tensor_name(n + ".")[:-1] if n else n: n for n, _ in super().named_modules()}
                    mapped._metadata = OrderedDict(  # type: ignore[attr-defined]
                        (mod_to_raw.get(k, k), v) for k, v in meta.items()
                    )
                result = super().load_state_dict(mapped, strict=strict)
        finally:
            _IN_STATE_DICT.reset(token)
        return type(result)(
            [clean_tensor_name(k) for k in result.missing_keys],
            [clean_tensor_name(k) for k in result.unexpected_keys],
        )

    # --------------------------------------------- not implemented (yet)
    def _nyi(name: str, issue: int):  # type: ignore[misc]
        def method(*args, **kwargs):
            raise _not_implemented(f"FullyShardedDataParallel.{name}", issue)

        method.__name__ = name
        method.__doc__ = f"Not implemented yet in cfsdp (issue {issue}); raises NotImplementedError."
        return method

    no_sync = _nyi("no_sync", 3)
    clip_grad_norm_ = _nyi("clip_grad_norm_", 3)
    register_comm_hook = _nyi("register_comm_hook", 3)
    state_dict_type = staticmethod(_nyi("state_dict_type", 4))
    set_state_dict_type = staticmethod(_nyi("set_state_dict_type", 4))
    get_state_dict_type = staticmethod(_nyi("get_state_dict_type", 4))
    optim_state_dict = staticmethod(_nyi("optim_state_dict", 4))
    optim_state_dict_to_load = staticmethod(_nyi("optim_state_dict_to_load", 4))
    full_optim_state_dict = staticmethod(_nyi("full_optim_state_dict", 4))
    sharded_optim_state_dict = staticmethod(_nyi("sharded_optim_state_dict", 4))
    shard_full_optim_state_dict = staticmethod(_nyi("shard_full_optim_state_dict", 4))
    scatter_full_optim_state_dict = staticmethod(_nyi("scatter_full_optim_state_dict", 4))
    flatten_sharded_optim_state_dict = staticmethod(_nyi("flatten_sharded_optim_state_dict", 4))
    rekey_optim_state_dict = staticmethod(_nyi("rekey_optim_state_dict", 4))
    del _nyi


class SummonStateError(AssertionError, RuntimeError):
    """``summon_full_params`` (or a full state dict) at a time it cannot run:
    during forward/backward, or nested.  torch's FSDP1 raises ``AssertionError``
    there, so this is one (and a ``RuntimeError``, which cfsdp raised before)."""


def _validate_summon_args(
    w: FullyShardedDataParallel, writeback: bool, rank0_only: bool, offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    """The argument combinations torch's FSDP1 rejects, with the same error kind."""
    if with_grads and (offload_to_cpu or not w._use_orig_params):
        raise NotImplementedError(
            f"summon_full_params(with_grads=True) with use_orig_params={w._use_orig_params}, "
            f"offload_to_cpu={offload_to_cpu} is not supported (as in torch's FSDP1): "
            "with_grads=True needs use_orig_params=True on every wrapper and "
            "offload_to_cpu=False."
        )
    if writeback and rank0_only:
        raise NotImplementedError(
            "summon_full_params(writeback=True, rank0_only=True) is not supported (as in "
            "torch's FSDP1): only rank 0 would see the changes. Pass writeback=False with "
            "rank0_only=True, or rank0_only=False to write changes back on every rank."
        )


def _check_can_summon(wrappers: list[FullyShardedDataParallel]) -> None:
    for w in wrappers:
        ts = w._state.training_state
        if ts in (TrainingState.FORWARD, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
            raise SummonStateError(
                "Cannot manually unshard parameters during forward/backward: "
                "summon_full_params / state_dict was called while a unit of "
                f"{w._state.name} is in {ts.name}. Call it between training steps "
                "(after backward, or before forward)."
            )
        if ts is TrainingState.SUMMON:
            raise SummonStateError(
                "Cannot manually unshard parameters when already unsharding parameters: "
                "summon_full_params / state_dict was called inside summon_full_params of "
                f"{w._state.name}. Leave the outer summon_full_params context first (its "
                "parameters are already full), or summon disjoint units with recurse=False."
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
    _check_can_summon(wrappers)
    # unit -> (full grad or None, CPU copy or None); only for units shown full
    shown: dict[int, tuple] = {}
    done: list[FullyShardedDataParallel] = []
    try:
        for w in wrappers:
            u = w._state.unit
            if u is not None:
                u.drop_grad_if_orig_grads_cleared()
                u.unshard()
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
            w._state.training_state = TrainingState.SUMMON
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
            w._state.training_state = TrainingState.IDLE
