/* decode_http_internal.h - private to decode_http.c and the decode_http_*.c parts it is split
 *   into, as kern_cuda_internal.h is to the .cu files.
 * Owns: struct decode_http (the front end's state), a request's context (http_req) and its
 *   choices (http_choice, lp_tok), the limits on choices and stop strings, and the functions of
 *   decode_http.c that the parts call on a request's context.
 * Not here: the public API (decode_http.h); each part's own functions are declared in its own
 *   header (decode_http_parse.h, decode_http_reply.h).
 * Threading: as decode_http.c says: the HTTP thread owns every http_req field but refs; the
 *   live list is behind decode_http.mu. */
#ifndef DECODE_HTTP_INTERNAL_H
#define DECODE_HTTP_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "decode_api.h"
#include "decode_http.h"
#include "pd_chat.h"
#include "pd_http.h"
#include "pd_status.h"

struct evhttp_request;
struct evhttp_connection;

#define MAX_STOP 4
#define MAX_STOP_LEN 256

struct decode_http {
    decode_server *s;
    pd_http *http;
    decode_metrics *dm;
    char model[256];
    int reasoning;                   /* --reasoning-parser qwen3: <think> text becomes
                                      * reasoning_content */
    char *api_key;                   /* NULL: requests need no key */
    atomic_int draining;
    atomic_int inflight;
    atomic_ullong next_id;
    int closing;                     /* destroy began: messages must not touch evhttp */
    pthread_mutex_t mu;              /* guards the live list */
    struct http_req *live;
    struct resp_store *store;        /* stored Responses (HTTP thread only; NULL: none) */
};

#define MAX_N 16                     /* choices per prompt ("n") */
#define MAX_CHOICES 128              /* choices per request: prompts x n */

/* One choice of a request: an engine request of its own ("n" > 1 runs n of them). */
typedef struct http_choice {
    struct http_req *r;
    int idx;                         /* its "index" in the response */
    decode_handle *h;
    char *gen;                       /* generated text so far (cut at a stop string) */
    size_t gen_len, gen_cap, sent, scan;
    int stopped;                     /* a stop string matched; cancel asked */
    int n_gen;                       /* tokens received (usage when a stop string ended it) */
    struct lp_tok *lps;              /* [n_lps] logprobs of the tokens kept so far ... */
    int n_lps, cap_lps, lp_sent;     /* ... of which the first lp_sent went out in stream events */
    struct lp_tok *plps;             /* [n_plps] with prompt_lp: the prompt's, for its field */
    int n_plps;
    int done;                        /* its result arrived (below) */
    pd_chat_parser *cp;              /* a streamed chat with tools or reasoning: the text split
                                      * into content, reasoning and tool calls as it comes */
    size_t lp_end;                   /* with cp: the logprobs of tokens before here went out */
    const char *finish;              /* "stop" / "length" / "tool_calls" when it ended well */
    int n_tokens, prompt_tokens, cached_tokens, rounds, block_size;
    long accepted;
} http_choice;

#define DECODE_HTTP_XRID_MAX 48     /* X-Request-Id: the reply's id is "chatcmpl-" + it */

typedef struct http_req {
    atomic_int refs;                 /* the HTTP side, and one per engine request */
    decode_http *dh;
    struct evhttp_request *req;      /* NULL once the final reply was handed to evhttp */
    struct evhttp_connection *evcon; /* NULL once the client went away */
    int chat, stream, include_usage;
    int responses;                   /* POST /v1/responses: a chat request answered as a Response */
    struct cJSON *resp_echo;         /* ... the request's fields the response repeats */
    struct resp_state *rs;           /* ... its output items (decode_http_responses.c) */
    struct cJSON *resp_conv;         /* ... its conversation, to store with it (NULL: not kept) */
    int resp_stored;                 /* ... it was stored (store_put took resp_conv) */
    char id[64];                     /* the reply's id: the node's own, or from X-Request-Id */
    char uid[64];                    /* the node's own id, unique per request (tool call ids) */
    long created;
    char *stop[MAX_STOP];
    int n_stop;
    size_t max_stop;
    int keep_stop;                   /* include_stop_str_in_output (vLLM) */
    int started;                     /* SSE headers sent */
    int gone;
    int logprobs, top_logprobs;      /* the request asked for logprobs (and this many likeliest) */
    int prompt_lp, prompt_lp_top;    /* vLLM's prompt_logprobs: asked, and this many likeliest */
    int tok_ids;                     /* return_tokens_as_token_ids: logprobs' tokens as "token_id:ID" */
    int echo, no_gen;                /* echo: every choice's text starts with the prompt (and its
                                      * logprobs with the prompt's); no_gen: max_tokens 0 */
    int tools, reasoning;            /* chat: parse <tool_call> blocks; <think>: pd_chat_parser_create's */
    int n_choice, n_done;            /* choices, and those whose result arrived */
    int n_per_prompt;                /* "n": choices i*n .. i*n+n-1 are those of prompt i */
    http_choice ch[MAX_CHOICES];
    pd_status err_st;                /* the first choice that failed: the request's answer */
    char err_msg[512];
    struct http_req *prev, *next;
} http_req;

/* One generated token's logprobs and where its text starts in http_req.gen. */
typedef struct lp_tok {
    int32_t id;
    size_t off;
    int none;                        /* the prompt's first token: no logprob (null) */
    pd_token_logprobs lp;
} lp_tok;

/* Asks every choice still running to end (the client left, or one choice failed). */
void decode_http_cancel_all(http_req *r);
/* Drops one of r's references (decode_http.c says whose); the last unlinks r and frees it. */
void decode_http_req_unref(http_req *r);
/* The reply is complete (handed to evhttp): detaches r from the connection, drops the HTTP
 * reference. */
void decode_http_req_finish(http_req *r);

#endif
