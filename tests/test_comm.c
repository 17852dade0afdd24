/* test_comm.c - the local communicator: repeated all-gather / broadcast / barrier over 1..8 rank
 * threads, all-reduce sums over 1..5 ranks (rank order, bit-identical on every rank), in-place and zero-byte collectives, a custom copy function, mismatched calls, a rank
 * that never arrives (timeout, not a hang), abort, bad arguments; and the CP round trip the
 * CP forward performs: shard by a pd_cp plan, all-gather, re-range into global order. With PD_TEST_NCCL_GPUS=N set
 * (and a CUDA build) it also runs the NCCL communicator over N GPUs.
 * Threading: one thread per rank, each with its own handle. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pd_comm.h"
#include "pd_cp.h"
#include "test_util.h"

#ifdef PD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

/* TEST_CHECK counts in plain ints; rank threads report through atomics instead. */
static atomic_int thread_fail;

#define T_CHECK(cond)                                                                        \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            atomic_fetch_add(&thread_fail, 1);                                               \
            fprintf(stderr, "FAIL %s:%d (thread): %s\n", __FILE__, __LINE__, #cond);         \
        }                                                                                    \
    } while (0)

typedef struct {
    pd_comm *c;
    int rank;
    int n;
    int iters;
} rank_arg;

static unsigned char pattern(int rank, int iter, size_t i)
{
    return (unsigned char)(rank * 31 + iter * 7 + (int)i * 3 + 1);
}

static void *rank_main(void *p)
{
    rank_arg *a = p;
    pd_comm *c = a->c;
    pd_err err;
    T_CHECK(pd_comm_rank(c) == a->rank && pd_comm_size(c) == a->n);
    T_CHECK(strcmp(pd_comm_name(c), "local") == 0);
    enum { MAXB = 300 };
    unsigned char send[MAXB], recv[8 * MAXB], bc[MAXB];
    for (int it = 0; it < a->iters; it++) {
        size_t bytes = (size_t)((it * 37) % MAXB); /* includes 0; same on every rank */
        for (size_t i = 0; i < bytes; i++)
            send[i] = pattern(a->rank, it, i);
        memset(recv, 0xEE, sizeof(recv));
        T_CHECK(pd_comm_all_gather(c, send, recv, bytes, &err) == PD_OK);
        int bad = 0;
        for (int r = 0; r < a->n; r++)
            for (size_t i = 0; i < bytes; i++)
                bad += recv[(size_t)r * bytes + i] != pattern(r, it, i);
        T_CHECK(bad == 0);

        /* in place: this rank's part already sits in recv */
        for (size_t i = 0; i < bytes; i++)
            recv[(size_t)a->rank * bytes + i] = pattern(a->rank, it + 1, i);
        T_CHECK(pd_comm_all_gather(c, recv + (size_t)a->rank * bytes, recv, bytes, &err) ==
                PD_OK);
        bad = 0;
        for (int r = 0; r < a->n; r++)
            for (size_t i = 0; i < bytes; i++)
                bad += recv[(size_t)r * bytes + i] != pattern(r, it + 1, i);
        T_CHECK(bad == 0);

        int root = it % a->n;
        for (size_t i = 0; i < bytes; i++)
            bc[i] = a->rank == root ? pattern(100 + root, it, i) : 0;
        T_CHECK(pd_comm_broadcast(c, bc, bytes, root, &err) == PD_OK);
        bad = 0;
        for (size_t i = 0; i < bytes; i++)
            bad += bc[i] != pattern(100 + root, it, i);
        T_CHECK(bad == 0);
        if (it % 5 == 0)
            T_CHECK(pd_comm_barrier(c, &err) == PD_OK);
    }
    pd_comm_destroy(c);
    return NULL;
}

