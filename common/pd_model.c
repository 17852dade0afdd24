/* pd_model.c - loads Qwen3 target and DSpark draft weights from safetensors onto a backend.
 * Owns: the tensor names and shapes each model expects (derived from its config), the one
 *   kern_buf holding all of a model's weights, the conversion to be->weight_dtype, and the
 *   borrowing of the target's embed/lm_head by a draft that lacks them.
 * Not here: config parsing (pd_model_config.c), file parsing (pd_safetensors.c), forward passes.
 * Threading: load/free on one thread; a loaded model is immutable. */
#include "pd_model.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_log.h"
#include "pd_safetensors.h"

/* Every tensor starts on a 256-byte boundary: enough for any vector load or cuBLAS. */
#define MODEL_ALIGN ((size_t)256)

/* One expected tensor: where it goes and the shape the config implies. */
typedef struct {
    char name[128];
    int n_dims;
    int64_t shape[2];
    kern_weight *dst;
    int optional;
    const pd_st_tensor *t;   /* NULL when optional and absent */
    size_t off;
} plan_entry;

typedef struct {
    plan_entry *e;
    size_t n;
    size_t cap;
} plan;

static void plan_cleanup(plan *p)
{
    free(p->e);
    p->e = NULL;
    p->n = p->cap = 0;
}

static pd_status plan_add(plan *p, kern_weight *dst, int optional, int n_dims, int64_t d0,
                          int64_t d1, pd_err *err, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));

static pd_status plan_add(plan *p, kern_weight *dst, int optional, int n_dims, int64_t d0,
                          int64_t d1, pd_err *err, const char *fmt, ...)
{
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        plan_entry *e = realloc(p->e, cap * sizeof(*e));
        if (e == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "model: weight plan of %zu entries", cap);
        p->e = e;
        p->cap = cap;
    }
    plan_entry *e = &p->e[p->n];
    memset(e, 0, sizeof(*e));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->name, sizeof(e->name), fmt, ap);
    va_end(ap);
    e->n_dims = n_dims;
    e->shape[0] = d0;
    e->shape[1] = d1;
    e->dst = dst;
    e->optional = optional;
    p->n++;
    return PD_OK;
}

#define ADD_VEC(p, dst, n, err, ...) plan_add((p), (dst), 0, 1, (n), 0, (err), __VA_ARGS__)
#define ADD_MAT(p, dst, r, c, err, ...) plan_add((p), (dst), 0, 2, (r), (c), (err), __VA_ARGS__)

/* The eleven tensors of a Qwen3 decoder layer, under prefix ("model.layers.3." or "layers.3."). */
static pd_status plan_layer(plan *p, const pd_qwen3_config *c, const char *prefix,
                            pd_layer_weights *w, pd_err *err)
{
    const int64_t h = c->hidden_size, hd = c->head_dim, im = c->intermediate_size;
    const int64_t q = (int64_t)c->num_attention_heads * hd;
    const int64_t kv = (int64_t)c->num_key_value_heads * hd;
    pd_status st;
    if ((st = ADD_VEC(p, &w->input_norm, h, err, "%sinput_layernorm.weight", prefix)) ||
        (st = ADD_VEC(p, &w->post_norm, h, err, "%spost_attention_layernorm.weight", prefix)) ||
        (st = ADD_MAT(p, &w->q_proj, q, h, err, "%sself_attn.q_proj.weight", prefix)) ||
        (st = ADD_MAT(p, &w->k_proj, kv, h, err, "%sself_attn.k_proj.weight", prefix)) ||
        (st = ADD_MAT(p, &w->v_proj, kv, h, err, "%sself_attn.v_proj.weight", prefix)) ||
        (st = ADD_MAT(p, &w->o_proj, h, q, err, "%sself_attn.o_proj.weight", prefix)) ||
        (st = ADD_VEC(p, &w->q_norm, hd, err, "%sself_attn.q_norm.weight", prefix)) ||
        (st = ADD_VEC(p, &w->k_norm, hd, err, "%sself_attn.k_norm.weight", prefix)) ||
        (st = ADD_MAT(p, &w->gate_proj, im, h, err, "%smlp.gate_proj.weight", prefix)) ||
        (st = ADD_MAT(p, &w->up_proj, im, h, err, "%smlp.up_proj.weight", prefix)) ||
        (st = ADD_MAT(p, &w->down_proj, h, im, err, "%smlp.down_proj.weight", prefix)))
        return st;
    return PD_OK;
}

