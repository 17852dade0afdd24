/* test_rpc.c - pd_rpc on 127.0.0.1:0: unary and server-streaming calls, deadline, malformed
 * request, wrong version, unknown method, client cancel seen by the server, handler errors,
 * shutdown with calls in flight. Nothing here is timed; waits are bounded only to turn a hang
 * into a failure. */
#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pd_proto_version.h"
#include "pd_rpc.h"
#include "pdspark.pb-c.h"
#include "test_util.h"

#define M_HEALTH "/pdspark.Prefill/Health"
#define M_CANCEL "/pdspark.Prefill/CancelPrefill"
#define M_PREFILL "/pdspark.Prefill/Prefill"
#define M_GENERATE "/pdspark.Generate/Generate"

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_health;
    int n_done;            /* on-done callbacks seen */
    int n_done_cancelled;
    int n_prefill_cancelled;
    int n_stream_cancel_seen; /* writer saw PD_ERR_CANCELLED or on-done(cancelled) */
    int n_held;               /* "hold" streams the handler accepted */
    int n_deadline_seen;      /* on_prefill saw a finite client deadline */
    int n_prefill_started;
    pthread_t writers[64];
    int n_writers;
} server_state;

typedef struct {
    server_state *s;
    pd_rpc_call *call;
    unsigned n_chunks;      /* 0 = until cancelled */
} writer_args;

