"""Caches of numba typed lists, keyed by the arrays' identities, that keep no array alive.

Building a typed list of a model's arrays costs microseconds per array; a training loop passes
the same arrays step after step. An entry holds weak references to its arrays: a hit is the same
array objects, still alive (an id can be reused once its array is gone), and the entry's list
holds no reference to them (its views borrow the memory of arrays the caller passes to the step
that uses them). So an entry costs only its list: the caches hold many, enough for every chunk of
a ``CPUOffload`` (one list per chunk's bucket, 20-odd for GPT-2 1.3B), where four entries kept
alive made the chunks evict each other and rebuild their lists every step (about 20 us an array:
6 ms for the chunk of 194 small tensors). Arrays that cannot be weakly referenced are held by
their entry, as before. Gradients are often new arrays every step (torch's
``zero_grad(set_to_none=True)``): their cache keeps the latest list of each model (its
parameters' list) only, so two param groups stepped in turn each find their own.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable, List, Optional, Tuple


def _refs(arrays: List[Any]) -> Optional[Tuple[Any, ...]]:
    """Weak references to ``arrays``, or None where one cannot be weakly referenced."""
    try:
        return tuple(map(weakref.ref, arrays))
    except TypeError:
        return None


def _held(arrays: List[Any], built: Any) -> tuple:
    """A cache entry of ``built``: weak references and a list that borrows nothing, or else the arrays."""
    refs = _refs(arrays)
    if refs is None:
        return False, list(arrays), built
    if hasattr(built, "borrowed"):
        built.borrowed = None  # its views' memory is the caller's, alive while it steps with them
    return True, refs, built


def _same(entry: tuple, arrays: List[Any]) -> bool:
    """Whether ``entry`` was built from these very array objects (alive: the caller passed them)."""
    weak, held, _ = entry
    if len(held) != len(arrays):
        return False
    if weak:
        return all(r() is a for r, a in zip(held, arrays))
    return all(h is a for h, a in zip(held, arrays))


def _gone(entry: tuple) -> bool:
    weak, held, _ = entry
    return weak and any(r() is None for r in held)


def _admit(cache: "OrderedDict[Any, tuple]", key: Any, entry: tuple, limit: int) -> None:
    """Put ``entry`` in, after dropping entries whose arrays are gone, then the least recently used
    beyond ``limit``."""
    for k in [k for k, e in cache.items() if _gone(e)]:
        del cache[k]
    cache[key] = entry
    while len(cache) > limit:
        cache.popitem(last=False)


def _typed_list(cache: "OrderedDict[Any, tuple]", key: Any, arrays: List[Any], limit: int,
                build: Callable[[List[Any]], Any]) -> Any:
    """The entry of ``key`` when it was built from ``arrays``, else ``build(arrays)`` put in its place."""
    hit = cache.get(key)
    if hit is None or not _same(hit, arrays):
        hit = _held(arrays, build(arrays))
        _admit(cache, key, hit, limit)
    else:
        cache.move_to_end(key)
    return hit[2]


def cached_typed_list(cache: "OrderedDict[tuple, tuple]", arrays: List[Any], limit: int,
                      build: Callable[[List[Any]], Any]) -> Any:
    """``build(arrays)`` from ``cache`` (least recently used first out, at most ``limit`` entries)."""
    return _typed_list(cache, tuple(map(id, arrays)), arrays, limit, build)


def latest_typed_list(cache: "OrderedDict[tuple, tuple]", owner: tuple, arrays: List[Any], limit: int,
                      build: Callable[[List[Any]], Any]) -> Any:
    """``build(arrays)``, kept as the latest of ``owner`` (one list per owner, at most ``limit`` owners)."""
    return _typed_list(cache, owner, arrays, limit, build)
