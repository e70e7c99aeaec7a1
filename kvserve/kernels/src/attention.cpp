// Paged attention over the KV cache pages in place: for each (query row, KV head) an online softmax
// over the row's keys, position lo..p, in blocks of BLOCK absolute positions. One thread takes a tile
// (up to TILE consecutive rows of one block table) x one KV head: each block of K/V is decoded from
// its page through the layer's codec once for the tile, K transposed (keys along vector lanes), then
// every (row, head) of the tile takes its keys of the block.
//
//   cache [num_pages, page_size, kv_heads, head_dim (int4: head_dim / 2 bytes)]
//   row r: position p, keys lo..p (lo = max(0, p - window + 1)); logical page i of its block table
//          is tables[table_offsets[r] + i - table_first[r]]
//
// Invariance by construction: a (row, head)'s float operations depend only on p, lo and the values of
// its keys, never on the other rows, the tile, the chunking or the thread count (a row's keys are
// never split; a score is one fma chain over head_dim; sums over a block use one fixed lane tree).
#include "ops_simd.h"
#include <omp.h>
#include <algorithm>
#include <climits>
#include <vector>

namespace {

using namespace kvs::simd;

constexpr int BLOCK = 16;  // keys per online-softmax step, aligned to absolute positions
constexpr int TILE = 16;  // prefill rows of one table attended together (each key block decoded once)

enum Codec : int { FP32 = 0, BF16 = 1, FP16 = 2, FP8 = 3, INT8 = 4, INT4 = 5 };

struct Args {
    const float* q;
    int64_t q_row_stride;  // floats between rows of q (heads * head_dim when contiguous)
    float* out;  // [rows, heads, head_dim]
    int64_t num_rows;
    int heads, kv_heads, head_dim, page_size, window, codec;
    const void* k_data;
    const void* v_data;
    const float* k_scales;  // [num_pages, kv_heads] (int codecs)
    const float* v_scales;
    const float* k_table;  // [256] fp8 byte -> value (per-tensor scale folded in)
    const float* v_table;
    const int64_t* positions;
    const int64_t* table_offsets;
    const int64_t* table_first;
    const int64_t* tables;
    const float* k_own;  // [n, page_size, kv_heads, head_dim] float32: a prefill query's own page
    const float* v_own;
    const int64_t* own_index;  // [rows] index into k_own, -1: the own page is read from the cache
    float scale;
};

int64_t row_bytes(const Args& a) {
    int elem = a.codec == FP32 ? 4 : a.codec == BF16 || a.codec == FP16 ? 2 : 1;
    return a.codec == INT4 ? a.head_dim / 2 : static_cast<int64_t>(a.head_dim) * elem;
}

// One stored row of head_dim values -> float32 dst.
void decode_row(const Args& a, const uint8_t* src, float scale, const float* table, float* dst) {
    const int hd = a.head_dim;
    switch (a.codec) {
        case FP32:
            std::memcpy(dst, src, sizeof(float) * hd);
            break;
        case BF16:
            for (int d = 0; d < hd; d += W) vstore(dst + d, vload_bf16(reinterpret_cast<const uint16_t*>(src) + d));
            break;
        case FP16:
            for (int d = 0; d < hd; d += W) vstore(dst + d, vload_f16(reinterpret_cast<const uint16_t*>(src) + d));
            break;
        case FP8:
            for (int d = 0; d < hd; d += W) vstore(dst + d, vlookup(table, src + d));
            break;
        case INT8: {  // (code + 0.5) * s, exact
            vf s = vset1(scale), half = vset1(0.5f);
            for (int d = 0; d < hd; d += W)
                vstore(dst + d, vmul(vadd(vload_i8(reinterpret_cast<const int8_t*>(src) + d), half), s));
            break;
        }
        case INT4: {  // byte j: code j in the low nibble, code j + hd/2 in the high one, each + 8
            const int half_dim = hd / 2;
            float lo[W], hi[W];
            for (int d = 0; d < half_dim; d += W) {
                for (int i = 0; i < W; ++i) {
                    lo[i] = static_cast<float>(src[d + i] & 15);
                    hi[i] = static_cast<float>(src[d + i] >> 4);
                }
                vf s = vset1(scale), off = vset1(7.5f);
                vstore(dst + d, vmul(vsub(vload(lo), off), s));
                vstore(dst + half_dim + d, vmul(vsub(vload(hi), off), s));
            }
            break;
        }
    }
}

struct Scratch {
    std::vector<float> kt;  // [head_dim, BLOCK] one block of decoded keys, transposed (keys along lanes)
    std::vector<float> k, v;  // [BLOCK, head_dim] decoded keys / values (codecs other than fp32)
    std::vector<float> zero;  // [head_dim] zeros: the rows of lanes no query reads
    std::vector<float> q, o;  // [rows * group, head_dim] scaled queries, output accumulators
    std::vector<float> s;  // [rows * group, BLOCK] scores, then probabilities
    std::vector<float> m, l;  // [rows * group] running max and sum
};

constexpr int NV = BLOCK / W > 0 ? BLOCK / W : 1;  // vectors per block of scores
constexpr int QB = W == 1 ? 2 : 4;  // query vectors per pass over a key block (registers)

// s[q][j] = sum_d qs[q][d] * kt[d][j] for j in the block, d ascending: one fma chain per score, so a
// score never depends on which query vectors share the pass.
template <int NQ>
void scores(const float* qs, const float* kt, int hd, float* s) {
    vf acc[NQ][NV];
    for (int q = 0; q < NQ; ++q)
        for (int v = 0; v < NV; ++v) acc[q][v] = vzero();
    for (int d = 0; d < hd; ++d) {
        vf k[NV];
        for (int v = 0; v < NV; ++v) k[v] = vload(kt + d * BLOCK + v * W);
        for (int q = 0; q < NQ; ++q) {
            vf b = vset1(qs[q * hd + d]);
            for (int v = 0; v < NV; ++v) acc[q][v] = vfma(b, k[v], acc[q][v]);
        }
    }
    for (int q = 0; q < NQ; ++q)
        for (int v = 0; v < NV; ++v) vstore(s + q * BLOCK + v * W, acc[q][v]);
}

void all_scores(const float* qs, const float* kt, int nq, int hd, float* s) {
    int q = 0;
    for (; q + QB <= nq; q += QB) scores<QB>(qs + q * hd, kt, hd, s + q * BLOCK);
    switch (nq - q) {  // the rest in one pass (independent chains keep the FMA units busy)
        case 3: scores<3>(qs + q * hd, kt, hd, s + q * BLOCK); break;
        case 2: scores<2>(qs + q * hd, kt, hd, s + q * BLOCK); break;
        case 1: scores<1>(qs + q * hd, kt, hd, s + q * BLOCK); break;
        default: break;
    }
}

// o += sum_j p[j] v_j over j in [j0, j1] (block offsets), each element's sum in ascending j; ND
// vectors of o at once (independent chains).
template <int ND>
void accumulate_span(const float* p, const float* const* vb, int j0, int j1, int d0, float* o) {
    vf acc[ND];
    for (int c = 0; c < ND; ++c) acc[c] = vload(o + d0 + c * W);
    for (int j = j0; j <= j1; ++j) {
        const vf pj = vset1(p[j]);
        const float* vr = vb[j] + d0;
        for (int c = 0; c < ND; ++c) acc[c] = vfma(pj, vload(vr + c * W), acc[c]);
    }
    for (int c = 0; c < ND; ++c) vstore(o + d0 + c * W, acc[c]);
}

void accumulate(const float* p, const float* const* vb, int j0, int j1, int hd, float* o) {
    int d = 0;
    for (; d + 8 * W <= hd; d += 8 * W) accumulate_span<8>(p, vb, j0, j1, d, o);
    for (; d + 2 * W <= hd; d += 2 * W) accumulate_span<2>(p, vb, j0, j1, d, o);
    for (; d < hd; d += W) accumulate_span<1>(p, vb, j0, j1, d, o);
}

// kt[d][jj] = rows[jj][d] for jj < BLOCK (keys along lanes).
void transpose_block(const float* const* rows, int hd, float* kt) {
#if defined(KVS_ISA_AVX2) || defined(KVS_ISA_AVX512)
    for (int j8 = 0; j8 < BLOCK; j8 += 8) {
        for (int d = 0; d < hd; d += 8) {  // 8x8 tile: rows j8.., dims d..
            __m256 r[8];
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[j8 + i] + d);
            __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
            __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
            __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
            __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float* out = kt + d * BLOCK + j8;
            _mm256_storeu_ps(out + 0 * BLOCK, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(out + 1 * BLOCK, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(out + 2 * BLOCK, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(out + 3 * BLOCK, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(out + 4 * BLOCK, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(out + 5 * BLOCK, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(out + 6 * BLOCK, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(out + 7 * BLOCK, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    }
#else
    for (int j = 0; j < BLOCK; ++j)
        for (int d = 0; d < hd; ++d) kt[d * BLOCK + j] = rows[j][d];
#endif
}

// Rows row0 .. row0 + rows - 1 (one block table, keys read from the cache; or one row with an
// own-page view) x the `group` query heads of KV head h. Each (row, head) sees exactly the blocks
// and keys it would see alone: blocks outside its range are skipped, masked lanes never summed.
void attend_tile(const Args& a, int64_t row0, int rows, int h, Scratch& sc) {
    const int hd = a.head_dim, group = a.heads / a.kv_heads, ps = a.page_size, nq = rows * group;
    const int64_t rb = row_bytes(a);
    const int64_t* table = a.tables + a.table_offsets[row0] - a.table_first[row0];
    const auto* kd = static_cast<const uint8_t*>(a.k_data);
    const auto* vd = static_cast<const uint8_t*>(a.v_data);
    const int64_t own = a.own_index ? a.own_index[row0] : -1;  // rows == 1 when own >= 0
    int64_t lo[TILE], hi[TILE];
    int64_t kmin = INT64_MAX, kmax = -1;
    for (int i = 0; i < rows; ++i) {
        hi[i] = a.positions[row0 + i];
        lo[i] = a.window > 0 && hi[i] - a.window + 1 > 0 ? hi[i] - a.window + 1 : 0;
        kmin = lo[i] < kmin ? lo[i] : kmin;
        kmax = hi[i] > kmax ? hi[i] : kmax;
    }
    const int64_t own_start = own >= 0 ? hi[0] - hi[0] % ps : kmax + 1;  // keys from here: the own view
    sc.q.resize(static_cast<size_t>(nq) * hd);
    sc.o.assign(static_cast<size_t>(nq) * hd, 0.0f);
    sc.s.resize(static_cast<size_t>(nq) * BLOCK);
    sc.m.assign(nq, -INFINITY);
    sc.l.assign(nq, 0.0f);
    const vf sv = vset1(a.scale);
    for (int i = 0; i < rows; ++i)
        for (int g = 0; g < group; ++g) {
            const float* qr = a.q + (row0 + i) * a.q_row_stride + static_cast<int64_t>(h * group + g) * hd;
            float* dst = sc.q.data() + (i * group + g) * hd;
            for (int d = 0; d < hd; d += W) vstore(dst + d, vmul(vload(qr + d), sv));
        }
    const float* kb[BLOCK];
    const float* vb[BLOCK];
    for (int64_t b0 = kmin - kmin % BLOCK; b0 <= kmax; b0 += BLOCK) {
        const int64_t j0 = b0 > kmin ? b0 : kmin, j1 = b0 + BLOCK - 1 < kmax ? b0 + BLOCK - 1 : kmax;
        for (int jj = 0; jj < BLOCK; ++jj) kb[jj] = vb[jj] = sc.zero.data();  // lanes no row reads
        for (int64_t j = j0; j <= j1; ++j) {
            const int jj = static_cast<int>(j - b0);
            if (j >= own_start) {
                const int64_t at = ((own * ps + (j - own_start)) * a.kv_heads + h) * hd;
                kb[jj] = a.k_own + at;
                vb[jj] = a.v_own + at;
                continue;
            }
            const int64_t page = table[j / ps];
            const int64_t slot = (page * ps + j % ps) * a.kv_heads + h;
            if (a.codec == FP32) {
                kb[jj] = reinterpret_cast<const float*>(kd) + slot * hd;
                vb[jj] = reinterpret_cast<const float*>(vd) + slot * hd;
                continue;
            }
            const float ks = a.k_scales ? a.k_scales[page * a.kv_heads + h] : 0.0f;
            const float vs = a.v_scales ? a.v_scales[page * a.kv_heads + h] : 0.0f;
            decode_row(a, kd + slot * rb, ks, a.k_table, sc.k.data() + jj * hd);
            decode_row(a, vd + slot * rb, vs, a.v_table, sc.v.data() + jj * hd);
            kb[jj] = sc.k.data() + jj * hd;
            vb[jj] = sc.v.data() + jj * hd;
        }
        transpose_block(kb, hd, sc.kt.data());
        all_scores(sc.q.data(), sc.kt.data(), nq, hd, sc.s.data());
        // per row: its keys in this block, softmax bookkeeping, then p . v
        for (int i = 0; i < rows; ++i) {
            const int64_t r0 = b0 > lo[i] ? b0 : lo[i], r1 = b0 + BLOCK - 1 < hi[i] ? b0 + BLOCK - 1 : hi[i];
            if (r0 > r1) continue;  // this row sees no key of the block
            const int c0 = static_cast<int>(r0 - b0), c1 = static_cast<int>(r1 - b0);
            const bool full = c0 == 0 && c1 == BLOCK - 1;
            for (int g = 0; g < group; ++g) {
                const int qv = i * group + g;
                float* sq = sc.s.data() + qv * BLOCK;
                float mb;
                if (full) {
                    vf mx = vload(sq);
                    for (int v = 1; v < NV; ++v) mx = vmax(mx, vload(sq + v * W));
                    mb = hmax(mx);
                } else {
                    mb = sq[c0];
                    for (int j = c0 + 1; j <= c1; ++j) mb = sq[j] > mb ? sq[j] : mb;
                }
                const float m_old = sc.m[qv], m_new = mb > m_old ? mb : m_old;
                // alpha rescales what earlier blocks accumulated; the first block has none
                const float alpha = m_old == -INFINITY ? 0.0f : vfirst(vexp(vset1(m_old - m_new)));
                sc.m[qv] = m_new;
                const vf mv = vset1(m_new);
                for (int v = 0; v < NV; ++v) vstore(sq + v * W, vexp(vsub(vload(sq + v * W), mv)));
                if (!full) {  // lanes outside the row's keys add exact zeros to the sum below
                    for (int j = 0; j < c0; ++j) sq[j] = 0.0f;
                    for (int j = c1 + 1; j < BLOCK; ++j) sq[j] = 0.0f;
                }
                vf sum = vload(sq);  // one fixed tree over the block's lanes
                for (int v = 1; v < NV; ++v) sum = vadd(sum, vload(sq + v * W));
                sc.l[qv] = sc.l[qv] * alpha + hsum(sum);
                if (alpha != 1.0f) {
                    const vf va = vset1(alpha);
                    float* oq = sc.o.data() + qv * hd;
                    for (int d = 0; d < hd; d += W) vstore(oq + d, vmul(vload(oq + d), va));
                }
                accumulate(sq, vb, c0, c1, hd, sc.o.data() + qv * hd);
            }
        }
    }
    for (int i = 0; i < rows; ++i)
        for (int g = 0; g < group; ++g) {
            const int qv = i * group + g;
            float* dst = a.out + ((row0 + i) * a.heads + h * group + g) * static_cast<int64_t>(hd);
            const vf vl = vset1(sc.l[qv]);
            for (int d = 0; d < hd; d += W) vstore(dst + d, vdiv(vload(sc.o.data() + qv * hd + d), vl));
        }
}

}  // namespace

// Lanes of this build's float vector: head_dim must be a multiple (int4: of twice it).
KVS_EXPORT int kvs_simd_width() { return W; }

KVS_EXPORT int kvs_paged_attention(
    const float* q, int64_t q_row_stride, float* out, int64_t num_rows, int heads, int kv_heads, int head_dim,
    int page_size, int window, int codec, const void* k_data, const void* v_data, const float* k_scales,
    const float* v_scales, const float* k_table, const float* v_table, const int64_t* positions,
    const int64_t* table_offsets, const int64_t* table_first, const int64_t* tables, const float* k_own,
    const float* v_own, const int64_t* own_index, float scale, int num_threads) {
    if (head_dim % W || (codec == INT4 && head_dim % (2 * W)) || heads % kv_heads || codec < 0 || codec > INT4)
        return 1;
    const Args a{q, q_row_stride, out, num_rows, heads, kv_heads, head_dim, page_size, window, codec,
                 k_data, v_data, k_scales, v_scales, k_table, v_table, positions, table_offsets, table_first,
                 tables, k_own, v_own, own_index, scale};
    // tiles: up to TILE consecutive rows with one block table that read every key from the cache
    std::vector<int64_t> tiles;  // first row of each tile, then num_rows
    for (int64_t r = 0; r < num_rows; ++r) {
        const bool joins = !tiles.empty() && r - tiles.back() < TILE && table_offsets[r] == table_offsets[r - 1] &&
                           table_first[r] == table_first[r - 1] && !(own_index && (own_index[r] >= 0 ||
                                                                                    own_index[r - 1] >= 0));
        if (!joins) tiles.push_back(r);
    }
    const int64_t num_tiles = static_cast<int64_t>(tiles.size());
    tiles.push_back(num_rows);
    const int64_t units = num_tiles * kv_heads;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        Scratch sc;
        sc.kt.assign(static_cast<size_t>(BLOCK) * head_dim, 0.0f);
        sc.k.resize(static_cast<size_t>(BLOCK) * head_dim);
        sc.v.resize(static_cast<size_t>(BLOCK) * head_dim);
        sc.zero.assign(head_dim, 0.0f);
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t t = u / kv_heads;
            attend_tile(a, tiles[t], static_cast<int>(tiles[t + 1] - tiles[t]), static_cast<int>(u % kv_heads), sc);
        }
    }
    return 0;
}
