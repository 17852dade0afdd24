/* kern_rope.h - RoPE scaling and the cos/sin of one rotate-half pair, shared by both backends.
 * Owns: kern_rope_scaling (rope_scaling / rope_parameters of a checkpoint: default, linear,
 *   yarn), kern_rope_cs (the cos/sin every RoPE op of either backend applies).
 * Hugging Face computes a pair's inverse frequency in float32 from base^(2i/hd) and, for yarn,
 *   blends the extrapolated (1/f) and interpolated (1/(factor f)) frequencies over a linear ramp
 *   of pairs [low, high], then multiplies cos and sin by the attention factor. The frequency is
 *   formed here with those float32 steps (each operation rounded on its own: no contraction into
 *   fused multiply-adds, so the CPU and CUDA bits agree); the angle pos * inv_freq and its
 *   sine/cosine are taken in double (so long positions lose no accuracy) and rounded to float.
 *   The zero value is plain RoPE, whose frequency is (float)(1 / base^(2i/hd)) as before.
 * Not here: parsing the config (common/pd_model_config.c), applying the rotation (cpu/, cuda/).
 * Threading: pure functions. */
#ifndef KERN_ROPE_H
#define KERN_ROPE_H

#include <math.h>

typedef enum { KERN_ROPE_DEFAULT = 0, KERN_ROPE_LINEAR, KERN_ROPE_YARN } kern_rope_type;

typedef struct {
    int type;        /* kern_rope_type */
    float factor;    /* linear, yarn: the context scale (>= 1) */
    float low, span; /* yarn: the ramp over pairs from low to low + span (span > 0): pairs below
                      * it keep 1/f, pairs above it take 1/(factor f) */
    float attn;      /* yarn: cos and sin multiplied by it (the attention factor) */
} kern_rope_scaling;

#ifdef __CUDACC__
#define KERN_ROPE_FN static __host__ __device__ __forceinline__
#else
#define KERN_ROPE_FN static inline
#endif

/* a * b and a + b, each rounded to float on its own (device code would fuse them otherwise) */
KERN_ROPE_FN float kern_rope_mul(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

KERN_ROPE_FN float kern_rope_add(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

KERN_ROPE_FN float kern_rope_div(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

/* The inverse frequency of pair i of a head of hd dims */
KERN_ROPE_FN float kern_rope_inv_freq(float theta, const kern_rope_scaling *sc, int i, int hd)
{
    double e = (double)(2 * i) / hd;
    if (sc->type == KERN_ROPE_DEFAULT)
        return (float)(1.0 / pow((double)theta, e));
    float f = (float)pow((double)theta, e);                     /* base ** (2i / hd) */
    if (sc->type == KERN_ROPE_LINEAR)
        return kern_rope_div(kern_rope_div(1.0f, f), sc->factor);
    float extra = kern_rope_div(1.0f, f);
    float inter = kern_rope_div(1.0f, kern_rope_mul(sc->factor, f));
    float ramp = kern_rope_div(kern_rope_add((float)i, -sc->low), sc->span);
    ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
    float ef = kern_rope_add(1.0f, -ramp);                      /* the extrapolation's share */
    return kern_rope_add(kern_rope_mul(inter, kern_rope_add(1.0f, -ef)), kern_rope_mul(extra, ef));
}

/* cos and sin of pair i at position pos, the attention factor applied (yarn) */
KERN_ROPE_FN void kern_rope_cs(int pos, float theta, const kern_rope_scaling *sc, int i, int hd, float *c,
                               float *s)
{
    double ang = (double)pos * (double)kern_rope_inv_freq(theta, sc, i, hd), sd, cd;
#ifdef __CUDA_ARCH__
    sincos(ang, &sd, &cd);
#else
    sd = sin(ang);
    cd = cos(ang);
#endif
    *c = (float)cd;
    *s = (float)sd;
    if (sc->type == KERN_ROPE_YARN) {
        *c = kern_rope_mul(*c, sc->attn);
        *s = kern_rope_mul(*s, sc->attn);
    }
}

#endif
