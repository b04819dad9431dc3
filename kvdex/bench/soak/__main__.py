"""``python -m kvdex.bench.soak``: the same command as ``kvdex soak``."""

import sys

from kvdex.bench.soak.cli import main

sys.exit(main())
