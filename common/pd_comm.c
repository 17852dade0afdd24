/* pd_comm.c - the communicator wrappers and the local (threads of one process) communicator.
 * Owns: argument checks common to every implementation; the local group: a rendezvous with a
 *       timeout (mutex + condvar on CLOCK_MONOTONIC), the per-rank posting table and the
 *       pull copies; the NCCL stubs of a build without CUDA.
 * Not here: the NCCL communicator (pd_comm_nccl.c).
 * Threading: a handle is used by its rank's thread; the group is shared and guarded by its
 *       mutex. pd_comm_abort may come from any thread.
 *
 * A local collective is two rendezvous. Each rank posts {op, bytes, root, send, recv} in its
 * table slot and arrives; after the first rendezvous every rank checks that all posts agree
 * and pulls what it needs straight from the other ranks' send buffers into its own recv; the
 * second rendezvous keeps every send buffer (and table slot) untouched until all ranks have
 * finished reading. The mutex hand-off at each rendezvous orders the copies after the posts. */
#include "pd_comm.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd_log.h"

/* ---- checked wrappers ------------------------------------------------------------------- */

pd_status pd_comm_all_gather(pd_comm *c, const void *send, void *recv, size_t bytes, pd_err *err)
{
    if (c == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "comm all_gather: no communicator");
    if (bytes > 0 && (send == NULL || recv == NULL))
        return pd_err_set(err, PD_ERR_INVALID, "comm all_gather: null buffer for %zu bytes",
                          bytes);
    if (bytes > 0 && SIZE_MAX / bytes < (size_t)c->ops->size(c))
        return pd_err_set(err, PD_ERR_INVALID, "comm all_gather: %zu bytes x %d ranks overflows",
                          bytes, c->ops->size(c));
    return c->ops->all_gather(c, send, recv, bytes, err);
}

pd_status pd_comm_broadcast(pd_comm *c, void *buf, size_t bytes, int root, pd_err *err)
{
    if (c == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "comm broadcast: no communicator");
    if (root < 0 || root >= c->ops->size(c))
        return pd_err_set(err, PD_ERR_INVALID, "comm broadcast: root %d of %d ranks", root,
                          c->ops->size(c));
    if (bytes > 0 && buf == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "comm broadcast: null buffer for %zu bytes", bytes);
    return c->ops->broadcast(c, buf, bytes, root, err);
}

pd_status pd_comm_all_reduce_sum(pd_comm *c, const float *send, float *recv, size_t count,
                                 pd_err *err)
{
    if (c == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "comm all_reduce: no communicator");
    if (count > 0 && (send == NULL || recv == NULL))
        return pd_err_set(err, PD_ERR_INVALID, "comm all_reduce: null buffer for %zu floats",
                          count);
    if (count > SIZE_MAX / sizeof(float))
        return pd_err_set(err, PD_ERR_INVALID, "comm all_reduce: %zu floats overflow", count);
    return c->ops->all_reduce_sum(c, send, recv, count, err);
}

pd_status pd_comm_barrier(pd_comm *c, pd_err *err)
{
    if (c == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "comm barrier: no communicator");
    return c->ops->barrier(c, err);
}

void pd_comm_abort(pd_comm *c, const char *why)
{
    if (c != NULL)
        c->ops->abort(c, why != NULL ? why : "aborted");
}

int pd_comm_rank(const pd_comm *c) { return c != NULL ? c->ops->rank(c) : -1; }
int pd_comm_size(const pd_comm *c) { return c != NULL ? c->ops->size(c) : 0; }
const char *pd_comm_name(const pd_comm *c) { return c != NULL ? c->ops->name : "none"; }

void pd_comm_destroy(pd_comm *c)
{
    if (c != NULL)
        c->ops->destroy(c);
}

/* ---- local communicator ----------------------------------------------------------------- */

#define LOCAL_MAX_RANKS 1024
#define LOCAL_DEFAULT_TIMEOUT_MS 60000

typedef enum { OP_ALL_GATHER = 1, OP_BROADCAST, OP_BARRIER, OP_ALL_REDUCE } local_op;

static const char *op_name(int op)
{
    switch (op) {
    case OP_ALL_GATHER: return "all_gather";
    case OP_BROADCAST: return "broadcast";
    case OP_BARRIER: return "barrier";
    case OP_ALL_REDUCE: return "all_reduce";
    default: return "?";
    }
}

