/* pd_model_config.c - config.json / generation_config.json of the Qwen3 target and the DSpark
 *   drafter, and the check that a draft fits its target.
 * Owns: which keys are read (transformers 5 and older spellings), their defaults, and what
 *   this server refuses (attention bias, rope scaling, sliding windows, odd head counts).
 * Not here: tensors (pd_model.c, pd_safetensors.c).
 * Threading: pure functions of the files; any thread. */
#include "pd_model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pd_json.h"
#include "pd_log.h"

#define CFG_MAX_BYTES ((size_t)16 * 1024 * 1024)

/* ---- file and JSON helpers --------------------------------------------------------------- */

static pd_status read_text(const char *path, char **out, pd_err *err)
{
    FILE *fp = fopen(path, "rb");
    if (fp == NULL)
        return pd_err_set(err, PD_ERR_IO, "%s: open: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    pd_status st = PD_OK;
    if (buf == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "%s: read buffer", path);
        goto out_close;
    }
    for (;;) {
        if (len + 1 >= cap) {
            if (cap >= CFG_MAX_BYTES) {
                st = pd_err_set(err, PD_ERR_INVALID, "%s: larger than %zu bytes", path,
                                CFG_MAX_BYTES);
                goto out_free;
            }
            char *nb = realloc(buf, cap * 2);
            if (nb == NULL) {
                st = pd_err_set(err, PD_ERR_NOMEM, "%s: read buffer", path);
                goto out_free;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + len, 1, cap - 1 - len, fp);
        len += r;
        if (r == 0)
            break;
    }
    if (ferror(fp)) {
        st = pd_err_set(err, PD_ERR_IO, "%s: read error", path);
        goto out_free;
    }
    buf[len] = '\0';
    *out = buf;
    fclose(fp);
    return PD_OK;
out_free:
    free(buf);
out_close:
    fclose(fp);
    return st;
}

/* Parses path as a JSON object. *out = NULL and PD_OK when optional and the file is absent. */
static pd_status load_json(const char *path, int optional, cJSON **out, pd_err *err)
{
    *out = NULL;
    struct stat sb;
    if (optional && stat(path, &sb) != 0 && errno == ENOENT)
        return PD_OK;
    char *text = NULL;
    pd_status st = read_text(path, &text, err);
    if (st != PD_OK)
        return st;
    size_t bad = 0;
    cJSON *root = pd_json_parse_str(text, &bad);
    if (root == NULL) {
        /* line and column of the failure, so a hand-edited config is easy to fix */
        int line = 1, col = 1;
        for (const char *q = text; q < text + bad && *q; q++) {
            if (*q == '\n')
                line++, col = 1;
            else
                col++;
        }
        free(text);
        return pd_err_set(err, PD_ERR_INVALID, "%s: invalid JSON at line %d column %d", path,
                          line, col);
    }
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return pd_err_set(err, PD_ERR_INVALID, "%s: top level is not a JSON object", path);
    }
    *out = root;
    return PD_OK;
}

static const cJSON *jget(const cJSON *obj, const char *key)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNull(j) ? NULL : j;
}

static int json_is_int(const cJSON *j)
{
    if (!cJSON_IsNumber(j))
        return 0;
    double v = j->valuedouble;
    return v >= (double)INT_MIN && v <= (double)INT_MAX && v == floor(v);
}

/* Required int field, range [lo, hi]. */
static pd_status get_int(const cJSON *o, const char *file, const char *key, int lo, int hi,
                         int *out, pd_err *err)
{
    const cJSON *j = jget(o, key);
    if (j == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "%s: missing field %s", file, key);
    if (!json_is_int(j))
        return pd_err_set(err, PD_ERR_INVALID, "%s: field %s is not an integer", file, key);
    int v = (int)j->valuedouble;
    if (v < lo || v > hi)
        return pd_err_set(err, PD_ERR_INVALID, "%s: field %s = %d out of range [%d, %d]", file,
                          key, v, lo, hi);
    *out = v;
    return PD_OK;
}