static pd_status plan_layers(plan *p, const pd_qwen3_config *c, const char *fmt_prefix,
                             pd_layer_weights *layers, pd_err *err)
{
    for (int i = 0; i < c->num_hidden_layers; i++) {
        char prefix[64];
        snprintf(prefix, sizeof(prefix), fmt_prefix, i);
        pd_status st = plan_layer(p, c, prefix, &layers[i], err);
        if (st != PD_OK)
            return st;
    }
    return PD_OK;
}

/* Looks every entry up and checks its shape; absent optional entries keep t = NULL. */
static pd_status plan_resolve(plan *p, const pd_st_set *set, const char *dir, pd_err *err)
{
    for (size_t i = 0; i < p->n; i++) {
        plan_entry *e = &p->e[i];
        pd_status st = pd_st_get(set, e->name, e->n_dims, e->shape, &e->t, err);
        if (st == PD_ERR_NOT_FOUND && e->optional) {
            e->t = NULL;
            pd_err_clear(err);
            continue;
        }
        if (st == PD_ERR_NOT_FOUND)
            return pd_err_set(err, PD_ERR_INVALID, "%s: required tensor %s is missing from the "
                              "checkpoint", dir, e->name);
        if (st != PD_OK)
            return st;
        if (e->t->dtype == KERN_DTYPE_I32)
            return pd_err_set(err, PD_ERR_INVALID, "%s: tensor %s has dtype I32, expected a "
                              "float dtype (BF16, F16, F32)", e->t->file, e->name);
    }
    return PD_OK;
}

/* Extra tensors are tolerated (e.g. rotary inv_freq buffers) but worth a line in the log. */
static void plan_warn_unused(const plan *p, const pd_st_set *set)
{
    size_t n = pd_st_count(set);
    for (size_t i = 0; i < n; i++) {
        const pd_st_tensor *t = pd_st_at(set, i);
        int used = 0;
        for (size_t k = 0; k < p->n && !used; k++)
            used = p->e[k].t == t;
        if (!used)
            PD_LOG_WARN("model", "%s: ignoring unexpected tensor %s", t->file, t->name);
    }
}

/* Lays the resolved tensors out in one buffer, converts them to be->weight_dtype and points
 * each entry's kern_weight at its slice. */
static pd_status plan_upload(plan *p, kern_backend *be, kern_buf **out, pd_err *err)
{
    const kern_dtype wdt = be->weight_dtype;
    const size_t esz = kern_dtype_size(wdt);
    size_t total = 0;
    for (size_t i = 0; i < p->n; i++) {
        plan_entry *e = &p->e[i];
        if (e->t == NULL)
            continue;
        size_t bytes = (size_t)e->t->n_elems * esz;
        e->off = total;
        size_t padded = (bytes + MODEL_ALIGN - 1) & ~(MODEL_ALIGN - 1);
        if (total > SIZE_MAX - padded)
            return pd_err_set(err, PD_ERR_NOMEM, "model: weights overflow size_t");
        total += padded;
    }
    kern_buf *buf = NULL;
    pd_status st = kern_buf_alloc(be, total, &buf, err);
    if (st != PD_OK)
        return st;
    for (size_t i = 0; i < p->n; i++) {
        plan_entry *e = &p->e[i];
        if (e->t == NULL)
            continue;
        const pd_st_tensor *t = e->t;
        void *dst = (char *)buf->ptr + e->off;
        const void *src = t->data;
        void *tmp = NULL;
        /* a header whose length is not a multiple of the element size leaves the data
         * misaligned in the mmap; convert from an aligned copy rather than load unaligned */
        if (t->n_bytes > 0 && (uintptr_t)src % kern_dtype_size(t->dtype) != 0) {
            tmp = malloc(t->n_bytes);
            if (tmp == NULL) {
                st = pd_err_set(err, PD_ERR_NOMEM, "%s: tensor %s: aligned copy of %zu bytes",
                                t->file, t->name, t->n_bytes);
                goto err_free_buf;
            }
            memcpy(tmp, src, t->n_bytes);
            src = tmp;
        }
        st = kern_upload_convert(be, dst, wdt, src, t->dtype, (size_t)t->n_elems, err);
        free(tmp);
        if (st != PD_OK) {
            pd_err_prefix(err, "%s: tensor %s", t->file, t->name);
            goto err_free_buf;
        }
        e->dst->data = dst;
        e->dst->dtype = wdt;
        e->dst->rows = e->n_dims == 2 ? e->shape[0] : 1;
        e->dst->cols = e->n_dims == 2 ? e->shape[1] : e->shape[0];
    }
    *out = buf;
    return PD_OK;
err_free_buf:
    kern_buf_free(buf);
    return st;
}

