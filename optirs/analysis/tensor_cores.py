"""Tensor-core planning on the CPU: which precisions a GPU's tensor cores take, how to pad GEMM
shapes for them, and the mixed-precision (AMP) setup that goes with the chosen precision.

What is here is real planning; what is not is said so. numba.cuda exposes no ``wmma``/``mma``
intrinsics, so optirs cannot launch a tensor-core GEMM: :func:`tensor_core_gemm` and
:func:`fused_adam_tensor_core` raise :class:`optirs.UnsupportedOperationError` with the reason
and the alternative, instead of silently running something else.

The tables below cover compute capability 7.0 (Volta) to 12.0 (consumer Blackwell); minor
versions not listed inherit from the closest lower minor of the same major (8.7 -> 8.6). Below
7.0 there are no tensor cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, FrozenSet, Optional, Sequence, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError, UnsupportedOperationError

__all__ = ["Precision", "Architecture", "ARCHITECTURES", "compute_capability", "architecture",
           "tensor_core_precisions", "supports", "TileMultiples", "tile_multiples", "MatrixLayout",
           "optimize_layout", "pad_operands", "PrecisionChoice", "select_precision", "AmpPlan", "amp_plan",
           "tensor_core_gemm", "fused_adam_tensor_core"]


class Precision(str, Enum):
    """Input precisions of tensor-core matrix multiplies (FP32: plain CUDA cores, no tensor cores)."""

    FP64 = "fp64"
    TF32 = "tf32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    FP6 = "fp6"
    FP4 = "fp4"
    INT8 = "int8"
    INT4 = "int4"
    FP32 = "fp32"

    @property
    def bits(self) -> int:
        return _BITS[self]


_BITS = {Precision.FP64: 64, Precision.TF32: 32, Precision.FP32: 32, Precision.FP16: 16, Precision.BF16: 16,
         Precision.FP8_E4M3: 8, Precision.FP8_E5M2: 8, Precision.FP6: 6, Precision.FP4: 4, Precision.INT8: 8,
         Precision.INT4: 4}


@dataclass(frozen=True)
class Architecture:
    cc: Tuple[int, int]
    name: str
    precisions: FrozenSet[Precision]


def _arch(cc, name, *precisions):
    return Architecture(cc, name, frozenset(precisions))


P = Precision
_FP8 = (P.FP8_E4M3, P.FP8_E5M2)
ARCHITECTURES: Dict[Tuple[int, int], Architecture] = {a.cc: a for a in (
    _arch((7, 0), "Volta (V100)", P.FP16),
    _arch((7, 2), "Volta (Xavier)", P.FP16, P.INT8),
    _arch((7, 5), "Turing", P.FP16, P.INT8, P.INT4),
    _arch((8, 0), "Ampere (A100)", P.FP16, P.BF16, P.TF32, P.INT8, P.INT4, P.FP64),
    _arch((8, 6), "Ampere (GA10x)", P.FP16, P.BF16, P.TF32, P.INT8, P.INT4),
    _arch((8, 9), "Ada Lovelace", P.FP16, P.BF16, P.TF32, *_FP8, P.INT8, P.INT4),
    _arch((9, 0), "Hopper (H100/H200)", P.FP16, P.BF16, P.TF32, *_FP8, P.INT8, P.FP64),
    _arch((10, 0), "Blackwell (B200)", P.FP16, P.BF16, P.TF32, *_FP8, P.FP6, P.FP4, P.INT8, P.FP64),
    _arch((12, 0), "Blackwell (RTX 50)", P.FP16, P.BF16, P.TF32, *_FP8, P.FP6, P.FP4, P.INT8),
)}
NO_TENSOR_CORES = Architecture((0, 0), "no tensor cores (before Volta)", frozenset())


def compute_capability(device: Any) -> Tuple[int, int]:
    """(major, minor) from a tuple, a ``"8.6"`` string, or an object with ``compute_capability``
    (a numba CUDA device) or ``details["compute_capability"]`` (an optirs DeviceInfo)."""
    value = device
    if hasattr(device, "compute_capability"):
        value = device.compute_capability
    elif hasattr(device, "details") and isinstance(getattr(device, "details"), dict):
        value = device.details.get("compute_capability", device)
    if isinstance(value, str):
        parts = value.strip().split(".")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            return int(parts[0]), int(parts[1])
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in value):
        return int(value[0]), int(value[1])
    raise InvalidParameterError(f"compute capability {device!r}, expected (major, minor), 'major.minor' or a CUDA device")


def architecture(device: Any) -> Architecture:
    """The tensor-core table entry for a compute capability (see the module docstring)."""
    cc = compute_capability(device)
    if cc < (7, 0):
        return NO_TENSOR_CORES
    same_major = [k for k in ARCHITECTURES if k[0] == cc[0] and k <= cc]
    if not same_major:
        raise InvalidParameterError(
            f"compute capability {cc[0]}.{cc[1]} is not in the tensor-core table, expected one of "
            f"{sorted(f'{a}.{b}' for a, b in ARCHITECTURES)} (or below 7.0)"
        )
    return ARCHITECTURES[max(same_major)]


def tensor_core_precisions(device: Any) -> FrozenSet[Precision]:
    return architecture(device).precisions


def supports(device: Any, precision: Any) -> bool:
    return _precision(precision) in tensor_core_precisions(device)


def _precision(value: Any) -> Precision:
    try:
        return Precision(value.value if isinstance(value, Precision) else str(value).lower())
    except ValueError:
        raise InvalidParameterError(f"precision={value!r}, expected one of {[p.value for p in Precision]}") from None


# ----------------------------------------------------------------------------- layouts


# Warp-level MMA instruction shapes (m, n, k) from the PTX ISA (mma.sync), per precision; Volta
# only has m8n8k4 for fp16, Turing m16n8k8 for fp16 and m8n8k16/k32 for int8/int4.
_MMA = {P.FP16: (16, 8, 16), P.BF16: (16, 8, 16), P.TF32: (16, 8, 8), P.INT8: (16, 8, 32), P.INT4: (16, 8, 64),
        P.FP8_E4M3: (16, 8, 32), P.FP8_E5M2: (16, 8, 32), P.FP6: (16, 8, 32), P.FP4: (16, 8, 64), P.FP64: (8, 8, 4)}
_MMA_OLD = {((7, 0), P.FP16): (8, 8, 4), ((7, 2), P.FP16): (8, 8, 4), ((7, 2), P.INT8): (8, 8, 16),
            ((7, 5), P.FP16): (16, 8, 8), ((7, 5), P.INT8): (8, 8, 16), ((7, 5), P.INT4): (8, 8, 32)}

LAYOUT_MODES = ("aligned", "instruction", "preferred")


@dataclass(frozen=True)
class TileMultiples:
    m: int
    n: int
    k: int


def tile_multiples(precision: Any, device: Any, mode: str = "preferred") -> TileMultiples:
    """What M, N and K should be multiples of for ``precision`` on ``device``'s tensor cores.

    - ``aligned``: 16 bytes of elements in every dimension (the alignment cuBLAS needs to use
      tensor cores at all: 8 fp16/bf16, 4 tf32, 16 int8/fp8, 2 fp64, 32 int4/fp4 elements);
    - ``instruction``: the warp-level MMA instruction shape, so warp tiles have no ragged edge;
    - ``preferred``: both, and on compute capability 8.0+ 128 bytes along K (NVIDIA's guidance
      for A100 and later: fp16 dimensions in multiples of 64).
    """
    p = _precision(precision)
    arch = architecture(device)
    if mode not in LAYOUT_MODES:
        raise InvalidParameterError(f"mode={mode!r}, expected one of {list(LAYOUT_MODES)}")
    if p not in arch.precisions:
        raise UnsupportedOperationError(
            f"{p.value} has no tensor-core path on compute capability {arch.cc[0]}.{arch.cc[1]} ({arch.name}); "
            f"it supports {sorted(x.value for x in arch.precisions) or 'none'}"
        )
    # the fewest elements that fill a whole number of 16-byte units (fp6: 64 elements = 48 bytes)
    aligned = math.lcm(p.bits, 128) // p.bits
    mma = _MMA_OLD.get((arch.cc, p), _MMA[p])
    if mode == "aligned":
        return TileMultiples(aligned, aligned, aligned)
    if mode == "instruction":
        return TileMultiples(*mma)
    lcm = [math.lcm(aligned, d) for d in mma]
    if arch.cc >= (8, 0):
        lcm[2] = math.lcm(lcm[2], math.lcm(p.bits, 1024) // p.bits)
    return TileMultiples(*lcm)


@dataclass(frozen=True)
class MatrixLayout:
    """A GEMM C[m, n] = A[m, k] @ B[k, n] padded for tensor cores."""

    m: int
    n: int
    k: int
    padded_m: int
    padded_n: int
    padded_k: int
    precision: Precision
    multiples: TileMultiples

    @property
    def flop_overhead(self) -> float:
        """Extra multiply-adds the padding costs, as a fraction of the useful ones."""
        useful = self.m * self.n * self.k
        return self.padded_m * self.padded_n * self.padded_k / useful - 1.0 if useful else 0.0

    @property
    def memory_overhead(self) -> float:
        """Extra bytes of A, B and C, as a fraction of the unpadded operands."""
        useful = self.m * self.k + self.k * self.n + self.m * self.n
        padded = self.padded_m * self.padded_k + self.padded_k * self.padded_n + self.padded_m * self.padded_n
        return padded / useful - 1.0 if useful else 0.0

    @property
    def needs_padding(self) -> bool:
        return (self.m, self.n, self.k) != (self.padded_m, self.padded_n, self.padded_k)


def _dim(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidParameterError(f"{name}={value!r}, expected an integer >= 1")
    return int(value)


def optimize_layout(m: int, n: int, k: int, precision: Any, device: Any, mode: str = "preferred") -> MatrixLayout:
    """Pad M, N and K up to the multiples :func:`tile_multiples` gives."""
    m, n, k = _dim("m", m), _dim("n", n), _dim("k", k)
    t = tile_multiples(precision, device, mode)
    up = lambda x, q: -(-x // q) * q  # noqa: E731
    return MatrixLayout(m, n, k, up(m, t.m), up(n, t.n), up(k, t.k), _precision(precision), t)


def pad_operands(a: np.ndarray, b: np.ndarray, precision: Any, device: Any, mode: str = "preferred"):
    """Zero-pad A (m x k) and B (k x n) to the layout; ``(a_p @ b_p)[:m, :n]`` equals ``a @ b`` exactly.

    :return: ``(a_padded, b_padded, layout)``.
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise InvalidParameterError(f"operands of shapes {a.shape} and {b.shape}, expected (m, k) and (k, n)")
    layout = optimize_layout(a.shape[0], b.shape[1], a.shape[1], precision, device, mode)
    ap = np.zeros((layout.padded_m, layout.padded_k), a.dtype)
    bp = np.zeros((layout.padded_k, layout.padded_n), b.dtype)
    ap[: a.shape[0], : a.shape[1]] = a
    bp[: b.shape[0], : b.shape[1]] = b
    return ap, bp, layout


