"""Where each tensor's optimizer state lives in the flat state buffers, and the chunk table.

Optimizer state is one flat buffer per slot (``exp_avg``, ``exp_avg_sq``, ...) holding every
tensor back to back, so a step over a whole model is one launch. Each tensor starts at a multiple
of :data:`ALIGN` elements: a tensor of odd size early in a model would otherwise move every later
tensor's state off the grid of the kernels' vector accesses (8 elements a lane), and the whole
step onto their scalar path (1.5-2.4x slower on the GPU, docs/formats.md). The gaps cost at most
7 elements a tensor and slot; nothing reads them. The chunk table (the apex
``multi_tensor_apply`` idea) splits the model into pieces of at most ``chunk`` elements, each
naming its tensor and range, so one parallel loop or one grid covers every tensor.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np


ALIGN = 8  # elements: where each tensor's part of a flat buffer starts (a multiple of this)


def aligned_offsets(sizes: Sequence[int], align: int = ALIGN) -> Tuple[np.ndarray, int]:
    """(int64 offsets, total elements) of tensors of ``sizes`` back to back in one flat buffer, each
    starting at a multiple of ``align`` elements (``total`` ends at the last tensor's last element)."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    room = -(-sizes // align) * align
    offsets = np.cumsum(room) - room
    return offsets, int(offsets[-1] + sizes[-1]) if len(sizes) else 0


def pack_into(out: np.ndarray, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> np.ndarray:
    """``arrays`` copied into the flat host array ``out``, each from its offset; returns ``out``."""
    for a, o in zip(arrays, offsets):
        a = np.asarray(a).reshape(-1)
        out[int(o) : int(o) + a.size] = a
    return out


class TensorLayout:
    """The shapes of a model's tensors and their offsets into the flat state buffers.

    :param shapes: each tensor's shape.
    :param whole_sizes: for shards (a DTensor's local tensor), the elements of each whole tensor.
    :param align: each offset is a multiple of this many elements (:data:`ALIGN`; 1 packs the
        tensors without gaps). ``total`` is the elements a flat buffer needs, gaps included.
    """

    def __init__(self, shapes: Sequence[Tuple[int, ...]], whole_sizes: Optional[Sequence[int]] = None,
                 align: int = ALIGN):
        self.shapes: List[Tuple[int, ...]] = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = np.array([int(np.prod(s, dtype=np.int64)) for s in self.shapes], dtype=np.int64)
        # the elements of the whole tensor each entry is a part of (a DTensor's shard: its global
        # tensor): what decides a state format's per-tensor choices, so every sharding agrees
        self.whole_sizes = self.sizes if whole_sizes is None else np.array(whole_sizes, dtype=np.int64)
        self.align = int(align)
        self.offsets, self.total = aligned_offsets(self.sizes, self.align)
        # Backends keep prepared, per-layout data here (device chunk tables, typed lists, ...),
        # so a step does not rebuild it.
        self.cache: Dict[object, object] = {}
        self._chunks: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.shapes)

    def matches(self, shapes: Sequence[Tuple[int, ...]]) -> bool:
        return [tuple(s) for s in shapes] == self.shapes

    def views(self, flat: Any) -> List[Any]:
        """Per-tensor views (shaped like the tensors) into a flat buffer (numpy, a device array, torch)."""
        return [flat[int(o) : int(o) + int(n)].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def pack(self, arrays: Sequence[np.ndarray], dtype: Any = np.float32) -> np.ndarray:
        """One flat host array of ``total`` elements holding ``arrays`` at the offsets (zeros between)."""
        return pack_into(np.zeros(self.total, dtype), arrays, self.offsets)

    def chunks(self, chunk: int, grid: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tensor index, start, stop) of every chunk of at most ``chunk`` elements, as int64 arrays.

        ``grid`` (a divisor of ``chunk``, 0 for none): each tensor's chunks end where its state
        offsets cross a multiple of ``chunk`` (rounded down to a multiple of ``grid`` within the
        tensor), so that every chunk but a tensor's first and last covers one aligned piece of the
        flat buffers; starts stay multiples of ``grid`` within their tensor."""
        key = (chunk, grid)
        if key not in self._chunks:
            if grid:
                # the first chunk of each tensor takes it up to the flat grid, the rest are whole
                lead = (chunk - self.offsets % chunk) % chunk // grid * grid
                lead = np.where(lead == 0, chunk, lead)
                lead = np.minimum(lead, self.sizes)
                counts = np.where(self.sizes > 0, 1 + (self.sizes - lead + chunk - 1) // chunk, 0)
            else:
                lead = np.full(len(self.sizes), chunk, np.int64)
                counts = (self.sizes + chunk - 1) // chunk
            tensor = np.repeat(np.arange(len(self.sizes), dtype=np.int64), counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            k = np.arange(len(tensor), dtype=np.int64) - first
            start = np.where(k == 0, 0, lead[tensor] + (k - 1) * chunk)
            stop = np.minimum(np.where(k == 0, lead[tensor], start + chunk), self.sizes[tensor])
            self._chunks[key] = (tensor, start.astype(np.int64), stop.astype(np.int64))
        return self._chunks[key]


def storage_order(shape: Sequence[int], strides: Sequence[int]) -> Optional[Tuple[int, ...]]:
    """The order of dims, outermost first, in which a strided tensor's elements lie in memory when
    they fill one span without gaps or overlaps (row-major: ``(0, 1, ..., n-1)``; channels_last
    NCHW: ``(0, 2, 3, 1)``), or None when they do not (a slice, an expanded or overlapping view).

    An elementwise step over such a tensor can address its span as one flat run of elements, in
    any order, provided every tensor it reads with it has the same strides. Dims of size 1 keep
    their place (their stride is arbitrary)."""
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    n = len(shape)
    if any(s == 0 for s in shape):
        return tuple(range(n))  # nothing to address
    moving = sorted((d for d in range(n) if shape[d] > 1), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(moving):
        if strides[d] != expected:
            return None
        expected *= shape[d]
    # the size-1 dims keep their positions; the others take the remaining places in memory order
    order, it = [], iter(moving)
    for d in range(n):
        order.append(d if shape[d] == 1 else next(it))
    return tuple(order)
