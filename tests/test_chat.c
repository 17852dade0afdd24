/* test_chat: chat prompts and the chat output parser.
 * - pd_chat_render against the prompts Hugging Face's apply_chat_template makes from Qwen3's and
 *   Qwen2.5's templates and from the bundled model's ChatML template
 *   (tests/fixtures/chat/chat_cases.json, made by make_chat_cases.py with jinja2): tools, tool
 *   calls (arguments as objects, JSON text, none) and responses, reasoning in history,
 *   enable_thinking, Qwen2.5's default system prompt, add_generation_prompt false and
 *   continue_final_message;
 * - tools / tool_choice / parallel_tool_calls parsing and its errors; 3000 random requests
 *   (messages and tools of random shapes) rendered or refused with a message, never more;
 * - the tool-call grammar (Hermes format): calls that follow the schema accepted, others not;
 * - the output parser: content, <think> reasoning and <tool_call> blocks split the same whether
 *   the text comes whole or a byte at a time, tags split across feeds held back, bad blocks kept
 *   as content; when each call's arguments are whole (pd_chat_parser_calls_done), call ids;
 * - pd_chat_template_load: chat_template.jinja, tokenizer_config.json (string and named list),
 *   none, not ChatML, and --chat-template given as text or a file;
 * - pd_jinja against jinja2's renders (tests/fixtures/jinja/jinja_cases.json, made by
 *   make_jinja_cases.py): templates in the styles of chat templates and one through the
 *   language's corners, outputs byte for byte and raise_exception's messages; the bundled
 *   model's template rendering chat_cases.json's ChatML cases; syntax errors by line. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pd_chat.h"
#include "pd_jinja.h"
#include "test_util.h"

/* what Qwen2.5-Instruct's chat template writes when the messages bring no system turn */
#define QWEN25_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

static void test_render_fixture(void)
{
    size_t len = 0;
    char *txt = test_read_file(PD_FIXTURES "/chat/chat_cases.json", &len);
    TEST_CHECK(txt != NULL);
    cJSON *cases = txt != NULL ? cJSON_Parse(txt) : NULL;
    free(txt);
    TEST_CHECK(cJSON_IsArray(cases) && cJSON_GetArraySize(cases) >= 10);
    int n = 0;
    for (const cJSON *c = cases != NULL ? cases->child : NULL; c != NULL; c = c->next, n++) {
        const char *name = cJSON_GetObjectItem(c, "name")->valuestring;
        const char *flavour = cJSON_GetObjectItem(c, "template")->valuestring;
        int q3 = strcmp(flavour, "qwen3") == 0;
        pd_chat_template tp = { .think = q3, .think_switch = q3 };
        if (strcmp(flavour, "qwen25") == 0)
            snprintf(tp.default_system, sizeof(tp.default_system), "%s", QWEN25_SYSTEM);
        const cJSON *kw = cJSON_GetObjectItem(c, "chat_template_kwargs");
        const cJSON *et = cJSON_GetObjectItem(kw, "enable_thinking");
        const cJSON *cf = cJSON_GetObjectItem(kw, "continue_final_message");
        const cJSON *gp = cJSON_GetObjectItem(kw, "add_generation_prompt");
        pd_chat_opts co = { .enable_thinking = et == NULL ? -1 : cJSON_IsTrue(et),
                            .add_generation_prompt = gp == NULL || cJSON_IsTrue(gp),
                            .continue_final = cJSON_IsTrue(cf) };
        cJSON *root = cJSON_CreateObject();
        const cJSON *tools = cJSON_GetObjectItem(c, "tools");
        if (!cJSON_IsNull(tools))
            cJSON_AddItemReferenceToObject(root, "tools", (cJSON *)tools);
        pd_chat_tools t;
        const char *param = NULL;
        char msg[256] = "";
        TEST_CHECK_MSG(pd_chat_tools_parse(root, &t, &param, msg, sizeof(msg)) == 0, "%s: %s", name, msg);
        char *out = NULL;
        size_t out_len = 0;
        int rc = pd_chat_render(&tp, cJSON_GetObjectItem(c, "messages"), &t, &co, &out, &out_len, msg, sizeof(msg));
        const char *want = cJSON_GetObjectItem(c, "prompt")->valuestring;
        TEST_CHECK_MSG(rc == 0 && out != NULL && strcmp(out, want) == 0 && out_len == strlen(want),
                       "%s/%s: rc %d %s\n--- got\n%s\n--- want\n%s", name,
                       cJSON_GetObjectItem(c, "template")->valuestring, rc, msg, out ? out : "(null)", want);
        free(out);
        pd_chat_tools_free(&t);
        cJSON_Delete(root);
    }
    printf("render: %d fixture cases\n", n);
    cJSON_Delete(cases);
}

/* parse a request body and expect an error naming param and containing `has` */
static void tools_bad(const char *body, const char *param, const char *has)
{
    cJSON *root = cJSON_Parse(body);
    pd_chat_tools t;
    const char *p = NULL;
    char msg[256] = "";
    int rc = pd_chat_tools_parse(root, &t, &p, msg, sizeof(msg));
    TEST_CHECK_MSG(rc == -1 && p != NULL && strcmp(p, param) == 0 && strstr(msg, has) != NULL,
                   "%s -> rc %d param %s msg %s", body, rc, p ? p : "-", msg);
    pd_chat_tools_free(&t);
    cJSON_Delete(root);
}

