"""Convergence of the step formats (issue 13): a small convnet on scikit-learn's digits.

fp32 AdamW (torch.optim.AdamW) against optirs.torch.AdamW in each format: bfloat16 parameters
over float32 / remainder16 / remainder8 masters or none with stochastic rounding, and state in
float32 / bfloat16 / int8; plus float32 parameters with int8 state. Every run starts from the
same float32 weights (cast to the run's parameter dtype) and sees the same batches in the same
order; the validation loss is the mean cross-entropy over a fixed held-out split, evaluated in
float32 on the run's parameters. Peers (bitsandbytes AdamW8bit, FlashOptim's FlashAdamW) run
where they import (they need CUDA; on CPU the reason is printed).

The digits ship inside scikit-learn (``sklearn.datasets.load_digits``: 1797 8x8 images), so it
runs offline.

    PYTHONPATH=. python benchmarks/bench_convergence.py --epochs 30          # CPU
    PYTHONPATH=. python benchmarks/bench_convergence.py --epochs 30 --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

import optirs.torch as ot

# (label, parameter dtype, optirs.torch keywords); None keywords: torch.optim.AdamW in float32.
FORMATS: List[Tuple[str, torch.dtype, Optional[dict]]] = [
    ("fp32 torch AdamW", torch.float32, None),
    ("fp32 params, int8 state", torch.float32, dict(state_dtype="int8")),
]
for _master, _label in (("float32", "fp32 masters"), ("remainder16", "remainder16"), ("remainder8", "remainder8"),
                        (None, "no masters + SR")):
    for _state in ("float32", "bfloat16", "int8"):
        FORMATS.append((f"bf16 params, {_label}, {_state} state", torch.bfloat16,
                        dict(master_weights=_master, state_dtype=_state, stochastic_rounding=_master is None)))


def digits(seed: int = 0):
    """(train x, train y, val x, val y): a fixed 80/20 split of the 1797 digits, pixels in [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = len(y) // 5
    return x[perm[n_val:]], y[perm[n_val:]], x[perm[:n_val]], y[perm[:n_val]]


class ConvNet(torch.nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers (37k parameters; the second
    convolution's and the first linear layer's weights are above the 4096 elements of int8 state)."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
                                            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                                            torch.nn.MaxPool2d(2))
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.features(x))


def initial_state(seed: int) -> Dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in ConvNet().state_dict().items()}


def val_loss(model: torch.nn.Module, xv, yv) -> float:
    """Mean cross-entropy in float32 on the model's current parameters (cast, not re-rounded)."""
    ref = ConvNet().to(xv.device)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(ref(xv), yv))


def train(make_opt: Callable, dtype: torch.dtype, data, init, epochs: int, batch: int, seed: int,
          device: str) -> Tuple[float, float]:
    """(final validation loss, optimizer seconds) of one run."""
    xt, yt, xv, yv = (t.to(device) for t in data)
    model = ConvNet().to(device)
    model.load_state_dict(init)
    model = model.to(dtype)
    opt = make_opt(model.parameters())
    order = torch.Generator().manual_seed(seed)
    opt_s = 0.0
    for _ in range(epochs):
        perm = torch.randperm(len(yt), generator=order).to(device)
        for i in range(0, len(yt) - batch + 1, batch):
            idx = perm[i : i + batch]
            loss = torch.nn.functional.cross_entropy(model(xt[idx].to(dtype)).float(), yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t0 = time.perf_counter()
            opt.step()
            opt_s += time.perf_counter() - t0
    return val_loss(model, xv, yv), opt_s


def peers(lr: float, wd: float):
    """(label, dtype, factory or None, reason) for bitsandbytes' AdamW8bit and FlashOptim's FlashAdamW."""
    out = []
    try:
        import bitsandbytes as bnb

        out.append(("bitsandbytes AdamW8bit (fp32 params)", torch.float32,
                    lambda ps: bnb.optim.AdamW8bit(ps, lr=lr, weight_decay=wd), None))
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to print
        out.append(("bitsandbytes AdamW8bit (fp32 params)", torch.float32, None, f"{type(exc).__name__}: {exc}"))
    try:
        from flashoptim import FlashAdamW

        out.append(("FlashOptim FlashAdamW (bf16 params)", torch.bfloat16,
                    lambda ps: FlashAdamW(ps, lr=lr, weight_decay=wd), None))
    except Exception as exc:  # noqa: BLE001
        out.append(("FlashOptim FlashAdamW (bf16 params)", torch.bfloat16, None, f"{type(exc).__name__}: {exc}"))
    return out


def run(formats, epochs: int, batch: int, lr: float, wd: float, seed: int, device: str, backend: str,
        with_peers: bool = True, log=print, order_seed: Optional[int] = None) -> List[dict]:
    """One row per format: its final validation loss and ratio to the first row's. ``seed`` sets the
    initial weights and the stochastic rounding; ``order_seed`` (default ``seed``) the batches' order;
    the validation split is fixed."""
    data = digits(0)
    init = initial_state(seed)
    order = seed if order_seed is None else order_seed
    rows = []
    jobs = []
    for label, dtype, kw in formats:
        if kw is None:
            factory = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd)  # noqa: E731
        else:
            factory = (lambda kw: lambda ps: ot.AdamW(ps, lr=lr, weight_decay=wd, backend=backend, seed=seed,
                                                      **kw))(kw)
        jobs.append((label, dtype, factory, None))
    if with_peers:
        jobs += peers(lr, wd)
    base = None
    for label, dtype, factory, reason in jobs:
        if factory is None:
            log(f"{label:48s} not run: {reason}")
            rows.append({"format": label, "skipped": reason})
            continue
        try:
            loss, opt_s = train(factory, dtype, data, init, epochs, batch, order, device)
        except Exception as exc:  # noqa: BLE001 - a peer failing on this device is reported, not fatal
            log(f"{label:48s} failed: {type(exc).__name__}: {exc}")
            rows.append({"format": label, "skipped": f"{type(exc).__name__}: {exc}"})
            continue
        base = loss if base is None else base
        rows.append({"format": label, "val_loss": loss, "ratio": loss / base, "opt_s": opt_s})
        log(f"{label:48s} val loss {loss:.4f}  ratio {loss / base:.4f}  optimizer {opt_s:.2f} s")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--target", type=float, default=0.01, help="largest |ratio - 1| that passes (1%%)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    import optirs

    print(f"torch {torch.__version__}, optirs {optirs.__version__}, device {args.device}, "
          f"{args.epochs} epochs of batch {args.batch}, AdamW lr {args.lr} wd {args.weight_decay}, seed {args.seed}")
    rows = run(FORMATS, args.epochs, args.batch, args.lr, args.weight_decay, args.seed, args.device, args.backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    worst = max(abs(r["ratio"] - 1) for r in rows if "ratio" in r and r["format"].startswith(("fp32 params", "bf16")))
    print(f"largest |ratio - 1| of optirs' formats: {worst:.4f} (target {args.target})")
    return 0 if worst <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
