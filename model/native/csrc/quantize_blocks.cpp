// Quantizing float weights at load for the native kernel (a bfloat16 or float32 checkpoint served in
// bfloat16+int8 or +int4): Q8_0's and Q4_1's recipes per block of 32 (formats.quantize_q80 / quantize_q41)
// and the kernel's packed layouts (quant_matmul.pack_q8 / pack_q4), each the same bits as the torch code
// beside it, in one pass over the rows instead of a dozen tensor-wide passes (a Llama-3.2-1B's weights:
// ~60 s of torch ops on 2 cores).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "native_common.h"

namespace {

constexpr int BLOCK = 32;      // weights per Q8_0 block along K
constexpr int COLS = 16;       // output rows per packed group (quant_matmul.GROUP_COLS)
constexpr int GROUP_BYTES = 544;  // a group's int8 block: 512 codes + 16 float16 steps
constexpr int GROUP_BYTES_Q4 = 320;  // a group's int4 block: 256 bytes of nibbles, 16 steps, 16 minimums

inline float round_even(float x) {
    return _mm_cvtss_f32(_mm_round_ss(_mm_setzero_ps(), _mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline void put_half(uint8_t* dst, float x) {
#if defined(__F16C__)
    const uint16_t h = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    std::memcpy(dst, &h, 2);
#else
    (void)dst, (void)x;
#endif
}

inline float weight(const void* src, int bf16, int64_t i) {
    if (!bf16) return ((const float*)src)[i];
    const uint32_t bits = (uint32_t)((const uint16_t*)src)[i] << 16;
    float w;
    std::memcpy(&w, &bits, sizeof w);
    return w;
}

#if defined(__F16C__)
#if defined(__AVX512F__)
inline __m512 load16(const void* src, int bf16, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float*)src + i);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)src + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// One Q8_0 block of 32 (weights at `at`): |x| max, the step rounded to float16, x * inv rounded to nearest
// even and clamped. With AVX-512, the same operations on 16 lanes at a time, so the same bits.
inline void quantize_q80_block(const void* w, int bf16, int64_t at, int8_t* q, float* d) {
#if defined(__AVX512F__)
    const __m512 x0 = load16(w, bf16, at), x1 = load16(w, bf16, at + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float step = _cvtsh_ss(_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT));
    const __m512 inv = _mm512_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (int h = 0; h < 2; ++h) {
        const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(h ? x1 : x0, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
        _mm_storeu_si128((__m128i*)(q + 16 * h), _mm512_cvtsepi32_epi8(c));
    }
    *d = step;
#else
    float x[BLOCK], a[BLOCK];
    for (int l = 0; l < BLOCK; ++l) {  // loops the compiler vectorizes
        x[l] = weight(w, bf16, at + l);
        a[l] = std::fabs(x[l]);
    }
    float amax = 0.0f;
    for (int l = 0; l < BLOCK; ++l) amax = a[l] > amax ? a[l] : amax;
    const float step = _cvtsh_ss(_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT));
    const float inv = step > 0.0f ? 1.0f / step : 0.0f;
    for (int l = 0; l < BLOCK; ++l) {
        const float r = round_even(x[l] * inv);
        q[l] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    *d = step;
#endif
}
#endif

// body(dst, row, b, c) for each row c of each group of 16 rows and each block b of 32 along K, dst the
// group's packed block of `bytes` (the int8 and int4 layouts share this order).
template <class Body>
void each_packed_row(int64_t N, int64_t K, int64_t bytes, uint8_t* out, int threads, Body body) {
    const int64_t B = K / BLOCK;
    for_rows((int)(N / COLS), COLS * K, threads, [&](int g) {
        for (int64_t b = 0; b < B; ++b) {
            uint8_t* dst = out + (g * B + b) * bytes;
            for (int c = 0; c < COLS; ++c) body(dst, (int64_t)g * COLS + c, b, c);
        }
    });
}

}  // namespace

extern "C" {

// w [N, K] float32 (bf16 0) or bfloat16 (1) -> q [N, K] int8 and d [N, K/32] float32: per block,
// d = max|w| / 127 rounded to float16, q = w / d rounded to nearest even, clamped to [-127, 127] (0 where
// d is 0). Returns 1 where this build cannot round to float16 (no F16C): the caller quantizes with torch.
int lm_quantize_q80(const void* w, int bf16, int64_t N, int64_t K, int8_t* q, float* d, int threads) {
#if defined(__F16C__)
    if (K % BLOCK) return 1;
    for_rows((int)N, K, threads, [&](int r) {
        for (int64_t b = 0; b < K / BLOCK; ++b)
            quantize_q80_block(w, bf16, r * K + b * BLOCK, q + r * K + b * BLOCK, d + r * (K / BLOCK) + b);
    });
    return 0;
#else
    (void)w, (void)bf16, (void)N, (void)K, (void)q, (void)d, (void)threads;
    return 1;
#endif
}

// q [N, K] int8, d [N, K/32] float32 (float16 values) -> out [N/16 * K/32 * 544] uint8: per group of 16
// rows and block of 32, the codes + 128 at 64 j + 4 c + t for row c and k = 32 b + 4 j + t, then the
// 16 rows' steps as float16. Returns 1 where N or K does not fit the layout or there is no F16C.
int lm_pack_q8(const int8_t* q, const float* d, int64_t N, int64_t K, uint8_t* out, int threads) {
#if defined(__F16C__)
    if (N % COLS || K % BLOCK) return 1;
    each_packed_row(N, K, GROUP_BYTES, out, threads, [&](uint8_t* dst, int64_t row, int64_t b, int c) {
        const int8_t* src = q + row * K + b * BLOCK;
        for (int j = 0; j < 8; ++j)
            for (int t = 0; t < 4; ++t) dst[64 * j + 4 * c + t] = (uint8_t)(src[4 * j + t] + 128);
        put_half(dst + 512 + 2 * c, d[row * (K / BLOCK) + b]);
    });
    return 0;
#else
    (void)q, (void)d, (void)N, (void)K, (void)out, (void)threads;
    return 1;
#endif
}

// w [N, K] float32 (bf16 0) or bfloat16 (1) -> q [N, K] uint8 codes 0..15, d and m [N, K/32] float32: per
// block, m = min, d = (max - min) / 15, q = (w - m) / d rounded to nearest even, clamped to [0, 15] (0 where
// d is 0). Returns 1 for a K that is not a multiple of 32.
int lm_quantize_q41(const void* w, int bf16, int64_t N, int64_t K, uint8_t* q, float* d, float* m, int threads) {
    if (K % BLOCK) return 1;
    for_rows((int)N, K, threads, [&](int r) {
        for (int64_t b = 0; b < K / BLOCK; ++b) {
            const int64_t at = r * K + b * BLOCK;
            float x[BLOCK];
            for (int l = 0; l < BLOCK; ++l) x[l] = weight(w, bf16, at + l);
            float lo = x[0], hi = x[0];
            for (int l = 1; l < BLOCK; ++l) {
                lo = x[l] < lo ? x[l] : lo;
                hi = x[l] > hi ? x[l] : hi;
            }
            const float step = (hi - lo) / 15.0f, inv = step > 0.0f ? 1.0f / step : 0.0f;
            for (int l = 0; l < BLOCK; ++l) {
                const float v = round_even((x[l] - lo) * inv);
                q[at + l] = (uint8_t)(v > 15.0f ? 15.0f : v < 0.0f ? 0.0f : v);
            }
            d[r * (K / BLOCK) + b] = step;
            m[r * (K / BLOCK) + b] = lo;
        }
    });
    return 0;
}

// q [N, K] uint8 codes 0..15, d and m [N, K/32] float32 -> out [N/16 * K/32 * 320] uint8: per group of 16
// rows and block of 32, row c's codes k = 32 b + 8 j + t (low nibble) and 8 j + 4 + t (high) at byte
// 64 j + 4 c + t, then the 16 steps and the 16 minimums as float16. Returns 1 where N or K does not fit
// the layout or there is no F16C.
int lm_pack_q4(const uint8_t* q, const float* d, const float* m, int64_t N, int64_t K, uint8_t* out, int threads) {
#if defined(__F16C__)
    if (N % COLS || K % BLOCK) return 1;
    each_packed_row(N, K, GROUP_BYTES_Q4, out, threads, [&](uint8_t* dst, int64_t row, int64_t b, int c) {
        const uint8_t* src = q + row * K + b * BLOCK;
        for (int j = 0; j < 4; ++j)
            for (int t = 0; t < 4; ++t) dst[64 * j + 4 * c + t] = (uint8_t)(src[8 * j + t] | (src[8 * j + 4 + t] << 4));
        put_half(dst + 256 + 2 * c, d[row * (K / BLOCK) + b]);
        put_half(dst + 288 + 2 * c, m[row * (K / BLOCK) + b]);
    });
    return 0;
#else
    (void)q, (void)d, (void)m, (void)N, (void)K, (void)out, (void)threads;
    return 1;
#endif
}
}
