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

// A decoded group's blocks b_begin .. b_end - 1 as the tile unit's B operand, a block at a time (GROUP_BF16 values):
// pair row p holds elements 2p, 2p + 1 of each of the 16 weight rows side by side. From the group's k-group rows
// (4 bytes of each weight row): bytes 4c, 4c + 1 make pair row 2 kg, bytes 4c + 2, 4c + 3 pair row 2 kg + 1.
inline void bf16_group(const QGroup& g, int64_t b_begin, int64_t b_end, uint16_t* out) {
    const __m512i even = _mm512_set_epi32(0x3d3c3938, 0x35343130, 0x2d2c2928, 0x25242120, 0x1d1c1918, 0x15141110,
                                          0x0d0c0908, 0x05040100, 0x3d3c3938, 0x35343130, 0x2d2c2928, 0x25242120,
                                          0x1d1c1918, 0x15141110, 0x0d0c0908, 0x05040100);
    const __m512i odd = _mm512_add_epi8(even, _mm512_set1_epi8(2));
    for (int64_t kg = 8 * b_begin; kg < 8 * b_end; ++kg) {
        const __m512i bytes = _mm512_loadu_si512(g.q + 64 * kg);
        uint16_t* pairs_out = out + 64 * (kg - 8 * b_begin);
        for (int half = 0; half < 2; ++half) {
            const __m256i pairs = _mm512_castsi512_si256(_mm512_permutexvar_epi8(half ? odd : even, bytes));
            const __m512i w = _mm512_cvtepu8_epi16(pairs);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)));
            _mm512_storeu_si512(pairs_out + 32 * half, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

// Blocks of a K slice: the slice's BF16 codes for a panel's groups (reread by every sixteen activation rows) fill
// half the host's L2, whatever K is, so that a panel holds AMX_GROUPS groups and each activation tile loaded from
// the L3 serves all of them (a whole-K panel of the 8B's 14,336-wide down projection held one group)
inline int64_t amx_slice_blocks(int64_t groups, int64_t l2_bytes) {
    const int64_t fits = l2_bytes / 2 / (groups * GROUP_BF16 * int64_t(sizeof(uint16_t)));
    return std::max<int64_t>(AMX_CHUNK, fits / AMX_CHUNK * AMX_CHUNK);
}

// The process's permission to use the tile registers (Linux asks for it once: arch_prctl)
inline bool amx_permitted() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

// The tile shapes amx_groups uses (TileQueue), a block a k-step: the activation rows' block in tile 2 or 6 (16 rows
// x 64 bytes), the group's block in tile 3 or 7 (16 pair rows x 64 bytes), the block's totals in tile 0 or 1 (16 x
// 16 float32), by turns: a block's loads and product need not wait for the last one's
struct alignas(64) TileShapes {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
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

// The tile unit's side of amx_groups: a block's product (the activation rows' tile, Bf16Rows, at v against the
// group's block of BF16 at w) into tile 0 or 1 by turns, its loads in tiles 2, 3 or 6, 7; its totals (16 x 16
// float32) stored only after the next block's product is issued, which a store of its own would wait for
struct TileQueue {
    float* pending = nullptr;
    bool pending_odd = false;

    void issue(const uint16_t* v, const uint16_t* w, float* out, bool odd) {
        if (odd) {
            _tile_loadd(6, v, 64);
            _tile_loadd(7, w, 64);
            _tile_zero(1);
            _tile_dpbf16ps(1, 6, 7);
        } else {
            _tile_loadd(2, v, 64);
            _tile_loadd(3, w, 64);
            _tile_zero(0);
            _tile_dpbf16ps(0, 2, 3);
        }
        flush();
        pending = out, pending_odd = odd;
    }
    void flush() {
        if (!pending) return;
        if (pending_odd) {
            _tile_stored(1, pending, 64);
        } else {
            _tile_stored(0, pending, 64);
        }
        pending = nullptr;
    }
};

// a tile's 1 KB (16 lines) into L1
inline void prefetch_tile(const uint16_t* at) {
    for (int line = 0; line < 16; ++line) _mm_prefetch(reinterpret_cast<const char*>(at) + 64 * line, _MM_HINT_T0);
}

// One step of amx_groups: a chunk of blocks from b0 against group gi (its BF16 codes at w, the activation tile's
// at v)
struct AmxStep {
    int64_t b0, gi, chunk;
    const uint16_t* w;
    const uint16_t* v;
};

// y[r * ldy + c] for AMX_ROWS activation rows (x; their BF16 tile at v: Bf16Rows::tile) and the ngroups decoded
// groups at `groups` (gbytes apart) of a panel's nw rows, over blocks b_begin .. b_end - 1 of K (their BF16 codes
// at wbf, (b_end - b_begin) * GROUP_BF16 a group), without the offsets: qdot_group's outputs (TilesInUse held).
// A slice after the first adds to the sums y holds: each output's chain of additions is the whole-K one.
template <int Q>
inline void amx_groups(const XRow* x, const uint16_t* v, int64_t K, const uint8_t* groups, int64_t gbytes,
                       const uint16_t* wbf, int64_t ngroups, int64_t nw, int64_t b_begin, int64_t b_end, float* y,
                       int64_t ldy) {
    static_assert(Q != KVS_Q6_K);
    alignas(64) float totals[2][AMX_CHUNK][256];  // a step's block totals, and the next step's
    alignas(64) float sums[AMX_GROUPS][AMX_ROWS][TILE_GROUP];  // each group's accumulators between chunks
    const int64_t slice = b_end - b_begin;
    // group g's columns of y and those of them the panel has (a last group short of rows keeps fewer)
    const auto columns = [&](int64_t g) { return TILE_GROUP * g; };
    const auto kept = [&](int64_t g) {
        return __mmask16((1u << std::min<int64_t>(TILE_GROUP, nw - columns(g))) - 1);
    };
    for (int64_t g0 = 0; g0 < ngroups; g0 += AMX_GROUPS) {
        const int64_t gn = std::min<int64_t>(AMX_GROUPS, ngroups - g0);
        for (int64_t gi = 0; gi < gn; ++gi)
            for (int r = 0; r < AMX_ROWS; ++r)
                _mm512_store_ps(sums[gi][r], b_begin == 0 ? _mm512_setzero_ps()
                                                          : _mm512_maskz_loadu_ps(kept(g0 + gi),
                                                                                  y + r * ldy + columns(g0 + gi)));
        // steps of (chunk, group), software-pipelined: the tile unit makes step s + 1's totals, a block at a time,
        // while the vector unit scales and adds step s's; step s + 2's codes and activations are fetched into L1
        const int64_t steps = (slice + AMX_CHUNK - 1) / AMX_CHUNK * gn;
        const auto step_at = [&](int64_t step) {
            const int64_t b0 = b_begin + step / gn * AMX_CHUNK, gi = step % gn;
            return AmxStep{b0, gi, std::min<int64_t>(AMX_CHUNK, b_end - b0),
                           wbf + ((g0 + gi) * slice + b0 - b_begin) * GROUP_BF16, v + AMX_ROWS * 32 * b0};
        };
        AmxStep cur = step_at(0);
        TileQueue tile_unit;
        for (int64_t j = 0; j < cur.chunk; ++j)
            tile_unit.issue(cur.v + AMX_ROWS * 32 * j, cur.w + GROUP_BF16 * j, totals[0][j], j % 2);
        tile_unit.flush();
        for (int64_t step = 0; step < steps; ++step) {
            const bool has_next = step + 1 < steps, has_after = step + 2 < steps;
            const AmxStep next = has_next ? step_at(step + 1) : cur, after = has_after ? step_at(step + 2) : cur;
            float (*tot)[256] = totals[step % 2];
            float (*next_tot)[256] = totals[(step + 1) % 2];
            const QGroup g = qgroup_at(const_cast<uint8_t*>(groups) + (g0 + cur.gi) * gbytes, K);
            __m512 acc[AMX_ROWS];
            for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_load_ps(sums[cur.gi][r]);
            for (int64_t j = 0; j < cur.chunk; ++j) {
                if (has_next && j < next.chunk)  // (a step's chunk is never shorter than the next one's)
                    tile_unit.issue(next.v + AMX_ROWS * 32 * j, next.w + GROUP_BF16 * j, next_tot[j], j % 2);
                if (has_after && j < after.chunk) {
                    prefetch_tile(after.w + GROUP_BF16 * j);
                    if (after.gi == 0) prefetch_tile(after.v + AMX_ROWS * 32 * j);  // a new chunk's activations
                }
                const int64_t b = cur.b0 + j;
                const __m512 dw = _mm512_loadu_ps(g.d + TILE_GROUP * b);
                // Q4_K's and Q5_K's total times its sub-scale as a float product: both exact floats, so the
                // product rounds the exact integer once, as converting the vector tile's integer product does
                __m512 scale = _mm512_setzero_ps();
                if constexpr (has_subscales(Q))
                    scale = _mm512_cvtepi32_ps(_mm512_loadu_si512(g.scale + TILE_GROUP * b));
#pragma GCC unroll 16
                for (int r = 0; r < AMX_ROWS; ++r) {
                    __m512 total = _mm512_load_ps(tot[j] + 16 * r);
                    // less the bias times the row's sum: two integers under 2^24, so exactly their difference
                    if constexpr (tile_bias(Q) != 0)
                        total = _mm512_sub_ps(total, _mm512_set1_ps(float(tile_bias(Q) * x[r].sum[b])));
                    if constexpr (has_subscales(Q)) total = _mm512_mul_ps(total, scale);
                    acc[r] = _mm512_fmadd_ps(total, _mm512_mul_ps(dw, _mm512_set1_ps(x[r].d[b])), acc[r]);
                }
            }
            for (int r = 0; r < AMX_ROWS; ++r) _mm512_store_ps(sums[cur.gi][r], acc[r]);
            tile_unit.flush();
            cur = next;
        }
        for (int64_t gi = 0; gi < gn; ++gi)
            for (int r = 0; r < AMX_ROWS; ++r)
                _mm512_mask_storeu_ps(y + r * ldy + columns(g0 + gi), kept(g0 + gi), _mm512_load_ps(sums[gi][r]));
    }
}

}  // namespace kvs
#endif  // KVS_ISA_AMX
