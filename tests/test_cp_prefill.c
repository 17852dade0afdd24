/* test_cp_prefill.c - the context-parallel prefill (pd_cp_prefill.h) against the plain forward.
 * For cp_size 2, 3, 4 and every strategy, on the CPU with the tiny models:
 *  - forward: on the golden prompts g0..g3 (one batch), on prompts of length 1, cp-1 and cp+1
 *    (alone, split and replicated) and a batch of mixed lengths: every rank's KV pages (per
 *    sequence, per layer, every position), the packed aux and the logits of each sequence's last
 *    position equal cp_size 1 (pd_target_forward) within relative error 1e-5; padding never
 *    writes a KV slot; greedy first tokens equal;
 *  - engine: tokens and the per-round acceptance list of a DSpark generation (32 new tokens,
 *    3 prompts, and a chunked prefill so CP runs over a cached prefix) equal cp_size 1, and the
 *    aux the drafter receives has the shape and content of the cp_size 1 packed aux;
 *  - the seed's bug: handing the drafter the pre-norm hidden state fails (guard and engine);
 *  - T = 0 and a rank that fails mid-group return an error at once, never hang.
 * With --nccl N (CUDA builds): the same forward over N GPUs, one CUDA backend and model copy per
 *   rank and an NCCL communicator, against the single-GPU forward within bf16 tolerance; skips
 *   (77) without NCCL or N GPUs.
 * With --cuda-local N: N ranks on GPU 0 with the local communicator (device copies).
 * Both GPU modes also run the engine with the ranks' targets (pd_engine_config.cp_targets, the
 * nodes' path) against cp 1: same tokens and acceptance (round-robin-split).
 * Usage: test_cp_prefill [--quick] [--nccl N | --cuda-local N] (--quick: cp_size 2 only). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cp.h"
#include "pd_cp_prefill.h"
#include "pd_engine.h"
#include "pd_kv.h"
#include "pd_model.h"
#include "pd_qwen3.h"
#include "pd_safetensors.h"
#include "test_util.h"

#ifdef PD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

static double TOL = 1e-5;
#define PAGE 8
#define N_PAGES 128
#define MAX_RANKS 4

static kern_backend *be0;
static pd_qwen3_model *tm;
static pd_dspark_model *dm;
static const int taps[3] = {1, 3, 5};
static const int n_taps = 3;

static float *download(kern_backend *be, const float *dev, size_t n)
{
    float *h = malloc(n * sizeof(float) + 1);
    pd_err err;
    if (h == NULL || kern_download(be, h, dev, n * sizeof(float), &err) != PD_OK) {
        fprintf(stderr, "download failed\n");
        exit(1);
    }
    return h;
}

static pd_kv_pool *new_pool(kern_backend *be)
{
    pd_kv_layout lay = { .n_layers = tm->cfg.num_hidden_layers,
                         .n_kv_heads = tm->cfg.num_key_value_heads, .head_dim = tm->cfg.head_dim,
                         .page_size = PAGE, .n_pages = N_PAGES, .dtype = be->kv_dtype };
    pd_kv_pool *pool = NULL;
    pd_err err;
    if (pd_kv_pool_create(be, &lay, &pool, &err) != PD_OK) {
        fprintf(stderr, "pool: %s\n", err.msg);
        exit(1);
    }
    return pool;
}

/* ---- a packed batch ---------------------------------------------------------------------- */

typedef struct {
    int n_seqs;
    int32_t lens[8];
    int32_t *ids;            /* packed */
    int T;
} batch;

static void batch_free(batch *b) { free(b->ids); }

static batch batch_of(int n, const int32_t *lens, const int32_t *const *src)
{
    batch b = { .n_seqs = n };
    for (int s = 0; s < n; s++) {
        b.lens[s] = lens[s];
        b.T += lens[s];
    }
    b.ids = malloc((size_t)b.T * sizeof(int32_t));
    int t = 0;
    for (int s = 0; s < n; s++)
        for (int i = 0; i < lens[s]; i++)
            b.ids[t++] = src != NULL ? src[s][i] : (int32_t)((s * 7919 + i * 104729 + 13) % 8000 + 1);
    return b;
}

/* Results of one forward, on the host. */
typedef struct {
    float *aux;              /* [T, K*H] */
    float *logits;           /* [n_seqs, V] */
    int32_t first[8];
    float *kv[MAX_RANKS];    /* per rank: [n_seqs][layers][max_len][2][kv_dim] */
} result;

static void result_free(result *r)
{
    free(r->aux);
    free(r->logits);
    for (int i = 0; i < MAX_RANKS; i++)
        free(r->kv[i]);
}

static size_t kv_index(const batch *b, int s, int l, int p, int kv)
{
    int L = tm->cfg.num_hidden_layers, max_len = 0;
    for (int i = 0; i < b->n_seqs; i++)
        if (b->lens[i] > max_len)
            max_len = b->lens[i];
    int D = tm->cfg.num_key_value_heads * tm->cfg.head_dim;
    return ((((size_t)s * L + l) * max_len + p) * 2 + kv) * D;
}

static float *read_kv(kern_backend *be, pd_kv_pool *pool, const batch *b, pd_kv_seq *seqs)
{
    int L = tm->cfg.num_hidden_layers, D = tm->cfg.num_key_value_heads * tm->cfg.head_dim;
    float *out = calloc(kv_index(b, b->n_seqs, 0, 0, 0) + 1, sizeof(float));
    size_t es = kern_dtype_size(pd_kv_pool_layout(pool)->dtype);
    unsigned char *raw = malloc((size_t)D * es);
    pd_err err;
    for (int s = 0; s < b->n_seqs; s++)
        for (int l = 0; l < L; l++) {
            kern_kv_layer kl = pd_kv_pool_layer(pool, l);
            for (int p = 0; p < b->lens[s]; p++) {
                size_t slot = (size_t)pd_kv_seq_slot(pool, &seqs[s], p);
                for (int k = 0; k < 2; k++) {
                    const unsigned char *src = (const unsigned char *)(k ? kl.v : kl.k) + slot * D * es;
                    if (kern_download(be, raw, src, (size_t)D * es, &err) != PD_OK ||
                        kern_convert_host(out + kv_index(b, s, l, p, k), KERN_DTYPE_F32, raw, kl.dtype,
                                          (size_t)D, &err) != PD_OK) {
                        fprintf(stderr, "kv download: %s\n", err.msg);
                        exit(1);
                    }
                }
            }
        }
    free(raw);
    return out;
}

