"""cfsdp.backend follows CFSDP_IMPL; a broken C core is a loud ImportError.

Each case runs in a fresh interpreter (the backend is chosen at import
time), from a temporary directory so the installed package is what loads.
"""

import os
import subprocess
import sys
import textwrap

import pytest

# The children pick their own CFSDP_IMPL and only import cfsdp; this process never touches the
# core: run once, not again under the sanitizer or on the twins (see tests/unit/conftest.py).
pytestmark = pytest.mark.no_core

# A meta-path finder that makes cfsdp._C unimportable, as a missing or broken
# build would.
BLOCK_C = textwrap.dedent(
    """
    import sys
    class _BlockC:
        def find_spec(self, name, path=None, target=None):
            if name == "cfsdp._C":
                raise ImportError("simulated: cfsdp._C is broken")
            return None
    sys.meta_path.insert(0, _BlockC())
    """
)

REPORT = "import cfsdp, cfsdp._core as c; print(cfsdp.backend, c._C is None)"


def run(code, impl, tmp_path):
    env = dict(os.environ)
    if impl is None:
        env.pop("CFSDP_IMPL", None)
    else:
        env["CFSDP_IMPL"] = impl
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
        text=True, timeout=120,
    )


@pytest.mark.parametrize(
    "impl, want",
    [(None, "c False"), ("c", "c False"), ("python", "python True"), (" Python ", "python True")],
)
def test_backend_follows_env(impl, want, tmp_path):
    p = run(REPORT, impl, tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == want


def test_bogus_backend_is_an_import_error(tmp_path):
    code = textwrap.dedent(
        """
        try:
            import cfsdp
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    p = run(code, "fortran", tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("ImportError:"), out
    assert "'fortran'" in out and "CFSDP_IMPL=c" in out and "CFSDP_IMPL=python" in out


def test_missing_extension_is_a_loud_import_error(tmp_path):
    code = BLOCK_C + textwrap.dedent(
        """
        try:
            import cfsdp
        except ImportError as e:
            print("ImportError:", e)
            print("cause:", repr(e.__cause__))
        else:
            print("imported, backend", cfsdp.backend)
        """
    )
    p = run(code, "c", tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("ImportError:"), out
    assert "cfsdp._C" in out  # what failed
    assert "simulated: cfsdp._C is broken" in out  # why
    assert "CFSDP_IMPL=python" in out  # what to do instead
    assert "cause: ImportError" in out  # the original error is chained


def test_python_backend_needs_no_extension(tmp_path):
    p = run(BLOCK_C + REPORT, "python", tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "python True"


def test_extension_imports_outside_the_source_tree(tmp_path):
    code = "import cfsdp._C as C, inspect; print(inspect.signature(C.plan_layout))"
    p = run(code, "c", tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "(numels, align_numel, world_size, /)"
