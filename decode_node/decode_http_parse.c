/* decode_http_parse.c - the OpenAI request bodies of the decode node's HTTP front end, read
 *   and checked (decode_http_parse.h).
 * Owns: the body as a UTF-8 JSON object, the sampling fields of both endpoints (their defaults
 *   from --generation-config), the fields refused rather than ignored, stop strings, logprobs,
 *   logit bias, structured output (response_format, guided_*, structured_outputs; compiled
 *   here, so that a bad one is answered with its field's name), the prompts of a completions
 *   request, a chat request's tools and template flags. Each check's message names the field.
 * Not here: what becomes of a request (decode_http.c), rendering a chat prompt (pd_chat.c).
 * Threading: the HTTP thread; nothing is touched but the arguments (and the server's grammar
 *   cache, which is thread-safe). */
#include "decode_http_parse.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode_http_reply.h"
#include "pd_chat.h"
#include "pd_grammar.h"
#include "pd_http.h"
#include "pd_json.h"
#include "pd_tokenizer.h"
#include "pd_verify_policy.h"

#define COMPLETIONS_DEFAULT_MAX_TOKENS 16   /* OpenAI's default for /v1/completions */

/* ---------------------------------------------------------------------------------------------
 * Request parsing */

/* Optional field: absent or null -> 0 (untouched); wrong type -> -1 with a message. */
static int get_number(const cJSON *o, const char *k, double *v, char *msg, size_t cap)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    if (it == NULL || cJSON_IsNull(it))
        return 0;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble)) {
        snprintf(msg, cap, "'%s' must be a number", k);
        return -1;
    }
    *v = it->valuedouble;
    return 1;
}

/* An array of lo..hi token ids of a vocabulary of vocab at key k into out: their count (0 when
 * absent or null), or -1 with msg set */
static int get_ids(const cJSON *o, const char *k, int lo, int hi, int vocab, int32_t *out, char *msg,
                   size_t cap)
{
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, k);
    if (a == NULL || cJSON_IsNull(a))
        return 0;
    int n = cJSON_IsArray(a) ? cJSON_GetArraySize(a) : -1;
    if (n < lo || n > hi) {
        snprintf(msg, cap, "'%s' must be an array of %d to %d token ids", k, lo, hi);
        return -1;
    }
    int i = 0;
    for (const cJSON *it = a->child; it != NULL; it = it->next, i++) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
            it->valuedouble >= vocab) {
            snprintf(msg, cap, "'%s'[%d] is not a token id in 0..%d", k, i, vocab - 1);
            return -1;
        }
        out[i] = (int32_t)it->valuedouble;
    }
    return n;
}

static int get_int(const cJSON *o, const char *k, double lo, double hi, long long *v, char *msg,
                   size_t cap)
{
    double d = 0;
    int rc = get_number(o, k, &d, msg, cap);
    if (rc <= 0) {
        if (rc < 0)
            snprintf(msg, cap, "'%s' must be an integer", k);
        return rc;
    }
    if (d != floor(d)) {
        snprintf(msg, cap, "'%s' must be an integer", k);
        return -1;
    }
    if (d < lo || d > hi) {
        snprintf(msg, cap, "'%s' must be in [%.0f, %.0f], got %.0f", k, lo, hi, d);
        return -1;
    }
    *v = (long long)d;
    return 1;
}

static int get_bool(const cJSON *o, const char *k, int *v, char *msg, size_t cap)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    if (it == NULL || cJSON_IsNull(it))
        return 0;
    if (!cJSON_IsBool(it)) {
        snprintf(msg, cap, "'%s' must be a boolean", k);
        return -1;
    }
    *v = cJSON_IsTrue(it);
    return 1;
}

void decode_http_opts_free(req_opts *o)
{
    free(o->bias);
    o->bias = NULL;
    free(o->allowed);
    o->allowed = NULL;
    free(o->schema);
    free(o->regex);
    free(o->ebnf);
    pd_grammar_unref(o->grammar);
    o->grammar = NULL;
    for (int i = 0; i < o->n_choices; i++)
        free(o->choices[i]);
    free(o->choices);
    o->schema = o->regex = o->ebnf = NULL;
    o->choices = NULL;
    o->n_choices = 0;
    for (int i = 0; i < o->n_stop; i++)
        free(o->stop[i]);
    o->n_stop = 0;
}

/* structured output, one field's worth: a JSON schema (an object, or its text), choices (an array
 * of strings) or a regex (a string); the text compiles in decode_submit */
enum { GUIDE_SCHEMA, GUIDE_CHOICE, GUIDE_REGEX, GUIDE_GRAMMAR };

