/* call_params_check.c - compiles only if every field calls.c reads (native/src/preload/call_params.h) sits where
 * CUPTI's generated_cuda_meta.h puts it, for each call calls.c follows (tests/unit/test_call_params.py
 * compiles it against the CUPTI headers the injector is built with). */
#include <stddef.h>
#include <cuda.h>
/* generated_cuda_meta.h names the v1 calls' types, which cuda.h no longer declares: stand-ins (unread) */
typedef unsigned int CUdeviceptr_v1;
typedef struct { int unused; } CUDA_MEMCPY2D_v1, CUDA_MEMCPY3D_v1, CUDA_ARRAY_DESCRIPTOR_v1, CUDA_ARRAY3D_DESCRIPTOR_v1;
#include <generated_cuda_meta.h>

#include "../src/preload/call_params.h"
#include "../src/core/managed_params.h"

#define AT(M, T, f, Tf) _Static_assert(offsetof(struct M, f) == offsetof(T, Tf), #T "." #Tf " is not " #M "." #f)
#define COPY(M, T, d, s) AT(M, T, dst, d); AT(M, T, src, s); AT(M, T, bytes, ByteCount)
#define STREAM(M, T) AT(M, T, stream, hStream)

COPY(p_generic, cuMemcpy_params, dst, src); COPY(p_generic, cuMemcpyAsync_params, dst, src);
STREAM(p_generic, cuMemcpyAsync_params); STREAM(p_generic, cuMemcpyAsync_ptsz_params);
COPY(p_generic, cuMemcpyDtoD_v2_params, dstDevice, srcDevice); COPY(p_generic, cuMemcpyDtoDAsync_v2_params, dstDevice, srcDevice);
STREAM(p_generic, cuMemcpyDtoDAsync_v2_params);
COPY(p_htod, cuMemcpyHtoD_v2_params, dstDevice, srcHost); COPY(p_htod, cuMemcpyHtoDAsync_v2_params, dstDevice, srcHost);
STREAM(p_htod, cuMemcpyHtoDAsync_v2_params); STREAM(p_htod, cuMemcpyHtoDAsync_v2_ptsz_params);
COPY(p_dtoh, cuMemcpyDtoH_v2_params, dstHost, srcDevice); COPY(p_dtoh, cuMemcpyDtoHAsync_v2_params, dstHost, srcDevice);
STREAM(p_dtoh, cuMemcpyDtoHAsync_v2_params);
COPY(p_dtoa, cuMemcpyDtoA_v2_params, dstArray, srcDevice);
COPY(p_atod, cuMemcpyAtoD_v2_params, dstDevice, srcArray);
COPY(p_htoa, cuMemcpyHtoA_v2_params, dstArray, srcHost); COPY(p_htoa, cuMemcpyHtoAAsync_v2_params, dstArray, srcHost);
STREAM(p_htoa, cuMemcpyHtoAAsync_v2_params);
COPY(p_atoh, cuMemcpyAtoH_v2_params, dstHost, srcArray); COPY(p_atoh, cuMemcpyAtoHAsync_v2_params, dstHost, srcArray);
STREAM(p_atoh, cuMemcpyAtoHAsync_v2_params);
COPY(p_atoa, cuMemcpyAtoA_v2_params, dstArray, srcArray);
COPY(p_peer, cuMemcpyPeer_params, dstDevice, srcDevice); COPY(p_peer, cuMemcpyPeerAsync_params, dstDevice, srcDevice);
AT(p_peer, cuMemcpyPeerAsync_params, dctx, dstContext); AT(p_peer, cuMemcpyPeerAsync_params, sctx, srcContext);
STREAM(p_peer, cuMemcpyPeerAsync_params);
AT(p_ptr, cuMemcpy2D_v2_params, p, pCopy); AT(p_ptr, cuMemcpy2DAsync_v2_params, p, pCopy); STREAM(p_ptr, cuMemcpy2DAsync_v2_params);
AT(p_ptr, cuMemcpy2DUnaligned_v2_params, p, pCopy);
AT(p_ptr, cuMemcpy3D_v2_params, p, pCopy); AT(p_ptr, cuMemcpy3DAsync_v2_params, p, pCopy); STREAM(p_ptr, cuMemcpy3DAsync_v2_params);
AT(p_ptr, cuMemcpy3DPeer_params, p, pCopy); AT(p_ptr, cuMemcpy3DPeerAsync_params, p, pCopy); STREAM(p_ptr, cuMemcpy3DPeerAsync_params);
AT(p_ptr, cuGraphLaunch_params, p, hGraph); STREAM(p_ptr, cuGraphLaunch_params); STREAM(p_ptr, cuGraphLaunch_ptsz_params);
AT(p_set, cuMemsetD8_v2_params, n, N); AT(p_set, cuMemsetD16_v2_params, n, N); AT(p_set, cuMemsetD32_v2_params, n, N);
AT(p_set, cuMemsetD8Async_params, n, N); AT(p_set, cuMemsetD16Async_params, n, N); AT(p_set, cuMemsetD32Async_params, n, N);
STREAM(p_set, cuMemsetD8Async_params); STREAM(p_set, cuMemsetD16Async_params); STREAM(p_set, cuMemsetD32Async_params);
AT(p_set2d, cuMemsetD2D8_v2_params, width, Width); AT(p_set2d, cuMemsetD2D8_v2_params, height, Height);
AT(p_set2d, cuMemsetD2D16_v2_params, width, Width); AT(p_set2d, cuMemsetD2D32_v2_params, height, Height);
AT(p_set2d, cuMemsetD2D8Async_params, height, Height); STREAM(p_set2d, cuMemsetD2D8Async_params);
STREAM(p_set2d, cuMemsetD2D16Async_params); STREAM(p_set2d, cuMemsetD2D32Async_params);
#define BATCH(M, T) AT(M, T, dsts, dsts); AT(M, T, srcs, srcs); AT(M, T, sizes, sizes); AT(M, T, count, count); \
    STREAM(M, T)
