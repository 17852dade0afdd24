/* pd_engine_ctx.c - the draft context rows the engine committed but has not added to the
 *   draft KV yet. A scheduled request that does not draft in a round leaves its context rows for
 *   later: among fewer than gap_min_batch requests in a deferred buffer (the aux rows copied),
 *   among more as a gap of positions with no copy at all, recomputed by a target forward that
 *   reads the KV cache and stores nothing when the request drafts again. Before a drafting round
 *   the rows of the requests that draft are added; those of requests that end are dropped; a
 *   full buffer is compacted or flushed.
 * Owns: the deferred buffer (e->pend_*), the requests' gaps and counts of waiting rows, the
 *   measured seconds per added row (the scheduler's switch cost), the draft KV extension.
 * Not here: when a round drafts (pd_engine.c) and each request's policy (pd_engine_sched.c),
 *   the forwards themselves (pd_engine.c, pd_dspark.c).
 * Threading: the engine's thread only. */
#include "pd_engine_ctx.h"

#include "pd_engine_sched.h"
#include "pd_graph.h"

#include <stdint.h>
#include <stdlib.h>

/* dst[i] = aux[rows[i]] for n aux rows on the backend; a run of consecutive rows (every row of
 * a round without drafts) is one copy with no index upload. */
static int rows_consecutive(const int32_t *rows, int n)
{
    for (int i = 1; i < n; i++)
        if (rows[i] != rows[0] + i)
            return 0;
    return 1;
}

static pd_status gather_aux(pd_engine *e, const float *aux, const int32_t *rows, int n, float *dst,
                            pd_err *err)
{
    kern_backend *be = e->tm->be;
    int run = rows_consecutive(rows, n);
    kern_copy_rows_args cp = { .src = aux, .ld_src = e->aux_dim, .idx = NULL, .dst = dst,
                               .ld_dst = e->aux_dim, .rows = n, .cols = e->aux_dim };
    if (run) {
        cp.src = aux + (size_t)rows[0] * e->aux_dim;
    } else {
        TRY(kern_buf_grow(be, &e->idx_dev, &e->cap_idx, n, sizeof(int32_t), err));
        TRY(kern_upload(be, e->idx_dev->ptr, rows, (size_t)n * sizeof(int32_t), err));
        cp.idx = e->idx_dev->ptr;
    }
    return kern_copy_rows(be, &cp, err);
}

/* Adds aux rows rows[0..n-1] of aux (backend, [*, aux_dim] packed) to the draft context of the
 * given requests at the given positions. */
static pd_status extend_draft(pd_engine *e, const float *aux, const int32_t *rows,
                              const int32_t *pos, pd_request *const *owner, int n, pd_err *err)
{
    if (e->draft == NULL || n == 0)
        return PD_OK;
    const float *src = aux + (size_t)rows[0] * e->aux_dim;
    if (!rows_consecutive(rows, n) || e->tp != NULL) {
        /* tensor-parallel ranks read the rows from the engine's own scratch */
        TRY(kern_buf_grow(e->tm->be, &e->aux_dev, &e->cap_aux, n, (size_t)e->aux_dim * sizeof(float), err));
        TRY(gather_aux(e, aux, rows, n, e->aux_dev->ptr, err));
        src = e->aux_dev->ptr;
    }
    /* sequences: one slot per distinct owner, in order of first appearance (the deferred
     * buffer interleaves requests round by round; context rows attend nowhere, so their order
     * within the batch is free and the page table holds each request once) */
    int32_t *seq = malloc((size_t)n * sizeof(int32_t));
    pd_kv_seq **seqs = malloc((size_t)n * sizeof(pd_kv_seq *));
    if (seq == NULL || seqs == NULL) {
        free(seq);
        free(seqs);
        return pd_err_set(err, PD_ERR_NOMEM, "draft extend metadata");
    }
    int n_seq = 0;
    uint64_t epoch = ++e->ext_epoch;
    for (int i = 0; i < n; i++) {
        pd_request *r = owner[i];
        if (r->ext_epoch != epoch) {
            r->ext_epoch = epoch;
            r->ext_seq = n_seq;
            seqs[n_seq++] = &r->dkv;
        }
        seq[i] = r->ext_seq;
    }
    pd_tok_batch b = { .n_tok = n, .pos = pos, .seq = seq, .n_seq = n_seq, .seqs = seqs };
    pd_status st = pd_engine_draft_extend(e, src, &b, err);
    free(seq);
    free(seqs);
    return st;
}

