"""Small caches of numba typed lists, keyed by the arrays' identities.

Building a typed list of a model's arrays costs microseconds per array; a training loop passes
the same arrays step after step. An entry keeps its arrays alive, so the ids stay theirs; the
limit bounds what is kept alive. Gradients are often new arrays every step (torch's
``zero_grad(set_to_none=True)``): their cache keeps the latest list of each model (its
parameters' list) only, so an older step's gradients are let go, and two param groups stepped in
turn each find their own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, List


def cached_typed_list(cache: "OrderedDict[tuple, tuple]", arrays: List[Any], limit: int,
                      build: Callable[[List[Any]], Any]) -> Any:
    """``build(arrays)`` from ``cache`` (least recently used first out, at most ``limit`` entries)."""
    key = tuple(id(a) for a in arrays)
    hit = cache.get(key)
    if hit is None:
        hit = (arrays, build(arrays))
        cache[key] = hit
        while len(cache) > limit:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return hit[1]


def latest_typed_list(cache: "OrderedDict[tuple, tuple]", owner: tuple, arrays: List[Any], limit: int,
                      build: Callable[[List[Any]], Any]) -> Any:
    """``build(arrays)``, kept as the latest of ``owner`` (one list per owner, at most ``limit`` owners)."""
    key = tuple(map(id, arrays))
    hit = cache.get(owner)
    if hit is None or hit[0] != key:
        hit = (key, arrays, build(arrays))
        cache[owner] = hit
        while len(cache) > limit:
            cache.popitem(last=False)
    else:
        cache.move_to_end(owner)
    return hit[2]
