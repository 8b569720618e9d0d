// Decode attention on CPU: every decoding row of a step, one call per layer.
//
// Row b has one new token: its k/v go to cache slot slots[b] at position pos[b], then its query
// heads attend to keys 0..pos[b] of that slot (a sliding layer's: the last `window` of them). Work is split over (row, kv head) pairs, and each
// pair is computed by the same fixed sequence of operations whatever the batch around it, so a
// row's output is bitwise the same alone or in any batch (batch invariance by construction):
//   - a score is a dot product over the head dimension in 16-lane chunks, summed by one fixed
//     lane tree (16 keys at a time, each key reduced within its own lanes); with bfloat16 queries
//     and cache (and AVX-512 BF16) the chunks are vdpbf16ps on the rows' pairs as stored, 32 dims an
//     instruction, instead of float32 multiply-adds on rows widened first (2026-12-03, AMX Xeon VM,
//     30 layers, beside the widening build: 8 rows after 600 keys 6.50 -> 6.00 ms, 32 after 1,000
//     45.4 -> 43.1, 1 after 600 1.05 -> 0.96);
//   - the softmax sum runs over blocks of 16 keys from key 0 (the block pattern depends only on
//     the row's own length), then the same lane tree;
//     An int8 cache's scores are integer sums instead (query_codes): the query as int16 codes under a
//     power-of-two step, vpdpwssd against the key codes, exact in int32, then one conversion;
//   - the output accumulates p_j * v_j in key order, vectorised over the head dimension, each head's
//     accumulators in registers through the keys (value_pass).
// Arithmetic is float32 whatever the cache dtype (float32, bfloat16, or int8 codes with one scale
// per position and head: native_common.h). With int8, a score is (q16 . codes) x 2^-s x the key's
// scale, and the output weighs value codes by probability x the value's scale, the codes widened
// exactly. Measured by `lmserve bench attention-kernels` (a 1B step's 16 layers of 32 / 8 heads, the
// decode rows beside the previous kernel's); the value pass in registers gave the same bits 1.11-1.24x
// faster, the integer scores 1.10-1.24x more on an int8 cache (the 2-core Zen 4 VM, 2026-12-05). A value
// pass in integers too (weights as int16 a block, vpdpwssd over pairs of keys) was 20% slower there.
//
// Built by native.py with the machine's own instruction set (-march=native), wrapped by
// decode_attention.py; no torch headers. OpenMP resolves to the runtime torch has already loaded.

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "native_common.h"

// AVX2 without AVX-512 takes 8-lane paths of its own (LM_AVX2_PATHS, native_common.h) that give the bits
// of the 16-lane code every other build compiles.

static inline bool head_chunks_built(int c) { return c == 2 || c == 4 || c == 5 || c == 6 || c == 8 || c == 16; }
static const int MAX_GROUP = 16;   // query heads per kv head
static const int PREFETCH_BLOCKS = 2;  // key blocks fetched ahead of their scores