/* The deferred-context buffer grows up to this many rows or PD_PEND_MAX_BYTES, whichever is
 * less; a full buffer is compacted (rows of ended requests removed) when at most three quarters
 * of it are still wanted, else flushed. */
#define PD_PEND_MAX_ROWS 65536
#define PD_PEND_MAX_BYTES ((size_t)256 << 20)
/* Rounds of at least this many requests leave their waiting rows as gaps (decode_round,
 * prefill_forward). */
#define PD_GAP_MIN_BATCH 8

int pd_engine_gap_min_batch(const pd_engine *e)
{
    return e->cfg.gap_min_batch > 0 ? e->cfg.gap_min_batch : PD_GAP_MIN_BATCH;
}

/* The token at position p of r (prompt, then output). */
int32_t pd_engine_token_at(const pd_request *r, int p)
{
    return p < r->n_prompt ? r->prompt[p] : r->out[p - r->n_prompt];
}

/* One chunk of gap rows: the target forward of n committed tokens reads their keys from the
 * cache and writes nothing (they are there already; re-storing them with other kernels could
 * change them), then their aux rows extend the draft KV. */
static pd_status gap_chunk(pd_engine *e, const int32_t *ids, const int32_t *pos, const int32_t *seq,
                           const int32_t *rows, pd_request *const *own, int n, pd_kv_seq *const *seqs,
                           int n_seq, pd_err *err)
{
    pd_tok_batch b = { .n_tok = n, .ids = ids, .pos = pos, .seq = seq, .n_seq = n_seq, .seqs = seqs,
                       .no_store = 1 };
    TRY(pd_engine_target_forward(e, &b, NULL, 0, err));
    return extend_draft(e, pd_target_aux(e->target), rows, pos, own, n, err);
}

static int flush_takes(pd_flush_mode mode, const pd_request *one, const pd_request *r)
{
    return mode == PD_FLUSH_DRAFTING ? r->drafting : mode == PD_FLUSH_REQUEST ? r == one : 1;
}

/* Recomputes the gaps (decode rows of rounds without drafts, which kept no aux row) of the
 * requests mode takes and adds the rows to the draft KV, in chunks of at most
 * PD_DRAFT_EXTEND_GRAPH_MAX tokens; the gaps are closed. */
static pd_status gap_flush(pd_engine *e, pd_flush_mode mode, const pd_request *one, pd_err *err)
{
    int total = 0;
    for (int i = 0; i < e->n_reqs; i++)
        if (flush_takes(mode, one, e->reqs[i]))
            total += e->reqs[i]->n_gap;
    if (total == 0)
        return PD_OK;
    /* chunks the target's forward takes without growing its scratch (a grown buffer moves and
     * every target graph is captured again; with the recompute's own graphs that cost -5 % at
     * C = 8 on the tiny pair, 14:02 UTC) */
    int cap = PD_DRAFT_EXTEND_GRAPH_MAX, tcap = e->tp == NULL ? pd_target_capacity(e->target) : 0;
    if (e->cfg.pend_max_rows > 0 && e->cfg.pend_max_rows < cap)
        cap = e->cfg.pend_max_rows;
    if (tcap > 0 && tcap < cap)
        cap = tcap;
    while (tcap > 0 && cap > 1 && pd_graph_bucket(cap) > tcap)   /* padded to a graph bucket */
        cap--;
    if (total < cap)
        cap = total;
    int32_t *ids = malloc((size_t)cap * 4 * sizeof(int32_t));
    pd_request **own = malloc((size_t)cap * sizeof(*own));
    pd_kv_seq **seqs = malloc((size_t)cap * sizeof(*seqs));
    if (ids == NULL || own == NULL || seqs == NULL) {
        free(ids);
        free(own);
        free(seqs);
        return pd_err_set(err, PD_ERR_NOMEM, "recomputed draft context: %d rows", total);
    }
    int32_t *pos = ids + cap, *seq = pos + cap, *rows = seq + cap;
    pd_status st = PD_OK;
    int c = 0, ns = 0;
    for (int i = 0; i < e->n_reqs && st == PD_OK; i++) {
        pd_request *r = e->reqs[i];
        if (!flush_takes(mode, one, r))
            continue;
        for (int j = 0; j < r->n_gap && st == PD_OK; j++) {
            if (j == 0 || c == 0)
                seqs[ns++] = &r->tkv;
            pos[c] = r->gap_lo + j;
            ids[c] = pd_engine_token_at(r, pos[c]);
            seq[c] = ns - 1;
            rows[c] = c;
            own[c++] = r;
            if (c == cap) {
                st = gap_chunk(e, ids, pos, seq, rows, own, c, seqs, ns, err);
                c = ns = 0;
            }
        }
        e->pend_live -= r->n_gap;
        e->gap_live -= r->n_gap;
        r->n_pend -= r->n_gap;
        r->n_gap = 0;
    }
    if (st == PD_OK && c > 0)
        st = gap_chunk(e, ids, pos, seq, rows, own, c, seqs, ns, err);
    free(ids);
    free(own);
    free(seqs);
    return st;
}

