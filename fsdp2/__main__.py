"""``python -m fsdp2``: the ``fsdp2`` command (fsdp2/cli/__init__.py)."""

import sys

from fsdp2.cli import main

sys.exit(main())
