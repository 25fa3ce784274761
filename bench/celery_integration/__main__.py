"""``python -m bench.celery_integration``: see README.md beside this file."""

from __future__ import annotations

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
