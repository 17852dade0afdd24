/* pd_host_arena.c - chunks of a backend's host memory, first-fit pieces in them.
 * Owns: pd_host_arena.
 * How: each chunk keeps its gaps as a list sorted by offset; a piece takes the front of the
 *   first gap of the first chunk that holds it (a new chunk when none does and the cap allows),
 *   and a freed piece becomes a gap again, merged with the gaps it touches. Pieces are few (one
 *   per preempted request), so lists and linear walks serve.
 * Not here: which memory (kern_host_alloc); what the pieces hold.
 * Threading: one thread at a time per arena. */
#include "pd_host_arena.h"

#include "pd_buf.h"

#include <stdint.h>
#include <stdlib.h>

#define ARENA_ALIGN ((size_t)4096)

typedef struct {
    size_t off, n;
} extent;

typedef struct {
    char *base;
    size_t bytes;
    extent *gaps;   /* sorted by off, none touching another */
    int n_gaps, cap_gaps;
} chunk;

typedef struct {
    char *p;
    size_t n;
    int chunk;
} piece;

struct pd_host_arena {
    kern_backend *be;
    size_t cap, chunk_bytes, pinned, used;
    chunk *chunks;
    int n_chunks, cap_chunks;
    piece *pieces;
    int n_pieces, cap_pieces;
};

