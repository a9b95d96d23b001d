"""The error every command raises for a mistake of the user's: ``main`` prints it on one line and exits with 2."""

from __future__ import annotations

__all__ = ["EXIT_USAGE", "CLIError"]

#: Exit status of a command given something it cannot use (argparse uses the same for a bad option).
EXIT_USAGE = 2


class CLIError(Exception):
    """A problem with what the user gave (a name, a path, a budget): reported as one line, no traceback."""
