"""Buffer slots and the resident grid, shared by the float32 step's and the formats' chunked kernels.

OpenCL 1.2 kernels take no table of pointers, so a chunked launch takes a fixed number of parameter
and gradient buffers as arguments (the slots) and a tensor table names each tensor's slots. A
device takes as many as its kernel argument space holds (:func:`slot_count`: 128 on NVIDIA's
driver, 32 on PoCL), so the kernels' slot arguments and the pick of a slot's buffer are macros
generated for that count (:func:`slot_macros`) in front of the kernel file: one program per count,
and pyopencl's binary cache, keyed by the source, keeps them apart.

A launch is a resident grid (:func:`deal`): as many work-groups as the compute units keep at once,
each taking chunks from a counter on the device (:class:`Tickets`) until none are left. The
dealing itself is ``DEAL_CHUNK`` of ``optirs_chunks.h``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

from optirs.core.errors import GpuOptimError, InvalidParameterError

# The slot counts a device may get, largest first: a power of two keeps the pick a balanced tree.
SLOT_COUNTS = (128, 64, 32, 16)
# Bytes of argument space kept for the arguments other than the slots (state buffers, tables,
# the counter, the scalar record): the formats' LAMB apply pass needs the most, 312 (argument_bytes).
OTHER_ARGUMENTS = 512
# Work-items per compute unit a launch's grid holds: 2048 is the most an NVIDIA SM keeps; a
# work-group that does not fit starts late, finds no chunk left and ends, so more costs nothing.
RESIDENT = 2048


def slots_for(parameter_bytes: int) -> int:
    """Buffers of each kind one launch takes on a device whose kernel arguments may fill
    ``parameter_bytes`` (``CL_DEVICE_MAX_PARAMETER_SIZE``): the most of 128, 64, 32 whose pointers
    (16 bytes a slot: a parameter and a gradient buffer) leave OTHER_ARGUMENTS, else 16 (the
    OpenCL 1.2 minimum of 1024 bytes holds 32)."""
    return next((n for n in SLOT_COUNTS[:-1] if 16 * n + OTHER_ARGUMENTS <= parameter_bytes), SLOT_COUNTS[-1])


def slot_count(device: Any) -> int:
    """:func:`slots_for` the device's ``max_parameter_size`` (NVIDIA's driver: 4352 bytes, 128
    slots; PoCL: 1024, 32). Fewer launches for a model of many buffers, fewer launch tails."""
    return slots_for(int(device.max_parameter_size))


def slot_macros(slots: int) -> str:
    """The program's first lines: OPTIRS_SLOTS, SLOT_PARAMS(X, TY) (the kernel arguments
    ``__global TY *X0`` .. ``X<slots-1>``) and PICK(s, X) (slot s's buffer, a balanced tree of
    conditionals that work-item 0 evaluates once per chunk)."""
    if slots not in SLOT_COUNTS:
        raise InvalidParameterError(f"slots={slots!r}, expected one of {SLOT_COUNTS}")

    def tree(lo: int, hi: int) -> str:
        if hi - lo == 1:
            return f"X##{lo}"
        mid = (lo + hi) // 2
        return f"((s) < {mid} ? {tree(lo, mid)} : {tree(mid, hi)})"

    params = ", ".join(f"__global TY *X##{k}" for k in range(slots))
    return (f"#define OPTIRS_SLOTS {slots}\n#define SLOT_PARAMS(X, TY) {params}\n"
            f"#define PICK(s, X) {tree(0, slots)}\n")


def argument_bytes(arg_types: Sequence[Any], address_bytes: int = 8) -> int:
    """The bytes a kernel's arguments take, from the types the host sets (``None``: a buffer
    pointer; a numpy scalar type or record), each at its own alignment (a record's: 4, its fields
    being 4-byte words)."""
    total = 0
    for t in arg_types:
        if t is None:
            size = align = address_bytes
        else:
            dt = np.dtype(t)
            size, align = dt.itemsize, (4 if dt.fields else dt.itemsize)
        total = -(-total // align) * align + size
    return total


def check_argument_space(device: Any, kernels: Dict[str, Sequence[Any]]) -> None:
    """Refuse, naming the kernel, a kernel whose arguments overflow the device's argument space
    (the driver would fail the launch with a bare INVALID_KERNEL_ARGS)."""
    room, address = int(device.max_parameter_size), int(device.address_bits) // 8
    for name, types in kernels.items():
        need = argument_bytes(types, address)
        if need > room:
            raise GpuOptimError(f"OpenCL kernel {name} takes {need} bytes of arguments, the device "
                                f"{device.name.strip()!r} allows {room} (CL_DEVICE_MAX_PARAMETER_SIZE)")


# ---------------------------------------------------------------- launch groups


class Group(NamedTuple):
    """One chunked launch: its chunk range and, per slot, the index of a tensor whose buffer fills it."""

    chunk_begin: int
    chunk_end: int
    p_holders: Tuple[int, ...]
    g_holders: Tuple[int, ...]

    def buffers(self, ctx: Any, params: List[Any], grads: List[Any]) -> List[Any]:
        # Buffers are looked up on the caller's arrays at launch, so a cached plan holds no device memory.
        pad, slots = [ctx.dummy], ctx.slots
        return ([params[i].base_data for i in self.p_holders] + pad * (slots - len(self.p_holders))
                + [grads[i].base_data for i in self.g_holders] + pad * (slots - len(self.g_holders)))


class SlotGrouper:
    """Splits a model into launch groups of at most ``slots`` distinct parameter and gradient buffers.

    Tensors are added in order; ``add`` returns the tensor's (parameter slot, gradient slot) in its
    group and ``finish`` the groups (chunk ranges from the layout's chunk table)."""

    def __init__(self, tables: Any, slots: int):
        self.tables, self.groups, self.slots = tables, [], slots
        self._t0, self._pslots, self._gslots, self._pholders, self._gholders = 0, {}, {}, [], []

    def _close(self, t1: int) -> None:
        first = self.tables.host_first
        if first[t1] > first[self._t0]:
            self.groups.append(Group(int(first[self._t0]), int(first[t1]), tuple(self._pholders), tuple(self._gholders)))

    def add(self, t: int, pkey: int, gkey: int, pholder: int, gholder: int) -> Tuple[int, int]:
        """Tensor ``t`` reads the parameter buffer ``pkey`` (held by tensor ``pholder``) and the gradient buffer ``gkey``."""
        if (pkey not in self._pslots and len(self._pslots) == self.slots) or \
                (gkey not in self._gslots and len(self._gslots) == self.slots):
            self._close(t)
            self._t0, self._pslots, self._gslots, self._pholders, self._gholders = t, {}, {}, [], []
        if pkey not in self._pslots:
            self._pslots[pkey] = len(self._pholders)
            self._pholders.append(pholder)
        if gkey not in self._gslots:
            self._gslots[gkey] = len(self._gholders)
            self._gholders.append(gholder)
        return self._pslots[pkey], self._gslots[gkey]

    def finish(self, ntens: int) -> List[Group]:
        self._close(ntens)
        return self.groups


# ---------------------------------------------------------------- the resident grid


class Tickets:
    """The counter the launches deal chunks from (one per context, on the device) and the value it
    will hold once the queued launches have run: a launch takes ``nchunks + work-groups`` tickets
    (every work-group's last take finds no chunk; a launch that found_inf skips adds as many), so
    the host knows each launch's first ticket without reading the counter back. The counter is
    never reset; it wraps at 2**32 on both sides."""

    def __init__(self, ctx: Any):
        cl = ctx.cl
        self.buffer = cl.Buffer(ctx.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                hostbuf=np.zeros(1, np.uint32))
        self.next = 0


def resident_groups(ctx: Any, wg: int, variable: str) -> int:
    """The most work-groups of ``wg`` work-items a launch has: the environment ``variable`` (work-items
    per compute unit, else RESIDENT) over ``wg``, at least one work-group per compute unit."""
    text = os.environ.get(variable, "").strip()
    if text and (not text.isdigit() or int(text) < 1):
        raise InvalidParameterError(f"{variable}={text!r}, expected a number of work-items >= 1")
    return max(1, (int(text) if text else RESIDENT) // wg) * ctx.compute_units


def deal(ctx: Any, kernel: Any, wg: int, head: Sequence[Any], nchunks: int, tail: Sequence[Any], most: int) -> None:
    """Launch ``kernel`` over ``nchunks`` chunks in at most ``most`` work-groups of ``wg``: ``head``
    (the arguments before the counter's), then ``tickets, ticket_base``, then ``tail``. The caller
    holds ``ctx.lock`` (the ticket arithmetic assumes the launches reach the queue in order)."""
    tickets = ctx.tickets
    groups = max(1, min(nchunks, most))
    kernel(ctx.queue, (groups * wg,), (wg,), *head, tickets.buffer, tickets.next, *tail)
    tickets.next = (tickets.next + nchunks + groups) & 0xFFFFFFFF
