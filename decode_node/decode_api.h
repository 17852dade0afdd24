/* decode_api.h - the decode node's request-submission API, shared by every front end (the gRPC
 * Generate handler in decode_grpc.c, the OpenAI HTTP API).
 * Owns: the decode server (one engine thread with its pd_loop that owns the pd_engine, the KV
 *   pools, the UCX worker and the prefill-node clients), request admission (validation, KV page
 *   queueing, RESOURCE_EXHAUSTED), streaming detokenization, deadlines, cancellation, and the PD
 *   orchestration (least-loaded prefill node, Prefill RPC with the destination descriptor,
 *   completion or failure of the external prefill).
 * Not here: wire formats (decode_grpc.c, the HTTP module), the engine itself (pd_engine.c).
 * Threading: decode_submit, decode_cancel, decode_handle_release, decode_server_stats and the
 *   decode_server_* accessors may be called from any thread. Every callback (on_token, on_done)
 *   runs on the engine thread and must return quickly without blocking (no blocking I/O; a
 *   non-blocking pd_rpc_stream_write or a pd_loop_post is fine); callbacks must not call
 *   decode_server_destroy.
 *
 * Request lifecycle:
 *   1. decode_submit validates what it can on the caller's thread (prompt empty or longer than
 *      the context, ids outside the vocabulary, bad sampling params -> PD_ERR_INVALID with a
 *      message; no callback runs and *out is not set). On PD_OK the request is queued for the
 *      engine thread and *out is a handle holding one caller reference.
 *   2. On the engine thread: on_token(ud, chunk) for each batch of new tokens (ids + the text
 *      they complete; text may be "" while a UTF-8 sequence is incomplete), then exactly once
 *      on_done(ud, result). result->status is PD_OK for a normal end (finish reason LENGTH/STOP)
 *      or the error: PD_ERR_BUSY (no KV pages after queueing: queue full or waited too long),
 *      PD_ERR_TIMEOUT (deadline), PD_ERR_CANCELLED (decode_cancel), PD_ERR_PEER (its prefill node
 *      failed or timed out), PD_ERR_INVALID (a prefill node rejected it), PD_ERR_INTERNAL.
 *   3. The caller calls decode_handle_release(h) exactly once, from any thread, when it will no
 *      longer call decode_cancel(h) (before or after on_done). decode_cancel after on_done is a
 *      no-op. The pointers inside a chunk / result are valid during the callback only.
 *
 * KV pages of a request are freed when it ends, except that pages a prefill node may still write
 * (a Prefill in flight when the request is cancelled or fails) are held until the Prefill reply
 * or the transfer timeout: never free memory a remote put may still write. */
#ifndef DECODE_API_H
#define DECODE_API_H

#include <stddef.h>
#include <stdint.h>

#include "pd_engine.h"
#include "pd_chat.h"
#include "pd_status.h"
#include "pd_tokenizer.h"

#define DECODE_TRUNC_TEXT_MAX (64 << 20)   /* bytes of a text prompt with truncate_prompt_tokens */
#define DECODE_MAX_BAD_WORDS 64            /* decode_req.bad_words */

typedef struct decode_server decode_server;
typedef struct decode_handle decode_handle;

