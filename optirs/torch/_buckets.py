"""optirs.torch's buckets: one :class:`~optirs.optim.engine.StepEngine` per launch.

A bucket is one group's tensors on one device with one dtype and one step count. Its state is its
engine's, held in flat torch buffers that the engine's ``allocate`` callback makes: float32, or a
step format's buffers in their own dtypes (docs/formats.md: uint8 codes, float32 scales and
masters, int16 / int8 remainders, bfloat16 moments as ``torch.bfloat16`` whose uint16 bits the
kernels get), CPU buffers reaching the backend through ``optirs_host_view`` without a copy.
``opt.state[p]`` holds views of those buffers under torch's keys (a format's under its
checkpoint keys: ``exp_avg.codes``, ``exp_avg.scales``, ``master``, ``master_remainder``), so
``state_dict()`` sees the live state. Every ``state[p]["step"]`` is a view of one float32 buffer
per bucket, written after each step (by the device itself for device-side counts).

State that ``opt.state`` already holds (a loaded checkpoint, a bucket rebuilt over other tensors,
entries set by hand) is copied into new buffers, converted where its format differs
(:mod:`optirs.optim.state_convert`), and handed to the engine with ``engine.adopt``. A bucket
reads ``opt.state`` but writes it only in :meth:`Bucket.install`, which the front end calls after
the step transaction: a step that fails before it changes nothing.
"""

from __future__ import annotations

import math
import operator
import weakref
from itertools import repeat
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from optirs.core.definitions import OptimizerDefinition
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.core.formats import CODES_KINDS, StepFormat
from optirs.core.host_pages import advise_huge_pages
from optirs.core.layout import TensorLayout, storage_order
from optirs.optim import formats as fm
from optirs.optim.engine import PreparedStep, StepEngine
from optirs.optim.state_convert import MASTER_KEYS, TensorTarget, convert_entry, target_of
from optirs.plugin.hookspecs import AddressedArrays, DeviceStepInputs
from optirs.torch._dtensor import held, is_dtensor, local, shown
from optirs.torch._state import TrackedEntry, TrackedState

STATE_DTYPE = torch.float32
# numpy dtype of a state buffer -> the torch dtype it is held in (bfloat16 state as bfloat16: what a
# user sees in state_dict; the kernels get its uint16 bits)
_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.uint16): torch.bfloat16, np.dtype(np.uint8): torch.uint8,
          np.dtype(np.int16): torch.int16, np.dtype(np.int8): torch.int8}
_BITS = {torch.bfloat16: torch.uint16, torch.float16: torch.uint16}
_DATA_PTR = torch.Tensor.data_ptr
_IS = operator.is_
# the largest count a float32 step tensor holds exactly
MAX_STEP = 1 << 24


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def kernel_arrays(tensors: Sequence[torch.Tensor], on_cpu: bool, detach: bool) -> List[Any]:
    """The arrays the backend steps for ``tensors`` (same memory): numpy views on the CPU, the
    tensors on a device (read through ``__cuda_array_interface__``); 16-bit floats as their uint16 bits."""
    ts: Any = tensors
    if detach:  # a tensor that requires grad exports neither numpy nor __cuda_array_interface__
        ts = map(torch.Tensor.detach, ts)
    if tensors and tensors[0].dtype in _BITS:
        ts = map(torch.Tensor.view, ts, repeat(torch.uint16))
    if on_cpu:
        return list(map(torch.Tensor.numpy, ts))
    return list(ts)


