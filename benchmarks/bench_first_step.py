"""The first step of a fresh process: optirs.torch.AdamW beside torch.optim.AdamW, cold and warm cache.

numba compiles optirs's kernels on their first use and caches them on disk (docs/compile_cache.md),
so the first ``opt.step()`` of a process either compiles (cold cache) or loads (warm cache). For each
case this runs FRESH Python subprocesses with the same ``NUMBA_CACHE_DIR``: run 1 starts from an
empty cache directory (a new temporary one per case unless ``--cache-dir`` is given) and fills it,
runs 2 and later (``--warm-runs``, default 3) show what every later run pays; a second step is one
sample per process, so the warm figures are also given as the median over the warm runs. Each
subprocess times:

* ``import optirs.torch`` (torch imported before, and timed apart), then ``import torch._dynamo``
  (what torch.optim's constructor loads first, whichever optimizer is made first: timed apart);
* each optimizer's construction (optirs.torch opens its backend there: numba's start, the kernels
  module), and the sum of construction and first step beside torch's;
* optirs.torch.AdamW's first, second and steady ``opt.step()`` (steady: the median of ``--steps``
  more);
* torch.optim.AdamW (``fused=True`` on cuda, ``foreach=True`` on cpu) on a copy of the model, in the
  same process after optirs: its first, second and steady step. optirs runs first, so a lazy initialisation
  the two share (torch's) lands on optirs's figure, never on torch's.

Model: Linear(512, 1024), ReLU, Linear(1024, 512), with biases (1,050,112 parameters), an MSE loss
and a backward before every step; only ``opt.step()`` is timed (the device synchronized on both
sides on cuda). Cases: ``float32``; ``bf16-masters`` (bfloat16 parameters, ``master_weights="float32"``;
torch steps the bfloat16 parameters); ``int8-state`` (float32 parameters, ``state_dtype="int8"``).
Ratios: the first step minus torch's first step, in seconds (what optirs's first step costs beyond
torch's); second / steady and first / steady (how far from the steady step they are).

    python benchmarks/bench_first_step.py                       # cpu, every case
    python benchmarks/bench_first_step.py --cases float32 --json first-step.json
    python benchmarks/bench_first_step.py --device cuda --cache-dir /path/to/cache
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

LR, DECAY = 1e-3, 0.01
# case -> (parameter dtype, optirs.torch.AdamW's format keywords)
CASES: Dict[str, Any] = {
    "float32": ("float32", {}),
    "bf16-masters": ("bfloat16", {"master_weights": "float32"}),
    "int8-state": ("float32", {"state_dtype": "int8"}),
}
RESULT_PREFIX = "bench_first_step result: "


# ------------------------------------------------------------------ the subprocess


def child(case: str, device: str, steps: int) -> Dict[str, Any]:
    """One fresh process's figures (run by ``--child``)."""
    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    import optirs.torch as ot

    t2 = time.perf_counter()
    from optirs.core.compile_cache import cache_location, compile_records, install_compile_log

    install_compile_log()  # after the import's timing: it imports numba
    s = time.perf_counter()
    import torch._dynamo  # noqa: F401 - what torch.optim's constructor loads first, timed apart

    import_dynamo = time.perf_counter() - s
    dtype_name, formats = CASES[case]
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512)).to(device=device, dtype=dtype)
    peer_model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                     torch.nn.Linear(1024, 512)).to(device=device, dtype=dtype)
    peer_model.load_state_dict(model.state_dict())
    x = torch.randn(64, 512, device=device, dtype=dtype)
    y = torch.randn(64, 512, device=device, dtype=dtype)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed_steps(m: torch.nn.Module, opt: Any, n: int) -> List[float]:
        out = []
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(m(x).float(), y.float()).backward()
            sync()
            s = time.perf_counter()
            opt.step()
            sync()
            out.append(time.perf_counter() - s)
        return out

    s = time.perf_counter()
    opt = ot.AdamW(model.parameters(), lr=LR, weight_decay=DECAY, backend=device, **formats)
    optirs_construct = time.perf_counter() - s
    optirs_times = timed_steps(model, opt, 2 + steps)
    compiled = compile_records()
    peer_kwargs = {"fused": True} if device == "cuda" else {"foreach": True}
    s = time.perf_counter()
    peer = torch.optim.AdamW(peer_model.parameters(), lr=LR, weight_decay=DECAY, **peer_kwargs)
    peer_construct = time.perf_counter() - s
    peer_times = timed_steps(peer_model, peer, 2 + steps)
    return {
        "import_torch_s": t1 - t0, "import_optirs_torch_s": t2 - t1, "import_torch_dynamo_s": import_dynamo,
        "parameters": sum(p.numel() for p in model.parameters()),
        "optirs": {"construct_s": optirs_construct, "first_s": optirs_times[0], "second_s": optirs_times[1],
                   "steady_s": statistics.median(optirs_times[2:])},
        "torch": {"kind": next(iter(peer_kwargs)), "construct_s": peer_construct, "first_s": peer_times[0],
                  "second_s": peer_times[1], "steady_s": statistics.median(peer_times[2:])},
        "compiled": [{"kernel": r.name, "seconds": r.seconds} for r in compiled],
        "cache": cache_location().where,
    }


# ------------------------------------------------------------------ the parent