typedef struct {
    const char *model_dir;          /* target checkpoint (+ tokenizer.json) */
    const char *draft_dir;          /* DSpark checkpoint; NULL: plain target decoding, no
                                     * drafter (--no-draft; prefill nodes ship KV only) */
    const char *device;             /* "cpu" (default) or "cuda" */
    int f32;                        /* cuda: weights and KV cache in fp32 (--dtype f32; default
                                     * bf16); the cpu backend always is fp32 */
    int colocated;                  /* 1: in-process prefill (pd_engine_add) */
    const char *prefill;            /* "HOST:PORT[,HOST:PORT...]" or "file:PATH" (the same
                                     * entries, one or more per line) when !colocated; a host
                                     * that resolves to several addresses counts as several nodes */
    int64_t prefill_refresh_ms;     /* resolve (and read) prefill again this often: new addresses
                                     * become nodes, vanished ones are no longer picked (0 = at
                                     * start only; default 10000) */
    int kv_pages;                   /* target pool pages (0 = engine default) */
    int kv_staging_pages;           /* disaggregated, where prefill nodes cannot put into the KV
                                     * pools (device memory without UCX CUDA support): host pages
                                     * their puts land in, uploaded on the reply; at least the
                                     * longest admissible prompt's pages (0 = the pages of the aux
                                     * arena's rows + max_batch, at most the pool) */
    double kv_mem_fraction;         /* --kv-memory-fraction: pd_engine_config.kv_mem_fraction */
    int64_t swap_bytes;             /* --swap-space: pd_engine_config.swap_bytes (default 4 GiB;
                                     * 0 = every request reserves its worst case, no preemption) */
    int page_size;                  /* tokens per page (0 = 16) */
    int max_batch;                  /* running requests at most (0 = 64) */
    int max_prefill_tokens;         /* colocated: prompt tokens prefilled per engine step, a decode
                                     * round between steps (0 = the engine's 2048) */
    int prefix_cache;               /* pd_engine_config.prefix_cache (disaggregated too: the
                                     * pages prefill nodes send are kept) */
    int max_local_prefill;          /* disaggregated: a prompt whose uncached part is at most this
                                     * many tokens is prefilled here, not on a prefill node; -1 =
                                     * the page size with prefix_cache, else 0 (never) */
    int max_queue;                  /* requests waiting for pages at most (0 = 256) */
    int64_t queue_timeout_ms;       /* longest wait for pages before RESOURCE_EXHAUSTED (0 = 30000) */
    int64_t request_timeout_ms;     /* default deadline per request (0 = none) */
    int64_t transfer_timeout_ms;    /* bound on a Prefill call incl. its KV transfer (0 = 30000) */
    int cp_size;                    /* colocated: context-parallel prefill ranks (0/1 = off) */
    const char *cp_strategy;        /* colocated: NULL = engine default */
    int tp_size;                    /* colocated: tensor-parallel decode ranks (0/1 = off;
                                     * host devices only, pd_tp.h) */
    const char *verify;             /* verification policy: NULL/"full", "threshold", "scheduled"
                                     * (the draft's dspark_calibration.json is used when present;
                                     * scheduled profiles this device's SPS curve at start-up) */
    float verify_threshold;         /* threshold policy: minimum prefix survival (0 = 0.5) */
    int fast_kernels;               /* 1: fastest GPU kernels instead of batch-invariant ones */
    int spec_disable_batch;         /* --speculative-disable-by-batch-size (pd_engine_config's) */
    int graphs;                     /* pd_graph_mode (0 = auto: CUDA graphs where available) */
    int jinja;                      /* --jinja: every chat template through the Jinja subset */
    const char *chat_template;      /* --chat-template: a template file, or the template itself
                                     * (text with "{{" or "{%"), instead of the checkpoint's; NULL:
                                     * the checkpoint's (pd_chat_template_load) */
    int reasoning;                  /* --reasoning-parser qwen3: a chat reply's <think>...</think>
                                     * goes out apart from its content (HTTP reasoning_content, gRPC
                                     * GenerateChunk.reasoning_delta) */
    const char *generation_config;  /* --generation-config: NULL/"auto" (the model's
                                     * generation_config.json, absent is no error), "none", or a
                                     * directory holding one: decode_server_gen_defaults */
    const struct decode_observer *observer;  /* optional, borrowed: sees every request */
} decode_config;

/* The model's recommended sampling (its generation_config.json): what a request that leaves a
 * field out gets (HTTP; gRPC with SamplingParams.model_defaults), as vLLM's --generation-config
 * auto gives it. has_* = 0: the file does not set it. */
typedef struct {
    int has_temp, has_top_p, has_top_k, has_rep, has_max, has_min_p, has_typical_p;
    float temperature, top_p, repetition_penalty, min_p, typical_p;
    int top_k, max_new_tokens;
} decode_gen_defaults;

void decode_config_default(decode_config *cfg);

/* Loads the models and tokenizer, creates the engine, the UCX worker (disaggregated) and the
 * prefill clients, and starts the engine thread. Errors: whatever loading reports
 * (PD_ERR_IO, PD_ERR_INVALID, ...), PD_ERR_NOMEM, PD_ERR_INTERNAL. */