static void test_comm_local_collectives(void)
{
    for (int n = 1; n <= 8; n++) {
        pd_comm_local_group *g = NULL;
        pd_err err;
        TEST_CHECK(pd_comm_local_group_create(n, NULL, &g, &err) == PD_OK);
        pthread_t th[8];
        rank_arg args[8];
        for (int r = 0; r < n; r++) {
            args[r] = (rank_arg){ .rank = r, .n = n, .iters = 200 };
            TEST_CHECK(pd_comm_local_create(g, r, &args[r].c, &err) == PD_OK);
        }
        /* the creator's reference may go first: the rank handles keep the group alive, and
         * each rank thread destroys its own handle */
        pd_comm_local_group_destroy(g);
        for (int r = 0; r < n; r++)
            TEST_CHECK(pthread_create(&th[r], NULL, rank_main, &args[r]) == 0);
        for (int r = 0; r < n; r++)
            pthread_join(th[r], NULL);
    }
    TEST_CHECK(atomic_load(&thread_fail) == 0);
}

/* ---- all-reduce: rank-order f32 sums, bit-identical on every rank ----------------------- */

static float ar_value(int rank, int iter, size_t i)
{
    /* values whose sum depends on the order of the additions */
    return (float)((rank + 1) * 0.1f + (float)((i * 7 + (size_t)iter) % 13) * 1e-7f +
                   (rank % 2 ? 1e4f : -1e4f) * (float)(i % 3 == 0));
}

typedef struct {
    pd_comm *c;
    int rank, n;
    float **out;           /* [n] each rank's last in-place result, for the cross-rank check */
    size_t out_count;
} ar_arg;

static void *ar_rank_main(void *p)
{
    ar_arg *a = p;
    pd_err err;
    enum { MAXC = 5000 };
    float *send = malloc(MAXC * sizeof(float)), *recv = malloc(MAXC * sizeof(float));
    for (int it = 0; it < 40; it++) {
        size_t count = (size_t)(it * 997) % MAXC;
        for (size_t i = 0; i < count; i++)
            send[i] = ar_value(a->rank, it, i);
        int in_place = it % 2;
        T_CHECK(pd_comm_all_reduce_sum(a->c, send, in_place ? send : recv, count, &err) == PD_OK);
        const float *got = in_place ? send : recv;
        int bad = 0;
        for (size_t i = 0; i < count; i++) {
            float want = ar_value(0, it, i);
            for (int r = 1; r < a->n; r++)
                want += ar_value(r, it, i);
            bad += memcmp(&want, &got[i], sizeof(float)) != 0;
        }
        T_CHECK(bad == 0);
        if (it == 39) {
            memcpy(a->out[a->rank], got, count * sizeof(float));
            a->out_count = count;
        }
    }
    free(send);
    free(recv);
    return NULL;
}

static void test_comm_local_all_reduce(void)
{
    for (int n = 1; n <= 5; n++) {
        pd_comm_local_group *g = NULL;
        pd_err err;
        TEST_CHECK(pd_comm_local_group_create(n, NULL, &g, &err) == PD_OK);
        pthread_t th[5];
        ar_arg args[5];
        float *outs[5];
        for (int r = 0; r < n; r++) {
            outs[r] = malloc(5000 * sizeof(float));
            args[r] = (ar_arg){ .rank = r, .n = n, .out = outs };
            TEST_CHECK(pd_comm_local_create(g, r, &args[r].c, &err) == PD_OK);
        }
        for (int r = 0; r < n; r++)
            TEST_CHECK(pthread_create(&th[r], NULL, ar_rank_main, &args[r]) == 0);
        for (int r = 0; r < n; r++)
            pthread_join(th[r], NULL);
        for (int r = 1; r < n; r++)
            TEST_CHECK(memcmp(outs[0], outs[r], args[0].out_count * sizeof(float)) == 0);
        for (int r = 0; r < n; r++) {
            pd_comm_destroy(args[r].c);
            free(outs[r]);
        }
        pd_comm_local_group_destroy(g);
    }
    TEST_CHECK(atomic_load(&thread_fail) == 0);
}

