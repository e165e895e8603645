"""One rank of tests/test_torch_fsdp.py's process group (gloo, CPU): FSDP2 checks of optirs.torch.

Run as ``python tests/fsdp_worker.py CHECKDIR`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set (as torchrun sets them). Every check runs in this one group; a failed assertion exits non-zero
with its traceback on stderr; rank 0 writes ``done`` into CHECKDIR at the end.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import optirs.torch as ot
from optirs.torch._mesh_adafactor import factor_placements
from optirs.core.errors import UnsupportedOperationError

STEPS = 4


def make_model(seed=0):
    torch.manual_seed(seed)
    # 16 and 3 rows: an even and an uneven shard over 2 ranks (rank 1 holds 1 of the 3)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank: FSDP's mean is it
    return torch.randn(5, 6, generator=g)


def train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        (model(batch(step)) ** 2).mean().backward()
        opt.step()


def sharded(model, mesh):
    fully_shard(model, mesh=mesh)
    return model


def full(model):
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


def close(a, b, tol=dict(rtol=1e-5, atol=1e-6)):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **tol)


def check_adamw_equals_torch(mesh):
    # optirs and torch on the same sharding; both against torch on the whole model
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    ours = sharded(make_model(), mesh=mesh)
    theirs = sharded(make_model(), mesh=mesh)
    plain = make_model()
    opts = [ot.AdamW(ours.parameters(), backend="cpu", **kwargs), torch.optim.AdamW(theirs.parameters(), **kwargs),
            torch.optim.AdamW(plain.parameters(), **kwargs)]
    for step in range(STEPS):
        for m, o in zip((ours, theirs, plain), opts):
            train(m, o, 1, step)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p.to_local(), q.to_local(), rtol=1e-6, atol=1e-7)
        close(full(ours), full(plain))
    for p in ours.parameters():  # state: DTensors placed as the parameters, local shards of the flat buffers
        st = opts[0].state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(st[key], DTensor) and st[key].placements == p.placements, key
            assert st[key].shape == p.shape and st[key].to_local().shape == p.to_local().shape
            torch.testing.assert_close(st[key].full_tensor(), opts[1].state[q_of(ours, theirs, p)][key].full_tensor(),
                                       rtol=1e-5, atol=1e-8)
    return ours, opts[0]


def q_of(ours, theirs, p):
    return dict(zip(map(id, ours.parameters()), theirs.parameters()))[id(p)]


def check_other_elementwise_optimizers(mesh):
    # every elementwise definition steps shards the same way: a few against torch on the same sharding
    for name, kwargs in (("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
                         ("RMSprop", dict(lr=1e-2, centered=True)), ("Adagrad", dict(lr=0.05))):
        ours, theirs = sharded(make_model(), mesh), sharded(make_model(), mesh)
        opts = getattr(ot, name)(ours.parameters(), backend="cpu", **kwargs), \
            getattr(torch.optim, name)(theirs.parameters(), **kwargs)
        for step in range(STEPS):
            for m, o in zip((ours, theirs), opts):
                train(m, o, 1, step)
        close(full(ours), full(theirs), dict(rtol=1e-5, atol=1e-7))
    # bfloat16 FSDP2 parameters over float32 masters: the masters are DTensors too
    model = sharded(make_model().to(torch.bfloat16), mesh)
    opt = ot.AdamW(model.parameters(), lr=1e-2, master_weights="float32", backend="cpu")
    for step in range(2):
        opt.zero_grad()
        (model(batch(step).to(torch.bfloat16)) ** 2).float().mean().backward()
        opt.step()
    for p in model.parameters():
        master = opt.state[p]["master"]
        assert isinstance(master, DTensor) and master.dtype == torch.float32 and master.placements == p.placements
        torch.testing.assert_close(master.to_local().to(torch.bfloat16), p.to_local(), rtol=0, atol=0)


def check_bfloat16_state(mesh):
    model = sharded(make_model(), mesh=mesh)
    plain = make_model()
    opt = ot.AdamW(model.parameters(), lr=1e-2, state_dtype="bfloat16", backend="cpu")
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(STEPS):
        train(model, opt, 1, step)
        train(plain, ref, 1, step)
    close(full(model), full(plain), dict(rtol=2e-2, atol=2e-3))  # bfloat16 moments: their rounding
    for p in model.parameters():
        m = opt.state[p]["exp_avg"]
        assert isinstance(m, DTensor) and m.dtype == torch.bfloat16 and m.placements == p.placements


def check_checkpoint_round_trip_and_reshard(mesh, checkdir):
    # 3 steps, a distributed checkpoint, 3 more: a model loaded from the checkpoint (sharded the same
    # way, then along dim 1 instead of dim 0) resumes to the same parameters
    model = sharded(make_model(), mesh=mesh)
    opt = ot.AdamW(model.parameters(), lr=1e-2, backend="cpu")
    train(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(checkdir / "ckpt"))
    train(model, opt, 3, 3)
    expected = full(model)
    for placement in (None, lambda p: Shard(1) if p.dim() == 2 else Shard(0)):
        other = make_model(seed=1)
        fully_shard(other, mesh=mesh, **({} if placement is None else {"shard_placement_fn": placement}))
        other_opt = ot.AdamW(other.parameters(), lr=1e-2, backend="cpu")
        msd, osd = get_state_dict(other, other_opt)  # (the optimizer's state made by a first step of zeros)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(checkdir / "ckpt"))
        set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for p in other.parameters():
            st = other_opt.state[p]
            assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].placements == p.placements
        train(other, other_opt, 3, 3)
        close(full(other), expected, dict(rtol=1e-6, atol=1e-7))


def int8_model(seed=0):
    torch.manual_seed(seed)
    # int8 state needs tensors of 4096+ elements: a (16, 512) weight (rows of 2 blocks), a (256, 16)
    # one (blocks across rows: Shard(0) chunks of 2048 elements, whole blocks; each rank's shard has
    # fewer than 4096 elements, yet int8 as the whole tensor), two small biases (float32 state)
    return torch.nn.Sequential(torch.nn.Linear(512, 16), torch.nn.Tanh(), torch.nn.Linear(16, 256))


def int8_train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(200 + step))
        (model(x) ** 2).mean().backward()
        opt.step()


def check_int8_state(mesh, checkdir):
    # int8 AdamW on FSDP2: the running state int8 DTensors placed as the parameters, the shards'
    # trajectory that of int8 AdamW on the whole model, a DCP checkpoint resumed exactly into the
    # same sharding and into another (the first weight's dim 1)
    kwargs = dict(lr=1e-2, weight_decay=0.1, state_dtype="int8", backend="cpu")
    model, plain = sharded(int8_model(), mesh), int8_model()
    opt, ref = ot.AdamW(model.parameters(), **kwargs), ot.AdamW(plain.parameters(), **kwargs)
    int8_train(model, opt, 3)
    int8_train(plain, ref, 3)
    close(full(model), full(plain), dict(rtol=0, atol=0))
    for p, q in zip(model.parameters(), plain.parameters()):
        st, rt = opt.state[p], ref.state[q]
        assert set(st) == set(rt), (sorted(st), sorted(rt))
        for key, value in st.items():
            if key == "step":
                continue
            assert isinstance(value, DTensor) and value.placements == p.placements, key
            whole = value.full_tensor()
            assert whole.dtype == rt[key].dtype, key
            torch.testing.assert_close(whole.reshape(rt[key].shape), rt[key], rtol=0, atol=0)
        if p.numel() >= 4096:
            codes = st["exp_avg.codes"]
            assert codes.dtype == torch.uint8 and codes.to_local().shape == p.to_local().shape
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(checkdir / "int8"))
    int8_train(model, opt, 3, 3)
    expected = full(model)
    for placement in (None, lambda p: Shard(1) if p.shape == (16, 512) else Shard(0)):
        other = int8_model(seed=1)
        fully_shard(other, mesh=mesh, **({} if placement is None else {"shard_placement_fn": placement}))
        other_opt = ot.AdamW(other.parameters(), **kwargs)
        msd, osd = get_state_dict(other, other_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(checkdir / "int8"))
        set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        int8_train(other, other_opt, 3, 3)
        close(full(other), expected, dict(rtol=0, atol=0))
        assert other_opt.state[next(other.parameters())]["exp_avg.codes"].placements == \
            next(other.parameters()).placements
    # into one rank (a mesh of rank 0 alone): the whole tensors' blocks, resumed exactly
    from torch.distributed.device_mesh import DeviceMesh

    solo = DeviceMesh("cpu", torch.tensor([0]))
    if dist.get_rank() == 0:
        other = sharded(int8_model(seed=1), solo)
        other_opt = ot.AdamW(other.parameters(), **kwargs)
        msd, osd = get_state_dict(other, other_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(checkdir / "int8"), process_group=solo.get_group())
        set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        int8_train(other, other_opt, 3, 3)
        close(full(other), expected, dict(rtol=0, atol=0))
    dist.barrier()


def check_adafactor_over_the_mesh(mesh, checkdir):
    # Adafactor on FSDP2 (row and column sums of g^2 and the RMS reduced over the mesh) against
    # optirs's and torch's Adafactor on the whole model; the factors as DTensors (Replicate over the
    # mesh dims that shard the dim they sum over); a DCP checkpoint resumed into the same sharding
    # (exactly) and into a dim-1 one (the sums reduced in another order: float64 sums rounded once)
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    model, plain, theirs = sharded(make_model(), mesh), make_model(), make_model()
    opts = (ot.Adafactor(model.parameters(), backend="cpu", **kwargs),
            ot.Adafactor(plain.parameters(), backend="cpu", **kwargs),
            torch.optim.Adafactor(theirs.parameters(), **kwargs))
    for step in range(3):
        for m, o in zip((model, plain, theirs), opts):
            train(m, o, 1, step)
    close(full(model), full(plain), dict(rtol=1e-6, atol=1e-7))
    close(full(model), full(theirs), dict(rtol=1e-5, atol=1e-6))
    for p, q in zip(model.parameters(), plain.parameters()):
        st, rt = opts[0].state[p], opts[1].state[q]
        assert set(st) == set(rt) and float(st["step"]) == 3, (sorted(st), sorted(rt))
        for key in set(st) - {"step"}:
            wanted = (Replicate(),) if key == "col_var" else p.placements
            assert isinstance(st[key], DTensor) and st[key].placements == wanted, (key, st[key])
            torch.testing.assert_close(st[key].full_tensor(), rt[key], rtol=1e-6, atol=1e-12)
    msd, osd = get_state_dict(model, opts[0])
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(checkdir / "adafactor"))
    train(model, opts[0], 3, 3)
    expected = full(model)
    for placement, tol in ((None, dict(rtol=0, atol=0)), (lambda p: Shard(1) if p.dim() == 2 else Shard(0),
                                                            dict(rtol=1e-6, atol=1e-7))):
        other = make_model(seed=1)
        fully_shard(other, mesh=mesh, **({} if placement is None else {"shard_placement_fn": placement}))
        other_opt = ot.Adafactor(other.parameters(), backend="cpu", **kwargs)
        msd, osd = get_state_dict(other, other_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(checkdir / "adafactor"))
        set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train(other, other_opt, 3, 3)
        close(full(other), expected, tol)
        w = next(other.parameters())
        assert other_opt.state[w]["row_var"].placements == factor_placements(w, -1)
    # a 3-dim tensor sharded on each dim (a batch dim, the rows, the columns), maximize included
    torch.manual_seed(5)
    w = torch.randn(2, 6, 5)
    for dim in range(3):
        p = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(dim)]))
        q = torch.nn.Parameter(w.clone())
        ours, ref = (ot.Adafactor([t], lr=1e-2, maximize=True, backend="cpu") for t in (p, q))
        for step in range(3):
            g = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(step))
            p.grad, q.grad = distribute_tensor(g.clone(), mesh, [Shard(dim)]), g.clone()
            ours.step()
            ref.step()
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-7)


def check_refusals(mesh):
    model = sharded(make_model(), mesh=mesh)
    low = sharded(make_model().to(torch.bfloat16), mesh)  # (Adafactor's mesh step runs float32)
    for cls, kwargs, net, match in ((ot.Lamb, {"bias_correction": False}, model, "bias_correction=False"),
                                    (ot.Adafactor, {"lr": 1e-2}, low, "expected float32 parameters")):
        opt = cls(net.parameters(), backend="cpu", **kwargs)
        (net(batch(0).to(next(net.parameters()).dtype)) ** 2).float().mean().backward()
        before = [p.to_local().clone() for p in net.parameters()]
        try:
            opt.step()
        except UnsupportedOperationError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"{cls.__name__} stepped sharded parameters")
        assert all(torch.equal(a, p.to_local()) for a, p in zip(before, net.parameters())) and not opt.state
        opt.zero_grad()
    # int8 shards that would cut 256-element blocks: rows of 100 in chunks of 24 rows (2400
    # elements), and a dim-1 shard inside the blocks of a (256, 16) tensor
    for shape, placement in (((48, 100), Shard(0)), ((256, 16), Shard(1))):
        big = torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [placement]))
        big.grad = distribute_tensor(torch.ones(shape), mesh, [placement])
        opt = ot.AdamW([big], state_dtype="int8", backend="cpu")
        try:
            opt.step()
        except UnsupportedOperationError as exc:
            assert "int8 state" in str(exc) and "cut no 256-element block" in str(exc), exc
        else:
            raise AssertionError(f"int8 state stepped on a {shape} parameter placed {placement}")
        assert not opt.state and not big.to_local().any()
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(4), mesh, [Shard(0)]))
    p.grad = DTensor.from_local(torch.ones(8), mesh, [Partial()])  # (a whole (8,) tensor per rank, to sum)
    try:
        ot.SGD([p], lr=0.1).step()
    except UnsupportedOperationError as exc:
        assert "same mesh and placements" in str(exc), exc
    else:
        raise AssertionError("a Partial gradient was stepped")
    q = torch.nn.Parameter(DTensor.from_local(torch.zeros(4), mesh, [Partial()]))
    q.grad = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    try:
        ot.SGD([q], lr=0.1).step()
    except UnsupportedOperationError as exc:
        assert "Partial" in str(exc), exc
    else:
        raise AssertionError("a Partial parameter was stepped")


def check_lamb_norms_over_the_mesh(mesh):
    # LAMB on FSDP2 (norms of the shards summed over the mesh) equals LAMB on the whole model
    for kwargs in (dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05, max_trust_ratio=5.0)):
        model, plain = sharded(make_model(), mesh), make_model()
        ours, ref = ot.Lamb(model.parameters(), backend="cpu", **kwargs), ot.Lamb(plain.parameters(), backend="cpu",
                                                                                  **kwargs)
        for step in range(STEPS):
            train(model, ours, 1, step)
            train(plain, ref, 1, step)
        close(full(model), full(plain), dict(rtol=1e-5, atol=1e-6))
        for p, q in zip(model.parameters(), plain.parameters()):
            st = ours.state[p]
            assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].placements == p.placements
            torch.testing.assert_close(st["exp_avg_sq"].full_tensor(), ref.state[q]["exp_avg_sq"], rtol=1e-5,
                                       atol=1e-9)
            assert float(st["step"]) == STEPS


def check_replicated_lamb(mesh):
    # Replicate placements: each rank's local tensor is the whole tensor, so LAMB's norms are right
    torch.manual_seed(3)
    w = torch.randn(8, 5)
    p = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [torch.distributed.tensor.Replicate()]))
    ref = torch.nn.Parameter(w.clone())
    ours, theirs = ot.Lamb([p], lr=1e-2, backend="cpu"), ot.Lamb([ref], lr=1e-2, backend="cpu")
    for step in range(3):
        g = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
        p.grad = distribute_tensor(g.clone(), mesh, [torch.distributed.tensor.Replicate()])
        ref.grad = g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(p.to_local(), ref.detach(), rtol=0, atol=0)
    assert isinstance(ours.state[p]["exp_avg"], DTensor)


def check_ddp():
    # DistributedDataParallel, each rank its own batch: the averaged gradients, one optirs step per
    # rank, the ranks in sync and equal to torch's AdamW under DDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours, theirs = DDP(make_model()), DDP(make_model())
    opts = ot.AdamW(ours.parameters(), lr=1e-2, backend="cpu"), torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    rank = dist.get_rank()
    for step in range(STEPS):
        for m, o in zip((ours, theirs), opts):
            o.zero_grad()
            (m(batch(10 * step + rank)) ** 2).mean().backward()
            o.step()
    close(list(ours.parameters()), list(theirs.parameters()), dict(rtol=1e-6, atol=1e-7))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [p.detach() for p in ours.parameters()])
    close(gathered[0], gathered[1], dict(rtol=0, atol=0))


def check_muon_gathers_each_matrix(mesh):
    # Muon on FSDP2 (the whole matrix gathered for Newton-Schulz) against torch.optim.Muon unsharded
    model, plain = sharded(make_model(), mesh), make_model()
    weights = lambda m: [p for p in m.parameters() if p.dim() == 2]  # noqa: E731
    others = lambda m: [p for p in m.parameters() if p.dim() != 2]  # noqa: E731
    opts = [(ot.Muon(weights(model), lr=0.02, backend="cpu"), ot.AdamW(others(model), lr=1e-2, backend="cpu")),
            (torch.optim.Muon(weights(plain), lr=0.02), torch.optim.AdamW(others(plain), lr=1e-2))]
    for step in range(STEPS):
        for m, (muon, adamw) in zip((model, plain), opts):
            muon.zero_grad()
            adamw.zero_grad()
            (m(batch(step)) ** 2).mean().backward()
            muon.step()
            adamw.step()
    close(full(model), full(plain), dict(rtol=1e-4, atol=2e-5))
    for p in weights(model):
        buf = opts[0][0].state[p]["momentum_buffer"]
        assert isinstance(buf, DTensor) and buf.placements == p.placements


def main():
    checkdir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    check_adamw_equals_torch(mesh)
    check_bfloat16_state(mesh)
    check_other_elementwise_optimizers(mesh)
    check_checkpoint_round_trip_and_reshard(mesh, checkdir)
    check_int8_state(mesh, checkdir)
    check_adafactor_over_the_mesh(mesh, checkdir)
    check_refusals(mesh)
    check_replicated_lamb(mesh)
    check_lamb_norms_over_the_mesh(mesh)
    check_muon_gathers_each_matrix(mesh)
    check_ddp()
    dist.barrier()
    if dist.get_rank() == 0:
        (checkdir / "done").write_text("ok")
    leave_group_and_exit(checkdir, "fsdp")


def leave_group_and_exit(checkdir: Path, tag: str) -> None:
    """A rank's last call, its checks passed: ``destroy_process_group`` with rank 0 last (rank 0 hosts
    the group's TCPStore, so it waits, up to two minutes, until every other rank has torn its group
    down and said so in ``checkdir``), then the process ends at once (``os._exit``). Under load a
    rank once aborted in its teardown (std::terminate) after its peers had exited, and rank 0 still
    did in the interpreter's own teardown of torch's distributed objects, at exit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank:
        dist.destroy_process_group()
        (checkdir / f"{tag}-left-{rank}").write_text("ok")
    else:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all((checkdir / f"{tag}-left-{r}").exists() for r in range(1, world)):
            time.sleep(0.05)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
