"""`python -m hybrid_transfer` runs the CLI from a source tree (how GPU hosts run it)."""

import sys

from hybrid_transfer.cli import main

sys.exit(main())
