/* pd_comm.h - communicator interface for a context-parallel group, and its implementations.
 * Owns: the pd_comm vtable and the checked wrappers every caller uses; the local communicator
 *       (ranks are threads of one process, collectives are copies); the declarations of the
 *       NCCL communicator (pd_comm_nccl.c, built only with CUDA).
 * Not here: which tokens go where (pd_cp.h), the CP forward.
 * Threading: each pd_comm handle belongs to one thread, the worker of its rank; collectives
 *       are called by every rank of the group in the same order with matching arguments.
 *       pd_comm_abort may be called from any thread. A local group object is shared by its
 *       rank threads and is internally locked.
 *
 * Completion: the local communicator is synchronous (the result is in place when the call
 * returns). The NCCL communicator enqueues on the rank's CUDA stream: results are ordered
 * before later work on that stream; pd_comm_barrier waits for the stream on the host.
 *
 * Failure: a collective never waits forever. The local communicator waits at most timeout_ms
 * for the other ranks; when the wait runs out (a rank never arrived) or a rank calls
 * pd_comm_abort, the group is *broken*: every rank blocked in or later entering a collective
 * gets PD_ERR_TIMEOUT (the wait ran out) or PD_ERR_PEER (aborted), and the group must be
 * destroyed and recreated. The NCCL communicator does the same with ncclCommAbort after its
 * own timeout (see pd_comm_nccl_opts). */
#ifndef PD_COMM_H
#define PD_COMM_H

#include <stddef.h>

#include "pd_status.h"

typedef struct pd_comm pd_comm;

typedef struct {
    const char *name;
    /* Each rank contributes `bytes` bytes from send; recv receives size * bytes bytes, rank r's
     * contribution at offset r * bytes. send may equal recv + rank * bytes (in place); recv
     * must not otherwise overlap any rank's send. */
    pd_status (*all_gather)(pd_comm *c, const void *send, void *recv, size_t bytes, pd_err *err);
    /* root's buf (bytes bytes) is copied into buf of every other rank. */
    pd_status (*broadcast)(pd_comm *c, void *buf, size_t bytes, int root, pd_err *err);
    /* recv[i] = sum over ranks of send[i] for i < count (f32); send may equal recv (in place).
     * Every rank receives the same values: the local communicator adds the ranks' buffers in
     * rank order, so results are bit-identical on every rank and from run to run. */
    pd_status (*all_reduce_sum)(pd_comm *c, const float *send, float *recv, size_t count,
                                pd_err *err);
    pd_status (*barrier)(pd_comm *c, pd_err *err);
    /* Breaks the group: ranks waiting in or entering a collective get PD_ERR_PEER. Any thread. */
    void (*abort)(pd_comm *c, const char *why);
    int (*rank)(const pd_comm *c);
    int (*size)(const pd_comm *c);
    void (*destroy)(pd_comm *c);
} pd_comm_ops;

/* Every implementation embeds this as its first member. */
struct pd_comm {
    const pd_comm_ops *ops;
};

/* Checked wrappers: PD_ERR_INVALID for c == NULL, NULL buffers with bytes > 0, or a root out of
 * range (checked on every rank before any waiting, so all ranks fail alike). bytes == 0 is a
 * valid collective that still synchronises the ranks. Other errors as described above. */
pd_status pd_comm_all_gather(pd_comm *c, const void *send, void *recv, size_t bytes, pd_err *err);
pd_status pd_comm_broadcast(pd_comm *c, void *buf, size_t bytes, int root, pd_err *err);
pd_status pd_comm_all_reduce_sum(pd_comm *c, const float *send, float *recv, size_t count,
                                 pd_err *err);
pd_status pd_comm_barrier(pd_comm *c, pd_err *err);
void pd_comm_abort(pd_comm *c, const char *why);
int pd_comm_rank(const pd_comm *c);
int pd_comm_size(const pd_comm *c);
const char *pd_comm_name(const pd_comm *c);
/* Frees the handle (not the group it belongs to); NULL is a no-op. A destroyed rank that the
 * others still wait for looks to them like a rank that never arrives. */
