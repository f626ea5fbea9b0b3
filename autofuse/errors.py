"""The one user-facing error type.

Anything a user can get wrong (a name, a shape, a file) raises ``AutofuseError`` with a message meant
for them; only ``cli.py`` prints it and exits with code 2. Internal bugs raise ordinary exceptions.
"""


class AutofuseError(Exception):
    """A problem with the user's input or environment, explained in one line."""
