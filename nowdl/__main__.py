"""python -m nowdl: the command line."""

import sys

from nowdl.cli.commands import main

sys.exit(main())