static void test_tools_parse(void)
{
    const char *tw = "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                     "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}},"
                     " \"required\": [\"city\"]}}}, {\"type\": \"function\", \"function\": {\"name\": \"now\"}}]";
    char body[1024];
    struct { const char *tail; int choice, named, parallel; } ok[] = {
        { "}", PD_TOOLS_AUTO, 0, 1 },
        { ", \"tool_choice\": \"none\"}", PD_TOOLS_NONE, 0, 1 },
        { ", \"tool_choice\": \"required\", \"parallel_tool_calls\": false}", PD_TOOLS_REQUIRED, 0, 0 },
        { ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"now\"}}}", PD_TOOLS_NAMED, 1, 1 },
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        snprintf(body, sizeof(body), "%s%s", tw, ok[i].tail);
        cJSON *root = cJSON_Parse(body);
        pd_chat_tools t;
        const char *p = NULL;
        char msg[256] = "";
        TEST_CHECK_MSG(pd_chat_tools_parse(root, &t, &p, msg, sizeof(msg)) == 0, "%s: %s", body, msg);
        TEST_CHECK(t.n == 2 && t.choice == ok[i].choice && t.parallel == ok[i].parallel);
        TEST_CHECK(strcmp(t.names[0], "get_weather") == 0 && strcmp(t.names[1], "now") == 0);
        TEST_CHECK(t.schemas[0] != NULL && strstr(t.schemas[0], "\"city\"") != NULL && t.schemas[1] == NULL);
        if (ok[i].choice == PD_TOOLS_NAMED)
            TEST_CHECK(t.named == ok[i].named);
        pd_grammar *g = NULL;
        pd_err err;
        TEST_CHECK(pd_chat_tools_grammar(&t, NULL, &g, &err) == PD_OK);
        TEST_CHECK((g != NULL) == (ok[i].choice >= PD_TOOLS_REQUIRED));
        pd_grammar_unref(g);
        pd_chat_tools_free(&t);
        cJSON_Delete(root);
    }
    tools_bad("{\"tools\": {}}", "tools", "array");
    tools_bad("{\"tools\": [{\"type\": \"retrieval\"}]}", "tools", "tools[0]");
    tools_bad("{\"tools\": [{\"function\": {\"name\": \"a b\"}}]}", "tools", "tools[0].function.name");
    tools_bad("{\"tools\": [{\"function\": {\"name\": \"a\"}}, {\"function\": {\"name\": \"a\"}}]}", "tools",
              "second tool named 'a'");
    tools_bad("{\"tools\": [{\"function\": {\"name\": \"a\", \"parameters\": 3}}]}", "tools", "parameters");
    tools_bad("{\"tools\": [{\"function\": {\"name\": \"a\"}}], \"tool_choice\": \"always\"}", "tool_choice", "\"required\"");
    tools_bad("{\"tools\": [{\"function\": {\"name\": \"a\"}}], \"tool_choice\": {\"type\": \"function\", "
              "\"function\": {\"name\": \"b\"}}}", "tool_choice", "'b'");
    tools_bad("{\"tool_choice\": \"required\"}", "tool_choice", "needs 'tools'");
    tools_bad("{\"tools\": [{\"function\": {\"name\": \"a\"}}], \"parallel_tool_calls\": 1}", "parallel_tool_calls",
              "boolean");
    /* a schema the grammar cannot take is refused naming the tool */
    cJSON *root = cJSON_Parse("{\"tools\": [{\"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\", "
                              "\"properties\": {\"x\": {\"type\": \"number\", \"multipleOf\": 2}}}}}], "
                              "\"tool_choice\": \"required\"}");
    pd_chat_tools t;
    const char *p;
    char msg[256];
    TEST_CHECK(pd_chat_tools_parse(root, &t, &p, msg, sizeof(msg)) == 0);
    pd_grammar *g = NULL;
    pd_err err;
    TEST_CHECK(pd_chat_tools_grammar(&t, NULL, &g, &err) == PD_ERR_INVALID && g == NULL);
    TEST_CHECK_MSG(strstr(err.msg, "tool 'f'") != NULL && strstr(err.msg, "multipleOf") != NULL, "%s", err.msg);
    pd_chat_tools_free(&t);
    cJSON_Delete(root);
}

/* ---- the grammar, on a byte vocabulary (token b = byte b, 256 = eos) ---- */

static pd_gvocab *byte_vocab(void)
{
    static uint8_t bytes[256];
    const uint8_t *tok[257];
    size_t len[257];
    for (int i = 0; i < 256; i++) {
        bytes[i] = (uint8_t)i;
        tok[i] = &bytes[i];
        len[i] = 1;
    }
    tok[256] = NULL;
    len[256] = 0;
    int32_t eos = 256;
    pd_gvocab *v = NULL;
    pd_err err;
    TEST_CHECK(pd_gvocab_create_raw(tok, len, 257, &eos, 1, &v, &err) == PD_OK);
    return v;
}

static int accepts(pd_grammar *g, const pd_gvocab *v, const char *text)
{
    pd_gmatch *m = NULL;
    pd_err err;
    if (pd_gmatch_create(g, &m, &err) != PD_OK)
        return -1;
    int ok = 1;
    for (const char *p = text; *p && ok; p++)
        ok = pd_gmatch_advance(m, v, (uint8_t)*p, &err) == 1;
    ok = ok && pd_gmatch_complete(m);
    pd_gmatch_destroy(m);
    return ok;
}

static void test_grammar(void)
{
    pd_gvocab *v = byte_vocab();
    const char *names[2] = { "get_weather", "now" };
    const char *schemas[2] = { "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, "
                               "\"required\": [\"city\"], \"additionalProperties\": false}", NULL };
    pd_grammar *one = NULL, *par = NULL, *named = NULL;
    pd_err err;
    TEST_CHECK(pd_grammar_tool_calls(names, schemas, 2, 0, &one, &err) == PD_OK);
    TEST_CHECK(pd_grammar_tool_calls(names, schemas, 2, 1, &par, &err) == PD_OK);
    TEST_CHECK(pd_grammar_tool_calls(names + 1, schemas + 1, 1, 0, &named, &err) == PD_OK);
    const char *a = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    const char *b = "<tool_call>\n{\"name\": \"now\", \"arguments\": {\"tz\": [1, 2]}}\n</tool_call>";
    char two[512];
    snprintf(two, sizeof(two), "%s\n%s", a, b);
    TEST_CHECK(accepts(one, v, a) == 1 && accepts(one, v, b) == 1 && accepts(one, v, two) == 0);
    TEST_CHECK(accepts(par, v, a) == 1 && accepts(par, v, two) == 1);
    TEST_CHECK(accepts(named, v, b) == 1 && accepts(named, v, a) == 0);
    /* the schema holds inside: city required, nothing else, a string */
    TEST_CHECK(accepts(one, v, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>") == 0);
    TEST_CHECK(accepts(one, v, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 3}}\n</tool_call>") == 0);
    TEST_CHECK(accepts(one, v, "<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>") == 0);
    TEST_CHECK(accepts(one, v, "Sure! <tool_call>") == 0);
    /* what a forced call produces parses back into that call */
    pd_grammar_unref(one);
    pd_grammar_unref(par);
    pd_grammar_unref(named);
    const char *bad[1] = { "x\"y" };
    TEST_CHECK(pd_grammar_tool_calls(bad, schemas, 1, 0, &one, &err) == PD_ERR_INVALID);
    pd_gvocab_destroy(v);
}

/* ---- the output parser ---- */

typedef struct {
    char content[1024], reasoning[1024], calls[1024];
    size_t last_end;
    int ends_ok;
} collect;

static void on_piece(void *ud, const pd_chat_piece *p)
{
    collect *c = ud;
    char *dst = p->kind == PD_CHAT_CONTENT ? c->content : p->kind == PD_CHAT_REASONING ? c->reasoning : c->calls;
    size_t l = strlen(dst);
    if (p->kind == PD_CHAT_TOOL_CALL && p->first)   /* "[index name]" then the arguments' pieces */
        snprintf(dst + l, 1024 - l, "[%d %.*s]%.*s", p->index, (int)p->len, p->text, (int)p->args_len, p->args);
    else if (p->kind == PD_CHAT_TOOL_CALL)
        snprintf(dst + l, 1024 - l, "%.*s", (int)p->args_len, p->args);
    else
        snprintf(dst + l, 1024 - l, "%.*s", (int)p->len, p->text);
    if (p->end < c->last_end)
        c->ends_ok = 0;
    c->last_end = p->end;
}

/* the same text whole and byte by byte: the same pieces */
static void parse_case(int tools, int reasoning, const char *text, const char *content, const char *reason,
                       const char *calls)
{
    for (int bytewise = 0; bytewise < 2; bytewise++) {
        collect c = { .ends_ok = 1 };
        pd_chat_parser *p = pd_chat_parser_create(tools, reasoning);
        size_t n = strlen(text);
        if (bytewise)
            for (size_t i = 0; i <= n; i++)
                TEST_CHECK(pd_chat_parser_feed(p, text, i, 0, on_piece, &c) == 0);
        TEST_CHECK(pd_chat_parser_feed(p, text, n, 1, on_piece, &c) == 0);
        TEST_CHECK_MSG(strcmp(c.content, content) == 0 && strcmp(c.reasoning, reason) == 0 &&
                       strcmp(c.calls, calls) == 0 && c.ends_ok && (n == 0 || c.last_end <= n),
                       "%s (bytewise %d): content [%s] reasoning [%s] calls [%s]", text, bytewise, c.content,
                       c.reasoning, c.calls);
        pd_chat_parser_destroy(p);
    }
}

/* a xorshift stream: the random tests are the same on every run */
static uint64_t rs = 0x243f6a8885a308d3ull;
static uint32_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 11);
}

