/* pd_engine.h - the DSpark speculative decoding engine over a batch of requests.
 * Owns: request state (prompt, sampling, RNG, target and draft page tables, committed tokens,
 *   per-round acceptance), prefill (chunked, ragged), the decode step (draft all active
 *   requests, verify one ragged batch, accept, commit) and the stop rules.
 * The stop/round rules follow DeepSpec's decoding loop (generate_decoding_sample), so tau
 *   (accepted tokens per round incl. the bonus) is comparable with its reference numbers:
 *   the first token comes from the prefill; a round proposes B drafts for the anchor at
 *   position p and commits the accepted drafts plus the bonus; a stop token among accepted
 *   drafts ends the request without a bonus; the request ends once p >= prompt + max_new.
 * Not here: the network (decode_node/, prefill_node/), tokenization (pd_tokenizer.c).
 * Threading: an engine is driven by one thread. */
#ifndef PD_ENGINE_H
#define PD_ENGINE_H

#include <stdint.h>

#include "pd_cp.h"
#include "pd_dspark.h"
#include "pd_kv.h"
#include "pd_model.h"
#include "pd_qwen3.h"
#include "pd_sample.h"
#include "pd_tp.h"
#include "pd_verify_policy.h"

typedef struct {
    const pd_qwen3_model *target;      /* borrowed */
    const pd_dspark_model *draft;      /* borrowed; NULL = target-only decoding */
    int page_size;                     /* token slots per KV page (default 16) */
    int n_pages;                       /* target pool pages (default: kv_mem_fraction's, else
                                        * two contexts + 64) */
    int draft_n_pages;                 /* draft pool pages (default = n_pages) */
    double kv_mem_fraction;            /* in (0, 1) with n_pages 0: the target and draft pools
                                        * together take this fraction of the device memory that
                                        * is free when the engine is created (after the models
                                        * are loaded), as many pages of each; with cp_size > 1
                                        * every pool on a device (the CP ranks' too) together,
                                        * the fullest device deciding (GPU backends, not with
                                        * tp_size > 1; vLLM's --gpu-memory-utilization, for the
                                        * cache) */
    int block_size;                    /* drafts per round, <= the draft's block size (0 = it) */
    int max_prefill_tokens;            /* tokens per prefill forward (chunking; default 2048) */
    pd_verify_policy verify_policy;    /* for requests that name none (DEFAULT = full) */
    float verify_threshold;            /* threshold policy: minimum prefix survival (0.5 if 0) */
    const pd_calib *calib;             /* confidence calibration (NULL = identity); borrowed */
    const pd_sps *sps;                 /* steps/s curve for the scheduler (NULL = linear model) */
    int spec_disable_batch;            /* > 0: a decode round of more running requests than this
                                        * drafts nothing (every request verifies its anchor only,
                                        * a plain decode step), as vLLM's speculative
                                        * disable_by_batch_size; 0 = always draft */
    int fast_kernels;                  /* 1: decode rounds use the fastest kernels instead of the
                                        * batch-invariant ones (0, default): faster on a GPU, but
                                        * bf16 results then depend on the batch, so greedy
                                        * speculative output may part from greedy decoding at
                                        * near-ties */
    int cp_size;                       /* context-parallel prefill ranks (0 or 1 = plain prefill);
                                        * > 1 runs them as threads of this process, each with its
                                        * own backend handle and KV replica (the target pool is
                                        * rank 0's); decode stays single-rank */
    pd_cp_strategy cp_strategy;        /* how CP splits the prompt tokens (pd_cp.h) */
    const pd_qwen3_model *const *cp_targets; /* [cp_size - 1]: with a device backend, the target
                                        * as loaded on each of ranks 1.. (borrowed; their backends
                                        * are the ranks' backends, used by the rank threads only):
                                        * ranks on distinct devices talk through NCCL, ranks that
                                        * share one through the local communicator with device
                                        * copies. NULL: host backends (each rank gets a handle of
                                        * the target's backend and shares its weights). */
    int graphs;                        /* pd_graph_mode: AUTO (0, default) replays decode, verify
                                        * and draft steps as CUDA graphs per shape bucket where
                                        * the backend has graphs; OFF runs every op eagerly; PAD
                                        * pads batches to the buckets without graphs (tests) */
    int tp_size;                       /* tensor-parallel decode ranks (0 or 1 = none); > 1 splits
                                        * the target's heads, MLP and lm_head (and the drafter's
                                        * lm_head/markov_w2) over that many ranks, run as threads
                                        * of this process with their own backend handle and KV
                                        * shard (host backends only, pd_tp.h). Rank 0 is the
                                        * engine thread and decides every batch; then
                                        * pd_engine_target/draft must not be run directly, and
                                        * external prefills (whose KV would reach rank 0 only) are
                                        * refused. Not with cp_size > 1. */
    int sched_debug_arm;               /* tests only: 0 = the scheduled policy measures and picks
                                        * its arm per round; 1 = always no drafts, 2 = always
                                        * Algorithm 1, 3 = always all drafts (changed between
                                        * steps by pd_engine_set_sched_debug_arm) */
    int sched_probe_always;            /* tests only: a probe candidate (a new scheduled request)
                                        * is probed whatever the controller expects of the
                                        * all-drafts arm, so the probe path runs independently of
                                        * measured timings */
    void *sched_trace;                 /* diagnostics: a FILE * (stdio) that gets one line per
                                        * round of scheduled requests (the arm, its estimates and
                                        * what the round took); NULL = none */
    int pend_max_rows;                 /* tests only: rows of the deferred draft context buffer
                                        * (0: as many as fit in 256 MB, at most 65536), and the
                                        * chunk of recomputed gap rows when less than 1024 */
    int gap_min_batch;                 /* tests only: rounds of at least this many requests
                                        * leave waiting decode rows as gaps (0: 8) */
    int prefix_cache;                  /* 1: keep the full pages of prompts and finished answers
                                        * (target and draft K/V; prompts prefilled here or brought
                                        * by pd_engine_complete_prefill*) and give a later prompt
                                        * that starts with the same tokens those pages instead of
                                        * prefilling them (pd_prefix.h); not with cp_size or
                                        * tp_size > 1 */
    size_t swap_bytes;                 /* host memory for preempted requests' KV (vLLM's
                                        * --swap-space): > 0 admits a request with its prompt's
                                        * pages (and a draft block's) only, and grows its pages
                                        * round by round; when the pool runs out, the running
                                        * request admitted last is preempted: its KV pages (target
                                        * and draft) are copied to host memory bit for bit and
                                        * given back, and it resumes (copied back) before any new
                                        * request is admitted, so its output is the one it would
                                        * have had. 0: every request reserves its worst case
                                        * (prompt + max_new_tokens + a block) at admission and is
                                        * never preempted. With tp_size > 1 every rank's shard of
                                        * the pages moves (PD_TP_KV_COPY). When the swap space is
                                        * full, the victim's KV is given up instead and prefilled
                                        * again before it resumes (vLLM's recompute; its KV then
                                        * comes from the prefill kernels, so on a GPU its later
                                        * tokens may part from the unpreempted ones at a
                                        * near-tie). With cp_size > 1 that prefill runs over the
                                        * CP ranks, as a prompt's does. */
    int swap_arena;                    /* where the host copies live: 0 (default) in an arena of
                                        * the backend's pinned memory on a GPU (the first chunk of
                                        * up to 256 MiB pinned at creation, more as the swap space
                                        * fills, all kept, so a page copy reads and writes them in
                                        * place), in malloc'ed blocks on the CPU; 1 the arena on
                                        * any backend (tests); -1 malloc'ed blocks always */
    int tp_debug_fail_rank;            /* tests only: pd_tp_group_config.debug_fail_rank/cmd */
    int tp_debug_fail_cmd;
    /* Tests and debugging: called on the engine thread with exactly the aux tensor (backend
     * memory, [rows, cols] with row stride ld) the drafter receives from a prefill forward. */
    void (*prefill_aux_hook)(void *ud, const float *aux, int rows, int cols, int ld);
    void *prefill_aux_hook_ud;
    int cp_debug_aux_hidden;           /* tests only: hand the drafter the CP pre-norm hidden
                                        * state instead of the packed aux (the bug the hand-off
                                        * guard exists for); the prefill must then fail */
} pd_engine_config;

