/* kern_cpu.h - the CPU reference backend: fp32, plain loops, GEMM through OpenBLAS.
 * It defines "correct" for every other backend. Threading: one caller at a time per backend. */
#ifndef KERN_CPU_H
#define KERN_CPU_H

#include "kern_backend.h"

pd_status kern_cpu_backend_create(const kern_backend_config *cfg, kern_backend **out, pd_err *err);

#endif
