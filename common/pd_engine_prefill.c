/* pd_engine_prefill.c - the engine's prefill: forwards of up to max_prefill_tokens prompt
 *   tokens (one request per forward on a GPU with batch-invariant decoding), context-parallel
 *   over cp_size ranks when configured, the recompute of preempted requests' positions, prompt
 *   logprobs and the first token; and the completion of a prompt prefilled elsewhere (a prefill
 *   node, or a prefill engine writing into this engine's pages).
 * Owns: the CP group's ranks (backends, KV replicas) and a request's CP page tables, the
 *   loading of the CP ranks' targets (pd_cp_targets), the aux transfer modes' names.
 * Not here: the CP forward (pd_cp_prefill.c), the picks and logprobs (pd_engine_logits.c), the
 *   draft context of the prompt rows (pd_engine_ctx.c), preemption (pd_engine_kv.c).
 * Threading: the engine's thread only (the CP ranks' threads run inside pd_cp_group_prefill). */
#include "pd_engine_prefill.h"

#include "pd_engine_ctx.h"
#include "pd_engine_kv.h"
#include "pd_engine_logits.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* m is rank 0's target t loaded on another backend of t's kind and precision */
static int cp_target_ok(const pd_qwen3_model *m, const pd_qwen3_model *t)
{
    const pd_qwen3_config *a = m != NULL ? &m->cfg : NULL, *b = &t->cfg;
    return m != NULL && m->be != NULL && m->be->ops == t->be->ops &&
           m->be->act_bf16 == t->be->act_bf16 && m->be->weight_dtype == t->be->weight_dtype &&
           m->be->kv_dtype == t->be->kv_dtype && a->hidden_size == b->hidden_size &&
           a->num_hidden_layers == b->num_hidden_layers &&
           a->num_attention_heads == b->num_attention_heads &&
           a->num_key_value_heads == b->num_key_value_heads && a->head_dim == b->head_dim &&
           a->intermediate_size == b->intermediate_size && a->vocab_size == b->vocab_size;
}

/* The CP group: a host backend gets one more backend handle and KV replica per extra rank (the
 * weights shared); a device backend takes the ranks' targets from cfg.cp_targets (each on its
 * own backend) and a KV replica on each: NCCL when every rank has a device of its own, the
 * local communicator with device copies when ranks share one. */
