/* pd_safetensors.c - read-only safetensors checkpoints: one file, or shards behind an index.
 * Owns: the read-only mmap of every shard, header parsing (cJSON) and validation against the
 *   file size, the sorted name -> tensor table (bsearch).
 * Not here: what tensors mean and their expected shapes (pd_model.c), dtype conversion (kern_*).
 * Threading: pd_st_open/pd_st_close on one thread; an open set is immutable, any thread reads. */
#include "pd_safetensors.h"
#include "pd_json.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The reference implementation refuses headers over 100 MB; a larger one is corruption. */
#define ST_MAX_HEADER_BYTES ((uint64_t)100 * 1024 * 1024)
/* An index.json is a small name -> file map; anything this large is not one. */
#define ST_MAX_INDEX_BYTES ((size_t)256 * 1024 * 1024)
/* JSON integers are doubles in cJSON; beyond 2^53 they are no longer exact. */
#define ST_MAX_JSON_INT 9007199254740992.0

typedef struct {
    char *path;
    void *map;       /* NULL when the file is empty of data (never: size >= 8 is required) */
    size_t size;
} st_file;

struct pd_st_set {
    char *path;              /* what pd_st_open was given, for messages */
    st_file *files;
    size_t n_files;
    size_t cap_files;
    pd_st_tensor *tensors;   /* sorted by name after open */
    size_t n_tensors;
    size_t cap_tensors;
};

/* ---- small helpers ----------------------------------------------------------------------- */

static char *path_join(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (p == NULL)
        return NULL;
    memcpy(p, dir, a);
    size_t o = a;
    if (a > 0 && dir[a - 1] != '/')
        p[o++] = '/';
    memcpy(p + o, name, b + 1);
    return p;
}

static int is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static int exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

static int dtype_parse(const char *s, kern_dtype *out)
{
    if (strcmp(s, "BF16") == 0)
        *out = KERN_DTYPE_BF16;
    else if (strcmp(s, "F16") == 0)
        *out = KERN_DTYPE_F16;
    else if (strcmp(s, "F32") == 0)
        *out = KERN_DTYPE_F32;
    else if (strcmp(s, "I32") == 0)
        *out = KERN_DTYPE_I32;
    else
        return 0;
    return 1;
}

/* A non-negative integer that cJSON holds exactly. */
static int json_uint(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j))
        return 0;
    double v = j->valuedouble;
    if (!(v >= 0.0) || v > ST_MAX_JSON_INT || v != (double)(uint64_t)v)
        return 0;
    *out = (uint64_t)v;
    return 1;
}

