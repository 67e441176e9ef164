"""The one error users see: bad input, printed by the CLI as one line with exit status 2."""


class UserError(Exception):
    """Bad input: the CLI prints the message as one line and exits with status 2."""
