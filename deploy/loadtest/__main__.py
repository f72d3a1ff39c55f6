"""python -m deploy.loadtest"""

import sys

from deploy.loadtest.cli import main

sys.exit(main())
