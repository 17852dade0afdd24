/* pd_chat.c - chat prompts rendered as Qwen's ChatML templates write them, and the generated text
 * split back into content, reasoning and tool calls. See pd_chat.h. */
#include "pd_chat.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a growing string ------------------------------------------------------------------------ */

typedef struct {
    char *p;
    size_t len, cap;
} cbuf;

static int cb_add(cbuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (b->len + n + 1 > cap)
            cap *= 2;
        char *np = realloc(b->p, cap);
        if (np == NULL)
            return -1;
        b->p = np;
        b->cap = cap;
    }
    if (n > 0)
        memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

static int cb_str(cbuf *b, const char *s) { return cb_add(b, s, strlen(s)); }

/* ---- the template ---------------------------------------------------------------------------- */

int pd_chat_template_detect(const char *t, pd_chat_template *out, char *why, size_t cap)
{
    memset(out, 0, sizeof(*out));
    if (strstr(t, "<|im_start|>") == NULL || strstr(t, "<|im_end|>") == NULL || strstr(t, "role") == NULL ||
        strstr(t, "<|im_start|>assistant") == NULL) {
        snprintf(why, cap, "not ChatML (<|im_start|>role ... <|im_end|>)");
        return -1;
    }
    out->think = strstr(t, "</think>") != NULL && strstr(t, "reasoning_content") != NULL;
    out->open_think = strstr(t, "'<|im_start|>assistant\\n<think>\\n'") != NULL;
    out->think_switch = out->think && strstr(t, "enable_thinking") != NULL;
    return 0;
}

/* ---- Python's json.dumps --------------------------------------------------------------------- */

static int py_string(cbuf *b, const char *s)
{
    if (cb_add(b, "\"", 1) != 0)
        return -1;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char e[8];
        const char *rep = NULL;
        switch (*p) {
        case '"': rep = "\\\""; break;
        case '\\': rep = "\\\\"; break;
        case '\n': rep = "\\n"; break;
        case '\r': rep = "\\r"; break;
        case '\t': rep = "\\t"; break;
        case '\b': rep = "\\b"; break;
        case '\f': rep = "\\f"; break;
        default:
            if (*p < 0x20) {
                snprintf(e, sizeof(e), "\\u%04x", *p);
                rep = e;
            }
        }
        if (rep != NULL ? cb_str(b, rep) != 0 : cb_add(b, (const char *)p, 1) != 0)
            return -1;
    }
    return cb_add(b, "\"", 1);
}

/* repr(float): the shortest digits that read back the same value; integral values that JSON
 * gave as integers print as integers (cJSON keeps no difference between 1 and 1.0) */
static int py_number(cbuf *b, double v)
{
    char s[40];
    if (v == floor(v) && fabs(v) < 1e16)
        snprintf(s, sizeof(s), "%.0f", v);
    else if (isnan(v) || isinf(v))
        snprintf(s, sizeof(s), "%s", isnan(v) ? "NaN" : v > 0 ? "Infinity" : "-Infinity");
    else
        for (int prec = 1; prec <= 17; prec++) {
            snprintf(s, sizeof(s), "%.*g", prec, v);
            if (strtod(s, NULL) == v)
                break;
        }
    return cb_str(b, s);
}

static int py_json(cbuf *b, const cJSON *v)
{
    if (cJSON_IsObject(v) || cJSON_IsArray(v)) {
        int obj = cJSON_IsObject(v);
        if (cb_add(b, obj ? "{" : "[", 1) != 0)
            return -1;
        for (const cJSON *it = v->child; it != NULL; it = it->next) {
            if (it != v->child && cb_add(b, ", ", 2) != 0)
                return -1;
            if (obj && (py_string(b, it->string) != 0 || cb_add(b, ": ", 2) != 0))
                return -1;
            if (py_json(b, it) != 0)
                return -1;
        }
        return cb_add(b, obj ? "}" : "]", 1);
    }
    if (cJSON_IsString(v))
        return py_string(b, v->valuestring);
    if (cJSON_IsNumber(v))
        return py_number(b, v->valuedouble);
    return cb_str(b, cJSON_IsTrue(v) ? "true" : cJSON_IsFalse(v) ? "false" : "null");
}

