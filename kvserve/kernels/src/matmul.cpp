// y[T, N] = x[T, K] @ W^T with W in a GGUF format (the file's own bytes, one row of blocks per output),
// x and y float32. Block formats round each activation row to int8 blocks of 32 once; each thread
// takes a contiguous share of the N weight rows (block formats' prefill: panels of them, handed out
// dynamically), decodes them a few at a time (8-bit codes for block formats, float32 for float
// formats; once per call, or once per pass over an L3's worth of activation rows: prefill_pass_rows),
// then runs every tile of up to TILE_ROWS activation rows against them (matmul_quant.h's and
// matmul_tile.h's dot tiles; the block formats' offset terms as a pass of their own).
// Invariance: y[t, n] is one dot chain over row t of x and the decoded row n of W, in one order; threads
// split N only, and T and N are tiled without changing any element's operations.
#include "team.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "matmul_amx.h"
#include "matmul_direct.h"
#include "matmul_tile.h"

namespace kvs {
namespace {

constexpr int TILE_ROWS = 4;              // activation rows sharing each decoded weight row in registers
constexpr int64_t DIRECT_ROWS = KVS_DECODE_ROWS;  // up to this many rows: weights decoded in registers, no scratch
constexpr int64_t L1_BYTES = 24 * 1024;  // decoded rows for a few activation rows: stay in L1
constexpr int64_t L2_BYTES = 96 * 1024;  // decoded rows reread by every tile of a prefill chunk: in L2
constexpr int64_t PANELS_PER_THREAD = 4;  // prefill: weight panels a thread takes at least (dynamically)
constexpr int64_t L3_FALLBACK_BYTES = 32 << 20;  // where the host does not say (one CCD's L3 on Zen 3, 4 and 5)
constexpr int64_t CHUNK_BYTES = 16384;    // decode: weight bytes a thread takes at a time from a share

// ---------------------------------------------------------------- the format table
//
// Every row of kFormatRows (quant_formats.h) with its kernels, built from the rows at compile time:
//   to_float     one weight row -> float32 (matmul_quant.h decode_row: float formats' matmul, embeddings)
//   to_group     one weight row -> a row of a prefill tile group (matmul_tile.h decode_row_q)
//   tile[R-1]    R activation rows x one decoded group (matmul_tile.h qdot_group)
//   decode_rows  R <= DIRECT_ROWS activation rows x weight rows lo..hi decoded in registers (matmul_direct.h
//                qdot_direct_rows: qdot_direct32 for the 32-element formats, qdot_directk for the K formats,
//                qdot_interleaved for their interleaved twins)
// (and, for the interleaved twins on CAN_CHAIN_SUMS builds, decode rows with their sums chained: matmul_chained.cpp,
// used where the host's tuning names the base format: direct_rows)
// An interleaved twin has its decode rows only: everything else runs its base format's kernels on rows
// put back in the file's order (interleave.h file_row).

using ToFloatFn = void (*)(const uint8_t*, int64_t, float*);
using ToGroupFn = void (*)(const uint8_t*, int64_t, const QGroup&, int);
using GroupFn = void (*)(const XRow*, const QGroup&, int, int64_t, float*, int64_t);
#if defined(KVS_ISA_AMX)
using AmxGroupsFn = void (*)(const XRow*, const uint16_t*, int64_t, const uint8_t*, int64_t, const uint16_t*, int64_t,
                             int64_t, int64_t, int64_t, float*, int64_t);
#endif

struct FormatKernels {
    const FormatRow* row;
    ToFloatFn to_float;
    ToGroupFn to_group;                 // block formats
    GroupFn tile[TILE_ROWS];            // block formats
    DirectFn decode_rows[DIRECT_ROWS];  // block formats, SIMD builds
#if defined(KVS_ISA_AMX)
    AmxGroupsFn amx = nullptr;          // block formats: AMX_ROWS activation rows x a panel's decoded groups
#endif
};

template <int Q, size_t... R>
constexpr FormatKernels kernels_row(std::index_sequence<R...>) {
    static_assert(sizeof...(R) == DIRECT_ROWS && TILE_ROWS <= DIRECT_ROWS);
    if constexpr (is_float_type(Q)) {
        return {&format_row(Q), decode_row<Q>, nullptr, {}, {}};
    } else if constexpr (format_row(Q).group_rows > 1) {
        FormatKernels row{&format_row(Q), nullptr, nullptr, {}, {}};
#if KVS_SIMD
        ((row.decode_rows[R] = qdot_direct_rows<Q, int(R) + 1>), ...);
#endif
        return row;
    } else {
        FormatKernels row{&format_row(Q), decode_row<Q>, decode_row_q<Q>,
                          {qdot_group<Q, 1>, qdot_group<Q, 2>, qdot_group<Q, 3>, qdot_group<Q, 4>}, {}};
#if KVS_SIMD
        ((row.decode_rows[R] = qdot_direct_rows<Q, int(R) + 1>), ...);
#endif
#if defined(KVS_ISA_AMX)
        // (not Q6_K: its two sub-scales a block need integer products, vpmulld on every row, which cost the
        // vector unit more than the tile unit saves it: 1536 x 8960, 512 rows, 48 against 46 ms)
        if constexpr (Q != KVS_Q6_K) row.amx = amx_groups<Q>;
#endif
        return row;
    }
}

template <size_t... I>
constexpr auto kernels_table(std::index_sequence<I...>) {
    return std::array<FormatKernels, sizeof...(I)>{
        kernels_row<kFormatRows[I].type>(std::make_index_sequence<DIRECT_ROWS>{})...};
}

constexpr auto kFormatKernels = kernels_table(std::make_index_sequence<kNumFormats>{});

// the kernels of ggml type `type`, null where the library has none
const FormatKernels* kernels_of(int type) {
    for (const FormatKernels& f : kFormatKernels)
        if (f.row->type == type) return &f;
    return nullptr;
}

// the kernels that run f's rows once put back in the file's order: its base format's
const FormatKernels& row_kernels(const FormatKernels& f) { return *kernels_of(f.row->base); }

// Float formats: rows decoded to float32 (F32 read in place), float activations
void run_float(const FormatKernels& f, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T,
               float* y, int64_t ldy, int nthreads) {
    const int64_t row_bytes = K / f.row->block * f.row->bytes;
    const bool direct = f.row->type == KVS_F32;
    const int64_t rows_per_block = std::max<int64_t>(8, (T <= TILE_ROWS ? L1_BYTES : L2_BYTES) / (4 * K));
    // each thread's share of the rows, a block of rows at a time
    parallel_for_shares(nthreads, N, rows_per_block, rows_per_block, [&](int64_t n0, int64_t hi, int64_t) {
        thread_local std::vector<float> scratch;  // the team's threads persist: grown once
        if (!direct && int64_t(scratch.size()) < rows_per_block * K) scratch.resize(rows_per_block * K);
        thread_local std::vector<const float*> wrows;
        if (int64_t(wrows.size()) < rows_per_block) wrows.resize(rows_per_block);
        const int64_t nw = hi - n0;
        for (int64_t j = 0; j < nw; ++j) {
            const uint8_t* row = w + (n0 + j) * row_bytes;
            if (direct) {
                wrows[j] = reinterpret_cast<const float*>(row);
            } else {
                f.to_float(row, K, &scratch[j * K]);
                wrows[j] = &scratch[j * K];
            }
        }
        for (int64_t t = 0; t < T; t += TILE_ROWS) {
            const float* xr[TILE_ROWS];
            const int nr = int(std::min<int64_t>(TILE_ROWS, T - t));
            for (int r = 0; r < nr; ++r) xr[r] = x + (t + r) * ldx;
            float* yt = y + t * ldy + n0;
            switch (nr) {
                case 4: dot_panel<4>(xr, wrows.data(), nw, K, yt, ldy); break;
                case 3: dot_panel<3>(xr, wrows.data(), nw, K, yt, ldy); break;
                case 2: dot_panel<2>(xr, wrows.data(), nw, K, yt, ldy); break;
                default: dot_panel<1>(xr, wrows.data(), nw, K, yt, ldy); break;
            }
        }
    });
}

#if KVS_SIMD
// f's decode rows for T activation rows: chained where this build has them and the host's tuning names f's base
DirectFn direct_rows(const FormatKernels& f, int64_t T, const KvsTuning& tuning) {
    const DirectFn chained = tuning.chained_sums >> f.row->base & 1 ? chained_rows(f.row->type, T) : nullptr;
    return chained != nullptr ? chained : f.decode_rows[T - 1];
}

// Up to DIRECT_ROWS activation rows: every weight row decoded in registers and dotted as it streams in
// (a decode step is bound by reading the weights once; a scratch copy would be a second pass)
void run_quant_direct(const FormatKernels& f, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t nb,
                      const XRow* xrows, int64_t T, float* y, int64_t ldy, int nthreads) {
    const DirectFn rows_fn = direct_rows(f, T, current_tuning());
    // each thread's share of the rows in chunks of about CHUNK_BYTES (whole groups of eight rows)
    const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (DIRECT_GROUP * row_bytes)) * DIRECT_GROUP;
    parallel_for_shares(nthreads, N, DIRECT_GROUP, chunk, [&](int64_t lo, int64_t hi, int64_t share_end) {
        thread_local std::vector<float> off;  // per-block offsets of the weight rows in flight
        if (int64_t(off.size()) < DIRECT_GROUP * nb) off.resize(DIRECT_GROUP * nb);
        rows_fn(w, row_bytes, lo, hi, share_end, nb, xrows, off.data(), y, ldy);
    });
}
#endif

#if KVS_SIMD
// The parts of one linear layer (fused QKV, gate + up; block formats, up to DIRECT_ROWS rows) in one
// team call over one activation rounding: their groups of eight rows side by side, shared out as one
// row space, each chunk run by its part's decode rows. A decode step made a call (and a rounding) per
// part, and each small part (K and V: 256 rows) paid a call's start and drain. Each output's chain is
// its part's, whichever chunk holds it.
bool run_parts_direct(const KvsLinear& w, const float* x, int64_t T, float* y, int nthreads) {
    const int64_t P = w.num_parts, K = w.in_features, nb = K / 32;
    const FormatKernels* f[KVS_MAX_PARTS];
    DirectFn rows_fn[KVS_MAX_PARTS];
    const KvsTuning tuning = current_tuning();
    int64_t first[KVS_MAX_PARTS + 1] = {0}, col[KVS_MAX_PARTS] = {0}, row_bytes[KVS_MAX_PARTS];
    for (int64_t p = 0; p < P; ++p) {
        f[p] = kernels_of(static_cast<int>(w.formats[p]));
        if (f[p] == nullptr || f[p]->row->codes == Codes::Float || K % f[p]->row->block ||
            w.rows[p] % f[p]->row->group_rows)
            return false;
        row_bytes[p] = K / f[p]->row->block * f[p]->row->bytes;
        rows_fn[p] = direct_rows(*f[p], T, tuning);
        first[p + 1] = first[p] + (w.rows[p] + DIRECT_GROUP - 1) / DIRECT_GROUP;
        if (p + 1 < P) col[p + 1] = col[p] + w.rows[p];
    }
    thread_local XBlocks caller_blocks;
    XBlocks& xb = caller_blocks;
    xb.fit(T, K);
    XRow xrows[DIRECT_ROWS];
    for (int64_t t = 0; t < T; ++t) {
        quantize_row(x + t * K, K, xb, t);
        xrows[t] = xb.row(t, K);
    }
    const int64_t groups = first[P];
    const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (DIRECT_GROUP * row_bytes[0]));
    nthreads = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, groups)));
    parallel_for_shares(nthreads, groups, 1, chunk, [&](int64_t g0, int64_t g1, int64_t share_end) {
        thread_local std::vector<float> off;  // per-block offsets of the weight rows in flight
        if (int64_t(off.size()) < DIRECT_GROUP * nb) off.resize(DIRECT_GROUP * nb);
        for (int64_t p = 0; p < P; ++p) {
            const int64_t lo = std::max(g0, first[p]), hi = std::min(g1, first[p + 1]);
            if (lo >= hi) continue;
            const auto rows = [&](int64_t g) { return std::min(w.rows[p], (g - first[p]) * DIRECT_GROUP); };
            const int64_t prefetch_hi = rows(std::min(share_end, first[p + 1]));
            rows_fn[p](w.weights[p], row_bytes[p], rows(lo), rows(hi), prefetch_hi, nb, xrows, off.data(),
                       y + col[p], w.out_features);
        }
    });
    return true;
}