/* Counts nonzero values in KV slots that no sequence position owns: padding must never land. */
static long stray_kv(kern_backend *be, pd_kv_pool *pool, const batch *b, pd_kv_seq *seqs)
{
    int L = tm->cfg.num_hidden_layers, D = tm->cfg.num_key_value_heads * tm->cfg.head_dim;
    size_t n_slots = (size_t)N_PAGES * PAGE;
    unsigned char *owned = calloc(n_slots, 1);
    for (int s = 0; s < b->n_seqs; s++)
        for (int p = 0; p < b->lens[s]; p++)
            owned[pd_kv_seq_slot(pool, &seqs[s], p)] = 1;
    long stray = 0;
    size_t row = (size_t)D * kern_dtype_size(pd_kv_pool_layout(pool)->dtype);
    unsigned char *k = malloc(n_slots * row), *v = malloc(n_slots * row);
    pd_err err;
    for (int l = 0; l < L; l++) {
        kern_kv_layer kl = pd_kv_pool_layer(pool, l);
        if (kern_download(be, k, kl.k, n_slots * row, &err) != PD_OK ||
            kern_download(be, v, kl.v, n_slots * row, &err) != PD_OK) {
            fprintf(stderr, "kv download: %s\n", err.msg);
            exit(1);
        }
        for (size_t sl = 0; sl < n_slots; sl++)
            if (!owned[sl])
                for (size_t i = 0; i < row; i++)   /* the pool starts zeroed */
                    stray += k[sl * row + i] != 0 || v[sl * row + i] != 0;
    }
    free(k);
    free(v);
    free(owned);
    return stray;
}

static void reserve_all(pd_kv_pool *pool, const batch *b, pd_kv_seq *seqs)
{
    pd_err err;
    for (int s = 0; s < b->n_seqs; s++) {
        pd_kv_seq_init(&seqs[s]);
        if (pd_kv_seq_reserve(pool, &seqs[s], b->lens[s], &err) != PD_OK) {
            fprintf(stderr, "reserve: %s\n", err.msg);
            exit(1);
        }
    }
}

static void release_all(pd_kv_pool *pool, const batch *b, pd_kv_seq *seqs)
{
    for (int s = 0; s < b->n_seqs; s++)
        pd_kv_seq_release(pool, &seqs[s]);
}

static void last_rows(const batch *b, int32_t *rows)
{
    int t = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        t += b->lens[s];
        rows[s] = t - 1;
    }
}

/* cp_size 1: the plain target runner. */
static result reference(const batch *b)
{
    result res = {0};
    pd_err err;
    pd_kv_pool *pool = new_pool(be0);
    pd_target *t = NULL;
    pd_kv_seq seqs[8];
    reserve_all(pool, b, seqs);
    int32_t *pos = malloc((size_t)b->T * 4), *sq = malloc((size_t)b->T * 4), rows[8];
    pd_kv_seq *sp[8];
    int k = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        sp[s] = &seqs[s];
        for (int i = 0; i < b->lens[s]; i++, k++) {
            pos[k] = i;
            sq[k] = s;
        }
    }
    last_rows(b, rows);
    pd_tok_batch tb = { .n_tok = b->T, .ids = b->ids, .pos = pos, .seq = sq, .n_seq = b->n_seqs,
                        .seqs = sp };
    if (pd_target_create(tm, pool, taps, n_taps, &t, &err) != PD_OK ||
        pd_target_forward(t, &tb, rows, b->n_seqs, &err) != PD_OK) {
        fprintf(stderr, "reference forward: %s\n", err.msg);
        exit(1);
    }
    int H = tm->cfg.hidden_size, V = tm->cfg.vocab_size;
    res.aux = download(be0, pd_target_aux(t), (size_t)b->T * n_taps * H);
    res.logits = download(be0, pd_target_logits(t), (size_t)b->n_seqs * V);
    for (int s = 0; s < b->n_seqs; s++) {
        const float *x = res.logits + (size_t)s * V;
        int am = 0;
        for (int i = 1; i < V; i++)
            if (x[i] > x[am])
                am = i;
        res.first[s] = am;
    }
    res.kv[0] = read_kv(be0, pool, b, seqs);
    release_all(pool, b, seqs);
    pd_target_destroy(t);
    pd_kv_pool_destroy(pool);
    free(pos);
    free(sq);
    return res;
}

/* ---- a CP group over cpu backends --------------------------------------------------------- */

typedef struct {
    int n;
    kern_backend *be[MAX_RANKS];
    pd_kv_pool *pool[MAX_RANKS];
    pd_cp_group *g;
} group;

static void group_open(group *gr, int cp, pd_cp_strategy strat, int force)
{
    memset(gr, 0, sizeof(*gr));
    gr->n = cp;
    pd_err err;
    pd_cp_rank_res res[MAX_RANKS];
    for (int r = 0; r < cp; r++) {
        kern_backend_config bc = { .name = "cpu", .threads = 1 };
        if (r == 0)
            gr->be[r] = be0;
        else if (kern_backend_create(&bc, &gr->be[r], &err) != PD_OK)
            exit(1);
        gr->pool[r] = new_pool(gr->be[r]);
        res[r] = (pd_cp_rank_res){ .be = gr->be[r], .model = tm, .pool = gr->pool[r] };
    }
    pd_cp_group_config gc = { .opts = { .strategy = strat, .cp_size = cp, .force_split = force },
                              .comm = PD_CP_COMM_LOCAL, .ranks = res, .taps = taps,
                              .n_taps = n_taps, .timeout_ms = 20000 };
    if (pd_cp_group_create(&gc, &gr->g, &err) != PD_OK) {
        fprintf(stderr, "group: %s\n", err.msg);
        exit(1);
    }
}

static void group_close(group *gr)
{
    pd_cp_group_destroy(gr->g);
    for (int r = 0; r < gr->n; r++) {
        pd_kv_pool_destroy(gr->pool[r]);
        if (r > 0)
            kern_backend_destroy(gr->be[r]);
    }
}

static void check_rel(const char *what, const float *got, const float *want, size_t n, int *bad)
{
    double e = test_rel_l2(got, want, n);
    if (!(e <= TOL)) {
        (*bad)++;
        if (*bad <= 3)
            fprintf(stderr, "  %s: relative error %.3g\n", what, e);
    }
}

