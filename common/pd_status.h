/* pd_status.h - status codes and the error message carrier used everywhere.
 * Owns: pd_status, pd_err, pd_err_set, pd_status_str, PD_ASSERT.
 * Not here: mapping to gRPC codes (pd_rpc_code_from in pd_rpc.c).
 * Threading: pure functions; a pd_err belongs to the caller's thread. */
#ifndef PD_STATUS_H
#define PD_STATUS_H

#include <stdarg.h>

typedef enum {
    PD_OK = 0,
    PD_ERR_INVALID,   /* bad input from a user, a file or a peer */
    PD_ERR_NOMEM,
    PD_ERR_IO,        /* file or socket I/O failed */
    PD_ERR_CUDA,
    PD_ERR_PEER,      /* the other node failed or went away */
    PD_ERR_TIMEOUT,
    PD_ERR_BUSY,      /* no capacity now; retry later */
    PD_ERR_NOT_FOUND,
    PD_ERR_UNSUPPORTED,
    PD_ERR_CANCELLED,
    PD_ERR_INTERNAL
} pd_status;

typedef struct {
    pd_status code;
    char msg[512];
} pd_err;

/* Fill err (may be NULL) with code and a printf-style message; returns code so
 * callers can write `return pd_err_set(err, PD_ERR_INVALID, "...")`. */
pd_status pd_err_set(pd_err *err, pd_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
pd_status pd_err_vset(pd_err *err, pd_status code, const char *fmt, va_list ap);
/* Prepend "prefix: " to an existing message (used where context is only known
 * higher up, e.g. the file name around a parser error). Returns err->code. */
pd_status pd_err_prefix(pd_err *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void pd_err_clear(pd_err *err);
const char *pd_status_str(pd_status s);

void pd_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
/* For invariants this code guarantees itself, never for input. */
#define PD_ASSERT(x) ((x) ? (void)0 : pd_assert_fail(#x, __FILE__, __LINE__))

#endif