static void state_bump(server_state *s, int *field)
{
    pthread_mutex_lock(&s->mu);
    (*field)++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static int state_get(server_state *s, const int *field)
{
    pthread_mutex_lock(&s->mu);
    int v = *field;
    pthread_mutex_unlock(&s->mu);
    return v;
}

/* Wait until *field >= want; false after 20 s (a hang turned into a failure, not a timing). */
static bool state_wait(server_state *s, int *field, int want)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 20;
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    while (*field < want && rc == 0)
        rc = pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    bool ok = *field >= want;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static pd_status on_health(void *ud, const ProtobufCMessage *req, pd_rpc_call *call)
{
    (void)req;
    server_state *s = ud;
    state_bump(s, &s->n_health);
    Pdspark__HealthReply r = PDSPARK__HEALTH_REPLY__INIT;
    r.version = PD_PROTO_VERSION;
    r.status = PDSPARK__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING;
    r.node = (char *)"test";
    return pd_rpc_reply(call, &r.base) == PD_OK ? PD_OK : PD_OK;
}

static pd_status on_cancel_prefill(void *ud, const ProtobufCMessage *req, pd_rpc_call *call)
{
    (void)ud;
    const Pdspark__CancelPrefillRequest *r = (const Pdspark__CancelPrefillRequest *)req;
    if (strcmp(r->request_id, "known") != 0)
        return PD_ERR_NOT_FOUND;    /* pd_rpc finishes the call with NOT_FOUND */
    Pdspark__CancelPrefillReply rep = PDSPARK__CANCEL_PREFILL_REPLY__INIT;
    rep.version = PD_PROTO_VERSION;
    rep.was_running = true;
    pd_rpc_reply(call, &rep.base);
    return PD_OK;
}

static void prefill_done(void *arg, pd_rpc_call *call, bool cancelled)
{
    server_state *s = arg;
    if (cancelled)
        state_bump(s, &s->n_prefill_cancelled);
    state_bump(s, &s->n_done);
    pd_rpc_finish(call, PD_ERR_CANCELLED, "gone");   /* release our reference */
}

/* Never replies: it only ends when the client's deadline (or shutdown) cancels the call. */
static pd_status on_prefill(void *ud, const ProtobufCMessage *req, pd_rpc_call *call)
{
    (void)req;
    server_state *s = ud;
    if (pd_rpc_call_deadline_ms(call) < INT64_MAX)   /* checked on the main thread */
        state_bump(s, &s->n_deadline_seen);
    state_bump(s, &s->n_prefill_started);
    pd_rpc_call_on_done(call, prefill_done, ud);
    return PD_OK;
}

static void stream_done(void *arg, pd_rpc_call *call, bool cancelled)
{
    (void)call;
    server_state *s = arg;
    if (cancelled)
        state_bump(s, &s->n_done_cancelled);
    state_bump(s, &s->n_done);
}

static void *stream_writer(void *arg)
{
    writer_args *w = arg;
    server_state *s = w->s;
    pd_status st = PD_OK;
    for (unsigned i = 0; w->n_chunks == 0 || i < w->n_chunks; i++) {
        Pdspark__GenerateChunk c = PDSPARK__GENERATE_CHUNK__INIT;
        c.version = PD_PROTO_VERSION;
        char text[32];
        snprintf(text, sizeof(text), "tok%u ", i);
        c.text_delta = text;
        uint32_t id = i;
        c.n_token_ids = 1;
        c.token_ids = &id;
        st = pd_rpc_stream_write(w->call, &c.base);
        if (st == PD_ERR_BUSY) {            /* slow reader: back off */
            usleep(1000);
            i--;
            continue;
        }
        if (st != PD_OK)
            break;
        if (w->n_chunks == 0)
            usleep(2000);
    }
    if (st == PD_ERR_CANCELLED) {
        state_bump(s, &s->n_stream_cancel_seen);
        pd_rpc_finish(w->call, PD_ERR_CANCELLED, NULL);
    } else if (st == PD_OK) {
        Pdspark__GenerateChunk fin = PDSPARK__GENERATE_CHUNK__INIT;
        Pdspark__Usage usage = PDSPARK__USAGE__INIT;
        Pdspark__DSparkStats stats = PDSPARK__DSPARK_STATS__INIT;
        uint32_t acc[2] = {3, 4};
        fin.version = usage.version = stats.version = PD_PROTO_VERSION;
        fin.final = true;
        fin.finish_reason = PDSPARK__FINISH_REASON__FINISH_REASON_LENGTH;
        usage.prompt_tokens = 5;
        usage.completion_tokens = w->n_chunks;
        stats.rounds = 2;
        stats.n_accepted_per_round = 2;
        stats.accepted_per_round = acc;
        stats.tau = 4.5f;
        fin.usage = &usage;
        fin.stats = &stats;
        pd_rpc_stream_write(w->call, &fin.base);
        pd_rpc_finish(w->call, PD_OK, NULL);
    } else {
        pd_rpc_finish(w->call, st, NULL);
    }
    free(w);
    return NULL;
}

static void hold_done(void *arg, pd_rpc_call *call, bool cancelled)
{
    server_state *s = arg;
    if (cancelled)
        state_bump(s, &s->n_done_cancelled);
    state_bump(s, &s->n_done);
    pd_rpc_finish(call, PD_ERR_CANCELLED, NULL);
}

/* prompt_text "hold": keep the call open without writing until it is cancelled.
 * otherwise: a writer thread sends max_new_tokens chunks (0 = until cancelled). */
static pd_status on_generate(void *ud, const ProtobufCMessage *req, pd_rpc_call *call)
{
    server_state *s = ud;
    const Pdspark__GenerateRequest *r = (const Pdspark__GenerateRequest *)req;
    if (strcmp(r->prompt_text, "hold") == 0) {
        pd_rpc_call_on_done(call, hold_done, s);
        state_bump(s, &s->n_held);
        return PD_OK;
    }
    if (r->sampling == NULL)
        return PD_ERR_INVALID;
    pd_rpc_call_on_done(call, stream_done, s);
    writer_args *w = calloc(1, sizeof(*w));
    w->s = s;
    w->call = call;
    w->n_chunks = r->sampling->max_new_tokens;
    pthread_mutex_lock(&s->mu);
    PD_ASSERT(s->n_writers < 64);
    pthread_create(&s->writers[s->n_writers++], NULL, stream_writer, w);
    pthread_mutex_unlock(&s->mu);
    return PD_OK;
}

static const pd_rpc_method methods[] = {
    {M_HEALTH, PD_RPC_UNARY, &pdspark__health_request__descriptor, on_health},
    {M_CANCEL, PD_RPC_UNARY, &pdspark__cancel_prefill_request__descriptor, on_cancel_prefill},
    {M_PREFILL, PD_RPC_UNARY, &pdspark__prefill_request__descriptor, on_prefill},
    {M_GENERATE, PD_RPC_SERVER_STREAM, &pdspark__generate_request__descriptor, on_generate},
};

static pd_status count_chunk(void *ud, const ProtobufCMessage *msg)
{
    (void)msg;
    (*(unsigned *)ud)++;
    return PD_OK;
}

static pd_status stop_after_two(void *ud, const ProtobufCMessage *msg)
{
    (void)msg;
    return ++(*(unsigned *)ud) == 2 ? PD_ERR_CANCELLED : PD_OK;
}

static pd_status health_call(pd_rpc_channel *ch, uint32_t version, pd_err *err)
{
    Pdspark__HealthRequest req = PDSPARK__HEALTH_REQUEST__INIT;
    req.version = version;
    ProtobufCMessage *resp = NULL;
    pd_status st = pd_rpc_unary(ch, M_HEALTH, &req.base, &pdspark__health_reply__descriptor, 5000,
                                &resp, err);
    if (st == PD_OK) {
        Pdspark__HealthReply *h = (Pdspark__HealthReply *)resp;
        TEST_CHECK(pd_proto_version_check(resp, NULL) == PD_OK);
        TEST_CHECK(h->status == PDSPARK__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING);
        TEST_CHECK(strcmp(h->node, "test") == 0);
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    return st;
}

typedef struct {
    pd_rpc_channel *ch;
    int ok;                 /* calls that returned what they should */
} client_thread_arg;

/* Concurrent clients: unary calls and short streams from several threads on one channel. */
static void *client_thread(void *arg)
{
    client_thread_arg *a = arg;
    for (int i = 0; i < 25; i++) {
        Pdspark__HealthRequest req = PDSPARK__HEALTH_REQUEST__INIT;
        req.version = PD_PROTO_VERSION;
        ProtobufCMessage *resp = NULL;
        pd_err err;
        if (pd_rpc_unary(a->ch, M_HEALTH, &req.base, &pdspark__health_reply__descriptor, 10000,
                         &resp, &err) == PD_OK) {
            a->ok++;
            protobuf_c_message_free_unpacked(resp, NULL);
        }
        if (i % 5 == 0) {
            Pdspark__GenerateRequest g = PDSPARK__GENERATE_REQUEST__INIT;
            Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
            g.version = sp.version = PD_PROTO_VERSION;
            g.prompt_text = (char *)"x";
            sp.max_new_tokens = 10;
            g.sampling = &sp;
            unsigned n = 0;
            if (pd_rpc_stream_call(a->ch, M_GENERATE, &g.base,
                                   &pdspark__generate_chunk__descriptor, 10000, count_chunk,
                                   &n, &err) == PD_OK && n == 11)
                a->ok++;
        }
    }
    return NULL;
}

typedef struct {
    pd_rpc_channel *ch;
    pd_status st;
} held_unary_arg;

/* A Prefill call without a deadline: it ends only when the server shuts down. */
static void *held_unary(void *arg)
{
    held_unary_arg *a = arg;
    Pdspark__PrefillRequest req = PDSPARK__PREFILL_REQUEST__INIT;
    req.version = PD_PROTO_VERSION;
    req.request_id = (char *)"held";
    ProtobufCMessage *resp = NULL;
    pd_err err;
    a->st = pd_rpc_unary(a->ch, M_PREFILL, &req.base, &pdspark__prefill_reply__descriptor, 0,
                         &resp, &err);
    if (resp != NULL)
        protobuf_c_message_free_unpacked(resp, NULL);
    return NULL;
}

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n;                 /* callbacks run */
    pd_status st;
    bool resp_ok;
    char msg[512];
} async_box;

static void async_done(void *ud, pd_status st, ProtobufCMessage *resp, const pd_err *err)
{
    async_box *b = ud;
    pthread_mutex_lock(&b->mu);
    b->st = st;
    b->resp_ok = (st == PD_OK) == (resp != NULL);
    snprintf(b->msg, sizeof(b->msg), "%s", err->msg);
    b->n++;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    if (resp != NULL)
        protobuf_c_message_free_unpacked(resp, NULL);
}

static bool async_wait(async_box *b, int want)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 20;
    pthread_mutex_lock(&b->mu);
    int rc = 0;
    while (b->n < want && rc == 0)
        rc = pthread_cond_timedwait(&b->cv, &b->mu, &ts);
    bool ok = b->n >= want;
    pthread_mutex_unlock(&b->mu);
    return ok;
}

