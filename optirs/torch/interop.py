"""Bridges between the seed API (``optirs.GpuAdam`` ...) and torch.

- :func:`portable_state_dict`: a seed optimizer's ``state_dict()`` with its numpy arrays as torch
  tensors, so ``torch.save`` / ``torch.load(weights_only=True)`` round-trip it (what
  ``state_dict(portable=True)`` returns); the seed's ``load_state_dict`` takes it back as it is
  (it converts torch tensors back to numpy exactly, bfloat16 included).
- :func:`host_arrays`: torch CPU tensors as numpy views of the same memory (zero copy), torch
  CUDA tensors detached (they export ``__cuda_array_interface__``), anything else unchanged:
  what the seed API's ``step_gpu`` accepts.
"""

from __future__ import annotations

from typing import Any, List, Mapping

import numpy as np
import torch


def _portable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype.name == "bfloat16":  # ml_dtypes.bfloat16: torch.from_numpy does not know it
            bits = np.ascontiguousarray(value).view(np.int16).copy()
            return torch.from_numpy(bits).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_portable(v) for v in value)
    return value


def portable_state_dict(state_dict: Mapping[str, Any]) -> dict:
    """A seed optimizer's checkpoint that ``torch.load(weights_only=True)`` accepts (arrays as tensors)."""
    return _portable(state_dict)


def host_array(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        if not a.is_cpu:
            return a.detach()
        if a.dtype == torch.bfloat16:  # numpy has no bfloat16: the same memory as ml_dtypes.bfloat16
            import ml_dtypes

            return a.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return a.detach().numpy()
    return a


def host_arrays(arrays: Any) -> Any:
    """One array or a list: torch tensors as the arrays optirs steps in place (no copies)."""
    if isinstance(arrays, (list, tuple)):
        return [host_array(a) for a in arrays]
    return host_array(arrays)
