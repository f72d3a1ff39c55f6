"""pagedserve-loadtest: see deploy/loadtest/cli.py and docs/ARCHITECTURE.md."""

from deploy.loadtest.cli import main

__all__ = ["main"]