pd_status pd_engine_cp_create(pd_engine *e, const pd_kv_layout *tl, const int *taps, int n_taps,
                              pd_err *err)
{
    kern_backend *be = e->tm->be;
    int n = e->cfg.cp_size;
    if (!be->is_host && e->cfg.cp_targets == NULL)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "cp prefill on backend %s needs the target loaded once per rank "
                          "(pd_engine_config.cp_targets)", be->ops->name);
    if (e->cfg.cp_strategy < 0 || e->cfg.cp_strategy >= PD_CP_STRATEGY_COUNT)
        return pd_err_set(err, PD_ERR_INVALID, "cp strategy %d unknown", (int)e->cfg.cp_strategy);
    e->cp_be = calloc((size_t)n, sizeof(*e->cp_be));
    e->cp_pool = calloc((size_t)n, sizeof(*e->cp_pool));
    pd_cp_rank_res *res = calloc((size_t)n, sizeof(*res));
    if (e->cp_be == NULL || e->cp_pool == NULL || res == NULL) {
        free(res);
        return pd_err_set(err, PD_ERR_NOMEM, "cp group of %d ranks", n);
    }
    e->cp_n = n;
    e->cp_owns_be = be->is_host;
    e->cp_be[0] = be;
    e->cp_pool[0] = e->tpool;
    res[0] = (pd_cp_rank_res){ .be = be, .model = e->tm, .pool = e->tpool };
    pd_status st = kern_backend_bind_thread(be, &res[0].device, err);
    int distinct = 1;
    for (int r = 1; r < n && st == PD_OK; r++) {
        const pd_qwen3_model *m = e->tm;
        if (be->is_host) {
            kern_backend_config bc = { .name = be->ops->name, .f32 = be->weight_dtype == KERN_DTYPE_F32,
                                       .act_bf16 = be->act_bf16 };
            st = kern_backend_create(&bc, &e->cp_be[r], err);
        } else if (!cp_target_ok(e->cfg.cp_targets[r - 1], e->tm)) {
            st = pd_err_set(err, PD_ERR_INVALID, "cp rank %d: no target, or not the rank 0 target's "
                            "shapes on a %s backend of the same precision", r, be->ops->name);
        } else {
            m = e->cfg.cp_targets[r - 1];
            e->cp_be[r] = m->be;
            st = kern_backend_bind_thread(m->be, &res[r].device, err);
            for (int q = 0; q < r && st == PD_OK; q++)
                distinct &= res[q].device != res[r].device;
        }
        if (st == PD_OK)
            st = pd_kv_pool_create(e->cp_be[r], tl, &e->cp_pool[r], err);
        if (st == PD_OK)
            res[r] = (pd_cp_rank_res){ .be = e->cp_be[r], .model = m, .pool = e->cp_pool[r],
                                       .device = res[r].device };
    }
    /* this thread goes on with rank 0's device */
    if (st == PD_OK)
        st = kern_backend_bind_thread(be, NULL, err);
    pd_cp_group_config gc = { .opts = { .strategy = e->cfg.cp_strategy, .cp_size = n },
                              .comm = PD_CP_COMM_LOCAL, .ranks = res, .taps = taps,
                              .n_taps = n_taps };
    if (!be->is_host) {
        gc.comm = distinct && pd_comm_nccl_available() ? PD_CP_COMM_NCCL : PD_CP_COMM_LOCAL;
        gc.copy = gc.comm == PD_CP_COMM_LOCAL ? pd_comm_cuda_copy : NULL;
    }
    if (st == PD_OK)
        st = pd_cp_group_create(&gc, &e->cp, err);
    free(res);
    return st;
}

