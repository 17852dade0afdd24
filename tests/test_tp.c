/* test_tp.c - tensor-parallel decode on the CPU with the local communicator: the 32 public eval
 * prompts give the same tokens with --tp 2 (and 4: the tiny model's 2 KV heads are then
 * replicated over 2 ranks each) as with --tp 1, for the vanilla drafter (greedy with full,
 * scheduled and threshold verification, whose per-round lengths must vary and match), target-only
 * decoding (also with the vocab cut to 8190, so that tp 4 has an uneven last slice), and
 * sampling at temperature 0.8 with a fixed seed, and with requests preempted in a small pool
 * (their KV shards swapped to host memory, or, without swap space, recomputed). Bad tp values are refused by
 * name, external prefills are refused, the shard arithmetic is checked (uneven vocab slices,
 * replicated KV heads), and a rank that fails mid-forward ends the step with its error on rank
 * 0 within seconds instead of hanging the group. By default tp 4 runs only the scenarios where
 * four ranks add something to two (greedy full, the uneven vocab, swapped shards of replicated
 * KV heads), and tp 1's results serve every scenario that differs only in preemption (tp 1 is
 * not preempted); --tp-list runs every scenario at every size given.
 * Usage: test_tp [--max-new N] [--tp-list 2,4] [--scenario NAME-PART] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd_engine.h"
#include "pd_tp.h"
#include "test_util.h"

#define N_PROMPTS 32
#define CONCURRENCY 8
#define MAX_OUT 256
#define MAX_ROUNDS 256

typedef struct {
    int32_t out[MAX_OUT];
    int n_out;
    int verified[MAX_ROUNDS];
    int rounds;
    pd_finish_reason finish;
} result;

static kern_backend *be;
static pd_qwen3_model *tm;
static pd_dspark_model *dm;
static test_prompt prompts[N_PROMPTS];
static pd_qwen3_model tm_cut;   /* tm seen through its first 8190 vocab rows (uneven slices) */
static int max_new = 64;

static const char *only;            /* --scenario: the CPU scenarios whose name holds it */

typedef struct {
    const char *name;
    int with_draft;
    pd_verify_policy policy;
    float threshold;
    float temperature;
    const pd_qwen3_model *target;   /* NULL: tm */
    int preempt;                    /* tp > 1 runs get a pool of 40 pages (two prompts), so that
                                     * requests are preempted (tp 1, the reference, is not): 1
                                     * with 1 GiB of swap space (every victim's KV shards go to
                                     * host memory), 2 with 1 byte (every victim is recomputed) */
    int wide;                       /* also at tp sizes above 2 in the default list: where 4 ranks
                                     * add what 2 do not (KV heads replicated over ranks, their
                                     * shards swapped; the vocab cut unevenly); the others are the
                                     * same code at any rank count, so they run at tp 2 only */
} scenario;

