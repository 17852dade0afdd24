/* pd_chat.c - chat prompts rendered as Qwen's ChatML templates write them (other templates through
 * pd_jinja), and the generated text split back into content, reasoning and tool calls. See
 * pd_chat.h. */
#include "pd_chat.h"
#include "pd_jinja.h"

#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_buf.h"
#include "pd_cli.h"
#include "pd_json.h"

/* ---- a growing string ------------------------------------------------------------------------ */

typedef struct {
    char *p;
    size_t len, cap;
} cbuf;

static int cb_add(cbuf *b, const char *s, size_t n) { return pd_buf_append(&b->p, &b->len, &b->cap, s, n); }

static int cb_str(cbuf *b, const char *s) { return cb_add(b, s, strlen(s)); }

/* ---- the template ---------------------------------------------------------------------------- */

/* The system prompt a template writes when the messages bring none: the text of a string literal
 * '<|im_start|>system\n TEXT <|im_end|>\n' (Qwen2.5's templates); "" when the template has none
 * (its system literals end at the newline: Qwen3's). The literal's escapes are undone. */
static int default_system(const char *t, char *out, size_t n, char *why, size_t cap)
{
    static const char head[] = "<|im_start|>system\\n";
    out[0] = '\0';
    for (const char *p = strstr(t, head); p != NULL; p = strstr(p + 1, head)) {
        char quote = p > t ? p[-1] : '\0';
        if (quote != '\'' && quote != '"')
            continue;
        const char *s = p + strlen(head);
        size_t k = 0;
        for (; *s != '\0' && *s != quote; s++) {
            char c = *s;
            if (c == '\\' && s[1] != '\0')
                c = *++s == 'n' ? '\n' : *s == 't' ? '\t' : *s;
            if (k + 1 >= n) {
                snprintf(why, cap, "the template's default system prompt is longer than %zu bytes", n - 1);
                return -1;
            }
            out[k++] = c;
        }
        out[k] = '\0';
        static const char tail[] = "<|im_end|>\n";
        size_t tl = strlen(tail);
        if (*s == quote && k > tl && strcmp(out + k - tl, tail) == 0) {
            out[k - tl] = '\0';
            return 0;
        }
        out[0] = '\0';
    }
    return 0;
}

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
    return default_system(t, out->default_system, sizeof(out->default_system), why, cap);
}

/* The text of path, NULL when it cannot be read (an absent file means: look elsewhere) */
static char *read_text(const char *path)
{
    char *t = NULL;
    pd_err err;
    return pd_cli_read_text(path, &t, &err) == PD_OK ? t : NULL;
}

/* tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (the one
 * named "default", else the first) */
static char *config_template(const char *model_dir)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", model_dir);
    char *cfg = read_text(path);
    cJSON *j = pd_json_parse_str(cfg, NULL);
    free(cfg);
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(j, "chat_template");
    if (cJSON_IsArray(ct)) {
        const cJSON *pick = NULL;
        for (const cJSON *it = ct->child; it != NULL; it = it->next) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(it, "name");
            if (pick == NULL || (cJSON_IsString(nm) && strcmp(nm->valuestring, "default") == 0))
                pick = it;
        }
        ct = pick != NULL ? cJSON_GetObjectItemCaseSensitive(pick, "template") : NULL;
    }
    char *t = cJSON_IsString(ct) ? strdup(ct->valuestring) : NULL;
    cJSON_Delete(j);
    return t;
}

/* the checkpoint's bos_token / eos_token (tokenizer_config.json: a string or {"content": ...}) */
static void special_tokens(const char *model_dir, pd_chat_template *out)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", model_dir);
    char *cfg = read_text(path);
    cJSON *j = pd_json_parse_str(cfg, NULL);
    free(cfg);
    static const char *const keys[2] = {"bos_token", "eos_token"};
    for (int k = 0; k < 2; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, keys[k]);
        if (cJSON_IsObject(v))
            v = cJSON_GetObjectItemCaseSensitive(v, "content");
        if (cJSON_IsString(v))
            snprintf(k == 0 ? out->bos : out->eos, sizeof(out->bos), "%s", v->valuestring);
    }
    cJSON_Delete(j);
}

/* t into *out: a ChatML-shaped template for the ChatML renderer (unless jinja), any other parsed
 * by pd_jinja (-1 with why when it does not parse) */
