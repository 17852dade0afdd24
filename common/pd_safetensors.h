/* pd_safetensors.h - read-only access to safetensors checkpoints (single file or sharded).
 * Owns: mmap of every shard, header parsing and validation, name -> tensor lookup.
 * Not here: what the tensors mean (pd_model.c), dtype conversion onto a backend (kern_*).
 * Validation: every header is checked against the file size (offsets inside the data area,
 *   end >= begin, byte size == product(shape) * dtype size, no overlap past the end); errors
 *   name the file and the tensor.
 * Threading: immutable after open; any thread may read. */
#ifndef PD_SAFETENSORS_H
#define PD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "kern_backend.h"
#include "pd_status.h"

#define PD_ST_MAX_DIMS 8

typedef struct {
    const char *name;        /* borrowed from the set */
    kern_dtype dtype;        /* F32, BF16 or F16 (I32 for int tensors); other dtypes refused */
    int n_dims;
    int64_t shape[PD_ST_MAX_DIMS];
    int64_t n_elems;
    const void *data;        /* points into the mmap */
    size_t n_bytes;
    const char *file;        /* path of the shard holding it (borrowed) */
} pd_st_tensor;

typedef struct pd_st_set pd_st_set;

/* Opens a checkpoint: path is a directory (model.safetensors, or model.safetensors.index.json
 * with its shards) or a single .safetensors file. Errors: PD_ERR_IO (missing/unreadable file),
 * PD_ERR_INVALID (corrupt header, truncated file, index naming a missing shard). */
pd_status pd_st_open(const char *path, pd_st_set **out, pd_err *err);
void pd_st_close(pd_st_set *set);

/* NULL when absent. */
const pd_st_tensor *pd_st_find(const pd_st_set *set, const char *name);
size_t pd_st_count(const pd_st_set *set);
const pd_st_tensor *pd_st_at(const pd_st_set *set, size_t i);

/* Finds name and checks its shape equals shape[0..n_dims-1]; PD_ERR_INVALID names the tensor,
 * the file and both shapes, PD_ERR_NOT_FOUND when absent. */
pd_status pd_st_get(const pd_st_set *set, const char *name, int n_dims, const int64_t *shape,
                    const pd_st_tensor **out, pd_err *err);

#endif