static void test_parser(void)
{
    parse_case(0, 0, "plain <tool_call> text", "plain <tool_call> text", "", "");
    parse_case(1, 0, "no calls here\n", "no calls here\n", "", "");
    parse_case(1, 0, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": \"x y\"}}\n</tool_call>", "", "",
               "[0 f]{\"a\": 1, \"b\": \"x y\"}");
    parse_case(1, 0, "Let me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"g\"}\n</tool_call>", "Let me check.", "", "[0 f]{}[1 g]{}");
    /* a block that is not a call stays text; an unfinished one too */
    parse_case(1, 0, "a <tool_call>oops</tool_call> b", "a <tool_call>oops</tool_call> b", "", "");
    parse_case(1, 0, "x <tool_call>\n{\"name\": \"f\"", "x <tool_call>\n{\"name\": \"f\"", "", "");
    parse_case(1, 0, "ends with <tool_ca", "ends with <tool_ca", "", "");
    /* reasoning */
    parse_case(0, 1, "<think>\nstep 1\nstep 2\n</think>\n\nThe answer.", "The answer.", "step 1\nstep 2", "");
    parse_case(0, 1, "No thinking <think>x</think>", "No thinking <think>x</think>", "", "");
    parse_case(0, 1, "<thin", "<thin", "", "");
    parse_case(0, 1, "<think>\ncut off", "", "cut off", "");
    parse_case(0, 2, "already inside\n</think>\n\nout", "out", "already inside", "");
    parse_case(1, 1, "<think>\nuse f\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"<think>\"}}\n"
               "</tool_call>", "", "use f", "[0 f]{\"q\": \"<think>\"}");
    /* arguments stream as written: strings with braces and escapes, nesting, numbers, literals */
    parse_case(1, 0, "<tool_call>\n{\"name\": \"f\\\"x\", \"arguments\": {\"s\": \"a}\\\"]b\\u00e9\", \"n\": [1, {\"x\": "
               "-2.5e3}, []], \"t\": true, \"z\": null}}\n</tool_call>", "", "",
               "[0 f\"x]{\"s\": \"a}\\\"]b\\u00e9\", \"n\": [1, {\"x\": -2.5e3}, []], \"t\": true, \"z\": null}");
    parse_case(1, 0, "<tool_call>{\"name\":\"f\",\"parameters\":{\"a\":0.5}}</tool_call>", "", "", "[0 f]{\"a\":0.5}");
    /* another member order: judged whole, the arguments written again as json.dumps does */
    parse_case(1, 0, "<tool_call>\n{\"arguments\": {\"a\":1,\"b\":[true]}, \"name\": \"f\"}\n</tool_call>", "", "",
               "[0 f]{\"a\": 1, \"b\": [true]}");
    /* a bad byte ends the call there: the rest of the block is content */
    parse_case(1, 0, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1,}}\n</tool_call> after",
               "}}\n</tool_call> after", "", "[0 f]{\"a\": 1,");
    parse_case(1, 0, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 01}}</tool_call>",
               "1}}</tool_call>", "", "[0 f]{\"a\": 0");
    parse_case(1, 0, "<tool_call>{\"name\": \"f\", \"arguments\": {}} junk</tool_call>", "junk</tool_call>", "",
               "[0 f]{}");
    /* one call at most (parallel_tool_calls false): what follows the first is dropped */
    parse_case(2, 0, "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n"
               "{\"name\": \"g\", \"arguments\": {}}\n</tool_call> bye", "Sure.", "", "[0 f]{}");
    parse_case(2, 0, "<tool_call>{\"arguments\": {}, \"name\": \"f\"}</tool_call>more", "", "", "[0 f]{}");
    parse_case(2, 0, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": x}}</tool_call>", "", "", "[0 f]{\"a\": ");
    /* cut off inside the arguments: the call is what came */
    parse_case(1, 0, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"x", "", "", "[0 f]{\"a\": \"x");
    parse_case(1, 0, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_", "", "", "[0 f]{}");
}

typedef struct {
    int pieces;
    char last;   /* the last byte of the last arguments piece */
} args_seen;

static void on_args(void *ud, const pd_chat_piece *p)
{
    args_seen *a = ud;
    if (p->kind == PD_CHAT_TOOL_CALL && p->args_len > 0) {
        a->pieces++;
        a->last = p->args[p->args_len - 1];
    }
}

/* streamed arguments: each piece as soon as it is checked, never half a UTF-8 character */
static void test_args_stream(void)
{
    const char *t = "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"text\": \"caf\xc3\xa9 \xe2\x82\xac\"}}";
    size_t n = strlen(t);
    pd_chat_parser *p = pd_chat_parser_create(1, 0);
    args_seen a = { 0 };
    int split = 0;
    for (size_t i = 1; i <= n; i++) {
        a.last = 0;
        TEST_CHECK(pd_chat_parser_feed(p, t, i, 0, on_args, &a) == 0);
        if (a.last != 0 && ((unsigned char)a.last & 0xC0) == 0xC0)
            split = 1;   /* a piece ended with a UTF-8 lead byte */
    }
    TEST_CHECK(!split);
    TEST_CHECK_MSG(a.pieces == 18, "%d pieces", a.pieces);   /* a piece per character (18), not one at the end */
    TEST_CHECK(pd_chat_parser_calls(p) == 1);
    pd_chat_parser_destroy(p);
}

/* pd_chat_parser_calls_done: a streamed call is done once its arguments close (before its tags
 * end), a block of another shape when it is whole, a call cut off at the end when the output ends;
 * pd_chat_call_id: the same id from the same request, choice and call, another from another */
