"""The compiled-kernel cache's user side (optirs/core/compile_cache.py, docs/compile_cache.md): where
numba caches, the warning when it cannot cache where asked, what is cached, the compile log,
``optirs warmup`` and ``optirs info``'s section.

numba reads NUMBA_CACHE_DIR when it starts, so each case runs in a subprocess with its own
environment; one cold and one warm ``optirs warmup`` of the smallest kernel (SGD, float32) serve
every assertion about real kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from optirs.tools import cli, warmup

ROOT = Path(__file__).resolve().parent.parent


def _run(args, env_extra=None, drop=("NUMBA_CACHE_DIR", "OPTIRS_COMPILE_LOG", "NUMBA_CACHE_LOCATOR_CLASSES")):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="200", **(env_extra or {}))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _python(code, env_extra=None):
    out = _run(["-W", "always", "-c", textwrap.dedent(code)], env_extra)
    assert out.returncode == 0, out.stderr
    return out


def _module(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text("from numba import njit\n\n\n@njit(cache=True)\ndef plus_one(x):\n    return x + 1\n")
    return path


def test_processes_compiling_one_kernel_at_once_never_swap_its_signatures(tmp_path, monkeypatch):
    """Three dispatchers of one cached function stand for three processes. The first two compile
    it at once for two signatures, each having read the index before the other saved it, the
    first writing its machine code last: with numba's numbered files the index then names, for
    the second signature, a file holding the first's code (the third process computed 3.0 for
    2 * 1.5 + 1). Each key's own file: the third loads the second signature's code and compiles
    the first anew, both right."""
    from optirs.core.compile_cache import cached_njit

    path = tmp_path / "race_kernels.py"
    path.write_text("def twice_plus_one(x):\n    return x * 2 + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import race_kernels

    first, second, third = (cached_njit()(race_kernels.twice_plus_one) for _ in range(3))
    files = [d._cache._cache_file for d in (first, second, third)]
    assert len({f._index_path for f in files}) == 1
    late = []  # the first process's data write, held until the second has saved
    monkeypatch.setattr(files[0], "_save_data", lambda name, data: late.append((name, data)))
    monkeypatch.setattr(files[1], "_load_index", lambda: {})  # read before the first saved its entry
    assert first(3) == 7 and len(late) == 1
    assert second(1.5) == 4.0
    type(files[0])._save_data(files[0], *late[0])
    assert third(1.5) == 4.0 and third.stats.cache_hits[third.signatures[0]] == 1
    assert third(3) == 7 and len(third.signatures) == 2
    assert race_kernels.twice_plus_one(3) == 7


def test_a_kernel_cached_with_other_options_is_compiled_anew(tmp_path, monkeypatch):
    """numba keys a cached kernel by signature, machine and bytecode: a kernel cached under one
    error model would be loaded for another. cached_njit keys the options too."""
    from optirs.core.compile_cache import cached_njit

    path = tmp_path / "option_kernels.py"
    path.write_text("def inverse(x):\n    return 1.0 / x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import option_kernels

    quiet = cached_njit(error_model="numpy")(option_kernels.inverse)
    assert quiet(0.0) == float("inf")
    strict = cached_njit()(option_kernels.inverse)
    with pytest.raises(ZeroDivisionError):
        strict(0.0)
    assert strict.stats.cache_hits.get(strict.signatures[0], 0) == 0
    again = cached_njit(error_model="numpy")(option_kernels.inverse)
    assert again(0.0) == float("inf") and again.stats.cache_hits[again.signatures[0]] == 1


def test_a_parallel_kernel_lets_other_python_threads_run(tmp_path, monkeypatch):
    """A parallel kernel releases the GIL while it runs, its serial loops too (numba releases it
    around the parallel loops alone). With the interpreter never asked to switch threads, a thread
    that held the GIL through the kernel would leave the main thread no turn until the kernel
    returned: the main thread counts its turns while the kernel runs (half a second or so)."""
    import threading
    import time

    import numpy as np

    from optirs.core.compile_cache import cached_njit

    path = tmp_path / "gil_kernels.py"
    path.write_text("import numpy as np\nfrom numba import prange\n\n\ndef serial_then_parallel(a, n):\n"
                    "    s = 0.0\n    for r in range(n):\n        for i in range(a.size):\n"
                    "            s += np.sqrt(a[i] + r)\n    for i in prange(a.size):\n        a[i] += s\n"
                    "    return s\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gil_kernels

    kernel = cached_njit(parallel=True)(gil_kernels.serial_then_parallel)
    data = np.zeros(1 << 20)
    kernel(data[:8], 1)  # compiled here, not in the thread
    started, finished, turns, took = threading.Event(), threading.Event(), [], []

    def run() -> None:
        started.set()
        t0 = time.perf_counter()
        kernel(data, 200)
        took.append(time.perf_counter() - t0)
        finished.set()

    before = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        worker = threading.Thread(target=run)
        worker.start()
        started.wait()
        while not finished.is_set():
            turns.append(1)
            time.sleep(0.001)  # gives the GIL back, so that the worker can return from the kernel
        worker.join()
    finally:
        sys.setswitchinterval(before)
    # a turn is a millisecond's sleep and a little more: held through the kernel, the main thread
    # gets a few turns before and after it; free, about one a millisecond of it
    assert len(turns) > 1e3 * took[0] / 10, (len(turns), took)


def test_every_kernel_cached_on_disk_is_made_by_cached_njit():
    """A kernel made by ``njit(cache=True)`` itself would keep numba's numbered data files (the
    race above): the package's sources ask for the disk cache only through cached_njit."""
    package = ROOT / "optirs"
    direct = [f"{path.relative_to(ROOT)}:{k}" for path in sorted(package.rglob("*.py"))
              for k, line in enumerate(path.read_text().splitlines(), 1)
              if "cache=True" in line and "``" not in line and path.name != "compile_cache.py"]
    assert direct == []


