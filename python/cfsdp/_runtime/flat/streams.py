"""torch FSDP1's stream protocol for the wrapper's units (its ``_runtime_utils`` streams).

[Note: FSDP1 streams]
One :class:`FlatStreams` per wrapper root, shared by the root's units, takes its streams from
the device layer ([Note: device layer] in ``device.py``) picked at each root pre-forward.  On
a layer without streams (CPU: ``NoStreams``) ``streams`` is False and the units take their
old path (``async_op`` collectives, the C core, shared memory); with streams, as torch 2.13's
FSDP1 (``_init_streams``, ``_unshard``, ``_reshard``, ``_post_backward_hook``,
``_post_backward_final_callback``):

* root pre-forward (``_wait_for_computation_stream``): the unshard and pre-unshard streams
  wait for the current stream (the optimizer wrote the shards there);
* unshard in forward / pre-backward (and their prefetches): the low-precision shard (mixed
  precision; NO_SHARD's low-precision copy) is made on the pre-unshard stream, which the
  unshard stream then waits for; the rate limiter (``limit_all_gathers``, below); the
  all-gather buffer allocated and the all-gather issued inside the unshard stream
  (``async_op=False``), the low-precision shard freed there after a ``record_stream``.
  Outside a step (summon, state dicts) the current stream does it all, as torch's
  ``_unshard_params_for_summon``;
* the consumer (the blocking ``unshard`` of pre-forward and pre-backward, prefetched or not):
  the current stream waits for the unshard stream (``_pre_forward_unshard``,
  ``_pre_backward_hook``);
* reshard: ``record_stream`` of the unsharded buffer on the current stream (its compute
  read it there), then the free; with ``limit_all_gathers`` and a sharded unit, an event is
  recorded on the current stream and queued (``_FreeEventQueue``);
* rate limiter: before an unshard's all-gather, with two or more free events queued, the CPU
  waits for the oldest (``event.synchronize()``): at most two all-gathers run ahead of the
  frees of the compute stream.  It bounds memory, not ordering;
* post-backward: the post-backward stream waits for the current stream; the cast to
  ``reduce_dtype``, the pre-divide, the reduce-scatter (NO_SHARD's all-reduce, a comm hook)
  and the post-divide / cast / accumulation run on it; HSDP's all-reduce across replicas
  and the accumulation after it on the all-reduce stream, which waits for the post-backward
  stream; the autograd gradient is ``record_stream``'d on the post-backward stream;
* end of backward (the root's final callback, when the root syncs gradients): the current
  stream waits for the post-backward stream (and the all-reduce stream with HSDP).

Priorities as torch's ``_init_streams``: the unshard, pre-unshard and post-backward streams
are high priority (-1) when ``limit_all_gathers`` and a hybrid strategy go together, else 0;
HSDP's all-reduce stream 0 (``stream`` asks the layer for them so).

Each wait is one method here, so a test can take one away and watch the checker fail.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from .. import device
from ..base import TrainingState

_IN_STEP = (TrainingState.FORWARD, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)
MAX_INFLIGHT_ALL_GATHERS = 2  # torch's _FreeEventQueue._max_num_inflight_all_gathers


class FlatStreams:
    """The streams and the free-event queue one wrapper root's units share."""

    def __init__(self, root_state: Any, dev: torch.device, limit_all_gathers: bool,
                 hybrid: bool):
        self.root_state = root_state  # the root's UnitState: in a step or not, syncing or not
        self.device = dev
        self.limit_all_gathers = limit_all_gathers
        self.hybrid = hybrid  # HSDP: an all-reduce stream of its own (else the current one)
        # torch's _init_streams: -1 for the unshard / pre-unshard / post-backward streams with
        # limit_all_gathers and HSDP together, else 0
        self.priority = -1 if limit_all_gathers and hybrid else 0
        self.layer: Any = device.NO_STREAMS
        self.streams = False  # the layer has streams: the units take the protocol's path
        self.free_events: collections.deque = collections.deque()

    def stream(self, name: str) -> Any:
        """The layer's stream ``name`` at torch FSDP1's priority for this root (see the module
        docstring)."""
        return self.layer.stream(name, priority=0 if name == device.ALL_REDUCE else self.priority)

    def begin_forward(self) -> None:
        """Root pre-forward: pick the layer for this step; with streams, the unshard and
        pre-unshard streams wait for the current stream."""
        self.layer = layer = device.layer_for(self.device)
        self.streams = layer.has_streams
        if self.streams:
            cur = layer.current_stream()
            self.stream(device.UNSHARD).wait_stream(cur)
            self.stream(device.PRE_UNSHARD).wait_stream(cur)

    def in_step(self) -> bool:
        """Streams, and the root is in forward or backward (else the current stream)."""
        return self.streams and self.root_state.training_state in _IN_STEP

    # -- unshard --------------------------------------------------------------------------
    def rate_limit(self) -> None:
        """``limit_all_gathers``: with two free events queued, the CPU waits for the oldest."""
        if self.limit_all_gathers and len(self.free_events) >= MAX_INFLIGHT_ALL_GATHERS:
            self.free_events.popleft().synchronize()

    def wait_unshard(self) -> None:
        """The consumer: the current stream waits for the unshard stream."""
        self.layer.current_stream().wait_stream(self.stream(device.UNSHARD))

    def before_free(self, buf: torch.Tensor) -> None:
        """Reshard: the buffer is not reused before the current stream's work on it."""
        self.layer.record_stream(buf, self.layer.current_stream())

    def after_free(self) -> None:
        """Reshard freed a sharded unit's buffer: queue a free event (the rate limiter)."""
        if self.limit_all_gathers:
            self.free_events.append(self.layer.current_stream().record_event())

    # -- post-backward ----------------------------------------------------------------------
    def post_backward_waits_current(self, pb: Any, cur: Any) -> None:
        """Post-backward: the post-backward stream waits for the gradient's stream."""
        pb.wait_stream(cur)

    def wait_post_backward(self) -> None:
        """End of backward: the current stream waits for the post-backward stream (and the
        all-reduce stream with HSDP)."""
        layer = self.layer
        cur = layer.current_stream()
        cur.wait_stream(self.stream(device.POST_BACKWARD))
        if self.hybrid:
            cur.wait_stream(self.stream(device.ALL_REDUCE))

    def end_backward(self) -> None:
        if self.streams and self.root_state.sync_gradients:
            self.wait_post_backward()


__all__ = ["FlatStreams", "MAX_INFLIGHT_ALL_GATHERS"]
