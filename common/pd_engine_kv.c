/* pd_engine_kv.c - the engine's KV pages beyond admission: free pages counted with the prefix
 *   cache's evictable ones, the cache's part (a prompt takes the cached pages it starts with; a
 *   request offers its pages once their target and draft K/V are final) and preemption
 *   (cfg.swap_bytes: the running request admitted last moves its KV to host memory when the pool
 *   runs out, or gives it up to be prefilled again when the swap space is full; preempted
 *   requests resume in admission order).
 * Owns: e->prefix_free / prefix_hits, the swap space's use and the preemption counts, a
 *   preempted request's host copy (pd_request.swap) and recompute state.
 * Not here: the pools and page tables (pd_kv.c), the cache's index and eviction (pd_prefix.c),
 *   admission and a round's page reservation (pd_engine.c), the recompute's prefill
 *   (pd_engine_prefill.c).
 * Threading: the engine's thread only. */
#include "pd_engine_kv.h"

#include "pd_engine_ctx.h"
#include "pd_engine_prefill.h"
#include "pd_log.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* pages in the cache that only it holds are as good as free: a reservation takes them back
 * (counted after each step, admission and release, not at every read: a scan of the cache) */
int pd_engine_kv_free_pages(const pd_engine *e)
{
    return pd_kv_pool_free_pages(e->tpool) + e->prefix_free;
}

void pd_engine_prefix_count(pd_engine *e)
{
    e->prefix_free = e->prefix != NULL ? pd_prefix_evictable(e->prefix) : 0;
}
/* pages that hold len positions */
int pd_engine_pages_of(const pd_kv_pool *pool, int len)
{
    int ps = pd_kv_pool_layout(pool)->page_size;
    return (len + ps - 1) / ps;
}

/* ---- prefix cache ------------------------------------------------------------------------- */

/* The cached full pages prompt[0..n) starts with, at most all but the last prompt token's (the
 * first token needs one row of the prompt prefilled): their count; *pages (malloc'd, target
 * pages then at [max] the draft pages; NULL when there is nothing to look for) -1 on NOMEM. */
static int prefix_find(pd_engine *e, const int32_t *prompt, int n, int32_t **pages, int *max)
{
    int ps = pd_kv_pool_layout(e->tpool)->page_size;
    *max = (n - 1) / ps;
    *pages = NULL;
    if (*max <= 0)
        return 0;
    if ((*pages = malloc((size_t)*max * 2 * sizeof(int32_t))) == NULL)
        return -1;
    return pd_prefix_lookup(e->prefix, prompt, n, *max, *pages, e->dpool != NULL ? *pages + *max : NULL);
}

/* A new request takes the cached full pages its prompt starts with. */
pd_status pd_engine_prefix_take(pd_engine *e, pd_request *r, pd_err *err)
{
    int ps = pd_kv_pool_layout(e->tpool)->page_size, max_pages;
    int32_t *tp;
    int k = prefix_find(e, r->prompt, r->n_prompt, &tp, &max_pages);
    if (k < 0)
        return pd_err_set(err, PD_ERR_NOMEM, "prefix lookup");
    pd_status st = PD_OK;
    if (k > 0) {
        st = pd_kv_seq_share(e->tpool, &r->tkv, tp, k, err);
        if (st == PD_OK && e->dpool != NULL)
            st = pd_kv_seq_share(e->dpool, &r->dkv, tp + max_pages, k, err);
        if (st == PD_OK) {
            r->prefilled = r->cached = k * ps;
            e->prefix_hits += (uint64_t)r->cached;
        }
    }
    free(tp);
    return st;
}

/* Offers r's full pages to the cache once their target and draft K/V are final: the prompt
 * prefilled here or brought by a prefill node, and only pages below the committed length (a finished request's output too,
 * so a conversation's next turn, which repeats it, finds it) and below r's first draft context
 * row still deferred. */
