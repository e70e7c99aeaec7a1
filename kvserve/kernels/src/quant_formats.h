// GGUF/ggml weight formats as stored in the file: type ids, block geometry, half-float conversion and
// the K-quant scale unpacking. Layouts follow the GGUF specification (ggml's block_* structs).
#pragma once
#include <cstdint>
#include <cstring>

#include "kvs_api.h"

namespace kvs {

// How a block format's codes enter the u8 x s8 products (vpmaddubsw: unsigned bytes times signed bytes, pairs
// summed to int16 with saturation, which the sums never reach; VNNI's vpdpbusd: four to int32)
enum class Codes {
    Float,     // not a block format: float32 weights and activations
    Unsigned,  // codes 0..31 as they are (the format's minimum is its offset)
    Biased,    // c + bias stored (the file's own bits); bias * q taken off
    Signed,    // int8 codes: |c| times q with c's sign (the AVX-512 tiles store c + 128, Biased)
};

// One row per weight format: everything about the format the kernels branch on. Adding a format is a
// row here plus its decoding (matmul_quant.h's walkers and dequant_one); matmul.cpp's table gives every
// row its kernels, and kvs_formats hands the rows to Python.
struct FormatRow {
    int type;            // KvsFormat (the ggml type id)
    const char* name;
    int block;           // elements per block
    int bytes;           // bytes per block
    Codes codes;
    int code_bias;       // Biased: the bias stored codes carry
    bool has_subscales;  // integer sub-scales inside a superblock (the K formats)
    bool has_offset;     // w = d * sc * c + off: a per-block offset with its own dot (Q4_1, Q5_1, Q4_K, Q5_K)
    int group_rows;      // 1: rows as the file stores them; 8: kvserve's interleaved groups (interleave.h)
    int base;            // the file's format whose values these are (the type itself, or what was interleaved)
};

constexpr FormatRow kFormatRows[] = {
    // type         name       block bytes codes            bias subscales offset rows base
    {KVS_F32,     "F32",     1,   4,   Codes::Float,    0,  false, false, 1, KVS_F32},
    {KVS_F16,     "F16",     1,   2,   Codes::Float,    0,  false, false, 1, KVS_F16},
    {KVS_BF16,    "BF16",    1,   2,   Codes::Float,    0,  false, false, 1, KVS_BF16},
    {KVS_Q4_0,    "Q4_0",    32,  18,  Codes::Biased,   8,  false, false, 1, KVS_Q4_0},
    {KVS_Q4_1,    "Q4_1",    32,  20,  Codes::Unsigned, 0,  false, true,  1, KVS_Q4_1},
    {KVS_Q5_0,    "Q5_0",    32,  22,  Codes::Biased,   16, false, false, 1, KVS_Q5_0},
    {KVS_Q5_1,    "Q5_1",    32,  24,  Codes::Unsigned, 0,  false, true,  1, KVS_Q5_1},
    {KVS_Q8_0,    "Q8_0",    32,  34,  Codes::Signed,   0,  false, false, 1, KVS_Q8_0},
    {KVS_Q4_K,    "Q4_K",    256, 144, Codes::Unsigned, 0,  true,  true,  1, KVS_Q4_K},
    {KVS_Q5_K,    "Q5_K",    256, 176, Codes::Unsigned, 0,  true,  true,  1, KVS_Q5_K},
    {KVS_Q6_K,    "Q6_K",    256, 210, Codes::Biased,   32, true,  false, 1, KVS_Q6_K},
    {KVS_Q4_0_R8, "Q4_0_R8", 32,  18,  Codes::Biased,   8,  false, false, 8, KVS_Q4_0},
    {KVS_Q4_1_R8, "Q4_1_R8", 32,  20,  Codes::Unsigned, 0,  false, true,  8, KVS_Q4_1},
    {KVS_Q5_0_R8, "Q5_0_R8", 32,  22,  Codes::Biased,   16, false, false, 8, KVS_Q5_0},
    {KVS_Q5_1_R8, "Q5_1_R8", 32,  24,  Codes::Unsigned, 0,  false, true,  8, KVS_Q5_1},
    {KVS_Q8_0_R8, "Q8_0_R8", 32,  34,  Codes::Signed,   0,  false, false, 8, KVS_Q8_0},
    {KVS_Q4_K_R8, "Q4_K_R8", 256, 144, Codes::Unsigned, 0,  true,  true,  8, KVS_Q4_K},
    {KVS_Q5_K_R8, "Q5_K_R8", 256, 176, Codes::Unsigned, 0,  true,  true,  8, KVS_Q5_K},
    {KVS_Q6_K_R8, "Q6_K_R8", 256, 210, Codes::Biased,   32, true,  false, 8, KVS_Q6_K},
};
constexpr int kNumFormats = int(sizeof(kFormatRows) / sizeof(kFormatRows[0]));
constexpr FormatRow kNoFormat = {-1, "", 0, 0, Codes::Float, 0, false, false, 1, -1};

// the row of ggml type `type`, kNoFormat for a type the kernels do not run
constexpr const FormatRow& format_row(int type) {
    for (const FormatRow& row : kFormatRows)
        if (row.type == type) return row;
    return kNoFormat;
}

struct Geometry {
    int block;  // elements per block
    int bytes;  // bytes per block
};

// {0, 0} for a type the kernels do not run
constexpr Geometry geometry(int type) { return {format_row(type).block, format_row(type).bytes}; }
constexpr bool is_float_type(int type) { return format_row(type).codes == Codes::Float; }
constexpr Codes codes_of(int type) { return format_row(type).codes; }
constexpr int code_bias(int type) { return format_row(type).code_bias; }
constexpr bool has_subscales(int type) { return format_row(type).has_subscales; }
constexpr bool has_offset(int type) { return format_row(type).has_offset; }

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t load_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// IEEE half -> float, exact (portable bit manipulation; every half is a float)
inline float f16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal half: normalize
            int e = -1;
            do { mant <<= 1; ++e; } while (!(mant & 0x400));
            bits = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3FF) << 13;
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | mant << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | mant << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float load_f16(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// Q4_K / Q5_K: the eight 6-bit sub-scales and minimums of a superblock from its 12 packed bytes at q,
// byte j of sc and mn for sub-block j (j < 4: the low 6 bits of bytes j and 4 + j; j >= 4: byte
// 4 + j's nibbles, topped by the high 2 bits of bytes j - 4 and j), all eight at once
inline void k4_scales_mins(const uint8_t* q, uint64_t& sc, uint64_t& mn) {
    const uint32_t a = load_u32(q), b = load_u32(q + 4), c = load_u32(q + 8);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    sc = (a & low6) | uint64_t((c & low4) | (((a >> 6) & top2) << 4)) << 32;
    mn = (b & low6) | uint64_t(((c >> 4) & low4) | (((b >> 6) & top2) << 4)) << 32;
}

// the scale and min of sub-block j (0..7)
inline void k4_scale_min(int j, const uint8_t* q, int* sc, int* m) {
    uint64_t scales, mins;
    k4_scales_mins(q, scales, mins);
    *sc = int(scales >> (8 * j) & 0xff);
    *m = int(mins >> (8 * j) & 0xff);
}

}  // namespace kvs