// The offsets' vector: sixteen weight rows a vector on AVX-512, eight on AVX2, each lane running
// offset_dot's chain (offset_dots8's arithmetic on wider or narrower vectors: the same bits)
#if defined(KVS_ISA_AVX512)
struct OffLanes {
    using V = __m512;
    static constexpr int N = 16, ROWS = 4;  // ROWS activation rows at once: 4 x 4 accumulators
    static V zero() { return _mm512_setzero_ps(); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static V set1(float v) { return _mm512_set1_ps(v); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#else
struct OffLanes {
    using V = __m256;
    static constexpr int N = 8, ROWS = 2;  // sixteen vector registers
    static V zero() { return _mm256_setzero_ps(); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static V set1(float v) { return _mm256_set1_ps(v); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#endif

// offset_dot of OffLanes::N weight rows (offT transposed: block b's at offT[b * ldo ..]) against R activation
// rows' s: lane l of the 8-block chunks as one fma chain, the chains 0-3 then 4-7 (each load of offT
// feeds R rows; eight chains for each of R rows would not fit the registers), hsum8's tree over them, the
// tail's multiply-adds in order
template <int R>
inline void offset_rows(const float* offT, int64_t ldo, int64_t nb, const float* const* s, OffLanes::V* out) {
    using L = OffLanes;
    L::V first[R][4], a[R][4];
    for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r)
            for (int l = 0; l < 4; ++l) a[r][l] = L::zero();
        for (int64_t b = 0; b + 8 <= nb; b += 8)
            for (int l = 0; l < 4; ++l) {
                const L::V w = L::load(offT + (b + 4 * h + l) * ldo);
                for (int r = 0; r < R; ++r) a[r][l] = L::fma(w, L::set1(s[r][b + 4 * h + l]), a[r][l]);
            }
        if (h == 0)
            for (int r = 0; r < R; ++r)
                for (int l = 0; l < 4; ++l) first[r][l] = a[r][l];
    }
    for (int r = 0; r < R; ++r) {
        L::V v = L::add(L::add(L::add(first[r][0], a[r][0]), L::add(first[r][2], a[r][2])),
                        L::add(L::add(first[r][1], a[r][1]), L::add(first[r][3], a[r][3])));
        for (int64_t b = nb / 8 * 8; b < nb; ++b) v = L::add(v, L::mul(L::load(offT + b * ldo), L::set1(s[r][b])));
        out[r] = v;
    }
}

// y[r][j] += sum_b off[j][b] * s_r[b] for nr activation rows and the nw decoded rows of a panel: offT
// holds the panel's offsets transposed ([nb][ldo], ldo a multiple of the vector, rows past nw zero);
// offset_rows keeps offset_dot's chain, so adding it to a tile's offset-free result is the tile's own result
inline void add_offsets(const float* offT, int64_t ldo, int64_t nw, int64_t nb, const XRow* xr, int64_t nr, float* y,
                        int64_t ldy) {
    using L = OffLanes;
    for (int64_t r0 = 0; r0 < nr; r0 += L::ROWS) {
        const int rows = int(std::min<int64_t>(L::ROWS, nr - r0));
        const float* s[L::ROWS];
        for (int r = 0; r < rows; ++r) s[r] = xr[r0 + r].s;
        for (int64_t j = 0; j < nw; j += L::N) {
            L::V v[L::ROWS];
            switch (rows) {
                case 1: offset_rows<1>(offT + j, ldo, nb, s, v); break;
                case 2: offset_rows<2>(offT + j, ldo, nb, s, v); break;
#if defined(KVS_ISA_AVX512)
                case 3: offset_rows<3>(offT + j, ldo, nb, s, v); break;
                case 4: offset_rows<4>(offT + j, ldo, nb, s, v); break;
#endif
            }
            for (int r = 0; r < rows; ++r) {
                float* yr = y + (r0 + r) * ldy + j;
                if (j + L::N <= nw) {
                    L::store(yr, L::add(L::load(yr), v[r]));
                    continue;
                }
                alignas(64) float tail[L::N];
                L::store(tail, v[r]);
                for (int64_t c = 0; c < nw - j; ++c) yr[c] = yr[c] + tail[c];
            }
        }
    }
}
#endif

// The size of cpu0's cache at sysfs `index` (2: L2, 3: L3), or `fallback` where Linux does not say
int64_t sysfs_cache_bytes(int index, int64_t fallback) {
    const std::string path = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size";
    FILE* f = std::fopen(path.c_str(), "r");
    long kib = 0;
    const bool read = f && std::fscanf(f, "%ldK", &kib) == 1 && kib > 0;
    if (f) std::fclose(f);
    return read ? int64_t(kib) << 10 : fallback;
}

// The host's L3 in bytes: KVSERVE_KERNELS_L3_BYTES where set (a host whose sysfs says nothing or the wrong
// size; the tests, to reach several passes with small matrices), else what Linux reports for cpu0 in sysfs
// (cpuid's figure, which sysconf gives, can be the whole socket's inside a VM: 320 MiB against lscpu's 32
// on this project's Zen 4 hosts)
int64_t host_l3_bytes() {
    if (const char* set = std::getenv("KVSERVE_KERNELS_L3_BYTES"))
        if (const long long bytes = std::atoll(set); bytes > 0) return bytes;
    static const int64_t sysfs = sysfs_cache_bytes(3, L3_FALLBACK_BYTES);
    return sysfs;
}

#if defined(KVS_ISA_AMX)
// The host's L2 per core (sysfs index2): the AMX tile's K slices (a panel's BF16 codes, reread by every sixteen
// activation rows) are sized to half of it
int64_t host_l2_bytes() {
    static const int64_t sysfs = sysfs_cache_bytes(2, 1 << 20);
    return sysfs;
}
#endif

// Activation rows one pass over a prefill's weight panels takes: every panel's tiles read every row of the
// pass, so a pass's rounded rows (~1.5 bytes an element: the int8 codes, the blocks' fields and the
// sub-blocks' exponents or multipliers) are kept within a quarter of the L3 and read from there; each pass
// decodes the panels again. (1.5B down projection, 1,536 x 8,960 x 1,547 rows, one thread, Zen 4: one pass
// 200-222 ms, passes of 8 MB 186-187, of 16 MB 193-197, of 4 MB 193-197, of 2 MB 211; 8B's 4,096 x 14,336:
// 942-982 -> 824-825 ms; 14,336 x 4,096, whose 9.5 MB of rows took two passes of 8 MB: within the noise.)
int64_t prefill_pass_rows(int64_t T, int64_t K) {
    const int64_t rounded_row_bytes = K + K / 2;
    constexpr int64_t step = 4 * TILE_ROWS;  // whole steps of AMX's sixteen rows (the vector tiles' four, four times)
    const int64_t fits = host_l3_bytes() / 4 / rounded_row_bytes;
    return std::min(T, fits >= step ? fits / step * step : std::max<int64_t>(TILE_ROWS, fits / TILE_ROWS * TILE_ROWS));
}

// Block formats: activations rounded to int8 blocks once, rows decoded to 8-bit codes
void run_quant(const FormatKernels& f, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T,
               float* y, int64_t ldy, int nthreads) {
    const int64_t row_bytes = K / f.row->block * f.row->bytes, nb = K / 32;
    thread_local XBlocks caller_blocks;  // the calling thread's; the workers below write into it
    XBlocks& xb = caller_blocks;
    xb.fit(T, K);
    std::vector<XRow> xrows(T);
    parallel_for(T > 1 ? nthreads : 1, T, [&](int64_t t) {
        quantize_row(x + t * ldx, K, xb, t);
        xrows[t] = xb.row(t, K);
    });
    const bool offsets = f.row->has_offset;
#if KVS_SIMD
    if (T <= DIRECT_ROWS) {
        run_quant_direct(f, w, row_bytes, N, nb, xrows.data(), T, y, ldy, nthreads);
        return;
    }
#endif
    const int64_t gbytes = qgroup_bytes(K);
    const FormatKernels& tiles = row_kernels(f);
#if defined(KVS_ISA_AMX)
    // sixteen rows at a time in the tile unit where the OS lets this process use it; the rows left over (and
    // every row elsewhere) on the vector tiles, which give the same bits
    const bool amx = T >= AMX_MIN_ROWS && tiles.amx && amx_permitted();
    thread_local Bf16Rows caller_bf16;
    Bf16Rows& xbf = caller_bf16;
    if (amx) {
        xbf.fit(T, K);
        parallel_for(nthreads, T / AMX_ROWS * AMX_ROWS, [&](int64_t t) { bf16_row(xrows[t], K, xbf, t); });
    }
#endif
    // panels of weight rows (whole groups) handed out one at a time, at least PANELS_PER_THREAD a
    // thread: on a shared host a thread that loses its core leaves the rest of its panels to the other
    const int64_t per_thread = (N + PANELS_PER_THREAD * nthreads - 1) / (PANELS_PER_THREAD * nthreads);
    int64_t panel_bytes = T <= TILE_ROWS ? L1_BYTES : L2_BYTES;
#if defined(KVS_ISA_AMX)
    if (amx) panel_bytes = AMX_GROUPS * gbytes;  // the tile unit takes these groups' BF16 codes a K slice at a time
#endif
    const int64_t rows_per_block =
        (std::max<int64_t>(TILE_GROUP, std::min(TILE_GROUP * panel_bytes / gbytes, per_thread)) +
         TILE_GROUP - 1) / TILE_GROUP * TILE_GROUP;
    const int64_t num_panels = (N + rows_per_block - 1) / rows_per_block;
    const int64_t pass_rows = prefill_pass_rows(T, K);
    for (int64_t t_begin = 0; t_begin < T; t_begin += pass_rows) {
        const int64_t t_end = std::min(T, t_begin + pass_rows);
        DynamicCounter panels(num_panels);
        team_run(nthreads, [&](int, int) {
            thread_local std::vector<uint8_t> scratch;  // the panel's decoded groups
            const int64_t scratch_bytes = rows_per_block / TILE_GROUP * gbytes;
            if (int64_t(scratch.size()) < scratch_bytes) scratch.resize(scratch_bytes);
            thread_local std::vector<uint8_t> file_order;  // an interleaved row put back in order
            if (int64_t(file_order.size()) < row_bytes) file_order.resize(row_bytes);
            // the offsets' dot runs as its own pass over eight rows a vector (SIMD builds): the tiles skip it
            const bool split_offsets = KVS_SIMD && offsets;
            const int64_t ldo = rows_per_block;
            thread_local std::vector<float> offT;  // [nb][ldo] the panel's offsets, transposed
            if (split_offsets && int64_t(offT.size()) < nb * ldo) offT.resize(nb * ldo);
#if defined(KVS_ISA_AMX)
            const TilesInUse tiles_in_use(amx);
#endif
            panels.each([&](int64_t panel) {
                const int64_t n0 = panel * rows_per_block, nw = std::min(N, n0 + rows_per_block) - n0;
                const int64_t groups = (nw + TILE_GROUP - 1) / TILE_GROUP;
                // a last group short of rows repeats the panel's last row (its outputs are not kept)
                for (int64_t j = 0; j < groups * TILE_GROUP; ++j) {
                    const QGroup g = qgroup_at(&scratch[j / TILE_GROUP * gbytes], K);
                    const uint8_t* row = file_row(f.row->type, w, row_bytes, n0 + std::min(j, nw - 1), file_order.data());
                    tiles.to_group(row, K, g, int(j % TILE_GROUP));
                    if (split_offsets)
                        for (int64_t b = 0; b < nb; ++b) offT[b * ldo + j] = j < nw ? g.off[(j % TILE_GROUP) * nb + b] : 0.0f;
                }
                int64_t t = t_begin;
#if defined(KVS_ISA_AMX)
                // sixteen rows at a time over each K slice of the panel's codes (amx_slice_blocks), the offsets
                // after the last slice
                const int64_t amx_end = amx && t % AMX_ROWS == 0 ? t + (t_end - t) / AMX_ROWS * AMX_ROWS : t;
                if (amx_end > t) {
                    thread_local std::vector<uint16_t> wbf;  // the slice's codes as the tile unit's BF16 operand
                    const int64_t slice = amx_slice_blocks(groups, host_l2_bytes());
                    if (int64_t(wbf.size()) < groups * slice * GROUP_BF16) wbf.resize(groups * slice * GROUP_BF16);
                    for (int64_t b0 = 0; b0 < nb; b0 += slice) {
                        const int64_t b1 = std::min(nb, b0 + slice);
                        for (int64_t gi = 0; gi < groups; ++gi)
                            bf16_group(qgroup_at(&scratch[gi * gbytes], K), b0, b1,
                                       &wbf[gi * (b1 - b0) * GROUP_BF16]);
                        for (int64_t ta = t; ta < amx_end; ta += AMX_ROWS)
                            tiles.amx(&xrows[ta], xbf.tile(ta, K), K, scratch.data(), gbytes, wbf.data(), groups, nw,
                                      b0, b1, y + ta * ldy + n0, ldy);
                    }
                    if (split_offsets)
                        for (int64_t ta = t; ta < amx_end; ta += AMX_ROWS)
                            add_offsets(offT.data(), ldo, nw, nb, &xrows[ta], AMX_ROWS, y + ta * ldy + n0, ldy);
                    t = amx_end;
                }
#endif
                for (; t < t_end; t += TILE_ROWS) {
                    const XRow* xr = &xrows[t];
                    float* yt = y + t * ldy + n0;
                    const int64_t nr = std::min<int64_t>(TILE_ROWS, t_end - t);
                    for (int64_t gi = 0; gi < groups; ++gi)
                        tiles.tile[nr - 1](xr, qgroup_at(&scratch[gi * gbytes], K),
                                           int(std::min<int64_t>(TILE_GROUP, nw - TILE_GROUP * gi)), nb,
                                           yt + TILE_GROUP * gi, ldy);
#if KVS_SIMD
                    if (split_offsets) add_offsets(offT.data(), ldo, nw, nb, xr, nr, yt, ldy);
#endif
                }
            });
        });
    }
}

void run(const FormatKernels& f, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T,
         float* y, int64_t ldy, int nthreads) {
    nthreads = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, (N + 7) / 8)));
    if (f.row->codes == Codes::Float) {
        run_float(f, w, N, K, x, ldx, T, y, ldy, nthreads);
    } else {
        run_quant(f, w, N, K, x, ldx, T, y, ldy, nthreads);
    }
}

}  // namespace
}  // namespace kvs

