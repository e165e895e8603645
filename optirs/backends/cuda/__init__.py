"""The ``cuda`` backend: numba.cuda kernels, device-resident state, one launch per step.

* State slots are flat device arrays (``optirs_alloc``), laid out by :class:`optirs.core.layout.TensorLayout`.
* numpy inputs are copied into one reused device buffer per step (params and grads), stepped, and
  copied back in ``Staged.finish``. Device inputs (anything with ``__cuda_array_interface__``:
  numba device arrays, CuPy arrays, torch CUDA tensors) are stepped in place: the kernel reads
  their addresses from a small device pointer table, so there is no host copy.
* A step is one kernel launch for the whole model (LAMB: a moments pass and an apply pass, plus a
  norm pass with global gradient clipping), see :mod:`optirs.backends.cuda.kernels`.
* Host overhead: the compiled kernels, the chunk and pointer tables and the marshalled launch
  arguments are cached; a step updates the per-step scalars in the cached argument block and
  calls ``cuLaunchKernel`` once through ctypes.
* Launch sizes come from the analysis plugins (``optirs_launch_config``, answered by the occupancy
  plugin from the compiled kernel's registers and shared memory); without an answer the default
  is 256 threads per block and as many blocks as the compiled kernel keeps resident on every SM
  at once (the driver's occupancy query), never more blocks than chunks.

* Streams: every launch (the prepared cuLaunchKernel's hStream, numba's ``kernel[grid, block,
  stream]``) and every copy goes on the context's stream. Pinned by the open option ``stream``
  (``GpuOptimizerConfig(options={"stream": handle})``, per optimizer) or ``optirs_use_stream``;
  otherwise resolved per call from its arrays: torch CUDA tensors use torch's current stream of
  their device at the time of the call (one ``torch.cuda.current_stream()`` per step), anything
  else the legacy default stream 0. numpy inputs are downloaded after their stream's work.
  ``optirs_synchronize`` waits for the whole context (every stream).
* CUDA graphs: a step (or state allocation, unscale, sparse step) while its stream is being
  captured raises UnsupportedOperationError (``cuStreamIsCapturing``): the per-step scalars are
  host values in the launch arguments and a replay would repeat them. The ``capturable``
  capability (``optirs_capturable_step``, optirs.torch's ``capturable=True``) is the exception:
  a one-thread kernel advances the step count and computes the scalars on the device, and the
  step kernel reads them there, so a captured step replays correctly.

numba.cuda is imported by ``optirs_probe`` / ``optirs_open``, never by ``import optirs``.
"""

from __future__ import annotations

from optirs.backends.cuda.adafactor import CudaAdafactor
from optirs.backends.cuda.capturable import CudaCapturable
from optirs.backends.cuda.context import (DEFAULT_BLOCK, SIM_BLOCK, SIM_GRID, CudaContext, DeviceList, PreparedLaunch,
                                          _head_types, device_address, import_failure_reason, stream_handle)
from optirs.backends.cuda.device import CudaDevice
from optirs.backends.cuda.fake_quant import CudaFakeQuant
from optirs.backends.cuda.fingerprint import CudaFingerprint
from optirs.backends.cuda.formats import CudaFormats
from optirs.backends.cuda.fusion import CudaFusion
from optirs.backends.cuda.measure import CudaMeasure
from optirs.backends.cuda.mixed_precision import CudaMixedPrecision
from optirs.backends.cuda.replica_reduce import CudaReplicaReduce
from optirs.backends.cuda.sparse import CudaSparse
from optirs.backends.cuda.steps import CudaSteps
from optirs.backends.cuda.streams import CudaStreams

__all__ = ["DEFAULT_BLOCK", "SIM_BLOCK", "SIM_GRID", "CudaBackend", "CudaContext", "DeviceList", "PreparedLaunch",
           "device_address", "import_failure_reason", "plugin", "stream_handle"]


class CudaBackend(CudaDevice, CudaSteps, CudaReplicaReduce, CudaFingerprint, CudaFakeQuant, CudaMixedPrecision, CudaSparse, CudaFusion,
                  CudaAdafactor, CudaMeasure, CudaStreams, CudaCapturable, CudaFormats):
    """numba.cuda kernels on an NVIDIA GPU (or numba's CUDA simulator): one mixin per capability."""


plugin = CudaBackend()
