/* pd_prefix.h - the prefix cache: full KV pages of prompts kept after their requests, found again
 *   by a later prompt that starts with the same tokens (automatic prefix caching).
 * Owns: the entries (one per full page of a cached prompt: its tokens, the target page and the
 *   draft page holding their K/V, the entry of the page before it), their lookup by (previous
 *   entry, tokens), their references on the pools' pages, and eviction (least recently used
 *   leaves that no sequence holds) when a pool runs short.
 * Not here: what may be cached and when (pd_engine_kv.c: pages whose target and draft K/V are
 *   final); the pages themselves (pd_kv.c).
 * Threading: used by the engine thread only. */
#ifndef PD_PREFIX_H
#define PD_PREFIX_H

#include <stdint.h>

#include "pd_kv.h"
#include "pd_status.h"

typedef struct pd_prefix pd_prefix;

/* A cache over tpool (and dpool, the drafter's pool with the same page ids per position; NULL
 * without a drafter): it installs itself as both pools' reclaim hook. */
pd_status pd_prefix_create(pd_kv_pool *tpool, pd_kv_pool *dpool, pd_prefix **out, pd_err *err);
/* Drops every entry (their pages return unless sequences hold them) and the hooks. */
void pd_prefix_destroy(pd_prefix *c);

/* The longest cached chain of full pages that prompt[0..n) starts with, at most max_pages:
 * tpages[i] / dpages[i] (dpages may be NULL) get page i's pages; returns the page count. The
 * entries become the most recently used. */
int pd_prefix_lookup(pd_prefix *c, const int32_t *prompt, int n, int max_pages, int32_t *tpages,
                     int32_t *dpages);
/* Caches pages 0..n_pages-1 of a prompt (page i holds prompt[i * page_size ..] with final K/V in
 * tpages[i] and dpages[i]): pages already cached stay as they are, new ones take a reference on
 * their pool pages. Returns the pages newly cached (0 when out of memory: nothing is lost). */
int pd_prefix_insert(pd_prefix *c, const int32_t *prompt, int n_pages, const int32_t *tpages,
                     const int32_t *dpages);
/* Pages the cache alone holds (what eviction could give back), and entries. */
int pd_prefix_evictable(const pd_prefix *c);
int pd_prefix_entries(const pd_prefix *c);
/* Evicts until `need` more target pages are free or nothing more can go; returns pages freed. */
int pd_prefix_evict(pd_prefix *c, int need);

#endif
