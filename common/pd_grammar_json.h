/* pd_grammar_json.h - grammars from JSON schemas, for any JSON object, and for tool calls
 *   (pd_grammar_json.c); pd_grammar.h includes it.
 * Owns: pd_grammar_json and pd_grammar_tool_calls.
 * Not here: references to a grammar and the limits (pd_grammar.h), the regex of a schema's
 *   pattern (pd_grammar_regex.h).
 * Threading: any thread; each call makes a new grammar (one reference, the caller's). */
#ifndef PD_GRAMMAR_JSON_H
#define PD_GRAMMAR_JSON_H

#include <stddef.h>

#include "pd_status.h"

typedef struct pd_grammar pd_grammar;

/* The schema text (JSON; the schema object of OpenAI's json_schema response format or vLLM's
 * guided_json). Supported: type (one or a list), properties (in their order), required,
 * additionalProperties, items, minItems, maxItems, enum, const, anyOf, oneOf, allOf of one
 * schema, $ref to #/$defs/... or #/definitions/... (recursion allowed), minLength, maxLength,
 * pattern (pd_grammar_regex's subset, searched in the string's text as ECMA-262 does: unanchored
 * ends take any text; not with min/maxLength), minimum / maximum / exclusiveMinimum /
 * exclusiveMaximum on integers, and on numbers when the bounds are whole numbers (the number
 * then has no exponent);
 * title, description, default, examples, $schema, $id, $comment and format are annotations
 * (format is not enforced). Any other keyword: PD_ERR_INVALID naming it. NULL = any JSON
 * object (json_object). */
pd_status pd_grammar_json(const char *schema, size_t len, pd_grammar **out, pd_err *err);
/* Tool calls as Qwen's (Hermes) chat templates teach them:
 *   <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>
 * NAME one of names[0..n), ARGS an object that matches schemas[i] (a JSON schema's text as for
 * pd_grammar_json; NULL = any object). parallel: one or more calls, each after the first
 * preceded by "\n"; else exactly one. A bad schema: PD_ERR_INVALID naming the tool. */
pd_status pd_grammar_tool_calls(const char *const *names, const char *const *schemas, int n, int parallel,
                                pd_grammar **out, pd_err *err);

#endif