#define PD_MAX_STOP_IDS 16

typedef struct pd_grammar pd_grammar;
typedef struct pd_gvocab pd_gvocab;
typedef struct pd_gmatch pd_gmatch;

typedef struct {
    pd_sample_params sample;
    int max_new_tokens;
    int ignore_eos;
    int capture_aux;         /* keep the prompt's packed aux rows in r->aux (prefill nodes) */
    int capture_ctx;         /* keep the prompt's draft context features in r->ctx */
    int hold_kv;             /* keep the KV pages after the request ends, until release */
    pd_verify_policy verify_policy;  /* PD_VERIFY_DEFAULT = the engine's */
    float verify_threshold;  /* <= 0: the engine's */
    int record_confidence;   /* keep each round's confidence logits in r->conf_log (calibration) */
    int logprobs;            /* 1: keep each output token's logprob in r->lps (pd_sample.h: the
                              * target's log_softmax, before temperature and filtering) */
    int top_logprobs;        /* with logprobs: also the 0..PD_MAX_TOP_LOGPROBS most likely tokens
                              * of each position */
    int prompt_logprobs;     /* 1: r->prompt_lps[i] = the logprobs of prompt token i given the
                              * ones before (i >= 1; with prompt_top_logprobs likeliest), from
                              * the prefill's rows (in chunks of at most 256 tokens then; not
                              * with context parallelism); an external prefill brings them
                              * (pd_engine_set_prompt_logprobs) */
    int prompt_top_logprobs; /* with prompt_logprobs: the 0..PD_MAX_TOP_LOGPROBS most likely
                              * tokens of each prompt position (top_logprobs is the output's) */
    /* penalties on the target's logits before every pick (kern_penalty_entry: vLLM's meaning),
     * verify rows included, so speculative decoding stays lossless for the penalised
     * distribution; logprobs are then those of the penalised logits */
    float presence_penalty;  /* [-2, 2]; 0 = off */
    float frequency_penalty; /* [-2, 2]; 0 = off */
    float repetition_penalty;/* (0, 10]; 0 or 1 = off */
    const pd_logit_bias *logit_bias; /* [n_logit_bias] distinct tokens (copied at admission) */
    int n_logit_bias;        /* 0..PD_MAX_LOGIT_BIAS */
    int min_tokens;          /* 0..max_new_tokens: the eos and stop tokens are masked (-inf) while
                              * fewer tokens were generated (ignore_eos or not, as vLLM) */
    int32_t stop_ids[PD_MAX_STOP_IDS]; /* vLLM's stop_token_ids: each ends the request as an eos
                              * does (finish STOP, the token kept in out), ignore_eos or not */
    int n_stop_ids;
    /* structured output (pd_grammar.h): every pick (the first token, every verify row) is
     * masked to the tokens the grammar allows after the output so far and the drafts before
     * the row (kern_token_mask), so greedy speculative decoding stays exactly the masked
     * greedy decoding; eos only where the grammar may end. The engine takes its own reference
     * to grammar; gvocab (of the engine's vocabulary) must outlive the request. Not with
     * min_tokens. */
    pd_grammar *grammar;
    const pd_gvocab *gvocab;
    /* the first token's mask alone (a prefill node: the decode node computed it), words
     * (V + 31) / 32, copied at admission; ignored with grammar */
    const uint32_t *first_allow;
    /* vLLM's allowed_token_ids: every pick (the first token, every verify row, every draft) is
     * masked to these tokens (bit t of word t / 32), with a grammar to those both allow; words
     * (V + 31) / 32, copied at admission. NULL = any. */
    const uint32_t *allow;
    /* vLLM's bad_words as token sequences, each [len, id_1 .. id_len] one after the other
     * (n_bad ints in all; copied at admission): a pick whose output so far (drafts included)
     * ends with id_1 .. id_{len-1} may not be id_len (a one-token word never). NULL = none. */
    const int32_t *bad;
    int n_bad;
} pd_gen_params;