static pd_status get_int_opt(const cJSON *o, const char *file, const char *key, int lo, int hi,
                             int dflt, int *out, pd_err *err)
{
    if (jget(o, key) == NULL) {
        *out = dflt;
        return PD_OK;
    }
    return get_int(o, file, key, lo, hi, out, err);
}

static pd_status get_bool_opt(const cJSON *o, const char *file, const char *key, int dflt,
                              int *out, pd_err *err)
{
    const cJSON *j = jget(o, key);
    if (j == NULL) {
        *out = dflt;
        return PD_OK;
    }
    if (!cJSON_IsBool(j))
        return pd_err_set(err, PD_ERR_INVALID, "%s: field %s is not a boolean", file, key);
    *out = cJSON_IsTrue(j) ? 1 : 0;
    return PD_OK;
}

static pd_status get_float_opt(const cJSON *o, const char *file, const char *key, double dflt,
                               float *out, pd_err *err)
{
    const cJSON *j = jget(o, key);
    if (j == NULL) {
        *out = (float)dflt;
        return PD_OK;
    }
    /* positive as the float it is used as (1e-96 is 0 there, 1e39 infinite) */
    if (!cJSON_IsNumber(j) || !((float)j->valuedouble > 0.0f) || !isfinite((float)j->valuedouble))
        return pd_err_set(err, PD_ERR_INVALID, "%s: field %s must be a positive number (as a float)", file,
                          key);
    *out = (float)j->valuedouble;
    return PD_OK;
}

/* eos_token_id: an int or a list of ints. *found = 0 when the field is absent or null. */
static pd_status get_eos(const cJSON *o, const char *file, int vocab, pd_qwen3_config *c,
                         int *found, pd_err *err)
{
    const cJSON *j = jget(o, "eos_token_id");
    *found = 0;
    if (j == NULL)
        return PD_OK;
    int n = 0;
    if (json_is_int(j)) {
        c->eos_ids[n++] = (int)j->valuedouble;
    } else if (cJSON_IsArray(j)) {
        for (const cJSON *e = j->child; e != NULL; e = e->next) {
            if (!json_is_int(e))
                return pd_err_set(err, PD_ERR_INVALID, "%s: eos_token_id has a non-integer entry",
                                  file);
            if (n == PD_MAX_EOS)
                return pd_err_set(err, PD_ERR_UNSUPPORTED,
                                  "%s: eos_token_id has more than %d entries", file, PD_MAX_EOS);
            c->eos_ids[n++] = (int)e->valuedouble;
        }
    } else {
        return pd_err_set(err, PD_ERR_INVALID, "%s: eos_token_id is not an integer or a list",
                          file);
    }
    for (int i = 0; i < n; i++)
        if (c->eos_ids[i] < 0 || c->eos_ids[i] >= vocab)
            return pd_err_set(err, PD_ERR_INVALID,
                              "%s: eos_token_id %d outside the vocab [0, %d)", file,
                              c->eos_ids[i], vocab);
    c->n_eos = n;
    *found = 1;
    return PD_OK;
}

static pd_status get_token_opt(const cJSON *o, const char *file, const char *key, int vocab,
                               int *out, int *found, pd_err *err)
{
    *found = 0;
    if (jget(o, key) == NULL)
        return PD_OK;
    pd_status st = get_int(o, file, key, 0, vocab - 1, out, err);
    if (st == PD_OK)
        *found = 1;
    return st;
}

/* The rope_type of a rope_parameters / rope_scaling object r ("type" in old configs; absent:
 * default) into *type; unknown types are refused by name. NULL-safe. */
