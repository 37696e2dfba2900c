"""torch FSDP1's stream protocol in the ``FullyShardedDataParallel`` wrapper, checked on CPU
([Note: FSDP1 streams] in ``cfsdp/_runtime/flat/streams.py``).

No GPU here: the runtime runs against the recording device layer of ``stream_check.py`` (every
stream op and tensor op logged with its stream) and the happens-before checker replays the
log.  This tests cfsdp's ordering logic only; it proves nothing about CUDA itself.

At world 1 every sharded strategy is NO_SHARD (as torch's); the ``sharded`` cases replace
that conversion (``_one_rank_no_shard``) in the plain and the recorded run alike, so the
units shard over one rank and take the all-gather / reduce-scatter paths.  The all-gather
then takes the local transport (``comm._Solo``: a copy); the ``process group`` cases put the
process group's transport in its place, so the log carries gloo's c10d collectives.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy

import cfsdp.fully_sharded_data_parallel as fsdp_mod
from cfsdp._runtime import comm, device
from cfsdp._runtime.flat.streams import FlatStreams

_spec = importlib.util.spec_from_file_location(
    "stream_check", Path(__file__).resolve().parents[1] / "distributed" / "stream_check.py")
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)
CURRENT, RaceError, RecordingDevice, check = sc.CURRENT, sc.RaceError, sc.RecordingDevice, sc.check

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py

FULL, GRAD_OP, NO, HYBRID = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                             ShardingStrategy.NO_SHARD, ShardingStrategy.HYBRID_SHARD)
AG, RS, AR = "c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default", \
    "c10d.allreduce_.default"


@pytest.fixture(params=["solo", "process group"])
def transport(request, monkeypatch):
    if request.param == "process group":
        monkeypatch.setattr(comm, "_accelerator_transport",
                            lambda group: comm.Transport(group, "process group (test)"))
    # shard over the one rank (see the module doc)
    monkeypatch.setattr(fsdp_mod, "_one_rank_no_shard", lambda s, g, r: (s, g, r))
    return request.param


def _kw(strategy, mp=False, **kw):
    if strategy is HYBRID:
        kw["device_mesh"] = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    if mp:
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    return dict(sharding_strategy=strategy, **kw)


def _run(kw):
    want = sc.train_wrapper(None, **kw)
    rec = RecordingDevice()
    got = sc.train_wrapper(rec, **kw)
    check(rec.log)
    sc.assert_same(want, got)
    return rec


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", [FULL, GRAD_OP, NO, HYBRID],
                         ids=["full", "grad_op", "no_shard", "hybrid"])
def test_recorded_training_is_ordered_and_bitwise_equal(transport, strategy, mp,
                                                        use_orig_params):
    rec = _run(_kw(strategy, mp, use_orig_params=use_orig_params))
    ops = {s: rec.ops_on(s) for s in (CURRENT, "pre_unshard", "unshard", "post_backward",
                                     "all_reduce")}
    if strategy is not NO:
        # 2 steps x (3 units in forward, + the 2 children that FULL_SHARD / HYBRID_SHARD
        # resharded after forward, in backward)
        n = 10 if strategy in (FULL, HYBRID) else 6
        if transport == "process group":
            assert ops["unshard"].count(AG) == n, ops["unshard"]
            assert ops["post_backward"].count(RS) == 6
            assert not any(op.startswith("c10d.") for op in ops[CURRENT]), ops[CURRENT]
        else:
            assert "aten.copy_.default" in ops["unshard"]
        assert ("wait_stream", CURRENT, "unshard") in rec.log
    elif transport == "process group":
        assert ops["post_backward"].count(AR) == 6
    assert ("wait_stream", "post_backward", CURRENT) in rec.log
    assert ("wait_stream", CURRENT, "post_backward") in rec.log
    if mp:  # the low-precision shard (copy) is made on the pre-unshard stream
        assert "aten.copy_.default" in ops["pre_unshard"] or any(
            "_to_copy" in op for op in ops["pre_unshard"]), ops["pre_unshard"]
        assert ("wait_stream", "unshard", "pre_unshard") in rec.log
    if strategy is HYBRID:
        assert ("wait_stream", "all_reduce", "post_backward") in rec.log
        assert ("wait_stream", CURRENT, "all_reduce") in rec.log
        if transport == "process group":
            assert ops["all_reduce"].count(AR) == 6
    else:
        assert not ops["all_reduce"]


@pytest.mark.parametrize("strategy", [FULL, GRAD_OP, NO], ids=["full", "grad_op", "no_shard"])
def test_no_sync_then_a_synced_backward(transport, strategy):
    """A ``no_sync()`` backward keeps its gradient on the current stream (nothing on the
    post-backward stream until the synced one), ordered and bitwise as the plain run."""
    rec = _run(_kw(strategy, mp=True, use_orig_params=True) | {"no_sync": 1})
    assert ("wait_stream", "post_backward", CURRENT) in rec.log


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_summon_and_state_dict_between_steps(transport, use_orig_params):
    """``summon_full_params`` (a write carried back) and a full state dict between steps
    unshard on the current stream, outside the protocol's side streams; the run stays
    ordered and bitwise the plain one."""
    import cfsdp

    def between(model):
        with cfsdp.FullyShardedDataParallel.summon_full_params(model, writeback=True):
            with torch.no_grad():
                next(model.parameters()).mul_(0.5)
        model.state_dict()

    rec = _run(_kw(FULL, mp=True, use_orig_params=use_orig_params) | {"between": between})
    assert ("wait_stream", CURRENT, "unshard") in rec.log


@pytest.mark.parametrize("hook", ["reduce_scatter_hook", "allreduce_hook"])
def test_comm_hook_on_the_post_backward_stream(transport, hook):
    """``register_comm_hook``: the hook runs on the post-backward stream, as torch's."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    strategy = FULL if hook == "reduce_scatter_hook" else NO
    state = default_hooks.DefaultState(torch.distributed.distributed_c10d._get_default_group())
    rec = _run(_kw(strategy) | {"comm_hook": (state, getattr(default_hooks, hook))})
    # the hook calls torch.distributed itself: its collective is logged under either transport
    assert (RS if strategy is FULL else AR) in rec.ops_on("post_backward")