typedef enum {
    PD_FINISH_NONE = 0,      /* still running */
    PD_FINISH_STOP,          /* a stop (eos) token was generated */
    PD_FINISH_LENGTH,        /* max_new_tokens or the context length reached */
    PD_FINISH_CANCELLED,
    PD_FINISH_ERROR
} pd_finish_reason;

const char *pd_finish_reason_str(pd_finish_reason r);

typedef struct pd_engine pd_engine;

/* One request. Fields are read-only for callers; the engine owns the struct. */
typedef struct pd_request {
    uint64_t id;
    int32_t *prompt;
    int n_prompt;
    pd_gen_params params;
    pd_rng rng;
    int32_t *out;            /* generated tokens (the first one comes from prefill) */
    int n_out;
    pd_token_logprobs *lps;  /* [n_out] when params.logprobs: out[i]'s logprobs */
    int cached;              /* prompt tokens whose K/V came from the prefix cache */
    pd_token_logprobs *prompt_lps; /* [n_prompt] when params.prompt_logprobs ([0] is zeros, rank
                              * 0 too: nothing comes before it) */
    pd_logit_bias *bias;     /* the request's copy of params.logit_bias, sorted by token */
    uint32_t *pen;           /* [vocab] with penalties: occurrences in out (bits 0-30) and
                              * whether the prompt holds the token (bit 31) ... */
    int32_t *pen_tok;        /* ... and the tokens whose entry is not 0 */
    int n_pen_tok, cap_pen_tok;
    int n_emitted;           /* tokens already handed out by pd_engine_take_new */
    int *accepted;           /* per round: accepted drafts + bonus (DeepSpec acceptance_length) */
    int n_rounds;
    int accepted_at_pos[32]; /* rounds whose draft k (0-based) was accepted */
    float *aux;              /* [n_prompt, aux_dim] when params.capture_aux */
    float *ctx;              /* [n_prompt, hidden] when params.capture_ctx */
    float *conf_log;         /* [n_conf_rounds, block] when params.record_confidence */
    int n_conf_rounds;       /* rounds recorded (the round's verified length is accepted[]) */
    int *verified;           /* [n_rounds] drafts verified per round */
    pd_finish_reason finish;
    char error[512];
    /* engine-private below */
    int prefilled;           /* prompt tokens prefilled so far */
    int external;            /* prefill comes from outside (pd_engine_add_external) */
    int anchor_pos;          /* position of the last committed token (the anchor) */
    pd_kv_seq tkv, dkv;
    pd_kv_seq *cp_kv;        /* [cp_size - 1] page tables in the CP ranks' KV replicas, held
                              * only while the prompt is being prefilled */
    int cap_out, cap_rounds;
    int n_pend;              /* committed context rows the draft KV still lacks (rounds
                              * without drafts, see pd_engine_ctx.c): rows in the engine's
                              * deferred buffer plus the n_gap rows below */
    int gap_lo, n_gap;       /* positions gap_lo .. gap_lo + n_gap - 1: decode rows of rounds
                              * without drafts, recomputed by a target forward when needed */
    int drafting;            /* it drafts in the current round */
    double acc_tok, acc_rounds; /* its rounds that verified a whole block: committed tokens and
                              * rounds, discounted (the scheduled policy's per-request acceptance) */
    int n_whole;             /* its rounds that verified a whole block */
    int plain_streak;        /* its rounds in a row without drafts */
    int n_probed;            /* times the scheduled policy considered trying it with all drafts */
    int ext_seq;             /* scratch of extend_draft: this request's sequence slot ... */
    uint64_t ext_epoch;      /* ... valid while equal to the engine's extend counter */
    int offered;             /* full pages offered to the prefix cache so far */
    pd_gmatch *gm;           /* params.grammar: where the output so far leaves it ... */
    pd_gmatch *gm_row;       /* ... and a copy walked along the drafter's steps (its picks
                              * masked too), then along the verify block's drafts: one mask
                              * cache serves both, since their states are the same */
    uint32_t *first_allow;   /* the copy of params.first_allow */
    uint32_t *allow;         /* the copy of params.allow */
    int32_t *bad;            /* the copy of params.bad (n_bad ints) */
    void *swap;              /* preempted (pd_engine_config.swap_bytes): its target then draft
                              * KV pages in host memory (pd_kv_seq_copy; then each tensor-
                              * parallel worker's), NULL while it runs */
    size_t swap_bytes;
    int swap_tlen, swap_dlen; /* its tkv.len and dkv.len when it was preempted */
    int recompute;           /* preempted when the swap space was full: its KV given up; 1 waits
                              * for pages, 2 has them and is prefilled again (positions before
                              * its anchor), then it decodes on (0) */
} pd_request;