/* One CP forward of b, compared with ref. Returns whether the plan split. */
static int cp_case(const char *name, const batch *b, const result *ref, int cp, pd_cp_strategy strat,
                   int force)
{
    group gr;
    group_open(&gr, cp, strat, force);
    pd_kv_seq seqs[MAX_RANKS][8];
    pd_kv_seq *sp[MAX_RANKS][8];
    pd_kv_seq *const *rank_sp[MAX_RANKS];
    for (int r = 0; r < cp; r++) {
        reserve_all(gr.pool[r], b, seqs[r]);
        for (int s = 0; s < b->n_seqs; s++)
            sp[r][s] = &seqs[r][s];
        rank_sp[r] = sp[r];
    }
    int32_t rows[8];
    last_rows(b, rows);
    pd_cp_group_batch gb = { .n_seqs = b->n_seqs, .seq_lens = b->lens, .ids = b->ids,
                             .seqs = rank_sp, .logit_rows = rows, .n_logits = b->n_seqs };
    pd_err err;
    pd_status st = pd_cp_group_prefill(gr.g, &gb, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s cp %d %s: %s", name, cp, pd_cp_strategy_name(strat), err.msg);
    int split = st == PD_OK ? pd_cp_group_plan(gr.g)->split : 0;
    if (st == PD_OK) {
        int H = tm->cfg.hidden_size, V = tm->cfg.vocab_size, bad = 0;
        size_t D = (size_t)tm->cfg.num_key_value_heads * tm->cfg.head_dim;
        for (int r = 0; r < cp; r++) {
            pd_cp_rank *rk = pd_cp_group_rank(gr.g, r);
            pd_cp_aux a = pd_cp_rank_aux(rk);
            TEST_CHECK(a.rows == b->T && a.cols == n_taps * H && a.ld == n_taps * H);
            TEST_CHECK(pd_cp_aux_check(&a, b->T, n_taps * H, pd_cp_rank_hidden(rk), &err) == PD_OK);
            float *aux = download(gr.be[r], a.data, (size_t)b->T * n_taps * H);
            for (int t = 0; t < b->T; t++)
                check_rel("aux row", aux + (size_t)t * n_taps * H, ref->aux + (size_t)t * n_taps * H,
                          (size_t)n_taps * H, &bad);
            free(aux);
            float *lg = download(gr.be[r], pd_cp_rank_logits(rk), (size_t)b->n_seqs * V);
            const int32_t *first = pd_cp_rank_first_tokens(rk);
            for (int s = 0; s < b->n_seqs; s++) {
                check_rel("logits", lg + (size_t)s * V, ref->logits + (size_t)s * V, (size_t)V, &bad);
                if (first[s] != ref->first[s] && bad++ < 3)
                    fprintf(stderr, "  first token of seq %d: %d, want %d\n", s, first[s], ref->first[s]);
            }
            free(lg);
            float *kv = read_kv(gr.be[r], gr.pool[r], b, seqs[r]);
            for (int s = 0; s < b->n_seqs; s++)
                for (int l = 0; l < tm->cfg.num_hidden_layers; l++)
                    for (int p = 0; p < b->lens[s]; p++)
                        for (int k = 0; k < 2; k++) {
                            size_t at = kv_index(b, s, l, p, k);
                            char what[96];
                            snprintf(what, sizeof(what), "rank %d seq %d layer %d pos %d %s", r, s, l,
                                     p, k ? "V" : "K");
                            check_rel(what, kv + at, ref->kv[0] + at, D, &bad);
                        }
            free(kv);
            long stray = stray_kv(gr.be[r], gr.pool[r], b, seqs[r]);
            TEST_CHECK_MSG(stray == 0, "%s cp %d %s rank %d: %ld KV values outside the sequences",
                           name, cp, pd_cp_strategy_name(strat), r, stray);
        }
        TEST_CHECK_MSG(bad == 0, "%s cp %d %s%s: %d mismatches", name, cp, pd_cp_strategy_name(strat),
                       force ? " (forced split)" : "", bad);
    }
    for (int r = 0; r < cp; r++)
        release_all(gr.pool[r], b, seqs[r]);
    group_close(&gr);
    return split;
}

/* The input ids of golden prompts g0..g{n-1} (exits when one is missing) */
static void golden_prompts(const pd_st_set *g, int n, const int32_t **prompts, int32_t *lens)
{
    for (int p = 0; p < n; p++) {
        char name[32];
        snprintf(name, sizeof(name), "g%d.input_ids", p);
        const pd_st_tensor *t = pd_st_find(g, name);
        if (t == NULL) {
            fprintf(stderr, "golden %s missing\n", name);
            exit(1);
        }
        prompts[p] = t->data;
        lens[p] = (int32_t)t->shape[0];
    }
}

static void test_forward(const pd_st_set *g, int max_cp)
{
    const int32_t *gsrc[4];
    int32_t glens[4];
    golden_prompts(g, 4, gsrc, glens);
    batch gold = batch_of(4, glens, gsrc);
    result gref = reference(&gold);
    for (int cp = 2; cp <= max_cp; cp++) {
        batch shorts[3], mixed;
        int32_t l1[1] = {1}, l2[1] = {cp - 1}, l3[1] = {cp + 1};
        int32_t lm[4] = {cp + 1, 1, 2 * cp + 3, cp > 2 ? cp - 1 : 5};
        shorts[0] = batch_of(1, l1, NULL);
        shorts[1] = batch_of(1, l2, NULL);
        shorts[2] = batch_of(1, l3, NULL);
        mixed = batch_of(4, lm, NULL);
        result sref[3], mref = reference(&mixed);
        for (int i = 0; i < 3; i++)
            sref[i] = reference(&shorts[i]);
        for (int st = 0; st < PD_CP_STRATEGY_COUNT; st++) {
            int n_split = 0;
            n_split += cp_case("golden g0..g3", &gold, &gref, cp, (pd_cp_strategy)st, 0);
            n_split += cp_case("mixed lengths", &mixed, &mref, cp, (pd_cp_strategy)st, 0);
            cp_case("mixed lengths", &mixed, &mref, cp, (pd_cp_strategy)st, 1);
            for (int i = 0; i < 3; i++) {
                char name[48];
                snprintf(name, sizeof(name), "prompt of %d", shorts[i].lens[0]);
                cp_case(name, &shorts[i], &sref[i], cp, (pd_cp_strategy)st, 0);
                cp_case(name, &shorts[i], &sref[i], cp, (pd_cp_strategy)st, 1);
            }
            /* the golden batch is long enough for every strategy to really split */
            TEST_CHECK_MSG(n_split >= 1, "cp %d %s never split", cp, pd_cp_strategy_name(st));
            printf("forward cp %d %-17s ok\n", cp, pd_cp_strategy_name(st));
        }
        for (int i = 0; i < 3; i++) {
            result_free(&sref[i]);
            batch_free(&shorts[i]);
        }
        result_free(&mref);
        batch_free(&mixed);
    }
    result_free(&gref);
    batch_free(&gold);
}

/* ---- engine ------------------------------------------------------------------------------- */

typedef struct {
    int calls;
    int bad_shape;
    float *rows;             /* every aux row the drafter got from prefills, in order */
    size_t n, cap;
} aux_log;

static void aux_hook(void *ud, const float *aux, int rows, int cols, int ld)
{
    aux_log *lg = ud;
    lg->calls++;
    if (cols != n_taps * tm->cfg.hidden_size || ld != cols || rows < 1) {
        lg->bad_shape++;
        return;
    }
    size_t need = lg->n + (size_t)rows * cols;
    if (need > lg->cap) {
        lg->cap = need * 2;
        lg->rows = realloc(lg->rows, lg->cap * sizeof(float));
    }
    pd_err err;
    if (kern_download(be0, lg->rows + lg->n, aux, (size_t)rows * cols * sizeof(float), &err) != PD_OK)
        lg->bad_shape++;
    lg->n = need;
}

typedef struct {
    int n_out[4];
    int32_t out[4][64];
    int n_rounds[4];
    int acc[4][64];
    aux_log aux;
    uint64_t preemptions;
    int free_pages;          /* the target pool's free pages at the end */
} gen_result;

/* cp_targets: NULL on the cpu; the targets of ranks 1.. on a device backend. n_pages: the target
 * pool (0: 256); swap_bytes: pd_engine_config's (preemption) */
static pd_status generate(int cp, pd_cp_strategy strat, int chunk, int debug_hidden,
                          const int32_t *const *prompts, const int32_t *lens, int n,
                          const pd_qwen3_model *const *cp_targets, int n_pages, size_t swap_bytes,
                          gen_result *res, pd_err *err)
{
    memset(res, 0, sizeof(*res));
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = PAGE,
                            .n_pages = n_pages > 0 ? n_pages : 256, .swap_bytes = swap_bytes,
                            .max_prefill_tokens = chunk, .cp_size = cp, .cp_strategy = strat,
                            .cp_targets = cp_targets,
                            .prefill_aux_hook = aux_hook, .prefill_aux_hook_ud = &res->aux,
                            .cp_debug_aux_hidden = debug_hidden };
    pd_engine *e = NULL;
    pd_status st = pd_engine_create(&ec, &e, err);
    if (st != PD_OK)
        return st;
    pd_request *req[4] = {0};
    pd_gen_params gp = { .sample = { .top_p = 1.0f }, .max_new_tokens = 32, .ignore_eos = 1 };
    for (int i = 0; i < n && st == PD_OK; i++)
        st = pd_engine_add(e, (uint64_t)i + 1, prompts[i], lens[i], &gp, &req[i], err);
    for (int guard = 0; st == PD_OK && pd_engine_active(e) > 0 && guard < 1000; guard++)
        st = pd_engine_step(e, err);
    for (int i = 0; st == PD_OK && i < n; i++) {
        if (req[i]->finish == PD_FINISH_ERROR)
            st = pd_err_set(err, PD_ERR_INTERNAL, "request %d: %s", i, req[i]->error);
        res->n_out[i] = req[i]->n_out < 64 ? req[i]->n_out : 64;
        memcpy(res->out[i], req[i]->out, (size_t)res->n_out[i] * sizeof(int32_t));
        res->n_rounds[i] = req[i]->n_rounds < 64 ? req[i]->n_rounds : 64;
        memcpy(res->acc[i], req[i]->accepted, (size_t)res->n_rounds[i] * sizeof(int));
    }
    int swapped;
    size_t bytes;
    pd_engine_swap_stats(e, &res->preemptions, &swapped, &bytes);
    for (int i = 0; i < n; i++)
        if (req[i] != NULL)
            pd_engine_release(e, req[i]);
    res->free_pages = pd_engine_kv_free_pages(e);
    pd_engine_destroy(e);
    return st;
}

