"""Twins of the C core's bulk-binding entry points (``csrc/bind_bulk.c``).

The runtime keeps, per unit, tuples of the dicts, names and objects its hooks
touch (module attributes, registered parameters, gradients) and makes one call
per pass instead of a Python loop per parameter.  These are the same passes in
Python, with the same argument checks and messages.
"""

from __future__ import annotations



def _tuple(fname: str, what: str, obj) -> int:
    if not isinstance(obj, tuple):
        raise TypeError(f"{fname}(): {what} must be a tuple, not {type(obj).__name__}")
    return len(obj)


def _pair(fname: str, wa: str, a, wb: str, b) -> int:
    n, nb = _tuple(fname, wa, a), _tuple(fname, wb, b)
    if n != nb:
        raise ValueError(f"{fname}(): {wa} has {n} items but {wb} has {nb}")
    return n


def _dicts(fname: str, dicts: tuple) -> None:
    for i, d in enumerate(dicts):
        if not isinstance(d, dict):
            raise TypeError(f"{fname}(): dicts[{i}] is a {type(d).__name__}, not a dict")


def _name(fname: str, name) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{fname}(): name must be a str")


def dict_set(dicts: tuple, keys: tuple, values: tuple) -> None:
    """``dicts[i][keys[i]] = values[i]`` for every i."""
    n = _pair("dict_set", "dicts", dicts, "keys", keys)
    if _tuple("dict_set", "values", values) != n:
        raise ValueError(f"dict_set(): dicts has {n} items but values has {len(values)}")
    _dicts("dict_set", dicts)
    for d, k, v in zip(dicts, keys, values):
        d[k] = v


def dict_pop(dicts: tuple, keys: tuple) -> None:
    """``dicts[i].pop(keys[i], None)`` for every i."""
    _pair("dict_pop", "dicts", dicts, "keys", keys)
    _dicts("dict_pop", dicts)
    for d, k in zip(dicts, keys):
        d.pop(k, None)


def attr_flags(objs: tuple, name: str) -> bytes:
    """One byte, 0 or 1, per object: ``bool(getattr(o, name))``."""
    _tuple("attr_flags", "objs", objs)
    _name("attr_flags", name)
    return bytes(bool(getattr(o, name)) for o in objs)


def attr_set(objs: tuple, name: str, values) -> None:
    """``setattr(objs[i], name, values[i])``; ``values=None`` sets every one to None."""
    _tuple("attr_set", "objs", objs)
    _name("attr_set", name)
    if values is None:
        values = (None,) * len(objs)
    else:
        _pair("attr_set", "objs", objs, "values", values)
    for o, v in zip(objs, values):
        setattr(o, name, v)


def attr_get(objs: tuple, name: str) -> tuple:
    """``tuple(getattr(o, name) for o in objs)``."""
    _tuple("attr_get", "objs", objs)
    _name("attr_get", name)
    return tuple(getattr(o, name) for o in objs)


def shape_views(chunks: tuple, index: tuple, shapes: tuple, trainable, occ_index: tuple) -> tuple:
    """A unit's forward views: view i is ``chunks[index[i]].view(shapes[i])`` (the
    piece itself where ``shapes[i]`` is None), detached where ``trainable`` (bytes,
    or None: all trainable) holds 0; returns view ``occ_index[k]`` for every k."""
    _tuple("shape_views", "chunks", chunks)
    n = _pair("shape_views", "index", index, "shapes", shapes)
    _tuple("shape_views", "occ_index", occ_index)
    if trainable is not None and (not isinstance(trainable, bytes) or len(trainable) != n):
        raise ValueError(f"shape_views(): trainable must be None or {n} bytes")
    views = []
    for i, (j, shape) in enumerate(zip(index, shapes)):
        if not 0 <= j < len(chunks):
            raise ValueError(f"shape_views(): index[{i}] = {j} is not a chunk ({len(chunks)})")
        v = chunks[j] if shape is None else chunks[j].view(shape)
        views.append(v if trainable is None or trainable[i] else v.detach())
    for k, i in enumerate(occ_index):
        if not 0 <= i < n:
            raise ValueError(f"shape_views(): occ_index[{k}] = {i} is not a view ({n})")
    return tuple(views[i] for i in occ_index)
