"""optirs.torch.CPUOffload under FSDP2 (``fully_shard``): spawned gloo groups on the CPU.

This file is also the ranks' program (``python tests/test_torch_offload_fsdp.py MODE CHECKDIR`` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set). Two ranks check that CPUOffload over an
optirs.torch AdamW steps each rank's local shards bit for bit as the same AdamW without offload
on the same sharding (float32 and bfloat16 state, bfloat16 parameters on float32 or remainder16
masters, the steps started in backward, GradScaler, a chunk step that fails once, a
KeyboardInterrupt during the step), that its state is DTensors placed as the parameters, that a
distributed checkpoint loads with exactly the saved state into the same sharding, a dim-1
sharding and the optimizer without offload and resumes, that Replicate parameters take a
per-tensor optimizer (LAMB), and that what a shard cannot step is refused with the step changing
nothing. Then one rank loads the two ranks' checkpoint (2 -> 1 reshard) and resumes. On the CPU
the "transfers" are host copies; the hooks, chunks, workers and state bookkeeping are the
offload's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from test_torch_fsdp import dist, spawn, torch  # (its module-level skips: no gloo, no FSDP2)

from fsdp_worker import batch, leave_group_and_exit, train

STEPS = 4


# ---------------------------------------------------------------- the pytest side

def _spawn(mode: str, world: int, checkdir: Path) -> None:
    report = spawn(Path(__file__), [mode, checkdir], world)
    assert (checkdir / f"{mode}-done").read_text() == "ok", report


def test_cpu_offload_under_fsdp2_two_ranks_then_resharded_to_one(tmp_path):
    _spawn("two", 2, tmp_path)
    _spawn("one", 1, tmp_path)  # the two ranks' checkpoint on one rank


@pytest.mark.gpu
def test_cuda_fsdp2_equals_the_optimizer_without_offload(tmp_path):
    """One rank (nccl) on a CUDA mesh: real copies on the side streams, FSDP2's reduce-scatter
    stream calling the hooks, host DTensors on a CUDA mesh through a distributed checkpoint."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs torch with a real CUDA GPU and nccl")
    _spawn("cuda", 1, tmp_path)


# ---------------------------------------------------------------- the ranks

def make_model(seed=0):
    torch.manual_seed(seed)
    # 16, 3 and 1 rows over 2 ranks: an even shard, an uneven one (rank 1 holds 1 of the 3) and an
    # empty one (rank 1 holds none of the last layer)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 1))


def offload(params, **kwargs):
    import optirs.torch as ot

    # tiny chunks: the model's six tensors fall into several, so both workers work
    return ot.CPUOffload(ot.AdamW, params, bucket_elements=40, workers=2, lr=1e-2, weight_decay=0.1, **kwargs)


def plain(params, **kwargs):
    import optirs.torch as ot

    return ot.AdamW(params, backend="cpu", lr=1e-2, weight_decay=0.1, **kwargs)


def full(model):
    return [p.full_tensor() for p in model.parameters()]


def full_state(model, opt):
    """The parameters and every state tensor, gathered whole (what a checkpoint holds)."""
    out = full(model)
    for p in model.parameters():
        st = opt.state[p]
        out += [st[k].full_tensor() for k in sorted(st) if k != "step"] + [st["step"].clone()]
    return out


