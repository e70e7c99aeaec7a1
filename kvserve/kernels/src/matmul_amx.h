// The prefill tile on Intel's AMX (the `amx` build: AVX-512 plus AMX's tiles): sixteen activation rows against a
// panel's decoded groups (matmul_tile.h) in the tile unit, each block's exact total then scaled and added by the
// AVX-512 tile's own float operations, so every output has the same bits as on the other builds.
//
// Exact in BF16: a block's total is sum_k u[k] * v[k], u the group's stored byte (<= 255: 8 significant bits) and
// v = q * m the activation's int8 times its sub-block's power of two (7 significant bits): both are BF16 values,
// each product is exact in float32, and every partial sum of a block (< 32 * 255 * 1016 < 2^24) is an integer
// float32 holds, so TDPBF16PS adds them without rounding, in any order. One tile product a block (K = 32), where
// AMX-INT8 would need v split in two bytes, and its result is already the float the vector tile converts its
// integer total to. Not Q6_K (matmul.cpp says why).
#pragma once
#include "matmul_tile.h"

#if defined(KVS_ISA_AMX)
#include <sys/syscall.h>
#include <unistd.h>

namespace kvs {

constexpr int AMX_ROWS = 16;    // activation rows a tile multiplies: a tile register's 16 rows
// calls of fewer rows run the vector tiles: a panel's BF16 codes cost about two tile steps to make, paid back over
// eight (1536 x 2048 Q4_K, 2 threads: even with the vector tiles at 64 and 128 rows, 1.17x faster at 256)
constexpr int64_t AMX_MIN_ROWS = 8 * AMX_ROWS;
constexpr int AMX_CHUNK = 8;    // blocks whose totals the tile unit makes before the vector unit reads them
constexpr int AMX_GROUPS = 16;  // decoded groups a pass over a chunk's activation rows takes (from L1 after the first)
constexpr int64_t GROUP_BF16 = 512;  // BF16 values of a group's block: 16 pair rows x 16 weight rows x 2

// Activation rows as BF16 (v = q * m) laid out as the tile unit reads them: for each AMX_ROWS rows, block by block,
// the rows' 32 values side by side (a tile's 1 KB in one piece: the hardware prefetcher follows it, where rows
// K apart made every tile load wait on 16 misses)
struct Bf16Rows {
    std::vector<uint16_t> v;
    void fit(int64_t T, int64_t K) {
        if (int64_t(v.size()) < T * K) v.resize(T * K);
    }
    uint16_t* tile(int64_t t, int64_t K) { return &v[t / AMX_ROWS * AMX_ROWS * K]; }  // rows t .. t + 15 (t % 16 == 0)
};

// row t's blocks into its place: q widened to int16 times its pair's multiplier (XRow::mult, one int16 per two
// elements, doubled into both halves of a 32-bit lane), then to float and BF16 (exact: at most 11 bits, 7
// significant)
inline void bf16_row(const XRow& x, int64_t K, Bf16Rows& rows, int64_t t) {
    uint16_t* out = rows.tile(t, K) + t % AMX_ROWS * 32;
    for (int64_t b = 0; b < K / 32; ++b) {
        const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * b)));
        const __m512i m = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.mult + 16 * b)));
        const __m512i v = _mm512_mullo_epi16(q, _mm512_or_si512(m, _mm512_slli_epi32(m, 16)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
        _mm512_storeu_si512(out + AMX_ROWS * 32 * b, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// A decoded group's codes as the tile unit's B operand, a block at a time (GROUP_BF16 values): pair row p holds
// elements 2p, 2p + 1 of each of the 16 weight rows side by side. From the group's k-group rows (4 bytes of each
// weight row): bytes 4c, 4c + 1 make pair row 2 kg, bytes 4c + 2, 4c + 3 pair row 2 kg + 1.
inline void bf16_group(const QGroup& g, int64_t nb, uint16_t* out) {
    const __m512i even = _mm512_set_epi32(0x3d3c3938, 0x35343130, 0x2d2c2928, 0x25242120, 0x1d1c1918, 0x15141110,
                                          0x0d0c0908, 0x05040100, 0x3d3c3938, 0x35343130, 0x2d2c2928, 0x25242120,
                                          0x1d1c1918, 0x15141110, 0x0d0c0908, 0x05040100);
    const __m512i odd = _mm512_add_epi8(even, _mm512_set1_epi8(2));
    for (int64_t kg = 0; kg < 8 * nb; ++kg) {
        const __m512i bytes = _mm512_loadu_si512(g.q + 64 * kg);
        for (int half = 0; half < 2; ++half) {
            const __m256i pairs = _mm512_castsi512_si256(_mm512_permutexvar_epi8(half ? odd : even, bytes));
            const __m512i w = _mm512_cvtepu8_epi16(pairs);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)));
            _mm512_storeu_si512(out + 64 * kg + 32 * half, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

// The process's permission to use the tile registers (Linux asks for it once: arch_prctl)
inline bool amx_permitted() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

// The tile shapes amx_groups uses, a block a k-step: the activation rows' block in tile 2 (16 rows x 64 bytes), the
// group's block in tile 3 (16 pair rows x 64 bytes), the totals of consecutive blocks in tiles 0 and 1 by turns
// (16 x 16 float32: the next product need not wait for a store)
struct alignas(64) TileShapes {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16};
};

// The shapes loaded for one thread's share of a call and released after it: another user of the tile unit on
// the same thread (oneDNN under torch, on the calling thread) loads its own shapes, and releases them
struct TilesInUse {
    bool on;
    explicit TilesInUse(bool use) : on(use) {
        static const TileShapes shapes;
        if (on) _tile_loadconfig(&shapes);
    }
    ~TilesInUse() {
        if (on) _tile_release();
    }
};

// a block of the activation rows' tile (Bf16Rows) at v against the group's block of BF16 at wb, its totals stored
// at out (16 x 16 float32) from tile 0 (even blocks) or 1 (odd)
inline void tile_step(const uint16_t* v, const uint16_t* wb, float* out, bool odd) {
    _tile_loadd(2, v, 64);
    _tile_loadd(3, wb, 64);
    if (odd) {
        _tile_zero(1);
        _tile_dpbf16ps(1, 2, 3);
        _tile_stored(1, out, 64);
    } else {
        _tile_zero(0);
        _tile_dpbf16ps(0, 2, 3);
        _tile_stored(0, out, 64);
    }
}

// y[r * ldy + c] for AMX_ROWS activation rows (x; their BF16 tile at v: Bf16Rows::tile) and the ngroups decoded
// groups at `groups` (gbytes apart; their BF16 codes at wbf, nb * GROUP_BF16 a group) of a panel's nw rows,
// without the offsets: qdot_group's outputs (TilesInUse held)
template <int Q>
inline void amx_groups(const XRow* x, const uint16_t* v, int64_t K, const uint8_t* groups, int64_t gbytes,
                       const uint16_t* wbf, int64_t ngroups, int64_t nw, int64_t nb, float* y, int64_t ldy) {
    static_assert(Q != KVS_Q6_K);
    alignas(64) float totals[AMX_CHUNK][256];
    alignas(64) float sums[AMX_GROUPS][AMX_ROWS][TILE_GROUP];  // each group's accumulators between chunks
    for (int64_t g0 = 0; g0 < ngroups; g0 += AMX_GROUPS) {
        const int64_t gn = std::min<int64_t>(AMX_GROUPS, ngroups - g0);
        std::memset(sums, 0, sizeof(sums));
        for (int64_t b0 = 0; b0 < nb; b0 += AMX_CHUNK) {
            const int64_t chunk = std::min<int64_t>(AMX_CHUNK, nb - b0);
            for (int64_t gi = 0; gi < gn; ++gi) {
                const QGroup g = qgroup_at(const_cast<uint8_t*>(groups) + (g0 + gi) * gbytes, K);
                const uint16_t* wb = wbf + (g0 + gi) * nb * GROUP_BF16 + b0 * GROUP_BF16;
                for (int64_t j = 0; j < chunk; ++j)
                    tile_step(v + AMX_ROWS * 32 * (b0 + j), wb + GROUP_BF16 * j, totals[j], j % 2);
                __m512 acc[AMX_ROWS];
                for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_load_ps(sums[gi][r]);
                for (int64_t j = 0; j < chunk; ++j) {
                    const int64_t b = b0 + j;
                    const __m512 dw = _mm512_loadu_ps(g.d + TILE_GROUP * b);
                    // Q4_K's and Q5_K's total times its sub-scale as a float product: both exact floats, so the
                    // product rounds the exact integer once, as converting the vector tile's integer product does
                    __m512 scale = _mm512_setzero_ps();
                    if constexpr (has_subscales(Q)) scale = _mm512_cvtepi32_ps(_mm512_loadu_si512(g.scale + TILE_GROUP * b));
#pragma GCC unroll 16
                    for (int r = 0; r < AMX_ROWS; ++r) {
                        __m512 total = _mm512_load_ps(totals[j] + 16 * r);
                        // less the bias times the row's sum: two integers under 2^24, so exactly their difference
                        if constexpr (tile_bias(Q) != 0)
                            total = _mm512_sub_ps(total, _mm512_set1_ps(float(tile_bias(Q) * x[r].sum[b])));
                        if constexpr (has_subscales(Q)) total = _mm512_mul_ps(total, scale);
                        acc[r] = _mm512_fmadd_ps(total, _mm512_mul_ps(dw, _mm512_set1_ps(x[r].d[b])), acc[r]);
                    }
                }
                for (int r = 0; r < AMX_ROWS; ++r) _mm512_store_ps(sums[gi][r], acc[r]);
            }
        }
        for (int64_t gi = 0; gi < gn; ++gi) {
            const int64_t c0 = TILE_GROUP * (g0 + gi), cn = std::min<int64_t>(TILE_GROUP, nw - c0);
            for (int r = 0; r < AMX_ROWS; ++r)
                for (int64_t c = 0; c < cn; ++c) y[r * ldy + c0 + c] = sums[gi][r][c];
        }
    }
}

}  // namespace kvs
#endif  // KVS_ISA_AMX
