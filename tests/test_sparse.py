"""optirs.optim.sparse against torch.optim (SparseAdam, SGD on sparse gradients) and optirs.core.reference.

Every backend that opens here runs the same checks (the ``feature_backend`` fixture): cpu always,
opencl on PoCL, cuda on a GPU or under numba's simulator (``NUMBA_ENABLE_CUDASIM=1 pytest -m cuda``),
and the third-party numpy example backend, which implements the ``sparse`` hooks in numpy.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from optirs import AdamParams, SgdParams
from optirs.core import reference
from optirs.core.errors import (BackendUnavailableError, InvalidParameterError, ShapeMismatchError,
                                UnsupportedOperationError)
from optirs.optim.sparse import (CooGradient, CsrGradient, LazyAdamMode, SparseAdam, SparseAdamConfig,
                                     SparseAdamTable, SparseSgd, SparseSgdConfig, SparseSgdTable)

from conftest import BUILTIN_BACKENDS, from_backend_array, to_backend_array

torch = pytest.importorskip("torch")
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


R, D = 24, 5  # tiny tables: the simulator runs every thread in Python


def _steps(seed: int, steps: int, nnz: int = 9, empty_at: int | None = None):
    """A sequence of COO gradients with duplicate rows (and one empty step if asked)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        n = 0 if t == empty_at else nnz
        idx = rng.integers(0, R, n)
        if n:
            idx[-1] = idx[0]  # always at least one duplicate
        out.append((idx, rng.standard_normal((n, D)).astype(np.float32)))
    return out


def _torch_sparse(idx, vals):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_coo_tensor(torch.as_tensor(idx, dtype=torch.int64)[None], torch.as_tensor(vals), (R, D))


def _grad(form: str, idx, vals):
    coo = CooGradient(idx, vals)
    return coo if form == "coo" else CsrGradient.from_coo(coo, R)


# ---------------------------------------------------------------- SparseAdam


