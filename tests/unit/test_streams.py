"""torch FSDP2's stream protocol in ``fully_shard``, checked on CPU ([Note: stream protocol]).

No GPU here: the runtime runs against a recording device layer (``stream_check.py``) that
logs every stream op and tensor op with its stream, and a happens-before checker replays the
log.  This tests cfsdp's ordering logic only; it proves nothing about CUDA itself.

At world 1 (conftest's one-rank gloo group) the accelerator path takes the local transport
(``comm._Solo``: copies, no collective); the ``process group`` cases put the process group's
transport in its place, so the log carries gloo's c10d collectives on their streams.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from cfsdp._runtime import comm, device
from cfsdp._runtime.chunk.streams import CommContext

# the recorder and checker are a helper of tests/distributed too (fully_shard/features.py)
_spec = importlib.util.spec_from_file_location(
    "stream_check", Path(__file__).resolve().parents[1] / "distributed" / "stream_check.py")
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)
CURRENT, RaceError, RecordingDevice, check = sc.CURRENT, sc.RaceError, sc.RecordingDevice, sc.check

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py

SIDE = ("all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce")


def _train(rec, reshard_after_forward=True, hsdp=False, hook_stream=None):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")) if hsdp else None
    # (HSDP takes no all-reduce hook with a stream; without one its hook runs after the
    # all-reduce on the all-reduce stream either way)
    return sc.train(rec, mesh, reshard_after_forward, hook=not hsdp or hook_stream is not None,
                    hook_stream=hook_stream)


@pytest.fixture(params=["solo", "process group"])
def transport(request, monkeypatch):
    if request.param == "process group":
        monkeypatch.setattr(comm, "_accelerator_transport",
                            lambda group: comm.Transport(group, "process group (test)"))
    return request.param


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_recorded_training_is_ordered_and_bitwise_equal(transport, reshard_after_forward, hsdp):
    want = _train(None, reshard_after_forward, hsdp)
    rec = RecordingDevice()
    got = _train(rec, reshard_after_forward, hsdp)
    check(rec.log)
    sc.assert_same(want, got)
    ops = {s: rec.ops_on(s) for s in (CURRENT, *SIDE)}
    # the stream roles: allocation on copy-in, collectives inside their streams
    assert "aten.empty.memory_format" in ops["all_gather_copy_in"]
    if transport == "process group":
        assert ops["all_gather"].count("c10d._allgather_base_.default") >= 6
        assert ops["reduce_scatter"].count("c10d._reduce_scatter_base_.default") == 6
        assert not any(op.startswith("c10d.") for op in ops[CURRENT]), ops[CURRENT]
        if hsdp:
            assert ops["all_reduce"].count("c10d.allreduce_.default") == 6
    else:
        assert "aten.copy_.default" in ops["all_gather"]
    # HSDP: the all-reduce stream follows the reduce-scatter stream (under "solo" its
    # all-reduce over one replica runs nothing)
    assert not hsdp or ("wait_stream", "all_reduce", "reduce_scatter") in rec.log
    assert any(e[0] == "free" for e in rec.log)  # held buffers released


def test_frozen_parameter_reduces_the_trainable_layout(transport):
    """A unit with a frozen weight reduce-scatters its trainable bias alone, as torch's
    FSDP2 ([Note: trainable layout] in chunk/grads.py), on the streams' path too: ordered,
    and bitwise the run without the recorder."""
    want = sc.train(None, frozen=True)
    rec = RecordingDevice()
    got = sc.train(rec, frozen=True)
    check(rec.log)
    sc.assert_same(want, got)


def test_mixed_precision_casts_on_the_copy_in_stream(transport):
    """bf16 parameters, fp32 reductions: the copy-in cast runs on the copy-in stream, the
    cast of the reduced gradient with the fold on the reduce-scatter (or hook) stream."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    want = sc.train(None, mp_policy=mp)
    rec = RecordingDevice()
    got = sc.train(rec, mp_policy=mp)
    check(rec.log)
    sc.assert_same(want, got)
    assert "aten.copy_.default" in rec.ops_on("all_gather_copy_in")


