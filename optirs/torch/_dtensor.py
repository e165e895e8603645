"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallel): what optirs.torch steps of them.

A DTensor parameter is stepped through its local tensor (``_local_tensor``: the shard this rank
holds, whose memory is the parameter's), with its gradient's local tensor, when both have the
same mesh and placements and every placement is ``Shard`` or ``Replicate``: an elementwise step
of the shards is the step of the whole tensor. Its state is kept in the flat buffers as for any
tensor and shown in ``opt.state`` as DTensors with the parameter's mesh and placements (torch's
own optimizers keep the same), so ``torch.distributed.checkpoint`` saves and reshards it.

int8 state keeps one scale per 256-element block, counted from the start of the tensor the kernel
is given (docs/formats.md): for a shard, its local tensor. Those blocks are the whole tensor's
blocks, and its scales shard like the parameter, when the shard boundaries cut no block. So a
tensor's scales are shown on its *block grid* (:func:`block_grid`): with ``m`` the last dim such
that the dims from ``m`` on hold whole blocks (``prod(shape[m:]) % 256 == 0``; 0 if none), each
index of the leading dims ``shape[:m]`` owns whole blocks, and the scales are a tensor of shape
``shape[:m] + (blocks per index,)`` placed as the parameter. A ``Shard`` of a leading dim cuts no
block; a ``Shard(m)`` does not when its chunks are whole blocks; any other is refused
(:func:`refusal`). The codes have the parameter's shape and shard with it, so a checkpoint holds
the int8 state as it runs and reshards it exactly (a reshard moves whole blocks with their
scales). Whether a tensor keeps float32 state (fewer than 4096 elements) is decided on the whole
tensor (``TensorLayout.whole_sizes``), so every sharding keeps the same keys.

What a shard alone cannot compute is refused with the reason: a ``Partial`` placement (a sum not
yet reduced), per-tensor reductions inside a kernel on a sharded tensor (Adafactor's and LAMB's,
which their own mesh paths reduce instead: :mod:`optirs.torch._mesh_lamb`,
:mod:`optirs.torch._mesh_adafactor`), and int8 shards that cut blocks.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from optirs.core.errors import UnsupportedOperationError
from optirs.core.formats import BLOCK, MIN_INT8_SIZE

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


def sharding_dims(p: torch.Tensor, dim: Optional[int] = None) -> List[int]:
    """The mesh dims of DTensor ``p`` that shard tensor dim ``dim`` (None: any dim; [] for a plain tensor)."""
    if not is_dtensor(p):
        return []
    return [i for i, pl in enumerate(p.placements)
            if isinstance(pl, Shard) and (dim is None or pl.dim % p.dim() == dim % p.dim())]


def sum_over_mesh(items: List[Tuple[torch.Tensor, Any, List[int]]]) -> None:
    """Sum each tensor in place over its mesh dims: ``items`` of (tensor, mesh, mesh dims), one
    all-reduce per (mesh, mesh dim) over all the tensors it concerns (every rank passes the same
    items in the same order)."""
    import torch.distributed as dist

    by_dim: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    meshes = {}
    for t, mesh, dims in items:
        for d in dims:
            by_dim.setdefault((id(mesh), d), []).append(t)
            meshes[id(mesh)] = mesh
    for (mesh_id, d), ts in by_dim.items():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=meshes[mesh_id].get_group(d))
        for t, part in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(part.view(t.shape))


def refusal(p: torch.Tensor, g: Any, where: str, per_tensor: Optional[str], blocks: bool) -> Optional[Exception]:
    """The error of a parameter / gradient pair of which at least one is a DTensor that the step cannot
    take, or None. ``per_tensor``: what of the optimizer needs the whole tensor (None: it is
    elementwise); ``blocks``: its state is kept in int8 blocks, which no shard boundary may cut."""
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
        if blocks and p.numel() >= MIN_INT8_SIZE:
            return _cut_blocks(p, where)
    return None


def block_grid(shape: Tuple[int, ...]) -> int:
    """``m``: the last dim from which on the dims hold whole int8 blocks (0 if none; module docstring)."""
    for m in range(len(shape) - 1, -1, -1):
        if math.prod(shape[m:]) % BLOCK == 0:
            return m
    return 0


