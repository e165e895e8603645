"""optirs.torch under FSDP2 (``fully_shard``): one spawned 2-process gloo group on the CPU.

The ranks run tests/fsdp_worker.py (every check in one group, tiny models): AdamW's trajectory
equals torch.optim.AdamW's on the same sharding and torch's on the whole model, its state is
DTensors placed as the parameters, bfloat16 state, a distributed checkpoint saved and loaded into
the same sharding and into another (dim 1) resumes exactly, int8 state equals the unsharded run
bit for bit and resumes exactly into another sharding and into one rank, Adafactor and LAMB with
their sums reduced over the mesh equal them on the whole model, Muon gathers each matrix, DDP
keeps the ranks in sync, and what a shard cannot step (int8 shards cutting blocks, Adafactor on
bfloat16 shards, Partial placements) is refused with the step changing nothing. CPUOffload under
FSDP2: tests/test_torch_offload_fsdp.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
pytest.importorskip("torch.distributed.fsdp")
from torch.distributed import fsdp  # noqa: E402

if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("fsdp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(program: Path, args: list, world: int) -> str:
    """Run ``python program *args`` as ``world`` ranks of a gloo / nccl group on this host; assert
    that every rank exits 0 (the report: each rank's last output). Returns the report."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(program), *map(str, args)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    report = "\n".join(f"--- rank {r} (exit {p.returncode}):\n{out[-6000:]}" for r, (p, out) in
                       enumerate(zip(procs, outputs)))
    assert all(p.returncode == 0 for p in procs), report
    return report


def test_fsdp2_two_ranks_on_gloo(tmp_path):
    report = spawn(WORKER, [tmp_path], 2)
    assert (tmp_path / "done").read_text() == "ok", report


@pytest.mark.gpu
def test_fsdp2_on_one_gpu_equals_torch(tmp_path):
    """benchmarks/bench_fsdp2.py --smoke on CUDA (nccl, one rank): optirs.torch.AdamW's parameters
    after 3 FSDP2 steps on the same gradients equal torch's fused AdamW's to rounding."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs torch with a real CUDA GPU and nccl")
    out = tmp_path / "fsdp2.json"
    env = dict(os.environ, MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fsdp2.py"), "--smoke", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    import json

    result = json.loads(out.read_text())
    assert result["max_abs_diff_after_3_steps"] < 1e-5, result  # same gradients; a wrong step is off by ~1e-3
