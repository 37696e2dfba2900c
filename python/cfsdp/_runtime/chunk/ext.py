"""All-gather extensions of a ``fully_shard`` unit: parameters whose sharded local tensor
defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torchao's float8 weights,
torch FSDP2's extension protocol, ``_fully_shard/_fsdp_param.py``).

[Note: all-gather extensions]
torch's FSDP2 shards such a parameter as any other (``param.new_zeros(padded chunk)``,
this rank's rows copied in, the sharded DTensor's local tensor a narrow of it: the
subclass), and on every unshard:

* ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` (or the older
  ``fsdp_pre_all_gather(mesh)``) on the sharded local tensor gives the all-gather inputs
  (one or several tensors, any dtypes, each of the padded chunk's size when the parameter
  is unevenly sharded) and a metadata object;
* each input is all-gathered (rank-major) into an all-gather output made once and kept
  (its storage freed on reshard);
* ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` (each output viewed as
  ``(-1, *input_size[1:])``) returns the unsharded tensor and the inner tensors to free on
  reshard, the first time; the unsharded parameter is the unsharded tensor's first
  ``outer_size`` elements (``as_strided``), made once.  Every later unshard gives the inner
  tensors their storage back and calls ``fsdp_post_all_gather(..., out=unsharded)``, which
  refills it in place.

cfsdp does the same, beside the packed C all-gather of the unit's other parameters: an
extension parameter keeps a slot in the unit's layout (``shard`` / ``natural``, zeros: what
its rows there hold is never read), which only its gradient uses.  Its all-gather inputs
are all-gathered one by one (``comm.all_gather``: an all-gather is a byte copy, so the
outputs are the bytes torch's one packed uint8 all-gather gives).  Forward binds the
unsharded parameter through :class:`_Route`, an autograd function that hands the
gradient it receives to the parameter's view of the flat parameter: the gradient of an
extension parameter is then reduced with the unit's, exactly as torch's ``foreach_reduce``
reduces a plain gradient (torch reduces ``unsharded_param.grad`` with the others too).

Not yet (each refused naming the parameter): a ``Shard(d > 0)`` placement, HSDP, a
tensor-parallel (DTensor) parameter, the meta device, ``reshard_after_forward`` as an int
(torch refuses that one too), and replacing the parameter after ``fully_shard``
(``to_empty``, ``load_state_dict(assign=True)``, ``module.to(dtype)``).  A gradient that is
itself a tensor subclass (autograd gives the unsharded tensor's own type) is a
``NotImplementedError`` naming the parameter in backward.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.nn as nn

from .. import comm
from ..base import alloc_storage, free_storage

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def has_extension(t: torch.Tensor) -> bool:
    """Whether ``t`` uses the all-gather extension protocol (both hooks, as torch
    requires; :func:`check_extension` names a parameter with only one)."""
    return hasattr(t, PRE) and hasattr(t, POST)


def check_extension(t: torch.Tensor, fqn: str) -> bool:
    """Whether parameter ``fqn`` uses the extension protocol; torch's error (an
    ``AssertionError``) when it defines only one of the two hooks."""
    pre, post = hasattr(t, PRE), hasattr(t, POST)
    if pre != post:
        raise AssertionError(
            "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using "
            f"all-gather extensions: {type(t).__name__} (cfsdp: parameter '{fqn}' defines only "
            f"{PRE if pre else POST}; define {POST if pre else PRE} too, or neither)"
        )
    return pre


class ExtState:
    """One extension parameter's pieces (torch's ``FSDPParam`` fields of the same role)."""

    __slots__ = ("padded_size", "padded", "local", "outputs", "inner", "param", "fqn")

    def __init__(self, p: torch.Tensor, rank: int, world: int, chunk_rows: int, local_rows: int,
                 fqn: str = ""):
        """This rank's chunk of ``p`` as torch makes it: ``p.new_zeros(padded chunk)`` (the
        subclass's own op), its rows copied in, the local tensor a narrow of it."""
        self.fqn = fqn  # for errors
        self.padded_size = torch.Size((chunk_rows, *p.shape[1:]))
        with torch.no_grad():
            self.padded = p.new_zeros(self.padded_size)
            if local_rows > 0:
                self.padded.narrow(0, 0, local_rows).copy_(
                    p.narrow(0, rank * chunk_rows, local_rows))
            self.local = self.padded.narrow(0, 0, local_rows)
        self.outputs: list[torch.Tensor] = []  # the all-gather outputs, made once
        self.inner: tuple = ()  # what fsdp_post_all_gather said to free on reshard
        self.param: Optional[nn.Parameter] = None  # the unsharded parameter, made once

    def free(self) -> None:
        """Reshard: free the all-gather outputs and the inner tensors (torch's
        ``free_unsharded_param``); the unsharded parameter object stays."""
        for t in (*self.outputs, *self.inner):
            if t.untyped_storage().size() != 0:
                free_storage(t)


