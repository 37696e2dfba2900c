"""``cfsdp.patch_torch()``: torch's public FSDP (and ZeRO) names point at cfsdp's objects (a face).

For code you cannot edit (accelerate, Lightning, torchtitan, the HF Trainer) that imports
torch's FSDP names itself.  After ``patch_torch()``, every *later* lookup of these names,
``from torch.distributed.fsdp import FullyShardedDataParallel``, ``import
torch.distributed.fsdp as fsdp; fsdp.fully_shard(...)`` or ``getattr``, gives cfsdp's object:

=============================================================  ===========================
module                                                         names pointed at cfsdp's
=============================================================  ===========================
``torch.distributed.fsdp``                                     ``FullyShardedDataParallel``,
                                                               ``FSDPModule``,
                                                               ``UnshardHandle``,
                                                               ``fully_shard``,
                                                               ``register_fsdp_forward_method``,
                                                               ``share_comm_ctx``
``torch.distributed.fsdp.fully_sharded_data_parallel``         ``FullyShardedDataParallel``
``torch.distributed.fsdp._fully_shard`` and its                the five FSDP2 names above
``._fully_shard``
``torch.distributed._composable.fsdp``                         ``FSDPModule``, ``fully_shard``,
                                                               ``register_fsdp_forward_method``
``torch.distributed._composable.fsdp.fully_shard``             those and ``UnshardHandle``
``torch.distributed.optim`` and its                            ``ZeroRedundancyOptimizer``
``.zero_redundancy_optimizer``
``torch.distributed.tensor.parallel.ddp``                      ``_pre_dp_module_transform``
=============================================================  ===========================

(A module gets exactly the names of that list it defines in the installed torch: the same in
torch 2.11 to 2.15.)  Configs, enums and
policies (``MixedPrecision``, ``ShardingStrategy``, ``StateDictType``, ``wrap.*``, ...) are not
touched: they are torch's own objects in cfsdp too.  ``unpatch_torch()`` gives every module back
as it was; both are idempotent.  Names bound *before* the patch (``from torch.distributed.fsdp
import fully_shard`` at the top of a module imported earlier) keep torch's objects: call
``patch_torch()`` before importing the trainer, or use the switch below.

[Note: only the outside view is patched]  torch's own code refers to these names as globals of
the modules that define them: ``FullyShardedDataParallel``'s methods call
``FullyShardedDataParallel.fsdp_modules`` and test ``isinstance(m, FullyShardedDataParallel)``,
torch's ``fully_shard`` builds ``FSDP<Cls>`` classes on ``FSDPModule``.  Rebinding those globals
would turn torch's FSDP, still usable through references taken before the patch (cfsdp's own
``_TorchFSDP`` checks, a reference run in a test), into a hybrid that finds cfsdp's wrappers
instead of its own (tried: torch's FSDP1 ``state_dict()`` then fails).  So the modules' ``__dict__`` is never written.  Instead
each module's ``__class__`` becomes a subclass of its class (assignment of a module's class is
supported since Python 3.5) whose ``__getattribute__`` answers the patched names with cfsdp's
objects.  Attribute access from outside (``import``, ``getattr``, ``from m import *``) goes
through it; a global lookup inside torch's functions reads the module dict and still finds
torch's objects.  ``vars(module)`` shows torch's objects, and assigning a patched name while
patched (``unittest.mock.patch``) changes the module's dict as it would without the patch, but
lookups from outside keep answering cfsdp's object until ``unpatch_torch()``.

The switch for unmodified scripts: ``python -m cfsdp.run script.py [args]`` (also under
``torchrun -m cfsdp.run script.py [args]`` and ``accelerate launch -m cfsdp.run script.py``)
patches, then runs the script as ``__main__``; see ``cfsdp/run.py``.  No environment variable
is read at ``import cfsdp``: an unmodified script never imports cfsdp, so such a switch could
only act through a ``.pth`` file run at every interpreter start.

[Note: torch's own modules keep torch's objects]  torch modules that bind some of these names
at import (``TORCH_IMPORTERS``: pipelining's stage and schedules, ``replicate_with_fsdp``,
``torch.distributed.checkpoint.state_dict``, ...) are imported by ``patch_torch()`` before it
patches anything, so they hold torch's objects however late the program first uses them:
their code calls torch's FSDP internals, which cfsdp's objects do not have.  So
``torch.distributed.pipelining`` treats a cfsdp model as a plain module (read from its source,
not tested), and
``torch.distributed.checkpoint.state_dict`` tests ``isinstance(m, torch's FSDP)`` (cfsdp routes
its steps for cfsdp models anyway: ``cfsdp/checkpoint/state_dict.py``).  Code of torch that
looks a patched name up at call time (``torch._dynamo``'s guard serialisation reads
``torch.distributed.fsdp._fully_shard.FSDPModule``) sees cfsdp's object.  cfsdp's own checks
for torch's classes (``_TorchFSDP``) bind them when cfsdp is imported, before any patch.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from ._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .optim.zero import ZeroRedundancyOptimizer
from .parallel import pre_dp_module_transform

# torch's names that cfsdp implements (everything else it re-exports): the FSDP faces,
# ZeRO-1, and the TP-for-DDP transform (DistributedDataParallel(device_mesh=...) imports it
# from torch.distributed.tensor.parallel.ddp when it is built, so while patched DDP runs
# cfsdp's, which keeps the parameters visible: cfsdp/parallel.py)
CFSDP_OBJECTS: dict[str, Any] = {
    "FullyShardedDataParallel": FullyShardedDataParallel,
    "FSDPModule": FSDPModule,
    "UnshardHandle": UnshardHandle,
    "fully_shard": fully_shard,
    "register_fsdp_forward_method": register_fsdp_forward_method,
    "share_comm_ctx": share_comm_ctx,
    "ZeroRedundancyOptimizer": ZeroRedundancyOptimizer,
    "_pre_dp_module_transform": pre_dp_module_transform,
}

# the modules third-party code imports them from (the same in torch 2.11 to 2.15)
TORCH_MODULES: tuple[str, ...] = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed.optim",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.tensor.parallel.ddp",
)

# torch's other modules that bind some of these names at import (torch 2.11-2.15; a unit test scans
# torch's source for them): imported before patching, so they hold torch's objects whenever
# they are used (see [Note: torch's own modules keep torch's objects])
TORCH_IMPORTERS: tuple[str, ...] = (
    "torch.distributed._composable.replicate_with_fsdp",
    "torch.distributed._tools.fsdp2_mem_tracker",
    "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook",
    "torch.distributed.algorithms._optimizer_overlap.optimizer_overlap",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.optim.named_optimizer",
    "torch.distributed.pipelining.schedules",
    "torch.distributed.pipelining.stage",
)

# module name -> (the module, its class before the patch, the patched class); the record that
# unpatch_torch() restores from
_PATCHED: dict[str, tuple[types.ModuleType, type, type]] = {}


def _patched_class(base: type, overrides: dict[str, Any]) -> type:
    """A subclass of the module class ``base`` whose instances answer the names of
    ``overrides`` from it (see [Note: only the outside view is patched])."""

    def __getattribute__(self, name: str) -> Any:
        if name in overrides:
            return overrides[name]
        return base.__getattribute__(self, name)

    return type(base.__name__, (base,), {
        "__getattribute__": __getattribute__,
        "__module__": base.__module__,
        "_cfsdp_overrides": overrides,
    })


def patch_torch() -> dict[str, tuple[str, ...]]:
    """Point torch's public FSDP names at cfsdp's objects (the module doc lists them), so code
    that looks them up afterwards runs on cfsdp.  Idempotent.  Returns what is patched:
    ``{module name: (name, ...)}``."""
    # every module first, then the patch: a module imported while another is patched would
    # bind cfsdp's objects in its own globals for good
    mods = [importlib.import_module(m) for m in TORCH_MODULES + TORCH_IMPORTERS]
    for modname, mod in zip(TORCH_MODULES, mods):
        if modname in _PATCHED:
            continue
        names = [n for n in CFSDP_OBJECTS if n in vars(mod)]
        if not names:
            raise AssertionError(f"cfsdp.patch_torch: {modname} defines none of "
                                 f"{sorted(CFSDP_OBJECTS)} (torch 2.11-2.15 do)")
        base = type(mod)
        patched = _patched_class(base, {n: CFSDP_OBJECTS[n] for n in names})
        mod.__class__ = patched
        _PATCHED[modname] = (mod, base, patched)
    return patched_torch_names()


def unpatch_torch() -> None:
    """Give torch's modules back their own objects: exactly what ``patch_torch()`` changed is
    restored.  Idempotent.  A module whose class was replaced again after the patch (by
    someone else) is left as it is: ``RuntimeError`` naming it, once every other module is
    restored."""
    stuck = []
    for modname, (mod, base, patched) in list(_PATCHED.items()):
        if type(mod) is patched:
            mod.__class__ = base
            del _PATCHED[modname]
        else:
            stuck.append(f"{modname} (class {type(mod).__qualname__})")
    if stuck:
        raise RuntimeError(
            "cfsdp.unpatch_torch: the class of " + ", ".join(stuck) + " was replaced after "
            "cfsdp.patch_torch(); undo that replacement first, then call unpatch_torch() again."
        )


def patched_torch_names() -> dict[str, tuple[str, ...]]:
    """What is patched now: ``{module name: (name, ...)}`` (empty when nothing is)."""
    return {m: tuple(p._cfsdp_overrides) for m, (_, _, p) in _PATCHED.items()}


__all__ = ["patch_torch", "unpatch_torch", "patched_torch_names", "CFSDP_OBJECTS",
           "TORCH_MODULES", "TORCH_IMPORTERS"]
