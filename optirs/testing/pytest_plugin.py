"""The conformance kit as pytest tests: one test per check and backend.

    pytest -p optirs.testing.pytest_plugin --optirs-backend=mybackend [--optirs-optimizers=sgd,adam]

A backend published through an entry point is found by its name; one registered at run time
(``optirs.register_plugin``) is registered in a ``conftest.py`` (its import runs before the tests).
The tests are added to whatever else the run collects (none is needed), as
``optirs-conformance/<backend>::<check>``; a check of a part the backend does not list is skipped
with the reason, and a failure says which optimizer and what differed.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import pytest

from optirs.testing import conformance


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("optirs", "optirs backend conformance (optirs.testing)")
    group.addoption("--optirs-backend", action="append", default=[], metavar="NAME",
                    help="run the optirs conformance checks on this backend (repeat for several)")
    group.addoption("--optirs-optimizers", default=None, metavar="NAMES",
                    help="comma-separated optimizer definitions to check (default: every one)")


def _optimizers(config: Any) -> Optional[Tuple[str, ...]]:
    value = config.getoption("optirs_optimizers")
    if not value:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(set(names) - set(conformance.DEFINITIONS))
    if unknown:
        raise pytest.UsageError(f"--optirs-optimizers={value!r} names {unknown}, expected optimizer definitions "
                                f"{sorted(conformance.DEFINITIONS)}")
    return names


class ConformanceItem(pytest.Item):
    """One conformance check on one backend."""

    def __init__(self, *, backend: str, check: str, optimizers: Optional[Tuple[str, ...]], **kwargs: Any):
        super().__init__(**kwargs)
        self.backend, self.check, self.optimizers = backend, check, optimizers

    def runtest(self) -> None:
        reason = conformance.check(self.backend, self.check, optimizers=self.optimizers)
        if reason is not None:
            pytest.skip(reason)

    def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
        if isinstance(excinfo.value, AssertionError):  # the kit's message says it all; its frames do not
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> Tuple[Any, Optional[int], str]:
        return self.path, None, f"optirs conformance: {self.check} on backend {self.backend!r}"


@pytest.hookimpl(tryfirst=True)  # before -k / -m select among the items
def pytest_collection_modifyitems(session: Any, config: Any, items: List[Any]) -> None:
    backends = config.getoption("optirs_backend")
    if not backends:
        return
    optimizers = _optimizers(config)
    for backend in backends:
        for check in conformance.CHECKS:
            items.append(ConformanceItem.from_parent(session, name=f"{check}[{backend}]",
                                                     nodeid=f"optirs-conformance/{backend}::{check}",
                                                     backend=backend, check=check, optimizers=optimizers))
