"""The child ranks of worker_dcp_save.py's kill scenarios, and the checkpoints they write.

A scenario's two ranks are children of the two torchrun ranks (one each), forked from a
forkserver that imported torch once, so a scenario costs a fork, not a torchrun launch.  They
form their own gloo group through a FileStore (timeout ``CHILD_PG_TIMEOUT_S``) and run one
step (``child``), then write what they saw to a JSON file:

* ``kill``: save checkpoint A (no kill), then install the scenario's kill point and save B.
  The rank the scenario kills SIGKILLs itself there (and writes nothing); the other rank
  records whether its save returned or raised, and the error with its notes.
* ``next``: what ``dcp.load`` finds at the path (``which``), then, for the scenarios that need
  it, ``dcp_recover`` and what is found then, then ``dcp_save`` of checkpoint C and what is
  found after it; rank 0 lists the checkpoint's parent directory.

Kill points are monkeypatches of the functions the save goes through (nothing in cfsdp knows
about them): DCP's per-item writer (``write``: after the first item of this rank's shard file
is written and flushed), ``dcp.save`` (``saved``: after it returned on this rank),
``_Publisher.publish`` (``agreed``: after every rank agreed, before the publish;
``published``: right after it), ``os.rename`` (``between``: the fallback publish, after the
previous checkpoint was moved aside, before the new one is renamed into place).
"""

from __future__ import annotations

import json
import os
import signal
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from cfsdp.checkpoint import _dcp_save, dcp_recover, dcp_save

CHILD_PG_TIMEOUT_S = 20
ROWS, COLS, N2 = 16, 4, 32
BASE = {"A": 0.0, "B": 1000.0, "C": 2000.0}
STEP = {"A": 1, "B": 2, "C": 3}

# name: (saver, fallback publish, kill point, rank killed, found after the kill,
#        leftovers after the kill, found after dcp_recover or None)
SCENARIOS = {
    "write_r1": ("cfsdp", False, "write", 1, "A", False, None),
    "write_r0": ("cfsdp", False, "write", 0, "A", True, None),
    "saved_r1": ("cfsdp", False, "saved", 1, "A", False, None),
    "agreed_r0": ("cfsdp", False, "agreed", 0, "A", True, None),
    "published_r0": ("cfsdp", False, "published", 0, "B", True, None),
    "fallback_between_r0": ("cfsdp", True, "between", 0, "missing", True, "B"),
    "fallback_published_r0": ("cfsdp", True, "published", 0, "B", True, None),
    # the control: torch's own dcp.save loses A when a rank dies while writing B
    "torch_write_r1": ("torch", False, "write", 1, "damaged", None, None),
}


def full(name: str) -> dict[str, torch.Tensor]:
    return {"w1": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + BASE[name],
            "w2": -torch.arange(N2, dtype=torch.float32) - BASE[name]}


def state(name: str, mesh) -> dict:
    """Checkpoint ``name`` as this rank holds it: two Shard(0) DTensors and a step count."""
    rank, world = mesh.get_rank(), mesh.size()
    local = {k: v.chunk(world)[rank].clone() for k, v in full(name).items()}
    sd = {k: DTensor.from_local(v, mesh, [Shard(0)]) for k, v in local.items()}
    sd["step"] = STEP[name]
    return sd


def which(target: Path, mesh, process_group=None) -> str:
    """``A``/``B``/``C`` if the checkpoint at ``target`` loads as exactly that one on every
    rank (a collective over ``process_group``, whose ranks ``mesh`` spans), ``missing`` if
    there is none, else what is wrong."""
    if not ((target / ".metadata").exists() or (target / "__0.metadata").exists()):
        return "missing"  # (the latter: saved with use_collectives=False)
    sd = state("A", mesh)
    for k in ("w1", "w2"):
        sd[k].to_local().fill_(float("nan"))
    sd["step"] = -1
    try:
        dcp.load(sd, checkpoint_id=target, process_group=process_group)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        return f"does not load: {type(e).__name__}: {str(e)[:300]}"
    for name in BASE:
        if sd["step"] == STEP[name] and all(torch.equal(sd[k].full_tensor(), v)
                                            for k, v in full(name).items()):
            return name
    return f"neither: step {sd['step']}, w1[0] {sd['w1'].full_tensor()[0].tolist()}"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(point: str, target: Path) -> None:
    """SIGKILL this process at ``point`` of the next save (see the module doc)."""
    if point == "write":
        real_write = dcp_fs._write_item

        def write_item(transforms, stream, *args, **kw):
            out = real_write(transforms, stream, *args, **kw)
            stream.flush()
            _die()
            return out

        dcp_fs._write_item = write_item
    elif point == "saved":
        real_save = dcp.save

        def save(*args, **kw):
            out = real_save(*args, **kw)
            _die()
            return out

        dcp.save = save
    elif point in ("agreed", "published"):
        real_publish = _dcp_save._Publisher.publish

        def publish(self):
            if point == "agreed":
                _die()
            real_publish(self)
            _die()

        _dcp_save._Publisher.publish = publish
    elif point == "between":
        real_rename = os.rename

        def rename(src, dst):
            if os.fspath(dst) == str(target) and Path(src).name.startswith(f".{target.name}.partial-"):
                _die()
            return real_rename(src, dst)

        os.rename = rename
    else:
        raise AssertionError(f"unknown kill point {point!r}")


def child(rank: int, world: int, store_path: str, root: str, step: str, scenario: str,
          result_path: str) -> None:
    """One child rank of one step of ``scenario`` (see the module doc)."""
    torch.set_num_threads(1)
    saver_name, fallback, point, killed, _, _, recovered = SCENARIOS[scenario]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=CHILD_PG_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (world,))
    target = Path(root) / "ckpts" / "ck"
    if fallback:
        _dcp_save._renameat2 = None  # as on a file system without RENAME_EXCHANGE
    result: dict = {}
    if step == "kill":
        save = dcp_save if saver_name == "cfsdp" else dcp.save
        save(state("A", mesh), checkpoint_id=target)
        result["before"] = which(target, mesh)
        if rank == killed:
            install_kill(point, target)
        try:
            save(state("B", mesh), checkpoint_id=target)
            result["returned"] = True
        except BaseException as e:  # noqa: BLE001 - what the survivor saw is the result
            result["returned"] = False
            result["error"] = "".join(traceback.format_exception_only(type(e), e))
        Path(result_path).write_text(json.dumps(result))
        os._exit(0)  # the group has a dead member: no teardown
    dist.barrier()  # both ranks look at the same thing: not before, nor after, a change
    result["found"] = which(target, mesh)
    dist.barrier()
    if recovered is not None:
        dcp_recover(target)
        dist.barrier()
        result["recovered"] = which(target, mesh)
    dcp_save(state("C", mesh), checkpoint_id=target)
    result["after_next"] = which(target, mesh)
    if rank == 0:
        result["listing"] = sorted(os.listdir(target.parent))
    Path(result_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