// 16 vectors (one per key) -> one vector of their 16 lane sums, key l in lane l. Every round adds
// lanes of the same key only, so a key's sum does not depend on the keys beside it.
template <class V>
static inline V lane_sums(const V a[16]) {
    V r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; ++i)
        r1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        r2[i] = __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        r3[i] = __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(r3[0], r3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(r3[0], r3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// An int8 cache's scores are integer dot products: each query head is taken as int16 codes under a
// power-of-two step, q = q16 2^-s with s putting max|q| in [2^14, 2^15), so every element whose bits
// reach down to max|q| 2^-15 is exact (a bfloat16 query's 8 bits, over a range of 2^7), and smaller ones
// round there (an error of at most max|q| 2^-16, against the 2^-9 of q's own bfloat16 rounding). A
// score is then sum(q16 codes) exactly in int32 (|q16| < 2^15, |code| <= 127, d <= 256: under 2^31),
// converted once and times 2^-s x the key's scale x `scale`. The key codes are widened once a block to
// int16 and shared by the query heads: two multiply-adds of 32 pairs a key and head at head_dim 64
// (vpdpwssd), where float32 took four fused multiply-adds after a widening to float.
// e with x = f 2^e, f in [0.5, 1), for a finite x >= 0 (0 and subnormals: -126)
static inline int exponent_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (int)(bits >> 23) - 126;
}

static inline float power_of_two(int s) {  // 2^s for s in [-126, 127]
    const uint32_t bits = (uint32_t)(s + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

constexpr int pair_vectors(int C) { return (C + 1) / 2; }  // 32 int16 a vector; head_dim 80 padded to 96

// q's d bfloat16 values -> int16 codes (padded with zeros to `padded`) and their step 2^-s; NaN when q
// holds a NaN or an infinity (its scores are NaN then, as the float path gives them); 0 for all zeros.
static inline float query_codes(const uint16_t* q, int d, int padded, int16_t* codes) {
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < d; ++i) {
        const float a = std::fabs(bf16_to_f32(q[i]));
        finite = finite && a <= 3.4028235e38f;
        amax = a > amax ? a : amax;
    }
    for (int i = 0; i < padded; ++i) codes[i] = 0;
    if (!finite) return __builtin_nanf("");
    if (amax == 0.0f) return 0.0f;
    const int e = exponent_of(amax);  // amax = f 2^e, f in [0.5, 1)
    if (e < -100) return 0.0f;  // under 2^-100: its scores are 0 (within 2^-85 of them)
    const int s = 15 - e;
    const float up = power_of_two(s);
    for (int i = 0; i < d; ++i) codes[i] = (int16_t)__builtin_rintf(bf16_to_f32(q[i]) * up);  // nearest, ties even
    return power_of_two(-s);
}

typedef int16_t v32s __attribute__((vector_size(64)));  // 32 int16

// acc + the pairwise products of 32 int16, exactly: lane t gets a[2t] b[2t] + a[2t + 1] b[2t + 1].
static inline v16i dot_pairs(v16i acc, v32s a, v32s b) {
#if defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
    return (v16i)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#else
    return (v16i)_mm512_add_epi32((__m512i)acc, _mm512_madd_epi16((__m512i)a, (__m512i)b));
#endif
#else  // two AVX2 halves
    __m256i h[2], x[2], y[2];
    memcpy(h, &acc, sizeof h);
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    for (int i = 0; i < 2; ++i) h[i] = _mm256_add_epi32(h[i], _mm256_madd_epi16(x[i], y[i]));
    v16i r;
    memcpy(&r, h, sizeof r);
    return r;
#endif
}

static inline v32s load_pairs(const int16_t* p) {
    v32s r;
    memcpy(&r, p, sizeof r);
    return r;
}

#if LM_AVX2_PATHS
// 8 lanes of a row widened to float32 exactly (AVX2)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif

// The weighted values of NG query heads (probabilities p[g] at stride `stride`, their sums' inverses
// inv[g]) over keys 0..n-1: a head's output is the sum of p_j v_j in key order (an int8 cache's p_j times
// the value's scale first), one fused multiply-add a key, as one head at a time would give it.
#if !LM_AVX2_PATHS
// Query heads whose output accumulators (C vectors each) stay in registers through a value pass: each
// key's value row is widened once into registers and added into every head's accumulators, which stay
// in registers from the first key to the last.
template <int C>
constexpr int HEADS_PER_PASS = C >= 16 ? 1 : 16 / C > 8 ? 8 : 16 / C;

template <class A, class KV, int C, int NG>
static void value_pass(const typename KV::T* V, const float* vs, int ss, int n, float* p, size_t stride,
                       const float* inv, typename A::T* out) {
    constexpr bool coded = sizeof(typename KV::T) == 1;
    constexpr int d = 16 * C;
    v16f o[NG][C];
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < C; ++c) o[g][c] = v16f{};
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int m = std::min(16, n - j0);
        float weighted[NG][16];  // each probability (times its value's scale, in an int8 cache)
        const v16f vscale = coded ? load_scales(vs + (size_t)j0 * ss, m, ss) : v16f{};
        for (int g = 0; g < NG; ++g) F32::store(weighted[g], coded ? F32::load(p + g * stride + j0) * vscale : F32::load(p + g * stride + j0));
        for (int l = 0; l < m; ++l) {
            v16f v[C];
            for (int c = 0; c < C; ++c) v[c] = KV::load(V + (size_t)(j0 + l) * d + 16 * c);
            for (int g = 0; g < NG; ++g)
                for (int c = 0; c < C; ++c) o[g][c] = o[g][c] + weighted[g][l] * v[c];
        }
    }
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < C; ++c) A::store(out + (size_t)g * d + 16 * c, o[g][c] * inv[g]);
}
#else
// AVX2 has 16 vector registers and a 16-lane vector takes two: the AVX-512 pass's accumulators
// (NG x C vectors) and value row (C) lived on the stack, reloaded and stored at every key (perf: most of
// a c=32 SmolLM2 step's attention on the Zen 3). So the head dimension is taken 8 lanes at a time, each
// slice's NG accumulators in registers through all the keys: every output lane still gets its products in
// key order, one fused multiply-add each, and the same final multiply, so the bits are the AVX-512 pass's.
// The weights (probability x value scale) are formed in place in p first, once for all slices.
template <int C>
constexpr int HEADS_PER_PASS = 8;