def test_post_optim_event_is_waited_by_the_all_gather_streams(transport, monkeypatch):
    """``set_post_optim_event(ev)``: the next root pre-forward makes the copy-in and all-gather
    streams wait for ``ev`` instead of for the current stream (torch's _root_pre_forward)."""
    import cfsdp

    rec = RecordingDevice()
    events = []
    real_step = torch.optim.SGD.step

    def step(opt, *a, **k):
        out = real_step(opt, *a, **k)
        ev = rec.current_stream().record_event()
        events.append(ev)
        for m in models:
            m.set_post_optim_event(ev)
        return out

    models = []
    real_fully_shard = cfsdp.fully_shard

    def fully_shard(module, **kw):
        out = real_fully_shard(module, **kw)
        if module.__class__.__name__.startswith("FSDPSequential"):
            models.append(module)
        return out

    monkeypatch.setattr(cfsdp, "fully_shard", fully_shard)
    monkeypatch.setattr(torch.optim.SGD, "step", step)
    sc.train(rec, steps=3)
    check(rec.log)
    for ev in events[:-1]:
        assert ("wait_event", "all_gather_copy_in", ev.id) in rec.log
        assert ("wait_event", "all_gather", ev.id) in rec.log
    assert [e for e in rec.log if e[0] == "wait_stream" and e[1] == "all_gather_copy_in"] == [
        ("wait_stream", "all_gather_copy_in", CURRENT)]  # the first step only


