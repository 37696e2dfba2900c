"""Tensors that must not cross into C, shared by test_core_boundary.py and the fuzz
driver _fuzz_c.py."""

import torch
from torch.utils._pytree import tree_map


class Wrapper(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass, as DTensor is: no memory at its address
    (``data_ptr()`` is 0), every op runs on the wrapped tensor ``inner``."""

    @staticmethod
    def __new__(cls, inner):
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                device=inner.device)
        r.inner = inner
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.inner if isinstance(x, Wrapper) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: Wrapper(x) if isinstance(x, torch.Tensor) else x, out)