static pd_status rope_type_of(const cJSON *r, const char *file, const char *key, int *type, pd_err *err)
{
    *type = KERN_ROPE_DEFAULT;
    if (r == NULL)
        return PD_OK;
    if (!cJSON_IsObject(r))
        return pd_err_set(err, PD_ERR_INVALID, "%s: field %s is not an object", file, key);
    const cJSON *t = jget(r, "rope_type");
    if (t == NULL)
        t = jget(r, "type");
    if (t == NULL)
        return PD_OK;
    if (!cJSON_IsString(t))
        return pd_err_set(err, PD_ERR_INVALID, "%s: %s.rope_type is not a string", file, key);
    if (strcmp(t->valuestring, "linear") == 0)
        *type = KERN_ROPE_LINEAR;
    else if (strcmp(t->valuestring, "yarn") == 0)
        *type = KERN_ROPE_YARN;
    else if (strcmp(t->valuestring, "default") != 0)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "%s: %s.rope_type %s is not supported (default, linear and yarn are)", file, key,
                          t->valuestring);
    return PD_OK;
}

/* An optional number field of a rope object: *out = dflt when absent (or null, or 0 where
 * zero_is_absent: Hugging Face reads beta_fast/beta_slow with "or") */
static pd_status rope_num(const cJSON *r, const char *file, const char *key, const char *field, double dflt,
                          int zero_is_absent, double *out, pd_err *err)
{
    const cJSON *j = jget(r, field);
    *out = dflt;
    if (j == NULL)
        return PD_OK;
    if (!cJSON_IsNumber(j) || !isfinite(j->valuedouble))
        return pd_err_set(err, PD_ERR_INVALID, "%s: %s.%s must be a number", file, key, field);
    if (!(zero_is_absent && j->valuedouble == 0.0))
        *out = j->valuedouble;
    return PD_OK;
}

