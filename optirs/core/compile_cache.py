"""Where compiled kernels are cached, what is cached, and a log of what compiles (docs/compile_cache.md).

numba compiles a kernel on its first call in a process; the ``@njit(cache=True)`` kernels keep the
machine code on disk, so a later run loads it instead. numba picks the directory itself when it
decorates each kernel: ``NUMBA_CACHE_DIR`` when set and usable, else the ``__pycache__`` folder
beside the module when writable, else its user-wide cache. It passes over an unusable choice
without a word, and raises at import when none is usable. This module asks numba's own locators
(it never restates their rules), says once when a choice was passed over, gives numba a temporary
directory when none is usable, and logs each real compile: numba fires ``numba:compile`` only when
it compiles (a disk-cache hit loads without it).

Nothing here imports numba at import time: ``optirs info`` and the backends pay for it when they ask.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

from optirs.core.errors import CompileCacheWarning

COMPILE_LOGGER = "optirs.compile"
COMPILE_LOG_ENV = "OPTIRS_COMPILE_LOG"

# The kinds of location, named as the user meets them.
USER_DIR = "NUMBA_CACHE_DIR"
IN_TREE = "in-tree"
USER_WIDE = "user-wide"
TEMPORARY = "temporary"
NONE = "none"

_PACKAGE = Path(__file__).resolve().parent.parent
# The element math every numba backend compiles: numba's choice for this file stands for its choice
# for every kernel module of the package (they live in one tree, so the same locator applies).
_PROBE_SOURCE = _PACKAGE / "backends" / "common" / "elementwise.py"

_LOCK = threading.RLock()
_READY: Optional["CacheLocation"] = None
_TEMPORARY_DIR: Optional[str] = None
_LISTENER: Any = None
_RECORDS: List["CompileRecord"] = []
_LOG_CHECKED = False


class PassedOver(NamedTuple):
    """A cache location numba passed over: its kind, the directory and why it cannot be used."""

    kind: str
    directory: str
    why: str


class CacheLocation(NamedTuple):
    """Where numba caches optirs's kernels (:func:`cache_location`).

    :param kind: ``"NUMBA_CACHE_DIR"``; ``"in-tree"`` (a ``__pycache__`` folder beside each module);
        ``"user-wide"`` (numba's user cache directory); ``"temporary"`` (no directory is usable:
        :func:`ensure_cache_usable` gave numba one for this process); ``"none"`` (no directory is
        usable and nothing replaced it); or a locator class's name (``NUMBA_CACHE_LOCATOR_CLASSES``).
    :param directory: the root of the cache: NUMBA_CACHE_DIR, the optirs package (in-tree),
        numba's user cache directory, the temporary directory; None for ``"none"``.
    :param kernels_directory: the directory of one kernel module (the backends' shared element
        math), exactly as numba computes it.
    :param reason: why numba uses it, in one sentence.
    :param passed_over: the locations numba tried first and could not use.
    """

    kind: str
    directory: Optional[str]
    kernels_directory: Optional[str]
    reason: str
    passed_over: Tuple[PassedOver, ...] = ()

    @property
    def where(self) -> str:
        """The location in words, for messages."""
        if self.kind == IN_TREE:
            return f"the __pycache__ folder beside each module under {self.directory} (in-tree)"
        if self.kind == USER_WIDE:
            return f"{self.directory} (numba's user-wide cache)"
        if self.kind == TEMPORARY:
            return f"{self.directory} (temporary: removed at exit)"
        return str(self.directory)

    @property
    def persistent(self) -> bool:
        """Whether a later run finds what this run compiles."""
        return self.kind not in (TEMPORARY, NONE)


class CachedModule(NamedTuple):
    """The cache files of one optirs source module (:func:`cached_kernels`); stale files included.

    :param functions: numba index files (``.nbi``), one per cached function.
    :param entries: numba data files (``.nbc``), one per compiled signature of a function.
    :param newest: the newest file's modification time (seconds since the epoch).
    """

    module: str
    directory: str
    functions: int
    entries: int
    bytes: int
    newest: Optional[float]


class BinaryCache(NamedTuple):
    """An OpenCL program cache (:func:`opencl_binary_caches`): files and bytes under ``directory``."""

    name: str
    directory: str
    files: int
    bytes: int
    note: str


class CompileRecord(NamedTuple):
    """One outermost compile of an optirs kernel (:func:`compile_records`).

    :param name: ``<module>.<function>``, the module without ``optirs.backends.``
        (``cpu.kernels.pointwise``) and the function without ``<locals>``.
    :param cache_directory: where numba saves it; None when it is not cached on disk.
    """

    name: str
    seconds: float
    cache_directory: Optional[str]
    failed: bool


# ------------------------------------------------------------------ where numba caches


def _locator_classes() -> Tuple[Tuple[type, str], ...]:
    """numba's standard locators in the order it tries them, with the kind each stands for."""
    from numba.core import caching

    def named(name: str) -> type:  # public names since numba 0.59; underscored before
        return getattr(caching, name, None) or getattr(caching, "_" + name)

    return ((named("UserProvidedCacheLocator"), USER_DIR), (named("InTreeCacheLocator"), IN_TREE),
            (named("UserWideCacheLocator"), USER_WIDE))


