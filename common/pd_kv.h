/* pd_kv.h - the paged KV cache: the one layout contract between prefill and decode.
 * Owns: page size and layout, the pool's free list, per-sequence page tables.
 * Layout of a pool's memory (one kern_buf): for layer l, K then V, each
 *   [n_pages, page_size, n_kv_heads, head_dim] of `dtype`; so a page of one layer's K is
 *   page_size * n_kv_heads * head_dim contiguous values (what pd_xfer puts between nodes).
 * Not here: moving bytes between nodes (pd_xfer), eviction policy (decode_node).
 * Threading: a pool and its sequences are used only by the thread that owns the engine. */
#ifndef PD_KV_H
#define PD_KV_H

#include <stddef.h>
#include <stdint.h>

#include "kern_backend.h"
#include "pd_status.h"

typedef struct {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int page_size;       /* token slots per page */
    int n_pages;         /* pages in the pool */
    kern_dtype dtype;
} pd_kv_layout;

typedef struct pd_kv_pool pd_kv_pool;

/* A sequence's page table. len is the number of committed token positions. */
typedef struct {
    int32_t *pages;
    int n_pages;
    int cap;
    int len;
} pd_kv_seq;

/* Bytes of one page of one layer's K (equal to V). */
size_t pd_kv_page_bytes(const pd_kv_layout *lay);
/* Bytes of a pool of this layout: K and V pages of every layer. */
size_t pd_kv_pool_bytes(const pd_kv_layout *lay);
/* Two layouts can exchange pages iff this returns PD_OK; the message names the first field
 * that differs. */
pd_status pd_kv_layout_match(const pd_kv_layout *a, const pd_kv_layout *b, pd_err *err);

pd_status pd_kv_pool_create(kern_backend *be, const pd_kv_layout *lay, pd_kv_pool **out, pd_err *err);
void pd_kv_pool_destroy(pd_kv_pool *pool);
const pd_kv_layout *pd_kv_pool_layout(const pd_kv_pool *pool);
kern_kv_layer pd_kv_pool_layer(const pd_kv_pool *pool, int layer);
const kern_buf *pd_kv_pool_buf(const pd_kv_pool *pool);
int pd_kv_pool_free_pages(const pd_kv_pool *pool);

/* --kv-memory-fraction: the pages per pool that let every pool on a device take together the
 * fraction f (in (0, 1)) of the memory its backend reports free now (kern_mem_info: a GPU's,
 * or the host's available memory). Pool i lives on be[i] and costs page_bytes[i] a page; pools
 * whose backends bind to the same device share it, and every pool gets the same pages, so the
 * device with the least room per page decides. what names the pools in the log line.
 * PD_ERR_INVALID for f out of range or a backend without memory figures, PD_ERR_NOMEM below
 * 64 pages. Leaves the calling thread bound to be[0]'s device. */
pd_status pd_kv_pages_from_memory(double f, int n, kern_backend *const *be, const double *page_bytes,
                                  int page_size, const char *what, int *n_pages, pd_err *err);

void pd_kv_seq_init(pd_kv_seq *seq);
/* Makes seq hold pages for at least n_tokens positions. PD_ERR_BUSY when the pool is out of
 * pages (seq unchanged). */
pd_status pd_kv_seq_reserve(pd_kv_pool *pool, pd_kv_seq *seq, int n_tokens, pd_err *err);
/* seq (empty) takes pages[0..n) that other sequences or a cache hold already (a shared prefix:
 * full pages nobody writes again); each gains a reference. */
pd_status pd_kv_seq_share(pd_kv_pool *pool, pd_kv_seq *seq, const int32_t *pages, int n, pd_err *err);
/* A page's references: a holder outside any sequence (the prefix cache) takes and drops its
 * own; a page returns to the free list when its last reference goes. */
void pd_kv_page_ref(pd_kv_pool *pool, int32_t page);
void pd_kv_page_unref(pd_kv_pool *pool, int32_t page);
int pd_kv_page_refs(const pd_kv_pool *pool, int32_t page);
/* Called by pd_kv_seq_reserve when the free list is `need` pages short, before it answers BUSY
 * (the prefix cache drops entries nobody else holds). NULL = none. */
void pd_kv_pool_set_reclaim(pd_kv_pool *pool, int (*fn)(void *ud, int need), void *ud);
/* Drops seq's reference to every page (a page nobody else holds returns to the pool) and
 * empties seq. */
void pd_kv_seq_release(pd_kv_pool *pool, pd_kv_seq *seq);
/* Copies the contents of seq's first n pages between the pool and host memory (n pages' K and
 * V of every layer at host, [layer][K, V][page]): to_host 1 downloads, 0 uploads into
 * the pages seq holds now. Runs of consecutive page ids move in one piece. Bit for bit. */
pd_status pd_kv_seq_copy(pd_kv_pool *pool, const pd_kv_seq *seq, int n, void *host, int to_host, pd_err *err);
/* A request's target and draft KV in one host block: the first nt pages of tseq in tpool, then
 * (dpool non-NULL) the first nd pages of dseq in dpool. pd_kv_pair_bytes gives its size,
 * pd_kv_pair_copy moves it (pd_kv_seq_copy's direction). */
size_t pd_kv_pair_bytes(const pd_kv_pool *tpool, int nt, const pd_kv_pool *dpool, int nd);
pd_status pd_kv_pair_copy(pd_kv_pool *tpool, const pd_kv_seq *tseq, int nt, pd_kv_pool *dpool,
                          const pd_kv_seq *dseq, int nd, char *host, int to_host, pd_err *err);
/* Slot index (page * page_size + offset) of position pos; pos must be reserved. */
int32_t pd_kv_seq_slot(const pd_kv_pool *pool, const pd_kv_seq *seq, int pos);

#endif