typedef struct {
    int op;
    size_t bytes;
    int root;
    const void *send;
    void *recv;
} local_post;

struct pd_comm_local_group {
    pthread_mutex_t mu;
    pthread_cond_t cv;            /* CLOCK_MONOTONIC, so wall-clock jumps don't cut waits */
    int n;
    int arrived;                  /* ranks at the current rendezvous */
    uint64_t gen;                 /* bumps when a rendezvous completes */
    int broken;                   /* sticky: the group failed */
    pd_status broken_code;
    char broken_msg[256];
    int refs;                     /* creator + live handles */
    unsigned char *has_handle;    /* [n] */
    local_post *posts;            /* [n] */
    pd_comm_copy_fn copy;
    void *copy_ud;
    int timeout_ms;
};

typedef struct {
    pd_comm base;
    pd_comm_local_group *g;
    int rank;
    float *sum;                   /* all_reduce scratch of this rank: [cap_sum] */
    size_t cap_sum;
} local_comm;

static pd_status memcpy_copy(void *ud, void *dst, const void *src, size_t n, pd_err *err)
{
    (void)ud;
    (void)err;
    memcpy(dst, src, n);
    return PD_OK;
}

static void group_unref_locked_and_unlock(pd_comm_local_group *g)
{
    int last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (!last)
        return;
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g->posts);
    free(g->has_handle);
    free(g);
}

/* Caller holds g->mu. The first failure wins; later ones are logged by their callers only. */
static void group_break_locked(pd_comm_local_group *g, pd_status code, const char *msg)
{
    if (g->broken)
        return;
    g->broken = 1;
    g->broken_code = code;
    snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", msg);
    pthread_cond_broadcast(&g->cv);
}

static pd_status broken_err(pd_comm_local_group *g, int rank, pd_err *err)
{
    return pd_err_set(err, g->broken_code, "local comm rank %d: group broken: %s", rank,
                      g->broken_msg);
}

/* Wait until all n ranks have arrived, at most timeout_ms. On timeout the group breaks, so the
 * ranks that did arrive fail too instead of waiting for a rank that is gone. */
static pd_status rendezvous(pd_comm_local_group *g, int rank, pd_err *err)
{
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += g->timeout_ms / 1000;
    deadline.tv_nsec += (long)(g->timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }

    pthread_mutex_lock(&g->mu);
    if (g->broken) {
        pd_status st = broken_err(g, rank, err);
        pthread_mutex_unlock(&g->mu);
        return st;
    }
    if (++g->arrived == g->n) {
        g->arrived = 0;
        g->gen++;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        return PD_OK;
    }
    uint64_t my_gen = g->gen;
    while (g->gen == my_gen && !g->broken) {
        int rc = pthread_cond_timedwait(&g->cv, &g->mu, &deadline);
        if (rc == ETIMEDOUT && g->gen == my_gen && !g->broken) {
            char msg[160];
            snprintf(msg, sizeof(msg), "rank %d waited %d ms, %d of %d ranks arrived", rank,
                     g->timeout_ms, g->arrived, g->n);
            group_break_locked(g, PD_ERR_TIMEOUT, msg);
            PD_LOG_ERROR("comm", "local comm timeout: %s", msg);
        }
    }
    pd_status st = PD_OK;
    /* a completed generation wins over a break that came after it */
    if (g->gen == my_gen)
        st = broken_err(g, rank, err);
    pthread_mutex_unlock(&g->mu);
    return st;
}

/* After the first rendezvous: every rank sees the same table, so every rank reaches the same
 * verdict and the group stays usable after a mismatch. */
static pd_status check_posts(const pd_comm_local_group *g, int rank, pd_err *err)
{
    const local_post *p0 = &g->posts[0];
    for (int r = 1; r < g->n; r++) {
        const local_post *p = &g->posts[r];
        if (p->op != p0->op || p->bytes != p0->bytes || p->root != p0->root)
            return pd_err_set(err, PD_ERR_INVALID,
                              "local comm rank %d: mismatched collectives: rank 0 %s(%zu bytes, "
                              "root %d), rank %d %s(%zu bytes, root %d)",
                              rank, op_name(p0->op), p0->bytes, p0->root, r, op_name(p->op),
                              p->bytes, p->root);
    }
    return PD_OK;
}