/* All prompts through one engine with tp ranks, CONCURRENCY at a time. */
static int run_all(const scenario *sc, int tp, result *res)
{
    pd_err err;
    pd_engine *e = NULL;
    int pages = sc->preempt && tp > 1 ? 40 : 512;
    pd_engine_config ec = { .target = sc->target != NULL ? sc->target : tm,
                            .draft = sc->with_draft ? dm : NULL, .page_size = 16, .n_pages = pages,
                            .tp_size = tp,
                            .swap_bytes = !sc->preempt || tp == 1 ? 0 : sc->preempt == 1 ? (size_t)1 << 30 : 1 };
    if (pd_engine_create(&ec, &e, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "%s tp %d: engine: %s", sc->name, tp, err.msg);
        return -1;
    }
    pd_request *live[CONCURRENCY] = { 0 };
    int owner[CONCURRENCY];
    int next = 0, done = 0, rc = 0;
    while (done < N_PROMPTS && rc == 0) {
        for (int s = 0; s < CONCURRENCY && next < N_PROMPTS; s++)
            if (live[s] == NULL) {
                pd_gen_params gp = { .sample = { .temperature = sc->temperature, .top_p = 0.95f,
                                                 .seed = 1234u + (uint64_t)next },
                                     .max_new_tokens = max_new, .verify_policy = sc->policy,
                                     .verify_threshold = sc->threshold };
                pd_status st = pd_engine_add(e, (uint64_t)next, prompts[next].ids, prompts[next].n, &gp,
                                             &live[s], &err);
                if (st == PD_ERR_BUSY && sc->preempt)
                    break;   /* no pages now (a server queues it): again after the next step */
                if (st != PD_OK) {
                    TEST_CHECK_MSG(0, "%s tp %d: add %d: %s", sc->name, tp, next, err.msg);
                    rc = -1;
                    break;
                }
                owner[s] = next++;
            }
        if (rc == 0 && pd_engine_step(e, &err) != PD_OK) {
            TEST_CHECK_MSG(0, "%s tp %d: step: %s", sc->name, tp, err.msg);
            rc = -1;
        }
        for (int s = 0; s < CONCURRENCY && rc == 0; s++) {
            pd_request *r = live[s];
            if (r == NULL || r->finish == PD_FINISH_NONE)
                continue;
            result *o = &res[owner[s]];
            TEST_CHECK_MSG(r->finish != PD_FINISH_ERROR, "%s tp %d prompt %d: %s", sc->name, tp,
                           owner[s], r->error);
            o->n_out = r->n_out < MAX_OUT ? r->n_out : MAX_OUT;
            memcpy(o->out, r->out, (size_t)o->n_out * sizeof(int32_t));
            o->rounds = r->n_rounds < MAX_ROUNDS ? r->n_rounds : MAX_ROUNDS;
            if (r->verified != NULL)
                memcpy(o->verified, r->verified, (size_t)o->rounds * sizeof(int));
            o->finish = r->finish;
            pd_engine_release(e, r);
            live[s] = NULL;
            done++;
        }
    }
    if (rc == 0)
        TEST_CHECK_MSG(pd_engine_kv_free_pages(e) == pages, "%s tp %d: kv pages leaked: %d of %d",
                       sc->name, tp, pd_engine_kv_free_pages(e), pages);
    if (rc == 0 && sc->preempt && tp > 1) {
        uint64_t pre = 0;
        int swapped = -1;
        size_t bytes = 1;
        pd_engine_swap_stats(e, &pre, &swapped, &bytes);
        printf("%-30s tp %d: %llu preemptions in a pool of %d pages (%s)\n", sc->name, tp,
               (unsigned long long)pre, pages, sc->preempt == 1 ? "swapped" : "recomputed: 1 byte of swap space");
        TEST_CHECK_MSG(pre > 0 && swapped == 0 && bytes == 0, "%s tp %d: %llu preemptions, %d swapped, %zu bytes",
                       sc->name, tp, (unsigned long long)pre, swapped, bytes);
    }
    pd_engine_destroy(e);
    return rc;
}

static int same_but_preempt(const scenario *a, const scenario *b)
{
    return a->with_draft == b->with_draft && a->policy == b->policy && a->threshold == b->threshold &&
           a->temperature == b->temperature && a->target == b->target;
}