/* YaRN's 0.1 * mscale * ln(scale) + 1 (1 at scale <= 1) */
static double yarn_mscale(double scale, double mscale)
{
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

/* Pair index at which a frequency makes n rotations over max_pos positions (YaRN) */
static double yarn_correction_dim(double n, int dim, double base, double max_pos)
{
    return dim * log(max_pos / (n * 2.0 * 3.141592653589793)) / (2.0 * log(base));
}

/* The RoPE scaling of a config: the rope_parameters object (transformers 5) or rope_scaling
 * (older) with a linear or yarn rope_type, its parameters formed as Hugging Face forms them
 * (factor, attention_factor or mscale / mscale_all_dim, beta_fast 32, beta_slow 1,
 * original_max_position_embeddings defaulting to max_position_embeddings, truncate); base is
 * the rope_theta read. A linear or yarn scaling serves factor x the original context (vLLM's
 * rule), so c->max_position_embeddings becomes that when it is larger. */
static pd_status parse_rope_scaling(const cJSON *o, const char *file, double base, pd_qwen3_config *c, pd_err *err)
{
    const cJSON *rp = jget(o, "rope_parameters"), *rs = jget(o, "rope_scaling");
    int tp, ts;
    pd_status st;
    if ((st = rope_type_of(rp, file, "rope_parameters", &tp, err)) != PD_OK ||
        (st = rope_type_of(rs, file, "rope_scaling", &ts, err)) != PD_OK)
        return st;
    const cJSON *r = tp != KERN_ROPE_DEFAULT ? rp : rs;
    const char *key = tp != KERN_ROPE_DEFAULT ? "rope_parameters" : "rope_scaling";
    int type = tp != KERN_ROPE_DEFAULT ? tp : ts;
    if (type == KERN_ROPE_DEFAULT)   /* c->rope_scaling stays zero */
        return PD_OK;
    double prf, orig, factor;
    if ((st = rope_num(r, file, key, "partial_rotary_factor", 1.0, 0, &prf, err)) != PD_OK ||
        (st = rope_num(r, file, key, "original_max_position_embeddings", c->max_position_embeddings, 0, &orig,
                       err)) != PD_OK)
        return st;
    if (prf != 1.0)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: %s.partial_rotary_factor %g is not supported (1 only)",
                          file, key, prf);
    if (!(orig >= 1.0 && orig <= (double)(1 << 30)))
        return pd_err_set(err, PD_ERR_INVALID, "%s: %s.original_max_position_embeddings %g must be in 1..%d", file,
                          key, orig, 1 << 30);
    /* yarn without a factor: the context's growth over the original (transformers 5) */
    if (type == KERN_ROPE_LINEAR && jget(r, "factor") == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "%s: %s.factor is missing (rope_type linear needs it)", file, key);
    if ((st = rope_num(r, file, key, "factor", c->max_position_embeddings / orig, 0, &factor, err)) != PD_OK)
        return st;
    if (!(factor >= 1.0 && factor <= 1e6))
        return pd_err_set(err, PD_ERR_INVALID, "%s: %s.factor %g must be in 1..1e6", file, key, factor);
    kern_rope_scaling *sc = &c->rope_scaling;
    sc->type = type;
    sc->factor = (float)factor;
    double served = (type == KERN_ROPE_YARN ? orig : (double)c->max_position_embeddings) * factor;
    if (served > (double)c->max_position_embeddings)
        c->max_position_embeddings = served < (double)(1 << 30) ? (int)served : 1 << 30;
    if (type == KERN_ROPE_LINEAR)
        return PD_OK;
    double attn, mscale, mscale_all, beta_fast, beta_slow;
    int truncate = 1;
    if ((st = rope_num(r, file, key, "attention_factor", -1.0, 0, &attn, err)) != PD_OK ||
        (st = rope_num(r, file, key, "mscale", 0.0, 0, &mscale, err)) != PD_OK ||
        (st = rope_num(r, file, key, "mscale_all_dim", 0.0, 0, &mscale_all, err)) != PD_OK ||
        (st = rope_num(r, file, key, "beta_fast", 32.0, 1, &beta_fast, err)) != PD_OK ||
        (st = rope_num(r, file, key, "beta_slow", 1.0, 1, &beta_slow, err)) != PD_OK ||
        (st = get_bool_opt(r, file, "truncate", 1, &truncate, err)) != PD_OK)
        return st;
    if (jget(r, "attention_factor") == NULL)
        attn = mscale != 0.0 && mscale_all != 0.0 ? yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                                                   : yarn_mscale(factor, 1.0);
    if (!(attn > 0.0 && attn <= 1e6))
        return pd_err_set(err, PD_ERR_INVALID, "%s: %s.attention_factor %g must be positive", file, key, attn);
    if (!(beta_fast > 0.0 && beta_slow > 0.0))
        return pd_err_set(err, PD_ERR_INVALID, "%s: %s.beta_fast %g and beta_slow %g must be positive", file, key,
                          beta_fast, beta_slow);
    if (!(base > 1.0))
        return pd_err_set(err, PD_ERR_INVALID, "%s: rope_theta %g must be > 1 for yarn", file, base);
    const int dim = c->head_dim;
    double low = yarn_correction_dim(beta_fast, dim, base, orig);
    double high = yarn_correction_dim(beta_slow, dim, base, orig);
    if (truncate) {
        low = floor(low);
        high = ceil(high);
    }
    low = low > 0.0 ? low : 0.0;
    high = high < dim - 1 ? high : dim - 1;
    if (low == high)
        high += 0.001;   /* as Hugging Face avoids the singularity */
    if (!(high > low))
        return pd_err_set(err, PD_ERR_INVALID, "%s: %s: beta_fast %g and beta_slow %g give an empty yarn ramp "
                          "(pairs %g..%g)", file, key, beta_fast, beta_slow, low, high);
    sc->low = (float)low;
    sc->span = (float)(high - low);
    sc->attn = (float)attn;
    return PD_OK;
}

static char *path_join(const char *dir, const char *name, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/%s", dir, name);
    return buf;
}

/* ---- Qwen3 ------------------------------------------------------------------------------- */