static void test_engine(const pd_st_set *g, int max_cp)
{
    const int32_t *prompts[3];
    int32_t lens[3];
    golden_prompts(g, 3, prompts, lens);
    pd_err err;
    /* chunk 24: the 37- and 100-token prompts are prefilled over a cached prefix */
    const int chunks[2] = {2048, 24};
    for (int c = 0; c < 2; c++) {
        gen_result ref;
        pd_status st = generate(1, PD_CP_STRATEGY_ROUND_ROBIN, chunks[c], 0, prompts, lens, 3, NULL, 0, 0, &ref, &err);
        TEST_CHECK_MSG(st == PD_OK, "engine cp 1: %s", err.msg);
        for (int cp = 2; cp <= max_cp; cp++)
            for (int s = 0; s < PD_CP_STRATEGY_COUNT; s++) {
                gen_result got;
                st = generate(cp, (pd_cp_strategy)s, chunks[c], 0, prompts, lens, 3, NULL, 0, 0, &got, &err);
                TEST_CHECK_MSG(st == PD_OK, "engine cp %d %s: %s", cp, pd_cp_strategy_name(s), err.msg);
                int same = 1;
                for (int i = 0; i < 3; i++) {
                    same &= got.n_out[i] == ref.n_out[i] && got.n_out[i] == 32 &&
                            memcmp(got.out[i], ref.out[i], (size_t)ref.n_out[i] * 4) == 0;
                    same &= got.n_rounds[i] == ref.n_rounds[i] &&
                            memcmp(got.acc[i], ref.acc[i], (size_t)ref.n_rounds[i] * sizeof(int)) == 0;
                }
                TEST_CHECK_MSG(same, "engine cp %d %s chunk %d: tokens or acceptance differ from cp 1",
                               cp, pd_cp_strategy_name(s), chunks[c]);
                /* what the drafter got: same calls, shapes and content as cp 1 */
                TEST_CHECK(got.aux.bad_shape == 0 && got.aux.calls == ref.aux.calls &&
                           got.aux.n == ref.aux.n && got.aux.n > 0);
                if (got.aux.n == ref.aux.n && got.aux.n > 0) {
                    double e = test_rel_l2(got.aux.rows, ref.aux.rows, got.aux.n);
                    TEST_CHECK_MSG(e <= TOL, "engine cp %d %s: drafter aux differs (%.3g)", cp,
                                   pd_cp_strategy_name(s), e);
                }
                free(got.aux.rows);
                printf("engine cp %d %-17s chunk %4d: %s\n", cp, pd_cp_strategy_name(s), chunks[c],
                       same ? "same tokens and acceptance" : "DIFFERENT");
            }
        free(ref.aux.rows);
    }
}

