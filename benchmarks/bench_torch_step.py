"""optirs on torch CUDA tensors against torch.optim.AdamW(fused=True), on the H200.

In one run:

* ``gpt2``: the parameter shapes of GPT-2 124M (``transformers.GPT2Config()``: 148 tensors,
  124.4M parameters; built on the meta device when transformers is importable, else by hand),
  two param groups (weight decay 0.1 on the matrices and embeddings, 0 on biases and norms).
  ``opt.step()`` wall time with the host included.
* ``small``: a 1M-parameter model in 50 tensors, the same way (the host-overhead case).
* ``copy``: device-to-device copy bandwidth (torch ``copy_``), the yardstick of every figure.
* ``*_graph``: ``capturable=True`` and one step captured into a CUDA graph after warm-up, timed
  as ``graph.replay()`` (torch fused capturable and optirs.torch), in the gpt2 and small cases.
* ``train``: a whole GPT-2 124M training step (forward, backward, step; bf16 autocast), with
  optirs and with torch fused, and the optimizer's share of the step for both.
* ``host``: the host time of the ``opt.step()`` call alone (``perf_counter`` around single calls,
  the device synchronized between calls, median), for the gpt2 and small cases in fp32, bf16
  parameters over float32 masters and bf16 ``remainder8`` masters with int8 state, beside torch
  fused (``torch.optim.AdamW(fused=True)``, on the same dtype) in the same run.

Optimizers: ``torch_fused`` (torch.optim.AdamW(fused=True)), ``optirs_seed`` (the seed API:
one ``optirs.GpuAdamW`` per group, ``step_gpu`` on the torch tensors) and ``optirs_torch``
(``optirs.torch.AdamW``, when importable). Every step is issued on torch's current stream,
which optirs follows. Timing: CUDA events around batches of back-to-back steps after warm-up
(the events see host gaps, so this is wall time with the host included); the median over
batches; also host ``perf_counter`` over the same batches. Each figure is printed as ms, as a
fraction of the copy bandwidth (28 bytes per element for AdamW) and as a ratio to torch fused.

On the CPU (``--cpu``, no GPU needed): torch CPU tensors, ``optirs.torch.AdamW(backend="cpu")``
against ``torch.optim.AdamW(fused=True)`` on the CPU, timed per call with the host clock (median of
many): ``small`` (1M parameters in 50 tensors), ``overhead`` (the same 50 tensors at one element
each: what is left is the front end's and the launch's host work) and ``train`` (a whole training
step of examples/train_torch.py's model: forward, backward, step), each with the ratio to torch;
and ``host`` as above, on GPT-2 124M's 148 tensors at one element each and the 50-tensor model
(on the CPU the kernel runs inside the call: its time is part of the host time).

    python benchmarks/bench_torch_step.py --json h200-torch-step.json
    python benchmarks/bench_torch_step.py --smoke        # tiny sizes; skips cleanly without CUDA
    python benchmarks/bench_torch_step.py --cpu [--smoke] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

ADAMW_BYTES = 28  # p, g, m, v read; p, m, v written (float32)
LR, BETAS, EPS, DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1


def cuda_unavailable_reason() -> Optional[str]:
    """Why this machine cannot run the benchmark (None: it can)."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


# ------------------------------------------------------------------ shapes and models


def gpt2_config(smoke: bool) -> Dict[str, int]:
    try:
        from transformers import GPT2Config

        c = GPT2Config()
        cfg = dict(vocab=c.vocab_size, positions=c.n_positions, embd=c.n_embd, layers=c.n_layer, heads=c.n_head)
    except ImportError:
        cfg = dict(vocab=50257, positions=1024, embd=768, layers=12, heads=12)  # GPT2Config()'s defaults
    if smoke:
        cfg = dict(vocab=512, positions=64, embd=64, layers=2, heads=2)
    return cfg