/* The targets of context-parallel ranks 1..cp_size-1 on a device backend
 * (pd_engine_config.cp_targets): rank r's backend of be0's kind and precision on device
 * r % (visible devices), the target loaded from dir there. One device: every rank on it (the
 * local communicator, device copies); as many devices as ranks: one each (NCCL). */
typedef struct {
    int n;                        /* cp_size: n - 1 entries below */
    kern_backend **be;
    pd_qwen3_model **tm;
} pd_cp_targets;
/* Loads them (nothing for a host backend or cp_size <= 1); the calling thread stays on be0's
 * device. PD_ERR_UNSUPPORTED without a device, load errors. pd_cp_targets_free after use
 * (after the engine that borrows them), also after a failure. */
pd_status pd_cp_targets_load(pd_cp_targets *t, kern_backend *be0, const char *dir, int cp_size,
                             pd_err *err);
void pd_cp_targets_free(pd_cp_targets *t);

pd_status pd_engine_create(const pd_engine_config *cfg, pd_engine **out, pd_err *err);
void pd_engine_destroy(pd_engine *e);

/* Validates and queues a request (prompt ids copied). PD_ERR_INVALID for an empty prompt,
 * an id outside the vocabulary, a prompt that leaves no room in the context, bad sampling
 * params; PD_ERR_BUSY when its prompt cannot get KV pages now. */
