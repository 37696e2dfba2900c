"""Fused optimizers over flat shards: ``cfsdp.optim.Adam``, ``AdamW``, ``SGD``.

Drop-in for ``torch.optim.Adam`` / ``AdamW`` / ``SGD`` (torch 2.13): they are
subclasses of those classes (so of ``torch.optim.Optimizer``), with the same
constructor signatures, defaults, validation, ``param_groups`` keys and
``state_dict()`` format (per-parameter ``step`` as a 0-dim float32 tensor,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``; SGD's ``momentum_buffer``),
so a state dict moves between them and torch.optim both ways, LR schedulers,
hooks, ``add_param_group``, ``zero_grad`` and closures work as with torch.
Only ``step()`` differs: one C pass per element (``csrc/optim.c``) instead of
torch's ten-odd tensor ops per parameter.

[Note: flat-shard fusion]
``step()`` looks at each parameter's local tensor (``p._local_tensor`` of a
DTensor, else ``p``) and its gradient's.  fp32 CPU contiguous parameters get
their state in flat buffers that mirror the layout of the memory the
parameters sit in (a unit's flat shard: one buffer per state kind per
cluster of neighbouring parameters, each parameter's state a view at the
parameter's offset; for DTensor parameters the state is a DTensor with the
parameter's mesh, placements, shape and stride whose local tensor aliases the
buffer through ``torch.from_dlpack``, as ``chunk.param`` builds parameters).
Parameters whose gradient and every state tensor sit at the same address
offset from the parameter (``grad.data_ptr() - param.data_ptr()`` the same
for all of them, and likewise per state kind) form a bucket that ONE C call
steps, with one ``(start, len)`` element range per parameter (adjacent ones
merged), so padding between parameters, frozen parameters and other groups'
parameters are never touched.  Other parameters still go to C, one range
each.  The plan is cached per group and checked every step against the
gradients' addresses (a new gradient buffer at the same relative layout just
moves the bucket's gradient base); it is rebuilt when a parameter gains or
loses its gradient, a gradient moves relative to the others, the group's
``params`` list or ``amsgrad``/momentum changes, or after
``load_state_dict`` (states replaced by fresh tensors are re-packed into flat
buffers at the next step, so the fast path comes back).  Each group keeps
its C parameters' ``step`` tensors as 0-dim views of one float32 buffer,
incremented by one op per step.  The plan also checks every step that each
C parameter's memory has not moved (``p.data = t``, as a
``ZeroRedundancyOptimizer`` rebuilding its buckets does) and that its state
dict is still the same object (``opt.state[p] = {...}``, as torch's
``ZeroRedundancyOptimizer.load_state_dict`` does); either rebuilds the plan.
State tensors replaced by hand inside a state dict
(``opt.state[p]["exp_avg"] = t``) are not noticed until the next
``load_state_dict``; in-place edits are fine (the plan keeps the tensors it
was built from, so the old buffers are what C steps, never freed memory).

The crossing itself is ``cfsdp._core.FusedPlan`` (the one door to C): the
plan hands it every C parameter's local tensor, gradient and states when it
is built, and the door checks each in full (``c_tensor_ok``, fp32), groups
the buckets and keeps their addresses; each step it checks only what can
change between steps (the parameters' addresses, each new gradient's cheap
form: a plain fp32 CPU tensor, contiguous, not lazily negated, the
parameter's numel, at its bucket's offset).  This module reads addresses
only through ``_core.address``, to lay out the state buffers.

What the C core does not take (fp64/bf16/fp16 parameters, non-CPU or strided
tensors, DTensor gradients with placements other than the parameter's,
aliasing memory, a parameter listed twice) runs torch's single-tensor math per
tensor with torch ops (``cfsdp._ref.optim``), with states created as torch
creates them.  ``CFSDP_IMPL=python`` runs the same plans on those twins.

[Note: duplicate parameters]
A parameter listed twice in a group (torch's Optimizer warns and keeps both)
is stepped by torch once per copy, in list order, with the one state of the
parameter (Adam's ``step`` counted twice a step); SGD reads every buffer
before the loop, so on the first step each copy starts a new buffer from the
gradient and the last one is kept.  Such a parameter takes the per-tensor
path, copy by copy, in that order, so the result is torch's.

Numerics: see ``cfsdp._ref.optim``: SGD is torch's bits; Adam's states are
torch's bits and its parameters within a few ulps per step (torch's CPU
``sqrt`` is MKL's 1-ulp one, the C core's is IEEE; with an IEEE sqrt in torch
the parameters are torch's bits too).

[Note: torch's kernels]
A param group takes torch's own step (``torch.optim.<Name>.step`` on that
group: its ``fused`` / ``foreach`` / single-tensor kernels, so torch's bits by
construction) when it asks for torch's kernels (``foreach=True``,
``fused=True``, ``capturable=True``, ``differentiable=True``, set at
construction or later, e.g. by ``load_state_dict`` from a torch optimizer built
with them) or holds a parameter on an accelerator (CUDA: torch's default there
is its multi-tensor kernels, the GPU idiom; cfsdp's C step is for CPU memory).
The other groups take cfsdp's fused C step.  Both keep torch's state format,
so a group may switch between them (state dicts load either way).  A
``GradScaler`` hands an optimizer built with ``fused=True`` its scale
(``grad_scale`` / ``found_inf``) to unscale in the step: torch's fused kernels
take it, its other paths raise torch's ``AssertionError``, and so does a group
on the C step (it stepped the scaled gradients, silently).

Options cfsdp's C step does not honour raise ``NotImplementedError`` naming
them at ``step()`` of a group on that path: Tensor ``lr`` / ``betas`` / SGD
``weight_decay``, complex parameters and sparse gradients (torch's kernels
take them: ask for one, e.g. ``foreach=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import _core
from .._torch.core import scalar_dtype as _get_scalar_dtype
from .._torch.core import unhooked_step

__all__ = ["Adam", "AdamW", "SGD"]

_F32 = torch.float32
_ADAM_KINDS = ("exp_avg", "exp_avg_sq")
_AMS_KIND = "max_exp_avg_sq"
_SGD_KIND = "momentum_buffer"
# Neighbouring parameters share one state buffer when the gap between them is
# at most this many bytes, or a quarter of the bytes the buffer would hold:
# the gaps (padding, other groups' parameters) are allocated but never used.
_CLUSTER_GAP_BYTES = 4096


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _torch_kernels(group: dict) -> bool:
    """Whether ``group`` takes torch's own step ([Note: torch's kernels])."""
    if any(group.get(k) for k in ("foreach", "fused", "capturable", "differentiable")):
        return True
    return any(p.device.type not in ("cpu", "meta") for p in group["params"])


def _reject_tensor(name: str, **values) -> None:
    for key, v in values.items():
        vals = v if isinstance(v, (tuple, list)) else (v,)
        if any(isinstance(x, Tensor) for x in vals):
            raise NotImplementedError(
                f"cfsdp.optim.{name}: a Tensor {key} is not supported; pass a Python float "
                f"(e.g. {key}=float(t)), or use torch.optim.{name}."
            )


_TORCH = "torch"  # a plan's kind for a parameter on the torch-ops path


@dataclass(eq=False)
class _Entry:
    """A C-path parameter of a plan (see [Note: flat-shard fusion])."""

    index: int  # in group["params"]
    param: Tensor
    local: Tensor  # the parameter's local tensor
    ptr: int  # the local tensor's address (_core.address), for packing its states
    numel: int
    placements: Optional[tuple]  # a DTensor parameter's placements, else None
    states: dict = field(default_factory=dict)  # kind -> local state tensor
    first: bool = False  # SGD: no momentum buffer yet
    state_obj: Optional[dict] = None  # the optimizer's state dict of the parameter at build


@dataclass(eq=False)
class _Plan:
    params: list  # the group's params list object it was built for
    param_ids: tuple
    kind: list  # per param: None (no grad at build), an _Entry, or "torch"
    key: tuple  # options the layout depends on (amsgrad / momentum != 0)
    version: int
    core: _core.FusedPlan  # the entries' checked crossing into C (tags: the _Entry objects)
    entries: list  # every C-path _Entry (steps[i] is entries[i]'s step)
    steps: Optional[Tensor] = None  # Adam: the entries' step tensors, flat

    @property
    def buckets(self) -> list:
        """The ``_core.FusedBucket``s: one C call each (``b.entries``: its _Entry objects)."""
        return self.core.buckets


class _FusedStep:
    """What the three optimizers share: the plans, state packing and step loop.
    Mixed in before the torch class (``class AdamW(_FusedStep, torch.optim.AdamW)``)."""

    _cf_name = ""
    _cf_kinds: tuple = ()

    # ----------------------------------------------------------- plumbing
    def _cf_reset(self) -> None:
        self._cf_plans: dict[int, _Plan] = {}
        self._cf_version = getattr(self, "_cf_version", 0) + 1

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._cf_reset()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._cf_reset()

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]  # with the defaults filled in
        if not _torch_kernels(group):
            try:
                self._cf_check_group(group)
            except NotImplementedError:
                self.param_groups.pop()  # not added, as torch leaves a group it refuses
                raise

    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Perform a single optimization step (see the module docstring).

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not hasattr(self, "_cf_plans"):
            self._cf_reset()
        torch_groups = [g for g in self.param_groups if _torch_kernels(g)]
        if torch_groups:
            self._cf_torch_step(torch_groups)
        with torch.no_grad():
            for gi, group in enumerate(self.param_groups):
                if not _torch_kernels(group):
                    self._cf_check_group(group)
                    if (getattr(self, "grad_scale", None) is not None
                            or getattr(self, "found_inf", None) is not None):
                        # a GradScaler's unscale-in-step ([Note: torch's kernels]): only
                        # torch's fused kernels take it; its other paths raise this
                        raise AssertionError("Expected grad_scale and found_inf to be None")
                    self._cf_step_group(gi, group)
        return loss

    def _cf_torch_step(self, groups: list) -> None:
        """torch's own step on ``groups`` only ([Note: torch's kernels]): the torch class's
        ``step`` sees just those groups (the state is keyed by parameter, so it reads and
        writes theirs); the step hooks ran once, around this optimizer's ``step``.

        The torch class's ``step`` is called without torch's hook wrapper: a torch
        optimizer of that class made anywhere in the process wraps the class's ``step``
        (``Optimizer._patch_step_function``), and through it the step pre/post hooks (this
        optimizer's and the global ones) ran a second time, on this optimizer, e.g. a
        gradient-scaling pre-hook scaled twice."""
        step = unhooked_step(super().step.__func__)  # type: ignore[misc]  (the torch class)
        every = self.param_groups
        self.param_groups = groups
        try:
            step(self)
        finally:
            self.param_groups = every

    def _cf_check_group(self, group: dict) -> None:
        _reject_tensor(self._cf_name, **{k: group[k] for k in self._cf_tensor_keys if k in group})

    # ------------------------------------------------------------- plans
    def _cf_layout_key(self, group: dict) -> tuple:
        raise NotImplementedError  # defined by each optimizer

    def _cf_plan(self, gi: int, group: dict, params: list, grads: list) -> _Plan:
        """The cached plan if it still fits this step's gradients (then with
        every bucket's gradient offset refreshed), else a new one."""
        plan = self._cf_plans.get(gi)
        if (
            plan is None
            or plan.version != self._cf_version
            or plan.params is not params
            or len(params) != len(plan.kind)
            or plan.key != self._cf_layout_key(group)
            or plan.param_ids != tuple(map(id, params))
            or not self._cf_refresh(plan, grads)
        ):
            plan = self._cf_build(gi, group, params, grads)
        return plan

    def _cf_refresh(self, plan: _Plan, grads: list) -> bool:
        """Check this step's gradients against the plan (cheaply: one pass over
        the parameters, then ``_core.FusedPlan.refresh``'s over the C entries, which
        records each bucket's gradient offset).  A parameter whose memory moved
        (``p.data = ...``, e.g. a ZeroRedundancyOptimizer rebuilding its buckets; a
        DTensor parameter given another local tensor) or whose state dict was replaced
        (``opt.state[p] = {...}``, as torch's ZeroRedundancyOptimizer loads a
        checkpoint) also fails the check: the plan's addresses are stale."""
        state = self.state
        gls = []
        for kind, g in zip(plan.kind, grads):
            if kind is None:
                if g is not None:
                    return False  # a parameter got its first gradient
                continue
            if kind is _TORCH:
                continue
            if g is None or state.get(kind.param) is not kind.state_obj:
                return False
            if kind.placements is None:
                gls.append(g)  # a DTensor gradient fails the door's type check
            elif (not isinstance(g, DTensor) or g.placements != kind.placements
                  or kind.param._local_tensor is not kind.local):
                return False
            else:
                gls.append(g._local_tensor)
        return plan.core.refresh(gls)

    def _cf_build(self, gi: int, group: dict, params: list, grads: list) -> _Plan:
        kinds: list = []
        entries: list[_Entry] = []
        counts: dict = {}
        for p in params:
            counts[id(p)] = counts.get(id(p), 0) + 1
        dups = {k for k, n in counts.items() if n > 1}
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is None:
                kinds.append(None)
                continue
            if g.is_sparse:
                raise NotImplementedError(
                    f"cfsdp.optim.{self._cf_name}: parameter {i} of param group {gi} has a "
                    "sparse gradient, which is not supported; use torch.optim."
                )
            if torch.is_complex(p):
                raise NotImplementedError(
                    f"cfsdp.optim.{self._cf_name}: parameter {i} of param group {gi} is "
                    f"complex ({p.dtype}), which is not supported; use torch.optim."
                )
            # a parameter listed twice: torch's path, copy by copy ([Note: duplicate
            # parameters])
            e = self._cf_entry(i, p, g) if id(p) not in dups else None
            kinds.append(e if e is not None else _TORCH)
            if e is not None:
                entries.append(e)
        if self._cf_kinds_of(group):  # torch's state order: parameter order
            for p, kind in zip(params, kinds):
                if kind is not None:
                    self.state[p]  # noqa: B018  (creates the entry)
        self._cf_pack(entries, group)
        steps = self._cf_home_steps(entries) if self._cf_uses_step else None
        for e in entries:
            e.state_obj = self.state.get(e.param)
        state_kinds = self._cf_kinds_of(group)
        core = _core.FusedPlan(
            entries, [e.local for e in entries], [_local(grads[e.index]) for e in entries],
            [tuple(e.states[k] for k in state_kinds) for e in entries],
            [e.first for e in entries])
        plan = _Plan(params, tuple(map(id, params)), kinds, self._cf_layout_key(group),
                     self._cf_version, core, entries, steps)
        if not self._cf_refresh(plan, grads):
            raise AssertionError("cfsdp.optim: a freshly built plan does not fit its gradients")
        self._cf_plans[gi] = plan
        return plan

    @staticmethod
    def _cf_entry(i: int, p: Tensor, g: Tensor) -> Optional[_Entry]:
        """The parameter as a C-path entry, or None for the torch-ops path."""
        if isinstance(p, DTensor):
            if not isinstance(g, DTensor) or g.placements != p.placements:
                return None
            pl, gl, placements = p._local_tensor, g._local_tensor, p.placements
        else:
            if isinstance(g, DTensor):
                return None
            pl, gl, placements = p, g, None
        if not (_core.fused_ok(pl) and _core.fused_ok(gl) and gl.numel() == pl.numel()):
            return None
        return _Entry(i, p, pl, _core.address(pl), pl.numel(), placements)

    # ----------------------------------------------------------- packing
    def _cf_pack(self, entries: list, group: dict) -> None:
        """Give every entry its state views, re-packing each cluster of
        neighbouring parameters whose states are not one flat mirror yet."""
        kinds = self._cf_kinds_of(group)
        if not kinds:  # SGD without momentum keeps no state, as torch
            return
        nonempty = sorted((e for e in entries if e.numel > 0), key=lambda e: e.ptr)
        for e in entries:
            if e.numel == 0:  # no memory to mirror: torch's zeros_like
                st = self.state[e.param]
                for k in kinds:
                    if st.get(k) is None:
                        st[k] = torch.zeros_like(e.param, memory_format=torch.preserve_format)
                        e.first = True
                    e.states[k] = _local(st[k])
        for cluster in _clusters(nonempty):
            if not self._cf_packed(cluster, kinds):
                self._cf_repack(cluster, kinds)
            for e in cluster:
                st = self.state[e.param]
                e.states = {k: _local(st[k]) for k in kinds}

    def _cf_packed(self, cluster: list, kinds: tuple) -> bool:
        for k in kinds:
            delta = None
            for e in cluster:
                s = self.state[e.param].get(k) if e.param in self.state else None
                if s is None:
                    return False
                if (e.placements is None) != (not isinstance(s, DTensor)):
                    return False
                if e.placements is not None and s.placements != e.placements:
                    return False
                sl = _local(s)
                if not (_core.fused_ok(sl) and sl.shape == e.local.shape):
                    return False
                d = _core.address(sl) - e.ptr
                if delta is None:
                    delta = d
                elif d != delta:
                    return False
        return True

    def _cf_repack(self, cluster: list, kinds: tuple) -> None:
        lo = cluster[0].ptr
        hi = max(e.ptr + 4 * e.numel for e in cluster)
        for k in kinds:
            # zeros: the gaps are never read, but a state buffer of garbage
            # would show up in a debugger as if it were state
            buf = torch.zeros((hi - lo) // 4, dtype=_F32)
            for e in cluster:
                st = self.state[e.param]
                off = (e.ptr - lo) // 4
                view = buf[off : off + e.numel].view(e.local.shape)
                old = st.get(k)
                if old is None:
                    e.first = True
                else:
                    ol = _local(old)
                    if ol.shape != e.local.shape:
                        raise ValueError(
                            f"cfsdp.optim.{self._cf_name}: state '{k}' of parameter "
                            f"{e.index} has local shape {tuple(ol.shape)}, expected "
                            f"{tuple(e.local.shape)} (the parameter's)"
                        )
                    view.copy_(ol)
                st[k] = _wrap_like(view, e.param)

    _cf_uses_step = False

    def _cf_home_steps(self, entries: list) -> Tensor:
        """One flat step buffer for the entries; each state's 'step' a 0-dim view."""
        vals = []
        for e in entries:
            s = self.state[e.param].get("step")
            vals.append(float(s) if s is not None else 0.0)
        steps = torch.tensor(vals, dtype=_get_scalar_dtype())
        for i, e in enumerate(entries):
            st = self.state[e.param]
            rest = {k: v for k, v in st.items() if k != "step"}
            st.clear()  # torch's key order: step first
            st["step"] = steps[i]
            st.update(rest)
        return steps


def _wrap_like(local: Tensor, param: Tensor) -> Tensor:
    """``local`` as a state of ``param``: a DTensor like torch's
    ``zeros_like(param)`` for a DTensor parameter (its local tensor aliasing
    ``local`` at storage offset 0 so that deepcopy works), else ``local``."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        torch.from_dlpack(local), param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )


def _clusters(entries: list) -> list:
    """Entries sorted by address, cut where the gap to the next is large (see
    _CLUSTER_GAP_BYTES) or the next overlaps (aliasing parameters)."""
    out, cur, end, used = [], [], 0, 0
    for e in entries:
        nbytes = 4 * e.numel
        if cur:
            gap = e.ptr - end
            if gap < 0 or gap > max(_CLUSTER_GAP_BYTES, (used + nbytes) // 4):
                out.append(cur)
                cur, used = [], 0
        cur.append(e)
        end = max(end, e.ptr + nbytes) if len(cur) > 1 else e.ptr + nbytes
        used += nbytes
    if cur:
        out.append(cur)
    return out


class Adam(_FusedStep, torch.optim.Adam):
    __doc__ = (
        "``torch.optim.Adam`` with cfsdp's fused step (see ``cfsdp.optim``).\n\n"
        + (torch.optim.Adam.__doc__ or "")
    )
    _cf_name = "Adam"
    _cf_tensor_keys = ("lr", "betas", "weight_decay", "eps")
    _cf_uses_step = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        if not (foreach or fused or capturable or differentiable):  # torch's kernels take them
            _reject_tensor(self._cf_name, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._cf_reset()
        torch.optim.Adam.__init__(
            self, params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
            maximize=maximize, capturable=capturable, differentiable=differentiable,
            fused=fused, decoupled_weight_decay=decoupled_weight_decay,
        )

    def _cf_kinds_of(self, group: dict) -> tuple:
        return _ADAM_KINDS + ((_AMS_KIND,) if group["amsgrad"] else ())

    def _cf_layout_key(self, group: dict) -> tuple:
        return (bool(group["amsgrad"]),)

    def _cf_step_group(self, gi: int, group: dict) -> None:
        params = group["params"]
        grads = [p.grad for p in params]
        plan = self._cf_plan(gi, group, params, grads)
        beta1, beta2 = group["betas"]
        hp = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                  weight_decay=group["weight_decay"],
                  decoupled=bool(group["decoupled_weight_decay"]),
                  amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]))
        if plan.steps is not None and len(plan.entries):
            plan.steps.add_(1)
            vals = plan.steps.tolist()
            uniform = min(vals) == max(vals)
            where = {id(e): i for i, e in enumerate(plan.entries)} if not uniform else None
            for b in plan.buckets:
                if uniform:
                    self._cf_adam_bucket(b, vals[0], hp)
                else:  # parameters at different steps: one call per step value
                    by_step: dict = {}
                    for j, e in enumerate(b.entries):
                        by_step.setdefault(vals[where[id(e)]], []).append(j)
                    for s, positions in by_step.items():
                        self._cf_adam_bucket(b.part(positions), s, hp)
        kinds = self._cf_kinds_of(group)
        for i, kind in enumerate(plan.kind):
            if kind is _TORCH:
                self._cf_adam_torch(params[i], grads[i], kinds, hp)

    def _cf_adam_bucket(self, b: _core.FusedBucket, step: float, hp: dict) -> None:
        if _core.optim_c_available():
            b.adam_step(step=step, **hp)
            return
        for e in b.entries:  # CFSDP_IMPL=python: the twin, tensor by tensor
            g = _plan_grad(e)
            _core.adam_tensor(e.local, g, e.states["exp_avg"], e.states["exp_avg_sq"],
                              e.states.get(_AMS_KIND), step=step, **hp)

    def _cf_adam_torch(self, p: Tensor, g: Tensor, kinds: tuple, hp: dict) -> None:
        """torch's own per-tensor path, states as torch creates them."""
        st = self.state[p]
        if len(st) == 0:
            st["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        for k in kinds:
            if st.get(k) is None:
                st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["step"] += 1
        _core.adam_tensor(p, g, st["exp_avg"], st["exp_avg_sq"], st.get(_AMS_KIND),
                          step=float(st["step"]), **hp)


def _plan_grad(e: _Entry) -> Tensor:
    """The entry's local gradient (checked by _cf_refresh this step)."""
    g = e.param.grad
    return g._local_tensor if isinstance(g, DTensor) else g


class AdamW(Adam, torch.optim.AdamW):
    __doc__ = (
        "``torch.optim.AdamW`` with cfsdp's fused step (see ``cfsdp.optim``).\n\n"
        + (torch.optim.AdamW.__doc__ or "")
    )
    _cf_name = "AdamW"

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        Adam.__init__(
            self, params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
            maximize=maximize, capturable=capturable, differentiable=differentiable,
            fused=fused, decoupled_weight_decay=True,
        )


class SGD(_FusedStep, torch.optim.SGD):
    __doc__ = (
        "``torch.optim.SGD`` with cfsdp's fused step (see ``cfsdp.optim``).\n\n"
        + (torch.optim.SGD.__doc__ or "")
    )
    _cf_name = "SGD"
    _cf_tensor_keys = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        if not (foreach or fused or differentiable):  # torch's kernels take them
            _reject_tensor(self._cf_name, lr=lr, momentum=momentum, dampening=dampening,
                           weight_decay=weight_decay)
        self._cf_reset()
        torch.optim.SGD.__init__(
            self, params, lr, momentum, dampening, weight_decay, nesterov,
            maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused,
        )

    def _cf_kinds_of(self, group: dict) -> tuple:
        return (_SGD_KIND,) if group["momentum"] != 0 else ()

    def _cf_layout_key(self, group: dict) -> tuple:
        return (group["momentum"] != 0,)

    def _cf_step_group(self, gi: int, group: dict) -> None:
        params = group["params"]
        grads = [p.grad for p in params]
        plan = self._cf_plan(gi, group, params, grads)
        hp = dict(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                  weight_decay=group["weight_decay"], nesterov=bool(group["nesterov"]),
                  maximize=bool(group["maximize"]))
        momentum = group["momentum"] != 0
        any_first = False
        for b in plan.buckets:
            any_first |= b.first
            if _core.optim_c_available():
                b.sgd_step(**hp)
            else:
                for e in b.entries:
                    _core.sgd_tensor(e.local, _plan_grad(e), e.states.get(_SGD_KIND),
                                     first_step=b.first, **hp)
        if any_first:  # the buffers are set now: rebuild, one bucket per layout
            self._cf_plans.pop(gi, None)
        torch_path = [i for i, kind in enumerate(plan.kind) if kind is _TORCH]
        if torch_path:
            self._cf_sgd_torch([params[i] for i in torch_path], [grads[i] for i in torch_path],
                               momentum, hp)

    def _cf_sgd_torch(self, ps: list, gs: list, momentum: bool, hp: dict) -> None:
        """torch's own per-tensor path (``_single_tensor_sgd``): the buffers are read for
        every parameter first, a missing one is a clone of the first gradient, and they
        are stored back in order ([Note: duplicate parameters]: a parameter listed twice
        gets a new buffer for each copy on its first step, and keeps the last)."""
        if not momentum:
            for p, g in zip(ps, gs):
                _core.sgd_tensor(p, g, None, first_step=False, **hp)
            return
        bufs = [self.state[p].get(_SGD_KIND) for p in ps]
        for k, (p, g) in enumerate(zip(ps, gs)):
            buf = bufs[k]
            first = buf is None
            if first:
                buf = bufs[k] = torch.empty_like(g, memory_format=torch.preserve_format)
            _core.sgd_tensor(p, g, buf, first_step=first, **hp)
        for p, buf in zip(ps, bufs):
            self.state[p][_SGD_KIND] = buf