/* Fills c from an already-parsed config.json (file names the file in messages). */
static pd_status parse_qwen3(const cJSON *o, const char *file, const char *want_arch,
                             pd_qwen3_config *c, pd_err *err)
{
    pd_status st;
    memset(c, 0, sizeof(*c));
    c->bos_id = -1;
    c->pad_id = -1;

    const cJSON *arch = jget(o, "architectures");
    if (!cJSON_IsArray(arch) || arch->child == NULL || !cJSON_IsString(arch->child))
        return pd_err_set(err, PD_ERR_INVALID, "%s: missing field architectures (expected [\"%s\"])",
                          file, want_arch);
    snprintf(c->arch, sizeof(c->arch), "%s", arch->child->valuestring);
    if (strcmp(arch->child->valuestring, want_arch) != 0)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "%s: architecture %s is not supported here (expected %s)", file,
                          arch->child->valuestring, want_arch);

    const int big = 1 << 30;
    if ((st = get_int(o, file, "vocab_size", 1, big, &c->vocab_size, err)) != PD_OK ||
        (st = get_int(o, file, "hidden_size", 1, 1 << 20, &c->hidden_size, err)) != PD_OK ||
        (st = get_int(o, file, "intermediate_size", 1, 1 << 22, &c->intermediate_size, err)) !=
            PD_OK ||
        (st = get_int(o, file, "num_hidden_layers", 1, 4096, &c->num_hidden_layers, err)) !=
            PD_OK ||
        (st = get_int(o, file, "num_attention_heads", 1, 4096, &c->num_attention_heads, err)) !=
            PD_OK)
        return st;
    /* older configs may omit the KV head count, meaning plain multi-head attention */
    if ((st = get_int_opt(o, file, "num_key_value_heads", 1, 4096, c->num_attention_heads,
                          &c->num_key_value_heads, err)) != PD_OK)
        return st;
    if (c->num_attention_heads % c->num_key_value_heads != 0)
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                          file, c->num_attention_heads, c->num_key_value_heads);
    if (jget(o, "head_dim") == NULL) {
        if (c->hidden_size % c->num_attention_heads != 0)
            return pd_err_set(err, PD_ERR_INVALID,
                              "%s: no head_dim, and hidden_size %d is not a multiple of "
                              "num_attention_heads %d", file, c->hidden_size,
                              c->num_attention_heads);
        c->head_dim = c->hidden_size / c->num_attention_heads;
    } else if ((st = get_int(o, file, "head_dim", 1, 1 << 16, &c->head_dim, err)) != PD_OK) {
        return st;
    }
    if (c->head_dim % 2 != 0)
        return pd_err_set(err, PD_ERR_INVALID, "%s: head_dim %d is odd (rotate-half RoPE needs "
                          "pairs)", file, c->head_dim);
    if ((st = get_float_opt(o, file, "rms_norm_eps", 1e-6, &c->rms_norm_eps, err)) != PD_OK)
        return st;

    /* transformers 5: rope_parameters {rope_theta, rope_type, ...}; older: rope_theta +
     * rope_scaling (parsed below, once max_position_embeddings is known) */
    const cJSON *rp = jget(o, "rope_parameters");
    if (rp != NULL && !cJSON_IsObject(rp))
        return pd_err_set(err, PD_ERR_INVALID, "%s: field rope_parameters is not an object", file);
    const cJSON *th = rp != NULL ? jget(rp, "rope_theta") : NULL;
    const char *th_key = "rope_parameters.rope_theta";
    if (th == NULL) {
        th = jget(o, "rope_theta");
        th_key = "rope_theta";
    }
    c->rope_theta = 10000.0f;   /* the Qwen3Config default */
    double base = 10000.0;
    if (th != NULL) {
        if (!cJSON_IsNumber(th) || !((float)th->valuedouble > 0.0f) || !isfinite((float)th->valuedouble))
            return pd_err_set(err, PD_ERR_INVALID, "%s: field %s must be a positive number (as a float)",
                              file, th_key);
        c->rope_theta = (float)th->valuedouble;
        base = th->valuedouble;
    }

    if ((st = get_int_opt(o, file, "max_position_embeddings", 1, big, 32768,
                          &c->max_position_embeddings, err)) != PD_OK ||
        (st = parse_rope_scaling(o, file, base, c, err)) != PD_OK ||
        (st = get_bool_opt(o, file, "tie_word_embeddings", 0, &c->tie_word_embeddings, err)) !=
            PD_OK ||
        (st = get_bool_opt(o, file, "attention_bias", 0, &c->attention_bias, err)) != PD_OK)
        return st;
    if (c->attention_bias)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "%s: attention_bias = true is not supported (Qwen3 has no q/k/v bias)",
                          file);
    int sw = 0;
    if ((st = get_bool_opt(o, file, "use_sliding_window", 0, &sw, err)) != PD_OK)
        return st;
    if (sw)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "%s: use_sliding_window = true is not supported (full attention only)",
                          file);
    const cJSON *lt = jget(o, "layer_types");
    if (lt != NULL) {
        if (!cJSON_IsArray(lt))
            return pd_err_set(err, PD_ERR_INVALID, "%s: field layer_types is not a list", file);
        int i = 0;
        for (const cJSON *e = lt->child; e != NULL; e = e->next, i++)
            if (!cJSON_IsString(e) || strcmp(e->valuestring, "full_attention") != 0)
                return pd_err_set(err, PD_ERR_UNSUPPORTED,
                                  "%s: layer_types[%d] is %s; only full_attention is supported",
                                  file, i, cJSON_IsString(e) ? e->valuestring : "not a string");
    }
    /* a quantized checkpoint (fp8, AWQ, GPTQ, ...) stores weights this engine cannot read: say so
     * before its tensors' dtypes do */
    const cJSON *qc = jget(o, "quantization_config");
    if (qc != NULL) {
        const cJSON *qm = cJSON_IsObject(qc) ? jget(qc, "quant_method") : NULL;
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "%s: quantization_config (quant_method %s) is not supported: load the bf16, f16 or f32 "
                          "checkpoint", file, cJSON_IsString(qm) ? qm->valuestring : "unknown");
    }
    const cJSON *act = jget(o, "hidden_act");
    if (act != NULL && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu") != 0))
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: hidden_act %s is not supported (silu only)",
                          file, cJSON_IsString(act) ? act->valuestring : "(not a string)");
    /* dtype (transformers 5) or torch_dtype: informational, weights carry their own dtype */
    const cJSON *dt = jget(o, "dtype");
    if (dt == NULL)
        dt = jget(o, "torch_dtype");
    if (dt != NULL && !cJSON_IsString(dt))
        return pd_err_set(err, PD_ERR_INVALID, "%s: field dtype is not a string", file);

    int found;
    if ((st = get_eos(o, file, c->vocab_size, c, &found, err)) != PD_OK ||
        (st = get_token_opt(o, file, "bos_token_id", c->vocab_size, &c->bos_id, &found, err)) !=
            PD_OK ||
        (st = get_token_opt(o, file, "pad_token_id", c->vocab_size, &c->pad_id, &found, err)) !=
            PD_OK)
        return st;
    return PD_OK;
}

