/* kern_cuda_rope.cu - rotate-half rotary position embedding, in place.
 * Owns: kern_cuda_rope_launch. One thread per (token, head, i < head_dim/2) pair. The angle is
 *   formed as the CPU reference forms it (kern_rope_cs, kern_rope.h: the float32 inverse frequency
 *   of Hugging Face, any rope scaling, then pos * inv_freq and its sine/cosine in double).
 * Not here: shape checks (kern_ops.c). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

__global__ void rope_kernel(float *x, int n_tok, int n_heads, int head_dim, int ld,
                            const int32_t *pos, float theta, kern_rope_scaling sc, int rnd)
{
    int half = head_dim / 2;
    size_t total = (size_t)n_tok * n_heads * half;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        int k = (int)(i % half);
        size_t th = i / half;
        int h = (int)(th % n_heads);
        size_t t = th / n_heads;
        float c, s;
        kern_rope_cs(pos[t], theta, &sc, (int)k, head_dim, &c, &s);
        float *p = x + t * ld + (size_t)h * head_dim;
        float x1 = p[k], x2 = p[k + half];
        kern_cuda_rope_pair(x1, x2, c, s, rnd, p + k, p + k + half);
    }
}

extern "C" pd_status kern_cuda_rope_launch(kern_backend *be, const kern_rope_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    size_t total = (size_t)a->n_tok * a->n_heads * (a->head_dim / 2);
    if (total == 0)
        return PD_OK;
    rope_kernel<<<kern_cuda_blocks(total, 256), 256, 0, c->stream>>>(
        a->x, a->n_tok, a->n_heads, a->head_dim, a->ld, a->pos, a->theta, a->scaling, be->act_bf16);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
