"""Built-in backends: ``cpu`` (numba.njit), ``cuda`` (numba.cuda) and ``opencl`` (pyopencl).

Each module exposes ``plugin``, registered under the module's name. Importing a backend module
is cheap: compilers and device libraries load when the backend opens.
"""