static int template_use(const char *t, int jinja, pd_chat_template *out, char *why, size_t cap)
{
    char d[128], perr[256];
    if (!jinja && pd_chat_template_detect(t, out, d, sizeof(d)) == 0)
        return 0;
    memset(out, 0, sizeof(*out));
    if ((out->jinja = pd_jinja_parse(t, perr, sizeof(perr))) == NULL) {
        snprintf(why, cap, "the chat template does not parse as Jinja (%s)", perr);
        return -1;
    }
    out->hermes_calls = strstr(t, "<tool_call>") != NULL;
    return 0;
}

/* a Jinja template's generation prompt that opens <think> itself: the reply starts inside it */
static void probe_open_think(pd_chat_template *tp)
{
    cJSON *ms = cJSON_CreateArray(), *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "user");
    cJSON_AddStringToObject(m, "content", "x");
    cJSON_AddItemToArray(ms, m);
    char *out = NULL, msg[256];
    size_t len = 0;
    if (pd_chat_render(tp, ms, NULL, NULL, &out, &len, msg, sizeof(msg)) == 0) {
        while (len > 0 && (out[len - 1] == '\n' || out[len - 1] == ' '))
            len--;
        tp->open_think = len >= 7 && memcmp(out + len - 7, "<think>", 7) == 0;
    }
    free(out);
    cJSON_Delete(ms);
}

void pd_chat_template_free(pd_chat_template *t)
{
    if (t == NULL)
        return;
    pd_jinja_free(t->jinja);
    t->jinja = NULL;
}

pd_status pd_chat_template_load(const char *model_dir, const char *given, pd_chat_template *out, int *usable,
                                char *why, size_t cap, pd_err *err)
{
    return pd_chat_template_open(model_dir, given, 0, out, usable, why, cap, err);
}

pd_status pd_chat_template_open(const char *model_dir, const char *given, int jinja, pd_chat_template *out,
                                int *usable, char *why, size_t cap, pd_err *err)
{
    char d[384];
    *usable = 0;
    memset(out, 0, sizeof(*out));
    if (given != NULL) {
        char *t = strstr(given, "{{") != NULL || strstr(given, "{%") != NULL ? strdup(given) : read_text(given);
        if (t == NULL)
            return pd_err_set(err, PD_ERR_IO, "--chat-template '%.200s': no such file (or give the template "
                              "text itself)", given);
        int rc = template_use(t, jinja, out, d, sizeof(d));
        free(t);
        if (rc != 0)
            return pd_err_set(err, PD_ERR_INVALID, "--chat-template: %s", d);
        *usable = 1;
    } else {
        char path[4096];
        snprintf(path, sizeof(path), "%s/chat_template.jinja", model_dir);
        const char *from = "chat_template.jinja";
        char *t = read_text(path);
        if (t == NULL) {
            t = config_template(model_dir);
            from = "tokenizer_config.json";
        }
        if (t == NULL)
            snprintf(why, cap, "chat is unavailable: the checkpoint ships no chat template "
                     "(chat_template.jinja or tokenizer_config.json); send a prompt you format yourself");
        else if (template_use(t, jinja, out, d, sizeof(d)) != 0)
            snprintf(why, cap, "chat is unavailable: the checkpoint's chat template (%s): %s; send a prompt you "
                     "format yourself or give --chat-template", from, d);
        else
            *usable = 1;
        free(t);
    }
    if (*usable && out->jinja != NULL) {
        special_tokens(model_dir, out);
        probe_open_think(out);
    }
    return PD_OK;
}

