// Which instruction set this build was compiled for, and OpenMP's thread count (torch's runtime).
#include "common.h"
#include <omp.h>

KVS_EXPORT const char* kvs_isa() { return KVS_ISA_NAME; }

KVS_EXPORT int kvs_max_threads() { return omp_get_max_threads(); }