/* ---- Qwen3 target ------------------------------------------------------------------------ */

pd_status pd_qwen3_load(kern_backend *be, const char *dir, pd_qwen3_model **out, pd_err *err)
{
    if (be == NULL || dir == NULL || out == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "qwen3 load: NULL backend, dir or out");
    pd_qwen3_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "qwen3 model");
    plan p = {0};
    pd_st_set *set = NULL;
    pd_status st = pd_qwen3_config_load(dir, &m->cfg, err);
    if (st != PD_OK)
        goto err_free_model;
    const pd_qwen3_config *c = &m->cfg;
    m->be = be;
    m->layers = calloc((size_t)c->num_hidden_layers, sizeof(*m->layers));
    if (m->layers == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "qwen3 model: %d layers", c->num_hidden_layers);
        goto err_free_model;
    }
    st = pd_st_open(dir, &set, err);
    if (st != PD_OK)
        goto err_free_model;
    const int64_t v = c->vocab_size, h = c->hidden_size;
    if ((st = ADD_MAT(&p, &m->embed, v, h, err, "model.embed_tokens.weight")) ||
        (st = plan_layers(&p, c, "model.layers.%d.", m->layers, err)) ||
        (st = ADD_VEC(&p, &m->final_norm, h, err, "model.norm.weight")))
        goto err_close;
    if (!c->tie_word_embeddings &&
        (st = ADD_MAT(&p, &m->lm_head, v, h, err, "lm_head.weight")) != PD_OK)
        goto err_close;
    if ((st = plan_resolve(&p, set, dir, err)) != PD_OK)
        goto err_close;
    plan_warn_unused(&p, set);
    if ((st = plan_upload(&p, be, &m->storage, err)) != PD_OK)
        goto err_close;
    if (c->tie_word_embeddings)
        m->lm_head = m->embed;
    plan_cleanup(&p);
    pd_st_close(set);
    *out = m;
    return PD_OK;
err_close:
    plan_cleanup(&p);
    pd_st_close(set);
err_free_model:
    pd_qwen3_free(m);
    return st;
}

void pd_qwen3_free(pd_qwen3_model *m)
{
    if (m == NULL)
        return;
    kern_buf_free(m->storage);
    free(m->layers);
    free(m);
}

/* ---- DSpark draft ------------------------------------------------------------------------ */