int pd_chat_render_text(const pd_chat_template *tp, const char *const *roles, const char *const *contents, int n,
                        const pd_chat_opts *o, char **out, size_t *out_len, char *msg, size_t cap)
{
    cJSON *ms = cJSON_CreateArray();
    for (int i = 0; ms != NULL && i < n; i++) {
        cJSON *m = cJSON_CreateObject();
        if (m == NULL || !cJSON_AddItemToArray(ms, m) || cJSON_AddStringToObject(m, "role", roles[i]) == NULL ||
            cJSON_AddStringToObject(m, "content", contents[i]) == NULL) {
            cJSON_Delete(ms);
            ms = NULL;
        }
    }
    if (ms == NULL) {
        snprintf(msg, cap, "out of memory rendering the messages");
        return -1;
    }
    int rc = pd_chat_render(tp, ms, NULL, o, out, out_len, msg, cap);
    cJSON_Delete(ms);
    return rc;
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

int pd_chat_tools_mode(const pd_chat_tools *t)
{
    return t->choice == PD_TOOLS_NONE ? 0 : t->parallel ? 1 : 2;
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
        /* JSON text is parsed and written again (what vLLM and SGLang hand the template); none or
         * "" is {} */
        cJSON *parsed = NULL;
        if (cJSON_IsString(args) && args->valuestring[0] != '\0') {
            parsed = pd_json_parse_str(args->valuestring, NULL);
            if (parsed == NULL) {
                snprintf(msg, cap, "messages[%d].tool_calls[%d].function.arguments is not valid JSON", i, k);
                return -1;
            }
            args = parsed;
        }
        int bad = parsed != NULL || cJSON_IsObject(args) ? py_json(o, args) : cb_str(o, "{}");
        cJSON_Delete(parsed);
        if (bad != 0)
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

static int is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }

/* continue_final_message: the render r[0..*n) cut after the final message's text f, as Hugging
 * Face's apply_chat_template cuts it (at the last place f.strip() occurs; f.lstrip() long when
 * the render keeps f whole there, else f.strip() long). -1 when f.strip() is not in it. */
static int cut_after_final(const char *r, size_t *n, const char *f)
{
    size_t fl = strlen(f), a = 0, b = fl;
    while (a < fl && is_space(f[a]))
        a++;
    while (b > a && is_space(f[b - 1]))
        b--;
    size_t sl = b - a;   /* f.strip() is f[a..b) */
    size_t loc = (size_t)-1;
    for (size_t i = 0; i + sl <= *n; i++)
        if (memcmp(r + i, f + a, sl) == 0)
            loc = i;
    if (loc == (size_t)-1)
        return -1;
    size_t ll = fl - a;   /* len(f.lstrip()) */
    int whole = loc + ll <= *n && ll == fl && memcmp(r + loc, f, fl) == 0;
    *n = loc + (whole ? ll : sl);
    return 0;
}

/* The messages as a template is handed them (as vLLM prepares them): developer as system, text
 * parts joined into a string, tool-call arguments given as JSON text parsed into objects ("" or
 * none: {}). NULL with msg. */
static cJSON *jinja_messages(const cJSON *ms, char *msg, size_t cap)
{
    cJSON *out = cJSON_CreateArray();
    cbuf text = {0};
    int i = 0;
    for (const cJSON *m = ms->child; m != NULL; m = m->next, i++) {
        cJSON *c = cJSON_Duplicate(m, 1);
        cJSON_AddItemToArray(out, c);
        cJSON_ReplaceItemInObjectCaseSensitive(c, "role", cJSON_CreateString(role_of(m)));
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (content != NULL && !cJSON_IsNull(content)) {
            if (content_of(m, i, 1, &text, msg, cap) != 0)
                goto fail;
            cJSON_ReplaceItemInObjectCaseSensitive(c, "content", cJSON_CreateString(text.p));
        }
        cJSON *calls = cJSON_GetObjectItemCaseSensitive(c, "tool_calls");
        int k = 0;
        for (cJSON *tc = cJSON_IsArray(calls) ? calls->child : NULL; tc != NULL; tc = tc->next, k++) {
            cJSON *fn = cJSON_GetObjectItemCaseSensitive(tc, "function");
            const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
            if (!cJSON_IsObject(fn) || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(fn, "name")) ||
                (args != NULL && !cJSON_IsNull(args) && !cJSON_IsString(args) && !cJSON_IsObject(args))) {
                snprintf(msg, cap, "messages[%d].tool_calls[%d] needs function.name (a string) and "
                         "function.arguments (a JSON text or an object)", i, k);
                goto fail;
            }
            if (cJSON_IsObject(args))
                continue;
            cJSON *parsed = cJSON_IsString(args) && args->valuestring[0] != '\0'
                          ? pd_json_parse_str(args->valuestring, NULL) : cJSON_CreateObject();
            if (parsed == NULL) {
                snprintf(msg, cap, "messages[%d].tool_calls[%d].function.arguments is not valid JSON", i, k);
                goto fail;
            }
            if (args != NULL)
                cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", parsed);
            else
                cJSON_AddItemToObject(fn, "arguments", parsed);
        }
    }
    free(text.p);
    return out;
fail:
    free(text.p);
    cJSON_Delete(out);
    return NULL;
}

/* A template that is not ChatML, rendered by pd_jinja with what apply_chat_template gives it:
 * messages, tools, add_generation_prompt, bos_token / eos_token, enable_thinking when asked */
