// Weight-only quantized matmul on CPU: y[M, N] = x[M, K] @ W^T with W held as GGUF-style blocks of
// 32 along K (int4 codes with a step and a minimum per block: Q4_0/Q4_1; int8 codes with a step
// per block: Q8_0), repacked once at load (quant_matmul.py) into groups of 16 output columns.
//
// Each row of x is quantized on the fly per block of 32: step e = max|x| / 127, codes
// h = round(x / e) and, for "precise" layers, a second int8 code of the remainder,
// l = round((x - e h) / (e / 256)), so x = (e / 256) (256 h + l) to ~16 bits (finer than the
// bfloat16 input; int8 codes alone lost 10x the KL on SmolLM2, whose norms make outlier channels).
// Every (row, column, block) is then exact integer dot products of 32 codes (VNNI vpdpbusd, or
// AVX2 maddubs), scaled in float32 and added to the column's sum in block order 0, 1, 2, ...
//   int4: y += (d * u) * sum(q * c) + m * sum(x)        (w = d * q + m, q in 0..15)
//   int8: y += (d * u) * sum(q * c)                     (w = d * q, q in -127..127)
// with c = 256 h + l and u = e / 256 (precise), or c = h and u = e. With one code (not precise) the
// int4 codes are centred, w = d (q - 8) + (m + 8 d):
//   y += (d * u) * (sum(q * h) - 8 sum(h)) + (m + 8 d) * sum(x)
// so that h's rounding meets products of at most 8 steps rather than 15 (SmolLM2, one code for every
// projection: mean KL 0.0135 uncentred, 0.0026 centred, emulated in float against float32).
// Integer sums are exact and the float steps run in one fixed order per output element, on that
// element's own row and column only: a row's output is bitwise the same alone or among any rows
// (batch invariance by construction), whatever the thread split (columns are split by group).
//
// Layout of one (16-column group, block) of the packed weight, groups outermost, blocks inner:
//   int4: 256 bytes of codes (4 chunks of 64: byte 4c+t of chunk j holds column c's codes at
//         k = 8j+t in the low nibble and k = 8j+4+t in the high one), 16 float16 d, 16 float16 m
//   int8: 512 bytes (8 chunks of 64: byte 4c+t of chunk j is column c's code at k = 4j+t, plus
//         128 so that it is unsigned), 16 float16 d
// Quantized activations: row-major (row r's block b at codes r K + 32 b, the l codes after every
// row's h codes; steps and sums [r KB + b]) for the AVX2 paths and AMX tiles; block-major on the
// AVX-512 VNNI path (block b of row r at (b M + r) 64, h then l; steps and sums [b M + r]), so that a
// row tile's codes are constant offsets from one pointer (no address arithmetic per row).
// Paths, fixed at compile time by what -march=native defines: AVX-512 VNNI (zmm), AVX-VNNI or
// AVX2 (two ymm halves per group). lm_qmm_path() says which one was built.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "native_common.h"

static const int QK = 32;          // block length along K
static const int GROUP_COLS = 16;  // output columns per packed group
static const int Q4_GROUP_BYTES = 256 + 64;
static const int Q8_GROUP_BYTES = 512 + 32;
// Weights are streamed once a step: asking for the bytes this far ahead of the block being read
// kept more memory requests in flight than the hardware prefetcher alone (one batch-1 row over
// SmolLM2's layers on the 2-core Xeon: int8 12.1 -> 14.7-17.8 GB/s, int4 10.0 -> 12.1-14.9 GB/s).
// The requests fill the L2 (T1), not the L1: a request for the L1 holds one of the core's few L1
// fill buffers until its line arrives, and with them all taken the loop stalls on its next request
// (where the time went by sampling, 2026-12-02). Measured side by side on the AMX Xeon VM, the
// layers' linears of a step (no head), ms T0 4 KiB / T1 8 KiB, in two runs with the builds' order
// swapped: int4 M=1 from memory 4.54 / 4.16 and 4.06 / 3.79, from the cache (a serving loop) 2.79 /
// 2.26 and 2.70 / 2.34; int8 M=8 from the cache 6.42 / 5.29 and 7.21 / 5.66; M=32 the same. 8 KiB
// was the best of 2-16 KiB with T1; T2 was within the noise of T1.
#ifndef QMM_PREFETCH_BYTES
#define QMM_PREFETCH_BYTES 8192  // build flags for measuring other distances and hints
#endif
#ifndef QMM_PREFETCH_HINT
#define QMM_PREFETCH_HINT _MM_HINT_T1
#endif
static const int PREFETCH_BYTES = QMM_PREFETCH_BYTES;

