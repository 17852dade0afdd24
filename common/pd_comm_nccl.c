/* pd_comm_nccl.c - the NCCL communicator: one GPU per rank, one worker thread (or process) per
 * GPU, collectives enqueued on the rank's CUDA stream.
 * Owns: NCCL communicator init (per-rank ncclCommInitRankConfig, or all ranks of one process in
 *       one NCCL group), ncclAllGather / ncclBroadcast, a bounded barrier, abort and teardown.
 * Not here: the interface and the local communicator (pd_comm.c), which ranks hold which
 *       tokens (pd_cp.c).
 * Threading: a handle belongs to its rank's thread, which must be the only one enqueueing NCCL
 *       work on it; pd_comm_abort may come from any thread and only raises a flag that the
 *       rank thread acts on at its next wait (NCCL calls on one communicator are not made from
 *       two threads at once).
 *
 * Hang safety: communicators are created non-blocking (ncclConfig_t.blocking = 0), so every
 * NCCL call returns at once and this file polls ncclCommGetAsyncError, with a deadline, until
 * the call has settled. Init and barrier (which polls the stream) give up after timeout_ms:
 * the communicator is then aborted (ncclCommAbort) and the call returns PD_ERR_TIMEOUT; all
 * later calls on the handle return PD_ERR_PEER. Work already enqueued on the stream is not
 * waited on by anything here except pd_comm_barrier, so callers wait on the stream through
 * pd_comm_barrier, not cudaStreamSynchronize, when a peer may be gone.
 *
 * The whole body is compiled only with PD_HAVE_CUDA; pd_comm.c has the stubs otherwise. */
#ifdef PD_HAVE_CUDA

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd_comm.h"
#include "pd_log.h"

#define NCCL_DEFAULT_TIMEOUT_MS 600000

_Static_assert(sizeof(pd_comm_nccl_id) == sizeof(ncclUniqueId), "pd_comm_nccl_id size");

typedef struct {
    pd_comm base;
    ncclComm_t nccl;
    int rank;
    int size;
    int device;
    cudaStream_t stream;
    int own_stream;
    int timeout_ms;
    int *d_scratch;            /* one int on the device, for the barrier's all-reduce */
    int dead;                  /* aborted: every later call fails (rank thread only) */
    atomic_int abort_req;      /* set by pd_comm_abort from any thread */
} nccl_comm;

#define CUDA_TRY(expr, err)                                                                  \
    do {                                                                                     \
        cudaError_t cuda_try_rc_ = (expr);                                                   \
        if (cuda_try_rc_ != cudaSuccess)                                                     \
            return pd_err_set((err), PD_ERR_CUDA, "%s: %s (%s:%d)", #expr,                   \
                              cudaGetErrorString(cuda_try_rc_), __FILE__, __LINE__);         \
    } while (0)

