/* test_services.c - the two services as real processes on loopback: bad input and lifecycle.
 * Bad input (decode_node --colocated and prefill_node): malformed protobuf bytes, a wrong
 *   protocol version, an oversized prompt, token ids outside the vocabulary, bad sampling params,
 *   a layout mismatch in a Prefill descriptor, an unknown id in CancelPrefill, a prompt top
 *   logprobs count past 20 -> INVALID_ARGUMENT / NOT_FOUND with a message, and the next good
 *   request still succeeds.
 * Prompt logprobs (GenerateRequest.prompt_logprobs), colocated and disaggregated: each choice's
 *   first chunk carries n_prompt - 1 entries, the prompt's next tokens, ranked, with the asked
 *   top count (prompt_lps_case).
 * Lifecycle (prefill_node + decode_node): a client that disconnects mid-stream gives its pages
 *   back (Health's free pages return to the baseline); a request past its deadline gets
 *   DEADLINE_EXCEEDED; a prefill node SIGKILLed while prefills are in flight fails only those
 *   requests (UNAVAILABLE, within the deadline) while decoding ones finish, and a prefill node
 *   restarted on the same port is used again.
 * Transfers (prefill_node against a destination in this process): a Prefill whose destination
 *   does not progress waits in its transfer; a CancelPrefill then reaches the running puts and
 *   decides the answer (CANCELLED) once they end; the next Prefill to the same destination,
 *   progressed now, is answered OK with the prompt's KV in the given pages; a destination process
 *   killed while the puts wait for it ends its Prefill UNAVAILABLE soon after, and the node
 *   serves the next one.
 * Tools (decode_node --colocated): tool calling over gRPC (test_services_tools says what).
 * Fuzz (decode_node --colocated): Generate requests with random field values of their own types
 *   (test_services_fuzz) get results or client errors, never a dropped connection.
 * Prefill fuzz (in the transfers part): mutated Prefill requests into a live destination, its
 *   memory claims kept, get results or client errors and never a put outside the pool.
 * Aux transfer modes: prefill_node --aux-transfer ctx|draft-kv without --draft refuses to start
 *   with one clear line; a draft-kv prefill node refuses a descriptor with no draft pool or a
 *   draft layout that differs (INVALID_ARGUMENT). (Decoding through ctx/draft-kv: test_e2e.py.)
 * Every wait here is bounded. Uses the binaries in PD_BIN_DIR and the tiny models. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pd_chat.h"
#include "pd_proto_version.h"
#include "pd_rpc.h"
#include "pd_xfer.h"
#include "pd_xfer_thread.h"
#include "pdspark.pb-c.h"
#include "test_util.h"

#define TARGET PD_MODELS "/tiny-code-qwen3"
#define DRAFT PD_MODELS "/tiny-code-dspark"

typedef struct {
    pid_t pid;
    char addr[64];
} node;

/* Start argv with stdout on a pipe; wait (bounded) for "listening grpc ADDR". */
static int node_start(char *const argv[], node *out)
{
    int fds[2];
    if (pipe(fds) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        setenv("OPENBLAS_NUM_THREADS", "1", 1);
        execv(argv[0], argv);
        _exit(127);
    }
    close(fds[1]);
    char buf[512];
    size_t len = 0;
    double t0 = test_now_ms();
    out->pid = pid;
    out->addr[0] = '\0';
    while (test_now_ms() - t0 < 60000 && len + 1 < sizeof(buf)) {
        struct pollfd p = { .fd = fds[0], .events = POLLIN };
        if (poll(&p, 1, 200) <= 0)
            continue;
        ssize_t n = read(fds[0], buf + len, sizeof(buf) - 1 - len);
        if (n <= 0)
            break;
        len += (size_t)n;
        buf[len] = '\0';
        char *l = strstr(buf, "listening grpc ");
        if (l != NULL && strchr(l, '\n') != NULL) {
            sscanf(l, "listening grpc %63s", out->addr);
            break;
        }
    }
    close(fds[0]);
    if (out->addr[0] == '\0') {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        fprintf(stderr, "%s did not start\n", argv[0]);
        return -1;
    }
    return 0;
}

static void node_stop(node *n, int sig)
{
    if (n->pid <= 0)
        return;
    kill(n->pid, sig);
    double t0 = test_now_ms();
    int status;
    while (waitpid(n->pid, &status, WNOHANG) == 0) {
        if (test_now_ms() - t0 > 30000) {
            kill(n->pid, SIGKILL);
            waitpid(n->pid, &status, 0);
            TEST_CHECK_MSG(0, "node %d did not stop within 30 s", (int)n->pid);
            break;
        }
        usleep(20000);
    }
    n->pid = 0;
}

/* ---- requests ----------------------------------------------------------------------------- */

typedef struct {
    uint32_t *ids;
    size_t n_ids;
    const char *text;
    float temperature, top_p, typical_p;
    uint32_t max_new;
    int ignore_eos;
    uint64_t timeout_ms;
    uint32_t version;         /* 0 = PD_PROTO_VERSION */
    int disconnect_after;     /* > 0: cancel after this many chunks */
    char *stop;               /* one stop string, or NULL */
    Pdspark__ChatMessage **msgs;   /* GenerateRequest.messages */
    size_t n_msgs;
    uint32_t thinking;        /* GenerateRequest.enable_thinking */
    uint32_t n;               /* GenerateRequest.n */
    uint64_t seed;
    const char *tools_json;   /* GenerateRequest.tools_json, tool_choice, parallel_tool_calls */
    const char *tool_choice;
    uint32_t par_tools;
    int prompt_lp;            /* GenerateRequest.prompt_logprobs, with prompt_top_logprobs: */
    uint32_t prompt_top;
    int stream_args;          /* GenerateRequest.stream_tool_arguments: calls[] joins the deltas */
    uint32_t calls_choice;    /* the choice (GenerateRequest.n) whose tool calls go to calls[] */
    const char *request_id;   /* GenerateRequest.request_id (NULL: the server's) */
    const char *regex;        /* SamplingParams.regex (NULL: none) */
    /* results */
    pd_status st;
    char msg[512];
    int chunks, tokens;
    atomic_int decoding;      /* a token arrived (read by other threads while it runs) */
    int finish;               /* finish reason of the final chunk */
    char out[4096];           /* the streamed text */
    char outs[4][1024];       /* the text of choices 0..3 (GenerateRequest.n) */
    int finals;               /* final chunks */
    int bad_index;            /* chunks of a choice past n */
    uint32_t prompt_tokens;   /* the final chunk's usage */
    struct { char id[48], name[64], args[512]; uint32_t index, version; } calls[4];   /* tool calls */
    int n_calls;
    int deltas;               /* ToolCall messages that came (stream_args: deltas) */
    int delta_chunks;         /* chunks that carried any */
    char seq[1024];           /* choice calls_choice's reply as a client reads it: each chunk's
                               * text_delta, then "[CALL name]" for each call it names */
    int delta_bad;            /* ToolCall messages that broke their mode's rules (delta_why: the first) */
    char delta_why[160];
    int plp_n[4];             /* prompt logprobs in the first chunk of choices 0..3 */
    int plp_late;             /* prompt logprobs in any later chunk */
    int plp_bad;              /* entries that broke a rule (plp_why says the first) */
    char plp_why[160];
    double ms;
} gen_call;

/* The prompt logprobs of a choice's first chunk: entry i is prompt token i + 1's (with g->ids),
 * a rank >= 1, a logprob <= 0, g->prompt_top alternatives, most likely first, the likeliest at
 * least as likely as the token. Breaks are counted in g->plp_bad. */
static void prompt_lps_check(gen_call *g, const Pdspark__GenerateChunk *ck)
{
    for (size_t i = 0; i < ck->n_prompt_logprobs; i++) {
        const Pdspark__TokenLogprobs *l = ck->prompt_logprobs[i];
        int ok = l->version == PD_PROTO_VERSION && l->rank >= 1 && l->logprob <= 0.0f &&
                 l->n_top_ids == g->prompt_top && l->n_top_logprobs == g->prompt_top &&
                 (g->ids == NULL || (i + 1 < g->n_ids && l->token_id == g->ids[i + 1])) &&
                 (l->n_top_logprobs == 0 || l->top_logprobs[0] >= l->logprob - 1e-4f);
        for (size_t k = 1; ok && k < l->n_top_logprobs; k++)
            ok = l->top_logprobs[k] <= l->top_logprobs[k - 1];
        if (!ok && g->plp_bad++ == 0)
            snprintf(g->plp_why, sizeof(g->plp_why), "entry %zu: id %u (prompt %u), logprob %g, rank %u, %zu/%zu top",
                     i, l->token_id, g->ids != NULL && i + 1 < g->n_ids ? g->ids[i + 1] : 0, l->logprob, l->rank,
                     l->n_top_ids, l->n_top_logprobs);
    }
}

static void delta_fail(gen_call *g, const char *why, const Pdspark__ToolCall *t)
{
    if (g->delta_bad++ == 0)
        snprintf(g->delta_why, sizeof(g->delta_why), "%s: index %u, id '%s', name '%s', json '%.24s', delta '%.24s'",
                 why, t->index, t->id, t->name, t->arguments_json, t->arguments_delta);
}

/* A chunk's ToolCall messages into g->calls. Whole calls (the default): every field set, no
 * arguments_delta. Deltas (g->stream_args): a call's first names it (id, name) at the next index,
 * later ones only carry its index and the next piece, which is joined to its arguments; never
 * arguments_json, at most one per call in a chunk. */
static void tool_calls_take(gen_call *g, const Pdspark__GenerateChunk *ck)
{
    uint32_t in_chunk = 0;   /* bit i: call i had a delta in this chunk */
    if (ck->index != g->calls_choice)
        return;
    strncat(g->seq, ck->text_delta != NULL ? ck->text_delta : "", sizeof(g->seq) - strlen(g->seq) - 1);
    for (size_t i = 0; i < ck->n_tool_calls; i++)
        if (ck->tool_calls[i]->name != NULL && ck->tool_calls[i]->name[0] != '\0')
            snprintf(g->seq + strlen(g->seq), sizeof(g->seq) - strlen(g->seq), "[CALL %s]",
                     ck->tool_calls[i]->name);
    g->delta_chunks += ck->n_tool_calls > 0;
    for (size_t i = 0; i < ck->n_tool_calls; i++) {
        const Pdspark__ToolCall *t = ck->tool_calls[i];
        g->deltas++;
        if (!g->stream_args) {
            if (t->arguments_delta[0] != '\0' || t->id[0] == '\0' || t->name[0] == '\0')
                delta_fail(g, "whole call with a delta or without its id or name", t);
            if (g->n_calls == 4)
                continue;
            snprintf(g->calls[g->n_calls].id, sizeof(g->calls[0].id), "%s", t->id);
            snprintf(g->calls[g->n_calls].name, sizeof(g->calls[0].name), "%s", t->name);
            snprintf(g->calls[g->n_calls].args, sizeof(g->calls[0].args), "%s", t->arguments_json);
            g->calls[g->n_calls].index = t->index;
            g->calls[g->n_calls].version = t->version;
            g->n_calls++;
            continue;
        }
        if (t->arguments_json[0] != '\0')
            delta_fail(g, "a delta with arguments_json", t);
        if (t->index < 32 && (in_chunk & (1u << t->index)))
            delta_fail(g, "two deltas of one call in a chunk", t);
        in_chunk |= t->index < 32 ? 1u << t->index : 0;
        if (t->id[0] != '\0') {
            if (t->index != (uint32_t)g->n_calls || t->name[0] == '\0') {
                delta_fail(g, "a first delta out of order or without a name", t);
                continue;
            }
            if (g->n_calls == 4)
                continue;
            snprintf(g->calls[g->n_calls].id, sizeof(g->calls[0].id), "%s", t->id);
            snprintf(g->calls[g->n_calls].name, sizeof(g->calls[0].name), "%s", t->name);
            snprintf(g->calls[g->n_calls].args, sizeof(g->calls[0].args), "%s", t->arguments_delta);
            g->calls[g->n_calls].index = t->index;
            g->calls[g->n_calls].version = t->version;
            g->n_calls++;
        } else if (t->index >= (uint32_t)g->n_calls || t->name[0] != '\0') {
            delta_fail(g, "a later delta before its first, or naming the call again", t);
        } else {
            char *a = g->calls[t->index].args;
            strncat(a, t->arguments_delta, sizeof(g->calls[0].args) - strlen(a) - 1);
        }
    }
}