int pd_chat_pyjson(const cJSON *v, char **buf, size_t *len, size_t *cap)
{
    cbuf b = { *buf, *len, *cap };
    int rc = py_json(&b, v);
    *buf = b.p;
    *len = b.len;
    *cap = b.cap;
    return rc;
}

/* ---- tools ----------------------------------------------------------------------------------- */

void pd_chat_tools_free(pd_chat_tools *t)
{
    for (int i = 0; i < t->n; i++) {
        if (t->names != NULL)
            free(t->names[i]);
        if (t->schemas != NULL)
            free(t->schemas[i]);
    }
    free(t->names);
    free(t->schemas);
    memset(t, 0, sizeof(*t));
}

static int name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n < 1 || n > 64)
        return 0;
    for (const char *c = s; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_' ||
              *c == '-' || *c == '.' || *c == ':'))
            return 0;
    return 1;
}

int pd_chat_tools_parse(const cJSON *root, pd_chat_tools *t, const char **param, char *msg, size_t cap)
{
    memset(t, 0, sizeof(*t));
    t->parallel = 1;
    *param = "tools";
    const cJSON *tl = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (tl != NULL && !cJSON_IsNull(tl)) {
        int n = cJSON_IsArray(tl) ? cJSON_GetArraySize(tl) : -1;
        if (n < 0 || n > PD_GRAMMAR_MAX_CHOICES) {
            snprintf(msg, cap, "'tools' must be an array of at most %d tools", PD_GRAMMAR_MAX_CHOICES);
            return -1;
        }
        t->list = n > 0 ? tl : NULL;
        t->names = calloc((size_t)n + 1, sizeof(char *));
        t->schemas = calloc((size_t)n + 1, sizeof(char *));
        if (t->names == NULL || t->schemas == NULL)
            goto nomem;
        int i = 0;
        for (const cJSON *it = tl->child; it != NULL; it = it->next, i++) {
            const cJSON *ty = cJSON_GetObjectItemCaseSensitive(it, "type");
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(it, "function");
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(fn, "name");
            const cJSON *pa = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
            if (!cJSON_IsObject(it) || (ty != NULL && !(cJSON_IsString(ty) && strcmp(ty->valuestring, "function") == 0))) {
                snprintf(msg, cap, "tools[%d] must be an object of type \"function\"", i);
                return -1;
            }
            if (!cJSON_IsObject(fn) || !cJSON_IsString(nm) || !name_ok(nm->valuestring)) {
                snprintf(msg, cap, "tools[%d].function.name must be 1..64 letters, digits, '_', '-', '.' or ':'", i);
                return -1;
            }
            for (int k = 0; k < t->n; k++)
                if (strcmp(t->names[k], nm->valuestring) == 0) {
                    snprintf(msg, cap, "tools[%d]: a second tool named '%s'", i, nm->valuestring);
                    return -1;
                }
            if (pa != NULL && !cJSON_IsNull(pa) && !cJSON_IsObject(pa)) {
                snprintf(msg, cap, "tools[%d].function.parameters must be a JSON schema object", i);
                return -1;
            }
            if ((t->names[i] = strdup(nm->valuestring)) == NULL)
                goto nomem;
            t->n = i + 1;
            if (cJSON_IsObject(pa) && (t->schemas[i] = cJSON_PrintUnformatted(pa)) == NULL)
                goto nomem;
        }
    }
    *param = "parallel_tool_calls";
    const cJSON *pc = cJSON_GetObjectItemCaseSensitive(root, "parallel_tool_calls");
    if (pc != NULL && !cJSON_IsNull(pc)) {
        if (!cJSON_IsBool(pc)) {
            snprintf(msg, cap, "'parallel_tool_calls' must be a boolean");
            return -1;
        }
        t->parallel = cJSON_IsTrue(pc);
    }
    *param = "tool_choice";
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "tool_choice");
    t->choice = t->n > 0 ? PD_TOOLS_AUTO : PD_TOOLS_NONE;
    if (tc == NULL || cJSON_IsNull(tc))
        return 0;
    if (cJSON_IsString(tc) && strcmp(tc->valuestring, "none") == 0) {
        t->choice = PD_TOOLS_NONE;
        return 0;
    }
    if (cJSON_IsString(tc) && strcmp(tc->valuestring, "auto") == 0) {
        t->choice = PD_TOOLS_AUTO;
    } else if (cJSON_IsString(tc) && strcmp(tc->valuestring, "required") == 0) {
        t->choice = PD_TOOLS_REQUIRED;
    } else {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(tc, "type");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(tc, "function"), "name");
        if (!cJSON_IsObject(tc) || !cJSON_IsString(ty) || strcmp(ty->valuestring, "function") != 0 ||
            !cJSON_IsString(nm)) {
            snprintf(msg, cap, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}");
            return -1;
        }
        t->named = -1;
        for (int k = 0; k < t->n; k++)
            if (strcmp(t->names[k], nm->valuestring) == 0)
                t->named = k;
        if (t->named < 0 && t->n > 0) {
            snprintf(msg, cap, "'tool_choice' names '%.64s', which is not one of the tools", nm->valuestring);
            return -1;
        }
        t->choice = PD_TOOLS_NAMED;
    }
    if (t->n == 0) {
        snprintf(msg, cap, "'tool_choice' \"%s\" needs 'tools'", cJSON_IsString(tc) ? tc->valuestring : "function");
        return -1;
    }
    return 0;