using namespace kvs;

KVS_EXPORT int kvs_formats(KvsFormatInfo* out, int capacity) {
    for (int i = 0; i < kNumFormats && i < capacity; ++i) {
        const FormatRow& row = kFormatRows[i];
        out[i] = KvsFormatInfo{row.type, row.block, row.bytes, row.codes == Codes::Float, {}, row.group_rows, row.base};
        std::strncpy(out[i].name, row.name, sizeof(out[i].name) - 1);
    }
    return kNumFormats;
}

KVS_EXPORT int kvs_matmul(int format, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T,
                          float* y, int64_t ldy, int num_threads) {
    const FormatKernels* f = kernels_of(format);
    if (f == nullptr) return KVS_MATMUL_NO_FORMAT;
    if (K % f->row->block != 0 || N % f->row->group_rows != 0) return KVS_MATMUL_BAD_ROW_LENGTH;
    if (T <= 0 || N <= 0) return KVS_MATMUL_OK;
    run(*f, w, N, K, x, ldx, T, y, ldy, std::max(1, num_threads));
    return KVS_MATMUL_OK;
}

namespace kvs {

int matmul_linear(const KvsLinear& w, const float* x, int64_t T, float* y, int num_threads) {
#if KVS_SIMD
    if (w.num_parts > 1 && T <= DIRECT_ROWS && run_parts_direct(w, x, T, y, std::max(1, num_threads)))
        return KVS_MATMUL_OK;
#endif
    int64_t col = 0;
    for (int64_t p = 0; p < w.num_parts; ++p) {
        const int rc = kvs_matmul(static_cast<int>(w.formats[p]), w.weights[p], w.rows[p], w.in_features, x,
                                  w.in_features, T, y + col, w.out_features, num_threads);
        if (rc) return rc;
        col += w.rows[p];
    }
    return KVS_MATMUL_OK;
}

}  // namespace kvs