pd_status pd_cp_targets_load(pd_cp_targets *t, kern_backend *be0, const char *dir, int cp_size,
                             pd_err *err)
{
    memset(t, 0, sizeof(*t));
    if (be0->is_host || cp_size <= 1)
        return PD_OK;
    int ndev = kern_backend_device_count(be0->ops->name);
    if (ndev < 1)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cp prefill: no %s device", be0->ops->name);
    t->be = calloc((size_t)cp_size - 1, sizeof(*t->be));
    t->tm = calloc((size_t)cp_size - 1, sizeof(*t->tm));
    if (t->be == NULL || t->tm == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cp prefill: %d ranks", cp_size);
    t->n = cp_size;
    pd_status st = PD_OK;
    for (int r = 1; r < cp_size && st == PD_OK; r++) {
        kern_backend_config bc = { .name = be0->ops->name, .device = r % ndev,
                                   .f32 = be0->weight_dtype == KERN_DTYPE_F32 };
        st = kern_backend_create(&bc, &t->be[r - 1], err);
        if (st == PD_OK)
            st = pd_qwen3_load(t->be[r - 1], dir, &t->tm[r - 1], err);
    }
    /* creating a backend selects its device: the caller goes on with rank 0's */
    pd_err berr;
    pd_status sb = kern_backend_bind_thread(be0, NULL, &berr);
    if (st == PD_OK && sb != PD_OK) {
        *err = berr;
        st = sb;
    }
    return st;
}

void pd_cp_targets_free(pd_cp_targets *t)
{
    for (int r = 0; r + 1 < t->n; r++) {
        if (t->tm != NULL)
            pd_qwen3_free(t->tm[r]);
        if (t->be != NULL)
            kern_backend_destroy(t->be[r]);
    }
    free(t->tm);
    free(t->be);
    memset(t, 0, sizeof(*t));
}

void pd_engine_cp_release(pd_engine *e, pd_request *r)
{
    if (r->cp_kv == NULL)
        return;
    for (int k = 1; k < e->cp_n; k++)
        pd_kv_seq_release(e->cp_pool[k], &r->cp_kv[k - 1]);
    free(r->cp_kv);
    r->cp_kv = NULL;
}

pd_status pd_engine_cp_reserve(pd_engine *e, pd_request *r, int n_tok, pd_err *err)
{
    if (e->cp_n <= 1)
        return PD_OK;
    if (r->cp_kv == NULL) {
        r->cp_kv = calloc((size_t)e->cp_n - 1, sizeof(*r->cp_kv));
        if (r->cp_kv == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "cp page tables");
        for (int k = 1; k < e->cp_n; k++)
            pd_kv_seq_init(&r->cp_kv[k - 1]);
    }
    pd_status st = PD_OK;
    for (int k = 1; k < e->cp_n && st == PD_OK; k++)
        st = pd_kv_seq_reserve(e->cp_pool[k], &r->cp_kv[k - 1], n_tok, err);
    if (st != PD_OK)
        pd_engine_cp_release(e, r);
    return st;
}

/* ---- prefill ----------------------------------------------------------------------------- */

/* The CP forward of a packed prefill batch (tokens of one sequence are contiguous, in order).
 * Sets the logits of lrows and the aux tensor the drafter gets, after the hand-off guard. */
static pd_status cp_prefill(pd_engine *e, const pd_tok_batch *b, pd_request *const *owner,
                            const int32_t *lrows, int n_logits, const float **logits,
                            const float **aux, pd_err *err)
{
    int n = e->cp_n, ns = b->n_seq;
    int32_t *lens = calloc((size_t)ns, sizeof(int32_t)), *prefix = calloc((size_t)ns, sizeof(int32_t));
    pd_kv_seq **tabs = calloc((size_t)n * ns, sizeof(*tabs));
    pd_kv_seq *const **rank_tabs = calloc((size_t)n, sizeof(*rank_tabs));
    pd_status st = PD_OK;
    if (lens == NULL || prefix == NULL || tabs == NULL || rank_tabs == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "cp prefill metadata: %d sequences", ns);
        goto out;
    }
    for (int t = 0; t < b->n_tok; t++) {
        int s = b->seq[t];
        if (lens[s]++ == 0) {
            prefix[s] = b->pos[t];
            tabs[s] = b->seqs[s];
            for (int k = 1; k < n; k++)
                tabs[(size_t)k * ns + s] = &owner[t]->cp_kv[k - 1];
        }
    }
    for (int k = 0; k < n; k++)
        rank_tabs[k] = tabs + (size_t)k * ns;
    pd_cp_group_batch gb = { .n_seqs = ns, .seq_lens = lens, .prefix_lens = prefix, .ids = b->ids,
                             .seqs = rank_tabs, .logit_rows = lrows, .n_logits = n_logits };
    st = pd_cp_group_prefill(e->cp, &gb, err);
    if (st != PD_OK)
        goto out;
    const pd_cp_rank *r0 = pd_cp_group_rank(e->cp, 0);
    *logits = pd_cp_rank_logits(r0);
    *aux = NULL;
    if (e->draft != NULL) {
        pd_cp_aux a = pd_cp_rank_aux(r0);
        if (e->cfg.cp_debug_aux_hidden)
            a = (pd_cp_aux){ .data = pd_cp_rank_hidden(r0), .rows = b->n_tok, .cols = e->H,
                             .ld = e->H };
        st = pd_cp_aux_check(&a, b->n_tok, e->aux_dim, pd_cp_rank_hidden(r0), err);
        if (st == PD_OK && a.ld != e->aux_dim)
            st = pd_err_set(err, PD_ERR_INTERNAL, "cp aux row stride %d, want %d", a.ld, e->aux_dim);
        *aux = a.data;
    }
out:
    free(lens);
    free(prefix);
    free(tabs);
    free(rank_tabs);
    return st;
}

