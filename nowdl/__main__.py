"""python -m nowdl: the command line."""

import sys

from nowdl.cli import main

sys.exit(main())