pd_status pd_dspark_load(kern_backend *be, const char *dir, const pd_qwen3_model *target,
                         pd_dspark_model **out, pd_err *err)
{
    if (be == NULL || dir == NULL || out == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "dspark load: NULL backend, dir or out");
    pd_dspark_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "dspark model");
    plan p = {0};
    pd_st_set *set = NULL;
    pd_status st = pd_dspark_config_load(dir, &m->cfg, err);
    if (st != PD_OK)
        goto err_free_model;
    if (target != NULL) {
        st = pd_dspark_config_check_target(&m->cfg, &target->cfg, err);
        if (st != PD_OK) {
            pd_err_prefix(err, "%s", dir);
            goto err_free_model;
        }
    }
    const pd_dspark_config *d = &m->cfg;
    const pd_qwen3_config *c = &d->base;
    m->be = be;
    m->layers = calloc((size_t)c->num_hidden_layers, sizeof(*m->layers));
    if (m->layers == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "dspark model: %d layers", c->num_hidden_layers);
        goto err_free_model;
    }
    st = pd_st_open(dir, &set, err);
    if (st != PD_OK)
        goto err_free_model;

    const int64_t v = c->vocab_size, h = c->hidden_size, r = d->markov_rank;
    const int64_t k = d->n_target_layers;
    if ((st = plan_add(&p, &m->embed, 1, 2, v, h, err, "embed_tokens.weight")) ||
        (st = plan_add(&p, &m->lm_head, 1, 2, v, h, err, "lm_head.weight")) ||
        (st = ADD_MAT(&p, &m->fc, h, k * h, err, "fc.weight")) ||
        (st = ADD_VEC(&p, &m->hidden_norm, h, err, "hidden_norm.weight")) ||
        (st = ADD_VEC(&p, &m->final_norm, h, err, "norm.weight")) ||
        (st = plan_layers(&p, c, "layers.%d.", m->layers, err)))
        goto err_close;
    if (d->markov_type != PD_MARKOV_NONE &&
        ((st = ADD_MAT(&p, &m->markov_w1, v, r, err, "markov_head.markov_w1.weight")) ||
         (st = ADD_MAT(&p, &m->markov_w2, v, r, err, "markov_head.markov_w2.weight"))))
        goto err_close;
    if (d->markov_type == PD_MARKOV_GATED &&
        ((st = ADD_MAT(&p, &m->gate_w, r, h + r, err, "markov_head.gate_proj.weight")) ||
         (st = ADD_VEC(&p, &m->gate_b, r, err, "markov_head.gate_proj.bias"))))
        goto err_close;
    if (d->markov_type == PD_MARKOV_RNN &&
        ((st = ADD_MAT(&p, &m->joint_w, 3 * r, 2 * r + h, err, "markov_head.joint_proj.weight")) ||
         (st = ADD_VEC(&p, &m->joint_b, 3 * r, err, "markov_head.joint_proj.bias"))))
        goto err_close;
    if (d->enable_confidence_head) {
        int64_t in = h + (d->confidence_head_with_markov ? r : 0);
        if ((st = ADD_MAT(&p, &m->conf_w, 1, in, err, "confidence_head.proj.weight")) ||
            (st = ADD_VEC(&p, &m->conf_b, 1, err, "confidence_head.proj.bias")))
            goto err_close;
    }
    if ((st = plan_resolve(&p, set, dir, err)) != PD_OK)
        goto err_close;
    /* entries 0 and 1 are embed_tokens and lm_head, the only optional ones */
    int own_embed = p.e[0].t != NULL, own_head = p.e[1].t != NULL;
    int tie_own = !own_head && own_embed && c->tie_word_embeddings;
    if ((!own_embed || (!own_head && !tie_own))) {
        const char *missing = !own_embed ? "embed_tokens.weight" : "lm_head.weight";
        if (target == NULL) {
            st = pd_err_set(err, PD_ERR_INVALID,
                            "%s: draft checkpoint has no %s and no target model was given to "
                            "borrow it from", dir, missing);
            goto err_close;
        }
        if (target->be != be) {
            st = pd_err_set(err, PD_ERR_INVALID,
                            "%s: draft borrows the target's %s, so it must be loaded on the "
                            "target's backend", dir, missing);
            goto err_close;
        }
    }
    plan_warn_unused(&p, set);
    if ((st = plan_upload(&p, be, &m->storage, err)) != PD_OK)
        goto err_close;
    if (!own_embed)
        m->embed = target->embed;
    if (!own_head)
        m->lm_head = tie_own ? m->embed : target->lm_head;
    PD_LOG_DEBUG("model", "%s: draft embed_tokens %s, lm_head %s", dir,
                 own_embed ? "own" : "from target",
                 own_head ? "own" : (tie_own ? "tied to own embed" : "from target"));
    plan_cleanup(&p);
    pd_st_close(set);
    *out = m;
    return PD_OK;
err_close:
    plan_cleanup(&p);
    pd_st_close(set);
err_free_model:
    pd_dspark_free(m);
    return st;
}

void pd_dspark_free(pd_dspark_model *m)
{
    if (m == NULL)
        return;
    kern_buf_free(m->storage);
    free(m->layers);
    free(m);
}

/* ---- synthetic models -------------------------------------------------------------------- */

/* One synthetic tensor: random (scaled by 1/sqrt(cols)) or all ones (norm weights). */
typedef struct {
    kern_weight *dst;
    int64_t rows, cols;
    int ones;
} synth_entry;

typedef struct {
    synth_entry *e;
    size_t n, cap;
} synth_plan;