KVS_EXPORT int kvs_dequantize_rows(int format, const uint8_t* w, int64_t K, const int64_t* rows, int64_t n,
                                   float* out) {
    const FormatKernels* f = kernels_of(format);
    if (f == nullptr) return KVS_MATMUL_NO_FORMAT;
    if (K % f->row->block != 0) return KVS_MATMUL_BAD_ROW_LENGTH;
    const int64_t row_bytes = K / f->row->block * f->row->bytes;
    std::vector<uint8_t> file_order(f->row->group_rows > 1 ? row_bytes : 0);
    for (int64_t i = 0; i < n; ++i)
        row_kernels(*f).to_float(file_row(f->row->type, w, row_bytes, rows[i], file_order.data()), K, out + i * K);
    return KVS_MATMUL_OK;
}

KVS_EXPORT int kvs_interleave_rows(int format, uint8_t* w, int64_t N, int64_t K) {
    const FormatRow* twin = nullptr;
    for (const FormatRow& row : kFormatRows)
        if (row.base == format && row.group_rows > 1) twin = &row;
    if (twin == nullptr) return KVS_MATMUL_NO_FORMAT;
    if (K % twin->block != 0 || N % twin->group_rows != 0) return KVS_MATMUL_BAD_ROW_LENGTH;
    with_interleaved_base(format, [&](auto base) { interleave_rows<decltype(base)::value>(w, N, K); });
    return KVS_MATMUL_OK;
}

KVS_EXPORT int kvs_quantize_activations(const float* x, int64_t T, int64_t K, int8_t* q, float* d, int16_t* mult) {
    if (K % 32 != 0) return KVS_MATMUL_BAD_ROW_LENGTH;
    XBlocks xb(T, K);
    for (int64_t t = 0; t < T; ++t) quantize_row(x + t * K, K, xb, t);
    std::copy_n(xb.q.begin(), T * K, q);
    std::copy_n(xb.d.begin(), T * K / 32, d);
    std::copy_n(xb.mult.begin(), T * K / 2, mult);
    return KVS_MATMUL_OK;
}
