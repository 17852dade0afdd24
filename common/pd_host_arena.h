/* pd_host_arena.h - long-lived host blocks of a backend's fastest host memory (pinned on CUDA),
 *   handed out in pieces: the swap space of preempted requests.
 * Owns: pd_host_arena (chunks of kern_host_alloc memory, first-fit pieces in them).
 * Why: pinning memory costs about as much as the copy it speeds up (a few GB/s), so a preemption
 *   cannot pin its block each time; the arena pins chunks as the swap space fills and keeps them
 *   for the next preemptions, up to a cap (as vLLM pins its swap space once).
 * Not here: what goes into the pieces (pd_engine_kv.c), the copies (kern_download_spans).
 * Threading: one thread at a time per arena. */
#ifndef PD_HOST_ARENA_H
#define PD_HOST_ARENA_H

#include "kern_backend.h"

#include <stddef.h>

typedef struct pd_host_arena pd_host_arena;

/* An arena that pins chunks of chunk_bytes (at most cap; or one piece's size, if larger) from
 * be, up to cap bytes in all; nothing is allocated before the first piece. */
pd_status pd_host_arena_create(kern_backend *be, size_t cap, size_t chunk_bytes, pd_host_arena **out,
                               pd_err *err);
/* Frees every chunk: the pieces must be given back (or no longer used) by then. NULL: no-op. */
void pd_host_arena_destroy(pd_host_arena *a);
/* A piece of n bytes (aligned to 4 KiB) or NULL when the chunks have no gap that large and the
 * cap or the backend refuses another chunk: the caller then uses plain memory. */
void *pd_host_arena_alloc(pd_host_arena *a, size_t n);
/* 1 when p is a piece of this arena (a NULL arena owns nothing). */
int pd_host_arena_owns(const pd_host_arena *a, const void *p);
/* A piece of n bytes when the arena has room, else (also with a NULL arena) a malloc'ed block;
 * NULL when neither can be had. pd_host_arena_give takes either back. */
void *pd_host_arena_take(pd_host_arena *a, size_t n);
/* Gives back what pd_host_arena_take gave: a piece to the arena, a malloc'ed block to free().
 * NULL: no-op. */
void pd_host_arena_give(pd_host_arena *a, void *p);
/* Takes chunks for n more bytes now (startup: the first preemption then pays no pinning); 0, or
 * -1 when the cap or the backend refuses. */
int pd_host_arena_reserve(pd_host_arena *a, size_t n);
/* Gives a piece back; its gap joins its neighbours'. p must be a piece of a. */
void pd_host_arena_free(pd_host_arena *a, void *p);
/* Bytes of the chunks pinned so far, and of the pieces handed out. */
size_t pd_host_arena_chunk_bytes(const pd_host_arena *a);
size_t pd_host_arena_used_bytes(const pd_host_arena *a);

#endif
