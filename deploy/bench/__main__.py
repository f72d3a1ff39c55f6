"""`python -m deploy.bench`: the throughput benchmark (throughput.py)."""

import sys

from deploy.bench.throughput import main

sys.exit(main())