/* Preemption under CP: a target pool too small for the three answers at once and a swap space
 * that holds nothing, so a victim's KV is given up and prefilled again over the CP ranks before
 * it resumes (recompute); every answer equals cp 1's in a large pool, and every page comes back. */
static void test_engine_recompute(const pd_st_set *g, int max_cp)
{
    const int32_t *prompts[3];
    int32_t lens[3];
    golden_prompts(g, 3, prompts, lens);
    int need = 0, held = 0;   /* pages of the three answers (prompt, 32 tokens and a block) and prompts */
    for (int i = 0; i < 3; i++) {
        need += (lens[i] + 32 + dm->cfg.block_size + PAGE) / PAGE;
        held += (lens[i] + PAGE) / PAGE;
    }
    const int pool = held + 4;   /* all admitted (a prompt's pages, a position more and the
                                  * watermark), far from all finished at once */
    pd_err err;
    gen_result ref;
    pd_status st = generate(1, PD_CP_STRATEGY_ROUND_ROBIN, 2048, 0, prompts, lens, 3, NULL, 0, 0, &ref, &err);
    TEST_CHECK_MSG(st == PD_OK, "engine cp 1: %s", err.msg);
    free(ref.aux.rows);
    for (int cp = 2; cp <= max_cp && st == PD_OK; cp++)
        for (int chunk = 2048; chunk >= 24; chunk = chunk == 2048 ? 24 : 0) {
            gen_result got;
            pd_status gs = generate(cp, PD_CP_STRATEGY_ZIGZAG, chunk, 0, prompts, lens, 3, NULL, pool, 1, &got, &err);
            TEST_CHECK_MSG(gs == PD_OK, "engine cp %d, %d pages, no swap space: %s", cp, pool, err.msg);
            int same = gs == PD_OK;
            for (int i = 0; i < 3; i++)
                same &= got.n_out[i] == 32 && memcmp(got.out[i], ref.out[i], 32 * 4) == 0;
            TEST_CHECK_MSG(same, "engine cp %d chunk %d with recompute: tokens differ from cp 1's", cp, chunk);
            TEST_CHECK_MSG(got.preemptions > 0, "engine cp %d chunk %d: no preemption in %d pages (the "
                           "answers need %d)", cp, chunk, pool, need);
            TEST_CHECK_MSG(got.free_pages == pool, "engine cp %d chunk %d: %d of %d pages free at the end",
                           cp, chunk, got.free_pages, pool);
            printf("engine cp %d chunk %4d, %d pages for %d: %llu preemptions (recompute), %s\n", cp, chunk,
                   pool, need, (unsigned long long)got.preemptions, same ? "same tokens as cp 1" : "DIFFERENT");
            free(got.aux.rows);
        }
}

/* ---- the seed's bug: the pre-norm hidden state handed to the DSpark path ------------------ */

static void test_hidden_handoff(const pd_st_set *g)
{
    const pd_st_tensor *t = pd_st_find(g, "g1.input_ids");
    int32_t len = (int32_t)t->shape[0];
    const int32_t *src[1] = {t->data};
    batch b = batch_of(1, &len, src);
    int H = tm->cfg.hidden_size;
    group gr;
    group_open(&gr, 2, PD_CP_STRATEGY_ZIGZAG, 0);
    pd_kv_seq seqs[2][1];
    pd_kv_seq *sp[2][1] = {{&seqs[0][0]}, {&seqs[1][0]}};
    pd_kv_seq *const *rank_sp[2] = {sp[0], sp[1]};
    for (int r = 0; r < 2; r++)
        reserve_all(gr.pool[r], &b, seqs[r]);
    int32_t row = b.T - 1;
    pd_cp_group_batch gb = { .n_seqs = 1, .seq_lens = b.lens, .ids = b.ids, .seqs = rank_sp,
                             .logit_rows = &row, .n_logits = 1 };
    pd_err err;
    TEST_CHECK(pd_cp_group_prefill(gr.g, &gb, &err) == PD_OK);
    TEST_CHECK(pd_cp_group_plan(gr.g)->split == 1);
    pd_cp_rank *r0 = pd_cp_group_rank(gr.g, 0);
    const float *hidden = pd_cp_rank_hidden(r0);
    pd_cp_aux good = pd_cp_rank_aux(r0);
    TEST_CHECK(pd_cp_aux_check(&good, b.T, n_taps * H, hidden, &err) == PD_OK);
    /* [T, hidden]: what the seed handed over */
    pd_cp_aux bad = { .data = hidden, .rows = b.T, .cols = H, .ld = H };
    TEST_CHECK(pd_cp_aux_check(&bad, b.T, n_taps * H, hidden, &err) == PD_ERR_INTERNAL);
    TEST_CHECK(strstr(err.msg, "packed aux") != NULL);
    /* the hidden state dressed in the aux shape (K = 1 would look like this) */
    pd_cp_aux dressed = { .data = hidden, .rows = b.T, .cols = n_taps * H, .ld = n_taps * H };
    TEST_CHECK(pd_cp_aux_check(&dressed, b.T, n_taps * H, hidden, &err) == PD_ERR_INTERNAL);
    pd_cp_aux wrong_rows = good;
    wrong_rows.rows = b.T - 1;
    TEST_CHECK(pd_cp_aux_check(&wrong_rows, b.T, n_taps * H, hidden, &err) == PD_ERR_INTERNAL);
    TEST_CHECK(pd_cp_aux_check(NULL, b.T, n_taps * H, hidden, &err) == PD_ERR_INTERNAL);
    for (int r = 0; r < 2; r++)
        release_all(gr.pool[r], &b, seqs[r]);
    group_close(&gr);
    batch_free(&b);

    /* through the engine: a CP run that hands the drafter the hidden state must fail loudly */
    const int32_t *prompts[1] = {t->data};
    gen_result res;
    pd_status st = generate(2, PD_CP_STRATEGY_ROUND_ROBIN, 2048, 1, prompts, &len, 1, NULL, 0, 0, &res, &err);
    TEST_CHECK_MSG(st == PD_ERR_INTERNAL, "engine with the hidden hand-off: %s", pd_status_str(st));
    TEST_CHECK(res.aux.calls == 0);   /* the drafter never saw it */
    free(res.aux.rows);
    printf("hidden-state hand-off rejected: %s\n", err.msg);
}

