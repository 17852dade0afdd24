/* pd_engine.c - continuous-batching DSpark engine: chunked ragged prefill, batched draft block
 *   + Markov loop, one ragged verify forward, lossless acceptance, commit (see pd_engine.h).
 * No request moves logits to the host: greedy ones take the backend's argmax, sampled ones
 *   the backend's sampling ops (kern_probs, kern_sample, kern_spec_verify) with uniforms drawn
 *   from their own rng on the host; only token ids come back.
 * Owns: an engine's creation and destruction, admission (checks, page reservation), the step
 *   (finished requests' pages, then prefill, then one decode round), the decode round (pages or
 *   preemption, draft block and Markov steps, verify, acceptance, commit), the forwards on this
 *   thread or the tensor-parallel group, the public accessors.
 * Not here: the engine's other parts, which share pd_engine_internal.h: the logits pipeline
 *   (pd_engine_logits.c), the draft context rows not added yet (pd_engine_ctx.c), the prefix
 *   cache's part and preemption (pd_engine_kv.c), prefill and context parallelism
 *   (pd_engine_prefill.c), the verification policies (pd_engine_sched.c), the SPS profile
 *   (pd_engine_sps.c).
 * Threading: one thread drives an engine. */
#include "pd_engine.h"

#include "pd_engine_ctx.h"
#include "pd_engine_internal.h"
#include "pd_engine_kv.h"
#include "pd_engine_logits.h"
#include "pd_engine_prefill.h"
#include "pd_engine_sched.h"
#include "pd_grammar.h"
#include "pd_graph.h"
#include "pd_log.h"
#include "pd_prefix.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SWAP_CHUNK_BYTES ((size_t)256 << 20)   /* pinned at a time as the swap space fills */

const char *pd_finish_reason_str(pd_finish_reason r)
{
    switch (r) {
    case PD_FINISH_NONE: return "none";
    case PD_FINISH_STOP: return "stop";
    case PD_FINISH_LENGTH: return "length";
    case PD_FINISH_CANCELLED: return "cancelled";
    case PD_FINISH_ERROR: return "error";
    }
    return "?";
}

pd_status pd_engine_grow_host(void **p, int *cap, int need, size_t per, pd_err *err)
{
    if (need <= *cap)
        return PD_OK;
    int c = *cap > 0 ? *cap : 8;
    while (c < need)
        c *= 2;
    void *n = realloc(*p, per * (size_t)c);
    if (n == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "engine host scratch: %d x %zu bytes", c, per);
    *p = n;
    *cap = c;
    return PD_OK;
}

/* The layout of a KV pool of n_pages for a model of config c */
static pd_kv_layout pool_layout(const pd_engine *e, const pd_qwen3_config *c, int n_pages)
{
    return (pd_kv_layout){ .n_layers = c->num_hidden_layers, .n_kv_heads = c->num_key_value_heads,
                           .head_dim = c->head_dim, .page_size = e->cfg.page_size, .n_pages = n_pages,
                           .dtype = e->tm->be->kv_dtype };
}

/* The pages kv_mem_fraction gives without tensor parallelism (a TP group sizes its ranks'
 * pools itself): rank 0's target and draft pools and each context-parallel rank's target pool,
 * on the backends they will live on. */
static pd_status pages_from_memory(const pd_engine *e, int *n_pages, pd_err *err)
{
    kern_backend *be = e->tm->be;
    pd_kv_layout one = pool_layout(e, &e->tm->cfg, 1);
    const double tpage = (double)pd_kv_pool_bytes(&one);
    double dpage = 0.0;
    if (e->dm != NULL) {
        one = pool_layout(e, &e->dm->cfg.base, 1);
        dpage = (double)pd_kv_pool_bytes(&one);
    }
    /* the ranks' backends (rank 0 first): a host backend's ranks share its memory */
    int nr = e->cfg.cp_size > 1 ? e->cfg.cp_size : 1;
    kern_backend **rb = calloc((size_t)nr, sizeof(*rb));
    double *per = calloc((size_t)nr, sizeof(*per));
    if (rb == NULL || per == NULL) {
        free(rb);
        free(per);
        return pd_err_set(err, PD_ERR_NOMEM, "kv memory fraction");
    }
    for (int r = 0; r < nr; r++) {
        const pd_qwen3_model *m = r > 0 && e->cfg.cp_targets != NULL ? e->cfg.cp_targets[r - 1] : NULL;
        rb[r] = m != NULL ? m->be : be;
        per[r] = r == 0 ? tpage + dpage : tpage;
    }
    pd_status st = pd_kv_pages_from_memory(e->cfg.kv_mem_fraction, nr, rb, per, e->cfg.page_size,
                                           nr > 1 ? "the cp ranks' pools" : "the KV pools", n_pages, err);
    free(rb);
    free(per);
    return st;
}