def _probe(source: Path) -> Any:
    """A function numba takes for one written in ``source``: numba locates a function's cache from its
    code's file name, so its own locators answer for that file without importing it."""
    namespace: Dict[str, Any] = {}
    exec(compile("def optirs_cache_probe():\n    pass\n", str(source), "exec"), namespace)
    return namespace["optirs_cache_probe"]


def _chosen_locator() -> Any:
    """The locator numba picks for optirs's kernels, or None when none is usable. numba's chain
    creates the chosen directory, as it does when it decorates a kernel."""
    from numba.core import caching

    try:
        return caching.CompileResultCacheImpl(_probe(_PROBE_SOURCE)).locator
    except RuntimeError:  # numba: "cannot cache function ...: no locator available for file ..."
        return None


def _why_unusable(locator: Any) -> Optional[str]:
    try:
        locator.ensure_cache_path()  # numba's own test: create the directory, write a file in it
    except OSError as exc:
        what = "is not writable" if os.path.isdir(locator.get_cache_path()) else "cannot be created"
        return f"{what} ({exc.strerror or exc})"
    return None


def _passed_over(chosen: Any) -> Tuple[PassedOver, ...]:
    from numba.core import config

    if config.CACHE_LOCATOR_CLASSES:  # the user's own chain: nothing of numba's was passed over
        return ()
    out = []
    for cls, kind in _locator_classes():
        if chosen is not None and type(chosen) is cls:
            break
        if kind == USER_DIR and not config.CACHE_DIR:
            continue  # not asked for: nothing passed over
        candidate = cls(_probe(_PROBE_SOURCE), str(_PROBE_SOURCE))
        why = _why_unusable(candidate)
        if why is not None:
            shown = config.CACHE_DIR if kind == USER_DIR else candidate.get_cache_path()
            out.append(PassedOver(kind, shown, why))
    return tuple(out)


def _resolve() -> Tuple[CacheLocation, Any]:
    from numba.core import config

    chosen = _chosen_locator()
    passed = _passed_over(chosen)
    kinds = {cls: kind for cls, kind in _locator_classes()}
    kind = NONE if chosen is None else kinds.get(type(chosen), type(chosen).__name__)
    if kind == USER_DIR and _TEMPORARY_DIR is not None and config.CACHE_DIR == _TEMPORARY_DIR:
        kind = TEMPORARY
    kernels = None if chosen is None else chosen.get_cache_path()
    if kind in (USER_DIR, TEMPORARY):
        directory, reason = os.path.abspath(config.CACHE_DIR), "NUMBA_CACHE_DIR is set"
        if kind == TEMPORARY:
            reason = ("no cache directory is usable: this process compiles into a temporary directory, "
                      "so every run compiles its kernels again")
    elif kind == IN_TREE:
        directory, reason = str(_PACKAGE), "numba's default"
    elif kind == USER_WIDE:
        directory = os.path.dirname(kernels)
        reason = "numba's fallback: the __pycache__ folders beside optirs's modules are not writable"
    elif kind == NONE:
        directory, reason = None, "no cache directory is usable: numba cannot cache optirs's kernels"
    else:
        directory, reason = kernels, "NUMBA_CACHE_LOCATOR_CLASSES chooses it"
    return CacheLocation(kind, directory, kernels, reason, passed), chosen


def cache_location() -> CacheLocation:
    """Where numba caches optirs's kernels now, and why (imports numba).

    numba's own locator chain answers (with the user's ``NUMBA_CACHE_LOCATOR_CLASSES`` if set); as
    numba does when it decorates a kernel, the chosen directory is created if missing.
    """
    return _resolve()[0]


