// Gather/scatter copy kernel for kvbm copy plans.
//
// One launch moves every run of a plan: run i copies `len` bytes from
// `src_bases[run.src_region] + run.src_offset` to
// `dst_bases[run.dst_region] + run.dst_offset`. Pinned host memory is read
// and written through its device pointer, so the same kernel serves
// host-to-device, device-to-host and device-to-device plans.
//
// Work split: workers (warps, or whole CTAs) walk "work items" with a
// stride. When there are more workers than runs, each run is cut into
// `workers / n_runs` parts (cut on 16-byte boundaries so relative alignment
// is kept); otherwise each worker copies whole runs. A worker's threads each
// hold up to UNROLL independent 16-byte loads in flight: bandwidth needs
// bytes in flight, not SMs, which is what lets a handful of CTAs reach line
// rate over PCIe while leaving the rest of the GPU to the model.
//
// Alignment: the widest vector (16, 8, 4 or 1 bytes) that source and
// destination share modulo its size is used; bytes before the first aligned
// address and after the last whole vector are copied one by one.
//
// A plan of up to INLINE_RUNS runs can instead travel inside the launch's
// parameters (`kvbm_copy_inline`): nothing is uploaded before the launch.
//
// Build with `cargo xtask kernels`; the fatbin is committed next to this file.

#include <stdint.h>

// Must match `CopyRun` in kvbm-layout / kvbm-transfer (#[repr(C)], 40 bytes).
struct CopyRun {
    uint32_t src_region;
    uint64_t src_offset;
    uint32_t dst_region;
    uint64_t dst_offset;
    uint64_t len;
};

static_assert(sizeof(CopyRun) == 40, "CopyRun layout must match the Rust side");

#define UNROLL 8

template <typename T>
__device__ __forceinline__ T load_stream(const T* p) { return *p; }
template <>
__device__ __forceinline__ uint4 load_stream<uint4>(const uint4* p) { return __ldcs(p); }

template <typename T>
__device__ __forceinline__ void store_stream(T* p, T v) { *p = v; }
template <>
__device__ __forceinline__ void store_stream<uint4>(uint4* p, uint4 v) { __stcs(p, v); }

// Copies `len` bytes where `src` and `dst` are congruent modulo sizeof(T),
// with `nthreads` threads of which this is `tid`. Each pass issues up to
// UNROLL independent loads per thread (predicated at the end) before the
// stores, so short runs still keep many loads in flight.
template <typename T>
__device__ __forceinline__ void copy_aligned(const uint8_t* src, uint8_t* dst, uint64_t len,
                                             uint64_t tid, uint64_t nthreads) {
    const uint64_t a = sizeof(T);
    uint64_t head = (a - ((uintptr_t)src & (a - 1))) & (a - 1);
    if (head > len) head = len;
    for (uint64_t i = tid; i < head; i += nthreads) dst[i] = src[i];

    const T* vs = reinterpret_cast<const T*>(src + head);
    T* vd = reinterpret_cast<T*>(dst + head);
    const uint64_t nvec = (len - head) / a;
    for (uint64_t i = tid; i < nvec; i += UNROLL * nthreads) {
        T r[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const uint64_t j = i + k * nthreads;
            if (j < nvec) r[k] = load_stream(vs + j);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const uint64_t j = i + k * nthreads;
            if (j < nvec) store_stream(vd + j, r[k]);
        }
    }

    const uint64_t tail = head + nvec * a;
    for (uint64_t j = tail + tid; j < len; j += nthreads) dst[j] = src[j];
}

__device__ __forceinline__ void copy_bytes(const uint8_t* src, uint8_t* dst, uint64_t len,
                                           uint64_t tid, uint64_t nthreads) {
    const uintptr_t diff = (uintptr_t)src ^ (uintptr_t)dst;
    if ((diff & 15) == 0) {
        copy_aligned<uint4>(src, dst, len, tid, nthreads);
    } else if ((diff & 7) == 0) {
        copy_aligned<uint2>(src, dst, len, tid, nthreads);
    } else if ((diff & 3) == 0) {
        copy_aligned<uint32_t>(src, dst, len, tid, nthreads);
    } else {
        copy_aligned<uint8_t>(src, dst, len, tid, nthreads);
    }
}