template <class A, class KV, int C, int NG>
static void value_pass(const typename KV::T* V, const float* vs, int ss, int n, float* p, size_t stride,
                       const float* inv, typename A::T* out) {
    constexpr bool coded = sizeof(typename KV::T) == 1;
    constexpr int d = 16 * C;
    if (coded)
        for (int j0 = 0; j0 < n; j0 += 16) {
            const v16f vscale = load_scales(vs + (size_t)j0 * ss, std::min(16, n - j0), ss);
            for (int g = 0; g < NG; ++g) F32::store(p + g * stride + j0, F32::load(p + g * stride + j0) * vscale);
        }
    alignas(32) float sums[NG][d];
    for (int c = 0; c < 2 * C; ++c) {
        __m256 o[NG];
        for (int g = 0; g < NG; ++g) o[g] = _mm256_setzero_ps();
        for (int j = 0; j < n; ++j) {
            const __m256 v = load8(V + (size_t)j * d + 8 * c);
            for (int g = 0; g < NG; ++g) o[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * stride + j]), v, o[g]);
        }
        for (int g = 0; g < NG; ++g) _mm256_store_ps(sums[g] + 8 * c, o[g]);
    }
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < C; ++c) A::store(out + (size_t)g * d + 16 * c, F32::load(sums[g] + 16 * c) * inv[g]);
}

// A block's 16 key scores on AVX2, the same values as the AVX-512 code computes. Float caches (q and
// the keys widened to float32 first): each key's 16 lanes of products by the same multiply and fused
// multiply-adds over the head dimension, then lane_sums' tree (lanes l + l+8, then + l+4, + l+2, + l+1)
// with 8 keys a register; int8 caches: exact integer dot products (any order gives the same sums).
static inline __m256 key_sums8(const __m256 s[8]) {  // s[k]: key k's lanes l + l+8; out: key k in lane k
    __m256 t[4], w[2];
    for (int i = 0; i < 4; ++i)  // keys 2i | 2i+1: lanes l + l+4
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)  // keys 4i, 4i+2 | 4i+1, 4i+3: lanes l + l+2
        w[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88), _mm256_shuffle_ps(w[0], w[1], 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // keys 0 2 4 6 | 1 3 5 7 -> in order
}

