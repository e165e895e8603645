"""The one builder of OpenCL program text from the sources in ``optirs/backends/common/kernels``.

A program is a kernel file (or kernel text) whose ``#include "name.h"`` lines are replaced by the
headers themselves, recursively. Headers are inlined on the host rather than found with ``-I``: no
path quoting issues, and drivers that cache binaries by source text (NVIDIA's does) see every
header change.
"""

from __future__ import annotations

import importlib.resources
import re

import numpy as np

from optirs.core.errors import GpuOptimError

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_MAX_DEPTH = 8


def _root():
    return importlib.resources.files("optirs.backends.common") / "kernels"


def read_source(name: str) -> str:
    """The text of one file in the kernels folder."""
    return (_root() / name).read_text(encoding="utf-8")


def expand_includes(text: str, depth: int = 0) -> str:
    """``text`` with every ``#include "file"`` replaced by that file's (expanded) text."""
    if depth > _MAX_DEPTH:
        raise GpuOptimError("#include nesting deeper than 8 in the optirs OpenCL sources")
    return _INCLUDE.sub(lambda m: expand_includes(read_source(m.group(1)), depth + 1), text)


def program_source(kernel_file: str) -> str:
    """The program text of a kernel file, headers inlined."""
    return expand_includes(read_source(kernel_file))


def scalar_record(scalars) -> np.ndarray:
    """A per-step scalars NamedTuple as the numpy struct matching its OpenCL struct
    (``optirs_scalars.h``: float32 -> float, bool -> int), to pass by value."""
    dtype = np.dtype([(name, "<i4" if isinstance(value, (bool, np.bool_)) else "<f4")
                      for name, value in zip(scalars._fields, scalars)])
    return np.array(tuple(scalars), dtype)