pd_status pd_engine_add(pd_engine *e, uint64_t id, const int32_t *prompt, int n_prompt,
                        const pd_gen_params *params, pd_request **out, pd_err *err);
/* Like pd_engine_add, but the prompt's KV and aux come from outside (a prefill node, or any
 * prefill engine writing into this engine's pages): the request reserves its pages and then
 * waits, skipped by the engine's own prefill, until pd_engine_complete_prefill. The KV pages to
 * fill are r->tkv.pages[0..r->tkv.n_pages-1] of pd_engine_target_pool(e), in pd_kv.h layout. */
pd_status pd_engine_add_external(pd_engine *e, uint64_t id, const int32_t *prompt, int n_prompt,
                                 const pd_gen_params *params, pd_request **out, pd_err *err);
/* The external prefill of r is done: its KV pages hold positions 0..n_prompt-1, aux_host holds
 * the packed aux rows [n_prompt, aux_dim] in global token order (NULL when the engine has no
 * draft), and first_token is the token sampled from the last position. The request joins the
 * decode rounds at the next step. PD_ERR_INVALID for a first token outside the vocabulary.
 * A request with params.logprobs gets zeros for the first token's (the _mode form takes them). */
pd_status pd_engine_complete_prefill(pd_engine *e, pd_request *r, int32_t first_token,
                                     const float *aux_host, pd_err *err);