def host_numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy of a tensor as numpy (bfloat16 as ml_dtypes.bfloat16)."""
    from optirs.torch.interop import host_array

    return np.array(host_array(t.detach().cpu()), copy=True)


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":  # ml_dtypes: torch.from_numpy does not know it
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype_name(dtype))


def step_value(value: Any, what: str) -> int:
    """A stored ``step`` as an int: a whole number >= 0 (a number, or a one-element tensor)."""
    number = value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            number = None
        else:
            number = value.item()
    if isinstance(number, (bool, np.bool_)) or not isinstance(number, (int, float, np.integer, np.floating)) \
            or not math.isfinite(number) or number < 0 or number != int(number) or number > MAX_STEP:
        raise InvalidParameterError(
            f"{what} has step={value!r}, expected a whole number >= 0 and <= {MAX_STEP} (an int, or a 1-element "
            "tensor holding one)")
    return int(number)


def _slot_views(state_layout: Any, slot: str, flat: torch.Tensor) -> List[Optional[torch.Tensor]]:
    """Per-tensor torch views of a flat float32 state buffer, where the definition's layout puts
    them: the layout answers with numpy views of a scratch host array (never touched), whose offsets
    and shapes are applied to the torch buffer, whatever its device."""
    probe = np.empty(flat.numel(), np.float32)
    base = probe.__array_interface__["data"][0]
    out: List[Optional[torch.Tensor]] = []
    for v in state_layout.views(slot, probe):
        if v is None:
            out.append(None)
            continue
        offset = (v.__array_interface__["data"][0] - base) // 4 if v.size else 0
        out.append(flat[offset : offset + v.size].view(v.shape))
    return out


def _format_views(fs: Any, flat: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
    """Per tensor: checkpoint key -> a torch view of its part of a format's flat buffers (as above)."""
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


def _allocator(bucket: "Bucket") -> Any:
    """The engine's allocate callback for ``bucket``, holding it weakly: the bound method would make
    the bucket and its engine a reference cycle, and a dropped optimizer's buffers (gigabytes of
    device memory) would wait for Python's garbage collector, which counts objects, not bytes."""
    method = weakref.WeakMethod(bucket._allocate)
    return lambda *args: method()(*args)


