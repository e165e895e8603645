"""One GPT-2 124M FSDP2 training step (1 process, 1 GPU): optirs.torch.AdamW beside torch's fused AdamW.

The model (benchmarks/bench_torch_step.py's GPT-2: transformers' GPT2LMHeadModel when importable,
else the same shapes in plain torch) is wrapped with ``fully_shard`` per block and at the root on a
one-rank mesh, so its parameters and gradients are DTensors as under FSDP2 at any scale; the
optimizer steps them through their local shards. Timed per optimizer, after warm-up, with CUDA
events around batches of steps (median over batches): the whole training step (forward, backward
under bf16 autocast, step) and ``opt.step()`` alone on the last gradients. Before timing, both
optimizers take the same 3 steps from the same weights on the same gradients (computed once per
step through torch's model and copied to the other: a GPU backward is not deterministic, and
Adam's normalised step turns a gradient's noise into a whole lr), and their parameters are
compared (the largest difference is printed: float32 rounding).

    python benchmarks/bench_fsdp2.py --json h200-fsdp2.json
    python benchmarks/bench_fsdp2.py --cpu --smoke       # tiny sizes, gloo on the CPU (checks the script)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_torch_step import TinyGPT2, gpt2_config  # noqa: E402


def build(cfg: Dict[str, int], device: str, mesh: Any):
    """(model, loss(idx)) of GPT-2 under fully_shard (per block, then the root) on ``mesh``."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["positions"], n_embd=cfg["embd"],
                            n_layer=cfg["layers"], n_head=cfg["heads"])
        model = GPT2LMHeadModel(config).to(device)
        blocks, loss_of = model.transformer.h, (lambda idx: model(input_ids=idx, labels=idx).loss)
    except ImportError:
        model = TinyGPT2.build(cfg).to(device)
        blocks, loss_of = model.h, (lambda idx: model(idx, idx))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, loss_of


def make_opt(kind: str, params: List[Any]):
    import torch

    if kind == "torch_fused":
        try:
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
        except (RuntimeError, ValueError):  # a torch without fused DTensor steps
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)
    import optirs.torch as ot

    return ot.AdamW(params, lr=1e-3, weight_decay=0.1)


def same_gradients_diff(cfg: Dict[str, int], device: str, mesh: Any, idx: Any, steps: int = 3) -> float:
    """The largest difference between torch fused's and optirs's parameters after ``steps`` steps
    from the same weights on the same gradients (each step's computed through torch's model)."""
    import torch

    models = {kind: build(cfg, device, mesh) for kind in ("torch_fused", "optirs_torch")}
    params = {kind: list(model.parameters()) for kind, (model, _) in models.items()}
    opts = {kind: make_opt(kind, ps) for kind, ps in params.items()}
    _, loss_of = models["torch_fused"]
    for _ in range(steps):
        for opt in opts.values():
            opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = loss_of(idx)
        loss.backward()
        for src, dst in zip(params["torch_fused"], params["optirs_torch"]):
            dst.grad = src.grad.detach().clone()
        for opt in opts.values():
            opt.step()
    diff = max(float((a.to_local() - b.to_local()).abs().max())
               for a, b in zip(params["torch_fused"], params["optirs_torch"]))
    del models, params, opts
    if device == "cuda":
        torch.cuda.empty_cache()
    return diff


def timed(fn: Callable[[], None], device: str, warmup: int, reps: int, batches: int) -> Dict[str, float]:
    import torch

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(batches):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) * 1e3 / reps)
    return {"ms": statistics.median(out), "batches": len(out)}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU instead of nccl on one GPU")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and few reps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device (use --cpu)")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))
    cfg = gpt2_config(args.smoke)
    batch, seq = (2, 16) if args.smoke else (args.batch, args.seq)
    reps, warmup, batches = (2, 1, 2) if args.smoke else (args.reps, args.warmup, args.batches)
    idx = torch.randint(0, cfg["vocab"], (batch, seq), device=device)
    results: Dict[str, Any] = {"torch": torch.__version__, "config": cfg, "batch": batch, "seq": seq,
                               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    results["max_abs_diff_after_3_steps"] = same_gradients_diff(cfg, device, mesh, idx)
    for kind in ("torch_fused", "optirs_torch"):
        model, loss_of = build(cfg, device, mesh)
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) for p in params)
        opt = make_opt(kind, params)

        def train_step() -> None:
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = loss_of(idx)
            loss.backward()
            opt.step()

        row = {"train_step": timed(train_step, device, warmup, reps, batches),
               "opt_step": timed(opt.step, device, warmup, reps, batches),
               "parameters": sum(p.numel() for p in params), "tensors": len(params)}
        row["opt_share"] = row["opt_step"]["ms"] / row["train_step"]["ms"]
        results[kind] = row
        print(f"{kind:13s} train step {row['train_step']['ms']:8.2f} ms   opt.step() {row['opt_step']['ms']:7.3f} ms"
              f"   ({row['parameters'] / 1e6:.1f}M parameters in {row['tensors']} DTensors)")
        del model, opt, params
        if device == "cuda":
            torch.cuda.empty_cache()
    diff = results["max_abs_diff_after_3_steps"]
    results["opt_step_vs_torch_fused"] = results["torch_fused"]["opt_step"]["ms"] / results["optirs_torch"]["opt_step"]["ms"]
    print(f"after 3 steps: max |optirs - torch| = {diff:.3g}; opt.step() speed vs torch fused: "
          f"{results['opt_step_vs_torch_fused']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
