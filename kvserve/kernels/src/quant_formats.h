// GGUF/ggml weight formats as stored in the file: type ids, block geometry, half-float conversion and
// the K-quant scale unpacking. Layouts follow the GGUF specification (ggml's block_* structs).
#pragma once
#include <cstdint>
#include <cstring>

namespace kvs {

// ggml type ids (gguf.GGMLQuantizationType)
enum QType : int {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

struct Geometry {
    int block;  // elements per block
    int bytes;  // bytes per block
};

// {0, 0} for a type the kernels do not run
constexpr Geometry geometry(int type) {
    switch (type) {
        case T_F32: return {1, 4};
        case T_F16: return {1, 2};
        case T_BF16: return {1, 2};
        case T_Q4_0: return {32, 18};
        case T_Q4_1: return {32, 20};
        case T_Q5_0: return {32, 22};
        case T_Q5_1: return {32, 24};
        case T_Q8_0: return {32, 34};
        case T_Q4_K: return {256, 144};
        case T_Q5_K: return {256, 176};
        case T_Q6_K: return {256, 210};
        default: return {0, 0};
    }
}

inline bool is_float_type(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }

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