static void gen_run(pd_rpc_channel *ch, gen_call *g)
{
    Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
    sp.version = PD_PROTO_VERSION;
    sp.temperature = g->temperature;
    sp.top_p = g->top_p;
    sp.typical_p = g->typical_p;
    sp.max_new_tokens = g->max_new;
    sp.ignore_eos = g->ignore_eos;
    sp.seed = g->seed;
    sp.regex = (char *)(g->regex != NULL ? g->regex : "");
    if (g->stop != NULL) {
        sp.n_stop = 1;
        sp.stop = &g->stop;
    }
    g->out[0] = '\0';
    memset(g->outs, 0, sizeof(g->outs));
    g->finals = g->bad_index = 0;
    Pdspark__GenerateRequest rq = PDSPARK__GENERATE_REQUEST__INIT;
    rq.version = g->version ? g->version : PD_PROTO_VERSION;
    rq.prompt_text = (char *)(g->text != NULL ? g->text : "");
    rq.n_prompt_token_ids = g->n_ids;
    rq.prompt_token_ids = g->ids;
    rq.sampling = &sp;
    rq.timeout_ms = g->timeout_ms;
    rq.return_token_ids = 1;
    rq.n_messages = g->n_msgs;
    rq.messages = g->msgs;
    rq.enable_thinking = g->thinking;
    rq.n = g->n;
    rq.tools_json = (char *)(g->tools_json != NULL ? g->tools_json : "");
    rq.tool_choice = (char *)(g->tool_choice != NULL ? g->tool_choice : "");
    rq.parallel_tool_calls = g->par_tools;
    rq.prompt_logprobs = g->prompt_lp;
    rq.prompt_top_logprobs = g->prompt_top;
    rq.stream_tool_arguments = g->stream_args;
    rq.request_id = (char *)(g->request_id != NULL ? g->request_id : "");
    g->n_calls = 0;
    g->seq[0] = '\0';
    g->deltas = g->delta_chunks = g->delta_bad = 0;
    g->delta_why[0] = '\0';
    int seen[4] = {0};
    memset(g->plp_n, 0, sizeof(g->plp_n));
    g->plp_late = g->plp_bad = 0;
    pd_err err = {0};
    pd_rpc_stream *s = NULL;
    double t0 = test_now_ms();
    g->st = pd_rpc_stream_open(ch, "/pdspark.Generate/Generate", &rq.base,
                               &pdspark__generate_chunk__descriptor, 60000, &s, &err);
    while (g->st == PD_OK) {
        ProtobufCMessage *m = NULL;
        g->st = pd_rpc_stream_read(s, &m, &err);
        if (g->st != PD_OK || m == NULL)
            break;
        g->chunks++;
        const Pdspark__GenerateChunk *ck = (const Pdspark__GenerateChunk *)m;
        g->tokens += (int)ck->n_token_ids;
        if (g->tokens > 0)
            atomic_store(&g->decoding, 1);
        if (ck->final) {
            g->finish = (int)ck->finish_reason;
            g->finals++;
            g->prompt_tokens = ck->usage != NULL ? ck->usage->prompt_tokens : 0;
        }
        tool_calls_take(g, ck);
        g->bad_index += ck->index >= (g->n > 1 ? g->n : 1);
        if (ck->index < 4 && !seen[ck->index]++) {
            g->plp_n[ck->index] = (int)ck->n_prompt_logprobs;
            prompt_lps_check(g, ck);
        } else {
            g->plp_late += (int)ck->n_prompt_logprobs;
        }
        const char *t = ck->text_delta != NULL ? ck->text_delta : "";
        strncat(g->out, t, sizeof(g->out) - strlen(g->out) - 1);
        if (ck->index < 4)
            strncat(g->outs[ck->index], t, sizeof(g->outs[0]) - strlen(g->outs[ck->index]) - 1);
        protobuf_c_message_free_unpacked(m, NULL);
        if (g->disconnect_after > 0 && g->chunks >= g->disconnect_after) {
            pd_rpc_stream_cancel(s);
            break;
        }
    }
    g->ms = test_now_ms() - t0;
    snprintf(g->msg, sizeof(g->msg), "%s", g->st == PD_OK ? "" : err.msg);
    pd_rpc_stream_close(s);
}

static void prompt_ids(gen_call *g, size_t n, uint32_t seed)
{
    g->ids = malloc(n * sizeof(uint32_t));
    g->n_ids = n;
    for (size_t i = 0; i < n; i++)
        g->ids[i] = 100 + (uint32_t)((i * 2654435761u + seed * 97u) % 7000u);
}

static int health(pd_rpc_channel *ch, Pdspark__HealthReply *out)
{
    Pdspark__HealthRequest rq = PDSPARK__HEALTH_REQUEST__INIT;
    rq.version = PD_PROTO_VERSION;
    ProtobufCMessage *m = NULL;
    pd_err err;
    if (pd_rpc_unary(ch, "/pdspark.Generate/Health", &rq.base, &pdspark__health_reply__descriptor,
                     5000, &m, &err) != PD_OK)
        return -1;
    *out = *(Pdspark__HealthReply *)m;
    out->node = NULL;
    out->message = NULL;
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}

/* Wait (bounded) for the decode node's free pages to reach `want`. Returns the last value. */
static int wait_free_pages(pd_rpc_channel *ch, uint32_t want, int ms)
{
    double t0 = test_now_ms();
    Pdspark__HealthReply h = PDSPARK__HEALTH_REPLY__INIT;
    int last = -1;
    while (test_now_ms() - t0 < ms) {
        if (health(ch, &h) == 0) {
            last = (int)h.free_kv_pages;
            if (h.free_kv_pages == want && h.active_requests == 0)
                return last;
        }
        usleep(50000);
    }
    return last;
}

/* ---- bad input ------------------------------------------------------------------------------ */

/* CancelPrefill of id; *reply (may stay NULL) is the caller's to free */
static pd_status cancel_prefill(pd_rpc_channel *pch, const char *id, ProtobufCMessage **reply, pd_err *err)
{
    Pdspark__CancelPrefillRequest cr = PDSPARK__CANCEL_PREFILL_REQUEST__INIT;
    cr.version = PD_PROTO_VERSION;
    cr.request_id = (char *)id;
    *reply = NULL;
    return pd_rpc_unary(pch, "/pdspark.Prefill/CancelPrefill", &cr.base,
                        &pdspark__cancel_prefill_reply__descriptor, 5000, reply, err);
}

static void expect(gen_call *g, pd_status st, const char *needle, const char *what)
{
    TEST_CHECK_MSG(g->st == st, "%s: status %s (%s), expected %s", what, pd_status_str(g->st),
                   g->msg, pd_status_str(st));
    TEST_CHECK_MSG(needle == NULL || strstr(g->msg, needle) != NULL,
                   "%s: message '%s' does not mention '%s'", what, g->msg, needle);
}

/* GenerateRequest.prompt_logprobs on a 24-token prompt, two choices: each choice's first chunk
 * has 23 entries (prompt_lps_check's rules), no later chunk has any. */
static void prompt_lps_case(pd_rpc_channel *ch, const char *what)
{
    gen_call g = { .max_new = 4, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 20000, .n = 2,
                   .prompt_lp = 1, .prompt_top = 3 };
    prompt_ids(&g, 24, 11);
    gen_run(ch, &g);
    TEST_CHECK_MSG(g.st == PD_OK && g.plp_n[0] == 23 && g.plp_n[1] == 23 && g.plp_late == 0 && g.plp_bad == 0,
                   "%s prompt logprobs: %s %s, first chunks %d and %d entries (want 23), %d later, %d bad (%s)",
                   what, pd_status_str(g.st), g.msg, g.plp_n[0], g.plp_n[1], g.plp_late, g.plp_bad, g.plp_why);
    /* without prompt_top_logprobs: the token's own logprob and rank only */
    gen_call z = { .max_new = 2, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 20000, .prompt_lp = 1 };
    z.ids = g.ids;
    z.n_ids = g.n_ids;
    gen_run(ch, &z);
    TEST_CHECK_MSG(z.st == PD_OK && z.plp_n[0] == 23 && z.plp_bad == 0, "%s prompt logprobs, no top: %s %s, %d "
                   "entries, %d bad (%s)", what, pd_status_str(z.st), z.msg, z.plp_n[0], z.plp_bad, z.plp_why);
    /* not asked: none */
    gen_call off = { .max_new = 2, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 20000, .prompt_top = 5 };
    off.ids = g.ids;
    off.n_ids = g.n_ids;
    gen_run(ch, &off);
    TEST_CHECK_MSG(off.st == PD_OK && off.plp_n[0] == 0 && off.plp_late == 0, "%s prompt logprobs not asked: %s "
                   "%s, %d entries", what, pd_status_str(off.st), off.msg, off.plp_n[0]);
    free(g.ids);
}

