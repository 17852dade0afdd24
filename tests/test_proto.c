/* test_proto.c - the wire contract: every message carries `uint32 version = 1`, round trips of
 * the messages with the most structure (PrefillRequest with its destination, the final
 * GenerateChunk with its tool calls, whole or as stream_tool_arguments deltas), HealthReply's
 * staging pool fields (0 from a sender that has none), the version check helper, malformed bytes
 * failing to unpack, and GenerateRequest's chat (messages with tool calls and results, tools, tool_choice)
 * read as the HTTP API's chat body: the same tools and the same rendered prompt, and each
 * malformed field refused by name (pd_wire_chat_in); pd_json_parse, which reads those fields
 * (a whole text as one JSON value, trailing bytes refused at their offset). */
#include <stdbool.h>
#include <string.h>

#include "pd_chat.h"
#include "pd_json.h"
#include "pd_proto_version.h"
#include "pd_wire.h"
#include "pdspark.pb-c.h"
#include "test_util.h"

static const ProtobufCMessageDescriptor *const all_messages[] = {
    &pdspark__sampling_params__descriptor,   &pdspark__health_request__descriptor,
    &pdspark__health_reply__descriptor,      &pdspark__generate_request__descriptor,
    &pdspark__usage__descriptor,             &pdspark__dspark_stats__descriptor,
    &pdspark__generate_chunk__descriptor,    &pdspark__page_layout__descriptor,
    &pdspark__aux_layout__descriptor,        &pdspark__remote_region__descriptor,
    &pdspark__destination__descriptor,       &pdspark__prefill_request__descriptor,
    &pdspark__prefill_timings__descriptor,   &pdspark__prefill_reply__descriptor,
    &pdspark__cancel_prefill_request__descriptor, &pdspark__cancel_prefill_reply__descriptor,
    &pdspark__logit_bias__descriptor,        &pdspark__chat_message__descriptor,
    &pdspark__token_logprobs__descriptor,    &pdspark__tool_call__descriptor,
};

static void test_version_fields(void)
{
    size_t n = sizeof(all_messages) / sizeof(all_messages[0]);
    for (size_t i = 0; i < n; i++) {
        const ProtobufCFieldDescriptor *f =
            protobuf_c_message_descriptor_get_field(all_messages[i], PD_PROTO_VERSION_FIELD);
        TEST_CHECK_MSG(f != NULL && strcmp(f->name, "version") == 0 &&
                           f->type == PROTOBUF_C_TYPE_UINT32 &&
                           f->label != PROTOBUF_C_LABEL_REPEATED,
                       "%s", all_messages[i]->name);
    }
    /* every message type in the file is in the list above */
    TEST_CHECK(pdspark__generate__descriptor.n_methods == 2);
    TEST_CHECK(pdspark__prefill__descriptor.n_methods == 3);
    TEST_CHECK(strcmp(pdspark__prefill__descriptor.name, "pdspark.Prefill") == 0);
    TEST_CHECK(strcmp(pdspark__generate__descriptor.name, "pdspark.Generate") == 0);
}

