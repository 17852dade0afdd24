/* pd_kv.c - paged KV pool: one backend allocation, a LIFO free list of page ids, page tables.
 * Threading: owner thread only (see pd_kv.h). */
#include "pd_kv.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "pd_log.h"

struct pd_kv_pool {
    pd_kv_layout lay;
    kern_backend *be;
    kern_buf *mem;
    int32_t *free_list;
    int n_free;
    uint16_t *refs;          /* [n_pages] sequences (and caches) holding each page */
    int (*reclaim)(void *ud, int need);
    void *reclaim_ud;
};

size_t pd_kv_page_bytes(const pd_kv_layout *lay)
{
    return (size_t)lay->page_size * lay->n_kv_heads * lay->head_dim * kern_dtype_size(lay->dtype);
}

size_t pd_kv_pool_bytes(const pd_kv_layout *lay)
{
    return pd_kv_page_bytes(lay) * (size_t)lay->n_pages * 2 * (size_t)lay->n_layers;
}

pd_status pd_kv_layout_match(const pd_kv_layout *a, const pd_kv_layout *b, pd_err *err)
{
#define FIELD(f) \
    if (a->f != b->f) \
        return pd_err_set(err, PD_ERR_INVALID, "kv layout mismatch: " #f " %d vs %d", (int)a->f, (int)b->f)
    FIELD(n_layers);
    FIELD(n_kv_heads);
    FIELD(head_dim);
    FIELD(page_size);
    FIELD(dtype);
#undef FIELD
    return PD_OK;
}

pd_status pd_kv_pool_create(kern_backend *be, const pd_kv_layout *lay, pd_kv_pool **out, pd_err *err)
{
    if (lay->n_layers <= 0 || lay->n_kv_heads <= 0 || lay->head_dim <= 0 || lay->page_size <= 0 ||
        lay->n_pages <= 0)
        return pd_err_set(err, PD_ERR_INVALID,
                          "kv pool: layers %d kv heads %d head dim %d page size %d pages %d",
                          lay->n_layers, lay->n_kv_heads, lay->head_dim, lay->page_size, lay->n_pages);
    pd_kv_pool *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "kv pool");
    pd_status st;
    pool->lay = *lay;
    pool->be = be;
    pool->free_list = malloc((size_t)lay->n_pages * sizeof(int32_t));
    pool->refs = calloc((size_t)lay->n_pages, sizeof(uint16_t));
    if (pool->free_list == NULL || pool->refs == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "kv free list: %d pages", lay->n_pages);
        goto err_free_pool;
    }
    size_t bytes = pd_kv_pool_bytes(lay);
    st = kern_buf_alloc(be, bytes, &pool->mem, err);
    if (st != PD_OK)
        goto err_free_list;
    /* zero once so a read of a never-written slot is finite (it is never attended to) */
    st = kern_memset0(be, pool->mem->ptr, bytes, err);
    if (st != PD_OK)
        goto err_free_mem;
    for (int i = 0; i < lay->n_pages; i++)
        pool->free_list[i] = lay->n_pages - 1 - i;   /* pop gives page 0 first */
    pool->n_free = lay->n_pages;
    *out = pool;
    return PD_OK;
err_free_mem:
    kern_buf_free(pool->mem);
err_free_list:
    free(pool->free_list);
    free(pool->refs);
err_free_pool:
    free(pool);
    return st;
}

void pd_kv_pool_destroy(pd_kv_pool *pool)
{
    if (pool == NULL)
        return;
    kern_buf_free(pool->mem);
    free(pool->free_list);
    free(pool->refs);
    free(pool);
}

const pd_kv_layout *pd_kv_pool_layout(const pd_kv_pool *pool) { return &pool->lay; }
const kern_buf *pd_kv_pool_buf(const pd_kv_pool *pool) { return pool->mem; }
int pd_kv_pool_free_pages(const pd_kv_pool *pool) { return pool->n_free; }

