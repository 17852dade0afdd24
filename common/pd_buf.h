/* pd_buf.h - a growing NUL-terminated byte string, the one the text paths share (chat rendering,
 * the HTTP and gRPC replies, pdspark-client's accumulated output), and the growing array the
 * grammar compiler, the metrics registry and the gRPC reply splitter share.
 * Owns: nothing; the caller owns *buf (malloc'd, free it).
 * Threading: pure function on the caller's data. */
#ifndef PD_BUF_H
#define PD_BUF_H

#include <stddef.h>

/* Appends s[0..n) to *buf (*len bytes used of *cap allocated; all three 0/NULL to start), which
 * stays NUL-terminated; the capacity doubles from 256. s may be NULL when n is 0. -1 on NOMEM
 * (*buf unchanged). */
int pd_buf_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n);

/* *p (capacity *cap elements of sz bytes) made to hold need elements, the capacity doubled from
 * 4; -1 when realloc fails (*p and *cap unchanged) */
int pd_buf_grow(void **p, int *cap, int need, size_t sz);

#endif
