"""megacore: the library shared by the mega-* tools (artifacts, data, models, parallel engine)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megacore")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"