static inline __m256i key_sums8(const __m256i s[8]) {  // s[k]: key k's 8 partial sums; out: key k's total in lane k
    const __m256i h01 = _mm256_hadd_epi32(s[0], s[1]), h23 = _mm256_hadd_epi32(s[2], s[3]);
    const __m256i h45 = _mm256_hadd_epi32(s[4], s[5]), h67 = _mm256_hadd_epi32(s[6], s[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);  // keys 0-3 | 0-3, 4-7 | 4-7
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// scores[j0 .. j0 + 15] of one query head (qf: d floats) over 16 widened keys (rows: 16 x d floats), C >= 2
template <int C>
static inline void float_scores(const float* qf, const float* rows, float scale, float* scores) {
    constexpr int d = 16 * C;
    for (int half = 0; half < 2; ++half) {
        __m256 s[8];
        for (int l = 0; l < 8; ++l) {
            const float* k = rows + (8 * half + l) * d;
            // q0 k0 + q1 k1 as GCC contracts the 16-lane code's first two terms: the first product fused
            __m256 lo = _mm256_fmadd_ps(_mm256_load_ps(qf), _mm256_load_ps(k),
                                        _mm256_mul_ps(_mm256_load_ps(qf + 16), _mm256_load_ps(k + 16)));
            __m256 hi = _mm256_fmadd_ps(_mm256_load_ps(qf + 8), _mm256_load_ps(k + 8),
                                        _mm256_mul_ps(_mm256_load_ps(qf + 24), _mm256_load_ps(k + 24)));
            for (int c = 2; c < C; ++c) {
                lo = _mm256_fmadd_ps(_mm256_load_ps(qf + 16 * c), _mm256_load_ps(k + 16 * c), lo);
                hi = _mm256_fmadd_ps(_mm256_load_ps(qf + 16 * c + 8), _mm256_load_ps(k + 16 * c + 8), hi);
            }
            s[l] = _mm256_add_ps(lo, hi);
        }
        _mm256_storeu_ps(scores + 8 * half, _mm256_mul_ps(key_sums8(s), _mm256_set1_ps(scale)));
    }
}

// the same from int16 codes (q16: the head's, krows: 16 keys', `width` each, zero-padded), times the
// keys' scales (kscale) and the head's step, as the AVX-512 code multiplies them
static inline void code_scores(const int16_t* q16, const int16_t* krows, int width, const float* kscale, float qstep,
                               float* scores) {
    for (int half = 0; half < 2; ++half) {
        __m256i s[8];
        for (int l = 0; l < 8; ++l) {
            const int16_t* k = krows + (8 * half + l) * width;
            __m256i a = _mm256_madd_epi16(_mm256_load_si256((const __m256i*)q16), _mm256_load_si256((const __m256i*)k));
            for (int i = 16; i < width; i += 16)
                a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_load_si256((const __m256i*)(q16 + i)),
                                                          _mm256_load_si256((const __m256i*)(k + i))));
            s[l] = a;
        }
        const __m256 step = _mm256_mul_ps(_mm256_loadu_ps(kscale + 8 * half), _mm256_set1_ps(qstep));
        _mm256_storeu_ps(scores + 8 * half, _mm256_mul_ps(_mm256_cvtepi32_ps(key_sums8(s)), step));
    }
}
#endif