# ----------------------------------------------------------------------------- precision selection

# Preference orders: training wants range (bf16) and then fp16 with loss scaling; inference
# takes the narrowest format the hardware runs.
PREFERENCES = {
    "training": (P.BF16, P.FP16, P.TF32, P.FP32),
    "inference": (P.FP8_E4M3, P.INT8, P.BF16, P.FP16, P.TF32, P.FP32),
}


@dataclass(frozen=True)
class PrecisionChoice:
    precision: Precision
    architecture: Architecture
    needs_loss_scaling: bool
    reason: str


def select_precision(device: Any, purpose: str = "training", prefer: Optional[Sequence[Any]] = None) -> PrecisionChoice:
    """The first precision of ``prefer`` (default: :data:`PREFERENCES[purpose]`) that the tensor
    cores take; FP32 (CUDA cores) when none does."""
    arch = architecture(device)
    if prefer is None:
        if purpose not in PREFERENCES:
            raise InvalidParameterError(f"purpose={purpose!r}, expected one of {sorted(PREFERENCES)}")
        order = PREFERENCES[purpose]
    else:
        order = tuple(_precision(p) for p in prefer)
        if not order:
            raise InvalidParameterError("prefer=[], expected at least one precision")
    where = f"compute capability {arch.cc[0]}.{arch.cc[1]} ({arch.name})" if arch.precisions else arch.name
    for p in order:
        if p in arch.precisions:
            skipped = [q.value for q in order[: order.index(p)]]
            why = f"{p.value}: the first of {[q.value for q in order]} that {where} runs on tensor cores"
            if skipped:
                why += f" ({', '.join(skipped)} not available)"
            return PrecisionChoice(p, arch, p is P.FP16, why)
    return PrecisionChoice(P.FP32, arch, False, f"fp32 on CUDA cores: none of {[q.value for q in order]} on {where}")


