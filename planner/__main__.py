"""``python -m planner`` is the ``ckplan`` command."""

import sys

from planner.report.cli import main

sys.exit(main())