/* ---- errors: empty batches and a failing rank return, never hang --------------------------- */

static void test_errors(void)
{
    group gr;
    group_open(&gr, 3, PD_CP_STRATEGY_ROUND_ROBIN, 0);
    pd_err err;
    int32_t zero = 0, ids[8] = {1, 2, 3, 4, 5, 6, 7, 8}, len = 8, row = 7;
    pd_kv_seq seqs[3];
    pd_kv_seq *sp[3][1] = {{&seqs[0]}, {&seqs[1]}, {&seqs[2]}};
    pd_kv_seq *const *rank_sp[3] = {sp[0], sp[1], sp[2]};
    pd_cp_group_batch empty = { .n_seqs = 0, .seq_lens = &zero, .ids = ids, .seqs = rank_sp };
    TEST_CHECK(pd_cp_group_prefill(gr.g, &empty, &err) == PD_ERR_INVALID);
    empty.n_seqs = 1;
    TEST_CHECK(pd_cp_group_prefill(gr.g, &empty, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_cp_group_prefill(gr.g, NULL, &err) == PD_ERR_INVALID);
    pd_cp_batch rb = { .ids = ids, .seqs = sp[0] };
    TEST_CHECK(pd_cp_rank_forward(pd_cp_group_rank(gr.g, 0), NULL, &rb, &err) == PD_ERR_INVALID);

    /* rank 2 has no pages: it fails, the others leave their all-gather, the error comes back */
    batch b = batch_of(1, &len, NULL);
    for (int r = 0; r < 2; r++)
        reserve_all(gr.pool[r], &b, &seqs[r]);
    pd_kv_seq_init(&seqs[2]);
    pd_cp_group_batch gb = { .n_seqs = 1, .seq_lens = &len, .ids = ids, .seqs = rank_sp,
                             .logit_rows = &row, .n_logits = 1 };
    TEST_CHECK(pd_cp_group_prefill(gr.g, &gb, &err) == PD_ERR_INVALID);
    TEST_CHECK(strstr(err.msg, "rank 2") != NULL);
    /* a bad token id fails on every rank alike */
    ids[3] = tm->cfg.vocab_size;
    reserve_all(gr.pool[2], &b, &seqs[2]);
    TEST_CHECK(pd_cp_group_prefill(gr.g, &gb, &err) == PD_ERR_INVALID);
    ids[3] = 4;
    /* the group recovers: the next prefill works */
    TEST_CHECK_MSG(pd_cp_group_prefill(gr.g, &gb, &err) == PD_OK, "after a failure: %s", err.msg);
    for (int r = 0; r < 3; r++)
        release_all(gr.pool[r], &b, &seqs[r]);
    batch_free(&b);
    group_close(&gr);

    /* engine config: CP on a non-host backend is refused at create (checked via an invalid
     * strategy here, since this test runs on the CPU) */
    pd_engine_config ec = { .target = tm, .draft = dm, .cp_size = 2, .cp_strategy = PD_CP_STRATEGY_COUNT };
    pd_engine *e = NULL;
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_ERR_INVALID);
    printf("errors ok\n");
}

/* Waves of the same n prompts through one engine (cp ranks, chunk): wave 0 adds them together
 * (a batch of n sequences: a split plan), the later waves one at a time (one sequence: the
 * replicated plan of round-robin-split) - as a serving node sees them, a burst and then a
 * trickle. Each prompt's tokens in a later wave against wave 0's (a rank's state from earlier
 * requests and plans must not leak into later ones); returns the waves equal to wave 0 */
static int waves(int cp, int chunk, const int32_t *const *prompts, const int32_t *lens, int n,
                 const pd_qwen3_model *const *cp_targets, int n_waves, pd_err *err)
{
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = PAGE, .n_pages = 256,
                            .max_prefill_tokens = chunk, .cp_size = cp,
                            .cp_strategy = PD_CP_STRATEGY_ROUND_ROBIN, .cp_targets = cp_targets };
    pd_engine *e = NULL;
    if (pd_engine_create(&ec, &e, err) != PD_OK)
        return -1;
    int32_t first[4][32];
    int good = 0;
    pd_gen_params gp = { .sample = { .top_p = 1.0f }, .max_new_tokens = 32, .ignore_eos = 1 };
    pd_status st = PD_OK;
    for (int w = 0; w < n_waves && st == PD_OK; w++) {
        int same = 1;
        for (int i0 = 0; i0 < n && st == PD_OK; i0 += w == 0 ? n : 1) {
            int i1 = w == 0 ? n : i0 + 1;
            pd_request *req[4];
            for (int i = i0; i < i1 && st == PD_OK; i++)
                st = pd_engine_add(e, (uint64_t)(w * n + i + 1), prompts[i], lens[i], &gp, &req[i], err);
            for (int guard = 0; st == PD_OK && pd_engine_active(e) > 0 && guard < 1000; guard++)
                st = pd_engine_step(e, err);
            for (int i = i0; i < i1 && st == PD_OK; i++) {
                if (w == 0)
                    memcpy(first[i], req[i]->out, 32 * sizeof(int32_t));
                same &= req[i]->n_out == 32 && memcmp(first[i], req[i]->out, 32 * sizeof(int32_t)) == 0;
                pd_engine_release(e, req[i]);
            }
        }
        good += st == PD_OK && same;
    }
    pd_engine_destroy(e);
    return good;
}

