"""``python -m attention`` and the ``abft`` console script: see :mod:`attention.cli`."""
from __future__ import annotations

import sys

from attention.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
