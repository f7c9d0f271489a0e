# Compiler directives are set in setup.py (one place, with a debug switch).
"""Compiled piece ``draft_token_ids``: the draft-token lists of vLLM's
``GPUModelRunner._get_draft_token_ids_cpu`` (speculative decoding).

vLLM does ``draft_token_ids_cpu[:num_reqs, :num_spec_tokens].tolist()``.
``draft_token_lists`` builds the same lists in one pass over the tensor's
memory, without the sliced view, the ids as the shared token-id objects.
``fastbatch._reference`` holds the same behaviour in plain Python.
"""

__all__ = ["draft_token_lists"]

from cpython.buffer cimport PyBuffer_Release
from libc.stdint cimport uint64_t

from fastbatch._kernels._common cimport SampledIds, rows_to_lists, view_ids

# Process-wide counters, read with stats().
cdef uint64_t _calls = 0
cdef uint64_t _rows = 0


def stats():
    """This piece's counters since import or the last ``reset_stats()``."""
    return {"calls": _calls, "rows": _rows}


def reset_stats():
    """Set every counter of ``stats()`` back to zero."""
    global _calls, _rows
    _calls = _rows = 0


def draft_token_lists(draft_token_ids, Py_ssize_t num_reqs, Py_ssize_t num_spec_tokens):
    """vLLM's ``draft_token_ids_cpu[:num_reqs, :num_spec_tokens].tolist()``
    (``GPUModelRunner._get_draft_token_ids_cpu``), the counts ints >= 0.

    ``draft_token_ids`` is a 2-D int32 or int64 CPU tensor (or buffer); the
    two counts are cut to the tensor's size, as slicing does.  Returns a new
    list of plain lists of plain ints.
    """
    global _calls, _rows
    cdef SampledIds ids
    cdef Py_buffer buffer
    cdef bint have_buffer = False
    if num_reqs < 0 or num_spec_tokens < 0:
        raise ValueError(f"num_reqs and num_spec_tokens must be >= 0, got "
                         f"{num_reqs} and {num_spec_tokens}")
    view_ids(draft_token_ids, &ids, &buffer, &have_buffer, "draft_token_ids")
    try:
        rows = rows_to_lists(&ids, min(num_reqs, ids.num_rows),
                             min(num_spec_tokens, ids.width), NULL)
    finally:
        if have_buffer:
            PyBuffer_Release(&buffer)
    _calls += 1
    _rows += len(rows)
    return rows