def test_cache_location_is_where_numba_caches(tmp_path):
    """Against numba itself: a cached function of a module written here, and optirs's own element math."""
    cache = tmp_path / "cache"
    module = _module(tmp_path / "mods", "probe_kernels")
    out = _python(f"""
        import json, sys
        sys.path.insert(0, {str(module.parent)!r})
        import probe_kernels
        from optirs.backends.common import elementwise
        from optirs.core import compile_cache as cc
        assert probe_kernels.plus_one(1) == 2
        print(json.dumps(dict(cc.cache_location()._asdict(), numba=probe_kernels.plus_one.stats.cache_path,
                              ours=cc.kernel_cache_directory(probe_kernels.__file__),
                              optirs=elementwise.adam_update.stats.cache_path)))
    """, {"NUMBA_CACHE_DIR": str(cache)})
    got = json.loads(out.stdout)
    assert got["kind"] == "NUMBA_CACHE_DIR" and got["directory"] == str(cache) and got["passed_over"] == []
    assert got["ours"] == got["numba"] and Path(got["numba"]).parent == cache
    assert any(name.startswith("probe_kernels.plus_one") for name in os.listdir(got["numba"]))
    assert got["kernels_directory"] == got["optirs"]


def test_an_unusable_numba_cache_dir_warns_once_and_names_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    asked = blocker / "cache"  # under a regular file: no one can create it, root included
    out = _python("""
        from optirs.core import compile_cache as cc
        first = cc.ensure_cache_usable()
        assert cc.ensure_cache_usable() is first
        print(first.kind)
    """, {"NUMBA_CACHE_DIR": str(asked)})
    warnings = [line for line in out.stderr.splitlines() if "CompileCacheWarning" in line]
    assert len(warnings) == 1, out.stderr
    assert f"NUMBA_CACHE_DIR={asked} cannot be created" in warnings[0]
    kind = out.stdout.strip()
    assert kind in ("in-tree", "user-wide") and "instead" in warnings[0] and kind in warnings[0]


