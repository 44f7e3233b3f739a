#!/usr/bin/env python
"""yirage backend manager: ``info``, ``set``, ``test`` and ``benchmark`` (same as ``python -m yirage``)."""

import sys

from yirage.cli import main

if __name__ == "__main__":
    sys.exit(main())