// One (row, kv head) pair: G query heads over keys 0..n-1, head_dim 16 * C (a constant, so the
// accumulators stay in registers). Keys are taken 16 rows at a time, widened to float32 once into
// `rows` (shared by the G query heads); values by value_pass. Both are fetched ahead of use.
// A: the layout of q and out; KV: the cache's (ks, vs: the int8 cache's scales of key 0, the next
// key's `ss` floats on).
template <class A, class KV, int C>
static void attend_pair(const typename A::T* q, const typename KV::T* K, const typename KV::T* V, const float* ks,
                        const float* vs, int ss, int n, int G, float scale, typename A::T* out,
                        std::vector<float>& work) {
    typedef typename KV::T T;
    constexpr bool coded = sizeof(T) == 1;
    const int d = 16 * C;
    const int blocks = (n + 15) / 16;
    const size_t stride = (size_t)blocks * 16;
    work.resize((size_t)G * stride + 16 * (size_t)d + (size_t)G * d + 16);
    float* scores = work.data();  // [G, blocks * 16]
    float* rows = scores + (size_t)G * stride;  // [16, d]: the block's keys in float32
    rows += (16 - ((uintptr_t)rows / 4) % 16) % 16;  // 64-byte aligned (work's floats are 4-byte aligned)
    float* qf = rows + 16 * (size_t)d;  // [G, d]: the queries in float32 (AVX2's float scores)
#if LM_AVX2_PATHS
    if constexpr (!coded)
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) F32::store(qf + (size_t)g * d + 16 * c, A::load(q + (size_t)g * d + 16 * c));
#endif
    const size_t row_bytes = (size_t)d * sizeof(T);

    auto widen = [&](const T* src, int j0, int m) {  // rows j0 .. j0 + m - 1 of src; the rest zero
        for (int l = 0; l < 16; ++l)
#if !LM_AVX2_PATHS
            for (int c = 0; c < C; ++c)
                F32::store(rows + l * d + 16 * c, l < m ? KV::load(src + (size_t)(j0 + l) * d + 16 * c) : v16f{});
#else
            for (int i = 0; i < d; i += 8)
                _mm256_store_ps(rows + l * d + i, l < m ? load8(src + (size_t)(j0 + l) * d + i) : _mm256_setzero_ps());
#endif
    };
    auto fetch = [&](const T* src, int j0) {  // rows j0 .. j0 + 15 of src on their way into the cache
        for (int l = 0; l < 16 && j0 + l < n; ++l)
            for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch((const char*)(src + (size_t)(j0 + l) * d) + off);
    };

    // bfloat16 queries and keys: scores by vdpbf16ps on the stored pairs, no widened copy of the keys
    constexpr bool pairs = std::is_same<A, BF16>::value && std::is_same<KV, BF16>::value && C % 2 == 0;
    constexpr int PV = pair_vectors(C);
    alignas(64) int16_t q16[coded ? MAX_GROUP : 1][32 * PV], krows[coded ? 16 : 1][32 * PV];
    float qstep[MAX_GROUP];  // an int8 cache: 2^-s x scale per query head
    if constexpr (coded) {
        for (int g = 0; g < G; ++g) qstep[g] = query_codes((const uint16_t*)q + (size_t)g * d, d, 32 * PV, q16[g]) * scale;
        for (int l = 0; l < 16; ++l)
            for (int i = d; i < 32 * PV; ++i) krows[l][i] = 0;
    }
    for (int blk = 0; blk < PREFETCH_BLOCKS; ++blk) fetch(K, blk * 16);
    for (int blk = 0; blk < blocks; ++blk) {
        const int j0 = blk * 16, m = std::min(16, n - j0);
        fetch(K, j0 + 16 * PREFETCH_BLOCKS);
        fetch(V, j0);  // read after the softmax
        if constexpr (pairs) {
#ifdef __AVX512BF16__
            for (int g = 0; g < G; ++g) {
                __m512bh qp[C / 2];
                for (int c = 0; c < C / 2; ++c) qp[c] = (__m512bh)_mm512_loadu_si512((const void*)(q + (size_t)g * d + 32 * c));
                v16f acc[16];
                for (int l = 0; l < 16; ++l) {
                    __m512 a = _mm512_setzero_ps();
                    if (l < m) {
                        const uint16_t* k = (const uint16_t*)K + (size_t)(j0 + l) * d;
                        for (int c = 0; c < C / 2; ++c) a = _mm512_dpbf16_ps(a, qp[c], (__m512bh)_mm512_loadu_si512((const void*)(k + 32 * c)));
                    }
                    acc[l] = (v16f)a;
                }
                const v16f sc = lane_sums(acc) * scale;
                memcpy(scores + g * stride + j0, &sc, sizeof sc);
            }
            continue;
#endif
        }
        if constexpr (coded) {
#if LM_AVX2_PATHS
            for (int l = 0; l < 16; ++l)  // this block's key codes as int16 (rows past the last: zeros)
                for (int i = 0; i < d; i += 16)
                    _mm256_store_si256((__m256i*)(krows[l] + i),
                                       l < m ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(K + (size_t)(j0 + l) * d + i)))
                                             : _mm256_setzero_si256());
            alignas(64) float kscales[16];
            F32::store(kscales, load_scales(ks + (size_t)j0 * ss, m, ss));
            for (int g = 0; g < G; ++g) code_scores(q16[g], krows[0], 32 * PV, kscales, qstep[g], scores + g * stride + j0);
            continue;