def _inputs(q: Any, ext: ExtState, mesh: Any, mp_policy: Any) -> tuple[list, Any]:
    """``q``'s all-gather inputs and metadata: its ``fsdp_pre_all_gather`` (either
    signature), checked as torch checks them."""
    local = q.sharded._local_tensor
    pre = getattr(local, PRE)
    n = len(inspect.signature(pre).parameters)
    if n not in (1, 5):
        raise AssertionError(
            f"Invalid fsdp_pre_all_gather: {inspect.signature(pre)}\n"
            "Expects fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, "
            "outer_stride: tuple[int, ...], module: nn.Module, mp_policy: "
            f"MixedPrecisionPolicy) (cfsdp: parameter '{q.fqn}')"
        )
    if n == 1:
        return pre(mesh)
    inputs, metadata = pre(mesh, q.shape, q.stride, q.module, mp_policy)
    if local.size() != ext.padded_size and any(t.size() != ext.padded_size for t in inputs):
        raise AssertionError(
            "When a parameter is unevenly sharded by FSDP "
            f"(orig size={q.shape}, FSDP world size={mesh.size()}), fsdp_pre_all_gather "
            f"must return all-gather inputs with the padded sharded size {ext.padded_size} "
            f"but got {[t.size() for t in inputs]} (cfsdp: parameter '{q.fqn}')"
        )
    return inputs, metadata


def gather(qs: tuple, group: Any, mesh: Any, mp_policy: Any, param_dtype: torch.dtype) -> None:
    """Unshard the extension parameters ``qs`` of a unit (see [Note: all-gather
    extensions]), in torch's order: every one's all-gather inputs, the all-gathers, then
    every one's post-all-gather into its unsharded parameter."""
    pres = pre_all_gather(qs, mesh, mp_policy)
    all_gather(qs, pres, group)
    post_all_gather(qs, pres, param_dtype)


def pre_all_gather(qs: tuple, mesh: Any, mp_policy: Any) -> list:
    """Every one's ``(all-gather inputs, metadata)`` (on the streams' path: on the copy-in
    stream, as torch's ``foreach_all_gather``)."""
    return [_inputs(q, q.ext, mesh, mp_policy) for q in qs]


def _outputs(qs: tuple, pres: list, world: int):
    """Every one's all-gather outputs (made once, their storage back), with its input."""
    for q, (inputs, _) in zip(qs, pres):
        ext = q.ext
        if not ext.outputs:
            ext.outputs = [torch.empty(t.numel() * world, dtype=t.dtype, device=t.device)
                           for t in inputs]
        for out, t in zip(ext.outputs, inputs):
            alloc_storage(out)
            yield out, t


def all_gather(qs: tuple, pres: list, group: Any) -> None:
    """Every one's inputs all-gathered into its outputs."""
    for out, t in _outputs(qs, pres, group.size()):
        # through ``.data``: an output the unsharded parameter aliases (no cast in
        # fsdp_post_all_gather) must not bump the version counter autograd saved, as
        # torch's copy-out (a custom op) does not
        comm.all_gather(out.data, t.reshape(-1), group, async_op=False).wait()


def all_gather_staged(pres: list, group: Any) -> list:
    """The streams' path (inside the all-gather stream): every input all-gathered into a
    temporary of that stream (the outputs live on the current stream, as torch's
    ``all_gather_outputs``: ``copy_out`` fills them there)."""
    world, staged = group.size(), []
    for inputs, _ in pres:
        for t in inputs:
            tmp = torch.empty(t.numel() * world, dtype=t.dtype, device=t.device)
            comm.all_gather(tmp, t.reshape(-1), group, async_op=False).wait()
            staged.append(tmp)
    return staged


def copy_out(qs: tuple, pres: list, staged: list, world: int) -> None:
    """The streams' path (on the current stream, after it waited for the all-gather): the
    staged all-gathers into the outputs (through ``.data``, as ``all_gather``)."""
    for (out, _), tmp in zip(_outputs(qs, pres, world), staged):
        out.data.copy_(tmp)


def post_all_gather(qs: tuple, pres: list, param_dtype: torch.dtype) -> None:
    """Every one's ``fsdp_post_all_gather`` into its unsharded parameter (on the streams'
    path: on the current stream, after it waited for the all-gather, as torch's
    ``init_unsharded_param``)."""
    for q, (inputs, metadata) in zip(qs, pres):
        ext = q.ext
        post = getattr(q.sharded._local_tensor, POST)
        outs = tuple(o.view(-1, *t.shape[1:]) for o, t in zip(ext.outputs, inputs))
        if ext.param is None:
            unsharded, inner = post(outs, metadata, param_dtype)
            ext.inner = tuple(inner)
            full = torch.as_strided(unsharded, q.shape, q.stride, storage_offset=0)
            ext.param = nn.Parameter(full, requires_grad=q.requires_grad)
            continue
        for t in ext.inner:
            alloc_storage(t)
        post(outs, metadata, param_dtype, out=ext.param)


class _Route(torch.autograd.Function):
    """Forward: the unsharded parameter (an alias, so a refill in place is seen by what
    autograd saved); backward: its gradient, handed to the parameter's view of the unit's
    flat parameter ([Note: all-gather extensions])."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor, unsharded: torch.Tensor, fqn: str) -> torch.Tensor:
        ctx.fqn = fqn
        return unsharded.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if type(grad) is not torch.Tensor:  # never reduced silently as something else
            raise NotImplementedError(
                f"fully_shard: parameter '{ctx.fqn}' (all-gather extensions) got a gradient "
                f"of type {type(grad).__name__}; cfsdp reduces plain tensor gradients of such "
                "parameters only. Make fsdp_post_all_gather's unsharded tensor give a plain "
                "gradient, or use torch's fully_shard for this module.")
        return grad, None, None


def forward_view(view: Optional[torch.Tensor], ext: ExtState) -> torch.Tensor:
    """What forward binds for an extension parameter whose view of the flat parameter is
    ``view`` (None or detached: frozen, then the unsharded parameter itself)."""
    if view is None or not view.requires_grad:
        return ext.param
    return _Route.apply(view, ext.param.detach(), ext.fqn)


__all__ = ["ExtState", "check_extension", "forward_view", "gather", "has_extension"]
