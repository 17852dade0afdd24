/* pd_engine_logits.c - the engine's per-request logits pipeline: what a token means for a
 *   request (stop rules), what is done to the target's logits before a pick (penalties, logit
 *   bias, min_tokens, grammar masks) and the picks themselves on the backend (argmax, sampling,
 *   sampled verification), with the logprobs of the picked tokens.
 * Owns: a request's penalty counts, bias copy and grammar matchers (set at admission, followed
 *   by pd_engine_push_out), the engine's queues of penalty entries and masks, sampling staging.
 * Not here: which rows a forward has and when they are picked (pd_engine.c decode rounds,
 *   pd_engine_prefill.c first tokens and prompt logprobs).
 * Threading: the engine's thread only. */
#include "pd_engine_logits.h"

#include "pd_grammar.h"

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int is_eos(const pd_engine *e, int32_t tok)
{
    for (int i = 0; i < e->tm->cfg.n_eos; i++)
        if (e->tm->cfg.eos_ids[i] == tok)
            return 1;
    return 0;
}

static int is_stop_id(const pd_request *r, int32_t tok)
{
    for (int i = 0; i < r->params.n_stop_ids; i++)
        if (r->params.stop_ids[i] == tok)
            return 1;
    return 0;
}

/* tok ends r: an eos (unless ignore_eos) or one of its stop_ids */
int pd_engine_token_ends(const pd_engine *e, const pd_request *r, int32_t tok)
{
    return (!r->params.ignore_eos && is_eos(e, tok)) || is_stop_id(r, tok);
}

/* ---- penalties (pd_gen_params presence/frequency/repetition) ------------------------------ */

#define PEN_PROMPT 0x80000000u

static int pen_rep_on(const pd_gen_params *p)
{
    return p->repetition_penalty != 0.0f && p->repetition_penalty != 1.0f;
}

static pd_status pen_track(pd_request *r, int32_t tok, pd_err *err)
{
    TRY(pd_engine_grow_host((void **)&r->pen_tok, &r->cap_pen_tok, r->n_pen_tok + 1, sizeof(int32_t), err));
    r->pen_tok[r->n_pen_tok++] = tok;
    return PD_OK;
}

/* A request with penalties gets its per-token state; the prompt's tokens count for the
 * repetition penalty only. */
pd_status pd_engine_pen_init(pd_engine *e, pd_request *r, pd_err *err)
{
    const pd_gen_params *p = &r->params;
    if (p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f && !pen_rep_on(p))
        return PD_OK;
    if ((r->pen = calloc((size_t)e->V, sizeof(uint32_t))) == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "penalty state");
    for (int i = 0; i < r->n_prompt && pen_rep_on(p); i++)
        if (r->pen[r->prompt[i]] == 0) {
            TRY(pen_track(r, r->prompt[i], err));
            r->pen[r->prompt[i]] = PEN_PROMPT;
        }
    return PD_OK;
}

static int by_tok(const void *a, const void *b)
{
    int32_t x = ((const pd_logit_bias *)a)->tok, y = ((const pd_logit_bias *)b)->tok;
    return x < y ? -1 : x > y;
}

/* The request's own sorted copy of its logit_bias (params.logit_bias then points at it);
 * a token named twice is refused. */
pd_status pd_engine_bias_init(pd_request *r, pd_err *err)
{
    int n = r->params.n_logit_bias;
    if (n == 0) {
        r->params.logit_bias = NULL;
        return PD_OK;
    }
    if ((r->bias = malloc((size_t)n * sizeof(*r->bias))) == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "logit_bias of %d tokens", n);
    memcpy(r->bias, r->params.logit_bias, (size_t)n * sizeof(*r->bias));
    qsort(r->bias, (size_t)n, sizeof(*r->bias), by_tok);
    r->params.logit_bias = r->bias;
    for (int i = 1; i < n; i++)
        if (r->bias[i].tok == r->bias[i - 1].tok)
            return pd_err_set(err, PD_ERR_INVALID, "logit_bias names token %d twice", r->bias[i].tok);
    return PD_OK;
}