/* ---- failure cases ---------------------------------------------------------------------- */

typedef struct {
    pd_comm *c;
    int mode;          /* 0 all_gather 8 bytes, 1 all_gather 16 bytes, 2 barrier, 3 abort,
                        * 4 all_reduce of 2 floats (8 bytes, as mode 0) */
    pd_status st;
    double secs;
} fail_arg;

static void *fail_main(void *p)
{
    fail_arg *a = p;
    unsigned char send[16] = { 0 }, recv[16 * 8];
    pd_err err;
    double t0 = test_now_s();
    switch (a->mode) {
    case 0: a->st = pd_comm_all_gather(a->c, send, recv, 8, &err); break;
    case 1: a->st = pd_comm_all_gather(a->c, send, recv, 16, &err); break;
    case 2: a->st = pd_comm_barrier(a->c, &err); break;
    case 4: a->st = pd_comm_all_reduce_sum(a->c, (float *)send, (float *)send, 2, &err); break;
    case 3:
        usleep(50000);
        pd_comm_abort(a->c, "test");
        a->st = PD_OK;
        break;
    }
    a->secs = test_now_s() - t0;
    return NULL;
}

static void run_ranks(pd_comm **cs, fail_arg *args, const int *modes, int n)
{
    pthread_t th[8];
    for (int r = 0; r < n; r++) {
        args[r] = (fail_arg){ .c = cs[r], .mode = modes[r], .st = PD_ERR_INTERNAL };
        pthread_create(&th[r], NULL, fail_main, &args[r]);
    }
    for (int r = 0; r < n; r++)
        pthread_join(th[r], NULL);
}

static void make_group(int n, int timeout_ms, pd_comm_local_group **g, pd_comm **cs)
{
    pd_comm_local_opts o = { .timeout_ms = timeout_ms };
    pd_err err;
    TEST_CHECK(pd_comm_local_group_create(n, &o, g, &err) == PD_OK);
    for (int r = 0; r < n; r++)
        TEST_CHECK(pd_comm_local_create(*g, r, &cs[r], &err) == PD_OK);
}

static void free_group(pd_comm_local_group *g, pd_comm **cs, int n)
{
    for (int r = 0; r < n; r++)
        pd_comm_destroy(cs[r]);
    pd_comm_local_group_destroy(g);
}

static void test_comm_local_timeout(void)
{
    /* ranks 0 and 1 gather, rank 2 never arrives: both time out after ~200 ms */
    pd_comm_local_group *g;
    pd_comm *cs[3];
    fail_arg args[3];
    make_group(3, 200, &g, cs);
    int modes[2] = { 0, 0 };
    double t0 = test_now_s();
    run_ranks(cs, args, modes, 2);
    double dt = test_now_s() - t0;
    TEST_CHECK(args[0].st == PD_ERR_TIMEOUT && args[1].st == PD_ERR_TIMEOUT);
    TEST_CHECK_MSG(dt >= 0.15 && dt < 5.0, "timeout took %.3f s", dt);
    /* the late rank finds the group broken at once, and so does any later call */
    pd_err err;
    unsigned char b[8] = { 0 }, rb[24];
    t0 = test_now_s();
    TEST_CHECK(pd_comm_all_gather(cs[2], b, rb, 8, &err) == PD_ERR_TIMEOUT);
    TEST_CHECK(strstr(err.msg, "broken") != NULL);
    TEST_CHECK(pd_comm_barrier(cs[0], &err) == PD_ERR_TIMEOUT);
    TEST_CHECK(test_now_s() - t0 < 0.1);
    free_group(g, cs, 3);
}