static inline void prefetch_ahead(const uint8_t* g, int bytes) {
    if (PREFETCH_BYTES <= 0) return;
    for (int c = 0; c < bytes; c += 64) _mm_prefetch((const char*)g + PREFETCH_BYTES + c, QMM_PREFETCH_HINT);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QMM_PATH 3
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
#define QMM_PATH 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QMM_PATH 1
#else
#define QMM_PATH 0
#endif

// rows sharing one unpacking of a group's codes: 12 in zmm registers (a verified draft of 8 is 9
// rows), 8 on the ymm paths (16 registers hold no more accumulators)
static const int ROW_TILE = QMM_PATH == 3 ? 12 : 8;

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; a NaN stays a NaN
    uint32_t w;
    memcpy(&w, &f, 4);
    if (f != f) return (uint16_t)((w >> 16) | 0x40u);
    return (uint16_t)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

// One row of x -> per block of 32: int8 codes h and remainder codes l, the step e, the float sum
// of x (int4's minimum term) and the code sums of h and l (int8's offset of 128). Depends on that
// row only. xl null: one code (no remainder codes, nor their sums).
static void quantize_row_scalar(const void* x, int bf16, int64_t K, int8_t* xh, int8_t* xl, float* dx, float* sx,
                         int32_t* sh, int32_t* sl, int64_t cs = QK, int64_t ss = 1) {
    float v[QK];
    for (int64_t b = 0; b < K / QK; ++b) {
        float amax = 0.0f, sum = 0.0f;
        for (int t = 0; t < QK; ++t) {
            int64_t k = b * QK + t;
            v[t] = bf16 ? bf16_to_f32(((const uint16_t*)x)[k]) : ((const float*)x)[k];
            float a = fabsf(v[t]);
            amax = a > amax ? a : amax;
        }
        for (int t = 0; t < QK; ++t) sum += v[t];  // in index order
        float e = amax / 127.0f;
        float ie = e > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s1 = 0, s2 = 0;
        for (int t = 0; t < QK; ++t) {
            int h = (int)nearbyintf(v[t] * ie);
            h = h > 127 ? 127 : (h < -127 ? -127 : h);
            xh[b * cs + t] = (int8_t)h;
            s1 += h;
            if (!xl) continue;
            // the remainder with one rounding (a fused multiply-add), whatever the compiler's contraction
            int l = (int)nearbyintf(fmaf(-e, (float)h, v[t]) * ie * 256.0f);
            l = l > 127 ? 127 : (l < -127 ? -127 : l);
            xl[b * cs + t] = (int8_t)l;
            s2 += l;
        }
        dx[b * ss] = e;
        sx[b * ss] = sum;
        sh[b * ss] = s1;
        if (xl) sl[b * ss] = s2;
    }
}

#if QMM_PATH == 3
// The float sums of blocks b0 .. b0 + n - 1 (n <= 16) of a row, block b0 + j in lane j: each lane adds
// its block's values one after another in index order from 0, as quantize_row_scalar does, so the sums
// are bitwise its own; the lanes read their values by gathers (a bfloat16 pair per dword) instead of
// moving each value out of a vector register one at a time.
static inline __m512 block_sums(const void* x, int bf16, int64_t b0, int n) {
    const __mmask16 live = (__mmask16)((1u << n) - 1u);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 sum = _mm512_setzero_ps();
    if (bf16) {
        const __m512i at = _mm512_mullo_epi32(lane, _mm512_set1_epi32(QK / 2));  // dwords: a block is 16 of them
        const int* base = (const int*)((const uint16_t*)x + b0 * QK);
        for (int t = 0; t < QK; t += 2) {
            const __m512i pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, base + t / 2, 4);
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));  // value t
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u))));
        }
    } else {
        const __m512i at = _mm512_mullo_epi32(lane, _mm512_set1_epi32(QK));
        const float* base = (const float*)x + b0 * QK;
        for (int t = 0; t < QK; ++t)
            sum = _mm512_add_ps(sum, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, base + t, 4));
    }
    return sum;
}

// quantize_row_scalar's codes, steps and sums, 16 lanes at a time: the same float operations per
// value (products, the remainder's fused multiply-add, roundings to the nearest even integer), the same
// maximum (order-free), and the float sums added in index order (block_sums). At 512 rows the scalar
// loop took ~20% of a prompt chunk's matmul; summing each block by moving its values out of a register
// one at a time, ~10% of a 24-row call (by sampling, 2026-12-03).
static void quantize_row(const void* x, int bf16, int64_t K, int8_t* xh, int8_t* xl, float* dx, float* sx,
                         int32_t* sh, int32_t* sl, int64_t cs = QK, int64_t ss = 1) {
    const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    alignas(64) float sums[16];
    for (int64_t b = 0; b < K / QK; ++b) {
        const int64_t k0 = b * QK;
        if (b % 16 == 0) _mm512_store_ps(sums, block_sums(x, bf16, b, (int)std::min<int64_t>(16, K / QK - b)));
        __m512 v[2];
        for (int i = 0; i < 2; ++i)
            v[i] = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)x + k0 + 16 * i))), 16))
                        : _mm512_loadu_ps((const float*)x + k0 + 16 * i);
        // lane maxima as the scalar loop keeps its one: a NaN never replaces the running value
        __m512 m = _mm512_max_ps(_mm512_abs_ps(v[1]), _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps()));
        float amax = _mm512_reduce_max_ps(m);
        float e = amax / 127.0f;
        float ie = e > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 ve = _mm512_set1_ps(e), vie = _mm512_set1_ps(ie), v256 = _mm512_set1_ps(256.0f);
        __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
        for (int i = 0; i < 2; ++i) {
            __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(v[i], vie), rn);
            h = _mm512_min_ps(_mm512_max_ps(h, nlim), lim);
            __m512i hi = _mm512_cvtps_epi32(h);
            _mm_storeu_si128((__m128i*)(xh + b * cs + 16 * i), _mm512_cvtepi32_epi8(hi));
            s1 = _mm512_add_epi32(s1, hi);
            if (!xl) continue;
            __m512 r = _mm512_mul_ps(_mm512_mul_ps(_mm512_fnmadd_ps(ve, h, v[i]), vie), v256);
            __m512 l = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(r, rn), nlim), lim);
            __m512i li = _mm512_cvtps_epi32(l);
            _mm_storeu_si128((__m128i*)(xl + b * cs + 16 * i), _mm512_cvtepi32_epi8(li));
            s2 = _mm512_add_epi32(s2, li);
        }
        dx[b * ss] = e;
        sx[b * ss] = sums[b % 16];
        sh[b * ss] = _mm512_reduce_add_epi32(s1);
        if (xl) sl[b * ss] = _mm512_reduce_add_epi32(s2);
    }
}
#else
static inline void quantize_row(const void* x, int bf16, int64_t K, int8_t* xh, int8_t* xl, float* dx, float* sx,
                                int32_t* sh, int32_t* sl, int64_t cs = QK, int64_t ss = 1) {
    quantize_row_scalar(x, bf16, K, xh, xl, dx, sx, sh, sl, cs, ss);
}
#endif

