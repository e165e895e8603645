"""Code every built-in backend shares: the per-element math for numba (CPU and CUDA) and the
OpenCL C sources with their one include builder."""