static void test_prefill_roundtrip(void)
{
    Pdspark__PrefillRequest req = PDSPARK__PREFILL_REQUEST__INIT;
    Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
    Pdspark__Destination dst = PDSPARK__DESTINATION__INIT;
    Pdspark__RemoteRegion kv = PDSPARK__REMOTE_REGION__INIT, aux = PDSPARK__REMOTE_REGION__INIT;
    Pdspark__PageLayout pl = PDSPARK__PAGE_LAYOUT__INIT;
    Pdspark__AuxLayout al = PDSPARK__AUX_LAYOUT__INIT;
    req.version = sp.version = dst.version = kv.version = aux.version = pl.version = al.version =
        PD_PROTO_VERSION;
    req.request_id = (char *)"req-42";
    uint32_t toks[5] = {151643, 1, 2, 3, 70000};
    req.n_token_ids = 5;
    req.token_ids = toks;
    sp.temperature = 0.7f;
    sp.top_k = 20;
    sp.seed = 1234567890123ull;
    char *stops[2] = {(char *)"\n\n", (char *)"</s>"};
    sp.n_stop = 2;
    sp.stop = stops;
    req.sampling = &sp;
    uint8_t waddr[7] = {9, 8, 7, 6, 5, 4, 3};
    dst.worker_address.len = sizeof(waddr);
    dst.worker_address.data = waddr;
    uint32_t pages[3] = {17, 4, 99};
    dst.n_page_ids = 3;
    dst.page_ids = pages;
    uint8_t rkey[4] = {0xde, 0xad, 0xbe, 0xef};
    kv.rkey.len = 4;
    kv.rkey.data = rkey;
    kv.base_addr = 0x7f0000001000ull;
    kv.length = 4u << 20;
    aux.rkey = kv.rkey;
    aux.base_addr = 0x7f0000900000ull;
    aux.length = 1u << 20;
    pl.page_size = 16;
    pl.dtype = PDSPARK__KV_DTYPE__KV_DTYPE_BF16;
    pl.n_layers = 28;
    pl.n_kv_heads = 8;
    pl.head_dim = 128;
    pl.bytes_per_page = 16ull * 28 * 8 * 128 * 2 * 2;
    al.mode = PDSPARK__AUX_MODE__AUX_MODE_CTX;
    al.rows = 5;
    al.row_bytes = 2560 * 2;
    dst.kv_pool = &kv;
    dst.aux = &aux;
    dst.page_layout = &pl;
    dst.aux_layout = &al;
    req.dest = &dst;

    size_t n = pdspark__prefill_request__get_packed_size(&req);
    uint8_t *buf = malloc(n);
    TEST_CHECK(pdspark__prefill_request__pack(&req, buf) == n);
    Pdspark__PrefillRequest *r = pdspark__prefill_request__unpack(NULL, n, buf);
    TEST_CHECK(r != NULL);
    if (r != NULL) {
        TEST_CHECK(pd_proto_version_check(&r->base, NULL) == PD_OK);
        TEST_CHECK(strcmp(r->request_id, "req-42") == 0);
        TEST_CHECK(r->n_token_ids == 5 && r->token_ids[4] == 70000);
        TEST_CHECK(r->sampling != NULL && r->sampling->top_k == 20 &&
                   r->sampling->seed == 1234567890123ull && r->sampling->n_stop == 2 &&
                   strcmp(r->sampling->stop[1], "</s>") == 0);
        const Pdspark__Destination *d = r->dest;
        TEST_CHECK(d != NULL && d->worker_address.len == 7 && d->worker_address.data[6] == 3);
        TEST_CHECK(d != NULL && d->n_page_ids == 3 && d->page_ids[2] == 99);
        TEST_CHECK(d != NULL && d->kv_pool != NULL && d->kv_pool->rkey.len == 4 &&
                   d->kv_pool->rkey.data[0] == 0xde && d->kv_pool->base_addr == kv.base_addr);
        TEST_CHECK(d != NULL && d->page_layout != NULL && d->page_layout->n_layers == 28 &&
                   d->page_layout->dtype == PDSPARK__KV_DTYPE__KV_DTYPE_BF16 &&
                   d->page_layout->bytes_per_page == pl.bytes_per_page);
        TEST_CHECK(d != NULL && d->aux_layout != NULL &&
                   d->aux_layout->mode == PDSPARK__AUX_MODE__AUX_MODE_CTX);
        pdspark__prefill_request__free_unpacked(r, NULL);
    }
    /* truncated bytes do not unpack */
    TEST_CHECK(pdspark__prefill_request__unpack(NULL, n - 3, buf) == NULL);
    free(buf);
}