def scales_shape(shape: Tuple[int, ...], m: Optional[int] = None) -> Tuple[int, ...]:
    """The shape int8 scales of a tensor of ``shape`` are shown in: ``shape[:m] + (blocks per index,)``
    (``m``: the block grid's, of ``shape`` itself unless given)."""
    m = block_grid(shape) if m is None else m
    return tuple(shape[:m]) + (-(-math.prod(shape[m:]) // BLOCK),)


def row_major_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def _cut_blocks(p: torch.Tensor, where: str) -> Optional[Exception]:
    """The error of a sharded DTensor whose shards would cut int8 blocks, or None (module docstring)."""
    shape, placements = tuple(p.shape), tuple(p.placements)
    m = block_grid(shape)
    folded = [(i, pl) for i, pl in enumerate(placements) if isinstance(pl, Shard) and pl.dim >= m]
    reason = None
    if not local(p).is_contiguous():
        reason = f"its local tensor has strides {local(p).stride()}, not row-major (the blocks are runs of memory)"
    elif any(pl.dim > m for _, pl in folded) or len(folded) > 1 or any(type(pl) is not Shard for _, pl in folded):
        reason = f"it shards {[str(pl) for _, pl in folded]}, inside the whole blocks of dims {m}.."
    elif folded:
        i, _ = folded[0]
        n, q, ranks = shape[m], math.prod(shape[m + 1:]), p.device_mesh.size(i)
        chunk = -(-n // ranks) * q
        blocks = -(-n * q // BLOCK)
        if chunk % BLOCK or -(-blocks // ranks) != chunk // BLOCK:
            reason = f"its Shard({m}) chunks of {chunk} elements are not whole blocks"
    if reason is None:
        return None
    lead = (f"a Shard of a dim before {m} (each index of dims 0..{m - 1} owns {math.prod(shape[m:])} elements, "
            "whole blocks), or " if m else "")
    return UnsupportedOperationError(
        f"{where} is a DTensor of shape {shape} placed {placements} with int8 state, but {reason}; expected "
        f"shards that cut no 256-element block: {lead}one Shard({m}) whose chunks hold whole blocks, so that "
        "each rank's blocks and scales are the whole tensor's and a checkpoint reshards them exactly "
        "(state_dtype='bfloat16' for this tensor's param group shards any way)")


def _placed(view: torch.Tensor, p: torch.Tensor, key: str) -> Tuple[torch.Tensor, Any, Any]:
    """(the local tensor, the global shape, the global strides) that ``opt.state[p][key]`` is shown
    with for a local state ``view`` of DTensor ``p``: ``p``'s where the view is shaped like its local
    tensor; int8 scales on ``p``'s block grid; (view, None, None) for state of another shape, which
    exists only for replicated ``p`` (the view is then the whole tensor)."""
    if key.endswith(".scales"):
        whole = tuple(p.shape)
        grid = scales_shape(tuple(p._local_tensor.shape), block_grid(whole))  # (the local tensor's blocks)
        shape = scales_shape(whole)
        return view.view(grid), torch.Size(shape), row_major_strides(shape)
    if tuple(view.shape) == tuple(p._local_tensor.shape):
        return view, p.shape, p.stride()
    return view, None, None


def shown(view: torch.Tensor, p: torch.Tensor, key: str = "") -> torch.Tensor:
    """What ``opt.state[p][key]`` holds for a local state ``view`` of DTensor ``p``: a DTensor over the
    same memory with ``p``'s mesh and placements (:func:`_placed` says its shape and strides)."""
    view, shape, stride = _placed(view, p, key)
    if shape is None:
        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False)
    return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


def hosted(view: torch.Tensor, p: torch.Tensor, key: str = "") -> torch.Tensor:
    """:func:`shown` for a ``view`` that stays where it is whatever the mesh's device: CPUOffload's
    host state of a parameter on a CUDA mesh (``DTensor.from_local`` would copy it to the mesh's
    device; FSDP2's own CPU offload makes its host DTensors the same way)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    view, shape, stride = _placed(view, p, key)
    meta = TensorMeta(view.shape, view.stride(), view.dtype) if shape is None else TensorMeta(shape, stride, view.dtype)
    return DTensor(view, DTensorSpec(p.device_mesh, tuple(p.placements), tensor_meta=meta), requires_grad=False)


def held(value: Any, p: torch.Tensor, key: str = "") -> Any:
    """A state value of DTensor ``p`` as a local tensor laid out as ``p``'s shard: a DTensor placed as
    ``p`` is, its local tensor (int8 scales flat, in the kernels' block order); placed otherwise,
    redistributed first (a collective: every rank adopts its state in the same step); anything
    else as it is."""
    if not is_dtensor(value):
        return value
    if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
        value = value.redistribute(p.device_mesh, p.placements)
    out = value._local_tensor
    return out.reshape(-1) if key.endswith(".scales") and tuple(value.shape) == scales_shape(tuple(p.shape)) else out


__all__ = ["block_grid", "held", "hosted", "is_dtensor", "local", "local_ptr", "refusal", "row_major_strides",
           "scales_shape", "sharded", "sharding_dims", "shown", "sum_over_mesh"]