static pd_status synth_add(synth_plan *p, kern_weight *dst, int64_t rows, int64_t cols, int ones,
                           pd_err *err)
{
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        synth_entry *e = realloc(p->e, cap * sizeof(*e));
        if (e == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "synthetic model: plan of %zu entries", cap);
        p->e = e;
        p->cap = cap;
    }
    p->e[p->n++] = (synth_entry){ .dst = dst, .rows = rows, .cols = cols, .ones = ones };
    return PD_OK;
}

static pd_status synth_layer(synth_plan *p, const pd_qwen3_config *c, pd_layer_weights *w, pd_err *err)
{
    const int64_t h = c->hidden_size, hd = c->head_dim, im = c->intermediate_size;
    const int64_t q = (int64_t)c->num_attention_heads * hd;
    const int64_t kv = (int64_t)c->num_key_value_heads * hd;
    pd_status st;
    if ((st = synth_add(p, &w->input_norm, 1, h, 1, err)) ||
        (st = synth_add(p, &w->post_norm, 1, h, 1, err)) ||
        (st = synth_add(p, &w->q_proj, q, h, 0, err)) ||
        (st = synth_add(p, &w->k_proj, kv, h, 0, err)) ||
        (st = synth_add(p, &w->v_proj, kv, h, 0, err)) ||
        (st = synth_add(p, &w->o_proj, h, q, 0, err)) ||
        (st = synth_add(p, &w->q_norm, 1, hd, 1, err)) ||
        (st = synth_add(p, &w->k_norm, 1, hd, 1, err)) ||
        (st = synth_add(p, &w->gate_proj, im, h, 0, err)) ||
        (st = synth_add(p, &w->up_proj, im, h, 0, err)) ||
        (st = synth_add(p, &w->down_proj, h, im, 0, err)))
        return st;
    return PD_OK;
}

static uint64_t synth_next(uint64_t *s)
{
    /* splitmix64: fast, and every seed gives a full-period stream */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Random bf16 weights, built from bits only: sign and mantissa random, exponent e0 or e0 - 1,
 * so |w| lies in [2^(e0-128), 2^(e0-126)) with 2^(e0-127) <= 1/sqrt(cols): mean 0, no zeros.
 * Drawing 4e9 values one by one costs ~20 s of host time (paid while a GPU is held), so a block
 * of SYNTH_BASE values is drawn once (exponent 127 / 126) and every chunk is that block read
 * from a random offset, XORed with a random sign/mantissa mask per 64-bit word lane set, then
 * shifted to the tensor's exponent: memory-speed, and no two chunks share their bits. */
#define SYNTH_BASE ((size_t)1 << 24)   /* values (32 MiB) */
#define SYNTH_CHUNK ((size_t)8 << 20)   /* values per upload */

typedef struct {
    uint64_t rng;
    uint64_t *base;          /* SYNTH_BASE / 4 words, 4 bf16 lanes each */
} synth_rng;

static pd_status synth_rng_init(synth_rng *g, uint64_t seed, pd_err *err)
{
    g->rng = seed;
    g->base = malloc(SYNTH_BASE * sizeof(uint16_t));
    if (g->base == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "synthetic model: random block");
    for (size_t w = 0; w < SYNTH_BASE / 4; w++) {
        uint64_t r = synth_next(&g->rng), v = 0;
        for (int k = 0; k < 4; k++) {
            uint64_t b = (r >> (16 * k)) & 0xFFFFu;
            uint64_t lane = ((b & 1u) << 15) | ((uint64_t)(127u - ((b >> 8) & 1u)) << 7) |
                            ((b >> 1) & 0x7Fu);
            v |= lane << (16 * k);
        }
        g->base[w] = v;
    }
    return PD_OK;
}

static void synth_fill_bf16(uint16_t *dst, size_t n, int64_t cols, int ones, synth_rng *g)
{
    if (ones) {
        for (size_t i = 0; i < n; i++)
            dst[i] = 0x3F80;   /* 1.0 */
        return;
    }
    int e = 0;   /* 2^e <= 1/sqrt(cols) */
    while (ldexp(1.0, e) > 1.0 / sqrt((double)(cols > 0 ? cols : 1)))
        e--;
    /* lanes hold exponent 126 or 127: subtracting -e per lane never borrows across lanes */
    const uint64_t sub = (uint64_t)(-e) << 7, sub4 = sub | sub << 16 | sub << 32 | sub << 48;
    const size_t nw = SYNTH_BASE / 4;
    size_t off = (size_t)(synth_next(&g->rng) % nw);
    uint64_t mask = synth_next(&g->rng) & 0x807F807F807F807Full;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint64_t v = (g->base[off] ^ mask) - sub4;
        memcpy(dst + i, &v, sizeof(v));
        if (++off == nw) {
            off = 0;
            mask = synth_next(&g->rng) & 0x807F807F807F807Full;
        }
    }
    for (; i < n; i++)
        dst[i] = (uint16_t)(((g->base[off] ^ mask) - sub4) >> (16 * (i % 4)));
}