static void test_waves(const pd_st_set *g)
{
    const int32_t *prompts[3];
    int32_t lens[3];
    golden_prompts(g, 3, prompts, lens);
    pd_err err;
    int g1 = waves(1, 2048, prompts, lens, 3, NULL, 3, &err);
    int g2 = waves(2, 2048, prompts, lens, 3, NULL, 3, &err);
    printf("engine waves (a burst, then one at a time): cp 1 %d/3, cp 2 %d/3 equal to the burst\n", g1, g2);
    TEST_CHECK_MSG(g1 == 3 && g2 == 3, "engine waves: cp 1 %d/3, cp 2 %d/3", g1, g2);
}

/* ---- NCCL: one GPU per rank --------------------------------------------------------------- */

static void set_device(int d)
{
#ifdef PD_HAVE_CUDA
    (void)cudaSetDevice(d);
#else
    (void)d;
#endif
}

/* local = 0: NCCL, rank r on GPU r. local = 1: local communicator, every rank on GPU 0 (device
 * copies between the ranks' buffers) - CP on a single GPU. */
static int test_gpu_group(int n, int local)
{
    if (!pd_comm_nccl_available())
        TEST_SKIP("this build has no CUDA (PD_WITH_CUDA=OFF)");
    if (n < 2 || n > MAX_RANKS)
        TEST_SKIP("--nccl / --cuda-local want 2..4 ranks");
    pd_err err;
    kern_backend *bes[MAX_RANKS] = {0};
    pd_qwen3_model *ms[MAX_RANKS] = {0};
    /* device 0 last, so this thread ends on it (a CUDA backend runs on the current device) */
    for (int r = n - 1; r >= 0; r--) {
        kern_backend_config bc = { .name = "cuda", .device = local ? 0 : r };
        set_device(local ? 0 : r);
        if (kern_backend_create(&bc, &bes[r], &err) != PD_OK)
            TEST_SKIP(err.msg);
        if (pd_qwen3_load(bes[r], PD_MODELS "/tiny-code-qwen3", &ms[r], &err) != PD_OK) {
            fprintf(stderr, "load on device %d: %s\n", r, err.msg);
            return 1;
        }
    }
    be0 = bes[0];
    tm = ms[0];
    TOL = 1e-2;   /* bf16 weights and KV; the ranks' GEMMs have other shapes than cp 1's */
    pd_st_set *g = NULL;
    if (pd_st_open(PD_FIXTURES "/golden/golden.safetensors", &g, &err) != PD_OK) {
        fprintf(stderr, "goldens: %s\n", err.msg);
        return 1;
    }
    const int32_t *gsrc[4];
    int32_t glens[4];
    golden_prompts(g, 4, gsrc, glens);
    batch gold = batch_of(4, glens, gsrc);
    result ref = reference(&gold);
    for (int st = 0; st < PD_CP_STRATEGY_COUNT; st++) {
        pd_kv_pool *pools[MAX_RANKS];
        pd_cp_rank_res res[MAX_RANKS];
        for (int r = n - 1; r >= 0; r--) {
            set_device(local ? 0 : r);
            pools[r] = new_pool(bes[r]);
            res[r] = (pd_cp_rank_res){ .be = bes[r], .model = ms[r], .pool = pools[r], .device = local ? 0 : r };
        }
        pd_cp_group_config gc = { .opts = { .strategy = (pd_cp_strategy)st, .cp_size = n },
                                  .comm = local ? PD_CP_COMM_LOCAL : PD_CP_COMM_NCCL, .ranks = res,
                                  .taps = taps, .n_taps = n_taps, .timeout_ms = 60000,
                                  .copy = local ? pd_comm_cuda_copy : NULL };
        pd_cp_group *grp = NULL;
        pd_status s = pd_cp_group_create(&gc, &grp, &err);
        TEST_CHECK_MSG(s == PD_OK, "nccl group: %s", err.msg);
        if (s != PD_OK)
            break;
        pd_kv_seq seqs[MAX_RANKS][8];
        pd_kv_seq *sp[MAX_RANKS][8];
        pd_kv_seq *const *rank_sp[MAX_RANKS];
        for (int r = 0; r < n; r++) {
            reserve_all(pools[r], &gold, seqs[r]);
            for (int q = 0; q < gold.n_seqs; q++)
                sp[r][q] = &seqs[r][q];
            rank_sp[r] = sp[r];
        }
        int32_t rows[8];
        last_rows(&gold, rows);
        pd_cp_group_batch gb = { .n_seqs = gold.n_seqs, .seq_lens = gold.lens, .ids = gold.ids,
                                 .seqs = rank_sp, .logit_rows = rows, .n_logits = gold.n_seqs };
        s = pd_cp_group_prefill(grp, &gb, &err);
        TEST_CHECK_MSG(s == PD_OK, "nccl prefill %s: %s", pd_cp_strategy_name(st), err.msg);
        set_device(0);
        if (s == PD_OK) {
            int H = tm->cfg.hidden_size, V = tm->cfg.vocab_size, bad = 0, same_first = 0;
            size_t D = (size_t)tm->cfg.num_key_value_heads * tm->cfg.head_dim;
            pd_cp_rank *r0 = pd_cp_group_rank(grp, 0);
            TEST_CHECK(pd_cp_group_plan(grp)->split == 1);
            float *aux = download(be0, pd_cp_rank_aux(r0).data, (size_t)gold.T * n_taps * H);
            check_rel("aux", aux, ref.aux, (size_t)gold.T * n_taps * H, &bad);
            float *lg = download(be0, pd_cp_rank_logits(r0), (size_t)gold.n_seqs * V);
            check_rel("logits", lg, ref.logits, (size_t)gold.n_seqs * V, &bad);
            for (int q = 0; q < gold.n_seqs; q++)
                same_first += pd_cp_rank_first_tokens(r0)[q] == ref.first[q];
            float *kv = read_kv(be0, pools[0], &gold, seqs[0]);
            size_t n_kv = kv_index(&gold, gold.n_seqs, 0, 0, 0);
            check_rel("kv", kv, ref.kv[0], n_kv, &bad);
            (void)D;
            TEST_CHECK_MSG(stray_kv(be0, pools[0], &gold, seqs[0]) == 0, "nccl %s: stray KV",
                           pd_cp_strategy_name(st));
            TEST_CHECK_MSG(bad == 0, "nccl %d ranks %s: %d mismatches", n, pd_cp_strategy_name(st), bad);
            printf("%s %d ranks %-17s aux %.2e logits %.2e kv %.2e, first tokens equal %d/%d\n",
                   local ? "cuda-local" : "nccl", n,
                   pd_cp_strategy_name(st), test_rel_l2(aux, ref.aux, (size_t)gold.T * n_taps * H),
                   test_rel_l2(lg, ref.logits, (size_t)gold.n_seqs * V), test_rel_l2(kv, ref.kv[0], n_kv),
                   same_first, gold.n_seqs);
            free(aux);
            free(lg);
            free(kv);
        }
        pd_cp_group_destroy(grp);
        for (int r = n - 1; r >= 0; r--) {
            set_device(local ? 0 : r);
            release_all(pools[r], &gold, seqs[r]);
            pd_kv_pool_destroy(pools[r]);
        }
        set_device(0);
    }
    /* the engine with the ranks' targets (pd_engine_config.cp_targets; the nodes' path) on a
     * DSpark run against cp 1. One chunk per prompt: the same tokens and acceptance (the ranks'
     * GEMMs stay on cuBLAS). 24-token chunks: the ranks' 12-row pieces take the skinny GEMM and
     * the split attention where cp 1's 24 rows take cuBLAS and the tensor cores, so bf16 results
     * differ by rounding and greedy text may part at a near-tie (printed, not asserted; on the
     * cpu every path is exact and test_engine asserts the same tokens) */
    set_device(0);
    if (pd_dspark_load(bes[0], PD_MODELS "/tiny-code-dspark", tm, &dm, &err) != PD_OK) {
        fprintf(stderr, "draft: %s\n", err.msg);
        return 1;
    }
    for (int c = 0; c < 2; c++) {
        const int chunk = c ? 24 : 2048;
        gen_result r1, rn;
        pd_status s1 = generate(1, PD_CP_STRATEGY_ROUND_ROBIN, chunk, 0, gsrc, glens, 3, NULL, 0, 0, &r1, &err);
        TEST_CHECK_MSG(s1 == PD_OK, "engine cp 1 on cuda: %s", err.msg);
        pd_status sn = generate(n, PD_CP_STRATEGY_ROUND_ROBIN, chunk, 0, gsrc, glens, 3,
                                (const pd_qwen3_model *const *)(ms + 1), 0, 0, &rn, &err);
        TEST_CHECK_MSG(sn == PD_OK, "engine cp %d on cuda: %s", n, err.msg);
        int same = s1 == PD_OK && sn == PD_OK, lead[3] = {0, 0, 0};
        for (int i = 0; i < 3; i++) {
            TEST_CHECK(rn.n_out[i] == 32 && r1.n_out[i] == 32);
            while (lead[i] < rn.n_out[i] && lead[i] < r1.n_out[i] && rn.out[i][lead[i]] == r1.out[i][lead[i]])
                lead[i]++;
            same &= rn.n_out[i] == r1.n_out[i] && lead[i] == r1.n_out[i] && rn.n_rounds[i] == r1.n_rounds[i] &&
                    memcmp(rn.acc[i], r1.acc[i], (size_t)r1.n_rounds[i] * sizeof(int)) == 0;
        }
        if (c == 0)
            TEST_CHECK_MSG(same, "engine cp %d (%s): tokens or acceptance differ from cp 1", n,
                           local ? "local" : "nccl");
        printf("engine %s %d ranks round-robin-split chunk %4d: %s (leading tokens equal to cp 1: "
               "%d %d %d of 32)\n", local ? "cuda-local" : "nccl", n, chunk,
               same ? "same tokens and acceptance as cp 1" : "differs", lead[0], lead[1], lead[2]);
        free(r1.aux.rows);
        free(rn.aux.rows);
    }
    for (int c = 0; c < 2; c++) {
        const int chunk = c ? 24 : 2048;
        int g1 = waves(1, chunk, gsrc, glens, 3, NULL, 3, &err);
        int gn = waves(n, chunk, gsrc, glens, 3, (const pd_qwen3_model *const *)(ms + 1), 3, &err);
        printf("engine waves chunk %4d (a burst, then one at a time): cp 1 %d/3 equal to the burst, "
               "cp %d %d/3\n", chunk, g1, n, gn);
        /* a GPU engine prefills one request per forward (CP too), so a burst and a trickle cut
         * the ranks' pieces the same way, chunked or not */
        TEST_CHECK_MSG(g1 == 3 && gn == 3, "engine waves chunk %d: cp 1 %d/3, cp %d %d/3 (%s)", chunk,
                       g1, n, gn, err.msg);
    }
    pd_dspark_free(dm);
    dm = NULL;
    result_free(&ref);
    batch_free(&gold);
    pd_st_close(g);
    for (int r = n - 1; r >= 0; r--) {
        set_device(local ? 0 : r);
        pd_qwen3_free(ms[r]);
        kern_backend_destroy(bes[r]);
    }
    TEST_DONE();
}