pd_status pd_engine_create(const pd_engine_config *cfg, pd_engine **out, pd_err *err)
{
    if (cfg->target == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "engine: no target model");
    const pd_qwen3_config *tc = &cfg->target->cfg;
    if (cfg->draft != NULL) {
        pd_status st = pd_dspark_config_check_target(&cfg->draft->cfg, tc, err);
        if (st != PD_OK)
            return st;
    }
    if (cfg->graphs < PD_GRAPHS_AUTO || cfg->graphs > PD_GRAPHS_PAD)
        return pd_err_set(err, PD_ERR_INVALID, "engine: graphs mode %d (expected 0..2)", cfg->graphs);
    pd_engine *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "engine");
    pd_status st;
    e->cfg = *cfg;
    e->tm = cfg->target;
    e->dm = cfg->draft;
    e->V = tc->vocab_size;
    e->H = tc->hidden_size;
    if (e->cfg.page_size <= 0)
        e->cfg.page_size = 16;
    int pages_per_ctx = (tc->max_position_embeddings + e->cfg.page_size - 1) / e->cfg.page_size;
    /* a memory fraction: the pages now, or a TP group's once its ranks' shards are on their
     * devices */
    const int frac = e->cfg.n_pages <= 0 && e->cfg.kv_mem_fraction > 0.0;
    if (frac && e->cfg.tp_size <= 1 && (st = pages_from_memory(e, &e->cfg.n_pages, err)) != PD_OK)
        goto err_free;
    if (e->cfg.n_pages <= 0 && !frac)
        e->cfg.n_pages = 2 * pages_per_ctx + 64;
    if (e->cfg.draft_n_pages <= 0)
        e->cfg.draft_n_pages = e->cfg.n_pages;
    if (e->cfg.max_prefill_tokens <= 0)
        e->cfg.max_prefill_tokens = 2048;
    if (e->dm != NULL) {
        int db = e->dm->cfg.block_size;
        e->B = e->cfg.block_size > 0 ? e->cfg.block_size : db;
        if (e->B > db || e->B > 31) {
            st = pd_err_set(err, PD_ERR_INVALID, "block size %d exceeds the draft's block size %d",
                            e->B, db);
            goto err_free;
        }
    }
    if (e->cfg.tp_size > 1) {
        if (e->cfg.cp_size > 1) {
            st = pd_err_set(err, PD_ERR_INVALID, "tp %d with cp %d: context-parallel prefill and "
                            "tensor-parallel decode do not combine", e->cfg.tp_size, e->cfg.cp_size);
            goto err_free;
        }
        if (e->cfg.graphs == PD_GRAPHS_PAD) {
            /* the worker ranks run rank 0's batch as given: padding on rank 0 alone would make
             * the ranks' collectives disagree in size */
            st = pd_err_set(err, PD_ERR_INVALID, "tp %d with graphs=pad: padded batches are not "
                            "supported with tensor-parallel decode", e->cfg.tp_size);
            goto err_free;
        }
        pd_tp_group_config gc = { .target = cfg->target, .draft = cfg->draft, .size = e->cfg.tp_size,
                                  .page_size = e->cfg.page_size, .n_pages = e->cfg.n_pages,
                                  .draft_n_pages = e->cfg.draft_n_pages,
                                  .kv_mem_fraction = frac ? e->cfg.kv_mem_fraction : 0.0,
                                  .taps = e->dm != NULL ? e->dm->cfg.target_layer_ids : NULL,
                                  .n_taps = e->dm != NULL ? e->dm->cfg.n_target_layers : 0,
                                  .debug_fail_rank = e->cfg.tp_debug_fail_rank,
                                  .debug_fail_cmd = e->cfg.tp_debug_fail_cmd };
        if ((st = pd_tp_group_create(&gc, &e->tp, err)) != PD_OK)
            goto err_free;
        e->tm = pd_tp_group_target(e->tp);
        e->dm = pd_tp_group_draft(e->tp);
        pd_tp_group_pages(e->tp, &e->cfg.n_pages, &e->cfg.draft_n_pages);   /* the fraction's */
        tc = &e->tm->cfg;   /* rank 0's heads: its KV pool holds its KV heads only */
    } else if (e->cfg.tp_size < 0) {
        st = pd_err_set(err, PD_ERR_INVALID, "tp %d must be >= 1", e->cfg.tp_size);
        goto err_free;
    }
    kern_backend *be = e->tm->be;
    pd_kv_layout tl = pool_layout(e, tc, e->cfg.n_pages);
    st = pd_kv_pool_create(be, &tl, &e->tpool, err);
    if (st != PD_OK)
        goto err_free;
    const int *taps = NULL;
    int n_taps = 0;
    if (e->dm != NULL) {
        pd_kv_layout dl = pool_layout(e, &e->dm->cfg.base, e->cfg.draft_n_pages);
        st = pd_kv_pool_create(be, &dl, &e->dpool, err);
        if (st != PD_OK)
            goto err_free;
        st = pd_draft_create(e->dm, e->dpool, &e->draft, err);
        if (st != PD_OK)
            goto err_free;
        taps = e->dm->cfg.target_layer_ids;
        n_taps = e->dm->cfg.n_target_layers;
    }
    st = pd_target_create(e->tm, e->tpool, taps, n_taps, &e->target, err);
    if (st != PD_OK)
        goto err_free;
    if (e->cfg.prefix_cache) {
        if (e->cfg.cp_size > 1 || e->cfg.tp_size > 1) {
            st = pd_err_set(err, PD_ERR_INVALID, "the prefix cache does not combine with %s (the "
                            "ranks' page tables would have to share pages too)",
                            e->cfg.cp_size > 1 ? "context-parallel prefill" : "tensor-parallel decode");
            goto err_free;
        }
        if ((st = pd_prefix_create(e->tpool, e->dpool, &e->prefix, err)) != PD_OK)
            goto err_free;
    }
    /* tensor parallel: rank 0 runs eagerly like its workers, so the ranks' collectives are
     * issued in step (a capture records rank 0's without running them) */
    int gmode = e->tp != NULL ? PD_GRAPHS_OFF : e->cfg.graphs;
    pd_target_set_graphs(e->target, gmode);
    if (e->draft != NULL)
        pd_draft_set_graphs(e->draft, gmode);
    e->aux_dim = pd_target_aux_dim(e->target);
    if (e->tp != NULL)
        pd_tp_group_attach(e->tp, e->target, e->draft);
    /* without a profile the scheduler assumes a memory-bound step: t(B) = 1 + B / 64 */
    st = pd_sps_linear(1.0, 1.0 / 64.0, 1024, &e->sps_default, err);
    if (st != PD_OK)
        goto err_free;
    pd_sched_init(&e->sched, e->cfg.sps);
    if (e->cfg.cp_size > 1 && (st = pd_engine_cp_create(e, &tl, taps, n_taps, err)) != PD_OK)
        goto err_free;
    if (e->cfg.swap_bytes > 0 && (e->cfg.swap_arena > 0 || (e->cfg.swap_arena == 0 && !be->is_host))) {
        size_t chunk = e->cfg.swap_bytes < SWAP_CHUNK_BYTES ? e->cfg.swap_bytes : SWAP_CHUNK_BYTES;
        if ((st = pd_host_arena_create(be, e->cfg.swap_bytes, chunk, &e->swap_arena, err)) != PD_OK)
            goto err_free;
        /* the first chunk now: pinning takes tens of ms, which a preemption would add to a step */
        double t0 = pd_engine_now_s();
        if (!be->is_host && pd_host_arena_reserve(e->swap_arena, chunk) == 0)
            PD_LOG_INFO("engine", "swap space: %.0f MiB of pinned host memory taken in %.1f ms (more as "
                        "preemptions need it, up to %.2f GiB)", (double)chunk / 1048576.0,
                        (pd_engine_now_s() - t0) * 1e3, (double)e->cfg.swap_bytes / 1073741824.0);
    }
    *out = e;
    return PD_OK;
err_free:
    pd_engine_destroy(e);
    return st;
}



static void request_free(pd_engine *e, pd_request *r)
{
    if (r->tkv.n_pages > 0)
        pd_engine_prefix_offer(e, r);   /* a request released before a step gave its pages back */
    pd_engine_pend_drop(e, r);   /* its pages go back: its deferred rows are not needed */
    pd_engine_cp_release(e, r);
    pd_kv_seq_release(e->tpool, &r->tkv);
    if (e->dpool != NULL)
        pd_kv_seq_release(e->dpool, &r->dkv);
    free(r->prompt);
    free(r->aux);
    free(r->ctx);
    free(r->conf_log);
    free(r->verified);
    free(r->out);
    free(r->lps);
    free(r->pen);
    free(r->pen_tok);
    free(r->prompt_lps);
    free(r->bias);
    free(r->accepted);
    pd_gmatch_destroy(r->gm);
    pd_gmatch_destroy(r->gm_row);
    free(r->first_allow);
    free(r->allow);
    free(r->bad);
    pd_engine_preempt_clear(e, r);
    free(r);
}

