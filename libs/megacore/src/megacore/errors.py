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


class Silent(UserError):
    """An error another process of the same job reports (rank 0 of a torchrun job): this process
    exits with the same code and prints nothing, so the user reads it once."""

    def __init__(self, exit_code: int = 2) -> None:
        super().__init__("")
        self.exit_code = exit_code


class DamagedFile(UserError):
    """A file of an artifact that is missing, or whose size or sha256 differs from its manifest's
    `$.files` entry: the artifact is damaged (a torn copy, a disk error), not merely misused.

    Its own type so that a caller can tell damage from other bad input: a training job resuming
    from a damaged checkpoint falls back to an older one."""
