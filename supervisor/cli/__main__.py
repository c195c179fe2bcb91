"""`python -m supervisor.cli`: the console script's `kimi-serve`."""

import sys

from supervisor.cli import main

sys.exit(main())
