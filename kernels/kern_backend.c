/* kern_backend.c - backend creation by name, dtype helpers and host dtype conversion.
 * Owns: the name -> backend table and the "no NULL op" rule.
 * Not here: shape checks (kern_ops.c), math (cpu/, cuda/).
 * Threading: create/destroy from one thread; the conversion helpers are pure. */
#include "kern_backend.h"

#include <string.h>

#include "cpu/kern_cpu.h"
#ifdef PD_HAVE_CUDA
#include "cuda/kern_cuda.h"
#endif

size_t kern_dtype_size(kern_dtype dt)
{
    switch (dt) {
    case KERN_DTYPE_F32: return 4;
    case KERN_DTYPE_BF16: return 2;
    case KERN_DTYPE_F16: return 2;
    case KERN_DTYPE_I32: return 4;
    }
    return 0;
}

const char *kern_dtype_name(kern_dtype dt)
{
    switch (dt) {
    case KERN_DTYPE_F32: return "F32";
    case KERN_DTYPE_BF16: return "BF16";
    case KERN_DTYPE_F16: return "F16";
    case KERN_DTYPE_I32: return "I32";
    }
    return "?";
}

float kern_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

uint16_t kern_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)   /* NaN: keep it a quiet NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float kern_act_round(float f, int on)
{
    return on ? kern_bf16_to_f32(kern_f32_to_bf16(f)) : f;
}

float kern_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {   /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while ((man & 0x400u) == 0) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ffu;
            u = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

uint16_t kern_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    uint32_t sign = (u >> 16) & 0x8000u;
    int32_t exp = (int32_t)((u >> 23) & 0xffu) - 127 + 15;
    uint32_t man = u & 0x7fffffu;
    if (((u >> 23) & 0xffu) == 0xffu)
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0));
    if (exp >= 31)
        return (uint16_t)(sign | 0x7c00u);
    if (exp <= 0) {
        if (exp < -10)
            return (uint16_t)sign;
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u)))
        half++;
    return (uint16_t)half;
}

static float load_one(const void *src, kern_dtype dt, size_t i)
{
    switch (dt) {
    case KERN_DTYPE_F32: return ((const float *)src)[i];
    case KERN_DTYPE_BF16: return kern_bf16_to_f32(((const uint16_t *)src)[i]);
    case KERN_DTYPE_F16: return kern_f16_to_f32(((const uint16_t *)src)[i]);
    case KERN_DTYPE_I32: return (float)((const int32_t *)src)[i];
    }
    return 0.0f;
}

pd_status kern_convert_host(void *dst, kern_dtype dst_dtype, const void *src, kern_dtype src_dtype,
                            size_t n, pd_err *err)
{
    if (dst_dtype == src_dtype) {
        memcpy(dst, src, n * kern_dtype_size(dst_dtype));
        return PD_OK;
    }
    if (dst_dtype == KERN_DTYPE_I32 || src_dtype == KERN_DTYPE_I32)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "convert %s -> %s", kern_dtype_name(src_dtype),
                          kern_dtype_name(dst_dtype));
    for (size_t i = 0; i < n; i++) {
        float f = load_one(src, src_dtype, i);
        switch (dst_dtype) {
        case KERN_DTYPE_F32: ((float *)dst)[i] = f; break;
        case KERN_DTYPE_BF16: ((uint16_t *)dst)[i] = kern_f32_to_bf16(f); break;
        case KERN_DTYPE_F16: ((uint16_t *)dst)[i] = kern_f32_to_f16(f); break;
        case KERN_DTYPE_I32: break;
        }
    }
    return PD_OK;
}

pd_status kern_backend_check_ops(const kern_backend_ops *o, pd_err *err)
{
    /* Every entry of the table is a pointer; walk them generically so a new op cannot be
     * forgotten here. */
    const void *const *slots = (const void *const *)(const void *)o;
    size_t n = sizeof(*o) / sizeof(void *);
    for (size_t i = 0; i < n; i++)
        if (slots[i] == NULL)
            return pd_err_set(err, PD_ERR_INTERNAL, "backend %s: ops table entry %zu is NULL",
                              o->name != NULL ? o->name : "?", i);
    return PD_OK;
}

pd_status kern_backend_create(const kern_backend_config *cfg, kern_backend **out, pd_err *err)
{
    const char *name = (cfg != NULL && cfg->name != NULL) ? cfg->name : "cpu";
    kern_backend *be = NULL;
    pd_status st;
    if (strcmp(name, "cpu") == 0) {
        st = kern_cpu_backend_create(cfg, &be, err);
    } else if (strcmp(name, "cuda") == 0) {
#ifdef PD_HAVE_CUDA
        st = kern_cuda_backend_create(cfg, &be, err);
#else
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "backend cuda: this build has no CUDA support (configure with a CUDA "
                          "toolkit, PD_WITH_CUDA=ON)");
#endif
    } else {
        return pd_err_set(err, PD_ERR_INVALID, "unknown backend '%s' (expected cpu or cuda)", name);
    }
    if (st != PD_OK)
        return st;
    st = kern_backend_check_ops(be->ops, err);
    if (st != PD_OK) {
        be->ops->destroy(be);
        return st;
    }
    *out = be;
    return PD_OK;
}

pd_status kern_backend_bind_thread(kern_backend *be, int *device, pd_err *err)
{
    if (device != NULL)
        *device = -1;
#ifdef PD_HAVE_CUDA
    if (!be->is_host && strcmp(be->ops->name, "cuda") == 0)
        return kern_cuda_bind_thread(be, device, err);
#endif
    (void)be;
    (void)err;
    return PD_OK;
}

int kern_backend_device_count(const char *name)
{
    if (name != NULL && strcmp(name, "cpu") == 0)
        return 1;
#ifdef PD_HAVE_CUDA
    if (name != NULL && strcmp(name, "cuda") == 0)
        return kern_cuda_device_count();
#endif
    return 0;
}

void *kern_backend_stream(kern_backend *be)
{
#ifdef PD_HAVE_CUDA
    if (!be->is_host && strcmp(be->ops->name, "cuda") == 0)
        return kern_cuda_stream(be);
#endif
    (void)be;
    return NULL;
}

void kern_backend_destroy(kern_backend *be)
{
    if (be != NULL)
        be->ops->destroy(be);
}
