"""TorchDynamo internals ``cfsdp._compile`` uses.

* ``in_compiled_autograd_region()``: a compiled-autograd graph is running
  (``torch._dynamo.compiled_autograd.in_compiled_autograd_region``).
* ``OptimizedModule``: what ``torch.compile(module)`` returns (``torch._dynamo.eval_frame``).
* ``skip``: ``torch._dynamo.decorators.skip``, which marks a function's code object skipped
  (dynamo runs that frame eagerly and compiles what it calls); None where the installed torch
  has none (``cfsdp._compile`` then uses the public ``torch.compiler.disable(recursive=False)``).
* ``HOOK_REASON``: the reason torch's FSDP2 gives dynamo when it skips its hooks (2.11:
  "skipping FSDP hooks since torch._dynamo.config.skip_fsdp_hooks is set"; 2.13+: "skipping
  FSDP hooks").
* ``fsdp_hooks_traced()``: ``torch._dynamo.config.skip_fsdp_hooks`` is set to False.  torch 2.11
  has the switch (default True; False traces FSDP2's hooks into the graphs, "traceable FSDP2"),
  2.13 removed it (setting it raises ``AttributeError``).  cfsdp's hooks always run eagerly, so
  cfsdp refuses the switch (``cfsdp._compile.check_not_compiled_autograd``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch._dynamo.compiled_autograd as _compiled_autograd
import torch._dynamo.config
import torch._dynamo.decorators as _decorators
from torch._dynamo.eval_frame import OptimizedModule

skip: Optional[Callable[[Any], Any]] = getattr(_decorators, "skip", None)

HAS_SKIP_FSDP_HOOKS: bool = hasattr(torch._dynamo.config, "skip_fsdp_hooks")
HOOK_REASON: str = ("skipping FSDP hooks since torch._dynamo.config.skip_fsdp_hooks is set"
                    if HAS_SKIP_FSDP_HOOKS else "skipping FSDP hooks")


def fsdp_hooks_traced() -> bool:
    return HAS_SKIP_FSDP_HOOKS and not torch._dynamo.config.skip_fsdp_hooks


def in_compiled_autograd_region() -> bool:
    return bool(_compiled_autograd.in_compiled_autograd_region)


__all__ = ["HAS_SKIP_FSDP_HOOKS", "HOOK_REASON", "OptimizedModule", "fsdp_hooks_traced",
           "in_compiled_autograd_region", "skip"]