static void test_services_bad_input(void)
{
    node dn = {0}, pn = {0};
    char *dargv[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--colocated", NULL };
    char *pargv[] = { PD_BIN_DIR "/prefill_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", NULL };
    if (node_start(dargv, &dn) != 0 || node_start(pargv, &pn) != 0) {
        TEST_CHECK_MSG(0, "nodes did not start");
        node_stop(&dn, SIGKILL);
        return;
    }
    pd_err err;
    pd_rpc_channel *ch = NULL, *pch = NULL;
    TEST_CHECK(pd_rpc_channel_create(dn.addr, &ch, &err) == PD_OK);
    TEST_CHECK(pd_rpc_channel_create(pn.addr, &pch, &err) == PD_OK);

    /* malformed protobuf bytes (a varint that never ends) on both nodes */
    static const unsigned char junk[] = { 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
    void *rb = NULL;
    size_t rl = 0;
    pd_status st = pd_rpc_unary_raw(ch, "/pdspark.Generate/Health", junk, sizeof(junk), 5000, &rb, &rl, &err);
    TEST_CHECK_MSG(st == PD_ERR_INVALID && err.msg[0], "decode malformed: %s %s", pd_status_str(st), err.msg);
    free(rb);
    rb = NULL;
    st = pd_rpc_unary_raw(pch, "/pdspark.Prefill/Prefill", junk, sizeof(junk), 5000, &rb, &rl, &err);
    TEST_CHECK_MSG(st == PD_ERR_INVALID && err.msg[0], "prefill malformed: %s %s", pd_status_str(st), err.msg);
    free(rb);

    gen_call g = { .max_new = 8, .top_p = 1.0f };
    prompt_ids(&g, 16, 1);
    /* wrong version */
    g.version = PD_PROTO_VERSION + 6;
    gen_run(ch, &g);
    expect(&g, PD_ERR_INVALID, "version", "wrong version");
    g.version = 0;
    /* oversized prompt: the context is 4096 tokens */
    gen_call big = { .max_new = 8, .top_p = 1.0f };
    prompt_ids(&big, 4096, 2);
    gen_run(ch, &big);
    expect(&big, PD_ERR_INVALID, "context", "oversized prompt");
    free(big.ids);
    /* ids outside the vocabulary (8192) */
    g.ids[3] = 8192;
    gen_run(ch, &g);
    expect(&g, PD_ERR_INVALID, "vocabulary", "token id 8192");
    g.ids[3] = 0xffffffffu;
    gen_run(ch, &g);
    expect(&g, PD_ERR_INVALID, "vocabulary", "token id 2^32-1");
    g.ids[3] = 11;
    /* bad sampling params */
    g.temperature = -1.0f;
    gen_run(ch, &g);
    expect(&g, PD_ERR_INVALID, "temperature", "temperature -1");
    g.temperature = 0.0f;
    g.top_p = 2.0f;
    gen_run(ch, &g);
    expect(&g, PD_ERR_INVALID, "top_p", "top_p 2");
    g.top_p = 1.0f;
    g.typical_p = 1.5f;
    gen_run(ch, &g);
    expect(&g, PD_ERR_INVALID, "typical_p", "typical_p 1.5");
    g.typical_p = -0.5f;
    gen_run(ch, &g);
    expect(&g, PD_ERR_INVALID, "typical_p", "typical_p -0.5");
    g.typical_p = 0.0f;
    /* both text and ids */
    g.text = "hello";
    gen_run(ch, &g);
    expect(&g, PD_ERR_INVALID, "not both", "text and ids");
    g.text = NULL;
    /* empty prompt */
    gen_call empty = { .max_new = 8, .top_p = 1.0f };
    gen_run(ch, &empty);
    expect(&empty, PD_ERR_INVALID, "empty", "empty prompt");

    /* CancelPrefill of an unknown id */
    ProtobufCMessage *m = NULL;
    st = cancel_prefill(pch, "no-such-request", &m, &err);
    TEST_CHECK_MSG(st == PD_ERR_NOT_FOUND && strstr(err.msg, "no-such-request") != NULL,
                   "cancel unknown: %s %s", pd_status_str(st), err.msg);
    if (m != NULL)
        protobuf_c_message_free_unpacked(m, NULL);

    /* a Prefill descriptor whose page layout differs */
    uint32_t toks[4] = { 1, 2, 3, 4 }, page = 0;
    Pdspark__PageLayout pl = PDSPARK__PAGE_LAYOUT__INIT;
    pl.version = PD_PROTO_VERSION;
    pl.page_size = 8;
    pl.dtype = PDSPARK__KV_DTYPE__KV_DTYPE_F32;
    pl.n_layers = 4;
    pl.n_kv_heads = 2;
    pl.head_dim = 64;
    Pdspark__RemoteRegion kv = PDSPARK__REMOTE_REGION__INIT;
    kv.version = PD_PROTO_VERSION;
    Pdspark__AuxLayout al = PDSPARK__AUX_LAYOUT__INIT;
    al.version = PD_PROTO_VERSION;
    Pdspark__Destination d = PDSPARK__DESTINATION__INIT;
    d.version = PD_PROTO_VERSION;
    d.page_layout = &pl;
    d.kv_pool = &kv;
    d.aux_layout = &al;
    d.n_page_ids = 1;
    d.page_ids = &page;
    Pdspark__PrefillRequest pr = PDSPARK__PREFILL_REQUEST__INIT;
    pr.version = PD_PROTO_VERSION;
    pr.request_id = "bad-layout";
    pr.n_token_ids = 4;
    pr.token_ids = toks;
    pr.dest = &d;
    m = NULL;
    st = pd_rpc_unary(pch, "/pdspark.Prefill/Prefill", &pr.base, &pdspark__prefill_reply__descriptor,
                      5000, &m, &err);
    TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, "page size") != NULL,
                   "layout mismatch: %s %s", pd_status_str(st), err.msg);
    if (m != NULL)
        protobuf_c_message_free_unpacked(m, NULL);
    pl.page_size = 16;
    pl.n_layers = 99;
    st = pd_rpc_unary(pch, "/pdspark.Prefill/Prefill", &pr.base, &pdspark__prefill_reply__descriptor,
                      5000, &m, &err);
    TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, "layer count") != NULL,
                   "layer mismatch: %s %s", pd_status_str(st), err.msg);
    if (m != NULL)
        protobuf_c_message_free_unpacked(m, NULL);
    /* the right layout, but a worker address and an rkey of garbage bytes: an error, not a crash */
    uint8_t junk_addr[96], junk_rkey[40];
    for (size_t i = 0; i < sizeof(junk_addr); i++)
        junk_addr[i] = (uint8_t)(i * 37u + 11u);
    for (size_t i = 0; i < sizeof(junk_rkey); i++)
        junk_rkey[i] = (uint8_t)(i * 53u + 7u);
    pl.n_layers = 8;
    pl.bytes_per_page = 8192;
    d.worker_address.data = junk_addr;
    d.worker_address.len = sizeof(junk_addr);
    kv.rkey.data = junk_rkey;
    kv.rkey.len = sizeof(junk_rkey);
    kv.base_addr = 0x10000;
    kv.length = 1 << 20;
    pr.request_id = "junk-address";
    pr.timeout_ms = 5000;
    m = NULL;
    st = pd_rpc_unary(pch, "/pdspark.Prefill/Prefill", &pr.base, &pdspark__prefill_reply__descriptor,
                      15000, &m, &err);
    TEST_CHECK_MSG(st != PD_OK && waitpid(pn.pid, NULL, WNOHANG) == 0,
                   "garbage worker address: %s %s (the prefill node must answer and live)", pd_status_str(st),
                   err.msg);
    printf("garbage worker address and rkey: %s: %s\n", pd_status_str(st), err.msg);

    /* a stop string ends the text before it, finish reason STOP */
    gen_call sg = { .max_new = 60, .ignore_eos = 1, .top_p = 1.0f, .text = "def fib(n):", .stop = "return" };
    gen_run(ch, &sg);
    TEST_CHECK_MSG(sg.st == PD_OK && sg.finish == PDSPARK__FINISH_REASON__FINISH_REASON_STOP &&
                   strstr(sg.out, "return") == NULL && sg.out[0] != 0,
                   "stop string: %s %s finish %d text '%s'", pd_status_str(sg.st), sg.msg, sg.finish, sg.out);

    /* chat messages: rendered by the node's chat template, so the reply is the one the same
     * text sent as the prompt gets (rendered here from the checkpoint's template) */
    pd_chat_template tp;
    int usable = 0;
    char why[256];
    TEST_CHECK(pd_chat_template_load(TARGET, NULL, &tp, &usable, why, sizeof(why), &err) == PD_OK && usable);
    Pdspark__ChatMessage cm[2], *cmp[2] = { &cm[0], &cm[1] };
    for (int i = 0; i < 2; i++) {
        pdspark__chat_message__init(&cm[i]);
        cm[i].version = PD_PROTO_VERSION;
    }
    cm[0].role = "system";
    cm[0].content = "You write Python.";
    cm[1].role = "user";
    cm[1].content = "def fib(n):";
    gen_call cg = { .max_new = 24, .top_p = 1.0f, .msgs = cmp, .n_msgs = 2 };
    gen_run(ch, &cg);
    cJSON *arr = cJSON_Parse("[{\"role\": \"system\", \"content\": \"You write Python.\"},"
                             " {\"role\": \"user\", \"content\": \"def fib(n):\"}]");
    pd_chat_opts co = PD_CHAT_OPTS_DEFAULT;
    char *ctext = NULL;
    size_t clen = 0;
    TEST_CHECK(pd_chat_render(&tp, arr, NULL, &co, &ctext, &clen, why, sizeof(why)) == 0);
    cJSON_Delete(arr);
    gen_call pg = { .max_new = 24, .top_p = 1.0f, .text = ctext };
    gen_run(ch, &pg);
    TEST_CHECK_MSG(cg.st == PD_OK && pg.st == PD_OK && cg.tokens > 0 && strcmp(cg.out, pg.out) == 0,
                   "chat messages: %s %s '%s', its rendered text as the prompt: %s '%s'", pd_status_str(cg.st),
                   cg.msg, cg.out, pd_status_str(pg.st), pg.out);
    free(ctext);
    cg.text = "hello";
    gen_run(ch, &cg);
    expect(&cg, PD_ERR_INVALID, "one of prompt_text", "messages and prompt_text");
    cg.text = NULL;
    cm[1].version = PD_PROTO_VERSION + 3;
    gen_run(ch, &cg);
    expect(&cg, PD_ERR_INVALID, "messages[1]: protocol version", "a message of another version");
    cm[1].version = PD_PROTO_VERSION;
    cm[1].role = "wizard";
    gen_run(ch, &cg);
    expect(&cg, PD_ERR_INVALID, "wizard", "an unknown role");
    cm[1].role = "user";
    cg.thinking = 3;
    gen_run(ch, &cg);
    expect(&cg, PD_ERR_INVALID, "enable_thinking", "enable_thinking 3");

    /* n choices on one stream: choice i is the request with seed + i; greedy choices are equal */
    gen_call ng = { .max_new = 12, .top_p = 1.0f, .text = "def fib(n):", .n = 3 };
    gen_run(ch, &ng);
    gen_call one = { .max_new = 12, .top_p = 1.0f, .text = "def fib(n):" };
    gen_run(ch, &one);
    TEST_CHECK_MSG(ng.st == PD_OK && one.st == PD_OK && ng.finals == 3 && ng.bad_index == 0 &&
                   one.out[0] != '\0' && strcmp(ng.outs[0], one.out) == 0 && strcmp(ng.outs[1], one.out) == 0 &&
                   strcmp(ng.outs[2], one.out) == 0,
                   "n 3 greedy: %s %s, %d finals, %d bad indexes, '%s' '%s' '%s', one request '%s'",
                   pd_status_str(ng.st), ng.msg, ng.finals, ng.bad_index, ng.outs[0], ng.outs[1], ng.outs[2], one.out);
    gen_call ns = { .max_new = 16, .top_p = 1.0f, .temperature = 0.9f, .text = "def fib(n):", .n = 3, .seed = 11 };
    gen_run(ch, &ns);
    TEST_CHECK_MSG(ns.st == PD_OK && ns.finals == 3, "n 3 sampled: %s %s, %d finals", pd_status_str(ns.st),
                   ns.msg, ns.finals);
    for (int i = 0; i < 3; i++) {
        gen_call si = { .max_new = 16, .top_p = 1.0f, .temperature = 0.9f, .text = "def fib(n):",
                        .seed = 11 + (uint64_t)i };
        gen_run(ch, &si);
        TEST_CHECK_MSG(si.st == PD_OK && strcmp(ns.outs[i], si.out) == 0,
                       "n 3 sampled, choice %d '%s' against seed %d alone: %s '%s'", i, ns.outs[i], 11 + i,
                       pd_status_str(si.st), si.out);
    }
    /* seed 0 is the proto's "server picks": each request (and choice) draws its own */
    char unseeded[4][sizeof(ns.out)];
    int differ = 0, all_ok = 1;
    for (int i = 0; i < 4; i++) {
        gen_call su = { .max_new = 16, .top_p = 1.0f, .temperature = 1.0f, .text = "def fib(n):" };
        gen_run(ch, &su);
        all_ok &= su.st == PD_OK;
        memcpy(unseeded[i], su.out, sizeof(su.out));
        differ |= strcmp(unseeded[i], unseeded[0]) != 0;
    }
    TEST_CHECK_MSG(all_ok && differ, "seed 0, sampled: four requests gave '%s' '%s' '%s' '%s'", unseeded[0],
                   unseeded[1], unseeded[2], unseeded[3]);
    ng.n = 17;
    gen_run(ch, &ng);
    expect(&ng, PD_ERR_INVALID, "n must be 1..16", "n 17");
    ng.n = 2;
    ng.max_new = 0x7fffffffu + 5u;   /* refused by decode_submit for the first choice */
    gen_run(ch, &ng);
    TEST_CHECK_MSG(ng.st != PD_OK && ng.finals == 0, "n 2 of a refused request: %s %s, %d finals",
                   pd_status_str(ng.st), ng.msg, ng.finals);

    /* the decode node keeps serving */
    gen_call ok = { .max_new = 16, .top_p = 1.0f };
    prompt_ids(&ok, 40, 3);
    /* prompt logprobs: a top count past 20 is refused naming the field; then they are served */
    gen_call plb = { .max_new = 2, .top_p = 1.0f, .text = "def fib(n):", .prompt_lp = 1, .prompt_top = 21 };
    gen_run(ch, &plb);
    expect(&plb, PD_ERR_INVALID, "prompt_top_logprobs", "prompt_top_logprobs 21");
    prompt_lps_case(ch, "colocated");
    gen_run(ch, &ok);
    TEST_CHECK_MSG(ok.st == PD_OK && ok.tokens >= 1, "good request after bad ones: %s %s",
                   pd_status_str(ok.st), ok.msg);
    free(ok.ids);
    free(g.ids);
    pd_rpc_channel_destroy(ch);
    pd_rpc_channel_destroy(pch);
    node_stop(&dn, SIGTERM);
    node_stop(&pn, SIGTERM);
}

/* ---- tool calling -------------------------------------------------------------------------- */