@pytest.mark.parametrize("form", ["coo", "csr"])
def test_lazy_adam_equals_torch_sparse_adam(feature_backend, form):
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    opt = SparseAdam(SparseAdamConfig(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6, backend=feature_backend))
    p = p0.copy()
    tp = torch.tensor(p0, requires_grad=True)
    topt = torch.optim.SparseAdam([tp], lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    for idx, vals in _steps(1, 5, empty_at=2):
        opt.step(p, _grad(form, idx, vals))
        tp.grad = _torch_sparse(idx, vals)
        topt.step()
    state = opt.state_dict()["tables"][0]
    tstate = topt.state[tp]
    assert state["step"] == tstate["step"] == 5
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state["exp_avg"], tstate["exp_avg"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state["exp_avg_sq"], tstate["exp_avg_sq"].numpy(), rtol=1e-6, atol=1e-8)
    # Lazy: rows never in a gradient are exactly as they were.
    touched = np.unique(np.concatenate([i for i, _ in _steps(1, 5, empty_at=2)]))
    untouched = np.setdiff1d(np.arange(R), touched)
    assert untouched.size
    np.testing.assert_array_equal(p[untouched], p0[untouched])
    np.testing.assert_array_equal(state["exp_avg"][untouched], 0.0)


def test_lazy_adam_two_tables_step_counts_are_per_table(feature_backend):
    """A table whose gradient is None does not step (as torch skips a parameter without grad)."""
    rng = np.random.default_rng(4)
    a0, b0 = rng.standard_normal((R, D)).astype(np.float32), rng.standard_normal((R, D)).astype(np.float32)
    opt = SparseAdam(SparseAdamConfig(lr=0.05, backend=feature_backend))
    a, b = a0.copy(), b0.copy()
    ta, tb = torch.tensor(a0, requires_grad=True), torch.tensor(b0, requires_grad=True)
    topt = torch.optim.SparseAdam([ta, tb], lr=0.05)
    for t, (idx, vals) in enumerate(_steps(5, 4)):
        gb = None if t % 2 else CooGradient(idx[::-1].copy(), vals[::-1].copy())
        opt.step([a, b], [CooGradient(idx, vals), gb])
        ta.grad = _torch_sparse(idx, vals)
        tb.grad = None if gb is None else _torch_sparse(idx[::-1].copy(), vals[::-1].copy())
        topt.step()
    assert [t.step for t in opt.tables] == [4, 2]
    assert all(isinstance(t, SparseAdamTable) for t in opt.tables)
    np.testing.assert_allclose(a, ta.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(b, tb.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("form", ["coo", "csr"])
def test_dense_decay_adam_equals_dense_adam_with_zero_gradients(feature_backend, form):
    rng = np.random.default_rng(6)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    cfg = SparseAdamConfig(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6, mode=LazyAdamMode.DENSE_DECAY,
                           backend=feature_backend)
    opt = SparseAdam(cfg)
    p = p0.copy()
    ref_p, ref_s = [p0], [{}]
    hp = AdamParams(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6)
    grads = _steps(7, 5, empty_at=3)
    for t, (idx, vals) in enumerate(grads, start=1):
        g = _grad(form, idx, vals)
        before_last = p.copy()
        opt.step(p, g)
        ref_p, ref_s = reference.adam(ref_p, [g.to_dense(R)], ref_s, hp, t)
    state = opt.state_dict()["tables"][0]
    np.testing.assert_allclose(p, ref_p[0], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(state["exp_avg"], ref_s[0]["exp_avg"], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(state["exp_avg_sq"], ref_s[0]["exp_avg_sq"], rtol=2e-6, atol=1e-8)
    # Rows seen earlier but absent from the last gradient still moved in the last step.
    absent = np.setdiff1d(np.concatenate([i for i, _ in grads[:-1]]), grads[-1][0])
    assert absent.size and np.all(np.any(p[absent] != before_last[absent], axis=1))


# ---------------------------------------------------------------- SparseSgd


@pytest.mark.parametrize("kw", [dict(momentum=0.0), dict(momentum=0.9, dampening=0.2),
                                dict(momentum=0.8, nesterov=True)], ids=["plain", "dampening", "nesterov"])
def test_dense_decay_sgd_equals_torch_sgd_on_sparse_gradients(feature_backend, kw):
    rng = np.random.default_rng(8)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    opt = SparseSgd(SparseSgdConfig(lr=0.1, mode="dense_decay", backend=feature_backend, **kw))
    p = p0.copy()
    tp = torch.tensor(p0, requires_grad=True)
    topt = torch.optim.SGD([tp], lr=0.1, **kw)
    for idx, vals in _steps(9, 5):
        opt.step(p, CooGradient(idx, vals))
        tp.grad = _torch_sparse(idx, vals)
        topt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-6)
    if kw["momentum"]:
        np.testing.assert_allclose(opt.state_dict()["tables"][0]["momentum_buffer"],
                                   topt.state[tp]["momentum_buffer"].to_dense().numpy(), rtol=1e-6, atol=1e-6)


def test_dense_decay_sgd_with_weight_decay_equals_reference(feature_backend):
    """torch.optim.SGD cannot add weight decay to a sparse gradient; the dense reference can."""
    rng = np.random.default_rng(10)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    hp = SgdParams(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05)
    opt = SparseSgd(SparseSgdConfig(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05,
                                    mode="dense_decay", backend=feature_backend))
    p, ref_p, ref_s = p0.copy(), [p0], [{}]
    for t, (idx, vals) in enumerate(_steps(11, 4), start=1):
        g = CsrGradient.from_coo(CooGradient(idx, vals), R)
        opt.step(p, g)
        ref_p, ref_s = reference.sgd(ref_p, [g.to_dense(R)], ref_s, hp, t)
    np.testing.assert_allclose(p, ref_p[0], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("kw", [dict(momentum=0.9, dampening=0.3, weight_decay=0.05), dict(momentum=0.0)],
                         ids=["momentum", "plain"])
def test_lazy_sgd_equals_per_row_reference(feature_backend, kw):
    """LAZY: each row steps as torch's SGD would over only the steps in which the row is present."""
    rng = np.random.default_rng(12)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    hp = SgdParams(lr=0.1, **kw)
    opt = SparseSgd(SparseSgdConfig(lr=0.1, backend=feature_backend, **kw))
    p = p0.copy()
    rows = {r: ([p0[r]], [{}], 0) for r in range(R)}
    for idx, vals in _steps(13, 5, nnz=6):
        g = CooGradient(idx, vals)
        opt.step(p, g)
        dense = g.to_dense(R)
        for r in np.unique(idx):
            rp, rs, n = rows[r]
            rp, rs = reference.sgd(rp, [dense[r]], rs, hp, n + 1)
            rows[r] = (rp, rs, n + 1)
    expected = np.stack([rows[r][0][0] for r in range(R)])
    np.testing.assert_allclose(p, expected, rtol=2e-6, atol=2e-6)
    assert any(n == 0 for _, _, n in rows.values())  # some rows never touched, so stayed put
    assert isinstance(opt.tables[0], SparseSgdTable)
    if kw["momentum"] == 0.0:  # nothing lazy about plain SGD: torch agrees too
        tp = torch.tensor(p0, requires_grad=True)
        topt = torch.optim.SGD([tp], lr=0.1)
        for idx, vals in _steps(13, 5, nnz=6):
            tp.grad = _torch_sparse(idx, vals)
            topt.step()
        np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- gradients, validation, checkpoints


def test_coo_and_csr_sum_duplicates_in_order():
    idx = np.array([3, 1, 3, 3])
    vals = np.array([[1e8], [2.0], [1.0], [-1e8]], np.float32)
    coo = CooGradient(idx, vals)
    dense = coo.to_dense(5)
    # ((1e8 + 1) - 1e8) in float32 is 0: the order given is the order summed.
    assert dense[3, 0] == np.float32(np.float32(1e8) + np.float32(1.0)) - np.float32(1e8)
    assert dense[1, 0] == 2.0 and not dense[[0, 2, 4]].any()
    csr = CsrGradient.from_coo(coo, 5)
    np.testing.assert_array_equal(csr.indptr, [0, 0, 1, 1, 4, 4])
    np.testing.assert_array_equal(csr.to_dense(5), dense)


@pytest.mark.parametrize("make, err, words", [
    (lambda: CooGradient(np.array([0, -2]), np.ones((2, D), np.float32)), InvalidParameterError, "-2"),
    (lambda: CooGradient(np.array([0, R]), np.ones((2, D), np.float32)), InvalidParameterError, f"num_rows={R}"),
    (lambda: CooGradient(np.array([0, 1, 2]), np.ones((2, D), np.float32)), ShapeMismatchError, "3 indices"),
    (lambda: CooGradient(np.array([0.0, 1.0]), np.ones((2, D), np.float32)), InvalidParameterError, "float64"),
    (lambda: CooGradient(np.array([0, 1]), np.ones((2, D), np.float64)), ShapeMismatchError, "float32"),
    (lambda: CsrGradient(np.r_[0, 2, 1, np.full(R - 2, 2)], np.ones((2, D), np.float32)), InvalidParameterError,
     "indptr[1]=2 > indptr[2]=1"),
    (lambda: CsrGradient(np.r_[1, np.full(R, 2)], np.ones((2, D), np.float32)), InvalidParameterError, "indptr[0]=1"),
    (lambda: CsrGradient(np.r_[0, np.full(R, 3)], np.ones((2, D), np.float32)), ShapeMismatchError, "nnz=2"),
    (lambda: CsrGradient(np.r_[0, np.full(R - 2, 2)], np.ones((2, D), np.float32)), ShapeMismatchError, "num_rows + 1"),
    (lambda: CooGradient(np.array([0, 1]), np.ones((2, D + 1), np.float32)), ShapeMismatchError, f"dim={D}"),
], ids=["negative", "out-of-range", "count", "float-indices", "float64-values", "unsorted-indptr",
        "indptr-start", "indptr-end", "indptr-length", "wrong-dim"])
def test_bad_gradients_raise_and_change_nothing(make, err, words):
    rng = np.random.default_rng(14)
    a0, b0 = rng.standard_normal((R, D)).astype(np.float32), rng.standard_normal((R, D)).astype(np.float32)
    opt = SparseAdam(SparseAdamConfig(lr=0.1, backend="cpu"))
    a, b = a0.copy(), b0.copy()
    opt.step([a, b], [CooGradient(np.array([1, 2]), np.ones((2, D), np.float32))] * 2)
    before = opt.state_dict()
    a1, b1 = a.copy(), b.copy()
    with pytest.raises(err) as info:
        # The first table's gradient is fine: it must not step when the second one is rejected.
        opt.step([a, b], [CooGradient(np.array([3]), np.ones((1, D), np.float32)), make()])
    assert words in str(info.value)
    np.testing.assert_array_equal(a, a1)
    np.testing.assert_array_equal(b, b1)
    after = opt.state_dict()
    for t0, t1 in zip(before["tables"], after["tables"]):
        assert t0["step"] == t1["step"] == 1
        np.testing.assert_array_equal(t0["exp_avg"], t1["exp_avg"])


def test_bad_tables_and_configs():
    opt = SparseAdam(SparseAdamConfig(backend="cpu"))
    g = CooGradient(np.array([0]), np.ones((1, D), np.float32))
    with pytest.raises(ShapeMismatchError, match="2-D"):
        opt.step(np.zeros(R, np.float32), g)
    with pytest.raises(ShapeMismatchError, match="float32"):
        opt.step(np.zeros((R, D)), g)
    with pytest.raises(InvalidParameterError, match="CooGradient"):
        opt.step(np.zeros((R, D), np.float32), np.zeros((R, D), np.float32))
    opt.step(np.zeros((R, D), np.float32), g)
    with pytest.raises(ShapeMismatchError, match="as in earlier steps"):
        opt.step(np.zeros((R + 1, D), np.float32), g)
    with pytest.raises(InvalidParameterError, match="beta1=1.0"):
        SparseAdamConfig(beta1=1.0)
    with pytest.raises(InvalidParameterError, match="mode='bogus'"):
        SparseAdamConfig(mode="bogus")
    with pytest.raises(InvalidParameterError, match="nesterov"):
        SparseSgdConfig(nesterov=True)
    with pytest.raises(BackendUnavailableError, match="unknown backend 'some-plugin'"):
        SparseSgd(SparseSgdConfig(backend="some-plugin")).step(np.zeros((R, D), np.float32), g)


@pytest.mark.parametrize("cls, cfg", [(SparseAdam, SparseAdamConfig), (SparseSgd, SparseSgdConfig)])
def test_backend_without_sparse_hooks_raises_and_changes_nothing(fresh_registry, cls, cfg):
    """A backend that lacks the capability is refused by name, before anything changes."""
    from conftest import FakeHostBackend

    import optirs

    optirs.register_plugin(FakeHostBackend(), "densehost")
    assert not optirs.get_backend("densehost").supports("sparse")
    opt = cls(cfg(backend="densehost"))
    p0 = np.ones((R, D), np.float32)
    p = p0.copy()
    with pytest.raises(UnsupportedOperationError) as info:
        opt.step(p, CooGradient(np.array([0, 3]), np.ones((2, D), np.float32)))
    assert "'densehost'" in str(info.value) and "'sparse'" in str(info.value)
    np.testing.assert_array_equal(p, p0)
    assert opt.tables == []


@pytest.mark.parametrize("cls, cfg", [
    (SparseAdam, SparseAdamConfig(lr=0.05, mode="lazy", backend="cpu")),
    (SparseAdam, SparseAdamConfig(lr=0.05, mode="dense_decay", backend="cpu")),
    (SparseSgd, SparseSgdConfig(lr=0.05, momentum=0.9, dampening=0.5, mode="lazy", backend="cpu")),
    (SparseSgd, SparseSgdConfig(lr=0.05, momentum=0.9, mode="dense_decay", backend="cpu")),
], ids=["adam-lazy", "adam-dense", "sgd-lazy", "sgd-dense"])
def test_checkpoint_resumes_exactly(cls, cfg):
    rng = np.random.default_rng(15)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    grads = _steps(16, 6)
    straight, p = cls(cfg), p0.copy()
    for idx, vals in grads:
        straight.step(p, CooGradient(idx, vals))
    first, q = cls(cfg), p0.copy()
    for idx, vals in grads[:3]:
        first.step(q, CooGradient(idx, vals))
    resumed = cls(cfg)
    resumed.load_state_dict(first.state_dict())
    for idx, vals in grads[3:]:
        resumed.step(q, CooGradient(idx, vals))
    np.testing.assert_array_equal(q, p)
    assert resumed.tables[0].step == 6
    bad = first.state_dict()
    bad["tables"][0][cls.table_type.SLOTS[0]] = np.zeros((R, D + 1), np.float32)
    with pytest.raises(ShapeMismatchError, match="expected"):
        cls(cfg).load_state_dict(bad)


@pytest.mark.skipif(SIMULATOR, reason="compiles real PTX; the simulator has no compiler")
def test_cuda_kernels_compile_to_sm90_ptx(monkeypatch):
    """The CUDA kernels compile for the H200 (sm_90) without a GPU, with float32-only arithmetic."""
    from numba import cuda, float32, int64, typeof, uint8
    import numba.cuda.dispatcher as dispatcher

    from optirs.core import scalars
    from optirs.backends.cuda import sparse_kernels as sk

    # compile_ptx takes the target from cc=, but device functions called from a kernel ask the
    # current device for it; stand in for the GPU this machine does not have.
    class _Sm90:
        compute_capability = (9, 0)

    monkeypatch.setattr(dispatcher, "get_current_device", lambda: _Sm90())
    f2, i1 = float32[:, ::1], int64[::1]
    adam_sc = typeof(SparseAdam(SparseAdamConfig(backend="cpu")).scalars(3))
    sgd_sc = typeof(scalars.sgd_scalars(SgdParams(momentum=0.9), 3))
    cases = {
        sk.adam_lazy: (f2, f2, f2, i1, i1, i1, f2, adam_sc),
        sk.adam_dense: (f2, f2, f2, i1, i1, i1, f2, adam_sc),
        sk.sgd_lazy: (f2, f2, uint8[::1], i1, i1, i1, f2, sgd_sc, sgd_sc),
        sk.sgd_dense: (f2, f2, i1, i1, i1, f2, sgd_sc),
    }
    for fn, sig in cases.items():
        ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
        assert ".target sm_90" in ptx
        assert ".f64" not in ptx, f"{fn.__name__} computes in float64"


@pytest.mark.parametrize("mode", ["lazy", "dense_decay"])
def test_device_tables_step_in_place(feature_backend, mode):
    """The backend's own arrays (table and gradient values) are stepped in place, matching numpy tables."""
    rng = np.random.default_rng(17)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    host = SparseAdam(SparseAdamConfig(lr=0.05, mode=mode, backend=feature_backend))
    dev = SparseAdam(SparseAdamConfig(lr=0.05, mode=mode, backend=feature_backend))
    p_host = p0.copy()
    if feature_backend in BUILTIN_BACKENDS:
        put = lambda a: to_backend_array(feature_backend, a)  # noqa: E731
    else:  # the numpy example backend's device arrays are numpy arrays
        put = np.copy
    p_dev = put(p0)
    for idx, vals in _steps(18, 3):
        host.step(p_host, CooGradient(idx, vals))
        dev.step(p_dev, CooGradient(idx, put(vals)))
    np.testing.assert_array_equal(from_backend_array(p_dev), p_host)


def test_docs_example_runs(capsys):
    """The example at the top of docs/sparse.md runs and prints what its comment says."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "sparse.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "docs/sparse.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["1", "0.2"]


def test_sorted_unique_fast_path_equals_general_path(feature_backend):
    """Coalesced gradients (sorted unique rows) skip the sort; the result is the shuffled input's."""
    rng = np.random.default_rng(19)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    idx = np.sort(rng.choice(R, 10, replace=False))
    vals = rng.standard_normal((10, D)).astype(np.float32)
    perm = rng.permutation(10)
    fast, general = SparseAdam(SparseAdamConfig(backend=feature_backend)), SparseAdam(SparseAdamConfig(backend=feature_backend))
    pf, pg = p0.copy(), p0.copy()
    for _ in range(2):
        fast.step(pf, CooGradient(idx, vals))
        general.step(pg, CooGradient(idx[perm], vals[perm]))
    np.testing.assert_array_equal(pf, pg)
    assert not np.array_equal(pf, p0)


def test_device_index_arrays_are_read_through_the_backend(feature_backend):
    """Index arrays on the device are copied at the step by the backend's to_host; a bad one changes nothing."""
    rng = np.random.default_rng(20)
    p0 = rng.standard_normal((R, D)).astype(np.float32)
    put = (lambda a: to_backend_array(feature_backend, a)) if feature_backend in BUILTIN_BACKENDS else np.copy
    idx, vals = _steps(21, 1)[0]
    csr = CsrGradient.from_coo(CooGradient(idx, vals), R)
    host, dev = SparseAdam(SparseAdamConfig(backend=feature_backend)), SparseAdam(SparseAdamConfig(backend=feature_backend))
    ph, pd = p0.copy(), p0.copy()
    host.step(ph, CooGradient(idx, vals))
    dev.step(pd, CooGradient(put(idx), vals))
    np.testing.assert_array_equal(pd, ph)
    host.step(ph, csr)
    dev.step(pd, CsrGradient(put(csr.indptr), vals[np.argsort(idx, kind="stable")]))
    np.testing.assert_array_equal(pd, ph)
    bad = csr.indptr.copy()
    bad[1], bad[2] = bad[2] + 1, bad[2]  # not sorted any more
    before = pd.copy()
    with pytest.raises(InvalidParameterError, match="not sorted"):
        dev.step(pd, CsrGradient(put(bad), vals))
    np.testing.assert_array_equal(pd, before)
    assert dev.tables[0].step == 2
