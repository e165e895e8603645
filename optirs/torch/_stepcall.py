"""How an optirs.torch ``step()`` is called: torch's contract, at the price of one check when
nothing observes the step.

``torch.optim.Optimizer`` wraps every subclass's ``step`` (``profile_hook_step``): the global and
per-optimizer step hooks, a ``record_function`` annotation for the profiler and the
``_optimizer_step_code`` marker that the profiler's Python tracer looks for. The annotation alone
goes through torch's operator dispatch and costs tens of microseconds per call, more than the
rest of a cached optirs step, even when no profiler listens. :func:`observed_step` calls torch's
own wrapper whenever something could observe the step (a hook is registered, a profiler runs,
or torch's hook registries moved), and the step itself otherwise. It is a graph break under
``torch.compile``: dynamo runs the step eagerly rather than tracing into the launch and into
numba's compiler on a first call. Like torch's own ``_disable_dynamo``, it does not import
dynamo (seconds) for that: a process that has not loaded dynamo is not compiling anything. (Grad mode is the step's own business: the front end turns it
off around its launches, where interrupts are deferred, so a Ctrl-C cannot leave it off.)
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch
import torch.optim.optimizer as _torch_optimizer

# Private registries of torch (stable since 2.0); where they are missing, every call goes through
# torch's wrapper.
_GLOBAL_PRE = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
_GLOBAL_POST = getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)
_PROFILING = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
_LEAN = _GLOBAL_PRE is not None and _GLOBAL_POST is not None and _PROFILING is not None
_MODULES = sys.modules


def observed_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` as a torch optimizer's ``step`` method (module docstring)."""

    full = torch.optim.Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        if (not _LEAN or _GLOBAL_PRE or _GLOBAL_POST or self._optimizer_step_pre_hooks
                or self._optimizer_step_post_hooks or _PROFILING()):
            return full(self, *args, **kwargs)
        return step(self, *args, **kwargs)

    disabled = None

    def via_dynamo(self, *args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = torch._dynamo.disable(call)  # recursive: nothing inside the step is traced
        return disabled(self, *args, **kwargs)

    via_dynamo._torchdynamo_disable = True  # a graph break where dynamo meets it, not traced

    @functools.wraps(step)
    def entry(self, *args: Any, **kwargs: Any) -> Any:
        # dynamo loads in seconds: only a process that loaded it can be compiling the caller
        if _MODULES.get("torch._dynamo") is None:
            return call(self, *args, **kwargs)
        return via_dynamo(self, *args, **kwargs)

    entry.hooked = True  # torch's Optimizer.__init__ must not wrap it again
    return entry


__all__ = ["observed_step"]