/* explicit_tps: the list came from --tp-list, so every scenario runs at every size in it */
static void test_tp_same_tokens(const int *tps, int n_tps, int explicit_tps)
{
    const scenario scs[] = {
        { "vanilla greedy full", 1, PD_VERIFY_FULL, 0.0f, 0.0f, NULL, 0, 1 },
        { "vanilla greedy scheduled", 1, PD_VERIFY_SCHEDULED, 0.0f, 0.0f, NULL, 0, 0 },
        { "vanilla greedy threshold 0.3", 1, PD_VERIFY_THRESHOLD, 0.3f, 0.0f, NULL, 0, 0 },
        { "target-only greedy", 0, PD_VERIFY_FULL, 0.0f, 0.0f, NULL, 0, 0 },
        { "vanilla sampled t=0.8 seed", 1, PD_VERIFY_FULL, 0.0f, 0.8f, NULL, 0, 0 },
        /* vocab 8190 over 4 ranks: slices of 2048, the last one 2046 */
        { "target-only greedy, vocab 8190", 0, PD_VERIFY_FULL, 0.0f, 0.0f, &tm_cut, 0, 1 },
        /* every rank's KV shard goes to host memory and back */
        { "vanilla greedy full, preempted", 1, PD_VERIFY_FULL, 0.0f, 0.0f, NULL, 1, 1 },
        /* no swap space: the victims' positions are prefilled again on every rank */
        { "vanilla greedy full, recomputed", 1, PD_VERIFY_FULL, 0.0f, 0.0f, NULL, 2, 0 },
    };
    static result ref[N_PROMPTS], got[N_PROMPTS];
    const scenario *ref_of = NULL;   /* the scenario ref holds tp 1's results of */
    double t1 = 0.0;
    for (size_t i = 0; i < sizeof(scs) / sizeof(scs[0]); i++) {
        const scenario *sc = &scs[i];
        if (only != NULL && strstr(sc->name, only) == NULL)
            continue;
        double t0 = test_now_s();
        /* tp 1 is never preempted, so a scenario that differs from the last reference only by
         * preempt has that reference's results */
        if (ref_of == NULL || !same_but_preempt(ref_of, sc)) {
            memset(ref, 0, sizeof(ref));
            ref_of = NULL;
            if (run_all(sc, 1, ref) != 0)
                continue;
            ref_of = sc;
            t1 = test_now_s() - t0;
        }
        long tokens = 0, rounds = 0;
        int hist[33] = { 0 }, distinct = 0;
        for (int p = 0; p < N_PROMPTS; p++) {
            tokens += ref[p].n_out;
            rounds += ref[p].rounds;
            for (int k = 0; k < ref[p].rounds; k++)
                if (ref[p].verified[k] >= 0 && ref[p].verified[k] <= 32)
                    hist[ref[p].verified[k]]++;
        }
        if (sc->with_draft) {
            printf("%-30s tp 1: rounds by verified length:", sc->name);
            for (int l = 0; l <= 32; l++)
                if (hist[l] > 0) {
                    printf(" %d:%d", l, hist[l]);
                    distinct++;
                }
            printf("\n");
        }
        /* scheduled/threshold runs only test something if their lengths vary from round to round */
        if (sc->policy != PD_VERIFY_FULL)
            TEST_CHECK_MSG(distinct >= 2, "%s: %d distinct verify lengths", sc->name, distinct);
        for (int ti = 0; ti < n_tps; ti++) {
            int tp = tps[ti];
            if (tp > 2 && !sc->wide && !explicit_tps)
                continue;
            memset(got, 0, sizeof(got));
            t0 = test_now_s();
            if (run_all(sc, tp, got) != 0)
                continue;
            double tt = test_now_s() - t0;
            int same = 0, same_len = 0;
            for (int p = 0; p < N_PROMPTS; p++) {
                int eq = got[p].n_out == ref[p].n_out &&
                         memcmp(got[p].out, ref[p].out, (size_t)ref[p].n_out * 4) == 0;
                int eql = got[p].rounds == ref[p].rounds &&
                          memcmp(got[p].verified, ref[p].verified, (size_t)ref[p].rounds * sizeof(int)) == 0;
                if (!eq) {
                    int j = 0;
                    while (j < got[p].n_out && j < ref[p].n_out && got[p].out[j] == ref[p].out[j])
                        j++;
                    printf("  %s tp %d prompt %d: parts at token %d (%d vs tp 1 %d)\n", sc->name, tp,
                           p, j, j < got[p].n_out ? got[p].out[j] : -1,
                           j < ref[p].n_out ? ref[p].out[j] : -1);
                }
                same += eq;
                same_len += eql;
            }
            printf("%-30s tp %d: %2d/%d prompts same tokens as tp 1, %2d/%d same verify lengths; "
                   "%ld tokens, %ld rounds; %.1f s (tp 1 %.1f s)\n", sc->name, tp, same, N_PROMPTS,
                   same_len, N_PROMPTS, tokens, rounds, tt, t1);
            TEST_CHECK_MSG(same == N_PROMPTS, "%s tp %d: %d of %d prompts differ from tp 1", sc->name,
                           tp, N_PROMPTS - same, N_PROMPTS);
            /* scheduled lengths follow measured step times (draft or not, the draft round's
             * cost), which differ from run to run; the others are pure functions of the logits */
            if (sc->policy != PD_VERIFY_SCHEDULED)
                TEST_CHECK_MSG(same_len == N_PROMPTS, "%s tp %d: verify lengths differ", sc->name, tp);
        }
    }
}

