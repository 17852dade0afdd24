/* test_eval.c - the 32 public eval prompts: greedy speculative decoding is lossless and its
 * acceptance matches DeepSpec's reference.
 * For each draft (vanilla, gated, rnn): every prompt's speculative output must equal the
 * engine's own target-only greedy output and the reference greedy_ids token for token; where
 * they part, the target's top-2 logit gap at that position is shown and only a numerical tie
 * (gap < 1e-3) may excuse it. Overall tau must be within +-3% of the reference (fp32 run of
 * public_reference.json for vanilla, public_reference_heads.json for gated/rnn), and the table
 * of per-prompt tau and per-position acceptance is printed next to the reference's.
 * Prompts run 8 at a time through one engine (continuous batching).
 * Usage: test_eval [--backend cpu|cuda] [--dtype bf16|f32] [--draft vanilla|gated|rnn|all]
 *                  [--ref fp32|bf16] [--act-bf16]
 * --dtype f32 keeps a CUDA backend's weights and KV in fp32 (the CPU backend always is); an fp32
 * run must then equal the fp32 reference's greedy ids. A CUDA bf16 run rounds activations to
 * bf16 (kern_backend.act_bf16); --act-bf16 makes the CPU backend do the same (its products are
 * not batch-invariant, so there a rounding boundary can part speculative from target-only
 * decoding: a study mode, not a test). gated/rnn have an fp32 reference only: with bf16
 * activations their tau is printed against it, not asserted. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_engine.h"
#include "pd_graph.h"
#include "test_util.h"

#define N_PROMPTS 32
#define MAX_NEW 128
#define CONCURRENCY 8

typedef struct {
    int32_t ids[512];
    int n;
    int32_t out[MAX_NEW + 8];
    int n_out;
    int accepted[MAX_NEW + 8];
    int verified[MAX_NEW + 8];
    int rounds;
    int at_pos[32];
} run_result;

static kern_backend *be;
static const pd_qwen3_model *tm;
static pd_verify_policy policy = PD_VERIFY_FULL;
static pd_graph_mode graphs = PD_GRAPHS_AUTO;
static int strict_ref = 1;   /* assert equality with the reference greedy ids (fp32 runs) */
static float threshold = 0.5f;
static run_result prompts[N_PROMPTS];

static int load_prompts(void)
{
    static test_prompt tp[N_PROMPTS];
    if (test_load_eval_prompts(PD_FIXTURES "/eval/public_prompts.jsonl", tp, N_PROMPTS) != 0)
        return -1;
    for (int i = 0; i < N_PROMPTS; i++) {
        prompts[i].n = tp[i].n;
        memcpy(prompts[i].ids, tp[i].ids, (size_t)tp[i].n * sizeof(int32_t));
    }
    return 0;
}