static void test_calls_done(void)
{
    const char *t = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}\n</tool_call>\n"
                    "<tool_call>\n{\"arguments\": {}, \"name\": \"g\"}\n</tool_call>\n"
                    "<tool_call>\n{\"name\": \"h\", \"arguments\": {\"b\": ";
    const char *head = "\"arguments\": {";
    size_t n = strlen(t);
    size_t open1 = (size_t)(strstr(t, head) - t) + strlen(head);          /* call 1 begins (its '{') */
    size_t close1 = (size_t)(strstr(t, "]}") - t) + 2;                     /* its arguments close */
    size_t whole2 = (size_t)(strstr(t, "g\"}\n</tool_call>") - t) + strlen("g\"}\n</tool_call>");
    size_t open3 = (size_t)(strstr(t + whole2, head) - t) + strlen(head);
    pd_chat_parser *p = pd_chat_parser_create(1, 0);
    args_seen a = { 0 };
    int ok = 1;
    for (size_t i = 1; i <= n && ok; i++) {
        TEST_CHECK(pd_chat_parser_feed(p, t, i, 0, on_args, &a) == 0);
        int calls = pd_chat_parser_calls(p), done = pd_chat_parser_calls_done(p);
        int want_calls = (i >= open1) + (i >= whole2) + (i >= open3), want_done = (i >= close1) + (i >= whole2);
        if (done != want_done || calls != want_calls) {
            TEST_CHECK_MSG(0, "at %zu bytes: %d calls, %d done; expected %d, %d", i, calls, done, want_calls,
                           want_done);
            ok = 0;
        }
    }
    /* the output ends inside call 3's arguments: it is done with what came */
    TEST_CHECK(ok && pd_chat_parser_feed(p, t, n, 1, on_args, &a) == 0 && pd_chat_parser_calls(p) == 3 &&
               pd_chat_parser_calls_done(p) == 3);
    pd_chat_parser_destroy(p);
    char id[PD_CHAT_CALL_ID_SIZE], same[PD_CHAT_CALL_ID_SIZE], other[PD_CHAT_CALL_ID_SIZE];
    pd_chat_call_id("chatcmpl-1", 0, 0, id);
    pd_chat_call_id("chatcmpl-1", 0, 0, same);
    pd_chat_call_id("chatcmpl-1", 1, 0, other);
    TEST_CHECK(strlen(id) == 29 && strncmp(id, "call_", 5) == 0 && strspn(id + 5, "0123456789abcdef") == 24 &&
               strcmp(id, same) == 0 && strcmp(id, other) != 0);
    pd_chat_call_id("chatcmpl-1", 0, 1, other);
    TEST_CHECK(strcmp(id, other) != 0);
}

/* the arguments' byte check against cJSON: random JSON objects, then bytes of them changed:
 * what the check lets through whole is what cJSON reads, and the objects it was given whole pass */
static void test_args_check(void)
{
    static const char *const frag[] = { "{", "}", "[", "]", "\"k\"", ":", ",", " ", "1", "-0.5e+2", "true", "null",
                                        "\"s\\n\\u00e9\"", "0", "\"", "\\", "e", "." };
    int bad = 0, whole = 0;
    for (int iter = 0; iter < 4000 && !bad; iter++) {
        char a[256] = "{";
        size_t n = 1;
        int parts = (int)(rnd() % 14);
        for (int k = 0; k < parts; k++) {
            const char *f = frag[rnd() % (sizeof(frag) / sizeof(frag[0]))];
            if (n + strlen(f) + 2 >= sizeof(a))
                break;
            memcpy(a + n, f, strlen(f));
            n += strlen(f);
        }
        a[n] = '\0';
        if (iter % 2 == 0 && n + 2 < sizeof(a)) {   /* half of them: a valid object */
            snprintf(a, sizeof(a), "{\"k%d\": [%d, {\"x\": \"y\\\"\"}, -%d.25], \"t\": %s}", iter, iter % 7, iter % 3,
                     iter % 4 == 0 ? "false" : "{}");
            n = strlen(a);
        }
        char text[400];
        snprintf(text, sizeof(text), "<tool_call>{\"name\": \"f\", \"arguments\": %s}</tool_call>", a);
        collect c = { .ends_ok = 1 };
        pd_chat_parser *p = pd_chat_parser_create(1, 0);
        pd_chat_parser_feed(p, text, strlen(text), 1, on_piece, &c);
        pd_chat_parser_destroy(p);
        char want[300];
        snprintf(want, sizeof(want), "[0 f]%s", a);
        int passed = strcmp(c.calls, want) == 0 && c.content[0] == '\0';
        cJSON *j = cJSON_Parse(a);
        if (passed && !cJSON_IsObject(j)) {
            fprintf(stderr, "the check let through what cJSON does not read: %s\n", a);
            bad = 1;
        }
        if (iter % 2 == 0 && !passed) {
            fprintf(stderr, "a valid object was stopped: %s -> calls [%s] content [%s]\n", a, c.calls, c.content);
            bad = 1;
        }
        whole += passed;
        cJSON_Delete(j);
    }
    TEST_CHECK(!bad);
    TEST_CHECK(whole >= 2000);
}

/* random texts of tag fragments: the pieces are the same whichever way the text is cut into
 * feeds (whole, byte by byte, random chunks), and content + reasoning + calls account for it */
static void test_parser_random(void)
{
    static const char *const frag[] = { "<tool_call>", "</tool_call>", "<think>", "</think>", "\n",
                                        "{\"name\": \"f\", \"arguments\": {\"a\": 1}}", "a", " ", "<", "</",
                                        "<tool_", "think>", "{\"name\": 3}", "\xc3\xa9",
                                        "{\"name\": \"g\", \"arguments\": {", "}", "\"s\": \"}\\\"\"", ",", "[1, 2]",
                                        "\"x\": " };
    int bad = 0;
    for (int iter = 0; iter < 3000 && !bad; iter++) {
        char text[512];
        size_t n = 0;
        int parts = 1 + (int)(rnd() % 12);
        for (int k = 0; k < parts; k++) {
            const char *f = frag[rnd() % (sizeof(frag) / sizeof(frag[0]))];
            size_t l = strlen(f);
            if (n + l >= sizeof(text))
                break;
            memcpy(text + n, f, l);
            n += l;
        }
        text[n] = '\0';
        int tools = (int)(rnd() % 3), reasoning = (int)(rnd() % 3);
        collect want = { .ends_ok = 1 };
        for (int way = 0; way < 3; way++) {
            collect c = { .ends_ok = 1 };
            pd_chat_parser *p = pd_chat_parser_create(tools, reasoning);
            size_t at = 0;
            while (way > 0 && at < n) {
                at += way == 1 ? 1 : 1 + rnd() % 7;
                if (at > n)
                    at = n;
                pd_chat_parser_feed(p, text, at, 0, on_piece, &c);
            }
            pd_chat_parser_feed(p, text, n, 1, on_piece, &c);
            pd_chat_parser_destroy(p);
            if (way == 0)
                want = c;
            else if (strcmp(c.content, want.content) != 0 || strcmp(c.reasoning, want.reasoning) != 0 ||
                     strcmp(c.calls, want.calls) != 0 || !c.ends_ok || c.last_end > n) {
                fprintf(stderr, "tools %d reasoning %d way %d: [%s]\n  content [%s] vs [%s]\n  reasoning [%s] vs "
                        "[%s]\n  calls [%s] vs [%s]\n", tools, reasoning, way, text, c.content, want.content,
                        c.reasoning, want.reasoning, c.calls, want.calls);
                bad = 1;
            }
        }
        /* without tools or reasoning the text comes back whole */
        if (!tools && reasoning == 0 && strcmp(want.content, text) != 0) {
            fprintf(stderr, "plain text changed: [%s] -> [%s]\n", text, want.content);
            bad = 1;
        }
    }
    TEST_CHECK(!bad);
}

static void test_pyjson(void)
{
    cJSON *v = cJSON_Parse("{\"a\": [1, 2.5, -0.001, 1e300, true, null], \"b\": \"\\u00e9\\t\\\"\\u0001/\", \"c\": {}}");
    char *buf = NULL;
    size_t len = 0, cap = 0;
    TEST_CHECK(pd_chat_pyjson(v, &buf, &len, &cap) == 0);
    const char *want = "{\"a\": [1, 2.5, -0.001, 1e+300, true, null], \"b\": \"\xc3\xa9\\t\\\"\\u0001/\", \"c\": {}}";
    TEST_CHECK_MSG(buf != NULL && strcmp(buf, want) == 0, "got %s", buf ? buf : "(null)");
    free(buf);
    cJSON_Delete(v);
}