static int render_jinja(const pd_chat_template *tp, const cJSON *ms, const cJSON *tools, const pd_chat_opts *opt,
                        char **out, size_t *out_len, char *msg, size_t cap)
{
    if (tools != NULL && !tp->hermes_calls) {
        snprintf(msg, cap, "tools: this model's chat template writes tool calls in a format the server does not "
                 "parse (it reads <tool_call> blocks); send the request without tools");
        return -1;
    }
    if (opt->continue_final && opt->add_generation_prompt) {
        snprintf(msg, cap, "continue_final_message and add_generation_prompt cannot both be true");
        return -1;
    }
    int n = cJSON_GetArraySize(ms);
    const cJSON *last = cJSON_GetArrayItem(ms, n - 1);
    if (opt->continue_final && strcmp(role_of(last), "assistant") != 0) {
        snprintf(msg, cap, "continue_final_message needs the last message (messages[%d]) to be the assistant's", n - 1);
        return -1;
    }
    cJSON *prepared = jinja_messages(ms, msg, cap);
    if (prepared == NULL)
        return -1;
    cJSON *ctx = cJSON_CreateObject();
    cJSON_AddItemToObject(ctx, "messages", prepared);
    if (tools != NULL)
        cJSON_AddItemReferenceToObject(ctx, "tools", (cJSON *)tools);
    cJSON_AddBoolToObject(ctx, "add_generation_prompt", opt->add_generation_prompt != 0);
    if (tp->bos[0] != '\0')
        cJSON_AddStringToObject(ctx, "bos_token", tp->bos);
    if (tp->eos[0] != '\0')
        cJSON_AddStringToObject(ctx, "eos_token", tp->eos);
    /* the request's chat_template_kwargs, but not over what the server sets */
    static const char *const reserved[] = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                           "enable_thinking", NULL};
    for (const cJSON *kv = cJSON_IsObject(opt->kwargs) ? opt->kwargs->child : NULL; kv != NULL; kv = kv->next) {
        int taken = 0;
        for (int k = 0; reserved[k] != NULL && !taken; k++)
            taken = strcmp(kv->string, reserved[k]) == 0;
        if (!taken)
            cJSON_AddItemReferenceToObject(ctx, kv->string, (cJSON *)kv);
    }
    if (opt->enable_thinking >= 0)
        cJSON_AddBoolToObject(ctx, "enable_thinking", opt->enable_thinking != 0);
    char err[384];
    int rc = pd_jinja_render(tp->jinja, ctx, out, out_len, err, sizeof(err));
    if (rc != 0) {
        snprintf(msg, cap, "the chat template refused the messages: %s", err);
    } else if (opt->continue_final) {
        const cJSON *lc = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(prepared, n - 1), "content");
        if (cut_after_final(*out, out_len, cJSON_IsString(lc) ? lc->valuestring : "") != 0) {
            snprintf(msg, cap, "continue_final_message: the text of messages[%d] is not in the rendered prompt", n - 1);
            free(*out);
            *out = NULL;
            rc = -1;
        } else {
            (*out)[*out_len] = '\0';
        }
    }
    cJSON_Delete(ctx);
    return rc;
}

