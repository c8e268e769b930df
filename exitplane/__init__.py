"""exitplane: control plane for early-exit language models.

`__version__` is the installed distribution's version; pyproject.toml is its one definition.
"""

from importlib.metadata import PackageNotFoundError, version
from pkgutil import extend_path

# `exitplane.wire` and `exitplane.client` come from the exitplane-client distribution
# (clients/python/): this package spans every `exitplane` directory on sys.path.
__path__ = extend_path(__path__, __name__)

try:
    __version__ = version("exitplane")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
