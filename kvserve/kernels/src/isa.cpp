// Which instruction set this build was compiled for, from which sources, and OpenMP's thread count
// (torch's runtime).
#include "common.h"
#include <omp.h>

KVS_EXPORT const char* kvs_isa() { return KVS_ISA_NAME; }

// kvserve.kernels.source_digest() of the sources this library was built from (build.py passes it)
KVS_EXPORT const char* kvs_source_digest() { return KVS_SOURCE_DIGEST; }

KVS_EXPORT int kvs_max_threads() { return omp_get_max_threads(); }
