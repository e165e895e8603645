"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallel): what optirs.torch steps of them.

A DTensor parameter is stepped through its local tensor (``_local_tensor``: the shard this rank
holds, whose memory is the parameter's), with its gradient's local tensor, when both have the
same mesh and placements and every placement is ``Shard`` or ``Replicate``: an elementwise step
of the shards is the step of the whole tensor. Its state is kept in the flat buffers as for any
tensor and shown in ``opt.state`` as DTensors with the parameter's mesh and placements (torch's
own optimizers keep the same), so ``torch.distributed.checkpoint`` saves and reshards it.

What a shard alone cannot compute is refused with the reason (:func:`refusal`): a ``Partial``
placement (a sum not yet reduced), per-tensor reductions inside a kernel (Adafactor's factors and
RMS) on a sharded tensor, and per-block compact state (int8 scales belong to blocks of the local
shard, which a reshard would cut). LAMB reduces its norms over the mesh instead
(:mod:`optirs.torch._mesh_lamb`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from optirs.core.errors import UnsupportedOperationError

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - a torch without (public) DTensor: no parameter is one
    DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor an elementwise step addresses: a DTensor's local shard (its memory), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t  # (to_local() would add an autograd node per call)


def local_ptr(t: torch.Tensor) -> int:
    return local(t).data_ptr()


def sharded(t: torch.Tensor) -> bool:
    """Whether a DTensor's local tensor is less than the whole tensor."""
    return is_dtensor(t) and not all(isinstance(pl, Replicate) for pl in t.placements)


def refusal(p: torch.Tensor, g: Any, where: str, per_tensor: Optional[str], blocks: bool) -> Optional[Exception]:
    """The error of a parameter / gradient pair of which at least one is a DTensor that the step cannot
    take, or None. ``per_tensor``: what of the optimizer needs the whole tensor (None: it is
    elementwise); ``blocks``: its state is kept in blocks of the local shard (int8)."""
    if not is_dtensor(p) or not is_dtensor(g):
        return UnsupportedOperationError(
            f"{where} is a {type(p).__name__} with a {type(g).__name__} gradient, expected both DTensors (with the "
            "same mesh and placements) or neither")
    if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
        return UnsupportedOperationError(
            f"{where} is a DTensor placed {tuple(p.placements)} on {p.device_mesh}, but its gradient is placed "
            f"{tuple(g.placements)} on {g.device_mesh}; expected the same mesh and placements (redistribute the "
            "gradient first), so that each rank's shards of both are the same elements")
    for pl in p.placements:
        if not isinstance(pl, (Shard, Replicate)):
            return UnsupportedOperationError(
                f"{where} is a DTensor with placement {pl}, expected Shard or Replicate placements: a rank's local "
                "tensor of that placement is not its elements' values (a Partial one is a sum still to reduce)")
    if sharded(p):
        if per_tensor is not None:
            return UnsupportedOperationError(
                f"{where} is a DTensor sharded {tuple(p.placements)}, but {per_tensor} needs the whole tensor, "
                "which one rank's shard is not; expected Replicate placements (or an elementwise optimizer such "
                "as AdamW for sharded parameters)")
        if blocks:
            return UnsupportedOperationError(
                f"{where} is a DTensor sharded {tuple(p.placements)} with int8 state, expected state_dtype "
                "'float32' or 'bfloat16' on sharded parameters: int8 state keeps one scale per block of the "
                "local shard, and a checkpoint resharded to another layout would cut those blocks apart")
    return None


def shown(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """What ``opt.state[p]`` holds for a local state ``view`` of DTensor ``p``: a DTensor over the same
    memory with ``p``'s mesh and placements (the global shape and strides of ``p`` where the view is
    shaped like its local tensor; state of another shape exists only for replicated ``p``)."""
    if tuple(view.shape) == tuple(p._local_tensor.shape):
        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False)


def hosted(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`shown` for a ``view`` that stays where it is whatever the mesh's device: CPUOffload's
    host state of a parameter on a CUDA mesh (``DTensor.from_local`` would copy it to the mesh's
    device; FSDP2's own CPU offload makes its host DTensors the same way)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    whole = tuple(view.shape) != tuple(p._local_tensor.shape)  # (state of another shape: replicated p only)
    meta = TensorMeta(view.shape if whole else p.shape, view.stride() if whole else p.stride(), view.dtype)
    return DTensor(view, DTensorSpec(p.device_mesh, tuple(p.placements), tensor_meta=meta), requires_grad=False)


def held(value: Any, p: torch.Tensor) -> Any:
    """A state value of DTensor ``p`` as a local tensor laid out as ``p``'s shard: a DTensor placed as
    ``p`` is, its local tensor; placed otherwise, redistributed first (a collective: every rank adopts
    its state in the same step); anything else as it is."""
    if not is_dtensor(value):
        return value
    if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
        value = value.redistribute(p.device_mesh, p.placements)
    return value._local_tensor


__all__ = ["is_dtensor", "local", "local_ptr", "sharded", "refusal", "shown", "hosted", "held"]
