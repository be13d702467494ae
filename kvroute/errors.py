"""The error every layer raises for bad user input (a flag, a file, a spec): the command line prints it as one
line, `kvroute COMMAND: error: MESSAGE`, with exit status 2 and no traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad user input: printed as one line, no traceback."""