def gpt2_shapes(cfg: Dict[str, int]) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of GPT2LMHeadModel's parameters (lm_head is tied to wte): 148 at 12 layers."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["positions"], n_embd=cfg["embd"],
                            n_layer=cfg["layers"], n_head=cfg["heads"])
        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        return [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    except ImportError:
        pass
    e, out = cfg["embd"], [("transformer.wte.weight", (cfg["vocab"], cfg["embd"])),
                            ("transformer.wpe.weight", (cfg["positions"], cfg["embd"]))]
    for i in range(cfg["layers"]):
        h = f"transformer.h.{i}."
        out += [(h + "ln_1.weight", (e,)), (h + "ln_1.bias", (e,)),
                (h + "attn.c_attn.weight", (e, 3 * e)), (h + "attn.c_attn.bias", (3 * e,)),
                (h + "attn.c_proj.weight", (e, e)), (h + "attn.c_proj.bias", (e,)),
                (h + "ln_2.weight", (e,)), (h + "ln_2.bias", (e,)),
                (h + "mlp.c_fc.weight", (e, 4 * e)), (h + "mlp.c_fc.bias", (4 * e,)),
                (h + "mlp.c_proj.weight", (4 * e, e)), (h + "mlp.c_proj.bias", (e,))]
    return out + [("transformer.ln_f.weight", (e,)), ("transformer.ln_f.bias", (e,))]


def small_shapes(total: int, count: int, seed: int = 1) -> List[Tuple[str, Tuple[int, ...]]]:
    import numpy as np

    w = np.random.default_rng(seed).lognormal(0.0, 1.0, count)
    sizes = np.maximum(1, np.round(w / w.sum() * total)).astype(int)
    return [(f"t{i}", (int(s),)) for i, s in enumerate(sizes)]


def make_params(shapes, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.randn(s, device="cuda", generator=g) * 0.02 for _, s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-3
    return params


def groups_of(shapes, params):
    decay = [p for (_, s), p in zip(shapes, params) if len(s) >= 2]
    no_decay = [p for (_, s), p in zip(shapes, params) if len(s) < 2]
    groups = [{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # a model of matrices only has no no-decay group


class TinyGPT2:
    """GPT-2 in plain torch (no transformers needed): the same parameters as GPT2LMHeadModel."""

    @staticmethod
    def build(cfg):
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                e = cfg["embd"]
                self.ln_1, self.ln_2 = nn.LayerNorm(e), nn.LayerNorm(e)
                self.c_attn, self.c_proj = nn.Linear(e, 3 * e), nn.Linear(e, e)
                self.c_fc, self.mlp_proj = nn.Linear(e, 4 * e), nn.Linear(4 * e, e)

            def forward(self, x):
                b, t, e = x.shape
                q, k, v = self.c_attn(self.ln_1(x)).split(e, dim=2)
                q, k, v = (z.view(b, t, cfg["heads"], e // cfg["heads"]).transpose(1, 2) for z in (q, k, v))
                y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, e))
                return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.wte = nn.Embedding(cfg["vocab"], cfg["embd"])
                self.wpe = nn.Embedding(cfg["positions"], cfg["embd"])
                self.h = nn.ModuleList([Block() for _ in range(cfg["layers"])])
                self.ln_f = nn.LayerNorm(cfg["embd"])

            def forward(self, idx, labels):
                pos = torch.arange(idx.shape[1], device=idx.device)
                x = self.wte(idx) + self.wpe(pos)
                for block in self.h:
                    x = block(x)
                logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
                return nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))

        return Model()


def gpt2_model(cfg):
    """(model, loss(idx) function, source): transformers' GPT2LMHeadModel when importable."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["positions"], n_embd=cfg["embd"],
                            n_layer=cfg["layers"], n_head=cfg["heads"])
        model = GPT2LMHeadModel(config).cuda()
        return model, (lambda idx: model(input_ids=idx, labels=idx).loss), "transformers.GPT2LMHeadModel"
    except ImportError:
        model = TinyGPT2.build(cfg).cuda()
        return model, (lambda idx: model(idx, idx)), "plain-torch GPT-2 (same shapes)"


# ------------------------------------------------------------------ optimizers


def make_optimizer(kind: str, groups) -> Optional[Callable[[], None]]:
    """A zero-argument step for ``kind``, or None when it cannot be built here."""
    import torch

    if kind == "torch_fused":
        opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
        return opt.step
    if kind == "optirs_seed":
        import optirs

        hp = [optirs.AdamParams(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=g["weight_decay"]) for g in groups]
        cfg = optirs.GpuOptimizerConfig(backend="cuda")
        opts = [(optirs.GpuAdamW(h, cfg), list(g["params"])) for h, g in zip(hp, groups)]

        def step() -> None:
            for opt, ps in opts:
                opt.step_gpu(ps, [p.grad for p in ps])

        return step
    if kind == "optirs_torch":
        try:
            import optirs.torch as ot
        except ImportError:
            return None
        if not hasattr(ot, "AdamW"):
            return None
        opt = ot.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
        return opt.step
    if kind in ("torch_fused_graph", "optirs_torch_graph"):
        # capturable=True, one step captured into a CUDA graph after warm-up on a side stream:
        # the step is graph.replay() (the host work left is the replay's launch)
        lr = torch.tensor(LR, device="cuda")
        if kind == "torch_fused_graph":
            opt = torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, fused=True, capturable=True)
        else:
            try:
                import optirs.torch as ot
            except ImportError:
                return None
            opt = ot.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, capturable=True)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                opt.step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
        def replay() -> None:
            graph.replay()  # (the closure keeps opt alive: the graph writes its state buffers)

        replay.optimizer = opt  # type: ignore[attr-defined]
        return replay
    raise ValueError(kind)


KINDS = ("torch_fused", "optirs_seed", "optirs_torch", "torch_fused_graph", "optirs_torch_graph")
TRAIN_KINDS = KINDS[:3]  # a graph of the step alone replays on static gradients: not a training step


# ------------------------------------------------------------------ timing


def time_batches(fn: Callable[[], None], warmup: int, reps: int, batches: int) -> Dict[str, float]:
    """Median ms per call over ``batches`` batches of ``reps`` back-to-back calls (events and host clock)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev, wall = [], []
    for _ in range(batches):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3 / reps)
        ev.append(start.elapsed_time(stop) / reps)
    return {"ms": statistics.median(ev), "wall_ms": statistics.median(wall), "min_ms": min(ev)}


def copy_bandwidth(elements: int, reps: int, batches: int) -> Dict[str, float]:
    import torch

    src, dst = torch.rand(elements, device="cuda"), torch.empty(elements, device="cuda")
    t = time_batches(lambda: dst.copy_(src), 3, reps, batches)
    return {"elements": elements, **t, "GBps": 8 * elements / (t["ms"] * 1e6)}


def bench_steps(name: str, shapes, copy_gbps: float, args) -> Dict[str, Any]:
    elements = sum(int(_prod(s)) for _, s in shapes)
    rows: Dict[str, Any] = {"tensors": len(shapes), "elements": elements}
    for kind in KINDS:
        params = make_params(shapes)
        step = make_optimizer(kind, groups_of(shapes, params))
        if step is None:
            rows[kind] = {"skipped": "not importable"}
            continue
        t = time_batches(step, args.warmup, args.reps, args.batches)
        t["of_copy"] = ADAMW_BYTES * elements / (t["ms"] * 1e6) / copy_gbps
        rows[kind] = t
        del params, step
    base = rows["torch_fused"]["ms"]
    for kind in KINDS:
        if "ms" in rows[kind]:
            rows[kind]["vs_torch_fused"] = base / rows[kind]["ms"]
    return rows


def bench_train(cfg, args) -> Dict[str, Any]:
    """Forward + backward + step of GPT-2 (bf16 autocast), per optimizer, and the step's share."""
    import torch

    out: Dict[str, Any] = {}
    batch, seq = (2, 32) if args.smoke else (args.batch, args.seq)
    for kind in TRAIN_KINDS:
        torch.manual_seed(0)
        model, loss_of, source = gpt2_model(cfg)
        out["model"] = source
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        params = [p for _, p in model.named_parameters()]
        idx = torch.randint(0, cfg["vocab"], (batch, seq), device="cuda")
        for p in params:
            p.grad = torch.zeros_like(p)
        step = make_optimizer(kind, groups_of(named, params))
        if step is None:
            out[kind] = {"skipped": "not importable"}
            continue

        def train_step() -> None:
            for p in params:
                p.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(idx)
            loss.backward()
            step()

        reps = max(1, args.reps // 10)
        t = time_batches(train_step, args.warmup, reps, args.batches)
        t_opt = time_batches(step, 2, reps, args.batches)  # the optimizer alone, on these grads
        t["optimizer_ms"], t["optimizer_share"] = t_opt["ms"], t_opt["ms"] / t["ms"]
        out[kind] = t
        del model, params, step
        torch.cuda.empty_cache()
    base = out["torch_fused"]["ms"]
    for kind in TRAIN_KINDS:
        if "ms" in out.get(kind, {}):
            out[kind]["vs_torch_fused"] = base / out[kind]["ms"]
    return out


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def environment() -> Dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    for mod in ("numpy", "numba", "optirs", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    return env


def report(results: Dict[str, Any]) -> None:
    print(f"copy: {results['copy']['GBps']:.0f} GB/s ({results['copy']['elements']} float32)")
    for case in ("gpt2", "small"):
        r = results[case]
        print(f"{case}: {r['tensors']} tensors, {r['elements']} parameters, opt.step() ms (wall with host)")
        for kind in KINDS:
            t = r[kind]
            if "ms" not in t:
                print(f"  {kind:13s} {t['skipped']}")
                continue
            print(f"  {kind:13s} {t['ms']:8.3f} ms (host clock {t['wall_ms']:.3f})  {t['of_copy']:6.1%} of copy  "
                  f"{t['vs_torch_fused']:.2f}x torch fused")
    report_host(results["host"])
    tr = results.get("train")
    if tr:
        print(f"train step ({tr['model']}, bf16 autocast):")
        for kind in TRAIN_KINDS:
            t = tr.get(kind, {})
            if "ms" in t:
                print(f"  {kind:13s} {t['ms']:8.3f} ms  optimizer {t['optimizer_ms']:.3f} ms "
                      f"({t['optimizer_share']:.1%})  {t['vs_torch_fused']:.2f}x torch fused")


# ------------------------------------------------------------------ host time of the step call

# label -> (parameter dtype name, optirs.torch format keywords)
HOST_FORMATS = {"fp32": ("float32", {}),
                "bf16+fp32 masters": ("bfloat16", {"master_weights": "float32"}),
                "bf16 remainder8+int8": ("bfloat16", {"master_weights": "remainder8", "state_dtype": "int8"})}
HOST_KINDS = ("torch_fused", "optirs_torch")


def host_step_times(step: Callable[[], None], sync: Callable[[], None], warmup: int, reps: int) -> Dict[str, float]:
    """Median and minimum microseconds of host time in one ``step()`` call, the device idle before each."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return {"us": statistics.median(times), "min_us": min(times)}


def checked_reads_us(params, args) -> Dict[str, float]:
    """Host time of the per-tensor reads that a step which checks its inputs cannot skip: every
    gradient, the dtype, device, sizes and strides of every parameter and gradient (checked in C
    by torch's TensorGuards, as optirs.torch does) and every data pointer. No launch, no math:
    the floor under a checked step's host time on this host."""
    import operator

    import torch
    from torch._C._dynamo.guards import TensorGuards

    get, ptr = operator.attrgetter("grad"), torch.Tensor.data_ptr
    tensors = list(params) + [p.grad for p in params]
    guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.size()) for t in tensors],
                         dynamic_dims_strides=[list(t.stride()) for t in tensors])

    def reads() -> None:
        grads = list(map(get, params))
        if not guard.check(*params, *grads):
            raise AssertionError("the tensors changed while they were timed")
        tuple(map(ptr, params))
        tuple(map(ptr, grads))

    return time_calls(reads, max(3, args.warmup), max(5, args.reps))


def bench_host(shapes, device: str, args, backend: str = "auto") -> Dict[str, Any]:
    """``host`` rows of one model: per format, torch fused and optirs.torch (module docstring)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows: Dict[str, Any] = {"tensors": len(shapes), "elements": sum(_prod(s) for _, s in shapes)}
    for label, (dtype_name, kw) in HOST_FORMATS.items():
        dtype = getattr(torch, dtype_name)
        row: Dict[str, Any] = {}
        for kind in HOST_KINDS:
            g = torch.Generator(device=device).manual_seed(0)
            params = [torch.nn.Parameter((torch.randn(s, device=device, generator=g) * 0.02).to(dtype))
                      for _, s in shapes]
            for p in params:
                p.grad = (torch.randn(p.shape, device=device, generator=g) * 1e-3).to(dtype)
            try:
                if kind == "torch_fused":
                    opt = torch.optim.AdamW(groups_of(shapes, params), lr=LR, betas=BETAS, eps=EPS, fused=True)
                else:
                    import optirs.torch as ot

                    opt = ot.AdamW(groups_of(shapes, params), lr=LR, betas=BETAS, eps=EPS, backend=backend, **kw)
                row[kind] = host_step_times(opt.step, sync, max(3, args.warmup), max(5, args.reps))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
                row[kind] = {"skipped": f"{type(exc).__name__}: {exc}"}
            if "checked_reads" not in rows:
                try:
                    rows["checked_reads"] = checked_reads_us(params, args)
                except Exception as exc:  # noqa: BLE001 - torch's private guards may be missing
                    rows["checked_reads"] = {"skipped": f"{type(exc).__name__}: {exc}"}
            del params
        if "us" in row.get("torch_fused", {}) and "us" in row.get("optirs_torch", {}):
            row["optirs_vs_torch_fused"] = row["torch_fused"]["us"] / row["optirs_torch"]["us"]
        rows[label] = row
    return rows


def report_host(host: Dict[str, Any]) -> None:
    print("host time of one opt.step() call, us (median; device synchronized between calls); >1x: optirs less")
    for case, rows in host.items():
        print(f"  {case}: {rows['tensors']} tensors, {rows['elements']} parameters")
        floor = rows.get("checked_reads", {})
        if "us" in floor:
            print(f"    {'the checks alone':22s} {floor['us']:9.1f} (reading every gradient, every tensor's metadata "
                  "and address: the floor of a checked step)")
        for label in HOST_FORMATS:
            row = rows[label]
            cells = []
            for kind in HOST_KINDS:
                t = row.get(kind, {})
                cells.append(f"{kind} {t['us']:9.1f}" if "us" in t else f"{kind} skipped ({t.get('skipped')})")
            ratio = f"  {row['optirs_vs_torch_fused']:.2f}x" if "optirs_vs_torch_fused" in row else ""
            print(f"    {label:22s} " + "  ".join(cells) + ratio)


# ------------------------------------------------------------------ the CPU mode


def cpu_optimizer(kind: str, groups):
    import torch

    if kind == "torch_fused":
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    import optirs.torch as ot

    return ot.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, backend="cpu")


def time_calls(fn: Callable[[], None], warmup: int, reps: int) -> Dict[str, float]:
    """Median and minimum microseconds per call over ``reps`` calls, each timed by the host clock."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return {"us": statistics.median(times), "min_us": min(times)}


def cpu_steps(shapes, args) -> Dict[str, Any]:
    import torch

    rows: Dict[str, Any] = {"tensors": len(shapes), "elements": sum(_prod(s) for _, s in shapes)}
    for kind in ("torch_fused", "optirs_torch"):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for _, s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        rows[kind] = time_calls(cpu_optimizer(kind, groups_of(shapes, params)).step, args.warmup, args.reps)
    rows["optirs_vs_torch_fused"] = rows["torch_fused"]["us"] / rows["optirs_torch"]["us"]
    return rows


def cpu_train(args) -> Dict[str, Any]:
    """examples/train_torch.py's model and batches: forward + backward + step, per optimizer."""
    import importlib.util
    from pathlib import Path

    import torch

    path = Path(__file__).resolve().parents[1] / "examples" / "train_torch.py"
    spec = importlib.util.spec_from_file_location("train_torch", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    text = example.corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    context, batch = 8, (32 if args.smoke else 256)
    windows = torch.tensor([index[c] for c in text], dtype=torch.long).unfold(0, context + 1, 1)
    out: Dict[str, Any] = {}
    for kind in ("torch_fused", "optirs_torch"):
        torch.manual_seed(0)
        model = example.CharModel(len(chars), context)
        opt = cpu_optimizer(kind, example.param_groups(model, DECAY))
        gen = torch.Generator().manual_seed(1)

        def train_step() -> None:
            rows = windows[torch.randint(0, len(windows), (batch,), generator=gen)]
            loss = torch.nn.functional.cross_entropy(model(rows[:, :-1]), rows[:, -1])
            opt.zero_grad()
            loss.backward()
            opt.step()

        out[kind] = time_calls(train_step, args.warmup, args.reps)
        out[kind]["step_us"] = time_calls(opt.step, 2, args.reps)["us"]  # the optimizer alone, on these grads
        out["parameters"] = sum(p.numel() for p in model.parameters())
        out["tensors"] = len(list(model.parameters()))
    out["optirs_vs_torch_fused"] = out["torch_fused"]["us"] / out["optirs_torch"]["us"]
    return out


def cpu_main(args) -> int:
    import torch

    if args.threads:  # both libraries' thread pools (torch's intra-op, numba's parallel loops)
        import numba

        torch.set_num_threads(args.threads)
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    if args.smoke:
        args.warmup, args.reps = 2, 5
    total = 10_000 if args.smoke else 1_000_000
    small = small_shapes(total, 50)
    results: Dict[str, Any] = {
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "smoke": args.smoke,
        "small": cpu_steps(small, args),
        "overhead": cpu_steps([(n, (1,)) for n, _ in small], args),
    }
    gpt2_tiny = [(n, (1,) * len(s)) for n, s in gpt2_shapes(gpt2_config(False))]  # host work only
    results["host"] = {"gpt2": bench_host(gpt2_tiny, "cpu", args, backend="cpu"),
                       "small": bench_host(small, "cpu", args, backend="cpu")}
    if not args.no_train:
        results["train"] = cpu_train(args)
    env = results["environment"]
    print(f"CPU ({env['cpu']}, {env['threads']} torch threads, load average {env['load_average']}), us per call "
          "(median); >1x: optirs faster")
    for case in ("small", "overhead"):
        r = results[case]
        print(f"{case:9s} {r['tensors']} tensors, {r['elements']:8d} parameters: torch fused "
              f"{r['torch_fused']['us']:9.1f}  optirs.torch {r['optirs_torch']['us']:9.1f}  "
              f"{r['optirs_vs_torch_fused']:.2f}x")
    report_host(results["host"])
    tr = results.get("train")
    if tr:
        print(f"train     {tr['tensors']} tensors, {tr['parameters']:8d} parameters: torch fused "
              f"{tr['torch_fused']['us']:9.1f} (step {tr['torch_fused']['step_us']:.1f})  optirs.torch "
              f"{tr['optirs_torch']['us']:9.1f} (step {tr['optirs_torch']['step_us']:.1f})  "
              f"{tr['optirs_vs_torch_fused']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and few reps (skips cleanly without CUDA)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--reps", type=int, default=50, help="steps per timed batch")
    ap.add_argument("--batches", type=int, default=11, help="timed batches (the median is reported)")
    ap.add_argument("--batch", type=int, default=8, help="training batch size")
    ap.add_argument("--seq", type=int, default=1024, help="training sequence length")
    ap.add_argument("--no-train", action="store_true", help="skip the whole-training-step case")
    ap.add_argument("--cpu", action="store_true", help="the CPU mode: torch CPU tensors, the cpu backend")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU mode: torch's and numba's threads (0: their defaults)")
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_main(args)
    reason = cuda_unavailable_reason()
    if reason is not None:
        message = f"bench_torch_step: skipped: {reason}; this benchmark needs torch with a CUDA GPU"
        print(message)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": reason}, f, indent=2)
        return 0 if args.smoke else 2
    if args.smoke:
        args.warmup, args.reps, args.batches = 2, 3, 3
    cfg = gpt2_config(args.smoke)
    gpt2 = gpt2_shapes(cfg)
    small = small_shapes(10_000 if args.smoke else 1_000_000, 50)
    elements = sum(_prod(s) for _, s in gpt2)
    results: Dict[str, Any] = {"environment": environment(), "config": cfg, "smoke": args.smoke}
    results["copy"] = copy_bandwidth(elements, args.reps, args.batches)
    results["gpt2"] = bench_steps("gpt2", gpt2, results["copy"]["GBps"], args)
    results["small"] = bench_steps("small", small, results["copy"]["GBps"], args)
    results["host"] = {"gpt2": bench_host(gpt2, "cuda", args), "small": bench_host(small, "cuda", args)}
    if not args.no_train:
        results["train"] = bench_train(cfg, args)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