# ----------------------------------------------------------------------------- AMP glue


@dataclass
class AmpPlan:
    """The mixed-precision setup for a precision choice.

    ``config`` is None when parameters stay float32 (tf32/fp32); fp16 gets GradScaler's dynamic
    loss scaling, bf16 a fixed scale of 1 (its range matches float32) that still skips steps
    whose gradients overflow.
    """

    choice: PrecisionChoice
    config: Any  # Optional[MixedPrecisionConfig]
    scaler: Any  # Optional[DynamicLossScaler]

    def wrap(self, optimizer: Any):
        """The optimizer to train with: ``optimizer`` itself, or a MixedPrecisionOptimizer around it."""
        if self.config is None:
            return optimizer
        from optirs.optim.mixed_precision import MixedPrecisionOptimizer

        wrapped = MixedPrecisionOptimizer(optimizer, self.config)
        wrapped.scaler = self.scaler  # one scaler: the plan's and the optimizer's
        return wrapped

    def scale_loss(self, loss: Any):
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def unscale(self, grads: Sequence[Any]):
        """float32 unscaled gradients and whether any is inf/NaN (host arrays)."""
        if self.scaler is None:
            out = [np.asarray(g, dtype=np.float32) for g in grads]
            return out, not all(bool(np.isfinite(g).all()) for g in out)
        return self.scaler.unscale(grads)

    def update(self, found_inf: bool) -> bool:
        """Record a step's outcome; True when it may be applied."""
        return (not found_inf) if self.scaler is None else self.scaler.update(found_inf)