static int guide_set(const cJSON *v, int kind, const char *name, decode_req *dr, req_opts *o, char *msg,
                     size_t cap)
{
    o->guide_param = strchr(name, '.') != NULL && strncmp(name, "response_format", 15) == 0 ? "response_format"
                   : strncmp(name, "structured_outputs", 18) == 0 ? "structured_outputs" : name;
    if (++o->n_guides > 1) {
        snprintf(msg, cap, "'%s': give only one of response_format, guided_json, guided_choice, "
                 "guided_regex, guided_grammar and structured_outputs", name);
        return -1;
    }
    if (kind == GUIDE_SCHEMA) {
        if (cJSON_IsString(v))
            o->schema = strdup(v->valuestring);
        else if (cJSON_IsObject(v))
            o->schema = cJSON_PrintUnformatted(v);
        else {
            snprintf(msg, cap, "'%s' must be a JSON schema (an object, or its text)", name);
            return -1;
        }
        if (o->schema == NULL)
            goto nomem;
        dr->json_schema = o->schema;
        dr->json_schema_len = strlen(o->schema);
        return 0;
    }
    if (kind == GUIDE_GRAMMAR) {
        if (!cJSON_IsString(v)) {
            snprintf(msg, cap, "'%s' must be a string (a GBNF grammar)", name);
            return -1;
        }
        if ((o->ebnf = strdup(v->valuestring)) == NULL)
            goto nomem;
        dr->ebnf = o->ebnf;
        dr->ebnf_len = strlen(o->ebnf);
        return 0;
    }
    if (kind == GUIDE_REGEX) {
        if (!cJSON_IsString(v)) {
            snprintf(msg, cap, "'%s' must be a string (a regular expression)", name);
            return -1;
        }
        if ((o->regex = strdup(v->valuestring)) == NULL)
            goto nomem;
        dr->regex = o->regex;
        dr->regex_len = strlen(o->regex);
        return 0;
    }
    int n = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : 0;
    if (n < 1 || n > PD_GRAMMAR_MAX_CHOICES) {
        snprintf(msg, cap, "'%s' must be an array of 1..%d strings", name, PD_GRAMMAR_MAX_CHOICES);
        return -1;
    }
    if ((o->choices = calloc((size_t)n, sizeof(char *))) == NULL)
        goto nomem;
    for (const cJSON *it = v->child; it != NULL; it = it->next) {
        if (!cJSON_IsString(it)) {
            snprintf(msg, cap, "'%s' must be an array of strings", name);
            return -1;
        }
        if ((o->choices[o->n_choices++] = strdup(it->valuestring)) == NULL)
            goto nomem;
    }
    dr->choices = (const char *const *)o->choices;
    dr->n_choices = n;
    return 0;
nomem:
    snprintf(msg, cap, "out of memory");
    return -1;
}

/* OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
 * {"name", "schema", "strict"}}), vLLM's guided_json / guided_choice / guided_regex /
 * guided_grammar (GBNF) and its structured_outputs {"json" | "choice" | "regex" | "grammar" |
 * "json_object"} */
