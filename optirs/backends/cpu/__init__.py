"""The ``cpu`` backend: numba.njit(parallel) loops over the model's chunk table.

One call steps every tensor of the model: a parallel loop over chunks (optirs.core.layout) whose
body calls the shared per-element math in :mod:`optirs.backends.common.elementwise`. Kernels are
cached on disk (``cache=True``), so a second process does not recompile. numba is imported
when the backend opens, not when optirs is imported.
"""

from __future__ import annotations

from optirs.backends.cpu.adafactor import CpuAdafactor
from optirs.backends.cpu.context import CpuContext, cpu_name
from optirs.backends.cpu.device import CpuDevice
from optirs.backends.cpu.fake_quant import CpuFakeQuant
from optirs.backends.cpu.fingerprint import CpuFingerprint
from optirs.backends.cpu.formats import CpuFormats
from optirs.backends.cpu.fusion import CpuFusion
from optirs.backends.cpu.measure import CpuMeasure
from optirs.backends.cpu.mixed_precision import CpuMixedPrecision
from optirs.backends.cpu.replica_reduce import CpuReplicaReduce
from optirs.backends.cpu.sparse import CpuSparse
from optirs.backends.cpu.steps import CHUNK, CpuSteps
from optirs.backends.cpu.streams import CpuStreams

__all__ = ["CHUNK", "CpuBackend", "CpuContext", "cpu_name", "plugin"]


class CpuBackend(CpuDevice, CpuSteps, CpuReplicaReduce, CpuFingerprint, CpuFakeQuant, CpuMixedPrecision, CpuSparse, CpuFusion, CpuAdafactor, CpuMeasure, CpuStreams,
                 CpuFormats):
    """numba.njit kernels on the host's cores: one mixin per capability."""


plugin = CpuBackend()
