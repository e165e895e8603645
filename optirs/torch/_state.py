"""``opt.state`` of the optirs.torch optimizers: torch's ``defaultdict(dict)``, counting changes.

A cached step must know that ``opt.state`` still holds the views of its buckets' flat buffers:
an entry replaced (``opt.state[p] = {...}``) or a value replaced (``opt.state[p]["exp_avg"] = t``)
is state the user means the next step to use. :class:`TrackedState` counts every set or removal
of its own items and of the items of its :class:`TrackedEntry` entries in one ``version``, so a
step where nothing was replaced sees it in one comparison, whatever the number of tensors.

Both pickle and copy as the plain ``defaultdict`` / ``dict`` torch keeps (a checkpoint never
names an optirs class, so ``torch.load(weights_only=True)`` reads it); a copy or an unpickled
optimizer rebuilds its buckets at the first step.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Optional


def _counting(name: str, owner_of):
    """``dict.name`` that counts one change on the owning state first."""
    method = getattr(dict, name)

    def counted(self, *args: Any, **kwargs: Any):
        owner = owner_of(self)
        if owner is not None:
            owner.version += 1
        return method(self, *args, **kwargs)

    counted.__name__ = name
    return counted


def _counts_changes(owner_of):
    """A class decorator: every dict method that sets or removes items counts on ``owner_of(self)``."""

    def decorate(cls: type) -> type:
        for name in ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault", "__ior__"):
            setattr(cls, name, _counting(name, owner_of))
        return cls

    return decorate


@_counts_changes(lambda state: state)
class TrackedState(defaultdict):
    """``opt.state`` (torch's ``defaultdict(dict)``) that counts the changes of its items and of its
    :class:`TrackedEntry` entries' items in ``version`` (module docstring)."""

    def __init__(self, items: Any = ()):
        super().__init__(dict)
        dict.update(self, items)
        self.version = 0

    def __reduce__(self):
        return (defaultdict, (dict,), None, None, iter(self.items()))


@_counts_changes(lambda entry: entry.owner)
class TrackedEntry(dict):
    """One tensor's entry of a :class:`TrackedState`: a dict whose changes count on its owner, held
    weakly (the state holds its entries: a strong reference back would make every dropped
    optimizer's state tensors wait for the garbage collector)."""

    __slots__ = ("_owner",)

    def __init__(self, owner: Optional[TrackedState], items: Any = ()):
        super().__init__(items)
        self._owner = weakref.ref(owner) if owner is not None else None

    @property
    def owner(self) -> Optional[TrackedState]:
        return self._owner() if self._owner is not None else None

    def __reduce__(self):
        return (dict, (), None, None, iter(self.items()))

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: Any) -> dict:
        import copy

        out: dict = {}
        memo[id(self)] = out
        for k, v in self.items():
            out[copy.deepcopy(k, memo)] = copy.deepcopy(v, memo)
        return out


def plain(entry: Any) -> Any:
    """An entry as the plain dict a checkpoint holds."""
    return dict(entry) if type(entry) is TrackedEntry else entry


__all__ = ["TrackedEntry", "TrackedState", "plain"]
