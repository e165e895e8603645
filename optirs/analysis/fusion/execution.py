"""Running a fusion plan on the bound backend: one compiled kernel per group, values kept on the device.

Nothing here knows a backend: the kernels are compiled and run by the backend's ``fusion``
capability (``optirs_fusion_compile`` / ``optirs_fusion_run``), the group sources come from the
analysis plugin answering ``optirs_fusion_generate``, and values move with the backend's
``optirs_to_device`` / ``optirs_alloc`` / ``optirs_to_host``. Opaque groups run on the host.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Union

import numpy as np

from optirs.analysis.fusion.graph import call_opaque
from optirs.core.errors import BackendUnavailableError, InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.plugin.hookspecs import CompiledFusedKernel, FusedGroupSource
from optirs.plugin.registry import REGISTRY, Backend

CAPABILITY = "fusion"


def bind_backend(backend: Union[str, Backend]) -> Backend:
    """The opened backend for ``backend``; UnsupportedOperationError naming it when it cannot open."""
    if isinstance(backend, Backend):
        return backend
    if not isinstance(backend, str):
        raise InvalidParameterError(f"backend={backend!r}, expected a backend name or an optirs Backend")
    try:
        return REGISTRY.get_backend(backend)
    except BackendUnavailableError as exc:
        raise UnsupportedOperationError(f"fusion backend {backend!r} is unavailable: {exc}") from exc


class CompiledPlan:
    """A plan with one compiled kernel per group on one backend; :meth:`run` executes it."""

    def __init__(self, plan: Any, backend: Union[str, Backend]):
        self.plan = plan
        self.backend = bind_backend(backend)
        compile_group = self.backend.hook(CAPABILITY, "optirs_fusion_compile")
        self._run_group = self.backend.hook(CAPABILITY, "optirs_fusion_run")
        self.group_sources: List[Optional[FusedGroupSource]] = []
        self.kernels: List[Optional[CompiledFusedKernel]] = []
        for g in plan.groups:
            if g.opaque:
                self.group_sources.append(None)
                self.kernels.append(None)
                continue
            source = REGISTRY.pm.hook.optirs_fusion_generate(graph=plan.graph, group=g)
            if source is None:
                raise UnsupportedOperationError(
                    f"no plugin generates fused kernel source for group {g.index} (is the 'fusion' analysis plugin registered?)"
                )
            self.group_sources.append(source)
            self.kernels.append(compile_group(self.backend.ctx, source))

    def sources(self) -> List[Optional[str]]:
        """The generated source the backend compiled for each group (None for opaque groups)."""
        return [None if k is None else k.text for k in self.kernels]

    @property
    def kernel_count(self) -> int:
        return sum(k is not None for k in self.kernels)

    def run(self, inputs: Mapping[str, Any], out: Optional[Mapping[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
        """Execute the graph; numpy arrays in (shapes and dtypes as declared), numpy arrays out.

        :param out: optional preallocated arrays for some graph outputs (C-contiguous, of the
            output's shape and dtype); they are filled and returned instead of new arrays.
        """
        graph = self.plan.graph
        host = graph.check_inputs(inputs)
        out = self._check_out(out or {})
        b, ctx = self.backend, self.backend.ctx
        # Where the backend's memory is the host's, kernels read the inputs and write the outputs in
        # place (no copies); elsewhere values move with to_device / to_host.
        env = {k: self._to_device(np.ascontiguousarray(v)) for k, v in host.items()}
        in_place: Dict[str, np.ndarray] = {}
        for g, source, kernel in zip(self.plan.groups, self.group_sources, self.kernels):
            if source is None:
                (name,) = g.ops
                op = graph[name]
                args = [b.to_host(ctx, env[v]).reshape(graph.shape(v)) for v in op.inputs]
                env[name] = b.to_device(ctx, np.ascontiguousarray(call_opaque(op, args)).reshape(-1))
                continue
            outputs = []
            for name, size, dt in zip(source.output_names, source.output_sizes, source.output_dtypes):
                target = out.get(name)
                if target is not None and any(np.may_share_memory(target, a) for a in host.values()):
                    target = None  # writing over an input the graph still reads: go through a buffer
                if target is None:
                    target = np.empty(graph.shape(name), dt)
                view = b.host_view(target)
                if view is None:
                    outputs.append(b.alloc(ctx, size, dt, 0))
                else:
                    in_place[name] = target
                    outputs.append(view)
            self._run_group(ctx, kernel, [env[v] for v in source.input_names], outputs, source.elements)
            env.update(zip(source.output_names, outputs))
        b.synchronize()
        result = {}
        for v in graph.outputs:
            if v in in_place:
                result[v] = in_place[v]
                continue
            value = b.to_host(ctx, env[v]).reshape(graph.shape(v))
            if v in out:
                out[v][...] = value
                value = out[v]
            result[v] = value
        return result

    def _to_device(self, array: np.ndarray) -> Any:
        view = self.backend.host_view(array)
        if view is not None:
            return view
        return self.backend.to_device(self.backend.ctx, array.reshape(-1))

    def _check_out(self, out: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        graph = self.plan.graph
        for v, a in out.items():
            if v not in graph.outputs:
                raise InvalidParameterError(f"out names {v!r}, which is not a graph output; outputs are {list(graph.outputs)}")
            shape, dt = graph.shape(v), graph.dtype(v)
            if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dt:
                raise ShapeMismatchError(f"out[{v!r}]: {getattr(a, 'shape', type(a).__name__)} "
                                         f"{getattr(a, 'dtype', '')}, expected a numpy array of shape {shape} dtype {dt}")
            if not (a.flags.c_contiguous and a.flags.writeable):
                raise ShapeMismatchError(f"out[{v!r}] must be C-contiguous and writeable")
        return dict(out)

    def __repr__(self) -> str:
        return f"<CompiledPlan {self.kernel_count} kernels on {self.backend.name!r}>"
