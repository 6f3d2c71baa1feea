"""``python -m attention``: the ``abft`` command line (:mod:`attention.experiments.cli`)."""
from __future__ import annotations

import sys

from attention.experiments.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
