#!/usr/bin/env python
"""The short name of tools/yirage_backend_manager.py (the project's guides and issues use it): runs that script."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).with_name("yirage_backend_manager.py")), run_name="__main__")