void pd_engine_destroy(pd_engine *e)
{
    if (e == NULL)
        return;
    for (int i = 0; i < e->n_reqs; i++)
        request_free(e, e->reqs[i]);
    free(e->reqs);
    pd_host_arena_destroy(e->swap_arena);   /* its pieces went with the requests */
    pd_cp_group_destroy(e->cp);
    for (int r = 1; r < e->cp_n; r++) {
        pd_kv_pool_destroy(e->cp_pool[r]);
        if (e->cp_owns_be)
            kern_backend_destroy(e->cp_be[r]);
    }
    free(e->cp_pool);
    free(e->cp_be);
    pd_sps_cleanup(&e->sps_default);
    pd_target_destroy(e->target);
    pd_draft_destroy(e->draft);
    pd_prefix_destroy(e->prefix);   /* drops its page references: before the pools */
    pd_kv_pool_destroy(e->tpool);
    pd_kv_pool_destroy(e->dpool);
    kern_buf_free(e->smp_p);
    kern_buf_free(e->smp_q);
    kern_buf_free(e->smp_dev);
    free(e->smp_host);
    kern_buf_free(e->ids_dev);
    kern_buf_free(e->pen_dev);
    kern_buf_free(e->mask_dev);
    free(e->mask_rows);
    free(e->mask_bits);
    free(e->pen_host);
    kern_buf_free(e->aux_dev);
    kern_buf_free(e->idx_dev);
    kern_buf_free(e->pend_aux);
    free(e->pend_pos);
    free(e->pend_owner);
    pd_tp_group_destroy(e->tp);   /* after the runners built on its rank-0 shards */
    free(e);
}

int pd_engine_block_size(const pd_engine *e) { return e->B; }
pd_target *pd_engine_target(pd_engine *e) { return e->target; }
pd_draft *pd_engine_draft(pd_engine *e) { return e->draft; }

int pd_engine_active(const pd_engine *e)
{
    int n = 0;
    for (int i = 0; i < e->n_reqs; i++)
        n += e->reqs[i]->finish == PD_FINISH_NONE;
    return n;
}

static pd_status add_request(pd_engine *e, uint64_t id, const int32_t *prompt, int n_prompt,
                             const pd_gen_params *params, int external, pd_request **out, pd_err *err);

pd_status pd_engine_add(pd_engine *e, uint64_t id, const int32_t *prompt, int n_prompt,
                        const pd_gen_params *params, pd_request **out, pd_err *err)
{
    pd_status st = add_request(e, id, prompt, n_prompt, params, 0, out, err);
    pd_engine_prefix_count(e);   /* pages it took from the cache (or the cache gave back) */
    return st;
}

pd_status pd_engine_add_external(pd_engine *e, uint64_t id, const int32_t *prompt, int n_prompt,
                                 const pd_gen_params *params, pd_request **out, pd_err *err)
{
    if (e->tp != NULL)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "tp %d: an external prefill would fill only rank 0's KV shard; "
                          "tensor-parallel decode prefills in the engine (--colocated)",
                          pd_tp_group_size(e->tp));
    return add_request(e, id, prompt, n_prompt, params, 1, out, err);
}

int pd_engine_aux_dim(const pd_engine *e) { return e->draft != NULL ? e->aux_dim : 0; }
pd_kv_pool *pd_engine_target_pool(pd_engine *e) { return e->tpool; }
pd_kv_pool *pd_engine_draft_pool(pd_engine *e) { return e->dpool; }

void pd_engine_fail(pd_engine *e, pd_request *r, const char *msg)
{
    (void)e;
    if (r->finish != PD_FINISH_NONE)
        return;
    r->finish = PD_FINISH_ERROR;
    snprintf(r->error, sizeof(r->error), "%s", msg);
}

static pd_status add_request(pd_engine *e, uint64_t id, const int32_t *prompt, int n_prompt,
                             const pd_gen_params *params, int external, pd_request **out, pd_err *err)
{
    int max_pos = e->tm->cfg.max_position_embeddings;
    if (n_prompt <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "empty prompt");
    if (n_prompt >= max_pos)
        return pd_err_set(err, PD_ERR_INVALID,
                          "prompt of %d tokens leaves no room in the context of %d tokens", n_prompt,
                          max_pos);
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= e->V)
            return pd_err_set(err, PD_ERR_INVALID,
                              "prompt token %d (index %d) is outside the vocabulary (0..%d)", prompt[i],
                              i, e->V - 1);
    if (params->max_new_tokens < 1)
        return pd_err_set(err, PD_ERR_INVALID, "max_new_tokens %d must be >= 1", params->max_new_tokens);
    TRY(pd_sample_params_check(&params->sample, err));
    if (params->verify_policy < PD_VERIFY_DEFAULT || params->verify_policy > PD_VERIFY_SCHEDULED)
        return pd_err_set(err, PD_ERR_INVALID, "verify policy %d unknown", (int)params->verify_policy);
    if (!(params->verify_threshold <= 1.0f) || params->verify_threshold < 0.0f)
        return pd_err_set(err, PD_ERR_INVALID, "verify threshold %g must be in [0, 1]",
                          (double)params->verify_threshold);
    TRY(pd_penalties_check(params->presence_penalty, params->frequency_penalty,
                           params->repetition_penalty, err));
    TRY(pd_logit_bias_check(params->logit_bias, params->n_logit_bias, e->V, err));
    TRY(pd_stop_ids_check(params->stop_ids, params->n_stop_ids, PD_MAX_STOP_IDS, e->V, err));
    if (params->min_tokens < 0 || params->min_tokens > params->max_new_tokens)
        return pd_err_set(err, PD_ERR_INVALID, "min_tokens %d must be in 0..max_new_tokens (%d)",
                          params->min_tokens, params->max_new_tokens);
    if (params->grammar != NULL && params->min_tokens > 0)
        return pd_err_set(err, PD_ERR_INVALID, "min_tokens cannot be combined with structured output "
                          "(the grammar decides where the output may end)");
    if (params->grammar != NULL &&
        (params->gvocab == NULL || pd_gvocab_words(params->gvocab) != (e->V + 31) / 32))
        return pd_err_set(err, PD_ERR_INVALID, "structured output: the grammar's vocabulary does not "
                          "match the model's %d tokens", e->V);
    if (params->prompt_logprobs && !external && e->cp != NULL)
        return pd_err_set(err, PD_ERR_INVALID, "prompt logprobs are not available with "
                          "context-parallel prefill");
    if (params->top_logprobs < 0 || params->top_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "top_logprobs %d must be in 0..%d",
                          params->top_logprobs, PD_MAX_TOP_LOGPROBS);
    if (params->prompt_top_logprobs < 0 || params->prompt_top_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "prompt_top_logprobs %d must be in 0..%d",
                          params->prompt_top_logprobs, PD_MAX_TOP_LOGPROBS);
    TRY(pd_engine_grow_host((void **)&e->reqs, &e->cap_reqs, e->n_reqs + 1, sizeof(pd_request *), err));
    pd_request *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "request");
    pd_status st;
    r->id = id;
    r->external = external;
    r->params = *params;
    pd_rng_seed(&r->rng, params->sample.seed);
    pd_kv_seq_init(&r->tkv);
    pd_kv_seq_init(&r->dkv);
    r->prompt = malloc((size_t)n_prompt * sizeof(int32_t));
    if (r->prompt == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "prompt copy: %d tokens", n_prompt);
        goto err_free;
    }
    memcpy(r->prompt, prompt, (size_t)n_prompt * sizeof(int32_t));
    r->n_prompt = n_prompt;
    if ((st = pd_engine_pen_init(e, r, err)) != PD_OK || (st = pd_engine_bias_init(r, err)) != PD_OK ||
        (st = pd_engine_grammar_init(e, r, err)) != PD_OK)
        goto err_free;
    if (params->prompt_logprobs &&
        (r->prompt_lps = calloc((size_t)n_prompt, sizeof(*r->prompt_lps))) == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "prompt logprobs of %d tokens", n_prompt);
        goto err_free;
    }
    if (params->capture_aux && e->draft != NULL) {
        r->aux = malloc((size_t)n_prompt * e->aux_dim * sizeof(float));
        if (r->aux == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "aux rows: %d x %d", n_prompt, e->aux_dim);
            goto err_free;
        }
    }
    if (params->capture_ctx && e->draft != NULL) {
        r->ctx = malloc((size_t)n_prompt * e->H * sizeof(float));
        if (r->ctx == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "context rows: %d x %d", n_prompt, e->H);
            goto err_free;
        }
    }
    /* Admission reserves the request's whole worst case (prompt, every new token and one draft
     * block past the last), so a running request never meets an empty pool mid-decode; a full
     * pool answers BUSY here instead, where the caller can queue. */
    if (st == PD_OK && e->prefix != NULL && !external && !params->capture_aux && !params->capture_ctx &&
        !params->prompt_logprobs)
        st = pd_engine_prefix_take(e, r, err);
    /* with preemption (cfg.swap_bytes) only the prompt and a block: the pages grow round by
     * round; a new request waits while a preempted one does, and leaves a little room */
    int grows = e->cfg.swap_bytes > 0 && !params->hold_kv;
    long worst = (long)n_prompt + (grows ? 0 : params->max_new_tokens) + e->B + 1;
    int reserve = worst < e->tm->cfg.max_position_embeddings ? (int)worst : e->tm->cfg.max_position_embeddings;
    if (st == PD_OK && grows) {
        /* a request that could not finish alone in the pool would wait preempted for ever */
        long full = (long)n_prompt + params->max_new_tokens + e->B + 1;
        int whole = pd_engine_pages_of(e->tpool, full < e->tm->cfg.max_position_embeddings
                                                 ? (int)full : e->tm->cfg.max_position_embeddings);
        if (whole > pd_kv_pool_layout(e->tpool)->n_pages)
            st = pd_err_set(err, PD_ERR_INVALID, "prompt of %d tokens with max_new_tokens %d needs %d KV "
                            "pages, the pool has %d", n_prompt, params->max_new_tokens, whole,
                            pd_kv_pool_layout(e->tpool)->n_pages);
    }
    if (st == PD_OK && grows && e->n_swapped + e->n_recompute > 0)
        st = pd_err_set(err, PD_ERR_BUSY, "%d preempted requests resume first", e->n_swapped + e->n_recompute);
    if (st == PD_OK && grows && pd_engine_active(e) > 0) {
        int need = pd_engine_pages_of(e->tpool, reserve) - r->tkv.n_pages;
        int watermark = pd_kv_pool_layout(e->tpool)->n_pages / 100;
        if (watermark < 1)
            watermark = 1;
        if (pd_engine_kv_free_pages(e) - need < watermark)
            st = pd_err_set(err, PD_ERR_BUSY, "kv pool: %d pages needed, %d free (%d kept for running "
                            "requests)", need, pd_engine_kv_free_pages(e), watermark);
    }
    if (st == PD_OK)
        st = pd_kv_seq_reserve(e->tpool, &r->tkv, reserve, err);
    if (st == PD_OK && e->dpool != NULL)
        st = pd_kv_seq_reserve(e->dpool, &r->dkv, reserve, err);
    if (st == PD_OK && !external)
        st = pd_engine_cp_reserve(e, r, n_prompt, err);
    if (st != PD_OK)
        goto err_free;
    e->reqs[e->n_reqs++] = r;
    *out = r;
    return PD_OK;
