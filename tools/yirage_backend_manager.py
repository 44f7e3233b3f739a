#!/usr/bin/env python
"""yirage backend manager: ``info``, ``set``, ``test``, ``benchmark``, ``optimize``, ``dump``, ``compare``.

The command line lives in yirage/cli.py (also ``python -m yirage``); this file is the script name the spec
promises users (``python tools/yirage_backend_manager.py info``), so it only runs that entry point.
"""

import sys

from yirage.cli import main

if __name__ == "__main__":
    sys.exit(main())
