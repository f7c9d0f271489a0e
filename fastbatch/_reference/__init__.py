"""The pure-Python twins of the compiled pieces (``fastbatch._kernels``): the
test oracle, one module per piece, named like its patch in ``fastbatch.patches``.
``_common`` holds what they share."""

from fastbatch import _names
from fastbatch._counters import combined

PIECES = _names.twin_modules()
stats, reset_stats = combined(PIECES)
_EXPORTS = _names.exports(PIECES)
globals().update(_EXPORTS)
__all__ = ["reset_stats", "stats", *_EXPORTS]