#define T_WEATHER "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": " \
                  "\"Weather of a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": " \
                  "{\"enum\": [\"Paris\", \"Rome\", \"Oslo\"]}, \"days\": {\"type\": \"integer\", \"minimum\": 1, " \
                  "\"maximum\": 7}}, \"required\": [\"city\", \"days\"], \"additionalProperties\": false}}}"
#define T_NOW "{\"type\": \"function\", \"function\": {\"name\": \"now\", \"parameters\": {\"type\": \"object\", " \
              "\"properties\": {\"tz\": {\"enum\": [\"UTC\", \"CET\"]}}, \"required\": [\"tz\"], " \
              "\"additionalProperties\": false}}}"
#define T_TOOLS "[" T_WEATHER ", " T_NOW "]"
#define T_QUESTION "What is the weather in Paris for 3 days?"

/* a call's id as the HTTP API writes them: call_ and 24 hex digits */
static int call_id_ok(const char *id)
{
    if (strncmp(id, "call_", 5) != 0 || strlen(id) != 29)
        return 0;
    for (const char *c = id + 5; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f')))
            return 0;
    return 1;
}

/* get_weather's arguments obey its schema: city one of three, days 1..7, nothing else */
static int weather_args_ok(const char *args)
{
    cJSON *a = cJSON_Parse(args);
    const cJSON *city = cJSON_GetObjectItemCaseSensitive(a, "city");
    const cJSON *days = cJSON_GetObjectItemCaseSensitive(a, "days");
    int ok = cJSON_IsObject(a) && cJSON_GetArraySize(a) == 2 && cJSON_IsString(city) &&
             (strcmp(city->valuestring, "Paris") == 0 || strcmp(city->valuestring, "Rome") == 0 ||
              strcmp(city->valuestring, "Oslo") == 0) &&
             cJSON_IsNumber(days) && days->valuedouble == (int)days->valuedouble && days->valuedouble >= 1 &&
             days->valuedouble <= 7;
    cJSON_Delete(a);
    return ok;
}

/* Tool calling over gRPC (decode_node --colocated): tools_json with tool_choice naming a function
 * forces that call, which comes back as a ToolCall (id, name, arguments obeying the schema) with
 * finish reason TOOL_CALLS and no text; "required" forces one of the tools; with
 * stream_tool_arguments the same requests give the calls as deltas (index, id and name first, then
 * pieces over several chunks) whose pieces join to the whole calls' arguments, and the flag
 * without tools changes nothing; Health reports no staging pool; a multi-turn chat with
 * an assistant's tool_calls turn and tool turns is the prompt the HTTP path renders of the same
 * conversation (same usage and greedy reply as that text sent as the prompt); malformed
 * tools_json / tool_choice, tools without messages and a tool schema that does not compile get
 * INVALID_ARGUMENT naming the field, and the next request is served. */
static void test_services_tools(void)
{
    node dn = {0};
    char *dargv[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--colocated", NULL };
    if (node_start(dargv, &dn) != 0) {
        TEST_CHECK_MSG(0, "decode node did not start");
        return;
    }
    pd_err err;
    pd_rpc_channel *ch = NULL;
    TEST_CHECK(pd_rpc_channel_create(dn.addr, &ch, &err) == PD_OK);
    Pdspark__ChatMessage q = PDSPARK__CHAT_MESSAGE__INIT, *qp = &q;
    q.version = PD_PROTO_VERSION;
    q.role = "user";
    q.content = T_QUESTION;

    /* a named function: that call, whole (one ToolCall, no arguments_delta), and no text */
    gen_call fc = { .max_new = 64, .top_p = 1.0f, .msgs = &qp, .n_msgs = 1, .tools_json = T_TOOLS,
                    .tool_choice = "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}",
                    .request_id = "tools-named" };
    gen_run(ch, &fc);
    TEST_CHECK_MSG(fc.deltas == 1 && fc.delta_bad == 0, "named tool_choice, whole: %d ToolCall messages, %s",
                   fc.deltas, fc.delta_why);
    TEST_CHECK_MSG(fc.st == PD_OK && fc.n_calls == 1 && strcmp(fc.calls[0].name, "get_weather") == 0 &&
                   fc.calls[0].index == 0 && fc.calls[0].version == PD_PROTO_VERSION && call_id_ok(fc.calls[0].id) &&
                   weather_args_ok(fc.calls[0].args) && fc.out[0] == '\0' &&
                   fc.finish == PDSPARK__FINISH_REASON__FINISH_REASON_TOOL_CALLS,
                   "named tool_choice: %s %s, %d calls, first %s %s(%s), text '%s', finish %d", pd_status_str(fc.st),
                   fc.msg, fc.n_calls, fc.calls[0].id, fc.calls[0].name, fc.calls[0].args, fc.out, fc.finish);
    printf("forced call: %s(%s) %s\n", fc.calls[0].name, fc.calls[0].args, fc.calls[0].id);
    /* the same request with stream_tool_arguments, and "required" with parallel calls on both
     * ways: the calls come as deltas over several chunks, index, id and name on each call's first,
     * and each call's pieces joined are the whole call's arguments (same ids: same request id) */
    gen_call rw = fc;
    rw.tool_choice = "required";
    rw.par_tools = 2;
    rw.max_new = 96;
    rw.request_id = "tools-required";
    gen_run(ch, &rw);
    TEST_CHECK_MSG(rw.st == PD_OK && rw.n_calls >= 1 && rw.deltas == rw.n_calls && rw.delta_bad == 0,
                   "required, parallel, whole: %s %s, %d calls in %d messages, %s", pd_status_str(rw.st), rw.msg,
                   rw.n_calls, rw.deltas, rw.delta_why);
    const gen_call *whole[] = { &fc, &rw };
    for (int w = 0; w < 2; w++) {
        gen_call sd = *whole[w];
        sd.stream_args = 1;
        gen_run(ch, &sd);
        int same = sd.n_calls == whole[w]->n_calls;
        for (int k = 0; same && k < sd.n_calls; k++)
            same = sd.calls[k].index == (uint32_t)k && sd.calls[k].version == PD_PROTO_VERSION &&
                   strcmp(sd.calls[k].id, whole[w]->calls[k].id) == 0 &&
                   strcmp(sd.calls[k].name, whole[w]->calls[k].name) == 0 &&
                   strcmp(sd.calls[k].args, whole[w]->calls[k].args) == 0;
        TEST_CHECK_MSG(sd.st == PD_OK && sd.delta_bad == 0 && same && sd.deltas > sd.n_calls &&
                       sd.delta_chunks > 1 && strcmp(sd.out, whole[w]->out) == 0 && sd.finish == whole[w]->finish,
                       "%s, deltas: %s %s, %d calls (whole: %d), first %s %s(%s) vs %s(%s), %d deltas in %d chunks, "
                       "finish %d (%d), text '%s', %s", w == 0 ? "named" : "required", pd_status_str(sd.st), sd.msg,
                       sd.n_calls, whole[w]->n_calls, sd.calls[0].id, sd.calls[0].name, sd.calls[0].args,
                       whole[w]->calls[0].name, whole[w]->calls[0].args, sd.deltas, sd.delta_chunks, sd.finish,
                       whole[w]->finish, sd.out, sd.delta_why);
        if (w == 0)
            printf("streamed call: %d deltas in %d chunks, joined %s\n", sd.deltas, sd.delta_chunks, sd.calls[0].args);
    }
    /* deltas with two choices (greedy: the same reply twice): each choice's deltas join to the
     * whole call, under a call id of its own */
    char id0[48] = "";
    for (uint32_t c = 0; c < 2; c++) {
        gen_call sn = fc;
        sn.stream_args = 1;
        sn.n = 2;
        sn.calls_choice = c;
        gen_run(ch, &sn);
        TEST_CHECK_MSG(sn.st == PD_OK && sn.delta_bad == 0 && sn.n_calls == 1 && sn.finals == 2 &&
                       sn.calls[0].index == 0 && strcmp(sn.calls[0].name, fc.calls[0].name) == 0 &&
                       strcmp(sn.calls[0].args, fc.calls[0].args) == 0 && call_id_ok(sn.calls[0].id) &&
                       strcmp(sn.calls[0].id, id0) != 0 && sn.deltas > 1,
                       "n 2, choice %u, deltas: %s %s, %d calls, %d finals, %s(%s) id %s (choice 0: %s), %d deltas, %s",
                       c, pd_status_str(sn.st), sn.msg, sn.n_calls, sn.finals, sn.calls[0].name, sn.calls[0].args,
                       sn.calls[0].id, id0, sn.deltas, sn.delta_why);
        snprintf(id0, sizeof(id0), "%s", sn.calls[0].id);
    }
    /* text, a call and text again (forced by a regex, tool_choice auto): a client that reads each
     * message's text before its calls reads them in the reply's order, whole and streamed, also
     * where the call's end and the next text come in one chunk (a stop string that the end tag
     * and the text after it begin, but which is not hit, holds them back and sends them together) */
    char stop_late[] = "}}\n</tool_call>\nDone, that is all!";
    for (int sa = 0; sa < 2; sa++) {
        gen_call ta = { .max_new = 96, .top_p = 1.0f, .msgs = &qp, .n_msgs = 1, .tools_json = T_TOOLS,
                        .thinking = 1, .stream_args = sa, .request_id = "tools-text-after", .stop = stop_late,
                        .regex = "Let me check\\.\n<tool_call>\n\\{\"name\": \"get_weather\", \"arguments\": "
                                 "\\{\"city\": \"Paris\", \"days\": 3\\}\\}\n</tool_call>\nDone, that is all\\." };
        gen_run(ch, &ta);
        const char *pre = strstr(ta.seq, "Let me check."), *cl = strstr(ta.seq, "[CALL get_weather]");
        const char *post = strstr(ta.seq, "Done, that is all.");
        TEST_CHECK_MSG(ta.st == PD_OK && ta.delta_bad == 0 && ta.n_calls == 1 && weather_args_ok(ta.calls[0].args) &&
                       pre != NULL && cl != NULL && post != NULL && pre < cl && cl < post &&
                       ta.finish == PDSPARK__FINISH_REASON__FINISH_REASON_TOOL_CALLS,
                       "text, call, text (%s): %s %s, %d calls, read as '%s', finish %d, %s",
                       sa ? "deltas" : "whole", pd_status_str(ta.st), ta.msg, ta.n_calls, ta.seq, ta.finish,
                       ta.delta_why);
        printf("text, call, text (%s): %d chunks, read as %s\n", sa ? "deltas" : "whole", ta.chunks, ta.seq);
    }
    /* the flag without tools changes nothing */
    gen_call plain = { .max_new = 12, .top_p = 1.0f, .msgs = &qp, .n_msgs = 1 }, plain_s = plain;
    plain_s.stream_args = 1;
    gen_run(ch, &plain);
    gen_run(ch, &plain_s);
    TEST_CHECK_MSG(plain.st == PD_OK && plain_s.st == PD_OK && plain.out[0] != '\0' &&
                   strcmp(plain.out, plain_s.out) == 0 && plain_s.deltas == 0 && plain.finish == plain_s.finish,
                   "stream_tool_arguments without tools: '%s' vs '%s', %d ToolCall messages", plain_s.out, plain.out,
                   plain_s.deltas);
    /* a colocated node has no KV staging pool: Health says 0 of 0 */
    Pdspark__HealthReply hh = PDSPARK__HEALTH_REPLY__INIT;
    TEST_CHECK_MSG(health(ch, &hh) == 0 && hh.staging_pages_total == 0 && hh.staging_pages_used == 0 &&
                   hh.staging_waits == 0 && hh.total_kv_pages > 0,
                   "colocated Health: staging %u of %u pages, %llu waits", hh.staging_pages_used,
                   hh.staging_pages_total, (unsigned long long)hh.staging_waits);
    /* "required" with parallel_tool_calls off: one call of one of the tools */
    gen_call rc = fc;
    rc.tool_choice = "required";
    rc.par_tools = 1;
    gen_run(ch, &rc);
    TEST_CHECK_MSG(rc.st == PD_OK && rc.n_calls == 1 && rc.finish == PDSPARK__FINISH_REASON__FINISH_REASON_TOOL_CALLS &&
                   (strcmp(rc.calls[0].name, "now") == 0 || weather_args_ok(rc.calls[0].args)) &&
                   (strcmp(rc.calls[0].name, "get_weather") == 0 || strcmp(rc.calls[0].name, "now") == 0),
                   "tool_choice required: %s %s, %d calls, first %s(%s), finish %d", pd_status_str(rc.st), rc.msg,
                   rc.n_calls, rc.calls[0].name, rc.calls[0].args, rc.finish);

    /* a tool round in the history: the prompt the HTTP path renders of the same conversation */
    static const char *const roles[] = { "user", "assistant", "tool", "user" };
    static const char *const contents[] = { T_QUESTION, "", "sunny, 21C", "And in Rome?" };
    Pdspark__ChatMessage cm[4], *cmp[4];
    for (int i = 0; i < 4; i++) {
        pdspark__chat_message__init(&cm[i]);
        cm[i].version = PD_PROTO_VERSION;
        cm[i].role = (char *)roles[i];
        cm[i].content = (char *)contents[i];
        cmp[i] = &cm[i];
    }
    cm[1].tool_calls_json = "[{\"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                            "\"arguments\": \"{\\\"city\\\":\\\"Paris\\\",\\\"days\\\":3}\"}}]";
    cm[2].tool_call_id = "call_1";
    cm[2].name = "get_weather";
    gen_call hg = { .max_new = 24, .top_p = 1.0f, .msgs = cmp, .n_msgs = 4, .tools_json = T_TOOLS,
                    .tool_choice = "auto" };
    gen_run(ch, &hg);
    pd_chat_template tp;
    int usable = 0;
    char why[256];
    TEST_CHECK(pd_chat_template_load(TARGET, NULL, &tp, &usable, why, sizeof(why), &err) == PD_OK && usable);
    cJSON *body = cJSON_Parse("{\"messages\": [{\"role\": \"user\", \"content\": \"" T_QUESTION "\"}, "
                              "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\", "
                              "\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
                              "\"{\\\"city\\\":\\\"Paris\\\",\\\"days\\\":3}\"}}]}, {\"role\": \"tool\", "
                              "\"tool_call_id\": \"call_1\", \"content\": \"sunny, 21C\"}, {\"role\": \"user\", "
                              "\"content\": \"And in Rome?\"}], \"tools\": " T_TOOLS ", \"tool_choice\": \"auto\"}");
    pd_chat_tools tools;
    pd_chat_opts co = PD_CHAT_OPTS_DEFAULT;
    const char *param = NULL;
    char *ctext = NULL;
    size_t clen = 0;
    TEST_CHECK(body != NULL && pd_chat_tools_parse(body, &tools, &param, why, sizeof(why)) == 0 &&
               pd_chat_render(&tp, cJSON_GetObjectItemCaseSensitive(body, "messages"), &tools, &co, &ctext, &clen,
                              why, sizeof(why)) == 0);
    pd_chat_tools_free(&tools);
    cJSON_Delete(body);
    gen_call pg = { .max_new = 24, .top_p = 1.0f, .text = ctext };
    gen_run(ch, &pg);
    TEST_CHECK_MSG(hg.st == PD_OK && pg.st == PD_OK && hg.tokens > 0 && hg.prompt_tokens > 100 &&
                   hg.prompt_tokens == pg.prompt_tokens && strcmp(hg.out, pg.out) == 0 && hg.n_calls == 0,
                   "tool round: gRPC chat %s %s, %u prompt tokens '%s'; HTTP's render as the prompt: %s %u '%s'",
                   pd_status_str(hg.st), hg.msg, hg.prompt_tokens, hg.out, pd_status_str(pg.st), pg.prompt_tokens,
                   pg.out);
    free(ctext);

    /* malformed fields: INVALID_ARGUMENT naming the field, and the next request is served */
    struct { const char *tools, *choice; int chat; const char *needle; } bad[] = {
        { "[{\"type\": \"function\"", "", 1, "tools_json is not valid JSON" },
        { "[{\"type\": \"function\", \"function\": {\"name\": \"a b\"}}]", "", 1, "tools_json: tools[0]" },
        { T_TOOLS, "{\"type\": \"function\", \"function\": {\"name\": \"nope\"}}", 1, "'tool_choice' names 'nope'" },
        { T_TOOLS, "{\"type\": \"function\",", 1, "tool_choice is not valid JSON" },
        { T_TOOLS, "sometimes", 1, "'tool_choice' must be" },
        { "", "required", 1, "needs 'tools'" },
        { T_TOOLS, "required", 0, "need messages" },
        { "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\", "
          "\"properties\": {\"x\": {\"type\": \"number\", \"multipleOf\": 2}}}}}]", "required", 1, "tools_json: " },
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        gen_call bg = { .max_new = 8, .top_p = 1.0f, .tools_json = bad[i].tools, .tool_choice = bad[i].choice };
        if (bad[i].chat) {
            bg.msgs = &qp;
            bg.n_msgs = 1;
        } else {
            bg.text = T_QUESTION;
        }
        gen_run(ch, &bg);
        char what[64];
        snprintf(what, sizeof(what), "bad tools case %zu", i);
        expect(&bg, PD_ERR_INVALID, bad[i].needle, what);
        gen_call next = fc;
        gen_run(ch, &next);
        TEST_CHECK_MSG(next.st == PD_OK && next.n_calls == 1 && strcmp(next.calls[0].args, fc.calls[0].args) == 0,
                       "after bad tools case %zu: %s %s, %d calls", i, pd_status_str(next.st), next.msg, next.n_calls);
    }
    pd_rpc_channel_destroy(ch);
    node_stop(&dn, SIGTERM);
}

/* ---- fuzz ------------------------------------------------------------------------------------ */

/* Mutated Generate requests: a request with most fields set is packed, 1-4 of its bytes changed
 * (or it is cut), and what still parses as a GenerateRequest is sent (so fields take random
 * values of their own types: ids, floats, strings, nested messages); every other case starts
 * from the same request as chat messages (with tools). Every answer is a result
 * or an error the client caused (INVALID_ARGUMENT, a deadline, busy), never a dropped
 * connection or an internal error; the node then serves a normal request. PD_FUZZ_N sets the
 * count (default 600), PD_FUZZ_SEED another sequence of mutations. */
static void test_services_fuzz(void)
{
    node dn = {0};
    char *dargv[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--colocated", NULL };
    if (node_start(dargv, &dn) != 0) {
        TEST_CHECK_MSG(0, "decode node did not start");
        return;
    }
    pd_err err;
    pd_rpc_channel *ch = NULL;
    TEST_CHECK(pd_rpc_channel_create(dn.addr, &ch, &err) == PD_OK);
    char *stop = "return";
    uint32_t stop_ids[2] = { 8188, 8190 };
    Pdspark__LogitBias lb = PDSPARK__LOGIT_BIAS__INIT;
    lb.version = PD_PROTO_VERSION;
    lb.token_id = 8189;
    lb.bias = -2.0f;
    Pdspark__LogitBias *lbs = &lb;
    Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
    sp.version = PD_PROTO_VERSION;
    sp.temperature = 0.7f;
    sp.top_p = 0.9f;
    sp.top_k = 20;
    sp.min_p = 0.05f;
    sp.typical_p = 0.95f;
    sp.seed = 5;
    sp.max_new_tokens = 6;
    sp.n_stop = 1;
    sp.stop = &stop;
    sp.presence_penalty = 0.5f;
    sp.frequency_penalty = 0.25f;
    sp.repetition_penalty = 1.1f;
    sp.n_logit_bias = 1;
    sp.logit_bias = &lbs;
    sp.n_stop_token_ids = 2;
    sp.stop_token_ids = stop_ids;
    sp.regex = "[a-z (]+";
    Pdspark__GenerateRequest rq = PDSPARK__GENERATE_REQUEST__INIT;
    rq.version = PD_PROTO_VERSION;
    rq.request_id = "fuzz";
    rq.prompt_text = "def fib(n):";
    rq.sampling = &sp;
    rq.timeout_ms = 20000;
    rq.return_token_ids = 1;
    rq.logprobs = 1;
    rq.top_logprobs = 3;
    /* and the same request as a chat (every other case): two messages instead of the text */
    Pdspark__ChatMessage cm[2], *cmp[2] = { &cm[0], &cm[1] };
    for (int i = 0; i < 2; i++) {
        pdspark__chat_message__init(&cm[i]);
        cm[i].version = PD_PROTO_VERSION;
        cm[i].role = i == 0 ? "system" : "user";
        cm[i].content = i == 0 ? "You write Python." : "def fib(n):";
    }
    Pdspark__GenerateRequest rc = rq;
    rc.prompt_text = "";
    rc.n_messages = 2;
    rc.messages = cmp;
    rc.enable_thinking = 1;
    rc.tools_json = T_TOOLS;   /* the regex keeps it from calls; mutated, it must be refused cleanly */
    rc.tool_choice = "auto";
    size_t len_t = protobuf_c_message_get_packed_size(&rq.base), len_c = protobuf_c_message_get_packed_size(&rc.base);
    size_t cap = len_t > len_c ? len_t : len_c;
    uint8_t *base_t = malloc(cap), *base_c = malloc(cap), *buf = malloc(cap);
    protobuf_c_message_pack(&rq.base, base_t);
    protobuf_c_message_pack(&rc.base, base_c);
    const char *env = getenv("PD_FUZZ_N");
    int n = env != NULL ? atoi(env) : 600, sent = 0, counts[PD_ERR_INTERNAL + 1] = {0};
    const char *seed = getenv("PD_FUZZ_SEED");   /* other mutations, by hand */
    uint64_t x = seed != NULL ? strtoull(seed, NULL, 0) * 0x9e3779b97f4a7c15ull + 1 : 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < n; i++) {
        const uint8_t *base = i % 2 ? base_c : base_t;
        size_t len = i % 2 ? len_c : len_t, used = len;
        memcpy(buf, base, len);
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int k = 1 + (int)((x >> 33) % 4);
        for (int j = 0; j < k; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            buf[(x >> 20) % len] = (uint8_t)(x >> 50);
        }
        if ((x >> 40) % 10 == 0)
            used = (size_t)((x >> 8) % len);
        Pdspark__GenerateRequest *m = (Pdspark__GenerateRequest *)protobuf_c_message_unpack(
            &pdspark__generate_request__descriptor, NULL, used, buf);
        if (m == NULL)
            continue;   /* malformed bytes: bad_input's case */
        /* only what would make a case long is bounded */
        if (m->sampling != NULL && (m->sampling->max_new_tokens == 0 || m->sampling->max_new_tokens > 12))
            m->sampling->max_new_tokens = 12;
        if (m->timeout_ms == 0 || m->timeout_ms > 20000)
            m->timeout_ms = 20000;
        pd_rpc_stream *s = NULL;
        pd_status st = pd_rpc_stream_open(ch, "/pdspark.Generate/Generate", &m->base,
                                          &pdspark__generate_chunk__descriptor, 60000, &s, &err);
        while (st == PD_OK) {
            ProtobufCMessage *c = NULL;
            st = pd_rpc_stream_read(s, &c, &err);
            if (st != PD_OK || c == NULL)
                break;
            protobuf_c_message_free_unpacked(c, NULL);
        }
        pd_rpc_stream_close(s);
        sent++;
        counts[st]++;
        TEST_CHECK_MSG(st == PD_OK || st == PD_ERR_INVALID || st == PD_ERR_TIMEOUT || st == PD_ERR_BUSY ||
                           st == PD_ERR_NOT_FOUND,
                       "fuzz %d: %s %s", i, pd_status_str(st), err.msg);
        protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    printf("fuzz: %d of %d mutated requests parsed and sent: ok %d, invalid %d, deadline %d, busy %d\n",
           sent, n, counts[PD_OK], counts[PD_ERR_INVALID], counts[PD_ERR_TIMEOUT], counts[PD_ERR_BUSY]);
    TEST_CHECK_MSG(sent > n / 4 && counts[PD_OK] > 0 && counts[PD_ERR_INVALID] > 0,
                   "fuzz: %d sent, %d ok, %d invalid: the mutations did not exercise both", sent,
                   counts[PD_OK], counts[PD_ERR_INVALID]);
    TEST_CHECK_MSG(waitpid(dn.pid, NULL, WNOHANG) == 0, "the decode node died during the fuzz");
    gen_call ok = { .max_new = 8, .top_p = 1.0f, .text = "def fib(n):" };
    gen_run(ch, &ok);
    TEST_CHECK_MSG(ok.st == PD_OK && ok.tokens >= 1, "serving after the fuzz: %s %s", pd_status_str(ok.st),
                   ok.msg);
    free(base_t);
    free(base_c);
    free(buf);
    pd_rpc_channel_destroy(ch);
    node_stop(&dn, SIGTERM);
}

/* ---- aux transfer modes --------------------------------------------------------------------- */

/* Runs cmd (stderr captured), returns its exit status; its output goes to out. */
static int run_capture(const char *cmd, char *out, size_t cap)
{
    char full[1024];
    snprintf(full, sizeof(full), "%s 2>&1", cmd);
    FILE *f = popen(full, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    int rc = pclose(f);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void test_services_aux_modes(void)
{
    char out[2048];
    const char *modes[] = { "ctx", "draft-kv" };
    for (int i = 0; i < 2; i++) {
        char cmd[512];
        snprintf(cmd, sizeof(cmd), "OPENBLAS_NUM_THREADS=1 timeout 60 %s/prefill_node --model %s --listen 127.0.0.1:0 "
                 "--aux-transfer %s", PD_BIN_DIR, TARGET, modes[i]);
        int rc = run_capture(cmd, out, sizeof(out));
        TEST_CHECK_MSG(rc == 1 && strstr(out, "--draft") != NULL && strstr(out, modes[i]) != NULL,
                       "--aux-transfer %s without --draft: exit %d, '%s'", modes[i], rc, out);
    }
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "timeout 60 %s/prefill_node --model %s --draft %s --listen 127.0.0.1:0 "
             "--aux-transfer bogus", PD_BIN_DIR, TARGET, DRAFT);
    int rc = run_capture(cmd, out, sizeof(out));
    TEST_CHECK_MSG(rc != 0 && strstr(out, "bogus") != NULL, "--aux-transfer bogus: exit %d, '%s'", rc, out);

    node pn = {0};
    char *pargv[] = { PD_BIN_DIR "/prefill_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--aux-transfer", "draft-kv", NULL };
    if (node_start(pargv, &pn) != 0) {
        TEST_CHECK_MSG(0, "prefill_node --aux-transfer draft-kv did not start");
        return;
    }
    pd_err err = {0};
    pd_rpc_channel *pch = NULL;
    TEST_CHECK(pd_rpc_channel_create(pn.addr, &pch, &err) == PD_OK);
    /* the tiny target's layout (16-token pages, f32, 8 layers, 2 kv heads, head dim 64) */
    uint32_t toks[4] = { 1, 2, 3, 4 }, page = 0;
    uint8_t dummy[8] = { 1 };
    Pdspark__PageLayout pl = PDSPARK__PAGE_LAYOUT__INIT;
    pl.version = PD_PROTO_VERSION;
    pl.page_size = 16;
    pl.dtype = PDSPARK__KV_DTYPE__KV_DTYPE_F32;
    pl.n_layers = 8;
    pl.bytes_per_page = 8192;
    pl.n_kv_heads = 2;
    pl.head_dim = 64;
    pl.bytes_per_page = 16 * 2 * 64 * 4;
    Pdspark__RemoteRegion kv = PDSPARK__REMOTE_REGION__INIT;
    kv.version = PD_PROTO_VERSION;
    kv.rkey.data = dummy;
    kv.rkey.len = sizeof(dummy);
    kv.length = 2ull * 8 * pl.bytes_per_page * 4;
    Pdspark__AuxLayout al = PDSPARK__AUX_LAYOUT__INIT;
    al.version = PD_PROTO_VERSION;
    al.mode = PDSPARK__AUX_MODE__AUX_MODE_RAW;
    al.rows = 4;
    Pdspark__Destination d = PDSPARK__DESTINATION__INIT;
    d.version = PD_PROTO_VERSION;
    d.worker_address.data = dummy;
    d.worker_address.len = sizeof(dummy);
    d.page_layout = &pl;
    d.kv_pool = &kv;
    d.aux_layout = &al;
    d.n_page_ids = 1;
    d.page_ids = &page;
    Pdspark__PrefillRequest pr = PDSPARK__PREFILL_REQUEST__INIT;
    pr.version = PD_PROTO_VERSION;
    pr.request_id = "no-draft-pool";
    pr.n_token_ids = 4;
    pr.token_ids = toks;
    pr.dest = &d;
    ProtobufCMessage *m = NULL;
    pd_status st = pd_rpc_unary(pch, "/pdspark.Prefill/Prefill", &pr.base,
                                &pdspark__prefill_reply__descriptor, 5000, &m, &err);
    TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, "no draft KV pool") != NULL,
                   "draft-kv without a draft pool: %s %s", pd_status_str(st), err.msg);
    if (m != NULL)
        protobuf_c_message_free_unpacked(m, NULL);
    Pdspark__PageLayout dpl = pl;
    dpl.n_layers = 99;
    Pdspark__RemoteRegion dkv = kv;
    d.draft_kv_pool = &dkv;
    d.draft_page_layout = &dpl;
    d.n_draft_page_ids = 1;
    d.draft_page_ids = &page;
    m = NULL;
    st = pd_rpc_unary(pch, "/pdspark.Prefill/Prefill", &pr.base, &pdspark__prefill_reply__descriptor,
                      5000, &m, &err);
    TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, "draft kv layout mismatch") != NULL,
                   "draft layout mismatch: %s %s", pd_status_str(st), err.msg);
    if (m != NULL)
        protobuf_c_message_free_unpacked(m, NULL);
    pd_rpc_channel_destroy(pch);
    node_stop(&pn, SIGTERM);
}

/* ---- transfers ------------------------------------------------------------------------------ */

typedef struct {
    pd_rpc_channel *ch;
    const Pdspark__PrefillRequest *rq;
    pd_status st;
    pd_err err;
    Pdspark__PrefillReply *rep;
    double ms;
    atomic_int returned;
} prefill_call;

static void *prefill_thread(void *arg)
{
    prefill_call *c = arg;
    ProtobufCMessage *m = NULL;
    double t0 = test_now_ms();
    c->st = pd_rpc_unary(c->ch, "/pdspark.Prefill/Prefill", &c->rq->base, &pdspark__prefill_reply__descriptor,
                         60000, &m, &c->err);
    c->ms = test_now_ms() - t0;
    c->rep = (Pdspark__PrefillReply *)m;
    atomic_store(&c->returned, 1);
    return NULL;
}

/* the tiny target's pool layout: 16-token pages, f32, 8 layers, 2 kv heads, head dim 64 */
enum { XT_LAYERS = 8, XT_POOL_PAGES = 8, XT_PAGE_BYTES = 16 * 2 * 64 * 4 };
#define XT_POOL_BYTES (2ull * XT_LAYERS * XT_POOL_PAGES * XT_PAGE_BYTES)

typedef struct {
    uint64_t base;
    uint32_t addr_len, rkey_len;
    uint8_t addr[1024], rkey[1024];
} xt_dest;

/* A destination in a child process that registers a pool, says where it is, and then never
 * progresses (a decode node stuck in a long step) until it is killed. Forked before this
 * process starts UCX. Returns the child's pid (0 on failure). */
static pid_t dying_dest_start(xt_dest *out)
{
    int fds[2];
    if (pipe(fds) != 0)
        return 0;
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        pd_xfer_config xc;
        pd_xfer_config_default(&xc);
        xc.name = "dying-dst";
        pd_xfer *x = NULL;
        pd_xfer_mem *m = NULL;
        void *rk = NULL;
        size_t rl = 0;
        const void *a = NULL;
        size_t al = 0;
        pd_err e;
        void *pool = calloc(1, XT_POOL_BYTES);
        xt_dest d = {0};
        if (pool != NULL && pd_xfer_create(&xc, &x, &e) == PD_OK &&
            pd_xfer_mem_register(x, pool, XT_POOL_BYTES, &m, &e) == PD_OK &&
            pd_xfer_mem_pack(m, &rk, &rl, &e) == PD_OK) {
            pd_xfer_address(x, &a, &al);
            if (al <= sizeof(d.addr) && rl <= sizeof(d.rkey)) {
                d.base = (uint64_t)(uintptr_t)pool;
                d.addr_len = (uint32_t)al;
                d.rkey_len = (uint32_t)rl;
                memcpy(d.addr, a, al);
                memcpy(d.rkey, rk, rl);
            }
        }
        if (write(fds[1], &d, sizeof(d)) != (ssize_t)sizeof(d))
            _exit(1);
        for (;;)
            pause();
    }
    close(fds[1]);
    size_t got = 0;
    while (pid > 0 && got < sizeof(*out)) {
        ssize_t r = read(fds[0], (char *)out + got, sizeof(*out) - got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fds[0]);
    if (pid > 0 && (got < sizeof(*out) || out->addr_len == 0)) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return 0;
    }
    return pid > 0 ? pid : 0;
}