pd_status decode_server_create(const decode_config *cfg, decode_server **out, pd_err *err);
/* Stops accepting work, ends every request (on_done with PD_ERR_CANCELLED), waits for Prefill
 * calls in flight (bounded by the transfer timeout), joins the engine thread, frees. Handles not
 * yet released stay valid for decode_cancel / decode_handle_release. NULL is a no-op. */
void decode_server_destroy(decode_server *s);

/* The chat template that HTTP chat requests and gRPC Generate's messages are rendered by; NULL
 * with *why (a sentence for the client) when chat is unavailable: the checkpoint has none, or it
 * does not parse as Jinja. */
const pd_chat_template *decode_server_chat_template(const decode_server *s, const char **why);
/* decode_config.reasoning */
int decode_server_reasoning(const decode_server *s);
/* The request defaults of decode_config.generation_config (all has_* 0 with "none" or no file);
 * valid until decode_server_destroy. */
const decode_gen_defaults *decode_server_gen_defaults(const decode_server *s);

typedef struct {
    const char *request_id;         /* for logs and echo; NULL/"" = the server assigns one */
    const char *prompt_text;        /* exactly one of prompt_text / prompt_ids */
    size_t prompt_text_len;
    const int32_t *prompt_ids;      /* borrowed; copied by decode_submit */
    int n_prompt_ids;
    int truncate_prompt_tokens;     /* vLLM's: N > 0 keeps only the prompt's last N tokens; -1 its
                                       last tokens that leave max_new_tokens (at least 1) of the
                                       context; 0 = off. Without it a text prompt may
                                       have at most 64 bytes a context token, with it
                                       DECODE_TRUNC_TEXT_MAX */
    float temperature;              /* 0 = greedy; must be finite and >= 0 */
    float top_p;                    /* 0 or 1 = off; else in (0, 1] */
    float min_p;                    /* 0 = off; else in (0, 1] */
    float typical_p;                /* 0 or 1 = off; else in (0, 1) (pd_sample_params) */
    int top_k;                      /* 0 = off */
    uint64_t seed;
    int seed_random;                /* 1: no seed was given (HTTP without "seed", gRPC seed 0):
                                       decode_submit draws one, so that unseeded sampled requests
                                       differ, as in vLLM and OpenAI; seed is then ignored */
    int max_new_tokens;             /* 0 = the rest of the context (decode_server_max_new) */
    int ignore_eos;
    int skip_special;               /* 1: special tokens (<|im_start|>, ...) add no text (vLLM's
                                     * skip_special_tokens, the HTTP default); 0: their content */
    int64_t timeout_ms;             /* deadline from submission; 0 = the server default */
    int verify_policy;              /* pd_verify_policy; PD_VERIFY_DEFAULT (0) = the node's */
    float verify_threshold;         /* threshold policy: (0, 1]; 0 = the node's */
    float presence_penalty;         /* [-2, 2] (pd_gen_params); 0 = off */
    float frequency_penalty;        /* [-2, 2]; 0 = off */
    float repetition_penalty;       /* (0, 10]; 0 or 1 = off */
    const pd_logit_bias *logit_bias;  /* [n_logit_bias], borrowed for the call (copied) */
    int n_logit_bias;
    int min_tokens;                 /* 0..max_new_tokens (its default when that is 0) */
    const int32_t *stop_token_ids;  /* [n_stop_token_ids] (<= PD_MAX_STOP_IDS), borrowed */
    int n_stop_token_ids;
    const int32_t *allowed_token_ids; /* vLLM's: [n_allowed_token_ids] (1..vocab, repeats
                                     * allowed), borrowed; every token is one of them */
    int n_allowed_token_ids;
    const char *const *bad_words;   /* vLLM's: [n_bad_words] (<= DECODE_MAX_BAD_WORDS, each 1..256
                                     * bytes), borrowed; no token sequence of one (as vLLM
                                     * tokenizes it, with and without a leading space) is
                                     * completed in the output */
    int n_bad_words;
    int logprobs;                   /* 1: chunks carry each token's logprob (pd_sample.h) */
    int top_logprobs;               /* with logprobs: and its 0..PD_MAX_TOP_LOGPROBS likeliest */
    int prompt_logprobs;            /* 1: the first chunk carries the prompt's logprobs (not on
                                     * a colocated node with context parallelism) */
    int prompt_top_logprobs;        /* with prompt_logprobs: and each position's
                                     * 0..PD_MAX_TOP_LOGPROBS likeliest */
    /* structured output (pd_grammar.h), at most one: */
    int json_object;                /* 1: any JSON object */
    const char *json_schema;        /* a JSON schema's text ... */
    size_t json_schema_len;
    const char *const *choices;     /* one of these strings ... */
    int n_choices;
    const char *regex;              /* a whole match of this regular expression ... */
    size_t regex_len;
    const char *ebnf;               /* ... or of this GBNF grammar's rule root */
    size_t ebnf_len;
    struct pd_grammar *grammar;     /* or one of them already compiled (borrowed; the request
                                     * takes its own reference) */
    uint64_t group;                 /* 0, or an id shared by requests of one prompt (the choices
                                     * of an "n" request): with the prefix cache the first one
                                     * admitted is prefilled alone and the others wait for its
                                     * first token, then take its prompt pages from the cache */
} decode_req;