static void test_chunk_roundtrip(void)
{
    Pdspark__GenerateChunk c = PDSPARK__GENERATE_CHUNK__INIT;
    Pdspark__Usage u = PDSPARK__USAGE__INIT;
    Pdspark__DSparkStats st = PDSPARK__DSPARK_STATS__INIT;
    c.version = u.version = st.version = PD_PROTO_VERSION;
    c.final = true;
    c.finish_reason = PDSPARK__FINISH_REASON__FINISH_REASON_STOP;
    u.prompt_tokens = 12;
    u.completion_tokens = 30;
    uint32_t acc[4] = {6, 0, 3, 6};
    st.rounds = 4;
    st.n_accepted_per_round = 4;
    st.accepted_per_round = acc;
    st.tau = 4.75f;
    c.usage = &u;
    c.stats = &st;
    Pdspark__ToolCall tc = PDSPARK__TOOL_CALL__INIT, *tcp = &tc;
    tc.version = PD_PROTO_VERSION;
    tc.id = "call_0123456789abcdef01234567";
    tc.name = "get_weather";
    tc.arguments_json = "{\"city\": \"Paris\"}";
    tc.index = 1;
    c.n_tool_calls = 1;
    c.tool_calls = &tcp;
    c.finish_reason = PDSPARK__FINISH_REASON__FINISH_REASON_TOOL_CALLS;
    uint8_t buf[256];
    TEST_CHECK(pdspark__generate_chunk__get_packed_size(&c) <= sizeof(buf));
    size_t n = pdspark__generate_chunk__pack(&c, buf);
    Pdspark__GenerateChunk *r = pdspark__generate_chunk__unpack(NULL, n, buf);
    TEST_CHECK(r != NULL && r->final && r->usage != NULL && r->usage->completion_tokens == 30 &&
               r->stats != NULL && r->stats->n_accepted_per_round == 4 &&
               r->stats->accepted_per_round[2] == 3 && r->stats->tau == 4.75f &&
               r->finish_reason == PDSPARK__FINISH_REASON__FINISH_REASON_TOOL_CALLS);
    TEST_CHECK(r != NULL && r->n_tool_calls == 1 && r->tool_calls[0]->version == PD_PROTO_VERSION &&
               strcmp(r->tool_calls[0]->name, "get_weather") == 0 && r->tool_calls[0]->index == 1 &&
               strcmp(r->tool_calls[0]->arguments_json, tc.arguments_json) == 0 &&
               strcmp(r->tool_calls[0]->id, tc.id) == 0);
    if (r != NULL)
        pdspark__generate_chunk__free_unpacked(r, NULL);
}

/* stream_tool_arguments: a chunk with a call's first delta (index, id, name, a piece) and a later
 * delta of another call (index and piece only) round trips, the unset strings read as empty; a
 * whole call carries no delta; the request flag round trips and is off unless set */
