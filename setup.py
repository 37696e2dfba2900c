"""Build of cfsdp's C core, ``cfsdp._C`` (metadata lives in pyproject.toml).

The extension is built against CPython headers only: no torch at build time.
Environment switches:
  CFSDP_WERROR=1    add -Werror (CI and ``make build``);
  CFSDP_SANITIZE=1  build with ASan + UBSan (``make sanitize``); the process
                    must then preload libasan/libubsan to import it.
"""

import os
from glob import glob

from setuptools import Extension, find_packages, setup


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


# -std=c11 (not gnu11): no FP contraction, so the numerics match torch's.
cflags = ["-std=c11", "-Wall", "-Wextra", "-O3"]
ldflags = []
macros = []
if os.name == "posix":  # csrc/thread.c: large chunk copies use a few POSIX threads
    cflags.append("-pthread")
    ldflags.append("-pthread")
    macros.append(("CF_HAVE_PTHREADS", "1"))
if _flag("CFSDP_WERROR"):
    cflags.append("-Werror")
if _flag("CFSDP_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    cflags += san + ["-fno-omit-frame-pointer", "-O1", "-g"]
    ldflags += san

ext = Extension(
    "cfsdp._C",
    sources=sorted(glob("csrc/*.c")),
    depends=sorted(glob("csrc/*.h")),
    include_dirs=["csrc"],
    define_macros=macros,
    extra_compile_args=cflags,
    extra_link_args=ldflags,
    libraries=["m"] if os.name == "posix" else [],  # norm.c uses pow()
)

setup(
    package_dir={"": "python"},
    packages=find_packages(where="python"),
    ext_modules=[ext],
)
