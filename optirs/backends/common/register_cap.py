"""The formats kernels' register cap: one rule for the GPU backends (cuda, and OpenCL where the
driver takes a cap).

int8 state: at most 64 registers per thread. The compiler gives those kernels 92-94 registers on
the H200, which leaves 5 resident 128-thread blocks per SM (31% occupancy) for a latency-bound
loop (the maps' lookups, the block's absmax); capped at 64, 8 blocks fit. Measured there (GPT-2
124M, end to end): remainder8 + int8 1.41 -> 1.17 ms, float32 + int8 0.98 -> 0.94 ms; 48 spilled
(1.27 ms) and 40 more so. The 16-bit formats gained nothing (bf16 + float32 masters lost 2% at
64), so they keep the compiler's choice (docs/benchmarks.md).

A kernel compiled with a round for a chunk's full groups beside the general round (the cuda
backend's bfloat16 parameters with square-root codes) holds more values live across the two: at
64 its registers spilled (2 local accesses an element, ncu) and it took 2-5% more time than at 72.
"""

from __future__ import annotations

import os
from typing import Any

from optirs.core.errors import InvalidParameterError
from optirs.core.formats import INT8_STATES

INT8_MAX_REGISTERS = 64
FULL_ROUNDS_MAX_REGISTERS = 72


def formats_register_cap(fmt: Any, variable: str, full_rounds: bool = False) -> int:
    """Registers per thread for the formats kernels of ``fmt`` (0: the compiler's choice): the
    environment variable ``variable`` (tuning: a cap for every formats kernel, 0 for none), else
    :data:`FULL_ROUNDS_MAX_REGISTERS` for a kernel with a full groups' round (``full_rounds``),
    :data:`INT8_MAX_REGISTERS` for other int8 state and 0 otherwise."""
    text = os.environ.get(variable, "").strip()
    if text:
        if not text.isdigit():
            raise InvalidParameterError(f"{variable}={text!r}, expected a register count (0: no cap)")
        return int(text)
    if fmt is None or fmt.state_dtype not in INT8_STATES:
        return 0
    return FULL_ROUNDS_MAX_REGISTERS if full_rounds else INT8_MAX_REGISTERS
