"""``cfsdp.patch_torch()`` / ``unpatch_torch()`` and ``python -m cfsdp.run`` without a process
group (the distributed training through torch's names: tests/distributed/test_patch.py).

Every test leaves torch unpatched (the ``unpatched`` fixture), whatever it did.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import cfsdp
from cfsdp import _patch

pytestmark = pytest.mark.no_core

# what each module answers with cfsdp's object after the patch (torch 2.13: the names each
# module defines)
FSDP2 = ("FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method",
         "share_comm_ctx")
EXPECTED = {
    "torch.distributed.fsdp": ("FullyShardedDataParallel",) + FSDP2,
    "torch.distributed.fsdp.fully_sharded_data_parallel": ("FullyShardedDataParallel",),
    "torch.distributed.fsdp._fully_shard": FSDP2,
    "torch.distributed.fsdp._fully_shard._fully_shard": FSDP2,
    "torch.distributed._composable.fsdp": ("FSDPModule", "fully_shard",
                                           "register_fsdp_forward_method"),
    "torch.distributed._composable.fsdp.fully_shard": ("FSDPModule", "UnshardHandle",
                                                       "fully_shard",
                                                       "register_fsdp_forward_method"),
    "torch.distributed.optim": ("ZeroRedundancyOptimizer",),
    "torch.distributed.optim.zero_redundancy_optimizer": ("ZeroRedundancyOptimizer",),
    "torch.distributed.tensor.parallel.ddp": ("_pre_dp_module_transform",),
}
DEFINED_IN = {n: m for m, names in EXPECTED.items() for n in names}  # a module defining it
PKG_ROOT = Path(cfsdp.__file__).resolve().parent


def originals() -> dict[str, dict[str, object]]:
    """torch's objects, read from each module's dict (never written by the patch)."""
    return {m: {n: vars(importlib.import_module(m))[n] for n in names}
            for m, names in EXPECTED.items()}


@pytest.fixture(autouse=True)
def unpatched():
    assert not _patch.patched_torch_names(), "a test started with torch patched"
    yield
    cfsdp.unpatch_torch()


def test_patch_points_each_name_at_cfsdp_and_unpatch_gives_torch_back():
    orig = originals()
    classes = {m: type(importlib.import_module(m)) for m in EXPECTED}
    for name, obj in _patch.CFSDP_OBJECTS.items():  # cfsdp's own, not torch's
        assert obj.__module__.startswith("cfsdp."), name
        assert orig[DEFINED_IN[name]][name] is not obj

    got = cfsdp.patch_torch()
    assert {m: set(n) for m, n in got.items()} == {m: set(n) for m, n in EXPECTED.items()}
    assert cfsdp.patch_torch() == got  # idempotent
    for modname, names in EXPECTED.items():
        mod = importlib.import_module(modname)
        for n in names:
            ns: dict = {}
            exec(f"from {modname} import {n} as x", ns)  # noqa: S102 - the import statement itself
            assert ns["x"] is getattr(mod, n) is _patch.CFSDP_OBJECTS[n], (modname, n)
            # torch's own code reads the module dict: still torch's object
            assert vars(mod)[n] is orig[modname][n], (modname, n)
        star: dict = {}
        exec(f"from {modname} import *", star)  # noqa: S102
        for n in set(names) & set(star):
            assert star[n] is _patch.CFSDP_OBJECTS[n]
        # what is not patched is untouched: configs are torch's (and cfsdp's) own objects
        if modname == "torch.distributed.fsdp":
            assert mod.ShardingStrategy is cfsdp.ShardingStrategy
            assert mod.wrap.ModuleWrapPolicy is cfsdp.wrap.ModuleWrapPolicy

    cfsdp.unpatch_torch()
    cfsdp.unpatch_torch()  # idempotent
    assert _patch.patched_torch_names() == {}
    for modname, names in EXPECTED.items():
        mod = importlib.import_module(modname)
        assert type(mod) is classes[modname]
        for n in names:
            assert getattr(mod, n) is orig[modname][n], (modname, n)


def test_cfsdp_keeps_torch_classes_while_patched():
    """cfsdp's own checks for torch's FSDP1 (a cfsdp wrapper around torch's, torch's inside a
    cfsdp model under torch's DSD helpers) must see torch's class, not the patched name's."""
    import cfsdp.checkpoint
    import cfsdp.checkpoint.state_dict
    import cfsdp.fully_sharded_data_parallel

    torch_fsdp1 = originals()["torch.distributed.fsdp"]["FullyShardedDataParallel"]
    cfsdp.patch_torch()
    for mod in (cfsdp.fully_sharded_data_parallel, cfsdp.checkpoint, cfsdp.checkpoint.state_dict):
        assert mod._TorchFSDP is torch_fsdp1, mod.__name__
    # and nothing in cfsdp looks a patched name up in torch at call time
    late = []
    for path in PKG_ROOT.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.ImportFrom) and node.module in _patch.TORCH_MODULES
                        and any(a.name in _patch.CFSDP_OBJECTS for a in node.names)):
                    late.append(f"{path.relative_to(PKG_ROOT)}:{node.lineno}")
    assert not late, f"call-time imports of torch's patched names: {late}"


