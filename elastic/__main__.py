"""`python -m elastic ...`: the `elastic` command (elastic/cli.py)."""
import sys

from elastic.cli import main

sys.exit(main())
