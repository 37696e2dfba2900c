"""A process group of one rank: cfsdp's collectives are local (no transport), and
``fully_shard`` / the wrapper on one process train exactly as torch's FSDP does.

The group is created in-process (gloo over a ``HashStore``) for this module only
and destroyed after it, so the other unit tests still run without a default group.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import cfsdp
from cfsdp import _core
from cfsdp._runtime import comm


pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


@pytest.fixture
def no_transport(monkeypatch):
    """Every process-group collective raises: a one-rank call must not reach it."""

    def boom(*a, **k):
        raise AssertionError("a one-rank collective reached the process group")

    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                 "reduce_scatter_tensor", "all_reduce", "broadcast"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, boom)


PLAN = [(0, 6, 6, 0, 1), (6, 4, 4, 6, 1), (10, 9, 9, 10, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collectives_are_local_copies(no_transport, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, generator=g).to(dtype)
    out = torch.full((19,), 7.0, dtype=dtype)
    comm.all_gather(out, x, None, async_op=True).wait()
    assert torch.equal(out, x)

    nat = torch.empty(19, dtype=dtype)
    comm.all_gather_unpack(nat, x, PLAN, comm.pack_plan(PLAN), None, async_op=False).wait()
    ref = torch.empty(19, dtype=dtype)
    _core.chunk_unpack(ref, x, PLAN, 1, 19)
    assert torch.equal(nat, ref)

    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        got = torch.empty(19, dtype=torch.float32)
        comm.reduce_scatter_pack(got, nat, PLAN, comm.pack_plan(PLAN), 2.0, None, True, op=op).wait()
        want = torch.empty(19, dtype=torch.float32)
        _core.chunk_pack(want, nat, PLAN, 1, 19, divisor=2.0)
        assert torch.equal(got, want)

    rs = torch.empty(19, dtype=dtype)
    comm.reduce_scatter(rs, x, None, True, op=dist.ReduceOp.AVG, scale=0.5).wait()
    assert torch.equal(rs, x * 0.5)
    t = x.clone()
    comm.all_reduce(t, None, False, scale=4.0).wait()
    assert torch.equal(t, x * 4.0)
    comm.broadcast(t, 0, None).wait()
    assert torch.equal(t, x * 4.0)
    with pytest.raises(ValueError, match="all_gather: output has 18 elements"):
        comm.all_gather(torch.empty(18, dtype=dtype), x, None, async_op=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(9, 9), nn.LayerNorm(9)) for _ in range(3))
        self.head = nn.Linear(9, 5)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x)) + x
        return self.head(x)


def _train(face, impl, steps=4):
    torch.manual_seed(0)
    model = Net()
    if face == "fully_shard":
        for b in model.blocks:
            impl.fully_shard(b)
        impl.fully_shard(model)
    else:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = impl.FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), use_orig_params=True,
            device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 9, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in model.named_parameters()}
    return torch.stack(losses), params


@pytest.mark.parametrize("face", ["fully_shard", "wrapper"])
def test_one_rank_training_matches_torch(face):
    """Losses and parameters bit for bit against torch's FSDP on the same one-rank
    group (torch runs its collectives; cfsdp runs none)."""
    import torch.distributed.fsdp as tfsdp

    ref_losses, ref_params = _train(face, tfsdp)
    losses, params = _train(face, cfsdp)
    assert torch.equal(losses, ref_losses)
    assert list(params) == list(ref_params)
    for k in params:
        assert torch.equal(params[k], ref_params[k]), k


def _contract_members() -> list[str]:
    from cfsdp._runtime.base import UnitContract

    names = [n for n in vars(UnitContract) if not n.startswith("_")]
    names += list(getattr(UnitContract, "__annotations__", {}))
    return sorted(set(names))


def test_fully_shard_returns_what_it_was_given():
    """fully_shard returns the module (or the list of modules) it was called with, as torch's
    (a loop variable once shadowed the argument: the last parameter's owner came back)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    assert cfsdp.fully_shard(model[1]) is model[1]
    assert cfsdp.fully_shard(model) is model
    blocks = nn.ModuleList([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3))])
    group = [blocks[0], blocks[1]]
    assert cfsdp.fully_shard(group) is group