/* One allocation for every entry; fills it chunk by chunk from seed. */
static pd_status synth_upload(synth_plan *p, kern_backend *be, uint64_t seed, kern_buf **out,
                              pd_err *err)
{
    const kern_dtype wdt = be->weight_dtype;
    const size_t esz = kern_dtype_size(wdt);
    size_t total = 0;
    size_t *off = malloc((p->n + 1) * sizeof(size_t));
    uint16_t *chunk = malloc(SYNTH_CHUNK * sizeof(uint16_t));
    synth_rng rng = { 0 };
    pd_status st = PD_OK;
    kern_buf *buf = NULL;
    if (off == NULL || chunk == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "synthetic model: host chunk");
        goto out;
    }
    for (size_t i = 0; i < p->n; i++) {
        size_t bytes = (size_t)(p->e[i].rows * p->e[i].cols) * esz;
        off[i] = total;
        total += (bytes + MODEL_ALIGN - 1) & ~(MODEL_ALIGN - 1);
    }
    if ((st = kern_buf_alloc(be, total, &buf, err)) != PD_OK)
        goto out;
    if ((st = synth_rng_init(&rng, seed, err)) != PD_OK) {
        kern_buf_free(buf);
        buf = NULL;
        goto out;
    }
    for (size_t i = 0; i < p->n; i++) {
        synth_entry *e = &p->e[i];
        size_t n = (size_t)(e->rows * e->cols);
        char *dst = (char *)buf->ptr + off[i];
        for (size_t done = 0; done < n; done += SYNTH_CHUNK) {
            size_t m = n - done < SYNTH_CHUNK ? n - done : SYNTH_CHUNK;
            synth_fill_bf16(chunk, m, e->cols, e->ones, &rng);
            st = kern_upload_convert(be, dst + done * esz, wdt, chunk, KERN_DTYPE_BF16, m, err);
            if (st != PD_OK) {
                kern_buf_free(buf);
                buf = NULL;
                goto out;
            }
        }
        e->dst->data = dst;
        e->dst->dtype = wdt;
        e->dst->rows = e->rows;
        e->dst->cols = e->cols;
    }
    *out = buf;
out:
    free(rng.base);
    free(off);
    free(chunk);
    return st;
}

pd_status pd_qwen3_synthetic(kern_backend *be, const char *name, uint64_t seed,
                             pd_qwen3_model **out, pd_err *err)
{
    if (be == NULL || name == NULL || out == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "synthetic target: NULL backend, name or out");
    pd_qwen3_config c = {
        .vocab_size = 151936, .num_hidden_layers = 36, .num_attention_heads = 32,
        .num_key_value_heads = 8, .head_dim = 128, .rms_norm_eps = 1e-6f, .rope_theta = 1e6f,
        .max_position_embeddings = 40960, .eos_ids = { 151645, 151643 }, .n_eos = 2,
        .bos_id = 151643, .pad_id = 151643,
    };
    snprintf(c.arch, sizeof(c.arch), "Qwen3ForCausalLM");
    if (strcmp(name, "qwen3-4b") == 0) {
        c.hidden_size = 2560;
        c.intermediate_size = 9728;
        c.tie_word_embeddings = 1;
    } else if (strcmp(name, "qwen3-8b") == 0) {
        c.hidden_size = 4096;
        c.intermediate_size = 12288;
        c.tie_word_embeddings = 0;
    } else {
        return pd_err_set(err, PD_ERR_INVALID, "synthetic target: unknown model %s (qwen3-4b, "
                          "qwen3-8b)", name);
    }
    pd_qwen3_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "synthetic target");
    m->cfg = c;
    m->be = be;
    synth_plan p = {0};
    pd_status st = PD_OK;
    m->layers = calloc((size_t)c.num_hidden_layers, sizeof(*m->layers));
    if (m->layers == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "synthetic target: %d layers", c.num_hidden_layers);
        goto err_free;
    }
    if ((st = synth_add(&p, &m->embed, c.vocab_size, c.hidden_size, 0, err)) ||
        (st = synth_add(&p, &m->final_norm, 1, c.hidden_size, 1, err)))
        goto err_free;
    for (int l = 0; l < c.num_hidden_layers; l++)
        if ((st = synth_layer(&p, &c, &m->layers[l], err)) != PD_OK)
            goto err_free;
    if (!c.tie_word_embeddings &&
        (st = synth_add(&p, &m->lm_head, c.vocab_size, c.hidden_size, 0, err)) != PD_OK)
        goto err_free;
    if ((st = synth_upload(&p, be, seed, &m->storage, err)) != PD_OK)
        goto err_free;
    if (c.tie_word_embeddings)
        m->lm_head = m->embed;
    free(p.e);
    *out = m;
    return PD_OK;