// Who this thread works for: with `per_warp` each warp is a worker (many
// runs in flight per CTA, for small runs and small grids), otherwise each
// CTA is.
struct Worker {
    uint64_t worker, workers, tid, nthreads;
};

__device__ __forceinline__ Worker this_worker(bool per_warp) {
    if (per_warp) {
        const uint64_t warps_per_cta = blockDim.x / 32;
        return {(uint64_t)blockIdx.x * warps_per_cta + threadIdx.x / 32,
                (uint64_t)gridDim.x * warps_per_cta, threadIdx.x % 32u, 32};
    }
    return {blockIdx.x, gridDim.x, threadIdx.x, blockDim.x};
}

// Walks the work items of `n_runs` runs: `run_at(r)` gives run r's source,
// destination and length, and each item copies its part of one run.
template <typename RunAt>
__device__ __forceinline__ void copy_items(uint64_t n_runs, Worker me, RunAt run_at) {
    const uint64_t parts = me.workers > n_runs ? me.workers / n_runs : 1;
    const uint64_t items = n_runs * parts;
    for (uint64_t w = me.worker; w < items; w += me.workers) {
        const uint8_t* src;
        uint8_t* dst;
        uint64_t run_len;
        run_at(w / parts, src, dst, run_len);
        const uint64_t part = w % parts;
        uint64_t part_len = (run_len + parts - 1) / parts;
        part_len = (part_len + 15) & ~(uint64_t)15;
        const uint64_t begin = part * part_len;
        if (begin >= run_len) continue;
        uint64_t len = run_len - begin;
        if (len > part_len) len = part_len;
        copy_bytes(src + begin, dst + begin, len, me.tid, me.nthreads);
    }
}

// `per_warp` != 0: each warp is a worker; 0: each CTA is.
extern "C" __global__ void kvbm_copy_runs(const CopyRun* __restrict__ runs,
                                          uint32_t n_runs,
                                          const uint64_t* __restrict__ src_bases,
                                          const uint64_t* __restrict__ dst_bases,
                                          uint32_t per_warp) {
    if (n_runs == 0) return;
    copy_items(n_runs, this_worker(per_warp != 0),
               [&](uint64_t r, const uint8_t*& src, uint8_t*& dst, uint64_t& len) {
                   const CopyRun run = runs[r];
                   src = reinterpret_cast<const uint8_t*>(src_bases[run.src_region] + run.src_offset);
                   dst = reinterpret_cast<uint8_t*>(dst_bases[run.dst_region] + run.dst_offset);
                   len = run.len;
               });
}

// Runs a launch carries in its parameters (see `InlineRuns`).
#define INLINE_RUNS 64

// A small plan passed by value: no descriptor upload before the launch and
// no read of descriptors from memory in the kernel. Addresses are resolved
// on the host. Must match `InlineRuns` on the Rust side (#[repr(C)]).
struct InlineRuns {
    uint64_t src[INLINE_RUNS];
    uint64_t dst[INLINE_RUNS];
    uint64_t len[INLINE_RUNS];
    uint32_t n_runs;
};

static_assert(sizeof(InlineRuns) == 3 * 8 * INLINE_RUNS + 8, "InlineRuns layout must match the Rust side");

// Every warp is a worker.
extern "C" __global__ void kvbm_copy_inline(const __grid_constant__ InlineRuns plan) {
    if (plan.n_runs == 0) return;
    copy_items(plan.n_runs, this_worker(true),
               [&](uint64_t r, const uint8_t*& src, uint8_t*& dst, uint64_t& len) {
                   src = reinterpret_cast<const uint8_t*>(plan.src[r]);
                   dst = reinterpret_cast<uint8_t*>(plan.dst[r]);
                   len = plan.len[r];
               });
}
