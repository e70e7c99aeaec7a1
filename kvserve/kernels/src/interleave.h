// kvserve's own layout of a block format's weight rows: eight rows interleaved, so the decode rows read
// one 32-bit word of each row in one 256-bit load and keep a lane per row from the products to the
// block's total (matmul_direct.h qdot_interleaved), with no reduction across lanes. The bytes and the
// values are the file's; only their order changes (Q5's fifth bits: within their word): kvs_interleave_rows
// rewrites a matrix in place, and deinterleave_row gives any row back as the file had it (embeddings, the
// prefill tiles).
#pragma once
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_formats.h"

namespace kvs {

constexpr int INTERLEAVED_ROWS = 8;  // one int32 lane of a 256-bit vector per row
constexpr bool table_groups_are_interleaved_rows() {
    for (const FormatRow& row : kFormatRows)
        if (row.group_rows != 1 && row.group_rows != INTERLEAVED_ROWS) return false;
    return true;
}
static_assert(table_groups_are_interleaved_rows(), "every interleaved row of the format table is a group of eight");

// Where a block of an interleaved format's base (a K format's superblock of 256, or a block of 32) keeps its
// codes (a run of 32-bit words, interleaved) and the rest (the header: scales and fp16 fields, whole per row)
struct BlockSpan {
    int header_at, header_bytes;
    int code_at, code_bytes;
};

constexpr BlockSpan block_span(int base) {
    switch (base) {
        case KVS_Q6_K: return {192, 18, 0, 192};  // ql, qh | scales, d
        case KVS_Q5_K: return {0, 16, 16, 160};   // d, dmin, scales | qh, qs
        case KVS_Q4_K: return {0, 16, 16, 128};   // d, dmin, scales | qs
        case KVS_Q5_1: return {0, 4, 4, 20};      // d, m | qh, qs (qh: the codes' fifth bits, one word)
        case KVS_Q5_0: return {0, 2, 2, 20};      // d | qh, qs
        case KVS_Q4_1: return {0, 4, 4, 16};      // d, m | qs
        case KVS_Q8_0: return {0, 2, 2, 32};      // d | qs
        default: return {0, 2, 2, 16};            // Q4_0: d | qs
    }
}

// Block i of a group of eight rows, interleaved: the eight headers one after another, then code word w
// of row r at codes + (8 w + r) * 4; the group's blocks follow each other, so the group holds the bytes its
// eight rows held (rows 8g .. 8g + 7 of the file's layout). P: const uint8_t* to read, uint8_t* to write.
template <int Base, class P = const uint8_t*>
struct GroupBlock {
    P header[INTERLEAVED_ROWS];
    P codes;
    GroupBlock(P group, int64_t i) {
        P blk = group + i * INTERLEAVED_ROWS * geometry(Base).bytes;
        for (int r = 0; r < INTERLEAVED_ROWS; ++r) header[r] = blk + r * block_span(Base).header_bytes;
        codes = blk + INTERLEAVED_ROWS * block_span(Base).header_bytes;
    }
    P word(int w, int r) const { return codes + (INTERLEAVED_ROWS * w + r) * 4; }
};

// Q5_0's and Q5_1's twins keep a block's 32 fifth bits (its qh word) transposed: byte k holds, at bit w, the
// bit of element 4w + k and, at bit 4 + w, that of element 16 + 4w + k (w, k < 4), so that the decode rows
// take a code word's fifth bits with one shift and one mask. Bit i of the file's word goes to bit twin_bit(i).
constexpr bool transposes_fifth_bits(int base) { return base == KVS_Q5_0 || base == KVS_Q5_1; }
constexpr int twin_bit(int i) { return i < 16 ? 8 * (i % 4) + i / 4 : 8 * ((i - 16) % 4) + 4 + (i - 16) / 4; }

// code word w of a block (4 bytes at `from`) to `to`, from the file's layout to the twin's or back
template <int Base>
inline void copy_word(int w, const uint8_t* from, uint8_t* to, bool to_twin) {
    if (!transposes_fifth_bits(Base) || w != 0) {
        std::memcpy(to, from, 4);
        return;
    }
    uint32_t in, out = 0;
    std::memcpy(&in, from, 4);
    for (int i = 0; i < 32; ++i) {  // the file's bit i is the twin's bit twin_bit(i)
        const int file = i, twin = twin_bit(i);
        out |= (in >> (to_twin ? file : twin) & 1u) << (to_twin ? twin : file);
    }
    std::memcpy(to, &out, 4);
}

// eight rows in the file's layout (rows, contiguous) -> one interleaved group at out
template <int Base>
inline void interleave_group(const uint8_t* rows, int64_t blocks, uint8_t* out) {
    constexpr BlockSpan span = block_span(Base);
    constexpr int bytes = geometry(Base).bytes;
    const int64_t row_bytes = blocks * bytes;
    for (int64_t s = 0; s < blocks; ++s) {
        const GroupBlock<Base, uint8_t*> blk(out, s);
        for (int r = 0; r < INTERLEAVED_ROWS; ++r) {
            const uint8_t* src = rows + r * row_bytes + s * bytes;
            std::memcpy(blk.header[r], src + span.header_at, span.header_bytes);
            for (int w = 0; w < span.code_bytes / 4; ++w)
                copy_word<Base>(w, src + span.code_at + 4 * w, blk.word(w, r), true);
        }
    }
}

// row r of an interleaved group -> the file's bytes of that row
template <int Base>
inline void deinterleave_row(const uint8_t* group, int64_t blocks, int r, uint8_t* row) {
    constexpr BlockSpan span = block_span(Base);
    constexpr int bytes = geometry(Base).bytes;
    for (int64_t s = 0; s < blocks; ++s) {
        const GroupBlock<Base> blk(group, s);
        uint8_t* dst = row + s * bytes;
        std::memcpy(dst + span.header_at, blk.header[r], span.header_bytes);
        for (int w = 0; w < span.code_bytes / 4; ++w)
            copy_word<Base>(w, blk.word(w, r), dst + span.code_at + 4 * w, false);
    }
}

// A matrix of N rows (N a multiple of eight) of format Base rewritten in place, group by group
template <int Base>
inline void interleave_rows(uint8_t* w, int64_t N, int64_t K) {
    const int64_t blocks = K / geometry(Base).block, group_bytes = INTERLEAVED_ROWS * blocks * geometry(Base).bytes;
    std::vector<uint8_t> rows(group_bytes);
    for (int64_t g = 0; g < N / INTERLEAVED_ROWS; ++g) {
        uint8_t* group = w + g * group_bytes;
        std::memcpy(rows.data(), group, group_bytes);
        interleave_group<Base>(rows.data(), blocks, group);
    }
}

// f(std::integral_constant<int, Base>) for an interleaved format's base, the one switch over them
template <class F>
inline void with_interleaved_base(int base, F&& f) {
    switch (base) {
        case KVS_Q4_0: f(std::integral_constant<int, KVS_Q4_0>{}); break;
        case KVS_Q4_1: f(std::integral_constant<int, KVS_Q4_1>{}); break;
        case KVS_Q5_0: f(std::integral_constant<int, KVS_Q5_0>{}); break;
        case KVS_Q5_1: f(std::integral_constant<int, KVS_Q5_1>{}); break;
        case KVS_Q8_0: f(std::integral_constant<int, KVS_Q8_0>{}); break;
        case KVS_Q4_K: f(std::integral_constant<int, KVS_Q4_K>{}); break;
        case KVS_Q5_K: f(std::integral_constant<int, KVS_Q5_K>{}); break;
        default: f(std::integral_constant<int, KVS_Q6_K>{}); break;
    }
}

// Row n of a matrix of format `type` in the file's layout: the row itself, or for an interleaved format
// its bytes put back in order into `scratch` (row_bytes)
inline const uint8_t* file_row(int type, const uint8_t* w, int64_t row_bytes, int64_t n, uint8_t* scratch) {
    const FormatRow& f = format_row(type);
    if (f.group_rows == 1) return w + n * row_bytes;
    const uint8_t* group = w + n / INTERLEAVED_ROWS * INTERLEAVED_ROWS * row_bytes;
    with_interleaved_base(f.base, [&](auto base) {
        deinterleave_row<decltype(base)::value>(group, row_bytes / f.bytes, int(n % INTERLEAVED_ROWS), scratch);
    });
    return scratch;
}

}  // namespace kvs
