/* pd_qwen3.h - Qwen3 forward on a backend: the target runner and the decoder layer it shares
 *   with the DSpark drafter.
 * Owns: the activation workspace, one ragged-batch forward (prefill chunks, verify blocks and
 *   single decode tokens are all "n_tok tokens of n_seq sequences"), aux capture at tap layers.
 * Not here: weights loading (pd_model.c), sampling (pd_sample.c), scheduling (pd_engine.c).
 * Threading: a runner is used by one thread at a time. */
#ifndef PD_QWEN3_H
#define PD_QWEN3_H

#include <stdint.h>

#include "kern_backend.h"
#include "pd_kv.h"
#include "pd_model.h"
#include "pd_status.h"

struct pd_tp_rank;

/* Backend scratch for one forward of up to cap_tok tokens. Grown on demand. */
typedef struct {
    kern_backend *be;
    struct pd_tp_rank *tp;    /* tensor parallelism (pd_tp.h): this rank holds a shard of the
                               * heads and MLP columns; NULL = the whole layer */
    int cap_tok;
    int cap_seq_pages;        /* capacity of the page-table buffer in entries */
    int hidden, q_dim, kv_dim, inter;
    kern_buf *buf;            /* all float scratch */
    float *x, *h, *q, *k, *v, *o, *g, *u;
    kern_buf *ibuf;           /* int32 per-token arrays */
    int32_t *ids, *pos, *seq, *kv_len, *slot;
    kern_buf *ptbuf;
    int32_t *page_table;
    float *tap;               /* NULL, or where the next pd_layer_attn_mlp also writes its output
                               * rows [n_tok, ld_tap] (the down projection's epilogue writes them
                               * twice: no copy kernel); the caller sets and clears it, and leaves
                               * it NULL under tensor parallelism (the epilogue sees a partial) */
    int ld_tap;
} pd_act;

pd_status pd_act_init(pd_act *a, kern_backend *be, const pd_qwen3_config *cfg, pd_err *err);
/* Makes room for n_tok tokens and n_pt page-table entries. */
pd_status pd_act_reserve(pd_act *a, int n_tok, int n_pt, pd_err *err);
void pd_act_cleanup(pd_act *a);

/* Per-token metadata of a ragged batch, host side. */
typedef struct {
    int n_tok;
    const int32_t *ids;       /* [n_tok] token ids (may be NULL when the caller fills a->x) */
    const int32_t *pos;       /* [n_tok] absolute positions */
    const int32_t *seq;       /* [n_tok] index into seqs */
    const int32_t *kv_len;    /* [n_tok] keys each query sees; NULL = causal (pos + 1) */
    int n_seq;
    pd_kv_seq *const *seqs;   /* page tables, reserved to cover every position written */
    int no_store;             /* 1: the keys of these positions are in the cache already: they
                               * are read, nothing is written (recomputing committed rows) */
} pd_tok_batch;

/* Uploads ids/pos/seq/kv_len/slots and the page table of b into a (slots from pool); a's
 * per-token arrays point at this batch's layout afterwards. */
pd_status pd_act_load_batch(pd_act *a, const pd_kv_pool *pool, const pd_tok_batch *b,
                            int *pt_stride_out, int *max_kv_out, pd_err *err);
/* The same, padded (graph buckets, pd_graph.h) when pad is PD_ACT_PAD_BUCKET (to
 * pd_graph_bucket(n_tok) rows) or a row count > 0 (to max(pad, n_tok) rows): *n_pad_out rows, the extra ones token 0 at position 0 of sequence 0 with one key and no KV slot
 * (nothing stored, their outputs unused); the page-table stride and *max_kv_out are rounded up
 * to powers of two. With pad 0, *n_pad_out = n_tok and nothing is rounded. */
#define PD_ACT_PAD_BUCKET (-1)
pd_status pd_act_load_batch_pad(pd_act *a, const pd_kv_pool *pool, const pd_tok_batch *b, int pad,
                                int *n_pad_out, int *pt_stride_out, int *max_kv_out, pd_err *err);

/* One pre-norm decoder layer on a->x [n_tok, hidden] in place: attention through the paged
 * layer kv (this batch's K/V are stored at a->slot first), then the SwiGLU MLP. Leaves
 * a->q/k/v/o undefined (one kern_attn_block op). */
pd_status pd_layer_forward(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                           kern_kv_layer kv, int n_tok, int n_seq, int pt_stride, int max_kv,
                           pd_err *err);
/* K/V of rows in[n_tok, hidden] (already normalised as the caller wants) through lw's k/v
 * projections, k_norm and RoPE at a->pos, stored at a->slot. Used by the drafter's context. */
