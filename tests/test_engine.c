/* test_engine.c - engine behaviour beyond the goldens: the external-prefill path (what a decode
 * node does with a prefill node's KV pages and aux rows) equals the in-process path; batching
 * does not change results; pages return to the pool on finish, cancel and release; a full pool
 * answers BUSY and loses nothing else; a long prompt is prefilled in chunks of
 * max_prefill_tokens with a decode round between them, so a running request keeps producing
 * tokens meanwhile, and the chunked prompt decodes as it does prefilled whole. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pd_engine.h"
#include "pd_grammar.h"
#include "test_util.h"

static kern_backend *be;
static pd_qwen3_model *tm;
static pd_dspark_model *dm;

static const int32_t prompt_a[] = {1069, 4873, 4088, 7158, 365, 1966, 1476, 1947, 388, 1756, 834, 1503,
                                   293, 519, 7058, 395, 11, 12, 13, 220, 220, 17};
static const int32_t prompt_b[] = {2, 2729, 220, 17, 15, 17, 16, 631, 5376};

static pd_gen_params greedy(int max_new)
{
    pd_gen_params gp = { .sample = { .temperature = 0.0f, .top_p = 1.0f }, .max_new_tokens = max_new };
    return gp;
}

static int run_to_end(pd_engine *e)
{
    pd_err err;
    while (pd_engine_active(e) > 0)
        if (pd_engine_step(e, &err) != PD_OK) {
            fprintf(stderr, "step: %s\n", err.msg);
            return -1;
        }
    return 0;
}

/* copy every layer's K and V of the given pages from one pool to another (same layout) */
static void copy_pages(pd_kv_pool *src, const pd_kv_seq *ss, pd_kv_pool *dst, const pd_kv_seq *ds, int n_pages)
{
    const pd_kv_layout *lay = pd_kv_pool_layout(src);
    size_t pb = pd_kv_page_bytes(lay);
    for (int l = 0; l < lay->n_layers; l++) {
        kern_kv_layer a = pd_kv_pool_layer(src, l), b = pd_kv_pool_layer(dst, l);
        for (int p = 0; p < n_pages; p++) {
            memcpy((char *)b.k + (size_t)ds->pages[p] * pb, (char *)a.k + (size_t)ss->pages[p] * pb, pb);
            memcpy((char *)b.v + (size_t)ds->pages[p] * pb, (char *)a.v + (size_t)ss->pages[p] * pb, pb);
        }
    }
}

static void test_engine_external_prefill(void)
{
    pd_err err;
    pd_engine *ref = NULL, *pre = NULL, *dec = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 128 };
    TEST_CHECK(pd_engine_create(&ec, &ref, &err) == PD_OK);
    TEST_CHECK(pd_engine_create(&ec, &pre, &err) == PD_OK);
    /* the decode side uses a different page size mapping: same layout, other page ids */
    TEST_CHECK(pd_engine_create(&ec, &dec, &err) == PD_OK);
    int n = (int)(sizeof(prompt_a) / 4);
    pd_gen_params gp = greedy(40);
    pd_request *ra = NULL;
    TEST_CHECK(pd_engine_add(ref, 1, prompt_a, n, &gp, &ra, &err) == PD_OK);
    TEST_CHECK(run_to_end(ref) == 0);
    /* prefill node: prompt only, aux kept, pages held */
    pd_gen_params pg = greedy(1);
    pg.capture_aux = 1;
    pg.hold_kv = 1;
    pd_request *rp = NULL;
    TEST_CHECK(pd_engine_add(pre, 2, prompt_a, n, &pg, &rp, &err) == PD_OK);
    TEST_CHECK(run_to_end(pre) == 0);
    TEST_CHECK(pd_engine_step(pre, &err) == PD_OK);   /* held pages survive a later step */
    TEST_CHECK(rp->n_out == 1 && rp->aux != NULL && rp->tkv.n_pages > 0);
    /* burn a few pages on the decode side so its page ids differ */
    pd_request *filler = NULL;
    TEST_CHECK(pd_engine_add_external(dec, 9, prompt_b, 9, &gp, &filler, &err) == PD_OK);
    pd_request *rd = NULL;
    TEST_CHECK(pd_engine_add_external(dec, 3, prompt_a, n, &gp, &rd, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(dec, &err) == PD_OK);
    TEST_CHECK(rd->n_out == 0 && rd->finish == PD_FINISH_NONE);   /* waits for its prefill */
    copy_pages(pd_engine_target_pool(pre), &rp->tkv, pd_engine_target_pool(dec), &rd->tkv, (n + 15) / 16);
    TEST_CHECK(pd_engine_complete_prefill(dec, rd, rp->out[0], rp->aux, &err) == PD_OK);
    TEST_CHECK(pd_engine_complete_prefill(dec, rd, rp->out[0], rp->aux, &err) == PD_ERR_INVALID);
    pd_engine_fail(dec, filler, "prefill node went away");
    TEST_CHECK(run_to_end(dec) == 0);
    TEST_CHECK(filler->finish == PD_FINISH_ERROR && strstr(filler->error, "went away") != NULL);
    TEST_CHECK_MSG(rd->n_out == ra->n_out && memcmp(rd->out, ra->out, (size_t)ra->n_out * 4) == 0,
                   "external prefill output differs (%d vs %d tokens)", rd->n_out, ra->n_out);
    TEST_CHECK(rd->n_rounds == ra->n_rounds &&
               memcmp(rd->accepted, ra->accepted, (size_t)ra->n_rounds * sizeof(int)) == 0);
    int32_t bad_first = 99999;
    pd_request *rx = NULL;
    TEST_CHECK(pd_engine_add_external(dec, 4, prompt_b, 9, &gp, &rx, &err) == PD_OK);
    TEST_CHECK(pd_engine_complete_prefill(dec, rx, bad_first, rp->aux, &err) == PD_ERR_INVALID);
    pd_engine_release(dec, rx);
    pd_engine_release(pre, rp);
    pd_engine_release(dec, rd);
    pd_engine_release(dec, filler);
    pd_engine_release(ref, ra);
    TEST_CHECK(pd_engine_kv_free_pages(pre) == 128 && pd_engine_kv_free_pages(dec) == 128);
    pd_engine_destroy(ref);
    pd_engine_destroy(pre);
    pd_engine_destroy(dec);
}

/* The three --aux-transfer payloads (raw aux, context features, draft context K/V) give the
 * same decoding as the in-process prefill. */
static void test_engine_aux_modes(void)
{
    pd_err err;
    pd_engine *ref = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 128 };
    TEST_CHECK(pd_engine_create(&ec, &ref, &err) == PD_OK);
    int n = (int)(sizeof(prompt_a) / 4);
    pd_gen_params gp = greedy(32);
    pd_request *ra = NULL;
    TEST_CHECK(pd_engine_add(ref, 1, prompt_a, n, &gp, &ra, &err) == PD_OK);
    TEST_CHECK(run_to_end(ref) == 0);
    for (int mode = PD_AUX_RAW; mode <= PD_AUX_DRAFT_KV; mode++) {
        pd_engine *pre = NULL, *dec = NULL;
        TEST_CHECK(pd_engine_create(&ec, &pre, &err) == PD_OK);
        TEST_CHECK(pd_engine_create(&ec, &dec, &err) == PD_OK);
        pd_gen_params pg = greedy(1);
        pg.capture_aux = mode == PD_AUX_RAW;
        pg.capture_ctx = mode == PD_AUX_CTX;
        pg.hold_kv = 1;
        pd_request *rp = NULL, *filler = NULL, *rd = NULL;
        TEST_CHECK(pd_engine_add(pre, 2, prompt_a, n, &pg, &rp, &err) == PD_OK);
        TEST_CHECK(run_to_end(pre) == 0);
        TEST_CHECK(pd_engine_add_external(dec, 9, prompt_b, 9, &gp, &filler, &err) == PD_OK);
        TEST_CHECK(pd_engine_add_external(dec, 3, prompt_a, n, &gp, &rd, &err) == PD_OK);
        copy_pages(pd_engine_target_pool(pre), &rp->tkv, pd_engine_target_pool(dec), &rd->tkv,
                   (n + 15) / 16);
        const float *rows = mode == PD_AUX_RAW ? rp->aux : mode == PD_AUX_CTX ? rp->ctx : NULL;
        if (mode == PD_AUX_DRAFT_KV)
            copy_pages(pd_engine_draft_pool(pre), &rp->dkv, pd_engine_draft_pool(dec), &rd->dkv, (n + 15) / 16);
        pd_status st = pd_engine_complete_prefill_mode(dec, rd, rp->out[0], (pd_aux_mode)mode, rows, NULL, &err);
        TEST_CHECK_MSG(st == PD_OK, "%s: %s", pd_aux_mode_name((pd_aux_mode)mode), err.msg);
        pd_engine_fail(dec, filler, "unused");
        TEST_CHECK(run_to_end(dec) == 0);
        int same = rd->n_out == ra->n_out && memcmp(rd->out, ra->out, (size_t)ra->n_out * 4) == 0 &&
                   rd->n_rounds == ra->n_rounds &&
                   memcmp(rd->accepted, ra->accepted, (size_t)ra->n_rounds * sizeof(int)) == 0;
        TEST_CHECK_MSG(same, "aux transfer %s: decoding differs from the in-process prefill",
                       pd_aux_mode_name((pd_aux_mode)mode));
        printf("aux transfer %-8s: %s\n", pd_aux_mode_name((pd_aux_mode)mode), same ? "same tokens and acceptance" : "DIFFERS");
        pd_engine_release(pre, rp);
        pd_engine_release(dec, rd);
        pd_engine_release(dec, filler);
        pd_engine_destroy(pre);
        pd_engine_destroy(dec);
    }
    pd_aux_mode am;
    TEST_CHECK(pd_aux_mode_parse("draft-kv", &am, &err) == PD_OK && am == PD_AUX_DRAFT_KV);
    TEST_CHECK(pd_aux_mode_parse("bogus", &am, &err) == PD_ERR_INVALID);
    pd_engine_release(ref, ra);
    pd_engine_destroy(ref);
}

