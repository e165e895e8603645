"""optirs.torch on any dense layout: channels_last and other permuted strides stepped in place.

Each trajectory trains a small conv model moved to ``channels_last`` with a torch.optim optimizer
and the optirs.torch one of the same arguments, and compares the parameters (and their strides:
they stay channels_last) after every step; the state keeps the parameters' strides as torch's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import optirs.torch as ot  # noqa: E402
from optirs.core import reference  # noqa: E402
from optirs.core.errors import ShapeMismatchError, UnsupportedOperationError  # noqa: E402
from optirs.core.layout import storage_order  # noqa: E402

STEPS = 12
TOL = dict(rtol=2e-5, atol=2e-6)


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 2),
                                torch.nn.Flatten(), torch.nn.Linear(2 * 5 * 5, 3))
    return model.to(memory_format=torch.channels_last)


DATA = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(3)).to(memory_format=torch.channels_last)


def loss_of(model):
    return (model(DATA) ** 2).mean()


def train_pair(make_ours, make_theirs, steps=STEPS, tol=TOL):
    ours_model, theirs_model = make_model(), make_model()
    ours, theirs = make_ours(ours_model.parameters()), make_theirs(theirs_model.parameters())
    for _ in range(steps):
        for model, opt in ((ours_model, ours), (theirs_model, theirs)):
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()
        for p, q in zip(ours_model.parameters(), theirs_model.parameters()):
            assert p.stride() == q.stride()
            torch.testing.assert_close(p.detach(), q.detach(), **tol)
    return ours_model, ours


@pytest.mark.parametrize("name, kwargs", [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("RMSprop", dict(lr=1e-2, centered=True, momentum=0.5)),
])
def test_channels_last_trajectory_equals_torch_and_stays_channels_last(name, kwargs):
    model, opt = train_pair(lambda ps: getattr(ot, name)(ps, backend="cpu", **kwargs),
                            lambda ps: getattr(torch.optim, name)(ps, **kwargs))
    conv = model[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    for key, value in opt.state[conv].items():
        if key != "step":  # as torch's zeros_like(p, memory_format=torch.preserve_format)
            assert value.stride() == conv.stride(), key
    # the state is the live buffers: a state_dict loads into torch's optimizer and resumes the same
    theirs = torch.optim.__dict__[name](model.parameters(), **kwargs)
    theirs.load_state_dict(opt.state_dict())
    for key in opt.state[conv]:
        torch.testing.assert_close(theirs.state[conv][key], opt.state[conv][key], rtol=0, atol=0)


def test_lamb_norms_do_not_depend_on_the_order_of_memory():
    # LAMB's per-tensor norms over a channels_last tensor: the float64 reference on the logical tensor
    w = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(5))
    p = torch.nn.Parameter(w.clone().to(memory_format=torch.channels_last))
    opt = ot.Lamb([p], lr=1e-2, backend="cpu")
    hp = opt.group_hyperparameters(opt.param_groups[0])[1]
    ref_p, state = w.double().numpy().copy(), None
    for step in range(1, 6):
        g = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(step))
        p.grad = g.clone().to(memory_format=torch.channels_last)
        opt.step()
        ref_p, state = reference.lamb([ref_p], [g.double().numpy()], state, hp, step)
        ref_p = ref_p[0]
        torch.testing.assert_close(p.detach().double(), torch.from_numpy(ref_p), rtol=1e-5, atol=1e-6)
    assert p.is_contiguous(memory_format=torch.channels_last)


def test_int8_state_of_a_channels_last_tensor_converts_element_by_element():
    # int8 blocks are runs of memory (4096+ elements: blocks, not the small tensors' float32 state);
    # its checkpoint converted to float32 state and back follows each element, whatever the strides
    def build(state_dtype, seed=7):
        w = torch.randn(16, 32, 3, 3, generator=torch.Generator().manual_seed(seed))
        p = torch.nn.Parameter(w.to(torch.bfloat16).to(memory_format=torch.channels_last))
        return p, ot.AdamW([p], lr=1e-2, state_dtype=state_dtype, backend="cpu")

    p, opt = build("int8")
    for step in range(3):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(
            torch.bfloat16).to(memory_format=torch.channels_last)
        opt.step()
    codes = opt.state[p]["exp_avg.codes"]
    assert codes.dtype == torch.uint8 and codes.stride() == p.stride()
    q, as_float = build("float32")
    as_float.load_state_dict(opt.state_dict())
    as_float.param_groups[0]["state_dtype"] = "float32"  # (the checkpoint's groups said int8)
    q.grad = torch.zeros_like(q)
    as_float.step()  # adopts the checkpoint: int8 dequantised into float32 state
    exp_avg = as_float.state[q]["exp_avg"]
    assert exp_avg.stride() == q.stride()
    # a float32 model stepped the same way: its moment is what the int8 codes approximate, element by element
    r, exact = build("float32")
    for step in range(3):
        r.grad = torch.randn(r.shape, generator=torch.Generator().manual_seed(step)).to(
            torch.bfloat16).to(memory_format=torch.channels_last)
        exact.step()
    expected = exact.state[r]["exp_avg"] * 0.9  # one more step with a zero gradient
    scale = expected.abs().max()
    assert ((exp_avg - expected).abs().max() / scale).item() < 0.02
    # back to int8, then to a contiguous parameter: refused (the blocks are runs of the saved order)
    s, contiguous = build("int8")
    s.data = s.data.contiguous()
    contiguous.load_state_dict(opt.state_dict())
    s.grad = torch.zeros_like(s)
    with pytest.raises(UnsupportedOperationError, match="same memory layout"):
        contiguous.step()


def test_layouts_that_cannot_be_stepped_are_refused_and_change_nothing():
    p = torch.nn.Parameter(torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last))
    p.grad = torch.ones(2, 3, 4, 4)  # contiguous: another order than its parameter's
    opt = ot.Adam([p], backend="cpu")
    with pytest.raises(ShapeMismatchError, match=r"strides .* expected the same strides"):
        opt.step()
    assert not opt.state and torch.count_nonzero(p) == 0
    q = torch.nn.Parameter(torch.zeros(3, 4).t())
    q.grad = torch.ones(3, 4).t()
    with pytest.raises(UnsupportedOperationError, match="factored over the last two dims"):
        ot.Adafactor([q], lr=1e-2).step()
    expanded = torch.nn.Parameter(torch.zeros(3, 1).expand(3, 4))
    expanded.grad = torch.ones(3, 4)
    with pytest.raises(ShapeMismatchError, match="non-overlapping"):
        ot.SGD([expanded], lr=0.1).step()


@pytest.mark.parametrize("shape, permute", [((2, 3, 4, 5), (0, 2, 3, 1)), ((4, 3), (1, 0)), ((2, 1, 3), (2, 1, 0)),
                                            ((2, 3, 4), (1, 2, 0))])
def test_storage_order_is_the_order_that_makes_a_permuted_tensor_contiguous(shape, permute):
    base = torch.zeros([shape[d] for d in permute])  # contiguous in memory order
    t = base.permute(sorted(range(len(permute)), key=permute.__getitem__))
    assert tuple(t.shape) == shape
    order = storage_order(t.shape, t.stride())
    assert order is not None and t.permute(order).is_contiguous()
    assert storage_order(t.shape, tuple(2 * s for s in t.stride())) is None  # gaps: not one run
    assert storage_order(t.shape, t.stride()[:-1] + (0,)) is None  # broadcast: overlapping


@pytest.mark.gpu
@pytest.mark.parametrize("name, kwargs", [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                          ("SGD", dict(lr=0.05, momentum=0.9))])
def test_channels_last_on_cuda_equals_torch(name, kwargs):
    # the cuda backend addresses the tensors by pointer: a channels_last span as one flat run
    if not torch.cuda.is_available():
        pytest.skip("needs torch with a real CUDA GPU")
    data = DATA.cuda()
    ours_model, theirs_model = make_model().cuda(), make_model().cuda()
    ours = getattr(ot, name)(ours_model.parameters(), **kwargs)
    theirs = getattr(torch.optim, name)(theirs_model.parameters(), **kwargs)
    for _ in range(STEPS):
        for model, opt in ((ours_model, ours), (theirs_model, theirs)):
            opt.zero_grad()
            (model(data) ** 2).mean().backward()
            opt.step()
    for p, q in zip(ours_model.parameters(), theirs_model.parameters()):
        assert p.stride() == q.stride()
        torch.testing.assert_close(p, q, **TOL)
