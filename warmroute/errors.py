"""Errors a user can cause and fix: shown as one line, never as a traceback."""


class UsageError(Exception):
    """Bad command-line input or configuration: printed as one line, exit status 2."""