class Bucket:
    """One launch: a group's tensors on one device with one dtype and one step count (module docstring).

    :param storage: the state's step format (None: float32 tensors and state).
    :param names: how messages name each tensor (``param_groups[0]['params'][3]``).
    :param device_steps: the count lives on the device (``state[p]["step"]`` there) and every step
        takes device-side scalars (``capturable``, the GradScaler's device tensors).
    :param detach_grads: the gradients require grad (``create_graph=True``): detach them first.
    """

    def __init__(self, definition: OptimizerDefinition, backend: Any, params: List[torch.Tensor],
                 slots: Dict[str, float], storage: Optional[StepFormat], seed: int, has_step: bool, names: List[str],
                 device_steps: bool = False, detach_grads: bool = False):
        self.definition, self.backend, self.params, self.slots = definition, backend, params, slots
        self.storage, self.seed, self.has_step, self.names = storage, seed, has_step, names
        self.device = params[0].device
        self.on_cpu = self.device.type == "cpu"
        self.device_steps, self.detach_grads = device_steps, detach_grads
        # What the kernels address: each parameter's local tensor (a DTensor's shard), its dims in
        # memory order (a channels_last tensor as the row-major NHWC view of its memory), so that
        # the layout's flat runs are the tensors' spans. The front end checked that they are dense
        # and that each gradient has its parameter's strides.
        self.dist = any(map(is_dtensor, params))
        locals_ = list(map(local, params)) if self.dist else params
        self.orders = [storage_order(t.shape, t.stride()) if not t.is_contiguous() else None for t in locals_]
        self.permuted = any(o is not None for o in self.orders)
        self.inverse = [None if o is None else tuple(sorted(range(len(o)), key=o.__getitem__)) for o in self.orders]
        self.signature = [(tuple(t.shape), t.stride()) for t in locals_]
        self.layout = TensorLayout([tuple(t.shape) if o is None else tuple(t.shape[d] for d in o)
                                    for t, o in zip(locals_, self.orders)],
                                   [p.numel() for p in params] if self.dist else None)  # (a shard's whole tensor)
        self.fs = fm.format_state(definition, self.layout, storage, slots) if storage is not None else None
        self.engine = StepEngine(definition, backend, allocate=_allocator(self))
        self.flat: Optional[Dict[str, torch.Tensor]] = None
        self.refresh_params()
        self.formats: Dict[torch.dtype, Optional[StepFormat]] = {}
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=self.device if device_steps else "cpu")
        self.steps_host = self.steps.numpy() if not device_steps else None  # the host count's view
        # the 0-dim values torch keeps beside the step (definition.tensor_state: NAdam's mu_product,
        # ASGD's eta and mu): one float32 row per name, on the host as torch keeps them
        self.tensor_state_names = tuple(definition.tensor_state(definition.default_params(), 0)) \
            if definition.tensor_state is not None else ()
        self.tensor_state = torch.zeros((len(self.tensor_state_names), len(params)), dtype=torch.float32)
        self.hp_used: Any = None  # the hyperparameters of the last prepared step (its tensor_state)
        self.extras: List[Dict[str, Any]] = [{} for _ in params]
        self.entries: Optional[List[Dict[str, Any]]] = None  # opt.state's entries, once installed
        self._checks: tuple = ((), (), ())
        self.state_seen, self.version = None, None
        self._gcache: tuple = ((), (), [])  # on the CPU: the last gradients, their data pointers, their arrays
        self._gptrs: tuple = ()  # on a device: the last gradients' addresses
        self.last: Optional[PreparedStep] = None  # the last step prepared with host scalars (prepare_again's model)
        if device_steps:
            fields = definition.scalars_type._fields
            self.record = torch.zeros(len(fields), dtype=torch.float32, device=self.device)  # written on the device
            self.type_record: Any = None  # a record of the family: its type only (the hook reads the device one)

    def matches(self, params: List[torch.Tensor]) -> bool:
        """Whether ``params`` are laid out as when this bucket was made (shapes and strides)."""
        return [(tuple(t.shape), t.stride()) for t in map(local, params)] == self.signature

    def adapt(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """The gradients as the kernels address them (local shards, dims in memory order)."""
        if self.dist:
            grads = list(map(local, grads))
        if self.permuted:
            grads = [g if o is None else g.permute(o) for g, o in zip(grads, self.orders)]
        return grads

    def __repr__(self) -> str:
        return f"<optirs.torch bucket of {len(self.params)} tensors on {self.device}: {self.engine!r}>"

    # ------------------------------------------------------------ buffers

    def _allocate(self, sizes: Dict[str, int], dtypes: Dict[str, np.dtype], fills: Dict[str, float]) -> Dict[str, Any]:
        """The engine's allocate callback: flat torch buffers, and the backend's arrays over them."""
        flat = {}
        for k, n in sizes.items():
            dtype = _TORCH[np.dtype(dtypes[k])]
            buf = torch.empty(n, dtype=dtype, device=self.device)
            if buf.is_cpu:  # huge pages before the fill first writes it (numpy's own arrays have them)
                advise_huge_pages(buf.data_ptr(), buf.numel() * buf.element_size())
            value = fills[k]  # a bfloat16 fill is its bit pattern
            buf.view(_BITS.get(dtype, dtype)).fill_(int(value) if np.dtype(dtypes[k]).kind in "iu" else float(value))
            flat[k] = buf
        self.flat = flat
        return {k: self._array(v) for k, v in flat.items()}

    def _array(self, flat: torch.Tensor) -> Any:
        bits = flat.view(_BITS.get(flat.dtype, flat.dtype))
        if not flat.is_cpu:
            return bits
        backend = self.backend
        try:
            view = backend.host_view(bits.numpy())
        except Exception as exc:  # a plugin's own error names the plugin and the hook
            error = backend.plugin_error(exc, "optirs_host_view")
            if error is exc:
                raise
            raise error from exc
        if view is None:
            raise UnsupportedOperationError(
                f"backend {self.backend.name!r} cannot work in host memory, expected a backend whose memory is the "
                "host's for torch CPU tensors (backend='cpu')")
        return view

    def _buffer_spec(self) -> tuple:
        if self.fs is not None:
            fs = self.fs
            return fs.buffer_sizes(), fs.buffer_dtypes(), fs.buffer_fills(dict(self.slots))
        sizes = self.definition.state_layout(self.layout, tuple(self.slots)).buffer_sizes()
        return sizes, {k: np.dtype(np.float32) for k in sizes}, {k: float(self.slots[k]) for k in sizes}

    def stepped_views(self) -> List[Dict[str, torch.Tensor]]:
        """Per tensor: state key -> a view of its part of the flat buffers, as the kernels address it."""
        flat = self.flat
        if self.fs is not None:
            return _format_views(self.fs, flat)
        state_layout = self.definition.state_layout(self.layout, tuple(self.slots))
        per_slot = {k: _slot_views(state_layout, k, v) for k, v in flat.items()}
        return [{k: views[i] for k, views in per_slot.items() if views[i] is not None} for i in range(len(self.params))]

    def tensor_views(self) -> List[Dict[str, torch.Tensor]]:
        """Per tensor: state key -> a view of its part of the flat buffers, shaped as its local
        parameter (state shaped like a permuted parameter has the parameter's strides, as torch's
        ``zeros_like(p, memory_format=torch.preserve_format)`` state)."""
        views = self.stepped_views()
        if self.permuted:
            for entry, t, inverse in zip(views, self.stepped, self.inverse):
                if inverse is not None:
                    for k, v in entry.items():
                        if v.shape == t.shape:
                            entry[k] = v.permute(inverse)
        return views

    # ------------------------------------------------------------ state held in opt.state

    def adopt(self, entries: List[Optional[Dict[str, Any]]], step: int) -> None:
        """Copy the state ``opt.state`` holds for these tensors (converted where its format differs)
        into new buffers and hand them to the engine; entries that are empty keep a fresh state.
        Every entry is checked before the engine holds anything; ``opt.state`` is only read."""
        arrays = self._allocate(*self._buffer_spec())
        views = self.tensor_views()
        stepped = self.stepped_views() if self.permuted else views
        signed = {s.name: s.signed for s in self.definition.slots}
        for i, (entry, wanted) in enumerate(zip(entries, views)):
            if not entry:
                continue
            if self.dist and is_dtensor(self.params[i]):
                entry = {k: held(v, self.params[i], k) for k, v in entry.items()}
            what = f"the state of {self.names[i]}"
            self._check_codes(i, entry, what)
            if all(isinstance(entry.get(k), torch.Tensor) and entry[k].dtype == v.dtype and entry[k].shape == v.shape
                   for k, v in wanted.items()) and not any(entry.get(k) is not None for k in MASTER_KEYS
                                                          if k not in wanted):
                for k, v in wanted.items():  # as the buffers keep it: a copy, bit for bit
                    v.copy_(entry[k].detach())
                consumed = set(wanted)
            else:
                consumed = self._convert(i, entry, wanted, stepped[i], signed, what)
            self.extras[i] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in entry.items() if k != "step" and k not in consumed}
        self._adopt_tensor_state(entries, step)
        self.steps.fill_(float(step))
        self.engine.adopt(self.layout, self.slots, self.storage, arrays, step)

    def _adopt_tensor_state(self, entries: List[Optional[Dict[str, Any]]], step: int) -> None:
        """The tensor_state values the entries hold (else the definition's at ``step`` with default
        hyperparameters, until the next step writes them)."""
        if not self.tensor_state_names:
            return
        defaults = self.definition.tensor_state(self.definition.default_params(), step)
        for k, name in enumerate(self.tensor_state_names):
            for i, entry in enumerate(entries):
                value = (entry or {}).get(name)
                if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
                    value = float(value.item())
                elif not isinstance(value, float):
                    value = defaults[name]
                self.tensor_state[k, i] = value

    def _check_codes(self, i: int, entry: Dict[str, Any], what: str) -> None:
        """int8 codes are read in blocks of their own memory order: a checkpoint's must have the parameter's."""
        t = local(self.params[i])
        order = self.orders[i] or tuple(range(t.dim()))
        for k, v in entry.items():
            if k.rsplit(".", 1)[-1] in CODES_KINDS and isinstance(v, torch.Tensor) and v.shape == t.shape and v.dim() > 1 \
                    and storage_order(v.shape, v.stride()) != order:
                raise UnsupportedOperationError(
                    f"{what} has {k} with strides {v.stride()}, but the parameter has strides {t.stride()}; expected "
                    "int8 state saved from a parameter of the same memory layout: its scales belong to blocks of the "
                    "saved memory order (load the checkpoint into the model before changing its memory format)")

    def _convert(self, i: int, entry: Dict[str, Any], wanted: Dict[str, torch.Tensor],
                 stepped: Dict[str, torch.Tensor], signed: Dict[str, bool], what: str) -> set:
        """Tensor ``i``'s state from ``entry`` in another format (or dtype) than the buffers keep
        (``wanted``: its views shaped as the parameter; ``stepped``: as the kernels address them)."""
        p, order = self.stepped[i].detach(), self.orders[i]
        local_shape = local(self.params[i]).shape
        if order is not None:  # everything in the kernels' order (int8 blocks are runs of memory)
            entry = {k: (v.permute(order) if isinstance(v, torch.Tensor) and v.shape == local_shape else v)
                     for k, v in entry.items()}
            wanted = stepped
        source = {k: (host_numpy(v) if isinstance(v, torch.Tensor) else v) for k, v in entry.items() if k != "step"}
        words = host_numpy(p.view(torch.uint16) if p.dtype in _BITS else p)
        if self.fs is not None:
            target = target_of(self.fs, i, words)
        else:
            target = TensorTarget({k: (tuple(v.shape), _numpy_dtype(v.dtype)) for k, v in wanted.items()}, signed,
                                  None, words)
        out, consumed = convert_entry(source, target, what)
        for k, value in out.items():
            wanted[k].copy_(_from_numpy(value).view(wanted[k].shape))
        return consumed

    def install(self, state: Any) -> None:
        """Point ``opt.state[p]`` at this bucket's views (after the step transaction)."""
        views = self.tensor_views()
        step_views = list(self.steps.unbind(0)) if self.has_step else None
        owner = state if isinstance(state, TrackedState) else None
        entries = []
        named = [(name, list(self.tensor_state[k].unbind(0))) for k, name in enumerate(self.tensor_state_names)]
        for i, (p, view) in enumerate(zip(self.params, views)):
            entry = TrackedEntry(owner, self.extras[i])
            if step_views is not None:
                entry["step"] = step_views[i]
            for name, values in named:
                view[name] = values[i]
            entry.update(view if not is_dtensor(p) else
                         {k: (v if k in self.tensor_state_names else shown(v, p, k)) for k, v in view.items()})
            state[p] = entry
            entries.append(entry)
        self.entries = entries
        # (entry, key, value) of everything opt.state must still hold, flattened for a C-speed check
        triples = [(e, k, e[k]) for e, view in zip(entries, views) for k in view]
        if step_views is not None:
            triples += [(e, "step", s) for e, s in zip(entries, step_views)]
        self._checks = ([t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples])
        self.state_seen, self.version = None, None

    def intact(self, state: Any) -> bool:
        """Whether ``opt.state`` still holds this bucket's views (nothing replaced them): one
        comparison when nothing in ``opt.state`` changed since the last look (its version counts
        every entry and every value set or removed), else a look at each entry and value."""
        if self.entries is None:
            return False
        version = getattr(state, "version", None)
        if version is not None and version == self.version and state is self.state_seen:
            return True
        if not all(map(_IS, map(state.get, self.params), self.entries)):
            return False
        entries, keys, values = self._checks
        if not all(map(_IS, map(dict.get, entries, keys), values)):
            return False
        self.state_seen, self.version = state, version
        return True

    # ------------------------------------------------------------ the step

    def refresh_params(self) -> None:
        """The kernels' arrays over the parameters' current memory (on a device, with the addresses
        just read: the backend reads nothing again per step)."""
        ts = list(map(local, self.params)) if self.dist else self.params
        ptrs = tuple(map(_DATA_PTR, ts))  # (read first: a stale pair only re-reads them)
        self.stepped = [t if o is None else t.permute(o) for t, o in zip(ts, self.orders)]
        arrays = kernel_arrays(self.stepped, self.on_cpu, True)
        self.param_arrays = arrays if self.on_cpu else AddressedArrays(arrays, ptrs)
        self.param_ptrs = ptrs

    def grad_arrays(self, grads: List[torch.Tensor]) -> List[Any]:
        """The gradients as the backend reads them. On a device: the tensors themselves (16-bit ones
        too: no view per tensor and step) with their addresses, the same tuple object as the last
        step's when the addresses did not move (the backend's caches of a step's launch hit by
        identity), and no gradient kept after the step (``zero_grad()`` frees them, as with torch).
        On the CPU: numpy views, the same list as the last step's for the same tensors."""
        if self.dist or self.permuted:
            grads = self.adapt(grads)
        ptrs = tuple(map(_DATA_PTR, grads))
        if not self.on_cpu:
            if ptrs == self._gptrs:
                ptrs = self._gptrs
            else:
                self._gptrs = ptrs
            return AddressedArrays(list(map(torch.Tensor.detach, grads)) if self.detach_grads else grads, ptrs)
        last, last_ptrs, arrays = self._gcache
        if ptrs == last_ptrs and len(grads) == len(last) and all(map(_IS, grads, last)):
            return arrays
        arrays = kernel_arrays(grads, True, self.detach_grads)
        self._gcache = (grads, ptrs, arrays)  # one assignment: an interrupt leaves it whole
        return arrays

    def step_format(self, grad_dtype: torch.dtype) -> Optional[StepFormat]:
        """The step's format for gradients of ``grad_dtype`` (its storage is the bucket's)."""
        fmt = self.formats.get(grad_dtype, self)
        if fmt is self:
            from dataclasses import replace

            fmt = None if self.storage is None else replace(self.storage, grad_dtype=dtype_name(grad_dtype))
            self.formats[grad_dtype] = fmt
        return fmt

    def prepare(self, hp: Any, grads: List[torch.Tensor], factor: float, found_inf: Optional[bool],
                device: Optional[DeviceStepInputs] = None) -> PreparedStep:
        """The engine's prepared step over ``grads`` (nothing the engine holds changes)."""
        garrays = self.grad_arrays(grads)
        fmt = self.step_format(grads[0].dtype)
        self.hp_used = hp
        last = self.last
        if last is not None and device is None and found_inf is None and last.fmt is fmt:
            again = self.engine.prepare_again(last, self.param_arrays, garrays, hp, factor)
            if again is not None:
                self.last = again
                return again
        scalars = None
        if device is not None:
            if self.type_record is None:
                self.type_record = self.definition.scalars(hp, 1)
            scalars = self.type_record
        prepared = self.engine.prepare(self.param_arrays, garrays, shapes=self.layout.shapes, hp=hp, slots=self.slots,
                                       fmt=fmt, scalars=scalars, grad_factor=factor, found_inf=found_inf,
                                       device=device, seed=self.seed, layout=self.layout)
        self.last = prepared if device is None and found_inf is None else None
        return prepared

    def rehearse(self, hp: Any, grads: List[torch.Tensor], factor: float) -> None:
        """Prepare a next step like the last one and drop it (nothing is launched; the engine holds
        nothing new): a warm-up of the repeat step's path."""
        last = self.last
        if last is None or self.device_steps or self.engine.state is None or last.fmt is not self.step_format(
                grads[0].dtype):
            return
        again = self.engine.prepare_again(last, self.param_arrays, self.grad_arrays(grads), hp, factor)
        if again is not None:
            again.grads = None

    def finish(self, prepared: PreparedStep) -> None:
        """After the transaction: the step tensors follow a host count; the step, kept as the model
        of the next, lets go of its gradients (nothing holds them past the step)."""
        prepared.grads = None
        if prepared.applied and self.has_step and not self.device_steps:
            self.steps_host[...] = self.engine.step_count  # (a numpy view: a torch fill_ costs more)
        if prepared.applied and self.tensor_state_names:
            values = self.definition.tensor_state(self.hp_used, self.engine.step_count)
            for k, name in enumerate(self.tensor_state_names):
                self.tensor_state[k].fill_(values[name])


__all__ = ["Bucket", "STATE_DTYPE", "dtype_name", "kernel_arrays", "step_value"]