@pytest.mark.parametrize("face", ["wrapper", "fully_shard"])
def test_both_unit_kinds_meet_the_contract(face):
    """Every member of base.UnitContract (the calls the hooks and PendingReduce make, the
    attributes they read) exists on a live unit of each kind, methods callable."""
    from cfsdp._runtime.base import UnitContract

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    if face == "wrapper":
        unit = cfsdp.FullyShardedDataParallel(model)._state.unit
    else:
        unit = cfsdp.fully_shard(model)._cfsdp_fs_state.unit
    missing = [n for n in _contract_members() if not hasattr(unit, n)]
    assert not missing, f"{type(unit).__name__} lacks {missing}"
    not_callable = [n for n in vars(UnitContract)
                    if not n.startswith("_") and callable(getattr(UnitContract, n))
                    and not isinstance(vars(UnitContract)[n], property)
                    and not callable(getattr(unit, n))]
    assert not not_callable, not_callable


def test_fully_shard_initialises_the_default_group_as_torch():
    """fully_shard without an initialised process group initialises the default one from the
    environment (torchrun's variables), as torch's does (a fresh interpreter: this module's
    own group must not be seen)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    code = ("import torch, torch.distributed as dist, cfsdp\n"
            "m = cfsdp.fully_shard(torch.nn.Linear(3, 2))\n"
            "m(torch.randn(4, 3)).sum().backward()\n"
            "assert dist.is_initialized() and dist.get_world_size() == 1\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_post_optim_event_is_waited_on_the_stream_not_the_cpu(monkeypatch):
    """``set_post_optim_event``: the root's next forward makes the current stream of the
    event's device wait for it (torch FSDP2: its all-gather streams ``wait_event``), never
    ``event.synchronize()`` (a CPU stall), and only once.  No GPU here: a CUDA event and
    stream are stood in for, recording what is called."""
    calls = []

    class Stream:
        def wait_event(self, ev):
            calls.append(("wait_event", ev))

    class Event:
        device = torch.device("cuda", 0)

        def synchronize(self):
            calls.append(("synchronize", self))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    cfsdp.fully_shard(model[0])
    cfsdp.fully_shard(model)
    model(torch.randn(3, 4)).sum().backward()
    ev = Event()
    model.set_post_optim_event(ev)
    model(torch.randn(3, 4)).sum().backward()
    model(torch.randn(3, 4)).sum().backward()
    assert calls == [("wait_event", ev)], calls


def test_all_reduce_hook_stream_is_ordered_both_ways(monkeypatch):
    """``set_all_reduce_hook(hook, stream=s)`` on an accelerator: ``s`` waits for the
    current stream (where the reduced gradient was made) before the hook runs on it, and
    the current stream (where cfsdp post-divides and accumulates) waits for ``s`` after;
    torch orders the same two (``all_reduce_stream.wait_stream(reduce_scatter_stream)``,
    then the compute stream waits at the end of backward).  Without either, the hook
    races the reduction or the accumulation races the hook.  No GPU here: the CUDA
    stream API is stood in for, recording calls in order."""
    log = []

    class Stream:
        def __init__(self, name):
            self.name, self.device = name, torch.device("cuda", 0)

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    current, side = Stream("current"), Stream("side")

    class StreamCtx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            log.append(f"enter {self.s.name}")

        def __exit__(self, *exc):
            log.append(f"exit {self.s.name}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", StreamCtx)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    cfsdp.fully_shard(model)
    model.set_all_reduce_hook(lambda out: log.append("hook"), stream=side)
    model(torch.randn(2, 4)).sum().backward()
    assert log == ["side waits current", "enter side", "hook", "exit side",
                   "current waits side"], log