static void test_detect(void)
{
    pd_chat_template tp;
    char why[128];
    TEST_CHECK(pd_chat_template_detect("{{'<|im_start|>' + message['role']}}<|im_end|><|im_start|>assistant", &tp, why,
                                       sizeof(why)) == 0 && tp.think == 0);
    TEST_CHECK(pd_chat_template_detect("<|im_start|>role<|im_end|><|im_start|>assistant reasoning_content </think>",
                                       &tp, why, sizeof(why)) == 0 && tp.think == 1 && tp.think_switch == 0);
    TEST_CHECK(pd_chat_template_detect("<|im_start|>role<|im_end|><|im_start|>assistant reasoning_content </think>"
                                       " enable_thinking", &tp, why, sizeof(why)) == 0 && tp.think_switch == 1);
    TEST_CHECK(pd_chat_template_detect("[INST] {{ message['content'] }} [/INST]", &tp, why, sizeof(why)) == -1 &&
               strstr(why, "ChatML") != NULL);
    /* a template whose generation prompt opens <think> (Qwen3 Thinking 2507, QwQ) */
    const char *qwq = "{{'<|im_start|>' + m['role']}}<|im_end|>{%- if add_generation_prompt %}"
                      "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %} reasoning_content </think>";
    TEST_CHECK(pd_chat_template_detect(qwq, &tp, why, sizeof(why)) == 0 && tp.think == 1 && tp.open_think == 1 &&
               tp.default_system[0] == '\0');
    /* a default system prompt (Qwen2.5's shape): the literal's text, escapes undone; literals that
     * end at the newline (Qwen3's) give none */
    const char *q25 = "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
                      "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are \\'X\\'.\\nBe kind."
                      "<|im_end|>\\n' }}{%- endif %}{{'<|im_start|>' + m['role']}}<|im_start|>assistant";
    TEST_CHECK_MSG(pd_chat_template_detect(q25, &tp, why, sizeof(why)) == 0 &&
                   strcmp(tp.default_system, "You are 'X'.\nBe kind.") == 0, "got '%s'", tp.default_system);
    const char *q3 = "{{- '<|im_start|>system\\n' }}{{- '<|im_start|>system\\n' + messages[0].content + "
                     "'<|im_end|>\\n' }}<|im_start|>assistant role";
    TEST_CHECK(pd_chat_template_detect(q3, &tp, why, sizeof(why)) == 0 && tp.default_system[0] == '\0');
    TEST_CHECK(pd_chat_template_detect(qwq, &tp, why, sizeof(why)) == 0);
    cJSON *ms = cJSON_Parse("[{\"role\": \"user\", \"content\": \"hi\"}]");
    char *out = NULL;
    size_t len = 0;
    pd_chat_opts off = { .enable_thinking = 0, .add_generation_prompt = 1 };
    TEST_CHECK(pd_chat_render(&tp, ms, NULL, &off, &out, &len, why, sizeof(why)) == 0 && out != NULL &&
               strcmp(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n") == 0);
    free(out);
    cJSON_Delete(ms);
}

/* messages the renderer refuses, each with an error naming the message at fault */
static void test_render_errors(void)
{
    static const struct { const char *messages, *has; } bad[] = {
        { "[]", "non-empty array" },
        { "[{\"content\": \"x\"}]", "messages[0] must be an object with a string 'role'" },
        { "[{\"role\": \"robot\", \"content\": \"x\"}]", "messages[0].role 'robot'" },
        { "[{\"role\": \"user\", \"content\": 3}]", "messages[0].content must be" },
        { "[{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", \"tool_calls\": {}}]",
          "messages[1].tool_calls must be an array" },
        { "[{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", \"tool_calls\": "
          "[{\"function\": {\"arguments\": \"{}\"}}]}]", "messages[1].tool_calls[0] needs function.name" },
        { "[{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", \"tool_calls\": "
          "[{\"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}, {\"function\": {\"name\": \"f\", "
          "\"arguments\": \"{\\\"a\\\": \"}}]}]", "messages[1].tool_calls[1].function.arguments is not valid JSON" },
        { "[{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", \"tool_calls\": "
          "[{\"function\": {\"name\": \"f\", \"arguments\": \"{} {}\"}}]}]",
          "messages[1].tool_calls[0].function.arguments is not valid JSON" },
        { "[{\"role\": \"user\", \"content\": \"x\"}]", "continue_final_message needs the last message (messages[0])" },
        { "[{\"role\": \"assistant\", \"content\": \"x\"}]", "continue_final_message and add_generation_prompt cannot both" },
    };
    pd_chat_template tp = { .think = 1 };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cJSON *ms = cJSON_Parse(bad[i].messages);
        TEST_CHECK_MSG(ms != NULL, "case %zu does not parse", i);
        char msg[256] = "", *out = NULL;
        size_t len = 0;
        pd_chat_opts co = PD_CHAT_OPTS_DEFAULT;
        if (strstr(bad[i].has, "continue_final") != NULL) {
            co.continue_final = 1;
            co.add_generation_prompt = strstr(bad[i].has, "cannot both") != NULL;
        }
        int rc = pd_chat_render(&tp, ms, NULL, &co, &out, &len, msg, sizeof(msg));
        TEST_CHECK_MSG(rc == -1 && out == NULL && strstr(msg, bad[i].has) != NULL, "case %zu: rc %d '%s'", i, rc, msg);
        free(out);
        cJSON_Delete(ms);
    }
}

/* A random JSON value of the shapes chat fields take, and of others: strings (with template
 * tags and quotes), numbers, null, booleans, arrays of parts, objects of call shape. */
static cJSON *fz_value(uint64_t *x, int depth)
{
    static const char *strs[] = { "", "x", "hi there", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                                  "<think>", "\"quoted\"", "{\"a\": 1}", "{", "\\", "中文😀", "user", "assistant",
                                  "system", "tool", "developer", "f", "text", "function" };
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    int kind = (int)((*x >> 33) % (depth > 2 ? 4 : 7));
    switch (kind) {
    case 0: return cJSON_CreateString(strs[(*x >> 40) % (sizeof(strs) / sizeof(strs[0]))]);
    case 1: return cJSON_CreateNumber((double)(int64_t)(*x >> 40) - 5e5);
    case 2: return cJSON_CreateNull();
    case 3: return cJSON_CreateBool((*x >> 45) & 1);
    case 4: {
        cJSON *a = cJSON_CreateArray();
        int n = (int)((*x >> 50) % 4);
        for (int i = 0; i < n; i++)
            cJSON_AddItemToArray(a, fz_value(x, depth + 1));
        return a;
    }
    default: {
        static const char *keys[] = { "type", "text", "function", "name", "arguments", "id", "content", "role" };
        cJSON *o = cJSON_CreateObject();
        int n = (int)((*x >> 50) % 4);
        for (int i = 0; i < n; i++) {
            *x = *x * 6364136223846793005ull + 1442695040888963407ull;
            cJSON_AddItemToObject(o, keys[(*x >> 40) % 8], fz_value(x, depth + 1));
        }
        return o;
    }
    }
}

/* Random message lists (roles, content of every type, tool_calls and reasoning of random
 * shapes) and random tools, 3000, through tools parsing and rendering with the Qwen3 and the
 * Qwen2.5 behaviour: each renders (a NUL-free ChatML text) or is refused with a message. */
static void test_render_fuzz(void)
{
    static const char *fields[] = { "role", "content", "tool_calls", "reasoning_content", "name", "tool_call_id" };
    static const char *roles[] = { "system", "developer", "user", "assistant", "tool", "robot" };
    uint64_t x = 4242;
    int rendered = 0, refused = 0, bad = 0;
    for (int it = 0; it < 3000; it++) {
        cJSON *root = cJSON_CreateObject(), *ms = cJSON_AddArrayToObject(root, "messages");
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int n = 1 + (int)((x >> 33) % 5);
        for (int i = 0; i < n; i++) {
            cJSON *m = cJSON_CreateObject();
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            cJSON_AddStringToObject(m, "role", roles[(x >> 40) % 6]);
            if ((x >> 45) % 4 != 0)
                cJSON_AddItemToObject(m, "content", (x >> 47) % 2 ? cJSON_CreateString("hello") : fz_value(&x, 1));
            for (int f = 2; f < 6; f++)
                if ((x >> (48 + f)) % 5 == 0)
                    cJSON_AddItemToObject(m, fields[f], fz_value(&x, 1));
            cJSON_AddItemToArray(ms, m);
        }
        if ((x >> 60) % 3 == 0)
            cJSON_AddItemToObject(root, "tools", fz_value(&x, 0));
        if ((x >> 58) % 4 == 0)
            cJSON_AddItemToObject(root, "tool_choice", fz_value(&x, 1));
        pd_chat_tools tools = { 0 };
        const char *param = NULL;
        char msg[256] = "";
        int trc = pd_chat_tools_parse(root, &tools, &param, msg, sizeof(msg));
        if (trc != 0 && (param == NULL || msg[0] == '\0'))
            bad++;
        pd_chat_template tp = { .think = (int)(it & 1), .think_switch = (int)(it & 1) };
        if (!(it & 1))
            snprintf(tp.default_system, sizeof(tp.default_system), "You are a helpful assistant.");
        pd_chat_opts co = PD_CHAT_OPTS_DEFAULT;
        co.enable_thinking = (int)((x >> 20) % 3) - 1;
        char *out = NULL;
        size_t len = 0;
        msg[0] = '\0';
        int rc = pd_chat_render(&tp, ms, trc == 0 ? &tools : NULL, &co, &out, &len, msg, sizeof(msg));
        if (rc == 0) {
            rendered++;
            bad += out == NULL || strlen(out) != len || strncmp(out, "<|im_start|>", 12) != 0;
        } else {
            refused++;
            bad += out != NULL || msg[0] == '\0';
        }
        free(out);
        pd_chat_tools_free(&tools);   /* also after a refusal (the contract) */
        cJSON_Delete(root);
    }
    printf("render fuzz: 3000 random requests: %d rendered, %d refused\n", rendered, refused);
    TEST_CHECK_MSG(bad == 0 && rendered > 100 && refused > 100, "render fuzz: %d bad, %d rendered, %d refused", bad,
                   rendered, refused);
}

static void write_text(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    TEST_CHECK(f != NULL);
    if (f != NULL) {
        fputs(text, f);
        fclose(f);
    }
}

static void remove_text(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    unlink(path);
}

/* pd_chat_template_load from a checkpoint directory and from --chat-template */
static void test_template_load(void)
{
    static const char *chatml = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                                "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                                "{{ '<|im_start|>assistant\\n' }}{% endif %}";
    char dir[] = "/tmp/pd_chat_XXXXXX";
    TEST_CHECK(mkdtemp(dir) != NULL);
    pd_chat_template t;
    pd_err err;
    char why[256];
    int usable = -1;
    /* no template at all: chat unavailable, said so */
    TEST_CHECK(pd_chat_template_load(dir, NULL, &t, &usable, why, sizeof(why), &err) == PD_OK);
    TEST_CHECK_MSG(usable == 0 && strstr(why, "no chat template") != NULL, "no template: %d '%s'", usable, why);
    /* tokenizer_config.json, a list: the one named "default" */
    cJSON *cj = cJSON_CreateObject(), *list = cJSON_AddArrayToObject(cj, "chat_template");
    cJSON *other = cJSON_CreateObject(), *def = cJSON_CreateObject();
    cJSON_AddStringToObject(other, "name", "tool_use");
    cJSON_AddStringToObject(other, "template", "[INST] {{ m }} [/INST]");
    cJSON_AddStringToObject(def, "name", "default");
    cJSON_AddStringToObject(def, "template", chatml);
    cJSON_AddItemToArray(list, other);
    cJSON_AddItemToArray(list, def);
    char *cfg = cJSON_PrintUnformatted(cj);
    write_text(dir, "tokenizer_config.json", cfg);
    free(cfg);
    cJSON_Delete(cj);
    TEST_CHECK(pd_chat_template_load(dir, NULL, &t, &usable, why, sizeof(why), &err) == PD_OK);
    TEST_CHECK_MSG(usable == 1, "tokenizer_config.json list: %d '%s'", usable, why);
    /* chat_template.jinja wins; not ChatML: rendered by pd_jinja; one that does not parse:
     * unavailable, naming the file and the line */
    write_text(dir, "chat_template.jinja", "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
                                           "{{ bos_token }}|{{ eos_token }}");
    write_text(dir, "tokenizer_config.json", "{\"bos_token\": \"<s>\", \"eos_token\": {\"content\": \"</s>\"}}");
    TEST_CHECK(pd_chat_template_load(dir, NULL, &t, &usable, why, sizeof(why), &err) == PD_OK);
    TEST_CHECK_MSG(usable == 1 && t.jinja != NULL && strcmp(t.bos, "<s>") == 0 && strcmp(t.eos, "</s>") == 0,
                   "non-ChatML template: %d '%s'", usable, why);
    cJSON *ms = cJSON_Parse("[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"hi\"}]}]");
    char *out = NULL, msg[256] = "";
    size_t out_len = 0;
    TEST_CHECK_MSG(pd_chat_render(&t, ms, NULL, NULL, &out, &out_len, msg, sizeof(msg)) == 0 && out != NULL &&
                   strcmp(out, "[INST] hi [/INST]<s>|</s>") == 0, "rendered through Jinja: %s %s", out, msg);
    free(out);
    cJSON_Delete(ms);
    pd_chat_template_free(&t);
    write_text(dir, "chat_template.jinja", "a\n{% if x %}b");
    TEST_CHECK(pd_chat_template_load(dir, NULL, &t, &usable, why, sizeof(why), &err) == PD_OK);
    TEST_CHECK_MSG(usable == 0 && t.jinja == NULL && strstr(why, "chat_template.jinja") != NULL &&
                   strstr(why, "does not parse") != NULL && strstr(why, "line 2") != NULL,
                   "a template that does not parse: %d '%s'", usable, why);
    write_text(dir, "chat_template.jinja", chatml);
    TEST_CHECK(pd_chat_template_load(dir, NULL, &t, &usable, why, sizeof(why), &err) == PD_OK && usable == 1);
    /* --chat-template: text, a file, a missing file, not ChatML */
    TEST_CHECK(pd_chat_template_load(dir, chatml, &t, &usable, why, sizeof(why), &err) == PD_OK && usable == 1);
    char path[512];
    snprintf(path, sizeof(path), "%s/chat_template.jinja", dir);
    TEST_CHECK(pd_chat_template_load("/nonexistent", path, &t, &usable, why, sizeof(why), &err) == PD_OK &&
               usable == 1);
    snprintf(path, sizeof(path), "%s/nope.jinja", dir);
    pd_status st = pd_chat_template_load(dir, path, &t, &usable, why, sizeof(why), &err);
    TEST_CHECK_MSG(st == PD_ERR_IO && strstr(err.msg, "no such file") != NULL, "missing file: %s", err.msg);
    st = pd_chat_template_load(dir, "[INST] {{ m }} [/INST]", &t, &usable, why, sizeof(why), &err);
    TEST_CHECK_MSG(st == PD_OK && usable == 1 && t.jinja != NULL, "given non-ChatML: %s", err.msg);
    pd_chat_template_free(&t);
    st = pd_chat_template_load(dir, "{% for m in messages %}", &t, &usable, why, sizeof(why), &err);
    TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, "does not parse") != NULL && t.jinja == NULL,
                   "given, not parsing: %s", err.msg);
    remove_text(dir, "chat_template.jinja");
    remove_text(dir, "tokenizer_config.json");
    rmdir(dir);
}

