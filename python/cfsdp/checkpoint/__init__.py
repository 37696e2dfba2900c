"""Checkpoint files for cfsdp models: crash-safe writes and full-state-dict checkpoints.

``atomic_save(obj, path)``
    ``torch.save`` that never leaves a half-written file at ``path``: the bytes go to a
    temporary file in the same directory (``.<name>.tmp-<pid>@<host>.<random>``), which is
    flushed and fsynced, then renamed onto ``path`` with ``os.replace`` (atomic on POSIX within
    one file system), and the directory is fsynced so the rename itself is durable.  If
    anything raises, the temporary file is removed and an existing file at ``path`` is
    untouched.  A process killed mid-write (SIGKILL, power loss) leaves its temporary file
    behind, never a damaged ``path``; the writer holds an exclusive ``flock`` on its temporary
    file from its creation until the rename, and each save first removes the temporary files
    of ``path`` whose writers are gone, by the rule of ``cfsdp.checkpoint._liveness`` (never a
    file whose lock is held: a live writer, on this host or another one that shares the file
    system; never a file of another name).

``dcp_save(state_dict, *, checkpoint_id=...)`` / ``dcp_recover(checkpoint_id)``
    ``torch.distributed.checkpoint.save`` that a killed rank cannot damage: see
    ``cfsdp.checkpoint._dcp_save``.

``save_full_state_dict(model, path, optimizer=None)`` / ``load_full_state_dict(...)``
    One file ``{"model": full model state dict, "optim": full optimizer state dict or None}``
    for a model wrapped with ``cfsdp.FullyShardedDataParallel`` (torch's FSDP1 works too: only
    the torch-compatible API is used).  Both are collectives over the model's process group.

``cfsdp.checkpoint.state_dict``
    ``torch.distributed.checkpoint.state_dict``'s helpers for cfsdp models.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP

from .._runtime.base import wrappers_in
from ..api import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from ..fully_sharded_data_parallel import FullyShardedDataParallel as _CFSDP
from . import _liveness
from ._agree import agree
from ._dcp_save import dcp_recover, dcp_save

__all__ = ["atomic_save", "dcp_save", "dcp_recover", "save_full_state_dict", "load_full_state_dict"]


def _new_file_mode(path: str) -> int:
    """The permission bits ``open(path, "wb")`` would give: the old file's if there is one,
    else 0o666 minus the umask (``mkstemp`` creates 0o600)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_save(obj: Any, path: str | os.PathLike, **torch_save_kwargs: Any) -> None:
    """``torch.save(obj, path, **torch_save_kwargs)``, all or nothing (see the module doc)."""
    if "f" in torch_save_kwargs:
        raise TypeError("atomic_save() got the destination twice: pass it as path, not f=")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    directory = os.path.dirname(os.path.abspath(path))
    stem = f".{os.path.basename(path)}.tmp-"
    mode = _new_file_mode(path)
    _liveness.remove_dead_files(directory, stem)
    fd, tmp, tag = _liveness.create_locked(directory, stem)
    # the file stays open (its lock held) until it has been renamed onto path: closed before,
    # a complete but not yet renamed file would look like a dead writer's leftover
    f = os.fdopen(fd, "wb", closefd=False)
    try:
        torch.save(obj, f, **torch_save_kwargs)
        f.flush()
        os.fchmod(f.fileno(), mode)
        os.fsync(f.fileno())
        f.close()  # not fd: closefd=False
        os.replace(tmp, path)
    except BaseException:
        try:
            f.close()
        except OSError:  # flushing the rest failed too: the first error is the one to see
            pass
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        _liveness.release(fd, tag)
        raise
    _liveness.release(fd, tag)
    _liveness.fsync_dir(directory)


# ---------------------------------------------------------------------------
# full-state-dict checkpoints (collective)
# ---------------------------------------------------------------------------