err_free:
    request_free(e, r);
    return st;
}

static void fail_request(pd_request *r, const pd_err *why)
{
    r->finish = PD_FINISH_ERROR;
    memcpy(r->error, why->msg, sizeof(r->error));
    r->error[sizeof(r->error) - 1] = '\0';
}

/* ---- forwards: on this thread, or handed to every rank of the tensor-parallel group ------- */

pd_status pd_engine_tp_run(pd_engine *e, pd_tp_cmd *c, pd_err *err)
{
    c->batch_invariant = e->tm->be->batch_invariant;
    return pd_tp_group_run(e->tp, c, err);
}

pd_status pd_engine_target_forward(pd_engine *e, const pd_tok_batch *b, const int32_t *rows, int n,
                                   pd_err *err)
{
    if (e->tp == NULL)
        return pd_target_forward(e->target, b, rows, n, err);
    pd_tp_cmd c = { .op = PD_TP_TARGET_FORWARD, .b = b, .rows = rows, .n_rows = n };
    return pd_engine_tp_run(e, &c, err);
}

pd_status pd_engine_draft_extend(pd_engine *e, const float *aux, const pd_tok_batch *b, pd_err *err)
{
    if (e->tp == NULL)
        return pd_draft_extend(e->draft, aux, e->aux_dim, b, err);
    pd_tp_cmd c = { .op = PD_TP_DRAFT_EXTEND, .b = b, .aux = aux, .ld_aux = e->aux_dim };
    return pd_engine_tp_run(e, &c, err);
}

static pd_status draft_block(pd_engine *e, int n_req, const int32_t *anchor, const int32_t *start,
                             pd_kv_seq *const *seqs, pd_err *err)
{
    if (e->tp == NULL)
        return pd_draft_block(e->draft, n_req, anchor, start, seqs, err);
    pd_tp_cmd c = { .op = PD_TP_DRAFT_BLOCK, .n_req = n_req, .anchor = anchor, .start = start,
                    .seqs = seqs };
    return pd_engine_tp_run(e, &c, err);
}

static pd_status markov_step(pd_engine *e, int k, const int32_t *prev, float *conf_out, pd_err *err)
{
    if (e->tp == NULL)
        return pd_draft_markov_step(e->draft, k, prev, conf_out, err);
    pd_tp_cmd c = { .op = PD_TP_MARKOV_STEP, .k = k, .prev = prev, .conf_out = conf_out };
    return pd_engine_tp_run(e, &c, err);
}

/* ---- one speculative round over every running request ------------------------------------ */

/* What a slot's verify decided, into sl->n_acc, bonus and stop_at. */
static void slot_accept(const pd_engine *e, pd_round_slot *sl, const int32_t *vargmax)
{
    const pd_request *r = sl->r;
    int a = 0;
    if (pd_sample_is_greedy(&r->params.sample)) {
        while (a < sl->l && sl->d[a] == vargmax[sl->base + a])
            a++;
        sl->bonus = vargmax[sl->base + a];
    } else {
        a = sl->acc;   /* rejection sampling on the backend (pd_engine_verify_sampled) */
        sl->bonus = sl->next;
    }
    sl->n_acc = a;
    sl->stop_at = -1;
    for (int j = 0; j < a; j++)
        if (pd_engine_token_ends(e, r, sl->d[j])) {
            sl->stop_at = j;
            break;
        }
}