static char *jinja_render(const char *src, const cJSON *ctx, char *err, size_t cap)
{
    pd_jinja *t = pd_jinja_parse(src, err, cap);
    if (t == NULL)
        return NULL;
    char *out = NULL;
    size_t len = 0;
    int rc = pd_jinja_render(t, ctx, &out, &len, err, cap);
    pd_jinja_free(t);
    return rc == 0 ? out : NULL;
}

static void test_jinja_fixture(void)
{
    size_t len = 0;
    char *txt = test_read_file(PD_FIXTURES "/jinja/jinja_cases.json", &len);
    TEST_CHECK(txt != NULL);
    cJSON *cases = txt != NULL ? cJSON_Parse(txt) : NULL;
    free(txt);
    TEST_CHECK(cJSON_IsArray(cases) && cJSON_GetArraySize(cases) >= 10);
    int n = 0, errs = 0;
    for (const cJSON *c = cases != NULL ? cases->child : NULL; c != NULL; c = c->next, n++) {
        const char *name = cJSON_GetObjectItem(c, "name")->valuestring;
        const cJSON *want = cJSON_GetObjectItem(c, "output"), *want_err = cJSON_GetObjectItem(c, "error");
        char err[512] = "";
        char *out = jinja_render(cJSON_GetObjectItem(c, "template")->valuestring, cJSON_GetObjectItem(c, "context"),
                                 err, sizeof(err));
        if (want != NULL) {
            size_t at = 0;
            while (out != NULL && out[at] != '\0' && out[at] == want->valuestring[at])
                at++;
            TEST_CHECK_MSG(out != NULL && strcmp(out, want->valuestring) == 0,
                           "%s: %s (first difference at byte %zu: got '%.20s', want '%.20s')", name, err, at,
                           out != NULL ? out + at : "(null)", want->valuestring + at);
        } else {
            errs++;
            /* jinja2's own errors word themselves otherwise; raise_exception's message is the template's */
            int raised = strstr(cJSON_GetObjectItem(c, "template")->valuestring, "raise_exception") != NULL &&
                         strstr(want_err->valuestring, "list object") == NULL;
            TEST_CHECK_MSG(out == NULL && err[0] != '\0' && (!raised || strcmp(err, want_err->valuestring) == 0),
                           "%s: want the error '%s', got '%s' %s", name, want_err->valuestring, err,
                           out != NULL ? out : "");
        }
        free(out);
    }
    printf("jinja: %d fixture cases (%d errors)\n", n, errs);
    TEST_CHECK(errs >= 3);
    cJSON_Delete(cases);
}