/* Runs all prompts through one engine, CONCURRENCY at a time. */
static int run_all(const pd_dspark_model *dm, run_result *res)
{
    pd_err err;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 512, .graphs = graphs };
    if (pd_engine_create(&ec, &e, &err) != PD_OK) {
        fprintf(stderr, "engine: %s\n", err.msg);
        return -1;
    }
    pd_gen_params gp = { .sample = { .temperature = 0.0f, .top_p = 1.0f }, .max_new_tokens = MAX_NEW,
                         .verify_policy = dm != NULL ? policy : PD_VERIFY_FULL, .verify_threshold = threshold };
    pd_request *live[CONCURRENCY] = {0};
    int owner[CONCURRENCY];
    int next = 0, done = 0;
    while (done < N_PROMPTS) {
        for (int s = 0; s < CONCURRENCY && next < N_PROMPTS; s++)
            if (live[s] == NULL) {
                if (pd_engine_add(e, (uint64_t)next, prompts[next].ids, prompts[next].n, &gp, &live[s],
                                  &err) != PD_OK) {
                    fprintf(stderr, "add %d: %s\n", next, err.msg);
                    pd_engine_destroy(e);
                    return -1;
                }
                owner[s] = next++;
            }
        if (pd_engine_step(e, &err) != PD_OK) {
            fprintf(stderr, "step: %s\n", err.msg);
            pd_engine_destroy(e);
            return -1;
        }
        for (int s = 0; s < CONCURRENCY; s++) {
            pd_request *r = live[s];
            if (r == NULL || r->finish == PD_FINISH_NONE)
                continue;
            run_result *o = &res[owner[s]];
            TEST_CHECK_MSG(r->finish != PD_FINISH_ERROR, "prompt %d: %s", owner[s], r->error);
            o->n_out = r->n_out;
            memcpy(o->out, r->out, (size_t)r->n_out * 4);
            o->rounds = r->n_rounds;
            memcpy(o->accepted, r->accepted, (size_t)r->n_rounds * sizeof(int));
            if (r->verified != NULL)
                memcpy(o->verified, r->verified, (size_t)r->n_rounds * sizeof(int));
            memcpy(o->at_pos, r->accepted_at_pos, sizeof(o->at_pos));
            pd_engine_release(e, r);
            live[s] = NULL;
            done++;
        }
    }
    TEST_CHECK_MSG(pd_engine_kv_free_pages(e) == 512, "kv pages leaked: %d of 512 free",
                   pd_engine_kv_free_pages(e));
    uint64_t g_eager = 0, g_cap = 0, g_rep = 0;
    pd_engine_graph_stats(e, &g_eager, &g_cap, &g_rep);
    printf("%s: graphs: %llu eager steps, %llu captures, %llu replays\n", dm != NULL ? "dspark" : "target-only",
           (unsigned long long)g_eager, (unsigned long long)g_cap, (unsigned long long)g_rep);
    if (graphs == PD_GRAPHS_AUTO && !be->is_host)   /* the decode steps must really replay graphs */
        TEST_CHECK_MSG(g_rep > g_cap && g_cap > 0, "graphs: %llu captures, %llu replays",
                       (unsigned long long)g_cap, (unsigned long long)g_rep);
    if (graphs == PD_GRAPHS_PAD) {
        TEST_CHECK_MSG(g_eager > 0 && g_rep == 0, "padded steps ran eagerly: %llu", (unsigned long long)g_eager);
        /* padding to buckets must keep the shapes few, or a GPU would warm up (run eagerly) a
         * new graph in most rounds instead of replaying one */
        long rounds = pd_engine_phase_times(e)->rounds;
        uint64_t shapes = pd_engine_graph_cold(e);
        printf("%s: %llu step shapes over %ld engine rounds\n", dm != NULL ? "dspark" : "target-only",
               (unsigned long long)shapes, rounds);
        TEST_CHECK_MSG(shapes * 4 <= (uint64_t)rounds, "%llu step shapes over %ld rounds",
                       (unsigned long long)shapes, rounds);
    }
    pd_engine_destroy(e);
    return 0;
}

/* The target's top-2 logit gap after prompt + out[0..j-1] (the position where outputs part). */
static double gap_at(int p, const int32_t *out, int j)
{
    pd_err err;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .page_size = 16, .n_pages = 64, .graphs = graphs };
    double gap = -1.0;
    if (pd_engine_create(&ec, &e, &err) != PD_OK)
        return gap;
    int n = prompts[p].n + j;
    int32_t *ids = malloc((size_t)n * 4);
    memcpy(ids, prompts[p].ids, (size_t)prompts[p].n * 4);
    memcpy(ids + prompts[p].n, out, (size_t)j * 4);
    pd_kv_seq seq;
    pd_kv_seq_init(&seq);
    pd_kv_pool *pool = pd_target_pool(pd_engine_target(e));
    if (pd_kv_seq_reserve(pool, &seq, n, &err) == PD_OK) {
        int32_t *pos = malloc((size_t)n * 4), *sq = calloc((size_t)n, 4), last = n - 1;
        for (int i = 0; i < n; i++)
            pos[i] = i;
        pd_kv_seq *seqs[1] = {&seq};
        pd_tok_batch b = { .n_tok = n, .ids = ids, .pos = pos, .seq = sq, .n_seq = 1, .seqs = seqs };
        if (pd_target_forward(pd_engine_target(e), &b, &last, 1, &err) == PD_OK) {
            int V = tm->cfg.vocab_size;
            float *l = malloc((size_t)V * 4);
            kern_download(be, l, pd_target_logits(pd_engine_target(e)), (size_t)V * 4, &err);
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int i = 0; i < V; i++) {
                if (l[i] > b1) {
                    b2 = b1;
                    b1 = l[i];
                } else if (l[i] > b2) {
                    b2 = l[i];
                }
            }
            gap = b1 - b2;
            free(l);
        }
        free(pos);
        free(sq);
        pd_kv_seq_release(pool, &seq);
    }
    free(ids);
    pd_engine_destroy(e);
    return gap;
}

