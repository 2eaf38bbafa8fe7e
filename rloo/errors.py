"""The errors a person can fix by changing the input: the CLI prints them as one line and exits 2.

Everything else (a bug) keeps its traceback. The message says what is wrong, where (file:line or the
config key) and how to fix it.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a config value, a data file, a missing or corrupt upstream output."""


class InputError(UserError, ValueError):
    """A value or a file that cannot be used as it is."""


class MissingInputError(UserError, FileNotFoundError):
    """An input a stage needs is not there (usually: an earlier stage has not run)."""


class UnavailableError(UserError, RuntimeError):
    """Something the config asks for is not there on this machine (a GPU, an optional package)."""
