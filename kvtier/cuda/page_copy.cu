// Gather and scatter of fragmented KV page segments, compiled at run time through CuPy RawModule.
//
// An engine's page is many segments (one per layer, per K and V) scattered across its pool. A
// store gathers them into one contiguous staging buffer so a single DMA can move it; a recall
// scatters a staging buffer back. One thread block per segment; 16-byte vector copies when both
// ends are 16-byte aligned (the common case: segments are multiples of head_dim * dtype bytes),
// a byte loop otherwise.

#if defined(__CUDACC_RTC__)
// NVRTC (what CuPy's RawModule compiles with) ships no C++ standard library headers.
typedef unsigned char uint8_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#else
#include <cstdint>
#endif

namespace {

__device__ __forceinline__ void copy_segment(const uint8_t* __restrict__ src,
                                             uint8_t* __restrict__ dst, uint64_t num_bytes) {
    const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    uint64_t done = 0;
    if (aligned) {
        const uint64_t num_vectors = num_bytes / 16;
        const uint4* src4 = reinterpret_cast<const uint4*>(src);
        uint4* dst4 = reinterpret_cast<uint4*>(dst);
        const uint64_t stride = blockDim.x;
        uint64_t i = threadIdx.x;
        // Four loads in flight per thread before their stores: a copy over PCIe or out of HBM
        // is latency-bound, and one load at a time leaves the link or the memory mostly idle.
        for (; i + 3 * stride < num_vectors; i += 4 * stride) {
            const uint4 a = src4[i], b = src4[i + stride], c = src4[i + 2 * stride],
                        d = src4[i + 3 * stride];
            dst4[i] = a;
            dst4[i + stride] = b;
            dst4[i + 2 * stride] = c;
            dst4[i + 3 * stride] = d;
        }
        for (; i < num_vectors; i += stride) {
            dst4[i] = src4[i];
        }
        done = num_vectors * 16;
    }
    for (uint64_t i = done + threadIdx.x; i < num_bytes; i += blockDim.x) {
        dst[i] = src[i];
    }
}

}  // namespace

// dst_base + dst_offsets[s] <- src_ptrs[s], lengths[s] bytes, for every segment s.
extern "C" __global__ void gather_segments(const uint64_t* __restrict__ src_ptrs,
                                           const uint64_t* __restrict__ dst_offsets,
                                           const uint64_t* __restrict__ lengths,
                                           uint64_t num_segments, uint8_t* __restrict__ dst_base) {
    for (uint64_t s = blockIdx.x; s < num_segments; s += gridDim.x) {
        copy_segment(reinterpret_cast<const uint8_t*>(src_ptrs[s]), dst_base + dst_offsets[s],
                     lengths[s]);
    }
}

// dst_ptrs[s] <- src_base + src_offsets[s], lengths[s] bytes, for every segment s.
extern "C" __global__ void scatter_segments(const uint8_t* __restrict__ src_base,
                                            const uint64_t* __restrict__ src_offsets,
                                            const uint64_t* __restrict__ lengths,
                                            uint64_t num_segments, const uint64_t* __restrict__ dst_ptrs) {
    for (uint64_t s = blockIdx.x; s < num_segments; s += gridDim.x) {
        copy_segment(src_base + src_offsets[s], reinterpret_cast<uint8_t*>(dst_ptrs[s]),
                     lengths[s]);
    }
}
