"""The step transaction: repeat calls validated like first ones, threads, interrupts, failing plugins.

Every case checks the promise: a rejected or failed call changes nothing (parameters, state and
step count bit-identical to before), and concurrent or interrupted runs give exactly what the
sequential, uninterrupted run gives (a second optimizer on the same backend is the reference, and
optirs/core/reference.py checks that reference itself).
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.core.errors import GpuOptimError, InvalidParameterError, PluginError, ShapeMismatchError
from optirs.plugin.hookspecs import StepSupport, hookimpl

from conftest import FakeHostBackend, interrupt_at

SHAPES = [(6, 4), (10,), (3, 5)]


def _model(seed, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _grads(seed, steps, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]


def _adam(backend, **hp):
    return optirs.GpuAdam(optirs.AdamParams(lr=0.01, amsgrad=True, **hp), optirs.GpuOptimizerConfig(backend=backend))


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _assert_same(params, state, ref_params, ref_state):
    """Bit-identical parameters and state_dict (step, shapes and every slot)."""
    for a, b in zip(params, ref_params):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    assert state["step"] == ref_state["step"] and state["shapes"] == ref_state["shapes"]
    assert len(state["state"]) == len(ref_state["state"])
    for a, b in zip(state["state"], ref_state["state"]):
        assert set(a) == set(b)
        for k in b:
            np.testing.assert_array_equal(_bits(a[k]), _bits(b[k]))


def _check_reference(params0, grads, params, hp):
    """The sequential optirs run itself against the float64 reference."""
    expected, _ = reference.run("adam", params0, grads, hp)
    for a, e in zip(params, expected):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ 1. repeat calls are validated like first ones


@pytest.mark.parametrize("kind", ["read_only", "read_only_grad_ok"])
def test_parameter_made_read_only_after_a_step_is_rejected(backend, kind):
    params, grads = _model(1), _grads(2, 1)[0]
    opt = _adam(backend)
    opt.step_gpu(params, grads)  # the same lists every step, as a training loop passes them
    if kind == "read_only_grad_ok":  # read-only gradients are fine, on first and repeat calls
        for g in grads:
            g.flags.writeable = False
        opt.step_gpu(params, grads)
        assert opt.step_count == 2
        return
    # A fresh optimizer's first call refuses a read-only parameter: so must a repeat call.
    ro = [p.copy() for p in params]
    ro[1].flags.writeable = False
    with pytest.raises(ShapeMismatchError, match=r"params\[1\] is read-only") as first:
        _adam(backend).step_gpu(ro, grads)
    before_p, before_s = [p.copy() for p in params], opt.state_dict()
    params[1].flags.writeable = False
    with pytest.raises(type(first.value), match=r"params\[1\] is read-only"):
        opt.step_gpu(params, grads)
    _assert_same(params, opt.state_dict(), before_p, before_s)
    assert opt.step_count == 1
    # Writeable again: the same lists step on, exactly like an optimizer that never saw the refusal.
    params[1].flags.writeable = True
    opt.step_gpu(params, grads)
    twin, twin_p = _adam(backend), _model(1)
    for _ in range(2):
        twin.step_gpu(twin_p, grads)
    _assert_same(params, opt.state_dict(), twin_p, twin.state_dict())


# ------------------------------------------------------------------ 2. two optimizers, two threads


STEPS = 100


def _run_in_threads(jobs):
    """Run each job in its own thread, all released at once; re-raise the first failure."""
    barrier, errors = threading.Barrier(len(jobs)), []

    def run(job):
        try:
            barrier.wait()
            job()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch often: interleavings that a long interval hides
    try:
        threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]


def test_two_optimizers_in_two_threads_match_the_sequential_run(backend):
    steps = STEPS
    models = [_model(10 + k) for k in range(2)]
    grads = [_grads(20 + k, steps) for k in range(2)]
    # sequential reference, on the same backend
    seq = []
    for k in range(2):
        opt, p = _adam(backend), [a.copy() for a in models[k]]
        for g in grads[k]:
            opt.step_gpu(p, g)
        seq.append((p, opt.state_dict()))
    _check_reference(models[0], grads[0], seq[0][0], _adam("cpu").params)
    # the same two runs, concurrently
    opts = [_adam(backend) for _ in range(2)]
    live = [[a.copy() for a in m] for m in models]

    def job(k):
        return lambda: [opts[k].step_gpu(live[k], g) for g in grads[k]]

    _run_in_threads([job(0), job(1)])
    for k in range(2):
        _assert_same(live[k], opts[k].state_dict(), *seq[k])


# ------------------------------------------------------------------ 3. one optimizer, many threads


def test_one_optimizer_stepped_from_many_threads_loses_no_step(backend):
    n_threads, per_thread = 4, 25
    total = n_threads * per_thread
    g = _grads(30, 1)[0]  # the same gradients every step: the order of the steps does not matter
    ref, ref_p = _adam(backend), _model(31)
    for _ in range(total):
        ref.step_gpu(ref_p, g)
    opt, p = _adam(backend), _model(31)

    def job():
        for i in range(per_thread):
            opt.step_gpu(p, g)
            if i % 5 == 0:  # checkpoints and moves interleaved with the steps never corrupt them
                opt.state_dict()
                opt.move_to_cpu()

    _run_in_threads([job] * n_threads)
    assert opt.step_count == total
    _assert_same(p, opt.state_dict(), ref_p, ref.state_dict())


# ------------------------------------------------------------------ 4. KeyboardInterrupt during a step


def test_keyboard_interrupt_lands_before_or_after_a_step(backend):
    """SIGINT at every point of a step (each line optirs runs): the optimizer is then exactly as
    before the step or exactly as after it, step count included."""
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    victim, twin = _adam(backend), _adam(backend)
    p, twin_p = _model(40), _model(40)
    g = _grads(41, 1)[0]
    victim.step_gpu(p, g)
    twin.step_gpu(twin_p, g)
    # how many optirs line events one step takes (the first step allocates; count a later one)
    tracer, count = interrupt_at(-1)
    sys.settrace(tracer)
    try:
        victim.step_gpu(p, g)
    finally:
        sys.settrace(None)
    twin.step_gpu(twin_p, g)
    events = count[0]
    assert events > 10
    points = list(range(1, events + 1))
    outcomes = {"before": 0, "after": 0}
    for k in points:
        before_count = victim.step_count
        tracer, seen = interrupt_at(k)
        interrupted = False
        sys.settrace(tracer)
        try:
            try:
                victim.step_gpu(p, g)
            finally:
                sys.settrace(None)
            for _ in range(3):  # a signal still pending is delivered here, after the step
                pass
        except KeyboardInterrupt:
            interrupted = True
        # A step can run fewer lines than the one counted (on a GPU the prepared launch rewrites
        # only the scalars that changed, and late in a run bias corrections stop changing in
        # float32): then no interrupt was sent and the step simply completed.
        sent = seen[0] >= k
        assert interrupted or not sent, f"the interrupt at line event {k} of {events} was lost"
        if victim.step_count == before_count:
            outcomes["before"] += 1
        else:
            assert victim.step_count == before_count + 1
            twin.step_gpu(twin_p, g)
            outcomes["after"] += 1
        assert victim.step_count == twin.step_count
        _assert_same(p, victim.state_dict(), twin_p, twin.state_dict())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert outcomes["after"] > 0  # interrupts inside the step land after it
    # and the interrupted optimizer steps on exactly like the twin
    victim.step_gpu(p, g)
    twin.step_gpu(twin_p, g)
    _assert_same(p, victim.state_dict(), twin_p, twin.state_dict())


def test_interrupts_are_deferred_only_in_the_main_thread():
    from optirs.core.interrupts import deferred_interrupts

    seen = []

    def worker():
        with deferred_interrupts():  # no handler can be swapped here: a no-op
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            _thread.interrupt_main()
            with deferred_interrupts():  # nested: still deferred to the outermost exit
                for _ in range(3):
                    pass
            seen.append("inside")
    assert seen[-1] == "inside"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ------------------------------------------------------------------ 5. a plugin step hook that raises


class _Raising(FakeHostBackend):
    """A host backend whose SGD step raises ``error`` on the steps listed in ``fail``."""

    def __init__(self, error, fail):
        super().__init__()
        self.error, self.fail, self.calls = error, set(fail), 0

    @hookimpl
    def optirs_step_support(self):
        return StepSupport(optimizers=("sgd",))

    @hookimpl
    def optirs_step(self, request):
        self.calls += 1
        if self.calls in self.fail:
            raise self.error
        for p, g in zip(request.params, request.grads):
            p -= request.scalars.lr * g


@pytest.mark.parametrize("error", [RuntimeError("kernel exploded"), KeyError("slot")])
def test_a_raising_plugin_step_is_a_plugin_error_and_not_counted(fresh_registry, error):
    optirs.register_plugin(_Raising(error, fail={2}), "raising")
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.5), optirs.GpuOptimizerConfig(backend="raising"))
    p, g = np.ones(4, np.float32), np.ones(4, np.float32)
    opt.step_gpu(p, g)
    before_p, before_s = p.copy(), opt.state_dict()
    with pytest.raises(PluginError, match=r"plugin 'raising' raised \w+ in optirs_step: ") as info:
        opt.step_gpu(p, g)
    assert info.value.__cause__ is error
    assert type(error).__name__ in str(info.value)
    assert opt.step_count == 1
    _assert_same([p], opt.state_dict(), [before_p], before_s)
    opt.step_gpu(p, g)  # the next step counts as the second
    assert opt.step_count == 2
    np.testing.assert_array_equal(p, np.zeros(4, np.float32))


def test_a_raising_first_step_leaves_no_state(fresh_registry):
    optirs.register_plugin(_Raising(RuntimeError("no"), fail={1}), "raising")
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.5, momentum=0.9), optirs.GpuOptimizerConfig(backend="raising"))
    p = np.ones(4, np.float32)
    with pytest.raises(PluginError):
        opt.step_gpu(p, np.ones(4, np.float32))
    assert opt.step_count == 0 and opt.state_dict()["state"] == [] and opt.state_dict()["shapes"] == []
    np.testing.assert_array_equal(p, np.ones(4, np.float32))


@pytest.mark.parametrize("error", [InvalidParameterError("params[0]=bad, expected good"),
                                   optirs.DeviceMemoryError("out of fake memory")])
def test_optirs_errors_from_a_plugin_pass_through(fresh_registry, error):
    assert isinstance(error, GpuOptimError)
    optirs.register_plugin(_Raising(error, fail={1}), "raising")
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.5), optirs.GpuOptimizerConfig(backend="raising"))
    with pytest.raises(type(error)) as info:
        opt.step_gpu(np.ones(4, np.float32), np.ones(4, np.float32))
    assert info.value is error
    assert opt.step_count == 0
