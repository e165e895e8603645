"""The cpu backend's int8 block loops (optirs.backends.cpu.formats_kernels) against numpy.

The block's new values are coded in separate loops (absmax as an integer maximum, then the codes:
byte planes in registers where the cpu has AVX-512 VBMI, gathers of packed words where it has
AVX-512F, else the scaling and bucket
arithmetic and the two table lookups): the scale and every code must be exactly what the contract
gives (docs/formats.md), NaN, inf, zeros and short blocks included. The reference here is plain
numpy: the scale is ``max |x|`` over the block (NaN when any value is NaN: numpy's max propagates
it), the codes :func:`quantize_table` on ``(x * pre) * inv``.
"""

from __future__ import annotations

import numpy as np
import pytest

from optirs.backends.common.int8_buckets import bucket_table, padded_midpoints, quantize_table
from optirs.core.formats import dynamic_map


def _reference_scale(values):
    """The contract's block scale: the largest |x|, NaN when the block holds one."""
    return np.float32(np.max(np.abs(np.asarray(values, np.float32)))) if len(values) else np.float32(0)


def _block(rng, n, specials):
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2)).astype(np.float32)
    if specials and n > 2:
        where = rng.choice(n, size=min(n, 6), replace=False)
        x[where] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40], np.float32)[: where.size]
    return x


@pytest.fixture(scope="module", params=["compiled", "tables"])
def kernels(request):
    """The block loops as the cpu compiles them (the map's lookups in AVX-512 registers where the
    cpu has it: optirs.backends.cpu.int8_native) and the portable table reads, on every cpu."""
    from numba import njit

    import optirs.backends.cpu.formats_kernels as K
    import optirs.backends.cpu.int8_native as N
    from optirs.backends.common.formats import quantize_factors

    tables = request.param == "tables"

    @njit
    def store(w, scales, mid, tbl, blk, o, n, buf, ix):
        tree = N.encoder_key(mid, tbl, True)
        if tables:
            m = K._block_absmax(buf, n)
            scales[blk] = m
            pre, inv = quantize_factors(m)
            N.encode_block_tables(buf, n, pre, inv, mid, tbl, w, o, ix)
        else:
            K._encode_scaled(w, scales, mid, tbl, tree, blk, o, n, buf, ix, K._block_absmax(buf, n))

    @njit
    def decode_compiled(w, q, s, o, n, buf):
        if tables:
            N.decode_block_tables(w, q, s, o, n, buf)
        else:
            K._decode_block(w, q, s, o, n, buf)

    def decode(w, q, s, o, n, buf):  # the decoders read the map's decoder_table (q, then its byte planes)
        decode_compiled(w, N.decoder_table(q), s, o, n, buf)

    return store, decode


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("specials", [False, True])
def test_store_codes_is_the_sequential_definition(kernels, signed, specials):
    store, decode = kernels
    rng = np.random.default_rng(11 + signed + 2 * specials)
    mid, tbl, q = padded_midpoints(signed), bucket_table(signed), dynamic_map(signed)
    for n in (256, 255, 200, 33, 16, 9, 8, 7, 1):
        for _ in range(6):
            x = _block(rng, n, specials)
            if _ == 5:  # a subnormal scale (pre = 2**64)
                x = (x * np.float32(1e-30) * np.float32(1e-14)).astype(np.float32)
            if not signed:
                x = np.abs(x)
            o, blk = 5, 2  # a block at an offset inside the arrays
            w = np.full(o + n + 3, 77, np.uint8)
            scales = np.full(4, -1.0, np.float32)
            store(w, scales, mid, tbl, blk, o, n, x.copy(), np.zeros(256, np.uint32))
            scale = _reference_scale(x)
            assert (np.isnan(scale) and np.isnan(scales[blk])) or scales[blk].tobytes() == scale.tobytes(), \
                (n, scales[blk], scale)
            pre = np.float32(2.0**64) if 0 < scale < 2.0**-126 else np.float32(1)
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                inv = np.float32(1) / (scale * pre) if scale != 0 else np.float32(0)
                y = (x * pre) * inv
            assert np.array_equal(w[o : o + n], quantize_table(y, mid, tbl)), n
            assert np.all(w[:o] == 77) and np.all(w[o + n :] == 77)  # nothing outside the block
            got = np.zeros(n, np.float32)
            decode(w, q, scales[blk], o, n, got)
            with np.errstate(invalid="ignore", over="ignore"):
                want = q[w[o : o + n]] * scales[blk]  # a NaN or inf scale decodes to NaN / inf
            assert np.array_equal(got, want, equal_nan=True)