/* The deferred buffer's rows of the requests mode takes to the draft KV; their entries are
 * left as those of ended requests (owner NULL), and the buffer empties when none is wanted. */
static pd_status buf_flush(pd_engine *e, pd_flush_mode mode, const pd_request *one, pd_err *err)
{
    int n = e->n_pend;
    if (n == 0)
        return PD_OK;
    int32_t *idx = malloc((size_t)n * sizeof(int32_t)), *pos = malloc((size_t)n * sizeof(int32_t));
    pd_request **own = malloc((size_t)n * sizeof(*own));
    if (idx == NULL || pos == NULL || own == NULL) {
        free(idx);
        free(pos);
        free(own);
        return pd_err_set(err, PD_ERR_NOMEM, "deferred draft context metadata");
    }
    int k = 0, kept = 0;
    for (int i = 0; i < n; i++) {
        pd_request *r = e->pend_owner[i];
        if (r == NULL)
            continue;
        if (!flush_takes(mode, one, r)) {
            kept++;
            continue;
        }
        idx[k] = i;
        pos[k] = e->pend_pos[i];
        own[k++] = r;
    }
    /* in chunks the graph-replayed extension takes: its buffers stay at that size, where one
     * batch of every row (thousands) grew device scratch, which also made every graph stale */
    pd_status st = PD_OK;
    for (int c0 = 0; c0 < k && st == PD_OK; c0 += PD_DRAFT_EXTEND_GRAPH_MAX) {
        int c = k - c0 < PD_DRAFT_EXTEND_GRAPH_MAX ? k - c0 : PD_DRAFT_EXTEND_GRAPH_MAX;
        st = extend_draft(e, e->pend_aux->ptr, idx + c0, pos + c0, own + c0, c, err);
    }
    for (int j = 0; j < k; j++) {
        e->pend_owner[idx[j]] = NULL;
        own[j]->n_pend--;
    }
    e->pend_live -= k;
    if (kept == 0)
        e->n_pend = 0;
    free(idx);
    free(pos);
    free(own);
    return st;
}

static void smooth(double *avg, double x) { *avg = *avg > 0.0 ? 0.7 * *avg + 0.3 * x : x; }

/* Adds the context rows the draft KV still lacks, those mode takes (gaps and buffer rows),
 * with the fast (cuBLAS) kernels, and keeps the seconds per row of each kind. The
 * batch-invariant kernels are for the target's logits, which decide the output; the drafter's
 * context only changes which drafts are proposed, and a flush of thousands of rows through the
 * skinny invariant kernel cost milliseconds on the tiny pair (docs/BENCHMARKS.md). */
pd_status pd_engine_pend_flush(pd_engine *e, pd_flush_mode mode, const pd_request *one, pd_err *err)
{
    if (e->n_pend == 0 && e->pend_live == 0)
        return PD_OK;
    e->times.pend_flushes++;
    kern_backend *be = e->tm->be;
    int inv = be->batch_invariant;
    be->batch_invariant = 0;
    int gaps0 = e->gap_live;
    double t0 = pd_engine_now_s();
    pd_status st = mode == PD_FLUSH_BUFFER ? PD_OK : gap_flush(e, mode, one, err);
    /* a recompute is a forward: wait for it, so its time (the controller's switch cost) is
     * not taken for the draft round that follows */
    if (st == PD_OK && e->gap_live != gaps0)
        st = kern_sync(be, err);
    double t1 = pd_engine_now_s();
    if (st == PD_OK && e->gap_live != gaps0)
        smooth(&e->gap_row_s, (t1 - t0) / (gaps0 - e->gap_live));
    int buf0 = e->pend_live;
    if (st == PD_OK)
        st = buf_flush(e, mode, one, err);
    /* host seconds per buffer row (captures included: the last chunk's size varies, so a flush
     * often captures one) */
    if (st == PD_OK && e->pend_live != buf0)
        smooth(&e->flush_row_s, (pd_engine_now_s() - t1) / (buf0 - e->pend_live));
    be->batch_invariant = inv;
    return st;
}

