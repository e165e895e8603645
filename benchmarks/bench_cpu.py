"""The CPU benchmark: each optimizer on 16M float32 parameters, the CPU backend beside numpy
and torch's fused CPU optimizers, as fractions of the machine's measured memory bandwidth.

    python benchmarks/bench_cpu.py --json cpu.json

16M = 256M x 0.0625 (``--size-scale``); extra arguments are passed through to ``optirs bench``.
"""

import sys

from optirs.tools.bench import main

DEFAULTS = ["--backends", "cpu", "--cases", "flat", "--size-scale", "0.0625", "--reps", "5", "--repeats", "9"]

if __name__ == "__main__":
    sys.exit(main(DEFAULTS + sys.argv[1:]))
