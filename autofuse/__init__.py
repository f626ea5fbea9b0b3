"""autofuse: fused-kernel search on Apache TVM.

Patterns live in ``search_spaces/``; the stages that tune, store, build and measure them live here,
one module each.
"""

from .errors import AutofuseError

__version__ = "0.1.0"
__all__ = ["AutofuseError", "__version__"]
