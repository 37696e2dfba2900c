"""State dicts and checkpoints: load_state_dict, the distributed state-dict API (DSD), DCP
round trips, and gloo with one collective in flight while a feature overlaps."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map

import _harness as h
import parity_common as pc
from dcp_common import assert_equal, describe
from fs_common import Impl, Scenario, batches, local, make_model, mesh_1d, run_scenario, run_steps
from fully_shard.common import IMPLS
from fully_shard.features import FEATURES


# --------------------------------------------------------------------------------------------
# 6. state dicts and checkpoints
# --------------------------------------------------------------------------------------------


def trained(impl: Impl, ctx, mesh, kind: str, data, seed: int = 0, unit_kw: dict | None = None):
    sc = Scenario(kind=kind, unit_kw=unit_kw or {})
    model = make_model(impl, sc, mesh, seed)
    opt = pc.make_optim(sc.optim, model.parameters())
    if data:
        run_steps(impl, sc, model, opt, data, ctx.rank, [])
    return model, opt


DIRECTIONS = ("cfsdp->cfsdp", "torch->cfsdp", "cfsdp->torch")


def clone_tree(obj: Any) -> Any:
    """Every tensor of a nested state dict cloned, as if saved and read back: state dicts hold
    live tensors (AdamW's ``step`` too) that the writer's next steps update in place."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, obj)


def save_and_resume(ctx, kind: str, save: Callable, load: Callable,
                    unit_kw: dict | None = None) -> dict:
    """torch and cfsdp train one step and ``save(writer, model, opt)`` (whatever it returns is
    the checkpoint); both continue two steps (the uninterrupted runs). Then, in every direction
    of DIRECTIONS, a freshly sharded model of the reader (other seed) ``load(checkpoint, model,
    opt)``s the writer's checkpoint and trains the same two steps: losses and final local
    parameters must be the writer's, bitwise. ``unit_kw``: fully_shard's keywords. Returns the
    checkpoints."""
    mesh = mesh_1d(ctx)
    data = batches(kind, 3, ctx.world_size)
    sc = Scenario(kind=kind, unit_kw=unit_kw or {})
    src = {name: trained(impl, ctx, mesh, kind, data[:1], unit_kw=unit_kw) for name, impl in IMPLS.items()}
    saved = {name: save(name, *src[name]) for name in IMPLS}
    want = {name: run_steps(IMPLS[name], sc, *src[name], data[1:], ctx.rank, []) for name in IMPLS}
    mm = pc.Mismatches(ctx)
    for direction in DIRECTIONS:
        writer, reader = direction.split("->")
        dst = trained(IMPLS[reader], ctx, mesh, kind, None, seed=1, unit_kw=unit_kw)
        load(saved[writer], *dst)
        got = run_steps(IMPLS[reader], sc, *dst, data[1:], ctx.rank, [])
        for i, (a, b) in enumerate(zip(got, want[writer])):
            mm.tensors(f"{direction}: loss of resumed step {i}", a, b, a_name="loaded", b_name="uninterrupted")
        for (n, p), (_, q) in zip(dst[0].named_parameters(), src[writer][0].named_parameters()):
            mm.tensors(f"{direction}: local param {n} after the resumed steps", local(p), local(q),
                       a_name="loaded", b_name="uninterrupted")
    mm.raise_if_any()
    return saved


@h.subtest(grid={"feature": ["prefetch_lists", "unshard_async"]})
def gloo_one_in_flight(ctx, feature: str):
    """On the process group (gloo), cfsdp's explicit prefetches and asynchronous unshards never
    put two collectives of one group in flight together (torch 2.13's gloo corrupts its heap
    when two finish at once: gloo_in_flight.py), and training is bitwise torch's."""
    import gloo_in_flight

    group = gloo_in_flight.process_group_only()
    mesh = DeviceMesh.from_group(group, "cpu")
    with gloo_in_flight.watch(group) as overlaps:
        run_scenario(ctx, FEATURES[feature](), mesh=mesh)
    assert not overlaps, "two collectives in flight on one gloo group:\n" + "\n".join(overlaps[:2])


@h.subtest(grid={"kind": ["mlp", "lm1"]})
def state_dict_load(ctx, kind: str, unit_kw: dict | None = None):
    """``model.state_dict()`` / ``optimizer.state_dict()`` loaded with ``load_state_dict`` into a
    freshly sharded model (other seed), torch's into cfsdp and back: the model's state dict is
    then the saved one, and the next steps are the uninterrupted run's. ``unit_kw``:
    fully_shard's keywords (section 9)."""

    def save(writer, model, opt):
        return clone_tree((model.state_dict(), opt.state_dict()))

    def load(saved, model, opt):
        model.load_state_dict(saved[0])
        opt.load_state_dict(clone_tree(saved[1]))  # it keeps the tensors it is given
        assert_equal(describe(model.state_dict()), describe(saved[0]), "state_dict() after loading")

    save_and_resume(ctx, kind, save, load, unit_kw)


def dsd_options(full: bool, offload: bool, loading: bool = False) -> StateDictOptions:
    # a full state dict with cpu_offload lives on rank 0 only: loading it needs the broadcast
    return StateDictOptions(full_state_dict=full, cpu_offload=offload and not loading,
                            broadcast_from_rank0=full and offload and loading)


DSD_OPTIONS = {"full_state_dict+cpu_offload": (True, True), "full_state_dict": (True, False),
               "sharded": (False, False)}  # (full_state_dict, cpu_offload)


@h.subtest(grid={"options": list(DSD_OPTIONS)})
def dsd(ctx, options: str, unit_kw: dict | None = None):
    """torch.distributed.checkpoint.state_dict on both: get_model_state_dict /
    get_optimizer_state_dict of cfsdp equal torch's (keys, types, placements, values; full
    tensors for full_state_dict, ``{}`` on ranks other than 0 with cpu_offload);
    set_model_state_dict / set_optimizer_state_dict of either's into a fresh model of either
    resume the uninterrupted run."""
    full_state_dict, cpu_offload = DSD_OPTIONS[options]
    opts = dsd_options(full_state_dict, cpu_offload)
    load_opts = dsd_options(full_state_dict, cpu_offload, loading=True)

    def save(writer, model, opt):
        return clone_tree((get_model_state_dict(model, options=opts),
                           get_optimizer_state_dict(model, opt, options=opts)))

    def load(saved, model, opt):
        msd, osd = clone_tree(saved)
        set_model_state_dict(model, msd, options=load_opts)
        set_optimizer_state_dict(model, opt, osd, options=load_opts)

    got = save_and_resume(ctx, "lm1", save, load, unit_kw)
    assert_equal(describe(got["cfsdp"]), describe(got["torch"]), "DSD (model, optim) state dicts")
    if full_state_dict and cpu_offload and ctx.rank != 0 and (got["cfsdp"][0] or got["cfsdp"][1]):
        raise AssertionError("full_state_dict with cpu_offload: ranks other than 0 must get {}")


@contextlib.contextmanager
def shared_tmpdir(ctx):
    """A directory every rank sees: rank 0 creates it and broadcasts the path."""
    obj = [tempfile.mkdtemp(prefix="cfsdp-fs-", dir=os.environ.get("CFSDP_CKPT_DIR")) if ctx.rank == 0 else None]
    dist.broadcast_object_list(obj, src=0, group=ctx.pg)
    try:
        yield obj[0]
    finally:
        dist.barrier(group=ctx.pg)
        if ctx.rank == 0:
            shutil.rmtree(obj[0], ignore_errors=True)


def dcp_save(ctx, model, opt, path: str) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=ctx.pg)


def dcp_load(ctx, model, opt, path: str) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path, process_group=ctx.pg)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


@h.subtest
def dcp_roundtrip(ctx, unit_kw: dict | None = None):
    """dcp.save of the sharded model+optimizer state dicts by each implementation, dcp.load into
    a fresh model of either: the next steps are the uninterrupted run's, bitwise."""
    with shared_tmpdir(ctx) as root:
        def save(writer, model, opt):
            path = os.path.join(root, writer)
            dcp_save(ctx, model, opt, path)
            return path

        save_and_resume(ctx, "lm1", save, lambda path, model, opt: dcp_load(ctx, model, opt, path),
                        unit_kw)