/* What a prefill brings for the drafter (the prefill node's --aux-transfer): RAW = the packed
 * aux rows [n_prompt, aux_dim]; CTX = the context features hidden_norm(fc(aux)) [n_prompt,
 * hidden] (1/K of the bytes); DRAFT_KV = nothing here: the prefill already wrote the draft
 * context K/V of every draft layer into r->dkv's pages of pd_engine_draft_pool (pd_kv.h
 * layout). All three give identical decoding. */
typedef enum { PD_AUX_RAW = 0, PD_AUX_CTX, PD_AUX_DRAFT_KV } pd_aux_mode;
pd_status pd_aux_mode_parse(const char *s, pd_aux_mode *out, pd_err *err);
const char *pd_aux_mode_name(pd_aux_mode m);
/* first_lp: the first token's logprobs as the prefill computed them (nullable: zeros) for a
 * request with params.logprobs; ids outside the vocabulary or n_top beyond the request's
 * top_logprobs are PD_ERR_INVALID. */
pd_status pd_engine_complete_prefill_mode(pd_engine *e, pd_request *r, int32_t first_token,
                                          pd_aux_mode mode, const float *rows_host,
                                          const pd_token_logprobs *first_lp, pd_err *err);
/* An external prefill's prompt logprobs (params.prompt_logprobs): lps[n_prompt] into
 * r->prompt_lps, before pd_engine_complete_prefill. PD_ERR_INVALID for a count other than the
 * prompt's, top ids outside the vocabulary, more tops than the request asked for
 * (prompt_top_logprobs) or a rank outside 0..vocabulary. */
pd_status pd_engine_set_prompt_logprobs(pd_engine *e, pd_request *r, const pd_token_logprobs *lps,
                                        int n, pd_err *err);
/* Ends a request with PD_FINISH_ERROR and msg (e.g. its prefill node failed). */
void pd_engine_fail(pd_engine *e, pd_request *r, const char *msg);
/* Width of one packed aux row (K * hidden; 0 without a draft). */
int pd_engine_aux_dim(const pd_engine *e);
pd_kv_pool *pd_engine_target_pool(pd_engine *e);
pd_kv_pool *pd_engine_draft_pool(pd_engine *e);
/* Measures the target's verify step time for batches of 1..max_tokens tokens on this device
 * (a short sweep at powers of two and midpoints, interpolated, each point the median of a few
 * runs over a context of ctx_len tokens) and builds the smoothed SPS curve of the scheduler.
 * When cache_path is set, a cached curve with the same key is used instead and a new one is
 * saved there. key names the model, device and build. */
pd_status pd_engine_profile_sps(pd_engine *e, int max_tokens, int ctx_len, const char *cache_path,
                                const char *key, pd_sps *out, pd_err *err);
/* pd_engine_profile_sps over max_batch * (B + 1) tokens (max_batch at least 8, fewer when the
 * KV pool cannot hold that many 256-token profile sequences) at a 256-token context, cached in
 * $HOME/.cache/pdspark (or /tmp) under a key of the model's real path, the device name and this
 * build; a cached curve that covers the range is reused. */
pd_status pd_engine_profile_sps_cached(pd_engine *e, const char *model_dir, const char *device,
                                       int max_batch, pd_sps *out, pd_err *err);
/* The prefix cache (pd_engine_config.prefix_cache): pages only it holds (free for the asking),
 * entries, and prompt tokens served from it so far. Zeros without one. */
