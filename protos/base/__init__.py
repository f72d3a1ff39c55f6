"""What every process shares besides the wire: the command-line parser, environment variables, log
format, and how a process says it cannot go on.
"""

# Exit codes, every process's (the supervisor reads them): a configuration that cannot work
# (restarting cannot help; the supervisor gives up), a worker that cannot go on (restarted), and a
# refusal for now (restarted after a backoff).
EXIT_CONFIG = 2
EXIT_FAILED = 3
EXIT_RETRY = 75


class ConfigError(Exception):
    """A setting or input that cannot work: said in one
    line, exit EXIT_CONFIG, never a traceback.
    """
