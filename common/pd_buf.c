/* pd_buf.c - a growing NUL-terminated byte string (pd_buf.h). */
#include "pd_buf.h"

#include <stdlib.h>
#include <string.h>

int pd_buf_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (*len + n + 1 > c)
            c *= 2;
        char *nb = realloc(*buf, c);
        if (nb == NULL)
            return -1;
        *buf = nb;
        *cap = c;
    }
    if (n > 0)
        memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 0;
}

int pd_buf_grow(void **p, int *cap, int need, size_t sz)
{
    if (need <= *cap)
        return 0;
    int nc = *cap ? *cap * 2 : 4;
    while (nc < need)
        nc *= 2;
    void *np = realloc(*p, (size_t)nc * sz);
    if (np == NULL)
        return -1;
    *p = np;
    *cap = nc;
    return 0;
}
