"""ddbench: benchmarking and profiling toolkit for a Kimi K2.6 DDTree speculative engine."""

__version__ = "0.1.0"


class UserError(Exception):
    """Bad input from the user: the CLI prints it on one line and exits with code 2."""
