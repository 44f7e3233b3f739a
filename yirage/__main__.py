"""``python -m yirage info``: the backend manager."""

import sys

from yirage.cli import main

sys.exit(main())