static void test_comm_local_abort(void)
{
    pd_comm_local_group *g;
    pd_comm *cs[3];
    fail_arg args[3];
    make_group(3, 30000, &g, cs);
    int modes[3] = { 2, 2, 3 }; /* two wait in a barrier, the third aborts instead */
    run_ranks(cs, args, modes, 3);
    TEST_CHECK(args[0].st == PD_ERR_PEER && args[1].st == PD_ERR_PEER);
    TEST_CHECK(args[0].secs < 5.0 && args[1].secs < 5.0);
    free_group(g, cs, 3);
}

static void test_comm_local_mismatch(void)
{
    pd_comm_local_group *g;
    pd_comm *cs[2];
    fail_arg args[2];
    make_group(2, 5000, &g, cs);
    int modes[2] = { 0, 1 }; /* 8 vs 16 bytes */
    run_ranks(cs, args, modes, 2);
    TEST_CHECK(args[0].st == PD_ERR_INVALID && args[1].st == PD_ERR_INVALID);
    int modes2[2] = { 0, 2 }; /* all_gather vs barrier */
    run_ranks(cs, args, modes2, 2);
    TEST_CHECK(args[0].st == PD_ERR_INVALID && args[1].st == PD_ERR_INVALID);
    int modes3[2] = { 0, 4 }; /* all_gather vs all_reduce of the same byte count */
    run_ranks(cs, args, modes3, 2);
    TEST_CHECK(args[0].st == PD_ERR_INVALID && args[1].st == PD_ERR_INVALID);
    int ok[2] = { 1, 1 }; /* the group is still usable */
    run_ranks(cs, args, ok, 2);
    TEST_CHECK(args[0].st == PD_OK && args[1].st == PD_OK);
    free_group(g, cs, 2);
}

static atomic_int copies;

static pd_status counting_copy(void *ud, void *dst, const void *src, size_t n, pd_err *err)
{
    (void)err;
    atomic_fetch_add(&copies, 1);
    TEST_CHECK(ud == (void *)&copies);
    memcpy(dst, src, n);
    return PD_OK;
}

