"""``python -m labserver.cli``: the same as the ``labserver`` console script."""

import sys

from . import main

sys.exit(main())
