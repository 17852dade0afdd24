/* pd_graph.h - replaying recorded steps as backend graphs (CUDA graphs), one per shape bucket.
 * Owns: the per-runner graph cache (keys of a step's shape and buffers -> an instantiated
 *   graph), the warm-up/capture/replay/fallback rules, and the shape buckets that keep the number
 *   of distinct graphs small (pd_graph_bucket).
 * Not here: what a step does (the caller's body function), padding of a batch (pd_qwen3.c and
 *   pd_dspark.c pad their metadata to the bucket), the capture itself (kern_graph_* ops).
 * Rules: a body must be capturable: only backend ops on the backend's stream, no uploads,
 *   downloads or syncs, no host decisions on device data. The first time a key is seen the body
 *   runs eagerly (it may grow scratch memory then); the second time it is captured and the graph
 *   launched; later it is replayed. A capture that fails (e.g. scratch had to grow) runs the body
 *   eagerly instead; a key whose capture failed twice stays eager. On a backend without graphs
 *   (cpu) every call runs the body eagerly.
 * Threading: a cache belongs to one runner, used by one thread. */
#ifndef PD_GRAPH_H
#define PD_GRAPH_H

#include <stdint.h>

#include "kern_backend.h"
#include "pd_status.h"

#define PD_GRAPH_KEY_LEN 16
#define PD_GRAPH_CACHE_SIZE 48

typedef enum {
    PD_GRAPHS_AUTO = 0,   /* graphs where the backend has them (cuda), eager elsewhere */
    PD_GRAPHS_OFF,        /* always eager, no padding to buckets */
    PD_GRAPHS_PAD         /* pad batches to buckets even without graphs (tests on the cpu) */
} pd_graph_mode;

typedef struct {
    int64_t key[PD_GRAPH_KEY_LEN];
    void *graph;          /* NULL: seen once (warmed up), not captured yet */
    int failures;         /* captures that failed for this key */
    uint64_t last_use;
} pd_graph_entry;

typedef struct {
    kern_backend *be;
    pd_graph_mode mode;
    int usable;           /* the backend can capture (probed on first use; 1 until known) */
    int probed;
    uint64_t clock;
    int n;
    pd_graph_entry e[PD_GRAPH_CACHE_SIZE];
    /* counters, for tests and the bench; n_cold counts the runs that were not a plain replay
     * or a steady eager run: a new shape's warm-up, a capture, a stale graph's re-run (with
     * PD_GRAPHS_PAD: the new shapes, i.e. the warm-ups a GPU would run) */
    uint64_t n_eager, n_captures, n_replays, n_cold;
} pd_graph_cache;

/* "auto", "off" or "pad" (PD_ERR_INVALID naming the value otherwise). */
pd_status pd_graph_mode_parse(const char *s, pd_graph_mode *out, pd_err *err);

void pd_graph_cache_init(pd_graph_cache *gc, kern_backend *be, pd_graph_mode mode);
void pd_graph_cache_clear(pd_graph_cache *gc);   /* frees every graph */
/* 1 when batches should be padded to buckets (graphs usable, or PD_GRAPHS_PAD). */
int pd_graph_pad(const pd_graph_cache *gc);

/* The bucket a count n >= 1 is padded to: n itself up to 4, then multiples of 4 up to 16, of
 * 8 up to 64, of 32 up to 256, of 128 above (always less than 2n; the decode shapes that matter,
 * B x (block + 1) verify tokens, mostly land on a bucket exactly). */
int pd_graph_bucket(int n);
/* The bucket of a length that only needs an upper bound (KV lengths, page-table strides):
 * the next power of two >= n, at least min. */
int pd_graph_bucket_pow2(int n, int min);

typedef pd_status (*pd_graph_body)(void *ud, pd_err *err);

/* Runs body(ud) for the step described by key[0..n_key-1] (n_key <= PD_GRAPH_KEY_LEN; the key
 * must name everything that shapes the recorded launches: sizes, buffer pointers, kernel
 * choices). */
pd_status pd_graph_run(pd_graph_cache *gc, const int64_t *key, int n_key, pd_graph_body body,
                       void *ud, pd_err *err);

#endif
