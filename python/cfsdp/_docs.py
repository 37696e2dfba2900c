"""torch's docstrings on cfsdp's torch-mirrored public API (bottom layer).

A drop-in should document itself as the original does: ``help(FSDP.summon_full_params)``
shows torch's text, read from the installed torch at import (nothing of it is copied
into this source), followed by a ``cfsdp:`` paragraph with what cfsdp adds or does
differently (the method's own docstring, if it has one).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Optional

_CFSDP_MARK = "\n\ncfsdp: "


def _function_of(obj: Any) -> Optional[Any]:
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    if isinstance(obj, property):
        return obj.fget
    return obj if callable(obj) else None


def _compose(ours: Any, theirs: Any) -> None:
    fn, tfn = _function_of(ours), _function_of(theirs)
    if fn is None or tfn is None:
        return
    tdoc = inspect.getdoc(tfn)
    if not tdoc:
        return
    own = inspect.cleandoc(fn.__doc__) if fn.__doc__ else ""
    if own.startswith(tdoc):  # already composed
        return
    fn.__doc__ = tdoc + (_CFSDP_MARK + own if own else "")


def adopt_class_docs(cls: type, torch_cls: type, names: Optional[Iterable[str]] = None) -> None:
    """Give ``cls``'s public members that ``torch_cls`` also defines torch's docstrings
    (class docstring included)."""
    if names is None:
        names = [n for n in vars(cls) if not n.startswith("_") and hasattr(torch_cls, n)]
    for name in names:
        _compose(vars(cls)[name], inspect.getattr_static(torch_cls, name))
    if torch_cls.__doc__:
        own = inspect.cleandoc(cls.__doc__) if cls.__doc__ else ""
        if not own.startswith(inspect.cleandoc(torch_cls.__doc__)):
            cls.__doc__ = inspect.cleandoc(torch_cls.__doc__) + (_CFSDP_MARK + own if own else "")


def adopt_function_doc(fn: Any, torch_fn: Any) -> None:
    """Give a module-level function torch's docstring (then its own, as above)."""
    _compose(fn, torch_fn)


__all__ = ["adopt_class_docs", "adopt_function_doc"]