// count outputs of one row from v (float32) into y at column n0: bfloat16 (f32_to_bf16's rounding, 16
// lanes at a time: BF16::store computes the same bits) or float32
static inline void store_row(void* y, int bf16, int64_t n0, const float* v, int count) {
    if (bf16) {
        uint16_t* o = (uint16_t*)y + n0;
        int c = 0;
        for (; c + 16 <= count; c += 16) BF16::store(o + c, F32::load(v + c));
        for (; c < count; ++c) o[c] = f32_to_bf16(v[c]);
    } else {
        memcpy((float*)y + n0, v, sizeof(float) * count);
    }
}

// For kquant_matmul.cpp, whose activations are these same codes: quantize_row by name.
void qmm_quantize_row(const void* x, int bf16, int64_t K, int8_t* xh, int8_t* xl, float* dx, float* sx, int32_t* sh,
                      int32_t* sl, int64_t cs, int64_t ss) {
    quantize_row(x, bf16, K, xh, xl, dx, sx, sh, sl, cs, ss);
}

struct Acts {  // the quantized rows of one call
    const int8_t *xh, *xl;  // [M, K] codes and remainder codes
    const float *dx, *sx;  // [M, K/32] steps and float sums
    // [M, K/32] code sums of h and l; with one code on the block-major layout (vnni_group), sl holds
    // each row-block's chain start instead (chain_start)
    const int32_t *sh, *sl;
    int64_t K, KB;
    bool precise;  // both codes (256 h + l), else h alone
    int64_t M;  // rows (the block-major layout's row count: vnni_group)
    // AMX only, [rows rounded up to the tile height, K/32] with the padding rows 0: unit() of each
    // row-block, and sx again, so that a tile's rows read them with no bounds to check
    const float* units;
    const float* sums;
};

// One thread's buffers for a call's quantized rows (codes, steps and float sums, code sums), kept
// from call to call; acts() sizes them for a call and lays them out as its Acts (the header's layouts).
struct RowBuffers {
    std::vector<int8_t> codes;
    std::vector<float> floats;
    std::vector<int32_t> sums;
    Acts acts(int64_t rows, int64_t M, int64_t K, int64_t KB, bool blocked, bool precise) {
        codes.resize((size_t)(2 * rows * K));
        floats.resize((size_t)(2 * M * KB));
        sums.resize((size_t)(2 * M * KB));
        const int8_t* c = codes.data();
        const float* f = floats.data();
        const int32_t* u = sums.data();
        return Acts{c, blocked ? c + 32 : c + rows * K, f, f + M * KB, u, u + M * KB, K, KB, precise, M, nullptr, nullptr};
    }
};

// The activation unit of a row-block of step e: e / 256 with the remainder codes, else e. Every path
// takes it from here, so its rounding is one and the same.
static inline float unit_of(bool precise, float e) { return precise ? e * (1.0f / 256.0f) : e; }
// 128 x a two-code row-block's code sum (256 sh + sl): what the int8 codes stored unsigned (+ 128) add.
static inline int32_t offset_of(int32_t sh, int32_t sl) { return 128 * (256 * sh + sl); }
static inline float unit(const Acts& a, int64_t rb) { return unit_of(a.precise, a.dx[rb]); }
// Where a one-code row-block's vpdpbusd chain starts: minus what the weight codes stored unsigned add
// to its products (int8: codes + 128; centred int4: q = (q - 8) + 8), so the chain ends at the exact
// sum over the signed codes.
static inline int32_t chain_start(int bits, int32_t sh) { return -(bits == 8 ? 128 : 8) * sh; }

#if QMM_PATH == 3
typedef int32_t __attribute__((may_alias)) int32_alias;

// One 64-byte chunk of packed int4 codes -> its low nibbles (lo) and its high ones (hi), a code a byte.
static inline void nibbles(__m512i p, __m512i& lo, __m512i& hi) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(p, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
}

// acc += w (unsigned bytes) x the 4 signed codes at p, broadcast to every lane from the instruction's
// memory operand (the intrinsic with _mm512_set1_epi32 costs GCC a separate vpbroadcastd each time)
static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_alias*)p));
    return acc;
}

// The first k of chunk j of a block's unpacked weight codes (the chunk holds k .. k + 3): 4j (ORDER 0),
// or int4's interleave 8(j/2) + 4(j%2) (ORDER 1).
template <int ORDER> static inline int chunk_k(int j) { return ORDER ? 8 * (j / 2) + 4 * (j % 2) : 4 * j; }