static void test_tool_deltas(void)
{
    Pdspark__GenerateChunk c = PDSPARK__GENERATE_CHUNK__INIT;
    c.version = PD_PROTO_VERSION;
    Pdspark__ToolCall d0 = PDSPARK__TOOL_CALL__INIT, d1 = PDSPARK__TOOL_CALL__INIT, *dp[2] = { &d0, &d1 };
    d0.version = d1.version = PD_PROTO_VERSION;
    d0.index = 0;
    d0.arguments_delta = "\"Paris\"}";
    d1.index = 1;
    d1.id = "call_0123456789abcdef01234567";
    d1.name = "now";
    d1.arguments_delta = "{\"tz\": ";
    c.n_tool_calls = 2;
    c.tool_calls = dp;
    uint8_t buf[256];
    TEST_CHECK(pdspark__generate_chunk__get_packed_size(&c) <= sizeof(buf));
    size_t n = pdspark__generate_chunk__pack(&c, buf);
    Pdspark__GenerateChunk *r = pdspark__generate_chunk__unpack(NULL, n, buf);
    TEST_CHECK(r != NULL && r->n_tool_calls == 2);
    if (r != NULL && r->n_tool_calls == 2) {
        const Pdspark__ToolCall *a = r->tool_calls[0], *b = r->tool_calls[1];
        TEST_CHECK(a->index == 0 && a->id[0] == '\0' && a->name[0] == '\0' && a->arguments_json[0] == '\0' &&
                   strcmp(a->arguments_delta, d0.arguments_delta) == 0);
        TEST_CHECK(b->index == 1 && strcmp(b->id, d1.id) == 0 && strcmp(b->name, "now") == 0 &&
                   b->arguments_json[0] == '\0' && strcmp(b->arguments_delta, d1.arguments_delta) == 0);
    }
    if (r != NULL)
        pdspark__generate_chunk__free_unpacked(r, NULL);
    /* a whole call leaves arguments_delta empty (proto3: not on the wire) */
    Pdspark__ToolCall w = PDSPARK__TOOL_CALL__INIT;
    w.version = PD_PROTO_VERSION;
    w.id = d1.id;
    w.name = "now";
    w.arguments_json = "{\"tz\": \"UTC\"}";
    size_t wn = pdspark__tool_call__pack(&w, buf);
    Pdspark__ToolCall *wr = pdspark__tool_call__unpack(NULL, wn, buf);
    TEST_CHECK(wr != NULL && wr->arguments_delta[0] == '\0' &&
               strcmp(wr->arguments_json, w.arguments_json) == 0);
    if (wr != NULL)
        pdspark__tool_call__free_unpacked(wr, NULL);
    Pdspark__GenerateRequest q = PDSPARK__GENERATE_REQUEST__INIT;
    q.version = PD_PROTO_VERSION;
    TEST_CHECK(!q.stream_tool_arguments);
    q.stream_tool_arguments = true;
    n = pdspark__generate_request__pack(&q, buf);
    Pdspark__GenerateRequest *qr = pdspark__generate_request__unpack(NULL, n, buf);
    TEST_CHECK(qr != NULL && qr->stream_tool_arguments);
    if (qr != NULL)
        pdspark__generate_request__free_unpacked(qr, NULL);
}

/* HealthReply's staging pool: the numbers round trip (waits past 32 bits); a reply with the
 * older fields only reads 0 of 0 */
static void test_health_staging(void)
{
    Pdspark__HealthReply h = PDSPARK__HEALTH_REPLY__INIT;
    h.version = PD_PROTO_VERSION;
    h.status = PDSPARK__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING;
    h.free_kv_pages = 100;
    h.total_kv_pages = 400;
    uint8_t buf[128];
    size_t n = pdspark__health_reply__pack(&h, buf);
    Pdspark__HealthReply *r = pdspark__health_reply__unpack(NULL, n, buf);
    TEST_CHECK(r != NULL && r->total_kv_pages == 400 && r->staging_pages_used == 0 && r->staging_pages_total == 0 &&
               r->staging_waits == 0);
    if (r != NULL)
        pdspark__health_reply__free_unpacked(r, NULL);
    h.staging_pages_used = 16;
    h.staging_pages_total = 256;
    h.staging_waits = 5000000000ull;
    n = pdspark__health_reply__pack(&h, buf);
    r = pdspark__health_reply__unpack(NULL, n, buf);
    TEST_CHECK(r != NULL && r->staging_pages_used == 16 && r->staging_pages_total == 256 &&
               r->staging_waits == 5000000000ull && r->free_kv_pages == 100);
    if (r != NULL)
        pdspark__health_reply__free_unpacked(r, NULL);
}

static void test_version_check(void)
{
    pd_err err;
    Pdspark__HealthRequest h = PDSPARK__HEALTH_REQUEST__INIT;
    TEST_CHECK(pd_proto_version_check(&h.base, &err) == PD_ERR_INVALID);   /* unset */
    TEST_CHECK(strstr(err.msg, "not set") != NULL);
    h.version = PD_PROTO_VERSION + 1;
    TEST_CHECK(pd_proto_version_check(&h.base, &err) == PD_ERR_INVALID);
    TEST_CHECK_MSG(strstr(err.msg, "pdspark.HealthRequest: protocol version 2, expected 1") != NULL,
                   "%s", err.msg);
    h.version = PD_PROTO_VERSION;
    TEST_CHECK(pd_proto_version_check(&h.base, &err) == PD_OK);
    TEST_CHECK(pd_proto_version_of(&h.base) == PD_PROTO_VERSION);
    TEST_CHECK(pd_proto_version_check(NULL, &err) == PD_ERR_INVALID);
    /* a message decoded from an older peer without the field reads as 0 -> refused */
    uint8_t empty[1];
    Pdspark__HealthRequest *r = pdspark__health_request__unpack(NULL, 0, empty);
    TEST_CHECK(r != NULL && pd_proto_version_check(&r->base, NULL) == PD_ERR_INVALID);
    if (r != NULL)
        pdspark__health_request__free_unpacked(r, NULL);
}

