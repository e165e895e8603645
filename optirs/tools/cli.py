"""The ``optirs`` command: ``info`` here; other subcommands live beside the code they drive.

Each subcommand is ``module:function`` taking ``argv`` and returning an exit code, imported only
when that subcommand runs, so ``optirs info`` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Dict, List, Optional, Tuple

SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "info": ("optirs.tools.cli:info_main", "list backends, devices, status, capability matrix and plugins"),
    "bench": ("optirs.tools.bench:main", "time every optimizer on every backend beside torch"),
    "occupancy": ("optirs.tools.occupancy_cli:main", "CUDA occupancy table and curves"),
    "warmup": ("optirs.tools.warmup:main", "compile (or load from the cache) the kernels of some optimizers and formats"),
}


def table_box(console):
    """The box a table is drawn with: rich's heavy head in a terminal, plain ASCII (``+-|``) in a
    pipe or a log, where a reader's font, ``grep`` or an e-mail may not have box-drawing glyphs."""
    from rich import box

    return box.HEAVY_HEAD if console.is_terminal else box.ASCII2


def plain_console():
    """A console for a command's output: the terminal's width in one, 80 columns in a pipe."""
    import os

    from rich.console import Console

    columns = os.environ.get("COLUMNS", "")
    return Console(width=None if sys.stdout.isatty() else int(columns) if columns.isdigit() else 80)


def _fmt_bytes(n: Optional[int]) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def info_main(argv: List[str]) -> int:
    import optirs
    from optirs.plugin.hookspecs import CAPABILITIES, OPTIMIZER_NAMES, STEP_CAPABILITIES
    from optirs.plugin.registry import REGISTRY

    parser = argparse.ArgumentParser(prog="optirs info", description=SUBCOMMANDS["info"][1])
    parser.parse_args(argv)
    from rich.table import Table

    console = plain_console()
    console.print(f"optirs {optirs.__version__}; probe order for backend='auto': {', '.join(optirs.SUPPORTED_BACKENDS)}")
    backends = optirs.list_backends()
    # Long words (device names, paths, versions) fold instead of ending in "...": a pipe has 80 columns.
    table = Table(title="Backends", box=table_box(console))
    for col in ("backend", "status", "devices"):
        table.add_column(col, overflow="fold")
    for b in backends:
        status = "[green]available[/]" if b.available else f"[red]unavailable[/]: {b.reason}"
        devices = "\n".join(
            f"{d.name} ({d.kind}; {d.compute_units or '-'} units; {_fmt_bytes(d.memory_bytes)})"
            + "".join(f"; {k}={v}" for k, v in d.details.items())
            for d in b.devices
        ) or "-"
        table.add_row(b.name, status, devices)
    console.print(table)
    from optirs.plugin.registry import choose_auto

    console.print(str(choose_auto()), markup=False, highlight=False)
    console.print(_capability_matrix(backends, REGISTRY, OPTIMIZER_NAMES, tuple(CAPABILITIES), STEP_CAPABILITIES,
                                     table_box(console)))
    plugins = Table(title="Plugins", box=table_box(console))
    for col in ("plugin", "kind", "source", "summary / error"):
        plugins.add_column(col, overflow="fold")
    for p in optirs.list_plugins():
        plugins.add_row(p.name, p.kind, p.source, p.error or p.summary)
    console.print(plugins)
    _compile_cache_report(console)
    return 0


def _compile_cache_report(console) -> None:
    """Where numba caches optirs's kernels and what is there, and the OpenCL program caches: read
    from the directories only (nothing is compiled)."""
    import datetime

    from rich.table import Table

    from optirs.core.compile_cache import cache_location, cached_kernels, opencl_binary_caches

    location = cache_location()
    modules = cached_kernels()
    table = Table(title="Compiled kernel cache (numba; `optirs warmup` fills it)", box=table_box(console),
                  caption="entries: compiled signatures; functions: cached functions (stale files included)")
    for col, justify in (("module", "left"), ("entries", "right"), ("functions", "right"), ("size", "right"),
                         ("newest", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for m in modules:
        newest = datetime.datetime.fromtimestamp(m.newest).strftime("%Y-%m-%d %H:%M") if m.newest else "-"
        table.add_row(m.module.removeprefix("optirs.").removeprefix("backends."), str(m.entries), str(m.functions),
                      _fmt_bytes(m.bytes), newest)
    if modules:
        table.add_section()
        table.add_row("all", str(sum(m.entries for m in modules)), str(sum(m.functions for m in modules)),
                      _fmt_bytes(sum(m.bytes for m in modules)), "")
    else:
        table.add_row("nothing cached yet: each kernel compiles on its first step", "-", "-", "-", "-")
    console.print(table)
    lines = [f"numba caches optirs's kernels in {location.where}: {location.reason}"]
    lines += [f"  passed over {p.directory}: it {p.why}" for p in location.passed_over]
    lines += [f"{c.name} cache: {c.directory}: {c.files} files, {_fmt_bytes(c.bytes)} ({c.note})"
              for c in opencl_binary_caches()]
    for line in lines:
        console.print(line, markup=False, highlight=False)


def _capability_matrix(backends, registry, optimizers, capabilities, step_capabilities, style=None):
    """One column per backend (there are few; optimizers and capabilities are many): per optimizer
    what its optirs_step runs (optirs_step_support), then every capability the backend offers."""
    from rich.table import Table

    matrix = Table(title="Capability matrix (optirs_step_support and the hooks each backend implements)",
                   **({"box": style} if style is not None else {}),
                   caption_justify="left",
                   caption="float32: the optimizer steps; formats: also in step formats (16-bit parameters, "
                           "compact state); capturable: also with device-side scalars (CUDA graphs)")
    matrix.add_column("optimizer / capability", overflow="fold")
    for b in backends:
        matrix.add_column(b.name, justify="center", overflow="fold")
    supports = [registry.step_support(b.name) for b in backends]
    for opt in optimizers:
        cells = []
        for s in supports:
            kinds = [k for k, listed in (("float32", s.optimizers), ("formats", s.formats),
                                         ("capturable", s.capturable)) if opt in listed]
            cells.append(", ".join(kinds) or "-")
        matrix.add_row(opt, *cells)
    matrix.add_section()
    for cap in capabilities + tuple(c for c in step_capabilities if c not in capabilities):
        matrix.add_row(cap, *["yes" if cap in b.capabilities else "-" for b in backends])
    return matrix


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from optirs import __version__

        print(f"optirs {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: optirs [--version] {" + ",".join(SUBCOMMANDS) + "} [options]\n")
        for name, (_, help_text) in SUBCOMMANDS.items():
            print(f"  {name:<10} {help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"optirs: unknown command {name!r}; known commands: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module, func = SUBCOMMANDS[name][0].split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
