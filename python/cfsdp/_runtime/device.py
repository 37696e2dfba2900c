"""The device layer: where the runtime gets its streams, events and storage notifications.

[Note: device layer]
The runtime never calls ``torch.cuda`` for streams itself: it asks :func:`layer_for` (the one
seam) for the layer of a tensor's device and uses what that gives:

* ``current_stream()``; ``stream(name, priority=None)``: a side stream, made lazily, one per
  name and priority per device (``None``: the name's own, ``default_priority``; FSDP2's names
  for ``fully_shard``: :data:`ALL_GATHER_COPY_IN`, :data:`ALL_GATHER`, :data:`REDUCE_SCATTER`,
  :data:`ALL_REDUCE`; FSDP1's for the wrapper: :data:`PRE_UNSHARD`, :data:`UNSHARD`,
  :data:`POST_BACKWARD`, and :data:`ALL_REDUCE` for HSDP);
* ``on(s)``: a context making ``s`` the current stream;
* on a stream ``s``: ``s.wait_stream(t)``, ``s.record_event()`` -> event, ``s.wait_event(ev)``
  (torch's ``Stream`` methods); on an event ``ev.synchronize()``: the CPU waits for it (the
  wrapper's rate limiter, FSDP1's ``limit_all_gathers``);
* ``record_stream(t, s)``: ``t``'s memory is not reused before the work queued on ``s`` so
  far is done (the caching allocator's ``Tensor.record_stream``);
* ``free(t)`` / ``alloc(t)``: notifications that ``base.free_storage`` / ``base.alloc_storage``
  send when a unit frees or re-allocates a buffer, and the protocol sends when it releases a
  buffer it held for another stream.

Layers:

* :class:`NoStreams` (CPU tensors): one implicit stream, every call a no-op.  ``has_streams``
  is False, and the runtime then takes exactly the code path it took before streams existed
  (the C core, the shared-memory transports, ``async_op`` collectives).
* :class:`CudaStreams` (any accelerator with torch's stream API, ``torch.get_device_module``):
  a thin mapping onto torch's streams.  Never run here (no GPU).
* A test's recording layer (``tests/distributed/stream_check.py``), installed with :func:`use`: it
  logs every stream op and tensor op, and a happens-before checker reads the log.

``host_paths`` says whether the C core and the shared-memory transports may take the layer's
tensors: False for an accelerator (they are not host memory) and for a recording layer (its
tensors are CPU tensors, but the run must take the path an accelerator's would, so that every
op goes through torch's dispatcher where the recorder sees it).  :func:`use` switches
``_core`` to the twins while such a layer is installed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from .. import _core

ALL_GATHER_COPY_IN = "all_gather_copy_in"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
# torch FSDP1's (the wrapper's, [Note: FSDP1 streams] in flat/streams.py)
PRE_UNSHARD = "pre_unshard"
UNSHARD = "unshard"
POST_BACKWARD = "post_backward"


class _NoStream:
    """The one implicit stream of :class:`NoStreams`: every operation a no-op."""

    __slots__ = ()

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        pass

    def __repr__(self) -> str:
        return "<no stream>"


NO_STREAM = _NoStream()


class NoStreams:
    """The layer of CPU tensors: one implicit stream, nothing to order."""

    has_streams = False
    host_paths = True

    def current_stream(self) -> _NoStream:
        return NO_STREAM

    def stream(self, name: str, priority: Optional[int] = None) -> _NoStream:
        return NO_STREAM

    def on(self, s: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record_stream(self, t: torch.Tensor, s: Any) -> None:
        pass

    def free(self, t: torch.Tensor) -> None:
        pass

    def alloc(self, t: torch.Tensor) -> None:
        pass


NO_STREAMS = NoStreams()

# FSDP2 makes its all-gather and reduce-scatter streams high priority (they gate compute).
# FSDP1's streams take priority 0 by name; torch 2.13 gives them -1 only with
# limit_all_gathers and HSDP together (its _init_streams), which the wrapper asks for by
# passing the priority (flat/streams.py: FlatStreams.stream)
_HIGH_PRIORITY = {ALL_GATHER_COPY_IN: -1, ALL_GATHER: -1, REDUCE_SCATTER: -1}


def default_priority(name: str) -> int:
    """A stream's priority when its user names none: -1 (high) for FSDP2's all-gather and
    reduce-scatter streams, 0 for the rest."""
    return _HIGH_PRIORITY.get(name, 0)


class CudaStreams:
    """torch's streams of one accelerator device (``torch.get_device_module(device)``);
    the device module is looked up per call, nothing is touched before the first one."""

    has_streams = True
    host_paths = False

    def __init__(self, device: torch.device):
        self.device = device
        self._streams: dict[str, Any] = {}

    def _mod(self) -> Any:
        return torch.get_device_module(self.device.type)

    def current_stream(self) -> Any:
        return self._mod().current_stream(self.device)

    def stream(self, name: str, priority: Optional[int] = None) -> Any:
        """The side stream ``name`` of this priority (``None``: ``default_priority(name)``);
        the same name at another priority is another stream, as torch makes one per FSDP1
        root."""
        prio = default_priority(name) if priority is None else priority
        s = self._streams.get((name, prio))
        if s is None:
            s = self._streams[(name, prio)] = self._mod().Stream(device=self.device,
                                                                 priority=prio)
        return s

    def on(self, s: Any) -> contextlib.AbstractContextManager:
        return self._mod().stream(s)

    def record_stream(self, t: torch.Tensor, s: Any) -> None:
        t.record_stream(s)

    def free(self, t: torch.Tensor) -> None:
        pass  # the caching allocator takes the free when the last reference goes

    def alloc(self, t: torch.Tensor) -> None:
        pass


_accelerators: dict[torch.device, CudaStreams] = {}
_override: Optional[Any] = None  # a layer installed by ``use`` (tests), for every device


def layer_for(device: torch.device) -> Any:
    """The device layer of ``device`` (the runtime's one seam): the installed one under
    :func:`use`, else :data:`NO_STREAMS` for the CPU, else the accelerator's streams."""
    if _override is not None:
        return _override
    if device.type == "cpu":
        return NO_STREAMS
    if device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    layer = _accelerators.get(device)
    if layer is None:
        layer = _accelerators[device] = CudaStreams(device)
    return layer


def notified() -> Optional[Any]:
    """The installed layer that wants ``free``/``alloc`` notifications (None: no layer is
    installed; the real layers take none, so storage helpers skip the call)."""
    return _override


@contextlib.contextmanager
def use(layer: Any) -> Iterator[Any]:
    """Install ``layer`` for every device (a test's recording layer); the C core steps aside
    while its ``host_paths`` is False.  Not nested."""
    global _override
    if _override is not None:
        raise RuntimeError("cfsdp: a device layer is already installed")
    enter = getattr(layer, "__enter__", None)
    _override = layer
    _core.set_twins_only(not layer.host_paths)
    try:
        if enter is not None:
            with layer:
                yield layer
        else:
            yield layer
    finally:
        _override = None
        _core.set_twins_only(False)


__all__ = ["ALL_GATHER_COPY_IN", "ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE", "PRE_UNSHARD",
           "UNSHARD", "POST_BACKWARD", "NO_STREAM",
           "NoStreams", "NO_STREAMS", "CudaStreams", "layer_for", "notified", "use"]