typedef struct {
    const char *request_id;
    const int32_t *ids;             /* the new token ids */
    int n_ids;
    const char *text;               /* the text they complete (NUL-terminated, may be "") */
    size_t text_len;
    const size_t *piece_len;        /* [n_ids]: the bytes of text each id completed, in order
                                     * (an id that starts a UTF-8 sequence completes none) */
    const pd_token_logprobs *logprobs;  /* [n_ids] when the request asked for them, else NULL */
    const pd_token_logprobs *prompt_logprobs;  /* first chunk of a request with prompt_logprobs:
                                     * [n_prompt], entry i that of prompt_ids[i] ([0] zeros) */
    const int32_t *prompt_ids;      /* with prompt_logprobs: the prompt as tokenized */
    int n_prompt;
} decode_chunk;

typedef struct {
    const char *request_id;
    pd_status status;               /* see the lifecycle above */
    const char *error;              /* message when status != PD_OK, else "" */
    pd_finish_reason finish;        /* PD_FINISH_STOP = eos, PD_FINISH_LENGTH, ... */
    const char *text_tail;          /* text held back by the detokenizer, flushed at the end */
    size_t text_tail_len;
    const int32_t *tokens;          /* every generated token */
    int n_tokens;
    int prompt_tokens;
    int cached_tokens;              /* of them, served from the prefix cache */
    int rounds;                     /* DSpark verify rounds */
    const int *accepted_per_round;  /* [rounds]: accepted drafts + the bonus (DeepSpec's
                                     * acceptance_length; tau is their mean) */
    double tau;
    int block_size;
    const int *accepted_at_pos;     /* [block_size]: rounds whose draft k was accepted */
    double ttft_ms;                 /* submission -> first token */
    double time_ms;                 /* submission -> end */
    /* where the first token's time went (-1 = the request never got there): */
    double queue_ms;                /* submission -> admitted (pages reserved; the prefill starts) */
    double prefill_call_ms;         /* disaggregated: the last Prefill call, sent -> its reply */
    double prefill_join_ms;         /* disaggregated: that reply -> the first token emitted (the
                                     * engine thread's wait and the staged upload) */
} decode_result;

typedef void (*decode_token_fn)(void *ud, const decode_chunk *chunk);
typedef void (*decode_done_fn)(void *ud, const decode_result *res);

/* An observer of every request of every front end (metrics, request logs), set in
 * decode_config.observer: called on the engine thread right before the request's own on_token /
 * on_done, with the same chunk / result. gap_ms: time since this request's previous chunk, or
 * since submission for its first chunk (first = 1). Same rules as the callbacks. */
typedef struct decode_observer {
    void (*on_token)(void *ud, const decode_chunk *chunk, double gap_ms, int first);
    void (*on_done)(void *ud, const decode_result *res);
    void *ud;
} decode_observer;

/* Submit a request (see the lifecycle above). req and its buffers are borrowed for the call.
 * Errors: PD_ERR_INVALID (bad request, message for the client; also a prompt that can never
 * fit the KV pool or the aux arena), PD_ERR_BUSY (max_queue requests already wait for pages),
 * PD_ERR_CANCELLED (shutting down / draining), PD_ERR_NOMEM. */
