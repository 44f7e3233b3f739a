#!/usr/bin/env python
"""yirage backend manager under the spec's name: the same tool as tools/backend_manager.py (``python -m yirage``).

``info``, ``set``, ``test``, ``benchmark`` and ``optimize``; see yirage/cli.py.
"""

import sys

from yirage.cli import main

if __name__ == "__main__":
    sys.exit(main())