def kernel_cache_directory(source: Any) -> Optional[str]:
    """The directory numba caches the ``@njit(cache=True)`` kernels of the Python file ``source`` in,
    by the locator it picks for optirs's kernels (None: no directory is usable)."""
    chosen = _resolve()[1]
    return None if chosen is None else type(chosen)(_probe(Path(source)), str(source)).get_cache_path()


def ensure_cache_usable() -> CacheLocation:
    """Check once where numba will cache optirs's kernels and say so when it is not where it should be.

    - ``NUMBA_CACHE_DIR`` set but unusable (numba then caches elsewhere without a word): one
      :class:`~optirs.core.errors.CompileCacheWarning` naming the directory, why, and where the
      kernels are cached instead.
    - No directory usable (numba would raise at the kernels' import): numba gets a temporary
      directory for this process, removed at exit, and one warning says that caching is off.
    - The in-tree folders not writable: numba's user-wide cache serves, as numba intends for
      read-only installs; an INFO line on the ``optirs.compile`` logger says so (no warning: a
      read-only site-packages is the normal case there).

    Idempotent; after the first call it returns the same answer at once. Call it before the first
    optirs kernel is decorated (before importing a kernel module): numba picks the directory then.
    """
    global _READY, _TEMPORARY_DIR
    if _READY is not None:
        return _READY
    with _LOCK:
        if _READY is None:
            location = cache_location()
            if location.kind == NONE:
                from numba.core import config

                try:
                    _TEMPORARY_DIR = tempfile.mkdtemp(prefix="optirs-kernels-")
                except OSError:
                    pass  # numba raises at the kernels' import; the warning below says why
                else:
                    atexit.register(shutil.rmtree, _TEMPORARY_DIR, True)
                    config.CACHE_DIR = _TEMPORARY_DIR  # read at each kernel's decoration
                    location = cache_location()._replace(passed_over=location.passed_over)
            _announce(location)
            _READY = location
    return _READY


def _announce(location: CacheLocation) -> None:
    from numba.core import config

    unusable = ("; ".join(f"{p.directory} {p.why}" for p in location.passed_over)
                or f"NUMBA_CACHE_LOCATOR_CLASSES={config.CACHE_LOCATOR_CLASSES}")
    if location.kind in (TEMPORARY, NONE):
        where = (f"this run compiles into {location.directory}" if location.kind == TEMPORARY
                 else "numba will refuse to import them")
        warnings.warn(f"optirs: no directory to cache compiled kernels in is usable ({unusable}): kernel "
                      f"caching is off and every run compiles its kernels again ({where}); set "
                      "NUMBA_CACHE_DIR to a writable directory", CompileCacheWarning, stacklevel=3)
    elif any(p.kind == USER_DIR for p in location.passed_over):
        warnings.warn(f"optirs: NUMBA_CACHE_DIR={unusable}; numba caches optirs's kernels in "
                      f"{location.where} instead", CompileCacheWarning, stacklevel=3)
    elif location.passed_over:
        logging.getLogger(COMPILE_LOGGER).info("optirs: %s; numba caches optirs's kernels in %s instead",
                                               unusable, location.where)


# ------------------------------------------------------------------ what is cached


def cached_kernels() -> Tuple[CachedModule, ...]:
    """The numba cache files of each optirs source module that has any, where numba caches now.

    Files are matched by their name, which numba starts with the module's file stem
    (``formats_kernels._make_pointwise.locals._run_words-135.py311.nbi``). Imports numba; reads
    directories only.
    """
    chosen = _resolve()[1]
    if chosen is None:
        return ()
    folders: Dict[Path, List[Path]] = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        if "__pycache__" not in path.parts:
            folders.setdefault(path.parent, []).append(path)
    out = []
    for folder, files in folders.items():
        directory = type(chosen)(_probe(files[0]), str(files[0])).get_cache_path()
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        stems = {f.stem: f for f in files}
        found: Dict[str, List[Tuple[str, os.stat_result]]] = {}
        for name in names:
            suffix = name.rpartition(".")[2]
            stem = name.partition(".")[0]
            if suffix not in ("nbi", "nbc") or stem not in stems:
                continue
            try:
                st = os.stat(os.path.join(directory, name))
            except OSError:
                continue  # removed meanwhile
            found.setdefault(stem, []).append((suffix, st))
        for stem, stats in sorted(found.items()):
            rel = stems[stem].relative_to(_PACKAGE.parent).with_suffix("").parts
            module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
            out.append(CachedModule(module, directory, sum(k == "nbi" for k, _ in stats),
                                    sum(k == "nbc" for k, _ in stats), sum(s.st_size for _, s in stats),
                                    max(s.st_mtime for _, s in stats)))
    return tuple(out)