#endif
            for (int l = 0; l < m; ++l)  // this block's key codes as int16 (rows past the last: zeros)
                for (int i = 0; i < d; ++i) krows[l][i] = (int16_t)K[(size_t)(j0 + l) * d + i];
            for (int l = m; l < 16; ++l)
                for (int i = 0; i < d; ++i) krows[l][i] = 0;
            const v16f kscale = load_scales(ks + (size_t)j0 * ss, m, ss);
            for (int g = 0; g < G; ++g) {
                v16i acc[16];
                for (int l = 0; l < 16; ++l) {
                    v16i a = v16i{};
                    for (int c = 0; c < PV; ++c) a = dot_pairs(a, load_pairs(q16[g] + 32 * c), load_pairs(krows[l] + 32 * c));
                    acc[l] = a;
                }
                const v16f sc = __builtin_convertvector(lane_sums(acc), v16f) * (kscale * qstep[g]);
                memcpy(scores + g * stride + j0, &sc, sizeof sc);
            }
            continue;
        }
        widen(K, j0, m);
#if LM_AVX2_PATHS
        for (int g = 0; g < G; ++g) float_scores<C>(qf + (size_t)g * d, rows, scale, scores + g * stride + j0);
        continue;
#endif
        for (int g = 0; g < G; ++g) {
            v16f qg[C];
            for (int c = 0; c < C; ++c) qg[c] = A::load(q + (size_t)g * d + 16 * c);
            v16f acc[16];
            for (int l = 0; l < 16; ++l) {
                const float* k = rows + l * d;
                v16f a = qg[0] * F32::load(k);
                for (int c = 1; c < C; ++c) a = a + qg[c] * F32::load(k + 16 * c);
                acc[l] = a;
            }
            const v16f sc = lane_sums(acc) * scale;
            memcpy(scores + g * stride + j0, &sc, sizeof sc);
        }
    }

    float inv[MAX_GROUP];
    for (int g = 0; g < G; ++g) inv[g] = softmax_numerators(scores + g * stride, n);

    for (int g0 = 0; g0 < G; g0 += HEADS_PER_PASS<C>)
        switch (std::min(HEADS_PER_PASS<C>, G - g0)) {
#define PASS(h) \
    case h: value_pass<A, KV, C, (h <= HEADS_PER_PASS<C> ? h : 1)>(V, vs, ss, n, scores + g0 * stride, stride, inv + g0, \
                                                                    out + (size_t)g0 * d); break;
            PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
        }
}

template <class A, class KV>
static void attend_pair(const typename A::T* q, const typename KV::T* K, const typename KV::T* V, const float* ks,
                        const float* vs, int ss, int n, int G, int d, float scale, typename A::T* out,
                        std::vector<float>& work) {
    switch (d / 16) {
#define CASE(c) \
    case c: attend_pair<A, KV, c>(q, K, V, ks, vs, ss, n, G, scale, out, work); break;
        CASE(2) CASE(4) CASE(5) CASE(6) CASE(8) CASE(16)  // head_dim 32, 64, 80, 96, 128, 256 (HEAD_CHUNKS)
#undef CASE
    }
}

// A row's new k/v into the cache: copied as they are, or as int8 codes and a scale.
template <class A, class KV>
static inline void put_row(const typename A::T* src, typename KV::T* dst, float* scale, int d) {
    if constexpr (sizeof(typename KV::T) == 1)
        quantize_kv_row(src, d, dst, scale);
    else
        memcpy(dst, src, d * sizeof(typename A::T));
}

