"""torch.compile (TorchDynamo) and cfsdp: the hooks run eagerly, the modules compile.

What torch 2.13 does with its own FSDP, measured (``tests/distributed/test_compile.py``):

* FSDP2 (``fully_shard``): every hook entry point (pre/post-forward, pre/post-backward, the
  end-of-backward callback) is wrapped in ``torch._dynamo.disable(recursive=True)``
  (``_fsdp_common._dynamo_disable``).  Dynamo never traces them: a hook called inside a
  frame it traces is a graph break; a graph break inside a loop (the hooks of a module
  called from a parent's ``for block in blocks``) makes dynamo skip the whole parent frame,
  which then runs eagerly while each child module's own ``forward`` frame is compiled.
  ``torch._dynamo.config.skip_fsdp_hooks`` no longer exists (setting it raises
  ``AttributeError``): torch 2.13 cannot trace FSDP2's hooks into a graph.  torch 2.11 has
  the switch (default True, the behaviour above, with the longer reason "skipping FSDP hooks
  since torch._dynamo.config.skip_fsdp_hooks is set", which cfsdp gives there too); with
  False it traces FSDP2's hooks into the graphs, which cfsdp cannot: it refuses False at
  the first backward hook (``NotImplementedError`` naming the setting and the version).
* FSDP1 (the wrapper): ``FullyShardedDataParallel.forward`` is traced until it reaches
  torch's own lazy-init and CUDA-stream code, where dynamo gives up on the frame; the
  frame runs eagerly and the wrapped module's ``forward`` is compiled as a frame of its
  own.
* Both mark the modules they manage with ``_is_fsdp_managed_module`` /
  ``_fsdp_use_orig_params`` (cfsdp's faces set the same flags).  Dynamo traces such a
  module unspecialised (its parameters are graph inputs read on every call, without
  guards on their identity, ``config.skip_fsdp_guards``), and refuses one with
  ``_fsdp_use_orig_params=False`` (graph break "FSDP with use_orig_params=False": with
  ``use_orig_params=False`` nothing under the wrapper compiles, for torch and cfsdp alike).

cfsdp gives its entry points the same treatment, through torch's public
``torch.compiler.disable`` and, for the wrapper's ``forward``, the frame skip that FSDP1's
``forward`` ends up with:

* :func:`dynamo_disable` (``recursive=True``): the hooks and everything they call (unshard,
  collectives, the process group) run eagerly, outside any graph.  Applied to
  ``fully_shard``'s registered pre/post-forward hooks and ``_FSState.pre_forward`` /
  ``post_forward`` (as FSDP2's ``_pre_forward`` / ``_post_forward``), and to the runtime's
  ``UnitState.pre_forward`` / ``post_forward`` / pre-backward hook / post-backward /
  end-of-backward callback, which serve both faces.
* :func:`dynamo_skip_frame` on the wrapper's ``forward``: dynamo runs that frame eagerly
  (its pre/post-forward calls are ``dynamo_disable``'d) and compiles the wrapped module's
  frames, so the graphs are FSDP1's.  ``torch.compiler.disable(recursive=False)`` does
  the same through a wrapper function around ``forward``; ``torch._dynamo.decorators.skip``
  marks the code object skipped once and leaves ``forward`` itself in place (nothing added
  to an eager call, ``forward``'s signature and docstring unchanged), so it is used where
  this torch has it, the public form otherwise (per compiled call both cost the same).

So the same frames compile into the same graphs as under torch's FSDP (up to the names of
the graph inputs: FSDP2 registers its unsharded parameters as ``nn.Parameter``s, cfsdp's
forward views are plain tensors), and the number of compiled frames does not grow from
one step to the next, as torch's.  A compiled region that must not break
(``fullgraph=True`` around a wrapped module) raises dynamo's ``Unsupported``, as torch's.

Compiled autograd (``torch._dynamo.config.compiled_autograd=True`` with ``backward()`` in a
compiled region, or ``torch._dynamo.compiled_autograd._enable``): the backward hooks would
run eagerly in the middle of a compiled backward graph that captured its inputs before them.
torch 2.13's FSDP2, and its FSDP1 with ``use_orig_params=False``, then train with wrong
losses on CPU (from the second step; measured at 2 ranks), its FSDP1 with
``use_orig_params=True`` fails inside dynamo, as does torch 2.11's FSDP2 ("queue_callback() is
only supported when Compiled Autograd is enabled with fullgraph=True").  cfsdp refuses it at
the first backward hook,
:func:`check_not_compiled_autograd`, naming the setting
(``tests/distributed/worker_compile.py`` ``compiled_autograd`` checks both sides).

This module sits at the bottom: it knows nothing of cfsdp, only torch.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from ._torch import dynamo as _torch_dynamo

_F = TypeVar("_F", bound=Callable)

REASON = _torch_dynamo.HOOK_REASON  # torch's FSDP2 reason: dynamo prints it at the graph break


def dynamo_disable(fn: _F) -> _F:
    """``fn`` and everything it calls run eagerly under ``torch.compile``: a call from a
    traced frame is a graph break, as a call of one of torch's FSDP hooks is."""
    return torch.compiler.disable(fn, recursive=True, reason=REASON)  # type: ignore[return-value]


def dynamo_skip_frame(fn: _F) -> _F:
    """Dynamo runs ``fn``'s own frame eagerly (a call from a traced frame is a graph break)
    and still compiles the frames ``fn`` calls.  ``fn`` is returned as is (no wrapper:
    nothing is added to an eager call); its code object is marked skipped once."""
    skip = _torch_dynamo.skip
    if skip is None:  # not in this torch: the public equivalent, dearer per compiled call
        return torch.compiler.disable(  # type: ignore[return-value]
            fn, recursive=False, reason=REASON)
    return skip(fn)


COMPILED_AUTOGRAD_MESSAGE = (
    "cfsdp: backward under compiled autograd (torch._dynamo.config.compiled_autograd=True, "
    "or torch._dynamo.compiled_autograd._enable) is not supported. cfsdp's backward hooks "
    "run eagerly, as torch's FSDP hooks do (torch 2.13+ has no "
    "torch._dynamo.config.skip_fsdp_hooks=False to trace them), and a compiled backward graph "
    "around them computes wrong gradients (torch 2.13's own FSDP2, and FSDP1 with "
    "use_orig_params=False, train with wrong losses there; torch 2.11's FSDP2 fails inside "
    "dynamo). Set "
    "torch._dynamo.config.compiled_autograd=False (or leave the "
    "compiled_autograd._enable context) for backward; torch.compile of the model's forward "
    "works as with torch's FSDP."
)


SKIP_FSDP_HOOKS_MESSAGE = (
    "cfsdp: torch._dynamo.config.skip_fsdp_hooks=False (torch {version}: trace FSDP2's hooks into "
    "the compiled graphs) is not supported: cfsdp's hooks always run eagerly between the graphs, "
    "as torch's FSDP hooks do with the default True (and as torch 2.13+, which removed the "
    "switch, always does). Leave torch._dynamo.config.skip_fsdp_hooks=True."
)


def check_not_compiled_autograd() -> None:
    """Raise if a compiled-autograd graph is running (a backward hook was called from it), or,
    on a torch that has the switch (2.11), if ``skip_fsdp_hooks`` asks for traced hooks."""
    if _torch_dynamo.in_compiled_autograd_region():
        raise NotImplementedError(COMPILED_AUTOGRAD_MESSAGE)
    if _torch_dynamo.fsdp_hooks_traced():
        raise NotImplementedError(SKIP_FSDP_HOOKS_MESSAGE.format(version=torch.__version__))
