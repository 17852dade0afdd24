/* pd_prefix.c - the prefix cache (pd_prefix.h): fixed arrays sized by the target pool (an entry
 * holds one target page, so there are never more entries than pages), chained hash buckets keyed
 * by (previous entry, the page's tokens), LRU by a use counter, eviction of leaves only (an entry
 * with cached pages after it stays until they went, so every chain stays reachable). */
#include "pd_prefix.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t parent;          /* the entry of the page before, -1 for a prompt's first page */
    int32_t tpage, dpage;    /* dpage -1 without a draft pool */
    int32_t next;            /* bucket chain */
    int32_t n_children;      /* cached pages after this one */
    uint64_t hash, used;
    int live;
} entry;

struct pd_prefix {
    pd_kv_pool *tp, *dp;
    int ps, cap;
    entry *e;
    int32_t *toks;           /* [cap, ps] */
    int32_t *slots;          /* free entry slots */
    int n_slots, n_live;
    int32_t *bucket;         /* [n_bucket] chain heads, -1 = empty */
    uint64_t n_bucket, tick;
};

static uint64_t page_hash(int32_t parent, const int32_t *t, int ps)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)(uint32_t)parent;
    h *= 1099511628211ull;
    for (int i = 0; i < ps; i++) {
        h ^= (uint64_t)(uint32_t)t[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static int32_t find(const pd_prefix *c, int32_t parent, const int32_t *t, uint64_t h)
{
    for (int32_t i = c->bucket[h & (c->n_bucket - 1)]; i >= 0; i = c->e[i].next)
        if (c->e[i].hash == h && c->e[i].parent == parent &&
            memcmp(c->toks + (size_t)i * c->ps, t, (size_t)c->ps * sizeof(int32_t)) == 0)
            return i;
    return -1;
}

static int cache_only(const pd_prefix *c, const entry *x)
{
    return pd_kv_page_refs(c->tp, x->tpage) == 1 && (c->dp == NULL || pd_kv_page_refs(c->dp, x->dpage) == 1);
}

static void drop(pd_prefix *c, int32_t i)
{
    entry *x = &c->e[i];
    int32_t *link = &c->bucket[x->hash & (c->n_bucket - 1)];
    while (*link != i)
        link = &c->e[*link].next;
    *link = x->next;
    if (x->parent >= 0)
        c->e[x->parent].n_children--;
    pd_kv_page_unref(c->tp, x->tpage);
    if (c->dp != NULL)
        pd_kv_page_unref(c->dp, x->dpage);
    x->live = 0;
    c->slots[c->n_slots++] = i;
    c->n_live--;
}

int pd_prefix_evict(pd_prefix *c, int need)
{
    int freed = 0;
    while (freed < need) {
        int32_t best = -1;
        for (int32_t i = 0; i < c->cap; i++) {
            const entry *x = &c->e[i];
            if (x->live && x->n_children == 0 && cache_only(c, x) && (best < 0 || x->used < c->e[best].used))
                best = i;
        }
        if (best < 0)
            break;
        drop(c, best);
        freed++;
    }
    return freed;
}

static int reclaim(void *ud, int need)
{
    return pd_prefix_evict(ud, need);
}

pd_status pd_prefix_create(pd_kv_pool *tpool, pd_kv_pool *dpool, pd_prefix **out, pd_err *err)
{
    const pd_kv_layout *tl = pd_kv_pool_layout(tpool);
    if (dpool != NULL && pd_kv_pool_layout(dpool)->page_size != tl->page_size)
        return pd_err_set(err, PD_ERR_INVALID, "prefix cache: draft pages of %d tokens, target pages of %d",
                          pd_kv_pool_layout(dpool)->page_size, tl->page_size);
    pd_prefix *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "prefix cache");
    c->tp = tpool;
    c->dp = dpool;
    c->ps = tl->page_size;
    c->cap = tl->n_pages;
    c->n_bucket = 1;
    while (c->n_bucket < 2 * (uint64_t)c->cap)
        c->n_bucket *= 2;
    c->e = calloc((size_t)c->cap, sizeof(*c->e));
    c->toks = malloc((size_t)c->cap * c->ps * sizeof(int32_t));
    c->slots = malloc((size_t)c->cap * sizeof(int32_t));
    c->bucket = malloc(c->n_bucket * sizeof(int32_t));
    if (c->e == NULL || c->toks == NULL || c->slots == NULL || c->bucket == NULL) {
        pd_prefix_destroy(c);
        return pd_err_set(err, PD_ERR_NOMEM, "prefix cache of %d pages", c->cap);
    }
    for (int i = 0; i < c->cap; i++)
        c->slots[i] = c->cap - 1 - i;
    c->n_slots = c->cap;
    memset(c->bucket, 0xff, c->n_bucket * sizeof(int32_t));
    pd_kv_pool_set_reclaim(tpool, reclaim, c);
    if (dpool != NULL)
        pd_kv_pool_set_reclaim(dpool, reclaim, c);
    *out = c;
    return PD_OK;
}

void pd_prefix_destroy(pd_prefix *c)
{
    if (c == NULL)
        return;
    for (int32_t i = 0; c->e != NULL && i < c->cap; i++)
        if (c->e[i].live) {
            pd_kv_page_unref(c->tp, c->e[i].tpage);
            if (c->dp != NULL)
                pd_kv_page_unref(c->dp, c->e[i].dpage);
        }
    if (c->bucket != NULL) {
        pd_kv_pool_set_reclaim(c->tp, NULL, NULL);
        if (c->dp != NULL)
            pd_kv_pool_set_reclaim(c->dp, NULL, NULL);
    }
    free(c->e);
    free(c->toks);
    free(c->slots);
    free(c->bucket);
    free(c);
}

int pd_prefix_lookup(pd_prefix *c, const int32_t *prompt, int n, int max_pages, int32_t *tpages,
                     int32_t *dpages)
{
    int32_t parent = -1;
    int k = 0;
    for (; k < max_pages && (k + 1) * c->ps <= n; k++) {
        const int32_t *t = prompt + (size_t)k * c->ps;
        int32_t i = find(c, parent, t, page_hash(parent, t, c->ps));
        if (i < 0)
            break;
        c->e[i].used = ++c->tick;
        tpages[k] = c->e[i].tpage;
        if (dpages != NULL)
            dpages[k] = c->e[i].dpage;
        parent = i;
    }
    return k;
}

int pd_prefix_insert(pd_prefix *c, const int32_t *prompt, int n_pages, const int32_t *tpages,
                     const int32_t *dpages)
{
    int32_t parent = -1;
    int added = 0;
    for (int k = 0; k < n_pages; k++) {
        const int32_t *t = prompt + (size_t)k * c->ps;
        uint64_t h = page_hash(parent, t, c->ps);
        int32_t i = find(c, parent, t, h);
        if (i < 0) {
            if (c->n_slots == 0)   /* every page cached already: unreachable, entries <= pages */
                break;
            i = c->slots[--c->n_slots];
            entry *x = &c->e[i];
            *x = (entry){ .parent = parent, .tpage = tpages[k], .dpage = dpages != NULL ? dpages[k] : -1,
                          .hash = h, .live = 1 };
            memcpy(c->toks + (size_t)i * c->ps, t, (size_t)c->ps * sizeof(int32_t));
            x->next = c->bucket[h & (c->n_bucket - 1)];
            c->bucket[h & (c->n_bucket - 1)] = i;
            if (parent >= 0)
                c->e[parent].n_children++;
            pd_kv_page_ref(c->tp, x->tpage);
            if (c->dp != NULL)
                pd_kv_page_ref(c->dp, x->dpage);
            c->n_live++;
            added++;
        }
        c->e[i].used = ++c->tick;
        parent = i;
    }
    return added;
}

int pd_prefix_evictable(const pd_prefix *c)
{
    int n = 0;
    for (int32_t i = 0; i < c->cap; i++)
        n += c->e[i].live && cache_only(c, &c->e[i]);
    return n;
}

int pd_prefix_entries(const pd_prefix *c)
{
    return c->n_live;
}
