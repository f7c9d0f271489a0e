# The decode call of ``allocate_slots`` for the other compiled pieces
# (``schedule_running``): see allocate_slots.pyx.

cimport cython


# What ``_plan`` finds vLLM's method would do (flags; ``_STOCK`` alone: vLLM decides).
cdef enum:
    _STOCK = -1
    _NOTHING = 0      # return empty_kv_cache_blocks, change nothing
    _ALLOCATE = 1     # new blocks for the new tokens and lookahead slots
    _CACHE = 2        # full blocks of committed tokens to cache


cdef struct _Counts:
    Py_ssize_t need_slots     # num_tokens_need_slot
    Py_ssize_t main_tokens    # num_tokens_main_model
    Py_ssize_t to_cache       # num_tokens_to_cache


@cython.final
cdef class _Manager:
    """What the plan reads of a KV-cache manager that is the same for every
    request: its coordinator's one full-attention manager's block table,
    pending partial hits and cached-block counts, the block pool (and its
    free queue where the pool is vLLM's own class), sizes, and whether
    caching applies."""
    cdef object manager
    cdef object coordinator
    cdef object req_to_blocks
    cdef object partial_hits
    cdef object cached
    cdef object pool
    cdef object free_queue
    cdef bint exact_pool
    cdef bint caching
    cdef Py_ssize_t max_model_len
    cdef Py_ssize_t block_size
    cdef Py_ssize_t reprefillable


cdef _Manager manager_view(object manager)
cdef object allocate_decode(_Manager view, object request, Py_ssize_t num_new_tokens,
                            Py_ssize_t num_lookahead_tokens, bint act)
