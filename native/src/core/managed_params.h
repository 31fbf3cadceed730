/* managed_params.h - the parameters of the driver's managed-memory calls as CUPTI hands them to a callback
 * (functionParams, generated_cuda_meta.h) and as interpose.c's wrappers lay them out: each call's arguments in
 * order. managed.c reads them; native/tests/call_params_check.c asserts the offsets against CUPTI's header. */
#ifndef GC_MANAGED_PARAMS_H
#define GC_MANAGED_PARAMS_H

#include <stddef.h>
#include <cuda.h>

struct p_malloc { CUdeviceptr *dptr; size_t bytes; unsigned int flags; };              /* cuMemAllocManaged */
struct p_mpool { CUdeviceptr *dptr; size_t bytes; void *pool_or_stream; };            /* cuMemAlloc(FromPool)Async */
struct p_mfree { CUdeviceptr ptr; };                                      /* cuMemFree_v2, cuMemFreeAsync */
struct p_madvise { CUdeviceptr ptr; size_t bytes; CUmem_advise advice; CUdevice dev; };          /* cuMemAdvise */
struct p_madvise2 { CUdeviceptr ptr; size_t bytes; CUmem_advise advice; CUmemLocation loc; };    /* cuMemAdvise_v2 */
struct p_mprefetch1 { CUdeviceptr ptr; size_t bytes; CUdevice to; CUstream stream; };  /* cuMemPrefetchAsync (12.x) */
struct p_mprefetch2 { CUdeviceptr ptr; size_t bytes; CUmemLocation loc; unsigned int flags; CUstream stream; }; /* _v2 */
/* cuMemPrefetchBatchAsync and cuMemDiscardAndPrefetchBatchAsync */
struct p_mbatch { CUdeviceptr *dptrs; size_t *sizes; size_t count; CUmemLocation *locs; size_t *loc_idx; size_t nlocs;
                  unsigned long long flags; CUstream stream; };

#endif
