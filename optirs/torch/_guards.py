"""One check of many tensors' metadata, in C: what a cached step plan re-reads every step.

A step over the same tensors as the last one need not re-check each of them: it asks whether
every tensor still has the dtype, device, sizes, strides and ``requires_grad`` it had when the
plan was made. torch's dynamo keeps exactly that check for its compiled graphs
(``torch._C._dynamo.guards.TensorGuards``, about 140 ns per tensor, importable without importing
``torch._dynamo``); it is private API, so it is feature-detected and a few ``map()`` calls over
the same attributes stand in where it is missing or refuses.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import Any, Callable, List, Optional, Sequence

import torch

try:  # private API: absent or changed in some torch versions
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # noqa: BLE001 - any failure means: use the map() checks
    _TensorGuards = None

_META = (attrgetter("dtype"), attrgetter("device"), attrgetter("requires_grad"), torch.Tensor.size,
         torch.Tensor.stride)


def _dynamo_guard(tensors: Sequence[torch.Tensor]) -> Optional[Callable[..., bool]]:
    """TensorGuards' check over ``tensors`` (static sizes and strides), or None where it cannot be used."""
    if _TensorGuards is None:
        return None
    try:
        guard = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.size()) for t in tensors],
                              dynamic_dims_strides=[list(t.stride()) for t in tensors])
        check = guard.check
        if check(*tensors) is not True:  # it must accept the tensors it was made from
            return None
        return check
    except Exception:  # noqa: BLE001 - a changed private API: fall back
        return None


class TensorCheck:
    """Whether tensors still have the dtype, device, sizes, strides and requires_grad of the
    tensors it was made from, position by position (identity and memory are the caller's checks)."""

    __slots__ = ("_check", "_meta")

    def __init__(self, tensors: Sequence[torch.Tensor], use_dynamo: bool = True):
        self._check = _dynamo_guard(tensors) if use_dynamo else None
        self._meta = None if self._check is not None else self._read(tensors)

    @staticmethod
    def _read(tensors: Sequence[torch.Tensor]) -> List[List[Any]]:
        return [list(map(get, tensors)) for get in _META]

    @property
    def native(self) -> bool:
        """Whether the check runs in torch's C++ guards (else in map() calls)."""
        return self._check is not None

    def __call__(self, tensors: Sequence[torch.Tensor]) -> bool:
        check = self._check
        if check is not None:
            try:
                return check(*tensors)
            except Exception:  # noqa: BLE001 - e.g. a non-tensor where a tensor was: not the same
                return False
        meta = self._meta
        try:
            return all(map(list.__eq__, meta, map(list, map(map, _META, repeat(tensors)))))
        except Exception:  # noqa: BLE001
            return False


__all__ = ["TensorCheck"]
