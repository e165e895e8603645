"""DataParallelOptimizer over torch.distributed (gloo, two CPU processes on 127.0.0.1).

One launch of two worker processes trains every optimizer in both modes; the test then runs the
same training on one rank in this process and compares. Rank r's gradient at step t is
``a_r * p + noise(t, r)``, so the run depends on the parameters it produces; one rank sees the
average ``(g_0 + g_1) / 2``, which is exactly what a two-rank all-reduce of float32 computes.

The workers are this file run as a script; every wait has a timeout so a hang fails the test
instead of stalling CI.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np
import pytest

from optirs import (AdagradParams, AdamParams, GpuAdagrad, GpuAdam, GpuAdamW, GpuLamb, GpuOptimizerConfig, GpuRmsprop,
                    GpuSgd, LambParams, RmspropParams, SgdParams)

SHAPES = [(5, 3), (7,), (2, 2, 3), (1,), (11,), (4, 4)]
STEPS, CHECKPOINT_AT = 5, 3
WORLD = 2
MODES = ("allreduce", "zero1")
CPU = GpuOptimizerConfig(backend="cpu")

CASES = {
    "adam": lambda: GpuAdam(AdamParams(lr=0.05, weight_decay=0.01, amsgrad=True), CPU),
    "adamw": lambda: GpuAdamW(AdamParams(lr=0.05, weight_decay=0.1), CPU),
    "sgd": lambda: GpuSgd(SgdParams(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), CPU),
    "rmsprop": lambda: GpuRmsprop(RmspropParams(lr=0.01, momentum=0.5, centered=True), CPU),
    "adagrad": lambda: GpuAdagrad(AdagradParams(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1), CPU),
    "lamb": lambda: GpuLamb(LambParams(lr=0.02, weight_decay=0.01), CPU),
    # Small max_grad_norm so global clipping acts every step: its norm must span both shards.
    "lamb-clip": lambda: GpuLamb(LambParams(lr=0.02, max_grad_norm=0.5, max_trust_ratio=5.0), CPU),
}


def initial_params() -> List[np.ndarray]:
    rng = np.random.default_rng(2024)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def rank_grads(params: List[np.ndarray], step: int, rank: int) -> List[np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    a = np.float32(0.5 + rank)
    return [(a * p + rng.standard_normal(p.shape).astype(np.float32)).astype(np.float32) for p in params]


def mean_grads(params: List[np.ndarray], step: int) -> List[np.ndarray]:
    """What a two-rank all-reduce (sum) followed by division by 2 gives, in float32."""
    g0, g1 = rank_grads(params, step, 0), rank_grads(params, step, 1)
    return [(a + b) / np.float32(2) for a, b in zip(g0, g1)]


def train(opt, params, steps, start, grads_fn):
    for t in range(start, start + steps):
        opt.step_gpu(params, grads_fn(params, t))
    return params


# ---------------------------------------------------------------- the worker (run as a script)


def worker(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from optirs.optim.data_parallel import DataParallelOptimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    from optirs.optim.data_parallel import broadcast_parameters

    mine = lambda params, t: rank_grads(params, t, rank)  # noqa: E731
    results: Dict[str, dict] = {}
    differing = [p + np.float32(rank) for p in initial_params()]  # each rank starts elsewhere ...
    broadcast_parameters(differing)  # ... until rank 0's values are broadcast
    results["broadcast"] = differing
    for name, make in CASES.items():
        for mode in MODES:
            opt = DataParallelOptimizer(make(), mode=mode)
            params = train(opt, initial_params(), CHECKPOINT_AT, 0, mine)
            checkpoint = opt.state_dict()  # a collective: every rank gathers the whole state
            at_checkpoint = [p.copy() for p in params]
            final = train(opt, params, STEPS - CHECKPOINT_AT, CHECKPOINT_AT, mine)
            # The checkpoint also loads on two ranks (re-sharded) and continues identically.
            again = DataParallelOptimizer(make(), mode=mode)
            again.load_state_dict(checkpoint)
            resumed = train(again, [p.copy() for p in at_checkpoint], STEPS - CHECKPOINT_AT, CHECKPOINT_AT, mine)
            results[f"{name}/{mode}"] = {
                "final": [p.copy() for p in final], "resumed": resumed, "at_checkpoint": at_checkpoint,
                "checkpoint": checkpoint if rank == 0 else None, "state_bytes": opt.state_bytes(),
            }
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "wb") as f:
        pickle.dump(results, f)


# ---------------------------------------------------------------- the test side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out, port: int) -> str:
    """Run the two workers; return '' on success, else the failing rank's log tail."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    # Logs go to files, not pipes: a rank blocked on a full pipe would look like a hang.
    logs = [out / f"rank{r}.log" for r in range(WORLD)]
    procs = []
    for r in range(WORLD):
        with open(logs[r], "wb") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, str(r), str(port), str(out / f"rank{r}.pkl")],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 600
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail("the two gloo workers did not finish within 600 s (hang in a collective?)")
    for r, p in enumerate(procs):
        if p.returncode != 0:
            return f"rank {r} failed (exit {p.returncode}):\n{logs[r].read_text(errors='replace')[-4000:]}"
    return ""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    pytest.importorskip("torch")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("ranks")
    for attempt in range(3):
        failed = _launch(out, _free_port())
        # The free port can be taken by another process between our probe and rank 0's bind:
        # only that is retried; any other failure is reported at once.
        if not failed or "address already in use" not in failed.lower():
            break
    assert not failed, failed
    results = []
    for r in range(WORLD):
        with open(out / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def _close(actual, expected):
    for a, e in zip(actual, expected):
        # float32 rounding: a few ulps (LAMB's all-reduced norm is summed in another order).
        np.testing.assert_allclose(a, e, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_rank(two_ranks, name, mode):
    from optirs.optim.data_parallel import DataParallelOptimizer

    one = train(DataParallelOptimizer(CASES[name](), mode=mode), initial_params(), STEPS, 0, mean_grads)
    plain = train(CASES[name](), initial_params(), STEPS, 0, mean_grads)
    r0, r1 = (two_ranks[r][f"{name}/{mode}"] for r in range(WORLD))
    _close(one, plain)
    _close(r0["final"], one)
    # ... and not what rank 0 would reach on its own gradients: the exchange did something.
    alone = train(CASES[name](), initial_params(), STEPS, 0, lambda p, t: rank_grads(p, t, 0))
    assert max(np.abs(a - b).max() for a, b in zip(alone, r0["final"])) > 1e-4
    for a, b in zip(r0["final"], r1["final"]):
        np.testing.assert_array_equal(a, b)  # the ranks never diverge
    # Re-sharded load of the gathered checkpoint on two ranks continues exactly.
    for a, b in zip(r0["resumed"], r0["final"]):
        np.testing.assert_array_equal(a, b)
    if mode == "zero1":
        from optirs.core.layout import TensorLayout
        from optirs.optim.data_parallel import ELEMENTWISE_OPTIMIZERS, ShardPlan

        opt = CASES[name]()
        plan = ShardPlan(SHAPES, WORLD, opt.name not in ELEMENTWISE_OPTIMIZERS)
        slots = len(opt.state_slots(opt.params))
        # each rank's state: its pieces' flat buffers (each piece from a multiple of 8 elements)
        held = [TensorLayout([(b - a,) for _, a, b in plan.pieces[r]]).total * 4 * slots for r in range(WORLD)]
        assert [r0["state_bytes"], r1["state_bytes"]] == held
        assert sum(plan.shard_size(r) for r in range(WORLD)) == sum(int(np.prod(s)) for s in SHAPES)
        assert max(held) < sum(held)  # each rank holds only its shard


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["adam", "sgd", "lamb-clip"])
def test_two_rank_checkpoint_loads_on_one_rank(two_ranks, name, mode):
    from optirs.optim.data_parallel import DataParallelOptimizer

    r0 = two_ranks[0][f"{name}/{mode}"]
    checkpoint = r0["checkpoint"]
    assert checkpoint["step"] == CHECKPOINT_AT and len(checkpoint["state"]) == len(SHAPES)
    for other_mode in MODES:  # a checkpoint of either mode loads into either mode
        opt = DataParallelOptimizer(CASES[name](), mode=other_mode)
        opt.load_state_dict(checkpoint)
        assert opt.step_count == CHECKPOINT_AT
        params = train(opt, [p.copy() for p in r0["at_checkpoint"]], STEPS - CHECKPOINT_AT, CHECKPOINT_AT, mean_grads)
        _close(params, r0["final"])
    plain = CASES[name]()  # and into the plain optimizer
    plain.load_state_dict(checkpoint)
    params = train(plain, [p.copy() for p in r0["at_checkpoint"]], STEPS - CHECKPOINT_AT, CHECKPOINT_AT, mean_grads)
    _close(params, r0["final"])


def test_broadcast_makes_parameters_equal(two_ranks):
    for r in range(WORLD):
        for a, b in zip(two_ranks[r]["broadcast"], initial_params()):
            np.testing.assert_array_equal(a, b)


def test_zero1_shards_lamb_on_tensor_boundaries_and_adam_evenly():
    from optirs.optim.data_parallel import ShardPlan

    even = ShardPlan(SHAPES, 2, tensor_boundaries=False)
    total = sum(int(np.prod(s)) for s in SHAPES)
    assert [even.shard_size(r) for r in range(2)] == [-(-total // 2), total - -(-total // 2)]
    whole = ShardPlan(SHAPES, 2, tensor_boundaries=True)
    sizes = [int(np.prod(s)) for s in SHAPES]
    for pieces in whole.pieces:
        assert all(a == 0 and b == sizes[t] for t, a, b in pieces)  # whole tensors only
    assert sorted(t for pieces in whole.pieces for t, _, _ in pieces) == list(range(len(SHAPES)))
    lonely = ShardPlan([(3,)], 4, tensor_boundaries=True)  # fewer tensors than ranks: some ranks idle
    assert sorted(len(p) for p in lonely.pieces) == [0, 0, 0, 1]


def test_bad_wrapping_is_refused():
    from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
    from optirs.optim.data_parallel import DataParallelOptimizer

    with pytest.raises(InvalidParameterError, match="mode='zero2'"):
        DataParallelOptimizer(CASES["adam"](), mode="zero2")
    with pytest.raises(InvalidParameterError, match="GpuOptimizer"):
        DataParallelOptimizer(object())
    stepped = CASES["adam"]()
    stepped.step_gpu(initial_params(), mean_grads(initial_params(), 0))
    with pytest.raises(InvalidParameterError, match="fresh optimizer"):
        DataParallelOptimizer(stepped, mode="zero1")
    opt = DataParallelOptimizer(CASES["adam"](), mode="zero1")
    params = initial_params()
    with pytest.raises(ShapeMismatchError, match="expected"):
        opt.step_gpu(params, mean_grads(params, 0)[:-1])
    with pytest.raises(UnsupportedOperationError, match="OpenCL"):
        from optirs.optim.data_parallel import _torch_view

        _torch_view(type("Buffer", (), {})(), "params[0]")
    assert opt.step_count == 0


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
