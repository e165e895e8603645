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


def test_bench_cpu_formats_selects_labels_that_hold_commas(capsys):
    """``bench_cpu_formats.py --formats`` takes ';' between labels (which hold commas), ',' where no ';'
    is given, and refuses a selection that matches nothing (naming the labels)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu_formats.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_formats", path)
    bcf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bcf)
    picked = [f[0] for f in bcf.select("remainder8, int8 sqrt;fp32 params, int8 sqrt")]
    assert picked == ["fp32 params, int8 sqrt state", "bf16 params, remainder8, int8 sqrt state"]
    assert {f[0] for f in bcf.select("int8,bf16 state")} == {f[0] for f in bcf.FORMATS
                                                             if "int8" in f[0] or "bf16 state" in f[0]}
    assert bcf.select("") == list(bcf.FORMATS)
    assert [f[0] for f in bcf.select("fp32 params, int8 sqrt")] == ["fp32 params, int8 sqrt state"]
    with pytest.raises(SystemExit) as e:
        bcf.main(["--formats", "no such format"])
    assert e.value.code != 0 and "fp32 params, fp32 state" in capsys.readouterr().err


def test_diag_cpu_format_parts_refuses_unknown_parts_and_formats(capsys):
    """The parts diagnostic fails loudly, before starting any process, on a part or a format it does not know."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "diag_cpu_format_parts.py"
    spec = importlib.util.spec_from_file_location("diag_cpu_format_parts", path)
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    for argv, said in ((["--parts", "decode,nonsense"], "nonsense"), (["--formats", "no such;label"], "no such"),
                       (["--threads", "one"], "one")):
        with pytest.raises(SystemExit) as e:
            diag.main(argv)
        assert e.value.code != 0 and said in capsys.readouterr().err
    sys.modules.pop("bench_cpu_formats", None)
