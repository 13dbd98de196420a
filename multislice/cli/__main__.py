"""``python -m multislice.cli``: the ``multislice`` command."""

import sys

from multislice.cli import main

sys.exit(main())
