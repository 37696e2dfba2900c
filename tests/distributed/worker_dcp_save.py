"""cfsdp.checkpoint.dcp_save across ranks (run by test_dcp_save.py, W=2, gloo).

* ``roundtrip``, ``same_files``, ``use_collectives``: Shard(0) DTensors saved by two ranks
  over the subtest's group; the same files and metadata as ``dcp.save`` with the same
  ``FileSystemWriter`` options; nothing left beside the checkpoint.
* ``write_error_on_one_rank``, ``bad_argument_on_one_rank``, ``overwrite_false``: a rank that
  fails makes every rank fail, with a message naming it (torch's message where torch also
  refuses), and the previous checkpoint stays, with nothing left beside it.
* ``kill[scenario=...]``: a rank SIGKILLed at each point of a save (see dcp_kill.py): after
  the kill the path holds exactly A or exactly B (or, at the one point where the fallback
  publish cannot avoid it, nothing until ``dcp_recover`` puts B there), the surviving rank
  raised with a note saying so, and the next ``dcp_save`` works and removes every leftover.
  The control scenario saves with ``dcp.save`` and must lose A.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import DeviceMesh

import _harness as h
import dcp_kill as dk

from cfsdp.checkpoint import dcp_save

CHILD_TIMEOUT_S = 90
multiprocessing.set_forkserver_preload(["dcp_kill"])


def folder(ctx: h.Context, name: str) -> Path:
    """An empty folder shared by the ranks: ``$CFSDP_CKPT_DIR/<name>``."""
    d = Path(os.environ["CFSDP_CKPT_DIR"]) / name
    if ctx.rank == 0:
        d.mkdir(parents=True)
    dist.barrier(group=ctx.pg)
    return d


def mesh_of(ctx: h.Context) -> DeviceMesh:
    return DeviceMesh.from_group(ctx.pg, "cpu")


def check_only(parent: Path, *want: str) -> None:
    got = sorted(os.listdir(parent))
    if got != sorted(want):
        raise AssertionError(f"{parent}: {got}, want only {sorted(want)}")


def check_found(ctx: h.Context, target: Path, want: str) -> None:
    got = dk.which(target, mesh_of(ctx), ctx.pg)
    if got != want:
        raise AssertionError(f"{target} holds {got}, want {want}")


def expect_failure(fn, *, contains: str) -> str:
    """``fn()`` must raise (any BaseException but KeyboardInterrupt) with ``contains`` in its
    message or notes; returns the whole text."""
    try:
        fn()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        text = str(e) + "\n" + "\n".join(getattr(e, "__notes__", []))
        if contains not in text:
            raise AssertionError(f"{type(e).__name__} without {contains!r}: {text}") from e
        return text
    raise AssertionError(f"did not raise (wanted {contains!r})")


# --------------------------------------------------------------------------- all ranks alive


@h.subtest
def roundtrip(ctx):
    parent = folder(ctx, "roundtrip")
    target = parent / "ck"
    mesh = mesh_of(ctx)
    dcp_save(dk.state("A", mesh), checkpoint_id=target, process_group=ctx.pg)
    check_found(ctx, target, "A")
    writer = FileSystemWriter(target, thread_count=2)
    dcp_save(dk.state("B", mesh), storage_writer=writer, process_group=ctx.pg)
    check_found(ctx, target, "B")
    if writer.path != target:
        raise AssertionError(f"writer.path {writer.path}, want {target}")
    dist.barrier(group=ctx.pg)
    check_only(parent, "ck")


@h.subtest(grid={"use_collectives": [True, False]})
def same_files(ctx, use_collectives):
    parent = folder(ctx, f"same_files_{use_collectives}")
    mesh = mesh_of(ctx)
    for impl, save in (("torch", dcp.save), ("cfsdp", dcp_save)):
        save(dk.state("A", mesh), storage_writer=FileSystemWriter(parent / impl / "ck", thread_count=2),
             process_group=ctx.pg, use_collectives=use_collectives)
        check_found(ctx, parent / impl / "ck", "A")
    dist.barrier(group=ctx.pg)
    t, c = parent / "torch" / "ck", parent / "cfsdp" / "ck"
    check_only(c.parent, "ck")
    if sorted(os.listdir(t)) != sorted(os.listdir(c)):
        raise AssertionError(f"files {sorted(os.listdir(c))}, torch's {sorted(os.listdir(t))}")
    if use_collectives:
        mt, mc = (FileSystemReader(p).read_metadata() for p in (t, c))
        if mt.state_dict_metadata != mc.state_dict_metadata or mc.storage_meta.checkpoint_id != c:
            raise AssertionError(f"metadata differs: {mc} vs torch's {mt}")


def fails_and_keeps_a(ctx: h.Context, name: str, attempt, contains: str) -> str:
    """Save A, then ``attempt(target, mesh)`` a save of B that must fail on every rank with
    ``contains`` in its message; A stays, with nothing beside it.  Returns the message."""
    parent = folder(ctx, name)
    target = parent / "ck"
    mesh = mesh_of(ctx)
    dcp_save(dk.state("A", mesh), checkpoint_id=target, process_group=ctx.pg)
    text = expect_failure(lambda: attempt(target, mesh), contains=contains)
    check_found(ctx, target, "A")
    dist.barrier(group=ctx.pg)
    check_only(parent, "ck")
    return text


@h.subtest
def write_error_on_one_rank(ctx):
    real = dcp_fs._write_item

    def write_item(*args, **kw):
        raise OSError(28, "injected: no space left on rank 1")

    def attempt(target, mesh):
        if ctx.rank == 1:
            dcp_fs._write_item = write_item
        try:
            dcp_save(dk.state("B", mesh), checkpoint_id=target, process_group=ctx.pg)
        finally:
            dcp_fs._write_item = real

    text = fails_and_keeps_a(ctx, "write_error", attempt, "injected: no space left on rank 1")
    if "nothing was published" not in text:
        raise AssertionError(text)


@h.subtest
def bad_argument_on_one_rank(ctx):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    def attempt(target, mesh):
        writer = FsspecWriter(str(target)) if ctx.rank == 1 else FileSystemWriter(target)
        dcp_save(dk.state("B", mesh), storage_writer=writer, process_group=ctx.pg)

    fails_and_keeps_a(ctx, "bad_argument", attempt,
                      "storage_writer=FsspecWriter" if ctx.rank == 1 else
                      "preparing failed on rank(s) [1]: rank 1: NotImplementedError: dcp_save: "
                      "storage_writer=FsspecWriter")


@h.subtest(grid={"impl": ["torch", "cfsdp"]})
def overwrite_false(ctx, impl):
    save = dcp.save if impl == "torch" else dcp_save  # torch's message is in ours
    fails_and_keeps_a(ctx, f"overwrite_false_{impl}", lambda target, mesh: save(
        dk.state("B", mesh), process_group=ctx.pg, storage_writer=FileSystemWriter(target, overwrite=False)),
        "Checkpoint already exists and self.overwrite=False.")


# --------------------------------------------------------------------------- a rank killed


def run_child(ctx: h.Context, root: Path, step: str, scenario: str) -> dict:
    """This rank's child for one step of ``scenario``; its exit code and its JSON result."""
    result = root / f"{step}-{ctx.rank}.json"
    p = multiprocessing.get_context("forkserver").Process(
        target=dk.child, args=(ctx.rank, ctx.world_size, str(root / f"store-{step}"), str(root),
                               step, scenario, str(result)))
    p.start()
    p.join(CHILD_TIMEOUT_S)
    if p.is_alive():
        p.kill()
        p.join()
        raise AssertionError(f"{scenario} {step}: rank {ctx.rank}'s child hung for {CHILD_TIMEOUT_S} s")
    return {"exitcode": p.exitcode, **(json.loads(result.read_text()) if result.exists() else {})}


