// Two ceilings of this machine that bound the weight-only linears (machine_peaks.py), built with the
// same compiler and flags as the serving kernels (model/native/build.py) but for benchmarks only:
//   - lm_peak_products: int8 dot products a second on independent registers, the instruction the
//     quantized kernel uses (AVX-512 VNNI vpdpbusd: 64 products; AVX-VNNI: 32; AVX2 maddubs+madd: 32);
//   - lm_peak_read: bytes a second reading a list of buffers as the native decode loop reads a step's
//     weights: one OpenMP region per buffer (the loop calls the kernel once per linear, each splitting
//     its 16-column groups statically over the threads), or one region streaming them all.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

// Four 64-bit lanes of a running sum: AVX2 where built with it, else plain words (same sums).
#if defined(__AVX2__)
typedef __m256i Lanes;
static inline Lanes zero_lanes() { return _mm256_setzero_si256(); }
static inline Lanes add_lanes(Lanes acc, const uint8_t* p) { return _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i*)p)); }
static inline uint64_t total_of(Lanes v) {
    return (uint64_t)_mm256_extract_epi64(v, 0) + (uint64_t)_mm256_extract_epi64(v, 1) +
           (uint64_t)_mm256_extract_epi64(v, 2) + (uint64_t)_mm256_extract_epi64(v, 3);
}
#else
struct Lanes { uint64_t w[4]; };
static inline Lanes zero_lanes() { return Lanes{{0, 0, 0, 0}}; }
static inline Lanes add_lanes(Lanes acc, const uint8_t* p) {
    for (int i = 0; i < 4; ++i) {
        uint64_t x;
        memcpy(&x, p + 8 * i, 8);
        acc.w[i] += x;
    }
    return acc;
}
static inline uint64_t total_of(Lanes v) { return v.w[0] + v.w[1] + v.w[2] + v.w[3]; }
#endif

