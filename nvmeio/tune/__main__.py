"""``python -m nvmeio.tune``: the nvme_tune command."""

import sys

from .cli import main

sys.exit(main())