/* The prompt is in the pages and the draft context: commit the first token. */
static pd_status commit_first(pd_engine *e, pd_request *r, int32_t tok, const pd_token_logprobs *lp,
                              pd_err *err)
{
    pd_engine_cp_release(e, r);   /* decode is single-rank: the CP replicas' pages are not needed now */
    r->prefilled = r->n_prompt;
    r->tkv.len = r->n_prompt;
    r->dkv.len = r->n_prompt;
    r->anchor_pos = r->n_prompt;
    TRY(pd_engine_push_out(r, tok, lp, err));
    if (pd_engine_token_ends(e, r, tok))
        r->finish = PD_FINISH_STOP;
    else if (r->n_out >= r->params.max_new_tokens)
        r->finish = PD_FINISH_LENGTH;
    return PD_OK;
}

pd_status pd_aux_mode_parse(const char *s, pd_aux_mode *out, pd_err *err)
{
    if (strcmp(s, "raw") == 0)
        *out = PD_AUX_RAW;
    else if (strcmp(s, "ctx") == 0)
        *out = PD_AUX_CTX;
    else if (strcmp(s, "draft-kv") == 0)
        *out = PD_AUX_DRAFT_KV;
    else
        return pd_err_set(err, PD_ERR_INVALID, "aux transfer '%s' (expected raw, ctx or draft-kv)", s);
    return PD_OK;
}

const char *pd_aux_mode_name(pd_aux_mode m)
{
    return m == PD_AUX_CTX ? "ctx" : m == PD_AUX_DRAFT_KV ? "draft-kv" : "raw";
}

pd_status pd_engine_complete_prefill(pd_engine *e, pd_request *r, int32_t first_token,
                                     const float *aux_host, pd_err *err)
{
    return pd_engine_complete_prefill_mode(e, r, first_token, PD_AUX_RAW, aux_host, NULL, err);
}

/* The draft context of a prompt prefilled elsewhere: positions 0..n-1 of r->dkv from the raw aux
 * rows (uploaded first) or from ready context features (host rows). */
static pd_status extend_prompt_context(pd_engine *e, pd_request *r, pd_aux_mode mode, const float *rows,
                                       pd_err *err)
{
    int n = r->n_prompt;
    if (mode == PD_AUX_RAW) {
        kern_backend *be = e->tm->be;
        TRY(kern_buf_grow(be, &e->aux_dev, &e->cap_aux, n, (size_t)e->aux_dim * sizeof(float), err));
        TRY(kern_upload(be, e->aux_dev->ptr, rows, (size_t)n * e->aux_dim * sizeof(float), err));
    }
    int32_t *pos = malloc((size_t)n * sizeof(int32_t)), *seq = calloc((size_t)n, sizeof(int32_t));
    if (pos == NULL || seq == NULL) {
        free(pos);
        free(seq);
        return pd_err_set(err, PD_ERR_NOMEM, "prefill completion metadata");
    }
    for (int i = 0; i < n; i++)
        pos[i] = i;
    pd_kv_seq *seqs[1] = {&r->dkv};
    pd_tok_batch b = { .n_tok = n, .pos = pos, .seq = seq, .n_seq = 1, .seqs = seqs };
    pd_status st = mode == PD_AUX_RAW ? pd_draft_extend(e->draft, e->aux_dev->ptr, e->aux_dim, &b, err)
                                      : pd_draft_extend_ctx(e->draft, rows, &b, err);
    free(pos);
    free(seq);
    return st;
}

/* Logprobs that came from elsewhere: at most max_top tops (the request's count), ids and the
 * rank within the vocabulary. */
