"""exitplane: control plane for early-exit language models.

`__version__` is the installed distribution's version; pyproject.toml is its one definition.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("exitplane")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
