"""Gradient reduction on one device, and data-parallel training over torch.distributed.

Two parts, honest about which is which:

- :func:`reduce_replicas`: a real reduction kernel on ONE device: the sum or mean of N gradient
  replicas, written in place into the first, by the bound backend's ``replica_reduce``
  capability (hook ``optirs_replica_reduce``). Replicas on two different physical devices raise
  :class:`~optirs.core.errors.UnsupportedOperationError`: optirs does not move data between devices
  itself.
- :class:`DataParallelOptimizer`: wraps any optirs optimizer for data-parallel training through
  an existing engine, ``torch.distributed`` (NCCL between GPUs, gloo between CPU processes,
  launched by ``torchrun``). Mode ``"allreduce"`` averages gradients with one all-reduce and
  every rank steps everything; mode ``"zero1"`` (ZeRO stage 1) reduce-scatters gradients so
  each rank keeps and steps only its shard of the optimizer state, then all-gathers the updated
  parameters. Arrays are handed to torch without host copies: numpy through
  ``torch.from_numpy``, device arrays through ``__cuda_array_interface__`` / DLPack.

See docs/distributed.md for launching, the communication cost per step, and many hosts.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from optirs.core.arrays import check_no_overlap, describe
from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.layout import TensorLayout
from optirs.plugin.registry import REGISTRY, Backend

F32 = np.dtype(np.float32)
CAPABILITY = "replica_reduce"

# ================================================================ one device: reduce_replicas

REDUCE_OPS = ("sum", "mean")


def _bound_backend(backend: Any) -> Backend:
    """The opened backend for ``backend``: a name (``"auto"`` too), a Backend, or an optimizer."""
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, str):
        return REGISTRY.get_backend(backend)
    bound = getattr(backend, "backend", None)  # an optirs optimizer (or a wrapper of one)
    if isinstance(bound, Backend):
        return bound
    raise InvalidParameterError(
        f"backend={backend!r}, expected a backend name, an optirs Backend (optirs.get_backend) or an optirs optimizer"
    )


def reduce_replicas(replicas: Sequence[Any], op: str = "mean", backend: Any = "auto") -> Any:
    """Reduce N gradient replicas on one device into the first, in place, and return it.

    ``replicas[0] = replicas[0] + replicas[1] + ... + replicas[N-1]`` (summed left to right in
    float32), divided by N for ``op="mean"``. The other replicas are not modified. The backend's
    ``replica_reduce`` capability (hook ``optirs_replica_reduce``) does the work on its device.

    :param replicas: float32 arrays of one shape and one kind: the backend's own device arrays
        (numba / CuPy / torch CUDA arrays on cuda, ``pyopencl.array.Array`` on opencl) or host
        numpy arrays (which every built-in backend accepts; a device backend uploads them).
    :param op: ``"sum"`` or ``"mean"``.
    :param backend: where to reduce: a backend name (``"auto"``: the fastest kind of device
        found, ``optirs.plugin.registry.choose_auto``), a Backend from :func:`optirs.get_backend`, or
        an optirs optimizer (its bound backend).
    :return: ``replicas[0]``.
    :raises InvalidParameterError: for an unknown ``op``, an empty list or the same memory twice.
    :raises ShapeMismatchError: for replicas that differ in kind, shape or dtype, are not float32,
        not C-contiguous, or a read-only ``replicas[0]``.
    :raises UnsupportedOperationError: when the backend lacks the ``replica_reduce`` capability, or
        the replicas live on different physical devices (that needs a collective:
        :class:`DataParallelOptimizer` over torch.distributed).
    """
    if op not in REDUCE_OPS:
        raise InvalidParameterError(f"op={op!r}, expected one of {list(REDUCE_OPS)}")
    if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence) or not replicas:
        raise InvalidParameterError(f"replicas={type(replicas).__name__}, expected a non-empty list of arrays")
    metas = [describe(r, f"replicas[{i}]") for i, r in enumerate(replicas)]
    first = metas[0]
    for i, m in enumerate(metas):
        if m.kind != first.kind:
            raise ShapeMismatchError(f"replicas[{i}] is a {m.kind} array, expected {first.kind} like replicas[0]")
        if m.shape != first.shape or m.dtype != F32:
            raise ShapeMismatchError(
                f"replicas[{i}] has shape {m.shape} and dtype {m.dtype}, expected {first.shape} float32 like replicas[0]"
            )
        if not m.contiguous:
            raise ShapeMismatchError(f"replicas[{i}] is not C-contiguous, expected a contiguous array")
    check_no_overlap(metas, what="replicas", expected="distinct arrays")  # real extents (optirs.core.arrays)
    if not first.writeable:
        raise ShapeMismatchError("replicas[0] is read-only, expected a writeable array (it receives the result)")
    bound = _bound_backend(backend)
    reduce = bound.hook(CAPABILITY, "optirs_replica_reduce")
    average = op == "mean"
    if first.size == 0 or (len(replicas) == 1 and not average):
        return replicas[0]
    reduce(bound.ctx, list(replicas), average)
    return replicas[0]


def reduce_across_devices(*args: Any, **kwargs: Any) -> None:
    """Not implemented: optirs does not move data between physical devices on its own.

    :raises UnsupportedOperationError: always; use :class:`DataParallelOptimizer` (torch.distributed).
    """
    raise UnsupportedOperationError(
        "reducing across physical devices needs a collective library; optirs does it through torch.distributed "
        "(NCCL on GPUs): wrap the optimizer in optirs.optim.data_parallel.DataParallelOptimizer and launch with torchrun"
    )


# ================================================================ many devices: torch.distributed

MODES = ("allreduce", "zero1")
# Optimizers whose update of an element depends only on that element (and per-step scalars):
# their state may be split anywhere. Anything else (LAMB's per-tensor trust ratio, third-party
# optimizers we know nothing about) is sharded on tensor boundaries, which keeps it exact.
ELEMENTWISE_OPTIMIZERS = frozenset({"adam", "adamw", "sgd", "rmsprop", "adagrad"})


def _dist():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - torch is an optional dependency
        raise UnsupportedOperationError(f"data-parallel training needs torch.distributed: {exc}") from exc
    return torch, dist


def init_process_group_from_env(backend: Optional[str] = None, timeout_s: float = 600.0) -> Tuple[int, int]:
    """Join the process group ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    :param backend: ``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available, else gloo.
        With NCCL, the process's CUDA device (torch and numba) is set to ``LOCAL_RANK``.
    :return: (rank, world_size).
    """
    import datetime

    torch, dist = _dist()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise InvalidParameterError(f"environment variable {var} is not set, expected a torchrun launch")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        from numba import cuda as numba_cuda

        numba_cuda.select_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _torch_view(array: Any, what: str):
    """A torch tensor sharing ``array``'s memory (no host copy), through the array protocols torch reads."""
    torch, _ = _dist()
    if isinstance(array, torch.Tensor):
        return array
    # torch.as_tensor shares the memory of a float32 __array_interface__ (host) or
    # __cuda_array_interface__ (device) array instead of copying it.
    if hasattr(array, "__array_interface__") or hasattr(array, "__cuda_array_interface__"):
        return torch.as_tensor(array)
    if hasattr(array, "__dlpack__"):
        return torch.from_dlpack(array)
    raise UnsupportedOperationError(
        f"{what} is a {type(array).__module__}.{type(array).__name__}; torch.distributed exchanges host arrays (gloo) "
        "and CUDA arrays (NCCL) without host copies, not OpenCL buffers or other memory torch cannot view"
    )


