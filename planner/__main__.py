"""``python -m planner`` is the ``ckplan`` command."""

import sys

from planner.cli import main

sys.exit(main())
