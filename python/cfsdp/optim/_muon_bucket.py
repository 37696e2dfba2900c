"""``cfsdp.optim.Muon``'s exchange of sharded matrices with their owners, in bounded buckets.

Both sharded layouts (``_muon_shard``: ``torch.chunk`` along one dim, or the wrapper's element
ranges; ``_muon_mesh``: TP x FSDP's blocks) come here as blocks: rank ``r`` of the group holds
the rectangular block ``blocks[k].of_rank[r] = (starts, sizes)`` of matrix ``k``'s view shape
(its shape, or ``[numel]`` for element ranges), and every rank knows every rank's block from the
shapes and placements.  ``exchange_blocks``:

1. owners from ``assign_owners`` over the full shapes, buckets from ``plan_buckets`` over the
   matrices' bytes on the wire (``bucket_bytes()``: ``BUCKET_BYTES``, or the
   ``CFSDP_MUON_BUCKET_BYTES`` environment variable), both computed from what every rank of the
   group knows identically, so every rank makes the same sequence of collectives; the bound is
   the one input a rank could disagree on (an environment set per host, read once per process),
   so a group's first exchange checks it on every rank with one small all-reduce
   (``agreed_bucket_bytes``) and every rank raises, naming the variable, where they differ,
   instead of one rank waiting for a collective the others never post;
2. per bucket, one all-to-all to the owners (``comm.all_to_all``: shared memory among the
   ranks of one host, shared memory and the process group in two levels across hosts, else
   the process group's ``all_to_all_single``; every rank knows every rank's blocks, so each
   passes the whole counts matrix, which the shared-memory ranks check they agree on): each
   rank writes its block of every matrix of the bucket straight into its slot of one send
   buffer of the wire dtype (bf16: Newton–Schulz's first op is ``.bfloat16()``, an
   elementwise rounding, and ``copy_`` into a bf16 buffer is the same conversion, fp64
   included; no padding: every rank knows every block's size), ordered by destination rank,
   then by matrix index; the owner receives into one buffer and writes the blocks into its
   full matrices;
3. the owner orthogonalizes the bucket's matrices in one call (each through torch's
   function: [Note: Newton-Schulz per matrix] in ``_muon``), writes each rank's block of each
   result into one send buffer, and one all-to-all brings every rank its block of the results;
4. pipelined: bucket ``b + 1``'s forward exchange is issued (``async_op=True``) before the
   owners orthogonalize bucket ``b``, and bucket ``b``'s return is in flight while bucket
   ``b + 1`` is orthogonalized; every return is waited for before this returns (before the
   caller updates the parameters).

A rank holds at a time about two buckets' send and receive buffers, one bucket's full matrices
and Newton–Schulz operands, and its own blocks of the results (what the parameter update needs),
instead of every matrix of the group.  The copies and Newton–Schulz are torch ops; the
exchanges are cfsdp's collectives (C on a host).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .._runtime import comm
from ._muon_owners import assign_owners, plan_buckets

__all__ = ["BUCKET_BYTES", "BUCKET_ENV", "agreed_bucket_bytes", "bucket_bytes", "exchange_blocks"]

# a bucket's bound in bytes on the wire (the sum of its full matrices'); a matrix larger than the
# bound goes alone
BUCKET_BYTES = 1 << 20
BUCKET_ENV = "CFSDP_MUON_BUCKET_BYTES"


# CFSDP_MUON_BUCKET_BYTES's text as this process read it the first time (None: not read yet)
_ENV_READ: Optional[str] = None
# the process groups whose ranks were found to agree on the bound (their first exchange)
_AGREED: "weakref.WeakSet" = weakref.WeakSet()
# the largest bound taken: the agreement sends it (and its negation) as int64
_MAX_BOUND = 1 << 62


def bucket_bytes() -> int:
    """The bucket bound: ``CFSDP_MUON_BUCKET_BYTES`` when set, else ``BUCKET_BYTES``.  The
    variable is read once per process (a later change is ignored: every rank keeps the bound
    its group agreed on); a value that is not a positive integer below 2**62 is a
    ``ValueError``."""
    global _ENV_READ
    if _ENV_READ is None:
        _ENV_READ = os.environ.get(BUCKET_ENV, "").strip()
    if not _ENV_READ:
        return int(BUCKET_BYTES)
    try:
        value = int(_ENV_READ)
    except ValueError:
        value = -1
    if not 1 <= value < _MAX_BOUND:
        raise ValueError(f"{BUCKET_ENV}={_ENV_READ!r}: expected a positive integer (bytes) "
                         "below 2**62")
    return value


def agreed_bucket_bytes(pg, count: int, device: torch.device) -> int:
    """``bucket_bytes()``, checked equal on every rank of ``pg`` (``count`` ranks) at the group's
    first exchange: one all-reduce (MAX of the bound and of its negation) on ``device``, then
    never again for that group (the variable is read once per process, so a rank cannot change
    its bound later on its own).  Where the ranks differ, or one rank's value is not a positive
    integer, every rank raises a ``ValueError`` naming the variable: a bound differing silently
    would give the ranks different buckets, so different collectives (a hang, or blocks read
    with another rank's sizes)."""
    try:
        bound, bad = bucket_bytes(), None
    except ValueError as e:
        bound, bad = 0, e
    if count <= 1 or pg in _AGREED:
        if bad is not None:
            raise bad
        return bound
    both = torch.tensor([bound, -bound], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pg)
    hi, lo = (int(v) for v in both.tolist())
    lo = -lo
    if bad is not None:
        raise bad
    if hi != lo:
        what = "a rank's value is not a positive integer" if lo == 0 else \
            f"the ranks between {lo} and {hi} bytes"
        raise ValueError(
            f"cfsdp.optim.Muon: the exchange's bucket bound differs across the {count} ranks of a "
            f"group ({BUCKET_ENV}, read once per process: this rank {bound}, {what}); the buckets "
            f"decide the collectives, so every rank must use the same bound: set {BUCKET_ENV} to "
            f"one positive integer on every rank, or unset it everywhere")
    _AGREED.add(pg)
    return bound


def _region(block: tuple) -> tuple:
    starts, sizes = block[:2]
    return tuple(slice(a, a + b) for a, b in zip(starts, sizes))


def _piece(block: tuple) -> tuple:
    """The shape of a rank's piece: its block's, or ``(hi - lo,)`` for a range of one."""
    return tuple(block[1]) if len(block) == 2 else (block[3] - block[2],)

def exchange_blocks(
    pg,
    count: int,
    index: int,
    shapes: Sequence[Sequence[int]],
    views: Sequence[Sequence[int]],
    blocks: Sequence[Sequence[tuple]],
    chunks: list,
    orthogonalize: Callable[[list], list],
    out_dtype: torch.dtype,
    wire_dtype: Optional[torch.dtype] = None,
    on_result: Optional[Callable[[int, Tensor], None]] = None,
    strides: Optional[Sequence[Optional[Sequence[int]]]] = None,
) -> list[Optional[Tensor]]:
    """This rank's block of ``orthogonalize``'s result for every matrix (see the module
    docstring).  Over process group ``pg`` (``count`` ranks, this one ``index``): matrix ``k``
    of shape ``shapes[k]`` is split in view shape ``views[k]`` (same numel), rank ``r`` holding
    block ``blocks[k][r] = (starts, sizes)`` of it; ``chunks[k]`` is this rank's block (any
    dtype: it travels as ``wire_dtype``, default the chunks' own); each entry of the list
    ``chunks`` is set to None once it is in a send buffer, so that a caller holding no other
    reference frees it bucket by bucket.  ``orthogonalize`` takes a list of full tensors of
    ``wire_dtype`` (its own to overwrite) and returns one ``out_dtype`` tensor per input,
    reshapeable to the input's shape (it may drop the list's entries as it consumes them).
    Every rank of ``pg`` calls this with the same shapes,
    views and blocks.  Returns this rank's block of every result (``out_dtype``, shaped as its
    block); with ``on_result``, ``on_result(k, block)`` gets each as soon as its bucket's return
    has landed (bucket by bucket, its receive buffer then freed) and the list holds None.
    A block may also be ``(starts, sizes, lo, hi)``: the rank holds elements ``[lo, hi)`` of
    the row-major flattened block (its chunk is 1-D; the wrapper's tensor-parallel originals:
    a TP block, dp-sharded by element ranges); the ranks sharing a block cover it between them.
    ``strides[k]``, when given and not None, says matrix ``k`` is not row-major (the wrapper's
    strided originals, laid out in memory order): its view ``[numel]`` is its memory, the
    matrix ``as_strided(shapes[k], strides[k])`` of it; the owner orthogonalizes the matrix
    (made contiguous: the same values) and its result goes back in memory order."""
    n, me = count, index
    for k, (s, b, t) in enumerate(zip(shapes, blocks, chunks)):
        if tuple(t.shape) != _piece(b[me]):
            raise AssertionError(f"matrix {k} of shape {tuple(s)}: local block {tuple(t.shape)} "
                                 f"on rank {me} of {n}, expected {_piece(b[me])}")
    numel = [[math.prod(_piece(blk)) for blk in b] for b in blocks]  # [matrix][rank]
    stride = [None] * len(shapes) if strides is None else [
        None if s is None else tuple(int(x) for x in s) for s in strides]
    if wire_dtype is None:
        wire_dtype = chunks[0].dtype if chunks else out_dtype
    owners = assign_owners(shapes, n)
    item = torch.empty(0, dtype=wire_dtype).element_size()
    device = chunks[0].device if chunks else torch.device("cpu")
    bound = agreed_bucket_bytes(pg, n, device) if shapes else bucket_bytes()
    buckets = plan_buckets([math.prod(s) * item for s in shapes], bound)

    def a2a(send: Tensor, counts: list, dtype: torch.dtype):
        """Post one all-to-all of ``counts`` (the whole matrix, sender-major: every rank
        knows every rank's blocks) through cfsdp's collectives: (work, send, recv)."""
        recv = torch.empty(sum(row[me] for row in counts), dtype=dtype, device=device)
        work = comm.all_to_all(recv, send, counts, pg, async_op=True)
        return work, send, recv

    def forward(ks: list):
        """Post the bucket's blocks to their owners: (work, send, recv)."""
        dest = [[k for k in ks if owners[k] == r] for r in range(n)]
        splits = [sum(numel[k][me] for k in d) for d in dest]
        send = torch.empty(sum(splits), dtype=wire_dtype, device=device)
        off = 0
        for d in dest:
            for k in d:
                send.narrow(0, off, numel[k][me]).view(_piece(blocks[k][me])).copy_(chunks[k])
                chunks[k] = None
                off += numel[k][me]
        counts = [[sum(numel[k][s] for k in ks if owners[k] == r) for r in range(n)]
                  for s in range(n)]
        return a2a(send, counts, wire_dtype)

    def assembled(ks: list, recv: Tensor) -> tuple:
        """The owner's full matrices of the bucket (rank r's blocks in ``recv`` after rank
        r - 1's, each rank's in matrix order): (matrix indices, full matrices)."""
        mine = [k for k in ks if owners[k] == me]
        fulls = [torch.empty(views[k], dtype=wire_dtype, device=device) for k in mine]
        ranged: dict = {}  # (matrix, block) -> the block row-major, filled range by range
        off = 0
        for r in range(n):
            for full, k in zip(fulls, mine):
                b, got = blocks[k][r], recv.narrow(0, off, numel[k][r])
                if len(b) == 2:
                    full[_region(b)] = got.view(b[1])
                else:
                    key = (k, tuple(b[0]), tuple(b[1]))
                    if key not in ranged:
                        ranged[key] = torch.empty(math.prod(b[1]), dtype=wire_dtype,
                                                  device=device)
                    ranged[key][b[2]:b[3]] = got
                off += numel[k][r]
        for full, k in zip(fulls, mine):
            for (kk, starts, sizes), flat in list(ranged.items()):
                if kk == k:
                    full[_region((starts, sizes))] = flat.view(sizes)
        del ranged
        return mine, [f.view(shapes[k]) if stride[k] is None else
                      f.as_strided(shapes[k], stride[k]).contiguous()
                      for f, k in zip(fulls, mine)]

    def orthogonalized(mine: list, fulls: list) -> list:
        """``orthogonalize``'s results, checked, in view shape (``fulls`` handed over)."""
        if not fulls:
            return []
        results = orthogonalize(fulls)
        out = []
        for k, res in zip(mine, results):
            if res.dtype != out_dtype:
                raise AssertionError(f"orthogonalize returned {res.dtype}, expected {out_dtype}")
            if stride[k] is None:
                out.append(res.reshape(views[k]))
            else:  # back to memory order
                mem = torch.empty(views[k], dtype=out_dtype, device=device)
                mem.as_strided(shapes[k], stride[k]).copy_(res.reshape(shapes[k]))
                out.append(mem)
        return out

    def back(ks: list, mine: list, results: list):
        """Post each rank its block of the owner's results: (work, send, recv)."""
        splits = [sum(numel[k][r] for k in mine) for r in range(n)]
        send = torch.empty(sum(splits), dtype=out_dtype, device=device)
        off = 0
        for r in range(n):
            for k, res in zip(mine, results):
                b = blocks[k][r]
                part = res[_region(b)]
                if len(b) == 4:
                    part = part.reshape(-1)[b[2]:b[3]]
                send.narrow(0, off, numel[k][r]).view(_piece(b)).copy_(part)
                off += numel[k][r]
        counts = [[sum(numel[k][r] for k in ks if owners[k] == s) for r in range(n)]
                  for s in range(n)]
        return a2a(send, counts, out_dtype)

    out: list = [None] * len(shapes)

    def landed(ks: list, work, recv: Tensor) -> None:
        """Wait for a bucket's return; its blocks to ``out`` or ``on_result``."""
        work.wait()
        off = 0
        for r in range(n):
            for k in ks:
                if owners[k] == r:
                    piece = recv.narrow(0, off, numel[k][me]).view(_piece(blocks[k][me]))
                    if on_result is None:
                        out[k] = piece
                    else:
                        on_result(k, piece)
                    off += numel[k][me]

    ahead = forward(buckets[0]) if buckets else None
    returning = None  # the previous bucket's return in flight: (bucket, work, send, recv)
    for b, ks in enumerate(buckets):
        work, send, recv = ahead
        ahead = forward(buckets[b + 1]) if b + 1 < len(buckets) else None
        work.wait()
        mine, fulls = assembled(ks, recv)
        del work, send, recv  # before Newton–Schulz: the owner holds the bucket once
        results = orthogonalized(mine, fulls)
        del fulls
        now = (ks,) + back(ks, mine, results)
        del results
        if returning is not None:  # in flight while this bucket was orthogonalized
            landed(returning[0], returning[1], returning[3])
        returning = now
    if returning is not None:
        landed(returning[0], returning[1], returning[3])
    return out
