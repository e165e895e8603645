"""Tools for testing optirs backends: the conformance kit (:mod:`optirs.testing.conformance`) and
its pytest plugin (:mod:`optirs.testing.pytest_plugin`)."""

from optirs.testing.conformance import CHECKS, check, check_backend

__all__ = ["CHECKS", "check", "check_backend"]
