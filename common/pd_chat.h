/* pd_chat.h - chat completions' text, both ways.
 * Owns: the prompt of an OpenAI chat request (messages, tools, chat_template_kwargs) rendered
 *   as ChatML the way Qwen's chat templates write it (tools in <tools>, calls in <tool_call>,
 *   results in <tool_response>, Qwen3's <think> handling), or, for a template of another shape,
 *   by pd_jinja with what transformers' apply_chat_template hands a template; the request's tools and tool_choice
 *   (and the grammar that forces a call); the generated text split back into content,
 *   reasoning (<think>...</think>) and tool calls, piece by piece as it streams.
 * Not here: the HTTP request and response shapes (decode_node/decode_http_parse.c,
 *   decode_http_reply.c), the grammar machinery (pd_grammar.h), tokenization.
 * Threading: a pd_chat_template is immutable once detected; a parser belongs to one choice of
 *   one request. Everything else is a pure function. */
#ifndef PD_CHAT_H
#define PD_CHAT_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "pd_grammar.h"
#include "pd_status.h"

struct pd_jinja;

/* What the checkpoint's chat template does, as far as this renderer follows it. */
typedef struct {
    int think;                     /* Qwen3: reasoning of earlier turns dropped, the last turns'
                                    * rendered in <think> */
    int think_switch;              /* it reads enable_thinking: false closes an empty <think>
                                    * block after the generation prompt */
    int open_think;                /* the generation prompt opens <think> itself (Qwen3 Thinking
                                    * 2507, QwQ): the reply starts inside it */
    char default_system[1024];     /* the system turn written when the messages bring none
                                    * (Qwen2.5: "You are Qwen, created by Alibaba Cloud. ..."); ""
                                    * = none (Qwen3) */
    /* A template that is not ChatML-shaped is rendered by pd_jinja (the Jinja2 subset) instead: */
    struct pd_jinja *jinja;        /* its parse (NULL: the ChatML renderer) */
    int hermes_calls;              /* it writes tool calls as <tool_call> blocks, the format the
                                    * output parser reads (else requests with tools are refused) */
    char bos[128], eos[128];       /* the checkpoint's bos_token / eos_token ("" = none) */
} pd_chat_template;

/* 0 and *out filled when tmpl is ChatML-shaped (<|im_start|>ROLE\n ... <|im_end|>), the shape
 * this renderer writes itself; -1 with why otherwise (pd_chat_template_load then parses it with
 * pd_jinja). The default system prompt is the text of a
 * literal '<|im_start|>system\n...<|im_end|>\n' in the template. */
int pd_chat_template_detect(const char *tmpl, pd_chat_template *out, char *why, size_t cap);

/* The template chat requests are rendered by: `given` (--chat-template: a file, or the template
 * text itself when it holds '{{' or '{%'), else the checkpoint's (model_dir/chat_template.jinja,
 * else tokenizer_config.json's chat_template, the one named "default" of a list). A ChatML-shaped
 * template is rendered by this file's ChatML renderer; any other is parsed by pd_jinja (with the
 * checkpoint's bos_token and eos_token, and whether its generation prompt opens <think>). PD_OK
 * with *usable 1 and *out filled, or *usable 0 and why (a sentence for the client: the checkpoint
 * has no template, or it does not parse). A `given` template that cannot be read or does not
 * parse is an error (PD_ERR_IO / PD_ERR_INVALID). */
/* (the template's Jinja parse is freed by pd_chat_template_free) */
pd_status pd_chat_template_load(const char *model_dir, const char *given, pd_chat_template *out, int *usable,
                                char *why, size_t cap, pd_err *err);
/* The same; jinja: every template goes through pd_jinja, ChatML-shaped ones too (llama.cpp's
 * --jinja: the checkpoint's template followed exactly rather than the ChatML renderer's Qwen
 * rules). */
pd_status pd_chat_template_open(const char *model_dir, const char *given, int jinja, pd_chat_template *out,
                                int *usable, char *why, size_t cap, pd_err *err);
void pd_chat_template_free(pd_chat_template *t);   /* NULL or zeroed: nothing */

/* The request's tools. */
enum { PD_TOOLS_NONE, PD_TOOLS_AUTO, PD_TOOLS_REQUIRED, PD_TOOLS_NAMED };

typedef struct {
    const cJSON *list;             /* the request's "tools" (borrowed; rendered into the prompt
                                    * unless choice is PD_TOOLS_NONE); NULL = none */
    int n;
    char **names;                  /* [n] */
    char **schemas;                /* [n] each tool's parameters as JSON text, NULL = none given */
    int choice;                    /* PD_TOOLS_*; "auto" when tools came without tool_choice */
    int named;                     /* PD_TOOLS_NAMED: the index of the tool */
    int parallel;                  /* parallel_tool_calls (default true) */
} pd_chat_tools;

/* Reads "tools", "tool_choice" and "parallel_tool_calls" of a chat request (root). -1 with
 * *param (the field at fault) and msg set when they are malformed. pd_chat_tools_free(out)
 * either way. */
int pd_chat_tools_parse(const cJSON *root, pd_chat_tools *out, const char **param, char *msg, size_t cap);
void pd_chat_tools_free(pd_chat_tools *t);
/* pd_chat_parser_create's tools for a reply to a request with t: 0 when its tool_choice is
 * "none" (or it has no tools), 2 when parallel_tool_calls is false, else 1. */
int pd_chat_tools_mode(const pd_chat_tools *t);
/* The grammar that forces tool calls: PD_TOOLS_REQUIRED (any of the tools, one or, with
 * parallel, more) or PD_TOOLS_NAMED (that one, once), from cache when it holds the same tools
 * (cache may be NULL). *out NULL for the other choices. */
