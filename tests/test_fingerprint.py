"""The ``fingerprint`` capability (optirs_fingerprint) against numpy, on every backend that has it."""

import re

import ml_dtypes
import numpy as np
import pytest

import optirs
from conftest import SIMULATOR, from_backend_array, to_backend_array
from optirs.core.errors import InvalidParameterError
from optirs.plugin.hookspecs import FINGERPRINT_INDEX_MASK


def reference(words: np.ndarray) -> tuple:
    """numpy's (sum, key) of 16- or 32-bit words, as the hook's docstring defines them."""
    bits = 8 * words.itemsize
    u = words.reshape(-1).view(np.uint32 if bits == 32 else np.uint16).astype(np.int64)
    if u.size == 0:
        return 0, 0
    sign = 1 << (bits - 1)
    signed = np.where(u >= sign, u - (1 << bits), u)
    total = int(signed.sum(dtype=np.int64))  # wraps as int64
    ordered = np.where(u < sign, u ^ sign, ((1 << bits) - 1) - u) << (32 - bits)
    idx = np.arange(u.size, dtype=np.int64)
    keys = (ordered << 31) | (FINGERPRINT_INDEX_MASK - (idx & FINGERPRINT_INDEX_MASK))
    return total, int(keys.max())


def _values(rng, n, dtype):
    x = rng.standard_normal(n).astype(np.float32) * 3
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -1e-40], np.float32)
    x[: min(n, len(specials))] = specials[: min(n, len(specials))]
    if dtype == "float32":
        return x.view(np.int32)
    return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16).view(np.int16)


def _hook(name):
    b = optirs.get_backend(name)
    if not b.supports("fingerprint"):
        pytest.skip(f"backend {name} has no fingerprint capability")
    return b, b.hook("fingerprint", "optirs_fingerprint")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fingerprints_are_numpys_sum_and_largest_key(backend, dtype, rng):
    b, hook = _hook(backend)
    sizes = [0, 1, 37, 3000] if backend == "cuda" and SIMULATOR else [0, 1, 37, 3000, 200_001]
    arrays = [_values(rng, n, dtype) for n in sizes]
    devices = [to_backend_array(backend, a) for a in arrays]
    # the words one element in: no 16-byte loads on cuda (an address 2 or 4 bytes past an aligned one)
    arrays.append(arrays[2][1:])
    devices.append(to_backend_array(backend, arrays[2])[1:])
    sizes = sizes + [arrays[-1].size]
    out_host = np.full((len(sizes) + 2, 2), 7, np.int64)  # rows are overwritten; rows 2 and -1 are left alone
    for rows in (list(range(len(sizes)))[::-1], [r if r < 2 else r + 1 for r in range(len(sizes))]):
        out = to_backend_array(backend, out_host)
        hook(b.ctx, devices, out, rows)
        got = from_backend_array(out)
        for a, r in zip(arrays, rows):
            assert tuple(got[r]) == reference(a), (a.size, r)
        assert tuple(got[-1]) == (7, 7) and (2 in rows or tuple(got[2]) == (7, 7))
    # one array a request (the hooks' form; several are one launch over a table on cuda)
    out = to_backend_array(backend, out_host)
    for k, d in enumerate(devices):
        hook(b.ctx, [d], out, [k])
    got = from_backend_array(out)
    for k, a in enumerate(arrays):
        assert tuple(got[k]) == reference(a), (a.size, k)


def test_a_fingerprint_moves_with_every_edit_the_offload_must_see(rng):
    b, hook = _hook("cpu")
    g = np.array([1.0, -1.0, 2.0, -2.0], np.float32)
    one_ulp = g.copy()
    one_ulp.view(np.int32)[3] += 1
    cases = [g, g.copy(), -g, one_ulp, g * np.float32(0.5), g[::-1].copy()]
    out = np.zeros((len(cases), 2), np.int64)
    hook(b.ctx, [c.view(np.int32) for c in cases], out, list(range(len(cases))))
    assert tuple(out[0]) == tuple(out[1])
    assert out[2, 0] == out[0, 0]  # a sign flip of as many positive as negative values keeps the sum ...
    for i in range(2, len(cases)):
        assert tuple(out[i]) != tuple(out[0]), i  # ... but not the key; every other edit moves one


def test_bad_fingerprint_requests_are_refused_before_anything_is_written():
    b, hook = _hook("cpu")
    out = np.full((2, 2), 5, np.int64)
    words = np.zeros(4, np.int32)
    for arrays, o, rows, said in [
        ([np.zeros(4, np.int8)], out, [0], "1-byte elements, expected 2 or 4"),
        ([np.zeros((4, 4), np.int32)[:, 0]], out, [0], "not C-contiguous"),
        ([words], out, [2], "rows[0] is 2, expected a row of out (0 to 1)"),
        ([words, words], out, [0], "rows has 1 entries for 2 arrays"),
        ([words, words], out, [1, 1], "rows [1, 1] name a row twice, expected one row per array"),
        ([words], np.zeros((2, 3), np.int64), [0], "expected C-contiguous int64 of shape (n, 2)"),
        ([words], np.zeros((2, 2), np.int32), [0], "expected C-contiguous int64 of shape (n, 2)"),
        ([[0, 1]], out, [0], "arrays[0] is a builtins.list, expected a numpy array on the cpu backend"),
    ]:
        with pytest.raises(InvalidParameterError, match=re.escape(said)):
            hook(b.ctx, arrays, o, rows)
    assert (out == 5).all()


@pytest.mark.skipif(SIMULATOR, reason="compiles real PTX; the simulator has no compiler")
def test_the_cuda_fingerprint_kernel_compiles_to_sm90_ptx(monkeypatch):
    import types as pytypes

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    from optirs.backends.cuda import fingerprint as fp

    monkeypatch.setattr(dispatcher, "get_current_device", lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    fp._bind(pytypes.SimpleNamespace(cuda=cuda, simulator=False))
    ptx, _ = cuda.compile_ptx(fp.fingerprint_kernel, fp._argument_types(), cc=(9, 0))
    assert ".target sm_90" in ptx and "ld.global.v4.u32" in ptx  # 16 bytes a load
    # one 64-bit add and one signed 64-bit max per block at the row's address; no spills, no float64
    assert "atom.global.add.u64" in ptx and "atom.global.max.s64" in ptx
    assert ".local" not in ptx and ".f64" not in ptx


def _bench():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_fingerprint.py"
    spec = importlib.util.spec_from_file_location("bench_fingerprint", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_fingerprint"] = module
    spec.loader.exec_module(module)
    return module


def test_the_fingerprint_benchmark_runs_every_round_and_refuses_bad_input(tmp_path, capsys):
    pytest.importorskip("torch")
    import json

    bench = _bench()
    assert len(bench.gpt_shapes(50257, 1024, 2048, 24)) == 292  # GPT-2 1.3B's parameters (the head tied)
    out = tmp_path / "fp.json"
    assert bench.main(["--device", "cpu", "--quick", "--dtypes", "bfloat16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"bfloat16 torch", "bfloat16 capability (cpu)", "bfloat16 one a call (cpu)"}
    assert all(r["total_ms"] > 0 and r["limit_ms"] > 0 for r in rows.values())
    for bad in (["--device", "tpu"], ["--dtypes", "int8"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench.main(bad)
    import torch

    if not torch.cuda.is_available():
        assert bench.main(["--device", "cuda"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().out
