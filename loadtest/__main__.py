"""`python -m loadtest`: the command line entry point."""

import sys

from loadtest.cli import main

sys.exit(main())