/* Compares a and b; a difference is excused only by a numerical tie. Returns 1 when equal up
 * to ties. */
static int compare_outputs(const char *what, int p, const int32_t *a, int na, const int32_t *b, int nb)
{
    int n = na < nb ? na : nb;
    for (int j = 0; j < n; j++)
        if (a[j] != b[j]) {
            double gap = gap_at(p, a, j);
            printf("  prompt %2d: %s part at generated token %d (%d vs %d), target top-2 gap %.3g%s\n", p,
                   what, j, a[j], b[j], gap, gap >= 0 && gap < 1e-3 ? " (numerical tie: excused)" : "");
            return gap >= 0 && gap < 1e-3;
        }
    if (na != nb)
        printf("  prompt %2d: %s lengths differ (%d vs %d)\n", p, what, na, nb);
    return na == nb;
}

/* ref_same_dtype: the reference tau comes from a run in this run's activation dtype (asserted
 * within 3%); 0: only an fp32 reference exists for a bf16 run (gated/rnn), printed only */
static void eval_draft(const char *label, const char *dir, const cJSON *ref_prompts, const char *ref_key,
                       double ref_tau, const cJSON *ref_pos, const run_result *greedy, int ref_same_dtype)
{
    pd_err err;
    pd_dspark_model *dm = NULL;
    if (pd_dspark_load(be, dir, tm, &dm, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "load %s: %s", dir, err.msg);
        return;
    }
    static run_result spec[N_PROMPTS];
    memset(spec, 0, sizeof(spec));
    if (run_all(dm, spec) != 0) {
        TEST_CHECK_MSG(0, "%s: run failed", label);
        pd_dspark_free(dm);
        return;
    }
    int B = dm->cfg.block_size;
    long acc_sum = 0, rounds = 0, pos_sum[32] = {0};
    int lossless = 0, ref_equal = 0;
    printf("\n== %s draft (%s): %d prompts, greedy, block %d, max_new %d, verify %s ==\n", label, dir, N_PROMPTS,
           B, MAX_NEW, pd_verify_policy_name(policy));
    printf("prompt  tau    ref_tau  rounds ref_rounds  equal_target equal_ref\n");
    for (int p = 0; p < N_PROMPTS; p++) {
        const run_result *s = &spec[p];
        const cJSON *rp = cJSON_GetObjectItem(cJSON_GetArrayItem(ref_prompts, p), ref_key);
        const cJSON *gids = cJSON_GetObjectItem(rp, "greedy_ids");
        int32_t ref_ids[MAX_NEW + 8];
        int n_ref = cJSON_GetArraySize(gids);
        for (int j = 0; j < n_ref && j < MAX_NEW + 8; j++)
            ref_ids[j] = cJSON_GetArrayItem(gids, j)->valueint;
        long a = 0;
        for (int r = 0; r < s->rounds; r++)
            a += s->accepted[r];
        acc_sum += a;
        rounds += s->rounds;
        for (int k = 0; k < B; k++)
            pos_sum[k] += s->at_pos[k];
        int eq_t = memcmp(s->out, greedy[p].out, (size_t)s->n_out * 4) == 0 && s->n_out == greedy[p].n_out;
        int eq_r = s->n_out == n_ref && memcmp(s->out, ref_ids, (size_t)n_ref * 4) == 0;
        if (!eq_t)
            eq_t = compare_outputs("speculative vs target-only", p, s->out, s->n_out, greedy[p].out,
                                   greedy[p].n_out);
        if (!eq_r)
            eq_r = compare_outputs("speculative vs reference greedy", p, s->out, s->n_out, ref_ids, n_ref);
        lossless += eq_t;
        ref_equal += eq_r;
        TEST_CHECK_MSG(eq_t, "%s prompt %d: speculative output differs from target-only greedy", label, p);
        /* the fp32 engine must reproduce the fp32 reference; in bf16 another implementation's
         * rounding legitimately parts from ours (the reference's own bf16 greedy differs from
         * its fp32 greedy on 13 of 32 prompts), so there only losslessness and tau are asserted */
        if (strict_ref)
            TEST_CHECK_MSG(eq_r, "%s prompt %d: output differs from the reference greedy ids", label, p);
        printf("%6d  %.3f  %.3f    %4d   %4d        %s          %s\n", p,
               s->rounds ? (double)a / s->rounds : 0.0, cJSON_GetObjectItem(rp, "tau")->valuedouble,
               s->rounds, cJSON_GetObjectItem(rp, "rounds")->valueint, eq_t ? "yes" : "NO", eq_r ? "yes" : "NO");
    }
    double tau = rounds ? (double)acc_sum / rounds : 0.0;
    printf("overall tau %.4f (reference %.4f, %+.2f%%), %ld rounds; lossless %d/%d, equal to reference %d/%d\n",
           tau, ref_tau, 100.0 * (tau - ref_tau) / ref_tau, rounds, lossless, N_PROMPTS, ref_equal, N_PROMPTS);
    printf("acceptance by position:");
    for (int k = 0; k < B; k++)
        printf(" %.3f", rounds ? (double)pos_sum[k] / rounds : 0.0);
    printf("\nreference             :");
    for (int k = 0; k < B && k < cJSON_GetArraySize(ref_pos); k++)
        printf(" %.3f", cJSON_GetArrayItem(ref_pos, k)->valuedouble);
    printf("\n");
    if (policy == PD_VERIFY_SCHEDULED) {
        /* rounds that verified every draft accept about as much as full verification does (a
         * guard on draft quality under the scheduler; the deferred draft context itself is
         * checked exactly in test_engine) */
        long acc_all = 0, n_all = 0;
        for (int p = 0; p < N_PROMPTS; p++)
            for (int k = 0; k < spec[p].rounds; k++)
                if (spec[p].verified[k] == B) {
                    acc_all += spec[p].accepted[k];
                    n_all++;
                }
        double tau_all = n_all > 0 ? (double)acc_all / n_all : 0.0;
        printf("scheduled: %ld rounds verified all %d drafts, tau there %.4f (full-verification reference %.4f)\n",
               n_all, B, tau_all, ref_tau);
        if (n_all >= 50)
            TEST_CHECK_MSG(tau_all >= 0.8 * ref_tau, "%s: rounds verifying all drafts reach tau %.4f only "
                           "(reference %.4f): the draft context is broken", label, tau_all, ref_tau);
    }
    if (policy == PD_VERIFY_FULL && ref_same_dtype)
        TEST_CHECK_MSG(fabs(tau - ref_tau) <= 0.03 * ref_tau, "%s: tau %.4f not within 3%% of %.4f", label, tau, ref_tau);
    else if (policy == PD_VERIFY_FULL)
        printf("%s: the reference is an fp32 run (public_reference_heads.json has no bf16 run) and this run "
               "rounds activations to bf16: tau %+.2f%% from it, not asserted\n", label,
               100.0 * (tau - ref_tau) / ref_tau);
    else
        printf("verify policy %s: tau is not comparable with the full-verification reference\n",
               pd_verify_policy_name(policy));
    pd_dspark_free(dm);
}