// The integer sum of one row's block of 32 codes (h at xh, l at xl) against w: 256 x the h codes' sum
// plus the l codes'. Four independent chains of four vpdpbusd.
template <int ORDER>
static inline __m512i row_block_sum(const __m512i w[8], const int8_t* xh, const int8_t* xl) {
    __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
    __m512i l0 = _mm512_setzero_si512(), l1 = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
        h0 = dpbusd_bcast(h0, w[j], xh + chunk_k<ORDER>(j));
        h1 = dpbusd_bcast(h1, w[j + 1], xh + chunk_k<ORDER>(j + 1));
        l0 = dpbusd_bcast(l0, w[j], xl + chunk_k<ORDER>(j));
        l1 = dpbusd_bcast(l1, w[j + 1], xl + chunk_k<ORDER>(j + 1));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
}

// The same with one code: a single chain of eight vpdpbusd that starts from the row-block's correction
// (chain_start: minus what the unsigned weight codes add), so the sum comes out corrected, with no
// second chain to add, no zeroing and no subtraction. The same exact integer as two chains less the
// correction (so the same outputs): all int4 and int8 linears of a step and the head on the AMX Xeon
// VM, 8 rows, cold, builds alternating first (2026-12-03): 6.82 -> 6.45 ms; 1 row unchanged (5.07 / 5.06).
template <int ORDER>
static inline __m512i row_block_sum_one_code(const __m512i w[8], const int8_t* xh, const int32_t* chain_start) {
    __m512i s = _mm512_set1_epi32(*chain_start);  // a broadcast from memory: no vector port
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) s = dpbusd_bcast(s, w[j], xh + chunk_k<ORDER>(j));
    return s;  // exact: |s| < 2^24 for int4 codes, < 2^31 for int8
}

// rows r0 .. r0+R-1 of one column group over all blocks; R <= ROW_TILE. Per block and row:
//   int4: y += (d * u) * sum(q * c) + m * sum(x) (one code: centred, see the header)
//   int8: y += (d * u) * (sum(q' * c) - 128 sum(c))
// The weight codes are unpacked once per block for all R rows; the accumulators stay in registers.
template <int R, int BITS, bool PRECISE>
static void vnni_group(const uint8_t* g, const Acts& a, int64_t r0, float out[][GROUP_COLS]) {
    __m512 acc[R];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int group_bytes = BITS == 4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES;
    constexpr int ORDER = BITS == 4 ? 1 : 0;  // the unpacked codes' k order (chunk_k)
    // block-major activations: block b of row r at codes (b M + r) 64 (h, then l at + 32), its steps and
    // sums at [b M + r], so every row of the tile is a constant offset from one pointer per block
    const int64_t M = a.M, KB = a.KB;
    const int8_t* c = a.xh + r0 * 64;
    const float* dx = a.dx + r0;
    const float* sx = a.sx + r0;
    const int32_t* sh = a.sh + r0;
    const int32_t* sl = a.sl + r0;
    for (int64_t b = 0; b < KB; ++b, g += group_bytes, c += M * 64, dx += M, sx += M, sh += M, sl += M) {
        prefetch_ahead(g, group_bytes);
        __m512i w[8];
        if (BITS == 4) {
            for (int j = 0; j < 4; ++j) nibbles(_mm512_loadu_si512(g + 64 * j), w[2 * j], w[2 * j + 1]);
        } else {
            for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(g + 64 * j);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + (BITS == 4 ? 256 : 512))));
        __m512 m = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + 288))) : d;
        if (BITS == 4 && !PRECISE) m = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), d, m);  // centred codes' minimum
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
            __m512i s;
            if (PRECISE) {
                s = row_block_sum<ORDER>(w, c + r * 64, c + r * 64 + 32);
                if (BITS == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset_of(sh[r], sl[r])));
            } else {
                s = row_block_sum_one_code<ORDER>(w, c + r * 64, sl + r);  // sl: the chain starts
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(unit_of(PRECISE, dx[r]))), acc[r]);
            if (BITS == 4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r]), acc[r]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

template <int R>
static void q4_group(const uint8_t* g, const Acts& a, int64_t r0, float out[][GROUP_COLS]) {
    if (a.precise) vnni_group<R, 4, true>(g, a, r0, out); else vnni_group<R, 4, false>(g, a, r0, out);
}

template <int R>
static void q8_group(const uint8_t* g, const Acts& a, int64_t r0, float out[][GROUP_COLS]) {
    if (a.precise) vnni_group<R, 8, true>(g, a, r0, out); else vnni_group<R, 8, false>(g, a, r0, out);
}

#if defined(LM_INT8_TILES)
#define QMM_AMX 1
// AMX tiles (Sapphire Rapids and later) for row tiles of up to 16: the same exact integer sums, taken
// by tile dot products (T rows x 16 columns x 32 k in one instruction), then the same float steps as
// vnni_group, element by element in block order. The weight codes enter the tile signed where the
// VNNI path corrects for unsigned ones (int8's codes - 128, centred int4's q - 8: tdpbssd), so the
// tile's sum is already the corrected integer and the float steps subtract no offset. So a row's
// output is bitwise what the VNNI path gives: which path runs for a call (by its row count) cannot
// change a row, and batch invariance holds across the switch. A call's rows are split into tiles of
// one even height of at most 16 (amx_height, native_common.h).
// Where the OS refuses the tile state (amx_granted, native_common.h) the VNNI path serves every call.
// A build with -DLM_SOFT_TILES runs this code over native_common.h's software tile unit (tests).