pd_status decode_submit(decode_server *s, const decode_req *req, decode_token_fn on_token,
                        decode_done_fn on_done, void *ud, decode_handle **out, pd_err *err);
/* Ask the request to end (client gone). on_done then runs with PD_ERR_CANCELLED unless the
 * request already ended. Any thread; a no-op after on_done. */
void decode_cancel(decode_handle *h);
/* Drop the caller's reference (exactly once per handle). Any thread. NULL is a no-op. */
void decode_handle_release(decode_handle *h);

typedef struct {
    int serving;                    /* 0 while starting or stopping */
    int active_requests;            /* admitted and not ended (incl. prefilling) */
    int queued_requests;            /* waiting for KV pages */
    int free_kv_pages;
    int total_kv_pages;
    int pages_in_use;               /* total - free: includes pages held for in-flight puts */
    int prefill_inflight;           /* Prefill calls in flight */
    int staging_pages;              /* the KV staging pool's pages (0 = no staging) ... */
    int staging_pages_used;         /* ... held by requests (in prefill, or ended with a put
                                     * that may still land) ... */
    uint64_t staging_waits;         /* ... and the requests that waited for them at the head
                                     * of the queue so far */
    uint64_t preemptions;           /* requests preempted so far (--swap-space) ... */
    int swapped_requests;           /* ... preempted now, and the host bytes of their KV ... */
    size_t swap_bytes;
    size_t swap_held;               /* ... and the host memory the swap space holds (pinned on a
                                     * GPU, kept once taken; pd_engine_swap_arena_stats) */
    int disaggregated;              /* 1 unless colocated */
    int prefill_nodes;              /* disaggregated: prefill nodes --prefill resolves to now */
    int prefill_nodes_up;           /* not marked down after a failure (at the update) */
    double prefill_retry_ms;        /* pd_cli_now_ms() clock: when the first down node is tried
                                     * again (a path is usable again from then on) */
} decode_stats;

/* Stop admitting (graceful drain): decode_submit fails with PD_ERR_CANCELLED "draining" and
 * stats.serving becomes 0; admitted requests run to their end. Any thread; idempotent. */
void decode_server_drain(decode_server *s);
/* A snapshot (updated by the engine thread after every change). Any thread. */
void decode_server_stats(decode_server *s, decode_stats *out);
/* The tokenizer the server loaded (immutable; its decode functions may be called from any
 * thread while the server lives). */
const pd_tokenizer *decode_server_tokenizer(const decode_server *s);
/* The structured output req asks for (json_object / json_schema / choices / regex / ebnf),
 * compiled, or the same grammar compiled for an earlier request (the server keeps the last 64
 * by spec; their matchers share masks). PD_ERR_INVALID naming what is wrong. Any thread. */
pd_status decode_compile_guide(decode_server *s, const decode_req *req, struct pd_grammar **out, pd_err *err);
/* That cache (for grammars other front ends build). Any thread. */
struct pd_gcache *decode_server_grammars(decode_server *s);
/* The grammar that forces a chat request's tool calls (t's tool_choice "required" or a named
 * function), from that cache, into *out (NULL, with PD_OK, for the other choices): what both
 * front ends use. guide: the field by which the request also asks for structured output (NULL:
 * none); min_tokens: the request's. PD_ERR_INVALID with *param the field at fault: "tool_choice"
 * (with structured output: both constrain the output), "min_tokens", or "tools" (a tool's
 * parameters do not compile). Any thread. */
pd_status decode_tools_grammar(decode_server *s, const pd_chat_tools *t, const char *guide, int min_tokens,
                               struct pd_grammar **out, const char **param, pd_err *err);
/* The model's vocabulary size (token ids 0..vocab-1). */
int decode_server_vocab(const decode_server *s);
/* The context length: prompt plus generated tokens at most. */
int decode_server_max_ctx(const decode_server *s);
/* "cpu"/"cuda" and "colocated"/"disaggregated", for reports. */
const char *decode_server_device(const decode_server *s);
const char *decode_server_mode(const decode_server *s);

#endif
