"""The seed example: Adam on 1,024 parameters, state moved to the device, one step, moved back.

Run: python examples/quickstart.py [backend]   (default: auto, the fastest kind of device found; `optirs info` says which)
"""

import sys

import numpy as np

from optirs import AdamParams, GpuAdam, GpuOptimizerConfig

backend = sys.argv[1] if len(sys.argv) > 1 else "auto"
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