// Tiles of height T: 0 / 1 (and 5 / 6) the int32 sums of h / l codes, 2 / 3 the h / l codes (T rows x 32),
// 4 the block's weight codes (8 rows of k/4 x 16 columns x 4).
static AmxTileConfig qmm_tiles(int T) {
    AmxTileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; ++t) c.rows[t] = (uint8_t)T;
    c.colsb[0] = c.colsb[1] = 64;
    c.colsb[2] = c.colsb[3] = QK;
    c.rows[4] = QK / 4;
    c.colsb[4] = 64;
    c.rows[5] = c.rows[6] = (uint8_t)T;
    c.colsb[5] = c.colsb[6] = 64;
    return c;
}

// Whether a tile takes the weight codes signed (tdpbssd): int8 (codes - 128) and centred int4 (q - 8);
// int4 with two codes keeps q in 0..15 (tdpbsud) and adds the minimum term alone.
template <int BITS>
static inline bool amx_signed(const Acts& a) { return BITS == 8 || !a.precise; }

// Block g's weight codes for a tile, one byte a code, signed where amx_signed, in tile order (8 rows of
// k/4 x 16 columns x 4).
template <int BITS>
static inline void amx_unpack(const uint8_t* g, const Acts& a, uint8_t (*wq)[64]) {
    if (BITS == 4) {  // chunk j's low nibbles are k = 8j + t (tile row 2j), high ones k = 8j + 4 + t
        const __m512i shift = _mm512_set1_epi8(a.precise ? 0 : 8);
        for (int j = 0; j < 4; ++j) {
            __m512i lo, hi;
            nibbles(_mm512_loadu_si512(g + 64 * j), lo, hi);
            _mm512_store_si512(wq[2 * j], _mm512_sub_epi8(lo, shift));
            _mm512_store_si512(wq[2 * j + 1], _mm512_sub_epi8(hi, shift));
        }
    } else {  // the packed chunks are the tile's rows, the codes stored + 128: back to signed
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int j = 0; j < 8; ++j) _mm512_store_si512(wq[j], _mm512_xor_si512(_mm512_loadu_si512(g + 64 * j), flip));
    }
}

// The tile sums of block b of rows r0.. (the tile's height) into ch / cl from its codes in wq: tiles 0 / 1
// (even b) or 5 / 6 (odd b), so that the next block's tile work runs while the float steps read the last
// one's sums.
template <int BITS>
static inline void amx_block_sums(const Acts& a, int64_t r0, int64_t b, const uint8_t (*wq)[64],
                                  int32_t (*ch)[GROUP_COLS], int32_t (*cl)[GROUP_COLS]) {
    TILE_LOAD(4, wq, 64);
    const int64_t off = r0 * a.K + b * QK;
    TILE_LOAD(2, a.xh + off, a.K);
    if (a.precise) TILE_LOAD(3, a.xl + off, a.K);
    // sums of the h codes (tile 2) into tile H, of the l codes (tile 3) into tile L; tile numbers are immediates
#define SUMS(H, L, DP)             \
    TILE_ZERO(H);                  \
    DP(H, 2, 4);                   \
    TILE_STORE(H, ch, 64);         \
    if (a.precise) {               \
        TILE_ZERO(L);              \
        DP(L, 3, 4);               \
        TILE_STORE(L, cl, 64);     \
    }
    const bool sgn = amx_signed<BITS>(a);
    if (b & 1) {
        if (sgn) { SUMS(5, 6, TILE_DPBSSD) } else { SUMS(5, 6, TILE_DPBSUD) }
    } else {
        if (sgn) { SUMS(0, 1, TILE_DPBSSD) } else { SUMS(0, 1, TILE_DPBSUD) }
    }
#undef SUMS
}

// A block's weight codes as amx_unpack lays them out for the tile.
struct alignas(64) TileCodes {
    uint8_t rows[QK / 4][64];
};

// rows r0 .. r0+R-1 (R <= T; the codes buffer holds T rows past r0) of one column group, tiles of height T.
// Per block and row the float steps of vnni_group. `codes`: room for the group's blocks unpacked, shared
// by the call's row tiles over this group (null: a ring of three here); `fill`: this tile unpacks them
// (the group's first), else they are there already.
template <int BITS, int T>
static void amx_group(const uint8_t* g, const Acts& a, int64_t r0, int R, float out[][GROUP_COLS], TileCodes* codes,
                      bool fill) {
    alignas(64) int32_t ch[2][T][GROUP_COLS], cl[2][T][GROUP_COLS];
    // blocks' codes for the tiles, unpacked two blocks ahead: a tile load of bytes that vector stores
    // have just written waits for them to reach the cache (~27 ns a block on the AMX Xeon VM, against
    // ~10 ns for a block's whole tile work), so the stores get a block's float steps to land
    TileCodes ring[3];
    const bool unpack = fill || !codes;
    auto block_codes = [&](int64_t b) { return codes ? codes[b].rows : ring[b % 3].rows; };
    __m512 acc[T];
#pragma GCC unroll 16
    for (int r = 0; r < T; ++r) acc[r] = _mm512_setzero_ps();
    const int group_bytes = BITS == 4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES;
    const bool precise = a.precise;
    const int64_t KB = a.KB;
    if (unpack) {
        amx_unpack<BITS>(g, a, block_codes(0));
        if (KB > 1) amx_unpack<BITS>(g + group_bytes, a, block_codes(1));
    }
    amx_block_sums<BITS>(a, r0, 0, block_codes(0), ch[0], cl[0]);
    const float* units = a.units + r0 * KB;
    const float* sums = a.sums + r0 * KB;
    for (int64_t b = 0; b < KB; ++b, g += group_bytes) {
        const int p = (int)(b & 1);
        if (b + 1 < KB) amx_block_sums<BITS>(a, r0, b + 1, block_codes(b + 1), ch[1 - p], cl[1 - p]);
        if (unpack && b + 2 < KB) {
            prefetch_ahead(g + 2 * group_bytes, group_bytes);
            amx_unpack<BITS>(g + 2 * group_bytes, a, block_codes(b + 2));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + (BITS == 4 ? 256 : 512))));
        __m512 m = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + 288))) : d;
        if (BITS == 4 && !precise) m = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), d, m);  // centred codes' minimum
        // all T rows (a padding row is thrown away): a fixed count keeps acc[] in registers
