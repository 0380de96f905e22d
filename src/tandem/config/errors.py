"""The one exception type for user mistakes in configs: printed without a traceback, exit code 2."""


class ConfigError(ValueError):
    """A config the user wrote is wrong; the message says what, where, and how to fix it."""

    exit_code = 2