@h.subtest(grid={"scenario": list(dk.SCENARIOS)})
def kill(ctx, scenario):
    saver, _, point, killed, found, leftovers, recovered = dk.SCENARIOS[scenario]
    root = folder(ctx, f"kill_{scenario}")
    # both ranks run both steps whatever they find (an early raise on one rank would leave the
    # other waiting in a barrier); what is wrong is collected and raised at the end
    got = run_child(ctx, root, "kill", scenario)
    dist.barrier(group=ctx.pg)
    after_kill = sorted(os.listdir(root / "ckpts"))
    dist.barrier(group=ctx.pg)
    nxt = run_child(ctx, root, "next", scenario)
    problems = []
    if nxt["exitcode"] != 0:
        problems.append(f"the next dcp_save failed: {nxt}")
    elif found == "damaged":
        if nxt["found"] in ("A", "B"):
            problems.append(f"dcp.save killed mid-write left {nxt['found']}: the scenario does "
                            "not interrupt the write")
    elif nxt["found"] != found:
        problems.append(f"after the kill the path holds {nxt['found']}, want {found}")
    elif recovered is not None and nxt["recovered"] != recovered:
        problems.append(f"after dcp_recover the path holds {nxt['recovered']}, want {recovered}")
    elif nxt["after_next"] != "C" or (ctx.rank == 0 and nxt["listing"] != ["ck"]):
        problems.append(f"the next dcp_save: {nxt} (after the kill: {after_kill})")
    if ctx.rank == killed:
        if got["exitcode"] != -signal.SIGKILL:
            problems.append(f"the child was to be killed at {point}: {got}")
    elif got["exitcode"] != 0 or got["before"] != "A" or got["returned"]:
        problems.append(f"the surviving child must have saved A, then failed: {got}")
    else:
        ctx.log(f"after the kill: {after_kill}; the survivor raised: {got['error'].strip()[-300:]}")
        if saver == "cfsdp" and "cfsdp.checkpoint.dcp_save: " not in got["error"]:
            problems.append(f"the survivor's error says nothing of the checkpoint: {got}")
    if leftovers is not None and (after_kill != ["ck"]) != leftovers:
        problems.append(f"after the kill: {after_kill}, leftovers expected: {leftovers}")
    if problems:
        raise AssertionError("\n".join(problems))


if __name__ == "__main__":
    h.main()