static void test_comm_local_misc(void)
{
    pd_err err;
    pd_comm_local_group *g = NULL;
    TEST_CHECK(pd_comm_local_group_create(0, NULL, &g, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_local_group_create(-3, NULL, &g, &err) == PD_ERR_INVALID);
    pd_comm_local_opts bad = { .timeout_ms = -1 };
    TEST_CHECK(pd_comm_local_group_create(2, &bad, &g, &err) == PD_ERR_INVALID);
    TEST_CHECK(g == NULL);

    pd_comm_local_opts o = { .copy = counting_copy, .copy_ud = &copies, .timeout_ms = 1000 };
    TEST_CHECK(pd_comm_local_group_create(1, &o, &g, &err) == PD_OK);
    pd_comm *c = NULL, *c2 = NULL;
    TEST_CHECK(pd_comm_local_create(g, 1, &c, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_local_create(g, 0, &c, &err) == PD_OK);
    TEST_CHECK(pd_comm_local_create(g, 0, &c2, &err) == PD_ERR_BUSY);
    int x = 42, y = 0;
    TEST_CHECK(pd_comm_all_gather(c, &x, &y, sizeof(x), &err) == PD_OK);
    TEST_CHECK(y == 42 && atomic_load(&copies) == 1);
    TEST_CHECK(pd_comm_broadcast(c, &x, sizeof(x), 1, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_broadcast(c, &x, sizeof(x), -1, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_broadcast(c, NULL, 4, 0, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_all_gather(c, NULL, &y, 4, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_all_gather(NULL, &x, &y, 4, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_barrier(NULL, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_barrier(c, &err) == PD_OK);
    /* all_reduce adds on the host: a group with a device copy refuses it by name */
    float f = 1.0f;
    TEST_CHECK(pd_comm_all_reduce_sum(c, &f, &f, 1, &err) == PD_ERR_UNSUPPORTED);
    TEST_CHECK(strstr(err.msg, "all_reduce") != NULL);
    TEST_CHECK(pd_comm_all_reduce_sum(c, NULL, &f, 1, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_all_reduce_sum(NULL, &f, &f, 1, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_comm_rank(NULL) == -1 && pd_comm_size(NULL) == 0);
    pd_comm_destroy(c);
    /* the rank's slot is free again once its handle is gone */
    TEST_CHECK(pd_comm_local_create(g, 0, &c, &err) == PD_OK);
    pd_comm_destroy(c);
    pd_comm_destroy(NULL);
    pd_comm_local_group_destroy(g);
    pd_comm_local_group_destroy(NULL);
}

/* ---- CP round trip: pd_cp plan + local all-gather, as the CP forward uses them ------------ */

typedef struct {
    pd_comm *c;
    const pd_cp_plan *plan;
    const float *global;   /* [T, W] */
    int ok;
} cp_arg;

enum { CP_W = 64 };

static void *cp_rank_main(void *p)
{
    cp_arg *a = p;
    const pd_cp_plan *plan = a->plan;
    int me = pd_comm_rank(a->c);
    size_t row = CP_W * sizeof(float);
    float *local = malloc((size_t)plan->n_local * row + 1);
    float *gathered = malloc((size_t)plan->n_slots * row + 1);
    float *out = malloc((size_t)plan->n_tokens * row);
    pd_err err;
    a->ok = pd_cp_shard_rows(plan, me, a->global, local, row, &err) == PD_OK;
    /* the "layer": every rank transforms its own rows; padding rows stay zero */
    for (int32_t s = 0; s < plan->n_local; s++)
        for (int k = 0; k < CP_W; k++)
            local[(size_t)s * CP_W + k] *= 2.0f;
    a->ok &= pd_comm_all_gather(a->c, local, gathered, (size_t)plan->n_local * row, &err) ==
             PD_OK;
    a->ok &= pd_cp_gather_rows(plan, gathered, out, row, &err) == PD_OK;
    for (size_t i = 0; i < (size_t)plan->n_tokens * CP_W; i++)
        a->ok &= out[i] == 2.0f * a->global[i];
    free(local);
    free(gathered);
    free(out);
    return NULL;
}

static void test_comm_cp_roundtrip(void)
{
    int32_t lens[3] = { 37, 300, 21 };
    int32_t T = 37 + 300 + 21;
    float *global = malloc((size_t)T * CP_W * sizeof(float));
    for (int32_t i = 0; i < T * CP_W; i++)
        global[i] = (float)(i % 1000) - 500.0f;
    static const pd_cp_strategy strats[] = { PD_CP_STRATEGY_ROUND_ROBIN,
                                             PD_CP_STRATEGY_INTERLEAVE, PD_CP_STRATEGY_ZIGZAG };
    for (int cp = 1; cp <= 8; cp++)
        for (int si = 0; si < 3; si++) {
            pd_cp_opts o = { .strategy = strats[si], .cp_size = cp };
            pd_cp_plan *plan = NULL;
            pd_comm_local_group *g = NULL;
            pd_err err;
            TEST_CHECK(pd_cp_plan_create(lens, NULL, 3, &o, &plan, &err) == PD_OK);
            TEST_CHECK(pd_comm_local_group_create(cp, NULL, &g, &err) == PD_OK);
            if (plan == NULL || g == NULL)
                continue;
            pthread_t th[8];
            cp_arg args[8];
            for (int r = 0; r < cp; r++) {
                args[r] = (cp_arg){ .plan = plan, .global = global };
                TEST_CHECK(pd_comm_local_create(g, r, &args[r].c, &err) == PD_OK);
            }
            for (int r = 0; r < cp; r++)
                pthread_create(&th[r], NULL, cp_rank_main, &args[r]);
            int ok = 1;
            for (int r = 0; r < cp; r++) {
                pthread_join(th[r], NULL);
                ok &= args[r].ok;
                pd_comm_destroy(args[r].c);
            }
            TEST_CHECK_MSG(ok, "cp round trip %s cp %d", pd_cp_strategy_name(o.strategy), cp);
            pd_comm_local_group_destroy(g);
            pd_cp_plan_destroy(plan);
        }
    free(global);
}

/* ---- NCCL, opt-in: PD_TEST_NCCL_GPUS=N ---------------------------------------------------- */

#ifdef PD_HAVE_CUDA
typedef struct {
    pd_comm *c;
    int iters;
    int n;
} nccl_arg;

static void *nccl_rank_main(void *p)
{
    nccl_arg *a = p;
    int me = pd_comm_rank(a->c);
    pd_err err;
    enum { N = 1 << 16 };
    unsigned char *h = malloc((size_t)N * (size_t)a->n), *d_send = NULL, *d_recv = NULL;
    T_CHECK(cudaMalloc((void **)&d_send, N) == cudaSuccess);
    T_CHECK(cudaMalloc((void **)&d_recv, (size_t)N * (size_t)a->n) == cudaSuccess);
    for (int it = 0; it < a->iters; it++) {
        size_t bytes = (size_t)(1 + (it * 4099) % N);
        for (size_t i = 0; i < bytes; i++)
            h[i] = pattern(me, it, i);
        T_CHECK(cudaMemcpy(d_send, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
        T_CHECK(pd_comm_all_gather(a->c, d_send, d_recv, bytes, &err) == PD_OK);
        T_CHECK(pd_comm_broadcast(a->c, d_send, bytes, it % a->n, &err) == PD_OK);
        /* all_reduce of small integers in f32 (exact in any order): sum = n (n - 1) / 2 + i */
        size_t nf = bytes / sizeof(float);
        float *hf = malloc(nf * sizeof(float) + 1);
        for (size_t i = 0; i < nf; i++)
            hf[i] = (float)(me + (int)(i % 1000) * (me == 0));
        T_CHECK(cudaMemcpy(d_send, hf, nf * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
        T_CHECK(pd_comm_all_reduce_sum(a->c, (const float *)d_send, (float *)d_send, nf, &err) ==
                PD_OK);
        T_CHECK(pd_comm_barrier(a->c, &err) == PD_OK);
        T_CHECK(cudaMemcpy(hf, d_send, nf * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
        int bad_ar = 0;
        for (size_t i = 0; i < nf; i++)
            bad_ar += hf[i] != (float)(a->n * (a->n - 1) / 2 + (int)(i % 1000));
        T_CHECK(bad_ar == 0);
        free(hf);
        T_CHECK(cudaMemcpy(d_send, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
        T_CHECK(pd_comm_broadcast(a->c, d_send, bytes, it % a->n, &err) == PD_OK);
        T_CHECK(pd_comm_barrier(a->c, &err) == PD_OK);
        T_CHECK(cudaMemcpy(h, d_recv, bytes * (size_t)a->n, cudaMemcpyDeviceToHost) ==
                cudaSuccess);
        int bad = 0;
        for (int r = 0; r < a->n; r++)
            for (size_t i = 0; i < bytes; i++)
                bad += h[(size_t)r * bytes + i] != pattern(r, it, i);
        T_CHECK(cudaMemcpy(h, d_send, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
        for (size_t i = 0; i < bytes; i++)
            bad += h[i] != pattern(it % a->n, it, i);
        T_CHECK(bad == 0);
    }
    cudaFree(d_send);
    cudaFree(d_recv);
    free(h);
    return NULL;
}

typedef struct {
    pd_comm_nccl_id id;
    int n, rank;
    pd_comm *c;
    pd_status st;
} nccl_init_arg;

static void *nccl_init_main(void *p)
{
    nccl_init_arg *a = p;
    pd_comm_nccl_opts o = { .device = a->rank, .timeout_ms = 60000 };
    pd_err err;
    a->st = pd_comm_nccl_create(&a->id, a->n, a->rank, &o, &a->c, &err);
    if (a->st != PD_OK)
        fprintf(stderr, "nccl rank %d: %s\n", a->rank, err.msg);
    return NULL;
}

static void run_nccl_group(pd_comm **cs, int n)
{
    pthread_t th[8];
    nccl_arg args[8];
    for (int r = 0; r < n; r++) {
        args[r] = (nccl_arg){ .c = cs[r], .iters = 20, .n = n };
        pthread_create(&th[r], NULL, nccl_rank_main, &args[r]);
    }
    for (int r = 0; r < n; r++)
        pthread_join(th[r], NULL);
}

static void test_comm_nccl(int n)
{
    int have = 0;
    if (cudaGetDeviceCount(&have) != cudaSuccess || have < n) {
        printf("nccl: want %d GPUs, have %d: skipped\n", n, have);
        return;
    }
    pd_err err;
    /* one thread creates all ranks */
    pd_comm_nccl_opts opts[8];
    pd_comm *cs[8] = { 0 };
    for (int r = 0; r < n; r++)
        opts[r] = (pd_comm_nccl_opts){ .device = r, .timeout_ms = 60000 };
    pd_status st = pd_comm_nccl_create_all(n, opts, cs, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st == PD_OK) {
        run_nccl_group(cs, n);
        for (int r = 0; r < n; r++)
            pd_comm_destroy(cs[r]);
    }
    /* one thread per rank, with a shared unique id */
    nccl_init_arg ia[8];
    pthread_t th[8];
    pd_comm_nccl_id id;
    TEST_CHECK(pd_comm_nccl_id_create(&id, &err) == PD_OK);
    for (int r = 0; r < n; r++) {
        ia[r] = (nccl_init_arg){ .id = id, .n = n, .rank = r };
        pthread_create(&th[r], NULL, nccl_init_main, &ia[r]);
    }
    int all_ok = 1;
    for (int r = 0; r < n; r++) {
        pthread_join(th[r], NULL);
        TEST_CHECK(ia[r].st == PD_OK);
        all_ok &= ia[r].st == PD_OK;
        cs[r] = ia[r].c;
    }
    if (all_ok)
        run_nccl_group(cs, n);
    for (int r = 0; r < n; r++)
        pd_comm_destroy(ia[r].st == PD_OK ? cs[r] : NULL);
    /* a rank that never joins: init times out instead of hanging (needs one GPU only) */
    {
        TEST_CHECK(pd_comm_nccl_id_create(&id, &err) == PD_OK);
        pd_comm_nccl_opts o = { .device = 0, .timeout_ms = 3000 };
        pd_comm *c = NULL;
        double t0 = test_now_s();
        st = pd_comm_nccl_create(&id, 2, 0, &o, &c, &err);
        TEST_CHECK_MSG(st == PD_ERR_TIMEOUT, "%s: %s", pd_status_str(st), err.msg);
        TEST_CHECK(test_now_s() - t0 < 30.0);
        pd_comm_destroy(st == PD_OK ? c : NULL);
    }
    TEST_CHECK(atomic_load(&thread_fail) == 0);
    printf("nccl: %d ranks done\n", n);
}
#endif

int main(void)
{
    test_comm_local_misc();
    test_comm_local_collectives();
    test_comm_local_all_reduce();
    test_comm_local_mismatch();
    test_comm_local_abort();
    test_comm_local_timeout();
    test_comm_cp_roundtrip();
    const char *ng = getenv("PD_TEST_NCCL_GPUS");
    if (ng != NULL) {
#ifdef PD_HAVE_CUDA
        TEST_CHECK(pd_comm_nccl_available() == 1);
        int n = atoi(ng);
        if (n >= 1 && n <= 8)
            test_comm_nccl(n);
#else
        printf("nccl: built without CUDA\n");
#endif
    } else {
        printf("nccl: set PD_TEST_NCCL_GPUS=N to run it\n");
    }
    TEST_CHECK(atomic_load(&thread_fail) == 0);
    TEST_DONE();
}
