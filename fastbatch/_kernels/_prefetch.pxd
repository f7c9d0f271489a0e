"""Cache prefetch hints (``_prefetch.h``): declarations only, no module.

The pieces overlap the cache misses of a block of requests (group
prefetching): in stages, each hinting what the next stage will read, then the
work.  A hint never faults and never changes a result.
"""


cdef extern from "_prefetch.h":
    void prefetch_read "fastbatch_prefetch_read"(const void* address) noexcept nogil
    void prefetch_write "fastbatch_prefetch_write"(const void* address) noexcept nogil
