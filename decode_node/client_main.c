/* client_main.c - pdspark-client: a gRPC client of the decode node's Generate service.
 * Owns: flags, one Generate stream printed as it arrives, the final JSON (the fields of
 *   pdspark-generate --json), and --health (the node's Health reply as JSON).
 * Not here: anything of the server.
 * Threading: single-threaded (pd_rpc's blocking stream). */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_buf.h"
#include "pd_cli.h"
#include "pd_json.h"
#include "pd_proto_version.h"
#include "pd_rpc.h"
#include "pd_tls.h"
#include "pdspark.pb-c.h"

#define PROG "pdspark-client"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pdspark-client --server HOST:PORT (--prompt TEXT | --prompt-ids FILE | --messages FILE\n"
            "                      | --health) [--chat [--system TEXT]] [--thinking on|off]\n"
            "                      [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]\n"
            "                      [--min-p P] [--typical-p P] [--seed S] [--ignore-eos]\n"
            "                      [--skip-special-tokens]\n"
            "                      [--timeout-ms N] [--model-defaults]\n"
            "                      [--request-id ID]\n"
            "                      [--stop STR]... [--json] [--stream] [--disconnect-after N]\n"
            "                      [--verify full|threshold|scheduled] [--verify-threshold T]\n"
            "                      [--logprobs N] [--prompt-logprobs N] [--truncate-prompt-tokens N]\n"
            "                      [--presence-penalty P]\n"
            "                      [--frequency-penalty F] [--repetition-penalty R]\n"
            "                      [--logit-bias ID:BIAS[,...]] [--min-tokens N]\n"
            "                      [--allowed-token-ids ID[,ID...]] [--bad-word WORD]...\n"
            "                      [--json-object | --json-schema FILE | --choice TEXT... | --regex RE\n"
            "                       | --grammar FILE] [--n N]\n"
            "                      [--tools FILE [--tool-choice auto|none|required|NAME]\n"
            "                       [--parallel-tool-calls on|off] [--stream-tool-arguments]]\n"
            "                      [--tls-ca FILE [--tls-cert FILE --tls-key FILE]]\n"
            "\n"
            "Streams one completion from a decode node. Text is printed as it arrives; --json\n"
            "prints instead one object at the end with the fields of pdspark-generate --json\n"
            "(tokens, text, rounds, accepted_per_round, tau, ...); --stream with --json prints\n"
            "both. --health prints the node's Health as JSON. --disconnect-after N drops the\n"
            "connection after N chunks (tests). --verify / --verify-threshold pick this request's\n"
            "DSpark verification policy (default: the node's). --tls-ca FILE (PEM roots) talks\n"
            "TLS to a node run with --tls-cert, verifying its certificate against them and the host\n"
            "named in --server; --tls-cert/--tls-key present a client certificate to a node that\n"
            "asks for one (--tls-client-ca). --chat sends --prompt as a user\n"
            "message (after a --system message), --messages FILE a JSON array of OpenAI chat\n"
            "messages ({\"role\", \"content\"}, an assistant's \"tool_calls\" and\n"
            "\"reasoning_content\", a tool's \"tool_call_id\" and \"name\"); the node renders them with its chat template (the reply\n"
            "is the raw text, <think> included, unless the node splits reasoning off: --json then\n"
            "adds it as \"reasoning\"); --thinking sets enable_thinking. --tools FILE (a JSON array of\n"
            "OpenAI tools) offers the chat tools: the reply's calls are printed as they close, one\n"
            "'[tool call I] NAME ARGUMENTS' line each (--json: \"tool_calls\" as the HTTP API writes\n"
            "them, finish_reason \"tool_calls\"); --tool-choice required forces a call, NAME a call\n"
            "of that function (or give the choice's JSON), none leaves the tools out;\n"
            "--parallel-tool-calls off allows one call at most; --stream-tool-arguments asks for\n"
            "the calls as deltas (stream_tool_arguments): a call's line is printed as its arguments\n"
            "arrive, and the deltas are joined into the same \"tool_calls\". --logprobs N (0..20) asks\n"
            "for each token's logprob, its rank (vLLM's: 1 + the other tokens at least as likely)\n"
            "and its N likeliest alternatives: --json then adds \"logprobs\": [{\"id\", \"logprob\",\n"
            "\"rank\", \"top\": [[id, logprob], ...]}, ...]. --prompt-logprobs N (0..20) asks the\n"
            "same of each prompt token from the second on: --json adds them as \"prompt_logprobs\"\n"
            "(the first prompt token has none). --truncate-prompt-tokens N keeps only the prompt's\n"
            "last N tokens (-1: those that leave --max-new-tokens of the context). --n N (1..16)\n"
            "asks for N choices of the prompt (choice i samples with --seed + i; without --seed, or\n"
            "with 0, the node draws a seed for each request and choice): each one's text is\n"
            "printed when all have ended, after a '[choice i]' line, and --json prints one object per\n"
            "choice and line, with its \"index\" (not with --stream). --model-defaults lets the\n"
            "node fill in the model's generation_config.json values for --temperature, --top-p,\n"
            "--top-k, --min-p, --typical-p, --repetition-penalty and --max-new-tokens where they are\n"
            "not given\n"
            "(without it: greedy, top-p 1, 128 new tokens). Errors print\n"
            "'pdspark-client: CODE: message' and exit 1 (2 for bad flags).\n");
}

/* GenerateRequest.messages of --chat / --messages */
typedef struct {
    Pdspark__ChatMessage *m, **ptr;
    char **calls;                    /* [n] the tool_calls_json of each (malloc'd, NULL: none) */
    int n;
    cJSON *doc;                      /* --messages: the strings point into it */
} chat_turns;

static int turns_alloc(chat_turns *t, int n)
{
    t->m = calloc((size_t)n, sizeof(*t->m));
    t->ptr = calloc((size_t)n, sizeof(*t->ptr));
    t->calls = calloc((size_t)n, sizeof(*t->calls));
    if (t->m == NULL || t->ptr == NULL || t->calls == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        pdspark__chat_message__init(&t->m[i]);
        t->m[i].version = PD_PROTO_VERSION;
        t->ptr[i] = &t->m[i];
    }
    t->n = n;
    return 0;
}