/* generation_config.json overrides the token ids of config.json, as in transformers' generate. */
static pd_status apply_generation_config(const char *dir, pd_qwen3_config *c, pd_err *err)
{
    char path[4096];
    path_join(dir, "generation_config.json", path, sizeof(path));
    cJSON *g = NULL;
    pd_status st = load_json(path, 1, &g, err);
    if (st != PD_OK || g == NULL)
        return st;
    pd_qwen3_config tmp = *c;
    int found;
    if ((st = get_eos(g, path, c->vocab_size, &tmp, &found, err)) != PD_OK)
        goto out;
    if (found) {
        memcpy(c->eos_ids, tmp.eos_ids, sizeof(c->eos_ids));
        c->n_eos = tmp.n_eos;
    }
    int v;
    if ((st = get_token_opt(g, path, "bos_token_id", c->vocab_size, &v, &found, err)) != PD_OK)
        goto out;
    if (found)
        c->bos_id = v;
    if ((st = get_token_opt(g, path, "pad_token_id", c->vocab_size, &v, &found, err)) != PD_OK)
        goto out;
    if (found)
        c->pad_id = v;
out:
    cJSON_Delete(g);
    return st;
}

static pd_status load_qwen3_like(const char *dir, const char *want_arch, cJSON **root_out,
                                 char *path, size_t path_cap, pd_qwen3_config *c, pd_err *err)
{
    if (dir == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "model config: NULL dir");
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return pd_err_set(err, PD_ERR_IO, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return pd_err_set(err, PD_ERR_IO, "%s: not a directory", dir);
    path_join(dir, "config.json", path, path_cap);
    cJSON *root = NULL;
    pd_status st = load_json(path, 0, &root, err);
    if (st != PD_OK)
        return st;
    st = parse_qwen3(root, path, want_arch, c, err);
    if (st == PD_OK)
        st = apply_generation_config(dir, c, err);
    if (st != PD_OK) {
        cJSON_Delete(root);
        return st;
    }
    *root_out = root;
    return PD_OK;
}

pd_status pd_qwen3_config_load(const char *dir, pd_qwen3_config *out, pd_err *err)
{
    char path[4096];
    cJSON *root = NULL;
    pd_qwen3_config c;
    pd_status st = load_qwen3_like(dir, "Qwen3ForCausalLM", &root, path, sizeof(path), &c, err);
    if (st != PD_OK)
        return st;
    cJSON_Delete(root);
    if (c.n_eos == 0)
        PD_LOG_WARN("model", "%s: no eos_token_id in config.json or generation_config.json", dir);
    *out = c;
    return PD_OK;
}

/* ---- DSpark ------------------------------------------------------------------------------ */

pd_status pd_dspark_config_load(const char *dir, pd_dspark_config *out, pd_err *err)
{
    char path[4096];
    cJSON *o = NULL;
    pd_dspark_config d;
    memset(&d, 0, sizeof(d));
    pd_status st = load_qwen3_like(dir, "Qwen3DSparkModel", &o, path, sizeof(path), &d.base, err);
    if (st != PD_OK)
        return st;
    const int vocab = d.base.vocab_size;
    if ((st = get_int(o, path, "block_size", 1, 1024, &d.block_size, err)) != PD_OK ||
        (st = get_int(o, path, "mask_token_id", 0, vocab - 1, &d.mask_token_id, err)) != PD_OK ||
        (st = get_int_opt(o, path, "num_target_layers", 1, 4096, 0, &d.num_target_layers, err)) !=
            PD_OK ||
        (st = get_int_opt(o, path, "markov_rank", 0, 1 << 16, 0, &d.markov_rank, err)) != PD_OK ||
        (st = get_bool_opt(o, path, "enable_confidence_head", 0, &d.enable_confidence_head,
                           err)) != PD_OK ||
        (st = get_bool_opt(o, path, "confidence_head_with_markov", 0,
                           &d.confidence_head_with_markov, err)) != PD_OK)
        goto out;

    const cJSON *taps = jget(o, "target_layer_ids");
    if (taps == NULL) {
        st = pd_err_set(err, PD_ERR_INVALID, "%s: missing field target_layer_ids", path);
        goto out;
    }
    if (!cJSON_IsArray(taps) || taps->child == NULL) {
        st = pd_err_set(err, PD_ERR_INVALID, "%s: target_layer_ids must be a non-empty list",
                        path);
        goto out;
    }
    for (const cJSON *e = taps->child; e != NULL; e = e->next) {
        if (d.n_target_layers == PD_MAX_TAPS) {
            st = pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: more than %d target_layer_ids", path,
                            PD_MAX_TAPS);
            goto out;
        }
        if (!json_is_int(e) || e->valuedouble < -1) {
            st = pd_err_set(err, PD_ERR_INVALID,
                            "%s: target_layer_ids[%d] must be an integer >= -1", path,
                            d.n_target_layers);
            goto out;
        }
        int l = (int)e->valuedouble;
        if (d.num_target_layers > 0 && l >= d.num_target_layers - 1) {
            st = pd_err_set(err, PD_ERR_INVALID,
                            "%s: target_layer_ids[%d] = %d must be below the final target layer "
                            "%d (num_target_layers %d)", path, d.n_target_layers, l,
                            d.num_target_layers - 1, d.num_target_layers);
            goto out;
        }
        d.target_layer_ids[d.n_target_layers++] = l;
    }

    const cJSON *mt = jget(o, "markov_head_type");
    if (d.markov_rank == 0) {
        d.markov_type = PD_MARKOV_NONE;
    } else if (mt == NULL) {
        d.markov_type = PD_MARKOV_VANILLA;   /* DeepSpec's default head */
    } else if (!cJSON_IsString(mt)) {
        st = pd_err_set(err, PD_ERR_INVALID, "%s: markov_head_type is not a string", path);
        goto out;
    } else if (strcmp(mt->valuestring, "vanilla") == 0) {
        d.markov_type = PD_MARKOV_VANILLA;
    } else if (strcmp(mt->valuestring, "gated") == 0) {
        d.markov_type = PD_MARKOV_GATED;
    } else if (strcmp(mt->valuestring, "rnn") == 0) {
        d.markov_type = PD_MARKOV_RNN;
    } else {
        st = pd_err_set(err, PD_ERR_UNSUPPORTED,
                        "%s: markov_head_type %s is not supported (vanilla, gated or rnn)", path,
                        mt->valuestring);
        goto out;
    }
    if (d.markov_rank == 0)
        d.confidence_head_with_markov = 0;
    *out = d;
    st = PD_OK;
out:
    cJSON_Delete(o);
    return st;
}

