/*
 * copy_class.c - a copy's direction and host memory kind from its two ends, as the driver knows their pointers. One
 * classifier for every copy the census sizes itself: a copy call's arguments (calls.c) and a graph's memcpy nodes
 * (graphs.c). Pageable host memory is what the driver does not know; managed memory is OTHER.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>

#include <cuda.h>

#include "gpu_census.h"
#include "internal.h"

static CUresult (*g_ptr_attr)(void *, CUpointer_attribute, CUdeviceptr);

int gc_copy_class_start(void)
{
    if (g_ptr_attr) return 0;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda) *(void **)&g_ptr_attr = dlsym(cuda, "cuPointerGetAttribute");
    return g_ptr_attr ? 0 : -1;
}

struct side { int host, mem, dev; };

/* One end of a copy: host or device, its memory kind, its device (-1: unknown). */
static struct side side_of(CUmemorytype type, const void *host, CUdeviceptr dptr)
{
    struct side s = {0, GC_MEM_DEVICE, -1};
    unsigned int mt = 0, managed = 0;
    if (!g_ptr_attr) { /* never, after gc_copy_class_start(): the API's own word then */
        if (type == CU_MEMORYTYPE_HOST) s.host = 1, s.mem = GC_MEM_OTHER;
        return s;
    }
    int ord = -1;
    switch (type) {
    case CU_MEMORYTYPE_HOST:
        /* registered or cudaHostAlloc'd memory is known to the driver; pageable memory is not */
        s.host = 1;
        s.mem = g_ptr_attr(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)host) == CUDA_SUCCESS
                    ? GC_MEM_PINNED : GC_MEM_PAGEABLE;
        return s;
    case CU_MEMORYTYPE_ARRAY:
        return s;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED:
    default:
        if (g_ptr_attr(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dptr) != CUDA_SUCCESS) {
            if (type == CU_MEMORYTYPE_UNIFIED) s.host = 1, s.mem = GC_MEM_PAGEABLE;
            return s;
        }
        if (g_ptr_attr(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, dptr) == CUDA_SUCCESS && managed) {
            s.mem = GC_MEM_OTHER;
            return s;
        }
        if (mt == CU_MEMORYTYPE_HOST) {
            s.host = 1;
            s.mem = GC_MEM_PINNED;
            return s;
        }
        if (g_ptr_attr(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dptr) == CUDA_SUCCESS) s.dev = ord;
        return s;
    }
}

void gc_copy_class(CUmemorytype src_type, const void *src_host, CUdeviceptr src_dev,
                   CUmemorytype dst_type, const void *dst_host, CUdeviceptr dst_dev, int *dir, int *mem, int *peer_dev)
{
    struct side src = side_of(src_type, src_host, src_dev), dst = side_of(dst_type, dst_host, dst_dev);
    *peer_dev = -1;
    if (src.host && dst.host) *dir = GC_DIR_HTOH, *mem = src.mem;
    else if (src.host) *dir = GC_DIR_HTOD, *mem = src.mem;
    else if (dst.host) *dir = GC_DIR_DTOH, *mem = dst.mem;
    else if (src.dev >= 0 && dst.dev >= 0 && src.dev != dst.dev) *dir = GC_DIR_PTOP, *mem = GC_MEM_DEVICE, *peer_dev = dst.dev;
    else *dir = GC_DIR_DTOD, *mem = GC_MEM_DEVICE;
}

