/* pd_engine_sps.c - the engine's steps-per-second profile: the median time of the target's
 *   verify-shaped forward at batches of 1..max_tokens tokens (a sweep of points, interpolated),
 *   with the batch-invariant kernels decode rounds use, made into the scheduler's SPS curve and
 *   cached on disk under a key of the model, device and build.
 * Owns: the sweep, its profile sequences (reserved and given back within a call), the cache
 *   file's name and key.
 * Not here: the curve itself (pd_verify_policy.c: pd_sps_from_times, load, save), its use
 *   (pd_engine_sched.c, pd_verify_policy.c).
 * Threading: the engine's thread only, between steps. */
#include "pd_engine_sps.h"

#include "pd_engine_internal.h"
#include "pd_engine_logits.h"
#include "pd_log.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* median wall time of one verify-shaped forward of b tokens (one sequence per 8 tokens) */
static pd_status time_verify(pd_engine *e, int b, int ctx_len, double *out, pd_err *err)
{
    int n_seq = (b + 7) / 8;
    pd_kv_seq *seqs = calloc((size_t)n_seq, sizeof(*seqs));
    pd_kv_seq **sp = calloc((size_t)n_seq, sizeof(*sp));
    int32_t *ids = malloc((size_t)b * 4), *pos = malloc((size_t)b * 4), *seq = malloc((size_t)b * 4),
            *rows = malloc((size_t)b * 4);
    pd_status st = PD_OK;
    if (!seqs || !sp || !ids || !pos || !seq || !rows) {
        st = pd_err_set(err, PD_ERR_NOMEM, "sps profile");
        goto out;
    }
    for (int s = 0; s < n_seq && st == PD_OK; s++) {
        pd_kv_seq_init(&seqs[s]);
        sp[s] = &seqs[s];
        st = pd_kv_seq_reserve(e->tpool, &seqs[s], ctx_len + 8, err);
    }
    for (int t = 0; t < b; t++) {
        ids[t] = (t * 7919) % e->V;
        seq[t] = t / 8;
        pos[t] = ctx_len + t % 8;
        rows[t] = t;
    }
    double times[5];
    int inv = e->tm->be->batch_invariant;
    e->tm->be->batch_invariant = 1;   /* time the kernels decode rounds use */
    for (int it = 0; it < 6 && st == PD_OK; it++) {
        pd_tok_batch vb = { .n_tok = b, .ids = ids, .pos = pos, .seq = seq, .n_seq = n_seq, .seqs = sp };
        double t0 = pd_engine_now_s();
        st = pd_engine_target_forward(e, &vb, rows, b, err);
        if (st == PD_OK)
            st = pd_engine_argmax_rows(e, pd_target_logits(e->target), b, rows, err);   /* includes the sync */
        for (int t = 0; t < b; t++)
            rows[t] = t;
        if (it > 0)   /* the first run warms up */
            times[it - 1] = pd_engine_now_s() - t0;
    }
    e->tm->be->batch_invariant = inv;
    if (st == PD_OK) {
        qsort(times, 5, sizeof(double), cmp_double);
        *out = times[2];
    }
out:
    for (int s = 0; seqs != NULL && s < n_seq; s++)
        pd_kv_seq_release(e->tpool, &seqs[s]);
    free(seqs);
    free(sp);
    free(ids);
    free(pos);
    free(seq);
    free(rows);
    return st;
}

pd_status pd_engine_profile_sps(pd_engine *e, int max_tokens, int ctx_len, const char *cache_path,
                                const char *key, pd_sps *out, pd_err *err)
{
    if (max_tokens < 1 || ctx_len < 0 || ctx_len + 8 >= e->tm->cfg.max_position_embeddings)
        return pd_err_set(err, PD_ERR_INVALID, "sps profile: %d tokens over a context of %d", max_tokens, ctx_len);
    if (cache_path != NULL && pd_sps_load(cache_path, key, out, NULL) == PD_OK && out->max_tokens >= max_tokens)
        return PD_OK;
    double *t = calloc((size_t)max_tokens + 1, sizeof(double));
    if (t == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "sps profile table");
    /* measured points: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to max_tokens */
    int pts[64], n_pts = 0;
    for (int p = 1; p <= max_tokens && n_pts < 62; p = p < 4 ? p + 1 : (p & (p - 1)) == 0 ? p + p / 2 : (p / 3) * 4)
        pts[n_pts++] = p;
    if (pts[n_pts - 1] != max_tokens)
        pts[n_pts++] = max_tokens;
    pd_status st = PD_OK;
    for (int i = 0; i < n_pts && st == PD_OK; i++)
        st = time_verify(e, pts[i], ctx_len, &t[pts[i]], err);
    if (st == PD_OK) {
        for (int i = 0; i + 1 < n_pts; i++)
            for (int b = pts[i] + 1; b < pts[i + 1]; b++)
                t[b] = t[pts[i]] + (t[pts[i + 1]] - t[pts[i]]) * (b - pts[i]) / (double)(pts[i + 1] - pts[i]);
        st = pd_sps_from_times(t, max_tokens, out, err);
    }
    if (st == PD_OK && cache_path != NULL) {
        pd_err cerr;
        if (pd_sps_save(cache_path, key, t, max_tokens, &cerr) != PD_OK)
            PD_LOG_WARN("engine", "sps cache not written: %s", cerr.msg);
    }
    free(t);
    return st;
}

pd_status pd_engine_profile_sps_cached(pd_engine *e, const char *model_dir, const char *device,
                                       int max_batch, pd_sps *out, pd_err *err)
{
    char key[PATH_MAX + 256], real[PATH_MAX], dir[1024], cache[1100];
    if (realpath(model_dir, real) == NULL)
        snprintf(real, sizeof(real), "%s", model_dir);
    snprintf(key, sizeof(key), "model=%s device=%s dtype=%s build=%s %s", real, device,
             kern_dtype_name(e->tm->be->weight_dtype), __DATE__, __TIME__);
    uint64_t h = 1469598103934665603ull;   /* FNV-1a of the key names the file */
    for (const char *ch = key; *ch != '\0'; ch++)
        h = (h ^ (unsigned char)*ch) * 1099511628211ull;
    const char *home = getenv("HOME");
    snprintf(dir, sizeof(dir), "%s/.cache", home != NULL ? home : "/tmp");
    mkdir(dir, 0755);
    snprintf(dir, sizeof(dir), "%s/.cache/pdspark", home != NULL ? home : "/tmp");
    mkdir(dir, 0755);
    snprintf(cache, sizeof(cache), "%s/sps-%016llx.json", dir, (unsigned long long)h);
    int b = e->B > 0 ? e->B : 7;
    /* time_verify holds one 264-token sequence per 8 tokens */
    const pd_kv_layout *lay = pd_kv_pool_layout(e->tpool);
    int seqs = pd_kv_pool_free_pages(e->tpool) / ((256 + 8 + lay->page_size - 1) / lay->page_size);
    int max_tok = (max_batch > 8 ? max_batch : 8) * (b + 1);
    if (max_tok > seqs * 8)
        max_tok = seqs * 8 > 8 * (b + 1) ? seqs * 8 : 8 * (b + 1);
    return pd_engine_profile_sps(e, max_tok, 256, cache, key, out, err);
}