@pytest.mark.parametrize("limit", [True, False], ids=["limited", "unlimited"])
@pytest.mark.parametrize("prefetch", ["none", "forward", "backward_pre", "backward_post"])
def test_prefetch_and_rate_limiter(transport, prefetch, limit):
    kw = _kw(FULL, limit_all_gathers=limit)
    if prefetch == "forward":
        kw["forward_prefetch"] = True
    kw["backward_prefetch"] = {"none": None, "forward": None,
                               "backward_pre": BackwardPrefetch.BACKWARD_PRE,
                               "backward_post": BackwardPrefetch.BACKWARD_POST}[prefetch]
    rec = _run(kw)
    syncs = [e for e in rec.log if e[0] == "synchronize"]
    free_events = {e[2] for e in rec.log if e[0] == "record_event" and e[1] == CURRENT}
    if not limit:
        assert not syncs and not free_events
        return
    # the CPU waits only for free events of the current stream, oldest first, once two are
    # queued, and then before an all-gather (torch's _FreeEventQueue)
    assert syncs and {e[2] for e in syncs} <= free_events
    queue: list = []
    for i, e in enumerate(rec.log):
        if e[0] == "record_event" and e[1] == CURRENT:
            queue.append(e[2])
        elif e[0] == "synchronize":
            assert len(queue) >= 2 and e[2] == queue.pop(0)
            nxt = next(x for x in rec.log[i + 1:] if x[0] == "op")
            assert nxt[1] == "unshard", nxt


@pytest.mark.parametrize("wait", ["wait_unshard", "post_backward_waits_current",
                                  "wait_post_backward"])
