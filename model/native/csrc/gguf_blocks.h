// GGUF block formats decoded to float32 (gguf_dequant.cpp's loader reads, native_step.cpp's embedding
// lookup from a file's own blocks). Each value is computed in float32 with the products in the same order
// as the gguf package's numpy dequantizers, so float32 is bitwise theirs; bfloat16 is that float32
// rounded to nearest even, as torch's conversion does. Plain loops over 32 values, which the compiler
// vectorizes for the machine.
#pragma once
#include <cstdint>
#include <cstring>

namespace gguf {


constexpr int QK_K = 256;

// IEEE half -> float, exactly (normals, subnormals, infinities and NaN).
inline float half_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: man x 2^-24, exact in float32
        float f = float(man) * 5.9604644775390625e-08f;
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// One block's values into out (float32): `n` values per block of the type.
inline void q4_0(const uint8_t* b, float* y) {
    const float d = half_to_float(b);
    for (int l = 0; l < 16; l++) {
        y[l] = d * float(int(b[2 + l] & 0xF) - 8);
        y[l + 16] = d * float(int(b[2 + l] >> 4) - 8);
    }
}

inline void q4_1(const uint8_t* b, float* y) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int l = 0; l < 16; l++) {
        y[l] = d * float(b[4 + l] & 0xF) + m;
        y[l + 16] = d * float(b[4 + l] >> 4) + m;
    }
}

inline void q5_0(const uint8_t* b, float* y) {
    const float d = half_to_float(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int l = 0; l < 16; l++) {
        y[l] = d * float(int((b[6 + l] & 0xF) | (((qh >> l) & 1) << 4)) - 16);
        y[l + 16] = d * float(int((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16);
    }
}

inline void q5_1(const uint8_t* b, float* y) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    for (int l = 0; l < 16; l++) {
        y[l] = d * float((b[8 + l] & 0xF) | (((qh >> l) & 1) << 4)) + m;
        y[l + 16] = d * float((b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) + m;
    }
}

inline void q8_0(const uint8_t* b, float* y) {
    const float d = half_to_float(b);
    for (int l = 0; l < 32; l++) y[l] = float(int8_t(b[2 + l])) * d;
}

// Q4_K and Q5_K: eight sub-blocks of 32, each with a 6-bit scale and minimum packed in 12 bytes.
inline void scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q5_K is Q4_K with a fifth bit per value (32 bytes of high bits before the nibbles).
template <bool FIVE>
inline void q45_k(const uint8_t* b, float* y) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qh = b + 16, *qs = b + (FIVE ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min(b + 4, j, sc, m);
        const float ds = d * float(sc), dm = dmin * float(m);
        const uint8_t* q = qs + (j / 2) * 32;
        const int shift = (j & 1) * 4;
        for (int l = 0; l < 32; l++) {
            const int high = FIVE ? ((qh[l] >> j) & 1) << 4 : 0;
            y[j * 32 + l] = ds * float(((q[l] >> shift) & 0xF) | high) - dm;
        }
    }
}

inline void q6_k(const uint8_t* b, float* y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* scales = (const int8_t*)(b + 192);
    const float d = half_to_float(b + 208);
    for (int c = 0; c < 8; c++) {  // chunks of 32: half h of the block, quarter k of it
        const int h = c / 4, k = c % 4;
        const uint8_t* lo = ql + h * 64 + (k & 1) * 32;
        const int lshift = (k / 2) * 4;
        const uint8_t* hi = qh + h * 32;
        for (int l = 0; l < 32; l++) {
            const float ds = d * float(scales[c * 2 + l / 16]);
            const int q = int(((lo[l] >> lshift) & 0xF) | (((hi[l] >> (2 * k)) & 3) << 4)) - 32;
            y[c * 32 + l] = ds * float(q);
        }
    }
}

struct Format {
    int values, bytes;
    void (*block)(const uint8_t*, float*);
};

// GGML type ids: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14.
inline bool format_for(int ggml_type, Format& f) {
    switch (ggml_type) {
        case 2: f = {32, 18, q4_0}; return true;
        case 3: f = {32, 20, q4_1}; return true;
        case 6: f = {32, 22, q5_0}; return true;
        case 7: f = {32, 24, q5_1}; return true;
        case 8: f = {32, 34, q8_0}; return true;
        case 12: f = {QK_K, 144, q45_k<false>}; return true;
        case 13: f = {QK_K, 176, q45_k<true>}; return true;
        case 14: f = {QK_K, 210, q6_k}; return true;
        default: return false;
    }
}

inline uint16_t to_bf16(float x) {  // round to nearest even; NaN stays a (quiet) NaN
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}


// One row of K values of a GGML type -> bfloat16; false for a type it does not take.
inline bool row_to_bf16(int ggml_type, const uint8_t* row, int64_t K, uint16_t* out) {
    Format f;
    if (!format_for(ggml_type, f) || K % f.values) return false;
    float buf[QK_K];
    for (int64_t i = 0; i < K / f.values; i++) {
        f.block(row + i * f.bytes, buf);
        for (int l = 0; l < f.values; l++) out[i * f.values + l] = to_bf16(buf[l]);
    }
    return true;
}

}  // namespace gguf
