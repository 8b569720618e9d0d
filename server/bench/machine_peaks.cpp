// Two ceilings of this machine that bound the weight-only linears (machine_peaks.py), built with the
// same compiler and flags as the serving kernels (model/native.py) but for benchmarks only:
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

// Products per instruction of the path built here (0: none of them).
int lm_peak_products_per_instruction() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    return 64;
#elif defined(__AVXVNNI__) || defined(__AVX2__)
    return 32;
#else
    return 0;
#endif
}

// Runs `iters` dot-product instructions on each of `threads` threads (12 independent chains each);
// returns a checksum so that the work is kept.
int64_t lm_peak_products(int64_t iters, int threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
        __m512i a[12], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
        for (int i = 0; i < 12; ++i) a[i] = _mm512_setzero_si512();
        for (int64_t it = 0; it < iters / 12; ++it) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
            asm volatile("" : "+v"(w));
        }
        for (int i = 1; i < 12; ++i) a[0] = _mm512_add_epi32(a[0], a[i]);
        total += _mm512_reduce_add_epi32(a[0]);
#elif defined(__AVXVNNI__)
        __m256i a[12], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
        for (int i = 0; i < 12; ++i) a[i] = _mm256_setzero_si256();
        for (int64_t it = 0; it < iters / 12; ++it) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; ++i) a[i] = _mm256_dpbusd_avx_epi32(a[i], w, x);
            asm volatile("" : "+v"(w));
        }
        for (int i = 1; i < 12; ++i) a[0] = _mm256_add_epi32(a[0], a[i]);
        total += _mm256_extract_epi32(a[0], 0);
#elif defined(__AVX2__)
        __m256i a[12], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1);
        for (int i = 0; i < 12; ++i) a[i] = _mm256_setzero_si256();
        for (int64_t it = 0; it < iters / 12; ++it) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; ++i)
                a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), one));
            asm volatile("" : "+v"(w));
        }
        for (int i = 1; i < 12; ++i) a[0] = _mm256_add_epi32(a[0], a[i]);
        total += _mm256_extract_epi32(a[0], 0);
#else
        (void)iters;
#endif
    }
    return total;
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