/* The step-by-step draft loop after the block forward (sampled drafts, or tensor-parallel ranks,
 * whose step logits are gathered after each step): B Markov steps from the anchors, each
 * picking one token per drafting request, the backend's argmax or, when any request samples,
 * kern_sample's pick (greedy rows get their argmax there too) with the distribution kept at row
 * j * B + k of e->smp_q for verification. One download of n_draft ids per step. prev and tok:
 * n_draft ids of scratch; conf_k: n_draft floats when want_conf. */
static pd_status draft_steps(pd_engine *e, pd_round_slot **dslot, int n_draft, const int32_t *anchor,
                             int any_sampled, int32_t *prev, int32_t *tok, float *conf_k,
                             float *conf, int want_conf, pd_err *err)
{
    pd_request **owner = NULL;
    pd_status st = PD_OK;
    if (any_sampled) {
        owner = malloc((size_t)n_draft * sizeof(*owner));
        if (owner == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "draft owners");
        for (int j = 0; j < n_draft; j++) {
            owner[j] = dslot[j]->r;
            dslot[j]->qrow = j * e->B;
        }
        st = kern_buf_grow(e->tm->be, &e->smp_q, &e->cap_smp_q, n_draft * e->B,
                           (size_t)e->V * sizeof(float), err);
    }
    memcpy(prev, anchor, (size_t)n_draft * sizeof(int32_t));
    /* structured output: each step's pick masked by the grammar after the drafts before it, so
     * the drafter proposes only text the grammar allows (the verify rows are masked anyway) */
    for (int j = 0; j < n_draft && st == PD_OK; j++)
        if (dslot[j]->r->gm != NULL)
            st = pd_gmatch_copy(dslot[j]->r->gm_row, dslot[j]->r->gm, err);
    for (int k = 0; k < e->B && st == PD_OK; k++) {
        st = markov_step(e, k, prev, want_conf ? conf_k : NULL, err);
        if (st != PD_OK)
            break;
        const float *sl = pd_draft_step_logits(e->draft);
        for (int j = 0; j < n_draft && st == PD_OK; j++)
            st = pd_engine_mask_step(e, dslot[j]->r, j, dslot[j]->d, k, err);
        if (st == PD_OK)
            st = pd_engine_mask_apply(e, sl, err);
        if (st != PD_OK)
            break;
        if (any_sampled)
            st = pd_engine_sample_rows(e, sl, owner, n_draft, (float *)e->smp_q->ptr + (size_t)k * e->V,
                                       e->B * e->V, tok, err);
        else
            st = pd_engine_argmax_rows(e, sl, n_draft, tok, err);
        for (int j = 0; j < n_draft && st == PD_OK; j++) {
            dslot[j]->d[k] = tok[j];
            prev[j] = tok[j];
            if (want_conf)
                conf[(size_t)j * e->B + k] = conf_k[j];
            /* past the end of the grammar (an eos drafted) its mask stays that of the end */
            if (dslot[j]->r->gm != NULL &&
                pd_gmatch_advance(dslot[j]->r->gm_row, dslot[j]->r->params.gvocab, tok[j], err) < 0)
                st = err != NULL ? err->code : PD_ERR_INTERNAL;
        }
    }
    free(owner);
    return st;
}

static uint64_t graph_cold(const pd_engine *e)
{
    return pd_target_graph_cold(e->target) + (e->draft != NULL ? pd_draft_graph_cold(e->draft) : 0);
}

