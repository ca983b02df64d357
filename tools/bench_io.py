"""Run tba's I/O benchmark from a checkout: ``python tools/bench_io.py --size 512M``.

Same as ``python -m tba bench-io``; see :mod:`tba.cli.bench_io` for what it measures.
"""

import sys

from tba.cli.bench_io import main

if __name__ == "__main__":
    sys.exit(main())
