"""Scratch tensors that an optimizer composed of inner optirs.torch steps keeps per parameter
(Muon's momentum, LAMB's direction on shards), and the hand-over of ``opt.state[p]`` to the inner
optimizer's ``state[scratch]``, which holds the same entry object once a step installed it."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch


def scratch_for(cache: Dict[int, torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """A tensor like ``p`` (dtype, shape, strides; a DTensor placed as ``p`` is), made once per parameter."""
    z = cache.get(id(p))
    if z is None or z.shape != p.shape or z.dtype != p.dtype or z.stride() != p.stride():
        z = cache[id(p)] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
    return z


def hand_over(state: Any, inner_state: Any, p: torch.Tensor, z: torch.Tensor,
              fresh: Optional[Callable[[torch.Tensor], Dict[str, Any]]] = None) -> None:
    """Make the inner optimizer step ``z`` from what ``state[p]`` holds: the entry itself where it is
    not already the inner one (loaded, set by hand: the inner step adopts it), else ``fresh(p)`` (or
    nothing: the inner optimizer's own fresh state) when ``state[p]`` is empty."""
    entry = state.get(p)
    if entry and entry is inner_state.get(z):
        return
    if entry:
        inner_state[z] = entry
    elif fresh is not None:
        inner_state[z] = fresh(p)
    else:
        inner_state.pop(z, None)


__all__ = ["scratch_for", "hand_over"]
