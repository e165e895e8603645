"""GPU-aware analysis that runs on the CPU: occupancy, kernel fusion, quantization-aware training.

Each module is registered as an analysis plugin beside the backends (see ``optirs info``).
Submodules are imported on first use.
"""