static void test_services_transfer(void)
{
    enum { LAYERS = XT_LAYERS, POOL_PAGES = XT_POOL_PAGES, PAGE_BYTES = XT_PAGE_BYTES, N_TOK = 40 };
    const size_t pool_bytes = XT_POOL_BYTES;
    pd_err err = {0};
    xt_dest dying = {0};
    pid_t dying_pid = dying_dest_start(&dying);
    TEST_CHECK_MSG(dying_pid > 0, "the dying destination did not start");
    pd_xfer_config xc;
    pd_xfer_config_default(&xc);
    xc.name = "test-dst";
    pd_xfer *x = NULL;
    pd_status st = pd_xfer_create(&xc, &x, &err);
    if (st == PD_ERR_UNSUPPORTED || st != PD_OK) {
        if (st == PD_ERR_UNSUPPORTED)
            printf("transfers: skipped, UCX has no transport here\n");
        TEST_CHECK_MSG(st == PD_ERR_UNSUPPORTED, "%s", err.msg);
        if (dying_pid > 0) {
            kill(dying_pid, SIGKILL);
            waitpid(dying_pid, NULL, 0);
        }
        return;
    }
    node pn = {0};
    char *pargv[] = { PD_BIN_DIR "/prefill_node", "--model", TARGET, "--listen", "127.0.0.1:0",
                      "--transfer-timeout-ms", "30000", NULL };
    if (node_start(pargv, &pn) != 0) {
        TEST_CHECK_MSG(0, "prefill node did not start");
        pd_xfer_destroy(x);
        return;
    }
    unsigned char *pool = calloc(1, pool_bytes);
    pd_xfer_mem *mem = NULL;
    void *rkey = NULL;
    size_t rkey_len = 0;
    const void *waddr = NULL;
    size_t waddr_len = 0;
    TEST_CHECK(pd_xfer_mem_register(x, pool, pool_bytes, &mem, &err) == PD_OK);
    TEST_CHECK(pd_xfer_mem_pack(mem, &rkey, &rkey_len, &err) == PD_OK);
    pd_xfer_address(x, &waddr, &waddr_len);
    uint32_t toks[N_TOK], pages[3] = { 5, 2, 7 };
    for (int i = 0; i < N_TOK; i++)
        toks[i] = 100 + (uint32_t)(i * 37 % 5000);
    Pdspark__PageLayout pl = PDSPARK__PAGE_LAYOUT__INIT;
    pl.version = PD_PROTO_VERSION;
    pl.page_size = 16;
    pl.dtype = PDSPARK__KV_DTYPE__KV_DTYPE_F32;
    pl.n_layers = LAYERS;
    pl.n_kv_heads = 2;
    pl.head_dim = 64;
    pl.bytes_per_page = PAGE_BYTES;
    Pdspark__RemoteRegion kv = PDSPARK__REMOTE_REGION__INIT;
    kv.version = PD_PROTO_VERSION;
    kv.rkey.data = rkey;
    kv.rkey.len = rkey_len;
    kv.base_addr = (uint64_t)(uintptr_t)pool;
    kv.length = pool_bytes;
    Pdspark__AuxLayout al = PDSPARK__AUX_LAYOUT__INIT;
    al.version = PD_PROTO_VERSION;
    al.mode = PDSPARK__AUX_MODE__AUX_MODE_NONE;
    Pdspark__Destination d = PDSPARK__DESTINATION__INIT;
    d.version = PD_PROTO_VERSION;
    d.worker_address.data = (uint8_t *)waddr;
    d.worker_address.len = waddr_len;
    d.page_layout = &pl;
    d.kv_pool = &kv;
    d.aux_layout = &al;
    d.n_page_ids = 3;
    d.page_ids = pages;
    Pdspark__PrefillRequest pr = PDSPARK__PREFILL_REQUEST__INIT;
    pr.version = PD_PROTO_VERSION;
    pr.request_id = "stalled";
    pr.n_token_ids = N_TOK;
    pr.token_ids = toks;
    pr.dest = &d;
    pd_rpc_channel *pch = NULL;
    TEST_CHECK(pd_rpc_channel_create(pn.addr, &pch, &err) == PD_OK);

    /* nothing progresses the destination: over tcp the puts cannot end */
    prefill_call c1 = { .ch = pch, .rq = &pr };
    pthread_t th;
    pthread_create(&th, NULL, prefill_thread, &c1);
    usleep(1500000);
    TEST_CHECK_MSG(!atomic_load(&c1.returned), "a transfer into a destination that never progressed ended: %s %s",
                   pd_status_str(c1.st), c1.err.msg);
    ProtobufCMessage *m = NULL;
    st = cancel_prefill(pch, "stalled", &m, &err);
    TEST_CHECK_MSG(st == PD_OK && m != NULL && ((Pdspark__CancelPrefillReply *)m)->was_running,
                   "cancel during the transfer: %s %s", pd_status_str(st), err.msg);
    if (m != NULL)
        protobuf_c_message_free_unpacked(m, NULL);
    /* now the destination progresses: the cancelled puts end, and the cancel answers */
    pd_xfer_thread *xt = NULL;
    TEST_CHECK(pd_xfer_thread_start(x, &xt, &err) == PD_OK);
    pthread_join(th, NULL);
    TEST_CHECK_MSG(c1.st == PD_ERR_CANCELLED && strstr(c1.err.msg, "cancelled by the decode node") != NULL,
                   "cancelled transfer: %s %s", pd_status_str(c1.st), c1.err.msg);
    TEST_CHECK_MSG(c1.ms < 25000, "cancelled transfer answered after %.0f ms", c1.ms);
    printf("transfers: a stalled transfer cancelled, answered %.0f ms after the Prefill\n", c1.ms);
    if (c1.rep != NULL)
        protobuf_c_message_free_unpacked(&c1.rep->base, NULL);

    /* the same destination again: the KV lands in pages 5, 2, 7 of every layer's K and V */
    memset(pool, 0, pool_bytes);
    pr.request_id = "flowing";
    prefill_call c2 = { .ch = pch, .rq = &pr };
    prefill_thread(&c2);
    TEST_CHECK_MSG(c2.st == PD_OK && c2.rep != NULL, "prefill after the cancel: %s %s", pd_status_str(c2.st),
                   c2.err.msg);
    if (c2.rep != NULL) {
        TEST_CHECK(c2.rep->first_token_id < 8192 && c2.rep->prompt_tokens == N_TOK);
        TEST_CHECK_MSG(c2.rep->timings != NULL &&
                       c2.rep->timings->bytes_transferred == 2ull * LAYERS * 3 * PAGE_BYTES,
                       "bytes transferred %llu", c2.rep->timings != NULL ?
                       (unsigned long long)c2.rep->timings->bytes_transferred : 0ull);
        protobuf_c_message_free_unpacked(&c2.rep->base, NULL);
    }
    int filled = 0, untouched = 1;
    for (int half = 0; half < 2 * LAYERS; half++)
        for (int p = 0; p < POOL_PAGES; p++) {
            const unsigned char *pg = pool + ((size_t)half * POOL_PAGES + (size_t)p) * PAGE_BYTES;
            int nz = 0;
            for (size_t b = 0; b < PAGE_BYTES && !nz; b++)
                nz = pg[b] != 0;
            if (p == 5 || p == 2 || p == 7)
                filled += nz;
            else
                untouched &= !nz;
        }
    TEST_CHECK_MSG(filled == 2 * LAYERS * 3, "%d of %d destination pages hold data", filled, 2 * LAYERS * 3);
    TEST_CHECK_MSG(untouched, "a page outside the request's was written");

    /* a destination that dies while the puts wait for it: UNAVAILABLE naming the transfer, well
     * before the 30 s transfer timeout; then the live destination is served again */
    if (dying_pid > 0) {
        kv.rkey.data = dying.rkey;
        kv.rkey.len = dying.rkey_len;
        kv.base_addr = dying.base;
        d.worker_address.data = dying.addr;
        d.worker_address.len = dying.addr_len;
        pr.request_id = "dying";
        prefill_call c3 = { .ch = pch, .rq = &pr };
        pthread_create(&th, NULL, prefill_thread, &c3);
        usleep(1000000);
        TEST_CHECK_MSG(!atomic_load(&c3.returned), "a transfer into a stalled destination ended: %s %s",
                       pd_status_str(c3.st), c3.err.msg);
        double t_kill = test_now_ms();
        kill(dying_pid, SIGKILL);
        waitpid(dying_pid, NULL, 0);
        pthread_join(th, NULL);
        TEST_CHECK_MSG(c3.st == PD_ERR_PEER && strstr(c3.err.msg, "kv transfer to the decode node failed") != NULL,
                       "dead destination: %s %s", pd_status_str(c3.st), c3.err.msg);
        TEST_CHECK_MSG(test_now_ms() - t_kill < 20000, "dead destination answered %.0f ms after the kill",
                       test_now_ms() - t_kill);
        printf("transfers: a destination killed mid-transfer: %s, %.0f ms after the kill\n",
               pd_status_str(c3.st), test_now_ms() - t_kill);
        if (c3.rep != NULL)
            protobuf_c_message_free_unpacked(&c3.rep->base, NULL);
        kv.rkey.data = rkey;
        kv.rkey.len = rkey_len;
        kv.base_addr = (uint64_t)(uintptr_t)pool;
        d.worker_address.data = (uint8_t *)waddr;
        d.worker_address.len = waddr_len;
        pr.request_id = "after-death";
        prefill_call c4 = { .ch = pch, .rq = &pr };
        prefill_thread(&c4);
        TEST_CHECK_MSG(c4.st == PD_OK, "prefill after a destination died: %s %s", pd_status_str(c4.st),
                       c4.err.msg);
        if (c4.rep != NULL)
            protobuf_c_message_free_unpacked(&c4.rep->base, NULL);
    }

    /* mutated Prefill requests into the live destination: the packed request with 1-4 bytes
     * changed, sent when it still parses, with the decode node's own claims about its memory
     * (worker address, the pool's key, base and length) put back, since a decode node is trusted
     * with those; page ids, layouts, tokens, sampling, aux and draft fields stay mutated. The
     * prefill node answers each (a result or a client error), never writes outside the pool (a
     * put outside it would fault here) and lives. PD_FUZZ_N sets the count (default 300). */
    pr.request_id = "fuzz";
    pr.timeout_ms = 20000;
    size_t plen = protobuf_c_message_get_packed_size(&pr.base);
    uint8_t *pbase = malloc(plen), *pbuf = malloc(plen);
    protobuf_c_message_pack(&pr.base, pbase);
    uint64_t fx = 0x51ed270b27c0ffeeull;
    int sent = 0, ok_n = 0, bad_n = 0, n_fuzz = getenv("PD_FUZZ_N") != NULL ? atoi(getenv("PD_FUZZ_N")) : 300;
    for (int it = 0; it < n_fuzz && pbase != NULL && pbuf != NULL; it++) {
        memcpy(pbuf, pbase, plen);
        fx = fx * 6364136223846793005ull + 1442695040888963407ull;
        int k = 1 + (int)((fx >> 33) % 4);
        for (int j = 0; j < k; j++) {
            fx = fx * 6364136223846793005ull + 1442695040888963407ull;
            pbuf[(fx >> 20) % plen] = (uint8_t)(fx >> 50);
        }
        Pdspark__PrefillRequest *fm = (Pdspark__PrefillRequest *)protobuf_c_message_unpack(
            &pdspark__prefill_request__descriptor, NULL, plen, pbuf);
        if (fm == NULL)
            continue;
        Pdspark__Destination *fd = fm->dest;
        ProtobufCBinaryData keep_addr = { 0 }, keep_rkey = { 0 };
        uint64_t keep_base = 0, keep_len = 0;
        if (fd != NULL) {
            keep_addr = fd->worker_address;
            fd->worker_address.data = (uint8_t *)waddr;
            fd->worker_address.len = waddr_len;
            if (fd->kv_pool != NULL) {
                keep_rkey = fd->kv_pool->rkey;
                keep_base = fd->kv_pool->base_addr;
                keep_len = fd->kv_pool->length;
                fd->kv_pool->rkey.data = rkey;
                fd->kv_pool->rkey.len = rkey_len;
                fd->kv_pool->base_addr = (uint64_t)(uintptr_t)pool;
                fd->kv_pool->length = pool_bytes;
            }
        }
        if (fm->timeout_ms == 0 || fm->timeout_ms > 20000)
            fm->timeout_ms = 20000;
        prefill_call cf = { .ch = pch, .rq = fm };
        prefill_thread(&cf);
        sent++;
        ok_n += cf.st == PD_OK;
        bad_n += cf.st == PD_ERR_INVALID;
        TEST_CHECK_MSG(cf.st == PD_OK || cf.st == PD_ERR_INVALID || cf.st == PD_ERR_TIMEOUT ||
                           cf.st == PD_ERR_BUSY || cf.st == PD_ERR_UNSUPPORTED,
                       "prefill fuzz %d: %s %s", it, pd_status_str(cf.st), cf.err.msg);
        if (cf.rep != NULL)
            protobuf_c_message_free_unpacked(&cf.rep->base, NULL);
        if (fd != NULL) {   /* the unpacked message owns what it had */
            fd->worker_address = keep_addr;
            if (fd->kv_pool != NULL) {
                fd->kv_pool->rkey = keep_rkey;
                fd->kv_pool->base_addr = keep_base;
                fd->kv_pool->length = keep_len;
            }
        }
        protobuf_c_message_free_unpacked(&fm->base, NULL);
    }
    printf("prefill fuzz: %d mutated requests sent, %d answered OK, %d INVALID_ARGUMENT\n", sent, ok_n, bad_n);
    TEST_CHECK_MSG(sent > 50 && ok_n > 0 && bad_n > 0, "prefill fuzz: %d sent, %d ok, %d invalid", sent, ok_n,
                   bad_n);
    TEST_CHECK_MSG(waitpid(pn.pid, NULL, WNOHANG) == 0, "the prefill node died during the fuzz");
    free(pbase);
    free(pbuf);
    pr.request_id = "after-fuzz";
    prefill_call c5 = { .ch = pch, .rq = &pr };
    prefill_thread(&c5);
    TEST_CHECK_MSG(c5.st == PD_OK, "prefill after the fuzz: %s %s", pd_status_str(c5.st), c5.err.msg);
    if (c5.rep != NULL)
        protobuf_c_message_free_unpacked(&c5.rep->base, NULL);
    pd_rpc_channel_destroy(pch);
    node_stop(&pn, SIGTERM);
    pd_xfer_thread_stop(xt);
    pd_xfer_mem_deregister(mem);
    pd_xfer_destroy(x);
    free(rkey);
    free(pool);
}