nomem:
    snprintf(msg, cap, "out of memory");
    return -1;
}

static pd_status tools_compile(void *ud, pd_grammar **out, pd_err *err)
{
    const pd_chat_tools *t = ud;
    if (t->choice == PD_TOOLS_REQUIRED)
        return pd_grammar_tool_calls((const char *const *)t->names, (const char *const *)t->schemas, t->n,
                                     t->parallel, out, err);
    return pd_grammar_tool_calls((const char *const *)t->names + t->named,
                                 (const char *const *)t->schemas + t->named, 1, 0, out, err);
}

pd_status pd_chat_tools_grammar(const pd_chat_tools *t, pd_gcache *cache, pd_grammar **out, pd_err *err)
{
    *out = NULL;
    if (t->choice != PD_TOOLS_REQUIRED && t->choice != PD_TOOLS_NAMED)
        return PD_OK;
    /* the key: "t", the choice, parallel, then each tool that counts as name NUL schema NUL */
    cbuf k = { 0 };
    char head[4] = { 't', (char)('0' + t->choice), (char)('0' + (t->parallel && t->choice == PD_TOOLS_REQUIRED)), 0 };
    int ok = cb_add(&k, head, 4) == 0;
    for (int i = 0; i < t->n && ok; i++) {
        if (t->choice == PD_TOOLS_NAMED && i != t->named)
            continue;
        ok = cb_add(&k, t->names[i], strlen(t->names[i]) + 1) == 0 &&
             cb_add(&k, t->schemas[i] != NULL ? t->schemas[i] : "", t->schemas[i] != NULL ? strlen(t->schemas[i]) + 1 : 1) == 0;
    }
    pd_status st = ok ? pd_gcache_get(cache, k.p, k.len, tools_compile, (void *)t, out, err)
                      : pd_err_set(err, PD_ERR_NOMEM, "tool grammar key");
    free(k.p);
    return st;
}

/* ---- rendering ------------------------------------------------------------------------------- */

static const char *role_of(const cJSON *m)
{
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
    if (!cJSON_IsString(r))
        return NULL;
    return strcmp(r->valuestring, "developer") == 0 ? "system" : r->valuestring;
}

/* message i's content as text (a string, or the texts of {"type": "text"} parts joined);
 * null or absent gives "" where allowed. -1 with msg. */
static int content_of(const cJSON *m, int i, int null_ok, cbuf *out, char *msg, size_t cap)
{
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
    out->len = 0;
    if (cb_add(out, "", 0) != 0)
        goto nomem;
    if (cJSON_IsString(c))
        return cb_str(out, c->valuestring) != 0 ? (snprintf(msg, cap, "out of memory"), -1) : 0;
    if (cJSON_IsArray(c)) {
        for (const cJSON *part = c->child; part != NULL; part = part->next) {
            const cJSON *ty = cJSON_GetObjectItemCaseSensitive(part, "type");
            const cJSON *tx = cJSON_GetObjectItemCaseSensitive(part, "text");
            if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "text") != 0 || !cJSON_IsString(tx)) {
                snprintf(msg, cap, "messages[%d].content: only text parts are supported", i);
                return -1;
            }
            if (cb_str(out, tx->valuestring) != 0)
                goto nomem;
        }
        return 0;
    }
    if ((c == NULL || cJSON_IsNull(c)) && null_ok)
        return 0;
    snprintf(msg, cap, "messages[%d].content must be a string or an array of text parts", i);
    return -1;
