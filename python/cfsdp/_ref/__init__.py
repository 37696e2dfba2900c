"""Pure-Python twins of every entry point of the C core ``cfsdp._C``.

Each function here has the same contract as its C counterpart (see ``csrc/``);
``cfsdp._core`` picks one or the other (``CFSDP_IMPL=c|python``), and the unit
tests run both and compare.  The twins are also the device-generic path: they
use only torch ops, so they serve CUDA tensors as well as CPU ones.
"""

from .layout import plan_layout_lists
from .copy import shard_fill
from .chunk import chunk_pack, chunk_unpack
from .reduce import scale_cast_add
from .norm import norm_partial
from .shm import ShmSegment, shm_all_to_all, shm_memcpy, shm_reduce
from .optim import adam_step, sgd_step
from .bind import attr_flags, attr_get, attr_set, dict_pop, dict_set, shape_views

__all__ = [
    "plan_layout_lists",
    "shard_fill",
    "chunk_unpack",
    "chunk_pack",
    "scale_cast_add",
    "norm_partial",
    "shm_reduce",
    "shm_memcpy",
    "shm_all_to_all",
    "ShmSegment",
    "adam_step",
    "sgd_step",
    "dict_set",
    "dict_pop",
    "attr_flags",
    "attr_set",
    "attr_get",
    "shape_views",
]