err_free:
    free(p.e);
    pd_qwen3_free(m);
    return st;
}

pd_status pd_dspark_synthetic(kern_backend *be, const pd_qwen3_model *target, int n_layers,
                              int block_size, uint64_t seed, pd_dspark_model **out, pd_err *err)
{
    if (be == NULL || target == NULL || out == NULL || target->be != be)
        return pd_err_set(err, PD_ERR_INVALID, "synthetic draft: needs the target on the same backend");
    if (n_layers < 1 || block_size < 1 || block_size > 31)
        return pd_err_set(err, PD_ERR_INVALID, "synthetic draft: %d layers, block %d", n_layers,
                          block_size);
    const pd_qwen3_config *tc = &target->cfg;
    pd_dspark_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "synthetic draft");
    pd_dspark_config *d = &m->cfg;
    d->base = *tc;
    snprintf(d->base.arch, sizeof(d->base.arch), "Qwen3DSparkModel");
    d->base.num_hidden_layers = n_layers;
    d->block_size = block_size;
    d->mask_token_id = tc->vocab_size - 1;
    int L = tc->num_hidden_layers;
    d->n_target_layers = 3;
    d->target_layer_ids[0] = 1;
    d->target_layer_ids[1] = L / 2 - 1;
    d->target_layer_ids[2] = L - 3;
    d->num_target_layers = L;
    d->markov_rank = 64;
    d->markov_type = PD_MARKOV_VANILLA;
    d->enable_confidence_head = 1;
    d->confidence_head_with_markov = 1;
    m->be = be;
    synth_plan p = {0};
    pd_status st = pd_dspark_config_check_target(d, tc, err);
    if (st != PD_OK)
        goto err_free;
    m->layers = calloc((size_t)n_layers, sizeof(*m->layers));
    if (m->layers == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "synthetic draft: %d layers", n_layers);
        goto err_free;
    }
    const int64_t h = tc->hidden_size, v = tc->vocab_size, r = d->markov_rank;
    if ((st = synth_add(&p, &m->fc, h, d->n_target_layers * h, 0, err)) ||
        (st = synth_add(&p, &m->hidden_norm, 1, h, 1, err)) ||
        (st = synth_add(&p, &m->final_norm, 1, h, 1, err)) ||
        (st = synth_add(&p, &m->markov_w1, v, r, 0, err)) ||
        (st = synth_add(&p, &m->markov_w2, v, r, 0, err)) ||
        (st = synth_add(&p, &m->conf_w, 1, h + r, 0, err)) ||
        (st = synth_add(&p, &m->conf_b, 1, 1, 0, err)))
        goto err_free;
    for (int l = 0; l < n_layers; l++)
        if ((st = synth_layer(&p, &d->base, &m->layers[l], err)) != PD_OK)
            goto err_free;
    if ((st = synth_upload(&p, be, seed, &m->storage, err)) != PD_OK)
        goto err_free;
    m->embed = target->embed;
    m->lm_head = target->lm_head;
    free(p.e);
    *out = m;
    return PD_OK;
err_free:
    free(p.e);
    pd_dspark_free(m);
    return st;
}