nomem:
    snprintf(msg, cap, "out of memory");
    return -1;
}

static int is_tool_response(const char *s)
{
    size_t n = strlen(s);
    return strncmp(s, "<tool_response>", 15) == 0 && n >= 16 && strcmp(s + n - 16, "</tool_response>") == 0;
}

/* Python's s.lstrip('\n') / rstrip('\n') as offsets */
static const char *lstrip_nl(const char *s)
{
    while (*s == '\n')
        s++;
    return s;
}

static size_t rstrip_nl(const char *s, size_t n)
{
    while (n > 0 && s[n - 1] == '\n')
        n--;
    return n;
}

/* the tool calls of an assistant message, after its content */
static int render_calls(cbuf *o, const cJSON *calls, int i, int has_content, char *msg, size_t cap)
{
    int k = 0;
    for (const cJSON *tc = calls->child; tc != NULL; tc = tc->next, k++) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tc, "function");
        if (!cJSON_IsObject(fn))
            fn = tc;
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        if (!cJSON_IsString(nm) || (args != NULL && !cJSON_IsString(args) && !cJSON_IsObject(args))) {
            snprintf(msg, cap, "messages[%d].tool_calls[%d] needs function.name (a string) and "
                     "function.arguments (a JSON text or an object)", i, k);
            return -1;
        }
        if (((k == 0 && has_content) || k > 0) && cb_str(o, "\n") != 0)
            goto nomem;
        if (cb_str(o, "<tool_call>\n{\"name\": \"") != 0 || cb_str(o, nm->valuestring) != 0 ||
            cb_str(o, "\", \"arguments\": ") != 0)
            goto nomem;
        if (cJSON_IsString(args) ? cb_str(o, args->valuestring) != 0
                                 : args == NULL ? cb_str(o, "{}") != 0 : py_json(o, args) != 0)
            goto nomem;
        if (cb_str(o, "}\n</tool_call>") != 0)
            goto nomem;
    }
    return 0;
nomem:
    snprintf(msg, cap, "out of memory");
    return -1;
}

static int render_assistant(cbuf *o, const pd_chat_template *tp, const cJSON *m, int i, int last, int lqi,
                            const char *content, char *msg, size_t cap)
{
    const char *body = content;
    char *reasoning = NULL;
    int rc = -1;
    if (tp->think) {
        const cJSON *rs = cJSON_GetObjectItemCaseSensitive(m, "reasoning_content");
        const char *end = strstr(content, "</think>");
        if (cJSON_IsString(rs)) {
            reasoning = strdup(rs->valuestring);
        } else if (end != NULL) {
            /* content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') */
            size_t n = rstrip_nl(content, (size_t)(end - content));
            const char *st = content, *p;
            while ((p = strstr(st, "<think>")) != NULL && p + 7 <= content + n)
                st = p + 7;
            st = lstrip_nl(st);
            size_t rn = st < content + n ? (size_t)(content + n - st) : 0;
            if ((reasoning = malloc(rn + 1)) != NULL) {
                memcpy(reasoning, st, rn);
                reasoning[rn] = '\0';
            }
            /* content.split('</think>')[-1].lstrip('\n') */
            const char *q = end;
            while ((p = strstr(q + 8, "</think>")) != NULL)
                q = p;
            body = lstrip_nl(q + 8);
        } else {
            reasoning = strdup("");
        }
        if (reasoning == NULL)
            goto nomem;
    }
    if (tp->think && i > lqi && (last || reasoning[0] != '\0')) {
        const char *r0 = lstrip_nl(reasoning);
        if (cb_str(o, "<|im_start|>assistant\n<think>\n") != 0 || cb_add(o, r0, rstrip_nl(r0, strlen(r0))) != 0 ||
            cb_str(o, "\n</think>\n\n") != 0 || cb_str(o, lstrip_nl(body)) != 0)
            goto nomem;
    } else if (cb_str(o, "<|im_start|>assistant\n") != 0 || cb_str(o, body) != 0) {
        goto nomem;
    }
    const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
    if (calls != NULL && !cJSON_IsNull(calls)) {
        if (!cJSON_IsArray(calls)) {
            snprintf(msg, cap, "messages[%d].tool_calls must be an array", i);
            goto out;
        }
        if (render_calls(o, calls, i, body[0] != '\0', msg, cap) != 0)
            goto out;
    }
    if (cb_str(o, "<|im_end|>\n") != 0)
        goto nomem;
    rc = 0;
    goto out;
nomem:
    snprintf(msg, cap, "out of memory");
out:
    free(reasoning);
    return rc;
}