/* ---- GenerateRequest's chat as the HTTP API's chat body ------------------------------------ */

#define WEATHER "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": " \
                "\"Weather of a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": " \
                "{\"enum\": [\"Paris\", \"Rome\"]}, \"days\": {\"type\": \"integer\"}}, \"required\": " \
                "[\"city\"]}}}"
#define NOW "{\"type\": \"function\", \"function\": {\"name\": \"now\", \"parameters\": {\"type\": " \
            "\"object\", \"properties\": {\"tz\": {\"enum\": [\"UTC\", \"CET\"]}}}}}"
/* an assistant turn's calls: the arguments as JSON text, compact (rendered as json.dumps writes them) */
#define CALLS "[{\"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", " \
              "\"arguments\": \"{\\\"city\\\":\\\"Paris\\\",\\\"days\\\":3}\"}}, {\"id\": \"call_2\", " \
              "\"type\": \"function\", \"function\": {\"name\": \"now\", \"arguments\": \"{}\"}}]"

/* the prompt and the tools pd_chat makes of a chat body (what decode_http does with a request's) */
static int render_body(const pd_chat_template *tp, const cJSON *body, int thinking, pd_chat_tools *t, char **out)
{
    const char *param = NULL;
    char msg[256];
    size_t len = 0;
    pd_chat_opts o = PD_CHAT_OPTS_DEFAULT;
    o.enable_thinking = thinking;
    *out = NULL;
    if (pd_chat_tools_parse(body, t, &param, msg, sizeof(msg)) != 0 ||
        pd_chat_render(tp, cJSON_GetObjectItemCaseSensitive(body, "messages"), t, &o, out, &len, msg,
                       sizeof(msg)) != 0) {
        fprintf(stderr, "render: %s: %s\n", param != NULL ? param : "", msg);
        return -1;
    }
    return 0;
}

/* n chat messages of these roles and contents (version set, the rest empty) and their pointers */
static void chat_msgs(Pdspark__ChatMessage *cm, Pdspark__ChatMessage **cmp, const char *const *roles,
                      const char *const *contents, int n)
{
    for (int i = 0; i < n; i++) {
        pdspark__chat_message__init(&cm[i]);
        cm[i].version = PD_PROTO_VERSION;
        cm[i].role = (char *)roles[i];
        cm[i].content = (char *)contents[i];
        cmp[i] = &cm[i];
    }
}

static void test_chat_in(void)
{
    /* a tool round: system, user, the assistant's two calls, their two results, the user again */
    static const char *const roles[] = { "system", "user", "assistant", "tool", "tool", "user" };
    static const char *const contents[] = { "You are terse.", "Weather in Paris for 3 days, and the time?", "",
                                            "sunny, 21C", "12:00", "Thanks. And Rome?" };
    Pdspark__ChatMessage cm[6], *cmp[6];
    chat_msgs(cm, cmp, roles, contents, 6);
    cm[2].tool_calls_json = CALLS;
    cm[3].tool_call_id = "call_1";
    cm[3].name = "get_weather";
    cm[4].tool_call_id = "call_2";
    Pdspark__GenerateRequest rq = PDSPARK__GENERATE_REQUEST__INIT;
    rq.version = PD_PROTO_VERSION;
    rq.n_messages = 6;
    rq.messages = cmp;
    rq.tools_json = "[" WEATHER ", " NOW "]";
    rq.tool_choice = "{\"type\": \"function\", \"function\": {\"name\": \"now\"}}";
    rq.parallel_tool_calls = 1;
    /* the same conversation as an HTTP client sends it (an assistant's content null) */
    cJSON *http = cJSON_Parse("{\"messages\": [{\"role\": \"system\", \"content\": \"You are terse.\"}, "
                              "{\"role\": \"user\", \"content\": \"Weather in Paris for 3 days, and the time?\"}, "
                              "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": " CALLS "}, "
                              "{\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"sunny, 21C\"}, "
                              "{\"role\": \"tool\", \"tool_call_id\": \"call_2\", \"content\": \"12:00\"}, "
                              "{\"role\": \"user\", \"content\": \"Thanks. And Rome?\"}], "
                              "\"tools\": [" WEATHER ", " NOW "], \"tool_choice\": {\"type\": \"function\", "
                              "\"function\": {\"name\": \"now\"}}, \"parallel_tool_calls\": false}");
    TEST_CHECK(http != NULL);
    /* a Qwen2.5-like template and a Qwen3 one (reasoning of earlier turns dropped, enable_thinking) */
    pd_chat_template plain = { 0 }, think = { .think = 1, .think_switch = 1 };
    snprintf(plain.default_system, sizeof(plain.default_system), "You are a helpful assistant.");
    const pd_chat_template *tps[2] = { &plain, &think };
    for (int k = 0; k < 2; k++) {
        for (int thinking = 0; thinking < 2; thinking++) {
            cJSON *body = NULL;
            pd_err err = { 0 };
            TEST_CHECK_MSG(pd_wire_chat_in(&rq, &body, &err) == PD_OK, "%s", err.msg);
            pd_chat_tools tg, th;
            char *pg = NULL, *ph = NULL;
            TEST_CHECK(body != NULL && render_body(tps[k], body, thinking, &tg, &pg) == 0);
            TEST_CHECK(render_body(tps[k], http, thinking, &th, &ph) == 0);
            TEST_CHECK_MSG(pg != NULL && ph != NULL && strcmp(pg, ph) == 0,
                           "template %d: gRPC's chat renders\n%s\nthe HTTP body's\n%s", k, pg, ph);
            TEST_CHECK(pg != NULL && strstr(pg, "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                                                "\"days\": 3}}") != NULL && strstr(pg, "<tools>") != NULL &&
                       strstr(pg, "<tool_response>\n12:00\n</tool_response>") != NULL);
            TEST_CHECK(tg.choice == PD_TOOLS_NAMED && th.choice == PD_TOOLS_NAMED && tg.named == 1 && th.named == 1 &&
                       tg.n == 2 && th.n == 2 && tg.parallel == 0 && th.parallel == 0 &&
                       strcmp(tg.schemas[0], th.schemas[0]) == 0 && pd_chat_tools_mode(&tg) == 2);
            free(pg);
            free(ph);
            pd_chat_tools_free(&tg);
            pd_chat_tools_free(&th);
            cJSON_Delete(body);
        }
    }
    cJSON_Delete(http);
    /* the keywords go as strings; parallel_tool_calls 0 and 2 are on */
    static const char *const words[] = { "auto", "required", "none", "" };
    static const int want[] = { PD_TOOLS_AUTO, PD_TOOLS_REQUIRED, PD_TOOLS_NONE, PD_TOOLS_AUTO };
    for (int i = 0; i < 4; i++) {
        rq.tool_choice = (char *)words[i];
        rq.parallel_tool_calls = (uint32_t)(i % 2 == 0 ? 0 : 2);
        cJSON *body = NULL;
        pd_err err = { 0 };
        pd_chat_tools t;
        const char *param = NULL;
        char msg[256];
        TEST_CHECK(pd_wire_chat_in(&rq, &body, &err) == PD_OK &&
                   pd_chat_tools_parse(body, &t, &param, msg, sizeof(msg)) == 0);
        TEST_CHECK_MSG(t.choice == want[i] && t.parallel == 1, "tool_choice '%s': %d", words[i], t.choice);
        pd_chat_tools_free(&t);
        cJSON_Delete(body);
    }
    /* an assistant's reasoning (ChatMessage.reasoning_content, the HTTP API's reasoning_content):
     * a reasoning template renders it for the turn after the last user message */
    {
        Pdspark__ChatMessage rm[3], *rmp[3];
        static const char *const rroles[] = { "user", "assistant", "tool" };
        static const char *const rcontents[] = { "Weather in Paris?", "", "sunny, 21C" };
        chat_msgs(rm, rmp, rroles, rcontents, 3);
        rm[1].tool_calls_json = CALLS;
        rm[1].reasoning_content = "The user wants the weather: call get_weather.";
        rm[2].tool_call_id = "call_1";
        Pdspark__GenerateRequest rr = PDSPARK__GENERATE_REQUEST__INIT;
        rr.version = PD_PROTO_VERSION;
        rr.n_messages = 3;
        rr.messages = rmp;
        rr.tools_json = "[" WEATHER "]";
        cJSON *hb = cJSON_Parse("{\"messages\": [{\"role\": \"user\", \"content\": \"Weather in Paris?\"}, "
                                "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": " CALLS ", "
                                "\"reasoning_content\": \"The user wants the weather: call get_weather.\"}, "
                                "{\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"sunny, 21C\"}], "
                                "\"tools\": [" WEATHER "]}");
        cJSON *gb = NULL;
        pd_err err = { 0 };
        TEST_CHECK_MSG(hb != NULL && pd_wire_chat_in(&rr, &gb, &err) == PD_OK, "%s", err.msg);
        pd_chat_template thk = { .think = 1, .think_switch = 1 };
        pd_chat_tools tg, th;
        char *pg = NULL, *ph = NULL;
        TEST_CHECK(gb != NULL && render_body(&thk, gb, 1, &tg, &pg) == 0 && render_body(&thk, hb, 1, &th, &ph) == 0);
        TEST_CHECK_MSG(pg != NULL && ph != NULL && strcmp(pg, ph) == 0, "reasoning: gRPC's chat renders\n%s\nHTTP's\n%s",
                       pg, ph);
        TEST_CHECK_MSG(pg != NULL && strstr(pg, "<think>\nThe user wants the weather: call get_weather.\n</think>") != NULL,
                       "the reasoning is not in the prompt:\n%s", pg != NULL ? pg : "");
        free(pg);
        free(ph);
        pd_chat_tools_free(&tg);
        pd_chat_tools_free(&th);
        cJSON_Delete(gb);
        cJSON_Delete(hb);
    }
    /* malformed fields, each refused naming itself */
    struct { const char *tools, *choice, *calls; uint32_t par, version; const char *needle; } bad[] = {
        { "[" WEATHER, "", NULL, 0, PD_PROTO_VERSION, "tools_json is not valid JSON" },
        { "[" WEATHER "]", "{\"type\": \"function\"", NULL, 0, PD_PROTO_VERSION, "tool_choice is not valid JSON" },
        { "[" WEATHER "]", "", "{\"id\": 1}", 0, PD_PROTO_VERSION, "messages[2].tool_calls_json is not a JSON array" },
        { "[" WEATHER "]", "", "[{\"id\"", 0, PD_PROTO_VERSION, "messages[2].tool_calls_json is not valid JSON (at byte 5)" },
        /* one JSON value and nothing after it but whitespace */
        { "[" WEATHER "] x", "", NULL, 0, PD_PROTO_VERSION, "tools_json is not valid JSON (at byte" },
        { "[" WEATHER "]", "\"auto\"\"none\"", NULL, 0, PD_PROTO_VERSION, "tool_choice is not valid JSON (at byte 6)" },
        { "[" WEATHER "]", "", NULL, 3, PD_PROTO_VERSION, "parallel_tool_calls" },
        { "[" WEATHER "]", "", NULL, 0, PD_PROTO_VERSION + 1, "messages[4]: protocol version" },
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        rq.tools_json = (char *)bad[i].tools;
        rq.tool_choice = (char *)bad[i].choice;
        cm[2].tool_calls_json = (char *)(bad[i].calls != NULL ? bad[i].calls : CALLS);
        rq.parallel_tool_calls = bad[i].par;
        cm[4].version = bad[i].version;
        cJSON *body = (cJSON *)&rq;   /* must stay untouched */
        pd_err err = { 0 };
        pd_status st = pd_wire_chat_in(&rq, &body, &err);
        TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, bad[i].needle) != NULL && body == (cJSON *)&rq,
                       "bad case %zu: %s '%s', expected '%s'", i, pd_status_str(st), err.msg, bad[i].needle);
    }
    /* JSON that reads but says the wrong thing is pd_chat_tools_parse's to refuse, as for HTTP */
    cm[2].tool_calls_json = CALLS;
    cm[4].version = PD_PROTO_VERSION;
    rq.parallel_tool_calls = 0;
    rq.tools_json = "{\"type\": \"function\"}";
    rq.tool_choice = "sometimes";
    cJSON *body = NULL;
    pd_err err = { 0 };
    pd_chat_tools t;
    const char *param = NULL;
    char msg[256];
    TEST_CHECK(pd_wire_chat_in(&rq, &body, &err) == PD_OK);
    TEST_CHECK(pd_chat_tools_parse(body, &t, &param, msg, sizeof(msg)) != 0 && strcmp(param, "tools") == 0);
    pd_chat_tools_free(&t);
    cJSON_Delete(body);
    rq.tools_json = "[" NOW "]";
    TEST_CHECK(pd_wire_chat_in(&rq, &body, &err) == PD_OK);
    TEST_CHECK(pd_chat_tools_parse(body, &t, &param, msg, sizeof(msg)) != 0 && strcmp(param, "tool_choice") == 0);
    pd_chat_tools_free(&t);
    cJSON_Delete(body);
}

