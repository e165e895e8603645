"""optirs bench's own reference check passes for every optimizer definition (it would hide a bad figure)."""

from __future__ import annotations

import pytest

import optirs
from optirs.core.definitions import DEFINITIONS
from optirs.tools import bench


@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_bench_reference_check_passes_for_every_definition(backend, name):
    kind = bench.make_kind(optirs.get_backend(backend))
    result = bench.check_against_reference(backend, kind, name, DEFINITIONS[name].benchmark_params())
    assert result.startswith("ok"), result


def test_bench_arrays_keep_their_shape():
    kind = bench.make_kind(optirs.get_backend("cpu"))
    import numpy as np

    assert kind.make(np.zeros((3, 4), np.float32)).shape == (3, 4)