def test_a_block_with_nans_keeps_the_nan_of_its_first_lane(kernels):
    """Which NaN a block's scale holds: that of the first of the 8 lanes (element i in lane i % 8)
    holding one, its first NaN, sign cleared; the bits these loops have always stored."""
    store, _ = kernels
    mid, tbl = padded_midpoints(True), bucket_table(True)
    rng = np.random.default_rng(5)
    for n, where in ((256, (3, 11, 200)), (256, (8, 1)), (13, (12, 4)), (256, (255,))):
        x = rng.standard_normal(n).astype(np.float32)
        payloads = np.uint32([0xFFC00001, 0x7FC00002, 0x7FA00003])[: len(where)]
        x[list(where)] = payloads.view(np.float32)
        lanes = [i for i in range(n) if np.isnan(x[i])]
        first = min(lanes, key=lambda i: (i % 8, i))
        scales = np.zeros(1, np.float32)
        store(np.zeros(n, np.uint8), scales, mid, tbl, 0, 0, n, x.copy(), np.zeros(256, np.uint32))
        assert scales.view(np.uint32)[0] == x.view(np.uint32)[first] & 0x7FFFFFFF, (n, where)


@pytest.mark.parametrize("signed", [True, False])
def test_every_avx512_form_counts_at_the_midpoints(signed):
    """The AVX-512 encoders (gathers of packed words, the search, byte planes where the cpu has VBMI)
    and decoders (registers, gathers, byte planes where the cpu has VBMI)
    on the values where a count changes: each midpoint, its float32 neighbours and their negations,
    the first and last buckets' edges, zeros, inf, NaN and random bit patterns (all 2**32 are
    checked by benchmarks/check_int8_native.py)."""
    import optirs.backends.cpu.int8_native as N

    if not N.NATIVE:
        pytest.skip("numba does not compile for a cpu with AVX-512F here: only the table reads run")
    mid, tbl, q = padded_midpoints(signed), bucket_table(signed), np.asarray(dynamic_map(signed), np.float32)
    m = np.asarray(mid[:255], np.float32)
    edges = np.uint32([0x33FF0000, 0x34000000, 0x3F80FFFF, 0x3F810000, 0x7F800000, 0x7FC00000, 0x7F800001, 0,
                       0x00000001]).view(np.float32)
    y = np.concatenate([m, np.nextafter(m, np.float32(np.inf)), np.nextafter(m, np.float32(-np.inf)), edges])
    y = np.concatenate([y, -y, np.random.default_rng(2).integers(0, 2**32, 4096, dtype=np.uint64)
                        .astype(np.uint32).view(np.float32)]).astype(np.float32)
    n = y.size
    want = quantize_table(y, mid, tbl)
    keys = N.encoder_keys(mid, tbl)
    tree, words, planes = keys["search"], keys["gathers"], keys["planes"]
    one, ix = np.float32(1), np.zeros(256, np.uint32)
    forms = [("search", N.encode_block_registers, tree), ("gathers", N.encode_block_gathers, words)]
    for form, encode, key in forms + ([("planes", N.encode_block_planes, planes)] if N.VBMI else []):
        got = np.zeros(n, np.uint8)
        encode(y.copy(), n, one, one, key, mid, tbl, got, 0, ix)
        assert np.array_equal(got, want), (form, y[got != want][:4], got[got != want][:4], want[got != want][:4])
    codes = np.arange(256 * 3 + 5, dtype=np.uint32).astype(np.uint8)
    table = N.decoder_table(q)
    for decode in (N.decode_block_registers, N.decode_block_gathers) + ((N.decode_block_planes,) if N.VBMI else ()):
        got = np.zeros(codes.size, np.float32)
        decode(codes, table, np.float32(3.7e-3), 0, codes.size, got)
        assert np.array_equal(got, q[codes] * np.float32(3.7e-3)), decode.__name__