def environment(device: str) -> Dict[str, Any]:
    env: Dict[str, Any] = {"python": platform.python_version(), "machine": platform.processor() or platform.machine(),
                           "cpus": os.cpu_count()}
    for mod in ("torch", "numpy", "numba", "optirs"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    if device == "cuda":
        import torch

        env["device"] = torch.cuda.get_device_name()
    return env


def run_child(case: str, device: str, steps: int, cache_dir: str) -> Dict[str, Any]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, OPTIRS_COMPILE_LOG="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--device", device, "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {case} subprocess failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def ratios(r: Dict[str, Any]) -> Dict[str, float]:
    o, t = r["optirs"], r["torch"]
    return {"first_minus_torch_first_s": o["first_s"] - t["first_s"],
            "ready_minus_torch_ready_s": (o["construct_s"] + o["first_s"]) - (t["construct_s"] + t["first_s"]),
            "second_over_steady": o["second_s"] / o["steady_s"],
            "first_over_steady": o["first_s"] / o["steady_s"]}


def warm_median(runs: List[Dict[str, Any]]) -> Dict[str, float]:
    """The medians over warm runs of the first step beyond torch's, the second and steady steps and
    their ratio (each run's own ratio)."""
    return {"first_minus_torch_first_s": statistics.median(r["ratios"]["first_minus_torch_first_s"] for r in runs),
            "second_s": statistics.median(r["optirs"]["second_s"] for r in runs),
            "steady_s": statistics.median(r["optirs"]["steady_s"] for r in runs),
            "second_over_steady": statistics.median(r["ratios"]["second_over_steady"] for r in runs),
            "torch_second_over_steady": statistics.median(r["torch"]["second_s"] / r["torch"]["steady_s"] for r in runs)}


def line(case: str, run: int, r: Dict[str, Any]) -> str:
    o, t, q = r["optirs"], r["torch"], r["ratios"]
    compiled = sum(k["seconds"] for k in r["compiled"])
    return (f"{case:13s} run {run} ({'cold' if run == 1 else 'warm'}): import optirs.torch "
            f"{r['import_optirs_torch_s']:6.2f} s | construct optirs {o['construct_s']:6.3f} s, torch "
            f"{t['construct_s']:6.3f} s | optirs first {o['first_s']:7.3f} s, second "
            f"{o['second_s'] * 1e3:8.2f} ms, steady {o['steady_s'] * 1e3:7.2f} ms | torch {t['kind']} first "
            f"{t['first_s'] * 1e3:7.2f} ms, second {t['second_s'] * 1e3:6.2f} ms, steady {t['steady_s'] * 1e3:7.2f} ms | "
            f"first - torch first "
            f"{q['first_minus_torch_first_s']:+7.3f} s, construct + first - torch's {q['ready_minus_torch_ready_s']:+7.3f} s, "
            f"second / steady {q['second_over_steady']:5.2f}x | "
            f"{len(r['compiled'])} kernels compiled ({compiled:.1f} s)")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="torch device and optirs backend (default: cpu)")
    ap.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES), help="default: every case")
    ap.add_argument("--cache-dir", help="NUMBA_CACHE_DIR of the subprocesses (default: a new temporary directory "
                                        "per case, so that run 1 is cold; removed afterwards)")
    ap.add_argument("--steps", type=int, default=10, help="steps after the second whose median is the steady step")
    ap.add_argument("--warm-runs", type=int, default=3, help="fresh processes after the cold one (default 3)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", choices=tuple(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps={args.steps}, expected at least 1")
    if args.warm_runs < 1:
        ap.error(f"--warm-runs={args.warm_runs}, expected at least 1")
    if args.child:
        print(RESULT_PREFIX + json.dumps(child(args.child, args.device, args.steps)), flush=True)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"bench_first_step: torch {torch.__version__} sees no CUDA device; use --device cpu", file=sys.stderr)
            return 2
    env = environment(args.device)
    print("bench_first_step: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    print(f"cache: {args.cache_dir} (shared by every case; run 1 is cold only if it starts empty)" if args.cache_dir
          else "cache: a new empty temporary NUMBA_CACHE_DIR per case, so that run 1 compiles from nothing")
    results: Dict[str, Any] = {"environment": env, "device": args.device, "steps": args.steps,
                               "cache_dir": args.cache_dir, "cases": {}}
    for case in args.cases:
        cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="optirs-first-step-")
        try:
            runs = []
            for run in range(1, 2 + args.warm_runs):
                r = run_child(case, args.device, args.steps, cache_dir)
                r["ratios"] = ratios(r)
                runs.append(r)
                print(line(case, run, r), flush=True)
        except RuntimeError as exc:
            print(f"bench_first_step: {exc}", file=sys.stderr)
            return 1
        finally:
            if not args.cache_dir:
                shutil.rmtree(cache_dir, ignore_errors=True)
        median = warm_median(runs[1:])
        print(f"{case:13s} warm, median of {len(runs) - 1} runs: first - torch first "
              f"{median['first_minus_torch_first_s']:+7.3f} s, second {median['second_s'] * 1e3:6.2f} ms, steady "
              f"{median['steady_s'] * 1e3:6.2f} ms, second / steady {median['second_over_steady']:5.2f}x (torch's "
              f"{median['torch_second_over_steady']:5.2f}x)", flush=True)
        results["cases"][case] = {"cold": runs[0], "warm": runs[1], "warm_runs": runs[1:], "warm_median": median}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
