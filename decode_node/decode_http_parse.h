/* decode_http_parse.h - the OpenAI request bodies read and checked (decode_http_parse.c).
 * Owns: req_opts (what a request asks beyond its decode_req, and what that points at),
 *   prompt_in (one prompt of a completions request) and the functions that fill them.
 * Not here: the request's context and what becomes of it (decode_http.c).
 * Threading: the HTTP thread. */
#ifndef DECODE_HTTP_PARSE_H
#define DECODE_HTTP_PARSE_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "decode_http_internal.h"

/* What a request asks beyond its decode_req, and what the decode_req points at (the stop
 * strings, logit bias, stop ids and structured output are held here until the request ends). */
typedef struct {
    int n_stop;
    char *stop[MAX_STOP];
    int keep_stop;                   /* include_stop_str_in_output */
    int stream, include_usage;
    int n;                           /* choices */
    int echo, max0;                  /* "echo"; "max_tokens": 0 (with echo only) */
    int tok_ids;                     /* "return_tokens_as_token_ids" (vLLM) */
    int prompt_lp, prompt_lp_top;    /* "prompt_logprobs" asked (not streamed), and its count */
    pd_logit_bias *bias;             /* "logit_bias" (decode_req.logit_bias points here) */
    int vocab;                       /* the model's, to check token ids */
    decode_server *srv;              /* its grammar cache */
    const decode_gen_defaults *gd;          /* the fields' defaults (the model's generation config) */
    int32_t stop_ids[PD_MAX_STOP_IDS];   /* "stop_token_ids" */
    int32_t *allowed;                /* "allowed_token_ids" (vLLM), malloc'd */
    const char *bad_words[DECODE_MAX_BAD_WORDS];   /* "bad_words" (vLLM): the request JSON's */
    char *schema;                    /* structured output: a JSON schema's text, or ... */
    char *regex;                     /* ... a regex, or ... */
    char *ebnf;                      /* ... a GBNF grammar, or ... */
    char **choices;                  /* ... the choices (decode_req points at these) */
    int n_choices;
    int n_guides;                    /* fields that asked for structured output */
    pd_grammar *grammar;             /* theirs, compiled once (decode_req.grammar) */
    const char *guide_param;         /* the (last) one of them */
} req_opts;

/* One prompt of a completions request: its text (borrowed from the request JSON) or its ids. */
typedef struct {
    const char *text;
    size_t len;
    int32_t *ids;                    /* malloc'd */
    int n_ids;
} prompt_in;

/* The sampling fields shared by both endpoints, the stop strings, structured output (compiled
 * here through o->srv's grammar cache) and the rest of what the request asks, into dr and o (o:
 * zeroed, with vocab, srv and gd set, by the caller). 0, or -1 with *param (the field) and
 * msg set. What o holds is the caller's to free with decode_http_opts_free, on either. */
int decode_http_parse_common(const cJSON *root, int chat, decode_req *dr, req_opts *o,
                             const char **param, char *msg, size_t cap);
void decode_http_opts_free(req_opts *o);
/* /v1/completions "prompt": a string, an array of token ids, or an array of either (a batch);
 * at most max of them. *out (calloc'd, the caller frees it with decode_http_prompts_free, even
 * on -1) and *n_out are set; -1 with msg set. */
int decode_http_parse_prompts(const cJSON *root, int max, prompt_in **out, int *n_out, char *msg,
                              size_t cap);
void decode_http_prompts_free(prompt_in *p, int n);
/* dr's prompt becomes p's (borrowed). */
void decode_http_prompt_use(decode_req *dr, const prompt_in *p);
/* A chat request's tools (into t, the caller's to free with pd_chat_tools_free),
 * chat_template_kwargs, add_generation_prompt and continue_final_message (into co); a forced
 * tool call's grammar into o->grammar and dr->grammar (dr NULL: not made). -1 with *param and
 * msg set. */
int decode_http_chat_setup(const cJSON *root, decode_req *dr, req_opts *o, pd_chat_tools *t,
                           pd_chat_opts *co, const char **param, char *msg, size_t cap);
/* The request's body as a JSON object (the caller's to cJSON_Delete), or NULL after answering
 * 400 (not UTF-8, not JSON, not an object) or 500. */
cJSON *decode_http_json_body(struct evhttp_request *req);

#endif
