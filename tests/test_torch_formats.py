"""optirs.torch's step-format keywords (docs/formats.md) against torch.optim.

References: torch.optim.AdamW in float32 on the values the format defines. ``master_weights=None``
on bfloat16 parameters is "update in float32, round to nearest even into bfloat16": torch's AdamW
stepping a float32 copy of the bfloat16 parameters (with float32 state), rounded back into
bfloat16 after every step. ``master_weights="float32"`` is torch's AdamW on float32 masters,
cast to bfloat16. (torch's AdamW run directly on bfloat16 parameters keeps its moments in bfloat16,
rounded after every op: a different format, which optirs offers as ``state_dtype="bfloat16"`` with
unbiased stochastic rounding instead.)
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import optirs.torch as ot  # noqa: E402
from optirs.core import formats as F  # noqa: E402
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError  # noqa: E402

SHAPES = [(70, 61), (33,)]


def _init(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 0.1).bfloat16() for s in SHAPES]


def _bits(t):
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32).to(torch.int32)


def test_bf16_without_masters_equals_torch_adamw_rounded_to_nearest():
    init = _init()
    params = [torch.nn.Parameter(x.bfloat16()) for x in init]
    opt = ot.AdamW(params, lr=1e-2, weight_decay=0.1, backend="cpu")
    ref = [torch.nn.Parameter(x.bfloat16().float()) for x in init]
    ropt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for step in range(6):
        for p, r, g in zip(params, ref, _grads(step)):
            p.grad, r.grad = g.clone(), g.float()
        opt.step()
        ropt.step()
        with torch.no_grad():
            for r in ref:
                r.copy_(r.bfloat16().float())
        for p, r in zip(params, ref):
            assert p.dtype == torch.bfloat16
            # torch's float32 op order can differ from optirs' in the last float32 bit, which moves
            # a round-to-nearest at most one bfloat16 step; on these inputs they agree bit for bit
            assert int((_bits(p) - _bits(r.bfloat16())).abs().max()) <= 1
        for k in ("exp_avg", "exp_avg_sq"):
            for p, r in zip(params, ref):
                torch.testing.assert_close(opt.state[p][k], ropt.state[r][k], rtol=1e-5, atol=1e-8)


def test_bf16_over_float32_masters_equals_torch_adamw_on_the_masters():
    init = _init(1)
    params = [torch.nn.Parameter(x.bfloat16()) for x in init]
    opt = ot.AdamW(params, lr=1e-2, backend="cpu", master_weights="float32")
    masters = [torch.nn.Parameter(x.bfloat16().float()) for x in init]  # step 1 reads the masters off the parameters
    ropt = torch.optim.AdamW(masters, lr=1e-2)
    for step in range(6):
        for p, m, g in zip(params, masters, _grads(step)):
            p.grad, m.grad = g.clone(), g.float()
        opt.step()
        ropt.step()
        for p, m in zip(params, masters):
            torch.testing.assert_close(opt.state[p]["master"], m.detach(), rtol=1e-6, atol=1e-7)
            assert opt.state[p]["master"].dtype == torch.float32
            assert int((_bits(p) - _bits(m.bfloat16())).abs().max()) <= 1


@pytest.mark.parametrize("dtype, kw", [(torch.bfloat16, dict(master_weights="remainder8", state_dtype="int8")),
                                       (torch.bfloat16, dict(state_dtype="bfloat16", stochastic_rounding=True, seed=5)),
                                       (torch.bfloat16, dict(master_weights="float32", state_dtype="int8")),
                                       # torch casts the int8 codes and bfloat16 moments of float32
                                       # parameters to float32 in load_state_dict: they must come back
                                       (torch.float32, dict(state_dtype="int8")),
                                       (torch.float32, dict(state_dtype="bfloat16", seed=5)),
                                       (torch.float32, dict(state_dtype="int8_sqrt")),
                                       (torch.bfloat16, dict(master_weights="remainder8", state_dtype="float8_e4m3fn"))])
def test_state_dict_round_trip_is_bit_exact(dtype, kw):
    init = _init(2)

    def run(steps, load=None):
        params = [torch.nn.Parameter(x.to(dtype)) for x in init]
        opt = ot.AdamW(params, lr=1e-2, backend="cpu", **kw)
        if load is not None:
            for p, v in zip(params, load[1]):
                p.data.copy_(v)
            opt.load_state_dict(load[0])
        for step in steps:
            for p, g in zip(params, _grads(step)):
                p.grad = g.to(dtype)
            opt.step()
        return opt, params

    full, pf = run(range(6))
    half, ph = run(range(3))
    sd = half.state_dict()
    dtypes = {k: v.dtype for k, v in sd["state"][0].items()}
    resumed, pr = run(range(3, 6), (sd, [p.detach().clone() for p in ph]))
    for k, v in resumed.state[pr[0]].items():
        assert v.dtype == dtypes[k], k  # torch would have cast the float32 masters/scales to bfloat16
    for a, b in zip(pf, pr):
        assert torch.equal(_bits(a), _bits(b))
    for a, b in zip(pf, pr):
        for k, v in full.state[a].items():
            w = resumed.state[b][k]
            assert v.dtype == w.dtype and torch.equal(v.view(torch.uint8) if v.dim() else v, w.view(torch.uint8) if w.dim() else w), k


def test_int8_state_dict_is_about_a_quarter_of_float32():
    def state_bytes(**kw):
        p = torch.nn.Parameter(torch.randn(256, 512))
        opt = ot.AdamW([p], backend="cpu", **kw)
        p.grad = torch.randn(256, 512)
        opt.step()
        return sum(v.numel() * v.element_size() for v in opt.state_dict()["state"][0].values() if v.dim())

    n32, n8 = state_bytes(), state_bytes(state_dtype="int8")
    assert n32 == 8 * 256 * 512
    assert n8 == 2 * (256 * 512 + 4 * 512)  # codes + one float32 scale per 256 elements, per moment


@pytest.mark.parametrize("source, target", [("int8", "int8_sqrt"), ("int8_sqrt", "int8"), ("float8_e4m3fn", "int8"),
                                            ("int8_sqrt", "float8_e4m3fn")])
def test_one_byte_checkpoint_of_one_code_continues_in_another(source, target):
    """Codes are read only by their own kind's decoder (distinct keys): a checkpoint of one one-byte
    state, loaded and its group set to the other (torch's groups take the checkpoint's keywords),
    is converted by value at the next step, whose moments stay within a few code steps of the
    source optimizer's same step."""
    from optirs.core import reference as R

    params = [torch.nn.Parameter(x.clone()) for x in _init(4)]
    opt = ot.AdamW(params, lr=1e-2, backend="cpu", state_dtype=source)
    for step in range(3):
        for p, g in zip(params, _grads(step)):
            p.grad = g.float()
        opt.step()
    other = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = ot.AdamW(other, lr=1e-2, backend="cpu", state_dtype=target)
    saved = copy.deepcopy(opt.state_dict())  # (as torch's, a state_dict's tensors are the live state)
    loaded.load_state_dict(saved)
    loaded.param_groups[0]["state_dtype"] = target
    for o in (opt, loaded):
        for p, g in zip(o.param_groups[0]["params"], _grads(3)):
            p.grad = g.float()
        o.step()
    keys = F.CODES_SUFFIX
    a, b = opt.state[params[0]], loaded.state[other[0]]
    assert f"exp_avg.{keys[target]}" in b and f"exp_avg.{keys[source]}" not in b
    for slot, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        ca, sa = a[f"{slot}.{keys[source]}"].numpy(), a[f"{slot}.scales"].numpy()
        cb, sb = b[f"{slot}.{keys[target]}"].numpy(), b[f"{slot}.scales"].numpy()
        va, vb = R.dequantize_blocks(ca, sa, signed, source), R.dequantize_blocks(cb, sb, signed, target)
        # the conversion's code step (on the values it converted), then each side's final one
        was = saved["state"][0]
        converted = R.quantize_blocks(R.dequantize_blocks(was[f"{slot}.{keys[source]}"].numpy(),
                                                          was[f"{slot}.scales"].numpy(), signed, source), signed, target)
        bound = (R.code_step(*converted, signed, target) + R.code_step(ca, sa, signed, source)
                 + R.code_step(cb, sb, signed, target))
        assert np.all(np.abs(va - vb) <= bound * 1.001), slot


