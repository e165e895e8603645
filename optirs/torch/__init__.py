"""optirs.torch: drop-in ``torch.optim`` optimizers on optirs' one-launch kernels.

``import optirs`` does not import torch; ``import optirs.torch`` does (torch is an optional
dependency). See docs/torch.md; ``CPUOffload`` (the state in host memory): docs/offload.md.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - torch is optional
    from optirs.core.errors import BackendUnavailableError

    raise BackendUnavailableError(f"optirs.torch needs PyTorch ({exc}); pip install torch") from exc

from optirs.torch._frontend import OptirsOptimizer
from optirs.torch.optimizers import SGD, Adafactor, Adagrad, Adam, AdamW, Lamb, Lion, RMSprop
from optirs.torch.offload import CPUOffload
from optirs.torch.muon import Muon
from optirs.torch.classic import ASGD, LBFGS, Adadelta, Adamax, NAdam, RAdam, Rprop
from optirs.torch.sparse import SparseAdam

__all__ = ["OptirsOptimizer", "Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adafactor", "Lamb", "Lion", "CPUOffload",
           "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop", "LBFGS", "SparseAdam", "Muon"]