static pd_status decode_round(pd_engine *e, pd_err *err)
{
    int max_pos = e->tm->cfg.max_position_embeddings;
    int n = 0;
    for (int i = 0; i < e->n_reqs; i++) {
        pd_request *r = e->reqs[i];
        n += r->finish == PD_FINISH_NONE && r->prefilled == r->n_prompt && r->n_out > 0;
    }
    if (n == 0)
        return PD_OK;
    double t_enter = pd_engine_now_s();
    e->times.rounds++;
    /* confidence logits are needed only when some request verifies less than everything */
    int want_conf = 0;
    float *conf = NULL, *conf_k = NULL;
    pd_round_slot *slots = calloc((size_t)n, sizeof(*slots));
    if (slots == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "round slots");
    pd_status st = PD_OK;
    int m = 0;
    for (int i = 0; i < e->n_reqs; i++) {
        pd_request *r = e->reqs[i];
        if (!pd_engine_request_decoding(r))
            continue;
        int p = r->anchor_pos;
        if (p >= max_pos) {
            r->finish = PD_FINISH_LENGTH;
            continue;
        }
        int l = e->B;
        if (p + l + 1 > max_pos)
            l = max_pos - 1 - p;
        pd_err rerr;
        pd_status rs;
        for (;;) {
            rs = pd_kv_seq_reserve(e->tpool, &r->tkv, p + l + 1, &rerr);
            if (rs == PD_OK && e->dpool != NULL && l > 0)
                /* block positions p..p+B-1, and after a full accept the context reaches p+B */
                rs = pd_kv_seq_reserve(e->dpool, &r->dkv, p + e->B + 1, &rerr);
            if (rs != PD_ERR_BUSY || e->cfg.swap_bytes == 0)
                break;
            /* the pool ran out: preempt the request admitted last (r itself when it is) */
            pd_request *v = pd_engine_swap_victim(e, i);
            pd_err serr;
            pd_status ss = v != NULL ? pd_engine_swap_out(e, v, &serr) : PD_ERR_BUSY;
            if (ss == PD_ERR_BUSY && v != NULL) {
                pd_engine_recompute_out(e, v);   /* no room in the swap space: its KV is given up */
                ss = PD_OK;
            }
            if (ss != PD_OK) {
                char why[sizeof(rerr.msg)];
                snprintf(why, sizeof(why), "%.200s; %.300s", rerr.msg,
                         v != NULL ? serr.msg : "no running request to preempt");
                snprintf(rerr.msg, sizeof(rerr.msg), "%s", why);
                if (ss != PD_ERR_BUSY) {
                    free(slots);
                    *err = serr;
                    return ss;
                }
                break;
            }
            if (v == r)
                break;
        }
        if (r->swap != NULL || r->recompute)
            continue;
        if (rs != PD_OK) {
            fail_request(r, &rerr);
            continue;
        }
        slots[m].r = r;
        slots[m].l = l;
        m++;
    }
    if (m == 0) {   /* every request ended, failed or waits preempted */
        free(slots);
        return PD_OK;
    }
    /* ---- a batch past spec_disable_batch drafts nothing (scheduled requests' rows then wait
     * as in their own rounds without drafts; their controller is left out of the round) ---- */
    const int spec_off = e->dm != NULL && e->cfg.spec_disable_batch > 0 && m > e->cfg.spec_disable_batch;
    for (int i = 0; i < m && spec_off; i++)
        slots[i].l = 0;
    /* ---- scheduled requests: draft this round or not ---- */
    double t_round = pd_engine_now_s();
    uint64_t cold0 = graph_cold(e);
    int n_sched = 0, sched_mode = -1, sched_probed = 0;
    for (int i = 0; i < m && e->dm != NULL && !spec_off; i++)
        n_sched += slots[i].l > 0 && pd_engine_request_policy(e, slots[i].r) == PD_VERIFY_SCHEDULED;
    if (n_sched > 0) {
        pd_request *probe = e->cfg.sched_debug_arm <= 0 ? pd_engine_sched_probe(e, slots, m) : NULL;
        sched_probed = probe != NULL;
        pd_engine_sched_accept(e, slots, m, NULL);
        pd_sched_set_switch(&e->sched, pd_engine_switch_cost(e));
        if (e->cfg.sched_debug_arm > 0) {
            sched_mode = e->cfg.sched_debug_arm - 1;
        } else if (probe != NULL) {
            sched_mode = PD_SCHED_ALL;
            e->sched.n_arm[PD_SCHED_ALL]++;
            e->sched.n_probes++;
        } else {
            sched_mode = (int)pd_sched_pick(&e->sched, m);
        }
        for (int i = 0; i < m && sched_mode == PD_SCHED_PLAIN; i++)
            if (pd_engine_request_policy(e, slots[i].r) == PD_VERIFY_SCHEDULED)
                slots[i].l = 0;
    }
    /* rows of scheduled requests that do not draft this round wait: at small batches in the
     * deferred buffer (a copy per round; drafting rounds and probes come often there, and
     * recomputing a gap costs a forward, a whole step on a large model), at larger ones as
     * gaps (nothing per round; drafting rarely resumes there) */
    int gaps = m >= pd_engine_gap_min_batch(e);
    int round_tokens = 0;
    /* ---- draft: one block forward for every request that drafts, then the Markov loop ---- */
    int n_draft = 0;
    for (int i = 0; i < m; i++)
        n_draft += slots[i].l > 0;
    int32_t *anchor = malloc((size_t)(n_draft + 1) * 4), *start = malloc((size_t)(n_draft + 1) * 4),
            *prev = malloc((size_t)(n_draft + 1) * 4), *tok = malloc((size_t)(n_draft + 1) * 4);
    pd_kv_seq **dseqs = malloc((size_t)(n_draft + 1) * sizeof(*dseqs));
    pd_round_slot **dslot = malloc((size_t)(n_draft + 1) * sizeof(*dslot));
    int32_t *vids = NULL, *vpos = NULL, *vseq = NULL, *vrows = NULL, *vargmax = NULL;
    const float *vl_rows = NULL;   /* the verify logits (backend), for logprobs */
    pd_kv_seq **vseqs = NULL;
    if (!anchor || !start || !prev || !tok || !dseqs || !dslot) {
        st = pd_err_set(err, PD_ERR_NOMEM, "draft round metadata");
        goto out;
    }
    int any_sampled = 0, d_i = 0;
    for (int i = 0; i < m; i++) {
        any_sampled |= !pd_sample_is_greedy(&slots[i].r->params.sample);
        slots[i].r->drafting = slots[i].l > 0;
        if (slots[i].l == 0)
            continue;
        anchor[d_i] = slots[i].r->out[slots[i].r->n_out - 1];
        start[d_i] = slots[i].r->anchor_pos;
        dseqs[d_i] = &slots[i].r->dkv;
        dslot[d_i] = &slots[i];
        d_i++;
    }
    /* confidences are read by threshold requests, by scheduled ones when the round runs
     * Algorithm 1 (not when every draft is verified), and by requests that record them */
    for (int i = 0; i < m && e->dm != NULL && e->dm->cfg.enable_confidence_head; i++) {
        pd_verify_policy p = pd_engine_request_policy(e, slots[i].r);
        want_conf |= slots[i].l > 0 && (p == PD_VERIFY_THRESHOLD || slots[i].r->params.record_confidence ||
                                        (p == PD_VERIFY_SCHEDULED && sched_mode != PD_SCHED_ALL));
    }
    if (want_conf) {
        conf = malloc((size_t)n_draft * e->B * sizeof(float));
        conf_k = malloc((size_t)n_draft * sizeof(float));
        if (conf == NULL || conf_k == NULL) {
            free(conf);
            free(conf_k);
            st = pd_err_set(err, PD_ERR_NOMEM, "confidence scratch");
            goto out;
        }
    }
    e->times.reserve += pd_engine_now_s() - t_enter;
    double flush_sec = 0.0;
    int pend_drafting = 0;
    for (int j = 0; j < n_draft; j++)
        pend_drafting += dslot[j]->r->n_pend;
    if (pend_drafting > 0) {
        double t_flush = pd_engine_now_s();
        /* the drafts must see every committed position of their request */
        st = pd_engine_pend_flush(e, PD_FLUSH_DRAFTING, NULL, err);
        flush_sec = pd_engine_now_s() - t_flush;
        e->times.flush += flush_sec;
        if (st != PD_OK)
            goto out;
    }
    double t_draft = pd_engine_now_s(), draft_sec = 0.0;
    uint64_t cold_draft = graph_cold(e);
    int any_masked = 0;   /* a grammar, allowed tokens or bad words: picks masked step by step */
    for (int j = 0; j < n_draft; j++)
        any_masked |= dslot[j]->r->gm != NULL || dslot[j]->r->allow != NULL || dslot[j]->r->bad != NULL;
    if (n_draft > 0 && !any_sampled && e->tp == NULL && !any_masked) {
        /* greedy drafts: the whole round chained on the device, one download (tensor-parallel
         * ranks take the step-by-step path below: each step's logits are gathered over them;
         * so do rounds with structured output, whose picks are masked step by step) */
        int dB = e->dm->cfg.block_size;
        int32_t *ids = malloc((size_t)n_draft * dB * sizeof(int32_t));
        float *cf = want_conf ? malloc((size_t)n_draft * dB * sizeof(float)) : NULL;
        if (ids == NULL || (want_conf && cf == NULL)) {
            free(ids);
            free(cf);
            st = pd_err_set(err, PD_ERR_NOMEM, "draft round ids");
            goto out;
        }
        st = pd_draft_round_greedy(e->draft, n_draft, anchor, start, dseqs, ids, cf, err);
        for (int j = 0; j < n_draft && st == PD_OK; j++)
            for (int k = 0; k < e->B; k++) {
                dslot[j]->d[k] = ids[(size_t)j * dB + k];
                if (want_conf)
                    conf[(size_t)j * e->B + k] = cf[(size_t)j * dB + k];
            }
        free(ids);
        free(cf);
        if (st != PD_OK)
            goto out;
    } else if (n_draft > 0) {
        st = draft_block(e, n_draft, anchor, start, dseqs, err);
        if (st == PD_OK)
            st = draft_steps(e, dslot, n_draft, anchor, any_sampled, prev, tok, conf_k, conf, want_conf, err);
        if (st != PD_OK)
            goto out;
    }
    if (n_draft > 0) {
        /* the draft round just ended with a download, so the host clock saw all of it */
        draft_sec = pd_engine_now_s() - t_draft;
        e->times.draft += draft_sec;
        if (graph_cold(e) == cold_draft)   /* a capture says little about the next rounds */
            pd_sched_add_draft(&e->sched, n_draft, draft_sec);
        if (want_conf) {
            pd_engine_choose_lengths(e, dslot, n_draft, conf, pd_sched_draft_s(&e->sched, m), sched_mode == PD_SCHED_ALL);
            for (int j = 0; j < n_draft; j++) {
                pd_request *r = dslot[j]->r;
                if (!r->params.record_confidence)
                    continue;
                float *nl = realloc(r->conf_log, (size_t)(r->n_conf_rounds + 1) * e->B * sizeof(float));
                if (nl == NULL)
                    continue;
                r->conf_log = nl;
                memcpy(nl + (size_t)r->n_conf_rounds * e->B, conf + (size_t)j * e->B, (size_t)e->B * sizeof(float));
                r->n_conf_rounds++;
            }
        }
    }
    /* ---- verify: [anchor, d_1..d_l] of every request in one ragged target forward ---- */
    int n_v = 0;
    for (int i = 0; i < m; i++) {
        slots[i].base = n_v;
        n_v += slots[i].l + 1;
    }
    vids = malloc((size_t)n_v * 4);
    vpos = malloc((size_t)n_v * 4);
    vseq = malloc((size_t)n_v * 4);
    vrows = malloc((size_t)n_v * 4);
    vargmax = malloc((size_t)n_v * 4);
    vseqs = malloc((size_t)(m + 1) * sizeof(*vseqs));
    if (!vids || !vpos || !vseq || !vrows || !vargmax || !vseqs) {
        st = pd_err_set(err, PD_ERR_NOMEM, "verify batch of %d tokens", n_v);
        goto out;
    }
    /* structured output: each verify row's mask (queued, applied after the forward), the drafts
     * the grammar forces replaced first */
    for (int i = 0; i < m && st == PD_OK; i++)
        st = pd_engine_mask_rows(e, slots[i].r, slots[i].base, slots[i].d, slots[i].l,
                                 pd_sample_is_greedy(&slots[i].r->params.sample), err);
    if (st != PD_OK)
        goto out;
    for (int i = 0; i < m; i++) {
        pd_request *r = slots[i].r;
        vseqs[i] = &r->tkv;
        for (int j = 0; j <= slots[i].l; j++) {
            int t = slots[i].base + j;
            vids[t] = j == 0 ? r->out[r->n_out - 1] : slots[i].d[j - 1];
            vpos[t] = r->anchor_pos + j;
            vseq[t] = i;
            vrows[t] = t;
        }
    }
    double t_verify = pd_engine_now_s();
    int pended = 0;
    if (m > 0) {
        pd_tok_batch vb = { .n_tok = n_v, .ids = vids, .pos = vpos, .seq = vseq, .n_seq = m,
                            .seqs = vseqs };
        st = pd_engine_target_forward(e, &vb, vrows, n_v, err);
        if (st != PD_OK)
            goto out;
        /* a round without drafts in which every request verifies only its anchor commits
         * every row: scheduled requests' rows join their gaps (host bookkeeping only), the
         * others' extension is queued while the forward runs instead of after the host saw
         * the results */
        if (sched_mode == PD_SCHED_PLAIN && n_v == m && e->draft != NULL) {
            pd_request **own = malloc((size_t)m * sizeof(*own));
            if (own == NULL) {
                st = pd_err_set(err, PD_ERR_NOMEM, "deferred context owners");
                goto out;
            }
            for (int i = 0; i < m; i++)
                own[i] = slots[i].r;
            st = pd_engine_extend_or_defer(e, pd_target_aux(e->target), vrows, vpos, own, m, 0, gaps, err);
            free(own);
            if (st != PD_OK)
                goto out;
            pended = 1;
        }
        const float *vl = pd_target_logits(e->target);
        vl_rows = vl;
        for (int i = 0; i < m && st == PD_OK; i++)
            for (int j = 0; j <= slots[i].l && st == PD_OK; j++)
                st = pd_engine_pen_row(e, slots[i].r, slots[i].base + j, slots[i].d, j, err);
        if (st == PD_OK)
            st = pd_engine_pen_apply(e, vl, err);
        if (st == PD_OK)
            st = pd_engine_mask_apply(e, vl, err);
        if (st == PD_OK)
            st = pd_engine_argmax_rows(e, vl, n_v, vargmax, err);
        if (st == PD_OK && any_sampled)
            st = pd_engine_verify_sampled(e, vl, slots, m, err);
        if (st != PD_OK)
            goto out;
    }
    double t_commit = pd_engine_now_s();
    e->times.verify += t_commit - t_verify;
    /* ---- accept and commit ---- */
    int n_ext = 0;
    int32_t *ext_rows = vrows, *ext_pos = vpos;   /* reuse: filled in increasing order */
    pd_request **ext_owner = malloc((size_t)(n_v + 1) * sizeof(*ext_owner));
    if (ext_owner == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "commit metadata");
        goto out;
    }
    for (int i = 0; i < m; i++)
        slot_accept(e, &slots[i], vargmax);
    int *lp_off = malloc((size_t)m * sizeof(int));
    pd_token_logprobs *round_lps = NULL;
    pd_err lp_err;
    pd_status lp_st = lp_off == NULL ? pd_err_set(&lp_err, PD_ERR_NOMEM, "logprobs offsets")
                                     : pd_engine_round_logprobs(e, slots, m, vl_rows, lp_off, &round_lps, &lp_err);
    for (int i = 0; i < m; i++) {
        pd_round_slot *sl = &slots[i];
        pd_request *r = sl->r;
        int l = sl->l, a = sl->n_acc, stop_at = sl->stop_at;
        int32_t bonus = sl->bonus;
        for (int k = 0; k < (stop_at >= 0 ? stop_at + 1 : a); k++)
            r->accepted_at_pos[k]++;
        int commit = stop_at >= 0 ? stop_at + 1 : a;
        pd_err rerr;
        int cap_before = r->cap_rounds;
        pd_status rs = pd_engine_grow_host((void **)&r->accepted, &r->cap_rounds, r->n_rounds + 1, sizeof(int),
                                           &rerr);
        if (rs == PD_OK && (r->verified == NULL || r->cap_rounds != cap_before)) {
            int *nv = realloc(r->verified, (size_t)r->cap_rounds * sizeof(int));
            if (nv == NULL)
                rs = pd_err_set(&rerr, PD_ERR_NOMEM, "round log");
            else
                r->verified = nv;
        }
        if (rs == PD_OK)
            r->verified[r->n_rounds] = l;
        /* logprobs of the committed tokens (pd_engine_round_logprobs) */
        const pd_token_logprobs *lp = NULL;
        if (rs == PD_OK && r->params.logprobs) {
            if (lp_st != PD_OK) {
                rs = lp_st;
                rerr = lp_err;
            } else {
                lp = round_lps + lp_off[i];
            }
        }
        for (int j = 0; j < commit && rs == PD_OK; j++)
            rs = pd_engine_push_out(r, sl->d[j], lp != NULL ? &lp[j] : NULL, &rerr);
        pd_token_logprobs bonus_lp;
        if (lp != NULL && stop_at < 0)
            bonus_lp = lp[a];
        if (rs != PD_OK) {
            fail_request(r, &rerr);
            continue;
        }
        round_tokens += stop_at >= 0 ? commit : a + 1;
        if (l == e->B) {   /* a whole block verified: what this request accepts */
            r->acc_tok = PD_REQ_ACCEPT_DECAY * r->acc_tok + (stop_at >= 0 ? commit : a + 1);
            r->acc_rounds = PD_REQ_ACCEPT_DECAY * r->acc_rounds + 1.0;
            r->n_whole++;
        }
        r->plain_streak = l == 0 ? r->plain_streak + 1 : 0;
        if (stop_at >= 0) {
            r->accepted[r->n_rounds++] = commit;
            r->tkv.len = r->anchor_pos + commit;
            r->finish = PD_FINISH_STOP;
        } else {
            r->accepted[r->n_rounds++] = a + 1;
            if ((rs = pd_engine_push_out(r, bonus, lp != NULL ? &bonus_lp : NULL, &rerr)) != PD_OK) {
                fail_request(r, &rerr);
                continue;
            }
            /* context rows of the committed positions p..p+a feed the draft */
            for (int j = 0; j <= a; j++) {
                ext_rows[n_ext] = sl->base + j;
                ext_pos[n_ext] = r->anchor_pos + j;
                ext_owner[n_ext] = r;
                n_ext++;
            }
            r->tkv.len = r->anchor_pos + a + 1;
            r->dkv.len = r->tkv.len;
            r->anchor_pos += a + 1;
            if (pd_engine_token_ends(e, r, bonus))
                r->finish = PD_FINISH_STOP;
        }
        if (r->n_out >= r->params.max_new_tokens) {
            if (r->n_out > r->params.max_new_tokens)
                r->n_out = r->params.max_new_tokens;
            if (r->finish == PD_FINISH_NONE)
                r->finish = PD_FINISH_LENGTH;
        }
    }
    free(round_lps);
    free(lp_off);
    double t_extend = pd_engine_now_s();
    e->times.commit += t_extend - t_commit;
    if (!pended && n_ext > 0)
        /* rows of scheduled requests that did not draft wait (until their next drafting round);
         * the others' go in now */
        st = pd_engine_extend_or_defer(e, pd_target_aux(e->target), ext_rows, ext_pos, ext_owner, n_ext, 0, gaps,
                                       err);
    free(ext_owner);
    e->times.extend += pd_engine_now_s() - t_extend;
    if (st == PD_OK && sched_mode >= 0) {
        /* the flush is left out: it adds rows that the rounds without drafts put off, work a
         * drafting arm does anyway in its own rounds' extend (which is counted); charging a
         * trial round with every row deferred since the last one made drafting arms look slow
         * in proportion to how long they were not picked */
        double dt = pd_engine_now_s() - t_round - flush_sec;
        int cold = graph_cold(e) != cold0;
        if (e->cfg.sched_trace != NULL)
            pd_engine_sched_trace(e, sched_mode, sched_probed, m, slots[0].r->id, round_tokens, n_v, dt, draft_sec,
                                  flush_sec, cold);
        if (dt > 0.0)
            pd_sched_add(&e->sched, (pd_sched_arm)sched_mode, m, round_tokens, dt, draft_sec, n_v, cold);
    }
