"""``python -m bench.reliability``: the report (report.py)."""
import sys

from bench.reliability.report import main

sys.exit(main())
