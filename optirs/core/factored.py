"""Where Adafactor's factored second moments live in their flat state buffers.

Adafactor's state is not one value per element: a tensor of 2+ dims keeps a row mean per row and
a column mean per column of its last two dims (leading dims batched), a 0-1 dim tensor a full
``variance``. Each slot is still one flat buffer for the whole model (so a step is whole-model
work), but with its own per-tensor sizes and offsets, which this layout derives from the
model's :class:`optirs.core.layout.TensorLayout`. Tensors without a slot take 0 elements in it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from optirs.core.layout import TensorLayout
from optirs.core.reference import adafactor_state_shapes

SLOTS = ("row_var", "col_var", "variance")

# Columns of :meth:`FactoredLayout.table`, the per-tensor table the kernels read.
FACTORED, SIZE, BATCH, ROWS, COLS, ROW_OFF, COL_OFF, VAR_OFF, BATCH_OFF = range(9)
TABLE_COLUMNS = 9


class FactoredLayout:
    """Per-tensor sizes and offsets of the ``row_var``, ``col_var`` and ``variance`` buffers."""

    def __init__(self, layout: TensorLayout):
        self.shapes = list(layout.shapes)
        n = len(self.shapes)
        table = np.zeros((n, TABLE_COLUMNS), np.int64)
        for t, shape in enumerate(self.shapes):
            size = int(layout.sizes[t])
            table[t, SIZE] = size
            if len(shape) >= 2:
                rows, cols = shape[-2], shape[-1]
                batch = int(np.prod(shape[:-2], dtype=np.int64))
                table[t, [FACTORED, BATCH, ROWS, COLS]] = (1, batch, rows, cols)
        self.row_sizes = table[:, BATCH] * table[:, ROWS]
        self.col_sizes = table[:, BATCH] * table[:, COLS]
        self.var_sizes = np.where(table[:, FACTORED] == 1, 0, table[:, SIZE])
        for column, sizes in ((ROW_OFF, self.row_sizes), (COL_OFF, self.col_sizes), (VAR_OFF, self.var_sizes),
                              (BATCH_OFF, table[:, BATCH])):
            table[:, column] = np.cumsum(sizes) - sizes
        self.table = table
        self.sizes: Dict[str, np.ndarray] = {"row_var": self.row_sizes, "col_var": self.col_sizes,
                                             "variance": self.var_sizes}
        self.offsets: Dict[str, np.ndarray] = {"row_var": table[:, ROW_OFF], "col_var": table[:, COL_OFF],
                                               "variance": table[:, VAR_OFF]}
        self.totals: Dict[str, int] = {k: int(v.sum()) for k, v in self.sizes.items()}
        self.total_batches = int(table[:, BATCH].sum())

    def __len__(self) -> int:
        return len(self.shapes)

    def buffer_sizes(self) -> Dict[str, int]:
        """Elements to allocate per slot (at least 1, so every slot is a real buffer on every backend)."""
        return {k: max(1, v) for k, v in self.totals.items()}

    def state_shapes(self, t: int) -> Dict[str, Tuple[int, ...]]:
        """Slot name -> torch-compatible shape of tensor ``t``'s state."""
        return adafactor_state_shapes(self.shapes[t])

    def views(self, slot: str, flat: np.ndarray) -> List[Optional[np.ndarray]]:
        """Per-tensor views (torch shapes) into a flat host buffer of ``slot``; None where a tensor lacks it."""
        out: List[Optional[np.ndarray]] = []
        for t in range(len(self.shapes)):
            shape = self.state_shapes(t).get(slot)
            if shape is None:
                out.append(None)
            else:
                o, n = int(self.offsets[slot][t]), int(self.sizes[slot][t])
                out.append(flat[o : o + n].reshape(shape))
        return out


def factored_layout(layout: TensorLayout) -> FactoredLayout:
    """The model's FactoredLayout, made once per TensorLayout (kept in ``layout.cache``)."""
    hit = layout.cache.get("adafactor.factored")
    if hit is None:
        hit = layout.cache["adafactor.factored"] = FactoredLayout(layout)
    return hit  # type: ignore[return-value]
