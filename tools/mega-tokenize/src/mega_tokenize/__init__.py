"""mega-tokenize."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mega-tokenize")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"