def mirrored(ours, model, other, **kwargs):
    """The same AdamW without offload over ``other``'s copies of the offload's chunks, one group
    each, in the chunks' order: the same layouts, so the same kernel draws the same stochastic
    rounding bits for bfloat16 state (they depend on an element's index in its layout)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    params = list(other.parameters())
    return plain([{"params": [params[index[id(p)]] for p in c.params]} for c in ours._chunks], **kwargs)


def assert_equal(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: tensor {i} differs by {(x.float() - y.float()).abs().max()}"


def assert_dtensor_state(opt, model, dtype=torch.float32):
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            v = st[key]
            assert isinstance(v, DTensor) and v.placements == p.placements and v.device_mesh == p.device_mesh, key
            assert v.shape == p.shape and v.to_local().shape == p.to_local().shape and v.dtype == dtype, key
            assert v.to_local().device.type == "cpu"
        assert not isinstance(st["step"], DTensor)


def check_equals_the_same_optimizer_without_offload(mesh):
    from torch.distributed.fsdp import fully_shard

    from optirs.torch.offload import OffloadTiming

    for fmt, extra in (({}, {}), ({"state_dtype": "bfloat16"}, {}), ({}, {"step_in_backward": True})):
        ours, theirs = make_model(), make_model()
        fully_shard(ours, mesh=mesh)
        fully_shard(theirs, mesh=mesh)
        mine = offload(ours.parameters(), **fmt, **extra)
        opts = mine, (mirrored(mine, ours, theirs, **fmt) if fmt else plain(theirs.parameters()))
        assert len(mine._chunks) > 1
        mine.timing = OffloadTiming()
        for step in range(STEPS):
            for m, o in zip((ours, theirs), opts):
                train(m, o, 1, step)
            assert_equal([p.to_local() for p in ours.parameters()], [q.to_local() for q in theirs.parameters()],
                         f"{fmt} {extra} step {step}")
        if extra:  # the later rounds' chunk steps started in backward, from FSDP2's gradient hooks
            assert mine._armed and mine.timing.early_chunks > 0
        assert_dtensor_state(opts[0], ours, torch.bfloat16 if fmt else torch.float32)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            a, b = opts[0].state[p], opts[1].state[q]
            assert set(a) == set(b)
            for key in a:
                if key != "step":
                    assert torch.equal(a[key].to_local(), b[key].to_local()), key
            assert float(a["step"]) == float(b["step"]) == STEPS
        # the host state really is the offload's: its chunks' inner optimizers hold these bytes
        p = next(ours.parameters())
        c, k = opts[0]._where[p]
        assert opts[0].state[p]["exp_avg"].to_local().data_ptr() == c.inner.state[c.host[k]]["exp_avg"].data_ptr()


def check_16bit_parameters(mesh):
    # bfloat16 FSDP2 parameters: float32 masters (stepped apart with fuse_conversions=False: WIDEN)
    # or remainder16 masters (the formats step: FUSED) on the host, the masters shown as DTensors too
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import optirs.torch.offload as offload_mod

    for fmt, apart, mode in (({}, {"fuse_conversions": False}, offload_mod.WIDEN),
                             ({"master_weights": "remainder16"}, {}, offload_mod.FUSED)):
        ours, theirs = make_model().to(torch.bfloat16), make_model().to(torch.bfloat16)
        fully_shard(ours, mesh=mesh)
        fully_shard(theirs, mesh=mesh)
        opts = (offload(ours.parameters(), **fmt, **apart),
                plain(theirs.parameters(), **{"master_weights": "float32", **fmt}))
        assert {c.mode for c in opts[0]._chunks} == {mode}
        for step in range(STEPS):
            for m, o in zip((ours, theirs), opts):
                o.zero_grad()
                (m(batch(step).to(torch.bfloat16)) ** 2).float().mean().backward()
                o.step()
            assert_equal([p.to_local() for p in ours.parameters()], [q.to_local() for q in theirs.parameters()],
                         f"bfloat16 parameters {fmt} step {step}")
        sd, ref = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
        key = "master_remainder" if fmt else offload_mod.MASTER_KEY
        for i, p in enumerate(ours.parameters()):
            master = sd[i][key]
            assert isinstance(master, DTensor) and master.placements == p.placements and master.shape == p.shape
            assert master.to_local().device.type == "cpu" and torch.equal(master.to_local(), ref[i][key].to_local())


def check_checkpoints(mesh, checkdir):
    """3 steps, a distributed checkpoint, 3 more; a model and optimizer loaded from the checkpoint
    (the same sharding, dim 1 instead of dim 0, the optimizer without offload) hold the saved
    state exactly and resume to the same bits (bfloat16 state: in another layout, to its rounding;
    its stochastic rounding draws by the element's index in the layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for name, fmt in (("f32", {}), ("bf16", {"state_dtype": "bfloat16"})):
        model = make_model()
        fully_shard(model, mesh=mesh)
        opt = offload(model.parameters(), **fmt)
        train(model, opt, 3)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(checkdir / f"ckpt-{name}"))
        saved = full_state(model, opt)
        train(model, opt, 3, 3)
        expected = full(model)
        if dist.get_rank() == 0:
            torch.save({"saved": saved, "expected": expected}, checkdir / f"expected-{name}.pt")
        dim1 = {"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % 2 == 0 else Shard(0)}
        for how, shard, make_opt in (("same", {}, offload), ("dim 1", dim1, offload), ("no offload", {}, plain)):
            other = make_model(seed=1)
            fully_shard(other, mesh=mesh, **shard)
            other_opt = make_opt(other.parameters(), **fmt)
            msd, osd = get_state_dict(other, other_opt)  # (the state made by a first step of zeros, lr 0)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(checkdir / f"ckpt-{name}"))
            set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            if make_opt is offload:
                assert_dtensor_state(other_opt, other, torch.bfloat16 if fmt else torch.float32)
            assert_equal(full_state(other, other_opt), saved, f"{name} checkpoint loaded ({how})")
            train(other, other_opt, 3, 3)
            resumed(full(other), expected, exact=not fmt or how == "same", what=f"{name} checkpoint resumed ({how})")


def resumed(got, expected, exact, what):
    if exact:
        assert_equal(got, expected, what)
    else:  # bfloat16 moments rounded with other random bits: 3 steps apart by <= 1.6e-4 (measured);
        # resumed without the loaded moments they are 3e-3 .. 3e-2 apart
        for x, y in zip(got, expected):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-3, msg=what)