def broadcast_parameters(params: Any, src: int = 0, process_group: Any = None) -> None:
    """Make every rank's parameters equal to rank ``src``'s, in place (call once before training).

    :param params: one array or a list (numpy with gloo, CUDA arrays with NCCL), same shapes on every rank.
    """
    _, dist = _dist()
    plist = list(params) if isinstance(params, (list, tuple)) else [params]
    tensors = [_torch_view(p, f"params[{i}]") for i, p in enumerate(plist)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        for t in tensors:
            dist.broadcast(t, src=src, group=process_group)


def _as_optirs(tensor):
    """What an optirs optimizer steps: numpy for host tensors (shared memory; every backend stages
    numpy), the tensor itself on a device (a CUDA backend steps it in place)."""
    return tensor.numpy() if tensor.is_cpu else tensor


class ShardPlan:
    """Which contiguous pieces of which tensors each rank owns, and its segment length.

    Rank ``r``'s pieces ``(tensor, start, stop)`` (flat element ranges) lie back to back in a
    segment of ``segment`` elements (zero padded), so reduce-scatter and all-gather move equal
    chunks. ``tensor_boundaries`` assigns whole tensors to ranks; otherwise the flat model is cut
    into equal parts.
    """

    def __init__(self, shapes: Sequence[Tuple[int, ...]], world: int, tensor_boundaries: bool):
        # packed without gaps: the ranks' ranges cut the flat model into equal parts
        self.layout = TensorLayout(shapes, align=1)
        self.world = world
        self.tensor_boundaries = tensor_boundaries
        total = self.layout.total
        starts = self.layout.offsets.tolist()
        sizes = self.layout.sizes.tolist()
        if tensor_boundaries:
            # Cut at the tensor boundary nearest each ideal cut r * total / world.
            ends = np.cumsum([0] + sizes)
            cuts = [0]
            for r in range(1, world):
                ideal = r * total / world
                j = int(np.argmin(np.abs(ends - ideal)))
                cuts.append(max(cuts[-1], int(ends[j])))
            cuts.append(total)
        else:
            per = -(-total // world) if total else 0
            cuts = [min(r * per, total) for r in range(world)] + [total]
        self.ranges = [(cuts[r], cuts[r + 1]) for r in range(world)]
        self.pieces: List[List[Tuple[int, int, int]]] = []
        for lo, hi in self.ranges:
            mine = []
            for t, (off, n) in enumerate(zip(starts, sizes)):
                a, b = max(lo, off), min(hi, off + n)
                if a < b:
                    mine.append((t, a - off, b - off))
            self.pieces.append(mine)
        self.segment = max(1, max(hi - lo for lo, hi in self.ranges))

    def shard_size(self, rank: int) -> int:
        lo, hi = self.ranges[rank]
        return hi - lo


class DataParallelOptimizer:
    """Data-parallel training with any optirs optimizer over torch.distributed.

    .. code-block:: python

        rank, world = optirs.optim.data_parallel.init_process_group_from_env()      # under torchrun
        opt = DataParallelOptimizer(GpuAdam(AdamParams(lr=1e-3), config), mode="zero1")
        opt.step_gpu(params, grads)   # grads: this rank's; params: identical on every rank

    ``allreduce``: the gradients are averaged into one flat buffer with a single all-reduce and
    every rank steps every parameter (full optimizer state on each rank).

    ``zero1``: the gradients are averaged with a reduce-scatter, each rank steps only its shard
    (holding 1/world of the optimizer state), then the updated parameters are all-gathered.
    Element-wise optimizers are cut into equal flat shards; LAMB (and any optimizer not known to
    be element-wise) is cut on tensor boundaries so its per-tensor trust ratios are exact, and
    its global gradient-norm clipping uses an all-reduced norm.

    The caller's gradients are never modified. Every rank must call :meth:`step_gpu`,
    :meth:`state_dict` and :meth:`load_state_dict` together (they are collectives).

    :param optimizer: a fresh optirs optimizer (its hyperparameters and backend are used).
    :param mode: ``"allreduce"`` or ``"zero1"``.
    :param process_group: a torch.distributed group (default: the world); without an initialized
        process group the wrapper runs as a single rank.
    """

    def __init__(self, optimizer: Any, mode: str = "allreduce", process_group: Any = None):
        from optirs.optim.optimizers import GpuOptimizer

        if not isinstance(optimizer, GpuOptimizer):
            raise InvalidParameterError(f"optimizer={optimizer!r}, expected an optirs GpuOptimizer (GpuAdam, GpuLamb, ...)")
        if mode not in MODES:
            raise InvalidParameterError(f"mode={mode!r}, expected one of {list(MODES)}")
        if mode == "zero1" and optimizer.step_count:
            raise InvalidParameterError(
                f"optimizer has taken {optimizer.step_count} steps, expected a fresh optimizer for mode='zero1' "
                "(restore progress with load_state_dict instead)"
            )
        self.inner = optimizer
        self.mode = mode
        self.group = process_group
        self._hyper = optimizer.params  # the user's hyperparameters (zero1 LAMB clips outside the kernel)
        self._plan: Optional[ShardPlan] = None
        self._step = optimizer.step_count
        self._buffers: Dict[str, Any] = {}
        self._views: Dict[Tuple, Any] = {}

    # ------------------------------------------------------------ the process group

    @property
    def world_size(self) -> int:
        _, dist = _dist()
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        _, dist = _dist()
        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def params(self):
        return self._hyper

    @params.setter
    def params(self, params) -> None:
        """New hyperparameters between steps (lr schedules), on every rank alike."""
        self.inner.params = self._effective(params)
        self._hyper = params

    def _effective(self, params):
        # In zero1, LAMB's global clipping is applied by the wrapper with an all-reduced norm.
        if self.mode == "zero1" and self.inner.name == "lamb" and getattr(params, "max_grad_norm", None) is not None:
            return replace(params, max_grad_norm=None)
        return params

    # ------------------------------------------------------------ collectives (torch >= 2.13 renamed two)

    def _all_reduce(self, t, op=None):
        _, dist = _dist()
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group)

    def _reduce_scatter(self, out, inp):
        _, dist = _dist()
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out, inp, op=dist.ReduceOp.SUM, group=self.group)

    def _all_gather(self, out, inp):
        _, dist = _dist()
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, inp, group=self.group)

    # ------------------------------------------------------------ the step

    def _check(self, params: List[Any], grads: List[Any]) -> List[Tuple[int, ...]]:
        if len(params) != len(grads):
            raise ShapeMismatchError(f"{len(params)} params and {len(grads)} grads, expected one gradient per parameter")
        shapes = []
        for i, (p, g) in enumerate(zip(params, grads)):
            pm, gm = describe(p, f"params[{i}]"), describe(g, f"grads[{i}]")
            if pm.dtype != F32 or gm.dtype != F32:
                raise ShapeMismatchError(f"params[{i}]/grads[{i}] have dtypes {pm.dtype}/{gm.dtype}, expected float32")
            if pm.shape != gm.shape:
                raise ShapeMismatchError(f"grads[{i}] has shape {gm.shape}, expected {pm.shape} like params[{i}]")
            if not (pm.contiguous and gm.contiguous) or not pm.writeable:
                raise ShapeMismatchError(f"params[{i}] and grads[{i}] must be C-contiguous and params[{i}] writeable")
            shapes.append(pm.shape)
        if self._plan is not None and not self._plan.layout.matches(shapes):
            raise ShapeMismatchError(f"parameter shapes {shapes}, expected {self._plan.layout.shapes} as in earlier steps")
        return shapes

    def _buffer(self, name: str, size: int, like):
        torch, _ = _dist()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != size or buf.device != like.device:
            buf = torch.zeros(size, dtype=torch.float32, device=like.device)
            self._buffers[name] = buf
            self._views.clear()
        return buf

    def _cached(self, key, make):
        if key not in self._views:
            self._views[key] = make()
        return self._views[key]

    def step_gpu(self, params: Any, grads: Any) -> None:
        """One data-parallel step: this rank's ``grads`` are averaged over the ranks, ``params`` updated in place."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params]
        glist = list(grads) if isinstance(grads, (list, tuple)) else [grads]
        if not plist:
            raise InvalidParameterError("params=[], expected at least one array")
        shapes = self._check(plist, glist)
        # Memory torch cannot view raises UnsupportedOperationError here, before anything changes.
        tp = [_torch_view(p, f"params[{i}]") for i, p in enumerate(plist)]
        tg = [_torch_view(g, f"grads[{i}]") for i, g in enumerate(glist)]
        world = self.world_size
        if self._plan is None or self._plan.world != world:
            self._plan = ShardPlan(shapes, world, self.inner.name not in ELEMENTWISE_OPTIMIZERS)
            if self.inner.params != self._effective(self._hyper):
                self.inner.params = self._effective(self._hyper)
        if self.mode == "allreduce":
            self._step_allreduce(plist, tg, world)
        else:
            self._step_zero1(plist, tp, tg, world)
        self._step += 1

    def _step_allreduce(self, plist, tg, world):
        layout = self._plan.layout
        bucket = self._buffer("bucket", max(1, layout.total), tg[0])
        for g, off, n in zip(tg, layout.offsets.tolist(), layout.sizes.tolist()):
            bucket[off:off + n].copy_(g.reshape(-1))
        if world > 1:
            self._all_reduce(bucket)
            bucket.div_(world)
        views = self._cached("bucket_views", lambda: [
            _as_optirs(bucket[o:o + n].view(s))
            for o, n, s in zip(layout.offsets.tolist(), layout.sizes.tolist(), layout.shapes)])
        self.inner.step_gpu(plist, views)

    def _step_zero1(self, plist, tp, tg, world):
        plan, rank = self._plan, self.rank
        S = plan.segment
        gflat = self._buffer("grads", world * S, tg[0])
        for r in range(world):
            pos = r * S
            for t, a, b in plan.pieces[r]:
                gflat[pos:pos + b - a].copy_(tg[t].reshape(-1)[a:b])
                pos += b - a
        gshard = self._buffer("grad_shard", S, tg[0])
        if world > 1:
            self._reduce_scatter(gshard, gflat)
            gshard.div_(world)
        else:
            gshard.copy_(gflat[:S])
        mine = plan.pieces[rank]
        if self.inner.name == "lamb" and self._hyper.max_grad_norm is not None:
            self._clip_globally(gshard[:plan.shard_size(rank)], world)
        if mine:
            # The views into the caller's arrays are made once per parameter list (the entry keeps
            # the arrays alive, so their ids stay theirs), so backends can cache per list.
            key = tuple(id(p) for p in plist)
            entry = self._views.get("params")
            if entry is None or entry[0] != key:
                entry = (key, plist, [_as_optirs(tp[t].reshape(-1)[a:b]) for t, a, b in mine])
                self._views["params"] = entry
            pviews = entry[2]
            gviews = self._cached("grad_views", lambda: _split(gshard, mine, _as_optirs))
            self.inner.step_gpu(pviews, gviews)
        # All-gather the updated parameters: each rank packs its shard, then every rank unpacks all.
        pshard = self._buffer("param_shard", S, tp[0])
        pos = 0
        for t, a, b in mine:
            pshard[pos:pos + b - a].copy_(tp[t].reshape(-1)[a:b])
            pos += b - a
        if world > 1:
            pflat = self._buffer("params", world * S, tp[0])
            self._all_gather(pflat, pshard)
            for r in range(world):
                if r == rank:
                    continue
                pos = r * S
                for t, a, b in plan.pieces[r]:
                    tp[t].reshape(-1)[a:b].copy_(pflat[pos:pos + b - a])
                    pos += b - a

    def _clip_globally(self, shard, world):
        """LAMB's global gradient-norm clipping with the norm of the whole (averaged) gradient."""
        torch, _ = _dist()
        from optirs.backends.common.elementwise import clip_scale

        sq = torch.sum(shard.double() * shard.double()).reshape(1)
        if world > 1:
            self._all_reduce(sq)
        scale = np.float32(clip_scale(math.sqrt(float(sq.item())), float(np.float32(self._hyper.max_grad_norm))))
        if scale != 1:
            shard.mul_(float(scale))

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """One checkpoint of the whole model's optimizer state, in the wrapped optimizer's format.

        In ``zero1`` the shards are all-gathered (every rank gets the full checkpoint); it loads
        into a :class:`DataParallelOptimizer` on any number of ranks, or into a plain optimizer.
        """
        if self.mode == "allreduce":
            sd = self.inner.state_dict()
            sd["hyperparameters"] = self._hyper.to_dict()
            return sd
        plan = self._plan
        slots = list(self.inner.state_slots(self._hyper))
        base = {"optimizer": self.inner.name, "hyperparameters": self._hyper.to_dict(), "step": self._step}
        if plan is None:
            return {**base, "shapes": [], "state": []}
        torch, _ = _dist()
        world, S = plan.world, plan.segment
        local = self.inner.engine.host_state()
        # the inner optimizer's layout of this rank's pieces: its flat state back to back, gaps out
        pieces = TensorLayout([(b - a,) for _, a, b in plan.pieces[self.rank]])
        # NCCL gathers CUDA tensors, gloo CPU ones; the checkpoint itself is numpy.
        _, dist = _dist()
        device = "cuda" if world > 1 and dist.get_backend(self.group) == "nccl" else "cpu"
        full = {}
        for slot in slots:
            shard = torch.zeros(S, dtype=torch.float32)
            if slot in local and len(pieces):
                mine = np.concatenate(pieces.views(local[slot]))
                shard[:mine.size] = torch.from_numpy(mine)
            if world > 1:
                gathered = torch.zeros(world * S, dtype=torch.float32, device=device)
                self._all_gather(gathered, shard.to(device))
                gathered = gathered.cpu()
            else:
                gathered = shard
            flat = np.zeros(plan.layout.total, F32)
            for r in range(world):
                pos = r * S
                for t, a, b in plan.pieces[r]:
                    off = int(plan.layout.offsets[t])
                    flat[off + a:off + b] = gathered[pos:pos + b - a].numpy()
                    pos += b - a
            full[slot] = flat
        state = [{slot: full[slot][o:o + n].reshape(s).copy() for slot in slots}
                 for o, n, s in zip(plan.layout.offsets.tolist(), plan.layout.sizes.tolist(), plan.layout.shapes)]
        return {**base, "shapes": [list(s) for s in plan.layout.shapes], "state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint from :meth:`state_dict` (of any number of ranks) or from a plain optimizer."""
        # Check it in full with a scratch optimizer of the same kind (host memory only).
        scratch = type(self.inner)(self.inner.params, self.inner.config)
        scratch.load_state_dict(state_dict)
        hyper = scratch.params
        if self.mode == "allreduce":
            self.inner.load_state_dict(state_dict)
            self.inner.params = hyper
            self._hyper, self._step, self._plan = hyper, scratch.step_count, None
            return
        shapes = [tuple(int(d) for d in s) for s in state_dict["shapes"]]
        inner_sd = {"optimizer": self.inner.name, "hyperparameters": self._effective(hyper).to_dict(),
                    "step": 0, "shapes": [], "state": []}
        plan = ShardPlan(shapes, self.world_size, self.inner.name not in ELEMENTWISE_OPTIMIZERS) if shapes else None
        if plan is not None and plan.pieces[self.rank]:
            entries = state_dict["state"]
            inner_sd["step"] = int(state_dict["step"])
            inner_sd["shapes"] = [[b - a] for _, a, b in plan.pieces[self.rank]]
            inner_sd["state"] = [{k: np.asarray(v, F32).reshape(-1)[a:b].copy() for k, v in entries[t].items()}
                                 for t, a, b in plan.pieces[self.rank]]
        self.inner.load_state_dict(inner_sd)
        self._hyper, self._step, self._plan = hyper, int(state_dict["step"]), plan
        self._buffers.clear()
        self._views.clear()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the per-rank memory ZeRO-1 divides)."""
        return self.inner.engine.state_bytes()

    def __repr__(self) -> str:
        return f"DataParallelOptimizer({self.inner!r}, mode={self.mode!r}, world={self.world_size}, step={self._step})"


def _split(flat, pieces, wrap):
    out, pos = [], 0
    for _, a, b in pieces:
        out.append(wrap(flat[pos:pos + b - a]))
        pos += b - a
    return out


__all__ = ["reduce_replicas", "reduce_across_devices", "DataParallelOptimizer", "ShardPlan",
           "init_process_group_from_env", "broadcast_parameters", "MODES", "REDUCE_OPS"]