static void format_shape(char *buf, size_t cap, int n_dims, const int64_t *shape)
{
    size_t o = 0;
    int w = snprintf(buf, cap, "[");
    o = w > 0 ? (size_t)w : 0;
    for (int i = 0; i < n_dims && o < cap; i++) {
        w = snprintf(buf + o, cap - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
        if (w < 0)
            return;
        o += (size_t)w;
    }
    if (o < cap)
        snprintf(buf + o, cap - o, "]");
}

static pd_status tensors_reserve(pd_st_set *set, size_t extra, pd_err *err)
{
    if (set->n_tensors + extra <= set->cap_tensors)
        return PD_OK;
    size_t cap = set->cap_tensors ? set->cap_tensors : 64;
    while (cap < set->n_tensors + extra)
        cap *= 2;
    pd_st_tensor *t = realloc(set->tensors, cap * sizeof(*t));
    if (t == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "safetensors: table of %zu tensors", cap);
    set->tensors = t;
    set->cap_tensors = cap;
    return PD_OK;
}

static int tensor_cmp(const void *a, const void *b)
{
    return strcmp(((const pd_st_tensor *)a)->name, ((const pd_st_tensor *)b)->name);
}

static int tensor_key_cmp(const void *key, const void *elem)
{
    return strcmp((const char *)key, ((const pd_st_tensor *)elem)->name);
}

static int range_cmp(const void *a, const void *b)
{
    const pd_st_tensor *x = *(const pd_st_tensor *const *)a;
    const pd_st_tensor *y = *(const pd_st_tensor *const *)b;
    const char *px = x->data, *py = y->data;
    if (px != py)
        return px < py ? -1 : 1;
    return x->n_bytes < y->n_bytes ? -1 : x->n_bytes > y->n_bytes;
}

/* ---- one file ---------------------------------------------------------------------------- */

/* Parses one header entry into t; the data area is [data, data + data_len). */
static pd_status parse_entry(const char *file, const cJSON *e, const uint8_t *data,
                             uint64_t data_len, pd_st_tensor *t, pd_err *err)
{
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor %s: header entry is not an object",
                          file, name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(jd) || jd->valuestring == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor %s: missing or non-string dtype",
                          file, name);
    if (!dtype_parse(jd->valuestring, &t->dtype))
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "%s: tensor %s: unsupported dtype %s (supported: BF16, F16, F32, I32)",
                          file, name, jd->valuestring);
    if (!cJSON_IsArray(js))
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor %s: missing or non-array shape",
                          file, name);
    int n_dims = cJSON_GetArraySize(js);
    if (n_dims > PD_ST_MAX_DIMS)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: tensor %s: %d dims, at most %d supported",
                          file, name, n_dims, PD_ST_MAX_DIMS);
    t->n_dims = n_dims;
    int i = 0;
    int has_zero = 0;
    for (const cJSON *d = js->child; d != NULL; d = d->next, i++) {
        uint64_t v;
        if (!json_uint(d, &v))
            return pd_err_set(err, PD_ERR_INVALID,
                              "%s: tensor %s: shape dim %d is not a non-negative integer",
                              file, name, i);
        t->shape[i] = (int64_t)v;
        has_zero |= v == 0;
    }
    for (; i < PD_ST_MAX_DIMS; i++)
        t->shape[i] = 0;
    size_t esz = kern_dtype_size(t->dtype);
    uint64_t elems = 1;
    if (has_zero) {
        elems = 0;
    } else {
        for (int k = 0; k < n_dims; k++) {
            uint64_t v = (uint64_t)t->shape[k];
            if (elems > (uint64_t)INT64_MAX / esz / v)
                return pd_err_set(err, PD_ERR_INVALID, "%s: tensor %s: shape too large", file,
                                  name);
            elems *= v;
        }
    }
    uint64_t begin, end;
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !json_uint(jo->child, &begin) ||
        !json_uint(jo->child->next, &end))
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: tensor %s: data_offsets must be two non-negative integers",
                          file, name);
    if (begin > end)
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: tensor %s: data_offsets [%llu, %llu] end before begin", file, name,
                          (unsigned long long)begin, (unsigned long long)end);
    if (end > data_len)
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: tensor %s: data_offsets [%llu, %llu] past the end of the data area "
                          "(%llu bytes; file truncated?)",
                          file, name, (unsigned long long)begin, (unsigned long long)end,
                          (unsigned long long)data_len);
    if (end - begin != elems * esz) {
        char sh[160];
        format_shape(sh, sizeof(sh), n_dims, t->shape);
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: tensor %s: %llu bytes in data_offsets, but shape %s of %s needs %llu",
                          file, name, (unsigned long long)(end - begin), sh,
                          jd->valuestring, (unsigned long long)(elems * esz));
    }
    t->n_elems = (int64_t)elems;
    t->n_bytes = (size_t)(end - begin);
    t->data = data + begin;
    t->file = file;
    t->name = name;   /* temporary: replaced by an owned copy by the caller */
    return PD_OK;
}

