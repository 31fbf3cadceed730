/* call_params.h - the parameters of the driver's copy, memset and graph-launch calls as CUPTI hands them to
 * a callback (functionParams): each call's arguments in order, as in CUPTI's generated_cuda_meta.h, which
 * does not compile on its own. calls.c reads them; native/tests/call_params_check.c asserts every offset
 * read here against that header (a CPU test compiles it). */
#ifndef GC_CALL_PARAMS_H
#define GC_CALL_PARAMS_H

#include <stddef.h>
#include <cuda.h>

struct p_generic { CUdeviceptr dst, src; size_t bytes; CUstream stream; };   /* cuMemcpy(Async), DtoD */
struct p_htod { CUdeviceptr dst; const void *src; size_t bytes; CUstream stream; };
struct p_dtoh { void *dst; CUdeviceptr src; size_t bytes; CUstream stream; };
struct p_dtoa { CUarray dst; size_t off; CUdeviceptr src; size_t bytes; };
struct p_atod { CUdeviceptr dst; CUarray src; size_t off, bytes; };
struct p_htoa { CUarray dst; size_t off; const void *src; size_t bytes; CUstream stream; };
struct p_atoh { void *dst; CUarray src; size_t off, bytes; CUstream stream; };
struct p_atoa { CUarray dst; size_t doff; CUarray src; size_t soff, bytes; };
struct p_peer { CUdeviceptr dst; CUcontext dctx; CUdeviceptr src; CUcontext sctx; size_t bytes; CUstream stream; };
struct p_ptr { const void *p; CUstream stream; };      /* 2D, 3D, 3D peer (a descriptor); cuGraphLaunch (an exec) */
/* memsets: the value's type differs (unsigned char, short, int), never the offsets of what follows it */
struct p_set { CUdeviceptr dst; unsigned int value; size_t n; CUstream stream; };
struct p_set2d { CUdeviceptr dst; size_t pitch; unsigned int value; size_t width, height; CUstream stream; };
/* batches and copies with attributes: every copy of the batch is read from the caller's arrays */
struct p_batch { CUdeviceptr *dsts, *srcs; size_t *sizes; size_t count; CUmemcpyAttributes *attrs; size_t *attrs_idx;
                 size_t nattrs; CUstream stream; };                                  /* cuMemcpyBatchAsync_v2 */
struct p_batch1 { CUdeviceptr *dsts, *srcs; size_t *sizes; size_t count; CUmemcpyAttributes *attrs; size_t *attrs_idx;
                  size_t nattrs; size_t *fail; CUstream stream; };                    /* cuMemcpyBatchAsync (12.8) */
struct p_batch3d { size_t n; CUDA_MEMCPY3D_BATCH_OP *ops; unsigned long long flags; CUstream stream; };   /* _v2 */
struct p_batch3d1 { size_t n; CUDA_MEMCPY3D_BATCH_OP *ops; size_t *fail; unsigned long long flags; CUstream stream; };
struct p_attr { CUdeviceptr dst, src; size_t bytes; CUmemcpyAttributes *attr; CUstream stream; };
struct p_attr3d { CUDA_MEMCPY3D_BATCH_OP *op; unsigned long long flags; CUstream stream; };

#endif