def test_a_call_of_two_dtypes_shares_the_root_streams(transport):
    """A ``fully_shard`` call over two dtypes (``ChunkUnitGroup``: one chunk unit each) takes
    the root's protocol in every member."""
    import cfsdp

    class TwoDtypes(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            self.s = nn.Parameter(torch.randn(8, dtype=torch.float64))

        def forward(self, x):
            return (x @ self.w) * self.s.float()

    def run(rec):
        torch.manual_seed(0)
        model = nn.Sequential(TwoDtypes(), nn.Linear(8, 2))
        cfsdp.fully_shard(model[0])
        cfsdp.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with device.use(rec) if rec is not None else contextlib.nullcontext():
            for _ in range(2):
                loss = model(torch.randn(4, 8)).square().sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        return losses, [p.detach().full_tensor() for p in model.parameters()]

    want = run(None)
    rec = RecordingDevice()
    got = run(rec)
    check(rec.log)
    sc.assert_same(want, got)
    # 3 chunk units x 2 steps reduced on the stream, 2 events each (after the collective,
    # after the fold)
    assert len([e for e in rec.log if e[0] == "record_event" and e[1] == "reduce_scatter"]) == 12


def test_reset_iter_state_after_an_aborted_backward(transport):
    """An exception in backward (after some reductions), ``reset_iter_state``, then a step:
    the checker passes over all of it (on a torch without ``reset_iter_state``, before 2.13,
    cfsdp has none either: the checker passes over the aborted backward)."""
    import cfsdp
    from cfsdp._torch.fsdp2 import at_least

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    for m in model:
        cfsdp.fully_shard(m)
    cfsdp.fully_shard(model)
    rec = RecordingDevice()
    with device.use(rec):
        x = torch.randn(4, 8, requires_grad=True)
        x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected"):
            model(x).sum().backward()
        if hasattr(model, "reset_iter_state") != at_least(2, 13):
            raise AssertionError("reset_iter_state must exist exactly where torch's does (2.13+)")
        if at_least(2, 13):
            model.reset_iter_state()
            model(torch.randn(4, 8)).sum().backward()
    check(rec.log)


def test_all_reduce_hook_on_its_stream(transport):
    """``set_all_reduce_hook(stream=s)`` runs the hook on ``s``, ordered both ways."""
    want = _train(None)
    rec = RecordingDevice()
    got = _train(rec, hook_stream=lambda r: r.stream("user hook"))
    check(rec.log)
    assert "aten.mul_.Tensor" in rec.ops_on("user hook")
    sc.assert_same(want, got)


@pytest.mark.parametrize("wait", ["wait_unshard_event", "reduce_scatter_waits_current",
                                  "wait_post_reduce"])
def test_checker_catches_a_removed_wait(transport, monkeypatch, wait):
    monkeypatch.setattr(CommContext, wait, lambda self, *a: None)
    rec = RecordingDevice()
    _train(rec)
    expect = {"wait_unshard_event": ["on stream 'current' reads", "on stream 'all_gather'"],
              "reduce_scatter_waits_current": ["on stream 'reduce_scatter' reads",
                                               "on stream 'current'"],
              "wait_post_reduce": ["on stream 'current' reads", "on stream 'all_reduce'"]}[wait]
    sc.assert_race(rec.log, *expect)


def test_no_streams_leaves_the_cpu_path_alone(monkeypatch):
    """On CPU without a recording layer nothing of the protocol runs: every stream call of
    NoStreams fails if made, and the C core and shared paths stay on."""
    want = _train(None)

    def boom(*a, **k):
        raise AssertionError("a stream call on the CPU path")

    for name in ("current_stream", "stream", "on", "record_stream", "free", "alloc"):
        monkeypatch.setattr(device.NoStreams, name, boom)
    for name in ("wait_stream", "record_event", "wait_event"):
        monkeypatch.setattr(device._NoStream, name, boom)
    monkeypatch.setattr(CommContext, "release_all_gather", boom)
    assert device.notified() is None
    got = _train(None)
    sc.assert_same(want, got)


# --------------------------------------------------------------------------------------------
# the checker on hand-written logs
# --------------------------------------------------------------------------------------------


def _op(stream, name, reads=(), writes=(), fresh=()):
    return ("op", stream, name, tuple(reads), tuple(writes), tuple(fresh))


def test_checker_race_read_after_write():
    log = [_op("a", "w", fresh=[1]), _op("b", "r", reads=[1])]
    with pytest.raises(RaceError, match="r on stream 'b' reads .* write by w on stream 'a'"):
        check(log)


def test_checker_ordered_by_event():
    log = [_op("a", "w", fresh=[1]), ("record_event", "a", 7), ("wait_event", "b", 7),
           _op("b", "r", reads=[1])]
    check(log)


def test_checker_event_before_the_write_does_not_order_it():
    log = [("record_event", "a", 7), _op("a", "w", fresh=[1]), ("wait_event", "b", 7),
           _op("b", "r", reads=[1])]
    with pytest.raises(RaceError):
        check(log)


def test_checker_ordered_by_wait_stream_and_transitively():
    log = [_op("a", "w", fresh=[1]), ("wait_stream", "b", "a"), ("wait_stream", "c", "b"),
           _op("c", "r", reads=[1])]
    check(log)


def test_checker_write_after_read_race():
    log = [_op("a", "w", fresh=[1]), ("wait_stream", "b", "a"), _op("b", "r", reads=[1]),
           _op("a", "w2", writes=[1])]
    with pytest.raises(RaceError, match="w2 on stream 'a' writes .* after r on stream 'b'"):
        check(log)


def test_checker_free_without_record_stream():
    log = [_op("a", "w", fresh=[1]), ("wait_stream", "b", "a"), _op("b", "r", reads=[1]),
           ("free", "a", 1)]
    with pytest.raises(RaceError, match="free of storage .* after r on stream 'b'"):
        check(log)
    check(log[:3] + [("record_stream", "b", 1), ("free", "a", 1)])
    check(log[:3] + [("wait_stream", "a", "b"), ("free", "a", 1)])


def test_checker_end_of_a_storage_checked_at_its_streams_next_allocation():
    """A storage whose last reference dropped (``gone``: no runtime free) while another
    stream's access was not ordered before its stream: the caching allocator may give its
    memory to that stream's next allocation, which must be ordered after the access (how
    torch's FSDP2 keeps its reduce-scatter outputs safe: the next reduce-scatter stream waits
    for the current stream first)."""
    head = [_op("a", "w", fresh=[1]), ("wait_stream", "b", "a"), _op("b", "r", reads=[1]),
            ("gone", "b", 1)]
    with pytest.raises(RaceError, match="'a' may reuse the memory of storage .* before r on "
                                        "stream 'b'"):
        check(head + [_op("a", "new", fresh=[2])])
    with pytest.raises(RaceError, match="an allocation on stream 'a' may reuse"):
        check(head + [("alloc", "a", 2)])
    check(head + [("wait_stream", "a", "b"), _op("a", "new", fresh=[2])])
    check(head + [_op("c", "new", fresh=[2])])  # another stream's pool


def test_checker_a_new_storage_at_an_ended_ones_address():
    """A storage made where no op shows it (inside a collective) at the address of one that
    ended starts its own history: no race with the old one's writes."""
    check([_op("a", "w", fresh=[1]), ("gone", "a", 1), _op("b", "read", reads=[1])])
    with pytest.raises(RaceError, match="read on stream 'b' reads storage"):
        check([_op("a", "w", fresh=[1]), _op("b", "read", reads=[1])])


def test_recorder_logs_the_end_of_a_storage():
    rec = RecordingDevice()
    with rec:
        t = torch.ones(3) * 2
    k = sc.key(t)
    del t
    assert ("gone", CURRENT, k) in rec.log


def test_checker_end_of_a_storage_not_seen_allocated():
    """The end of a storage whose allocation the log does not show (made inside a collective,
    or before the recorder): its stream is unknown, so it is not checked."""
    check([("wait_stream", "b", "a"), _op("b", "r", reads=[1]), ("gone", "a", 1),
           _op("a", "new", fresh=[2])])