void pd_engine_prefix_offer(pd_engine *e, pd_request *r)
{
    if (e->prefix == NULL || r->prefilled < r->n_prompt)
        return;
    int ps = pd_kv_pool_layout(e->tpool)->page_size;
    int len = r->tkv.len;
    if (r->n_pend > 0) {
        if (r->n_gap > 0 && r->gap_lo < len)
            len = r->gap_lo;
        for (int i = 0; i < e->n_pend; i++)
            if (e->pend_owner[i] == r && e->pend_pos[i] < len)
                len = e->pend_pos[i];
    }
    if (e->dpool != NULL && r->dkv.len < len)
        len = r->dkv.len;
    if (len > r->n_prompt + r->n_out)
        len = r->n_prompt + r->n_out;
    int n = len / ps;
    if (n > r->tkv.n_pages)
        n = r->tkv.n_pages;
    if (e->dpool != NULL && n > r->dkv.n_pages)
        n = r->dkv.n_pages;
    if (n <= r->offered)   /* nothing new since the last offer (a held request, every step) */
        return;
    r->offered = n;
    const int32_t *toks = r->prompt;
    int32_t *all = NULL;
    if (n * ps > r->n_prompt) {   /* prompt + output */
        if ((all = malloc((size_t)n * ps * sizeof(int32_t))) == NULL)
            return;   /* nothing is lost: the pages are simply not cached */
        memcpy(all, r->prompt, (size_t)r->n_prompt * sizeof(int32_t));
        memcpy(all + r->n_prompt, r->out, (size_t)(n * ps - r->n_prompt) * sizeof(int32_t));
        toks = all;
    }
    pd_prefix_insert(e->prefix, toks, n, r->tkv.pages, e->dpool != NULL ? r->dkv.pages : NULL);
    free(all);
}

int pd_engine_prefix_cached(pd_engine *e, const int32_t *prompt, int n)
{
    if (e->prefix == NULL)
        return 0;
    int32_t *pages;
    int max, k = prefix_find(e, prompt, n, &pages, &max);
    free(pages);
    return k > 0 ? k * pd_kv_pool_layout(e->tpool)->page_size : 0;
}

void pd_engine_prefix_stats(const pd_engine *e, int *evictable, int *entries, uint64_t *hit_tokens)
{
    *evictable = e->prefix != NULL ? pd_prefix_evictable(e->prefix) : 0;
    *entries = e->prefix != NULL ? pd_prefix_entries(e->prefix) : 0;
    *hit_tokens = e->prefix_hits;
}

/* ---- preemption (cfg.swap_bytes): a running request's KV to host memory and back ---------- */

/* r runs decode rounds (prefilled, a first token, not preempted) */
int pd_engine_request_decoding(const pd_request *r)
{
    return r->finish == PD_FINISH_NONE && r->swap == NULL && !r->recompute && r->prefilled == r->n_prompt &&
           r->n_out > 0;
}

/* Counts a preemption; warns at the first and every 1000th (as vLLM warns, not per event). */
static void preempt_note(pd_engine *e, const char *how)
{
    e->n_preempt++;
    if (e->n_preempt == 1 || e->n_preempt % 1000 == 0)
        PD_LOG_WARN("engine", "the KV pool ran out: %llu preemptions so far (%s); more pages make them rarer",
                    (unsigned long long)e->n_preempt, how);
}

/* r is preempted no more (resumed, ended or freed): its host copy goes, its counts drop. */
void pd_engine_preempt_clear(pd_engine *e, pd_request *r)
{
    if (r->recompute) {
        e->n_recompute--;
        r->recompute = 0;
    }
    if (r->swap != NULL) {
        e->swap_used -= r->swap_bytes;
        e->n_swapped--;
        pd_host_arena_give(e->swap_arena, r->swap);
        r->swap = NULL;
        r->swap_bytes = 0;
    }
}

/* r (without pages) gets pages for want positions in both pools if that leaves spare free
 * pages (the cache's evictable entries hold a target and a draft page each: free for the
 * asking); 1 when it did, 0 (nothing held) when it must wait. */
static int take_pages(pd_engine *e, pd_request *r, int want, int spare)
{
    if (pd_engine_kv_free_pages(e) - pd_engine_pages_of(e->tpool, want) < spare ||
        (e->dpool != NULL &&
         pd_kv_pool_free_pages(e->dpool) + e->prefix_free - pd_engine_pages_of(e->dpool, want) < spare))
        return 0;
    pd_err rerr;
    if (pd_kv_seq_reserve(e->tpool, &r->tkv, want, &rerr) == PD_OK &&
        (e->dpool == NULL || pd_kv_seq_reserve(e->dpool, &r->dkv, want, &rerr) == PD_OK))
        return 1;
    pd_kv_seq_release(e->tpool, &r->tkv);
    if (e->dpool != NULL)
        pd_kv_seq_release(e->dpool, &r->dkv);
    return 0;
}