static void turns_free(chat_turns *t)
{
    for (int i = 0; t->calls != NULL && i < t->n; i++)
        free(t->calls[i]);
    free(t->calls);
    free(t->m);
    free(t->ptr);
    cJSON_Delete(t->doc);
}

/* --chat: [system,] user */
static int chat_from_prompt(chat_turns *t, const char *system_text, const char *prompt)
{
    if (turns_alloc(t, system_text != NULL ? 2 : 1) != 0)
        return -1;
    int i = 0;
    if (system_text != NULL) {
        t->m[i].role = "system";
        t->m[i++].content = (char *)system_text;
    }
    t->m[i].role = "user";
    t->m[i].content = (char *)prompt;
    return 0;
}

/* --messages FILE: a JSON array of OpenAI chat messages: {"role": string, "content": string
 * (null or absent: ""), "tool_calls": array, "tool_call_id": string, "name": string,
 * "reasoning_content": string} (the server checks the roles, the order and the calls) */
static int chat_from_file(chat_turns *t, const char *path)
{
    char *text = NULL;
    pd_err err;
    if (pd_cli_read_text(path, &text, &err) != PD_OK) {
        fprintf(stderr, PROG ": --messages: %s\n", err.msg);
        return -1;
    }
    t->doc = pd_json_parse_str(text, NULL);
    free(text);
    int n = cJSON_GetArraySize(t->doc);
    if (!cJSON_IsArray(t->doc) || n == 0) {
        fprintf(stderr, PROG ": --messages %s: not a JSON array of messages\n", path);
        return -1;
    }
    if (turns_alloc(t, n) != 0)
        return -1;
    int i = 0;
    for (const cJSON *m = t->doc->child; m != NULL; m = m->next, i++) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        const cJSON *call_id = cJSON_GetObjectItemCaseSensitive(m, "tool_call_id");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(m, "name");
        const cJSON *rs = cJSON_GetObjectItemCaseSensitive(m, "reasoning_content");
        if (!cJSON_IsString(role) || !(cJSON_IsString(content) || content == NULL || cJSON_IsNull(content)) ||
            !(calls == NULL || cJSON_IsNull(calls) || cJSON_IsArray(calls)) ||
            !(call_id == NULL || cJSON_IsString(call_id)) || !(name == NULL || cJSON_IsString(name)) ||
            !(rs == NULL || cJSON_IsNull(rs) || cJSON_IsString(rs))) {
            fprintf(stderr, PROG ": --messages %s: message %d needs a string \"role\" and \"content\" (or null), "
                    "an array \"tool_calls\", string \"tool_call_id\", \"name\" and \"reasoning_content\"\n",
                    path, i);
            return -1;
        }
        if (cJSON_IsString(rs))
            t->m[i].reasoning_content = rs->valuestring;
        t->m[i].role = role->valuestring;
        if (cJSON_IsString(content))
            t->m[i].content = content->valuestring;
        if (cJSON_IsArray(calls)) {
            if ((t->calls[i] = cJSON_PrintUnformatted(calls)) == NULL) {
                fprintf(stderr, PROG ": out of memory\n");
                return -1;
            }
            t->m[i].tool_calls_json = t->calls[i];
        }
        if (call_id != NULL)
            t->m[i].tool_call_id = call_id->valuestring;
        if (name != NULL)
            t->m[i].name = name->valuestring;
    }
    return 0;
}

/* --tool-choice: a keyword or the choice's JSON as given, a function's name as that JSON (*out
 * malloc'd) */
static int tool_choice_of(const char *arg, char **out)
{
    int word = strcmp(arg, "auto") == 0 || strcmp(arg, "none") == 0 || strcmp(arg, "required") == 0;
    if (word || arg[0] == '{') {
        *out = strdup(arg);
    } else {
        cJSON *o = cJSON_CreateObject();
        cJSON *fn = NULL;
        *out = cJSON_AddStringToObject(o, "type", "function") != NULL &&
               (fn = cJSON_AddObjectToObject(o, "function")) != NULL &&
               cJSON_AddStringToObject(fn, "name", arg) != NULL ? cJSON_PrintUnformatted(o) : NULL;
        cJSON_Delete(o);
    }
    if (*out == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        return -1;
    }
    return 0;
}

typedef struct {
    int32_t *tokens;
    int n, cap;
    char *text;
    size_t len, tcap;
    char *reasoning;                 /* GenerateChunk.reasoning_delta joined (NULL: none came) */
    size_t rlen, rcap;
    cJSON *calls;                    /* GenerateChunk.tool_calls as the HTTP API writes them (NULL:
                                      * none came) */
} acc;

/* a tool call's line, as printed without --json */
static void print_call(int index, const char *name, const char *args)
{
    printf("[tool call %d] %s %s\n", index, name, args);
}

/* A call appended to a->calls as the HTTP API writes one. -1 on NOMEM. */
static int acc_call(acc *a, const char *id, const char *name, const char *args)
{
    if (a->calls == NULL && (a->calls = cJSON_CreateArray()) == NULL)
        return -1;
    cJSON *o = cJSON_CreateObject(), *fn = NULL;
    if (o == NULL || !cJSON_AddItemToArray(a->calls, o) || cJSON_AddStringToObject(o, "id", id) == NULL ||
        cJSON_AddStringToObject(o, "type", "function") == NULL ||
        (fn = cJSON_AddObjectToObject(o, "function")) == NULL ||
        cJSON_AddStringToObject(fn, "name", name != NULL ? name : "") == NULL ||
        cJSON_AddStringToObject(fn, "arguments", args != NULL ? args : "") == NULL)
        return -1;
    return 0;
}

/* A streamed call's delta (stream_tool_arguments) joined into a->calls: its first (an id) adds the
 * call, a later one appends its piece to the arguments of the call of its index. -1 on NOMEM, -2
 * when the delta names no call that came before. */
