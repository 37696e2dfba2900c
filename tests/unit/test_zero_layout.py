"""cfsdp's ZeroRedundancyOptimizer without a process group: its partition against torch's,
the rank-major bucket layout, and the split / reassembly of a local optimizer state for
consolidation (pure Python and torch ops: no_core, but for the test that steps a
cfsdp.optim optimizer and the state round trips, which read addresses through cfsdp._core).  The distributed behaviour is tests/distributed/test_zero.py's."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, strategies as st
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

from cfsdp.optim import _zero_buckets, _zero_state
from cfsdp.optim.zero import partition_params

NO_CORE = pytest.mark.no_core


def torch_partition(groups: list, world_size: int) -> list:
    """torch's own ``_partition_parameters`` run on a bare instance (no process group)."""
    z = object.__new__(TorchZeRO)
    z.world_size = world_size
    z.param_groups = [{"params": ps, "lr": 0.1} for ps in groups]
    z._partition_parameters_cache = []
    return [[g["params"] for g in rank] for rank in z._partition_parameters()]


@NO_CORE
@given(st.lists(st.lists(st.integers(0, 40), max_size=12), min_size=1, max_size=4),
       st.integers(1, 8))
def test_partition_is_torchs(sizes, world_size):
    """Ties, empty groups, zero-size parameters, more ranks than parameters."""
    groups = [[torch.empty(n) for n in g] for g in sizes]
    ours = partition_params(groups, world_size)
    theirs = torch_partition(groups, world_size)
    ids = lambda part: [[[id(p) for p in g] for g in rank] for rank in part]  # noqa: E731
    assert ids(ours) == ids(theirs)


@NO_CORE
def test_partition_carries_totals_across_groups():
    a, b, c, d = (torch.empty(n) for n in (10, 6, 5, 4))
    assert [[[p.numel() for p in g] for g in r] for r in partition_params([[a, b], [c, d]], 2)] \
        == [[[10], [4]], [[6], [5]]]


@NO_CORE
@given(st.lists(st.integers(0, 50), min_size=1, max_size=10), st.integers(1, 5),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_rank_major_layout(numels, world_size, dtype):
    per_rank = [[torch.empty(n, dtype=dtype) for n in numels[r::world_size]]
                for r in range(world_size)]
    lay = _zero_buckets.RankMajor(per_rank)
    assert lay.seg * dtype.itemsize % 64 == 0
    assert lay.seg >= max(sum(p.numel() for p in ps) for ps in per_rank)
    assert lay.seg - max(sum(p.numel() for p in ps) for ps in per_rank) < lay.align
    for r, row in enumerate(lay.places):
        off = 0
        for pl, p in zip(row, per_rank[r]):
            assert (pl.param is p, pl.rank, pl.offset, pl.numel) == (True, r, off, p.numel())
            off += p.numel()


def test_bucket_views_keep_values_and_strides():
    """Each parameter becomes a view of its place, with its values; a transposed one keeps
    its strides (DDP lays out its gradients by them)."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3, generator=g)),
          torch.nn.Parameter(torch.randn(4, 6, generator=g).t()),
          torch.nn.Parameter(torch.randn(7, generator=g)),
          torch.nn.Parameter(torch.randn(2, 3, 4, generator=g).permute(2, 0, 1))]
    before = [(p.detach().clone(), p.stride()) for p in ps]
    bv = _zero_buckets.BucketViews(_zero_buckets.RankMajor([ps[:2], ps[2:]]))
    assert not bv.moved()
    for p, (v, stride) in zip(ps, before):
        assert bv.holds(p) and torch.equal(p.detach(), v) and p.stride() == stride
    ps[2].data = ps[2].data.clone()
    assert bv.moved()


@NO_CORE
@pytest.mark.parametrize("t,dense", [
    (torch.empty(3, 4), True), (torch.empty(4, 3).t(), True),
    (torch.empty(2, 3, 4).permute(1, 2, 0), True), (torch.empty(3, 8)[:, ::2], False),
    (torch.empty(1, 5).expand(4, 5), False), (torch.empty(6, 1, 2)[:, :, :1], False),
    (torch.empty(6, 1, 2)[:, :, 1:].squeeze(2).unsqueeze(1), False), (torch.empty(5, 1).t(), True),
])
def test_dense(t, dense):
    assert _zero_buckets._dense(t) is dense


def roundtrip(state: dict) -> dict:
    sk, payload = _zero_state.split_state(state)
    bufs = {(0, dn): torch.cat([r.reshape(-1) for r in runs]) for dn, runs in payload.items()}
    return _zero_state.assemble(copy.deepcopy(sk), bufs, 0)


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for i in a:
        if a[i] is None:
            assert b[i] is None
            continue
        assert list(a[i]) == list(b[i])
        for k, v in a[i].items():
            w = b[i][k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), (i, k)
            else:
                assert v == w, (i, k)


def test_state_roundtrip_fused_flat_buffers_go_in_place():
    """cfsdp.optim's flat states: one run per state kind and group, read in place."""
    import cfsdp.optim as co

    flat = torch.randn(40)
    ps = [torch.nn.Parameter(flat[o : o + n]) for o, n in ((0, 10), (10, 20), (30, 10))]
    opt = co.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.1}])
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state_dict()["state"]
    sk, payload = _zero_state.split_state(state)
    runs = payload["torch.float32"]
    assert sk.runs["torch.float32"] == [2, 1, 30, 10, 30, 10]  # steps, exp_avgs, exp_avg_sqs
    base = opt.state[ps[0]]["exp_avg"]
    assert runs[2].data_ptr() == base.data_ptr()  # no copy
    assert_same_state(roundtrip(state), state)


def test_state_roundtrip_many_runs_none_values_and_dtypes():
    g = torch.Generator().manual_seed(1)
    state = {i: {"step": torch.tensor(float(i)), "buf": torch.randn(i + 1, 2, generator=g)}
             for i in range(0, 40, 2)}
    state[3] = None
    state[5] = {"count": 7, "flags": torch.tensor([1, 0, 1], dtype=torch.int64),
                "half": torch.randn(3, generator=g).to(torch.bfloat16),
                "mask": torch.tensor([True, False]), "empty": torch.empty(0, 4)}
    sk, payload = _zero_state.split_state(state)
    assert len(payload["torch.float32"]) == 1  # more than MAX_RUNS runs: packed
    assert_same_state(roundtrip(state), {i: state[i] for i in sorted(state)})


def test_state_roundtrip_non_contiguous_tensor():
    t = torch.randn(4, 6).t()
    state = {0: {"m": t, "v": torch.randn(3)}}
    assert_same_state(roundtrip(state), state)