static int parse_guides(const cJSON *root, decode_req *dr, req_opts *o, const char **param, char *msg,
                        size_t cap)
{
    *param = "response_format";
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(root, "response_format");
    if (rf != NULL && !cJSON_IsNull(rf)) {
        const cJSON *ty = cJSON_IsObject(rf) ? cJSON_GetObjectItemCaseSensitive(rf, "type") : NULL;
        const char *t = cJSON_IsString(ty) ? ty->valuestring : "";
        if (strcmp(t, "json_object") == 0) {
            o->n_guides++;
            o->guide_param = "response_format";
            dr->json_object = 1;
        } else if (strcmp(t, "json_schema") == 0) {
            const cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
            const cJSON *sc = cJSON_IsObject(js) ? cJSON_GetObjectItemCaseSensitive(js, "schema") : NULL;
            if (sc == NULL) {
                snprintf(msg, cap, "'response_format': type json_schema needs json_schema.schema");
                return -1;
            }
            if (guide_set(sc, GUIDE_SCHEMA, "response_format.json_schema.schema", dr, o, msg, cap) < 0)
                return -1;
        } else if (strcmp(t, "text") != 0) {
            snprintf(msg, cap, "'response_format' must be an object whose type is text, json_object or json_schema");
            return -1;
        }
    }
    static const struct { const char *key; int kind; } vllm[] = {
        { "guided_json", GUIDE_SCHEMA }, { "guided_choice", GUIDE_CHOICE }, { "guided_regex", GUIDE_REGEX },
        { "guided_grammar", GUIDE_GRAMMAR },
    };
    for (size_t i = 0; i < sizeof(vllm) / sizeof(vllm[0]); i++) {
        *param = vllm[i].key;
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, vllm[i].key);
        if (v != NULL && !cJSON_IsNull(v) && guide_set(v, vllm[i].kind, vllm[i].key, dr, o, msg, cap) < 0)
            return -1;
    }
    *param = "structured_outputs";
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "structured_outputs");
    if (so != NULL && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so)) {
            snprintf(msg, cap, "'structured_outputs' must be an object");
            return -1;
        }
        static const struct { const char *key, *name; int kind; } keys[] = {
            { "json", "structured_outputs.json", GUIDE_SCHEMA },
            { "choice", "structured_outputs.choice", GUIDE_CHOICE },
            { "regex", "structured_outputs.regex", GUIDE_REGEX },
            { "grammar", "structured_outputs.grammar", GUIDE_GRAMMAR },
        };
        for (const cJSON *it = so->child; it != NULL; it = it->next) {
            if (cJSON_IsNull(it))
                continue;
            int k = -1;
            for (int q = 0; q < 4 && k < 0; q++)
                k = strcmp(it->string, keys[q].key) == 0 ? q : -1;
            if (k >= 0) {
                if (guide_set(it, keys[k].kind, keys[k].name, dr, o, msg, cap) < 0)
                    return -1;
            } else if (strcmp(it->string, "json_object") == 0) {
                if (cJSON_IsTrue(it)) {
                    if (++o->n_guides > 1) {
                        snprintf(msg, cap, "'structured_outputs': give only one kind of structured output");
                        return -1;
                    }
                    o->guide_param = "structured_outputs";
                    dr->json_object = 1;
                }
            } else {
                snprintf(msg, cap, "'structured_outputs.%.40s' is not supported (json, choice, regex, grammar, "
                         "json_object)",
                         it->string);
                return -1;
            }
        }
    }
    if (o->n_guides > 1) {
        snprintf(msg, cap, "give only one of response_format, guided_json, guided_choice, guided_regex, "
                 "guided_grammar and structured_outputs");
        return -1;
    }
    if (o->n_guides == 0)
        return 0;
    if (dr->min_tokens > 0) {
        *param = "min_tokens";
        snprintf(msg, cap, "'min_tokens' cannot be combined with structured output (the grammar decides where "
                 "the output may end)");
        return -1;
    }
    /* compiled here, so that a bad schema or regex is answered with its parameter's name, and
     * once for every choice of the request */
    pd_grammar *g = NULL;
    pd_err gerr;
    pd_status gst = decode_compile_guide(o->srv, dr, &g, &gerr);
    if (gst == PD_OK) {
        o->grammar = dr->grammar = g;
        dr->json_object = 0;
        dr->json_schema = dr->regex = dr->ebnf = NULL;
        dr->choices = NULL;
        dr->n_choices = 0;
    } else {
        *param = o->guide_param;
        snprintf(msg, cap, "%s", gerr.msg);
        return -1;
    }
    return 0;
}

