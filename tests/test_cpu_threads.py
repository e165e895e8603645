"""The cpu backend's thread count per step: serial below a size, the free cores above it, the
same results either way, and numba's own setting left as it was."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import optirs
from optirs.backends.cpu.threads import SERIAL_BELOW, FreeCores, StepThreads
from optirs.core import reference


class _Fixed(FreeCores):
    def __init__(self, free):
        super().__init__()
        self.fixed = free

    def __call__(self):
        return self.fixed


def test_small_steps_are_serial_and_large_ones_follow_the_free_cores():
    threads = StepThreads(free=_Fixed(1))
    assert threads.count(SERIAL_BELOW - 1, limit=8) == 1
    assert threads.count(SERIAL_BELOW, limit=8) == 1  # one core free
    threads.free.fixed = 3
    assert threads.count(SERIAL_BELOW, limit=8) == 3 and threads.count(SERIAL_BELOW, limit=2) == 2


def test_free_cores_reads_a_count_within_the_affinity():
    free = FreeCores()
    first = free()
    free._last = (free._last[0] - 1.0,) + free._last[1:]  # as if the last reading were a second old
    assert 1 <= first <= free.cores and 1 <= free() <= free.cores


@pytest.mark.parametrize("free", [1, 2])
def test_a_step_is_the_reference_step_whatever_the_thread_count(free):
    backend = optirs.get_backend("cpu")
    rng = np.random.default_rng(5)
    shapes = [(SERIAL_BELOW // 2 + 3,), (SERIAL_BELOW // 2 + 64,), (7,)]  # above SERIAL_BELOW in all
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(2)]
    hp = optirs.AdamParams(lr=1e-2, weight_decay=0.01)
    expected, _ = reference.run("adamw", host, grads, hp)
    params = [h.copy() for h in host]
    opt = optirs.GpuAdamW(hp, config=optirs.GpuOptimizerConfig(backend="cpu"))
    saved, before = backend.ctx.threads.free, numba.get_num_threads()
    backend.ctx.threads.free = _Fixed(free)
    try:
        for gs in grads:
            opt.step_gpu(params, gs)
    finally:
        backend.ctx.threads.free = saved
    assert numba.get_num_threads() == before
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p, e, rtol=1e-5, atol=1e-6)


def test_claimed_chunks_are_each_stepped_once():
    """Chunks claimed from a shared counter (optirs.backends.cpu.claims): with numba's threads
    claiming concurrently, every chunk is taken exactly once, however few or many chunks."""
    from numba import njit, prange

    from optirs.backends.cpu.claims import LOOPS, claim, counter, loops

    @njit(parallel=True)
    def take(nchunks, taken):
        next_chunk = counter()
        for _loop in prange(loops(nchunks)):
            c = claim(next_chunk)
            while c < nchunks:
                taken[c] += 1
                c = claim(next_chunk)

    for nchunks in (1, 2, LOOPS - 1, LOOPS + 1, 200_000):
        taken = np.zeros(nchunks, np.int64)
        take(nchunks, taken)
        assert taken.min() == 1 and taken.max() == 1, nchunks