static pd_status local_collective(local_comm *lc, int op, const void *send, void *recv,
                                  size_t bytes, int root, pd_err *err)
{
    pd_comm_local_group *g = lc->g;
    int me = lc->rank;
    /* only this rank writes its slot, and only between the second rendezvous of the previous
     * collective and the first of this one, when no rank reads the table */
    g->posts[me] = (local_post){ .op = op, .bytes = bytes, .root = root, .send = send,
                                 .recv = recv };
    pd_status st = rendezvous(g, me, err);
    if (st != PD_OK)
        return st;

    pd_status res = check_posts(g, me, err);
    if (res == PD_OK && bytes > 0) {
        if (op == OP_ALL_GATHER) {
            unsigned char *dst = recv;
            for (int r = 0; r < g->n && res == PD_OK; r++) {
                const void *src = g->posts[r].send;
                void *d = dst + (size_t)r * bytes;
                if (src != d)
                    res = g->copy(g->copy_ud, d, src, bytes, err);
            }
        } else if (op == OP_BROADCAST && me != root && recv != g->posts[root].send) {
            res = g->copy(g->copy_ud, recv, g->posts[root].send, bytes, err);
        } else if (op == OP_ALL_REDUCE) {
            /* into this rank's scratch: a send may be its owner's recv (in place), which must
             * stay unchanged until every rank has read it */
            size_t count = bytes / sizeof(float);
            float *sum = lc->sum;
            const float *s0 = g->posts[0].send;
            for (size_t i = 0; i < count; i++)
                sum[i] = s0[i];
            for (int r = 1; r < g->n; r++) {
                const float *sr = g->posts[r].send;
                for (size_t i = 0; i < count; i++)
                    sum[i] += sr[i];
            }
        }
    }

    st = rendezvous(g, me, err);
    if (st != PD_OK)
        return st;
    if (res == PD_OK && op == OP_ALL_REDUCE && bytes > 0)
        memcpy(recv, lc->sum, bytes);
    return res;
}

static pd_status local_all_gather(pd_comm *c, const void *send, void *recv, size_t bytes,
                                  pd_err *err)
{
    return local_collective((local_comm *)c, OP_ALL_GATHER, send, recv, bytes, 0, err);
}

static pd_status local_broadcast(pd_comm *c, void *buf, size_t bytes, int root, pd_err *err)
{
    return local_collective((local_comm *)c, OP_BROADCAST, buf, buf, bytes, root, err);
}

static void local_abort(pd_comm *c, const char *why);

static pd_status local_all_reduce_sum(pd_comm *c, const float *send, float *recv, size_t count,
                                      pd_err *err)
{
    local_comm *lc = (local_comm *)c;
    size_t bytes = count * sizeof(float);
    /* checked before the collective, alike on every rank of the group */
    if (lc->g->copy != memcpy_copy)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "local comm rank %d: all_reduce adds on the host; this group copies "
                          "with a custom (device) copy", lc->rank);
    if (count > lc->cap_sum) {
        float *n = realloc(lc->sum, bytes);
        if (n == NULL) {
            /* the others must not wait for this rank: fail the whole group */
            local_abort(c, "all_reduce scratch: out of memory");
            return pd_err_set(err, PD_ERR_NOMEM, "local comm rank %d: all_reduce scratch of %zu "
                              "floats", lc->rank, count);
        }
        lc->sum = n;
        lc->cap_sum = count;
    }
    return local_collective(lc, OP_ALL_REDUCE, send, recv, bytes, 0, err);
}

static pd_status local_barrier(pd_comm *c, pd_err *err)
{
    return local_collective((local_comm *)c, OP_BARRIER, NULL, NULL, 0, 0, err);
}

static void local_abort(pd_comm *c, const char *why)
{
    local_comm *lc = (local_comm *)c;
    char msg[200];
    snprintf(msg, sizeof(msg), "rank %d aborted: %s", lc->rank, why);
    pthread_mutex_lock(&lc->g->mu);
    group_break_locked(lc->g, PD_ERR_PEER, msg);
    pthread_mutex_unlock(&lc->g->mu);
}

static int local_rank(const pd_comm *c) { return ((const local_comm *)c)->rank; }
static int local_size(const pd_comm *c) { return ((const local_comm *)c)->g->n; }

static void local_destroy(pd_comm *c)
{
    local_comm *lc = (local_comm *)c;
    pd_comm_local_group *g = lc->g;
    pthread_mutex_lock(&g->mu);
    g->has_handle[lc->rank] = 0;
    free(lc->sum);
    free(lc);
    group_unref_locked_and_unlock(g);
}