def test_no_usable_directory_turns_caching_off_instead_of_failing(tmp_path):
    """numba raises at a cached kernel's decoration when no directory is usable; ensure_cache_usable
    gives it a temporary one and says that every run compiles. Probed on a module whose in-tree
    __pycache__ is a file, with NUMBA_CACHE_DIR and the user-wide cache under a file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    module = _module(tmp_path / "pkg", "blocked_kernels")
    (module.parent / "__pycache__").write_text("")
    out = _python(f"""
        import sys
        from pathlib import Path
        from optirs.core import compile_cache as cc
        cc._PROBE_SOURCE = Path({str(module)!r})  # the kernels' file stands in for optirs's
        location = cc.ensure_cache_usable()
        sys.path.insert(0, {str(module.parent)!r})
        import blocked_kernels
        assert blocked_kernels.plus_one(1) == 2
        print(location.kind, location.persistent, len(location.passed_over))
    """, {"NUMBA_CACHE_DIR": str(blocker / "cache"), "XDG_CACHE_HOME": str(blocker), "PYTHONDONTWRITEBYTECODE": "1"})
    assert out.stdout.split() == ["temporary", "False", "3"]
    warnings = [line for line in out.stderr.splitlines() if "CompileCacheWarning" in line]
    assert len(warnings) == 1 and "caching is off and every run compiles" in warnings[0], out.stderr


def test_the_compile_log_reports_the_outermost_optirs_compile_and_can_be_silenced():
    out = _python("""
        import os
        from numba import njit
        from optirs.core import compile_cache as cc
        cc.install_compile_log()
        cc.install_compile_log()  # idempotent: one listener, one line per compile

        def inner(x):
            return x + 1

        def outer(x):
            return jitted_inner(x) * 2

        def quiet(x):
            return x - 1

        for f in (inner, outer, quiet):
            f.__module__ = "optirs.backends.cpu.fake_kernels"
        jitted_inner, jitted_outer, jitted_quiet = njit(inner), njit(outer), njit(quiet)
        assert jitted_outer(1) == 4  # compiles inner inside outer: one report
        with cc.compiling("opencl.fake_program", "/somewhere"):  # a build numba's event does not see
            pass
        os.environ["OPTIRS_COMPILE_LOG"] = "0"
        assert jitted_quiet(1) == 0
        print([r.name for r in cc.compile_records()])
    """)
    assert out.stdout.strip() == "['cpu.fake_kernels.outer', 'opencl.fake_program', 'cpu.fake_kernels.quiet']"
    lines = [line for line in out.stderr.splitlines() if line.startswith("optirs:")]
    assert len(lines) == 4, out.stderr
    assert lines[0] == ("optirs: compiling cpu.fake_kernels.outer for this machine "
                        "(first use; it is not cached on disk: every run compiles it)")
    assert lines[1].startswith("optirs: compiled cpu.fake_kernels.outer in ")
    assert lines[2] == ("optirs: compiling opencl.fake_program for this machine "
                        "(first use; later runs load it from /somewhere)")
    assert lines[3].startswith("optirs: compiled opencl.fake_program in ")


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory):
    """One cold and one warm ``optirs warmup`` of SGD in float32 on cpu, and what is cached after."""
    cache = tmp_path_factory.mktemp("numba-cache")
    env = {"NUMBA_CACHE_DIR": str(cache)}
    command = ["-m", "optirs.tools.cli", "warmup", "--backend", "cpu", "--optimizer", "sgd", "--format", "float32"]
    runs = [_run(command, env) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    listing = _python("""
        import json
        from optirs.core.compile_cache import cached_kernels
        print(json.dumps([m._asdict() for m in cached_kernels()]))
    """, env)
    return cache, runs, json.loads(listing.stdout)


def test_a_cold_run_logs_its_compiles_and_a_warm_run_loads_them(cold_and_warm):
    cache, (cold, warm), _ = cold_and_warm
    started = [line for line in cold.stderr.splitlines() if line.startswith("optirs: compiling cpu.kernels.pointwise")]
    assert len(started) == 1, cold.stderr
    assert f"(first use; later runs load it from {cache}{os.sep}cpu_" in started[0]
    assert any(line.startswith("optirs: compiled cpu.kernels.pointwise in ") for line in cold.stderr.splitlines())
    assert "optirs: compiling" not in warm.stderr, warm.stderr
    assert "sgd float32" in cold.stdout and "compiled" in cold.stdout.split("sgd float32")[1].splitlines()[0]
    assert "loaded from cache" in warm.stdout.split("sgd float32")[1].splitlines()[0]


def test_cached_kernels_counts_the_files_a_cold_run_wrote(cold_and_warm):
    cache, _, modules = cold_and_warm
    kernels = {m["module"]: m for m in modules}["optirs.backends.cpu.kernels"]
    directory = Path(kernels["directory"])
    assert directory.parent == cache
    files = [f for f in os.listdir(directory) if f.startswith("kernels.")]
    assert kernels["entries"] == sum(f.endswith(".nbc") for f in files) >= 1
    assert kernels["functions"] == sum(f.endswith(".nbi") for f in files) >= 1
    assert kernels["bytes"] == sum((directory / f).stat().st_size for f in files)


def test_info_shows_the_cache_section(cold_and_warm):
    cache, _, _ = cold_and_warm
    out = _run(["-m", "optirs.tools.cli", "info"], {"NUMBA_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr
    assert "Compiled kernel cache" in out.stdout
    # piped: ASCII tables and lines folded at 80 columns (docs/cli.md)
    assert f"numba caches optirs's kernels in {cache}: NUMBA_CACHE_DIR is set" in " ".join(out.stdout.split())
    rows = [line.replace("│", "|") for line in out.stdout.splitlines()]
    assert any(line.split("|")[1].strip() == "cpu.kernels" for line in rows if line.count("|") > 2)


@pytest.mark.parametrize("args,message", [
    (["--backend", "nope"], "unknown backend 'nope'; known backends: "),
    (["--backend", "cpu", "--optimizer", "adamx"], "unknown optimizer 'adamx'; known optimizers: "),
    (["--backend", "cpu", "--format", "bf17"], "unknown format 'bf17'; known formats: float32, "),
    (["--backend", "cpu", "--optimizer", "adafactor", "--format", "bf16-masters"],
     "steps adafactor in float32 only, not in bf16-masters"),
])
def test_warmup_refuses_bad_arguments_before_compiling(args, message, capsys):
    assert cli.main(["warmup", *args]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")


def test_warmup_refuses_a_backend_that_does_not_open(capsys):
    from optirs.plugin.registry import REGISTRY

    closed = [n for n in ("cuda", "opencl") if n in REGISTRY.backend_names() and not REGISTRY.probe(n).available]
    if not closed:
        pytest.skip("every built-in backend opens here")
    assert warmup.main(["--backend", closed[0]]) == 2
    assert f"backend {closed[0]!r} is unavailable here: " in capsys.readouterr().err.replace("\n", "")


def test_warmup_formats_cover_every_combination_once():
    """Every parameter format with every state dtype, each a valid Precision."""
    from optirs import Precision

    assert len(warmup.FORMATS) == len(warmup.PARAM_FORMATS) * len(warmup.STATE_FORMATS)
    for spec in warmup.FORMATS.values():
        Precision(**spec.precision)
    assert warmup.FORMATS["bf16-masters+int8-state"].precision == {"master_weights": "float32", "state_dtype": "int8"}
    assert warmup.FORMATS["int8-state"].param_dtype == "float32"


def test_an_opencl_build_slow_enough_to_have_compiled_is_in_the_compile_log(monkeypatch):
    """The OpenCL driver's cache says nothing of a hit: a build over SLOW_BUILD_S is recorded as
    compiled, a faster one (a cache hit) is not."""
    cl = pytest.importorskip("pyopencl")
    from optirs.backends.opencl.context import build_program
    from optirs.core import compile_cache as cc

    try:
        device = next(d for p in cl.get_platforms() for d in p.get_devices())
    except (cl.Error, StopIteration):
        pytest.skip("no OpenCL device")
    context = cl.Context([device])
    source = "__kernel void twice(__global float *x) { x[get_global_id(0)] *= 2.0f; }"
    before = len(cc.compile_records())
    monkeypatch.setattr(cc, "SLOW_BUILD_S", 1e9)
    assert build_program(context, device, source, [], "fast").twice is not None
    assert len(cc.compile_records()) == before
    monkeypatch.setattr(cc, "SLOW_BUILD_S", 0.0)
    build_program(context, device, source, [], "slow")
    records = cc.compile_records()[before:]
    assert [(r.name, r.failed, r.cache_directory) for r in records] == [("opencl.slow", False, None)]
