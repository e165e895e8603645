"""The cpu backend's numba typed lists of a model's arrays, cached so that they keep no array alive.

Building a typed list of a model's arrays costs microseconds per array; a training loop passes
the same arrays step after step. The lists are kept in an :class:`ArrayListCache`
(``optirs/backends/common/identity_cache.py``): an entry holds its arrays weakly and goes when one
of them does, so a dropped model gives its memory back at once. Its list holds no reference to
them either: its views borrow the memory of arrays the caller passes to the step that uses them.
So an entry costs only its list, and the caches hold many, enough for every chunk of a
``CPUOffload`` (one list per chunk's bucket, 20-odd for GPT-2 1.3B), where four entries kept
alive made the chunks evict each other and rebuild their lists every step (about 20 us an array:
6 ms for the chunk of 194 small tensors). Gradients are often new arrays every step (torch's
``zero_grad(set_to_none=True)``): their cache keeps the latest list of each model (its
parameters' list) only, so two param groups stepped in turn each find their own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from optirs.backends.common.identity_cache import ArrayListCache, identity_key


def cached_typed_list(cache: ArrayListCache, arrays: list[Any], build: Callable[[list[Any]], Any],
                      ids: tuple | None = None) -> Any:
    """``build(arrays)``, found again by the arrays' identities (``ids``: their ``identity_key``,
    where the caller has it already)."""
    key = identity_key(arrays) if ids is None else ids
    built = cache.get_by_identity(key)
    return _built(cache, key, arrays, build, key) if built is None else built


def latest_typed_list(cache: ArrayListCache, owner: Hashable, arrays: list[Any],
                      build: Callable[[list[Any]], Any]) -> Any:
    """``build(arrays)``, kept as the latest list of ``owner`` (one list per owner)."""
    built = cache.get(owner, arrays)
    return _built(cache, owner, arrays, build) if built is None else built


def _built(cache: ArrayListCache, key: Hashable, arrays: list[Any], build: Callable[[list[Any]], Any],
           ids: tuple | None = None) -> Any:
    built = build(arrays)
    if hasattr(built, "borrowed"):
        built.borrowed = None  # its views' memory is the caller's, alive while it steps with them
    return cache.put(key, arrays, built, ids)