/* What adding every waiting row would cost now (a drafting round for the whole batch flushes
 * them first): buffer rows at their measured rate, gap rows at theirs or, before any was
 * recomputed, at the profile's forward of up to a chunk of tokens. */
double pd_engine_switch_cost(const pd_engine *e)
{
    double gap_row = e->gap_row_s;
    if (gap_row <= 0.0 && e->gap_live > 0 && e->sched.sps != NULL) {
        int n = e->gap_live < PD_DRAFT_EXTEND_GRAPH_MAX ? e->gap_live : PD_DRAFT_EXTEND_GRAPH_MAX;
        gap_row = 1.0 / pd_sps_at(e->sched.sps, n) / n;
    }
    return (e->pend_live - e->gap_live) * e->flush_row_s + e->gap_live * gap_row;
}

/* Forgets r's deferred rows: r ended and its draft KV goes back unread. */
void pd_engine_pend_drop(pd_engine *e, pd_request *r)
{
    e->pend_live -= r->n_pend;
    e->gap_live -= r->n_gap;
    r->n_pend -= r->n_gap;
    r->n_gap = 0;
    for (int i = 0; i < e->n_pend && r->n_pend > 0; i++)
        if (e->pend_owner[i] == r) {
            e->pend_owner[i] = NULL;
            r->n_pend--;
        }
    r->n_pend = 0;
}

/* Removes the rows of ended requests from the deferred buffer when at most three quarters of it
 * are still wanted (two copies of the rows kept, through e->aux_dev, which grows to hold them);
 * otherwise (or without memory for the index) leaves it as it is. */
static pd_status pend_compact(pd_engine *e, pd_err *err)
{
    int live = 0;
    for (int i = 0; i < e->n_pend; i++)
        live += e->pend_owner[i] != NULL;
    if (live > e->cap_pend / 4 * 3)
        return PD_OK;
    pd_status st = PD_OK;
    if (live > 0) {
        int32_t *idx = malloc((size_t)live * sizeof(int32_t));
        if (idx == NULL)
            return PD_OK;
        for (int i = 0, k = 0; i < e->n_pend; i++)
            if (e->pend_owner[i] != NULL)
                idx[k++] = i;
        kern_backend *be = e->tm->be;
        float *pend = e->pend_aux->ptr;
        st = kern_buf_grow(be, &e->aux_dev, &e->cap_aux, live, (size_t)e->aux_dim * sizeof(float), err);
        if (st == PD_OK)
            st = gather_aux(e, pend, idx, live, e->aux_dev->ptr, err);
        if (st == PD_OK) {
            kern_copy_rows_args cp = { .src = e->aux_dev->ptr, .ld_src = e->aux_dim, .dst = pend,
                                       .ld_dst = e->aux_dim, .rows = live, .cols = e->aux_dim };
            st = kern_copy_rows(be, &cp, err);
        }
        for (int k = 0; k < live && st == PD_OK; k++) {
            e->pend_pos[k] = e->pend_pos[idx[k]];
            e->pend_owner[k] = e->pend_owner[idx[k]];
        }
        free(idx);
        if (st != PD_OK)
            return st;
    }
    e->n_pend = live;
    e->times.pend_compactions++;
    return PD_OK;
}

/* Defers n committed context rows (rows of the target's aux tensor aux, at positions pos of
 * owner[i]) instead of adding them to the draft KV now. */
