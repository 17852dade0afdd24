/* pd_json.h - a whole text parsed as one JSON value. cJSON's parse functions stop after the first
 * value and let whatever follows it pass ({"a": 1} xyz parses); every JSON input of the project
 * (request bodies, JSON fields of gRPC requests, schemas, tool-call arguments, config and
 * checkpoint files, JSON lines) goes through here so that trailing bytes other than whitespace
 * are refused, and so is a raw control character (U+0000..U+001F) inside a string, which cJSON
 * also lets pass; the caller learns the byte where the text went wrong. Replies and
 * pdspark-generate --json print through pd_json_print, which writes a marked NUL byte as \u0000. (A safetensors header,
 * which may be padded with NUL bytes, checks its own tail: pd_safetensors.c.)
 * Owns: nothing; the caller frees the result with cJSON_Delete.
 * Threading: pure function (the failure position comes back through bad_at, not through
 *   cJSON_GetErrorPtr's global). */
#ifndef PD_JSON_H
#define PD_JSON_H

#include <stddef.h>

#include <cjson/cJSON.h>

/* s[0..n) as one JSON value followed by nothing but JSON whitespace (space, tab, CR, LF); NULL
 * when it is not (or out of memory), with *bad_at (when not NULL) the offset of the first byte
 * that does not fit: where cJSON gave up, the first byte after the value, or a raw control
 * character inside a string. */
cJSON *pd_json_parse(const char *s, size_t n, size_t *bad_at);

/* pd_json_parse of a NUL-terminated text; NULL s gives NULL */
cJSON *pd_json_parse_str(const char *s, size_t *bad_at);

/* cJSON_PrintUnformatted of o with each PD_TEXT_NUL (pd_tokenizer.h: a NUL byte of generated
 * text) written as \u0000; malloc'd, NULL when out of memory. */
char *pd_json_print(const cJSON *o);

#endif
