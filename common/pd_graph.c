/* pd_graph.c - the graph cache: warm up, capture, replay, fall back (pd_graph.h).
 * Owns: key lookup with LRU eviction and the capture state machine.
 * Not here: the capture mechanics (kern_graph_* in the backends).
 * Threading: one thread per cache. */
#include "pd_graph.h"

#include <string.h>

#include "pd_log.h"

pd_status pd_graph_mode_parse(const char *s, pd_graph_mode *out, pd_err *err)
{
    static const char *names[] = { "auto", "off", "pad" };
    for (int i = 0; i < 3; i++)
        if (s != NULL && strcmp(s, names[i]) == 0) {
            *out = (pd_graph_mode)i;
            return PD_OK;
        }
    return pd_err_set(err, PD_ERR_INVALID, "graphs '%s': expected auto, off or pad", s != NULL ? s : "");
}

void pd_graph_cache_init(pd_graph_cache *gc, kern_backend *be, pd_graph_mode mode)
{
    memset(gc, 0, sizeof(*gc));
    gc->be = be;
    gc->mode = mode;
    gc->usable = mode == PD_GRAPHS_AUTO && !be->is_host;   /* host backends have no graphs */
}

void pd_graph_cache_clear(pd_graph_cache *gc)
{
    for (int i = 0; i < gc->n; i++)
        kern_graph_free(gc->be, gc->e[i].graph);
    gc->n = 0;
}

int pd_graph_pad(const pd_graph_cache *gc)
{
    return gc->mode == PD_GRAPHS_PAD || (gc->mode == PD_GRAPHS_AUTO && gc->usable);
}

int pd_graph_bucket(int n)
{
    int step = n <= 4 ? 1 : n <= 16 ? 4 : n <= 64 ? 8 : n <= 256 ? 32 : 128;
    return (n + step - 1) / step * step;
}

int pd_graph_bucket_pow2(int n, int min)
{
    int b = min > 0 ? min : 1;
    while (b < n)
        b *= 2;
    return b;
}

static pd_graph_entry *find(pd_graph_cache *gc, const int64_t *key, int n_key)
{
    for (int i = 0; i < gc->n; i++)
        if (memcmp(gc->e[i].key, key, (size_t)n_key * sizeof(int64_t)) == 0 &&
            (n_key == PD_GRAPH_KEY_LEN || gc->e[i].key[n_key] == INT64_MIN))
            return &gc->e[i];
    return NULL;
}

static pd_graph_entry *insert(pd_graph_cache *gc, const int64_t *key, int n_key)
{
    pd_graph_entry *slot;
    if (gc->n < PD_GRAPH_CACHE_SIZE) {
        slot = &gc->e[gc->n++];
    } else {
        slot = &gc->e[0];
        for (int i = 1; i < gc->n; i++)
            if (gc->e[i].last_use < slot->last_use)
                slot = &gc->e[i];
        kern_graph_free(gc->be, slot->graph);
    }
    memset(slot, 0, sizeof(*slot));
    for (int i = 0; i < PD_GRAPH_KEY_LEN; i++)
        slot->key[i] = i < n_key ? key[i] : INT64_MIN;
    return slot;
}

static pd_status eager(pd_graph_cache *gc, pd_graph_body body, void *ud, pd_err *err)
{
    gc->n_eager++;
    return body(ud, err);
}

pd_status pd_graph_run(pd_graph_cache *gc, const int64_t *key, int n_key, pd_graph_body body,
                       void *ud, pd_err *err)
{
    if (gc->mode == PD_GRAPHS_PAD && n_key >= 0 && n_key <= PD_GRAPH_KEY_LEN) {
        /* no graphs, but the keys are kept: n_cold counts the shapes a GPU would capture */
        pd_graph_entry *en = find(gc, key, n_key);
        if (en == NULL) {
            en = insert(gc, key, n_key);
            gc->n_cold++;
        }
        en->last_use = ++gc->clock;
        return eager(gc, body, ud, err);
    }
    if (gc->mode != PD_GRAPHS_AUTO || !gc->usable || n_key < 0 || n_key > PD_GRAPH_KEY_LEN)
        return eager(gc, body, ud, err);
    pd_graph_entry *en = find(gc, key, n_key);
    if (en == NULL) {
        insert(gc, key, n_key)->last_use = ++gc->clock;
        gc->n_cold++;
        return eager(gc, body, ud, err);   /* warm-up: scratch grows outside any capture */
    }
    en->last_use = ++gc->clock;
    if (en->graph != NULL) {
        pd_err lerr;
        pd_status st = kern_graph_launch(gc->be, en->graph, &lerr);
        if (st == PD_OK) {
            gc->n_replays++;
            return PD_OK;
        }
        kern_graph_free(gc->be, en->graph);
        en->graph = NULL;
        gc->n_cold++;
        if (st != PD_ERR_BUSY) {
            *err = lerr;
            return st;
        }
        return eager(gc, body, ud, err);   /* stale: warm up again, capture next time */
    }
    if (en->failures >= 2)
        return eager(gc, body, ud, err);
    pd_err cerr;
    gc->n_cold++;
    pd_status st = kern_graph_begin(gc->be, &cerr);
    if (st == PD_ERR_UNSUPPORTED) {
        gc->usable = 0;
        return eager(gc, body, ud, err);
    }
    if (st != PD_OK) {
        *err = cerr;
        return st;
    }
    pd_status bst = body(ud, &cerr);
    void *g = NULL;
    pd_err eerr;
    pd_status est = kern_graph_end(gc->be, &g, &eerr);
    if (bst != PD_OK || est != PD_OK) {
        kern_graph_free(gc->be, g);
        if (++en->failures == 2)
            PD_LOG_WARN("graph", "capture failed twice for a step shape; it runs eagerly: %s",
                        bst != PD_OK ? cerr.msg : eerr.msg);
        return eager(gc, body, ud, err);   /* nothing recorded has run: run it now */
    }
    gc->n_captures++;
    st = kern_graph_launch(gc->be, g, err);
    if (st != PD_OK) {
        kern_graph_free(gc->be, g);
        return st;
    }
    en->graph = g;
    return PD_OK;
}