/* the bundled model's template through pd_chat's Jinja path gives jinja2's prompts of the ChatML
 * cases (messages prepared as vLLM prepares them, continue_final_message cut as transformers cuts) */
static void test_jinja_chatml(void)
{
    size_t len = 0;
    char *tmpl = test_read_file(PD_MODELS "/tiny-code-qwen3/chat_template.jinja", &len);
    char *txt = test_read_file(PD_FIXTURES "/chat/chat_cases.json", &len);
    TEST_CHECK(tmpl != NULL && txt != NULL);
    char err[512] = "";
    pd_chat_template tp = { .jinja = tmpl != NULL ? pd_jinja_parse(tmpl, err, sizeof(err)) : NULL };
    TEST_CHECK_MSG(tp.jinja != NULL, "the bundled template parses: %s", err);
    cJSON *cases = txt != NULL ? cJSON_Parse(txt) : NULL;
    int n = 0;
    for (const cJSON *c = cases != NULL ? cases->child : NULL; c != NULL && tp.jinja != NULL; c = c->next) {
        if (strcmp(cJSON_GetObjectItem(c, "template")->valuestring, "chatml") != 0)
            continue;
        const cJSON *kw = cJSON_GetObjectItem(c, "chat_template_kwargs");
        const cJSON *cf = cJSON_GetObjectItem(kw, "continue_final_message");
        const cJSON *gp = cJSON_GetObjectItem(kw, "add_generation_prompt");
        pd_chat_opts co = { .enable_thinking = -1, .add_generation_prompt = gp == NULL ? !cJSON_IsTrue(cf) : cJSON_IsTrue(gp),
                            .continue_final = cJSON_IsTrue(cf) };
        char msg[256] = "";
        char *out = NULL;
        size_t out_len = 0;
        int rc = pd_chat_render(&tp, cJSON_GetObjectItem(c, "messages"), NULL, &co, &out, &out_len, msg, sizeof(msg));
        const char *want = cJSON_GetObjectItem(c, "prompt")->valuestring;
        TEST_CHECK_MSG(rc == 0 && out != NULL && strcmp(out, want) == 0 && out_len == strlen(want),
                       "%s: %s\n--- got\n%s\n--- want\n%s", cJSON_GetObjectItem(c, "name")->valuestring, msg,
                       out != NULL ? out : "(null)", want);
        free(out);
        n++;
    }
    TEST_CHECK(n >= 3);
    printf("jinja: the bundled template through pd_chat_render on %d ChatML cases\n", n);
    pd_chat_template_free(&tp);
    cJSON_Delete(cases);
    free(txt);
    free(tmpl);
}