static pd_status lp_check(const pd_engine *e, const pd_token_logprobs *lp, int max_top, const char *what,
                          pd_err *err)
{
    if (lp->n_top < 0 || lp->n_top > max_top)
        return pd_err_set(err, PD_ERR_INVALID, "%s: %d top logprobs, the request asked for %d", what,
                          lp->n_top, max_top);
    if (lp->rank < 0 || lp->rank > e->V)
        return pd_err_set(err, PD_ERR_INVALID, "%s: rank %d outside 0..%d", what, lp->rank, e->V);
    for (int i = 0; i < lp->n_top; i++)
        if (lp->top_id[i] < 0 || lp->top_id[i] >= e->V)
            return pd_err_set(err, PD_ERR_INVALID, "%s: top logprob id %d outside the vocabulary "
                              "(0..%d)", what, lp->top_id[i], e->V - 1);
    return PD_OK;
}

pd_status pd_engine_set_prompt_logprobs(pd_engine *e, pd_request *r, const pd_token_logprobs *lps,
                                        int n, pd_err *err)
{
    if (r->prompt_lps == NULL || !r->external)
        return pd_err_set(err, PD_ERR_INVALID, "request %llu keeps no prompt logprobs from outside",
                          (unsigned long long)r->id);
    if (n != r->n_prompt)
        return pd_err_set(err, PD_ERR_INVALID, "%d prompt logprobs for a prompt of %d tokens", n,
                          r->n_prompt);
    for (int i = 0; i < n; i++)
        TRY(lp_check(e, &lps[i], r->params.prompt_top_logprobs, "prompt token", err));
    memcpy(r->prompt_lps, lps, (size_t)n * sizeof(*lps));
    return PD_OK;
}

pd_status pd_engine_complete_prefill_mode(pd_engine *e, pd_request *r, int32_t first_token,
                                          pd_aux_mode mode, const float *aux_host,
                                          const pd_token_logprobs *first_lp, pd_err *err)
{
    if (!r->external || r->prefilled == r->n_prompt || r->finish != PD_FINISH_NONE)
        return pd_err_set(err, PD_ERR_INVALID, "request %llu is not waiting for a prefill",
                          (unsigned long long)r->id);
    if (first_token < 0 || first_token >= e->V)
        return pd_err_set(err, PD_ERR_INVALID, "first token %d outside the vocabulary (0..%d)",
                          first_token, e->V - 1);
    if (e->draft != NULL && mode != PD_AUX_DRAFT_KV) {
        if (aux_host == NULL)
            return pd_err_set(err, PD_ERR_INVALID, "request %llu: prefill brought no %s rows",
                              (unsigned long long)r->id, mode == PD_AUX_CTX ? "context" : "aux");
        TRY(extend_prompt_context(e, r, mode, aux_host, err));
    }
    if (first_lp != NULL && r->params.logprobs)
        TRY(lp_check(e, first_lp, r->params.top_logprobs, "first token", err));
    /* the prefill node drew the first token's uniform from the same seed: skip it, so the rest
     * of the stream is what a request prefilled here draws (the same text for a seed colocated,
     * disaggregated, or prefilled here from the prefix cache) */
    if (!pd_sample_is_greedy(&r->params.sample))
        (void)pd_rng_uniform(&r->rng);
    TRY(commit_first(e, r, first_token, r->params.logprobs ? first_lp : NULL, err));
    pd_engine_prefix_offer(e, r);   /* its prompt pages are final: a sibling may take them at once */
    return PD_OK;
}

/* Prompt tokens r may prefill in one forward: the rest of its prompt, at most
 * PROMPT_LP_CHUNK when it keeps prompt logprobs (one logits row per token: the rows of a forward
 * stay within PROMPT_LP_CHUNK x vocabulary floats). */
#define PROMPT_LP_CHUNK 256
/* Positions the prefill covers: the prompt, or for a request preempted without a host copy
 * (recompute 2) every committed position before its anchor. */
