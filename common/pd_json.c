/* pd_json.c - a whole text parsed as one JSON value (pd_json.h). */
#include "pd_json.h"

#include <string.h>

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