def _torch_modules_binding_patched_names() -> dict[str, set[tuple[str, str]]]:
    """Every torch module (torch.testing aside) that binds a patched name at import, read from
    torch's source: ``from <patched module> import <name>`` at module level (also inside a
    top-level ``try`` or ``if``), relative imports resolved: {module: {(bound as, name)}}."""
    root = Path(torch.__file__).resolve().parent
    out: dict[str, set[tuple[str, str]]] = {}
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if not any(k in text for k in ("fsdp", "fully_shard", "ZeroRedundancyOptimizer",
                                       "_pre_dp_module_transform")):
            continue
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[:-1]  # of a module: its package; of a package's __init__: itself
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if name.startswith("torch.testing"):
            continue
        tree = ast.parse(text, str(path))
        for top in tree.body:
            for node in (ast.walk(top) if isinstance(top, (ast.Try, ast.If)) else [top]):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                got = {(a.asname or a.name, a.name) for a in node.names
                       if a.name in _patch.CFSDP_OBJECTS}
                if src in _patch.TORCH_MODULES and got:
                    out.setdefault(name, set()).update(got)
    return out


def test_torch_modules_that_bind_the_names_keep_torch_objects():
    """patch_torch() imports every torch module that binds a patched name at import before it
    patches (else one first imported while patched would keep cfsdp's objects in its globals
    after unpatch_torch(), and torch's code would call FSDP internals on them)."""
    binders = _torch_modules_binding_patched_names()
    assert "torch.distributed.pipelining.stage" in binders  # the scan sees what it must
    missing = sorted(set(binders) - set(_patch.TORCH_MODULES) - set(_patch.TORCH_IMPORTERS))
    assert not missing, f"add to cfsdp._patch.TORCH_IMPORTERS: {missing}"
    assert "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook" in binders
    orig = originals()
    cfsdp.patch_torch()
    for modname, names in binders.items():
        mod = sys.modules[modname]  # imported by patch_torch() at the latest
        for bound, n in names:
            assert vars(mod)[bound] is orig[DEFINED_IN[n]][n], (modname, bound)


def test_assigning_a_patched_name_changes_torch_module_not_the_patch():
    import torch.distributed.fsdp as tfsdp

    torch_cls = vars(tfsdp)["FullyShardedDataParallel"]
    cfsdp.patch_torch()
    with mock.patch("torch.distributed.fsdp.FullyShardedDataParallel", "stand-in"):
        assert vars(tfsdp)["FullyShardedDataParallel"] == "stand-in"
        assert tfsdp.FullyShardedDataParallel is cfsdp.FullyShardedDataParallel
    assert vars(tfsdp)["FullyShardedDataParallel"] is torch_cls
    cfsdp.unpatch_torch()
    assert tfsdp.FullyShardedDataParallel is torch_cls


def test_unpatch_leaves_a_module_whose_class_someone_else_replaced():
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp.fully_sharded_data_parallel as sub

    torch_cls = vars(sub)["FullyShardedDataParallel"]
    cfsdp.patch_torch()
    patched_class = type(tfsdp)
    other = type("OtherPatch", (patched_class,), {})
    tfsdp.__class__ = other
    try:
        with pytest.raises(RuntimeError, match=r"torch\.distributed\.fsdp \(class OtherPatch\)"):
            cfsdp.unpatch_torch()
        assert sub.FullyShardedDataParallel is torch_cls  # the others are restored
        assert list(_patch.patched_torch_names()) == ["torch.distributed.fsdp"]
    finally:
        tfsdp.__class__ = patched_class
    cfsdp.unpatch_torch()
    assert tfsdp.FullyShardedDataParallel is torch_cls


# ------------------------------------------------------------------------- python -m cfsdp.run
REPORT = """\
import json, os, sys
import torch.distributed.fsdp as f
from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as sub
import cfsdp
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "patched": f.FullyShardedDataParallel is cfsdp.FullyShardedDataParallel
                             and sub is cfsdp.FullyShardedDataParallel
                             and f.fully_shard is cfsdp.fully_shard}))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cfsdp.run", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_run_a_script(tmp_path):
    """As ``python script.py args``: __main__, argv, the script's directory on sys.path, the
    script's exit status; torch patched before its first line."""
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text(REPORT)
    res = _run(["sub/train.py", "a", "--lr", "1"], tmp_path, EXIT="3")
    assert res.returncode == 3, res.stderr
    out = json.loads(res.stdout)
    assert out == {"name": "__main__", "argv": ["sub/train.py", "a", "--lr", "1"],
                   "path0": str(script.parent), "patched": True}, res.stderr


def test_run_a_module_and_a_legacy_local_rank(tmp_path):
    """``-m module`` as ``python -m module``; a ``--local-rank=N`` put before the script (by
    torch.distributed.launch without --use-env) goes after it."""
    (tmp_path / "trainpkg").mkdir()
    (tmp_path / "trainpkg" / "__init__.py").write_text("")
    (tmp_path / "trainpkg" / "main.py").write_text(REPORT)
    res = _run(["--local-rank=1", "-m", "trainpkg.main", "x"], tmp_path,
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["name"] == "__main__" and out["patched"], out
    assert out["argv"] == [str(tmp_path / "trainpkg" / "main.py"), "--local-rank=1", "x"], out


def test_run_without_a_script_is_a_usage_error(tmp_path):
    res = _run([], tmp_path)
    assert res.returncode == 2
    assert "usage: python -m cfsdp.run" in res.stderr
    res = _run(["-m"], tmp_path)
    assert res.returncode == 2