static int acc_delta(acc *a, const Pdspark__ToolCall *t)
{
    const char *piece = t->arguments_delta != NULL ? t->arguments_delta : "";
    if (t->id != NULL && t->id[0] != '\0') {
        if (t->index != (uint32_t)(a->calls != NULL ? cJSON_GetArraySize(a->calls) : 0))
            return -2;   /* a call's index is its place among the calls */
        return acc_call(a, t->id, t->name, piece);
    }
    cJSON *o = a->calls != NULL && t->index < (uint32_t)cJSON_GetArraySize(a->calls)
             ? cJSON_GetArrayItem(a->calls, (int)t->index) : NULL;
    cJSON *fn = cJSON_GetObjectItemCaseSensitive(o, "function");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
    if (!cJSON_IsString(args))
        return -2;
    char *joined = NULL;
    size_t len = 0, cap = 0;
    cJSON *js = NULL;
    if (pd_buf_append(&joined, &len, &cap, args->valuestring, strlen(args->valuestring)) != 0 ||
        pd_buf_append(&joined, &len, &cap, piece, strlen(piece)) != 0 || (js = cJSON_CreateString(joined != NULL ? joined : "")) == NULL ||
        !cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", js)) {
        cJSON_Delete(js);
        free(joined);
        return -1;
    }
    free(joined);
    return 0;
}

/* -1 on NOMEM, -2 (deltas) on a delta of no call */
static int acc_add(acc *a, const Pdspark__GenerateChunk *c, int deltas)
{
    if (a->n + (int)c->n_token_ids > a->cap) {
        int cap = a->cap ? a->cap : 256;
        while (a->n + (int)c->n_token_ids > cap)
            cap *= 2;
        int32_t *nt = realloc(a->tokens, (size_t)cap * sizeof(int32_t));
        if (nt == NULL)
            return -1;
        a->tokens = nt;
        a->cap = cap;
    }
    for (size_t i = 0; i < c->n_token_ids; i++)
        a->tokens[a->n++] = (int32_t)c->token_ids[i];
    if (c->reasoning_delta != NULL && c->reasoning_delta[0] != '\0' &&
        pd_buf_append(&a->reasoning, &a->rlen, &a->rcap, c->reasoning_delta, strlen(c->reasoning_delta)) != 0)
        return -1;
    for (size_t i = 0; i < c->n_tool_calls; i++) {
        const Pdspark__ToolCall *t = c->tool_calls[i];
        if (deltas) {
            int rc = acc_delta(a, t);
            if (rc != 0)
                return rc;
            continue;
        }
        if (acc_call(a, t->id, t->name, t->arguments_json) != 0)
            return -1;
    }
    return pd_buf_append(&a->text, &a->len, &a->tcap, c->text_delta,
                         c->text_delta != NULL ? strlen(c->text_delta) : 0);
}

/* One choice of the call (GenerateChunk.index) */
typedef struct {
    acc a;
    Pdspark__GenerateChunk *fin;     /* its final chunk */
    cJSON *lps;                      /* --logprobs: its entries */
    cJSON *plps;                     /* --prompt-logprobs: the prompt's entries */
    double t_first;                  /* ms of its first token, -1 before */
} choice;

static const char *finish_str(Pdspark__FinishReason f)
{
    switch (f) {
    case PDSPARK__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case PDSPARK__FINISH_REASON__FINISH_REASON_EOS: return "stop";
    case PDSPARK__FINISH_REASON__FINISH_REASON_STOP: return "stop_string";
    case PDSPARK__FINISH_REASON__FINISH_REASON_CANCELLED: return "cancelled";
    case PDSPARK__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    case PDSPARK__FINISH_REASON__FINISH_REASON_TOOL_CALLS: return "tool_calls";
    default: return "none";
    }
}

static int fail(pd_status st, const pd_err *err)
{
    fprintf(stderr, PROG ": %s: %s\n", pd_rpc_code_str(pd_rpc_code_from(st)),
            err->msg[0] ? err->msg : pd_status_str(st));
    return 1;
}

static int do_health(pd_rpc_channel *ch, int64_t timeout_ms)
{
    Pdspark__HealthRequest rq = PDSPARK__HEALTH_REQUEST__INIT;
    rq.version = PD_PROTO_VERSION;
    ProtobufCMessage *out = NULL;
    pd_err err = {0};
    pd_status st = pd_rpc_unary(ch, "/pdspark.Generate/Health", &rq.base,
                                &pdspark__health_reply__descriptor, timeout_ms, &out, &err);
    if (st != PD_OK)
        return fail(st, &err);
    const Pdspark__HealthReply *r = (const Pdspark__HealthReply *)out;
    printf("{\"serving\":%s,\"node\":\"%s\",\"active_requests\":%u,\"queued_requests\":%u,"
           "\"free_kv_pages\":%u,\"total_kv_pages\":%u,\"pages_in_use\":%u,\"staging_pages_used\":%u,"
           "\"staging_pages_total\":%u,\"staging_waits\":%llu,\"preemptions\":%llu,\"swapped_requests\":%u,"
           "\"swap_bytes\":%llu,\"swap_space_held_bytes\":%llu}\n",
           r->status == PDSPARK__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING ? "true" : "false",
           r->node, r->active_requests, r->queued_requests, r->free_kv_pages, r->total_kv_pages,
           r->total_kv_pages - r->free_kv_pages, r->staging_pages_used, r->staging_pages_total,
           (unsigned long long)r->staging_waits, (unsigned long long)r->preemptions, r->swapped_requests,
           (unsigned long long)r->swap_bytes, (unsigned long long)r->swap_space_held_bytes);
    protobuf_c_message_free_unpacked(out, NULL);
    return 0;
}