int pd_chat_render(const pd_chat_template *tp, const cJSON *ms, const pd_chat_tools *t, const pd_chat_opts *opt,
                   char **out, size_t *out_len, char *msg, size_t cap)
{
    static const pd_chat_opts defaults = PD_CHAT_OPTS_DEFAULT;
    if (opt == NULL)
        opt = &defaults;
    int enable_thinking = opt->enable_thinking;
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
    if (tp->jinja != NULL)
        return render_jinja(tp, ms, tools, opt, out, out_len, msg, cap);
    const cJSON *first = ms->child;
    int first_system = strcmp(role_of(first), "system") == 0;
    if (cb_add(&o, "", 0) != 0)
        goto nomem;
    if (first_system && content_of(first, 0, 0, &content, msg, cap) != 0)
        goto out;
    /* the template's own system prompt stands in for a missing one (Qwen2.5) */
    int has_system = first_system || tp->default_system[0] != '\0';
    if (!first_system && has_system && (cb_add(&content, "", 0) != 0 || cb_str(&content, tp->default_system) != 0))
        goto nomem;
    if (tools != NULL) {
        if (cb_str(&o, "<|im_start|>system\n") != 0)
            goto nomem;
        if (has_system && (cb_str(&o, content.p) != 0 || cb_str(&o, "\n\n") != 0))
            goto nomem;
        if (render_tools(&o, tools) != 0)
            goto nomem;
    } else if (has_system) {
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
    if (opt->continue_final) {
        const cJSON *last = cJSON_GetArrayItem(ms, n - 1);
        if (opt->add_generation_prompt) {
            snprintf(msg, cap, "continue_final_message and add_generation_prompt cannot both be true");
            goto out;
        }
        if (strcmp(role_of(last), "assistant") != 0) {
            snprintf(msg, cap, "continue_final_message needs the last message (messages[%d]) to be the assistant's",
                     n - 1);
            goto out;
        }
        if (content_of(last, n - 1, 1, &content, msg, cap) != 0)
            goto out;
        if (cut_after_final(o.p, &o.len, content.p) != 0) {
            snprintf(msg, cap, "continue_final_message: the text of messages[%d] is not in the rendered prompt", n - 1);
            goto out;
        }
        o.p[o.len] = '\0';
    } else if (opt->add_generation_prompt &&
               (cb_str(&o, "<|im_start|>assistant\n") != 0 || (tp->open_think && cb_str(&o, "<think>\n") != 0) ||
                (tp->think_switch && !tp->open_think && enable_thinking == 0 &&
                 cb_str(&o, "<think>\n\n</think>\n\n") != 0))) {
        goto nomem;
    }
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

/* A JSON value checked a byte at a time (RFC 8259 grammar; UTF-8 inside strings not checked):
 * what lets a call's arguments stream as they are written and stop at their first bad byte. */
enum { J_VALUE, J_AFTER, J_KEY, J_KEY_OR_END, J_VALUE_OR_END, J_COLON, J_STRING, J_ESC, J_HEX, J_NUM,
       J_LIT, J_DONE };
enum { J_MORE, J_END, J_BAD };
#define J_DEPTH 128

typedef struct {
    int st;
    int key;             /* J_STRING: the string is an object key */
    int k;               /* J_HEX: hex digits left; J_NUM: number state; J_LIT: letters matched */
    const char *lit;     /* J_LIT: true / false / null */
    int depth;
    char stack[J_DEPTH]; /* '{' or '[' */
} jscan;

/* the value that just ended: what may follow */
static int j_after(jscan *j)
{
    j->st = j->depth == 0 ? J_DONE : J_AFTER;
    return j->depth == 0 ? J_END : J_MORE;
}

/* number states: 1 '-', 2 '0', 3 int digits, 4 '.', 5 frac digits, 6 'e', 7 e sign, 8 exp digits */
static int j_num(jscan *j, unsigned char c)
{
    int d = c >= '0' && c <= '9';
    switch (j->k) {
    case 1: return d ? (j->k = c == '0' ? 2 : 3, 1) : 0;
    case 2: return c == '.' ? (j->k = 4, 1) : (c == 'e' || c == 'E') ? (j->k = 6, 1) : 0;
    case 3: return d ? 1 : c == '.' ? (j->k = 4, 1) : (c == 'e' || c == 'E') ? (j->k = 6, 1) : 0;
    case 4: return d ? (j->k = 5, 1) : 0;
    case 5: return d ? 1 : (c == 'e' || c == 'E') ? (j->k = 6, 1) : 0;
    case 6: return d ? (j->k = 8, 1) : (c == '+' || c == '-') ? (j->k = 7, 1) : 0;
    case 7: return d ? (j->k = 8, 1) : 0;
    default: return d;
    }
}

static int j_feed(jscan *j, unsigned char c)
{
    switch (j->st) {
    case J_STRING:
        if (c == '"') {
            if (j->key) {
                j->st = J_COLON;
                return J_MORE;
            }
            return j_after(j);
        }
        if (c == '\\')
            j->st = J_ESC;
        return c < 0x20 ? J_BAD : J_MORE;
    case J_ESC:
        if (c == 'u') {
            j->st = J_HEX;
            j->k = 4;
            return J_MORE;
        }
        j->st = J_STRING;
        return strchr("\"\\/bfnrt", c) != NULL && c != '\0' ? J_MORE : J_BAD;
    case J_HEX:
        if (!isxdigit(c))
            return J_BAD;
        if (--j->k == 0)
            j->st = J_STRING;
        return J_MORE;
    case J_NUM:
        if (j_num(j, c))
            return J_MORE;
        if (j->k == 1 || j->k == 4 || j->k == 6 || j->k == 7)
            return J_BAD;
        if (j_after(j) == J_END)
            return J_BAD;   /* a top-level number ends only at the end of the text: not here */
        return j_feed(j, c);
    case J_LIT:
        if (c != (unsigned char)j->lit[j->k])
            return J_BAD;
        if (j->lit[++j->k] == '\0')
            return j_after(j);
        return J_MORE;
    case J_DONE:
        return J_BAD;
    }
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r')
        return J_MORE;
    switch (j->st) {
    case J_COLON:
        if (c != ':')
            return J_BAD;
        j->st = J_VALUE;
        return J_MORE;
    case J_KEY_OR_END:
    case J_KEY:
        if (c == '}' && j->st == J_KEY_OR_END) {
            j->depth--;
            return j_after(j);
        }
        if (c != '"')
            return J_BAD;
        j->st = J_STRING;
        j->key = 1;
        return J_MORE;
    case J_AFTER: {
        char top = j->stack[j->depth - 1];
        if (c == ',') {
            j->st = top == '{' ? J_KEY : J_VALUE;
            return J_MORE;
        }
        if (c != (top == '{' ? '}' : ']'))
            return J_BAD;
        j->depth--;
        return j_after(j);
    }
    case J_VALUE_OR_END:
        if (c == ']') {
            j->depth--;
            return j_after(j);
        }
        break;
    }
    /* J_VALUE (or the first of an array) */
    if (c == '{' || c == '[') {
        if (j->depth == J_DEPTH)
            return J_BAD;
        j->stack[j->depth++] = (char)c;
        j->st = c == '{' ? J_KEY_OR_END : J_VALUE_OR_END;
        return J_MORE;
    }
    if (c == '"') {
        j->st = J_STRING;
        j->key = 0;
        return J_MORE;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        j->st = J_NUM;
        j->k = c == '-' ? 1 : c == '0' ? 2 : 3;
        return J_MORE;
    }
    j->lit = c == 't' ? "true" : c == 'f' ? "false" : c == 'n' ? "null" : NULL;
    if (j->lit == NULL)
        return J_BAD;
    j->st = J_LIT;
    j->k = 1;
    return J_MORE;
}

enum { P_START, P_REASONING, P_CONTENT, P_CALL, P_DONE };
/* a <tool_call> block: its head {"name": "F", "arguments": read first; from the arguments' '{'
 * on the call streams; a block of another shape is judged whole at its end */
enum { C_HEAD, C_ARGS, C_TAIL, C_WHOLE };

struct pd_chat_parser {
    int tools;
    int mode;
    size_t pos;          /* bytes of the output consumed */
    size_t call_at;      /* P_CALL: where its <tool_call> began ... */
    size_t ws_at;        /* ... and the whitespace before it (text again if the call is not one) */
    int cst;             /* P_CALL: C_* */
    int tail_brace;      /* C_TAIL: the call object's '}' has come */
    int first;           /* C_ARGS: nothing of the call emitted yet */
    size_t scanned;      /* C_ARGS: the output's bytes js has checked (pos may be behind it) */
    char *name;          /* the current call's function */
    jscan js;            /* C_ARGS: the arguments so far */
    int skip;            /* P_CONTENT: leading characters to drop (1 '\n', 2 any whitespace) */
    int first_reason;    /* P_REASONING: nothing emitted yet (its leading '\n' is dropped) */
    int calls;
};

static const char T_THINK[] = "<think>", T_THINK_END[] = "</think>", T_CALL[] = "<tool_call>",
                  T_CALL_END[] = "</tool_call>";

int pd_chat_reasoning_mode(const pd_chat_template *tp, const pd_chat_opts *o)
{
    return tp->open_think && o->add_generation_prompt ? 2 : o->enable_thinking != 0 ? 1 : 0;
}

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

void pd_chat_parser_destroy(pd_chat_parser *p)
{
    if (p != NULL)
        free(p->name);
    free(p);
}

int pd_chat_parser_calls(const pd_chat_parser *p) { return p->calls; }

int pd_chat_parser_calls_done(const pd_chat_parser *p)
{
    /* only a streamed call's arguments can be open (C_ARGS); a whole block is emitted done */
    return p->calls - (p->mode == P_CALL && p->cst == C_ARGS);
}

void pd_chat_call_id(const char *request_id, int choice, int call, char out[PD_CHAT_CALL_ID_SIZE])
{
    uint64_t h[2] = { 1469598103934665603ull, 1099511628211ull * 7 };
    for (int w = 0; w < 2; w++) {
        for (const char *p = request_id; *p; p++)
            h[w] = (h[w] ^ (uint8_t)*p) * 1099511628211ull;
        h[w] = (h[w] ^ (uint64_t)(choice * 1000 + call + w * 77)) * 1099511628211ull;
        h[w] ^= h[w] >> 29;
    }
    snprintf(out, PD_CHAT_CALL_ID_SIZE, "call_%016llx%08llx", (unsigned long long)h[0],
             (unsigned long long)(h[1] & 0xffffffffull));
}

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

/* where the output goes on after a call: content, or nowhere when one call is the most */
static int after_call(const pd_chat_parser *p) { return p->tools == 2 ? P_DONE : P_CONTENT; }

/* a call's arguments a[0..n) (its first piece, with the function, when p->first) */
static void emit_args(pd_chat_parser *p, const char *a, size_t n, size_t end, pd_chat_emit emit, void *ud)
{
    p->pos = end;
    if (n == 0 && !p->first)
        return;
    pd_chat_piece pc = { .kind = PD_CHAT_TOOL_CALL, .text = p->name, .len = strlen(p->name), .args = a,
                         .args_len = n, .index = p->calls - 1, .first = p->first, .end = end };
    p->first = 0;
    emit(ud, &pc);
}

/* a whole <tool_call> block of another shape than the streamed one, text[call_at..end) (tags
 * included): a call when its body is {"name": STRING, "arguments": OBJECT or absent} (any member
 * order; the arguments written again as json.dumps does), else content */
static int emit_call(pd_chat_parser *p, const char *text, size_t end, pd_chat_emit emit, void *ud)
{
    const char *body = text + p->call_at + sizeof(T_CALL) - 1;
    size_t bn = end - p->call_at - (sizeof(T_CALL) - 1) - (sizeof(T_CALL_END) - 1);
    cJSON *j = pd_json_parse(body, bn, NULL);
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(j, "name");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(j, "arguments");
    if (args == NULL)
        args = cJSON_GetObjectItemCaseSensitive(j, "parameters");
    if (!cJSON_IsObject(j) || !cJSON_IsString(nm) || (args != NULL && !cJSON_IsObject(args))) {
        cJSON_Delete(j);
        emit_text(p, PD_CHAT_CONTENT, text + p->ws_at, end - p->ws_at, end, emit, ud);
        return 0;
    }
    cbuf a = { 0 };
    free(p->name);
    p->name = strdup(nm->valuestring);
    if (p->name == NULL || (args != NULL ? py_json(&a, args) : cb_str(&a, "{}")) != 0) {
        free(a.p);
        cJSON_Delete(j);
        return -1;
    }
    p->calls++;
    p->first = 1;
    emit_args(p, a.p, a.len, end, emit, ud);
    free(a.p);
    cJSON_Delete(j);
    p->skip = 2;   /* the "\n" between calls */
    p->mode = after_call(p);
    return 0;
}

/* the head of a block's body s[0..n): 1 (*args_at: the arguments' '{', *name malloc'd) when it
 * is {"name": STRING, "arguments" (or "parameters"): {, 0 when it may still be, -1 when it is
 * not, -2 on NOMEM */
static int call_head(const char *s, size_t n, size_t *args_at, char **name)
{
    size_t i = 0, name_at = 0, name_end = 0;
    static const char *const step[] = { "{", "\"name\"", ":", NULL, ",", "\"arguments\"", ":", "{" };
    for (int k = 0; k < 8; k++) {
        while (i < n && is_ws(s[i]))
            i++;
        if (i == n)
            return 0;
        if (k == 3) {   /* the name: a JSON string */
            if (s[i] != '"')
                return -1;
            name_at = i++;
            while (i < n && s[i] != '"')
                i += s[i] == '\\' ? 2 : 1;
            if (i >= n)
                return 0;
            name_end = ++i;
            continue;
        }
        const char *w = step[k];
        if (k == 5 && s[i + 1 < n ? i + 1 : i] == 'p')
            w = "\"parameters\"";
        size_t l = strlen(w), m = n - i < l ? n - i : l;
        if (memcmp(s + i, w, m) != 0)
            return -1;
        if (m < l)
            return 0;
        i += l;
    }
    cJSON *nm = pd_json_parse(s + name_at, name_end - name_at, NULL);
    if (!cJSON_IsString(nm)) {
        cJSON_Delete(nm);
        return -1;
    }
    free(*name);
    *name = strdup(nm->valuestring);
    cJSON_Delete(nm);
    if (*name == NULL)
        return -2;
    *args_at = i - 1;
    return 1;
}

/* bytes at the end of s[0..n) that begin a UTF-8 character not yet whole */
static size_t utf8_tail(const char *s, size_t n)
{
    for (size_t h = 1; h <= 3 && h <= n; h++) {
        unsigned char c = (unsigned char)s[n - h];
        if ((c & 0xC0) != 0x80) {
            size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
            return need > h ? h : 0;
        }
    }
    return 0;
}

/* P_CALL: the block from p->pos on; 1 when the parser moved on to content (go on), 0 when it
 * waits for more text, -1 on NOMEM */
static int feed_call(pd_chat_parser *p, const char *text, size_t len, int final, pd_chat_emit emit, void *ud)
{
    const char *s = text + p->pos;
    size_t n = len - p->pos;
    if (p->cst == C_HEAD) {
        size_t at = 0;
        int h = call_head(s, n, &at, &p->name);
        if (h == -2)
            return -1;
        if (h == 0 && !final)
            return 0;
        if (h == 1) {
            memset(&p->js, 0, sizeof(p->js));
            p->cst = C_ARGS;
            p->first = 1;
            p->calls++;
            p->pos += at;
            p->scanned = p->pos;
            s += at;
            n -= at;
        } else {
            p->cst = C_WHOLE;
        }
    }
    if (p->cst == C_WHOLE) {
        const char *e = find(s, n, T_CALL_END);
        if (e == NULL && !final)
            return 0;
        p->mode = P_CONTENT;
        if (e != NULL)
            return emit_call(p, text, (size_t)(e - text) + sizeof(T_CALL_END) - 1, emit, ud) != 0 ? -1 : 1;
        /* an unfinished block of another shape is text */
        emit_text(p, PD_CHAT_CONTENT, text + p->ws_at, len - p->ws_at, len, emit, ud);
        return 1;
    }
    if (p->cst == C_ARGS) {
        /* bytes held back (half a UTF-8 character) were checked already: go on after them */
        size_t i = p->scanned > p->pos ? p->scanned - p->pos : 0;
        int r = J_MORE;
        while (i < n && r == J_MORE)
            r = j_feed(&p->js, (unsigned char)s[i++]);
        p->scanned = p->pos + i;
        if (r == J_BAD) {   /* the call ends at its arguments' last good byte; the rest is text */
            emit_args(p, s, i - 1, p->pos + i - 1, emit, ud);
            p->mode = after_call(p);
            return 1;
        }
        size_t out = r == J_END || final ? i : i - utf8_tail(s, i);
        emit_args(p, s, out, p->pos + out, emit, ud);
        if (r != J_END) {
            if (final)
                p->mode = after_call(p);   /* cut off: the call is what came */
            return final;
        }
        p->cst = C_TAIL;
        p->tail_brace = 0;
        s += out;
        n -= out;
    }
    /* C_TAIL: the call object's '}', then </tool_call> */
    size_t i = 0;
    for (;;) {
        while (i < n && is_ws(s[i]))
            i++;
        if (i < n && s[i] == '}' && !p->tail_brace) {
            p->tail_brace = 1;
            i++;
            continue;
        }
        break;
    }
    size_t k = sizeof(T_CALL_END) - 1, m = n - i < k ? n - i : k;
    if (p->tail_brace && memcmp(s + i, T_CALL_END, m) == 0) {
        if (m < k && !final) {   /* the tag may be coming: wait at its start */
            p->pos += i;
            return 0;
        }
        p->pos += i + m;   /* (cut off inside the tag: the call is whole all the same) */
        p->mode = after_call(p);
        p->skip = 2;   /* the "\n" between calls */
        return 1;
    }
    if (i == n && !final) {
        p->pos += i;
        return 0;
    }
    /* anything else ends the call here: it is text */
    p->pos += i;
    p->mode = after_call(p);
    return 1;
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
                p->cst = C_HEAD;
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
        if (p->mode == P_DONE) {   /* one call at most: what follows it is not part of the reply */
            p->pos = len;
            return 0;
        }
        /* P_CALL */
        int r = feed_call(p, text, len, final, emit, ud);
        if (r <= 0)
            return r;
    }
}
