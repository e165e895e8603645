"""The cuda backend's steps whose count, lr and scalars live on the device (``optirs_step`` with ``controls.device``).

A capturable step is two launches on the step's stream: the family's one-thread scalars kernel
(``kernels.SCALARS_FUNCTIONS``: unless found_inf is set, advance the count, compute the record
from the constants, the step, the lr and the gradient factor, in float64, rounded to float32 as
the host does) and the generic step kernel reading that record (its ``rec`` argument) and the
found_inf flag (``flag``). Nothing is read back on the host, so the pair may be captured into a
CUDA graph and replayed.

Under capture nothing may be uploaded or compiled: the chunk and pointer tables, the compiled
kernels and the prepared launches must exist from a step outside the capture (torch's recipe
warms up on a side stream first); a step that would build them raises instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from optirs.backends.cuda.context import _head_types, device_address
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.plugin.hookspecs import AddressedArrays, DeviceStepInputs


def _address(array: Any, what: str) -> int:
    addr = device_address(array) if array is not None else 0
    if addr is None:
        raise InvalidParameterError(f"{what} is a {type(array).__name__}, expected a CUDA device array or None")
    return int(addr)


def _is_device_array(a: Any) -> bool:
    """A device array (by type, cheaply: no __cuda_array_interface__ dict is built per step)."""
    if isinstance(a, np.ndarray):
        return False
    is_cpu = getattr(a, "is_cpu", None)  # torch tensors
    if is_cpu is not None:
        return not is_cpu
    return device_address(a) is not None


class CudaCapturable:
    """Mixin of :class:`optirs.backends.cuda.CudaBackend`."""

    def _capturable_step(self, ctx, optimizer: str, params, grads, state, layout, scalars,
                               inputs: DeviceStepInputs) -> None:
        definition = DEFINITIONS[optimizer]
        family = definition.kernel
        fn = ctx.kernels.SCALARS_FUNCTIONS.get(family)
        if fn is None:
            raise UnsupportedOperationError(
                f"optimizer {optimizer!r} has no device-side scalars, expected an elementwise optimizer "
                f"({sorted(ctx.kernels.SCALARS_FUNCTIONS)}): its step needs per-tensor reductions between passes")
        vouched = type(params) is AddressedArrays and type(grads) is AddressedArrays
        for what, arrays in (() if vouched else (("params", params), ("grads", grads))):
            for i, a in enumerate(arrays):
                if not _is_device_array(a):
                    raise InvalidParameterError(
                        f"{what}[{i}] is a {type(a).__module__}.{type(a).__qualname__}"
                        f"{' on the CPU' if getattr(a, 'is_cpu', False) else ''}, expected a CUDA device array: a "
                        "capturable step takes device arrays only (CUDA tensors), not host arrays")
        handle = ctx.resolve_stream(params[0] if params else None)
        if layout.total == 0:
            return
        capturing = ctx.stream_capturing(handle)
        if vouched:  # the caller read the addresses (and checked the arrays)
            paddr, gaddr = params.addresses, grads.addresses
        else:
            paddr, gaddr = ctx.addresses(list(params), "params"), ctx.addresses(list(grads), "grads")
        warm = layout.cache.setdefault("cuda.capturable_warm", set())
        key = (optimizer, paddr, gaddr, type(scalars), len(inputs.constants))
        if capturing and key not in warm:
            raise UnsupportedOperationError(
                f"the first capturable {optimizer} step on these tensors was called while CUDA stream {handle:#x} is "
                "being captured, expected one step (a warm-up) before the capture: the kernels and device tables "
                "are built on the first step, and nothing can be uploaded during a capture")
        import numba

        lr = inputs.lr
        lr_addr = 0 if isinstance(lr, (int, float)) else _address(lr, "inputs.lr")
        record = _address(inputs.record, "inputs.record")
        flag = _address(inputs.found_inf, "inputs.found_inf")
        # every float last, in one tuple (the prepared launch rewrites it when it changes)
        floats = (float(lr) if lr_addr == 0 else 0.0, float(inputs.sign)) + tuple(float(c) for c in inputs.constants)
        sc_fn = ctx.compiled(f"scalars_{family}", fn, _head_types("scalars") + (numba.typeof(floats),))
        ctx.launch(sc_fn, (lr_addr, _address(inputs.steps, "inputs.steps"), len(layout),
                           _address(inputs.grad_scale, "inputs.grad_scale"), flag, record, floats), 1, 1)
        compiled, chunk, grid, block = ctx.plan(family, ctx.kernels.STEP_FUNCTIONS[family], "step", scalars, layout)
        chunks, nchunks = ctx.chunk_table(layout, chunk)
        ptrs = ctx.pointer_table(layout, paddr, gaddr)
        addrs, used = [0, 0, 0], 0
        for k, slot in enumerate(definition.slot_names()):
            if slot in state:
                addrs[k] = device_address(state[slot])
                used |= 1 << k
        ctx.launch(compiled, (chunks, ptrs, nchunks, *addrs, used, record, flag, scalars), grid, block)
        warm.add(key)