static void async_box_init(async_box *b)
{
    memset(b, 0, sizeof(*b));
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
}

static void async_box_cleanup(async_box *b)
{
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
}

static void test_async(server_state *s, pd_rpc_channel *ch, const char *target)
{
    pd_err err;
    async_box b;
    async_box_init(&b);

    /* reply */
    Pdspark__HealthRequest h = PDSPARK__HEALTH_REQUEST__INIT;
    h.version = PD_PROTO_VERSION;
    TEST_CHECK(pd_rpc_unary_async(ch, M_HEALTH, &h.base, &pdspark__health_reply__descriptor, 5000,
                                  async_done, &b, NULL, &err) == PD_OK);
    TEST_CHECK(async_wait(&b, 1) && b.st == PD_OK && b.resp_ok);

    /* error status */
    h.version = 99;
    TEST_CHECK(pd_rpc_unary_async(ch, M_HEALTH, &h.base, &pdspark__health_reply__descriptor, 5000,
                                  async_done, &b, NULL, &err) == PD_OK);
    TEST_CHECK(async_wait(&b, 2) && b.st == PD_ERR_INVALID && b.resp_ok);
    TEST_CHECK_MSG(strstr(b.msg, "protocol version 99") != NULL, "%s", b.msg);

    /* deadline */
    Pdspark__PrefillRequest pr = PDSPARK__PREFILL_REQUEST__INIT;
    pr.version = PD_PROTO_VERSION;
    pr.request_id = (char *)"async";
    TEST_CHECK(pd_rpc_unary_async(ch, M_PREFILL, &pr.base, &pdspark__prefill_reply__descriptor,
                                  200, async_done, &b, NULL, &err) == PD_OK);
    TEST_CHECK(async_wait(&b, 3) && b.st == PD_ERR_TIMEOUT);

    /* cancel by handle: the server sees it */
    int cancelled = state_get(s, &s->n_prefill_cancelled);
    int started = state_get(s, &s->n_prefill_started);
    pd_rpc_pending *pend = NULL;
    TEST_CHECK(pd_rpc_unary_async(ch, M_PREFILL, &pr.base, &pdspark__prefill_reply__descriptor, 0,
                                  async_done, &b, &pend, &err) == PD_OK);
    TEST_CHECK(state_wait(s, &s->n_prefill_started, started + 1));
    pd_rpc_pending_cancel(pend);
    TEST_CHECK(async_wait(&b, 4) && b.st == PD_ERR_CANCELLED);
    TEST_CHECK(state_wait(s, &s->n_prefill_cancelled, cancelled + 1));
    pd_rpc_pending_cancel(pend);   /* after the callback: a no-op */
    pd_rpc_pending_release(pend);

    /* channel destroyed with an async call in flight: its callback runs first */
    pd_rpc_channel *ch2 = NULL;
    TEST_CHECK(pd_rpc_channel_create(target, &ch2, &err) == PD_OK);
    started = state_get(s, &s->n_prefill_started);
    TEST_CHECK(pd_rpc_unary_async(ch2, M_PREFILL, &pr.base, &pdspark__prefill_reply__descriptor, 0,
                                  async_done, &b, &pend, &err) == PD_OK);
    TEST_CHECK(state_wait(s, &s->n_prefill_started, started + 1));
    pd_rpc_channel_destroy(ch2);
    pthread_mutex_lock(&b.mu);
    TEST_CHECK(b.n == 5 && b.st == PD_ERR_CANCELLED);
    pthread_mutex_unlock(&b.mu);
    pd_rpc_pending_cancel(pend);   /* still valid after the channel is gone */
    pd_rpc_pending_release(pend);
    async_box_cleanup(&b);
}

