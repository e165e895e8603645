"""Where each tensor's optimizer state lives in the flat state buffers, and the chunk table.

Optimizer state is one flat buffer per slot (``exp_avg``, ``exp_avg_sq``, ...) holding every
tensor back to back, so a step over a whole model is one launch. The chunk table (the apex
``multi_tensor_apply`` idea) splits the model into pieces of at most ``chunk`` elements, each
naming its tensor and range, so one parallel loop or one grid covers every tensor.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np


class TensorLayout:
    """The shapes of a model's tensors and their offsets into the flat state buffers."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]]):
        self.shapes: List[Tuple[int, ...]] = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = np.array([int(np.prod(s, dtype=np.int64)) for s in self.shapes], dtype=np.int64)
        self.offsets = np.zeros(len(self.shapes), dtype=np.int64)
        if len(self.shapes) > 1:
            np.cumsum(self.sizes[:-1], out=self.offsets[1:])
        self.total = int(self.sizes.sum())
        # Backends keep prepared, per-layout data here (device chunk tables, typed lists, ...),
        # so a step does not rebuild it.
        self.cache: Dict[object, object] = {}
        self._chunks: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.shapes)

    def matches(self, shapes: Sequence[Tuple[int, ...]]) -> bool:
        return [tuple(s) for s in shapes] == self.shapes

    def views(self, flat: np.ndarray) -> List[np.ndarray]:
        """Per-tensor views (shaped like the tensors) into a flat host buffer."""
        return [flat[o : o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def chunks(self, chunk: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tensor index, start, stop) of every chunk of at most ``chunk`` elements, as int64 arrays."""
        if chunk not in self._chunks:
            counts = (self.sizes + chunk - 1) // chunk
            tensor = np.repeat(np.arange(len(self.sizes), dtype=np.int64), counts)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            start = (np.arange(len(tensor), dtype=np.int64) - first) * chunk
            stop = np.minimum(start + chunk, self.sizes[tensor])
            self._chunks[chunk] = (tensor, start.astype(np.int64), stop.astype(np.int64))
        return self._chunks[chunk]