/* mmaps path, validates its header and appends its tensors to set. */
static pd_status open_file(pd_st_set *set, const char *path, pd_err *err)
{
    pd_status st;
    if (set->n_files == set->cap_files) {
        size_t cap = set->cap_files ? set->cap_files * 2 : 4;
        st_file *f = realloc(set->files, cap * sizeof(*f));
        if (f == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "safetensors: %zu shard slots", cap);
        set->files = f;
        set->cap_files = cap;
    }
    st_file *f = &set->files[set->n_files];
    memset(f, 0, sizeof(*f));
    f->path = strdup(path);
    if (f->path == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "safetensors: path %s", path);
    set->n_files++;   /* from here pd_st_close releases it, whatever happens below */

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return pd_err_set(err, PD_ERR_IO, "%s: open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        st = pd_err_set(err, PD_ERR_IO, "%s: fstat: %s", path, strerror(errno));
        close(fd);
        return st;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return pd_err_set(err, PD_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: truncated: %lld bytes, a safetensors file starts with an 8-byte "
                          "header length", path, (long long)sb.st_size);
    }
    f->size = (size_t)sb.st_size;
    void *map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int mmap_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return pd_err_set(err, PD_ERR_IO, "%s: mmap %zu bytes: %s", path, f->size,
                          strerror(mmap_errno));
    f->map = map;

    const uint8_t *p = map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | p[i];
    if (hlen < 2 || hlen > ST_MAX_HEADER_BYTES || hlen > f->size - 8)
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: header length %llu does not fit the file (%zu bytes%s)", path,
                          (unsigned long long)hlen, f->size,
                          hlen > ST_MAX_HEADER_BYTES ? ", limit 100 MB" : "");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts((const char *)p + 8, (size_t)hlen, &end, 0);
    if (root == NULL) {
        size_t off = end != NULL ? (size_t)(end - ((const char *)p + 8)) : 0;
        return pd_err_set(err, PD_ERR_INVALID, "%s: header is not valid JSON (near byte %zu)",
                          path, off);
    }
    /* what follows the JSON inside the header must be padding spaces */
    for (const char *q = end; q < (const char *)p + 8 + hlen; q++) {
        if (*q != ' ' && *q != '\0' && *q != '\n' && *q != '\t' && *q != '\r') {
            cJSON_Delete(root);
            return pd_err_set(err, PD_ERR_INVALID, "%s: trailing bytes after the header JSON",
                              path);
        }
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return pd_err_set(err, PD_ERR_INVALID, "%s: header is not a JSON object", path);
    }
    const uint8_t *data = p + 8 + hlen;
    uint64_t data_len = f->size - 8 - hlen;
    size_t n = 0;
    for (const cJSON *e = root->child; e != NULL; e = e->next)
        n++;
    st = tensors_reserve(set, n, err);
    if (st != PD_OK)
        goto out_root;
    size_t base = set->n_tensors;
    for (const cJSON *e = root->child; e != NULL; e = e->next) {
        if (e->string != NULL && strcmp(e->string, "__metadata__") == 0)
            continue;
        pd_st_tensor *t = &set->tensors[set->n_tensors];
        st = parse_entry(f->path, e, data, data_len, t, err);
        if (st != PD_OK)
            goto out_root;
        t->name = strdup(e->string);
        if (t->name == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "safetensors: tensor name %s", e->string);
            goto out_root;
        }
        set->n_tensors++;
    }
    /* ranges must not overlap: two tensors sharing bytes is a corrupt or hostile file */
    size_t cnt = set->n_tensors - base;
    if (cnt > 1) {
        const pd_st_tensor **by = malloc(cnt * sizeof(*by));
        if (by == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "safetensors: %zu tensor ranges", cnt);
            goto out_root;
        }
        for (size_t i = 0; i < cnt; i++)
            by[i] = &set->tensors[base + i];
        qsort(by, cnt, sizeof(*by), range_cmp);
        for (size_t i = 1; i < cnt; i++) {
            const char *prev_end = (const char *)by[i - 1]->data + by[i - 1]->n_bytes;
            if ((const char *)by[i]->data < prev_end) {
                st = pd_err_set(err, PD_ERR_INVALID, "%s: tensors %s and %s overlap", path,
                                by[i - 1]->name, by[i]->name);
                free(by);
                goto out_root;
            }
        }
        free(by);
    }
    st = PD_OK;
out_root:
    cJSON_Delete(root);
    return st;
}

/* ---- the index of a sharded checkpoint --------------------------------------------------- */

static int shard_name_ok(const char *s)
{
    if (s[0] == '\0' || s[0] == '/')
        return 0;
    /* shards live in the checkpoint dir; no ".." components */
    const char *q = s;
    while ((q = strstr(q, "..")) != NULL) {
        int at_start = q == s || q[-1] == '/';
        int at_end = q[2] == '\0' || q[2] == '/';
        if (at_start && at_end)
            return 0;
        q += 2;
    }
    return 1;
}

