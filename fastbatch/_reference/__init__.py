"""The pure-Python twins of the compiled pieces (``fastbatch._kernels``): the
test oracle, one module per piece, named like its patch in ``fastbatch.patches``.
``_common`` holds what they share."""

from fastbatch import registry
from fastbatch._counters import combined

PIECES = registry.twin_modules()
stats, reset_stats = combined(PIECES)
globals().update(registry.exports(PIECES))
__all__ = ["reset_stats", "stats", *registry.exports(PIECES)]