static pd_status nccl_fail(ncclResult_t rc, const char *what, pd_err *err)
{
    return pd_err_set(err, PD_ERR_CUDA, "nccl %s: %s", what, ncclGetErrorString(rc));
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void nap(void)
{
    struct timespec ts = { 0, 50000 }; /* 50 us: cheap next to any collective worth waiting on */
    nanosleep(&ts, NULL);
}

static void kill_comm(nccl_comm *c, const char *why)
{
    if (c->dead)
        return;
    c->dead = 1;
    PD_LOG_ERROR("comm", "nccl rank %d: aborting communicator: %s", c->rank, why);
    ncclCommAbort(c->nccl);
    c->nccl = NULL;
}

/* Poll one communicator until its last non-blocking call has settled. */
static pd_status settle(nccl_comm *c, const char *what, double deadline, pd_err *err)
{
    for (;;) {
        if (atomic_load(&c->abort_req)) {
            kill_comm(c, "abort requested");
            return pd_err_set(err, PD_ERR_PEER, "nccl rank %d %s: aborted", c->rank, what);
        }
        ncclResult_t state;
        ncclResult_t rc = ncclCommGetAsyncError(c->nccl, &state);
        if (rc != ncclSuccess)
            return nccl_fail(rc, what, err);
        if (state == ncclSuccess)
            return PD_OK;
        if (state != ncclInProgress) {
            pd_status st = nccl_fail(state, what, err);
            kill_comm(c, "async error");
            return st;
        }
        if (now_ms() > deadline) {
            kill_comm(c, "timeout");
            return pd_err_set(err, PD_ERR_TIMEOUT, "nccl rank %d %s: no progress in %d ms",
                              c->rank, what, c->timeout_ms);
        }
        nap();
    }
}

static pd_status check_alive(nccl_comm *c, const char *what, pd_err *err)
{
    if (!c->dead && atomic_load(&c->abort_req))
        kill_comm(c, "abort requested");
    if (c->dead)
        return pd_err_set(err, PD_ERR_PEER, "nccl rank %d %s: communicator aborted", c->rank,
                          what);
    CUDA_TRY(cudaSetDevice(c->device), err);
    return PD_OK;
}

/* A non-blocking NCCL call: ncclInProgress is the normal answer; settle() waits it out. */
static pd_status enqueued(nccl_comm *c, ncclResult_t rc, const char *what, pd_err *err)
{
    if (rc != ncclSuccess && rc != ncclInProgress)
        return nccl_fail(rc, what, err);
    return settle(c, what, now_ms() + c->timeout_ms, err);
}

static pd_status nccl_all_gather(pd_comm *base, const void *send, void *recv, size_t bytes,
                                 pd_err *err)
{
    nccl_comm *c = (nccl_comm *)base;
    pd_status st = check_alive(c, "all_gather", err);
    if (st != PD_OK)
        return st;
    return enqueued(c, ncclAllGather(send, recv, bytes, ncclUint8, c->nccl, c->stream),
                    "all_gather", err);
}

static pd_status nccl_broadcast(pd_comm *base, void *buf, size_t bytes, int root, pd_err *err)
{
    nccl_comm *c = (nccl_comm *)base;
    pd_status st = check_alive(c, "broadcast", err);
    if (st != PD_OK)
        return st;
    return enqueued(c, ncclBroadcast(buf, buf, bytes, ncclUint8, root, c->nccl, c->stream),
                    "broadcast", err);
}

/* Sums in f32 on the stream; NCCL's reduction order is its own, but every rank receives the
 * same result. */
static pd_status nccl_all_reduce_sum(pd_comm *base, const float *send, float *recv, size_t count,
                                     pd_err *err)
{
    nccl_comm *c = (nccl_comm *)base;
    pd_status st = check_alive(c, "all_reduce", err);
    if (st != PD_OK)
        return st;
    return enqueued(c, ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, c->nccl, c->stream),
                    "all_reduce", err);
}

/* NCCL has no barrier: a one-int all-reduce, then the host waits for the stream, bounded. */
static pd_status nccl_barrier(pd_comm *base, pd_err *err)
{
    nccl_comm *c = (nccl_comm *)base;
    pd_status st = check_alive(c, "barrier", err);
    if (st != PD_OK)
        return st;
    st = enqueued(c, ncclAllReduce(c->d_scratch, c->d_scratch, 1, ncclInt32, ncclSum, c->nccl,
                                   c->stream),
                  "barrier", err);
    if (st != PD_OK)
        return st;
    double deadline = now_ms() + c->timeout_ms;
    for (;;) {
        cudaError_t q = cudaStreamQuery(c->stream);
        if (q == cudaSuccess)
            return PD_OK;
        if (q != cudaErrorNotReady)
            return pd_err_set(err, PD_ERR_CUDA, "nccl rank %d barrier: stream: %s", c->rank,
                              cudaGetErrorString(q));
        /* a peer's failure shows up here as an async error while our stream is stuck */
        st = settle(c, "barrier", deadline, err);
        if (st != PD_OK)
            return st;
        if (now_ms() > deadline) {
            kill_comm(c, "barrier timeout");
            return pd_err_set(err, PD_ERR_TIMEOUT, "nccl rank %d barrier: stream not done in %d ms",
                              c->rank, c->timeout_ms);
        }
        nap();
    }
}

static void nccl_abort(pd_comm *base, const char *why)
{
    nccl_comm *c = (nccl_comm *)base;
    PD_LOG_WARN("comm", "nccl rank %d: abort requested: %s", c->rank, why);
    atomic_store(&c->abort_req, 1);
}

static int nccl_rank(const pd_comm *base) { return ((const nccl_comm *)base)->rank; }
static int nccl_size(const pd_comm *base) { return ((const nccl_comm *)base)->size; }

