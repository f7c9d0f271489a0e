"""The compiled pieces: one extension module per piece, named like its patch
in ``fastbatch.patches`` (and its pure-Python twin in ``fastbatch._reference``).
``_common`` holds what they share (the small-int helpers, the token table)."""

from fastbatch import _names
from fastbatch._counters import combined

PIECES = _names.kernel_modules()
stats, reset_stats = combined(PIECES)
_EXPORTS = _names.exports(PIECES)
globals().update(_EXPORTS)
__all__ = ["reset_stats", "stats", *_EXPORTS]