static pd_status read_small_file(const char *path, size_t limit, char **out, pd_err *err)
{
    FILE *fp = fopen(path, "rb");
    if (fp == NULL)
        return pd_err_set(err, PD_ERR_IO, "%s: open: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    if (buf == NULL) {
        fclose(fp);
        return pd_err_set(err, PD_ERR_NOMEM, "%s: read buffer", path);
    }
    for (;;) {
        if (len + 1 >= cap) {
            if (cap >= limit) {
                free(buf);
                fclose(fp);
                return pd_err_set(err, PD_ERR_INVALID, "%s: larger than %zu bytes", path, limit);
            }
            char *nb = realloc(buf, cap * 2);
            if (nb == NULL) {
                free(buf);
                fclose(fp);
                return pd_err_set(err, PD_ERR_NOMEM, "%s: read buffer of %zu bytes", path,
                                  cap * 2);
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + len, 1, cap - 1 - len, fp);
        len += r;
        if (r == 0)
            break;
    }
    int bad = ferror(fp);
    fclose(fp);
    if (bad) {
        free(buf);
        return pd_err_set(err, PD_ERR_IO, "%s: read error", path);
    }
    buf[len] = '\0';
    *out = buf;
    return PD_OK;
}

static pd_status open_index(pd_st_set *set, const char *dir, const char *index_path, pd_err *err)
{
    char *text = NULL;
    pd_status st = read_small_file(index_path, ST_MAX_INDEX_BYTES, &text, err);
    if (st != PD_OK)
        return st;
    size_t bad = 0;
    cJSON *root = pd_json_parse_str(text, &bad);
    if (root == NULL) {
        st = pd_err_set(err, PD_ERR_INVALID, "%s: not valid JSON (near byte %zu)", index_path, bad);
        free(text);
        return st;
    }
    free(text);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm) || wm->child == NULL) {
        st = pd_err_set(err, PD_ERR_INVALID, "%s: missing or empty weight_map object", index_path);
        goto out_root;
    }
    /* open each distinct shard once, in order of first mention */
    for (const cJSON *e = wm->child; e != NULL; e = e->next) {
        if (!cJSON_IsString(e) || e->valuestring == NULL || !shard_name_ok(e->valuestring)) {
            st = pd_err_set(err, PD_ERR_INVALID, "%s: weight_map entry for tensor %s is not a "
                            "shard file name in the checkpoint dir", index_path, e->string);
            goto out_root;
        }
        char *shard = path_join(dir, e->valuestring);
        if (shard == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "safetensors: shard path");
            goto out_root;
        }
        /* shards are few (tens); tensors may be thousands, so compare against the opened files */
        int seen = 0;
        for (size_t i = 0; i < set->n_files && !seen; i++)
            seen = strcmp(set->files[i].path, shard) == 0;
        if (seen) {
            free(shard);
            continue;
        }
        if (!exists(shard)) {
            st = pd_err_set(err, PD_ERR_INVALID,
                            "%s: names shard %s (for tensor %s), but %s does not exist",
                            index_path, e->valuestring, e->string, shard);
            free(shard);
            goto out_root;
        }
        st = open_file(set, shard, err);
        free(shard);
        if (st != PD_OK)
            goto out_root;
    }
    qsort(set->tensors, set->n_tensors, sizeof(*set->tensors), tensor_cmp);
    for (const cJSON *e = wm->child; e != NULL; e = e->next) {
        const pd_st_tensor *t = pd_st_find(set, e->string);
        char *shard = path_join(dir, e->valuestring);
        if (shard == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "safetensors: shard path");
            goto out_root;
        }
        int held = t != NULL && strcmp(t->file, shard) == 0;
        free(shard);
        if (!held) {
            st = pd_err_set(err, PD_ERR_INVALID,
                            "%s: lists tensor %s in shard %s, but that shard does not hold it",
                            index_path, e->string, e->valuestring);
            goto out_root;
        }
    }
    st = PD_OK;
out_root:
    cJSON_Delete(root);
    return st;
}

