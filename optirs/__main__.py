"""``python -m optirs``: the ``optirs`` command (``optirs --version``, ``optirs info``, ...)."""

import sys

from optirs.tools.cli import main

sys.exit(main())