/* Appends {"id", "logprob", "rank", "top": [[id, logprob], ...]} for each of l[n] to arr. */
static void lps_json_add(cJSON *arr, Pdspark__TokenLogprobs *const *l, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        cJSON *e = cJSON_CreateObject(), *top = cJSON_CreateArray();
        cJSON_AddNumberToObject(e, "id", l[i]->token_id);
        cJSON_AddNumberToObject(e, "logprob", l[i]->logprob);
        cJSON_AddNumberToObject(e, "rank", l[i]->rank);
        for (size_t j = 0; j < l[i]->n_top_ids && j < l[i]->n_top_logprobs; j++) {
            cJSON *pair = cJSON_CreateArray();
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(l[i]->top_ids[j]));
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(l[i]->top_logprobs[j]));
            cJSON_AddItemToArray(top, pair);
        }
        cJSON_AddItemToObject(e, "top", top);
        cJSON_AddItemToArray(arr, e);
    }
}

/* Prints one choice's result: --json one object (with "index" when index >= 0), else its text
 * (after a '[choice i]' line when index >= 0; streamed already otherwise) and a summary line on
 * stderr. t0: when the call started, ms: how long it took (all choices). */
static void report(choice *c, int index, int json, int logprobs, int prompt_logprobs, double t0, double ms)
{
    const Pdspark__GenerateChunk *fin = c->fin;
    const Pdspark__DSparkStats *ds = fin->stats;
    double tps = ms > 0 ? c->a.n / (ms / 1e3) : 0.0;
    long sum = 0;   /* accepted drafts: tau from the exact counts (the float in the message is rounded) */
    for (size_t i = 0; ds != NULL && i < ds->n_accepted_per_round; i++)
        sum += ds->accepted_per_round[i];
    if (json) {
        cJSON *o = cJSON_CreateObject();
        if (index >= 0)
            cJSON_AddNumberToObject(o, "index", index);
        cJSON *toks = cJSON_AddArrayToObject(o, "tokens");
        for (int i = 0; i < c->a.n; i++)
            cJSON_AddItemToArray(toks, cJSON_CreateNumber(c->a.tokens[i]));
        cJSON_AddStringToObject(o, "text", c->a.text != NULL ? c->a.text : "");
        if (c->a.reasoning != NULL)
            cJSON_AddStringToObject(o, "reasoning", c->a.reasoning);
        if (c->a.calls != NULL) {
            cJSON_AddItemToObject(o, "tool_calls", c->a.calls);
            c->a.calls = NULL;
        }
        uint32_t rounds = ds != NULL ? ds->rounds : 0;
        cJSON_AddNumberToObject(o, "rounds", rounds);
        cJSON *apr = cJSON_AddArrayToObject(o, "accepted_per_round");
        for (size_t i = 0; ds != NULL && i < ds->n_accepted_per_round; i++)
            cJSON_AddItemToArray(apr, cJSON_CreateNumber(ds->accepted_per_round[i]));
        cJSON_AddNumberToObject(o, "tau", rounds > 0 ? (double)sum / rounds : 0.0);
        cJSON *pos = cJSON_AddArrayToObject(o, "acceptance_by_position");
        for (size_t k = 0; ds != NULL && k < ds->n_accepted_at_position; k++)
            cJSON_AddItemToArray(pos, cJSON_CreateNumber(
                rounds > 0 ? (double)ds->accepted_at_position[k] / rounds : 0.0));
        cJSON_AddNumberToObject(o, "prompt_tokens", fin->usage != NULL ? fin->usage->prompt_tokens : 0);
        cJSON_AddNumberToObject(o, "completion_tokens", c->a.n);
        cJSON_AddStringToObject(o, "finish_reason", finish_str(fin->finish_reason));
        cJSON_AddNumberToObject(o, "time_ms", ms);
        cJSON_AddNumberToObject(o, "ttft_ms", c->t_first >= 0 ? c->t_first - t0 : ms);
        cJSON_AddNumberToObject(o, "tokens_per_s", tps);
        cJSON_AddStringToObject(o, "device", fin->device != NULL ? fin->device : "");
        cJSON_AddStringToObject(o, "mode", "dspark");
        cJSON_AddStringToObject(o, "request_id", fin->request_id != NULL ? fin->request_id : "");
        if (logprobs) {
            cJSON_AddItemToObject(o, "logprobs", c->lps);
            c->lps = NULL;
        }
        if (prompt_logprobs) {
            cJSON_AddItemToObject(o, "prompt_logprobs", c->plps);
            c->plps = NULL;
        }
        char *js = cJSON_PrintUnformatted(o);
        puts(js);
        free(js);
        cJSON_Delete(o);
        return;
    }
    if (index >= 0) {
        printf("[choice %d]\n%s\n", index, c->a.text != NULL ? c->a.text : "");
        int k = 0;
        for (const cJSON *t = c->a.calls != NULL ? c->a.calls->child : NULL; t != NULL; t = t->next, k++) {
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
            print_call(k, cJSON_GetObjectItemCaseSensitive(fn, "name")->valuestring,
                       cJSON_GetObjectItemCaseSensitive(fn, "arguments")->valuestring);
        }
        fflush(stdout);
    }
    if (index >= 0)
        fprintf(stderr, PROG ": choice %d: ", index);
    else
        fprintf(stderr, PROG ": ");
    fprintf(stderr, "%u prompt tokens, %d generated (%s) in %.1f ms, %.1f tokens/s",
            fin->usage != NULL ? fin->usage->prompt_tokens : 0, c->a.n, finish_str(fin->finish_reason), ms, tps);
    if (ds != NULL && ds->rounds > 0)
        fprintf(stderr, ", %u rounds, tau %.3f", ds->rounds, (double)sum / ds->rounds);
    fputc('\n', stderr);
}

