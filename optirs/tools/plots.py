"""Figures drawn from the analysis modules (matplotlib, imported only when a figure is drawn)."""

from __future__ import annotations

from dataclasses import replace

from optirs.analysis.occupancy import KiB, KernelResourceUsage, SmResourceLimits, block_sizes, calculate_occupancy


def occupancy_curves(path: str, limits: SmResourceLimits, usage: KernelResourceUsage, dynamic_smem: int,
                     block_size: int, carveout: int) -> None:
    """Write a PNG of occupancy against block size, registers per thread and shared memory per block.

    :param path: where the PNG goes.
    :param limits: the SM whose occupancy is drawn.
    :param usage: the kernel's resources; each panel varies one of them around this point.
    :param dynamic_smem: dynamic shared memory per block, bytes.
    :param block_size: the block size the register and shared-memory panels use (marked in the first).
    :param carveout: preferred shared-memory carveout in percent, -1 for none.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def occ(u: KernelResourceUsage, b: int, d: int) -> float:
        return calculate_occupancy(limits, u, b, d, carveout=carveout).occupancy * 100

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    blocks = block_sizes(limits, usage)
    axes[0].plot(blocks, [occ(usage, b, dynamic_smem) for b in blocks], marker=".")
    axes[0].axvline(block_size, color="grey", linestyle=":")
    axes[0].set(title=f"vs block size ({usage.registers_per_thread} regs, {usage.static_shared_mem + dynamic_smem} B smem)",
                xlabel="threads per block", ylabel="occupancy (%)")
    regs = list(range(0, limits.max_registers_per_thread + 1))
    axes[1].step(regs, [occ(replace(usage, registers_per_thread=r), block_size, dynamic_smem) for r in regs], where="post")
    axes[1].axvline(usage.registers_per_thread, color="grey", linestyle=":")
    axes[1].set(title=f"vs registers per thread (block {block_size})", xlabel="registers per thread")
    # Shared memory up to the opt-in maximum, as if the kernel opted in.
    optin = replace(usage, max_dynamic_shared_mem=max(0, limits.shared_mem_per_block_optin - usage.static_shared_mem))
    top = max(0, limits.shared_mem_per_block_optin - usage.static_shared_mem)
    step = max(1, top // 512)
    smem = list(range(0, top + 1, step))
    axes[2].step([(usage.static_shared_mem + s) / KiB for s in smem], [occ(optin, block_size, s) for s in smem], where="post")
    axes[2].axvline((usage.static_shared_mem + dynamic_smem) / KiB, color="grey", linestyle=":")
    axes[2].set(title=f"vs shared memory per block (block {block_size})", xlabel="shared memory per block (KiB)")
    for ax in axes:
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    fig.suptitle(f"CUDA occupancy, compute capability {limits.cc} ({limits.architecture})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