static void test_status_mapping(void)
{
    TEST_CHECK(pd_rpc_code_from(PD_OK) == PD_RPC_OK);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_INVALID) == PD_RPC_INVALID_ARGUMENT);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_NOT_FOUND) == PD_RPC_NOT_FOUND);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_TIMEOUT) == PD_RPC_DEADLINE_EXCEEDED);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_PEER) == PD_RPC_UNAVAILABLE);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_BUSY) == PD_RPC_RESOURCE_EXHAUSTED);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_CANCELLED) == PD_RPC_CANCELLED);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_UNSUPPORTED) == PD_RPC_UNIMPLEMENTED);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_NOMEM) == PD_RPC_INTERNAL);
    TEST_CHECK(pd_rpc_code_from(PD_ERR_CUDA) == PD_RPC_INTERNAL);
    pd_status round[] = {PD_OK, PD_ERR_INVALID, PD_ERR_NOT_FOUND, PD_ERR_TIMEOUT, PD_ERR_PEER,
                         PD_ERR_BUSY, PD_ERR_CANCELLED, PD_ERR_UNSUPPORTED, PD_ERR_INTERNAL};
    for (size_t i = 0; i < sizeof(round) / sizeof(round[0]); i++)
        TEST_CHECK(pd_rpc_status_from_code(pd_rpc_code_from(round[i])) == round[i]);
    TEST_CHECK(pd_rpc_status_from_code(PD_RPC_DATA_LOSS) == PD_ERR_INTERNAL);
}