def test_checker_catches_a_removed_wait(transport, monkeypatch, wait):
    monkeypatch.setattr(FlatStreams, wait, lambda self, *a: None)
    rec = RecordingDevice()
    sc.train_wrapper(rec, **_kw(FULL))
    expect = {"wait_unshard": ["on stream 'current' reads", "on stream 'unshard'"],
              "post_backward_waits_current": ["on stream 'post_backward' reads",
                                              "on stream 'current'"],
              "wait_post_backward": ["on stream 'current'", "on stream 'post_backward'"]}[wait]
    sc.assert_race(rec.log, *expect)


def test_record_stream_before_free_is_needed(transport, monkeypatch):
    """Without reshard's ``record_stream`` on the current stream, the free of the unsharded
    buffer (allocated on the unshard stream) is not ordered after the compute that read it."""
    monkeypatch.setattr(FlatStreams, "before_free", lambda self, buf: None)
    rec = RecordingDevice()
    sc.train_wrapper(rec, **_kw(FULL))
    with pytest.raises(RaceError, match="free of storage .* allocated on 'unshard'"):
        check(rec.log)


@pytest.mark.parametrize("strategy", [NO, FULL], ids=["no_shard", "full_sharded"])
def test_no_streams_leaves_the_cpu_path_alone(monkeypatch, strategy):
    """On CPU without a recording layer nothing of the protocol runs: every stream call of
    NoStreams and every wait of ``FlatStreams`` fails if made (FULL_SHARD sharded over the
    one rank, with every option that takes a stream op on a layer with streams)."""
    if strategy is FULL:
        monkeypatch.setattr(fsdp_mod, "_one_rank_no_shard", lambda s, g, r: (s, g, r))
    kw = _kw(strategy, mp=True, limit_all_gathers=True, forward_prefetch=True,
             backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    want = sc.train_wrapper(None, **kw)

    def boom(*a, **k):
        raise AssertionError("a stream call on the CPU path")

    for name in ("current_stream", "stream", "on", "record_stream", "free", "alloc"):
        monkeypatch.setattr(device.NoStreams, name, boom)
    for name in ("wait_stream", "record_event", "wait_event"):
        monkeypatch.setattr(device._NoStream, name, boom)
    for name in ("wait_unshard", "rate_limit", "before_free", "after_free",
                 "post_backward_waits_current", "wait_post_backward"):
        monkeypatch.setattr(FlatStreams, name, boom)
    assert device.notified() is None
    got = sc.train_wrapper(None, **kw)
    sc.assert_same(want, got)


def test_checker_synchronize_orders_later_work():
    """An event's ``synchronize`` (the CPU waits) orders every op issued after it."""
    op = lambda s, name, **k: ("op", s, name, tuple(k.get("reads", ())),  # noqa: E731
                               tuple(k.get("writes", ())), tuple(k.get("fresh", ())))
    log = [op("a", "w", fresh=[1]), ("record_event", "a", 7), ("synchronize", "host", 7),
           op("b", "r", reads=[1])]
    check(log)
    with pytest.raises(RaceError):
        check([log[0], log[1], log[3]])


def test_checker_free_covered_through_a_recorded_stream():
    """A free after ``record_stream(t, c)`` is safe for an access on ``u`` that ``c`` has
    waited for (NO_SHARD's low-precision copy: torch records only the default stream, which
    waits for the unshard stream)."""
    op = lambda s, name, **k: ("op", s, name, tuple(k.get("reads", ())),  # noqa: E731
                               tuple(k.get("writes", ())), tuple(k.get("fresh", ())))
    log = [op("pre", "w", fresh=[1]), ("wait_stream", "u", "pre"), op("u", "r", reads=[1]),
           ("record_stream", "c", 1), ("free", "c", 1)]
    with pytest.raises(RaceError, match="after r on stream 'u'"):
        check(log)
    check(log[:3] + [("wait_stream", "c", "u")] + log[3:])


@pytest.mark.parametrize("strategy", [FULL, HYBRID], ids=["full", "hybrid"])
@pytest.mark.parametrize("limit", [True, False], ids=["limit", "no_limit"])
def test_stream_priorities_as_torch_fsdp1(strategy, limit, monkeypatch):
    """torch 2.13's ``_init_streams``: the unshard, pre-unshard and post-backward streams are
    high priority (-1) only with ``limit_all_gathers`` and a hybrid strategy together, else 0;
    HSDP's all-reduce stream 0 (the recording layer keeps the priority each stream was asked
    for)."""
    monkeypatch.setattr(fsdp_mod, "_one_rank_no_shard", lambda s, g, r: (s, g, r))
    rec = _run(_kw(strategy, mp=True, limit_all_gathers=limit))
    high = -1 if (limit and strategy is HYBRID) else 0
    want = {"unshard": {high}, "pre_unshard": {high}, "post_backward": {high}}
    if strategy is HYBRID:
        want["all_reduce"] = {0}
    assert rec.priorities == want
    assert want == _torch_fsdp1_priorities(strategy, limit)


def _torch_fsdp1_priorities(strategy, limit: bool) -> dict:
    """What torch's own ``_init_streams`` asks a device for, on a fake root state of one unit
    with ``strategy`` and ``limit_all_gathers=limit`` (its streams by attribute name, the
    all-reduce stream only where it makes one)."""
    import types

    from torch.distributed.fsdp import _runtime_utils

    asked = []

    class Handle:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def current_stream():
            return "current"

        @staticmethod
        def Stream(priority=0):  # noqa: N802 - torch's name
            asked.append(priority)
            return f"stream {len(asked) - 1}"

    unit = types.SimpleNamespace(sharding_strategy=strategy)
    st = types.SimpleNamespace(_is_root=True, _device_handle=Handle, limit_all_gathers=limit,
                               _all_fsdp_states=[unit], _fsdp_extension=None)
    _runtime_utils._init_streams(st)
    out = {}
    for attr, name in (("_unshard_stream", "unshard"), ("_pre_unshard_stream", "pre_unshard"),
                       ("_post_backward_stream", "post_backward"),
                       ("_all_reduce_stream", "all_reduce")):
        made = getattr(st, attr)
        if made != "current":
            out[name] = {asked[int(made.split()[1])]}
    return out


@pytest.mark.no_core
def test_cuda_layer_makes_one_stream_per_name_and_priority():
    """``CudaStreams.stream``: a stream per (name, priority), made once (a fake device module
    records what is made): FSDP2's all-gather / reduce-scatter names default to -1, the rest
    to 0, an explicit priority wins."""
    made = []

    class FakeStream:
        def __init__(self, device=None, priority=0):
            made.append(priority)
            self.priority = priority

    layer = device.CudaStreams(torch.device("cpu"))
    layer._mod = lambda: type("Mod", (), {"Stream": FakeStream})
    assert layer.stream(device.ALL_GATHER).priority == -1
    assert layer.stream(device.REDUCE_SCATTER).priority == -1
    assert layer.stream(device.UNSHARD).priority == 0
    assert layer.stream(device.UNSHARD, priority=-1).priority == -1
    assert layer.stream(device.UNSHARD) is layer.stream(device.UNSHARD, priority=0)
    assert layer.stream(device.UNSHARD, priority=-1) is not layer.stream(device.UNSHARD)
    assert made == [-1, -1, 0, -1]


@pytest.mark.no_core
def test_recording_layer_refuses_a_name_at_two_priorities():
    """The recording layer keeps one stream per name; a CUDA layer would make two for two
    priorities, so a name asked for at two fails instead of merging them silently."""
    rec = RecordingDevice()
    assert rec.stream("unshard", priority=-1) is rec.stream("unshard", priority=-1)
    with pytest.raises(AssertionError, match="asked for at priorities \\[-1, 0\\]"):
        rec.stream("unshard")
