"""CPU-backend specifics: one kernel call per model step, and the on-disk kernel cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import optirs
from optirs.core.layout import TensorLayout


def test_a_model_is_one_kernel_call(monkeypatch, rng):
    backend = optirs.get_backend("cpu")
    calls = []
    real = backend.ctx.kernels.pointwise
    monkeypatch.setattr(backend.ctx, "kernels", type("K", (), {
        "pointwise": staticmethod(lambda *a: (calls.append(1), real(*a))),
        "typed_list": staticmethod(backend.ctx.kernels.typed_list)}))
    params = [rng.standard_normal(n).astype(np.float32) for n in (3, 70000, 1, 512)]
    opt = optirs.GpuAdam(config=optirs.GpuOptimizerConfig(backend="cpu"))
    opt.step_gpu(params, [np.ones_like(p) for p in params])
    assert len(calls) == 1


def test_chunk_table_covers_every_element_once():
    layout = TensorLayout([(3, 5), (0,), (100,), (1,), (65,)])
    tensor, start, stop = layout.chunks(32)
    covered = [np.zeros(n, int) for n in layout.sizes]
    for t, s, e in zip(tensor, start, stop):
        assert 0 < e - s <= 32
        covered[t][s:e] += 1
    assert all((c == 1).all() for c in covered)


def test_chunks_cut_on_the_flat_grid_cover_every_element_once():
    """``chunks(chunk, grid)``: each tensor's chunks end where its state offsets cross a multiple of
    ``chunk`` (its first chunk cut to a multiple of ``grid``), every start a multiple of ``grid``."""
    layout = TensorLayout([(5000,), (768,), (0,), (3000,), (100,), (2, 4096)])
    tensor, start, stop = layout.chunks(2048, 256)
    covered = [np.zeros(n, int) for n in layout.sizes]
    for t, s, e in zip(tensor, start, stop):
        assert 0 < e - s <= 2048 and s % 256 == 0
        covered[t][s:e] += 1
        if s > 0:  # every chunk after a tensor's first starts where the grid says
            lead = (2048 - layout.offsets[t] % 2048) % 2048 // 256 * 256 or 2048
            assert (s - lead) % 2048 == 0
    assert all((c == 1).all() for c in covered)
    assert layout.chunks(2048, 256) is layout.chunks(2048, 256)
    assert len(layout.chunks(2048)[0]) < len(tensor)  # the plain chunks from each tensor's start: fewer


def test_second_process_loads_kernels_from_disk_cache(tmp_path):
    code = textwrap.dedent("""
        import numpy as np, optirs
        from optirs.backends.cpu import kernels as cpu_kernels
        p = np.ones(10, np.float32)
        optirs.GpuAdam(config=optirs.GpuOptimizerConfig(backend="cpu")).step_gpu(p, p.copy())
        s = cpu_kernels.pointwise.stats
        print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first = [int(x) for x in runs[0].stdout.split()]
    second = [int(x) for x in runs[1].stdout.split()]
    assert first[1] == 1            # compiled in the first process
    assert second == [1, 0]         # loaded, not compiled, in the second


def test_only_the_latest_gradient_list_stays_cached(rng):
    """Gradients that are new arrays every step (torch's zero_grad(set_to_none=True)) are not kept
    alive by the typed-list cache beyond the latest step: an old step's gradients are freed."""
    import gc
    import weakref

    params = [rng.standard_normal(n).astype(np.float32) for n in (100, 7)]
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1), optirs.GpuOptimizerConfig(backend="cpu"))
    refs = []
    for _ in range(6):
        grads = [np.ones_like(p) for p in params]
        refs.append([weakref.ref(g) for g in grads])
        opt.step_gpu(params, grads)
        del grads
    gc.collect()
    alive = [sum(r() is not None for r in step) for step in refs]
    assert alive[:-1] == [0] * 5, alive  # the latest list may stay (the validation and stage caches)


def test_the_typed_list_caches_hold_many_lists_and_keep_no_array_alive(monkeypatch, rng):
    """Steps over more parameter lists than a handful (a CPUOffload's chunks) find their typed lists
    built, step after step; a list whose arrays are gone is let go, and its arrays with it."""
    import gc
    import weakref

    from optirs.backends.common.identity_cache import ArrayListCache, identity_key
    from optirs.backends.cpu import typed_lists

    backend = optirs.get_backend("cpu")
    built = []
    real = backend.ctx.kernels.typed_list
    monkeypatch.setattr(backend.ctx, "kernels", type("K", (), {
        "pointwise": backend.ctx.kernels.pointwise,
        "typed_list": staticmethod(lambda a: (built.append(len(a)), real(a))[1])}))
    models = [[rng.standard_normal(n).astype(np.float32) for n in (5, 3)] for _ in range(12)]
    grads = [[np.ones_like(p) for p in ps] for ps in models]
    opts = [optirs.GpuSgd(optirs.SgdParams(lr=0.1), optirs.GpuOptimizerConfig(backend="cpu")) for _ in models]
    for _ in range(2):
        for opt, ps, gs in zip(opts, models, grads):
            opt.step_gpu(ps, gs)
    assert len(built) == 2 * len(models)  # each model's parameters and gradients, once
    refs = [weakref.ref(a) for a in models[0] + grads[0]]
    del models[0], grads[0], opts[0], opt, ps, gs
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    # an entry found under the ids of other arrays (an id reused once its array is gone) is rebuilt
    a, b = [np.zeros(3, np.float32)], [np.zeros(3, np.float32)]
    cache = ArrayListCache(4)
    stale = cache.put(identity_key(b), a, real(a))
    count = lambda x: (built.append(-1), real(x))[1]
    rebuilt = typed_lists.cached_typed_list(cache, b, count)
    assert rebuilt is not stale and built[-1] == -1
    assert typed_lists.cached_typed_list(cache, b, count) is rebuilt and built.count(-1) == 1


def test_typed_lists_are_built_in_cached_code_and_keep_their_arrays():
    """The kernels' typed lists come from a compiled builder (numba's List.append from Python
    compiles in every process): the same views, and the arrays they borrow stay alive with the list."""
    import gc
    import weakref

    from optirs.backends.cpu.kernels import typed_list

    arrays = [np.arange(n, dtype=np.float32) for n in (5, 1, 300)]
    refs = [weakref.ref(a) for a in arrays]
    built = typed_list(arrays)
    del arrays
    gc.collect()
    assert all(r() is not None for r in refs)
    assert [np.array_equal(v, np.arange(n, dtype=np.float32)) for v, n in zip(built, (5, 1, 300))] == [True] * 3
    built[0][1] = 42.0  # a view: the caller's memory
    assert refs[0]()[1] == 42.0
    with pytest.raises(TypeError, match="contiguous"):
        typed_list([np.zeros((4, 4), np.float32)[:, 0]])


def test_a_formats_second_step_compiles_nothing():
    """The first step of a format has no loop of its own (a fresh float32 master reads the
    parameter), so the second step runs the first one's compiled loop."""
    torch = pytest.importorskip("torch")
    import optirs.torch as ot
    from optirs.core.compile_cache import compile_records, install_compile_log

    install_compile_log()
    model = torch.nn.Linear(300, 20).to(torch.bfloat16)
    opt = ot.AdamW(model.parameters(), lr=1e-3, master_weights="float32", state_dtype="int8", backend="cpu")
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        before = len(compile_records())
        opt.step()
    assert compile_records()[before:] == ()