void pd_engine_prefix_stats(const pd_engine *e, int *evictable, int *entries, uint64_t *hit_tokens);
/* The prompt tokens pd_engine_add would take from the prefix cache for prompt[0..n) (whole
 * pages, never the last token); 0 without a cache. */
int pd_engine_prefix_cached(pd_engine *e, const int32_t *prompt, int n);
/* Steps run eagerly, graphs captured and graph replays so far (target and draft runners). */
void pd_engine_graph_stats(const pd_engine *e, uint64_t *eager, uint64_t *captures, uint64_t *replays);
/* Step shapes warmed up so far (target and draft graph caches: new keys, captures, stale
 * re-runs); with graphs "pad" on the cpu, the new shapes a GPU would capture. */
uint64_t pd_engine_graph_cold(const pd_engine *e);
/* Replaces the scheduler's SPS curve (borrowed; must outlive the engine or the next call). */
void pd_engine_set_sps(pd_engine *e, const pd_sps *sps);
/* The scheduled policy's arm controller (diagnostics: picks per arm, estimates). */
const pd_sched_ctl *pd_engine_sched(const pd_engine *e);
/* Tests: pins the scheduled policy's arm from the next step on (pd_engine_config.sched_debug_arm). */
void pd_engine_set_sched_debug_arm(pd_engine *e, int arm);
/* Host wall seconds spent in each part of pd_engine_step so far (diagnostics; the device runs
 * asynchronously, so a part that downloads also waits for work queued before it). */
typedef struct {
    double step;      /* all of pd_engine_step */
    double prefill;   /* prefill work ... */
    double prefill_target;  /* ... of which the target's forward and first-token download */
    double prefill_draft;   /* ... and the draft context of the prompts (or its deferral) */
    double round;     /* decode rounds, all of them */
    double reserve;   /* page reservation and the arm pick */
    double flush;     /* deferred draft context added before a drafting round */
    double draft;     /* draft block and Markov steps */
    double verify;    /* the target's verify forward and the argmax (or sampled verify) download */
    double commit;    /* acceptance and output bookkeeping */
    double extend;    /* draft context extension or deferral of the committed rows */
    long rounds;      /* decode rounds with at least one request */
    long pend_flushes, pend_compactions;   /* of the deferred draft context buffer */
} pd_engine_times;
const pd_engine_times *pd_engine_phase_times(const pd_engine *e);
/* One engine step: prefill work for queued requests (up to max_prefill_tokens), then one
 * speculative round for every running request. A request that fails ends with
 * PD_FINISH_ERROR and its message; the step itself fails only on an engine-wide error. */
pd_status pd_engine_step(pd_engine *e, pd_err *err);
/* Number of requests not yet finished. */
int pd_engine_active(const pd_engine *e);
/* Tokens generated since the last call (pointer into r->out; count in *n). */
const int32_t *pd_engine_take_new(pd_request *r, int *n);
/* Marks a request cancelled; its pages are freed at the next step or on release. */
void pd_engine_cancel(pd_engine *e, pd_request *r);
/* Frees a finished (or cancelled) request. */
void pd_engine_release(pd_engine *e, pd_request *r);
int pd_engine_kv_free_pages(const pd_engine *e);
/* Preemptions so far (pd_engine_config.swap_bytes), requests preempted now, and the host bytes
 * their KV takes. */
void pd_engine_swap_stats(const pd_engine *e, uint64_t *preemptions, int *swapped, size_t *bytes);
/* Host bytes the swap arena holds (pd_engine_config.swap_arena; pinned on a GPU, kept once
 * taken), of them in use now; 0 and 0 without an arena. */
void pd_engine_swap_arena_stats(const pd_engine *e, size_t *held, size_t *used);
int pd_engine_block_size(const pd_engine *e);
pd_target *pd_engine_target(pd_engine *e);
pd_draft *pd_engine_draft(pd_engine *e);

#endif