static void test_tp_bad_sizes(void)
{
    pd_err err;
    pd_engine *e = NULL;
    struct {
        int tp;
        const char *want;
    } bad[] = {
        { 3, "does not divide the model's 4 attention heads" },
        { 8, "exceeds the model's 4 attention heads" },
        { -1, "must be >= 1" },
        { 1000, "outside 1..64" },
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 64,
                                .tp_size = bad[i].tp };
        pd_status st = pd_engine_create(&ec, &e, &err);
        TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, bad[i].want) != NULL,
                       "tp %d: %s (%s)", bad[i].tp, pd_status_str(st), st != PD_OK ? err.msg : "");
        if (st == PD_OK)
            pd_engine_destroy(e);
    }
    pd_engine_config cp = { .target = tm, .page_size = 16, .n_pages = 64, .tp_size = 2, .cp_size = 2 };
    TEST_CHECK(pd_engine_create(&cp, &e, &err) == PD_ERR_INVALID && strstr(err.msg, "cp 2") != NULL);
    /* KV heads that neither divide nor are divided by tp */
    pd_qwen3_config c = tm->cfg;
    c.num_attention_heads = 12;
    c.num_key_value_heads = 3;
    TEST_CHECK(pd_tp_check(&c, 2, &err) == PD_ERR_INVALID && strstr(err.msg, "3 KV heads") != NULL);
    TEST_CHECK(pd_tp_check(&c, 3, &err) == PD_OK && pd_tp_check(&c, 6, &err) == PD_OK);
    c.num_key_value_heads = 4;
    c.vocab_size = 5;
    TEST_CHECK(pd_tp_check(&c, 4, &err) == PD_ERR_INVALID && strstr(err.msg, "vocab") != NULL);
    TEST_CHECK(pd_tp_check(&tm->cfg, 1, &err) == PD_OK);
    /* tp 2: an external prefill is refused */
    pd_engine_config ok = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 64, .tp_size = 2 };
    if (pd_engine_create(&ok, &e, &err) == PD_OK) {
        pd_gen_params gp = { .sample = { .temperature = 0.0f, .top_p = 1.0f }, .max_new_tokens = 4 };
        pd_request *r = NULL;
        TEST_CHECK(pd_engine_add_external(e, 1, prompts[0].ids, prompts[0].n, &gp, &r, &err) ==
                   PD_ERR_UNSUPPORTED && strstr(err.msg, "external prefill") != NULL);
        pd_engine_destroy(e);
    } else {
        TEST_CHECK_MSG(0, "tp 2 engine: %s", err.msg);
    }
}