/* chat_template_kwargs reach a Jinja template as variables, but not over what the server sets */
static void test_jinja_kwargs(void)
{
    char err[256] = "";
    pd_chat_template tp = { .jinja = pd_jinja_parse("{{ greeting }} {{ messages[0].content }}{{ '!' if add_generation_prompt }}"
                                                    "{{ enable_thinking is defined }}", err, sizeof(err)) };
    cJSON *ms = cJSON_Parse("[{\"role\": \"user\", \"content\": \"hi\"}]");
    cJSON *kw = cJSON_Parse("{\"greeting\": \"hey\", \"messages\": \"no\", \"add_generation_prompt\": false}");
    pd_chat_opts co = PD_CHAT_OPTS_DEFAULT;
    co.kwargs = kw;
    char *out = NULL, msg[256] = "";
    size_t len = 0;
    TEST_CHECK_MSG(tp.jinja != NULL && pd_chat_render(&tp, ms, NULL, &co, &out, &len, msg, sizeof(msg)) == 0 &&
                   strcmp(out, "hey hi!False") == 0, "kwargs: %s %s %s", err, msg, out != NULL ? out : "(null)");
    free(out);
    co.enable_thinking = 0;
    TEST_CHECK(pd_chat_render(&tp, ms, NULL, &co, &out, &len, msg, sizeof(msg)) == 0 && strcmp(out, "hey hi!True") == 0);
    free(out);
    cJSON_Delete(kw);
    cJSON_Delete(ms);
    pd_chat_template_free(&tp);
}

/* mutated templates (bytes deleted, repeated, replaced by template syntax) parse and render or
 * fail with a message; never more (ASan runs this) */
static void test_jinja_fuzz(void)
{
    size_t len = 0;
    char *txt = test_read_file(PD_FIXTURES "/jinja/jinja_cases.json", &len);
    cJSON *cases = txt != NULL ? cJSON_Parse(txt) : NULL;
    free(txt);
    static const char *const bits[] = {"{{", "}}", "{%", "%}", "{#", "#}", "-", "(", ")", "[", "]", "'", "\"", "|",
                                       ".", ",", ":", "=", "endfor", "endif", "else", "loop", "in", "not", "~",
                                       "**", "//", "\\", "\n", " "};
    uint64_t rng = 20261208;
    int parsed = 0, rendered = 0, n = 0;
    for (int it = 0; it < 3000 && cases != NULL; it++) {
        const cJSON *c = cJSON_GetArrayItem(cases, it % cJSON_GetArraySize(cases));
        const char *src = cJSON_GetObjectItem(c, "template")->valuestring;
        size_t sl = strlen(src);
        char *m = malloc(sl + 64);
        memcpy(m, src, sl + 1);
        for (int k = 0; k < 1 + (int)(it % 4); k++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            size_t at = (size_t)(rng >> 33) % (strlen(m) + 1);
            int op = (int)((rng >> 20) % 3);
            size_t ml = strlen(m);
            if (op == 0 && at < ml) {   /* delete up to 8 bytes */
                size_t d = 1 + (size_t)((rng >> 8) % 8);
                if (at + d > ml)
                    d = ml - at;
                memmove(m + at, m + at + d, ml - at - d + 1);
            } else {                    /* insert a piece of syntax */
                const char *b = bits[(rng >> 12) % (sizeof(bits) / sizeof(bits[0]))];
                size_t bl = strlen(b);
                if (ml + bl + 1 > sl + 64)
                    continue;
                memmove(m + at + bl, m + at, ml - at + 1);
                memcpy(m + at, b, bl);
            }
        }
        char err[256] = "";
        pd_jinja *t = pd_jinja_parse(m, err, sizeof(err));
        if (t != NULL) {
            parsed++;
            char *out = NULL;
            size_t ol = 0;
            if (pd_jinja_render(t, cJSON_GetObjectItem(c, "context"), &out, &ol, err, sizeof(err)) == 0) {
                rendered++;
                TEST_CHECK(out != NULL && strlen(out) <= ol);
            } else {
                TEST_CHECK_MSG(err[0] != '\0', "a failed render says why");
            }
            free(out);
            pd_jinja_free(t);
        } else {
            TEST_CHECK_MSG(strncmp(err, "line ", 5) == 0, "a parse error names its line: %s", err);
        }
        free(m);
        n++;
    }
    printf("jinja fuzz: %d mutated templates, %d parsed, %d rendered\n", n, parsed, rendered);
    TEST_CHECK(n == 3000 && parsed > 100 && rendered > 50);
    cJSON_Delete(cases);
}

static void test_jinja_errors(void)
{
    static const struct { const char *src, *want; } bad[] = {
        {"a\n{% if x %}b", "line 2: {% if %} without {% endif %}"},
        {"{% for x in y %}", "line 1: {% for %} without {% endfor %}"},
        {"{{ x + }}", "line 1: unexpected"},
        {"{% endif %}", "line 1: unexpected {% endif %}"},
        {"{{ 'abc }}", "never ends"},
        {"x {{ y", "never ends"},
        {"{% include 'a' %}", "unknown statement 'include'"},
        {"{# open", "never ends"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char err[256] = "";
        pd_jinja *t = pd_jinja_parse(bad[i].src, err, sizeof(err));
        TEST_CHECK_MSG(t == NULL && strstr(err, bad[i].want) != NULL, "%s: want '%s', got '%s'", bad[i].src,
                       bad[i].want, err);
        pd_jinja_free(t);
    }
    /* nesting deep enough to exhaust a stack is refused at parse */
    static const char *const deep[] = {"(", "- ", "not ", "[", "{% if x %}"};
    for (size_t k = 0; k < sizeof(deep) / sizeof(deep[0]); k++) {
        char *src = malloc(20000);
        size_t o = (size_t)snprintf(src, 20000, "%s", k < 4 ? "{{ " : "");
        for (int d = 0; d < 1000; d++)
            o += (size_t)snprintf(src + o, 20000 - o, "%s", deep[k]);
        snprintf(src + o, 20000 - o, "%s", k < 4 ? "1 }}" : "");
        char err[256] = "";
        pd_jinja *t = pd_jinja_parse(src, err, sizeof(err));
        TEST_CHECK_MSG(t == NULL && strstr(err, "nested deeper") != NULL, "1000 x '%s': %s", deep[k], err);
        pd_jinja_free(t);
        free(src);
    }
    static const struct { const char *src, *want; } rbad[] = {
        {"{{ x | nope }}", "no filter named 'nope'"},
        {"{{ x is nope }}", "no test named 'nope'"},
        {"{{ 1 + 'a' }}", "unsupported operand"},
        {"{{ x.y }}", "undefined"},
        {"{% set r = range(5000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "too many steps"},
        {"{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "MiB"},
        {"{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "nest deeper"},
        {"{{ 'a'.nope() }}", "no method 'nope'"},
        {"{% set ns = namespace(a=1) %}{% set ns.me = [ns] %}{{ ns }}", "holds itself"},
        {"{% set ns = namespace(a=1) %}{% set ns.me = [ns] %}{{ ns | tojson }}", "holds itself"},
    };
    for (size_t i = 0; i < sizeof(rbad) / sizeof(rbad[0]); i++) {
        char err[256] = "";
        char *out = jinja_render(rbad[i].src, NULL, err, sizeof(err));
        TEST_CHECK_MSG(out == NULL && strstr(err, rbad[i].want) != NULL, "%s: want '%s', got '%s'", rbad[i].src,
                       rbad[i].want, err);
        free(out);
    }
}

int main(void)
{
    test_jinja_fixture();
    test_jinja_chatml();
    test_jinja_errors();
    test_jinja_fuzz();
    test_jinja_kwargs();
    test_template_load();
    test_detect();
    test_render_fixture();
    test_render_errors();
    test_render_fuzz();
    test_tools_parse();
    test_grammar();
    test_parser();
    test_parser_random();
    test_args_stream();
    test_calls_done();
    test_args_check();
    test_pyjson();
    TEST_DONE();
}