/* pd_json_parse: one JSON value and nothing after it but JSON whitespace */
static void test_json_whole(void)
{
    static const struct { const char *text; int ok; size_t bad_at; } cases[] = {
        { "{\"a\": 1}", 1, 0 },
        { " \t\r\n[1, 2]\n\n", 1, 0 },
        { "\"s\"", 1, 0 },
        { "{\"a\": 1} xyz", 0, 9 },
        { "{\"a\": 1}}", 0, 8 },
        { "1 2", 0, 2 },
        { "[1, 2] \f", 0, 7 },   /* form feed is not JSON whitespace */
        { "{\"a\": }", 0, 6 },
        { "", 0, 0 },
        { "   ", 0, 2 },
        /* a control character inside a string must be escaped (RFC 8259 7) */
        { "{\"pre\x04" "ence\": 1}", 0, 5 },
        { "[\"a\tb\"]", 0, 3 },
        { "[\"a\nb\"]", 0, 3 },
        { "{\"a\": \"x\x1f\"}", 0, 8 },
        { "[\"a\\tb\", \"\\\"\x7f\"]", 1, 0 },   /* escaped tab and quote, DEL: fine */
        { "\t[\"a\"]\n", 1, 0 },                    /* whitespace outside strings: fine */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t bad = 12345;
        cJSON *v = pd_json_parse_str(cases[i].text, &bad);
        TEST_CHECK_MSG((v != NULL) == cases[i].ok && (cases[i].ok ? bad == 0 : bad == cases[i].bad_at),
                       "'%s': %s at %zu, expected at %zu", cases[i].text, v != NULL ? "parsed" : "refused", bad,
                       cases[i].bad_at);
        cJSON_Delete(v);
    }
    /* a length shorter than the text: the bytes after it are not read */
    cJSON *v = pd_json_parse("[7] trailing", 3, NULL);
    TEST_CHECK(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 1);
    cJSON_Delete(v);
    TEST_CHECK(pd_json_parse_str(NULL, NULL) == NULL);
}

int main(void)
{
    test_version_fields();
    test_prefill_roundtrip();
    test_chunk_roundtrip();
    test_tool_deltas();
    test_health_staging();
    test_version_check();
    test_chat_in();
    test_json_whole();
    TEST_DONE();
}