def _tree_size(directory: str) -> Tuple[int, int]:
    files = size = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                pass
    return files, size


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on", "y", "t")


def opencl_binary_caches() -> Tuple[BinaryCache, ...]:
    """The OpenCL program caches optirs's OpenCL kernels can land in (none without pyopencl).

    pyopencl caches program binaries under its user cache directory (``XDG_CACHE_HOME`` on Linux;
    pyopencl reads no variable of its own for the place), unless ``PYOPENCL_NO_CACHE`` is set; for a
    PoCL or NVIDIA device it leaves caching to the driver (PoCL: ``POCL_CACHE_DIR``, else
    ``XDG_CACHE_HOME/pocl/kcache``; ``POCL_KERNEL_CACHE=0`` turns it off). Imports neither pyopencl
    nor an OpenCL driver.
    """
    if importlib.util.find_spec("pyopencl") is None:
        return ()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # the place pyopencl.cache computes (pyopencl offers no function that answers it)
    if sys.platform == "darwin" and xdg:
        base = os.path.join(xdg, "pyopencl")
    else:
        try:
            import platformdirs

            base = platformdirs.user_cache_dir("pyopencl", "pyopencl")
        except ImportError:
            base = os.path.join(xdg or os.path.expanduser("~/.cache"), "pyopencl")
    version = ".".join(str(i) for i in sys.version_info)
    pyopencl_dir = os.path.join(base, f"pyopencl-compiler-cache-v2-py{version}")
    note = ("off: PYOPENCL_NO_CACHE is set" if _env_true("PYOPENCL_NO_CACHE")
            else "program binaries; PoCL and NVIDIA devices leave caching to their driver")
    out = [BinaryCache("pyopencl", pyopencl_dir, *_tree_size(pyopencl_dir), note)]
    pocl_dir = os.environ.get("POCL_CACHE_DIR") or os.path.join(xdg or os.path.expanduser("~/.cache"), "pocl", "kcache")
    if os.environ.get("POCL_CACHE_DIR") or os.path.isdir(pocl_dir):
        off = os.environ.get("POCL_KERNEL_CACHE", "").strip() == "0"
        out.append(BinaryCache("PoCL", pocl_dir, *_tree_size(pocl_dir),
                               "off: POCL_KERNEL_CACHE=0" if off else "PoCL's own cache: every program PoCL built"))
    return tuple(out)


# ------------------------------------------------------------------ the compile log


def compile_records() -> Tuple[CompileRecord, ...]:
    """Every outermost optirs kernel compiled in this process since :func:`install_compile_log`, and
    every build a backend reported with :func:`compiling` or :func:`timed_build`, in order."""
    with _LOCK:
        return tuple(_RECORDS)


