"""A small cache of numba typed lists, keyed by the arrays' identities.

Building a typed list of a model's arrays costs microseconds per array; a training loop passes
the same arrays step after step. An entry keeps its arrays alive, so the ids stay theirs; the
limit bounds what is kept alive.
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