static void nccl_destroy(pd_comm *base)
{
    nccl_comm *c = (nccl_comm *)base;
    cudaSetDevice(c->device);
    if (!c->dead && c->nccl != NULL) {
        /* finalize flushes outstanding work; if that hangs on a lost peer, abort instead */
        ncclResult_t rc = ncclCommFinalize(c->nccl);
        pd_err e;
        if ((rc != ncclSuccess && rc != ncclInProgress) ||
            settle(c, "finalize", now_ms() + c->timeout_ms, &e) != PD_OK)
            kill_comm(c, "finalize failed");
        else
            ncclCommDestroy(c->nccl);
    }
    if (c->d_scratch != NULL)
        cudaFree(c->d_scratch);
    if (c->own_stream && c->stream != NULL)
        cudaStreamDestroy(c->stream);
    free(c);
}

static const pd_comm_ops nccl_ops = {
    .name = "nccl",
    .all_gather = nccl_all_gather,
    .broadcast = nccl_broadcast,
    .all_reduce_sum = nccl_all_reduce_sum,
    .barrier = nccl_barrier,
    .abort = nccl_abort,
    .rank = nccl_rank,
    .size = nccl_size,
    .destroy = nccl_destroy,
};

int pd_comm_nccl_available(void) { return 1; }

pd_status pd_comm_nccl_id_create(pd_comm_nccl_id *out, pd_err *err)
{
    ncclUniqueId id;
    ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess)
        return nccl_fail(rc, "get unique id", err);
    memcpy(out->bytes, id.internal, sizeof(out->bytes));
    return PD_OK;
}

/* The CUDA side of one rank (stream, scratch); the NCCL communicator is filled in later. */
static pd_status rank_alloc(int n_ranks, int rank, const pd_comm_nccl_opts *opts,
                            nccl_comm **out, pd_err *err)
{
    if (opts == NULL || opts->device < 0 || opts->timeout_ms < 0)
        return pd_err_set(err, PD_ERR_INVALID, "nccl rank %d: bad options", rank);
    nccl_comm *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "nccl comm: %zu bytes", sizeof(*c));
    c->base.ops = &nccl_ops;
    c->rank = rank;
    c->size = n_ranks;
    c->device = opts->device;
    c->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : NCCL_DEFAULT_TIMEOUT_MS;
    atomic_init(&c->abort_req, 0);
    pd_status st;
    cudaError_t ce = cudaSetDevice(c->device);
    if (ce == cudaSuccess && opts->stream == NULL) {
        ce = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
        c->own_stream = ce == cudaSuccess;
    } else {
        c->stream = (cudaStream_t)opts->stream;
    }
    if (ce == cudaSuccess)
        ce = cudaMalloc((void **)&c->d_scratch, sizeof(int));
    if (ce == cudaSuccess)
        ce = cudaMemset(c->d_scratch, 0, sizeof(int));
    if (ce != cudaSuccess) {
        st = pd_err_set(err, PD_ERR_CUDA, "nccl rank %d on device %d: %s", rank, c->device,
                        cudaGetErrorString(ce));
        c->dead = 1; /* no communicator yet: destroy only frees the CUDA side */
        nccl_destroy(&c->base);
        return st;
    }
    *out = c;
    return PD_OK;
}

static void init_config(ncclConfig_t *cfg)
{
    ncclConfig_t tmp = NCCL_CONFIG_INITIALIZER;
    tmp.blocking = 0;
    *cfg = tmp;
}

pd_status pd_comm_nccl_create(const pd_comm_nccl_id *id, int n_ranks, int rank,
                              const pd_comm_nccl_opts *opts, pd_comm **out, pd_err *err)
{
    if (id == NULL || n_ranks < 1 || rank < 0 || rank >= n_ranks)
        return pd_err_set(err, PD_ERR_INVALID, "nccl comm: rank %d of %d", rank, n_ranks);
    nccl_comm *c;
    pd_status st = rank_alloc(n_ranks, rank, opts, &c, err);
    if (st != PD_OK)
        return st;
    ncclUniqueId uid;
    memcpy(uid.internal, id->bytes, sizeof(uid.internal));
    ncclConfig_t cfg;
    init_config(&cfg);
    ncclResult_t rc = ncclCommInitRankConfig(&c->nccl, n_ranks, uid, rank, &cfg);
    if (rc != ncclSuccess && rc != ncclInProgress) {
        st = nccl_fail(rc, "init rank", err);
        goto err_destroy;
    }
    st = settle(c, "init", now_ms() + c->timeout_ms, err);
    if (st != PD_OK)
        goto err_destroy;
    PD_LOG_DEBUG("comm", "nccl rank %d of %d up on device %d", rank, n_ranks, c->device);
    *out = &c->base;
    return PD_OK;

err_destroy:
    if (c->nccl != NULL && !c->dead) {
        ncclCommAbort(c->nccl);
        c->nccl = NULL;
    }
    c->dead = 1;
    nccl_destroy(&c->base);
    return st;
}