def _compile_logger() -> Optional[logging.Logger]:
    """The compile log, or None when ``OPTIRS_COMPILE_LOG=0``. A user who configured no logging
    still sees it: without a handler anywhere above it, it gets one on stderr at INFO (once)."""
    global _LOG_CHECKED
    if os.environ.get(COMPILE_LOG_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    logger = logging.getLogger(COMPILE_LOGGER)
    with _LOCK:
        if not _LOG_CHECKED:
            _LOG_CHECKED = True
            if not logger.hasHandlers():
                handler = logging.StreamHandler()  # stderr
                handler.setFormatter(logging.Formatter("%(message)s"))
                logger.addHandler(handler)
                logger.setLevel(logging.INFO)
    return logger


def _short_name(py_func: Any) -> Optional[str]:
    module = getattr(py_func, "__module__", None) or ""
    if module != "optirs" and not module.startswith("optirs."):
        return None
    parts = module.split(".")[1:]
    if parts[:1] == ["backends"]:
        parts = parts[1:]
    qualname = getattr(py_func, "__qualname__", getattr(py_func, "__name__", "?")).replace("<locals>.", "")
    return ".".join(parts + [qualname])


def _compile_started(dispatcher: Any) -> Optional[Tuple[str, Optional[str], float]]:
    name = _short_name(getattr(dispatcher, "py_func", None))
    if name is None:
        return None
    try:
        cache = dispatcher.stats.cache_path
    except AttributeError:  # a dispatcher without a disk cache (lifted code)
        cache = None
    return _started(name, cache)


def _started(name: str, cache: Optional[str]) -> Tuple[str, Optional[str], float]:
    logger = _compile_logger()
    if logger is not None:
        if cache is None:
            later = "it is not cached on disk: every run compiles it"
        elif _TEMPORARY_DIR is not None and cache.startswith(_TEMPORARY_DIR):
            later = "caching is off: every run compiles it"
        else:
            later = f"later runs load it from {cache}"
        logger.info("optirs: compiling %s for this machine (first use; %s)", name, later)
    return name, cache, time.perf_counter()


def _compile_ended(started: Tuple[str, Optional[str], float], failed: bool) -> None:
    name, cache, t0 = started
    seconds = time.perf_counter() - t0
    with _LOCK:
        _RECORDS.append(CompileRecord(name, seconds, cache, failed))
    logger = _compile_logger()
    if logger is not None:
        logger.info("optirs: %s %s in %.1f s", "failed compiling" if failed else "compiled", name, seconds)


# An OpenCL build that took longer than this compiled (a driver's cache hit loads in milliseconds).
SLOW_BUILD_S = 0.5


def timed_build(name: str, seconds: float, where: str) -> None:
    """The compile log's line and record of a build whose cache is the driver's (an OpenCL
    program): whether it hit is known only by its time, so a build over ``SLOW_BUILD_S`` is
    reported after it, as what compiled. ``where``: who caches it for later runs."""
    if seconds < SLOW_BUILD_S:
        return
    with _LOCK:
        _RECORDS.append(CompileRecord(name, seconds, None, False))
    logger = _compile_logger()
    if logger is not None:
        logger.info("optirs: compiled %s in %.1f s (first build on this machine; %s)", name, seconds, where)


@contextmanager
def compiling(name: str, cache_directory: Optional[str] = None) -> Iterator[None]:
    """The compile log's two lines and record around a build numba's event does not cover: a
    numba-cuda kernel (numba-cuda fires no ``numba:compile`` for its kernels).

    :param name: what is built, as the log names it (``opencl.formats.adam``).
    :param cache_directory: where the build is cached for later runs; None when it is not.
    """
    started = _started(name, cache_directory)
    failed = True
    try:
        yield
        failed = False
    finally:
        _compile_ended(started, failed)


def _make_listener() -> Any:
    from numba.core import event

    class CompileLog(event.Listener):
        """Logs the outermost compile of an optirs kernel: a kernel's callees compile inside it and
        fire the event too, so only a compile that starts at depth 0 on its thread is reported."""

        def __init__(self) -> None:
            self._local = threading.local()

        def on_start(self, ev: Any) -> None:
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            if depth == 0:
                self._local.top = _compile_started((ev.data or {}).get("dispatcher"))

        def on_end(self, ev: Any) -> None:
            depth = max(getattr(self._local, "depth", 0) - 1, 0)
            self._local.depth = depth
            top = getattr(self._local, "top", None)
            if depth == 0 and top is not None:
                self._local.top = None
                # numba 0.68's Event.is_failed answers the opposite; a compile that succeeded has
                # added its overload by the time the event ends (Dispatcher.compile, LiftedLoop)
                data = ev.data or {}
                overloads = getattr(data.get("dispatcher"), "overloads", None)
                failed = overloads is not None and tuple(data.get("args") or ()) not in overloads
                _compile_ended(top, failed)

    return CompileLog()


def install_compile_log() -> None:
    """Log each compile of an optirs numba kernel on the ``optirs.compile`` logger (idempotent).

    One line when it starts (``optirs: compiling cpu.kernels.pointwise for this machine (first use;
    later runs load it from ...)``) and one with the seconds it took; a kernel loaded from the disk
    cache logs nothing. ``OPTIRS_COMPILE_LOG=0`` silences the lines (:func:`compile_records` still
    counts). Covers numba's CPU dispatchers; numba-cuda's kernels and OpenCL programs fire no
    such event: a backend wraps their builds in :func:`compiling`.
    """
    global _LISTENER
    if _LISTENER is not None:
        return
    with _LOCK:
        if _LISTENER is None:
            from numba.core import event

            listener = _make_listener()
            event.register("numba:compile", listener)
            _LISTENER = listener


@functools.lru_cache(maxsize=None)
def source_state(*folders: str) -> str:
    """The size and modification time of every Python source in ``folders`` (relative to the optirs
    package), read once per process: part of the cache key of kernels that numba would otherwise
    keep after an edit of a file they call into (numba checks the kernel's own file only)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stamps = []
    for folder in folders:
        here = os.path.join(root, folder)
        for name in sorted(os.listdir(here)):
            if name.endswith(".py"):
                st = os.stat(os.path.join(here, name))
                stamps.append(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(stamps)


# ------------------------------------------------------------------ one data file per key


@functools.lru_cache(maxsize=None)
def _key_named(files: type) -> type:
    class KeyNamedCacheFile(files):  # type: ignore[misc, valid-type]
        """numba's index and data files (``files``: numba's class, or numba-cuda's copy of it),
        each data file named by a digest of its index key and written before the index names it."""

        def save(self, key: Any, data: Any) -> None:
            name = self.data_name_of(key)
            self._save_data(name, data)
            overloads = self._load_index()
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

        def data_name_of(self, key: Any) -> str:
            # a key is numba types, the target's name and features and the code's hashes (and, for
            # the CUDA kernels, optirs's key): its text names each type by its unique name
            digest = hashlib.sha256(str(key).encode()).hexdigest()[:20]
            return f"{self._index_name[: -len('.nbi')]}.{digest}.nbc"

    return KeyNamedCacheFile


def key_named_cache(cache: Any) -> Any:
    """Gives ``cache`` (a numba function cache: a ``njit(cache=True)`` dispatcher's, numba-cuda's)
    one data file per index key, named by a digest of the key, written before the index entry.

    numba numbers a function's data files in the order its index gains keys. Two processes that
    compile one function for two signatures at once (pytest-xdist workers, the ranks of a
    data-parallel run on one machine) each read the index before the other saved it, take the same
    number, and can leave an index whose entry for one signature names the file holding the
    other's machine code: every later process then runs that code on the wrong argument types,
    with no error (seen: a format loop compiled for one family's scalars run with another's). A
    file per key cannot hold another key's code; an entry lost to the race costs one compile.
    A cache without files (caching disabled) is returned as it is."""
    file = getattr(cache, "_cache_file", None)
    if file is not None and not hasattr(file, "data_name_of"):
        cache._cache_file = _key_named(type(file))(cache_path=file._cache_path,
                                                   filename_base=file._index_name[: -len(".nbi")],
                                                   source_stamp=file._source_stamp)
    return cache


def cached_njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, **options)`` with :func:`key_named_cache`: the decorator every
    optirs cpu kernel that is cached on disk is made by.

    - A parallel kernel releases the GIL while it runs (``nogil``). numba releases it around the
      parallel loops only; without ``nogil`` the kernel's serial parts (a setup, a reduction
      between two parallel loops) hold it, and every other Python thread of the process (autograd's
      hooks in a backward running beside CPUOffload's step, a data loader) waits for them.
    - The options are part of the cache's key. numba keys a cached kernel by its signature, the
      machine and its bytecode only, so a kernel cached before its options changed (the GIL, the
      error model) would otherwise load its old machine code.
    """
    from numba import njit

    if options.get("parallel"):
        options.setdefault("nogil", True)
    decorate = njit(cache=True, **options)
    described = repr(sorted(options.items()))

    def make(fn: Callable[..., Any]) -> Any:
        dispatcher = decorate(fn)
        cache = dispatcher._cache
        index_key = getattr(cache, "_index_key", None)
        if index_key is not None:
            cache._index_key = lambda sig, codegen: (*index_key(sig, codegen), described)
        key_named_cache(cache)
        return dispatcher

    return make


def prepare_kernel_compilation() -> CacheLocation:
    """What a backend calls once before it imports its numba kernels: :func:`ensure_cache_usable`
    (numba picks each kernel's cache directory when it decorates it) and :func:`install_compile_log`.
    Cheap after the first call."""
    location = ensure_cache_usable()
    install_compile_log()
    return location


__all__ = [
    "COMPILE_LOGGER", "COMPILE_LOG_ENV", "CacheLocation", "PassedOver", "CachedModule", "BinaryCache",
    "CompileRecord", "cache_location", "kernel_cache_directory", "ensure_cache_usable", "cached_kernels",
    "opencl_binary_caches", "compile_records", "install_compile_log", "compiling", "prepare_kernel_compilation",
    "source_state", "key_named_cache", "cached_njit",
]
