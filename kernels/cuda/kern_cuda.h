/* kern_cuda.h - the CUDA backend's public entry points (plain C; nothing CUDA-specific here).
 * Owns: creating the CUDA backend, counting devices.
 * Not here: the op implementations (kern_cuda_<family>.cu), their private launchers and
 *   PD_CUDA_TRY (kern_cuda_internal.h, included by .cu files only).
 * Threading: kern_cuda_device_count is safe from any thread; a backend is used by one thread at
 *   a time (it owns one stream). */
#ifndef KERN_CUDA_H
#define KERN_CUDA_H

#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices; 0 when there is no driver, no GPU, or the runtime fails.
 * Never fails and never logs an error (tests call it to decide whether to skip). */
int kern_cuda_device_count(void);

/* Creates a CUDA backend on device cfg->device: a non-blocking stream, a cuBLAS handle bound to
 * it, and a growable device workspace. weight_dtype and kv_dtype are BF16. The backend and
 * everything it holds are released by its ops->destroy (kern_backend_destroy).
 * Errors: PD_ERR_CUDA (no such device, driver or cuBLAS failure), PD_ERR_NOMEM. */
pd_status kern_cuda_backend_create(const kern_backend_config *cfg, kern_backend **out, pd_err *err);

/* The backend's stream, as a cudaStream_t behind void * (this header stays CUDA-free), for a
 * caller that times or captures the backend's work with the CUDA runtime itself (pdspark-bench:
 * events, graph capture). NULL when be is not a CUDA backend. Borrowed: lives as long as be. */
void *kern_cuda_stream(kern_backend *be);

/* Makes be's device the calling thread's current CUDA device (a thread that is not the one that
 * created be must call it before using be: streams and kernels belong to one device). The
 * device ordinal of be into *device when device is not NULL. PD_ERR_CUDA on failure;
 * PD_ERR_INVALID when be is not a CUDA backend. */
pd_status kern_cuda_bind_thread(kern_backend *be, int *device, pd_err *err);

/* Timeline trace of the instrumented kernels (skinny GEMM, qk_post, batch-invariant attention)
 * in a build with -DPD_KTRACE: trace_begin clears the record buffer and points the kernels at
 * it, trace_end waits for the stream and writes one CSV line per CTA (kind, tag, cta, sm, start,
 * wait, end in ns) to path, then detaches. Without PD_KTRACE both return PD_ERR_INVALID. */
pd_status kern_cuda_trace_begin(kern_backend *be, pd_err *err);
pd_status kern_cuda_trace_end(kern_backend *be, const char *path, pd_err *err);

#ifdef __cplusplus
}
#endif

#endif
