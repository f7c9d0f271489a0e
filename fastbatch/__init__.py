"""fastbatch: vLLM's per-step, per-request CPU bookkeeping as compiled calls.

Each piece (``fastbatch.registry.NAMES``) replaces one loop of vLLM's
scheduler, model runner, output processor or OpenAI server with one compiled
call over the whole batch, and gives exactly the results of vLLM's own code.
This package exports every piece's public functions (its compiled module's
``__all__``), ``stats()`` (each piece's counters, by piece name) and
``reset_stats()``.  The vLLM plugin
(``fastbatch.vllm_plugin``, ``FASTBATCH=1``) installs them in vLLM.

Each is a compiled piece (``fastbatch._kernels``, one module per piece) with a
pure-Python twin (``fastbatch._reference``).  ``COMPILED`` says whether the
compiled pieces are in use; if they cannot be imported, the twins take their
place and one ``RuntimeWarning`` says so.
"""

import warnings

__version__ = "0.1.0"

try:
    from fastbatch import _kernels as _implementation
except ImportError as exc:  # no compiled module for this platform/interpreter
    warnings.warn(
        f"fastbatch: compiled kernel unavailable ({exc}); using the slower "
        "pure-Python fallback",
        RuntimeWarning,
        stacklevel=2,
    )
    from fastbatch import _reference as _implementation

    COMPILED = False
else:
    COMPILED = True

globals().update({name: getattr(_implementation, name) for name in _implementation.__all__})
__all__ = ["COMPILED", "__version__", *_implementation.__all__]