pd_status pd_kv_pages_from_memory(double f, int n, kern_backend *const *be, const double *page_bytes,
                                  int page_size, const char *what, int *n_pages, pd_err *err)
{
    if (!(f > 0.0 && f < 1.0))
        return pd_err_set(err, PD_ERR_INVALID, "kv memory fraction %g: give one in (0, 1)", f);
    int *dev = calloc((size_t)n, sizeof(*dev));
    double *per = calloc((size_t)n, sizeof(*per));   /* per[q]: bytes a page on pool q's device */
    if (dev == NULL || per == NULL) {
        free(dev);
        free(per);
        return pd_err_set(err, PD_ERR_NOMEM, "kv memory fraction");
    }
    pd_status st = PD_OK;
    for (int r = 0; r < n && st == PD_OK; r++) {
        st = kern_backend_bind_thread(be[r], &dev[r], err);
        int q = 0;   /* the first pool on this device holds its sum */
        while (dev[q] != dev[r])
            q++;
        per[q] += page_bytes[r];
    }
    double pages = -1.0, per_d = 0.0;   /* the deciding device: pages, bytes a page, its memory */
    size_t free_d = 0, total_d = 0;
    int n_dev = 0;
    for (int r = 0; r < n && st == PD_OK; r++) {
        if (per[r] == 0.0)
            continue;
        n_dev++;
        if ((st = kern_backend_bind_thread(be[r], NULL, err)) != PD_OK)
            break;
        size_t free_b = 0, total_b = 0;
        pd_err merr;
        if (kern_mem_info(be[r], &free_b, &total_b, &merr) != PD_OK) {
            st = pd_err_set(err, PD_ERR_INVALID, "a kv memory fraction needs a backend that reports its "
                            "memory (%s): size the pools in pages instead", merr.msg);
            break;
        }
        double nd = (double)free_b * f / per[r];
        if (pages < 0.0 || nd < pages) {
            pages = nd;
            per_d = per[r];
            free_d = free_b;
            total_d = total_b;
        }
    }
    if (n > 1) {   /* this thread goes on with the first pool's device */
        pd_err berr;
        pd_status bs = kern_backend_bind_thread(be[0], NULL, &berr);
        if (st == PD_OK && bs != PD_OK) {
            *err = berr;
            st = bs;
        }
    }
    free(dev);
    free(per);
    if (st != PD_OK)
        return st;
    if (pages < 64.0)
        return pd_err_set(err, PD_ERR_NOMEM, "kv memory fraction %g of %.2f GiB free gives %.0f pages of %d "
                          "tokens (%.1f KiB each for %s on that device): fewer than 64", f,
                          free_d / 1073741824.0, pages, page_size, per_d / 1024.0, what);
    *n_pages = pages > (double)(INT_MAX / 2) ? INT_MAX / 2 : (int)pages;
    PD_LOG_INFO("kv", "kv memory fraction %g of %.2f GiB free (%.2f GiB total%s): %d pages of %d tokens for %s", f,
                free_d / 1073741824.0, total_d / 1073741824.0, n_dev > 1 ? ", the fullest of the devices" : "",
                *n_pages, page_size, what);
    return PD_OK;
}

kern_kv_layer pd_kv_pool_layer(const pd_kv_pool *pool, int layer)
{
    size_t half = pd_kv_page_bytes(&pool->lay) * (size_t)pool->lay.n_pages;
    char *base = (char *)pool->mem->ptr + (size_t)layer * 2 * half;
    kern_kv_layer kv = {
        .k = base,
        .v = base + half,
        .dtype = pool->lay.dtype,
        .page_size = pool->lay.page_size,
        .n_kv_heads = pool->lay.n_kv_heads,
        .head_dim = pool->lay.head_dim,
    };
    return kv;
}

void pd_kv_seq_init(pd_kv_seq *seq)
{
    memset(seq, 0, sizeof(*seq));
}

/* room for need page ids in seq's table */
static pd_status seq_grow(pd_kv_seq *seq, int need, pd_err *err)
{
    if (need <= seq->cap)
        return PD_OK;
    int cap = seq->cap > 0 ? seq->cap : 8;
    while (cap < need)
        cap *= 2;
    int32_t *p = realloc(seq->pages, (size_t)cap * sizeof(int32_t));
    if (p == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "page table: %d entries", cap);
    seq->pages = p;
    seq->cap = cap;
    return PD_OK;
}

pd_status pd_kv_seq_reserve(pd_kv_pool *pool, pd_kv_seq *seq, int n_tokens, pd_err *err)
{
    int need = (n_tokens + pool->lay.page_size - 1) / pool->lay.page_size;
    if (need <= seq->n_pages)
        return PD_OK;
    int more = need - seq->n_pages;
    if (more > pool->n_free && pool->reclaim != NULL)
        pool->reclaim(pool->reclaim_ud, more - pool->n_free);
    if (more > pool->n_free)
        return pd_err_set(err, PD_ERR_BUSY, "kv pool exhausted: need %d pages, %d free", more,
                          pool->n_free);
    pd_status st = seq_grow(seq, need, err);
    if (st != PD_OK)
        return st;
    for (int i = 0; i < more; i++) {
        int32_t p = pool->free_list[--pool->n_free];
        pool->refs[p] = 1;
        seq->pages[seq->n_pages++] = p;
    }
    return PD_OK;
}