int main(void)
{
    test_status_mapping();

    server_state s;
    memset(&s, 0, sizeof(s));
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.cv, NULL);

    pd_err err;
    pd_rpc_server *srv = NULL;
    pd_status st = pd_rpc_server_create("127.0.0.1:0", methods, 4, &s, &srv, &err);
    if (st == PD_ERR_IO)
        TEST_SKIP("cannot listen on 127.0.0.1 (no loopback networking here)");
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK)
        TEST_DONE();
    int port = pd_rpc_server_port(srv);
    TEST_CHECK(port > 0);
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    pd_rpc_channel *ch = NULL;
    TEST_CHECK(pd_rpc_channel_create(target, &ch, &err) == PD_OK);

    /* bad method table is refused */
    pd_rpc_method bad = {"noslash", PD_RPC_UNARY, &pdspark__health_request__descriptor, on_health};
    pd_rpc_server *srv2 = NULL;
    TEST_CHECK(pd_rpc_server_create("127.0.0.1:0", &bad, 1, &s, &srv2, &err) == PD_ERR_INVALID);

    /* bad listen addresses are refused by name (gRPC would take port 99999 modulo 65536) */
    static const char *bad_addr[] = {"127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:12a", "nohostport",
                                     "127.0.0.1:", ":50051"};
    for (size_t i = 0; i < sizeof(bad_addr) / sizeof(bad_addr[0]); i++) {
        st = pd_rpc_server_create(bad_addr[i], methods, 4, &s, &srv2, &err);
        TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, bad_addr[i]) != NULL &&
                           strstr(err.msg, "want HOST:PORT") != NULL,
                       "%s: %s: %s", bad_addr[i], pd_status_str(st), err.msg);
        if (st == PD_OK)
            pd_rpc_server_destroy(srv2);
    }

    /* a channel to a port outside 1..65535 is refused by name; other target forms pass */
    static const char *bad_target[] = {"127.0.0.1:99999", "127.0.0.1:0"};
    for (size_t i = 0; i < 2; i++) {
        pd_rpc_channel *bc = NULL;
        st = pd_rpc_channel_create(bad_target[i], &bc, &err);
        TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, bad_target[i]) != NULL, "%s: %s: %s",
                       bad_target[i], pd_status_str(st), err.msg);
        if (st == PD_OK)
            pd_rpc_channel_destroy(bc);
    }
    {
        pd_rpc_channel *uc = NULL;
        st = pd_rpc_channel_create("unix:/nonexistent/pdspark.sock", &uc, &err);
        TEST_CHECK_MSG(st == PD_OK, "unix target: %s", err.msg);
        if (st == PD_OK)
            pd_rpc_channel_destroy(uc);
    }

    /* a second server on a port already served fails and names the address (gRPC would share
     * the port through SO_REUSEPORT and split the connections between the two) */
    st = pd_rpc_server_create(target, methods, 4, &s, &srv2, &err);
    TEST_CHECK_MSG(st == PD_ERR_IO && strstr(err.msg, target) != NULL, "%s: %s", pd_status_str(st), err.msg);
    if (st == PD_OK)
        pd_rpc_server_destroy(srv2);

    /* unary */
    st = health_call(ch, PD_PROTO_VERSION, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);

    /* wrong version: INVALID_ARGUMENT with a message naming the versions; handler not run */
    int before = state_get(&s, &s.n_health);
    st = health_call(ch, PD_PROTO_VERSION + 6, &err);
    TEST_CHECK(st == PD_ERR_INVALID);
    TEST_CHECK_MSG(strstr(err.msg, "protocol version 7, expected 1") != NULL, "%s", err.msg);
    TEST_CHECK_MSG(strstr(err.msg, "INVALID_ARGUMENT") != NULL, "%s", err.msg);
    st = health_call(ch, 0, &err);
    TEST_CHECK(st == PD_ERR_INVALID);
    TEST_CHECK(state_get(&s, &s.n_health) == before);

    /* malformed bytes through a raw call, then the server keeps serving */
    static const unsigned char junk[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01};
    void *out = NULL;
    size_t out_len = 0;
    st = pd_rpc_unary_raw(ch, M_HEALTH, junk, sizeof(junk), 5000, &out, &out_len, &err);
    TEST_CHECK_MSG(st == PD_ERR_INVALID, "%s: %s", pd_status_str(st), err.msg);
    TEST_CHECK_MSG(strstr(err.msg, "malformed") != NULL, "%s", err.msg);
    st = health_call(ch, PD_PROTO_VERSION, &err);
    TEST_CHECK_MSG(st == PD_OK, "after malformed: %s", err.msg);

    /* oversize request: INVALID_ARGUMENT from our limit, then the server keeps serving */
    {
        size_t big_len = PD_RPC_MAX_MESSAGE_BYTES + 4096;
        unsigned char *big = calloc(1, big_len);
        st = pd_rpc_unary_raw(ch, M_HEALTH, big, big_len, 20000, &out, &out_len, &err);
        TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, "exceeds the limit") != NULL,
                       "%s: %s", pd_status_str(st), err.msg);
        free(big);
        TEST_CHECK(health_call(ch, PD_PROTO_VERSION, &err) == PD_OK);
    }

    /* a valid message by raw bytes, answered by raw bytes */
    Pdspark__HealthRequest hreq = PDSPARK__HEALTH_REQUEST__INIT;
    hreq.version = PD_PROTO_VERSION;
    unsigned char hbuf[16];
    size_t hlen = pdspark__health_request__pack(&hreq, hbuf);
    st = pd_rpc_unary_raw(ch, M_HEALTH, hbuf, hlen, 5000, &out, &out_len, &err);
    TEST_CHECK(st == PD_OK && out_len > 0);
    if (st == PD_OK) {
        Pdspark__HealthReply *hr = pdspark__health_reply__unpack(NULL, out_len, out);
        TEST_CHECK(hr != NULL && hr->version == PD_PROTO_VERSION);
        if (hr != NULL)
            pdspark__health_reply__free_unpacked(hr, NULL);
        free(out);
    }

    /* unknown method */
    st = pd_rpc_unary_raw(ch, "/pdspark.Prefill/Nope", hbuf, hlen, 5000, &out, &out_len, &err);
    TEST_CHECK_MSG(st == PD_ERR_UNSUPPORTED, "%s", err.msg);
    TEST_CHECK(strstr(err.msg, "UNIMPLEMENTED") != NULL);

    /* handler error status -> NOT_FOUND; the good id gets a reply */
    Pdspark__CancelPrefillRequest creq = PDSPARK__CANCEL_PREFILL_REQUEST__INIT;
    creq.version = PD_PROTO_VERSION;
    creq.request_id = (char *)"nope";
    ProtobufCMessage *cresp = NULL;
    st = pd_rpc_unary(ch, M_CANCEL, &creq.base, &pdspark__cancel_prefill_reply__descriptor, 5000,
                      &cresp, &err);
    TEST_CHECK_MSG(st == PD_ERR_NOT_FOUND, "%s", err.msg);
    creq.request_id = (char *)"known";
    st = pd_rpc_unary(ch, M_CANCEL, &creq.base, &pdspark__cancel_prefill_reply__descriptor, 5000,
                      &cresp, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st == PD_OK) {
        TEST_CHECK(((Pdspark__CancelPrefillReply *)cresp)->was_running);
        protobuf_c_message_free_unpacked(cresp, NULL);
    }

    /* deadline exceeded: the server never replies; it sees the cancel */
    Pdspark__PrefillRequest preq = PDSPARK__PREFILL_REQUEST__INIT;
    preq.version = PD_PROTO_VERSION;
    preq.request_id = (char *)"r1";
    uint32_t toks[3] = {1, 2, 3};
    preq.n_token_ids = 3;
    preq.token_ids = toks;
    ProtobufCMessage *presp = NULL;
    /* 1 s: long enough for the request to reach the handler even on a loaded CI machine */
    st = pd_rpc_unary(ch, M_PREFILL, &preq.base, &pdspark__prefill_reply__descriptor, 1000,
                      &presp, &err);
    TEST_CHECK_MSG(st == PD_ERR_TIMEOUT, "%s: %s", pd_status_str(st), err.msg);
    TEST_CHECK(strstr(err.msg, "DEADLINE_EXCEEDED") != NULL);
    TEST_CHECK(state_wait(&s, &s.n_prefill_cancelled, 1));
    TEST_CHECK(state_get(&s, &s.n_deadline_seen) == 1);

    /* streaming: 20 chunks + final */
    Pdspark__GenerateRequest greq = PDSPARK__GENERATE_REQUEST__INIT;
    Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
    greq.version = sp.version = PD_PROTO_VERSION;
    greq.prompt_text = (char *)"hello";
    sp.max_new_tokens = 20;
    greq.sampling = &sp;
    pd_rpc_stream *rs = NULL;
    st = pd_rpc_stream_open(ch, M_GENERATE, &greq.base, &pdspark__generate_chunk__descriptor, 10000,
                            &rs, &err);
    TEST_CHECK(st == PD_OK);
    unsigned n_msgs = 0;
    bool ordered = true, got_final = false;
    for (;;) {
        ProtobufCMessage *m = NULL;
        st = pd_rpc_stream_read(rs, &m, &err);
        if (st != PD_OK || m == NULL)
            break;
        Pdspark__GenerateChunk *c = (Pdspark__GenerateChunk *)m;
        if (c->final) {
            got_final = c->usage != NULL && c->usage->completion_tokens == 20 &&
                        c->stats != NULL && c->stats->n_accepted_per_round == 2 &&
                        c->stats->accepted_per_round[1] == 4 &&
                        c->finish_reason == PDSPARK__FINISH_REASON__FINISH_REASON_LENGTH;
        } else {
            char want[32];
            snprintf(want, sizeof(want), "tok%u ", n_msgs);
            ordered = ordered && strcmp(c->text_delta, want) == 0 && c->n_token_ids == 1 &&
                      c->token_ids[0] == n_msgs;
            n_msgs++;
        }
        protobuf_c_message_free_unpacked(m, NULL);
    }
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    TEST_CHECK(n_msgs == 20);
    TEST_CHECK(ordered);
    TEST_CHECK(got_final);
    pd_rpc_stream_close(rs);

    /* handler returning an error on a stream */
    greq.sampling = NULL;
    st = pd_rpc_stream_open(ch, M_GENERATE, &greq.base, &pdspark__generate_chunk__descriptor, 5000,
                            &rs, &err);
    TEST_CHECK(st == PD_OK);
    if (st == PD_OK) {
        ProtobufCMessage *m = NULL;
        st = pd_rpc_stream_read(rs, &m, &err);
        TEST_CHECK(st == PD_ERR_INVALID && m == NULL);
        st = pd_rpc_stream_read(rs, &m, &err);   /* sticky */
        TEST_CHECK(st == PD_ERR_INVALID && m == NULL);
        pd_rpc_stream_close(rs);
    }
    greq.sampling = &sp;

    /* client cancel mid-stream: the server sees it (writer gets CANCELLED, on-done cancelled) */
    sp.max_new_tokens = 0;
    int done_before = state_get(&s, &s.n_done_cancelled);
    st = pd_rpc_stream_open(ch, M_GENERATE, &greq.base, &pdspark__generate_chunk__descriptor, 0,
                            &rs, &err);
    TEST_CHECK(st == PD_OK);
    for (int i = 0; i < 3 && st == PD_OK; i++) {
        ProtobufCMessage *m = NULL;
        st = pd_rpc_stream_read(rs, &m, &err);
        TEST_CHECK(st == PD_OK && m != NULL);
        if (m != NULL)
            protobuf_c_message_free_unpacked(m, NULL);
    }
    pd_rpc_stream_cancel(rs);
    {
        ProtobufCMessage *m = NULL;
        do {   /* messages already in flight may still arrive before the cancel status */
            if (m != NULL)
                protobuf_c_message_free_unpacked(m, NULL);
            st = pd_rpc_stream_read(rs, &m, &err);
        } while (st == PD_OK && m != NULL);
        TEST_CHECK_MSG(st == PD_ERR_CANCELLED, "%s", pd_status_str(st));
    }
    pd_rpc_stream_close(rs);
    TEST_CHECK(state_wait(&s, &s.n_done_cancelled, done_before + 1));
    TEST_CHECK(state_wait(&s, &s.n_stream_cancel_seen, 1));

    /* the callback form */
    sp.max_new_tokens = 5;
    unsigned n_cb = 0;
    st = pd_rpc_stream_call(ch, M_GENERATE, &greq.base, &pdspark__generate_chunk__descriptor,
                            10000, count_chunk, &n_cb, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    TEST_CHECK(n_cb == 6);
    /* a callback error cancels the call and comes back */
    n_cb = 0;
    sp.max_new_tokens = 0;
    st = pd_rpc_stream_call(ch, M_GENERATE, &greq.base, &pdspark__generate_chunk__descriptor,
                            10000, stop_after_two, &n_cb, &err);
    TEST_CHECK(st == PD_ERR_CANCELLED && n_cb == 2);
    TEST_CHECK(state_wait(&s, &s.n_stream_cancel_seen, 2));

    test_async(&s, ch, target);

    /* concurrent clients */
    enum { N_CLIENTS = 4 };
    pthread_t cts[N_CLIENTS];
    client_thread_arg cas[N_CLIENTS];
    for (int i = 0; i < N_CLIENTS; i++) {
        cas[i] = (client_thread_arg){ch, 0};
        pthread_create(&cts[i], NULL, client_thread, &cas[i]);
    }
    for (int i = 0; i < N_CLIENTS; i++) {
        pthread_join(cts[i], NULL);
        TEST_CHECK_MSG(cas[i].ok == 30, "client %d: %d of 30 calls ok", i, cas[i].ok);
    }

    /* shutdown with calls in flight: a held stream and a held unary */
    pd_rpc_stream *held = NULL;
    greq.prompt_text = (char *)"hold";
    st = pd_rpc_stream_open(ch, M_GENERATE, &greq.base, &pdspark__generate_chunk__descriptor, 0,
                            &held, &err);
    TEST_CHECK(st == PD_OK);
    TEST_CHECK(state_wait(&s, &s.n_held, 1));   /* the server holds it */
    held_unary_arg hu = {ch, PD_OK};
    pthread_t hut;
    int started = state_get(&s, &s.n_prefill_started);
    pthread_create(&hut, NULL, held_unary, &hu);
    TEST_CHECK(state_wait(&s, &s.n_prefill_started, started + 1));
    int done_total = state_get(&s, &s.n_done);
    pd_rpc_server_destroy(srv);
    TEST_CHECK(state_wait(&s, &s.n_done, done_total + 2));   /* both saw the cancel */
    pthread_join(hut, NULL);
    TEST_CHECK_MSG(hu.st == PD_ERR_CANCELLED || hu.st == PD_ERR_PEER, "%s",
                   pd_status_str(hu.st));
    if (held != NULL) {
        ProtobufCMessage *m = NULL;
        st = pd_rpc_stream_read(held, &m, &err);
        TEST_CHECK(m == NULL);
        TEST_CHECK_MSG(st == PD_ERR_CANCELLED || st == PD_ERR_PEER, "%s: %s", pd_status_str(st),
                       err.msg);
        pd_rpc_stream_close(held);
    }

    /* the server is gone: a call now fails with a status, not a hang */
    st = health_call(ch, PD_PROTO_VERSION, &err);
    TEST_CHECK_MSG(st == PD_ERR_PEER || st == PD_ERR_TIMEOUT, "%s", pd_status_str(st));

    pd_rpc_channel_destroy(ch);
    for (int i = 0; i < s.n_writers; i++)
        pthread_join(s.writers[i], NULL);
    pthread_mutex_destroy(&s.mu);
    pthread_cond_destroy(&s.cv);
    TEST_DONE();
}