def amp_plan(device: Any, purpose: str = "training", prefer: Optional[Sequence[Any]] = None, **scaler_options) -> AmpPlan:
    """Choose a precision for ``device`` and build its loss-scaling setup.

    ``scaler_options`` go to :class:`optirs.optim.mixed_precision.MixedPrecisionConfig` (fp16/bf16 only).
    """
    from optirs.optim.mixed_precision import MixedPrecisionConfig

    choice = select_precision(device, purpose, prefer)
    if choice.precision is P.FP16:
        config = MixedPrecisionConfig("float16", **scaler_options)
    elif choice.precision is P.BF16:
        config = MixedPrecisionConfig("bfloat16", **{"init_scale": 1.0, "dynamic": False, **scaler_options})
    elif choice.precision in (P.TF32, P.FP32):
        if scaler_options:
            raise InvalidParameterError(f"scaler options {sorted(scaler_options)} given, but {choice.precision.value} needs no loss scaling")
        config = None
    else:
        raise UnsupportedOperationError(
            f"{choice.precision.value} training needs per-tensor scaling recipes optirs does not implement; "
            "expected fp16, bf16, tf32 or fp32 for amp_plan"
        )
    return AmpPlan(choice, config, config.make_scaler() if config is not None else None)


# ----------------------------------------------------------------------------- device entry points

_NO_WMMA = ("numba.cuda exposes no wmma/mma (tensor-core) intrinsics, and optirs generates its CUDA kernels "
            "with numba.cuda, so it has no tensor-core kernel to run")


def tensor_core_gemm(a: Any, b: Any, c: Any = None, precision: Any = "fp16", **kwargs) -> Any:
    """Not available: raises :class:`optirs.UnsupportedOperationError` saying why.

    Use cuBLAS through the array library that owns the device arrays (``cupy.matmul``,
    ``torch.matmul``), with the shapes from :func:`optimize_layout`.
    """
    raise UnsupportedOperationError(
        f"tensor_core_gemm: {_NO_WMMA}; use cuBLAS through cupy.matmul or torch.matmul on the device arrays "
        "(optimize_layout gives tensor-core-friendly padded shapes)"
    )


def fused_adam_tensor_core(*args: Any, **kwargs: Any) -> Any:
    """Not available: raises :class:`optirs.UnsupportedOperationError` saying why.

    An optimizer step is elementwise and memory-bound: tensor cores (matrix multiply units) would
    not speed it up. Use :class:`optirs.GpuAdam` on the cuda backend.
    """
    raise UnsupportedOperationError(
        f"fused_adam_tensor_core: {_NO_WMMA}; an Adam step is elementwise and memory-bound, so tensor cores "
        "would not help it anyway: use optirs.GpuAdam on the cuda backend"
    )