void pd_comm_destroy(pd_comm *c);

/* ---- local: ranks are threads of this process --------------------------------------------- */

/* Copies n bytes from src to dst: memcpy by default; a backend copy (e.g. device to device on
 * one GPU) otherwise. Called concurrently from every rank thread. Returns PD_OK or an error it
 * has written into err. */
typedef pd_status (*pd_comm_copy_fn)(void *ud, void *dst, const void *src, size_t n,
                                     pd_err *err);

/* A pd_comm_copy_fn for device memory of one process (a copy on the legacy stream, complete when
 * it returns): several local ranks on one GPU. PD_ERR_UNSUPPORTED in builds without CUDA. */
pd_status pd_comm_cuda_copy(void *ud, void *dst, const void *src, size_t n, pd_err *err);

typedef struct {
    pd_comm_copy_fn copy;   /* NULL: memcpy (host memory) */
    void *copy_ud;          /* borrowed; must outlive the group */
    int timeout_ms;         /* longest wait for the other ranks; 0: 60000 */
} pd_comm_local_opts;

typedef struct pd_comm_local_group pd_comm_local_group;

/* One group for n_ranks threads (1..1024); opts may be NULL for the defaults. Collectives pull
 * directly from the other ranks' buffers between two rendezvous, so buffers need only be
 * readable by every rank thread through `copy`. all_reduce_sum adds on the host, so it needs
 * host buffers: a group with a custom copy answers it with PD_ERR_UNSUPPORTED. PD_ERR_INVALID, PD_ERR_NOMEM, PD_ERR_INTERNAL
 * (pthread init failed). */
pd_status pd_comm_local_group_create(int n_ranks, const pd_comm_local_opts *opts,
                                     pd_comm_local_group **out, pd_err *err);
/* The handle of rank `rank`, for that rank's thread; at most one live handle per rank
 * (PD_ERR_BUSY otherwise). The handle holds a reference on the group. */
pd_status pd_comm_local_create(pd_comm_local_group *g, int rank, pd_comm **out, pd_err *err);
/* Drops the creator's reference; the group is freed with its last handle. NULL is a no-op. */
void pd_comm_local_group_destroy(pd_comm_local_group *g);

/* ---- NCCL: one GPU per rank (pd_comm_nccl.c, only when built with CUDA) ------------------- */

/* An ncclUniqueId by value, so this header does not need <nccl.h>. */
typedef struct {
    char bytes[128];
} pd_comm_nccl_id;

typedef struct {
    int device;             /* CUDA device of this rank */
    void *stream;           /* cudaStream_t the collectives run on (borrowed); NULL: a stream
                             * the communicator creates and owns */
    int timeout_ms;         /* longest wait for init or a barrier; 0: 600000 */
} pd_comm_nccl_opts;

/* 1 when this build has the NCCL communicator (PD_HAVE_CUDA), else 0; the functions below then
 * return PD_ERR_UNSUPPORTED. */
int pd_comm_nccl_available(void);
/* Rank 0 (or any one thread) creates the id and hands it to every rank. */
pd_status pd_comm_nccl_id_create(pd_comm_nccl_id *out, pd_err *err);
/* Called concurrently by all n_ranks rank threads (or processes), each with its own rank;
 * returns when all have joined, or PD_ERR_TIMEOUT after opts->timeout_ms (the partial
 * communicator is aborted). PD_ERR_CUDA for a CUDA or NCCL failure. */
pd_status pd_comm_nccl_create(const pd_comm_nccl_id *id, int n_ranks, int rank,
                              const pd_comm_nccl_opts *opts, pd_comm **out, pd_err *err);
/* One thread creates all n_ranks handles of a single-process group at once
 * (ncclCommInitAll); opts[r] describes rank r. out[] receives n_ranks handles, one for each
 * rank's thread. */
pd_status pd_comm_nccl_create_all(int n_ranks, const pd_comm_nccl_opts *opts, pd_comm **out,
                                  pd_err *err);

#endif