pd_status pd_layer_store_kv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                            kern_kv_layer kv, const float *in, int n_tok, pd_err *err);

/* The pieces of pd_layer_forward, for a caller that moves K/V between computing and storing
 * them (the context-parallel prefill all-gathers them, pd_cp_prefill.c). pd_layer_forward is
 * pd_layer_qkv, kern_kv_store of a->k/a->v at a->slot, then pd_layer_attn_mlp (computed as one
 * kern_attn_block op and the MLP); all run on a->be.
 * pd_layer_qkv: h = input_norm(x) (never materialised: fused into the projections, one
 *   kern_linear launch for q/k/v); q = rope(q_norm(h Wq^T)) into a->q [n_tok, q_dim]; k/v of h
 *   as pd_layer_kv (q/k norm + RoPE in one kern_qk_post launch). Stores nothing.
 * pd_layer_kv: k = rope(k_norm(in Wk^T)) at a->pos into a->k, v = in Wv^T into a->v, both
 *   [n_tok, kv_dim] with row stride kv_dim.
 * pd_layer_attn_mlp: attention of a->q over the pages of kv (a->seq, a->kv_len,
 *   a->page_table), o_proj added to a->x, then the SwiGLU MLP added to a->x. */
pd_status pd_layer_qkv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw, int n_tok,
                       pd_err *err);
pd_status pd_layer_kv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                      const float *in, int n_tok, pd_err *err);
pd_status pd_layer_attn_mlp(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                            kern_kv_layer kv, int n_tok, int n_seq, int pt_stride, int max_kv,
                            pd_err *err);

/* Final norm and lm_head of rows idx[0..n-1] (backend int32, nullable = rows 0..n-1) of
 * x [*, hidden] (row stride ld_x), on be (which must be able to read m's weights): the rows are
 * copied into pick [n, hidden], normalised into normed [n, hidden], logits [n, vocab]. */
pd_status pd_qwen3_head(const pd_qwen3_model *m, kern_backend *be, const float *x, int ld_x,
                        const int32_t *idx, int n, float *pick, float *normed, float *logits,
                        pd_err *err);

/* ---- the target runner ------------------------------------------------------------------ */

typedef struct pd_target pd_target;

/* taps: layer ids whose raw outputs are captured (-1 = embedding output), n_taps may be 0.
 * pool: the target KV pool (borrowed). */
pd_status pd_target_create(const pd_qwen3_model *m, pd_kv_pool *pool, const int *taps, int n_taps,
                           pd_target **out, pd_err *err);
void pd_target_destroy(pd_target *t);

/* Runs b through every layer, writing K/V of every token into its sequence's pages.
 * Logits are produced for rows logit_rows[0..n_logits-1] (indices into the batch); aux rows
 * [n_tok, n_taps * hidden] are captured when the runner has taps. */
pd_status pd_target_forward(pd_target *t, const pd_tok_batch *b, const int32_t *logit_rows,
                            int n_logits, pd_err *err);
/* Graph capture of this runner's forwards (pd_graph.h; default PD_GRAPHS_AUTO): batches of
 * up to PD_TARGET_GRAPH_MAX_TOK tokens are padded to a bucket and replayed as one graph per
 * shape. Counters of eager runs, captures and replays go to the out-params (nullable). */
#define PD_TARGET_GRAPH_MAX_TOK 1024
void pd_target_set_graphs(pd_target *t, int mode);
void pd_target_graph_stats(const pd_target *t, uint64_t *eager, uint64_t *captures,
                           uint64_t *replays);
/* Runs so far that were a graph warm-up, capture or stale re-run (pd_graph_cache.n_cold). */
uint64_t pd_target_graph_cold(const pd_target *t);
/* Backend pointers valid until the next forward. */
const float *pd_target_logits(const pd_target *t);      /* [n_logits, vocab] */
const float *pd_target_aux(const pd_target *t);         /* [n_tok, n_taps * hidden] */
const float *pd_target_final_hidden(const pd_target *t); /* [n_logits, hidden] after final norm */
/* Tokens one forward takes now without growing its scratch (a grown buffer moves, and every
 * captured graph that used it is captured again). */
int pd_target_capacity(const pd_target *t);
int pd_target_aux_dim(const pd_target *t);
/* Makes t rank tp's part of a tensor-parallel group (pd_tp.h; borrowed): its model is that
 * rank's shard, row-parallel outputs are all-reduced and the logits all-gathered. */
void pd_target_set_tp(pd_target *t, struct pd_tp_rank *tp);
const pd_qwen3_model *pd_target_model(const pd_target *t);
pd_kv_pool *pd_target_pool(const pd_target *t);

#endif
