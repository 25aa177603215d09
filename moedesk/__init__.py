"""moedesk: run Mixture-of-Experts language models on one personal computer.

Installed, the repository's top-level folders (setup.py's LAYERS: `moedesk.app`, `moedesk.engine`,
`moedesk.kernels`, ...) are this package's subpackages. Run from a checkout without
installing (the GPU box does), the same names resolve to those folders through this package's path.
"""
import sys as _sys
from importlib.metadata import PackageNotFoundError, version as _version
from pathlib import Path as _Path

from moedesk import libstdcxx as _libstdcxx

# First, before any layer imports torch: llama.cpp's CUDA build loads beside torch only with the C++ runtime ahead
# of torch's libraries in the global symbol scope (moedesk/libstdcxx.py). Never raises.
_torch_first = "torch" in _sys.modules
_libstdcxx.before_torch = _libstdcxx.preload() and not _torch_first

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "engine" / "runtime.py").is_file() and (_checkout / "app" / "cli.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 -- a package's __path__, set by the import system

try:
    __version__ = _version("moedesk")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+checkout"