pd_status pd_dspark_config_check_target(const pd_dspark_config *d, const pd_qwen3_config *t,
                                        pd_err *err)
{
    if (d->base.vocab_size != t->vocab_size)
        return pd_err_set(err, PD_ERR_INVALID, "draft vocab_size %d != target vocab_size %d",
                          d->base.vocab_size, t->vocab_size);
    if (d->base.hidden_size != t->hidden_size)
        return pd_err_set(err, PD_ERR_INVALID, "draft hidden_size %d != target hidden_size %d",
                          d->base.hidden_size, t->hidden_size);
    if (d->base.head_dim != t->head_dim)
        return pd_err_set(err, PD_ERR_INVALID, "draft head_dim %d != target head_dim %d",
                          d->base.head_dim, t->head_dim);
    if (d->num_target_layers != 0 && d->num_target_layers != t->num_hidden_layers)
        return pd_err_set(err, PD_ERR_INVALID,
                          "draft num_target_layers %d != target num_hidden_layers %d",
                          d->num_target_layers, t->num_hidden_layers);
    /* the final layer is never a tap: its output is the final-norm input, not an aux feature */
    for (int i = 0; i < d->n_target_layers; i++) {
        int l = d->target_layer_ids[i];
        if (l < -1 || l >= t->num_hidden_layers - 1)
            return pd_err_set(err, PD_ERR_INVALID,
                              "draft target_layer_ids[%d] = %d out of range: must be -1 "
                              "(embeddings) or 0..%d (target has %d layers, the final one is "
                              "never a tap)", i, l, t->num_hidden_layers - 2,
                              t->num_hidden_layers);
    }
    if (d->mask_token_id < 0 || d->mask_token_id >= t->vocab_size)
        return pd_err_set(err, PD_ERR_INVALID, "draft mask_token_id %d outside target vocab %d",
                          d->mask_token_id, t->vocab_size);
    return PD_OK;
}
