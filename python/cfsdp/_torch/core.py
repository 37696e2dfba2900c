"""Core torch internals: autograd's engine, tensor checks, dispatch modes, profiler, optimizers.

* ``queue_callback(fn)``: run ``fn`` at the end of the current backward
  (``Variable._execution_engine.queue_callback``, as torch's FSDP1/FSDP2 and DDP do).
* ``current_autograd_node()``: the autograd node backward is running now (None outside
  backward; ``torch._C._current_autograd_node``), e.g. which ``AccumulateGrad`` node a
  post-accumulate-grad hook runs in.
* ``has_storage(t)``, ``is_functorch_wrapped(t)``: whether a tensor's memory may be handed to C
  (``cfsdp._core``).
* ``dispatch_mode_active()``: a ``TorchDispatchMode`` (e.g. ``CommDebugMode``) is on the stack,
  so collectives take the process group, where the mode sees them.
* ``profiler_enabled()``: an autograd profiler is recording (collectives get named ranges).
* ``unhooked_step(step)``: an optimizer class's ``step`` without the wrapper that runs the
  step hooks (``Optimizer._patch_step_function``'s ``profile_hook_step``: ``hooked``,
  ``__wrapped__``), for a subclass calling its torch class's step inside its own.
* ``scalar_dtype()``: the dtype torch's Adam/AdamW keep ``step`` in
  (``torch.optim.optimizer._get_scalar_dtype``).
* ``muon_adjust_lr(lr, adjust_lr_fn, shape)``: torch's Muon learning-rate adjustment
  (``torch.optim._muon._adjust_lr``; torch 2.14+ adds ``"spectral_unclamped"``).
* ``muon_newton_schulz(grad, ns_coefficients, ns_steps, eps)``: torch's Muon orthogonalization
  of one matrix (``torch.optim._muon._zeropower_via_newtonschulz``).

The same in torch 2.11 to 2.15.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.optim._muon import _adjust_lr as muon_adjust_lr
from torch.optim._muon import _zeropower_via_newtonschulz as muon_newton_schulz
from torch.optim.optimizer import _get_scalar_dtype as scalar_dtype

ENGINE = torch.autograd.Variable._execution_engine
has_storage: Callable[[torch.Tensor], bool] = torch._C._has_storage
is_functorch_wrapped: Callable[[torch.Tensor], bool] = torch._C._functorch.is_functorch_wrapped_tensor
profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled
current_autograd_node: Callable[[], object] = torch._C._current_autograd_node


def queue_callback(fn: Callable[[], None]) -> None:
    ENGINE.queue_callback(fn)


def dispatch_mode_active() -> bool:
    return torch._C._len_torch_dispatch_stack() > 0


def unhooked_step(step: Callable) -> Callable:
    """An optimizer class's ``step`` function without the hook wrapper torch puts around
    it once any optimizer of that class exists (``Optimizer._patch_step_function``:
    ``profile_hook_step``, marked ``hooked``, the function under ``__wrapped__``), which
    runs the step pre/post hooks."""
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


__all__ = ["ENGINE", "current_autograd_node", "dispatch_mode_active", "has_storage", "is_functorch_wrapped",
           "muon_adjust_lr", "muon_newton_schulz", "profiler_enabled", "queue_callback", "scalar_dtype",
           "unhooked_step"]
