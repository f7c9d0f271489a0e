/* Cache prefetch hints for the pieces' group prefetching.
 *
 * A hint never faults and never changes a result: on a compiler without
 * __builtin_prefetch it is nothing at all.  Read hints are for what a loop
 * will only read (request ids, list headers, ints); write hints for what it
 * will store to (list slots, reference counts of shared ints).
 */
#ifndef FASTBATCH_PREFETCH_H
#define FASTBATCH_PREFETCH_H

#if defined(__GNUC__) || defined(__clang__)
#define fastbatch_prefetch_read(p) __builtin_prefetch((const void *)(p), 0, 3)
#define fastbatch_prefetch_write(p) __builtin_prefetch((const void *)(p), 1, 3)
#else
#define fastbatch_prefetch_read(p) ((void)(p))
#define fastbatch_prefetch_write(p) ((void)(p))
#endif

#endif /* FASTBATCH_PREFETCH_H */
