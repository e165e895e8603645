"""``optirs occupancy``: the SM limits and the occupancy of every block size, as tables (and curves).

The numbers come from :mod:`optirs.analysis.occupancy`; this module only parses and prints.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Optional, Sequence

from optirs.analysis.occupancy import (CARVEOUT_DEFAULT, KNOWN_COMPUTE_CAPABILITIES, UNLIMITED, KernelResourceUsage,
                                       KiB, OccupancyLimiter, SmResourceLimits, block_sizes, calculate_occupancy,
                                       optimal_block_size)
from optirs.core.errors import BackendUnavailableError, InvalidParameterError


def _parse_size(text: str) -> int:
    """Bytes from '4096', '48K', '48KiB', '1.5K'."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = 1
    if t.endswith("k"):
        scale, t = KiB, t[:-1]
    elif t.endswith("m"):
        scale, t = KiB * KiB, t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 4096, 48K)") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole, non-negative number of bytes")
    return int(value)


_SHORT = {"warps": "warps", "registers": "regs", "shared_memory": "smem", "blocks": "blocks", "barriers": "bars"}


def _short(limiter: OccupancyLimiter) -> str:
    return "+".join(_SHORT[n] for n in limiter.names())


def _fmt_limit(n: int) -> str:
    return "-" if n == UNLIMITED else str(n)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``optirs occupancy``: the SM limits and the occupancy of every block size for a kernel's resources."""
    parser = argparse.ArgumentParser(prog="optirs occupancy",
                                     description="CUDA occupancy: SM limits, occupancy per block size, optimal block size")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--cc", help="compute capability, e.g. 9.0 (known: "
                       + ", ".join(f"{a}.{b}" for a, b in KNOWN_COMPUTE_CAPABILITIES) + "); default 9.0")
    where.add_argument("--device", action="store_true", help="use the live CUDA device (numba.cuda)")
    parser.add_argument("--sm-count", type=int, help="SMs of the product (for the minimum grid size)")
    parser.add_argument("--block-size", type=int, help="the block size to detail (default: the optimal one)")
    parser.add_argument("--registers", type=int, default=32, help="registers per thread (default 32)")
    parser.add_argument("--smem", type=_parse_size, default=0, help="static shared memory per block, bytes or 48K")
    parser.add_argument("--dynamic-smem", type=_parse_size, default=0, help="dynamic shared memory per block")
    parser.add_argument("--max-dynamic-smem", type=_parse_size,
                        help="the kernel's dynamic shared memory maximum (opt-in); default: the driver's default")
    parser.add_argument("--carveout", type=int, default=CARVEOUT_DEFAULT,
                        help="preferred shared-memory carveout in percent, -1 for none (default)")
    parser.add_argument("--plot", metavar="PNG", help="write occupancy vs block size, registers and shared memory")
    args = parser.parse_args(None if argv is None else list(argv))

    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        if args.device:
            limits = SmResourceLimits.from_device()
        else:
            limits = SmResourceLimits.for_compute_capability(args.cc or "9.0", sm_count=args.sm_count)
        if args.sm_count is not None:
            limits = replace(limits, sm_count=args.sm_count)
        usage = KernelResourceUsage(registers_per_thread=args.registers, static_shared_mem=args.smem,
                                    max_dynamic_shared_mem=args.max_dynamic_smem)
        best = optimal_block_size(limits, usage, args.dynamic_smem, carveout=args.carveout)
        runtime_best = optimal_block_size(limits, usage, args.dynamic_smem, carveout=args.carveout, api="runtime")
        detail_block = args.block_size or best.block_size or limits.warp_size
        detail = calculate_occupancy(limits, usage, detail_block, args.dynamic_smem, carveout=args.carveout)
        rows = [calculate_occupancy(limits, usage, b, args.dynamic_smem, carveout=args.carveout)
                for b in block_sizes(limits, usage)]
    except (InvalidParameterError, BackendUnavailableError) as exc:
        console.print(f"[red]optirs occupancy:[/] {exc}")
        return 2

    table = Table(title=f"SM limits, compute capability {limits.cc}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for name, value in limits.as_rows():
        table.add_row(name, value)
    console.print(table)

    title = (f"Occupancy: {usage.registers_per_thread} registers/thread, {usage.static_shared_mem} B static + "
             f"{args.dynamic_smem} B dynamic shared memory, carveout {args.carveout}")
    occ = Table(title=title)
    # The per-SM block limit is in the limits table; the rest fits 80 columns.
    for col in ("block", "by\nwarps", "by\nregs", "by\nsmem", "blocks\n/SM", "warps\n/SM", "occu-\npancy", "limit"):
        occ.add_column(col, justify="left" if col == "limit" else "right", no_wrap=True)
    for r in rows:
        style = "bold green" if r.block_size == best.block_size else ("bold" if r.block_size == detail_block else None)
        occ.add_row(str(r.block_size), _fmt_limit(r.block_limits["warps"]), _fmt_limit(r.block_limits["registers"]),
                    _fmt_limit(r.block_limits["shared_memory"]), str(r.active_blocks_per_sm),
                    str(r.active_warps_per_sm), f"{r.occupancy:.1%}", _short(r.limiter), style=style)
    console.print(occ)
    if best.block_size:
        grid = f", minimum grid {best.min_grid_size}" if best.min_grid_size is not None else ""
        console.print(f"optimal block size (cuOccupancyMaxPotentialBlockSize): [green]{best.block_size}[/] "
                      f"-> {best.blocks_per_sm} blocks/SM, occupancy {best.occupancy:.1%}{grid}")
        if runtime_best != best:
            # The driver's search drops a carveout preference other than 0; the table above keeps it.
            console.print(f"  the driver's query ignores carveout {args.carveout} (its blocks/SM are those without a "
                          f"preference); counting the carveout for every block size (cudaOccupancyMaxPotentialBlockSize): "
                          f"{runtime_best.block_size} -> {runtime_best.blocks_per_sm} blocks/SM, "
                          f"occupancy {runtime_best.occupancy:.1%}")
    else:
        console.print("[red]no block size can run[/]")
    console.print(f"block size {detail.block_size}: {detail.active_blocks_per_sm} blocks/SM, {detail.active_warps_per_sm} "
                  f"warps, occupancy {detail.occupancy:.1%}, limited by {detail.limiter}; registers/block "
                  f"{detail.allocated_registers_per_block}, shared memory/block {detail.allocated_shared_mem_per_block} B "
                  f"of a {detail.shared_mem_per_sm} B carveout"
                  + (f"\n[red]cannot run:[/] {detail.reason}" if detail.reason else ""))
    if args.plot:
        from optirs.tools.plots import occupancy_curves

        occupancy_curves(args.plot, limits, usage, args.dynamic_smem, detail_block, args.carveout)
        console.print(f"wrote {args.plot}")
    return 0
