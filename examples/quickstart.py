"""The seed example: Adam on 1,024 parameters, state moved to the device, one step, moved back.

    python examples/quickstart.py [backend]
"""

import argparse

import numpy as np

from optirs import AdamParams, GpuAdam, GpuOptimizerConfig

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("backend", nargs="?", default="auto",
                help="cpu, cuda, opencl or a plugin's name (default: auto, the fastest kind of device found; "
                     "`optirs info` says which)")
backend = ap.parse_args().backend
optimizer = GpuAdam(AdamParams(lr=1e-3), config=GpuOptimizerConfig(backend=backend))
optimizer.move_to_gpu()

params = np.full(1024, 1.0, dtype=np.float32)
grads = np.full(1024, 0.01, dtype=np.float32)
optimizer.step_gpu(params, grads)

# Bring the moment estimates back to host memory when done.
optimizer.move_to_cpu()

state = optimizer.state_dict()["state"][0]
print(f"backend: {optimizer.backend.name} ({optimizer.backend.devices[0].name})")
print(f"params[0] after one step: {params[0]:.6f} (expected 1 - lr = {1 - 1e-3:.6f})")
print(f"exp_avg[0] = {state['exp_avg'][0]:.6f}, exp_avg_sq[0] = {state['exp_avg_sq'][0]:.3e}")
