"""A cache of values built from lists of arrays, found again for the very same array objects,
that keeps no array alive.

A training loop passes the same arrays step after step, and what a backend derives from a list of
them costs per array to build (the cpu backend's numba typed lists, the cuda context's device
addresses). :class:`ArrayListCache` keeps such values under the arrays' identities
(:func:`identity_key`) or under an owner's key (the latest gradient list of a parameter list:
gradients are often new arrays every step, torch's ``zero_grad(set_to_none=True)``).

An entry holds weak references to its arrays, and the death of any one of them drops the entry at
once: a model dropped with its optimizer gives its memory back then, not when enough later lists
have pushed its entries out, and the limit can be generous (every chunk of a ``CPUOffload``).
Arrays that take no weak reference are held by their entry. Since an entry lives only while all
of its arrays do, and live objects' ids are unique, an entry whose arrays' ids are the caller's
was built from the caller's very arrays (an id reused once its array is gone finds nothing).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from optirs.core.errors import InvalidParameterError


def identity_key(arrays: Sequence[Any]) -> tuple:
    """The key of a list of arrays by their identities: theirs alone while they live."""
    return tuple(map(id, arrays))


class _Entry:
    __slots__ = ("__weakref__", "by_identity", "held", "ids", "value")

    def __init__(self, key: Hashable, ids: tuple, value: Any):
        self.ids, self.value = ids, value
        self.by_identity = type(key) is tuple and key == ids  # put under its arrays' identity_key
        self.held: tuple = ()


class ArrayListCache:
    """Values built from lists of arrays, at most ``limit`` of them (least recently used out first),
    each gone as soon as one of its arrays is."""

    def __init__(self, limit: int):
        if not isinstance(limit, int) or limit < 1:
            raise InvalidParameterError(f"ArrayListCache takes a limit of at least 1 entry, got {limit!r}")
        self.limit = limit
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, arrays: Sequence[Any]) -> Any | None:
        """The value put under ``key`` from these very ``arrays`` (the same objects), else None."""
        entry = self._entries.get(key)
        if entry is None or entry.ids != identity_key(arrays):
            return None
        try:
            self._entries.move_to_end(key)
        except KeyError:  # dropped since the lookup (a put's eviction, a callback on another thread)
            pass
        return entry.value

    def get_by_identity(self, ids: tuple) -> Any | None:
        """The value put for arrays whose :func:`identity_key` is ``ids``, else None: for a caller
        that holds those arrays (alive, so no other object has their ids), the key alone proves
        the entry theirs, with no second pass over the arrays."""
        entry = self._entries.get(ids)
        if entry is None or not entry.by_identity:
            return None
        try:
            self._entries.move_to_end(ids)
        except KeyError:  # as in get
            pass
        return entry.value

    def put(self, key: Hashable, arrays: Sequence[Any], value: Any, ids: tuple | None = None) -> Any:
        """Keeps ``value`` (not None: None is a miss) under ``key`` as built from ``arrays``, in
        place of what ``key`` held; returns it. ``ids``: the arrays' :func:`identity_key`, where the
        caller has it already."""
        if value is None:
            raise InvalidParameterError("ArrayListCache cannot keep None: get answers None for a miss")
        entries = self._entries
        entry = _Entry(key, identity_key(arrays) if ids is None else ids, value)
        # The callback holds the cache and the entry weakly: no reference cycle, so a cache dropped
        # goes at once with its values, not at the garbage collector's next run.
        entries_ref, entry_ref = weakref.ref(entries), weakref.ref(entry)

        def drop(_ref: Any) -> None:
            # only its own entry: an owner's key may hold a newer one by now (one put on another
            # thread between the two lines is dropped too, which costs a rebuild, not a wrong hit)
            live = entries_ref()
            if live is not None and live.get(key) is entry_ref():
                live.pop(key, None)

        held = []
        for a in arrays:
            try:
                held.append(weakref.ref(a, drop))
            except TypeError:
                held.append(a)  # takes no weak reference: held, so its id stays its own
        entry.held = tuple(held)
        entries[key] = entry
        entries.move_to_end(key)
        while len(entries) > self.limit:
            try:
                entries.popitem(last=False)
            except KeyError:  # emptied meanwhile by dying arrays' callbacks
                break
        return value