static int prefill_len(const pd_request *r)
{
    return r->recompute ? r->anchor_pos : r->n_prompt;
}

/* r waits for prefill work here: its own prompt, or a recompute whose pages are reserved */
static int prefill_wants(const pd_request *r)
{
    return r->finish == PD_FINISH_NONE && !r->external && r->recompute != 1 && r->prefilled < prefill_len(r);
}

static int prefill_take(const pd_request *r)
{
    int take = prefill_len(r) - r->prefilled;
    if (r->recompute)
        return take;
    return r->prompt_lps != NULL && take > PROMPT_LP_CHUNK ? PROMPT_LP_CHUNK : take;
}

/* The prompt logprobs of a prefill forward: logits row k (n_done <= k < n_rows) is that of
 * token lrows[k], which predicts the prompt token after it; one kern_logprobs for them all, the
 * longest top list asked for, each request's cut to its own. */
static pd_status prompt_logprobs(pd_engine *e, const float *logits, pd_request *const *owner,
                                 const int32_t *pos, const int32_t *lrows, int n_done, int n_rows, pd_err *err)
{
    int n = n_rows - n_done, top = 0;
    int32_t *rows = malloc((size_t)n * 2 * sizeof(int32_t));
    pd_token_logprobs *lp = malloc((size_t)n * sizeof(*lp));
    if (rows == NULL || lp == NULL) {
        free(rows);
        free(lp);
        return pd_err_set(err, PD_ERR_NOMEM, "prompt logprobs of %d rows", n);
    }
    int32_t *toks = rows + n;
    for (int i = 0; i < n; i++) {
        const pd_request *r = owner[lrows[n_done + i]];
        rows[i] = n_done + i;
        toks[i] = r->prompt[pos[lrows[n_done + i]] + 1];
        top = r->params.prompt_top_logprobs > top ? r->params.prompt_top_logprobs : top;
    }
    pd_status st = pd_engine_logprobs_entries(e, logits, rows, toks, n, top, lp, err);
    for (int i = 0; i < n && st == PD_OK; i++) {
        pd_request *r = owner[lrows[n_done + i]];
        pd_token_logprobs *d = &r->prompt_lps[pos[lrows[n_done + i]] + 1];
        *d = lp[i];
        pd_engine_lp_cut(d, r->params.prompt_top_logprobs);
    }
    free(rows);
    free(lp);
    return st;
}

/* One prefill forward of up to budget prompt tokens from at most max_seq requests; *n_out = the
 * tokens it took (0: nothing to prefill). */