pd_status pd_kv_seq_share(pd_kv_pool *pool, pd_kv_seq *seq, const int32_t *pages, int n, pd_err *err)
{
    if (seq->n_pages != 0)
        return pd_err_set(err, PD_ERR_INVALID, "kv share: the sequence holds %d pages already", seq->n_pages);
    pd_status st = seq_grow(seq, n, err);
    if (st != PD_OK)
        return st;
    for (int i = 0; i < n; i++) {
        PD_ASSERT(pool->refs[pages[i]] > 0 && pool->refs[pages[i]] < UINT16_MAX);
        pool->refs[pages[i]]++;
        seq->pages[seq->n_pages++] = pages[i];
    }
    return PD_OK;
}

void pd_kv_page_ref(pd_kv_pool *pool, int32_t page)
{
    PD_ASSERT(pool->refs[page] > 0 && pool->refs[page] < UINT16_MAX);
    pool->refs[page]++;
}

int pd_kv_page_refs(const pd_kv_pool *pool, int32_t page)
{
    return pool->refs[page];
}

void pd_kv_page_unref(pd_kv_pool *pool, int32_t page)
{
    PD_ASSERT(pool->refs[page] > 0);
    if (--pool->refs[page] == 0)
        pool->free_list[pool->n_free++] = page;
}

void pd_kv_pool_set_reclaim(pd_kv_pool *pool, int (*fn)(void *ud, int need), void *ud)
{
    pool->reclaim = fn;
    pool->reclaim_ud = ud;
}

void pd_kv_seq_release(pd_kv_pool *pool, pd_kv_seq *seq)
{
    if (seq == NULL)
        return;
    /* last page first, so the next reservation pops them in the order they had: a sequence's
     * pages stay in ascending runs, which transfers and staging copies take in one piece */
    for (int i = seq->n_pages - 1; i >= 0; i--)
        pd_kv_page_unref(pool, seq->pages[i]);
    free(seq->pages);
    pd_kv_seq_init(seq);
}

/* bytes one page holds over every layer (K and V) */
static size_t page_set_bytes(const pd_kv_layout *lay)
{
    return pd_kv_page_bytes(lay) * 2 * (size_t)lay->n_layers;
}

pd_status pd_kv_seq_copy(pd_kv_pool *pool, const pd_kv_seq *seq, int n, void *host, int to_host, pd_err *err)
{
    PD_ASSERT(n >= 0 && n <= seq->n_pages);
    size_t pb = pd_kv_page_bytes(&pool->lay);
    char *h = host;
    /* one batched copy (a copy call per run would cost thousands of calls and waits for a long
     * sequence's scattered pages) */
    kern_copy_span *sp = NULL;
    int nsp = 0;
    if (n > 0 && (sp = malloc((size_t)2 * pool->lay.n_layers * (size_t)n * sizeof(*sp))) == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "kv copy: %d spans", 2 * pool->lay.n_layers * n);
    for (int part = 0; part < 2 * pool->lay.n_layers; part++) {   /* layer l's K, then its V */
        char *base = (char *)pool->mem->ptr + (size_t)part * pb * (size_t)pool->lay.n_pages;
        for (int i = 0; i < n;) {
            int run = 1;
            while (i + run < n && seq->pages[i + run] == seq->pages[i] + run)
                run++;
            char *dev = base + (size_t)seq->pages[i] * pb;
            sp[nsp++] = to_host ? (kern_copy_span){ h, dev, (size_t)run * pb }
                                : (kern_copy_span){ dev, h, (size_t)run * pb };
            h += (size_t)run * pb;
            i += run;
        }
    }
    pd_status st = nsp == 0 ? PD_OK
                   : to_host ? kern_download_spans(pool->be, sp, nsp, err) : kern_upload_spans(pool->be, sp, nsp, err);
    free(sp);
    return st;
}

size_t pd_kv_pair_bytes(const pd_kv_pool *tpool, int nt, const pd_kv_pool *dpool, int nd)
{
    size_t b = (size_t)nt * page_set_bytes(&tpool->lay);
    return dpool != NULL ? b + (size_t)nd * page_set_bytes(&dpool->lay) : b;
}

pd_status pd_kv_pair_copy(pd_kv_pool *tpool, const pd_kv_seq *tseq, int nt, pd_kv_pool *dpool,
                          const pd_kv_seq *dseq, int nd, char *host, int to_host, pd_err *err)
{
    pd_status st = pd_kv_seq_copy(tpool, tseq, nt, host, to_host, err);
    if (st != PD_OK || dpool == NULL || nd == 0)
        return st;
    return pd_kv_seq_copy(dpool, dseq, nd, host + pd_kv_pair_bytes(tpool, nt, NULL, 0), to_host, err);
}

int32_t pd_kv_seq_slot(const pd_kv_pool *pool, const pd_kv_seq *seq, int pos)
{
    int ps = pool->lay.page_size;
    PD_ASSERT(pos >= 0 && pos / ps < seq->n_pages);
    return seq->pages[pos / ps] * ps + pos % ps;
}