#pragma GCC unroll 16
        for (int r = 0; r < T; ++r) {
            __m512i s = _mm512_load_si512(ch[p][r]);
            if (precise) s = _mm512_add_epi32(_mm512_slli_epi32(s, 8), _mm512_load_si512(cl[p][r]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(units[r * KB + b])), acc[r]);
            if (BITS == 4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * KB + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

typedef void (*AmxFn)(const uint8_t*, const Acts&, int64_t, int, float[][GROUP_COLS], TileCodes*, bool);

template <int BITS>
static AmxFn amx_of(int T) {  // T even, 2..16
    switch (T) {
        case 2: return amx_group<BITS, 2>; case 4: return amx_group<BITS, 4>; case 6: return amx_group<BITS, 6>;
        case 8: return amx_group<BITS, 8>; case 10: return amx_group<BITS, 10>; case 12: return amx_group<BITS, 12>;
        case 14: return amx_group<BITS, 14>; default: return amx_group<BITS, 16>;
    }
}
#endif
#elif QMM_PATH >= 1
// 8 lanes: u8 codes (0..15 for int4) x s8 activations, 4 products per int32 lane, added on.
static inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) {
#if QMM_PATH == 2
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// int4: w[j] unsigned codes 0..15, chunk j at k = 8(j/2) + 4(j%2)
static inline __m256i dot4_block(const __m256i w[8], const int8_t* xr) {
#if QMM_PATH == 2
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        int32_t x0, x1;
        memcpy(&x0, xr + 8 * (j / 2), 4);
        memcpy(&x1, xr + 8 * (j / 2) + 4, 4);
        s0 = dot_u8s8(s0, w[j], _mm256_set1_epi32(x0));
        s1 = dot_u8s8(s1, w[j + 1], _mm256_set1_epi32(x1));
    }
    return _mm256_add_epi32(s0, s1);
#else
    // maddubs's int16 pair sums (|q x| <= 15 x 128, two a lane) of all 8 chunks add up within int16
    // (8 x 3,840 < 2^15), so one widening madd a block instead of one a chunk: the same exact sums
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
        int32_t x;
        memcpy(&x, xr + 8 * (j / 2) + 4 * (j % 2), 4);
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(x)));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

// int8: w[j] signed codes, chunk j at k = 4j. |w| (u8 <= 127) times x with w's sign: the pairs
// stay within int16 and the sum is exact (the same integer VNNI computes from the offset codes).
static inline __m256i dot8_block(const __m256i w[8], const int8_t* xr) {
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
        int32_t x0;
        memcpy(&x0, xr + 4 * j, 4);
        __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(x0), w[j]);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), xs), _mm256_set1_epi16(1)));
    }
    return s;
}

template <int BITS>
static inline __m256i codes_dot(const Acts& a, const __m256i w[8], int64_t r, int64_t b) {
    const int64_t off = r * a.K + b * QK;
    __m256i s = BITS == 4 ? dot4_block(w, a.xh + off) : dot8_block(w, a.xh + off);
    if (a.precise) s = _mm256_add_epi32(_mm256_slli_epi32(s, 8), BITS == 4 ? dot4_block(w, a.xl + off) : dot8_block(w, a.xl + off));
    return s;
}

template <int R>
static void q4_group(const uint8_t* g, const Acts& a, int64_t r0, float out[][GROUP_COLS]) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < a.KB; ++b, g += Q4_GROUP_BYTES) {
        prefetch_ahead(g, Q4_GROUP_BYTES);
        for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h+7
            __m256i w[8];
            for (int j = 0; j < 4; ++j) {
                __m256i p = _mm256_loadu_si256((const __m256i*)(g + 64 * j + 32 * h));
                w[2 * j] = _mm256_and_si256(p, low);
                w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
            }
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 256 + 16 * h)));
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 288 + 16 * h)));
            if (!a.precise) m = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), d, m);  // centred codes' minimum
            for (int r = 0; r < R; ++r) {
                int64_t rb = (r0 + r) * a.KB + b;
                __m256i s = codes_dot<4>(a, w, r0 + r, b);
                if (!a.precise) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * a.sh[rb]));  // sum((q - 8) h)
                __m256 isum = _mm256_cvtepi32_ps(s);
                acc[r][h] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, _mm256_set1_ps(unit(a, rb))), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sx[rb]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(out[r], acc[r][0]);
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
}

template <int R>
static void q8_group(const uint8_t* g, const Acts& a, int64_t r0, float out[][GROUP_COLS]) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < a.KB; ++b, g += Q8_GROUP_BYTES) {
        prefetch_ahead(g, Q8_GROUP_BYTES);
        for (int h = 0; h < 2; ++h) {
            __m256i w[8];
            for (int j = 0; j < 8; ++j)  // back to signed codes
                w[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(g + 64 * j + 32 * h)), flip);
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 512 + 16 * h)));
            for (int r = 0; r < R; ++r) {
                int64_t rb = (r0 + r) * a.KB + b;
                __m256 isum = _mm256_cvtepi32_ps(codes_dot<8>(a, w, r0 + r, b));
                acc[r][h] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, _mm256_set1_ps(unit(a, rb))), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(out[r], acc[r][0]);
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
}
#endif

