// Block checksums of device memory, for verify mode.
//
// Computes, for each descriptor (a piece of one chunk of a block), the sum
// of the terms of the piece's bytes as kvbm-transfer's `checksum` module
// defines them, and adds it to the sum of the descriptor's block. Terms add
// (mod 2^64), so any thread may sum any words in any order; the host
// finishes each block's sum. A piece starts `first` words into its chunk
// (the host cuts chunks into pieces so that a lone block still keeps
// hundreds of warps busy), and each word is keyed by its place in the
// chunk.
//
// Work split: one warp per descriptor at a time, grid-striding over
// descriptors; each lane reads 16-byte vectors (8-byte words where the
// piece is only 8-byte aligned, single bytes where it is not even that).
//
// Build with `cargo xtask kernels`; the fatbin is committed next to this file.

#include <stdint.h>

// Must match `SumChunk` in kvbm-transfer (#[repr(C)], 24 bytes).
struct SumChunk {
    uint64_t addr;   // the piece's first byte
    uint32_t len;    // bytes in the piece
    uint32_t first;  // words of the chunk before the piece
    uint32_t block;
    uint32_t chunk;
};

static_assert(sizeof(SumChunk) == 24, "SumChunk layout must match the Rust side");

#define KEY_MUL 0x9E3779B97F4A7C15ull
#define KEY_ADD 0x165667B19E3779F9ull
#define CHUNK_SHIFT 40

__device__ __forceinline__ uint64_t key_of(uint32_t chunk, uint64_t word) {
    return ((((uint64_t)chunk) << CHUNK_SHIFT) | word) * KEY_MUL + KEY_ADD;
}

__device__ __forceinline__ uint64_t term(uint64_t w, uint64_t k) {
    const uint64_t x = w ^ k;
    const uint64_t product = (uint64_t)(uint32_t)x * (uint64_t)(uint32_t)(x >> 32);
    return product + ((w << 32) | (w >> 32));
}

// The word at index `j` of a chunk of `len` bytes at `p`, zero-padded past
// the end, read byte by byte.
__device__ __forceinline__ uint64_t word_bytes(const uint8_t* p, uint64_t len, uint64_t j) {
    uint64_t w = 0;
    for (int b = 0; b < 8; ++b) {
        const uint64_t at = j * 8 + b;
        if (at < len) w |= ((uint64_t)p[at]) << (8 * b);
    }
    return w;
}

// This lane's share of the terms of one piece.
__device__ __forceinline__ uint64_t chunk_terms(const SumChunk& c, uint32_t lane, uint32_t lanes) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(c.addr);
    const uint64_t words = (c.len + 7) / 8;
    uint64_t sum = 0;
    uint64_t first = 0;
    if ((c.addr & 15) == 0) {
        // Two words per 16-byte load, four loads in flight per lane.
        const uint4* v = reinterpret_cast<const uint4*>(p);
        const uint64_t nvec = c.len / 16;
        for (uint64_t i = lane; i < nvec; i += 4 * (uint64_t)lanes) {
            uint4 r[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const uint64_t at = i + u * (uint64_t)lanes;
                if (at < nvec) r[u] = __ldcs(v + at);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const uint64_t at = i + u * (uint64_t)lanes;
                if (at < nvec) {
                    const uint64_t w0 = ((uint64_t)r[u].y << 32) | r[u].x;
                    const uint64_t w1 = ((uint64_t)r[u].w << 32) | r[u].z;
                    sum += term(w0, key_of(c.chunk, c.first + 2 * at));
                    sum += term(w1, key_of(c.chunk, c.first + 2 * at + 1));
                }
            }
        }
        first = nvec * 2;
    } else if ((c.addr & 7) == 0) {
        const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
        const uint64_t whole = c.len / 8;
        for (uint64_t j = lane; j < whole; j += lanes) sum += term(w[j], key_of(c.chunk, c.first + j));
        first = whole;
    }
    for (uint64_t j = first + lane; j < words; j += lanes) {
        sum += term(word_bytes(p, c.len, j), key_of(c.chunk, c.first + j));
    }
    return sum;
}

extern "C" __global__ void kvbm_block_sums(const SumChunk* __restrict__ chunks, uint32_t n,
                                           unsigned long long* __restrict__ sums) {
    const uint32_t lane = threadIdx.x % 32;
    const uint64_t warps_per_cta = blockDim.x / 32;
    const uint64_t warp = (uint64_t)blockIdx.x * warps_per_cta + threadIdx.x / 32;
    const uint64_t warps = (uint64_t)gridDim.x * warps_per_cta;
    for (uint64_t i = warp; i < n; i += warps) {
        const SumChunk c = chunks[i];
        uint64_t s = chunk_terms(c, lane, 32);
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) s += __shfl_down_sync(0xffffffffu, s, offset);
        if (lane == 0) atomicAdd(sums + c.block, (unsigned long long)s);
    }
}