BATCH(p_batch, cuMemcpyBatchAsync_v2_params); BATCH(p_batch, cuMemcpyBatchAsync_v2_ptsz_params);
BATCH(p_batch1, cuMemcpyBatchAsync_params); BATCH(p_batch1, cuMemcpyBatchAsync_ptsz_params);
AT(p_batch3d, cuMemcpy3DBatchAsync_v2_params, n, numOps); AT(p_batch3d, cuMemcpy3DBatchAsync_v2_params, ops, opList);
STREAM(p_batch3d, cuMemcpy3DBatchAsync_v2_params);
AT(p_batch3d1, cuMemcpy3DBatchAsync_params, n, numOps); AT(p_batch3d1, cuMemcpy3DBatchAsync_params, ops, opList);
STREAM(p_batch3d1, cuMemcpy3DBatchAsync_params); STREAM(p_batch3d1, cuMemcpy3DBatchAsync_ptsz_params);
AT(p_attr, cuMemcpyWithAttributesAsync_params, dst, dst); AT(p_attr, cuMemcpyWithAttributesAsync_params, src, src);
AT(p_attr, cuMemcpyWithAttributesAsync_params, bytes, size); STREAM(p_attr, cuMemcpyWithAttributesAsync_params);
AT(p_attr3d, cuMemcpy3DWithAttributesAsync_params, op, op); STREAM(p_attr3d, cuMemcpy3DWithAttributesAsync_params);

/* managed memory (managed_params.h) */
AT(p_malloc, cuMemAllocManaged_params, dptr, dptr); AT(p_malloc, cuMemAllocManaged_params, bytes, bytesize);
AT(p_mpool, cuMemAllocFromPoolAsync_params, dptr, dptr); AT(p_mpool, cuMemAllocFromPoolAsync_params, bytes, bytesize);
AT(p_mpool, cuMemAllocAsync_params, dptr, dptr); AT(p_mpool, cuMemAllocAsync_params, bytes, bytesize);
AT(p_mpool, cuMemAllocFromPoolAsync_ptsz_params, bytes, bytesize); AT(p_mpool, cuMemAllocAsync_ptsz_params, bytes, bytesize);
AT(p_mfree, cuMemFree_v2_params, ptr, dptr); AT(p_mfree, cuMemFreeAsync_params, ptr, dptr);
AT(p_mfree, cuMemFreeAsync_ptsz_params, ptr, dptr);
AT(p_madvise, cuMemAdvise_params, dev, device); AT(p_madvise2, cuMemAdvise_v2_params, loc, location);
AT(p_mprefetch1, cuMemPrefetchAsync_params, bytes, count); AT(p_mprefetch1, cuMemPrefetchAsync_params, to, dstDevice);
AT(p_mprefetch1, cuMemPrefetchAsync_ptsz_params, to, dstDevice);
AT(p_mprefetch2, cuMemPrefetchAsync_v2_params, bytes, count); AT(p_mprefetch2, cuMemPrefetchAsync_v2_params, loc, location);
AT(p_mprefetch2, cuMemPrefetchAsync_v2_ptsz_params, loc, location);
#define MBATCH(T) AT(p_mbatch, T, dptrs, dptrs); AT(p_mbatch, T, sizes, sizes); AT(p_mbatch, T, count, count); \
    AT(p_mbatch, T, locs, prefetchLocs); AT(p_mbatch, T, loc_idx, prefetchLocIdxs); AT(p_mbatch, T, nlocs, numPrefetchLocs)
MBATCH(cuMemPrefetchBatchAsync_params); MBATCH(cuMemPrefetchBatchAsync_ptsz_params);
MBATCH(cuMemDiscardAndPrefetchBatchAsync_params); MBATCH(cuMemDiscardAndPrefetchBatchAsync_ptsz_params);

int main(void) { return 0; }