/* ---- lifecycle ------------------------------------------------------------------------------ */

typedef struct {
    pd_rpc_channel *ch;
    gen_call *g;
} thr_arg;

static void *gen_thread(void *arg)
{
    thr_arg *a = arg;
    gen_run(a->ch, a->g);
    return NULL;
}

static void test_services_lifecycle(void)
{
    node pn = {0}, dn = {0};
    char *pargv[] = { PD_BIN_DIR "/prefill_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--max-batch-tokens", "1024", NULL };
    if (node_start(pargv, &pn) != 0) {
        TEST_CHECK_MSG(0, "prefill node did not start");
        return;
    }
    char *dargv[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--prefill", pn.addr, "--kv-pages", "400",
                      "--transfer-timeout-ms", "4000", NULL };
    if (node_start(dargv, &dn) != 0) {
        TEST_CHECK_MSG(0, "decode node did not start");
        node_stop(&pn, SIGKILL);
        return;
    }
    pd_err err;
    pd_rpc_channel *ch = NULL;
    TEST_CHECK(pd_rpc_channel_create(dn.addr, &ch, &err) == PD_OK);
    Pdspark__HealthReply h = PDSPARK__HEALTH_REPLY__INIT;
    TEST_CHECK(health(ch, &h) == 0);
    uint32_t baseline = h.free_kv_pages;
    TEST_CHECK_MSG(h.total_kv_pages == 400 && baseline == 400, "baseline %u of %u pages free",
                   baseline, h.total_kv_pages);
    /* prefill nodes put into the (host) KV pool directly: no staging pool (test_e2e.py's staged
     * run checks one that exists) */
    TEST_CHECK_MSG(h.staging_pages_total == 0 && h.staging_pages_used == 0 && h.staging_waits == 0,
                   "disaggregated Health without staging: %u of %u staging pages", h.staging_pages_used,
                   h.staging_pages_total);

    /* a client that disconnects mid-stream */
    gen_call g1 = { .max_new = 1500, .ignore_eos = 1, .top_p = 1.0f, .disconnect_after = 3 };
    prompt_ids(&g1, 300, 4);
    gen_run(ch, &g1);
    TEST_CHECK_MSG(g1.chunks == 3, "disconnect: %d chunks (%s)", g1.chunks, g1.msg);
    int fp = wait_free_pages(ch, baseline, 5000);
    TEST_CHECK_MSG(fp == (int)baseline, "after disconnect: %d pages free, baseline %u", fp, baseline);
    free(g1.ids);

    /* a client that disconnects from three choices: all three end, their pages come back */
    gen_call g1n = { .max_new = 1500, .ignore_eos = 1, .top_p = 1.0f, .disconnect_after = 4, .n = 3 };
    prompt_ids(&g1n, 120, 9);
    gen_run(ch, &g1n);
    TEST_CHECK_MSG(g1n.chunks == 4, "disconnect from n 3: %d chunks (%s)", g1n.chunks, g1n.msg);
    fp = wait_free_pages(ch, baseline, 5000);
    TEST_CHECK_MSG(fp == (int)baseline, "after disconnect from n 3: %d pages free, baseline %u", fp, baseline);
    free(g1n.ids);

    /* a request past its deadline */
    gen_call g2 = { .max_new = 3000, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 400 };
    prompt_ids(&g2, 200, 5);
    gen_run(ch, &g2);
    expect(&g2, PD_ERR_TIMEOUT, "deadline", "deadline");
    TEST_CHECK_MSG(g2.ms < 3000, "deadline answered after %.0f ms", g2.ms);
    fp = wait_free_pages(ch, baseline, 5000);
    TEST_CHECK_MSG(fp == (int)baseline, "after deadline: %d pages free, baseline %u", fp, baseline);
    free(g2.ids);

    /* a deadline that ends during the prefill (5 ms): the request's timeout, not a failed
     * prefill node, and the node serves the next request (the prefill node still finishes the
     * abandoned prompt first: 900 tokens took over the next call's 4.5 s under ASan) */
    gen_call g2b = { .max_new = 8, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 5 };
    prompt_ids(&g2b, 300, 6);
    gen_run(ch, &g2b);
    expect(&g2b, PD_ERR_TIMEOUT, "deadline", "deadline during prefill");
    free(g2b.ids);
    gen_call g2c = { .max_new = 4, .ignore_eos = 1, .top_p = 1.0f };
    prompt_ids(&g2c, 20, 7);
    gen_run(ch, &g2c);
    TEST_CHECK_MSG(g2c.st == PD_OK && g2c.tokens == 4, "after a deadline during prefill: %s %s",
                   pd_status_str(g2c.st), g2c.msg);
    free(g2c.ids);
    fp = wait_free_pages(ch, baseline, 5000);
    TEST_CHECK_MSG(fp == (int)baseline, "after deadlines: %d pages free, baseline %u", fp, baseline);

    /* a prefill node killed with prefills in flight: two requests decode already, then six long
     * prompts go to prefill and the node dies under them */
    enum { N_EARLY = 2, N_LATE = 6 };
    gen_call early[N_EARLY], late[N_LATE];
    pthread_t te[N_EARLY], tl[N_LATE];
    thr_arg ae[N_EARLY], al[N_LATE];
    for (int i = 0; i < N_EARLY; i++) {
        early[i] = (gen_call){ .max_new = 200, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 60000 };
        prompt_ids(&early[i], 64, 10 + (uint32_t)i);
        ae[i] = (thr_arg){ ch, &early[i] };
        pthread_create(&te[i], NULL, gen_thread, &ae[i]);
    }
    /* wait until both decode: their first tokens arrived (so their prefill is done; a slow
     * machine, e.g. under ASan beside other tests, may take seconds) */
    double t0 = test_now_ms();
    while (test_now_ms() - t0 < 30000) {
        int all = 1;
        for (int i = 0; i < N_EARLY; i++)
            all &= atomic_load(&early[i].decoding);
        if (all)
            break;
        usleep(20000);
    }
    usleep(300000);
    double t_kill = 0;
    for (int i = 0; i < N_LATE; i++) {
        late[i] = (gen_call){ .max_new = 20, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 8000 };
        prompt_ids(&late[i], 2000, 20 + (uint32_t)i);
        al[i] = (thr_arg){ ch, &late[i] };
        pthread_create(&tl[i], NULL, gen_thread, &al[i]);
    }
    usleep(150000);
    t_kill = test_now_ms();
    node_stop(&pn, SIGKILL);
    int unavailable = 0;
    for (int i = 0; i < N_LATE; i++) {
        pthread_join(tl[i], NULL);
        TEST_CHECK_MSG(late[i].st == PD_OK || (late[i].st == PD_ERR_PEER && strstr(late[i].msg, "prefill") != NULL),
                       "late %d: %s %s", i, pd_status_str(late[i].st), late[i].msg);
        unavailable += late[i].st == PD_ERR_PEER;
        TEST_CHECK_MSG(test_now_ms() - t_kill < 9000, "late %d ended %.0f ms after the kill", i, test_now_ms() - t_kill);
        free(late[i].ids);
    }
    TEST_CHECK_MSG(unavailable >= 1, "no request saw the prefill node die");
    printf("prefill node killed: %d of %d in-flight prefills failed UNAVAILABLE\n", unavailable, N_LATE);
    for (int i = 0; i < N_EARLY; i++) {
        pthread_join(te[i], NULL);
        TEST_CHECK_MSG(early[i].st == PD_OK && early[i].tokens == 200, "early %d: %s %s (%d tokens)", i,
                       pd_status_str(early[i].st), early[i].msg, early[i].tokens);
        free(early[i].ids);
    }
    fp = wait_free_pages(ch, baseline, 10000);
    TEST_CHECK_MSG(fp == (int)baseline, "after the kill: %d pages free, baseline %u", fp, baseline);

    /* restart the prefill node on the same port: used again */
    char *pargv2[] = { PD_BIN_DIR "/prefill_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                       pn.addr, NULL };
    node pn2 = {0};
    TEST_CHECK(node_start(pargv2, &pn2) == 0);
    gen_call g3 = { .max_new = 16, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 20000 };
    prompt_ids(&g3, 50, 6);
    t0 = test_now_ms();
    do {
        g3.chunks = g3.tokens = 0;
        gen_run(ch, &g3);
        if (g3.st == PD_OK)
            break;
        usleep(200000);
    } while (test_now_ms() - t0 < 15000);
    TEST_CHECK_MSG(g3.st == PD_OK && g3.tokens == 16, "after restart: %s %s", pd_status_str(g3.st), g3.msg);

    /* a prefill node that never answers (stopped): the request ends UNAVAILABLE within the
     * transfer timeout (4 s here), and its pages come back once the hold after it has passed */
    kill(pn2.pid, SIGSTOP);
    g3.chunks = g3.tokens = 0;
    gen_run(ch, &g3);
    TEST_CHECK_MSG(g3.st == PD_ERR_PEER && strstr(g3.msg, "prefill") != NULL, "stopped prefill node: %s %s",
                   pd_status_str(g3.st), g3.msg);
    TEST_CHECK_MSG(g3.ms > 3500 && g3.ms < 8000, "stopped prefill node: answered after %.0f ms", g3.ms);
    kill(pn2.pid, SIGCONT);
    fp = wait_free_pages(ch, baseline, 10000);
    TEST_CHECK_MSG(fp == (int)baseline, "after the stopped node: %d pages free, baseline %u", fp, baseline);
    free(g3.ids);
    pd_rpc_channel_destroy(ch);
    node_stop(&dn, SIGTERM);
    node_stop(&pn2, SIGTERM);
}

/* Admission by free KV pages: a request that does not fit waits in the queue and runs once pages
 * come back; with the queue full the next one gets RESOURCE_EXHAUSTED at once. */
static void test_services_admission(void)
{
    node dn = {0};
    char *dargv[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--colocated", "--kv-pages", "24", "--max-queue", "1",
                      "--queue-timeout-ms", "20000", NULL };
    if (node_start(dargv, &dn) != 0) {
        TEST_CHECK_MSG(0, "decode node did not start");
        return;
    }
    pd_err err;
    pd_rpc_channel *ch = NULL;
    TEST_CHECK(pd_rpc_channel_create(dn.addr, &ch, &err) == PD_OK);
    gen_call a = { .max_new = 40, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 30000 };
    gen_call b = a, c = a;
    prompt_ids(&a, 200, 50);
    prompt_ids(&b, 200, 51);
    prompt_ids(&c, 200, 52);
    thr_arg ta = { ch, &a }, tb = { ch, &b };
    pthread_t pa, pb;
    Pdspark__HealthReply h = PDSPARK__HEALTH_REPLY__INIT;
    pthread_create(&pa, NULL, gen_thread, &ta);
    double t0 = test_now_ms();
    while (test_now_ms() - t0 < 10000 && !(health(ch, &h) == 0 && h.active_requests == 1))
        usleep(5000);
    pthread_create(&pb, NULL, gen_thread, &tb);
    t0 = test_now_ms();
    while (test_now_ms() - t0 < 10000 && !(health(ch, &h) == 0 && h.queued_requests == 1))
        usleep(5000);
    TEST_CHECK_MSG(h.queued_requests == 1 && h.active_requests == 1, "%u active, %u queued",
                   h.active_requests, h.queued_requests);
    gen_run(ch, &c);
    expect(&c, PD_ERR_BUSY, "waiting for KV pages", "queue full");
    gen_call never = c;
    never.max_new = 400;   /* 200 + 400 tokens can never fit 24 pages of 16 */
    gen_run(ch, &never);
    expect(&never, PD_ERR_INVALID, "KV pages", "larger than the pool");
    pthread_join(pa, NULL);
    pthread_join(pb, NULL);
    TEST_CHECK_MSG(a.st == PD_OK && a.tokens == 40, "first: %s %s", pd_status_str(a.st), a.msg);
    TEST_CHECK_MSG(b.st == PD_OK && b.tokens == 40, "queued: %s %s", pd_status_str(b.st), b.msg);
    free(a.ids);
    free(b.ids);
    free(c.ids);
    pd_rpc_channel_destroy(ch);
    node_stop(&dn, SIGTERM);
}


/* Preemption (--swap-space, on by default): three requests whose answers need twice the pool
 * run together, colocated and disaggregated; each is admitted with its prompt's pages, the
 * pool runs out, requests are preempted (KV to host memory, or with no swap space to spare
 * given up and prefilled again on the decode node) and resumed, and every answer is the one
 * the request gets alone (fp32 CPU); afterwards every page is free. */
static void preempt_case(const char *decode_addr, const char *what)
{
    enum { NQ = 3 };
    pd_err err;
    pd_rpc_channel *ch = NULL;
    TEST_CHECK(pd_rpc_channel_create(decode_addr, &ch, &err) == PD_OK);
    if (ch == NULL)
        return;
    gen_call g[NQ], alone[NQ];
    thr_arg ta[NQ];
    pthread_t th[NQ];
    for (int i = 0; i < NQ; i++) {
        /* 100 + 140 + a block: 16 pages of 16 each, 48 for the three; the pool has 24 */
        g[i] = (gen_call){ .max_new = 140, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 60000 };
        prompt_ids(&g[i], 100, 60 + i);
        alone[i] = g[i];
        ta[i] = (thr_arg){ ch, &g[i] };
        pthread_create(&th[i], NULL, gen_thread, &ta[i]);
    }
    for (int i = 0; i < NQ; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < NQ; i++) {
        gen_run(ch, &alone[i]);
        TEST_CHECK_MSG(g[i].st == PD_OK && g[i].tokens == 140, "%s request %d together: %s %s (%d tokens)",
                       what, i, pd_status_str(g[i].st), g[i].msg, g[i].tokens);
        TEST_CHECK_MSG(alone[i].st == PD_OK && strcmp(g[i].out, alone[i].out) == 0,
                       "%s request %d: the answer with preemption differs from the one alone", what, i);
        free(g[i].ids);
    }
    Pdspark__HealthReply h = PDSPARK__HEALTH_REPLY__INIT;
    double t0 = test_now_ms();
    while (test_now_ms() - t0 < 5000 && !(health(ch, &h) == 0 && h.free_kv_pages == 24))
        usleep(5000);
    TEST_CHECK_MSG(h.free_kv_pages == 24 && h.active_requests == 0, "%s: %u pages free of 24 afterwards",
                   what, h.free_kv_pages);
    /* the pool did run out (Health counts preemptions, swapped or recomputed alike), and nothing
     * is left in host memory */
    TEST_CHECK_MSG(h.preemptions >= 1 && h.swapped_requests == 0 && h.swap_bytes == 0,
                   "%s: %llu preemptions, %u requests and %llu bytes swapped afterwards", what,
                   (unsigned long long)h.preemptions, h.swapped_requests, (unsigned long long)h.swap_bytes);
    pd_rpc_channel_destroy(ch);
}

static void test_services_preemption(void)
{
    node dn = {0};
    char *dargv[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--colocated", "--kv-pages", "24", NULL };
    if (node_start(dargv, &dn) != 0) {
        TEST_CHECK_MSG(0, "decode node did not start");
        return;
    }
    preempt_case(dn.addr, "colocated");
    node_stop(&dn, SIGTERM);
    node pn = {0};
    char *pargv[] = { PD_BIN_DIR "/prefill_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", NULL };
    if (node_start(pargv, &pn) != 0) {
        TEST_CHECK_MSG(0, "prefill node did not start");
        return;
    }
    char *d2[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                   "127.0.0.1:0", "--prefill", pn.addr, "--kv-pages", "24", NULL };
    if (node_start(d2, &dn) != 0) {
        TEST_CHECK_MSG(0, "decode node did not start");
        node_stop(&pn, SIGKILL);
        return;
    }
    preempt_case(dn.addr, "disaggregated");
    node_stop(&dn, SIGTERM);
    /* a swap space of ~1 KB holds no victim: their KV is prefilled again on the decode node */
    char *d3[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                   "127.0.0.1:0", "--prefill", pn.addr, "--kv-pages", "24", "--swap-space", "0.000001", NULL };
    if (node_start(d3, &dn) != 0) {
        TEST_CHECK_MSG(0, "decode node did not start");
        node_stop(&pn, SIGKILL);
        return;
    }
    preempt_case(dn.addr, "disaggregated, recomputed");
    node_stop(&dn, SIGTERM);
    node_stop(&pn, SIGTERM);
}

/* Several prefill addresses, one of them dead: a name that resolves to several addresses counts
 * as several nodes, and a Prefill that never reached its node is re-sent to another one. */
static void test_services_multi_node(void)
{
    node pn = {0}, dn = {0};
    char *pargv[] = { PD_BIN_DIR "/prefill_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", NULL };
    if (node_start(pargv, &pn) != 0) {
        TEST_CHECK_MSG(0, "prefill node did not start");
        return;
    }
    const char *port = strrchr(pn.addr, ':') + 1;
    char list[160];
    snprintf(list, sizeof(list), "127.0.0.1:1,localhost:%s", port);
    char *dargv[] = { PD_BIN_DIR "/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                      "127.0.0.1:0", "--prefill", list, NULL };
    if (node_start(dargv, &dn) != 0) {
        TEST_CHECK_MSG(0, "decode node did not start");
        node_stop(&pn, SIGKILL);
        return;
    }
    pd_err err;
    pd_rpc_channel *ch = NULL;
    TEST_CHECK(pd_rpc_channel_create(dn.addr, &ch, &err) == PD_OK);
    for (int i = 0; i < 4; i++) {
        gen_call g = { .max_new = 8, .ignore_eos = 1, .top_p = 1.0f, .timeout_ms = 20000 };
        prompt_ids(&g, 30, 40 + (uint32_t)i);
        gen_run(ch, &g);
        TEST_CHECK_MSG(g.st == PD_OK && g.tokens == 8, "multi-node request %d: %s %s", i,
                       pd_status_str(g.st), g.msg);
        free(g.ids);
    }
    prompt_lps_case(ch, "disaggregated");
    pd_rpc_channel_destroy(ch);
    node_stop(&dn, SIGTERM);
    node_stop(&pn, SIGTERM);
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    const char *only = argc > 1 ? argv[1] : "all";
    if (access(PD_BIN_DIR "/decode_node", X_OK) != 0 || access(PD_BIN_DIR "/prefill_node", X_OK) != 0)
        TEST_SKIP("decode_node / prefill_node not built");
    if (strcmp(only, "all") == 0 || strcmp(only, "bad-input") == 0)
        test_services_bad_input();
    if (strcmp(only, "all") == 0 || strcmp(only, "tools") == 0)
        test_services_tools();
    if (strcmp(only, "all") == 0 || strcmp(only, "fuzz") == 0)
        test_services_fuzz();
    if (strcmp(only, "all") == 0 || strcmp(only, "aux-modes") == 0)
        test_services_aux_modes();
    if (strcmp(only, "all") == 0 || strcmp(only, "transfer") == 0)
        test_services_transfer();
    if (strcmp(only, "all") == 0 || strcmp(only, "lifecycle") == 0)
        test_services_lifecycle();
    if (strcmp(only, "all") == 0 || strcmp(only, "multi-node") == 0)
        test_services_multi_node();
    if (strcmp(only, "all") == 0 || strcmp(only, "admission") == 0)
        test_services_admission();
    if (strcmp(only, "all") == 0 || strcmp(only, "preemption") == 0)
        test_services_preemption();
    TEST_DONE();
}
