"""``python -m nvmeio.tune``: the nvme_tune command."""

import sys

from ._cli import main

sys.exit(main())
