/* pd_jinja.h - the subset of Jinja2 that Hugging Face chat templates are written in.
 * Owns: parsing a template (text, {{ expressions }}, {% statements %}, {# comments #}, with
 *   whitespace control and transformers' trim_blocks / lstrip_blocks) and rendering it with a
 *   JSON context, as transformers' apply_chat_template renders it (jinja2's sandbox with the
 *   loop-control extension; tojson as json.dumps writes it, not HTML-escaped).
 * The subset: if/elif/else, for (one or two targets, a filter condition, else, loop.* with
 *   loop.cycle), break/continue, set (names, namespace attributes, block set), macro and call of
 *   macros, call blocks (caller() without arguments), filter blocks, generation blocks (rendered as plain content), raw; expressions with
 *   literals (strings, numbers, lists, tuples, dicts, true/false/none), attribute, subscript and
 *   slice access, arithmetic, ~, Python's % formatting of strings, comparisons, in / not in,
 *   and / or / not, the conditional expression, filters and tests by name, string / dict / list
 *   methods templates call (strip, split, startswith, format, items, get, ...), and the globals
 *   raise_exception, namespace, range, strftime_now, dict.
 *   Not there: template inheritance and includes, caller() arguments, autoescape, extensions other
 *   than loop controls, integers past 64 bits (they become floats); a name outside the subset is
 *   an error naming it, not a silent empty string; a value that holds itself (a namespace can) is
 *   an error when printed, not a crash.
 * Not here: what a chat template is given (pd_chat.c).
 * Threading: a parsed template is immutable; renders of it may run on several threads. */
#ifndef PD_JINJA_H
#define PD_JINJA_H

#include <stddef.h>

#include <cjson/cJSON.h>

typedef struct pd_jinja pd_jinja;

/* The template src parsed; NULL with err ("line N: ...") on a syntax error or out of memory. */
pd_jinja *pd_jinja_parse(const char *src, char *err, size_t cap);
void pd_jinja_free(pd_jinja *t);   /* NULL is fine */
/* t rendered with the members of ctx (a JSON object) as its variables: 0 and *out (malloc'd,
 * NUL-ended, *len bytes), or -1 with err (raise_exception's message, an undefined filter, a type
 * error, a render that outgrows its limits). */
int pd_jinja_render(const pd_jinja *t, const cJSON *ctx, char **out, size_t *len, char *err, size_t cap);

#endif
