/* pd_status.c - status strings and pd_err formatting.
 * Owns: the message buffer discipline (truncate, never overflow).
 * Threading: any thread; no shared state. */
#include "pd_status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

pd_status pd_err_vset(pd_err *err, pd_status code, const char *fmt, va_list ap)
{
    if (err != NULL) {
        err->code = code;
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    }
    return code;
}

pd_status pd_err_set(pd_err *err, pd_status code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pd_err_vset(err, code, fmt, ap);
    va_end(ap);
    return code;
}

pd_status pd_err_prefix(pd_err *err, const char *fmt, ...)
{
    if (err == NULL)
        return PD_ERR_INTERNAL;
    char prefix[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof(prefix), fmt, ap);
    va_end(ap);
    char old[sizeof(err->msg)];
    memcpy(old, err->msg, sizeof(old));
    size_t np = strlen(prefix), no = strnlen(old, sizeof(old) - 1), cap = sizeof(err->msg) - 1;
    size_t o = 0;
    memcpy(err->msg, prefix, np < cap ? np : cap);
    o = np < cap ? np : cap;
    for (const char *sep = ": "; *sep != '\0' && o < cap; sep++)
        err->msg[o++] = *sep;
    size_t take = no < cap - o ? no : cap - o;
    memcpy(err->msg + o, old, take);
    err->msg[o + take] = '\0';
    return err->code;
}

void pd_err_clear(pd_err *err)
{
    if (err != NULL) {
        err->code = PD_OK;
        err->msg[0] = '\0';
    }
}

const char *pd_status_str(pd_status s)
{
    switch (s) {
    case PD_OK: return "ok";
    case PD_ERR_INVALID: return "invalid argument";
    case PD_ERR_NOMEM: return "out of memory";
    case PD_ERR_IO: return "i/o error";
    case PD_ERR_CUDA: return "cuda error";
    case PD_ERR_PEER: return "peer error";
    case PD_ERR_TIMEOUT: return "timeout";
    case PD_ERR_BUSY: return "busy";
    case PD_ERR_NOT_FOUND: return "not found";
    case PD_ERR_UNSUPPORTED: return "unsupported";
    case PD_ERR_CANCELLED: return "cancelled";
    case PD_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

void pd_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}
