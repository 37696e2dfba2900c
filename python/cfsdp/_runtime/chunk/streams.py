"""torch FSDP2's stream protocol for ``fully_shard`` units (its ``FSDPCommContext``).

[Note: stream protocol]
One :class:`CommContext` per root, shared by the root's chunk units, takes its streams from
the device layer ([Note: device layer] in ``device.py``) picked at each root pre-forward.  On
a layer without streams (CPU: ``NoStreams``) ``streams`` is False and the units take their
old path (``async_op`` collectives, the C core, shared memory); with streams, as torch 2.13:

* root pre-forward: the all-gather copy-in and all-gather streams wait for the current stream
  (the optimizer wrote the shards there), or for the event of ``set_post_optim_event``;
* unshard in forward / pre-backward (and their prefetches): the copy-in (cast to
  ``param_dtype``, the all-gather output allocated) on the copy-in stream; the all-gather
  stream waits for it, issues the collective inside it (``async_op=False``) and records an
  event.  Outside a step (explicit ``unshard``, summon, state dicts) both are the current
  stream, as torch's ``get_all_gather_streams``;
* wait_unshard: the current stream waits for that event, the copy-out runs on it, and the
  all-gather's buffers are held (torch's ``all_gather_state``) with an event recorded after
  the copy-out, until the next unshard's copy-in and all-gather streams have waited for it;
  then released (a ``free`` notification).  The hold is what bounds the CPU's run-ahead;
* post-backward: the reduce-scatter stream waits for the current stream; the copy-in
  (pack), the reduce-scatter and the post-divide / cast / accumulation run on it; HSDP's
  all-reduce (and an all-reduce hook without a stream of its own) on the all-reduce stream,
  which waits for the reduce-scatter stream, and the accumulation then follows there; an
  event is recorded after the last.  The reduce-scatter input is held until the next
  reduction, where the current stream waits for its event (torch's ``reduce_scatter_states``);
* end of backward (the root's final callback): the current stream waits for the last
  post-reduce event of each stream that post-reduced and for the held reduce-scatter input's
  event; the held all-gather buffers are released too (torch keeps them until the next
  unshard: the same waits, freed one step earlier).

Each wait is one method here, so a test can take one away and watch the checker fail.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import device
from ..base import TrainingState

_IN_STEP = (TrainingState.FORWARD, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)


class CommContext:
    """The streams, events and held buffers one root's chunk units share."""

    def __init__(self, root_state: Any, dev: torch.device):
        self.root_state = root_state  # the root's UnitState: in a step or not
        self.device = dev
        self.layer: Any = device.NO_STREAMS
        self.streams = False  # the layer has streams: the units take the protocol's path
        self.all_gather_state: Optional[tuple[tuple, Any]] = None  # (buffers, event)
        self.reduce_scatter_state: Optional[tuple[tuple, Any]] = None
        # the last post-reduce event of each stream that post-reduced (torch's
        # _last_post_reduce_events: a later event on a stream subsumes earlier ones)
        self.post_reduce_events: dict[Any, Any] = {}

    # -- root pre-forward -----------------------------------------------------------------
    def begin_forward(self, post_optim_event: Any = None) -> bool:
        """Pick the layer for this step; with streams, the all-gather streams wait for the
        optimizer: for ``post_optim_event`` if given (``set_post_optim_event``), else for the
        current stream.  Whether the layer has streams (if not, the caller waits for the
        event its own way)."""
        self.layer = layer = device.layer_for(self.device)
        self.streams = layer.has_streams
        if not self.streams:
            return False
        copy_in, ag = layer.stream(device.ALL_GATHER_COPY_IN), layer.stream(device.ALL_GATHER)
        if post_optim_event is not None:
            copy_in.wait_event(post_optim_event)
            ag.wait_event(post_optim_event)
        else:
            cur = layer.current_stream()
            copy_in.wait_stream(cur)
            ag.wait_stream(cur)
        return True

    # -- all-gather -------------------------------------------------------------------------
    def all_gather_streams(self) -> tuple[Any, Any, bool]:
        """``(copy_in, all_gather, in_step)``: side streams within a step, else the current
        stream for both."""
        layer = self.layer
        if self.root_state.training_state in _IN_STEP:
            return layer.stream(device.ALL_GATHER_COPY_IN), layer.stream(device.ALL_GATHER), True
        cur = layer.current_stream()
        return cur, cur, False

    def wait_unshard_event(self, event: Any) -> None:
        """wait_unshard: the current stream waits for the all-gather."""
        self.layer.current_stream().wait_event(event)

    def hold_all_gather(self, buffers: tuple, event: Any) -> None:
        self.release_all_gather()
        self.all_gather_state = (buffers, event)

    def release_all_gather(self) -> None:
        """The next unshard (or the end of backward): the all-gather streams wait for the
        held copy-out's event, then its buffers are freed."""
        state, self.all_gather_state = self.all_gather_state, None
        if state is None:
            return
        buffers, event = state
        layer = self.layer
        layer.stream(device.ALL_GATHER_COPY_IN).wait_event(event)
        layer.stream(device.ALL_GATHER).wait_event(event)
        for t in buffers:
            layer.free(t)

    # -- reductions ---------------------------------------------------------------------------
    def reduce_scatter_waits_current(self, rs: Any, cur: Any) -> None:
        """post-backward: the reduce-scatter stream waits for the gradient's stream."""
        rs.wait_stream(cur)

    def hold_reduce_scatter(self, buffers: tuple, event: Any) -> None:
        self.release_reduce_scatter()
        self.reduce_scatter_state = (buffers, event)

    def release_reduce_scatter(self) -> None:
        state, self.reduce_scatter_state = self.reduce_scatter_state, None
        if state is None:
            return
        buffers, event = state
        self.layer.current_stream().wait_event(event)
        for t in buffers:
            self.layer.free(t)

    def wait_post_reduce(self) -> None:
        """End of backward: the current stream waits for the last post-reduce event of
        each stream that post-reduced."""
        events, self.post_reduce_events = self.post_reduce_events, {}
        cur = self.layer.current_stream()
        for event in events.values():
            cur.wait_event(event)

    def end_backward(self) -> None:
        if not self.streams:
            return
        self.wait_post_reduce()
        self.release_reduce_scatter()
        self.release_all_gather()


__all__ = ["CommContext"]
