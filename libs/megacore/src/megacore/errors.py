"""The one error type that means "bad input": the CLI turns it into exit 2 and one line."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or usage. The message names what and where, and how to fix it when that is known.

    Raised anywhere in the library; `megacore.cli.run` prints it as one line on stderr and exits 2.
    """

    exit_code = 2

    def __init__(self, message: str, where: str | None = None) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)
