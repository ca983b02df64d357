#!/usr/bin/env python3
"""ROK curve tool; the same as ``python -m tba rok`` (see ``tba/cli/rok.py``). Run with --help."""

import sys

from tba.cli.rok import main

if __name__ == "__main__":
    sys.exit(main())