int main(int argc, char **argv)
{
    if (pd_cli_version_flag(argc, argv, PROG))
        return 0;
    const char *server = NULL, *prompt = NULL, *ids_path = NULL, *req_id = NULL, *system_text = NULL;
    const char *msgs_path = NULL, *tools_path = NULL, *tool_choice = NULL;
    int chat = 0, thinking = 0;   /* thinking: GenerateRequest.enable_thinking */
    int par_tools = 0;            /* GenerateRequest.parallel_tool_calls */
    int stream_args = 0;          /* GenerateRequest.stream_tool_arguments */
    int max_new = 128, top_k = 0, json = 0, stream = 0, ignore_eos = 0, health = 0, skip_special = 0;
    int truncate_n = 0;   /* GenerateRequest.truncate_prompt_tokens (not `truncate`: unistd.h's) */
    int disconnect_after = -1, logprobs = -1, prompt_logprobs = -1, n_choices = 1, model_defaults = 0, max_new_set = 0, top_p_set = 0;
    char *stops[16];
    size_t n_stops = 0;
    int64_t seed = 0, timeout_ms = 0;
    float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f, typical_p = 0.0f, verify_threshold = 0.0f;
    float presence = 0.0f, frequency = 0.0f, repetition = 0.0f;
    pd_logit_bias *bias = NULL;
    int n_bias = 0, min_tokens = 0;
    uint32_t *allowed = NULL;   /* SamplingParams.allowed_token_ids */
    int n_allowed = 0;
    char *bad_words[64];        /* SamplingParams.bad_words (the server checks the count) */
    size_t n_bad_words = 0;
    pd_cli_guide guide = { 0 };
    const char *verify = NULL, *tls_ca = NULL, *tls_cert = NULL, *tls_key = NULL;
    enum { O_SERVER = 256, O_PROMPT, O_IDS, O_MAXNEW, O_TEMP, O_TOPK, O_TOPP, O_SEED, O_IGNORE,
           O_TMO, O_RID, O_JSON, O_STREAM, O_DISC, O_HEALTH, O_STOP, O_VERIFY, O_VTHRESH, O_LOGPROBS,
           O_PRES, O_FREQ, O_REP, O_BIAS, O_ALLOWED, O_BADWORD, O_MINTOK, O_JOBJ, O_JSCHEMA, O_CHOICE, O_REGEX, O_GRAMMAR, O_SKIPSP,
           O_MINP, O_TYPP, O_CHAT, O_SYSTEM, O_THINK, O_MSGS, O_N, O_MODELDEF, O_TOOLS, O_TOOLCH, O_PARTOOLS,
           O_PROMPTLP, O_STREAMARGS, O_TRUNC, O_TLSCA, O_TLSCERT, O_TLSKEY, O_HELP };
    static const struct option opts[] = {
        {"server", required_argument, 0, O_SERVER}, {"prompt", required_argument, 0, O_PROMPT},
        {"prompt-ids", required_argument, 0, O_IDS}, {"max-new-tokens", required_argument, 0, O_MAXNEW},
        {"temperature", required_argument, 0, O_TEMP}, {"top-k", required_argument, 0, O_TOPK},
        {"top-p", required_argument, 0, O_TOPP}, {"seed", required_argument, 0, O_SEED},
        {"min-p", required_argument, 0, O_MINP}, {"typical-p", required_argument, 0, O_TYPP},
        {"chat", no_argument, 0, O_CHAT}, {"system", required_argument, 0, O_SYSTEM},
        {"thinking", required_argument, 0, O_THINK}, {"messages", required_argument, 0, O_MSGS},
        {"ignore-eos", no_argument, 0, O_IGNORE}, {"timeout-ms", required_argument, 0, O_TMO},
        {"skip-special-tokens", no_argument, 0, O_SKIPSP},
        {"request-id", required_argument, 0, O_RID}, {"json", no_argument, 0, O_JSON},
        {"stream", no_argument, 0, O_STREAM}, {"disconnect-after", required_argument, 0, O_DISC},
        {"health", no_argument, 0, O_HEALTH}, {"stop", required_argument, 0, O_STOP},
        {"verify", required_argument, 0, O_VERIFY},
        {"verify-threshold", required_argument, 0, O_VTHRESH},
        {"logprobs", required_argument, 0, O_LOGPROBS},
        {"prompt-logprobs", required_argument, 0, O_PROMPTLP},
        {"truncate-prompt-tokens", required_argument, 0, O_TRUNC},
        {"presence-penalty", required_argument, 0, O_PRES},
        {"frequency-penalty", required_argument, 0, O_FREQ},
        {"repetition-penalty", required_argument, 0, O_REP},
        {"logit-bias", required_argument, 0, O_BIAS}, {"min-tokens", required_argument, 0, O_MINTOK},
        {"allowed-token-ids", required_argument, 0, O_ALLOWED}, {"bad-word", required_argument, 0, O_BADWORD},
        {"json-object", no_argument, 0, O_JOBJ}, {"json-schema", required_argument, 0, O_JSCHEMA},
        {"choice", required_argument, 0, O_CHOICE}, {"regex", required_argument, 0, O_REGEX},
        {"grammar", required_argument, 0, O_GRAMMAR}, {"n", required_argument, 0, O_N},
        {"model-defaults", no_argument, 0, O_MODELDEF},
        {"tools", required_argument, 0, O_TOOLS}, {"tool-choice", required_argument, 0, O_TOOLCH},
        {"parallel-tool-calls", required_argument, 0, O_PARTOOLS},
        {"stream-tool-arguments", no_argument, 0, O_STREAMARGS},
        {"tls-ca", required_argument, 0, O_TLSCA}, {"tls-cert", required_argument, 0, O_TLSCERT},
        {"tls-key", required_argument, 0, O_TLSKEY},
        {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0},
    };
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case O_SERVER: server = optarg; break;
        case O_TLSCA: tls_ca = optarg; break;
        case O_TLSCERT: tls_cert = optarg; break;
        case O_TLSKEY: tls_key = optarg; break;
        case O_PROMPT: prompt = optarg; break;
        case O_IDS: ids_path = optarg; break;
        case O_MAXNEW:
            bad = pd_cli_parse_int(PROG, "--max-new-tokens", optarg, 0, INT_MAX, &max_new);
            max_new_set = 1;
            break;
        case O_TEMP: bad = pd_cli_parse_float(PROG, "--temperature", optarg, &temperature); break;
        case O_TOPK: bad = pd_cli_parse_int(PROG, "--top-k", optarg, 0, INT_MAX, &top_k); break;
        case O_TOPP:
            bad = pd_cli_parse_float(PROG, "--top-p", optarg, &top_p);
            top_p_set = 1;
            break;
        case O_MODELDEF: model_defaults = 1; break;
        case O_MINP: bad = pd_cli_parse_float(PROG, "--min-p", optarg, &min_p); break;
        case O_TYPP: bad = pd_cli_parse_float(PROG, "--typical-p", optarg, &typical_p); break;
        case O_CHAT: chat = 1; break;
        case O_SYSTEM: system_text = optarg; break;
        case O_MSGS: msgs_path = optarg; break;
        case O_THINK:
            if (strcmp(optarg, "on") != 0 && strcmp(optarg, "off") != 0) {
                fprintf(stderr, PROG ": --thinking takes on or off, not '%s'\n", optarg);
                return 2;
            }
            thinking = strcmp(optarg, "on") == 0 ? 2 : 1;
            break;
        case O_TOOLS: tools_path = optarg; break;
        case O_TOOLCH: tool_choice = optarg; break;   /* checked by the server */
        case O_PARTOOLS:
            if (strcmp(optarg, "on") != 0 && strcmp(optarg, "off") != 0) {
                fprintf(stderr, PROG ": --parallel-tool-calls takes on or off, not '%s'\n", optarg);
                return 2;
            }
            par_tools = strcmp(optarg, "on") == 0 ? 2 : 1;
            break;
        case O_STREAMARGS: stream_args = 1; break;
        case O_SEED: bad = pd_cli_parse_i64(PROG, "--seed", optarg, 0, INT64_MAX, &seed); break;
        case O_IGNORE: ignore_eos = 1; break;
        case O_SKIPSP: skip_special = 1; break;
        case O_TMO: bad = pd_cli_parse_i64(PROG, "--timeout-ms", optarg, 0, INT32_MAX, &timeout_ms); break;
        case O_RID: req_id = optarg; break;
        case O_JSON: json = 1; break;
        case O_STREAM: stream = 1; break;
        case O_DISC: bad = pd_cli_parse_int(PROG, "--disconnect-after", optarg, 0, INT_MAX, &disconnect_after); break;
        case O_HEALTH: health = 1; break;
        case O_VERIFY: verify = optarg; break;   /* checked by the server */
        case O_VTHRESH: bad = pd_cli_parse_float(PROG, "--verify-threshold", optarg, &verify_threshold); break;
        case O_PRES: bad = pd_cli_parse_float(PROG, "--presence-penalty", optarg, &presence); break;
        case O_FREQ: bad = pd_cli_parse_float(PROG, "--frequency-penalty", optarg, &frequency); break;
        case O_REP: bad = pd_cli_parse_float(PROG, "--repetition-penalty", optarg, &repetition); break;
        case O_BIAS: bad = pd_cli_parse_logit_bias(PROG, "--logit-bias", optarg, &bias, &n_bias); break;
        case O_ALLOWED:
            bad = pd_cli_parse_ids(PROG, "--allowed-token-ids", optarg, &allowed, &n_allowed);
            break;
        case O_MINTOK: bad = pd_cli_parse_int(PROG, "--min-tokens", optarg, 0, INT_MAX, &min_tokens); break;
        case O_JOBJ: bad = pd_cli_parse_guide(PROG, "--json-object", NULL, &guide); break;
        case O_JSCHEMA: bad = pd_cli_parse_guide(PROG, "--json-schema", optarg, &guide); break;
        case O_CHOICE: bad = pd_cli_parse_guide(PROG, "--choice", optarg, &guide); break;
        case O_REGEX: bad = pd_cli_parse_guide(PROG, "--regex", optarg, &guide); break;
        case O_GRAMMAR: bad = pd_cli_parse_guide(PROG, "--grammar", optarg, &guide); break;
        case O_LOGPROBS: bad = pd_cli_parse_int(PROG, "--logprobs", optarg, 0, 20, &logprobs); break;
        case O_PROMPTLP:
            bad = pd_cli_parse_int(PROG, "--prompt-logprobs", optarg, 0, 20, &prompt_logprobs);
            break;
        case O_TRUNC:
            bad = pd_cli_parse_int(PROG, "--truncate-prompt-tokens", optarg, -1, INT32_MAX, &truncate_n);
            break;
        case O_N: bad = pd_cli_parse_int(PROG, "--n", optarg, 1, 16, &n_choices); break;
        case O_BADWORD:
            if (n_bad_words == sizeof(bad_words) / sizeof(bad_words[0])) {
                fprintf(stderr, PROG ": at most 64 --bad-word words\n");
                return 2;
            }
            bad_words[n_bad_words++] = optarg;
            break;
        case O_STOP:
            if (n_stops == sizeof(stops) / sizeof(stops[0])) {
                fprintf(stderr, PROG ": at most 16 --stop strings\n");
                return 2;
            }
            stops[n_stops++] = optarg;
            break;
        case O_HELP: usage(stdout); return 0;
        default:
            return pd_cli_bad_flag(PROG, argv[optind - 1]);
        }
        if (bad)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, PROG ": unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (server == NULL) {
        fprintf(stderr, PROG ": --server HOST:PORT is required\n");
        return 2;
    }
    if (!health && (prompt != NULL) + (ids_path != NULL) + (msgs_path != NULL) != 1) {
        fprintf(stderr, PROG ": give exactly one of --prompt TEXT, --prompt-ids FILE or --messages FILE\n");
        return 2;
    }
    if ((system_text != NULL && !chat) || (thinking != 0 && !chat && msgs_path == NULL)) {
        fprintf(stderr, PROG ": --system needs --chat, --thinking --chat or --messages\n");
        return 2;
    }
    if ((tools_path != NULL || tool_choice != NULL || par_tools != 0) && !chat && msgs_path == NULL) {
        fprintf(stderr, PROG ": --tools, --tool-choice and --parallel-tool-calls need --chat or --messages\n");
        return 2;
    }
    if (stream_args && tools_path == NULL) {
        fprintf(stderr, PROG ": --stream-tool-arguments needs --tools (it streams their calls)\n");
        return 2;
    }
    if (chat && prompt == NULL) {
        fprintf(stderr, PROG ": --chat sends --prompt TEXT as the user's message\n");
        return 2;
    }
    if (stream && n_choices > 1) {
        fprintf(stderr, PROG ": --stream prints one choice as it arrives, not --n %d of them\n", n_choices);
        return 2;
    }
    if (!json)
        stream = n_choices == 1;   /* several choices: each one's text when all have ended */

    pd_err err = {0};
    pd_tls tls;
    if ((tls_cert != NULL || tls_key != NULL) && tls_ca == NULL) {
        fprintf(stderr, PROG ": --tls-cert/--tls-key present a client certificate over TLS: give --tls-ca too\n");
        return 2;
    }
    if (pd_tls_load(tls_cert, tls_key, tls_ca, NULL, &tls, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return 2;
    }
    pd_status tst = pd_rpc_set_tls(&tls, &err);
    pd_tls_free(&tls);
    if (tst != PD_OK)
        return fail(err.code, &err);
    pd_rpc_channel *ch = NULL;
    if (pd_rpc_channel_create(server, &ch, &err) != PD_OK)
        return fail(err.code, &err);
    if (health) {
        int rc = do_health(ch, timeout_ms > 0 ? timeout_ms : 5000);
        pd_rpc_channel_destroy(ch);
        return rc;
    }
    int32_t *ids = NULL;
    int n_ids = 0;
    if (ids_path != NULL && pd_cli_read_ids(PROG, ids_path, &ids, &n_ids) != 0) {
        pd_rpc_channel_destroy(ch);
        return 2;
    }
    uint32_t *uids = NULL;
    if (n_ids > 0) {
        uids = malloc((size_t)n_ids * sizeof(uint32_t));
        if (uids == NULL) {
            fprintf(stderr, PROG ": out of memory\n");
            return 1;
        }
        for (int i = 0; i < n_ids; i++)
            uids[i] = (uint32_t)ids[i];   /* negative ids wrap and the server refuses them */
    }
    chat_turns turns = {0};
    char *tools_text = NULL, *choice_json = NULL;   /* GenerateRequest.tools_json, tool_choice */
    int bad_in = chat ? chat_from_prompt(&turns, system_text, prompt)
               : msgs_path != NULL ? chat_from_file(&turns, msgs_path) : 0;
    if (bad_in == 0 && tools_path != NULL && pd_cli_read_text(tools_path, &tools_text, &err) != PD_OK) {
        fprintf(stderr, PROG ": --tools: %s\n", err.msg);   /* the node checks what the file says */
        bad_in = -1;
    }
    if (bad_in == 0 && tool_choice != NULL)
        bad_in = tool_choice_of(tool_choice, &choice_json);
    if (bad_in != 0) {
        turns_free(&turns);
        free(tools_text);
        free(uids);
        free(ids);
        pd_rpc_channel_destroy(ch);
        return 2;
    }
    Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
    sp.version = PD_PROTO_VERSION;
    sp.temperature = temperature;
    /* with the model's defaults, what was not given goes as 0: the node fills it in */
    sp.model_defaults = model_defaults;
    sp.top_p = model_defaults && !top_p_set ? 0.0f : top_p;
    sp.min_p = min_p;
    sp.typical_p = typical_p;
    sp.top_k = (uint32_t)top_k;
    sp.seed = (uint64_t)seed;
    sp.max_new_tokens = (uint32_t)(model_defaults && !max_new_set ? 0 : max_new);
    sp.ignore_eos = ignore_eos;
    sp.presence_penalty = presence;
    sp.frequency_penalty = frequency;
    sp.repetition_penalty = repetition;
    sp.min_tokens = (uint32_t)min_tokens;
    sp.json_object = guide.json_object;
    if (guide.schema != NULL)
        sp.json_schema = guide.schema;
    sp.n_choice = (size_t)guide.n_choices;
    sp.choice = guide.choices;
    if (guide.regex != NULL)
        sp.regex = (char *)guide.regex;
    if (guide.grammar != NULL)
        sp.grammar = guide.grammar;
    Pdspark__LogitBias lbm[PD_MAX_LOGIT_BIAS], *lbp[PD_MAX_LOGIT_BIAS];
    for (int i = 0; i < n_bias; i++) {
        pdspark__logit_bias__init(&lbm[i]);
        lbm[i].version = PD_PROTO_VERSION;
        lbm[i].token_id = (uint32_t)bias[i].tok;
        lbm[i].bias = bias[i].bias;
        lbp[i] = &lbm[i];
    }
    sp.n_logit_bias = (size_t)n_bias;
    sp.logit_bias = lbp;
    sp.n_allowed_token_ids = (size_t)n_allowed;
    sp.allowed_token_ids = allowed;
    sp.n_bad_words = n_bad_words;
    sp.bad_words = bad_words;
    sp.n_stop = n_stops;
    sp.stop = stops;
    Pdspark__GenerateRequest rq = PDSPARK__GENERATE_REQUEST__INIT;
    rq.version = PD_PROTO_VERSION;
    rq.request_id = (char *)(req_id != NULL ? req_id : "");
    rq.prompt_text = (char *)(prompt != NULL && !chat ? prompt : "");
    rq.n_messages = (size_t)turns.n;
    rq.messages = turns.ptr;
    rq.enable_thinking = (uint32_t)thinking;
    rq.tools_json = tools_text != NULL ? tools_text : "";
    rq.tool_choice = choice_json != NULL ? choice_json : "";
    rq.parallel_tool_calls = (uint32_t)par_tools;
    rq.stream_tool_arguments = stream_args;
    rq.n_prompt_token_ids = (size_t)n_ids;
    rq.prompt_token_ids = uids;
    rq.sampling = &sp;
    rq.timeout_ms = (uint64_t)timeout_ms;
    rq.return_token_ids = 1;
    rq.return_stats = 1;
    rq.verify_policy = (char *)(verify != NULL ? verify : "");
    rq.verify_threshold = verify_threshold;
    rq.logprobs = logprobs >= 0;
    rq.skip_special_tokens = skip_special;
    rq.top_logprobs = logprobs >= 0 ? (uint32_t)logprobs : 0;
    rq.prompt_logprobs = prompt_logprobs >= 0;
    rq.truncate_prompt_tokens = truncate_n;
    rq.prompt_top_logprobs = prompt_logprobs >= 0 ? (uint32_t)prompt_logprobs : 0;
    rq.n = (uint32_t)n_choices;
    choice *cs = calloc((size_t)n_choices, sizeof(*cs));
    if (cs == NULL) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    for (int i = 0; i < n_choices; i++) {
        cs[i].lps = cJSON_CreateArray();
        cs[i].plps = cJSON_CreateArray();
        cs[i].t_first = -1.0;
    }

    double t0 = pd_cli_now_ms();
    pd_rpc_stream *s = NULL;
    pd_status st = pd_rpc_stream_open(ch, "/pdspark.Generate/Generate", &rq.base,
                                      &pdspark__generate_chunk__descriptor,
                                      timeout_ms > 0 ? timeout_ms + 1000 : 0, &s, &err);
    int rc = 1;
    int chunks = 0, mid_line = 0;   /* --stream: the text printed last did not end a line */
    int call_open = 0;              /* --stream with deltas: a call's line awaits more arguments */
    while (st == PD_OK) {
        ProtobufCMessage *m = NULL;
        st = pd_rpc_stream_read(s, &m, &err);
        if (st != PD_OK || m == NULL)
            break;
        Pdspark__GenerateChunk *ck = (Pdspark__GenerateChunk *)m;
        if (ck->index >= (uint32_t)n_choices) {
            protobuf_c_message_free_unpacked(m, NULL);
            st = pd_err_set(&err, PD_ERR_INTERNAL, "a chunk of choice %u (asked for %d)", ck->index, n_choices);
            break;
        }
        choice *cc = &cs[ck->index];
        if (ck->n_token_ids > 0 && cc->t_first < 0)
            cc->t_first = pd_cli_now_ms();
        lps_json_add(cc->lps, ck->logprobs, ck->n_logprobs);
        lps_json_add(cc->plps, ck->prompt_logprobs, ck->n_prompt_logprobs);
        int arc = acc_add(&cc->a, ck, stream_args);
        if (arc != 0) {
            st = arc == -1 ? pd_err_set(&err, PD_ERR_NOMEM, "out of memory")
                           : pd_err_set(&err, PD_ERR_INTERNAL, "a tool call delta of index %u before its first",
                                        ck->tool_calls[0]->index);
            protobuf_c_message_free_unpacked(m, NULL);
            break;
        }
        if (stream && ck->text_delta != NULL && ck->text_delta[0] != '\0') {
            if (call_open)   /* the call's line ends where other text begins */
                fputc('\n', stdout);
            call_open = 0;
            fputs(ck->text_delta, stdout);
            fflush(stdout);
            mid_line = ck->text_delta[strlen(ck->text_delta) - 1] != '\n';
        }
        for (size_t i = 0; stream && i < ck->n_tool_calls; i++) {
            const Pdspark__ToolCall *t = ck->tool_calls[i];
            if (!stream_args || (t->id != NULL && t->id[0] != '\0')) {
                if (mid_line || call_open)
                    fputc('\n', stdout);
                mid_line = call_open = 0;
            }
            if (!stream_args) {
                print_call((int)t->index, t->name, t->arguments_json);
            } else {
                /* the whole call's line, written as its pieces come */
                if (t->id != NULL && t->id[0] != '\0')
                    printf("[tool call %u] %s ", t->index, t->name);
                fputs(t->arguments_delta != NULL ? t->arguments_delta : "", stdout);
                call_open = 1;
            }
            fflush(stdout);
        }
        chunks++;
        if (ck->final) {
            if (cc->fin != NULL)
                protobuf_c_message_free_unpacked(&cc->fin->base, NULL);
            cc->fin = ck;
        } else {
            protobuf_c_message_free_unpacked(m, NULL);
        }
        if (disconnect_after >= 0 && chunks >= disconnect_after) {
            pd_rpc_stream_cancel(s);
            fprintf(stderr, PROG ": disconnected after %d chunks\n", chunks);
            rc = 0;
            goto out;
        }
    }
    double ms = pd_cli_now_ms() - t0;
    if (st != PD_OK) {
        if (stream)
            fputc('\n', stdout);
        rc = fail(st, &err);
        goto out;
    }
    for (int i = 0; i < n_choices; i++)
        if (cs[i].fin == NULL) {
            fprintf(stderr, PROG ": INTERNAL: the stream ended without a final chunk of choice %d\n", i);
            goto out;
        }
    if (stream) {
        if (call_open)
            fputc('\n', stdout);
        fputc('\n', stdout);
        fflush(stdout);
    }
    for (int i = 0; i < n_choices; i++)
        report(&cs[i], n_choices > 1 ? i : -1, json, logprobs >= 0, prompt_logprobs >= 0, t0, ms);
    rc = 0;
out:
    for (int i = 0; cs != NULL && i < n_choices; i++) {
        if (cs[i].fin != NULL)
            protobuf_c_message_free_unpacked(&cs[i].fin->base, NULL);
        cJSON_Delete(cs[i].lps);
        cJSON_Delete(cs[i].plps);
        free(cs[i].a.tokens);
        free(cs[i].a.text);
        free(cs[i].a.reasoning);
        cJSON_Delete(cs[i].a.calls);
    }
    free(cs);
    pd_rpc_stream_close(s);
    pd_rpc_channel_destroy(ch);
    free(bias);
    free(allowed);
    pd_cli_guide_free(&guide);
    free(uids);
    free(ids);
    turns_free(&turns);
    free(tools_text);
    free(choice_json);
    return rc;
}
