"""TorchDynamo internals ``cfsdp._compile`` uses.

* ``in_compiled_autograd_region()``: a compiled-autograd graph is running
  (``torch._dynamo.compiled_autograd.in_compiled_autograd_region``).
* ``OptimizedModule``: what ``torch.compile(module)`` returns (``torch._dynamo.eval_frame``).
* ``skip``: ``torch._dynamo.decorators.skip``, which marks a function's code object skipped
  (dynamo runs that frame eagerly and compiles what it calls); None where the installed torch
  has none (``cfsdp._compile`` then uses the public ``torch.compiler.disable(recursive=False)``).

The same in torch 2.11, 2.13 and 2.14.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch._dynamo.compiled_autograd as _compiled_autograd
import torch._dynamo.decorators as _decorators
from torch._dynamo.eval_frame import OptimizedModule

skip: Optional[Callable[[Any], Any]] = getattr(_decorators, "skip", None)


def in_compiled_autograd_region() -> bool:
    return bool(_compiled_autograd.in_compiled_autograd_region)


__all__ = ["OptimizedModule", "in_compiled_autograd_region", "skip"]