pd_status pd_comm_nccl_create_all(int n_ranks, const pd_comm_nccl_opts *opts, pd_comm **out,
                                  pd_err *err)
{
    if (n_ranks < 1 || opts == NULL || out == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "nccl comm: %d ranks", n_ranks);
    nccl_comm **cs = calloc((size_t)n_ranks, sizeof(*cs));
    if (cs == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "nccl comm: %d ranks", n_ranks);
    pd_comm_nccl_id id;
    pd_status st = pd_comm_nccl_id_create(&id, err);
    if (st != PD_OK)
        goto err_free;
    for (int r = 0; r < n_ranks; r++) {
        st = rank_alloc(n_ranks, r, &opts[r], &cs[r], err);
        if (st != PD_OK)
            goto err_destroy;
    }
    ncclUniqueId uid;
    memcpy(uid.internal, id.bytes, sizeof(uid.internal));
    ncclConfig_t cfg;
    init_config(&cfg);
    /* one thread initialising several ranks must group the calls (what ncclCommInitAll does) */
    ncclResult_t rc = ncclGroupStart();
    for (int r = 0; r < n_ranks && rc == ncclSuccess; r++) {
        cudaSetDevice(cs[r]->device);
        rc = ncclCommInitRankConfig(&cs[r]->nccl, n_ranks, uid, r, &cfg);
        if (rc == ncclInProgress)
            rc = ncclSuccess;
    }
    ncclResult_t rc_end = ncclGroupEnd();
    if (rc == ncclSuccess && rc_end != ncclInProgress)
        rc = rc_end;
    if (rc != ncclSuccess) {
        st = nccl_fail(rc, "init all", err);
        goto err_destroy;
    }
    double deadline = now_ms() + cs[0]->timeout_ms;
    for (int r = 0; r < n_ranks; r++) {
        st = settle(cs[r], "init", deadline, err);
        if (st != PD_OK)
            goto err_destroy;
    }
    for (int r = 0; r < n_ranks; r++)
        out[r] = &cs[r]->base;
    free(cs);
    return PD_OK;

err_destroy:
    for (int r = 0; r < n_ranks; r++) {
        if (cs[r] == NULL)
            continue;
        if (cs[r]->nccl != NULL && !cs[r]->dead) {
            ncclCommAbort(cs[r]->nccl);
            cs[r]->nccl = NULL;
        }
        cs[r]->dead = 1;
        nccl_destroy(&cs[r]->base);
    }
err_free:
    free(cs);
    return st;
}

pd_status pd_comm_cuda_copy(void *ud, void *dst, const void *src, size_t n, pd_err *err)
{
    (void)ud;
    /* a device-to-device cudaMemcpy may return before the copy is done, and it runs on the
     * legacy stream, which the backends' non-blocking streams do not wait for: the copy must be
     * complete before the collective returns (this rank's kernels read dst next, and the other
     * ranks overwrite src once every rank has passed the closing rendezvous) */
    cudaError_t ce = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, cudaStreamLegacy);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(cudaStreamLegacy);
    if (ce != cudaSuccess)
        return pd_err_set(err, PD_ERR_CUDA, "local comm copy of %zu bytes: %s", n, cudaGetErrorString(ce));
    return PD_OK;
}

#else
#include "pd_comm.h"

pd_status pd_comm_cuda_copy(void *ud, void *dst, const void *src, size_t n, pd_err *err)
{
    (void)ud;
    (void)dst;
    (void)src;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "local comm copy of %zu device bytes: no CUDA in this build", n);
}
#endif /* PD_HAVE_CUDA */