/* ---- public ------------------------------------------------------------------------------ */

pd_status pd_st_open(const char *path, pd_st_set **out, pd_err *err)
{
    if (path == NULL || out == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "safetensors: NULL path or out");
    pd_st_set *set = calloc(1, sizeof(*set));
    if (set == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "safetensors: set");
    pd_status st;
    set->path = strdup(path);
    if (set->path == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "safetensors: path %s", path);
        goto err_close;
    }
    if (is_dir(path)) {
        /* a single-file checkpoint wins over an index, as in transformers */
        char *single = path_join(path, "model.safetensors");
        char *index = path_join(path, "model.safetensors.index.json");
        if (single == NULL || index == NULL) {
            free(single);
            free(index);
            st = pd_err_set(err, PD_ERR_NOMEM, "safetensors: path");
            goto err_close;
        }
        if (exists(single))
            st = open_file(set, single, err);
        else if (exists(index))
            st = open_index(set, path, index, err);
        else
            st = pd_err_set(err, PD_ERR_IO,
                            "%s: no model.safetensors or model.safetensors.index.json", path);
        free(single);
        free(index);
    } else if (exists(path)) {
        st = open_file(set, path, err);
    } else {
        st = pd_err_set(err, PD_ERR_IO, "%s: %s", path, strerror(ENOENT));
    }
    if (st != PD_OK)
        goto err_close;
    qsort(set->tensors, set->n_tensors, sizeof(*set->tensors), tensor_cmp);
    for (size_t i = 1; i < set->n_tensors; i++) {
        if (strcmp(set->tensors[i - 1].name, set->tensors[i].name) == 0) {
            const char *fa = set->tensors[i - 1].file, *fb = set->tensors[i].file;
            if (strcmp(fa, fb) == 0)
                st = pd_err_set(err, PD_ERR_INVALID, "%s: tensor %s appears twice", fa,
                                set->tensors[i].name);
            else
                st = pd_err_set(err, PD_ERR_INVALID, "%s: tensor %s appears in both %s and %s",
                                path, set->tensors[i].name, fa, fb);
            goto err_close;
        }
    }
    *out = set;
    return PD_OK;
err_close:
    pd_st_close(set);
    return st;
}

void pd_st_close(pd_st_set *set)
{
    if (set == NULL)
        return;
    for (size_t i = 0; i < set->n_tensors; i++)
        free((char *)set->tensors[i].name);
    free(set->tensors);
    for (size_t i = 0; i < set->n_files; i++) {
        if (set->files[i].map != NULL)
            munmap(set->files[i].map, set->files[i].size);
        free(set->files[i].path);
    }
    free(set->files);
    free(set->path);
    free(set);
}

const pd_st_tensor *pd_st_find(const pd_st_set *set, const char *name)
{
    if (set == NULL || name == NULL || set->n_tensors == 0)
        return NULL;
    return bsearch(name, set->tensors, set->n_tensors, sizeof(*set->tensors), tensor_key_cmp);
}

size_t pd_st_count(const pd_st_set *set)
{
    return set != NULL ? set->n_tensors : 0;
}

const pd_st_tensor *pd_st_at(const pd_st_set *set, size_t i)
{
    return set != NULL && i < set->n_tensors ? &set->tensors[i] : NULL;
}

pd_status pd_st_get(const pd_st_set *set, const char *name, int n_dims, const int64_t *shape,
                    const pd_st_tensor **out, pd_err *err)
{
    const pd_st_tensor *t = pd_st_find(set, name);
    if (t == NULL)
        return pd_err_set(err, PD_ERR_NOT_FOUND, "%s: tensor %s not found",
                          set != NULL ? set->path : "(null)", name);
    int same = t->n_dims == n_dims;
    for (int i = 0; same && i < n_dims; i++)
        same = t->shape[i] == shape[i];
    if (!same) {
        char want[160], got[160];
        format_shape(want, sizeof(want), n_dims, shape);
        format_shape(got, sizeof(got), t->n_dims, t->shape);
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor %s: shape %s, expected %s", t->file,
                          name, got, want);
    }
    if (out != NULL)
        *out = t;
    return PD_OK;
}