out:
    e->times.round += pd_engine_now_s() - t_enter;
    free(conf);
    free(conf_k);
    free(slots);
    free(anchor);
    free(start);
    free(prev);
    free(tok);
    free(dseqs);
    free(dslot);
    free(vids);
    free(vpos);
    free(vseq);
    free(vrows);
    free(vargmax);
    free(vseqs);
    return st;
}

pd_status pd_engine_step(pd_engine *e, pd_err *err)
{
    kern_backend *be = e->tm->be;
    for (int i = 0; i < e->n_reqs; i++) {
        pd_request *r = e->reqs[i];
        /* a finished request's deferred context rows: a request that keeps its KV gets them
         * (its draft KV is then complete), the others' are dropped, so nothing writes into
         * pages given back */
        if (r->finish != PD_FINISH_NONE && r->tkv.n_pages > 0)
            pd_engine_prefix_offer(e, r);
        if (r->finish != PD_FINISH_NONE && r->n_pend > 0) {
            if (r->params.hold_kv)
                TRY(pd_engine_pend_flush(e, PD_FLUSH_REQUEST, r, err));
            else
                pd_engine_pend_drop(e, r);
        }
        if (r->finish != PD_FINISH_NONE)
            pd_engine_preempt_clear(e, r);   /* a preempted request that was cancelled or failed */
        if (r->finish != PD_FINISH_NONE && !r->params.hold_kv) {
            /* finished requests give their pages back at once */
            pd_kv_seq_release(e->tpool, &r->tkv);
            if (e->dpool != NULL)
                pd_kv_seq_release(e->dpool, &r->dkv);
            pd_engine_cp_release(e, r);
        }
    }
    be->batch_invariant = 0;
    double t0 = pd_engine_now_s();
    /* preempted requests resume (or get pages for their recompute) before new prefill work */
    pd_status st = pd_engine_swap_in_waiting(e, err);
    if (st == PD_OK)
        st = pd_engine_prefill_step(e, err);
    double t1 = pd_engine_now_s();
    e->times.prefill += t1 - t0;
    if (st == PD_OK) {
        /* decode rounds: a token's numbers must not depend on its batch (lossless in bf16) */
        be->batch_invariant = !e->cfg.fast_kernels;
        st = decode_round(e, err);
        be->batch_invariant = 0;
    }
    e->times.step += pd_engine_now_s() - t0;
    pd_engine_prefix_count(e);
    return st;
}