def test_format_keywords_are_checked_and_adafactor_takes_none():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(InvalidParameterError, match="state_dtype"):
        ot.AdamW([p], state_dtype="int4", backend="cpu")
    with pytest.raises(InvalidParameterError, match="stochastic_rounding"):
        ot.SGD([p], master_weights="float32", stochastic_rounding=True, backend="cpu")
    with pytest.raises(TypeError):
        ot.Adafactor([p], state_dtype="int8", backend="cpu")
    q = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    q.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedOperationError, match="adafactor"):
        ot.Adafactor([q], backend="cpu").step()
    assert torch.equal(q, torch.zeros(4, dtype=torch.bfloat16))


def test_grad_scaler_unscale_and_skip_on_bf16():
    """GradScaler's grad_scale / found_inf on a format bucket: the unscaled step is the plain one."""
    init = _init(3)
    a = [torch.nn.Parameter(x.bfloat16()) for x in init]
    b = [torch.nn.Parameter(x.bfloat16()) for x in init]
    oa = ot.AdamW(a, lr=1e-2, backend="cpu", master_weights="remainder16")
    ob = ot.AdamW(b, lr=1e-2, backend="cpu", master_weights="remainder16")
    scale = torch.tensor(1024.0)
    for step in range(3):
        for p, q, g in zip(a, b, _grads(step)):
            p.grad, q.grad = g.clone(), (g.float() * 1024.0).bfloat16()  # a power of two: exact
        oa.step()
        ob.step(grad_scale=scale, found_inf=torch.tensor(0.0))
    before = [q.detach().clone() for q in b]
    ob.step(grad_scale=scale, found_inf=torch.tensor(1.0))  # skipped
    for p, q, r in zip(a, b, before):
        assert torch.equal(_bits(p), _bits(q)) and torch.equal(q, r)
    assert int(ob.state[b[0]]["step"]) == 3


def test_fp16_sgd_momentum_over_masters():
    init = _init(4)
    params = [torch.nn.Parameter(x.half()) for x in init]
    opt = ot.SGD(params, lr=0.1, momentum=0.9, backend="cpu", master_weights="float32")
    masters = [torch.nn.Parameter(x.half().float()) for x in init]
    ropt = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    for step in range(4):
        for p, m, g in zip(params, masters, _grads(step)):
            p.grad, m.grad = g.half(), g.half().float()
        opt.step()
        ropt.step()
    for p, m in zip(params, masters):
        torch.testing.assert_close(opt.state[p]["master"], m.detach(), rtol=1e-6, atol=1e-7)
        assert int((p.detach().view(torch.int16).int() - m.detach().half().view(torch.int16).int()).abs().max()) <= 1
