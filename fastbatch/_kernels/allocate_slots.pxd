# The decode call of ``allocate_slots`` for the other compiled pieces
# (``schedule_running``): see allocate_slots.pyx.

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


cdef object allocate_decode(object manager, object request, object num_new_tokens,
                            object num_lookahead_tokens, bint act)