static void test_tp_shard_math(void)
{
    pd_qwen3_config c = tm->cfg;   /* 4 heads, 2 KV heads, 768 MLP columns, vocab 8192 */
    pd_tp_shard s;
    int kv0[4] = { 0, 0, 1, 1 };
    for (int r = 0; r < 4; r++) {
        pd_tp_shard_of(&c, 4, r, &s);
        TEST_CHECK(s.n_q_heads == 1 && s.q_head0 == r && s.n_kv_heads == 1 && s.kv_head0 == kv0[r]);
        TEST_CHECK(s.n_inter == 192 && s.inter0 == 192 * r);
        TEST_CHECK(s.vocab_slice == 2048 && s.vocab0 == 2048 * r && s.n_vocab == 2048);
    }
    c.vocab_size = 10;
    c.intermediate_size = 7;
    int nv[4] = { 3, 3, 3, 1 }, total_inter = 0;
    for (int r = 0; r < 4; r++) {
        pd_tp_shard_of(&c, 4, r, &s);
        TEST_CHECK(s.vocab_slice == 3 && s.vocab0 == 3 * r && s.n_vocab == nv[r]);
        TEST_CHECK(s.inter0 == total_inter && s.n_inter >= 1);
        total_inter += s.n_inter;
    }
    TEST_CHECK(total_inter == 7);
}

/* Rank 1 fails a command: its 1st (the prefill forward, while rank 0 waits in an all-reduce)
 * or its 3rd (the draft block, which has no collective). Rank 0 must get the error (named by
 * rank) in seconds, later steps fail at once, and destroy must not hang. */
static void test_tp_rank_failure(int fail_cmd)
{
    pd_err err;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 64, .tp_size = 2,
                            .tp_debug_fail_rank = 2, .tp_debug_fail_cmd = fail_cmd };
    if (pd_engine_create(&ec, &e, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "engine: %s", err.msg);
        return;
    }
    pd_gen_params gp = { .sample = { .temperature = 0.0f, .top_p = 1.0f }, .max_new_tokens = 32 };
    pd_request *r = NULL;
    TEST_CHECK(pd_engine_add(e, 1, prompts[0].ids, prompts[0].n, &gp, &r, &err) == PD_OK);
    double t0 = test_now_s();
    pd_status st = PD_OK;
    for (int i = 0; i < 10 && st == PD_OK; i++)
        st = pd_engine_step(e, &err);
    double dt = test_now_s() - t0;
    printf("rank 1 fails command %d: step -> %s \"%s\" after %.2f s\n", fail_cmd, pd_status_str(st),
           err.msg, dt);
    TEST_CHECK(st == PD_ERR_INTERNAL && strstr(err.msg, "rank 1") != NULL &&
               strstr(err.msg, "injected") != NULL);
    TEST_CHECK_MSG(dt < 10.0, "failure took %.2f s", dt);
    /* a new request's first forward finds the group broken at once */
    TEST_CHECK(pd_engine_add(e, 2, prompts[1].ids, prompts[1].n, &gp, &r, &err) == PD_OK);
    t0 = test_now_s();
    st = pd_engine_step(e, &err);
    TEST_CHECK_MSG(st == PD_ERR_PEER && strstr(err.msg, "broken") != NULL, "%s: %s",
                   pd_status_str(st), err.msg);
    TEST_CHECK(test_now_s() - t0 < 1.0);
    pd_engine_destroy(e);
}

/* GPUs (opt-in, --backend cuda; the multi-GPU issue runs it): tp N over NCCL, one GPU per rank,
 * bf16. tp N against tp 1 may part at near-ties (the row-parallel sums round differently), so
 * what must hold is losslessness inside tp N: greedy speculative output equals tp N's own greedy
 * decoding (batch-invariant kernels on every rank and the fixed-order all-reduce). */