/* The host layout of a preempted request's nt target and nd draft pages: this engine's pools
 * (rank 0's), then each tensor-parallel worker's; part[k] = where rank k's part starts (NULL: not
 * wanted). Returns the total bytes. */
static size_t swap_layout(const pd_engine *e, int nt, int nd, size_t *part)
{
    size_t off = pd_kv_pair_bytes(e->tpool, nt, e->dpool, nd);
    if (part != NULL)
        part[0] = 0;
    for (int k = 1; e->tp != NULL && k < pd_tp_group_size(e->tp); k++) {
        if (part != NULL)
            part[k] = off;
        off += pd_tp_group_kv_bytes(e->tp, k, nt, nd);
    }
    return off;
}

/* Copies r's first nt target and nd draft pages of every rank between the pools and host
 * (swap_layout), to_host 1 downloading. */
static pd_status swap_copy(pd_engine *e, pd_request *r, int nt, int nd, char *host, int to_host, pd_err *err)
{
    size_t part[PD_TP_MAX_SIZE];
    swap_layout(e, nt, nd, part);
    TRY(pd_kv_pair_copy(e->tpool, &r->tkv, nt, e->dpool, &r->dkv, nd, host, to_host, err));
    if (e->tp == NULL)
        return PD_OK;
    char *at[PD_TP_MAX_SIZE] = { 0 };
    for (int k = 1; k < pd_tp_group_size(e->tp); k++)
        at[k] = host + part[k];
    pd_tp_cmd c = { .op = PD_TP_KV_COPY, .tseq = &r->tkv, .dseq = &r->dkv, .n_tpages = nt, .n_dpages = nd,
                    .host = at, .to_host = to_host };
    return pd_engine_tp_run(e, &c, err);
}

/* Preempts r: its deferred draft rows are added first (its draft KV is then whole), then the
 * pages holding its committed positions are copied to host memory and every page is given back.
 * PD_ERR_BUSY when the swap space cannot take it (nothing changed then). */
pd_status pd_engine_swap_out(pd_engine *e, pd_request *r, pd_err *err)
{
    if (r->n_pend > 0)
        TRY(pd_engine_pend_flush(e, PD_FLUSH_REQUEST, r, err));
    int nt = pd_engine_pages_of(e->tpool, r->tkv.len),
        nd = e->dpool != NULL ? pd_engine_pages_of(e->dpool, r->dkv.len) : 0;
    size_t bytes = swap_layout(e, nt, nd, NULL);
    if (e->swap_used + bytes > e->cfg.swap_bytes)
        return pd_err_set(err, PD_ERR_BUSY, "swap space full: %zu of %zu bytes used, %zu more needed",
                          e->swap_used, e->cfg.swap_bytes, bytes);
    /* the arena's pinned memory when it has room (pages copied in place), else a plain block */
    size_t held = pd_host_arena_chunk_bytes(e->swap_arena);
    char *host = pd_host_arena_take(e->swap_arena, bytes);
    if (pd_host_arena_chunk_bytes(e->swap_arena) > held)
        PD_LOG_INFO("engine", "swap space: %.0f MiB of host memory taken for preempted requests' KV (%.0f MiB "
                    "in all; kept for later preemptions, at most --swap-space)",
                    (double)(pd_host_arena_chunk_bytes(e->swap_arena) - held) / 1048576.0,
                    (double)pd_host_arena_chunk_bytes(e->swap_arena) / 1048576.0);
    if (host == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "swap: %zu bytes", bytes);
    pd_status st = swap_copy(e, r, nt, nd, host, 1, err);
    if (st != PD_OK) {
        pd_host_arena_give(e->swap_arena, host);
        return st;
    }
    r->swap = host;
    r->swap_bytes = bytes;
    r->swap_tlen = r->tkv.len;
    r->swap_dlen = r->dkv.len;
    pd_kv_seq_release(e->tpool, &r->tkv);
    if (e->dpool != NULL)
        pd_kv_seq_release(e->dpool, &r->dkv);
    e->swap_used += bytes;
    e->n_swapped++;
    PD_LOG_DEBUG("engine", "request %llu preempted: %d + %d KV pages (%zu bytes) to host memory, %d "
                 "preempted now", (unsigned long long)r->id, nt, nd, bytes, e->n_swapped);
    preempt_note(e, "a request's KV waits in host memory until pages free up");
    return PD_OK;
}

/* Preempts r without a host copy (the swap space is full): its deferred draft rows and every
 * page go back; it waits for pages (recompute 1), then the prefill computes its positions
 * before the anchor again (recompute 2) and it decodes on. */
