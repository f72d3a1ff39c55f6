"""What every process shares that is not the wire: the command-line parser (argtypes.py), the
environment variables it reads (env.py), the log format (logs.py), and how a process says it cannot
go on.
"""

# Exit codes, every process's (the supervisor reads them): a configuration that cannot work
# (restarting cannot help; the supervisor gives up), a worker that cannot go on (restarted), and a
# refusal for now (restarted after a backoff).
EXIT_CONFIG = 2
EXIT_FAILED = 3
EXIT_RETRY = 75


class ConfigError(Exception):
    """A setting or input that cannot work (a model path with no model, a port in use): the command
    says it in one line and exits with EXIT_CONFIG, never with a traceback.
    """
