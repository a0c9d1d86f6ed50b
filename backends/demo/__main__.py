"""``python -m lmcache_histate.backends.demo``: the demo (``make demo``)."""

import sys

from .main import main

sys.exit(main())
