"""``cfsdp.optim.ZeroRedundancyOptimizer``: torch's ZeRO-1, stepped in C, synced through shared memory.

A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer`` (torch 2.13): the
same constructor (``optimizer_class``, ``process_group``, ``parameters_as_bucket_view``,
``overlap_with_ddp``, ``**defaults``), methods (``step(closure, **kwargs)``,
``zero_grad``, ``add_param_group``, ``consolidate_state_dict(to)``, ``state_dict``,
``load_state_dict``, the ``Join`` hook) and state-dict formats.  Each rank keeps the
optimizer state of a partition of the parameters, steps it, and the ranks then share
the updated parameters.

What is torch's, exactly:

* the partition ([Note: ZeRO partition]), so a checkpoint moves between torch's ZeRO,
  cfsdp's and a plain optimizer, both ways, at any world size;
* the local optimizer: ``optimizer_class(<this rank's param groups>, **defaults)``, any
  torch optimizer; with cfsdp's ``Adam``/``AdamW``/``SGD`` its step is one C pass per
  bucket (see ``_fused.py``), which the bucket views make one pass over the rank's
  segment;
* ``param_groups``: the global groups, their hyperparameters copied to the local
  optimizer's groups before its step (so LR schedulers work) and back after it;
* state dicts: ``state_dict()`` raises (torch's ``RuntimeError``) on a rank that did not
  receive the last ``consolidate_state_dict(to)``; the consolidated dict has the plain
  optimizer's structure and values (global parameter indices); ``load_state_dict`` loads
  this rank's entries into the local optimizer and overwrites the other ranks' entries
  of the dict it is given with ``None`` (torch does: it frees them);
* ``Join``: ``join_hook()`` steps (and syncs) on a rank that has run out of inputs;
* the errors for bad ``params`` and functional optimizers (torch's types and messages).

What cfsdp does instead:

* the sync: one all-gather per (device, dtype) of rank-major flat buckets, shared memory
  within a host (see [Note: ZeRO buckets] in ``_zero_buckets.py``); torch broadcasts
  every bucket (bucket view) or every parameter (the default) through the process group.
  With bucket views and every rank on one host the bucket is ONE mapping shared by the
  ranks: the owners step their segments in place and the sync is a barrier, no copy
  ([Note: ZeRO shared bucket]: the parameters are held once per host, a closure is
  evaluated before the first barrier, and private buckets where that cannot be exact);
* consolidation moves flat state buffers, not pickled dicts ([Note: ZeRO consolidation]
  in ``_zero_state.py``), and the consolidated dict is a snapshot (torch's holds the
  target rank's live state tensors);
* parameters of several dense dtypes are accepted (one bucket per dtype; torch raises
  ``ValueError``);
* ``overlap_with_ddp=True`` is refused at construction (torch accepts it, then its
  ``step()`` does nothing and its DDP hook refuses gloo); on gloo with torch's
  ``RuntimeError`` message;
* a parameter whose memory moved (``model.to(...)``, ``p.data = t``) is noticed at the
  next ``step()`` and the buckets are rebuilt from its current value (torch would keep
  writing the old bucket);
* the optimizer's own ``state`` stays empty: the state lives in ``self.optim``.

[Note: ZeRO partition]
torch's sorted-greedy partition: for each param group in order, its parameters sorted
by ``numel()``, largest first (a stable sort: equal sizes keep their order), each to the
rank with the smallest total so far (the lowest such rank), totals carried across
groups; frozen parameters count.  Every rank computes it from the same ``param_groups``,
without communication.  ``add_param_group`` recomputes it; the groups before the new one
keep their assignment (they come first and their sizes have not changed).
"""

from __future__ import annotations

import copy
import inspect
import logging
from itertools import chain
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeRO
from torch.distributed.optim.utils import functional_optim_map
from torch.optim import Optimizer

from .. import _docs
from .._runtime import comm
from . import _zero_buckets, _zero_state
from ._fused import _FusedStep

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


# [Note: ZeRO shared bucket]: the optimizers whose step() evaluates the closure once,
# before it writes any parameter, and writes only the parameters it steps (torch.optim's
# own but LBFGS, which re-evaluates it between updates; cfsdp.optim's fused ones)
_CLOSURE_FIRST = frozenset((
    torch.optim.Adadelta, torch.optim.Adafactor, torch.optim.Adagrad, torch.optim.Adam,
    torch.optim.Adamax, torch.optim.AdamW, torch.optim.ASGD, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.SGD, _FusedStep))