int main(int argc, char **argv)
{
    const char *backend = "cpu", *which = "all", *ref_run = "fp32";
    int f32 = 0, act_bf16 = 0;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--act-bf16") == 0) {   /* a flag: drop it from the pairs below */
            act_bf16 = 1;
            memmove(argv + i, argv + i + 1, (size_t)(argc - i) * sizeof(*argv));
            argc--;
            i--;
        }
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--backend") == 0)
            backend = argv[i + 1];
        else if (strcmp(argv[i], "--dtype") == 0 && (strcmp(argv[i + 1], "f32") == 0 || strcmp(argv[i + 1], "bf16") == 0))
            f32 = strcmp(argv[i + 1], "f32") == 0;
        else if (strcmp(argv[i], "--draft") == 0)
            which = argv[i + 1];
        else if (strcmp(argv[i], "--ref") == 0)
            ref_run = argv[i + 1];
        else if (strcmp(argv[i], "--verify") == 0 && pd_verify_policy_parse(argv[i + 1], &policy, NULL) != PD_OK)
            return 2;
        else if (strcmp(argv[i], "--threshold") == 0)
            threshold = strtof(argv[i + 1], NULL);
        else if (strcmp(argv[i], "--graphs") == 0 && pd_graph_mode_parse(argv[i + 1], &graphs, NULL) != PD_OK)
            return 2;
    }
    pd_err err;
    kern_backend_config bc = { .name = backend, .f32 = f32, .act_bf16 = act_bf16 };
    if (kern_backend_create(&bc, &be, &err) != PD_OK) {
        if (strcmp(backend, "cpu") != 0)
            TEST_SKIP(err.msg);
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    strict_ref = be->weight_dtype == KERN_DTYPE_F32;
    pd_qwen3_model *m = NULL;
    if (pd_qwen3_load(be, PD_MODELS "/tiny-code-qwen3", &m, &err) != PD_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    tm = m;
    if (load_prompts() != 0) {
        fprintf(stderr, "cannot read the eval prompts\n");
        return 1;
    }
    char *rs = test_read_file(PD_FIXTURES "/eval/public_reference.json", NULL);
    char *hs = test_read_file(PD_FIXTURES "/eval/public_reference_heads.json", NULL);
    cJSON *ref = cJSON_Parse(rs), *heads = cJSON_Parse(hs);
    free(rs);
    free(hs);
    if (ref == NULL || heads == NULL) {
        fprintf(stderr, "cannot parse the reference files\n");
        return 1;
    }
    static run_result greedy[N_PROMPTS];
    if (run_all(NULL, greedy) != 0)
        return 1;
    const cJSON *rr = cJSON_GetObjectItem(cJSON_GetObjectItem(ref, "runs"), ref_run);
    const cJSON *ov = cJSON_GetObjectItem(rr, "overall");
    if (strcmp(which, "all") == 0 || strcmp(which, "vanilla") == 0)
        eval_draft("vanilla", PD_MODELS "/tiny-code-dspark", cJSON_GetObjectItem(ref, "per_prompt"), ref_run,
                   cJSON_GetObjectItem(ov, "acceptance_length")->valuedouble,
                   cJSON_GetObjectItem(ov, "accept_rates_by_position"), greedy, 1);
    const char *hk[2] = {"gated", "rnn"};
    for (int h = 0; h < 2; h++) {
        if (strcmp(which, "all") != 0 && strcmp(which, hk[h]) != 0)
            continue;
        char dir[256];
        snprintf(dir, sizeof(dir), PD_MODELS "/tiny-code-dspark-%s", hk[h]);
        const cJSON *hov = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(heads, "runs"), hk[h]),
                                               "overall");
        eval_draft(hk[h], dir, cJSON_GetObjectItem(heads, "per_prompt"), hk[h],
                   cJSON_GetObjectItem(hov, "acceptance_length")->valuedouble,
                   cJSON_GetObjectItem(hov, "accept_rates_by_position"), greedy, !be->act_bf16);
    }
    cJSON_Delete(ref);
    cJSON_Delete(heads);
    pd_qwen3_free(m);
    kern_backend_destroy(be);
    TEST_DONE();
}