def check_grad_scaler(mesh):
    # torch.amp.GradScaler drives the offload as the optimizer without offload (its scale folded
    # into the step); an inf on every rank skips the step on both
    from torch.distributed.fsdp import fully_shard

    ours, theirs = make_model(), make_model()
    fully_shard(ours, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opts = offload(ours.parameters()), plain(theirs.parameters())
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2) for _ in opts]
    for step in range(STEPS):
        for m, o, scaler in zip((ours, theirs), opts, scalers):
            o.zero_grad()
            scaler.scale((m(batch(step)) ** 2).mean()).backward()
            if step == 2:
                next(m.parameters()).grad.to_local().view(-1)[0] = float("inf")
            scaler.step(o)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert_equal([p.to_local() for p in ours.parameters()], [q.to_local() for q in theirs.parameters()],
                     f"GradScaler step {step}")
    assert float(opts[0].state[next(ours.parameters())]["step"]) == STEPS - 1


def check_interrupted_steps(mesh):
    # a chunk whose CPU step fails once is retried and the step completes; a KeyboardInterrupt
    # during the step lands after it: both as the uninterrupted optimizer without offload
    import _thread

    from optirs.core.errors import GpuOptimError
    from torch.distributed.fsdp import fully_shard

    ours, theirs = make_model(), make_model()
    fully_shard(ours, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opts = offload(ours.parameters()), plain(theirs.parameters())
    train(ours, opts[0], 2)
    train(theirs, opts[1], 2)
    for step, how in ((2, "fails once"), (3, "interrupted")):
        chunk = opts[0]._chunks[1]
        real = chunk.inner.step
        calls = []

        def flaky(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                if how == "fails once":
                    raise RuntimeError("injected worker failure")
                _thread.interrupt_main()  # a SIGINT while the workers are stepping
            return real(*a, **k)

        chunk.inner.step = flaky
        for m, o in zip((ours, theirs), opts):
            o.zero_grad()
            (m(batch(step)) ** 2).mean().backward()
        try:
            opts[0].step()
            for _ in range(1000):  # the interrupt is delivered by the main thread's next bytecodes
                pass
        except GpuOptimError as exc:
            assert how == "fails once" and "completed by retrying" in str(exc), exc
        except KeyboardInterrupt:
            assert how == "interrupted"
        else:
            raise AssertionError(f"{how}: step() raised nothing")
        del chunk.inner.step
        opts[1].step()
        assert_equal([p.to_local() for p in ours.parameters()], [q.to_local() for q in theirs.parameters()], how)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(opts[0].state[p]["exp_avg_sq"].to_local(), opts[1].state[q]["exp_avg_sq"].to_local())


def check_replicated_parameters_take_per_tensor_optimizers(mesh):
    # Replicate: each rank's local tensor is the whole tensor, so LAMB's norms are its own
    import optirs.torch as ot
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch.manual_seed(3)
    w = torch.randn(8, 5)
    p = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Replicate()]))
    ref = torch.nn.Parameter(w.clone())
    ours = ot.CPUOffload(ot.Lamb, [p], lr=1e-2)
    theirs = ot.Lamb([ref], lr=1e-2, backend="cpu")
    for step in range(3):
        g = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
        p.grad = distribute_tensor(g.clone(), mesh, [Replicate()])
        ref.grad = g.clone()
        ours.step()
        theirs.step()
        assert torch.equal(p.to_local(), ref.detach()), step
    st = ours.state[p]
    assert st["exp_avg"].placements == (Replicate(),) and torch.equal(st["exp_avg"].to_local(),
                                                                      theirs.state[ref]["exp_avg"])
    # int8 state of a Replicate parameter: as the same AdamW without offload on the same DTensor,
    # its scales shown on the block grid as that optimizer shows them
    a, b = (torch.nn.Parameter(distribute_tensor(torch.randn(64, 80, generator=torch.Generator().manual_seed(5)),
                                                 mesh, [Replicate()])) for _ in range(2))
    opts = offload([a], state_dtype="int8"), plain([b], state_dtype="int8")
    for step in range(3):
        g = torch.randn(64, 80, generator=torch.Generator().manual_seed(10 + step))
        for q, o in zip((a, b), opts):
            q.grad = distribute_tensor(g.clone(), mesh, [Replicate()])
            o.step()
        assert torch.equal(a.to_local(), b.to_local()), step
    sa, sb = opts[0].state_dict()["state"][0], opts[1].state_dict()["state"][0]
    assert set(sa) == set(sb) and sa["exp_avg.codes"].dtype == torch.uint8
    for key in sa:
        if key != "step":
            assert sa[key].shape == sb[key].shape and sa[key].placements == sb[key].placements, key
            assert torch.equal(sa[key].to_local(), sb[key].to_local()), key


