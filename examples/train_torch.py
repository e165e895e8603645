"""Train a character-level model on text that ships with Python, with optirs.torch.AdamW and
torch.optim.AdamW side by side, on the CPU.

The text is the standard library's own source (a few modules read through ``inspect``), so it
runs offline with no download. Both runs start from the same weights and see the same batches;
the script prints both losses and the optimizer step times (the median of opt.step() alone), and
exits non-zero when optirs' run does not reach --target (mean cross-entropy in nats of the last
20 steps).

    python examples/train_torch.py --steps 400
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

import torch

import optirs.torch as ot

MODULES = ("textwrap", "string", "shlex", "fnmatch", "glob", "bisect", "heapq")


def corpus(modules=MODULES) -> str:
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)


class CharModel(torch.nn.Module):
    """Embed the previous ``context`` characters, two hidden layers, predict the next one."""

    def __init__(self, vocab: int, context: int, dim: int = 24, hidden: int = 256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Sequential(torch.nn.Linear(context * dim, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, hidden), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.head(self.norm(self.body(self.embed(x).flatten(1))))


def param_groups(model, weight_decay):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="training steps of each run (default 400)")
    ap.add_argument("--batch", type=int, default=256, help="windows of text per step (default 256)")
    ap.add_argument("--context", type=int, default=8, help="characters the model sees before the one it predicts "
                    "(default 8)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the one-cycle schedule (default 3e-3)")
    ap.add_argument("--target", type=float, default=1.8, help="the loss optirs' run must reach, mean cross-entropy "
                    "in nats of the last 20 steps (default 1.8); the exit status is 1 when it does not")
    ap.add_argument("--threads", type=int, default=0, help="torch's intra-op threads, for the model and "
                    "torch.optim (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    text = corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    windows = data.unfold(0, args.context + 1, 1)
    print(f"corpus: {len(text)} characters of stdlib source, vocabulary {len(chars)}")

    torch.manual_seed(0)
    base = CharModel(len(chars), args.context)
    runs = {}
    for label, make in (("torch.optim.AdamW", lambda g: torch.optim.AdamW(g, lr=args.lr, weight_decay=0.1)),
                        ("optirs.torch.AdamW", lambda g: ot.AdamW(g, lr=args.lr, weight_decay=0.1))):
        model = CharModel(len(chars), args.context)
        model.load_state_dict(base.state_dict())
        opt = make(param_groups(model, 0.1))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
        gen = torch.Generator().manual_seed(1)
        losses, step_times = [], []
        for _ in range(args.steps):
            rows = windows[torch.randint(0, len(windows), (args.batch,), generator=gen)]
            loss = torch.nn.functional.cross_entropy(model(rows[:, :-1]), rows[:, -1])
            opt.zero_grad()
            loss.backward()
            t0 = time.perf_counter()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            sched.step()
            losses.append(float(loss.detach()))
        final = sum(losses[-20:]) / len(losses[-20:])
        step_times.sort()
        runs[label] = final
        print(f"{label:20s} loss {losses[0]:.3f} -> {final:.3f}   median step {step_times[len(step_times) // 2] * 1e6:7.1f} us"
              f"   ({sum(p.numel() for p in model.parameters())} parameters in {len(list(model.parameters()))} tensors)")
    ok = runs["optirs.torch.AdamW"] <= args.target
    print(f"target {args.target:.2f}: {'reached' if ok else 'NOT reached'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