/* Two prompts alone and together give the same outputs; cancel frees pages. */
static void test_engine_batching_and_pages(void)
{
    pd_err err;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 4, .n_pages = 64 };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    int na = (int)(sizeof(prompt_a) / 4), nb = (int)(sizeof(prompt_b) / 4);
    pd_gen_params gp = greedy(24);
    int32_t alone_a[64], alone_b[64];
    int n_alone_a, n_alone_b;
    pd_request *r = NULL;
    TEST_CHECK(pd_engine_add(e, 1, prompt_a, na, &gp, &r, &err) == PD_OK);
    run_to_end(e);
    n_alone_a = r->n_out;
    memcpy(alone_a, r->out, (size_t)r->n_out * 4);
    pd_engine_release(e, r);
    TEST_CHECK(pd_engine_add(e, 2, prompt_b, nb, &gp, &r, &err) == PD_OK);
    run_to_end(e);
    n_alone_b = r->n_out;
    memcpy(alone_b, r->out, (size_t)r->n_out * 4);
    pd_engine_release(e, r);
    TEST_CHECK(pd_engine_kv_free_pages(e) == 64);
    pd_request *ra = NULL, *rb = NULL, *rc = NULL;
    TEST_CHECK(pd_engine_add(e, 3, prompt_a, na, &gp, &ra, &err) == PD_OK);
    TEST_CHECK(pd_engine_add(e, 4, prompt_b, nb, &gp, &rb, &err) == PD_OK);
    TEST_CHECK(pd_engine_add(e, 5, prompt_b, nb, &gp, &rc, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    pd_engine_cancel(e, rc);
    run_to_end(e);
    TEST_CHECK(rc->finish == PD_FINISH_CANCELLED);
    TEST_CHECK(ra->n_out == n_alone_a && memcmp(ra->out, alone_a, (size_t)n_alone_a * 4) == 0);
    TEST_CHECK(rb->n_out == n_alone_b && memcmp(rb->out, alone_b, (size_t)n_alone_b * 4) == 0);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK_MSG(pd_engine_kv_free_pages(e) == 64, "pages after finish/cancel: %d free of 64",
                   pd_engine_kv_free_pages(e));
    pd_engine_release(e, ra);
    pd_engine_release(e, rb);
    pd_engine_release(e, rc);
    /* a prompt that cannot get pages is refused with BUSY; the pool is intact afterwards */
    int32_t big[300];
    for (int i = 0; i < 300; i++)
        big[i] = 220;
    pd_request *rbig = NULL;
    TEST_CHECK(pd_engine_add(e, 6, big, 300, &gp, &rbig, &err) == PD_ERR_BUSY);
    TEST_CHECK(strstr(err.msg, "exhausted") != NULL);
    TEST_CHECK(pd_engine_kv_free_pages(e) == 64);
    TEST_CHECK(pd_engine_add(e, 7, prompt_b, nb, &gp, &r, &err) == PD_OK);
    run_to_end(e);
    TEST_CHECK(r->n_out == n_alone_b && memcmp(r->out, alone_b, (size_t)n_alone_b * 4) == 0);
    pd_engine_release(e, r);
    pd_engine_destroy(e);
}

static int pages_ascending(const pd_kv_seq *q)
{
    for (int i = 1; i < q->n_pages; i++)
        if (q->pages[i] != q->pages[0] + i)
            return 0;
    return q->n_pages > 0;
}

/* The pool hands a request its pages as one ascending run, also pages that came back from
 * another request (transfers and staging copies then take a layer's pages in one piece). */
static void test_engine_page_runs(void)
{
    pd_err err;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 4, .n_pages = 64 };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    int na = (int)(sizeof(prompt_a) / 4), nb = (int)(sizeof(prompt_b) / 4);
    pd_gen_params gp = greedy(8);
    pd_request *r1 = NULL, *r2 = NULL, *r3 = NULL;
    TEST_CHECK(pd_engine_add(e, 1, prompt_a, na, &gp, &r1, &err) == PD_OK);
    TEST_CHECK(pd_engine_add(e, 2, prompt_b, nb, &gp, &r2, &err) == PD_OK);
    TEST_CHECK(pages_ascending(&r1->tkv) && pages_ascending(&r2->tkv));
    int32_t first1 = r1->tkv.pages[0], n1 = r1->tkv.n_pages;
    pd_engine_release(e, r1);
    TEST_CHECK(pd_engine_add(e, 3, prompt_a, na, &gp, &r3, &err) == PD_OK);
    TEST_CHECK_MSG(pages_ascending(&r3->tkv) && r3->tkv.pages[0] == first1 && r3->tkv.n_pages == n1,
                   "pages given back came out as %d.. (%d), before %d.. (%d)", r3->tkv.pages[0],
                   r3->tkv.n_pages, first1, n1);
    pd_engine_release(e, r2);
    pd_engine_release(e, r3);
    pd_engine_destroy(e);
}

