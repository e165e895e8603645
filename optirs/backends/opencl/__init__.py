"""The ``opencl`` backend: the six optimizers in OpenCL C through pyopencl.

Kernels (``kernels/optirs_steps.cl`` with the per-element math in ``kernels/optirs_elementwise.h``)
are built once per context, with correctly rounded division and sqrt where the device offers
it and no ``-cl-fast-relaxed-math``; the ``Kernel`` objects are made once with their argument
types set, so a step is one ``set_args`` and one enqueue per launch.

How a step is launched (see docs/opencl.md for the costs):

- numpy inputs are packed on upload into one flat device buffer at the layout's offsets (the
  same offsets as the state), stepped by one float4 launch and read back in ``Staged.finish``.
- ``pyopencl.array.Array`` inputs are stepped in place. When they are views of one allocation
  at the layout's offsets (a flat parameter buffer) it is the same single float4 launch.
  Otherwise OpenCL 1.2 has no pointer tables: a chunked kernel takes ``ctx.slots`` parameter and
  ``ctx.slots`` gradient buffers as arguments (as many as the device's argument space holds: 128
  on NVIDIA's driver, 32 on PoCL; ``slots.py``), so a model is one launch per ``ctx.slots``
  distinct buffers (views of a shared buffer count once), with no copies. Each launch is a
  resident grid dealing chunks from a counter on the device.
- LAMB runs as chunked passes (moments with per-chunk norm partials, per-tensor trust ratios,
  apply; two more with global gradient clipping), each pass one launch per group as above.

pyopencl is imported only when the backend is probed or opened.
"""

from __future__ import annotations

from optirs.backends.opencl.adafactor import OpenclAdafactor
from optirs.backends.opencl.context import (CHUNK, ELEMENTWISE, KERNEL_FILE, RECORDS, WORK_GROUP, OpenclContext,
                                            build_options, build_program, describe_device, kernel_source,
                                            record_dtype, select_device)
from optirs.backends.opencl.device import OpenclDevice
from optirs.backends.opencl.fake_quant import OpenclFakeQuant
from optirs.backends.opencl.formats import OpenclFormats
from optirs.backends.opencl.fusion import OpenclFusion
from optirs.backends.opencl.measure import OpenclMeasure
from optirs.backends.opencl.mixed_precision import OpenclMixedPrecision
from optirs.backends.opencl.replica_reduce import OpenclReplicaReduce
from optirs.backends.opencl.slots import SlotGrouper, slot_count
from optirs.backends.opencl.sparse import OpenclSparse
from optirs.backends.opencl.steps import OpenclSteps

__all__ = ["CHUNK", "ELEMENTWISE", "KERNEL_FILE", "RECORDS", "WORK_GROUP", "OpenclBackend", "OpenclContext",
           "SlotGrouper", "build_options", "build_program", "describe_device", "kernel_source", "plugin", "record_dtype",
           "select_device", "slot_count"]


class OpenclBackend(OpenclDevice, OpenclSteps, OpenclReplicaReduce, OpenclFakeQuant, OpenclMixedPrecision, OpenclSparse, OpenclFusion, OpenclAdafactor, OpenclMeasure,
                    OpenclFormats):
    """OpenCL C kernels through pyopencl: one mixin per capability."""


plugin = OpenclBackend()
