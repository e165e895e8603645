"""optirs.torch's buckets of 16-bit parameters and compact state (docs/formats.md).

A :class:`_FormatBucket` is one launch of the backend's ``formats`` capability over one group's
tensors on one device with one dtype: flat torch buffers as the bucket's
:class:`~optirs.core.formats.FormatState` says (uint8 codes, float32 block scales and small-tensor
state, bfloat16 moments, float32 masters, int16 / int8 remainders), and ``opt.state[p]`` as
views of them under the checkpoint keys (``exp_avg``, ``exp_avg.codes``, ``exp_avg.scales``,
``master``, ``master_remainder``), so ``state_dict()`` holds the compact buffers as tensors and
``load_state_dict`` brings them back (the front end keeps their dtypes: torch would cast them to
the parameter's).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from optirs.core.errors import InvalidParameterError, ShapeMismatchError
from optirs.core.formats import FormatState, StepFormat, format_slots
from optirs.core.layout import TensorLayout
from optirs.optim import formats as fm
from optirs.plugin.hookspecs import StepControls, StepRequest

# numpy dtype of a FormatState buffer -> the torch dtype it is held in (bfloat16 state as bfloat16:
# what a user sees in state_dict; the kernels get its uint16 bits).
_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.uint16): torch.bfloat16, np.dtype(np.uint8): torch.uint8,
          np.dtype(np.int16): torch.int16, np.dtype(np.int8): torch.int8}
_BITS = {torch.bfloat16: torch.uint16, torch.float16: torch.uint16}


def _kernel_array(backend, t: torch.Tensor):
    """The array the formats hooks read for a tensor: 16-bit floats as their uint16 bits, in place."""
    t = t.detach()
    bits = _BITS.get(t.dtype)
    if bits is not None:
        t = t.view(bits)
    return t if not t.is_cpu else t.numpy()


def _views(fs: FormatState, flat: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
    """Per tensor: checkpoint key -> a torch view of its part of the flat buffers.

    ``FormatState.tensor_views`` answers with numpy views of host buffers; the same offsets are
    read off scratch arrays (never touched) and applied to the torch buffers, whatever the device.
    """
    dtypes = fs.buffer_dtypes()
    probes = {k: np.empty(v.numel(), dtypes[k]) for k, v in flat.items()}
    bases = {k: v.__array_interface__["data"][0] for k, v in probes.items()}
    out = []
    for t in range(len(fs.layout)):
        entry = {}
        for key, view in fs.tensor_views(t, probes).items():
            buffer = f"{key}.small" if fs.int8 and key in fs.slot_names else key
            offset = (view.__array_interface__["data"][0] - bases[buffer]) // view.itemsize if view.size else 0
            entry[key] = flat[buffer][offset : offset + view.size].view(view.shape)
        out.append(entry)
    return out


class _FormatBucket:
    """One formats launch: one group's tensors on one device with one dtype and one step count."""

    def __init__(self, opt, definition, backend, params: List[torch.Tensor], slots: Dict[str, float], step: int,
                 storage: StepFormat, hp: Any, seed: int):
        fm.check_backend(backend, storage)
        self.seed = seed
        self.definition, self.backend, self.params, self.slots = definition, backend, params, slots
        self.storage, self.step, self.has_step = storage, step, opt._has_step_state
        self.key = tuple(map(id, params))
        device = params[0].device
        self.layout = TensorLayout([tuple(p.shape) for p in params])
        self.fs = FormatState(self.layout, format_slots(definition, hp), storage)
        sizes, dtypes = self.fs.buffer_sizes(), self.fs.buffer_dtypes()
        fills = self.fs.buffer_fills(dict(slots))
        self.flat = {}
        for k, n in sizes.items():
            dtype = _TORCH[dtypes[k]]
            buf = torch.empty(n, dtype=dtype, device=device)
            fill = np.array([fills[k]]).astype(dtypes[k])  # bits of bfloat16 fills
            buf.view(_BITS.get(dtype, dtype)).fill_(int(fill[0]) if dtypes[k].kind in "iu" else float(fill[0]))
            self.flat[k] = buf
        self.views = _views(self.fs, self.flat)
        self.device_state = {k: self._state_array(v) for k, v in self.flat.items()}
        self.param_arrays = [_kernel_array(backend, p) for p in params]
        self.param_ptrs = [p.data_ptr() for p in params]
        self.steps = torch.full((len(params),), float(step), dtype=torch.float32)
        self.step_views = [self.steps[i] for i in range(len(params))]
        # Copy existing (loaded) state in, checked before opt.state is pointed at the views.
        for i, p in enumerate(params):
            old = opt.state.get(p, {}) if p in opt.state else {}
            keys = {k for k in old if k != "step"}
            if not keys:
                continue
            want = self.views[i]
            if keys != set(want):
                raise InvalidParameterError(
                    f"state of a parameter of shape {tuple(p.shape)} has keys {sorted(keys)}, expected {sorted(want)} "
                    f"for the format {fm.describe_format(storage)}")
            for k, view in want.items():
                value = old[k]
                if not isinstance(value, torch.Tensor) or value.dtype != view.dtype:
                    raise InvalidParameterError(
                        f"state[{k!r}] of a parameter of shape {tuple(p.shape)} is "
                        f"{getattr(value, 'dtype', type(value).__name__)}, expected {view.dtype} (compact state is kept as it is)")
                if tuple(value.shape) != tuple(view.shape):
                    raise ShapeMismatchError(f"state[{k!r}] of a parameter of shape {tuple(p.shape)} has shape "
                                             f"{tuple(value.shape)}, expected {tuple(view.shape)}")
        for i, p in enumerate(params):
            old = opt.state.get(p, {}) if p in opt.state else {}
            for k, view in self.views[i].items():
                if k in old:
                    view.copy_(old[k].detach().to(device=device))
            entry: Dict[str, Any] = {"step": self.step_views[i]} if self.has_step else {}
            entry.update(self.views[i])
            opt.state[p] = entry
        self.entries = [opt.state[p] for p in params]

    def _state_array(self, flat: torch.Tensor):
        bits = flat.view(_BITS.get(flat.dtype, flat.dtype))
        if not flat.is_cpu:
            return bits
        view = self.backend.host_view(bits.numpy())
        if view is None:
            from optirs.core.errors import UnsupportedOperationError

            raise UnsupportedOperationError(f"backend {self.backend.name!r} cannot work in host memory, expected a "
                                            "backend whose memory is the host's for torch CPU tensors (backend='cpu')")
        return view

    def intact(self, opt) -> bool:
        state = opt.state
        for p, entry, ptr, views, step in zip(self.params, self.entries, self.param_ptrs, self.views, self.step_views):
            if state.get(p) is not entry or p.data_ptr() != ptr:
                return False
            if any(entry.get(k) is not v for k, v in views.items()):
                return False
            if self.has_step and entry.get("step") is not step:
                return False
        return True

    def launch(self, hp: Any, factor: float) -> None:
        backend = self.backend
        grads = [p.grad for p in self.params]
        # the unscale and maximize's sign inside the step: the scalars' grad_factor
        scalars = self.definition.scalars(hp, self.step + 1, grad_factor=factor)
        gdtype = str(grads[0].dtype).replace("torch.", "")
        garrays = [_kernel_array(backend, g) for g in grads]
        fmt = replace(self.storage, grad_dtype=gdtype)
        staged = backend.stage(backend.ctx, self.param_arrays, garrays, fmt)
        backend.step(backend.ctx, StepRequest(self.definition, staged.params, staged.grads, self.device_state, self.layout,
                                              scalars, StepControls(self.step + 1, self.seed), fmt, self.fs))
        if staged.finish is not None:
            staged.finish()
        self.step += 1
        if self.has_step:
            self.steps.fill_(float(self.step))