static int render_tools(cbuf *o, const cJSON *tools)
{
    if (cb_str(o, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>") != 0)
        return -1;
    for (const cJSON *t = tools->child; t != NULL; t = t->next)
        if (cb_str(o, "\n") != 0 || py_json(o, t) != 0)
            return -1;
    return cb_str(o, "\n</tools>\n\nFor each function call, return a json object with function name and "
                     "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                     "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n");
}

int pd_chat_render(const pd_chat_template *tp, const cJSON *ms, const pd_chat_tools *t, int enable_thinking,
                   char **out, size_t *out_len, char *msg, size_t cap)
{
    *out = NULL;
    *out_len = 0;
    if (ms == NULL || cJSON_IsNull(ms)) {
        snprintf(msg, cap, "'messages' is required");
        return -1;
    }
    if (!cJSON_IsArray(ms) || cJSON_GetArraySize(ms) == 0) {
        snprintf(msg, cap, "'messages' must be a non-empty array");
        return -1;
    }
    int n = cJSON_GetArraySize(ms);
    cbuf o = { 0 }, content = { 0 };
    int rc = -1, i = 0;
    /* every message checked first: a role this renderer knows */
    for (const cJSON *m = ms->child; m != NULL; m = m->next, i++) {
        const char *rs = role_of(m);
        if (!cJSON_IsObject(m) || rs == NULL) {
            snprintf(msg, cap, "messages[%d] must be an object with a string 'role'", i);
            return -1;
        }
        if (strcmp(rs, "system") != 0 && strcmp(rs, "user") != 0 && strcmp(rs, "assistant") != 0 &&
            strcmp(rs, "tool") != 0) {
            snprintf(msg, cap, "messages[%d].role '%.32s' is not one of system, developer, user, assistant, tool",
                     i, rs);
            return -1;
        }
    }
    const cJSON *tools = t != NULL && t->choice != PD_TOOLS_NONE ? t->list : NULL;
    const cJSON *first = ms->child;
    int first_system = strcmp(role_of(first), "system") == 0;
    if (cb_add(&o, "", 0) != 0)
        goto nomem;
    if (first_system && content_of(first, 0, 0, &content, msg, cap) != 0)
        goto out;
    if (tools != NULL) {
        if (cb_str(&o, "<|im_start|>system\n") != 0)
            goto nomem;
        if (first_system && (cb_str(&o, content.p) != 0 || cb_str(&o, "\n\n") != 0))
            goto nomem;
        if (render_tools(&o, tools) != 0)
            goto nomem;
    } else if (first_system) {
        if (cb_str(&o, "<|im_start|>system\n") != 0 || cb_str(&o, content.p) != 0 ||
            cb_str(&o, "<|im_end|>\n") != 0)
            goto nomem;
    }
    /* the last user query (not a tool response): Qwen3 keeps the reasoning of the turns after it */
    int lqi = n - 1;
    if (tp->think) {
        i = n - 1;
        for (const cJSON *m = cJSON_GetArrayItem(ms, n - 1); m != NULL; m = m->prev, i--) {
            if (strcmp(role_of(m), "user") == 0) {
                if (content_of(m, i, 0, &content, msg, cap) != 0)
                    goto out;
                if (!is_tool_response(content.p)) {
                    lqi = i;
                    break;
                }
            }
            if (m == first)
                break;
        }
    }
    i = 0;
    for (const cJSON *m = first; m != NULL; m = m->next, i++) {
        const char *rs = role_of(m);
        int assistant = strcmp(rs, "assistant") == 0, tool = strcmp(rs, "tool") == 0;
        if (content_of(m, i, assistant, &content, msg, cap) != 0)
            goto out;
        if (i == 0 && first_system)
            continue;
        if (assistant) {
            if (render_assistant(&o, tp, m, i, m->next == NULL, lqi, content.p, msg, cap) != 0)
                goto out;
        } else if (tool) {
            int open = m->prev == NULL || m == first || strcmp(role_of(m->prev), "tool") != 0;
            int close = m->next == NULL || strcmp(role_of(m->next), "tool") != 0;
            if ((open && cb_str(&o, "<|im_start|>user") != 0) || cb_str(&o, "\n<tool_response>\n") != 0 ||
                cb_str(&o, content.p) != 0 || cb_str(&o, "\n</tool_response>") != 0 ||
                (close && cb_str(&o, "<|im_end|>\n") != 0))
                goto nomem;
        } else if (cb_str(&o, "<|im_start|>") != 0 || cb_str(&o, rs) != 0 || cb_str(&o, "\n") != 0 ||
                   cb_str(&o, content.p) != 0 || cb_str(&o, "<|im_end|>\n") != 0) {
            goto nomem;
        }
    }
    if (cb_str(&o, "<|im_start|>assistant\n") != 0 || (tp->open_think && cb_str(&o, "<think>\n") != 0) ||
        (tp->think_switch && !tp->open_think && enable_thinking == 0 && cb_str(&o, "<think>\n\n</think>\n\n") != 0))
        goto nomem;
    *out = o.p;
    *out_len = o.len;
    o.p = NULL;
    rc = 0;
    goto out;
nomem:
    snprintf(msg, cap, "out of memory");
out:
    free(o.p);
    free(content.p);
    return rc;
}

/* ---- the output parser ----------------------------------------------------------------------- */

enum { P_START, P_REASONING, P_CONTENT, P_CALL };

struct pd_chat_parser {
    int tools;
    int mode;
    size_t pos;          /* bytes of the output consumed */
    size_t call_at;      /* P_CALL: where its <tool_call> began ... */
    size_t ws_at;        /* ... and the whitespace before it (text again if the call is not one) */
    int skip;            /* P_CONTENT: leading characters to drop (1 '\n', 2 any whitespace) */
    int first_reason;    /* P_REASONING: nothing emitted yet (its leading '\n' is dropped) */
    int calls;
};

static const char T_THINK[] = "<think>", T_THINK_END[] = "</think>", T_CALL[] = "<tool_call>",
                  T_CALL_END[] = "</tool_call>";

pd_chat_parser *pd_chat_parser_create(int tools, int reasoning)
{
    pd_chat_parser *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->tools = tools;
    p->mode = reasoning == 1 ? P_START : reasoning == 2 ? P_REASONING : P_CONTENT;
    p->first_reason = 1;
    return p;
}

void pd_chat_parser_destroy(pd_chat_parser *p) { free(p); }

int pd_chat_parser_calls(const pd_chat_parser *p) { return p->calls; }

static const char *find(const char *s, size_t n, const char *needle)
{
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (s[i] == needle[0] && memcmp(s + i, needle, k) == 0)
            return s + i;
    return NULL;
}

/* how many of the last bytes of s[0..n) may begin tag */
static size_t tag_prefix(const char *s, size_t n, const char *tag)
{
    size_t k = strlen(tag);
    for (size_t h = k - 1 < n ? k - 1 : n; h > 0; h--)
        if (memcmp(s + n - h, tag, h) == 0)
            return h;
    return 0;
}

static int is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

static void emit_text(pd_chat_parser *p, pd_chat_kind kind, const char *s, size_t n, size_t end, pd_chat_emit emit,
                      void *ud)
{
    p->pos = end;
    if (n == 0)
        return;
    pd_chat_piece pc = { .kind = kind, .text = s, .len = n, .end = end };
    emit(ud, &pc);
}

/* a whole <tool_call> block s[0..n) (tags included): a call when its body is
 * {"name": STRING, "arguments": OBJECT or absent}, else content */
static int emit_call(pd_chat_parser *p, const char *text, size_t end, pd_chat_emit emit, void *ud)
{
    const char *body = text + p->call_at + sizeof(T_CALL) - 1;
    size_t bn = end - p->call_at - (sizeof(T_CALL) - 1) - (sizeof(T_CALL_END) - 1);
    cJSON *j = cJSON_ParseWithLength(body, bn);
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(j, "name");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(j, "arguments");
    if (args == NULL)
        args = cJSON_GetObjectItemCaseSensitive(j, "parameters");
    if (!cJSON_IsObject(j) || !cJSON_IsString(nm) || (args != NULL && !cJSON_IsObject(args))) {
        cJSON_Delete(j);
        emit_text(p, PD_CHAT_CONTENT, text + p->ws_at, end - p->ws_at, end, emit, ud);
        return 0;
    }
    char *a = args != NULL ? cJSON_PrintUnformatted(args) : strdup("{}");
    if (a == NULL) {
        cJSON_Delete(j);
        return -1;
    }
    p->pos = end;
    pd_chat_piece pc = { .kind = PD_CHAT_TOOL_CALL, .text = nm->valuestring, .len = strlen(nm->valuestring),
                         .args = a, .args_len = strlen(a), .index = p->calls++, .end = end };
    emit(ud, &pc);
    free(a);
    cJSON_Delete(j);
    p->skip = 2;   /* the "\n" between calls */
    return 0;
}

int pd_chat_parser_feed(pd_chat_parser *p, const char *text, size_t len, int final, pd_chat_emit emit, void *ud)
{
    for (;;) {
        const char *s = text + p->pos;
        size_t n = len - p->pos;
        if (p->mode == P_START) {
            size_t k = sizeof(T_THINK) - 1;
            if (n < k && memcmp(s, T_THINK, n) == 0 && !final)
                return 0;   /* may still become <think> */
            if (n >= k && memcmp(s, T_THINK, k) == 0) {
                p->pos += k;
                p->mode = P_REASONING;
            } else {
                p->mode = P_CONTENT;
            }
            continue;
        }
        if (p->mode == P_REASONING) {
            if (p->first_reason) {   /* "<think>\n" */
                if (n == 0 && !final)
                    return 0;
                if (n > 0 && s[0] == '\n') {
                    p->pos++;
                    s++;
                    n--;
                }
                p->first_reason = 0;
            }
            const char *e = find(s, n, T_THINK_END);
            if (e != NULL) {
                size_t end = (size_t)(e - text) + sizeof(T_THINK_END) - 1;
                emit_text(p, PD_CHAT_REASONING, s, rstrip_nl(s, (size_t)(e - s)), end, emit, ud);
                p->mode = P_CONTENT;
                p->skip = 1;
                continue;
            }
            size_t keep = final ? n : n - tag_prefix(s, n, T_THINK_END);
            if (!final)
                keep = rstrip_nl(s, keep);   /* newlines before </think> are dropped */
            emit_text(p, PD_CHAT_REASONING, s, keep, p->pos + keep, emit, ud);
            return 0;
        }
        if (p->mode == P_CONTENT) {
            while (p->skip && n > 0 && (s[0] == '\n' || (p->skip == 2 && is_ws(s[0])))) {
                s++;
                n--;
                p->pos++;
            }
            if (n == 0)
                return 0;
            p->skip = 0;
            const char *c = p->tools ? find(s, n, T_CALL) : NULL;
            if (c != NULL) {
                size_t keep = (size_t)(c - s);
                while (keep > 0 && is_ws(s[keep - 1]))   /* the "\n" before a call */
                    keep--;
                emit_text(p, PD_CHAT_CONTENT, s, keep, (size_t)(c - text), emit, ud);
                p->ws_at = (size_t)(s - text) + keep;
                p->call_at = (size_t)(c - text);
                p->pos = p->call_at + sizeof(T_CALL) - 1;
                p->mode = P_CALL;
                continue;
            }
            size_t keep = n;
            if (p->tools && !final) {
                keep -= tag_prefix(s, n, T_CALL);
                while (keep > 0 && is_ws(s[keep - 1]))
                    keep--;
            }
            emit_text(p, PD_CHAT_CONTENT, s, keep, p->pos + keep, emit, ud);
            return 0;
        }
        /* P_CALL */
        const char *e = find(s, n, T_CALL_END);
        if (e != NULL) {
            size_t end = (size_t)(e - text) + sizeof(T_CALL_END) - 1;
            p->mode = P_CONTENT;
            if (emit_call(p, text, end, emit, ud) != 0)
                return -1;
            continue;
        }
        if (final)   /* an unfinished call is text */
            emit_text(p, PD_CHAT_CONTENT, text + p->ws_at, len - p->ws_at, len, emit, ud);
        return 0;
    }
}
