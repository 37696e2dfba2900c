"""Consolidating cfsdp's ZeroRedundancyOptimizer state on one rank: flat buffers, not pickles.

[Note: ZeRO consolidation]
torch's ``consolidate_state_dict(to)`` pickles each rank's local ``optim.state_dict()``
and broadcasts the bytes (one pickled dict per rank; the receivers unpickle).  cfsdp
splits each rank's local state (``optim.state_dict()["state"]``, local parameter
indices) in two (:func:`split_state`):

* a :class:`Skeleton`: per local index, its state keys in order, each a tensor spec
  (dtype, shape) or a plain value (a Python number, ...), and the payload's run lengths.
  Small: it is what goes through pickle (``dist.all_gather_object``; every rank needs
  the payload sizes);
* the tensor *payload*: per dtype, the elements of every tensor, key by key (all
  ``exp_avg``s in parameter order, then all ``exp_avg_sq``s, ...), cut in *runs*: maximal
  sequences of tensors that already lie one after the other in memory.  cfsdp's fused
  optimizers keep each state kind of a bucket in one flat buffer in the bucket's
  parameter order, so under cfsdp's ZeRO (whose buckets are in the local optimizer's
  parameter order) a state kind is one run, sent from where it lies, without a copy.
  Tensors in more than ``MAX_RUNS`` runs (torch's optimizers: one tensor each) are
  packed into one buffer first (one ``torch.cat``).

Then (:func:`move_to`), for every rank r but the target and every dtype, one broadcast
per run from r (``comm.broadcast``: shared memory within a host, else the process
group), received by the target straight into the flat buffer its consolidated tensors
are views of (:func:`assemble`), by the others into a scratch buffer (a broadcast is
what every transport has; torch's consolidation broadcasts too).  The target's own
payload is copied: the consolidated dict is a snapshot of every rank's state at the
call (torch's holds the target's live state tensors, which later steps change).
Non-float dtypes travel as bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import _core
from .._runtime import comm

MAX_RUNS = 16
_FLOATS = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dt, torch.dtype):
        raise AssertionError(f"cfsdp ZeRO consolidation: unknown dtype {name!r}")
    return dt


@dataclass
class Skeleton:
    """One rank's local optimizer state without its tensor data (see the module doc).

    ``entries``: ``(local_index, specs)`` in index order, ``specs`` None (a None state)
    or ``[(key, ("t", dtype name, shape) | ("v", value))]``; ``runs``: per dtype name
    (in payload order), the run lengths in elements."""

    entries: list = field(default_factory=list)
    runs: dict = field(default_factory=dict)
    device: str = "cpu"


def _payload_order(entries: list) -> dict:
    """dtype name -> key -> [(entry position, key, shape)]: the payload order."""
    order: dict = {}
    for ei, (_, specs) in enumerate(entries):
        for k, spec in specs or ():
            if spec[0] == "t":
                order.setdefault(spec[1], {}).setdefault(k, []).append((ei, k, spec[2]))
    return order


def _run_view(first: Tensor, numel: int) -> Tensor:
    """A 1-D view of ``numel`` elements of ``first``'s storage from ``first`` on."""
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (numel,), (1,))


def _runs(tensors: list) -> list:
    """Maximal sequences of contiguous tensors lying one after the other in one storage,
    as 1-D views (a non-contiguous tensor: a contiguous copy of its own)."""
    out: list = []
    first, n, end, storage = None, 0, -1, -1
    for t in tensors:
        if t.numel() == 0:
            continue
        if not t.is_contiguous():
            if first is not None:
                out.append(_run_view(first, n))
                first = None
            out.append(t.contiguous().view(-1))
            continue
        sp = _core.storage_address(t)
        if first is not None and sp == storage and _core.address(t) == end:
            n += t.numel()
        else:
            if first is not None:
                out.append(_run_view(first, n))
            first, n, storage = t, t.numel(), sp
        end = _core.address(t) + t.numel() * t.element_size()
    if first is not None:
        out.append(_run_view(first, n))
    return out