template <class A, class KV>
static void decode(const void* q_, int64_t q_row, const void* k_, int64_t k_row, const void* v_, int64_t v_row,
                   void* kc_, void* vc_, float* k_scales, float* v_scales, const int64_t* slots, const int64_t* pos,
                   void* out_, int B, int H, int Hkv, int d, int64_t max_len, float scale, int64_t window,
                   int threads) {
    typedef typename A::T T;
    typedef typename KV::T C;
    const T* q = (const T*)q_;
    const T* k_new = (const T*)k_;
    const T* v_new = (const T*)v_;
    C* k_cache = (C*)kc_;
    C* v_cache = (C*)vc_;
    T* out = (T*)out_;
    const int G = H / Hkv;
    const int tasks = B * Hkv;
    auto first_key = [&](int b) { return window > 0 && pos[b] >= window ? pos[b] + 1 - window : (int64_t)0; };
    int64_t keys = 0;
    for (int b = 0; b < B; ++b) keys += pos[b] + 1 - first_key(b);
    const bool parallel = threads > 1 && tasks > 1 && keys * Hkv * G * d >= (1 << 16);
#pragma omp parallel num_threads(threads) if (parallel)
    {
        std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; ++t) {
            const int b = t / Hkv, h = t % Hkv;
            const size_t base = (((size_t)slots[b] * Hkv + h) * max_len) * d;
            const int ss = 2 * Hkv;  // scales: [slots, max_len, 2, Hkv]
            const size_t at = (size_t)slots[b] * max_len * ss + h, step = (size_t)pos[b] * ss;
            float* ks = k_scales ? k_scales + at : nullptr;
            float* vs = v_scales ? v_scales + at : nullptr;
            put_row<A, KV>(k_new + b * k_row + (size_t)h * d, k_cache + base + (size_t)pos[b] * d, ks ? ks + step : nullptr, d);
            put_row<A, KV>(v_new + b * v_row + (size_t)h * d, v_cache + base + (size_t)pos[b] * d, vs ? vs + step : nullptr, d);
            const int64_t lo = first_key(b);  // a sliding layer's window starts here; blocks of 16 from it
            attend_pair<A, KV>(q + b * q_row + (size_t)h * G * d, k_cache + base + (size_t)lo * d,
                               v_cache + base + (size_t)lo * d, ks ? ks + (size_t)lo * ss : nullptr,
                               vs ? vs + (size_t)lo * ss : nullptr, ss, (int)(pos[b] + 1 - lo), G, d, scale,
                               out + ((size_t)b * H + (size_t)h * G) * d, work);
        }
    }
}

// window: 0, or a sliding layer's window w: row b attends to keys pos[b] - w + 1 .. pos[b] only.
// 0: done; 1: a shape the kernel does not take; 2: a row's slot or position outside the cache
// (nothing is written then: a bookkeeping error upstream must not become a stray write).
// k_scales, v_scales: null for a float32 or bfloat16 cache (of the activations' dtype); else the
// layer's K and V scale pointers of an int8 cache (native_common.h), bfloat16 activations.
extern "C" int lm_decode_attention(int bf16, const void* q, int64_t q_row, const void* k, int64_t k_row,
                                   const void* v, int64_t v_row, void* k_cache, void* v_cache, float* k_scales,
                                   float* v_scales, const int64_t* slots, const int64_t* pos, void* out, int B, int H,
                                   int Hkv, int d, int64_t num_slots, int64_t max_len, float scale, int64_t window,
                                   int threads) {
    if (d % 16 != 0 || !head_chunks_built(d / 16) || Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP || window < 0) return 1;
    if ((k_scales == nullptr) != (v_scales == nullptr) || (k_scales && !bf16)) return 1;
    for (int b = 0; b < B; ++b)
        if (slots[b] < 0 || slots[b] >= num_slots || pos[b] < 0 || pos[b] >= max_len) return 2;
    if (k_scales)
        decode<BF16, I8>(q, q_row, k, k_row, v, v_row, k_cache, v_cache, k_scales, v_scales, slots, pos, out, B, H, Hkv,
                         d, max_len, scale, window, threads);
    else if (bf16)
        decode<BF16, BF16>(q, q_row, k, k_row, v, v_row, k_cache, v_cache, nullptr, nullptr, slots, pos, out, B, H, Hkv,
                           d, max_len, scale, window, threads);
    else
        decode<F32, F32>(q, q_row, k, k_row, v, v_row, k_cache, v_cache, nullptr, nullptr, slots, pos, out, B, H, Hkv, d,
                         max_len, scale, window, threads);
    return 0;
}