const int32_t *pd_engine_take_new(pd_request *r, int *n)
{
    int from = r->n_emitted;
    *n = r->n_out - from;
    r->n_emitted = r->n_out;
    return r->out + from;
}

void pd_engine_cancel(pd_engine *e, pd_request *r)
{
    (void)e;
    if (r->finish == PD_FINISH_NONE)
        r->finish = PD_FINISH_CANCELLED;
}

void pd_engine_release(pd_engine *e, pd_request *r)
{
    for (int i = 0; i < e->n_reqs; i++)
        if (e->reqs[i] == r) {
            memmove(&e->reqs[i], &e->reqs[i + 1], (size_t)(e->n_reqs - i - 1) * sizeof(*e->reqs));
            e->n_reqs--;
            request_free(e, r);
            pd_engine_prefix_count(e);
            return;
        }
}

uint64_t pd_engine_graph_cold(const pd_engine *e) { return graph_cold(e); }

void pd_engine_graph_stats(const pd_engine *e, uint64_t *eager, uint64_t *captures, uint64_t *replays)
{
    uint64_t ge = 0, gc = 0, gr = 0;
    pd_target_graph_stats(e->target, &ge, &gc, &gr);
    if (e->draft != NULL)
        pd_draft_graph_stats(e->draft, &ge, &gc, &gr);
    if (eager != NULL)
        *eager = ge;
    if (captures != NULL)
        *captures = gc;
    if (replays != NULL)
        *replays = gr;
}

const pd_sched_ctl *pd_engine_sched(const pd_engine *e) { return &e->sched; }

void pd_engine_set_sched_debug_arm(pd_engine *e, int arm) { e->cfg.sched_debug_arm = arm; }
const pd_engine_times *pd_engine_phase_times(const pd_engine *e) { return &e->times; }

void pd_engine_set_sps(pd_engine *e, const pd_sps *sps)
{
    e->cfg.sps = sps;
    pd_sched_init(&e->sched, sps);   /* rates measured against another curve do not carry over */
}