int main(int argc, char **argv)
{
    int max_cp = MAX_RANKS;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            max_cp = 2;
        else if (strcmp(argv[i], "--nccl") == 0 && i + 1 < argc)
            return test_gpu_group(atoi(argv[++i]), 0);
        else if (strcmp(argv[i], "--cuda-local") == 0 && i + 1 < argc)
            return test_gpu_group(atoi(argv[++i]), 1);
    }
    pd_err err;
    kern_backend_config bc = { .name = "cpu", .threads = 1 };
    if (kern_backend_create(&bc, &be0, &err) != PD_OK ||
        pd_qwen3_load(be0, PD_MODELS "/tiny-code-qwen3", &tm, &err) != PD_OK ||
        pd_dspark_load(be0, PD_MODELS "/tiny-code-dspark", tm, &dm, &err) != PD_OK) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return 1;
    }
    pd_st_set *g = NULL;
    if (pd_st_open(PD_FIXTURES "/golden/golden.safetensors", &g, &err) != PD_OK) {
        fprintf(stderr, "goldens: %s\n", err.msg);
        return 1;
    }
    test_errors();
    test_hidden_handoff(g);
    test_forward(g, max_cp);
    test_engine(g, max_cp);
    test_engine_recompute(g, max_cp);
    test_waves(g);
    pd_st_close(g);
    pd_dspark_free(dm);
    pd_qwen3_free(tm);
    kern_backend_destroy(be0);
    TEST_DONE();
}