static pd_status pen_push(pd_engine *e, const kern_penalty_entry *en, pd_err *err)
{
    TRY(pd_engine_grow_host((void **)&e->pen_host, &e->cap_pen_host, e->n_pen + 1, sizeof(*en), err));
    e->pen_host[e->n_pen++] = *en;
    return PD_OK;
}

/* r's logit_bias entry of token t (sorted by token at admission), or NULL */
static const pd_logit_bias *bias_find(const pd_request *r, int32_t t)
{
    int lo = 0, hi = r->params.n_logit_bias - 1;
    const pd_logit_bias *b = r->params.logit_bias;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (b[mid].tok == t)
            return &b[mid];
        if (b[mid].tok < t)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

/* What row entries add to token t's logit: its bias, and -inf while its stop ids are masked */
static float entry_bias(const pd_engine *e, const pd_request *r, int32_t t, int mask_eos)
{
    const pd_logit_bias *b = bias_find(r, t);
    float v = b != NULL ? b->bias : 0.0f;
    return mask_eos && (is_eos(e, t) || is_stop_id(r, t)) ? -INFINITY : v;
}

/* Queues en (its row and penalties set) for token t, seen with cnt occurrences in the output */
static pd_status pen_push_tok(pd_engine *e, const pd_request *r, kern_penalty_entry *en, int32_t t,
                              int cnt, int mask_eos, pd_err *err)
{
    en->tok = t;
    en->count = cnt;
    en->seen = 1;
    en->bias = entry_bias(e, r, t, mask_eos);
    return pen_push(e, en, err);
}

/* Queues the entries of logits row `row` of r, whose history is r's output followed by
 * extra[0..n_extra) (the drafts before that row of a verify block): the penalties of every
 * token seen, the logit bias, and while the output is shorter than min_tokens the stop (eos)
 * tokens masked. One entry per token. */
pd_status pd_engine_pen_row(pd_engine *e, const pd_request *r, int row, const int32_t *extra, int n_extra,
                            pd_err *err)
{
    int mask_eos = r->params.min_tokens > r->n_out + n_extra;
    if (r->pen == NULL && r->params.n_logit_bias == 0 && !mask_eos)
        return PD_OK;
    kern_penalty_entry en = { .row = row, .rep = pen_rep_on(&r->params) ? r->params.repetition_penalty : 1.0f,
                              .freq = r->params.frequency_penalty, .pres = r->params.presence_penalty };
    for (int i = 0; r->pen != NULL && i < r->n_pen_tok; i++) {
        int32_t t = r->pen_tok[i];
        int cnt = (int)(r->pen[t] & ~PEN_PROMPT);
        for (int j = 0; j < n_extra; j++)
            cnt += extra[j] == t;
        TRY(pen_push_tok(e, r, &en, t, cnt, mask_eos, err));
    }
    /* drafts of this block not in the output yet: each distinct one once */
    for (int j = 0; r->pen != NULL && j < n_extra; j++) {
        int32_t t = extra[j], first = r->pen[t] == 0;
        for (int k = 0; k < j && first; k++)
            first = extra[k] != t;
        if (!first)
            continue;
        int cnt = 0;
        for (int k = j; k < n_extra; k++)
            cnt += extra[k] == t;
        TRY(pen_push_tok(e, r, &en, t, cnt, mask_eos, err));
    }
    /* biased and masked tokens the penalties did not name */
    en.count = en.seen = 0;
    int n_masked = mask_eos ? e->tm->cfg.n_eos + r->params.n_stop_ids : 0;
    for (int i = 0; i < r->params.n_logit_bias + n_masked; i++) {
        int bias_list = i < r->params.n_logit_bias, k = i - r->params.n_logit_bias;
        int32_t t = bias_list ? r->params.logit_bias[i].tok
                  : k < e->tm->cfg.n_eos ? e->tm->cfg.eos_ids[k] : r->params.stop_ids[k - e->tm->cfg.n_eos];
        int named = r->pen != NULL && r->pen[t] != 0;
        for (int j = 0; r->pen != NULL && j < n_extra && !named; j++)
            named = extra[j] == t;
        /* a masked token also in the bias list, or named twice among eos and stop ids */
        for (int q = 0; !bias_list && q < k && !named; q++)
            named = (q < e->tm->cfg.n_eos ? e->tm->cfg.eos_ids[q] : r->params.stop_ids[q - e->tm->cfg.n_eos]) == t;
        if (named || (!bias_list && bias_find(r, t) != NULL))
            continue;
        en.tok = t;
        en.bias = entry_bias(e, r, t, mask_eos);
        TRY(pen_push(e, &en, err));
    }
    return PD_OK;
}

/* Applies the queued entries to logits (backend memory, [*, V]) and empties the queue. */
pd_status pd_engine_pen_apply(pd_engine *e, const float *logits, pd_err *err)
{
    int n = e->n_pen;
    e->n_pen = 0;
    if (n == 0)
        return PD_OK;
    TRY(kern_buf_grow(e->tm->be, &e->pen_dev, &e->cap_pen, n, sizeof(kern_penalty_entry), err));
    TRY(kern_upload(e->tm->be, e->pen_dev->ptr, e->pen_host, (size_t)n * sizeof(kern_penalty_entry), err));
    /* the target's logits buffer: ours to change until its next forward */
    kern_penalty_args pa = { .x = (float *)(uintptr_t)logits, .ld_x = e->V, .n = e->V, .n_entries = n,
                             .e = (const kern_penalty_entry *)e->pen_dev->ptr };
    return kern_penalty(e->tm->be, &pa, err);
}

/* ---- structured output ---- */

pd_status pd_engine_grammar_init(pd_engine *e, pd_request *r, pd_err *err)
{
    const uint32_t *first = r->params.first_allow, *allow = r->params.allow;
    pd_grammar *g = r->params.grammar;
    r->params.first_allow = NULL;
    r->params.allow = NULL;
    r->params.grammar = NULL;   /* the matchers hold their references */
    const size_t bytes = (size_t)((e->V + 31) / 32) * sizeof(uint32_t);
    if (allow != NULL) {
        if ((r->allow = malloc(bytes)) == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "allowed-token mask");
        memcpy(r->allow, allow, bytes);
    }
    const int32_t *bad = r->params.bad;
    r->params.bad = NULL;
    if (bad != NULL && r->params.n_bad > 0) {
        for (int i = 0; i < r->params.n_bad; i += 1 + bad[i])
            if (bad[i] < 1 || i + bad[i] >= r->params.n_bad)
                return pd_err_set(err, PD_ERR_INVALID, "bad words: malformed sequence at %d", i);
        if ((r->bad = malloc((size_t)r->params.n_bad * sizeof(int32_t))) == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "bad words");
        memcpy(r->bad, bad, (size_t)r->params.n_bad * sizeof(int32_t));
    }
    if (g != NULL) {
        TRY(pd_gmatch_create(g, &r->gm, err));
        return pd_gmatch_create(g, &r->gm_row, err);
    }
    if (first != NULL) {
        if ((r->first_allow = malloc(bytes)) == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "first-token mask");
        memcpy(r->first_allow, first, bytes);
    }
    return PD_OK;
}

/* the mask slot of logits row `row`, queued */
pd_status pd_engine_mask_slot(pd_engine *e, int row, uint32_t **bits, pd_err *err)
{
    int words = (e->V + 31) / 32;
    TRY(pd_engine_grow_host((void **)&e->mask_rows, &e->cap_mask_rows, e->n_mask + 1, sizeof(int32_t), err));
    TRY(pd_engine_grow_host((void **)&e->mask_bits, &e->cap_mask_bits, (e->n_mask + 1) * words,
                            sizeof(uint32_t), err));
    e->mask_rows[e->n_mask] = row;
    *bits = e->mask_bits + (size_t)e->n_mask * words;
    e->n_mask++;
    return PD_OK;
}

/* The token at position i from the end (0: the last) of r's output followed by extra[0..n),
 * or -1 before the output's start */
static int32_t tail_tok(const pd_request *r, const int32_t *extra, int n, int i)
{
    if (i < n)
        return extra[n - 1 - i];
    i -= n;
    return i < r->n_out ? r->out[r->n_out - 1 - i] : -1;
}

/* bits &= what r's allowed tokens (allowed_token_ids) and bad words let follow its output and
 * extra[0..n) */
static void and_token_rules(const pd_engine *e, const pd_request *r, const int32_t *extra, int n, uint32_t *bits)
{
    for (int w = 0; r->allow != NULL && w < (e->V + 31) / 32; w++)
        bits[w] &= r->allow[w];
    for (int i = 0; r->bad != NULL && i < r->params.n_bad; i += 1 + r->bad[i]) {
        const int len = r->bad[i];
        const int32_t *seq = r->bad + i + 1;
        int match = 1;
        for (int k = 0; k < len - 1 && match; k++)   /* seq[len - 2 - k] is k from the end */
            match = tail_tok(r, extra, n, k) == seq[len - 2 - k];
        if (match)
            bits[seq[len - 1] / 32] &= ~(1u << (seq[len - 1] % 32));
    }
}

/* Queues the mask of logits row `row` of r (*bits: its words) after its output and extra[0..n):
 * what r->gm_row allows (with a grammar), else first (a first-token mask) or every token, less
 * what r's allowed tokens and bad words rule out */
static pd_status row_mask(pd_engine *e, pd_request *r, int row, const uint32_t *first, const int32_t *extra,
                          int n, uint32_t **bits, pd_err *err)
{
    const size_t bytes = (size_t)((e->V + 31) / 32) * sizeof(uint32_t);
    TRY(pd_engine_mask_slot(e, row, bits, err));
    if (r->gm != NULL)
        TRY(pd_gmatch_allowed(r->gm_row, r->params.gvocab, *bits, err));
    else if (first != NULL)
        memcpy(*bits, first, bytes);
    else
        memset(*bits, 0xff, bytes);
    and_token_rules(e, r, extra, n, *bits);
    return PD_OK;
}

pd_status pd_engine_mask_step(pd_engine *e, pd_request *r, int row, const int32_t *extra, int n, pd_err *err)
{
    uint32_t *bits;
    if (r->gm == NULL && r->allow == NULL && r->bad == NULL)
        return PD_OK;
    return row_mask(e, r, row, NULL, extra, n, &bits, err);
}

/* Queues the masks of r's rows row0 .. row0 + n_extra: row row0 + j follows the output and
 * extra[0..j) (a verify block's drafts). Past a draft the grammar refuses no row is masked:
 * that draft's own row is, so the block is accepted no further than it. With `force` (a greedy
 * request), a draft at a row where the grammar allows one token only becomes that token: the
 * masked argmax there can be nothing else, so the block goes on through the text the grammar
 * dictates (keys, punctuation) whatever the drafter proposed. Allowed tokens and bad words
 * mask the rows too (with a grammar or without). */
pd_status pd_engine_mask_rows(pd_engine *e, pd_request *r, int row0, int32_t *extra, int n_extra, int force,
                              pd_err *err)
{
    uint32_t *bits;
    if (r->gm == NULL) {
        const uint32_t *first = r->n_out == 0 ? r->first_allow : NULL;
        for (int j = 0; j <= n_extra && (r->allow != NULL || r->bad != NULL || (first != NULL && j == 0)); j++)
            TRY(row_mask(e, r, row0 + j, j == 0 ? first : NULL, extra, j, &bits, err));
        return PD_OK;
    }
    TRY(pd_gmatch_copy(r->gm_row, r->gm, err));
    int words = (e->V + 31) / 32;
    for (int j = 0; j <= n_extra; j++) {
        TRY(row_mask(e, r, row0 + j, NULL, extra, j, &bits, err));
        if (j == n_extra)
            break;
        int n_allowed = 0, only = -1;
        for (int w = 0; force && w < words && n_allowed < 2; w++)
            if (bits[w] != 0) {
                n_allowed += __builtin_popcount(bits[w]);
                only = w * 32 + __builtin_ctz(bits[w]);
            }
        if (n_allowed == 1 && only < e->V)
            extra[j] = only;
        int ok = pd_gmatch_advance(r->gm_row, r->params.gvocab, extra[j], err);
        if (ok < 0)
            return err != NULL ? err->code : PD_ERR_INTERNAL;
        if (ok == 0)
            break;
    }
    return PD_OK;
}

/* Applies the queued masks to logits (backend memory, [*, V]) and empties the queue. */
pd_status pd_engine_mask_apply(pd_engine *e, const float *logits, pd_err *err)
{
    int n = e->n_mask, words = (e->V + 31) / 32;
    e->n_mask = 0;
    if (n == 0)
        return PD_OK;
    size_t rows_bytes = ((size_t)n * sizeof(int32_t) + 255) & ~(size_t)255;
    size_t bytes = rows_bytes + (size_t)n * words * sizeof(uint32_t);
    TRY(kern_buf_grow(e->tm->be, &e->mask_dev, &e->cap_mask, (int)bytes, 1, err));
    char *dev = e->mask_dev->ptr;
    TRY(kern_upload(e->tm->be, dev, e->mask_rows, (size_t)n * sizeof(int32_t), err));
    TRY(kern_upload(e->tm->be, dev + rows_bytes, e->mask_bits, (size_t)n * words * sizeof(uint32_t), err));
    kern_token_mask_args ma = { .x = (float *)(uintptr_t)logits, .ld_x = e->V, .n = e->V, .n_rows = n,
                                .rows = (const int32_t *)dev, .bits = (const uint32_t *)(dev + rows_bytes),
                                .words = words };
    return kern_token_mask(e->tm->be, &ma, err);
}

/* Appends tok (with its logprobs lp when the request keeps them; NULL: zeros). */
pd_status pd_engine_push_out(pd_request *r, int32_t tok, const pd_token_logprobs *lp, pd_err *err)
{
    int cap = r->cap_out;
    TRY(pd_engine_grow_host((void **)&r->out, &r->cap_out, r->n_out + 1, sizeof(int32_t), err));
    if (r->params.logprobs && (r->lps == NULL || r->cap_out != cap)) {
        pd_token_logprobs *n = realloc(r->lps, (size_t)r->cap_out * sizeof(*n));
        if (n == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "logprobs of %d tokens", r->cap_out);
        r->lps = n;
    }
    if (r->params.logprobs) {
        if (lp != NULL)
            r->lps[r->n_out] = *lp;
        else
            memset(&r->lps[r->n_out], 0, sizeof(r->lps[0]));
    }
    if (r->pen != NULL) {
        if (r->pen[tok] == 0)
            TRY(pen_track(r, tok, err));
        r->pen[tok]++;
    }
    if (r->gm != NULL) {
        int ok = pd_gmatch_advance(r->gm, r->params.gvocab, tok, err);
        if (ok < 0)
            return err != NULL ? err->code : PD_ERR_INTERNAL;
        if (ok == 0)
            return pd_err_set(err, PD_ERR_INVALID, "structured output: token %d does not fit the grammar "
                              "after %d tokens", tok, r->n_out);
    }
    r->out[r->n_out++] = tok;
    return PD_OK;
}

static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Host and backend staging of bytes for one launch's small inputs (16-byte aligned parts). */
static pd_status stage_get(pd_engine *e, size_t bytes, char **host, char **dev, pd_err *err)
{
    if (bytes > INT_MAX / 2)
        return pd_err_set(err, PD_ERR_INVALID, "sampling inputs of %zu bytes", bytes);
    TRY(pd_engine_grow_host(&e->smp_host, &e->cap_smp_host, (int)bytes, 1, err));
    TRY(kern_buf_grow(e->tm->be, &e->smp_dev, &e->cap_smp_dev, (int)bytes, 1, err));
    *host = e->smp_host;
    *dev = e->smp_dev->ptr;
    return PD_OK;
}

/* A logprobs entry cut to want top entries, the rest zeros (equal answers compare equal). */
void pd_engine_lp_cut(pd_token_logprobs *d, int want)
{
    if (d->n_top > want)
        d->n_top = want;
    for (int j = d->n_top; j < PD_MAX_TOP_LOGPROBS; j++) {
        d->top_id[j] = 0;
        d->top_logprob[j] = 0.0f;
    }
}

/* out[i] = the logprobs of toks[i] from logits row rows[i] of dev ([*, V], backend memory), with
 * the n_top most likely tokens: kern_logprobs on the backend, only the entries come back. */
pd_status pd_engine_logprobs_entries(pd_engine *e, const float *dev, const int32_t *rows, const int32_t *toks,
                                     int n, int n_top, pd_token_logprobs *out, pd_err *err)
{
    if (n <= 0)
        return PD_OK;
    size_t ib = align16((size_t)n * sizeof(int32_t)), ob = (size_t)n * sizeof(kern_logprobs_row);
    char *h = NULL, *d = NULL;
    TRY(stage_get(e, 2 * ib + ob, &h, &d, err));
    memcpy(h, rows, (size_t)n * sizeof(int32_t));
    memcpy(h + ib, toks, (size_t)n * sizeof(int32_t));
    TRY(kern_upload(e->tm->be, d, h, 2 * ib, err));
    kern_logprobs_args la = { .x = dev, .ld_x = e->V, .n = e->V, .n_rows = n, .rows = (const int32_t *)d,
                              .tok = (const int32_t *)(d + ib), .n_top = n_top < e->V ? n_top : e->V,
                              .out = (kern_logprobs_row *)(d + 2 * ib) };
    TRY(kern_logprobs(e->tm->be, &la, err));
    TRY(kern_download(e->tm->be, out, d + 2 * ib, ob, err));
    for (int i = 0; i < n; i++)
        pd_engine_lp_cut(&out[i], n_top);
    return PD_OK;
}

/* out[i] = the logprobs of toks[i] from logits row row0 + i of dev, for a request that keeps
 * them (n <= 33: a round's drafts and its bonus). */
pd_status pd_engine_logprobs_rows(pd_engine *e, const pd_request *r, const float *dev, int row0,
                                  const int32_t *toks, int n, pd_token_logprobs *out, pd_err *err)
{
    int32_t rows[64];
    if (n > 64)
        return pd_err_set(err, PD_ERR_INTERNAL, "logprobs of %d rows at once", n);
    for (int i = 0; i < n; i++)
        rows[i] = row0 + i;
    return pd_engine_logprobs_entries(e, dev, rows, toks, n, r->params.top_logprobs, out, err);
}

/* Row-wise argmax on the backend, ids to host. */
pd_status pd_engine_argmax_rows(pd_engine *e, const float *dev, int n, int32_t *out, pd_err *err)
{
    kern_backend *be = e->tm->be;
    TRY(kern_buf_grow(be, &e->ids_dev, &e->cap_ids, n, sizeof(int32_t), err));
    kern_argmax_args am = { .x = dev, .ld_x = e->V, .rows = n, .n = e->V, .out = e->ids_dev->ptr };
    TRY(kern_argmax(be, &am, err));
    return kern_download(be, out, e->ids_dev->ptr, (size_t)n * sizeof(int32_t), err);
}

/* ---- sampled requests on the backend ------------------------------------------------------ */

static kern_sample_cfg sample_cfg(const pd_sample_params *p)
{
    kern_sample_cfg c = { .temperature = pd_sample_is_greedy(p) ? 0.0f : p->temperature,
                          .top_k = p->top_k, .top_p = p->top_p, .min_p = p->min_p,
                          .typical_p = p->typical_p };
    return c;
}

/* One token for each of n rows of backend logits [n, V], row i owned by owner[i]: its
 * distribution goes to probs + i * ld_probs (backend), a sampled owner's uniform comes from its
 * rng (greedy owners: the argmax, their rng untouched), and only the ids come back into out. */
pd_status pd_engine_sample_rows(pd_engine *e, const float *logits, pd_request *const *owner, int n,
                                float *probs, int ld_probs, int32_t *out, pd_err *err)
{
    kern_backend *be = e->tm->be;
    size_t cfg_b = align16((size_t)n * sizeof(kern_sample_cfg));
    char *h = NULL, *d = NULL;
    TRY(stage_get(e, cfg_b + (size_t)n * sizeof(double), &h, &d, err));
    kern_sample_cfg *cfg = (kern_sample_cfg *)h;
    double *u = (double *)(h + cfg_b);
    for (int i = 0; i < n; i++) {
        const pd_sample_params *sp = &owner[i]->params.sample;
        cfg[i] = sample_cfg(sp);
        u[i] = pd_sample_is_greedy(sp) ? 0.0 : pd_rng_uniform(&owner[i]->rng);
    }
    TRY(kern_upload(be, d, h, cfg_b + (size_t)n * sizeof(double), err));
    TRY(kern_buf_grow(be, &e->ids_dev, &e->cap_ids, n, sizeof(int32_t), err));
    kern_probs_args pa = { .x = logits, .ld_x = e->V, .cfg = (const kern_sample_cfg *)d, .rows = n,
                           .n = e->V, .out = probs, .ld_out = ld_probs };
    TRY(kern_probs(be, &pa, err));
    kern_sample_args sa = { .probs = probs, .ld = ld_probs, .rows = n, .n = e->V,
                            .u = (const double *)(d + cfg_b), .out = e->ids_dev->ptr };
    TRY(kern_sample(be, &sa, err));
    return kern_download(be, out, e->ids_dev->ptr, (size_t)n * sizeof(int32_t), err);
}

/* The logprobs of every committed token of the round's requests that keep them (slot_accept
 * done), in one kern_logprobs over the verify logits vl: *lps (malloc'd) holds them request
 * after request, off[i] = slot i's first (-1: none); each request's top list cut to its own. */
pd_status pd_engine_round_logprobs(pd_engine *e, const pd_round_slot *slots, int m, const float *vl, int *off,
                                   pd_token_logprobs **lps, pd_err *err)
{
    int n = 0, top = 0;
    *lps = NULL;
    for (int i = 0; i < m; i++) {
        const pd_request *r = slots[i].r;
        off[i] = r->params.logprobs ? n : -1;
        if (r->params.logprobs) {
            n += slots[i].stop_at >= 0 ? slots[i].stop_at + 1 : slots[i].n_acc + 1;
            top = r->params.top_logprobs > top ? r->params.top_logprobs : top;
        }
    }
    if (n == 0)
        return PD_OK;
    int32_t *rows = malloc((size_t)n * 3 * sizeof(int32_t));
    *lps = malloc((size_t)n * sizeof(**lps));
    if (rows == NULL || *lps == NULL) {
        free(rows);
        free(*lps);
        *lps = NULL;
        return pd_err_set(err, PD_ERR_NOMEM, "logprobs of a round: %d tokens", n);
    }
    int32_t *toks = rows + n, *want = rows + 2 * n;
    for (int i = 0; i < m; i++) {
        const pd_round_slot *sl = &slots[i];
        int a = sl->n_acc, k = sl->stop_at >= 0 ? sl->stop_at + 1 : a + 1;   /* the bonus's row: base + a */
        for (int j = 0; off[i] >= 0 && j < k; j++) {
            rows[off[i] + j] = sl->base + j;
            toks[off[i] + j] = j < a ? sl->d[j] : sl->bonus;
            want[off[i] + j] = sl->r->params.top_logprobs;
        }
    }
    pd_status st = pd_engine_logprobs_entries(e, vl, rows, toks, n, top, *lps, err);
    for (int t = 0; t < n && st == PD_OK; t++)
        pd_engine_lp_cut(&(*lps)[t], want[t]);
    free(rows);
    if (st != PD_OK) {
        free(*lps);
        *lps = NULL;
    }
    return st;
}

/* Verifies every sampled request of the round on the backend: its target rows of the verify
 * logits vl become distributions (kern_probs), and kern_spec_verify checks its drafts against
 * them and the round's draft distributions (e->smp_q); one upload, one download of two ints per
 * request into slots[i].acc / .next. Each request's uniforms (l accept tests, then the final
 * draw) come from its rng in that order. */
pd_status pd_engine_verify_sampled(pd_engine *e, const float *vl, pd_round_slot *slots, int m, pd_err *err)
{
    kern_backend *be = e->tm->be;
    enum { LD = 32 };   /* pd_round_slot.d */
    int ns = 0, nrow = 0;
    for (int i = 0; i < m; i++)
        if (!pd_sample_is_greedy(&slots[i].r->params.sample)) {
            ns++;
            nrow += slots[i].l + 1;
        }
    if (ns == 0)
        return PD_OK;
    /* staging: idx, cfg (per target row), p_row, q_row, len, draft (per request), u, out */
    size_t o_cfg = align16((size_t)nrow * sizeof(int32_t));
    size_t o_req = o_cfg + align16((size_t)nrow * sizeof(kern_sample_cfg));
    size_t o_draft = o_req + align16((size_t)3 * ns * sizeof(int32_t));
    size_t o_u = o_draft + align16((size_t)ns * LD * sizeof(int32_t));
    size_t o_out = o_u + align16((size_t)ns * (LD + 1) * sizeof(double));
    size_t bytes = o_out + (size_t)2 * ns * sizeof(int32_t);
    char *h = NULL, *d = NULL;
    TRY(stage_get(e, bytes, &h, &d, err));
    int32_t *idx = (int32_t *)h, *req = (int32_t *)(h + o_req), *draft = (int32_t *)(h + o_draft);
    kern_sample_cfg *cfg = (kern_sample_cfg *)(h + o_cfg);
    double *u = (double *)(h + o_u);
    int c = 0, row = 0;
    for (int i = 0; i < m; i++) {
        pd_round_slot *sl = &slots[i];
        pd_request *r = sl->r;
        if (pd_sample_is_greedy(&r->params.sample))
            continue;
        req[c] = row;
        req[ns + c] = sl->l > 0 ? sl->qrow : 0;
        req[2 * ns + c] = sl->l;
        for (int j = 0; j <= sl->l; j++, row++) {
            idx[row] = sl->base + j;
            cfg[row] = sample_cfg(&r->params.sample);
        }
        memcpy(draft + (size_t)c * LD, sl->d, (size_t)sl->l * sizeof(int32_t));
        for (int j = 0; j <= sl->l; j++)
            u[(size_t)c * (LD + 1) + j] = pd_rng_uniform(&r->rng);
        c++;
    }
    TRY(kern_upload(be, d, h, o_out, err));
    TRY(kern_buf_grow(be, &e->smp_p, &e->cap_smp_p, nrow, (size_t)e->V * sizeof(float), err));
    kern_probs_args pa = { .x = vl, .ld_x = e->V, .idx = (const int32_t *)d,
                           .cfg = (const kern_sample_cfg *)(d + o_cfg), .rows = nrow, .n = e->V,
                           .out = e->smp_p->ptr, .ld_out = e->V };
    TRY(kern_probs(be, &pa, err));
    const int32_t *dreq = (const int32_t *)(d + o_req);
    kern_spec_verify_args va = { .p = e->smp_p->ptr, .ld_p = e->V,
                                 .q = e->smp_q != NULL ? e->smp_q->ptr : NULL, .ld_q = e->V,
                                 .n = e->V, .n_req = ns, .p_row = dreq, .q_row = dreq + ns,
                                 .len = dreq + 2 * ns, .draft = (const int32_t *)(d + o_draft),
                                 .ld_draft = LD, .u = (const double *)(d + o_u), .ld_u = LD + 1,
                                 .out = (int32_t *)(d + o_out) };
    TRY(kern_spec_verify(be, &va, err));
    int32_t *out = (int32_t *)(h + o_out);
    TRY(kern_download(be, out, d + o_out, (size_t)2 * ns * sizeof(int32_t), err));
    c = 0;
    for (int i = 0; i < m; i++)
        if (!pd_sample_is_greedy(&slots[i].r->params.sample)) {
            slots[i].acc = out[2 * c];
            slots[i].next = out[2 * c + 1];
            c++;
        }
    return PD_OK;
}
