/* pd_json.c - a whole text parsed as one JSON value (pd_json.h). */
#include "pd_json.h"

#include <stdlib.h>
#include <string.h>

#include "pd_buf.h"
#include "pd_tokenizer.h"

cJSON *pd_json_parse(const char *s, size_t n, size_t *bad_at)
{
    if (bad_at != NULL)
        *bad_at = 0;
    if (s == NULL)
        return NULL;
    const char *end = NULL;
    cJSON *v = cJSON_ParseWithLengthOpts(s, n, &end, 0);
    size_t at = end != NULL && end >= s && end <= s + n ? (size_t)(end - s) : 0;
    if (v != NULL)
        while (at < n && (s[at] == ' ' || s[at] == '\t' || s[at] == '\n' || s[at] == '\r'))
            at++;
    /* cJSON takes a raw control character (U+0000..U+001F) inside a string; JSON does not
     * (RFC 8259 7: they must be escaped), nor do Python's json or a browser's JSON.parse */
    for (size_t i = 0, in_str = 0; v != NULL && at == n && i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!in_str) {
            in_str = c == '"';
        } else if (c == '\\') {
            i++;
        } else if (c == '"') {
            in_str = 0;
        } else if (c < 0x20) {
            at = i;
        }
    }
    if (v != NULL && at == n)
        return v;
    cJSON_Delete(v);
    if (bad_at != NULL)
        *bad_at = at;
    return NULL;
}

cJSON *pd_json_parse_str(const char *s, size_t *bad_at)
{
    return pd_json_parse(s, s != NULL ? strlen(s) : 0, bad_at);
}

char *pd_json_print(const cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    if (s == NULL || strstr(s, PD_TEXT_NUL) == NULL)
        return s;
    /* cJSON copies bytes >= 0x80 as they are: each two-byte mark goes out as \u0000 */
    char *out = NULL;
    size_t len = 0, cap = 0;
    const char *p = s, *m;
    int bad = 0;
    while (!bad && (m = strstr(p, PD_TEXT_NUL)) != NULL) {
        bad = pd_buf_append(&out, &len, &cap, p, (size_t)(m - p)) != 0 ||
              pd_buf_append(&out, &len, &cap, "\\u0000", 6) != 0;
        p = m + 2;
    }
    bad = bad || pd_buf_append(&out, &len, &cap, p, strlen(p)) != 0;
    free(s);
    if (bad) {
        free(out);
        return NULL;
    }
    return out;
}