def check_refusals(mesh):
    import optirs.torch as ot
    from optirs.core.errors import ShapeMismatchError, UnsupportedOperationError
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Partial, Replicate, Shard

    model = make_model()
    fully_shard(model, mesh=mesh)

    def refused(make, match):
        try:
            make()
        except UnsupportedOperationError as exc:
            assert match in str(exc), exc
            return
        raise AssertionError(f"not refused: {match}")

    # what needs the whole tensor, or int8 blocks that a reshard would cut, on sharded parameters
    refused(lambda: ot.CPUOffload(ot.Adafactor, model.parameters(), lr=1e-2), "adafactor's per-tensor reductions")
    refused(lambda: ot.CPUOffload(ot.Lamb, model.parameters(), lr=1e-2), "lamb's per-tensor reductions")
    refused(lambda: ot.CPUOffload(ot.Lamb, model.parameters(), lr=1e-2, max_grad_norm=1.0),
            "lamb's per-tensor reductions")
    refused(lambda: ot.CPUOffload(ot.AdamW, model.parameters(), state_dtype="int8"), "int8")
    bad = torch.nn.Parameter(torch.distributed.tensor.DTensor.from_local(torch.zeros(4), mesh, [Partial()]))
    refused(lambda: ot.CPUOffload(ot.SGD, [bad], lr=0.1), "Partial")
    # the format changed to int8 after construction: refused at step(), nothing stepped
    opt = offload(model.parameters())
    train(model, opt, 1)
    before = [p.to_local().clone() for p in model.parameters()]
    state = {k: v.to_local().clone() for k, v in opt.state[next(model.parameters())].items() if k != "step"}
    opt.param_groups[0]["state_dtype"] = "int8"
    (model(batch(1)) ** 2).mean().backward()
    refused(opt.step, "int8")
    opt.param_groups[0]["state_dtype"] = "float32"
    # a gradient placed otherwise than its parameter: refused at step(), nothing stepped
    w = next(model.parameters())
    w.grad = w.grad.redistribute(mesh, [Replicate()])
    refused(opt.step, "same mesh and placements")
    assert_equal(before, [p.to_local() for p in model.parameters()], "a refused step changed a parameter")
    after = opt.state[w]
    assert all(torch.equal(v, after[k].to_local()) for k, v in state.items()) and float(after["step"]) == 1
    # ... and the same optimizer steps on once the gradient is placed as the parameter
    w.grad = w.grad.redistribute(mesh, [Shard(0)])
    opt.step()
    assert float(opt.state[w]["step"]) == 2
    # a checkpoint whose state of a sharded parameter is a whole plain tensor: refused, nothing loaded
    sd = opt.state_dict()
    kept = opt.state[w]["exp_avg"].to_local().clone()
    bad = {**sd, "state": {**sd["state"], 0: {**sd["state"][0], "exp_avg": sd["state"][0]["exp_avg"].full_tensor()}}}
    try:
        opt.load_state_dict(bad)
    except ShapeMismatchError as exc:
        assert "state[0]['exp_avg']" in str(exc) and "shard" in str(exc), exc
    else:
        raise AssertionError("a whole tensor loaded as a shard's state")
    assert torch.equal(opt.state[w]["exp_avg"].to_local(), kept) and float(opt.state[w]["step"]) == 2