#if QMM_PATH >= 1
typedef void (*GroupFn)(const uint8_t*, const Acts&, int64_t, float[][GROUP_COLS]);

template <template <int> class F>
struct Tiles {
    static GroupFn of(int r) {
        switch (r) {
            case 1: return F<1>::fn; case 2: return F<2>::fn; case 3: return F<3>::fn; case 4: return F<4>::fn;
            case 5: return F<5>::fn; case 6: return F<6>::fn; case 7: return F<7>::fn;
#if QMM_PATH == 3
            case 8: return F<8>::fn; case 9: return F<9>::fn; case 10: return F<10>::fn; case 11: return F<11>::fn;
#endif
            default: return F<ROW_TILE>::fn;
        }
    }
};
template <int R> struct Q4 { static void fn(const uint8_t* g, const Acts& a, int64_t r0, float o[][GROUP_COLS]) { q4_group<R>(g, a, r0, o); } };
template <int R> struct Q8 { static void fn(const uint8_t* g, const Acts& a, int64_t r0, float o[][GROUP_COLS]) { q8_group<R>(g, a, r0, o); } };

#ifdef QMM_AMX
// Which calls take the AMX tiles (when granted): 0 none, 1 those the rule in matmul() picks, 2 every
// call (tests and benchmarks). Rows come out the same either way: a speed setting only (lm_qmm_set_amx).
static int amx_mode = 1;
static const int AMX_MIN_ROWS = 12;
#endif
bool qmm_takes_tiles(int64_t M);  // the rule (below, shared with kquant_matmul.cpp)
static const int OWN_ROWS_MAX = 8;  // calls of up to this many rows: every thread quantizes them all (matmul)

static int matmul(int bits, int precise, const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* w,
                  int64_t N, void* y, int y_bf16, int threads) {
    if (K % QK || N % GROUP_COLS || M < 0) return 1;
    const int64_t KB = K / QK, groups = N / GROUP_COLS;
    const int64_t group_bytes = KB * (bits == 4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES);
#ifdef QMM_AMX
    // A tile pass over a group has a larger fixed cost than the VNNI path's pass over a row tile and a
    // smaller one per row: the tiles serve calls of 12 rows or more. All int4 linears of a step on the AMX
    // Xeon VM (one code, ms VNNI / tiles, alternating first, 2026-12-02 after the tiles' shared unpacking):
    // 10 rows 5.12 / 5.20, 12 rows 6.19 / 5.61, 20 rows 10.40 / 8.85, 24 rows 10.27 / 9.90, 32 rows
    // 13.02 / 11.85. (Before that, one-code int4 took the tiles only where they made fewer passes than
    // the VNNI row tiles; int8 and two codes gained from 12 rows on.)
    const bool amx = qmm_takes_tiles(M);
    const int T = amx ? amx_height(M) : 0;
    const int64_t rows = amx ? (M + T - 1) / T * T : M;  // a tile reads T rows of codes
#else
    const bool amx = false;
    const int64_t rows = M;
#endif
    const bool blocked = QMM_PATH == 3 && !amx;  // the header's activation layouts: block-major for vnni_group
    // the calling thread's buffers, by reference: inside the parallel region a thread_local name
    // would be each worker's own copy
    static thread_local RowBuffers call_rows;
    RowBuffers& shared = call_rows;
    Acts a = shared.acts(rows, M, K, KB, blocked, precise != 0);
#ifdef QMM_AMX
    static thread_local std::vector<float> amx_floats;
    if (amx) {
        amx_floats.assign((size_t)(2 * rows * KB), 0.0f);
        a.units = amx_floats.data();
        a.sums = amx_floats.data() + rows * KB;
    }
    float* units = amx_floats.data();
#endif
    const size_t x_row = (size_t)K * (x_bf16 ? 2 : 4);
    auto quantize = [&](int64_t r, RowBuffers& into) {  // row r, either layout
        int8_t* codes_at = into.codes.data();
        float* floats_at = into.floats.data();
        int32_t* sums_at = into.sums.data();
        // one code (not precise): no remainder codes (xl null), and on the block-major layout the chains'
        // starts where their sums would be
        if (blocked) {
            quantize_row((const char*)x + r * x_row, x_bf16, K, codes_at + r * 64,
                         precise ? codes_at + r * 64 + 32 : nullptr, floats_at + r, floats_at + M * KB + r, sums_at + r,
                         sums_at + M * KB + r, M * 64, M);
            if (!precise)
                for (int64_t b = 0; b < KB; ++b) sums_at[M * KB + b * M + r] = chain_start(bits, sums_at[b * M + r]);
        } else
            quantize_row((const char*)x + r * x_row, x_bf16, K, codes_at + r * K,
                         precise ? codes_at + rows * K + r * K : nullptr, floats_at + r * KB, floats_at + M * KB + r * KB,
                         sums_at + r * KB, sums_at + M * KB + r * KB);
    };
    // A call of a few rows on the VNNI path (a decode step's): each thread quantizes every row into its
    // own buffers, so that the threads do not wait for each other between the quantizing and the
    // products (the same codes, computed twice). All linears of a step on the AMX Xeon VM, HEAD beside
    // this in one process (2026-12-03, cold, 11 rounds): 8 rows 6.08 / 5.63 ms, 9 rows 6.32 / 6.21, 1 row
    // 4.20 / 4.15 (and 6.33 / 5.89, 5.88 / 5.75 at 8 rows with the rule at 16 rows).
    const bool own_rows = blocked && M <= OWN_ROWS_MAX;
    const int64_t tiles = (M + ROW_TILE - 1) / ROW_TILE;
    auto store = [&](int64_t r0, int R, int64_t gi, float out[][GROUP_COLS]) {
        for (int r = 0; r < R; ++r)
            store_row((char*)y + (r0 + r) * N * (y_bf16 ? 2 : 4), y_bf16, gi * GROUP_COLS, out[r], GROUP_COLS);
    };
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        Acts rows_here = a;  // the rows this thread reads: the call's shared ones, or its own copy
        if (own_rows) {
            static thread_local RowBuffers own;  // each thread's own (inside the region)
            rows_here = own.acts(rows, M, K, KB, blocked, precise != 0);
            for (int64_t r = 0; r < M; ++r) quantize(r, own);
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r) quantize(r, shared);
        }