static void test_engine_chunked_prefill(void)
{
    enum { LONG = 600, CHUNK = 64 };
    pd_err err;
    int32_t longp[LONG];
    for (int i = 0; i < LONG; i++)
        longp[i] = prompt_a[i % (int)(sizeof(prompt_a) / 4)] + (i / 22) % 5;
    pd_gen_params gp = greedy(16);
    /* reference: the long prompt prefilled in one forward */
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 128,
                            .max_prefill_tokens = 4096 };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    pd_request *r = NULL;
    TEST_CHECK(pd_engine_add(e, 1, longp, LONG, &gp, &r, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK_MSG(r->prefilled == LONG, "whole prefill: %d of %d tokens after one step", r->prefilled, LONG);
    run_to_end(e);
    int32_t whole[16];
    int n_whole = r->n_out;
    memcpy(whole, r->out, sizeof(whole));
    pd_engine_release(e, r);
    pd_engine_destroy(e);

    ec.max_prefill_tokens = CHUNK;
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    pd_gen_params run = greedy(200);
    pd_request *ra = NULL, *rl = NULL;
    TEST_CHECK(pd_engine_add(e, 2, prompt_b, (int)(sizeof(prompt_b) / 4), &run, &ra, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK(ra->n_out >= 1);
    TEST_CHECK(pd_engine_add(e, 3, longp, LONG, &gp, &rl, &err) == PD_OK);
    int steps = 0, a_grew = 0;
    while (rl->prefilled < LONG && steps < 100) {
        int before = ra->n_out, pf = rl->prefilled;
        TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
        TEST_CHECK_MSG(rl->prefilled - pf == (LONG - pf < CHUNK ? LONG - pf : CHUNK),
                       "step %d prefilled %d tokens of the long prompt", steps, rl->prefilled - pf);
        a_grew += ra->n_out > before;
        steps++;
    }
    TEST_CHECK_MSG(steps == (LONG + CHUNK - 1) / CHUNK, "long prompt prefilled in %d steps", steps);
    TEST_CHECK_MSG(a_grew == steps, "the running request produced tokens in %d of %d prefill steps",
                   a_grew, steps);
    run_to_end(e);
    TEST_CHECK_MSG(rl->n_out == n_whole && memcmp(rl->out, whole, (size_t)n_whole * 4) == 0,
                   "chunked prefill decodes differently from a whole one");
    pd_engine_release(e, ra);
    pd_engine_release(e, rl);
    pd_engine_destroy(e);
}

/* The draft KV of r's first *len context positions (every committed position but the last
 * anchor): [layer][pos][K row, V row], malloc'd. */
static float *read_draft_kv(pd_engine *e, const pd_request *r, int *len)
{
    const pd_qwen3_config *dc = &dm->cfg.base;
    int row = dc->num_key_value_heads * dc->head_dim, L = dc->num_hidden_layers;
    *len = r->dkv.len - 1;
    pd_kv_pool *dp = pd_engine_draft_pool(e);
    float *kv = malloc((size_t)*len * L * 2 * row * sizeof(float));
    for (int l = 0; l < L; l++) {
        kern_kv_layer lay = pd_kv_pool_layer(dp, l);
        for (int p = 0; p < *len; p++) {
            int32_t slot = pd_kv_seq_slot(dp, &r->dkv, p);
            float *dst = kv + ((size_t)l * *len + p) * 2 * row;
            memcpy(dst, (const float *)lay.k + (size_t)slot * row, (size_t)row * sizeof(float));
            memcpy(dst + row, (const float *)lay.v + (size_t)slot * row, (size_t)row * sizeof(float));
        }
    }
    return kv;
}

/* max |a - b| over the first n positions of two read_draft_kv results */
static double draft_kv_diff(const float *a, int len_a, const float *b, int len_b, int n)
{
    const pd_qwen3_config *dc = &dm->cfg.base;
    int row = dc->num_key_value_heads * dc->head_dim, L = dc->num_hidden_layers;
    double maxd = 0.0;
    for (int l = 0; l < L; l++)
        for (int p = 0; p < n; p++)
            for (int i = 0; i < 2 * row; i++) {
                double d = fabs(a[((size_t)l * len_a + p) * 2 * row + i] - b[((size_t)l * len_b + p) * 2 * row + i]);
                maxd = d > maxd ? d : maxd;
            }
    return maxd;
}

static pd_engine *sched_engine_pages(int debug_arm, int n_pages)
{
    pd_err err;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 4, .n_pages = n_pages,
                            .verify_policy = PD_VERIFY_SCHEDULED, .sched_debug_arm = debug_arm };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    return e;
}

static pd_engine *sched_engine(int debug_arm) { return sched_engine_pages(debug_arm, 64); }

/* A scheduled engine whose rounds of any batch leave waiting decode rows as gaps (gaps = 1) or
 * that keeps them in the deferred buffer (gaps = 0), with a deferred buffer of buf_rows rows
 * (0: default). */
static pd_engine *gap_engine(int debug_arm, int gaps, int buf_rows, int n_pages)
{
    pd_err err;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 4, .n_pages = n_pages,
                            .verify_policy = PD_VERIFY_SCHEDULED, .sched_debug_arm = debug_arm,
                            .gap_min_batch = gaps ? 1 : 1 << 20, .pend_max_rows = buf_rows };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    return e;
}

/* Rounds without drafts (scheduled policy, "no drafts" arm) defer the drafter's context rows and
 * add them in one batch later: the draft KV of every committed position must end up as if each
 * round had added its rows at once (compared with the all-drafts arm, which adds them every
 * round); without the deferred batch those pages would never be written. Both ways of waiting:
 * the deferred buffer (aux rows copied) and gaps (rows recomputed by a target forward). */
static void test_engine_deferred_context(void)
{
    pd_err err;
    int na = (int)(sizeof(prompt_a) / 4);
    int len[3] = {0};
    float *kv[3] = {NULL};
    for (int run = 0; run < 3; run++) {   /* buffer, gaps, immediate */
        pd_engine *e = gap_engine(run < 2 ? 1 : 3, run == 1, 0, 64);
        pd_gen_params gp = greedy(20);
        gp.hold_kv = 1;
        pd_request *r = NULL;
        TEST_CHECK(pd_engine_add(e, 1, prompt_a, na, &gp, &r, &err) == PD_OK);
        run_to_end(e);
        /* the request holds its KV, so its prompt rows went in at once; 19 decode rounds */
        if (run == 0)
            TEST_CHECK_MSG(r->n_pend == 19 && r->n_gap == 0, "buffer: %d rows wait, %d in a gap", r->n_pend,
                           r->n_gap);
        if (run == 1)
            TEST_CHECK_MSG(r->n_pend == 19 && r->n_gap == 19 && r->gap_lo == na,
                           "decode rows %d..%d left as a gap, want %d..%d", r->gap_lo, r->gap_lo + r->n_gap - 1,
                           na, na + 18);
        TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* the finished request's rows land */
        TEST_CHECK(r->n_pend == 0);
        kv[run] = read_draft_kv(e, r, &len[run]);
        pd_engine_release(e, r);
        pd_engine_destroy(e);
    }
    for (int run = 0; run < 2; run++) {
        int n = len[run] < len[2] ? len[run] : len[2];
        TEST_CHECK_MSG(n > na, "context reaches past the prompt: %d vs %d", n, na);
        double maxd = draft_kv_diff(kv[run], len[run], kv[2], len[2], n);
        printf("deferred draft context (%s): %d positions, max |dK|,|dV| vs immediate %.2e\n",
               run ? "gaps" : "buffer", n, maxd);
        TEST_CHECK_MSG(maxd < 1e-3, "deferred draft context differs from the immediate one by %g", maxd);
    }
    for (int run = 0; run < 3; run++)
        free(kv[run]);
}

/* A scheduled request's prompt rows wait in the deferred buffer too (decoded without drafts, it
 * may end before they are needed) and land with the prefill kernels before its next round that
 * drafts; a request that drafts alongside lands nothing of it. Its draft KV then equals the one
 * of a full-blocks request, whose rows are added at once. */
static void test_engine_deferred_prompt(void)
{
    pd_err err;
    int na = (int)(sizeof(prompt_a) / 4), nb = (int)(sizeof(prompt_b) / 4);
    pd_engine *e = sched_engine(1);
    pd_gen_params gp = greedy(30), full = greedy(30);
    full.verify_policy = PD_VERIFY_FULL;
    pd_request *ra = NULL, *rb = NULL;
    TEST_CHECK(pd_engine_add(e, 1, prompt_a, na, &gp, &ra, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* prefill, then a round without drafts */
    TEST_CHECK_MSG(ra->n_pend == na + 1, "deferred rows after prefill and one plain round: %d, want %d",
                   ra->n_pend, na + 1);
    TEST_CHECK(pd_engine_add(e, 2, prompt_b, nb, &full, &rb, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* rb drafts, ra does not: ra's rows wait */
    TEST_CHECK_MSG(ra->n_pend == na + 2, "after rb's drafting round %d rows of ra wait, want %d", ra->n_pend,
                   na + 2);
    pd_engine_set_sched_debug_arm(e, 3);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* ra drafts: its rows land first */
    TEST_CHECK_MSG(ra->n_pend == 0, "after its drafting round %d rows of ra wait", ra->n_pend);
    int len0 = 0, len1 = 0;
    float *kv0 = read_draft_kv(e, ra, &len0);
    pd_engine_destroy(e);

    e = sched_engine(3);   /* a full-blocks request: nothing of it waits */
    TEST_CHECK(pd_engine_add(e, 1, prompt_a, na, &full, &ra, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK(ra->n_pend == 0);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    float *kv1 = read_draft_kv(e, ra, &len1);
    pd_engine_destroy(e);
    int n = len0 < len1 ? len0 : len1;
    TEST_CHECK_MSG(n > na, "context reaches past the prompt: %d vs %d", n, na);
    double maxd = draft_kv_diff(kv0, len0, kv1, len1, n);
    printf("deferred prompt rows: %d positions, max |dK|,|dV| vs immediate %.2e\n", n, maxd);
    TEST_CHECK_MSG(maxd < 1e-3, "deferred prompt context differs from the immediate one by %g", maxd);
    free(kv0);
    free(kv1);
}

/* More deferred rows than one graph-replayed extension takes (PD_DRAFT_EXTEND_GRAPH_MAX): the
 * flush adds them in chunks, and every position's draft KV equals an immediate extension's. */
static void test_engine_deferred_chunks(void)
{
    pd_err err;
    enum { NP = PD_DRAFT_EXTEND_GRAPH_MAX + 77 };
    static int32_t longp[NP];
    for (int i = 0; i < NP; i++)
        longp[i] = (int32_t)((i * 37 + 11) % 8000);
    pd_engine *e = sched_engine_pages(1, 400);
    pd_gen_params gp = greedy(4), full = greedy(4);
    full.verify_policy = PD_VERIFY_FULL;
    pd_request *ra = NULL;
    TEST_CHECK(pd_engine_add(e, 1, longp, NP, &gp, &ra, &err) == PD_OK);
    for (int i = 0; i < 20 && ra->prefilled < NP; i++)
        TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK_MSG(ra->n_pend > PD_DRAFT_EXTEND_GRAPH_MAX, "deferred rows %d, want more than %d", ra->n_pend,
                   PD_DRAFT_EXTEND_GRAPH_MAX);
    pd_engine_set_sched_debug_arm(e, 3);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* ra drafts: its rows land first, in chunks */
    TEST_CHECK_MSG(ra->n_pend == 0, "after a drafting round %d rows wait", ra->n_pend);
    int len0 = 0, len1 = 0;
    float *kv0 = read_draft_kv(e, ra, &len0);
    pd_engine_destroy(e);

    e = sched_engine_pages(3, 400);
    TEST_CHECK(pd_engine_add(e, 1, longp, NP, &full, &ra, &err) == PD_OK);
    for (int i = 0; i < 20 && ra->prefilled < NP; i++)
        TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    float *kv1 = read_draft_kv(e, ra, &len1);
    pd_engine_destroy(e);
    int n = len0 < len1 ? len0 : len1;
    TEST_CHECK_MSG(n >= NP, "context covers the prompt: %d of %d", n, NP);
    double maxd = draft_kv_diff(kv0, len0, kv1, len1, n);
    printf("deferred rows in chunks: %d positions, max |dK|,|dV| vs immediate %.2e\n", n, maxd);
    TEST_CHECK_MSG(maxd < 1e-3, "chunked flush differs from the immediate extension by %g", maxd);
    free(kv0);
    free(kv1);
}

/* The scheduled controller's probe of new requests (all-drafts rounds for a request that has
 * not verified PD_PROBE_ROUNDS whole blocks, sched_probe) is a few chances per request: never
 * more than three first probes per request (later ones come only after 16 rounds without
 * drafts), and a probed request has decoded a round before. Whether the controller expects the
 * all-drafts arm to pay depends on measured timings, so the engine probes every candidate here
 * (sched_probe_always): the limits are what is tested. */
static void test_engine_sched_probe(void)
{
    pd_err err;
    int na = (int)(sizeof(prompt_a) / 4), nb = (int)(sizeof(prompt_b) / 4);
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 4, .n_pages = 128,
                            .verify_policy = PD_VERIFY_SCHEDULED, .sched_probe_always = 1 };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    pd_gen_params gp = greedy(24);
    pd_request *r[4] = {0};
    for (int i = 0; i < 4; i++) {
        TEST_CHECK(pd_engine_add(e, (uint64_t)i + 1, i % 2 ? prompt_b : prompt_a, i % 2 ? nb : na, &gp, &r[i],
                                 &err) == PD_OK);
        TEST_CHECK(run_to_end(e) == 0);
        TEST_CHECK(r[i]->finish != PD_FINISH_NONE && r[i]->n_out == 24);
        TEST_CHECK(r[i]->n_probed == 0 || r[i]->n_rounds >= 2);
        TEST_CHECK(r[i]->n_probed <= 3);
    }
    const pd_sched_ctl *sc = pd_engine_sched(e);
    printf("scheduled at batch 1: %ld probes of 4 requests, arms plain/algo1/all %ld/%ld/%ld\n", sc->n_probes,
           sc->n_arm[PD_SCHED_PLAIN], sc->n_arm[PD_SCHED_ALGO1], sc->n_arm[PD_SCHED_ALL]);
    TEST_CHECK(sc->n_probes > 0 && sc->n_arm[PD_SCHED_ALL] >= sc->n_probes);
    for (int i = 0; i < 4; i++)
        pd_engine_release(e, r[i]);
    pd_engine_destroy(e);
}

/* A request that ends without keeping its KV drops its deferred rows (no flush of everyone's
 * rows then); the rows of the others stay deferred, and when they land later, the rows dropped
 * from the middle of the buffer do not shift them: the survivor's draft KV equals the one of
 * an immediate extension. */
static void test_engine_deferred_drop(void)
{
    pd_err err;
    int na = (int)(sizeof(prompt_a) / 4), nb = (int)(sizeof(prompt_b) / 4);
    pd_engine *e = sched_engine(1);
    pd_gen_params short_gp = greedy(6), long_gp = greedy(20);
    long_gp.hold_kv = 1;
    pd_request *ra = NULL, *rb = NULL;
    TEST_CHECK(pd_engine_add(e, 1, prompt_b, nb, &short_gp, &ra, &err) == PD_OK);
    TEST_CHECK(pd_engine_add(e, 2, prompt_a, na, &long_gp, &rb, &err) == PD_OK);
    for (int i = 0; i < 100 && ra->finish == PD_FINISH_NONE; i++)
        TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK(ra->finish != PD_FINISH_NONE && ra->n_pend > 0);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK_MSG(ra->n_pend == 0, "an ended request kept %d deferred rows", ra->n_pend);
    TEST_CHECK_MSG(rb->n_pend > 0, "a request ending flushed the other requests' deferred rows");
    pd_engine_release(e, ra);
    run_to_end(e);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK(rb->n_pend == 0);
    int len0 = 0, len1 = 0;
    float *kv0 = read_draft_kv(e, rb, &len0);
    pd_engine_release(e, rb);
    pd_engine_destroy(e);

    e = sched_engine(3);
    TEST_CHECK(pd_engine_add(e, 2, prompt_a, na, &long_gp, &rb, &err) == PD_OK);
    run_to_end(e);
    float *kv1 = read_draft_kv(e, rb, &len1);
    pd_engine_release(e, rb);
    pd_engine_destroy(e);
    int n = len0 < len1 ? len0 : len1;
    TEST_CHECK_MSG(n > na, "context reaches past the prompt: %d vs %d", n, na);
    double maxd = draft_kv_diff(kv0, len0, kv1, len1, n);
    printf("deferred rows of an ended request dropped: survivor's %d positions, max diff %.2e\n", n, maxd);
    TEST_CHECK_MSG(maxd < 1e-3, "survivor's draft context differs by %g after a drop", maxd);
    free(kv0);
    free(kv1);
}

/* Gaps of two requests recomputed in chunks smaller than either (pend_max_rows 16): a chunk
 * boundary falls inside each request's gap and a chunk holds the end of one and the start of the
 * next; both draft KVs equal immediate ones. */
static void test_engine_gap_chunks(void)
{
    pd_err err;
    int na = (int)(sizeof(prompt_a) / 4), nb = (int)(sizeof(prompt_b) / 4);
    pd_engine *e = gap_engine(1, 1, 16, 64);
    pd_gen_params gp = greedy(40);
    pd_request *ra = NULL, *rb = NULL;
    TEST_CHECK(pd_engine_add(e, 1, prompt_a, na, &gp, &ra, &err) == PD_OK);
    TEST_CHECK(pd_engine_add(e, 2, prompt_b, nb, &gp, &rb, &err) == PD_OK);
    for (int i = 0; i < 21; i++)
        TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
    TEST_CHECK_MSG(ra->n_gap >= 20 && rb->n_gap >= 20, "gaps of %d and %d rows, want 20+", ra->n_gap, rb->n_gap);
    TEST_CHECK_MSG(ra->gap_lo == 0 && rb->gap_lo == 0 && ra->n_gap == ra->n_pend, "prompt rows in the gaps: from %d, "
                   "%d, %d of %d rows", ra->gap_lo, rb->gap_lo, ra->n_gap, ra->n_pend);
    pd_engine_set_sched_debug_arm(e, 3);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* both draft: their gaps land first */
    TEST_CHECK_MSG(ra->n_pend == 0 && rb->n_pend == 0, "rows still lacking: %d, %d", ra->n_pend, rb->n_pend);
    int len[4] = {0};
    float *kv[4] = { read_draft_kv(e, ra, &len[0]), read_draft_kv(e, rb, &len[1]) };
    pd_engine_destroy(e);
    e = sched_engine(3);
    pd_request *ia = NULL, *ib = NULL;
    gp.hold_kv = 1;
    TEST_CHECK(pd_engine_add(e, 1, prompt_a, na, &gp, &ia, &err) == PD_OK);
    TEST_CHECK(pd_engine_add(e, 2, prompt_b, nb, &gp, &ib, &err) == PD_OK);
    run_to_end(e);
    kv[2] = read_draft_kv(e, ia, &len[2]);
    kv[3] = read_draft_kv(e, ib, &len[3]);
    pd_engine_destroy(e);
    for (int k = 0; k < 2; k++) {
        int n = len[k] < len[k + 2] ? len[k] : len[k + 2];
        TEST_CHECK_MSG(n >= (k == 0 ? na : nb) + 20, "context of %d positions", n);
        double maxd = draft_kv_diff(kv[k], len[k], kv[k + 2], len[k + 2], n);
        printf("gap rows in chunks of 16, request %d: %d positions, max |dK|,|dV| vs immediate %.2e\n", k, n,
               maxd);
        TEST_CHECK_MSG(maxd < 1e-3, "recomputed draft context differs from the immediate one by %g", maxd);
    }
    for (int k = 0; k < 4; k++)
        free(kv[k]);
}

/* A full deferred buffer whose rows mostly belong to ended requests is compacted, not flushed:
 * the prompt rows of a request that ends after three tokens fill most of it, a second request's
 * prompt rows join them, a third one's push it over, so the compaction moves the second one's
 * rows; then both survivors draft, which lands them. The second
 * request's draft KV equals an immediate one. */
static void test_engine_deferred_compact(void)
{
    pd_err err;
    int na = (int)(sizeof(prompt_a) / 4), nb = (int)(sizeof(prompt_b) / 4);
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 4, .n_pages = 64,
                            .verify_policy = PD_VERIFY_SCHEDULED, .sched_debug_arm = 1, .pend_max_rows = 32 };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    pd_gen_params short_gp = greedy(3), long_gp = greedy(24);
    pd_request *ra = NULL, *rb = NULL, *rc = NULL;
    TEST_CHECK(pd_engine_add(e, 1, prompt_a, na, &short_gp, &ra, &err) == PD_OK);
    run_to_end(e);
    TEST_CHECK(pd_engine_add(e, 2, prompt_b, nb, &long_gp, &rb, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* ra's rows dropped, rb's buffered */
    TEST_CHECK(pd_engine_add(e, 3, prompt_a, na, &long_gp, &rc, &err) == PD_OK);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* full: compacted, then rc's rows */
    const pd_engine_times *t = pd_engine_phase_times(e);
    printf("deferred buffer of 32 rows: %ld compactions, %ld flushes\n", t->pend_compactions, t->pend_flushes);
    TEST_CHECK_MSG(t->pend_compactions > 0, "the buffer was never compacted");
    pd_engine_set_sched_debug_arm(e, 3);
    TEST_CHECK(pd_engine_step(e, &err) == PD_OK);   /* rb and rc draft: their rows land */
    TEST_CHECK_MSG(rb->n_pend == 0, "rb still lacks %d rows after a drafting round", rb->n_pend);
    int len0 = 0, len1 = 0;
    float *kv0 = read_draft_kv(e, rb, &len0);
    pd_engine_destroy(e);

    e = sched_engine(3);
    TEST_CHECK(pd_engine_add(e, 2, prompt_b, nb, &long_gp, &rb, &err) == PD_OK);
    run_to_end(e);
    float *kv1 = read_draft_kv(e, rb, &len1);
    pd_engine_release(e, rb);
    pd_engine_destroy(e);
    int n = len0 < len1 ? len0 : len1;
    TEST_CHECK_MSG(n > nb, "context reaches past the prompt: %d vs %d", n, nb);
    double maxd = draft_kv_diff(kv0, len0, kv1, len1, n);
    printf("after compaction: survivor's %d positions, max diff %.2e\n", n, maxd);
    TEST_CHECK_MSG(maxd < 1e-3, "survivor's draft context differs by %g after a compaction", maxd);
    free(kv0);
    free(kv1);
}

/* An entry's rank against its own top list (kern_backend.h's rank: logits >= the token's): a
 * token at place t of the list has at least t + 1 (the ones before it are not below it), one
 * outside a full list more than the list holds, and rank 1 is the list's head. */
static int rank_fits(const pd_token_logprobs *a, int32_t tok, int V)
{
    if (a->rank < 1 || a->rank > V)
        return 0;
    for (int t = 0; t < a->n_top; t++)
        if (a->top_id[t] == tok)
            return a->rank >= t + 1 && (a->rank != 1 || t == 0);
    return a->rank > a->n_top;
}

/* Prompt logprobs of a 600-token prompt: prefilled in chunks of at most 256 tokens (the cap for
 * such requests) and in chunks of 100, with another request sharing the forwards; the same
 * numbers either way, the same output as without them; prompt_top_logprobs likeliest each, not
 * the output's count, and ranks that fit them; an external prefill's are checked and kept. */
static void test_engine_prompt_logprobs(void)
{
    enum { LONG = 600 };
    pd_err err;
    int32_t longp[LONG];
    for (int i = 0; i < LONG; i++)
        longp[i] = prompt_a[i % (int)(sizeof(prompt_a) / 4)] + (i / 22) % 5;
    pd_gen_params gp = greedy(8);
    gp.prompt_logprobs = 1;
    gp.prompt_top_logprobs = 2;
    gp.logprobs = 1;
    gp.top_logprobs = 1;   /* the output's own count: the prompt's is prompt_top_logprobs */
    pd_token_logprobs *first = NULL;
    int32_t out0[8] = {0};
    for (int pass = 0; pass < 3; pass++) {
        pd_engine *e = NULL;
        pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 128,
                                .max_prefill_tokens = pass == 1 ? 100 : 4096 };
        TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
        if (e == NULL)
            break;
        pd_gen_params p = gp;
        p.prompt_logprobs = pass < 2;
        pd_request *r = NULL, *other = NULL;
        pd_gen_params og = greedy(4);
        TEST_CHECK(pd_engine_add(e, 1, longp, LONG, &p, &r, &err) == PD_OK);
        TEST_CHECK(pd_engine_add(e, 2, prompt_b, 9, &og, &other, &err) == PD_OK);
        if (pass == 0) {
            TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
            TEST_CHECK_MSG(r->prefilled == 256, "prompt logprobs: %d tokens in the first step", r->prefilled);
        }
        TEST_CHECK(run_to_end(e) == 0 && r->n_out == 8);
        if (pass == 0) {
            first = r->prompt_lps;
            r->prompt_lps = NULL;   /* kept for the next pass (ours now) */
            memcpy(out0, r->out, sizeof(out0));
            int ranks_ok = first != NULL && first[0].rank == 0, top1 = 0;
            for (int i = 1; i < LONG && first != NULL; i++) {
                TEST_CHECK(first[i].n_top == 2 && first[i].logprob <= first[i].top_logprob[0] &&
                           first[i].logprob < 0.0f);
                ranks_ok &= rank_fits(&first[i], longp[i], tm->cfg.vocab_size);
                top1 += first[i].rank == 1;
            }
            TEST_CHECK_MSG(ranks_ok, "a prompt token's rank does not fit its top list");
            TEST_CHECK_MSG(top1 > 0 && top1 < LONG - 1, "prompt ranks: %d of %d first", top1, LONG - 1);
        } else if (pass == 1) {
            double worst = 0.0;
            for (int i = 1; i < LONG && first != NULL && r->prompt_lps != NULL; i++) {
                worst = fmax(worst, fabs(first[i].logprob - r->prompt_lps[i].logprob));
                TEST_CHECK(first[i].top_id[0] == r->prompt_lps[i].top_id[0]);
            }
            TEST_CHECK_MSG(worst < 1e-4, "prompt logprobs depend on the chunking: %.3g", worst);
        } else {
            TEST_CHECK(r->prompt_lps == NULL && memcmp(r->out, out0, sizeof(out0)) == 0);
        }
        pd_engine_release(e, r);
        pd_engine_release(e, other);
        /* an external prefill brings them: checked, then kept */
        pd_request *rx = NULL;
        TEST_CHECK(pd_engine_add_external(e, 3, prompt_b, 9, &gp, &rx, &err) == PD_OK);
        if (rx != NULL && first != NULL) {
            TEST_CHECK(pd_engine_set_prompt_logprobs(e, rx, first, 8, &err) == PD_ERR_INVALID &&
                       strstr(err.msg, "prompt of 9") != NULL);
            pd_token_logprobs bad[9];
            memcpy(bad, first, sizeof(bad));
            bad[4].n_top = 3;   /* the request asked for 2 */
            TEST_CHECK(pd_engine_set_prompt_logprobs(e, rx, bad, 9, &err) == PD_ERR_INVALID);
            bad[4].n_top = 2;
            bad[4].rank = tm->cfg.vocab_size + 1;
            TEST_CHECK(pd_engine_set_prompt_logprobs(e, rx, bad, 9, &err) == PD_ERR_INVALID &&
                       strstr(err.msg, "rank") != NULL);
            TEST_CHECK(pd_engine_set_prompt_logprobs(e, rx, first, 9, &err) == PD_OK &&
                       memcmp(rx->prompt_lps, first, 9 * sizeof(*first)) == 0);
            pd_engine_release(e, rx);
        }
        pd_engine_destroy(e);
    }
    free(first);
}

/* The prefix cache: a prompt that starts with a finished prompt's full pages takes them (its
 * prefill starts after them) and decodes exactly as without the cache, speculative and
 * target-only; the same prompt again takes all but its last page; a prompt that repeats a
 * finished request's prompt and answer takes the answer's pages too; a small pool full of cached
 * pages still admits a large request (the cache gives its pages back), and at rest every page
 * counts as free. */
static void test_engine_prefix_cache(void)
{
    enum { P = 100, N = 24 };
    pd_err err;
    int32_t a[P], b[P], c[P + N];
    for (int i = 0; i < P; i++) {
        a[i] = prompt_a[i % 22] + (i / 22) % 7;
        b[i] = i < 80 ? a[i] : prompt_b[i % 9] + 3;
    }
    pd_gen_params gp = greedy(N);
    gp.ignore_eos = 1;
    int32_t ref[3][N];
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 64 };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);   /* reference: no cache */
    pd_request *r = NULL;
    /* c: a conversation's next turn, a's prompt and a's answer */
    const int32_t *prompts[3] = {a, b, c};
    const int lens[3] = {P, P, P + N};
    for (int k = 0; k < 3 && e != NULL; k++) {
        TEST_CHECK(pd_engine_add(e, 1, prompts[k], lens[k], &gp, &r, &err) == PD_OK && r->cached == 0);
        TEST_CHECK(run_to_end(e) == 0 && r->n_out == N);
        memcpy(ref[k], r->out, sizeof(ref[k]));
        if (k == 0) {
            memcpy(c, a, sizeof(a));
            memcpy(c + P, r->out, N * sizeof(int32_t));
        }
        pd_engine_release(e, r);
    }
    pd_engine_destroy(e);
    for (int spec = 0; spec < 2; spec++) {
        ec.draft = spec ? dm : NULL;
        ec.prefix_cache = 1;
        e = NULL;
        TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
        if (e == NULL)
            break;
        /* a; b (shares 80 tokens); a again (all but its last page); c (a's prompt and answer:
         * the pages of a's output too) */
        const int32_t *seqs[4] = {a, b, a, c};
        const int slen[4] = {P, P, P, P + N}, want_cached[4] = {0, 80, 96, 112}, which[4] = {0, 1, 0, 2};
        for (int k = 0; k < 4; k++) {
            r = NULL;
            TEST_CHECK(pd_engine_add(e, 10 + k, seqs[k], slen[k], &gp, &r, &err) == PD_OK);
            if (r == NULL)
                continue;
            TEST_CHECK_MSG(r->cached == want_cached[k] && r->prefilled == want_cached[k],
                           "spec %d request %d: %d tokens from the cache, want %d", spec, k, r->cached,
                           want_cached[k]);
            TEST_CHECK(run_to_end(e) == 0 && r->n_out == N);
            /* target-only and speculative: the reference's (uncached, speculative) tokens */
            TEST_CHECK_MSG(memcmp(r->out, ref[which[k]], sizeof(ref[0])) == 0,
                           "%s request %d with cached pages decodes differently",
                           spec ? "speculative" : "target-only", k);
            pd_engine_release(e, r);
        }
        int ev = 0, ent = 0;
        uint64_t hits = 0;
        pd_engine_prefix_stats(e, &ev, &ent, &hits);
        /* a: 7 pages (6 of prompt, 1 with its answer), b: 2 of its own, c (148 tokens with
         * its answer): 2 beyond a's 7 */
        TEST_CHECK_MSG(hits == 288 && ent == 11 && ev == ent, "prefix stats: %d evictable, %d entries, "
                       "%llu hit tokens", ev, ent, (unsigned long long)hits);
        TEST_CHECK(pd_engine_kv_free_pages(e) == 64);
        pd_engine_destroy(e);
    }
    /* a small pool: cached pages go back when a request needs them */
    ec.draft = dm;
    ec.n_pages = 24;
    e = NULL;
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    for (int k = 0; k < 4 && e != NULL; k++) {
        int32_t p[P];
        for (int i = 0; i < P; i++)
            p[i] = a[i] + k + 1;
        pd_gen_params g8 = greedy(8);
        r = NULL;
        TEST_CHECK_MSG(pd_engine_add(e, 20 + k, p, P, &g8, &r, &err) == PD_OK, "small pool %d: %s", k, err.msg);
        TEST_CHECK(run_to_end(e) == 0);
        pd_engine_release(e, r);
    }
    if (e != NULL) {
        int ev = 0, ent = 0;
        uint64_t hits = 0;
        pd_engine_prefix_stats(e, &ev, &ent, &hits);
        TEST_CHECK_MSG(ent > 0 && ent < 4 * 6 && pd_engine_kv_free_pages(e) == 24,
                       "small pool: %d entries, %d free pages", ent, pd_engine_kv_free_pages(e));
    }
    pd_engine_destroy(e);
    /* not with tensor parallelism */
    ec.tp_size = 2;
    e = NULL;
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_ERR_INVALID && strstr(err.msg, "prefix cache") != NULL);
}

/* A speculative engine and a target-only one over the same target; 0 when both exist. */
static int spec_and_plain(pd_engine **spec, pd_engine **plain)
{
    pd_err err;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 64 };
    TEST_CHECK(pd_engine_create(&ec, spec, &err) == PD_OK);
    ec.draft = NULL;
    TEST_CHECK(pd_engine_create(&ec, plain, &err) == PD_OK);
    return *spec != NULL && *plain != NULL ? 0 : -1;
}

/* Logprobs: speculative decoding reports what target-only decoding reports for the same greedy
 * tokens (its verify rows against single-token rows); a sampled request's are consistent (its
 * token among the tops carries the same value, tops descend); a request that does not ask keeps
 * none; every token's rank fits its top list (greedy: first unless tied); out-of-range counts
 * are refused; an external prefill's first-token logprobs are kept as given and checked. */
static void test_engine_logprobs(void)
{
    pd_err err;
    pd_engine *spec = NULL, *plain = NULL;
    if (spec_and_plain(&spec, &plain) != 0)
        goto done;
    pd_gen_params gp = greedy(24);
    gp.ignore_eos = 1;
    gp.logprobs = 1;
    gp.top_logprobs = 3;
    pd_request *rs = NULL, *rp = NULL, *rn = NULL, *rx = NULL;
    TEST_CHECK(pd_engine_add(spec, 1, prompt_a, 22, &gp, &rs, &err) == PD_OK);
    TEST_CHECK(pd_engine_add(plain, 1, prompt_a, 22, &gp, &rp, &err) == PD_OK);
    pd_gen_params sp = gp;
    sp.sample = (pd_sample_params){ .temperature = 0.9f, .top_p = 0.95f, .seed = 7 };
    sp.top_logprobs = 20;
    TEST_CHECK(pd_engine_add(spec, 2, prompt_b, 9, &sp, &rx, &err) == PD_OK);
    pd_gen_params none = greedy(8);
    TEST_CHECK(pd_engine_add(spec, 3, prompt_b, 9, &none, &rn, &err) == PD_OK);
    TEST_CHECK(run_to_end(spec) == 0 && run_to_end(plain) == 0);
    TEST_CHECK(rs->n_out == 24 && rp->n_out == 24 && rs->lps != NULL && rp->lps != NULL);
    TEST_CHECK(rs->n_rounds < 23);   /* drafts were accepted: verify rows of several tokens */
    double worst = 0.0;
    for (int i = 0; i < rs->n_out && i < rp->n_out && rs->lps && rp->lps; i++) {
        TEST_CHECK_MSG(rs->out[i] == rp->out[i], "token %d: %d vs %d", i, rs->out[i], rp->out[i]);
        const pd_token_logprobs *a = &rs->lps[i], *b = &rp->lps[i];
        double d = fabs(a->logprob - b->logprob);
        TEST_CHECK(a->n_top == 3 && b->n_top == 3 && a->logprob <= 0.0f);
        /* greedy: the argmax, first unless tied */
        TEST_CHECK(rank_fits(a, rs->out[i], tm->cfg.vocab_size) &&
                   (a->rank == 1 || a->top_logprob[1] == a->top_logprob[0]));
        for (int t = 0; t < a->n_top; t++) {
            TEST_CHECK(a->top_id[t] == b->top_id[t]);
            d = fmax(d, fabs(a->top_logprob[t] - b->top_logprob[t]));
        }
        worst = fmax(worst, d);
    }
    TEST_CHECK_MSG(worst < 1e-4, "speculative vs plain logprobs differ by %.3g", worst);
    TEST_CHECK(rx->n_out == 24 && rx->lps != NULL);
    int in_top = 0;
    for (int i = 0; i < rx->n_out && rx->lps != NULL; i++) {
        const pd_token_logprobs *a = &rx->lps[i];
        TEST_CHECK(a->n_top == 20 && a->logprob <= a->top_logprob[0]);
        TEST_CHECK(rank_fits(a, rx->out[i], tm->cfg.vocab_size));
        for (int t = 0; t < a->n_top; t++) {
            TEST_CHECK(t == 0 || a->top_logprob[t] <= a->top_logprob[t - 1]);
            if (a->top_id[t] == rx->out[i]) {
                in_top++;
                TEST_CHECK(a->top_logprob[t] == a->logprob);
            }
        }
    }
    TEST_CHECK(in_top >= rx->n_out / 2);   /* top-p 0.95 samples mostly among the likeliest */
    TEST_CHECK(rn->lps == NULL && rn->n_out == 8);
    pd_engine_release(spec, rs);
    pd_engine_release(spec, rx);
    pd_engine_release(spec, rn);
    pd_engine_release(plain, rp);
    /* the count is checked */
    pd_gen_params bad = gp;
    bad.top_logprobs = PD_MAX_TOP_LOGPROBS + 1;
    pd_request *rb = NULL;
    TEST_CHECK(pd_engine_add(spec, 4, prompt_b, 9, &bad, &rb, &err) == PD_ERR_INVALID &&
               strstr(err.msg, "top_logprobs") != NULL);
    bad = gp;
    bad.prompt_logprobs = 1;
    bad.prompt_top_logprobs = PD_MAX_TOP_LOGPROBS + 1;
    TEST_CHECK(pd_engine_add(spec, 4, prompt_b, 9, &bad, &rb, &err) == PD_ERR_INVALID &&
               strstr(err.msg, "prompt_top_logprobs") != NULL);
    /* an external prefill's first-token logprobs */
    gp.max_new_tokens = 1;
    pd_request *re = NULL;
    TEST_CHECK(pd_engine_add_external(plain, 5, prompt_b, 9, &gp, &re, &err) == PD_OK);
    if (re != NULL) {
        pd_token_logprobs lp = { .logprob = -0.25f, .n_top = 4 };
        TEST_CHECK(pd_engine_complete_prefill_mode(plain, re, 11, PD_AUX_RAW, NULL, &lp, &err) == PD_ERR_INVALID &&
                   strstr(err.msg, "top logprobs") != NULL);
        lp.n_top = 2;
        lp.top_id[0] = 11;
        lp.top_id[1] = tm->cfg.vocab_size;
        TEST_CHECK(pd_engine_complete_prefill_mode(plain, re, 11, PD_AUX_RAW, NULL, &lp, &err) == PD_ERR_INVALID &&
                   strstr(err.msg, "vocabulary") != NULL);
        lp.top_id[1] = 12;
        lp.top_logprob[0] = -0.25f;
        lp.top_logprob[1] = -2.0f;
        lp.rank = -1;
        TEST_CHECK(pd_engine_complete_prefill_mode(plain, re, 11, PD_AUX_RAW, NULL, &lp, &err) == PD_ERR_INVALID &&
                   strstr(err.msg, "rank") != NULL);
        lp.rank = 1;
        TEST_CHECK(pd_engine_complete_prefill_mode(plain, re, 11, PD_AUX_RAW, NULL, &lp, &err) == PD_OK);
        TEST_CHECK(re->n_out == 1 && re->lps != NULL && re->lps[0].logprob == -0.25f &&
                   re->lps[0].n_top == 2 && re->lps[0].top_id[1] == 12 && re->lps[0].rank == 1);
        pd_engine_release(plain, re);
    }
done:
    pd_engine_destroy(spec);
    pd_engine_destroy(plain);
}

/* Greedy decoding with penalties by hand: a fresh forward over prompt + output for every token,
 * the penalties applied to the whole logits row on the host (vLLM's rules), the argmax; with a
 * matcher gm, the row masked to what the grammar allows (ending at eos). Returns the tokens made. */
static int ref_penalised(const int32_t *prompt, int n_prompt, const pd_gen_params *gp, int n_new,
                         int32_t *out, pd_gmatch *gm, const pd_gvocab *gv)
{
    pd_err err;
    int V = tm->cfg.vocab_size, T = n_prompt + n_new;
    pd_kv_layout lay = { .n_layers = tm->cfg.num_hidden_layers, .n_kv_heads = tm->cfg.num_key_value_heads,
                         .head_dim = tm->cfg.head_dim, .page_size = 16, .n_pages = 16, .dtype = be->kv_dtype };
    pd_kv_pool *pool = NULL;
    pd_target *t = NULL;
    TEST_CHECK(pd_kv_pool_create(be, &lay, &pool, &err) == PD_OK);
    TEST_CHECK(pd_target_create(tm, pool, NULL, 0, &t, &err) == PD_OK);
    int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *sq = calloc((size_t)T, 4);
    int *cnt = calloc((size_t)V, sizeof(int));
    char *in_prompt = calloc((size_t)V, 1);
    float *row = malloc((size_t)V * sizeof(float));
    memcpy(ids, prompt, (size_t)n_prompt * 4);
    for (int i = 0; i < n_prompt; i++)
        in_prompt[prompt[i]] = 1;
    for (int i = 0; i < T; i++)
        pos[i] = i;
    float rep = gp->repetition_penalty == 0.0f ? 1.0f : gp->repetition_penalty;
    uint32_t *bits = gm != NULL ? malloc((size_t)pd_gvocab_words(gv) * 4) : NULL;
    int made = 0;
    for (int k = 0; k < n_new && t != NULL; k++) {
        int n = n_prompt + k;
        pd_kv_seq seq;
        pd_kv_seq_init(&seq);
        TEST_CHECK(pd_kv_seq_reserve(pool, &seq, n, &err) == PD_OK);
        pd_kv_seq *seqs[1] = {&seq};
        pd_tok_batch b = { .n_tok = n, .ids = ids, .pos = pos, .seq = sq, .n_seq = 1, .seqs = seqs };
        int32_t last = n - 1;
        TEST_CHECK(pd_target_forward(t, &b, &last, 1, &err) == PD_OK);
        TEST_CHECK(kern_download(be, row, pd_target_logits(t), (size_t)V * sizeof(float), &err) == PD_OK);
        pd_kv_seq_release(pool, &seq);
        int best = 0;
        for (int v = 0; v < V; v++) {
            float x = row[v];
            for (int q = 0; q < gp->n_logit_bias; q++)
                if (gp->logit_bias[q].tok == v && gp->logit_bias[q].bias != 0.0f)
                    x = x + gp->logit_bias[q].bias;
            for (int q = 0; q < tm->cfg.n_eos && k < gp->min_tokens; q++)
                if (tm->cfg.eos_ids[q] == v)
                    x = -INFINITY;
            if ((in_prompt[v] || cnt[v] > 0) && rep != 1.0f)
                x = x > 0.0f ? x / rep : x * rep;
            if (cnt[v] > 0)
                x = x - gp->frequency_penalty * (float)cnt[v] - gp->presence_penalty;
            if (v == 0 && bits != NULL)
                TEST_CHECK(pd_gmatch_allowed(gm, gv, bits, &err) == PD_OK);
            if (bits != NULL && !((bits[v >> 5] >> (v & 31)) & 1u))
                x = -INFINITY;
            row[v] = x;
            if (x > row[best])
                best = v;
        }
        out[k] = best;
        ids[n] = best;
        cnt[best]++;
        made++;
        if (gm != NULL) {
            TEST_CHECK(pd_gmatch_advance(gm, gv, best, &err) == 1);
            int stop = 0;
            for (int q = 0; q < tm->cfg.n_eos; q++)
                stop |= tm->cfg.eos_ids[q] == best;
            if (stop)
                break;
        }
    }
    free(bits);
    free(ids);
    free(pos);
    free(sq);
    free(cnt);
    free(in_prompt);
    free(row);
    pd_target_destroy(t);
    pd_kv_pool_destroy(pool);
    return made;
}

static int repeats(const int32_t *t, int n)
{
    int r = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (t[j] == t[i]) {
                r++;
                break;
            }
    return r;
}

/* Penalties, logit bias and min_tokens: greedy speculative output equals target-only output
 * equals the hand-made reference (the verify rows count the block's earlier drafts); they change
 * what is generated (fewer repeats; a -100 bias keeps a token out); min_tokens holds back an eos
 * pushed by +100 until exactly then; a sampled request with penalties runs; bad values are
 * refused by name. */
static void test_engine_penalties(void)
{
    pd_err err;
    pd_engine *spec = NULL, *plain = NULL;
    if (spec_and_plain(&spec, &plain) != 0)
        goto done;
    enum { N = 40 };
    const pd_logit_bias bias[] = { {1966, 4.0f}, {362, -100.0f}, {220, 2.5f}, {13, -3.0f} };
    const pd_gen_params cases[] = {
        { .sample = { .top_p = 1.0f }, .max_new_tokens = N, .ignore_eos = 1, .frequency_penalty = 0.7f },
        { .sample = { .top_p = 1.0f }, .max_new_tokens = N, .ignore_eos = 1, .presence_penalty = 1.5f },
        { .sample = { .top_p = 1.0f }, .max_new_tokens = N, .ignore_eos = 1, .repetition_penalty = 1.3f },
        { .sample = { .top_p = 1.0f }, .max_new_tokens = N, .ignore_eos = 1, .repetition_penalty = 0.8f,
          .presence_penalty = -0.5f, .frequency_penalty = 0.3f, .logprobs = 1, .top_logprobs = 2 },
        { .sample = { .top_p = 1.0f }, .max_new_tokens = N, .ignore_eos = 1, .logit_bias = bias,
          .n_logit_bias = 4, .min_tokens = 7 },
        { .sample = { .top_p = 1.0f }, .max_new_tokens = N, .ignore_eos = 1, .logit_bias = bias + 1,
          .n_logit_bias = 3, .frequency_penalty = 0.4f, .repetition_penalty = 1.2f },
    };
    pd_gen_params none = greedy(N);
    none.ignore_eos = 1;
    pd_request *r0 = NULL;
    TEST_CHECK(pd_engine_add(spec, 9, prompt_a, 22, &none, &r0, &err) == PD_OK);
    TEST_CHECK(run_to_end(spec) == 0);
    int rep0 = r0 != NULL ? repeats(r0->out, r0->n_out) : 0;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        pd_request *rs = NULL, *rp = NULL;
        TEST_CHECK(pd_engine_add(spec, 10 + c, prompt_a, 22, &cases[c], &rs, &err) == PD_OK);
        TEST_CHECK(pd_engine_add(plain, 10 + c, prompt_a, 22, &cases[c], &rp, &err) == PD_OK);
        TEST_CHECK(run_to_end(spec) == 0 && run_to_end(plain) == 0);
        if (rs == NULL || rp == NULL)
            continue;
        int32_t ref[N];
        ref_penalised(prompt_a, 22, &cases[c], N, ref, NULL, NULL);
        int same_sp = rs->n_out == N && rp->n_out == N, same_ref = same_sp;
        for (int i = 0; i < N && same_sp; i++)
            same_sp = rs->out[i] == rp->out[i];
        for (int i = 0; i < N && same_ref; i++)
            same_ref = rp->out[i] == ref[i];
        TEST_CHECK_MSG(same_sp, "case %zu: speculative output differs from target-only", c);
        TEST_CHECK_MSG(same_ref, "case %zu: target-only output differs from the reference", c);
        TEST_CHECK_MSG(rs->n_rounds < N - 1, "case %zu: %d rounds: no draft accepted", c, rs->n_rounds);
        int diff = 0;
        for (int i = 0; i < N && r0 != NULL; i++)
            diff |= r0->out[i] != rs->out[i];
        TEST_CHECK_MSG(diff, "case %zu: the penalties changed nothing", c);
        for (int i = 0; i < N && cases[c].n_logit_bias > 0; i++)
            TEST_CHECK_MSG(rs->out[i] != 362, "case %zu: token 362 (bias -100) at %d", c, i);
        if (c < 3)
            TEST_CHECK_MSG(repeats(rs->out, N) < rep0, "case %zu: %d repeats, %d without penalties", c,
                           repeats(rs->out, N), rep0);
        if (cases[c].logprobs)   /* logprobs of the penalised rows: the pick is the top one */
            for (int i = 0; i < N && rs->lps != NULL; i++)
                TEST_CHECK(rs->lps[i].top_id[0] == rs->out[i]);
        printf("penalties case %zu: %d rounds, %d repeats (none: %d)\n", c, rs->n_rounds,
               repeats(rs->out, N), rep0);
        pd_engine_release(spec, rs);
        pd_engine_release(plain, rp);
    }
    pd_engine_release(spec, r0);
    /* sampled, with penalties */
    pd_gen_params sp = cases[3];
    sp.sample = (pd_sample_params){ .temperature = 0.8f, .top_p = 0.9f, .seed = 3 };
    pd_request *rx = NULL;
    TEST_CHECK(pd_engine_add(spec, 20, prompt_b, 9, &sp, &rx, &err) == PD_OK);
    TEST_CHECK(run_to_end(spec) == 0 && rx != NULL && rx->n_out == N && rx->finish == PD_FINISH_LENGTH);
    pd_engine_release(spec, rx);
    /* min_tokens: the eos token, pushed by a bias of +100, comes exactly when allowed */
    for (int eng = 0; eng < 2; eng++) {
        pd_logit_bias eb = { tm->cfg.eos_ids[0], 100.0f };
        pd_gen_params mg = greedy(20);
        mg.logit_bias = &eb;
        mg.n_logit_bias = 1;
        mg.min_tokens = 5;
        pd_request *rm = NULL;
        pd_engine *en = eng == 0 ? spec : plain;
        TEST_CHECK(pd_engine_add(en, 40, prompt_b, 9, &mg, &rm, &err) == PD_OK);
        TEST_CHECK(run_to_end(en) == 0);
        TEST_CHECK_MSG(rm != NULL && rm->n_out == 6 && rm->finish == PD_FINISH_STOP &&
                       rm->out[5] == tm->cfg.eos_ids[0],
                       "min_tokens 5 with eos pushed: %d tokens, finish %d", rm ? rm->n_out : -1,
                       rm ? (int)rm->finish : -1);
        for (int i = 0; rm != NULL && i < 5 && i < rm->n_out; i++)
            TEST_CHECK(!(rm->out[i] == tm->cfg.eos_ids[0]));
        pd_engine_release(en, rm);
    }
    /* stop_token_ids: the request ends at the first one it generates (kept in out), on both
     * engines; with min_tokens past it, it is masked until then */
    pd_gen_params sg = greedy(16);
    sg.ignore_eos = 1;
    pd_request *r1 = NULL;
    TEST_CHECK(pd_engine_add(plain, 50, prompt_b, 9, &sg, &r1, &err) == PD_OK);
    TEST_CHECK(run_to_end(plain) == 0 && r1 != NULL && r1->n_out == 16);
    int at = 3;
    while (r1 != NULL && at < 16) {   /* a token whose first occurrence is at 'at' */
        int seen = 0;
        for (int i = 0; i < at; i++)
            seen |= r1->out[i] == r1->out[at];
        if (!seen)
            break;
        at++;
    }
    for (int eng = 0; eng < 2 && r1 != NULL && at < 16; eng++) {
        pd_engine *en = eng == 0 ? spec : plain;
        pd_gen_params st = sg;
        st.stop_ids[0] = 12345 % tm->cfg.vocab_size;
        st.stop_ids[1] = r1->out[at];
        st.n_stop_ids = 2;
        pd_request *rs = NULL;
        TEST_CHECK(pd_engine_add(en, 51, prompt_b, 9, &st, &rs, &err) == PD_OK);
        TEST_CHECK(run_to_end(en) == 0);
        TEST_CHECK_MSG(rs != NULL && rs->n_out == at + 1 && rs->finish == PD_FINISH_STOP &&
                       rs->out[at] == r1->out[at], "stop id at %d: %d tokens", at, rs ? rs->n_out : -1);
        pd_engine_release(en, rs);
        st.min_tokens = at + 2;
        TEST_CHECK(pd_engine_add(en, 52, prompt_b, 9, &st, &rs, &err) == PD_OK);
        TEST_CHECK(run_to_end(en) == 0);
        for (int i = 0; rs != NULL && i < at + 2 && i < rs->n_out; i++)
            TEST_CHECK_MSG(rs->out[i] != r1->out[at], "masked stop id generated at %d", i);
        pd_engine_release(en, rs);
    }
    TEST_CHECK(at < 16);
    pd_engine_release(plain, r1);
    pd_gen_params bs = greedy(4);
    bs.stop_ids[0] = tm->cfg.vocab_size;
    bs.n_stop_ids = 1;
    pd_request *rbs = NULL;
    TEST_CHECK(pd_engine_add(spec, 53, prompt_b, 9, &bs, &rbs, &err) == PD_ERR_INVALID &&
               strstr(err.msg, "stop_token_ids") != NULL);
    /* bad values */
    struct { float pres, freq, rep; const char *name; } bad[] = {
        {2.5f, 0, 0, "presence_penalty"}, {0, -3.0f, 0, "frequency_penalty"},
        {0, 0, -1.0f, "repetition_penalty"}, {0, 0, 11.0f, "repetition_penalty"},
        {NAN, 0, 0, "presence_penalty"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        pd_gen_params b = greedy(4);
        b.presence_penalty = bad[i].pres;
        b.frequency_penalty = bad[i].freq;
        b.repetition_penalty = bad[i].rep;
        pd_request *rb = NULL;
        TEST_CHECK_MSG(pd_engine_add(spec, 30, prompt_b, 9, &b, &rb, &err) == PD_ERR_INVALID &&
                       strstr(err.msg, bad[i].name) != NULL, "bad %s accepted", bad[i].name);
    }
    pd_logit_bias badb[][2] = { {{5, 1.0f}, {5, 2.0f}}, {{-1, 1.0f}, {2, 0.0f}}, {{3, 101.0f}, {2, 0.0f}},
                                {{3, NAN}, {2, 0.0f}} };
    const char *why[] = {"twice", "vocabulary", "[-100, 100]", "[-100, 100]"};
    for (int i = 0; i < 4; i++) {
        pd_gen_params b = greedy(4);
        b.logit_bias = badb[i];
        b.n_logit_bias = 2;
        pd_request *rb = NULL;
        TEST_CHECK_MSG(pd_engine_add(spec, 31, prompt_b, 9, &b, &rb, &err) == PD_ERR_INVALID &&
                       strstr(err.msg, why[i]) != NULL, "bad logit_bias %d: %s", i, err.msg);
    }
    pd_gen_params bm = greedy(4);
    bm.min_tokens = 5;
    pd_request *rbm = NULL;
    TEST_CHECK(pd_engine_add(spec, 32, prompt_b, 9, &bm, &rbm, &err) == PD_ERR_INVALID &&
               strstr(err.msg, "min_tokens") != NULL);
done:
    pd_engine_destroy(spec);
    pd_engine_destroy(plain);
}

/* the first index of out[0..n) the grammar refuses (a fresh matcher), -1 when all fit; *complete:
 * whether the text is a whole match after them */
static int grammar_check(pd_grammar *g, const pd_gvocab *gv, const int32_t *out, int n, int *complete)
{
    pd_err err;
    pd_gmatch *m = NULL;
    if (pd_gmatch_create(g, &m, &err) != PD_OK)
        return 0;
    int bad = -1;
    for (int i = 0; i < n && bad < 0; i++)
        if (pd_gmatch_advance(m, gv, out[i], &err) != 1)
            bad = i;
    *complete = pd_gmatch_complete(m);
    pd_gmatch_destroy(m);
    return bad;
}

/* Structured output: with a JSON schema, json_object, choices and a regex, greedy speculative
 * output equals target-only output, which equals greedy decoding by hand over the masked rows
 * (the schema), and the masked drafter keeps tau up; every token fits the grammar, a choice
 * ends (eos) on one of the choices, a
 * finished JSON text parses; a sampled request fits too; a prefill node's first-token mask
 * decides the first token; min_tokens with a grammar and a foreign vocabulary are refused. */
static void test_engine_grammar(void)
{
    pd_err err;
    pd_engine *spec = NULL, *plain = NULL;
    pd_tokenizer *tk = NULL;
    pd_gvocab *gv = NULL;
    pd_grammar *gs[4] = { NULL };
    if (spec_and_plain(&spec, &plain) != 0)
        goto done;
    int V = tm->cfg.vocab_size;
    TEST_CHECK(pd_tokenizer_load(PD_MODELS "/tiny-code-qwen3", &tk, &err) == PD_OK);
    if (tk == NULL || pd_gvocab_create(tk, V, tm->cfg.eos_ids, tm->cfg.n_eos, &gv, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "vocabulary: %s", err.msg);
        goto done;
    }
    const char *schema = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":12},"
                         "\"n\":{\"type\":\"integer\"},\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"n\",\"ok\"]}";
    const char *choices[] = { "def", "class", "import os" };
    TEST_CHECK(pd_grammar_json(schema, strlen(schema), &gs[0], &err) == PD_OK);
    TEST_CHECK(pd_grammar_json(NULL, 0, &gs[1], &err) == PD_OK);
    TEST_CHECK(pd_grammar_choice(choices, 3, &gs[2], &err) == PD_OK);
    TEST_CHECK(pd_grammar_regex("[0-9]{2,4}-[a-z_]+", 18, &gs[3], &err) == PD_OK);
    enum { N = 48 };
    for (int c = 0; c < 4; c++) {
        if (gs[c] == NULL)
            continue;
        pd_gen_params gp = greedy(N);
        gp.grammar = gs[c];
        gp.gvocab = gv;
        pd_request *rs = NULL, *rp = NULL;
        TEST_CHECK(pd_engine_add(spec, 60 + c, prompt_a, 22, &gp, &rs, &err) == PD_OK);
        TEST_CHECK(pd_engine_add(plain, 60 + c, prompt_a, 22, &gp, &rp, &err) == PD_OK);
        TEST_CHECK(run_to_end(spec) == 0 && run_to_end(plain) == 0);
        if (rs == NULL || rp == NULL)
            continue;
        int same = rs->n_out == rp->n_out && rs->finish == rp->finish;
        for (int i = 0; i < rs->n_out && same; i++)
            same = rs->out[i] == rp->out[i];
        TEST_CHECK_MSG(same, "grammar %d: speculative output (%d tokens) differs from target-only (%d)", c,
                       rs->n_out, rp->n_out);
        int complete = 0, bad = grammar_check(gs[c], gv, rs->out, rs->n_out, &complete);
        TEST_CHECK_MSG(bad < 0, "grammar %d: token %d of the output does not fit", c, bad);
        char *text = NULL;
        size_t tl = 0;
        TEST_CHECK(pd_tokenizer_decode(tk, rs->out, (size_t)rs->n_out, 1, &text, &tl, &err) == PD_OK);
        printf("  grammar %d: %d tokens, %d rounds, finish %s: %s\n", c, rs->n_out, rs->n_rounds,
               pd_finish_reason_str(rs->finish), text ? text : "");
        if (c == 2)
            TEST_CHECK_MSG(rs->finish == PD_FINISH_STOP && complete && text != NULL &&
                           (!strcmp(text, "def") || !strcmp(text, "class") || !strcmp(text, "import os")),
                           "a choice: %s", text ? text : "");
        if ((c == 0 || c == 1) && rs->finish == PD_FINISH_STOP) {
            cJSON *doc = text != NULL ? cJSON_Parse(text) : NULL;
            TEST_CHECK_MSG(cJSON_IsObject(doc), "finished JSON parses: %s", text ? text : "");
            if (c == 0 && doc != NULL)
                TEST_CHECK(cJSON_IsString(cJSON_GetObjectItem(doc, "name")) &&
                           cJSON_IsNumber(cJSON_GetObjectItem(doc, "n")) && cJSON_IsBool(cJSON_GetObjectItem(doc, "ok")));
            cJSON_Delete(doc);
        }
        /* the drafter's picks are masked too: the schema's text (forced keys and punctuation)
         * is drafted right (8 rounds for 28 tokens; 15 with the verify rows alone) */
        if (c == 0)
            TEST_CHECK_MSG(rs->n_rounds * 2 < rs->n_out, "schema: %d rounds for %d tokens", rs->n_rounds, rs->n_out);
        if (c == 0) {   /* the hand-made reference: masked greedy decoding */
            pd_gmatch *m = NULL;
            int32_t ref[N];
            TEST_CHECK(pd_gmatch_create(gs[c], &m, &err) == PD_OK);
            int n_ref = m != NULL ? ref_penalised(prompt_a, 22, &gp, N, ref, m, gv) : 0;
            int eq = n_ref == rp->n_out;
            for (int i = 0; i < n_ref && eq; i++)
                eq = ref[i] == rp->out[i];
            TEST_CHECK_MSG(eq, "schema: target-only output (%d tokens) differs from masked greedy by hand (%d)",
                           rp->n_out, n_ref);
            pd_gmatch_destroy(m);
        }
        free(text);
        /* sampled */
        pd_gen_params sp = gp;
        sp.sample.temperature = 0.9f;
        sp.sample.seed = 7 + (uint64_t)c;
        pd_request *rr = NULL;
        TEST_CHECK(pd_engine_add(spec, 70 + c, prompt_b, 9, &sp, &rr, &err) == PD_OK);
        TEST_CHECK(run_to_end(spec) == 0);
        if (rr != NULL)
            TEST_CHECK_MSG(rr->finish != PD_FINISH_ERROR && grammar_check(gs[c], gv, rr->out, rr->n_out, &complete) < 0,
                           "grammar %d sampled: %s", c, rr->error);
    }
    /* a prefill node's first-token mask: only token 1966 */
    uint32_t *first = calloc((size_t)(V + 31) / 32, 4);
    first[1966 >> 5] |= 1u << (1966 & 31);
    pd_gen_params fp = greedy(3);
    fp.first_allow = first;
    pd_request *rf = NULL;
    TEST_CHECK(pd_engine_add(plain, 80, prompt_b, 9, &fp, &rf, &err) == PD_OK);
    free(first);   /* copied at admission */
    TEST_CHECK(run_to_end(plain) == 0);
    TEST_CHECK(rf != NULL && rf->n_out >= 1 && rf->out[0] == 1966);
    /* refused */
    pd_gen_params bm = greedy(8);
    bm.grammar = gs[1];
    bm.gvocab = gv;
    bm.min_tokens = 2;
    pd_request *rb = NULL;
    TEST_CHECK(pd_engine_add(spec, 81, prompt_b, 9, &bm, &rb, &err) == PD_ERR_INVALID && strstr(err.msg, "min_tokens"));
    pd_gvocab *small = NULL;
    const uint8_t *one[1] = { (const uint8_t *)"a" };
    size_t onel[1] = { 1 };
    int32_t e0 = 0;
    TEST_CHECK(pd_gvocab_create_raw(one, onel, 1, &e0, 0, &small, &err) == PD_OK);
    bm.min_tokens = 0;
    bm.gvocab = small;
    TEST_CHECK(pd_engine_add(spec, 82, prompt_b, 9, &bm, &rb, &err) == PD_ERR_INVALID && strstr(err.msg, "vocabulary"));
    pd_gvocab_destroy(small);
done:
    pd_engine_destroy(spec);
    pd_engine_destroy(plain);
    for (int i = 0; i < 4; i++)
        pd_grammar_unref(gs[i]);
    pd_gvocab_destroy(gv);
    pd_tokenizer_free(tk);
}


/* Preemption (pd_engine_config.swap_bytes): with a pool too small for every request's whole
 * answer, requests are admitted with their prompt's pages, grow round by round, and the one
 * admitted last is preempted (its KV to host memory) when the pool runs out, then resumed: every
 * answer equals the one it gets in a pool large enough (greedy and sampled, speculative and
 * target-only, with the scheduled policy's deferred draft rows); all pages and swap bytes come
 * back; with a swap space too small for a victim its KV is given up and recomputed (the
 * answers still finish); a preempted request can be cancelled. */
static void test_engine_preemption(void)
{
    enum { NR = 5, NEW = 48 };
    pd_err err;
    int32_t prompts[NR][22];
    int np = (int)(sizeof(prompt_a) / 4);
    for (int k = 0; k < NR; k++)
        for (int i = 0; i < np; i++)
            prompts[k][i] = (prompt_a[i] + 7 * k) % 4000 + 1;
    int32_t ref0[NR][NEW];   /* variant 0's answers (speculative greedy) */
    int n_ref0[NR];
    for (int variant = 0; variant < 4; variant++) {
        int spec = variant != 1, sampled = variant == 2, sched = variant == 3;
        pd_engine_config ec = { .target = tm, .draft = spec ? dm : NULL, .page_size = 4, .n_pages = 256,
                                .gap_min_batch = sched ? 2 : 0 };
        pd_gen_params gp = greedy(NEW);
        if (sampled) {
            gp.sample.temperature = 0.8f;
            gp.sample.top_k = 40;
        }
        if (sched)
            gp.verify_policy = PD_VERIFY_SCHEDULED;
        int32_t ref[NR][NEW];
        int n_ref[NR];
        pd_engine *e = NULL;
        TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
        pd_request *r[NR];
        for (int k = 0; k < NR && e != NULL; k++) {
            gp.sample.seed = 100 + k;
            r[k] = NULL;
            TEST_CHECK(pd_engine_add(e, k + 1, prompts[k], np, &gp, &r[k], &err) == PD_OK);
        }
        TEST_CHECK(e != NULL && run_to_end(e) == 0);
        for (int k = 0; k < NR && e != NULL; k++) {
            n_ref[k] = r[k] != NULL ? r[k]->n_out : 0;
            if (r[k] != NULL)
                memcpy(ref[k], r[k]->out, (size_t)n_ref[k] * 4);
            if (variant == 0) {
                n_ref0[k] = n_ref[k];
                memcpy(ref0[k], ref[k], (size_t)n_ref[k] * 4);
            }
            pd_engine_release(e, r[k]);
        }
        pd_engine_destroy(e);
        /* (22 + 48 + a block) tokens = ~20 pages each: 5 need ~100, the pool has 48 */
        ec.n_pages = 48;
        ec.swap_bytes = (size_t)1 << 30;
        ec.swap_arena = variant % 2 == 0 ? 1 : -1;   /* host copies in the arena, or malloc'ed */
        e = NULL;
        TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
        int admitted = 0;
        for (int k = 0; k < NR && e != NULL; k++) {
            gp.sample.seed = 100 + k;
            r[k] = NULL;
            admitted += pd_engine_add(e, k + 1, prompts[k], np, &gp, &r[k], &err) == PD_OK;
        }
        TEST_CHECK_MSG(admitted == NR, "variant %d: %d of %d admitted with their prompt's pages", variant,
                       admitted, NR);
        TEST_CHECK(e != NULL && run_to_end(e) == 0);
        uint64_t pre = 0;
        int swapped = -1;
        size_t bytes = 1;
        if (e != NULL)
            pd_engine_swap_stats(e, &pre, &swapped, &bytes);
        TEST_CHECK_MSG(pre > 0 && swapped == 0 && bytes == 0, "variant %d: %llu preemptions, %d swapped, "
                       "%zu bytes", variant, (unsigned long long)pre, swapped, bytes);
        size_t held = 1, used = 1;
        if (e != NULL)
            pd_engine_swap_arena_stats(e, &held, &used);
        TEST_CHECK_MSG(used == 0 && (ec.swap_arena > 0 ? held > 0 : held == 0),
                       "variant %d: swap arena %zu bytes held, %zu used", variant, held, used);
        for (int k = 0; k < NR && e != NULL; k++) {
            if (r[k] == NULL)
                continue;
            TEST_CHECK_MSG(r[k]->finish == PD_FINISH_LENGTH || r[k]->finish == PD_FINISH_STOP,
                           "variant %d request %d: finish %s (%s)", variant, k,
                           pd_finish_reason_str(r[k]->finish), r[k]->error);
            TEST_CHECK_MSG(r[k]->n_out == n_ref[k] && memcmp(r[k]->out, ref[k], (size_t)n_ref[k] * 4) == 0,
                           "variant %d request %d: %d tokens with preemption, %d without, or other tokens",
                           variant, k, r[k]->n_out, n_ref[k]);
            pd_engine_release(e, r[k]);
        }
        TEST_CHECK(e == NULL || pd_engine_kv_free_pages(e) == 48);
        pd_engine_destroy(e);
    }
    /* a swap space that holds nothing: the victims' KV is given up and prefilled again before
     * they resume (recompute); every request finishes, here (fp32 CPU) with the same tokens */
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 4, .n_pages = 48, .swap_bytes = 1 };
    pd_engine *e = NULL;
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    pd_gen_params gp = greedy(NEW);
    pd_request *r[NR] = {0};
    for (int k = 0; k < NR && e != NULL; k++)
        TEST_CHECK(pd_engine_add(e, k + 1, prompts[k], np, &gp, &r[k], &err) == PD_OK);
    TEST_CHECK(e != NULL && run_to_end(e) == 0);
    int same = 0;
    for (int k = 0; k < NR && e != NULL; k++) {
        if (r[k] == NULL)
            continue;
        TEST_CHECK_MSG(r[k]->finish == PD_FINISH_LENGTH || r[k]->finish == PD_FINISH_STOP,
                       "recompute: request %d %s (%s)", k, pd_finish_reason_str(r[k]->finish), r[k]->error);
        same += r[k]->n_out == n_ref0[k] && memcmp(r[k]->out, ref0[k], (size_t)n_ref0[k] * 4) == 0;
        pd_engine_release(e, r[k]);
    }
    uint64_t pre = 0;
    int swapped = -1;
    size_t bytes = 1;
    if (e != NULL)
        pd_engine_swap_stats(e, &pre, &swapped, &bytes);
    printf("preemption with a full swap space: %llu recomputes, %d of %d answers as without\n",
           (unsigned long long)pre, same, NR);
    TEST_CHECK_MSG(pre > 0 && swapped == 0 && bytes == 0 && same == NR,
                   "recompute: %llu preemptions, %d of %d answers as without", (unsigned long long)pre, same, NR);
    TEST_CHECK(e == NULL || pd_engine_kv_free_pages(e) == 48);
    /* one that could not finish alone in the pool is refused: it would wait preempted for ever */
    pd_gen_params huge = greedy(300);
    pd_request *rh = NULL;
    TEST_CHECK(e == NULL || (pd_engine_add(e, 99, prompts[0], np, &huge, &rh, &err) == PD_ERR_INVALID &&
                             strstr(err.msg, "the pool has 48") != NULL));
    /* a preempted request cancelled: its host copy goes at the next step */
    pd_engine_destroy(e);
    ec.swap_bytes = (size_t)1 << 30;
    e = NULL;
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    for (int k = 0; k < NR && e != NULL; k++)
        TEST_CHECK(pd_engine_add(e, k + 1, prompts[k], np, &gp, &r[k], &err) == PD_OK);
    int victim = -1;
    for (int step = 0; step < 200 && victim < 0 && e != NULL && pd_engine_active(e) > 0; step++) {
        TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
        for (int k = 0; k < NR; k++)
            if (r[k] != NULL && r[k]->swap != NULL)
                victim = k;
    }
    TEST_CHECK_MSG(victim >= 0, "no request was preempted");
    if (victim >= 0) {
        pd_engine_cancel(e, r[victim]);
        TEST_CHECK(pd_engine_step(e, &err) == PD_OK);
        swapped = -1;
        bytes = 1;
        pd_engine_swap_stats(e, &pre, &swapped, &bytes);
        TEST_CHECK_MSG(r[victim]->swap == NULL && swapped == 0 && bytes == 0 &&
                       r[victim]->finish == PD_FINISH_CANCELLED, "cancelled while preempted: %d swapped, %zu bytes",
                       swapped, bytes);
    }
    TEST_CHECK(e == NULL || run_to_end(e) == 0);
    for (int k = 0; k < NR && e != NULL; k++)
        pd_engine_release(e, r[k]);
    TEST_CHECK(e == NULL || pd_engine_kv_free_pages(e) == 48);
    pd_engine_destroy(e);
}

int main(void)
{
    pd_err err;
    kern_backend_config bc = { .name = "cpu" };
    if (kern_backend_create(&bc, &be, &err) != PD_OK || pd_qwen3_load(be, PD_MODELS "/tiny-code-qwen3", &tm, &err) != PD_OK ||
        pd_dspark_load(be, PD_MODELS "/tiny-code-dspark", tm, &dm, &err) != PD_OK) {
        fprintf(stderr, "load: %s\n", err.msg);
        return 1;
    }
    test_engine_external_prefill();
    test_engine_aux_modes();
    test_engine_batching_and_pages();
    test_engine_chunked_prefill();
    test_engine_page_runs();
    test_engine_deferred_context();
    test_engine_deferred_drop();
    test_engine_deferred_prompt();
    test_engine_deferred_chunks();
    test_engine_sched_probe();
    test_engine_deferred_compact();
    test_engine_gap_chunks();
    test_engine_logprobs();
    test_engine_penalties();
    test_engine_prompt_logprobs();
    test_engine_prefix_cache();
    test_engine_grammar();
    test_engine_preemption();
    pd_dspark_free(dm);
    pd_qwen3_free(tm);
    kern_backend_destroy(be);
    TEST_DONE();
}