def check_two_ranks(checkdir):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    check_equals_the_same_optimizer_without_offload(mesh)
    check_16bit_parameters(mesh)
    check_checkpoints(mesh, checkdir)
    check_grad_scaler(mesh)
    check_interrupted_steps(mesh)
    check_replicated_parameters_take_per_tensor_optimizers(mesh)
    check_refusals(mesh)


def check_one_rank(checkdir):
    """The two ranks' checkpoints on one rank (every shard gathered into one), resumed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for name, fmt in (("f32", {}), ("bf16", {"state_dtype": "bfloat16"})):
        model = make_model(seed=1)
        fully_shard(model, mesh=mesh)
        opt = offload(model.parameters(), **fmt)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(checkdir / f"ckpt-{name}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert_dtensor_state(opt, model, torch.bfloat16 if fmt else torch.float32)
        ref = torch.load(checkdir / f"expected-{name}.pt")
        assert_equal(full_state(model, opt), ref["saved"], f"{name} checkpoint loaded on one rank")
        train(model, opt, 3, 3)
        resumed(full(model), ref["expected"], exact=not fmt, what=f"{name} resharded 2 -> 1")


def check_cuda(checkdir):
    """On a CUDA mesh: the offload (steps at step() and in backward) against the same AdamW on the
    GPU, to float32 rounding (cuda and cpu kernels); its state on the host as DTensors of the CUDA
    mesh; a distributed checkpoint of that state resumes exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import optirs.torch as ot

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))

    def on_gpu(seed=0):
        model = make_model(seed).cuda()
        fully_shard(model, mesh=mesh)
        return model

    def run(model, opt, steps, first=0):
        for step in range(first, first + steps):
            opt.zero_grad()
            (model(batch(step).cuda()) ** 2).mean().backward()
            opt.step()

    for extra in ({}, {"step_in_backward": True}):
        ours, theirs = on_gpu(), on_gpu()
        opts = offload(ours.parameters(), **extra), ot.AdamW(theirs.parameters(), backend="cuda", lr=1e-2,
                                                             weight_decay=0.1)
        for step in range(STEPS):
            for m, o in zip((ours, theirs), opts):
                run(m, o, 1, step)
            for p, q in zip(ours.parameters(), theirs.parameters()):
                torch.testing.assert_close(p.to_local(), q.to_local(), rtol=1e-4, atol=1e-5)
        assert_dtensor_state(opts[0], ours)
        assert all(p.to_local().is_cuda for p in ours.parameters())
    model = on_gpu()
    opt = offload(model.parameters())
    run(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(checkdir / "ckpt-cuda"))
    run(model, opt, 3, 3)
    other = on_gpu(seed=1)
    other_opt = offload(other.parameters())
    msd, osd = get_state_dict(other, other_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(checkdir / "ckpt-cuda"))
    set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_dtensor_state(other_opt, other)
    run(other, other_opt, 3, 3)
    assert_equal(full(other), full(model), "a checkpoint on the CUDA mesh resumed")


def main():
    mode, checkdir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("nccl" if mode == "cuda" else "gloo")
    {"two": check_two_ranks, "one": check_one_rank, "cuda": check_cuda}[mode](checkdir)
    dist.barrier()
    if dist.get_rank() == 0:
        (checkdir / f"{mode}-done").write_text("ok")
    leave_group_and_exit(checkdir, mode)


if __name__ == "__main__":
    import signal

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a shell's background job starts ignoring it)
    main()