static void test_tp_gpu_lossless(const int *tps, int n_tps)
{
    const scenario spec = { "vanilla greedy full", 1, PD_VERIFY_FULL, 0.0f, 0.0f, NULL, 0, 1 };
    const scenario plain = { "target-only greedy", 0, PD_VERIFY_FULL, 0.0f, 0.0f, NULL, 0, 1 };
    static result a[N_PROMPTS], b[N_PROMPTS], one[N_PROMPTS];
    memset(one, 0, sizeof(one));
    if (run_all(&plain, 1, one) != 0)
        return;
    for (int ti = 0; ti < n_tps; ti++) {
        memset(a, 0, sizeof(a));
        memset(b, 0, sizeof(b));
        if (run_all(&spec, tps[ti], a) != 0 || run_all(&plain, tps[ti], b) != 0)
            continue;
        int same = 0, same_tp1 = 0;
        for (int p = 0; p < N_PROMPTS; p++) {
            same += a[p].n_out == b[p].n_out && memcmp(a[p].out, b[p].out, (size_t)a[p].n_out * 4) == 0;
            same_tp1 += b[p].n_out == one[p].n_out &&
                        memcmp(b[p].out, one[p].out, (size_t)b[p].n_out * 4) == 0;
        }
        printf("cuda tp %d: speculative == greedy on %d/%d prompts; greedy tp %d == tp 1 on %d/%d\n",
               tps[ti], same, N_PROMPTS, tps[ti], same_tp1, N_PROMPTS);
        TEST_CHECK_MSG(same == N_PROMPTS, "cuda tp %d: speculative output parts from greedy on %d prompts",
                       tps[ti], N_PROMPTS - same);
    }
}

int main(int argc, char **argv)
{
    int tps[8] = { 2, 4 }, n_tps = 2, explicit_tps = 0;
    const char *backend = "cpu";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--backend") == 0) {
            backend = argv[i + 1];
        } else if (strcmp(argv[i], "--scenario") == 0) {
            only = argv[i + 1];
        } else if (strcmp(argv[i], "--max-new") == 0) {
            max_new = atoi(argv[i + 1]);
        } else if (strcmp(argv[i], "--tp-list") == 0) {
            n_tps = 0;
            explicit_tps = 1;
            for (char *t = strtok(argv[i + 1], ","); t != NULL && n_tps < 8; t = strtok(NULL, ","))
                tps[n_tps++] = atoi(t);
        }
    }
    if (max_new < 1 || max_new > MAX_OUT - 40) {
        fprintf(stderr, "--max-new %d outside 1..%d\n", max_new, MAX_OUT - 40);
        return 2;
    }
    pd_err err;
    int gpu = strcmp(backend, "cpu") != 0;
    if (gpu) {
        int need = 2;
        for (int i = 0; i < n_tps; i++)
            need = tps[i] > need ? tps[i] : need;
        int have = kern_backend_device_count(backend);
        if (have < need || !pd_comm_nccl_available()) {
            printf("SKIP: tp over %s needs %d GPUs and NCCL (%d visible, NCCL %s)\n", backend, need,
                   have, pd_comm_nccl_available() ? "built" : "not built");
            return 77;
        }
    }
    kern_backend_config bc = { .name = backend };
    if (kern_backend_create(&bc, &be, &err) != PD_OK) {
        fprintf(stderr, "backend: %s\n", err.msg);
        return 1;
    }
    if (test_load_eval_prompts(PD_FIXTURES "/eval/public_prompts.jsonl", prompts, N_PROMPTS) != 0) {
        fprintf(stderr, "no eval prompts\n");
        return 1;
    }
    if (pd_qwen3_load(be, PD_MODELS "/tiny-code-qwen3", &tm, &err) != PD_OK ||
        pd_dspark_load(be, PD_MODELS "/tiny-code-dspark", tm, &dm, &err) != PD_OK) {
        fprintf(stderr, "load: %s\n", err.msg);
        return 1;
    }
    tm_cut = *tm;
    tm_cut.cfg.vocab_size = 8190;
    tm_cut.embed.rows = 8190;
    tm_cut.lm_head.rows = 8190;   /* the eval prompts' ids are all below 8187 */
    if (gpu) {
        test_tp_gpu_lossless(tps, n_tps);
        pd_dspark_free(dm);
        pd_qwen3_free(tm);
        kern_backend_destroy(be);
        TEST_DONE();
    }
    test_tp_shard_math();
    test_tp_bad_sizes();
    test_tp_rank_failure(1);
    test_tp_rank_failure(3);
    test_tp_same_tokens(tps, n_tps, explicit_tps);
    pd_dspark_free(dm);
    pd_qwen3_free(tm);
    kern_backend_destroy(be);
    TEST_DONE();
}