_SHARED_HEAP = r"""
import sys, threading
import numpy as np
from optirs import AdamParams, GpuAdam, GpuOptimizerConfig, Precision

def run(state, hammer):
    opt = GpuAdam(AdamParams(lr=1e-3), config=GpuOptimizerConfig(backend="cpu"), precision=Precision(state_dtype=state))
    rng = np.random.default_rng(0)
    p = rng.standard_normal(1 << 17).astype(np.float32)
    g = rng.standard_normal(1 << 17).astype(np.float32)
    opt.move_to_gpu()
    stop, bad = threading.Event(), [0]

    def allocate():  # blocks of the loops' scratch size, each checked after the others are made
        while not stop.is_set():
            blocks = [np.full(256 + i % 8, i, np.float32) for i in range(64)]
            bad[0] += sum(int(not (b == i).all()) for i, b in enumerate(blocks))

    other = threading.Thread(target=allocate)
    if hammer:
        other.start()
    for _ in range(12):
        opt.step_gpu(p, g)
    stop.set()
    if hammer:
        other.join()
    return p.view(np.uint32).copy(), bad[0]

for state in ("int8", "bfloat16"):
    quiet, _ = run(state, False)
    busy, bad = run(state, True)
    print(state, int((quiet != busy).sum()), bad)
"""


def test_step_scratch_lives_while_another_thread_allocates():
    """The loops' scratch blocks (viewed without references) live until the loops are done: with
    every thread on one malloc arena and another thread allocating blocks of the same size, a block
    freed early was handed to that thread while the step still wrote it (glibc aborted, or the step
    or the other thread read the other's values)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_ARENA_MAX="1", NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", _SHARED_HEAP], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [line[0] for line in lines] == ["int8", "bfloat16"], out.stdout
    for state, differ, bad in lines:
        assert (differ, bad) == ("0", "0"), f"{state} state: {differ} parameters differ, {bad} blocks overwritten"


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
def test_gradient_sums_by_lanes_are_the_float64_sum(kind):
    """LAMB's gradient norm on the cpu sums float64 squares per vector lane (``_sum_add``): the sum
    of the squares of the decoded words within float64 rounding, inf for an inf and NaN for a NaN."""
    import math

    from optirs.backends.cpu.formats_kernels import _grad_sum_squares
    from optirs.core import reference as R
    from optirs.core.formats import BF16, F32

    rng = np.random.default_rng(3)
    code = F32 if kind == "float32" else BF16
    for n in (0, 1, 7, 1000, 4099):
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-20, 20, n)).astype(np.float32)
        words = x.view(np.uint32) if kind == "float32" else R.nearest16(x, "bfloat16")
        values = words.view(np.float32) if kind == "float32" else R.decode16(words, "bfloat16")
        want = math.fsum(float(v) ** 2 for v in np.asarray(values, np.float64))
        got = _grad_sum_squares(words, code)
        assert abs(got - want) <= max(n, 1) * 2.0**-52 * want, (n, got, want)
        for special, expect in ((np.inf, math.isinf), (np.nan, math.isnan)):
            if n:
                w = words.copy()
                w[n // 2] = np.array([special], np.float32).view(np.uint32)[0] >> (16 if kind == "bfloat16" else 0)
                assert expect(_grad_sum_squares(w, code)), (n, special)