/* The sampling fields shared by both endpoints. Returns 0 or -1 with msg and *param set. */
int decode_http_parse_common(const cJSON *root, int chat, decode_req *dr, req_opts *o,
                             const char **param, char *msg, size_t cap)
{
    double d;
    long long ll;
    int rc, b = 0;
    dr->top_p = 1.0f;
    dr->max_new_tokens = chat ? 0 : COMPLETIONS_DEFAULT_MAX_TOKENS;
    const char *mt = "max_tokens";
    if (chat && cJSON_GetObjectItemCaseSensitive(root, "max_completion_tokens") != NULL &&
        !cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(root, "max_completion_tokens")))
        mt = "max_completion_tokens";
    *param = mt;
    if ((rc = get_int(root, mt, -1e18, 1e18, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (ll < 0 || (ll == 0 && chat)) {
            snprintf(msg, cap, "'%s' must be at least 1, got %lld", mt, ll);
            return -1;
        }
        o->max0 = ll == 0;   /* allowed with echo (scoring a prompt), checked below */
        dr->max_new_tokens = ll == 0 ? 1 : ll > 1000000000 ? 1000000000 : (int)ll;
    } else if (o->gd->has_max) {
        dr->max_new_tokens = o->gd->max_new_tokens;
    }
    *param = "temperature";
    if ((rc = get_number(root, "temperature", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (d < 0 || d > 2) {
            snprintf(msg, cap, "'temperature' must be in [0, 2], got %g", d);
            return -1;
        }
        dr->temperature = (float)d;
    } else {
        dr->temperature = o->gd->has_temp ? o->gd->temperature : 1.0f;   /* the model's, else OpenAI's */
    }
    *param = "top_p";
    if ((rc = get_number(root, "top_p", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (!(d > 0 && d <= 1)) {
            snprintf(msg, cap, "'top_p' must be in (0, 1], got %g", d);
            return -1;
        }
        dr->top_p = (float)d;
    } else if (o->gd->has_top_p) {
        dr->top_p = o->gd->top_p;
    }
    *param = "min_p";   /* extension (vLLM, SGLang, llama.cpp) */
    if ((rc = get_number(root, "min_p", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (!(d >= 0 && d <= 1)) {
            snprintf(msg, cap, "'min_p' must be in [0, 1], got %g", d);
            return -1;
        }
        dr->min_p = (float)d;
    } else if (o->gd->has_min_p) {
        dr->min_p = o->gd->min_p;
    }
    *param = "typical_p";   /* extension (transformers, TGI, llama.cpp); 1 = off */
    if ((rc = get_number(root, "typical_p", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (!(d > 0 && d <= 1)) {
            snprintf(msg, cap, "'typical_p' must be in (0, 1], got %g", d);
            return -1;
        }
        dr->typical_p = (float)d;
    } else if (o->gd->has_typical_p) {
        dr->typical_p = o->gd->typical_p;
    }
    *param = "top_k";   /* extension (vLLM, llama.cpp) */
    if ((rc = get_int(root, "top_k", -1, 1e9, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0)
        dr->top_k = ll < 0 ? 0 : (int)ll;
    else if (o->gd->has_top_k)
        dr->top_k = o->gd->top_k;
    *param = "seed";
    if ((rc = get_int(root, "seed", -9.2e18, 9.2e18, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0)
        dr->seed = (uint64_t)ll;
    dr->seed_random = rc == 0;   /* none given (or null): each request its own */
    *param = "verify";   /* extension: DSpark verification length policy of this request */
    const cJSON *vp = cJSON_GetObjectItemCaseSensitive(root, "verify");
    if (vp != NULL && !cJSON_IsNull(vp)) {
        pd_verify_policy pol;
        pd_err perr;
        if (!cJSON_IsString(vp)) {
            snprintf(msg, cap, "'verify' must be a string: full, threshold or scheduled");
            return -1;
        }
        if (pd_verify_policy_parse(vp->valuestring, &pol, &perr) != PD_OK) {
            snprintf(msg, cap, "'verify': %.400s", perr.msg);
            return -1;
        }
        dr->verify_policy = (int)pol;
    }
    *param = "verify_threshold";
    if ((rc = get_number(root, "verify_threshold", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (!(d > 0 && d <= 1)) {
            snprintf(msg, cap, "'verify_threshold' must be in (0, 1], got %g", d);
            return -1;
        }
        dr->verify_threshold = (float)d;
    }
    /* n choices: n engine requests of the same prompt, choice i sampling with seed + i */
    *param = "n";
    o->n = 1;
    if ((rc = get_int(root, "n", 1, MAX_N, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0)
        o->n = (int)ll;
    *param = "best_of";
    if ((rc = get_int(root, "best_of", -1e18, 1e18, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0 && ll < o->n) {
        snprintf(msg, cap, "'best_of' (%lld) must be >= 'n' (%d)", ll, o->n);
        return -1;
    }
    if (rc > 0 && ll > o->n) {
        snprintf(msg, cap, "'best_of' > 'n' is not supported (it ranks extra completions by "
                 "likelihood and returns n of them)");
        return -1;
    }
    /* fields that would change the answer if they were honoured: refused, not ignored (a number
     * equal to its no-op value, false and [] pass) */
    enum { ONLY_COMPLETIONS, ONLY_CHAT, BOTH };
    static const struct { const char *key, *why; int scope; double noop; } unsupported[] = {
        { "suffix", "'suffix' (text after the insertion) is not supported", ONLY_COMPLETIONS, 0 },
        { "functions", "'functions' (the legacy function calling) is not supported; send 'tools'", ONLY_CHAT, 0 },
        { "function_call", "'function_call' (the legacy function calling) is not supported; send 'tool_choice'",
          ONLY_CHAT, 0 },
        { "use_beam_search", "beam search is not supported", BOTH, 0 },
        { "logits_processors", "'logits_processors' are not supported", BOTH, 0 },
        { "chat_template", "'chat_template' per request is not supported (the node's template is used; "
          "decode_node --chat-template sets it)", ONLY_CHAT, 0 },
    };
    for (size_t k = 0; k < sizeof(unsupported) / sizeof(unsupported[0]); k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, unsupported[k].key);
        if (v == NULL || cJSON_IsNull(v) || cJSON_IsFalse(v) || (cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0) ||
            (cJSON_IsNumber(v) && v->valuedouble == unsupported[k].noop) ||
            (unsupported[k].scope != BOTH && unsupported[k].scope != (chat ? ONLY_CHAT : ONLY_COMPLETIONS)))
            continue;
        *param = unsupported[k].key;
        snprintf(msg, cap, "%s", unsupported[k].why);
        return -1;
    }
    *param = "stream";
    if (get_bool(root, "stream", &o->stream, msg, cap) < 0)
        return -1;
    *param = "ignore_eos";   /* extension (vLLM) */
    if (get_bool(root, "ignore_eos", &b, msg, cap) < 0)
        return -1;
    dr->ignore_eos = b;
    *param = "truncate_prompt_tokens";   /* extension (vLLM): the prompt's last N tokens */
    if ((rc = get_int(root, "truncate_prompt_tokens", -1, 1e9, &ll, msg, cap)) < 0)
        return -1;
    dr->truncate_prompt_tokens = rc > 0 ? (int)ll : 0;
    *param = "skip_special_tokens";   /* extension (vLLM): special tokens add no text unless false */
    b = 1;
    if (get_bool(root, "skip_special_tokens", &b, msg, cap) < 0)
        return -1;
    dr->skip_special = b;
    /* completions: the prompt comes back in front of the text (and, with logprobs, its own
     * logprobs in front of the completion's: scoring a text, as evaluation harnesses do) */
    *param = "return_tokens_as_token_ids";   /* vLLM: logprobs name tokens "token_id:ID" */
    b = 0;
    if (get_bool(root, *param, &b, msg, cap) < 0)
        return -1;
    o->tok_ids = b;
    *param = "echo";
    b = 0;
    if (get_bool(root, "echo", &b, msg, cap) < 0)
        return -1;
    if (b && chat) {
        snprintf(msg, cap, "'echo' applies to /v1/completions only");
        return -1;
    }
    o->echo = b;
    if (b && dr->truncate_prompt_tokens != 0) {
        *param = "truncate_prompt_tokens";
        snprintf(msg, cap, "'truncate_prompt_tokens' cannot be combined with 'echo' (the echoed prompt "
                 "would not be the one the model saw)");
        return -1;
    }
    if (o->max0 && !b) {
        *param = mt;
        snprintf(msg, cap, "'%s' must be at least 1 (0 only with 'echo': true), got 0", mt);
        return -1;
    }
    /* completions: "logprobs": N (0..20) asks for them and the N likeliest; chat: "logprobs":
     * true, and "top_logprobs": N */
    *param = "logprobs";
    if (chat) {
        b = 0;
        if (get_bool(root, "logprobs", &b, msg, cap) < 0)
            return -1;
        dr->logprobs = b;
        *param = "top_logprobs";
        if ((rc = get_int(root, "top_logprobs", 0, PD_MAX_TOP_LOGPROBS, &ll, msg, cap)) < 0)
            return -1;
        if (rc > 0 && !b) {
            snprintf(msg, cap, "'top_logprobs' needs 'logprobs': true");
            return -1;
        }
        dr->top_logprobs = rc > 0 ? (int)ll : 0;
    } else {
        if ((rc = get_int(root, "logprobs", 0, PD_MAX_TOP_LOGPROBS, &ll, msg, cap)) < 0)
            return -1;
        dr->logprobs = rc > 0;
        dr->top_logprobs = rc > 0 ? (int)ll : 0;
        dr->prompt_logprobs = dr->logprobs && o->echo;
    }
    /* vLLM's prompt_logprobs: N (0..20) answers each prompt token's logprob and rank with the N
     * likeliest tokens of its position (decode_http_reply.c writes them); with stream, only 0,
     * which gives nothing (vLLM's rule: streamed chunks have no such field). With echo and
     * logprobs too, one computation serves both, with the longer top list, each cut to its own. */
    *param = "prompt_logprobs";
    if ((rc = get_int(root, "prompt_logprobs", -1e18, 1e18, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0 && (ll < 0 || ll > PD_MAX_TOP_LOGPROBS)) {
        snprintf(msg, cap, "'prompt_logprobs' must be in [0, %d], got %lld%s", PD_MAX_TOP_LOGPROBS, ll,
                 ll == -1 ? " (-1, the whole vocabulary, is not supported)" : "");
        return -1;
    }
    if (rc > 0 && ll > 0 && o->stream) {
        snprintf(msg, cap, "'prompt_logprobs' is not available with 'stream': true (as in vLLM; 0 is "
                 "accepted and gives none)");
        return -1;
    }
    o->prompt_lp = rc > 0 && !o->stream;
    o->prompt_lp_top = o->prompt_lp ? (int)ll : 0;
    dr->prompt_top_logprobs = dr->prompt_logprobs ? dr->top_logprobs : 0;
    if (o->prompt_lp && o->prompt_lp_top > dr->prompt_top_logprobs)
        dr->prompt_top_logprobs = o->prompt_lp_top;
    dr->prompt_logprobs |= o->prompt_lp;
    /* OpenAI's presence/frequency penalties and the repetition penalty (extension, vLLM) */
    const char *pens[] = {"presence_penalty", "frequency_penalty", "repetition_penalty"};
    float *pv[] = {&dr->presence_penalty, &dr->frequency_penalty, &dr->repetition_penalty};
    for (int i = 0; i < 3; i++) {
        *param = pens[i];
        d = i == 2 && o->gd->has_rep ? o->gd->repetition_penalty : 0;
        if (get_number(root, pens[i], &d, msg, cap) < 0)
            return -1;
        float one[3] = {0.0f, 0.0f, 0.0f};
        one[i] = *pv[i] = (float)d;
        pd_err perr;
        if (pd_penalties_check(one[0], one[1], one[2], &perr) != PD_OK) {
            snprintf(msg, cap, "%s", perr.msg);
            return -1;
        }
    }
    /* OpenAI's logit_bias: {"token id": bias in [-100, 100]}; min_tokens (vLLM): no eos before */
    *param = "logit_bias";
    const cJSON *lb = cJSON_GetObjectItemCaseSensitive(root, "logit_bias");
    if (lb != NULL && !cJSON_IsNull(lb)) {
        int n = cJSON_GetArraySize(lb);
        if (!cJSON_IsObject(lb) || n > PD_MAX_LOGIT_BIAS) {
            snprintf(msg, cap, "'logit_bias' must be an object of at most %d \"token id\": bias pairs",
                     PD_MAX_LOGIT_BIAS);
            return -1;
        }
        if (n > 0 && (o->bias = calloc((size_t)n, sizeof(*o->bias))) == NULL) {
            snprintf(msg, cap, "out of memory");
            return -1;
        }
        int i = 0;
        for (const cJSON *it = lb->child; it != NULL; it = it->next, i++) {
            char *end = NULL;
            long id = strtol(it->string, &end, 10);
            if (it->string[0] == '\0' || *end != '\0' || id < 0 || id > INT32_MAX || !cJSON_IsNumber(it)) {
                snprintf(msg, cap, "'logit_bias': \"%.40s\" must be a token id with a number", it->string);
                return -1;
            }
            o->bias[i] = (pd_logit_bias){ .tok = (int32_t)id, .bias = (float)it->valuedouble };
        }
        pd_err berr;
        if (pd_logit_bias_check(o->bias, n, o->vocab, &berr) != PD_OK) {
            snprintf(msg, cap, "%s", berr.msg);
            return -1;
        }
        dr->logit_bias = o->bias;
        dr->n_logit_bias = n;
    }
    *param = "stop_token_ids";   /* extension (vLLM) */
    if ((dr->n_stop_token_ids = get_ids(root, *param, 0, PD_MAX_STOP_IDS, o->vocab, o->stop_ids, msg, cap)) < 0)
        return -1;
    dr->stop_token_ids = o->stop_ids;
    *param = "allowed_token_ids";   /* extension (vLLM): every token one of these */
    const cJSON *ati = cJSON_GetObjectItemCaseSensitive(root, *param);
    int n_at = cJSON_IsArray(ati) ? cJSON_GetArraySize(ati) : 0;
    if (n_at > 0 && (o->allowed = malloc((size_t)n_at * sizeof(int32_t))) == NULL) {
        snprintf(msg, cap, "out of memory for 'allowed_token_ids'");
        return -1;
    }
    if ((dr->n_allowed_token_ids = get_ids(root, *param, 1, o->vocab, o->vocab, o->allowed, msg, cap)) < 0)
        return -1;
    dr->allowed_token_ids = o->allowed;
    *param = "bad_words";   /* extension (vLLM): strings the output never completes */
    const cJSON *bw = cJSON_GetObjectItemCaseSensitive(root, *param);
    if (bw != NULL && !cJSON_IsNull(bw)) {
        int n = cJSON_IsArray(bw) ? cJSON_GetArraySize(bw) : -1;
        if (n < 0 || n > DECODE_MAX_BAD_WORDS) {
            snprintf(msg, cap, "'bad_words' must be an array of at most %d strings", DECODE_MAX_BAD_WORDS);
            return -1;
        }
        int i = 0;
        for (const cJSON *it = bw->child; it != NULL; it = it->next, i++) {
            if (!cJSON_IsString(it)) {
                snprintf(msg, cap, "'bad_words'[%d] is not a string", i);
                return -1;
            }
            o->bad_words[i] = it->valuestring;   /* tokenized by decode_submit (sizes checked there) */
        }
        dr->bad_words = o->bad_words;
        dr->n_bad_words = n;
    }
    *param = "min_tokens";
    if ((rc = get_int(root, "min_tokens", 0, 1e9, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (dr->max_new_tokens > 0 && ll > dr->max_new_tokens) {
            snprintf(msg, cap, "'min_tokens' (%lld) must not exceed the maximum (%d)", ll, dr->max_new_tokens);
            return -1;
        }
        dr->min_tokens = (int)ll;
    }
    if (parse_guides(root, dr, o, param, msg, cap) < 0)
        return -1;
    *param = "stream_options";
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (so != NULL && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so)) {
            snprintf(msg, cap, "'stream_options' must be an object");
            return -1;
        }
        if (get_bool(so, "include_usage", &o->include_usage, msg, cap) < 0)
            return -1;
    }
    *param = "stop";
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(root, "stop");
    if (st != NULL && !cJSON_IsNull(st)) {
        const cJSON *one = cJSON_IsString(st) ? st : NULL;
        if (one == NULL && !cJSON_IsArray(st)) {
            snprintf(msg, cap, "'stop' must be a string or an array of strings");
            return -1;
        }
        int n = one != NULL ? 1 : cJSON_GetArraySize(st);
        if (n > MAX_STOP) {
            snprintf(msg, cap, "'stop' takes at most %d strings", MAX_STOP);
            return -1;
        }
        for (int i = 0; i < n; i++) {
            const cJSON *it = one != NULL ? one : cJSON_GetArrayItem(st, i);
            if (!cJSON_IsString(it)) {
                snprintf(msg, cap, "'stop' must be a string or an array of strings");
                return -1;
            }
            size_t l = strlen(it->valuestring);
            if (l == 0 || l > MAX_STOP_LEN) {
                snprintf(msg, cap, "stop strings must have 1 to %d bytes", MAX_STOP_LEN);
                return -1;
            }
            if ((o->stop[o->n_stop] = strdup(it->valuestring)) == NULL) {
                snprintf(msg, cap, "out of memory");
                return -1;
            }
            o->n_stop++;
        }
    }
    *param = "include_stop_str_in_output";
    if (get_bool(root, "include_stop_str_in_output", &o->keep_stop, msg, cap) < 0)
        return -1;
    *param = NULL;
    return 0;
}

static int parse_one_prompt(const cJSON *p, prompt_in *out, char *msg, size_t cap)
{
    if (cJSON_IsString(p)) {
        if (p->valuestring[0] == '\0') {
            snprintf(msg, cap, "'prompt' must not be empty");
            return -1;
        }
        out->text = p->valuestring;
        out->len = strlen(p->valuestring);
        return 0;
    }
    int n = cJSON_IsArray(p) ? cJSON_GetArraySize(p) : -1;
    if (n < 0) {
        snprintf(msg, cap, "'prompt' must be a string, an array of token ids, or an array of either");
        return -1;
    }
    if (n == 0) {
        snprintf(msg, cap, "'prompt' must not be empty");
        return -1;
    }
    if ((out->ids = malloc((size_t)n * sizeof(int32_t))) == NULL) {
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    int i = 0;
    for (const cJSON *it = p->child; it != NULL; it = it->next, i++) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) ||
            it->valuedouble < 0 || it->valuedouble > 2147483647.0) {
            snprintf(msg, cap, "'prompt' token ids must be non-negative integers");
            return -1;
        }
        out->ids[i] = (int32_t)it->valuedouble;
    }
    out->n_ids = n;
    return 0;
}

/* /v1/completions "prompt": a string, an array of token ids, or an array of either (a batch: the
 * choices of prompt i come after those of prompt i - 1); at most max of them. *out is
 * calloc'd, *n_out set. */
int decode_http_parse_prompts(const cJSON *root, int max, prompt_in **out, int *n_out, char *msg, size_t cap)
{
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    *out = NULL;
    *n_out = 0;
    if (p == NULL || cJSON_IsNull(p)) {
        snprintf(msg, cap, "'prompt' is required");
        return -1;
    }
    int batch = cJSON_IsArray(p) && p->child != NULL && (cJSON_IsString(p->child) || cJSON_IsArray(p->child));
    int n = batch ? cJSON_GetArraySize(p) : 1;
    if (n > max) {
        snprintf(msg, cap, "%d prompts with n=%d make more than %d choices", n, MAX_CHOICES / max, MAX_CHOICES);
        return -1;
    }
    if ((*out = calloc((size_t)n, sizeof(prompt_in))) == NULL) {
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    *n_out = n;
    if (!batch)
        return parse_one_prompt(p, &(*out)[0], msg, cap);
    int i = 0;
    for (const cJSON *it = p->child; it != NULL; it = it->next, i++) {
        if (cJSON_IsString(it) != cJSON_IsString(p->child) || (!cJSON_IsString(it) && !cJSON_IsArray(it))) {
            snprintf(msg, cap, "'prompt' batch entries must all be strings or all be arrays of token ids");
            return -1;
        }
        if (parse_one_prompt(it, &(*out)[i], msg, cap) != 0) {
            char m2[300];
            snprintf(m2, sizeof(m2), "prompt[%d]: %s", i, msg);
            snprintf(msg, cap, "%s", m2);
            return -1;
        }
    }
    return 0;
}

void decode_http_prompts_free(prompt_in *p, int n)
{
    for (int i = 0; p != NULL && i < n; i++)
        free(p[i].ids);
    free(p);
}

void decode_http_prompt_use(decode_req *dr, const prompt_in *p)
{
    dr->prompt_text = p->text;
    dr->prompt_text_len = p->text != NULL ? p->len : 0;
    dr->prompt_ids = p->ids;
    dr->n_prompt_ids = p->ids != NULL ? p->n_ids : 0;
}

/* A chat request's tools, chat_template_kwargs, add_generation_prompt and
 * continue_final_message. tool_choice "required" or a named function forces the call through a
 * grammar (as structured output, so not with it or min_tokens; not made when dr is NULL:
 * /tokenize). -1 with *param and msg set. */
int decode_http_chat_setup(const cJSON *root, decode_req *dr, req_opts *o, pd_chat_tools *t,
                           pd_chat_opts *co, const char **param, char *msg, size_t cap)
{
    static const char *const flags[2] = { "add_generation_prompt", "continue_final_message" };
    for (int k = 0; k < 2; k++) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(root, flags[k]);
        if (f == NULL || cJSON_IsNull(f))
            continue;
        *param = flags[k];
        if (!cJSON_IsBool(f)) {
            snprintf(msg, cap, "'%s' must be a boolean", flags[k]);
            return -1;
        }
        *(k == 0 ? &co->add_generation_prompt : &co->continue_final) = cJSON_IsTrue(f);
    }
    if (co->add_generation_prompt && co->continue_final) {
        snprintf(msg, cap, "'continue_final_message' needs 'add_generation_prompt': false (the prompt ends in the "
                 "last message, not in a new one)");
        return -1;
    }
    *param = "messages";
    if (pd_chat_tools_parse(root, t, param, msg, cap) != 0)
        return -1;
    *param = "chat_template_kwargs";
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(root, "chat_template_kwargs");
    if (kw != NULL && !cJSON_IsNull(kw)) {
        const cJSON *et = cJSON_GetObjectItemCaseSensitive(kw, "enable_thinking");
        if (!cJSON_IsObject(kw) || (et != NULL && !cJSON_IsNull(et) && !cJSON_IsBool(et))) {
            snprintf(msg, cap, "'chat_template_kwargs' must be an object; its enable_thinking a boolean");
            return -1;
        }
        if (cJSON_IsBool(et))
            co->enable_thinking = cJSON_IsTrue(et);
        co->kwargs = kw;   /* a Jinja template sees them all */
    }
    if (dr != NULL) {
        pd_grammar *g = NULL;
        pd_err gerr;
        if (decode_tools_grammar(o->srv, t, o->n_guides > 0 ? o->guide_param : NULL, dr->min_tokens, &g, param,
                                 &gerr) != PD_OK) {
            snprintf(msg, cap, "%s", gerr.msg);
            return -1;
        }
        if (g != NULL)
            o->grammar = dr->grammar = g;
    }
    *param = "messages";
    return 0;
}

/* The request's body as a JSON object, or NULL after answering 400 (why: not UTF-8, not JSON,
 * not an object) or 500. JSON text must be UTF-8 (RFC 8259) and cJSON does not check it, so
 * the bytes are checked first: an error message that quotes a field stays valid JSON. */
cJSON *decode_http_json_body(struct evhttp_request *req)
{
    size_t blen = 0;
    char *body = pd_http_body(req, &blen);
    if (body == NULL) {
        decode_http_send_error(req, 500, NULL, "out of memory reading the body");
        return NULL;
    }
    size_t valid = pd_utf8_valid_prefix(body, blen);
    if (valid != blen) {
        free(body);
        pd_http_error(req, 400, "invalid_request_error", NULL, NULL,
                      "the request body is not valid UTF-8 (byte %zu)", valid);
        return NULL;
    }
    size_t bad = 0;
    cJSON *root = pd_json_parse(body, blen, &bad);
    free(body);
    if (root == NULL) {
        char msg[96];
        snprintf(msg, sizeof(msg), "the request body is not valid JSON (at byte %zu of %zu)", bad, blen);
        decode_http_send_error(req, 400, NULL, msg);
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        decode_http_send_error(req, 400, NULL, "the request body must be a JSON object");
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}