pd_status pd_host_arena_create(kern_backend *be, size_t cap, size_t chunk_bytes, pd_host_arena **out,
                               pd_err *err)
{
    if (chunk_bytes == 0)
        return pd_err_set(err, PD_ERR_INVALID, "host arena: chunks of 0 bytes");
    pd_host_arena *a = calloc(1, sizeof(*a));
    if (a == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "host arena");
    a->be = be;
    a->cap = cap;
    if (chunk_bytes > cap && cap > 0)
        chunk_bytes = cap;   /* a chunk never larger than the whole arena */
    a->chunk_bytes = (chunk_bytes + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    *out = a;
    return PD_OK;
}

void pd_host_arena_destroy(pd_host_arena *a)
{
    if (a == NULL)
        return;
    for (int i = 0; i < a->n_chunks; i++) {
        kern_host_free(a->be, a->chunks[i].base);
        free(a->chunks[i].gaps);
    }
    free(a->chunks);
    free(a->pieces);
    free(a);
}

/* Takes n bytes from the front of gap g of chunk c; returns where. */
static char *take(chunk *c, int g, size_t n)
{
    extent *e = &c->gaps[g];
    char *p = c->base + e->off;
    e->off += n;
    e->n -= n;
    if (e->n == 0) {
        for (int i = g; i + 1 < c->n_gaps; i++)
            c->gaps[i] = c->gaps[i + 1];
        c->n_gaps--;
    }
    return p;
}

/* A new chunk of at least n bytes; -1 when the cap or the backend refuses it. */
static int add_chunk(pd_host_arena *a, size_t n)
{
    size_t bytes = n > a->chunk_bytes ? n : a->chunk_bytes;
    if (a->pinned + bytes > a->cap) {
        if (a->pinned + n > a->cap)
            return -1;
        bytes = n;   /* the last chunk: what the cap leaves room for */
    }
    if (pd_buf_grow((void **)&a->chunks, &a->cap_chunks, a->n_chunks + 1, sizeof(chunk)) != 0)
        return -1;
    chunk c = { 0 };
    if ((c.gaps = malloc(sizeof(extent))) == NULL)
        return -1;
    c.cap_gaps = 1;
    void *p = NULL;
    pd_err err;
    if (kern_host_alloc(a->be, bytes, &p, &err) != PD_OK) {
        free(c.gaps);
        return -1;
    }
    c.base = p;
    c.bytes = bytes;
    c.gaps[0] = (extent){ 0, bytes };
    c.n_gaps = 1;
    a->chunks[a->n_chunks] = c;
    a->pinned += bytes;
    return a->n_chunks++;
}

int pd_host_arena_reserve(pd_host_arena *a, size_t n)
{
    size_t want = a->pinned + n;
    while (a->pinned < want)
        if (add_chunk(a, want - a->pinned < a->chunk_bytes ? want - a->pinned : a->chunk_bytes) < 0)
            return -1;
    return 0;
}

void *pd_host_arena_alloc(pd_host_arena *a, size_t n)
{
    if (a == NULL || n == 0)
        return NULL;
    if (n > SIZE_MAX - ARENA_ALIGN)
        return NULL;
    n = (n + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    if (pd_buf_grow((void **)&a->pieces, &a->cap_pieces, a->n_pieces + 1, sizeof(piece)) != 0)
        return NULL;
    int ci = -1, gi = -1;
    for (int i = 0; i < a->n_chunks && ci < 0; i++)
        for (int g = 0; g < a->chunks[i].n_gaps; g++)
            if (a->chunks[i].gaps[g].n >= n) {
                ci = i;
                gi = g;
                break;
            }
    if (ci < 0) {
        if ((ci = add_chunk(a, n)) < 0)
            return NULL;
        gi = 0;
    }
    char *p = take(&a->chunks[ci], gi, n);
    a->pieces[a->n_pieces++] = (piece){ p, n, ci };
    a->used += n;
    return p;
}

void *pd_host_arena_take(pd_host_arena *a, size_t n)
{
    void *p = pd_host_arena_alloc(a, n);
    return p != NULL ? p : malloc(n > 0 ? n : 1);
}

void pd_host_arena_give(pd_host_arena *a, void *p)
{
    if (pd_host_arena_owns(a, p))
        pd_host_arena_free(a, p);
    else
        free(p);
}

int pd_host_arena_owns(const pd_host_arena *a, const void *p)
{
    for (int i = 0; a != NULL && i < a->n_pieces; i++)
        if (a->pieces[i].p == p)
            return 1;
    return 0;
}

void pd_host_arena_free(pd_host_arena *a, void *p)
{
    int k = 0;
    while (k < a->n_pieces && a->pieces[k].p != p)
        k++;
    PD_ASSERT(k < a->n_pieces);
    piece pc = a->pieces[k];
    a->pieces[k] = a->pieces[--a->n_pieces];
    a->used -= pc.n;
    chunk *c = &a->chunks[pc.chunk];
    size_t off = (size_t)(pc.p - c->base);
    int g = 0;   /* the first gap after the piece */
    while (g < c->n_gaps && c->gaps[g].off < off)
        g++;
    int left = g > 0 && c->gaps[g - 1].off + c->gaps[g - 1].n == off;
    int right = g < c->n_gaps && off + pc.n == c->gaps[g].off;
    if (left && right) {
        c->gaps[g - 1].n += pc.n + c->gaps[g].n;
        for (int i = g; i + 1 < c->n_gaps; i++)
            c->gaps[i] = c->gaps[i + 1];
        c->n_gaps--;
    } else if (left) {
        c->gaps[g - 1].n += pc.n;
    } else if (right) {
        c->gaps[g].off = off;
        c->gaps[g].n += pc.n;
    } else {
        /* a gap of its own; if the list cannot grow, the bytes stay taken (never lost twice:
         * the chunk is freed whole at the end) */
        if (pd_buf_grow((void **)&c->gaps, &c->cap_gaps, c->n_gaps + 1, sizeof(extent)) != 0)
            return;
        for (int i = c->n_gaps; i > g; i--)
            c->gaps[i] = c->gaps[i - 1];
        c->gaps[g] = (extent){ off, pc.n };
        c->n_gaps++;
    }
}

size_t pd_host_arena_chunk_bytes(const pd_host_arena *a)
{
    return a != NULL ? a->pinned : 0;
}

size_t pd_host_arena_used_bytes(const pd_host_arena *a)
{
    return a != NULL ? a->used : 0;
}