#ifdef QMM_AMX
        if (amx) {
#pragma omp for schedule(static)
            for (int64_t rb = 0; rb < M * KB; ++rb) {
                units[rb] = unit(a, rb);
                units[rows * KB + rb] = a.sx[rb];
            }
            AmxScope tiles(qmm_tiles(T));
            const AmxFn group = bits == 4 ? amx_of<4>(T) : amx_of<8>(T);
            // several row tiles: a group's first unpacks its codes for all of them
            std::vector<TileCodes> codes(M > T ? (size_t)KB : 0);
#pragma omp for schedule(static)
            for (int64_t gi = 0; gi < groups; ++gi) {
                const uint8_t* g = w + gi * group_bytes;
                float out[AMX_ROWS][GROUP_COLS];
                for (int64_t r0 = 0; r0 < M; r0 += T) {
                    int R = (int)(M - r0 < T ? M - r0 : T);
                    group(g, a, r0, R, out, codes.empty() ? nullptr : codes.data(), r0 == 0);
                    store(r0, R, gi, out);
                }
            }
        } else
#endif
        {
#pragma omp for schedule(static)
            for (int64_t gi = 0; gi < groups; ++gi) {
                const uint8_t* g = w + gi * group_bytes;
                float out[ROW_TILE][GROUP_COLS];
                for (int64_t t = 0, r0 = 0; t < tiles; ++t) {  // rows in tiles of even sizes (16: 8 + 8)
                    const int R = (int)(M / tiles + (t < M % tiles));
                    (bits == 4 ? Tiles<Q4>::of(R) : Tiles<Q8>::of(R))(g, rows_here, r0, out);
                    store(r0, R, gi, out);
                    r0 += R;
                }
            }
        }
    }
    return 0;
}
#endif

// Whether a call of M rows takes the AMX tiles, by the setting (lm_qmm_set_amx) and the rule above.
// kquant_matmul.cpp asks too: one rule and one setting for both kernels.
bool qmm_takes_tiles(int64_t M) {
#ifdef QMM_AMX
    return M > 0 && (amx_mode == 2 || (amx_mode == 1 && M >= AMX_MIN_ROWS)) && amx_granted();
#else
    (void)M;
    return false;
#endif
}

extern "C" {

// 3: AVX-512 VNNI, 2: AVX-VNNI (ymm), 1: AVX2, 0: not built (the callers keep torch's kernels).
int lm_qmm_path() { return QMM_PATH; }

// 1 when calls of enough rows take AMX tiles (built with them and granted by the OS), 2 when they take
// the software tile unit (a test build: native_common.h), else 0.
int lm_qmm_amx() {
#ifdef QMM_AMX
    return amx_granted() ? LM_INT8_TILES : 0;
#else
    return 0;
#endif
}

// Which calls take the AMX tiles: 0 none, 1 by the rule (the default), 2 all; returns the previous setting.
int lm_qmm_set_amx(int mode) {
#ifdef QMM_AMX
    int was = amx_mode;
    amx_mode = mode < 0 ? 0 : (mode > 2 ? 2 : mode);
    return was;
#else
    (void)mode;
    return 0;
#endif
}

int lm_kqmm(int precise, const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* w, int64_t N, void* y,
            int y_bf16, int threads);  // kquant_matmul.cpp
static const int QMM_KQUANT = 256;  // "bits" of a weight packed by kquant_matmul.py: GGUF K-quant super-blocks

// y [M, N] (bfloat16 when y_bf16, else float32) = x [M, K] (bfloat16 / float32, rows packed) times
// the packed weight's transpose. bits: 4 or 8, or QMM_KQUANT (lm_kqmm); precise: remainder codes too.
// Returns 0, 1 for shapes it does not take, 2 when built without a path.
int lm_qmm(int bits, int precise, const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* w, int64_t N,
           void* y, int y_bf16, int threads) {
    if (bits == QMM_KQUANT) return lm_kqmm(precise, x, x_bf16, M, K, w, N, y, y_bf16, threads);
#if QMM_PATH >= 1
    if (bits != 4 && bits != 8) return 1;
    return matmul(bits, precise, x, x_bf16, M, K, w, N, y, y_bf16, threads);
#else
    (void)bits; (void)precise; (void)x; (void)x_bf16; (void)M; (void)K; (void)w; (void)N; (void)y; (void)y_bf16; (void)threads;
    return 2;
#endif
}
}