static const pd_comm_ops local_ops = {
    .name = "local",
    .all_gather = local_all_gather,
    .broadcast = local_broadcast,
    .all_reduce_sum = local_all_reduce_sum,
    .barrier = local_barrier,
    .abort = local_abort,
    .rank = local_rank,
    .size = local_size,
    .destroy = local_destroy,
};

pd_status pd_comm_local_group_create(int n_ranks, const pd_comm_local_opts *opts,
                                     pd_comm_local_group **out, pd_err *err)
{
    if (n_ranks < 1 || n_ranks > LOCAL_MAX_RANKS)
        return pd_err_set(err, PD_ERR_INVALID, "local comm: %d ranks outside 1..%d", n_ranks,
                          LOCAL_MAX_RANKS);
    if (opts != NULL && opts->timeout_ms < 0)
        return pd_err_set(err, PD_ERR_INVALID, "local comm: timeout %d ms < 0", opts->timeout_ms);
    pd_status st;
    pd_comm_local_group *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "local comm: %zu bytes", sizeof(*g));
    g->posts = calloc((size_t)n_ranks, sizeof(*g->posts));
    g->has_handle = calloc((size_t)n_ranks, 1);
    if (g->posts == NULL || g->has_handle == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "local comm: tables for %d ranks", n_ranks);
        goto err_free_tables;
    }
    if (pthread_mutex_init(&g->mu, NULL) != 0) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "local comm: pthread_mutex_init failed");
        goto err_free_tables;
    }
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc == 0) {
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        if (rc == 0)
            rc = pthread_cond_init(&g->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (rc != 0) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "local comm: condvar init: %s", strerror(rc));
        goto err_destroy_mutex;
    }
    g->n = n_ranks;
    g->refs = 1;
    g->copy = (opts != NULL && opts->copy != NULL) ? opts->copy : memcpy_copy;
    g->copy_ud = opts != NULL ? opts->copy_ud : NULL;
    g->timeout_ms = (opts != NULL && opts->timeout_ms > 0) ? opts->timeout_ms
                                                           : LOCAL_DEFAULT_TIMEOUT_MS;
    *out = g;
    return PD_OK;

err_destroy_mutex:
    pthread_mutex_destroy(&g->mu);
err_free_tables:
    free(g->has_handle);
    free(g->posts);
    free(g);
    return st;
}

pd_status pd_comm_local_create(pd_comm_local_group *g, int rank, pd_comm **out, pd_err *err)
{
    if (g == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "local comm: no group");
    if (rank < 0 || rank >= g->n)
        return pd_err_set(err, PD_ERR_INVALID, "local comm: rank %d of %d", rank, g->n);
    local_comm *lc = calloc(1, sizeof(*lc));
    if (lc == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "local comm: %zu bytes", sizeof(*lc));
    pthread_mutex_lock(&g->mu);
    if (g->has_handle[rank]) {
        pthread_mutex_unlock(&g->mu);
        free(lc);
        return pd_err_set(err, PD_ERR_BUSY, "local comm: rank %d already has a handle", rank);
    }
    g->has_handle[rank] = 1;
    g->refs++;
    pthread_mutex_unlock(&g->mu);
    lc->base.ops = &local_ops;
    lc->g = g;
    lc->rank = rank;
    *out = &lc->base;
    return PD_OK;
}

void pd_comm_local_group_destroy(pd_comm_local_group *g)
{
    if (g == NULL)
        return;
    pthread_mutex_lock(&g->mu);
    group_unref_locked_and_unlock(g);
}

/* ---- NCCL stubs for a build without CUDA ------------------------------------------------ */

#ifndef PD_HAVE_CUDA
int pd_comm_nccl_available(void) { return 0; }

pd_status pd_comm_nccl_id_create(pd_comm_nccl_id *out, pd_err *err)
{
    (void)out;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "nccl comm: built without CUDA");
}

pd_status pd_comm_nccl_create(const pd_comm_nccl_id *id, int n_ranks, int rank,
                              const pd_comm_nccl_opts *opts, pd_comm **out, pd_err *err)
{
    (void)id, (void)n_ranks, (void)rank, (void)opts, (void)out;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "nccl comm: built without CUDA");
}

pd_status pd_comm_nccl_create_all(int n_ranks, const pd_comm_nccl_opts *opts, pd_comm **out,
                                  pd_err *err)
{
    (void)n_ranks, (void)opts, (void)out;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "nccl comm: built without CUDA");
}
#endif