def _closure_first(optimizer_class: Any) -> bool:
    """Whether the ``step`` that ``optimizer_class`` runs is one of ``_CLOSURE_FIRST``'s
    (unwrapped: torch wraps a class's ``step`` in its profiling hook at the first
    instance, on the class itself)."""
    step = getattr(optimizer_class, "step", None)
    return step is not None and inspect.unwrap(step) in {
        inspect.unwrap(c.step) for c in _CLOSURE_FIRST}


def _min_index(values: list) -> int:
    """The first index of the smallest value."""
    best, best_i = None, -1
    for i, v in enumerate(values):
        if best is None or v < best:
            best, best_i = v, i
    return best_i


def partition_params(groups_params: list, world_size: int) -> list:
    """[Note: ZeRO partition]: ``groups_params[g]`` lists group g's parameters; returns
    ``per_rank[r][g]``, the parameters of group g that rank r steps, in partition order."""
    per_rank: list = [[] for _ in range(world_size)]
    sizes = [0] * world_size
    for params in groups_params:
        lists: list = [[] for _ in range(world_size)]
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            r = _min_index(sizes)
            lists[r].append(p)
            sizes[r] += p.numel()
        for r in range(world_size):
            per_rank[r].append(lists[r])
    return per_rank


def _to_device(value: Any, device: torch.device) -> Any:
    """torch's recursive copy of a state value to ``device`` (tensors by ``.to``)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        vals = [_to_device(v, device) for v in value]
        return vals if isinstance(value, list) else tuple(vals)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class _ZeroJoinHook(JoinHook):
    """A rank that joined early shadows the others' ``step()`` (and its collectives)."""

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise AssertionError("the ZeRO join hook needs a ZeroRedundancyOptimizer")
        self.zero = zero
        super().__init__()

    def main_hook(self) -> None:
        self.zero.step()


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """cfsdp's ZeroRedundancyOptimizer (see ``cfsdp.optim.zero``): torch's partition,
    local optimizer, ``param_groups`` and state-dict formats; the sync is one all-gather
    of flat rank-major buckets per dtype (shared memory within a host), consolidation
    moves flat state buffers."""

    def __init__(
        self,
        params,
        optimizer_class: type[Optimizer],
        process_group: Optional[Any] = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ):
        params = self._verify_and_init_params(params)
        self._verify_dense_params(self._all_params)
        self.initialized = False  # add_param_group during Optimizer.__init__: no partition
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        self._partition_cache: list = []
        self._param_to_rank_cache: dict = {}
        self._param_holders_cache: dict = {}
        self._param_to_index_cache: dict = {}
        self._index_to_param_cache: list = []
        self._is_trainable_mask = self._get_is_trainable_mask()
        self._default_device = self._all_params[0].device
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size: int = dist.get_world_size(self.process_group)
        self.rank: int = dist.get_rank(self.process_group)
        self.global_rank: int = dist.distributed_c10d.get_global_rank(self.process_group,
                                                                      self.rank)
        self._overlap_with_ddp = bool(overlap_with_ddp)
        self._optim_defaults = defaults
        self._optim_constructor = self._get_optimizer_constructor(optimizer_class)
        self._init_local_optimizer()
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        # the group whose ranks share the bucket views, one per host ([Note: ZeRO shared
        # bucket] in _zero_buckets.py), or None; decided once, the same on every rank
        # (CPU parameters only: a segment serves CPU memory, and an accelerator job's
        # group sets nothing up, comm.py's "Accelerator tensors")
        self._share = (self.process_group if self.parameters_as_bucket_view
                       and self.world_size > 1 and _closure_first(optimizer_class)
                       and all(p.device.type == "cpu" for g in self.param_groups
                               for p in g["params"])
                       and comm.one_segment(self.process_group) else None)
        self._flag = torch.zeros(1)  # the barrier's payload: "rebuild the buckets"
        self._syncs: list = []
        self._build_syncs()
        self._consolidated: Optional[dict] = None  # on the target of the last consolidation
        self._consolidated_to: Optional[int] = None
        # the ZeRO-2 hook's state ([Note: ZeRO-2 hook] in _zero_hook.py): its bucket plans
        # and scratch, whether a backward pass is under way, whether the gradients this
        # rank holds are its owned ones only
        self._rs_plans: dict = {}
        self._rs_scratch: dict = {}
        self._rs_in_backward = False
        self._grads_partitioned = False
        self.initialized = True

    # ------------------------------------------------------------ verification
    def _verify_and_init_params(self, params: Any) -> list:
        """torch's checks on ``params`` (its types and messages); sets ``_all_params``."""
        if isinstance(params, torch.Tensor):
            raise TypeError("`params` argument should be an iterable of "
                            f"Tensors, but got {torch.typename(params)}")
        try:
            all_params = list(params)
        except TypeError as e:
            raise TypeError("`params` argument should be an iterable of Tensors"
                            f" or dicts, but got {torch.typename(params)}") from e
        if len(all_params) == 0:
            raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
        all_tensors = all(isinstance(p, torch.Tensor) for p in all_params)
        all_dicts = all(isinstance(p, dict) for p in all_params)
        if not all_tensors and not all_dicts:
            raise TypeError("`params` argument should be an iterable of Tensors or dicts")
        if all_tensors:
            self._all_params = all_params
        else:
            self._all_params = []
            for group in all_params:
                if "params" not in group:
                    raise ValueError(
                        "Each parameter group passed-in via `params` must "
                        "have a 'params' key mapping to the parameters in the group")
                ps = group["params"]
                self._all_params.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        return all_params

    @staticmethod
    def _verify_dense_params(params: list) -> None:
        """Dense strided CPU/accelerator tensors, any float dtypes (one bucket each, synced on
        its own; the local optimizer steps each dtype with its own math: bit for bit plain
        DDP + that optimizer for float32/64, bfloat16 and float16, ``mixed_dtypes`` in
        tests/distributed/zero/parity.py).  torch requires one dense type for all (its
        ValueError), which cfsdp keeps on purpose; a sparse one is torch's ValueError."""
        for i, p in enumerate(params):
            if p.is_sparse or p.layout is not torch.strided:
                raise ValueError(
                    "ZeroRedundancyOptimizer only supports using the same dense type for all "
                    f"parameters but got {torch.typename(p)} (cfsdp: parameter {i} has layout "
                    f"{p.layout}; give the optimizer dense parameters)")
            if type(p) not in (torch.Tensor, torch.nn.Parameter):
                raise NotImplementedError(
                    f"cfsdp.optim.ZeroRedundancyOptimizer: parameter {i} is a "
                    f"{type(p).__name__}; ZeRO shards the optimizer state of plain "
                    "(replicated) parameters. For DTensor / sharded parameters use "
                    "cfsdp.fully_shard or cfsdp.FullyShardedDataParallel with cfsdp.optim.")

    def _get_optimizer_constructor(self, optimizer_class: Any) -> Any:
        functional = functional_optim_map.values()
        if not self._overlap_with_ddp:
            if optimizer_class in functional:
                raise ValueError(f"Passing in a functional optimizer {optimizer_class} "
                                 "when `overlap_with_ddp=False`")
            return optimizer_class
        if optimizer_class not in functional and optimizer_class not in functional_optim_map:
            raise ValueError(
                "Using `ddp_with_overlap=True` requires using a functional optimizer, but "
                f"there is no supported functional optimizer equivalent for {optimizer_class}")
        advice = ("cfsdp.optim.ZeroRedundancyOptimizer does not overlap its step with DDP: "
                  "pass overlap_with_ddp=False (the default) and call step() after backward; "
                  "cfsdp.optim.reduce_scatter_hook partitions DDP's gradients (ZeRO-2)")
        if dist.get_backend(self.process_group) == dist.Backend.GLOO:
            raise RuntimeError("Gloo backend using Overlapping DDP with ZeRO may meet hangs "
                               f"(cfsdp: {advice})")
        raise NotImplementedError(f"overlap_with_ddp=True: {advice}; or use "
                                  "torch.distributed.optim.ZeroRedundancyOptimizer")

    def _get_is_trainable_mask(self) -> list:
        return [p.requires_grad for p in self._all_params]

    # --------------------------------------------------------------- partition
    def _clear_cache(self) -> None:
        self._rs_plans = {}  # the ZeRO-2 hook's bucket plans hold owners
        self._partition_cache = []
        self._param_to_rank_cache = {}
        self._param_holders_cache = {}
        self._param_to_index_cache = {}
        self._index_to_param_cache = []

    def _partition_parameters(self) -> list:
        """``[rank][group]``: the param group dicts of each rank (copies of the global
        groups holding that rank's parameters; this rank's are its local optimizer's)."""
        if not self._partition_cache:
            per_rank = partition_params([g["params"] for g in self.param_groups],
                                        self.world_size)
            out: list = [[] for _ in range(self.world_size)]
            for r, lists in enumerate(per_rank):
                for group, ps in zip(self.param_groups, lists):
                    g = copy.copy(group)
                    g["params"] = ps
                    out[r].append(g)
            self._partition_cache = out
        return self._partition_cache

    @property
    def _param_to_rank(self) -> dict:
        if not self._param_to_rank_cache:
            for r, groups in enumerate(self._partition_parameters()):
                for g in groups:
                    for p in g["params"]:
                        self._param_to_rank_cache[p] = r
        return self._param_to_rank_cache

    @property
    def _param_holders(self) -> dict:
        """Each parameter's ranks, in rank order: one, or several for a parameter listed
        twice ([Note: ZeRO duplicate parameters] in ``_zero_buckets.py``)."""
        if not self._param_holders_cache:
            for r, groups in enumerate(self._partition_parameters()):
                for g in groups:
                    for p in g["params"]:
                        ranks = self._param_holders_cache.setdefault(p, [])
                        if r not in ranks:
                            ranks.append(r)
        return self._param_holders_cache

    @property
    def _param_to_index(self) -> dict:
        if not self._param_to_index_cache:
            self._param_to_index_cache = {p: i for i, p in enumerate(self._index_to_param)}
        return self._param_to_index_cache

    @property
    def _index_to_param(self) -> list:
        if not self._index_to_param_cache:
            self._index_to_param_cache = list(chain.from_iterable(
                g["params"] for g in self.param_groups))
        return self._index_to_param_cache

    def _init_local_optimizer(self) -> None:
        self.optim: Optimizer = self._optim_constructor(
            self._partition_parameters()[self.rank], **self._optim_defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    def _build_syncs(self) -> None:
        """The parameter sync of the current partition ([Note: ZeRO buckets])."""
        bucket_view = self.parameters_as_bucket_view
        per_rank = [[p for g in groups for p in g["params"] if p.requires_grad or not bucket_view]
                    for groups in self._partition_parameters()]
        self._syncs = _zero_buckets.build_syncs(per_rank, self.rank, bucket_view, self._syncs,
                                                self._share)

    def _shared(self) -> bool:
        """Whether any bucket is the host-shared one (the step's barriers are then due)."""
        return any(getattr(s, "shared", False) for s in self._syncs)

    @staticmethod
    def _sync_param_groups(src: list, dst: list) -> None:
        """Copy every key but ``params`` of each group of ``src`` to ``dst``'s."""
        if len(src) != len(dst):
            raise AssertionError(
                "Mismatch between number of source and destination parameter groups")
        for s, d in zip(src, dst):
            for k in s:
                if k != "params":
                    d[k] = s[k]

    # ------------------------------------------------------------------- API
    def add_param_group(self, param_group: dict) -> None:
        if self.initialized and self._overlap_with_ddp:
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only "
                               "supports a single parameter group")
        super().add_param_group(param_group)
        if not self.initialized:
            return
        new = self.param_groups[-1]["params"]
        self._verify_dense_params(new)
        self._all_params.extend(new)
        self._is_trainable_mask = self._get_is_trainable_mask()
        self._clear_cache()
        groups = self._partition_parameters()[self.rank]
        if len(groups) == len(self.optim.param_groups) + 1:
            self.optim.add_param_group(groups[-1])
        self._build_syncs()

    def _local_step(self, closure: Optional[Callable] = None, **kwargs: Any) -> Any:
        """The local optimizer's step (after a rebuild of the buckets where due).  With
        the shared bucket ([Note: ZeRO shared bucket]) the closure is evaluated here and a
        barrier (whose payload agrees on a rebuild) precedes the first write."""
        Join.notify_join_context(self)
        mask = self._get_is_trainable_mask()
        rebuild = False
        if mask != self._is_trainable_mask:
            logger.warning("ZeroRedundancyOptimizer detected that the trainable parameters "
                           "changed; rebuilding the parameter buckets if enabled")
            self._is_trainable_mask = mask
            rebuild = self.parameters_as_bucket_view
        rebuild = rebuild or any(s.moved() for s in self._syncs)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        loss = None
        if self._share is not None:  # a rebuild is collective: every rank agrees on it
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
                closure = None
            self._flag.fill_(1.0 if rebuild else 0.0)
            comm.all_reduce(self._flag, self._share, async_op=False)  # barrier: reads done
            rebuild = bool(self._flag[0] > 0)
        if rebuild:
            self._build_syncs()
        if closure is None:
            out = self.optim.step(**kwargs)
            loss = out if loss is None else loss
        else:
            loss = self.optim.step(closure=closure, **kwargs)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _sync_params(self) -> None:
        """The private buckets' all-gathers; for the shared one a barrier: every owner's
        writes are seen by every rank before its next forward."""
        for s in self._syncs:
            s.sync(self.rank, self.process_group)
        if self._share is not None and self._shared():
            comm.all_reduce(self._flag, self._share, async_op=False)

    def step(self, closure: Optional[Callable] = None, **kwargs: Any) -> Any:
        """The local step, then one all-gather per (device, dtype) bucket."""
        loss = self._local_step(closure=closure, **kwargs)
        self._sync_params()
        self._grads_partitioned = self._rs_in_backward = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._grads_partitioned = self._rs_in_backward = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters (in
        ``param_groups`` order), right whether each rank holds every gradient (ZeRO-1:
        torch's function) or only those of the parameters it owns (after a backward pass
        through ``cfsdp.optim.reduce_scatter_hook``).  In the second case each owner
        computes its gradients' norms as torch does, one all-reduce gives every rank every
        norm (each from its owner alone, so exactly), and the total and the clipping are
        torch's: the same bits as torch's function on the full gradients.  Call it on
        every rank."""
        params = [p for g in self.param_groups for p in g["params"]]
        if not self._grads_partitioned:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                  error_if_nonfinite, foreach)
        norm_type = float(norm_type)
        owner = self._param_to_rank
        mine = [i for i, p in enumerate(params) if owner[p] == self.rank and p.grad is not None]
        # [norms | has-grad flags], each entry from its owner alone: the sum is exact
        table = torch.zeros(2 * len(params), dtype=torch.float64)
        if mine:
            per = torch._foreach_norm([params[i].grad for i in mine], norm_type)
            for i, n in zip(mine, per):
                table[i] = n.double()
                table[len(params) + i] = 1.0
        comm.all_reduce(table, self.process_group, async_op=False)
        groups: dict = {}  # torch's grouping: by (device, dtype), in order of appearance
        for i, p in enumerate(params):
            if table[len(params) + i] > 0:
                groups.setdefault((p.device, p.dtype), []).append(table[i].to(p.dtype))
        if not groups:
            return torch.tensor(0.0)
        first = next(iter(groups))[0]
        total = torch.linalg.vector_norm(
            torch.stack([n.to(first) for ns in groups.values() for n in ns]), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        torch.nn.utils.clip_grads_with_norm_([params[i] for i in mine], max_norm, total, foreach)
        return total

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Every rank's state to rank ``to`` as flat buffers (one broadcast per rank and
        state run); the dict ``state_dict()`` then returns on ``to`` is a snapshot."""
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        self._consolidated, self._consolidated_to = None, to
        if not 0 <= to < self.world_size:
            return  # torch moves every rank's state to nobody; state_dict() then raises
        skeleton, payload = _zero_state.split_state(self.optim.state_dict()["state"])
        skeletons: list = [None] * self.world_size
        dist.all_gather_object(skeletons, skeleton, group=self.process_group)
        bufs = _zero_state.move_to(to, self.rank, skeletons, payload, self.process_group)
        if self.rank != to:
            return
        out: dict = {}
        index = self._param_to_index
        for r, groups in enumerate(self._partition_parameters()):
            local = [p for g in groups for p in g["params"]]
            for li, st in _zero_state.assemble(skeletons[r], bufs, r).items():
                out[index[local[li]]] = st
        self._consolidated = out

    def state_dict(self) -> dict:
        """The consolidated state (see ``consolidate_state_dict``) with the current
        ``param_groups``."""
        if self._consolidated is None:
            msg = ("Optimizer state has not been consolidated on this rank. "
                   f"Please call `consolidate_state_dict(to={self.rank})` on "
                   "all ranks beforehand if you meant to save the global state.")
            to = self._consolidated_to
            if to is not None and not 0 <= to < self.world_size:
                msg += (f" (cfsdp: the last consolidate_state_dict call had to={to}, which is "
                        f"not a rank of this optimizer's process group of {self.world_size} "
                        "ranks: pass a group rank)")
            raise RuntimeError(msg)
        sd = super().state_dict()
        state = sd["state"]
        state.update(self._consolidated)
        sd["state"] = dict(sorted(state.items()))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """This rank's entries into the local optimizer; the other ranks' entries of
        ``state_dict`` are set to ``None`` (torch's behaviour)."""
        for index, value in state_dict["state"].items():
            param = self._index_to_param[index]
            if self._param_to_rank[param] != self.rank:
                state_dict["state"][index] = None
            elif value is not None:
                st = _to_device(value, param.device)
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() == 0:
                        st[k] = v.cpu()
                self.optim.state[param] = st
        super().load_state_dict({**state_dict, "state": {}})
        self._sync_param_groups(state_dict["param_groups"], self.param_groups)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)

    # ------------------------------------------------------------------ Join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


_docs.adopt_class_docs(ZeroRedundancyOptimizer, _TorchZeRO)
