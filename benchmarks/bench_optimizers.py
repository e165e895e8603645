"""The full benchmark: every optimizer on every available backend beside torch.optim.

    python benchmarks/bench_optimizers.py --json results.json --plot results.png

Same as ``optirs bench``; extra arguments are passed through (``--backends cuda``, ``--cases flat``, ...).
"""

import sys

from optirs.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