pd_status pd_chat_tools_grammar(const pd_chat_tools *t, pd_gcache *cache, pd_grammar **out, pd_err *err);

/* How a chat request asks for its prompt (vLLM's request fields). */
typedef struct {
    int enable_thinking;           /* chat_template_kwargs.enable_thinking: -1 unset, 0 or 1 */
    int add_generation_prompt;     /* the assistant's generation prompt after the messages */
    const cJSON *kwargs;           /* chat_template_kwargs (borrowed; NULL: none): a Jinja
                                    * template sees each member as a variable (the ChatML renderer
                                    * reads enable_thinking only) */
    int continue_final;            /* continue_final_message: the prompt ends inside the last
                                    * (assistant) message, cut after its text as Hugging Face's
                                    * apply_chat_template cuts it */
} pd_chat_opts;

#define PD_CHAT_OPTS_DEFAULT { .enable_thinking = -1, .add_generation_prompt = 1, .continue_final = 0 }

/* The prompt: messages (system/developer, user, assistant with content and/or tool_calls and
 * reasoning_content, tool) and tools (t may be NULL) rendered as ChatML, then (o) the assistant's
 * generation prompt or the last message left open; with a Jinja template (tp->jinja), the
 * template's render of the messages as vLLM prepares them (developer as system, text parts
 * joined, arguments as objects) and of tools, add_generation_prompt, bos_token, eos_token and
 * enable_thinking, cut after the last message's text for continue_final_message; tools with a
 * template that writes no <tool_call> blocks are refused (the output parser reads those). A call's arguments given as JSON text are
 * parsed and written again as json.dumps writes them (as vLLM and SGLang hand them to the
 * template). *out is malloc'd. -1 with msg naming the message at fault. */
int pd_chat_render(const pd_chat_template *tp, const cJSON *messages, const pd_chat_tools *t,
                   const pd_chat_opts *o, char **out, size_t *out_len, char *msg, size_t cap);

/* pd_chat_render of n text turns (roles[i], contents[i]) without tools: what pdspark-generate
 * --chat gives. */
int pd_chat_render_text(const pd_chat_template *tp, const char *const *roles, const char *const *contents, int n,
                        const pd_chat_opts *o, char **out, size_t *out_len, char *msg, size_t cap);

/* Python's json.dumps(v, ensure_ascii=False) (what Jinja's tojson writes in HF templates):
 * ", " and ": " separators, members in their order. Appends to *buf (malloc'd, NUL-ended). */
int pd_chat_pyjson(const cJSON *v, char **buf, size_t *len, size_t *cap);

/* The generated text split back. */
typedef enum { PD_CHAT_CONTENT, PD_CHAT_REASONING, PD_CHAT_TOOL_CALL } pd_chat_kind;

typedef struct {
    pd_chat_kind kind;
    const char *text;              /* CONTENT / REASONING: the text; TOOL_CALL: the function */
    size_t len;
    const char *args;              /* TOOL_CALL: the next bytes of the arguments (a call's pieces
                                    * joined are its arguments, a JSON object as written) */
    size_t args_len;
    int index;                     /* TOOL_CALL: 0, 1, ... within the output */
    int first;                     /* TOOL_CALL: the call's first piece */
    size_t end;                    /* the output's bytes this piece accounts for: [0, end) */
} pd_chat_piece;

typedef void (*pd_chat_emit)(void *ud, const pd_chat_piece *p);

typedef struct pd_chat_parser pd_chat_parser;

/* tools: 1 <tool_call> blocks become calls; 2 the same, one call at most (parallel_tool_calls
 * false: the output after the first call is dropped). A block that opens {"name": "F", "arguments": { is a
 * call from there on: its arguments stream as they are written, checked byte by byte as JSON;
 * at a bad byte (or at the end of the output) the call ends with what came, and the rest of the
 * block is content. A block of another shape is a call when it parses whole as {"name": STRING,
 * "arguments": OBJECT or none} (arguments written again as json.dumps does), else content.
 * Whole or cut into any feeds, the text gives the same pieces joined.
 * reasoning: 0 none, 1 the output may open with <think>, 2 the output starts inside <think> (the
 * prompt opened it). NULL on NOMEM. */
pd_chat_parser *pd_chat_parser_create(int tools, int reasoning);
/* pd_chat_parser_create's reasoning for a reply to a prompt rendered by tp with o, on a node that
 * splits reasoning off (--reasoning-parser qwen3): 2 when the generation prompt opened <think>,
 * 1 unless the request turned thinking off, else 0. */
int pd_chat_reasoning_mode(const pd_chat_template *tp, const pd_chat_opts *o);
void pd_chat_parser_destroy(pd_chat_parser *p);   /* NULL is fine */
/* text[0..len) is all the output so far (it only grows); final: it is complete. Calls emit for
 * every piece that is certain (text that may begin a tag is held back until it is not).
 * -1 on NOMEM. */
int pd_chat_parser_feed(pd_chat_parser *p, const char *text, size_t len, int final, pd_chat_emit emit,
                        void *ud);
int pd_chat_parser_calls(const pd_chat_parser *p);   /* tool calls emitted so far */
/* Of them, those whose arguments are whole (all of them after a final feed): a call is done when
 * its arguments' JSON object closed, or the output went on with something else. */
int pd_chat_parser_calls_done(const pd_chat_parser *p);

#define PD_CHAT_CALL_ID_SIZE 40
/* A tool call's id, "call_" and 24 hex digits, from the request's id, the choice and the call's
 * index (the same three give the same id). */
void pd_chat_call_id(const char *request_id, int choice, int call, char out[PD_CHAT_CALL_ID_SIZE]);

#endif