def split_state(state: dict) -> tuple[Skeleton, dict]:
    """A local ``state_dict()["state"]`` as its skeleton and, per dtype name, its payload
    runs (1-D tensors, read in place where they can be)."""
    sk = Skeleton()
    for idx in sorted(state):
        st = state[idx]
        if st is None:
            sk.entries.append((idx, None))
            continue
        specs = []
        for k, v in st.items():
            if isinstance(v, Tensor):
                if type(v) is not Tensor and not isinstance(v, torch.nn.Parameter):
                    raise NotImplementedError(
                        f"cfsdp ZeroRedundancyOptimizer: state {k!r} of local parameter {idx} "
                        f"is a {type(v).__name__}; consolidation moves plain tensors only")
                specs.append((k, ("t", str(v.dtype), tuple(v.shape))))
                sk.device = str(v.device)
            else:
                specs.append((k, ("v", v)))
        sk.entries.append((idx, specs))
    payload = {}
    for dn, bykey in _payload_order(sk.entries).items():
        ts = [state[sk.entries[ei][0]][k].detach() for lst in bykey.values()
              for ei, k, _ in lst]
        runs = _runs(ts)
        if len(runs) > MAX_RUNS:
            runs = [torch.cat([t.reshape(-1) for t in ts])]
        payload[dn] = runs
        sk.runs[dn] = [r.numel() for r in runs]
    return sk, payload


def _wire(t: Tensor) -> Tensor:
    return t if t.dtype in _FLOATS else t.view(torch.uint8)


def move_to(to: int, rank: int, skeletons: list, payload: dict, group: Any) -> dict:
    """Every rank's payload to rank ``to`` (collective: every rank of ``group`` calls it
    with the same ``skeletons``).  Returns, on ``to``, ``{(rank, dtype name): flat
    buffer}`` (``to``'s own a copy), else ``{}``."""
    bufs: dict = {}
    scratch: dict = {}
    for r, sk in enumerate(skeletons):
        for dn, lens in sk.runs.items():
            dtype, total = _dtype(dn), sum(lens)
            device = torch.device(sk.device)
            if rank == to:
                dst = torch.empty(total, dtype=dtype, device=device)
                bufs[(r, dn)] = dst
            elif r != rank:
                if scratch.get(dn) is None or scratch[dn].numel() < max(lens, default=0):
                    scratch[dn] = torch.empty(max(lens), dtype=dtype, device=device)
            off = 0
            for i, n in enumerate(lens):
                if r == to:  # the target's own state is not sent
                    if rank == to:
                        bufs[(r, dn)][off : off + n].copy_(payload[dn][i])
                elif r == rank:
                    comm.broadcast(_wire(payload[dn][i]), r, group, async_op=False)
                elif rank == to:
                    comm.broadcast(_wire(bufs[(r, dn)][off : off + n]), r, group, async_op=False)
                else:
                    comm.broadcast(_wire(scratch[dn][:n]), r, group, async_op=False)
                off += n
    return bufs


def assemble(sk: Skeleton, bufs: dict, r: int) -> dict:
    """Rank ``r``'s local state rebuilt from its skeleton and the flat buffers of
    :func:`move_to`: ``{local index: {key: view or value} or None}``."""
    values: dict = {}
    for dn, bykey in _payload_order(sk.entries).items():
        buf, off = bufs[(r, dn)], 0
        for lst in bykey.values():
            for ei, k, shape in lst:
                n = math.prod(shape)
                values[(ei, k)] = buf[off : off + n].view(shape)
                off += n
        if off != buf.numel():
            raise AssertionError(f"cfsdp ZeRO consolidation: rank {r}'s {dn} payload has "
                                 f"{buf.numel()} elements, its skeleton {off}")
    out: dict = {}
    for ei, (idx, specs) in enumerate(sk.entries):
        out[idx] = None if specs is None else {
            k: values[(ei, k)] if spec[0] == "t" else spec[1] for k, spec in specs}
    return out

