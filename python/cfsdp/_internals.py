"""torch's private FSDP names that trainers and torch's own tests reach for, and cfsdp's answer.

Trainers read a few internals of torch's FSDP objects (surveyed in README.md, "torch's private
FSDP names"): accelerate reads ``_has_params``, ``_flat_param._fqns`` and
``_handle._orig_param_dtype`` of FSDP1 wrappers, verl ``_is_root``, ``_handle.reshard`` and
``_all_handles``, several trainers ``FSDPModule._get_fsdp_state()._fsdp_param_group``.  cfsdp
implements those that mean something for its units, with torch's behaviour, on the objects
themselves (``FullyShardedDataParallel._has_params`` / ``_is_root`` / ``_handle``,
``FSDPModule._get_fsdp_state`` / ``_set_unshard_async_op``, the ``fully_shard`` state's
``_is_root`` / ``_lazy_init``).  For the others it raises an ``AttributeError`` that starts as
Python's own ("'X' object has no attribute 'n'", so ``hasattr`` and code matching it behave as
before) and then says that the name is an internal of torch's FSDP that cfsdp does not have,
and what to use instead.  This module holds those answers (the bottom layer: it knows only
strings); the faces raise :func:`no_torch_internal` from their ``__getattr__``.

An FSDP1 wrapper's ``__getattr__`` forwards unknown names to the wrapped module, as torch's
does; only when that fails too, and the name is in :data:`FSDP1`, is the error cfsdp's (any
other name keeps the wrapped module's error).  The ``fully_shard`` state object and the
wrapper's ``_handle`` are cfsdp's own, so every name they lack gets cfsdp's error, with a
specific answer for the names below and :data:`STATE_DEFAULT` / :data:`HANDLE_DEFAULT`
otherwise.  ``tests/distributed/worker_internals.py`` checks that every name listed is one
torch's objects have, on the installed torch.
"""

from __future__ import annotations

README = "README.md, \"torch's private FSDP names\""

_FSDP_MODULES = ("FullyShardedDataParallel.fsdp_modules(model) (every wrapper) and each "
                 "wrapper's _handle")
_SUMMON = "use FullyShardedDataParallel.summon_full_params(...) for full parameters"

# FullyShardedDataParallel (FSDP1) instance attributes of torch's that cfsdp does not have
FSDP1: dict[str, str] = {
    "_all_handles": f"use {_FSDP_MODULES}; moving a wrapper's parameters to another device "
                    "after wrapping is not supported (cpu_offload=CPUOffload(offload_params="
                    "True) keeps them on the CPU)",
    "_all_fsdp_states": f"use {_FSDP_MODULES}",
    "_fully_sharded_module_to_handle": f"use {_FSDP_MODULES}",
    "_exec_order_data": "cfsdp records the forward order in its own runtime; there is "
                        "nothing to read or set",
    "_device_handle": "cfsdp runs on compute_device; to initialise a wrapper (what torch's "
                      "_runtime_utils._lazy_init(state, module) does) call "
                      "FullyShardedDataParallel.check_is_root() or run a forward",
    "_reset_lazy_init": "cfsdp initialises once, at the first forward; to change which "
                        "wrapper is the root set _is_root, or wrap the model anew",
    "_unshard": _SUMMON,
    "_use_training_state": _SUMMON,
    "_wait_unshard_streams_on_current_stream": "cfsdp issues no CUDA streams; there is "
                                               "nothing to wait for",
    "_deregister_orig_params_ctx": _SUMMON,
    "_assert_state": "read training_state",
    "_comm_hook": "register a hook with register_comm_hook(state, hook)",
    "_comm_hook_state": "register a hook with register_comm_hook(state, hook)",
    "_sync_gradients": "use the no_sync() context",
    "_low_precision_hook_enabled": "read mixed_precision",
    "_mixed_precision_enabled_for_buffers": "read mixed_precision",
}

# torch FSDPState (FSDP2, fully_shard.state(m) / m._get_fsdp_state()) attributes
_GROUP = ("cfsdp's unit is not torch's FSDPParamGroup: use the FSDPModule methods (unshard, "
          "reshard, set_requires_gradient_sync, set_reshard_after_forward, ...) for what it "
          "controls, and the module's DTensor parameters (.to_local()) for its shards")
STATE: dict[str, str] = {
    "_fsdp_param_group": _GROUP,
    "_fsdp_param_groups": _GROUP,
    "_training_state": "cfsdp's training state lives in its runtime: call the FSDPModule "
                       "methods between steps, and reset_iter_state() on the root after a step "
                       "that an exception aborted",
    "_state_ctx": "cfsdp's root state is internal to its runtime",
    "_comm_ctx": "cfsdp issues every collective in order on its process group (no CUDA "
                 "streams to share)",
}
STATE_DEFAULT = ("cfsdp's fully_shard state is not torch's FSDPState: it has _is_root and "
                 "_lazy_init(); for the rest use the FSDPModule methods")

# torch FlatParamHandle (FSDP1, wrapper._handle) attributes
HANDLE: dict[str, str] = {
    "flat_param_to": "moving a wrapper's parameters to another device after wrapping is not "
                     "supported (cpu_offload=CPUOffload(offload_params=True) keeps them on the "
                     "CPU)",
    "unshard": _SUMMON,
    "pre_unshard": _SUMMON,
    "post_unshard": _SUMMON,
}
HANDLE_DEFAULT = ("cfsdp's _handle has flat_param, reshard(free_unsharded_flat_param), "
                  "_orig_param_dtype and _offload_params")


def no_torch_internal(owner: str, name: str, torch_object: str, answer: str) -> AttributeError:
    """The ``AttributeError`` for torch's internal ``name`` looked up on cfsdp's ``owner``
    (its class name) where torch's ``torch_object`` has it: Python's own message first, then
    cfsdp's, with ``answer`` (what to use instead)."""
    return AttributeError(
        f"'{owner}' object has no attribute '{name}' (cfsdp: '{name}' is an internal of "
        f"torch's {torch_object}, which cfsdp does not have; {answer}. See {README}.)"
    )


__all__ = ["FSDP1", "HANDLE", "HANDLE_DEFAULT", "README", "STATE", "STATE_DEFAULT",
           "no_torch_internal"]