def _root_group(model: nn.Module) -> dist.ProcessGroup:
    """The process group of the model's outermost FSDP wrapper (cfsdp's or torch's)."""
    ours = set(wrappers_in(model))
    for m in model.modules():
        if m in ours:
            return m._process_group
        if isinstance(m, _TorchFSDP):
            return m.process_group
    raise ValueError(
        f"{type(model).__name__} contains no FullyShardedDataParallel module: "
        "save_full_state_dict/load_full_state_dict need a model wrapped with "
        "cfsdp.FullyShardedDataParallel (or torch's FSDP1)."
    )


def _fsdp_api_for(model: nn.Module):
    """cfsdp's wrapper class, or torch's when the model is wrapped with torch's FSDP1."""
    if any(isinstance(m, _TorchFSDP) for m in model.modules()):
        return _TorchFSDP
    return _CFSDP


def save_full_state_dict(
    model: nn.Module, path: str | os.PathLike, optimizer: Optional[torch.optim.Optimizer] = None
) -> None:
    """Write ``{"model": ..., "optim": ...}`` (full state dicts) to ``path`` on rank 0.

    A collective over the model's process group: every rank must call it.  The model state
    dict is gathered with ``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`` and,
    with an ``optimizer``, the optimizer's through ``FSDP.optim_state_dict`` under
    ``FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)``.  Rank 0 (of the
    model's group) writes with :func:`atomic_save`; then every rank learns whether the write
    succeeded, and if it did not, every rank raises (rank 0 its own error)."""
    fsdp = _fsdp_api_for(model)
    group = _root_group(model)
    # torch's FSDP1 with a CPU compute device frees the storage its "CPU copy" shares when
    # offloading (a CPU->CPU move is no copy): offload_to_cpu=True crashes it (SIGSEGV) in
    # torch 2.13. On a CPU device the tensors are in CPU memory anyway, so offloading means
    # nothing there; cfsdp always offloads as asked.
    offload = not (fsdp is not _CFSDP and all(
        m.compute_device.type == "cpu" for m in fsdp.fsdp_modules(model)
    ))
    with fsdp.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True),
    ):
        model_sd = model.state_dict()
        optim_sd = None if optimizer is None else fsdp.optim_state_dict(model, optimizer)
    error: Optional[BaseException] = None
    if group.rank() == 0:
        try:
            atomic_save({"model": model_sd, "optim": optim_sd}, path)
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
            error = e
    del model_sd, optim_sd
    agree(group, error, f"save_full_state_dict: writing {os.fspath(path)!r} on rank 0")


def load_full_state_dict(
    model: nn.Module, path: str | os.PathLike, optimizer: Optional[torch.optim.Optimizer] = None
) -> None:
    """Load a file written by :func:`save_full_state_dict` into ``model`` (and ``optimizer``).

    A collective over the model's process group.  Every rank reads ``path`` (memory-mapped,
    so the ranks of one host share the pages), so it must be visible to all ranks (one host,
    or a shared file system); if any rank cannot read it, every rank raises.  The model is
    loaded strictly under FULL_STATE_DICT; the optimizer through
    ``FSDP.optim_state_dict_to_load``.  Asking for the optimizer of a file saved without one
    is a ValueError."""
    fsdp = _fsdp_api_for(model)
    group = _root_group(model)
    error: Optional[BaseException] = None
    ckpt: Any = None
    try:
        ckpt = torch.load(os.fspath(path), map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(ckpt, dict) or "model" not in ckpt or "optim" not in ckpt:
            raise ValueError(
                f"{os.fspath(path)!r} is not a save_full_state_dict checkpoint (expected a dict "
                f"with keys 'model' and 'optim')"
            )
        if optimizer is not None and ckpt["optim"] is None:
            raise ValueError(
                f"{os.fspath(path)!r} holds no optimizer state (it was saved without an "
                "optimizer); call load_full_state_dict without optimizer="
            )
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
        error = e
    agree(group, error, f"load_full_state_dict: reading {os.fspath(path)!r}")
    with fsdp.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    ):
        model.load_state_dict(ckpt["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(fsdp.optim_state_dict_to_load(model, optimizer, ckpt["optim"]))