static pd_status prefill_forward(pd_engine *e, int budget, int max_seq, int *n_out, pd_err *err)
{
    int n_tok = 0, n_seq = 0;
    *n_out = 0;
    for (int i = 0; i < e->n_reqs && n_tok < budget && n_seq < max_seq; i++) {
        pd_request *r = e->reqs[i];
        if (!prefill_wants(r))
            continue;
        int take = prefill_take(r);
        n_tok += take < budget - n_tok ? take : budget - n_tok;
        n_seq++;
    }
    if (n_tok == 0)
        return PD_OK;
    *n_out = n_tok;
    int32_t *ids = malloc((size_t)n_tok * 4), *pos = malloc((size_t)n_tok * 4),
            *seq = malloc((size_t)n_tok * 4), *rows = malloc((size_t)n_tok * 4),
            *lrows = malloc((size_t)(n_seq + n_tok) * 4), *first = malloc((size_t)n_seq * 4);
    pd_kv_seq **seqs = malloc((size_t)n_seq * sizeof(*seqs));
    pd_request **owner = malloc((size_t)n_tok * sizeof(*owner));
    pd_request **done = malloc((size_t)n_seq * sizeof(*done)), **back = malloc((size_t)n_seq * sizeof(*back));
    pd_status st = PD_OK;
    if (!ids || !pos || !seq || !rows || !lrows || !first || !seqs || !owner || !done || !back) {
        st = pd_err_set(err, PD_ERR_NOMEM, "prefill batch of %d tokens", n_tok);
        goto out;
    }
    int t = 0, s = 0, n_done = 0;
    int n_back = 0;   /* recomputed requests whose context is whole again (back[]) */
    for (int i = 0; i < e->n_reqs && t < n_tok; i++) {
        pd_request *r = e->reqs[i];
        if (!prefill_wants(r))
            continue;
        int take = prefill_take(r);
        if (take > n_tok - t)
            take = n_tok - t;
        seqs[s] = &r->tkv;
        for (int j = 0; j < take; j++, t++) {
            ids[t] = pd_engine_token_at(r, r->prefilled + j);
            pos[t] = r->prefilled + j;
            seq[t] = s;
            rows[t] = t;
            owner[t] = r;
        }
        r->prefilled += take;
        if (r->prefilled == prefill_len(r) && r->recompute) {
            back[n_back++] = r;
        } else if (r->prefilled == r->n_prompt) {
            lrows[n_done] = t - 1;
            done[n_done++] = r;
        }
        s++;
    }
    /* prompt logprobs: the rows of every token that predicts a later prompt token, after the
     * first-token rows */
    int n_rows = n_done;
    for (int i = 0; i < n_tok; i++)
        if (owner[i]->prompt_lps != NULL && !owner[i]->recompute && pos[i] + 1 < owner[i]->n_prompt)
            lrows[n_rows++] = i;
    pd_tok_batch b = { .n_tok = n_tok, .ids = ids, .pos = pos, .seq = seq, .n_seq = s, .seqs = seqs };
    const float *logits = NULL, *aux = NULL;
    double t_fwd = pd_engine_now_s();
    if (e->cp != NULL) {
        st = cp_prefill(e, &b, owner, lrows, n_done, &logits, &aux, err);
    } else {
        st = pd_engine_target_forward(e, &b, lrows, n_rows, err);
        logits = pd_target_logits(e->target);
        aux = pd_target_aux(e->target);
    }
    if (st != PD_OK)
        goto out;
    if (n_rows > n_done)
        st = prompt_logprobs(e, logits, owner, pos, lrows, n_done, n_rows, err);
    if (st != PD_OK)
        goto out;
    if (e->draft != NULL && e->cfg.prefill_aux_hook != NULL)
        e->cfg.prefill_aux_hook(e->cfg.prefill_aux_hook_ud, aux, n_tok, e->aux_dim, e->aux_dim);
    double t_ext = pd_engine_now_s();
    e->times.prefill_target += t_ext - t_fwd;
    /* prompt rows wait as gaps too among enough requests, as decode rows do */
    int active = 0;
    for (int i = 0; i < e->n_reqs; i++)
        active += e->reqs[i]->finish == PD_FINISH_NONE;
    st = pd_engine_extend_or_defer(e, aux, rows, pos, owner, n_tok, 1, active >= pd_engine_gap_min_batch(e), err);
    e->times.prefill_draft += pd_engine_now_s() - t_ext;
    if (st != PD_OK)
        goto out;
    /* recomputed requests decode again from their anchor (their first token is long out) */
    for (int i = 0; i < n_back; i++) {
        pd_request *r = back[i];
        r->tkv.len = r->anchor_pos;
        r->dkv.len = r->anchor_pos;
        r->prefilled = r->n_prompt;
        pd_engine_cp_release(e, r);
        pd_engine_preempt_clear(e, r);
    }
    /* prefill nodes keep the packed aux rows (or the draft context features) of their prompts,
     * in global token order */
    for (int i = 0; i < n_tok; i++) {
        pd_request *r = owner[i];
        if ((r->aux == NULL && r->ctx == NULL) || (i > 0 && owner[i - 1] == r))
            continue;
        int cnt = 1;
        while (i + cnt < n_tok && owner[i + cnt] == r)
            cnt++;
        if (r->aux != NULL)
            st = kern_download(e->tm->be, r->aux + (size_t)pos[i] * e->aux_dim,
                               aux + (size_t)i * e->aux_dim,
                               (size_t)cnt * e->aux_dim * sizeof(float), err);
        if (st == PD_OK && r->ctx != NULL)
            st = kern_download(e->tm->be, r->ctx + (size_t)pos[i] * e->H,
                               pd_draft_ctx_feature(e->draft) + (size_t)i * e->H,
                               (size_t)cnt * e->H * sizeof(float), err);
        if (st != PD_OK)
            goto out;
    }
    /* penalties (the prompt's tokens, for the repetition penalty) */
    for (int i = 0; i < n_done && st == PD_OK; i++)
        if ((st = pd_engine_pen_row(e, done[i], i, NULL, 0, err)) == PD_OK)
            st = pd_engine_mask_rows(e, done[i], i, NULL, 0, 0, err);
    if (st == PD_OK)
        st = pd_engine_pen_apply(e, logits, err);
    if (st == PD_OK)
        st = pd_engine_mask_apply(e, logits, err);
    if (st != PD_OK)
        goto out;
    /* first tokens: the backend's argmax, or its sampling ops when a request samples */
    int any_sampled = 0;
    for (int i = 0; i < n_done; i++)
        any_sampled |= !pd_sample_is_greedy(&done[i]->params.sample);
    double t_first = pd_engine_now_s();
    if (n_done > 0 && !any_sampled)
        st = pd_engine_argmax_rows(e, logits, n_done, first, err);
    else if (n_done > 0 &&
             (st = kern_buf_grow(e->tm->be, &e->smp_p, &e->cap_smp_p, n_done, (size_t)e->V * sizeof(float), err)) == PD_OK)
        st = pd_engine_sample_rows(e, logits, done, n_done, e->smp_p->ptr, e->V, first, err);
    e->times.prefill_target += pd_engine_now_s() - t_first;
    if (st != PD_OK)
        goto out;
    for (int i = 0; i < n_done; i++) {
        pd_token_logprobs lp;
        if (done[i]->params.logprobs &&
            (st = pd_engine_logprobs_rows(e, done[i], logits, i, &first[i], 1, &lp, err)) != PD_OK)
            goto out;
        if ((st = commit_first(e, done[i], first[i], done[i]->params.logprobs ? &lp : NULL, err)) != PD_OK)
            goto out;
        pd_engine_prefix_offer(e, done[i]);
    }
out:
    free(ids);
    free(pos);
    free(seq);
    free(rows);
    free(lrows);
    free(first);
    free(seqs);
    free(owner);
    free(done);
    free(back);
    return st;
}

/* Prefill work of one engine step, about max_prefill_tokens. On a GPU with batch-invariant
 * decoding every forward holds one request's tokens only: the prefill kernels (cuBLAS, the
 * tensor-core attention) are not batch-invariant, so a prompt's KV must not depend on which
 * other prompts shared its forward - the same prompt then gets bit-identical KV whether it is
 * decoded speculatively or not, and greedy speculative output equals greedy decoding. CP
 * forwards too: the ranks' pieces (and so their kernels) follow from the forward's tokens, so a
 * node serving a burst and pdspark-generate serving one prompt prefill it the same way. */
pd_status pd_engine_prefill_step(pd_engine *e, pd_err *err)
{
    int budget = e->cfg.max_prefill_tokens;
    int solo = !e->cfg.fast_kernels && !e->tm->be->is_host;
    int n = 0, total = 0;
    do {
        /* a request's chunks are max_prefill_tokens long whatever else is waiting */
        TRY(prefill_forward(e, budget, solo ? 1 : INT_MAX, &n, err));
        total += n;
    } while (solo && n > 0 && total < budget);
    return PD_OK;
}