void pd_engine_recompute_out(pd_engine *e, pd_request *r)
{
    pd_engine_pend_drop(e, r);
    pd_kv_seq_release(e->tpool, &r->tkv);
    if (e->dpool != NULL)
        pd_kv_seq_release(e->dpool, &r->dkv);
    r->recompute = 1;
    r->prefilled = 0;
    r->external = 0;   /* its prefill is done here now */
    e->n_recompute++;
    PD_LOG_DEBUG("engine", "request %llu preempted for recompute (%d positions; the swap space is full)",
                 (unsigned long long)r->id, r->anchor_pos);
    preempt_note(e, "the swap space is full: a request's KV is prefilled again");
}

/* Resumes r when the pools have room for its pages and its next round, leaving spare free
 * pages; 1 when it did, 0 when it must wait (*st: an error of the copy). */
static int swap_in(pd_engine *e, pd_request *r, int spare, pd_err *err, pd_status *st)
{
    *st = PD_OK;
    if (!take_pages(e, r, r->anchor_pos + e->B + 1, spare))
        return 0;
    *st = swap_copy(e, r, pd_engine_pages_of(e->tpool, r->swap_tlen),
                    e->dpool != NULL ? pd_engine_pages_of(e->dpool, r->swap_dlen) : 0, r->swap, 0, err);
    if (*st != PD_OK)
        return 0;
    r->tkv.len = r->swap_tlen;
    r->dkv.len = r->swap_dlen;
    pd_engine_preempt_clear(e, r);
    PD_LOG_DEBUG("engine", "request %llu resumed: its KV back from host memory (%d preempted now)",
                 (unsigned long long)r->id, e->n_swapped);
    return 1;
}

/* Preempted requests resume in admission order (none passes one that waits), each leaving
 * free the pages that a round may add to every running request (so that it is not preempted
 * again at once). */
pd_status pd_engine_swap_in_waiting(pd_engine *e, pd_err *err)
{
    if (e->n_swapped + e->n_recompute == 0)
        return PD_OK;
    int running = 0, per_round = pd_engine_pages_of(e->tpool, e->B + 1) + 1;
    for (int i = 0; i < e->n_reqs; i++)
        running += pd_engine_request_decoding(e->reqs[i]);
    for (int i = 0; i < e->n_reqs && e->n_swapped + e->n_recompute > 0; i++) {
        pd_request *r = e->reqs[i];
        if (r->finish != PD_FINISH_NONE || (r->swap == NULL && r->recompute != 1))
            continue;
        pd_status st = PD_OK;
        if (r->swap != NULL && !swap_in(e, r, running * per_round, err, &st))
            return st;
        if (r->recompute == 1) {
            /* pages for its context and a round; the prefill fills them */
            if (!take_pages(e, r, r->anchor_pos + e->B + 1, running * per_round))
                return PD_OK;
            /* and, with CP, each rank's pages for the prefill of its context */
            pd_err cerr;
            if ((st = pd_engine_cp_reserve(e, r, r->anchor_pos, &cerr)) != PD_OK) {
                pd_kv_seq_release(e->tpool, &r->tkv);
                if (e->dpool != NULL)
                    pd_kv_seq_release(e->dpool, &r->dkv);
                if (st == PD_ERR_BUSY)
                    return PD_OK;
                *err = cerr;
                return st;
            }
            r->recompute = 2;
        }
        running++;
    }
    return PD_OK;
}

/* The victim when the pool runs out for reqs[i]: the running request admitted last (from i on,
 * so no request already in the round's batch), possibly reqs[i] itself; NULL: none. */
pd_request *pd_engine_swap_victim(pd_engine *e, int i)
{
    for (int j = e->n_reqs - 1; j >= i; j--)
        if (pd_engine_request_decoding(e->reqs[j]) && !e->reqs[j]->params.hold_kv)
            return e->reqs[j];
    return NULL;
}

void pd_engine_swap_stats(const pd_engine *e, uint64_t *preemptions, int *swapped, size_t *bytes)
{
    *preemptions = e->n_preempt;
    *swapped = e->n_swapped;
    *bytes = e->swap_used;
}

void pd_engine_swap_arena_stats(const pd_engine *e, size_t *held, size_t *used)
{
    *held = pd_host_arena_chunk_bytes(e->swap_arena);
    *used = pd_host_arena_used_bytes(e->swap_arena);
}
