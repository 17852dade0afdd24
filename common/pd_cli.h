/* pd_cli.h - small helpers shared by the command-line tools of both nodes (decode_node,
 * prefill_node, pdspark-client, pdspark-generate, ...): flag parsing, token-id files, the
 * monotonic clock, address splitting, the nodes' signal setup.
 * Owns: nothing stateful.
 * Not here: anything that talks to the engine or the network.
 * Threading: pure functions (pd_cli_read_ids does file I/O on the caller's thread;
 * pd_cli_block_stop_signals sets the calling thread's mask and SIGPIPE's disposition). */
#ifndef PD_CLI_H
#define PD_CLI_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "pd_sample.h"
#include "pd_status.h"

/* The build: pdspark's version ("0.1.0"), the source commit it was built from ("unknown"
 * outside a git checkout, "-dirty" with uncommitted changes), and the line every tool prints for
 * --version ("PROG (pdspark V, commit C; cuda on|off, services on, protocol N)", or "services off"
 * in a build without them). */
const char *pd_cli_version(void);
const char *pd_cli_commit(void);
void pd_cli_print_version(FILE *f, const char *prog);
/* 1 when argv has --version (before a "--"): the version line is then printed to stdout and the
 * tool exits 0 whatever else it was given, as GNU tools do. */
int pd_cli_version_flag(int argc, char **argv, const char *prog);
/* Milliseconds of CLOCK_MONOTONIC. */
double pd_cli_now_ms(void);
/* A node's signals: SIGINT, SIGTERM and SIGHUP blocked in the calling thread and every thread
 * it starts afterwards (the main thread takes them: pd_cli_wait_stop, or sigwait on *set, which
 * holds the two stop signals), SIGPIPE ignored. */
void pd_cli_block_stop_signals(sigset_t *set);
/* A node's main thread until it is told to stop: returns the stop signal of *stop (SIGINT or
 * SIGTERM) when it comes; meanwhile tick(ud, 1) runs at each SIGHUP and tick(ud, 0) every
 * every_ms (0: never; tick NULL: nothing runs), on this thread. */
int pd_cli_wait_stop(const sigset_t *stop, int64_t every_ms, void (*tick)(void *ud, int hup), void *ud);
/* A node's descriptor limit: the soft limit raised to the hard one (containers often start a
 * process at a soft 1024, which ~1000 idle HTTP clients use up). Returns the limit now in force
 * (-1: unlimited or unknown). */
long pd_cli_raise_fd_limit(void);
/* Parse an integer flag value in lo..hi; prints "prog: flag: ..." to stderr and returns -1 on
 * a bad value. */
int pd_cli_parse_i64(const char *prog, const char *flag, const char *s, int64_t lo, int64_t hi,
                     int64_t *out);
int pd_cli_parse_int(const char *prog, const char *flag, const char *s, int lo, int hi, int *out);
int pd_cli_parse_float(const char *prog, const char *flag, const char *s, float *out);
/* A fraction strictly between 0 and 1 (--kv-memory-fraction); -1 with a message otherwise. */
int pd_cli_parse_fraction(const char *prog, const char *flag, const char *s, double *out);
/* A size in GiB (a number >= 0, at most 65536; fractions allowed: --swap-space) as bytes; -1
 * with a message otherwise. */
int pd_cli_parse_gib(const char *prog, const char *flag, const char *s, int64_t *bytes);
/* "ID:BIAS[,ID:BIAS...]" appended to *b / *n (malloc'd, the caller frees *b); -1 with a message
 * naming flag for a malformed entry or more than PD_MAX_LOGIT_BIAS of them (ranges are checked
 * where the request is). */
int pd_cli_parse_logit_bias(const char *prog, const char *flag, const char *s, pd_logit_bias **b, int *n);
/* "ID[,ID...]" (each 0..UINT32_MAX) appended to *ids / *n (malloc'd, the caller frees *ids); -1
 * with a message naming flag for a malformed one (vocabularies are checked where the request
 * is). */
int pd_cli_parse_ids(const char *prog, const char *flag, const char *s, uint32_t **ids, int *n);
/* Structured output flags of pdspark-generate / pdspark-client: --json-object, --json-schema FILE
 * ("-" = stdin; the schema's text), --choice TEXT (repeated), --regex RE, --grammar FILE (GBNF). */
typedef struct {
    int json_object;
    char *schema;             /* malloc'd */
    char **choices;           /* malloc'd, n_choices strings */
    int n_choices;
    const char *regex;        /* borrowed from argv */
    char *grammar;            /* malloc'd: the GBNF file's text */
} pd_cli_guide;
/* One of those flags (flag as written, arg its argument or NULL); -1 with a message on an
 * unreadable schema file or a second kind of guide. */
int pd_cli_parse_guide(const char *prog, const char *flag, const char *arg, pd_cli_guide *g);
void pd_cli_guide_free(pd_cli_guide *g);
/* --dtype bf16|f32 (the weights and KV cache of a cuda backend; the cpu backend always is fp32):
 * *f32 = 1 for f32. Prints "prog: --dtype: ..." and returns -1 on anything else. */
int pd_cli_parse_dtype(const char *prog, const char *s, int *f32);
/* --log-format text|json: sets pd_log's format. Prints "prog: --log-format: ..." and returns -1
 * on anything else. */
int pd_cli_parse_log_format(const char *prog, const char *s);
/* The whole file at path, NUL-terminated, malloc'd into *out. Errors: PD_ERR_IO (named with
 * strerror), PD_ERR_NOMEM. */
pd_status pd_cli_read_text(const char *path, char **out, pd_err *err);
/* Whitespace-separated token ids from path ("-" = stdin) into a malloc'd array. Returns -1 with
 * a message on stderr on a bad file or value. */
int pd_cli_read_ids(const char *prog, const char *path, int32_t **ids, int *n);
/* getopt's answer to an unknown flag or one missing its value: prints the one line "prog:
 * unknown or incomplete flag 'arg' (prog --help lists the flags)" (not the whole usage, which
 * would scroll the error away); returns 2, the exit status of a bad command line. */
int pd_cli_bad_flag(const char *prog, const char *arg);
/* Split "HOST:PORT" or "[V6]:PORT" into host (without brackets) and port. Returns -1 when
 * there is no port or a part does not fit. */
int pd_cli_split_hostport(const char *addr, char *host, size_t host_len, char *port,
                          size_t port_len);

#endif