extern "C" {

// lm_peak_block_mix's float and integer operations on one vector, for the intrinsics' prefix P and float type F.
#define BLOCK_MIX_OPS(P, F)                                                                    \
    typedef F FVec;                                                                            \
    static inline FVec fsplat(float v) { return P##_set1_ps(v); }                              \
    static inline FVec floats(Vec a) { return P##_cvtepi32_ps(a); }                            \
    static inline FVec fmul(FVec a, FVec b) { return P##_mul_ps(a, b); }                       \
    static inline FVec fmadd(FVec a, FVec b, FVec c) { return P##_fmadd_ps(a, b, c); }           \
    static inline Vec mullo(Vec a, Vec b) { return P##_mullo_epi32(a, b); }                    \
    static inline Vec isplat(int v) { return P##_set1_epi32(v); }                              \
    static inline Vec broadcast(const int8_t* p) { /* 4 codes to every lane, as the kernel */  \
        int32_t v;                                                                             \
        memcpy(&v, p, 4);                                                                      \
        return isplat(v);                                                                      \
    }

// The dot-product instruction of the path built here, on one vector of accumulators: 64 products
// (AVX-512 VNNI), 32 (AVX-VNNI, or AVX2's maddubs + madd pair), or none.
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
typedef __m512i Vec;
static const int PRODUCTS = 64;
static inline Vec splat(char b) { return _mm512_set1_epi8(b); }
static inline Vec zero() { return _mm512_setzero_si512(); }
static inline Vec dot(Vec a, Vec w, Vec x) { return _mm512_dpbusd_epi32(a, w, x); }
static inline Vec add(Vec a, Vec b) { return _mm512_add_epi32(a, b); }
static inline int64_t first(Vec a) { return _mm512_reduce_add_epi32(a); }
BLOCK_MIX_OPS(_mm512, __m512)
static inline double ffirst(FVec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__)
typedef __m256i Vec;
static const int PRODUCTS = 32;
static inline Vec splat(char b) { return _mm256_set1_epi8(b); }
static inline Vec zero() { return _mm256_setzero_si256(); }
#if defined(__AVXVNNI__)
static inline Vec dot(Vec a, Vec w, Vec x) { return _mm256_dpbusd_avx_epi32(a, w, x); }
#else
static inline Vec dot(Vec a, Vec w, Vec x) {
    return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#endif
static inline Vec add(Vec a, Vec b) { return _mm256_add_epi32(a, b); }
static inline int64_t first(Vec a) { return _mm256_extract_epi32(a, 0); }
BLOCK_MIX_OPS(_mm256, __m256)
static inline double ffirst(FVec a) { return _mm256_cvtss_f32(a); }
#else
static const int PRODUCTS = 0;
#endif

// Products per instruction of the path built here (0: none of them).
int lm_peak_products_per_instruction() { return PRODUCTS; }

// Runs `iters` dot-product instructions on each of `threads` threads (12 independent chains each);
// returns a checksum so that the work is kept.
int64_t lm_peak_products(int64_t iters, int threads) {
    int64_t total = 0;
#if defined(__AVX2__)
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        Vec a[12], w = splat(3), x = splat(5);
        for (int i = 0; i < 12; ++i) a[i] = zero();
        for (int64_t it = 0; it < iters / 12; ++it) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; ++i) a[i] = dot(a[i], w, x);
            asm volatile("" : "+v"(w));
        }
        for (int i = 1; i < 12; ++i) a[0] = add(a[0], a[i]);
        total += first(a[0]);
    }
#else
    (void)iters;
    (void)threads;
#endif
    return total;
}

}  // extern "C"

// The K-quant kernel's inner loop as instruction mixes, on 12 rows' independent chains a thread: per block
// of 32 weights and row, 8 dot-product instructions from a fresh chain (one activation code, the kernel's
// `chunk_sum`), then
//   mix 0: the integer sum added on (nothing else: the dot products' own ceiling in this shape),
//   mix 1: the kernel's float steps (convert, step product, two multiply-adds: kquant_matmul.cpp's
//          activations quantized per block of 32 with a float step),
//   mix 2: an integer scale (multiply, add), what activations sharing one step over a super-block of 256
//          would leave per block (the sub-block scales applied in integers, one float step per 256).
// `iters` blocks per row and thread. Returns a checksum (mixes 0 and 2: the exact integer total).
#if defined(__AVX2__)
template <int MIX>
static int64_t block_mix(int64_t iters, int threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        Vec acc[12], w[8], scale = isplat(3);
        FVec y[12], step = fsplat(0.5f), mins = fsplat(0.25f), u = fsplat(1.0f / 64), sx = fsplat(2.0f);
        for (int j = 0; j < 8; ++j) w[j] = splat((char)(1 + j));
        for (int r = 0; r < 12; ++r) acc[r] = zero(), y[r] = fsplat(0.0f);
        int8_t codes[12 * 32];  // each row's activation codes, broadcast from memory 4 at a time as the kernel does
        memset(codes, 1, sizeof codes);
        for (int64_t it = 0; it < iters; ++it) {
            asm volatile("" ::: "memory");  // the codes are read anew every block, as the kernel reads them
#pragma GCC unroll 12
            for (int r = 0; r < 12; ++r) {
                Vec s = zero();
#pragma GCC unroll 8
                for (int j = 0; j < 8; ++j) s = dot(s, w[j], broadcast(codes + 32 * r + 4 * j));
                if (MIX == 1) {
                    y[r] = fmadd(floats(s), fmul(step, u), y[r]);
                    y[r] = fmadd(mins, sx, y[r]);
                } else {
                    acc[r] = add(acc[r], MIX == 2 ? mullo(s, scale) : s);
                }
            }
            asm volatile("" : "+v"(w[0]), "+v"(u), "+v"(scale));  // nothing constant to fold (a x3 scale: a shift and an add)
        }
        for (int r = 0; r < 12; ++r) total += first(acc[r]) + (int64_t)(ffirst(y[r]) != 0.0);
    }
    return total;
}
#endif

extern "C" {

int64_t lm_peak_block_mix(int64_t iters, int threads, int mix) {
#if defined(__AVX2__)
    return mix == 1 ? block_mix<1>(iters, threads) : (mix == 2 ? block_mix<2>(iters, threads) : block_mix<0>(iters, threads));
#else
    (void)iters;
    (void)threads;
    (void)mix;
    return 0;
#endif
}

// Reads buffers[i] (groups[i] groups of group_bytes[i] bytes), i < n, on `threads` threads, asking
// for each line 4 KiB ahead as the kernel does. one_region: 0, a parallel region per buffer (the
// decode loop's pattern); 1, one region with no barrier between buffers (a streaming upper bound).
// Returns the sum of every buffer's bytes read as int64 words (wrapping), so that a test can check
// that each byte was read once.
int64_t lm_peak_read(const uint8_t* const* buffers, const int64_t* groups, const int64_t* group_bytes, int n,
                     int threads, int one_region) {
    uint64_t total = 0;
    auto read = [](const uint8_t* w, int64_t gi, int64_t gb, Lanes acc) {
        const uint8_t* g = w + gi * gb;
        for (int64_t c = 0; c + 32 <= gb; c += 32) {
            if (c % 64 == 0) _mm_prefetch((const char*)g + c + 4096, _MM_HINT_T0);
            acc = add_lanes(acc, g + c);
        }
        return acc;
    };
    if (!one_region) {
        for (int i = 0; i < n; ++i) {
#pragma omp parallel num_threads(threads) reduction(+ : total)
            {
                Lanes acc = zero_lanes();
#pragma omp for schedule(static)
                for (int64_t gi = 0; gi < groups[i]; ++gi) acc = read(buffers[i], gi, group_bytes[i], acc);
                total += total_of(acc);
            }
        }
        return (int64_t)total;
    }
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        Lanes acc = zero_lanes();
        for (int i = 0; i < n; ++i) {
#pragma omp for schedule(static) nowait
            for (int64_t gi = 0; gi < groups[i]; ++gi) acc = read(buffers[i], gi, group_bytes[i], acc);
        }
        total += total_of(acc);
    }
    return (int64_t)total;
}
}