static pd_status pend_add(pd_engine *e, const float *aux, const int32_t *rows, const int32_t *pos,
                          pd_request *const *owner, int n, pd_err *err)
{
    if (n == 0)
        return PD_OK;
    size_t row_bytes = (size_t)e->aux_dim * sizeof(float);
    int max_rows = e->cfg.pend_max_rows > 0 ? e->cfg.pend_max_rows : PD_PEND_MAX_ROWS;   /* a power of
                                                           * two: kern_buf_grow sizes in those */
    while (max_rows > 64 && (size_t)max_rows * row_bytes > PD_PEND_MAX_BYTES)
        max_rows /= 2;
    if (e->n_pend + n > e->cap_pend && e->n_pend > 0)
        TRY(pend_compact(e, err));
    if (e->n_pend + n > e->cap_pend) {   /* still full (or not allocated yet) */
        TRY(pd_engine_pend_flush(e, PD_FLUSH_BUFFER, NULL, err));
        if (n > max_rows)
            return extend_draft(e, aux, rows, pos, owner, n, err);
        /* sized once, at its largest: growing would drop the contents */
        TRY(kern_buf_grow(e->tm->be, &e->pend_aux, &e->cap_pend, max_rows, row_bytes, err));
    }
    if (e->n_pend + n > e->cap_pend_host) {
        int cap = e->cap_pend_host;
        TRY(pd_engine_grow_host((void **)&e->pend_pos, &cap, e->n_pend + n, sizeof(int32_t), err));
        int cap2 = e->cap_pend_host;
        TRY(pd_engine_grow_host((void **)&e->pend_owner, &cap2, e->n_pend + n, sizeof(pd_request *), err));
        e->cap_pend_host = cap < cap2 ? cap : cap2;
    }
    TRY(gather_aux(e, aux, rows, n, (float *)e->pend_aux->ptr + (size_t)e->n_pend * e->aux_dim, err));
    for (int i = 0; i < n; i++) {
        e->pend_pos[e->n_pend + i] = pos[i];
        e->pend_owner[e->n_pend + i] = owner[i];
        owner[i]->n_pend++;
    }
    e->n_pend += n;
    e->pend_live += n;
    return PD_OK;
}

/* Which committed context rows wait instead of extending the draft KV now: a scheduled
 * request's rows of a round in which it does not draft, and its prompt rows (when the
 * scheduler then decodes without drafts the request may end before its next drafting round and
 * they are never computed) unless the prompt's context is handed on (prefill nodes: aux or ctx
 * rows kept, KV held). */
static int row_defers(const pd_engine *e, const pd_request *r, int prompt)
{
    return pd_engine_request_policy(e, r) == PD_VERIFY_SCHEDULED &&
           (prompt ? r->aux == NULL && r->ctx == NULL && !r->params.hold_kv : !r->drafting);
}

/* Puts r's context row at position p into its gap (pd_request.gap_lo) when it extends it. */
static int gap_add(pd_engine *e, pd_request *r, int p)
{
    if (r->n_gap > 0 && p != r->gap_lo + r->n_gap)
        return 0;
    if (r->n_gap == 0)
        r->gap_lo = p;
    r->n_gap++;
    r->n_pend++;
    e->pend_live++;
    e->gap_live++;
    return 1;
}

/* Adds context rows to the draft KV, except those row_defers picks, which wait: as their
 * request's gap when gaps is set (no copy at all: a flush recomputes them), else, or when a row
 * does not extend the gap, in the deferred buffer (with the aux they were computed with). */
pd_status pd_engine_extend_or_defer(pd_engine *e, const float *aux, const int32_t *rows, const int32_t *pos,
                                    pd_request *const *owner, int n, int prompt, int gaps, pd_err *err)
{
    if (e->draft == NULL || n == 0)
        return PD_OK;
    int any = 0;
    for (int i = 0; i < n && !any; i++)
        any = row_defers(e, owner[i], prompt);
    if (!any)
        return extend_draft(e, aux, rows, pos, owner, n, err);
    /* rows, positions and owners of the buffered rows [0, d) and of those added now [n, n + k) */
    int32_t *row2 = malloc((size_t)n * 4 * sizeof(int32_t));
    pd_request **own2 = malloc((size_t)n * 2 * sizeof(*own2));
    if (row2 == NULL || own2 == NULL) {
        free(row2);
        free(own2);
        return extend_draft(e, aux, rows, pos, owner, n, err);
    }
    int32_t *pos2 = row2 + 2 * (size_t)n;
    int d = 0, k = 0;
    for (int i = 0; i < n; i++) {
        pd_request *r = owner[i];
        int at;
        if (!row_defers(e, r, prompt))
            at = n + k++;
        else if (gaps && gap_add(e, r, pos[i]))
            continue;
        else
            at = d++;
        row2[at] = rows[i];
        pos2[at] = pos[i];
        own2[at] = r;
    }
    pd_status st = pend_add(e, aux, row2, pos2, own2, d, err);
    if (st == PD_OK && k > 0)
        st = extend_draft(e, aux, row2 + n, pos2 + n, own2 + n, k, err);
    free(row2);
    free(own2);
    return st;
}
