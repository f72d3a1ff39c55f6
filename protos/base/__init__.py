"""What every process shares besides the wire: the command-line parser, environment variables, log
format, and how a process says it cannot go on.
"""

# Exit codes the supervisor reads: a configuration that cannot work (it gives up), a worker that
# cannot go on (restarted), a model that failed to load (restarted a few times, then given up), a
# refusal for now (restarted after a backoff).
EXIT_CONFIG = 2
EXIT_FAILED = 3
EXIT_LOAD = 4
EXIT_RETRY = 75


class ConfigError(Exception):
    """A setting that cannot work: one line and EXIT_CONFIG, never a traceback."""
