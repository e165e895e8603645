"""The cache the backends keep per list of arrays (cpu typed lists, cuda addresses): found again for
the very same array objects only, keeping none of them alive."""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict

import numpy as np
import pytest

from optirs.backends.common.identity_cache import ArrayListCache, identity_key
from optirs.core.errors import InvalidParameterError


def _arrays(n=2):
    return [np.zeros(3, np.float32) for _ in range(n)]


def test_a_hit_is_the_same_objects_only():
    cache = ArrayListCache(4)
    a = _arrays()
    cache.put(identity_key(a), a, "a")
    assert cache.get_by_identity(identity_key(a)) == "a"
    assert cache.get(identity_key(a), a) == "a"
    b = [x.copy() for x in a]  # equal values, other objects
    assert cache.get_by_identity(identity_key(b)) is None
    assert cache.get(identity_key(b), b) is None
    assert cache.get(identity_key(a), b) is None  # a key with other arrays: compared, not trusted
    cache.put(identity_key(a), b, "b")  # put under ids that are not its arrays'
    assert cache.get_by_identity(identity_key(a)) is None


def test_an_entry_goes_with_its_arrays_and_keeps_none_alive():
    cache = ArrayListCache(4)
    a = _arrays()
    kept = _arrays()
    cache.put(identity_key(kept), kept, "kept")
    old = identity_key(a)
    cache.put(old, a, "a")
    ref = weakref.ref(a[1])
    del a[1]
    gc.collect()
    assert ref() is None and len(cache) == 1
    # new arrays, which may take the ids of the dead ones, find nothing
    for _ in range(20):
        c = [a[0]] + _arrays(1)
        assert cache.get_by_identity(identity_key(c)) is None and cache.get(old, c) is None
    assert cache.get_by_identity(identity_key(kept)) == "kept"


def test_a_dropped_cache_goes_at_once_with_its_values():
    """No reference cycle: a cache dropped with its owner (a layout, a context) frees its values
    then, not at the garbage collector's next run."""
    gc.collect()
    gc.disable()
    try:
        cache = ArrayListCache(4)
        a = _arrays()
        values = [np.zeros(1), np.zeros(1)]
        cache.put(identity_key(a), a, values[0])
        cache.put(("owner",), a, values[1])
        refs = [weakref.ref(cache)] + [weakref.ref(v) for v in values]
        del cache, values
        assert [r() for r in refs] == [None] * 3
        del a  # the arrays' callbacks find no cache: nothing to do
    finally:
        gc.enable()


def test_least_recently_used_beyond_the_limit_goes():
    cache = ArrayListCache(2)
    a, b, c = _arrays(), _arrays(), _arrays()
    cache.put(identity_key(a), a, "a")
    cache.put(identity_key(b), b, "b")
    assert cache.get(identity_key(a), a) == "a"  # a is now the most recent
    cache.put(identity_key(c), c, "c")
    assert len(cache) == 2 and cache.get_by_identity(identity_key(b)) is None
    assert cache.get_by_identity(identity_key(a)) == "a" and cache.get_by_identity(identity_key(c)) == "c"


def test_an_owners_old_arrays_dying_leave_its_new_entry():
    cache = ArrayListCache(4)
    owner = ("model",)
    old, new = _arrays(), _arrays()
    cache.put(owner, old, "old")
    cache.put(owner, new, "new")
    assert cache.get(owner, old) is None
    del old
    gc.collect()
    assert cache.get(owner, new) == "new"


class _NoWeakRef:
    __slots__ = ("gone",)

    def __init__(self, gone):
        self.gone = gone

    def __del__(self):
        self.gone.append(True)


def test_arrays_that_take_no_weak_reference_are_held():
    cache = ArrayListCache(4)
    gone = []
    arrays = [np.zeros(3, np.float32), _NoWeakRef(gone)]
    with pytest.raises(TypeError):
        weakref.ref(arrays[1])
    key = identity_key(arrays)
    cache.put(key, arrays, "v")
    del arrays[1]
    gc.collect()
    assert gone == [] and len(cache) == 1  # held by the entry: its id is still its own
    del arrays[0]
    gc.collect()
    assert gone == [True] and len(cache) == 0  # the weakly held array went, and the entry with it


def test_an_entry_dropped_during_a_lookup_is_no_error():
    class DroppedAfterLookup(OrderedDict):  # as by a dying array's callback on another thread
        def get(self, key, default=None):
            entry = super().get(key, default)
            self.pop(key, None)
            return entry

    cache = ArrayListCache(4)
    a = _arrays()
    cache.put(identity_key(a), a, "a")
    cache._entries = DroppedAfterLookup(cache._entries)
    assert cache.get(identity_key(a), a) == "a"
    assert cache.get_by_identity(identity_key(a)) is None


def test_bad_use_is_a_clear_error():
    with pytest.raises(InvalidParameterError, match="limit"):
        ArrayListCache(0)
    with pytest.raises(InvalidParameterError, match="None"):
        ArrayListCache(1).put((), [], None)
