// Prompt attention on CPU for a bfloat16 or int8 cache: every prefill token of a step (new prompts
// and continued chunks) in one call per layer, after the step's k/v are in the cache.
//
// Token t attends to keys 0..pos[t] of cache slot slots[t]. Tokens are grouped into blocks of
// consecutive positions of one slot; work is split over (block, kv head), and each query row
// (token, head) is computed by a fixed sequence of operations that depends only on its own keys
// and position: a token's output is bitwise the same whatever the chunk, batch or block it sits
// in (so a prompt prefilled in chunks, or after a prefix-cache hit, equals one prefilled whole).
//   - scores: bf16 x bf16 products summed in float32 by the AVX-512 BF16 dot product, keys 16 at a
//     time (K repacked so a vector holds one head-dimension pair of 16 keys), two partial chains
//     over the head dimension (even and odd pairs) added at the end;
//   - softmax in float32: the row's maximum, then e^x summed over blocks of 16 keys from key 0 by
//     one fixed lane tree; keys past the row's position count as 0;
//   - output: the probabilities rounded to bfloat16 (as SDPA's CPU kernel does for a bfloat16
//     cache) times V, summed in float32 by the same dot product over key pairs, divided by the sum.
//   - an int8 cache (native_common.h): the codes are exact in bfloat16, so they take the same dot
//     products; a score is then multiplied by its key's scale (before the softmax scale), and a
//     probability by its value's scale before the rounding to bfloat16.
// Where the OS grants AMX tiles, head_dim <= 128 takes them instead (run_amx): the same softmax
// and roundings with the two products on tile units, the keys and values packed once per call,
// ~4x faster on the 2-core Xeon VM; every prompt token of a process takes the same path. Without AVX-512 BF16 the entry points
// answer "not built" and attention stays on SDPA.
//
// Built by native.py with the machine's own instruction set (-march=native), wrapped by
// prompt_attention.py; no torch headers.

#include <algorithm>
#include <climits>
#include <type_traits>
#include <vector>

#include "native_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PA_BF16_DOT 1  // the pair products on the CPU's bfloat16 dot product
#else
#define PA_BF16_DOT 0  // ... on float multiply-adds (AVX2), in the order VDPBF16PS is specified with
#endif

static const int MAX_PAIRS = 128;  // head_dim <= 256
static const int GROUP_ROWS = 8;   // query rows scored together on the dot product (they share each K vector load)
static const int PV_ROWS = 4;      // query rows weighing values together (they share each V vector load)
static const int BLOCK_ROWS = 48;  // query rows per task at most: tokens per block = rows / heads per kv head
static const int SMALL_BLOCK_ROWS = 24;  // ... when larger blocks would leave the threads too few tasks to share

// Transposing 16 x 16 32-bit lanes by swapping off-diagonal blocks of 8, 4, 2, 1.
#define LO_(s, j) (((j) & (s)) ? 16 + (j) - (s) : (j))
#define HI_(s, j) (((j) & (s)) ? 16 + (j) : (j) + (s))
#define IDX16(M, s) M(s, 0), M(s, 1), M(s, 2), M(s, 3), M(s, 4), M(s, 5), M(s, 6), M(s, 7), M(s, 8), M(s, 9), \
                    M(s, 10), M(s, 11), M(s, 12), M(s, 13), M(s, 14), M(s, 15)

template <int S>
static inline void swap_blocks(v16u* r) {
    for (int i = 0; i < 16; ++i)
        if (!(i & S)) {
            const v16u a = r[i], b = r[i + S];
            r[i] = __builtin_shufflevector(a, b, IDX16(LO_, S));
            r[i + S] = __builtin_shufflevector(a, b, IDX16(HI_, S));
        }
}

static inline void transpose16(v16u* r) {
    swap_blocks<8>(r);
    swap_blocks<4>(r);
    swap_blocks<2>(r);
    swap_blocks<1>(r);
}

typedef uint16_t v32h __attribute__((vector_size(64)));

// 16 bfloat16 of a cache row (32 for pairs): copied, or int8 codes as the bfloat16 of the same value.
static inline v16h bf16_of(const uint16_t* p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return h;
}
static inline v16h bf16_of(const int8_t* p) {
    v16u w;
    const v16f f = I8::load(p);
    memcpy(&w, &f, sizeof w);
    return __builtin_convertvector(w >> 16, v16h);  // exact: a code has at most 7 significant bits
}
// 16 32-bit words of a cache row: 16 bfloat16 pairs (int8 codes as their bfloat16), or 16 floats' bits.
static inline v16u words_of(const uint16_t* p) {
    v16u r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline v16u words_of(const float* p) {
    v16u r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline v16u words_of(const int8_t* p) {
    const v16h lo = bf16_of(p), hi = bf16_of(p + 16);
    v32h both = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                        20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    v16u r;
    memcpy(&r, &both, sizeof r);
    return r;
}

// A row's 32-bit words: d / 2 bfloat16 pairs, or d floats.
template <class T>
constexpr int words_per_row(int d) { return sizeof(T) == 4 ? d : d / 2; }

// Keys j0..j0+15 of one (slot, head) into out[p] = word p (head dims 2p, 2p+1 of a bfloat16 or int8
// cache; head dim p of a float32 one) of the 16 keys, one key per lane; keys at or past `valid` read
// as zeros (positions past the block may hold anything).
template <class T>
static inline void pack_keys(const T* K, int d, int j0, int valid, v16u* out) {
    const int words = words_per_row<T>(d), per_word = d / words;
    for (int pc = 0; pc < words; pc += 16) {
        v16u r[16];
        for (int l = 0; l < 16; ++l) {
            if (j0 + l < valid)
                r[l] = words_of(K + (size_t)(j0 + l) * d + per_word * pc);
            else
                r[l] = v16u{};
        }
        transpose16(r);
        for (int p = 0; p < 16; ++p) out[pc + p] = r[p];
    }
}

// Values of key pairs (j0 + 2i, j0 + 2i + 1), i < 8: out[i * C + c] lane l = the two keys' head dim
// 16c + l as a bf16 pair (first key in the low half). Keys at or past `valid` read as zeros.
template <class T>
static inline void pack_values(const T* V, int d, int j0, int valid, v16u* out) {
    const int C = d / 16;
    for (int i = 0; i < 8; ++i) {
        const int a = j0 + 2 * i, b = a + 1;
        for (int c = 0; c < C; ++c) {
            v16h lo = v16h{}, hi = v16h{};
            if (a < valid) lo = bf16_of(V + (size_t)a * d + 16 * c);
            if (b < valid) hi = bf16_of(V + (size_t)b * d + 16 * c);
            out[i * C + c] = __builtin_convertvector(lo, v16u) | (__builtin_convertvector(hi, v16u) << 16);
        }
    }
}

// A float32 cache's values of key pairs (j0 + 2i, j0 + 2i + 1), i < 8, as widen_pairs lays out a
// bfloat16 cache's: out[(i * C + c) * 2] = key j0 + 2i + 1's head dims 16c..16c+15, out[... + 1] key
// j0 + 2i's (zeros at or past `valid`).
static inline void pack_values(const float* V, int d, int j0, int valid, v16u* out) {
    const int C = d / 16;
    for (int i = 0; i < 8; ++i)
        for (int c = 0; c < C; ++c)
            for (int o = 0; o < 2; ++o) {
                const int j = j0 + 2 * i + 1 - o;  // a pair's odd key first
                out[(i * C + c) * 2 + o] = j < valid ? words_of(V + (size_t)j * d + 16 * c) : v16u{};
            }
}

typedef uint32_t pair_t __attribute__((may_alias));  // two bfloat16 of a query row, read as one word
typedef uint32_t v8u __attribute__((vector_size(32)));

#if PA_BF16_DOT
// ---- bfloat16 pairs on the CPU's dot product (a bfloat16 or int8 cache with AVX-512 BF16) ----------
static inline __m512bh as_bh(v16u x) { return (__m512bh)(__m512i)x; }
static inline __m512bh broadcast_pair(uint32_t x) { return (__m512bh)_mm512_set1_epi32((int)x); }

// Raw scores of NR query rows against the 16 packed keys: out[r] lane l = q_r . k_l in float32, the
// even and the odd pairs in two chains added at the end.
template <int NR>
static inline void score_rows(const pair_t* const* q, const v16u* Kp, int pairs, v16f* out) {
    __m512 even[NR], odd[NR];
    for (int r = 0; r < NR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p += 2) {
        const __m512bh k0 = as_bh(Kp[p]), k1 = as_bh(Kp[p + 1]);
        for (int r = 0; r < NR; ++r) {
            even[r] = _mm512_dpbf16_ps(even[r], k0, broadcast_pair(q[r][p]));
            odd[r] = _mm512_dpbf16_ps(odd[r], k1, broadcast_pair(q[r][p + 1]));
        }
    }
    for (int r = 0; r < NR; ++r) out[r] = (v16f)_mm512_add_ps(even[r], odd[r]);
}

static void score_group(const pair_t* const* q, int n, const v16u* Kp, int pairs, v16f* out) {
    switch (n) {
        case 8: score_rows<8>(q, Kp, pairs, out); break;
        case 7: score_rows<7>(q, Kp, pairs, out); break;
        case 6: score_rows<6>(q, Kp, pairs, out); break;
        case 5: score_rows<5>(q, Kp, pairs, out); break;
        case 4: score_rows<4>(q, Kp, pairs, out); break;
        case 3: score_rows<3>(q, Kp, pairs, out); break;
        case 2: score_rows<2>(q, Kp, pairs, out); break;
        default: score_rows<1>(q, Kp, pairs, out); break;
    }
}

// The 16 probabilities of one key block rounded to bfloat16, as 8 key pairs (first key low).
static inline v8u prob_pairs(const float* p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    const v16f r = round_bf16(x);
    v16u w;
    memcpy(&w, &r, sizeof w);
    const v8u lo = __builtin_shufflevector(w, w, 0, 2, 4, 6, 8, 10, 12, 14) >> 16;
    const v8u hi = __builtin_shufflevector(w, w, 1, 3, 5, 7, 9, 11, 13, 15) & 0xFFFF0000u;
    return lo | hi;
}

// acc[r] (d floats) += the block's probabilities of NR rows x the packed values, in float32.
template <int NR>
static inline void weigh_rows(float* const* acc, const v8u* pp, const v16u* Vp, int C) {
    for (int c = 0; c < C; ++c) {
        __m512 o[NR];
        for (int r = 0; r < NR; ++r) o[r] = _mm512_loadu_ps(acc[r] + 16 * c);
        for (int i = 0; i < 8; ++i) {
            const __m512bh v = as_bh(Vp[i * C + c]);
            for (int r = 0; r < NR; ++r) o[r] = _mm512_dpbf16_ps(o[r], v, broadcast_pair(pp[r][i]));
        }
        for (int r = 0; r < NR; ++r) _mm512_storeu_ps(acc[r] + 16 * c, o[r]);
    }
}
#endif

// ---- float lanes: a float32 cache, and bfloat16 or int8 ones without the BF16 dot product -----------
// VDPBF16PS, as Intel's reference specifies it, adds a pair's odd product, then its even one, each sum
// rounded in float32, the products exact. Here the pairs are widened to floats once (keys and values
// per key block, a query row per call) and the same two multiply-adds run on float lanes, in that order,
// so both paths agree to float32 rounding at least (the instruction flushes denormals, and a CPU may
// round its pair sum otherwise); each is invariant on its own, and a machine runs one for every token.

struct Lanes {  // 16 float lanes: one AVX-512 register or two AVX2 ones
#if defined(__AVX512F__)
    __m512 v;
    static Lanes zero() { return {_mm512_setzero_ps()}; }
    static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
    static Lanes all(float x) { return {_mm512_set1_ps(x)}; }
    Lanes plus(Lanes a, Lanes b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }  // this + a * b, rounded once
    Lanes operator+(Lanes o) const { return {_mm512_add_ps(v, o.v)}; }
    void store(float* p) const { _mm512_storeu_ps(p, v); }
#else
    __m256 lo, hi;
    static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
    static Lanes all(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
    Lanes plus(Lanes a, Lanes b) const { return {_mm256_fmadd_ps(a.lo, b.lo, lo), _mm256_fmadd_ps(a.hi, b.hi, hi)}; }
    Lanes operator+(Lanes o) const { return {_mm256_add_ps(lo, o.lo), _mm256_add_ps(hi, o.hi)}; }
    void store(float* p) const { _mm256_storeu_ps(p, lo), _mm256_storeu_ps(p + 8, hi); }
#endif
};

// Raw scores of NR query rows against 16 keys as float words, K[w * 16 + l] = word w of key l, and each
// row's words q[r][w]: one chain takes words 4i and 4i + 1, the other 4i + 2 and 4i + 3 (for widened
// bfloat16 pairs: a pair's odd element then its even one, the even and the odd pairs' chains of the
// dot-product path), added at the end: out[r] lane l = q_r . k_l. words: a multiple of 4.
template <int NR>
static inline void score_lanes(const float* const* q, const float* K, int words, v16f* out) {
    Lanes a[NR], b[NR];
    for (int r = 0; r < NR; ++r) a[r] = b[r] = Lanes::zero();
    for (int w = 0; w < words; w += 4) {
        const Lanes k0 = Lanes::load(K + 16 * w), k1 = Lanes::load(K + 16 * (w + 1));
        const Lanes k2 = Lanes::load(K + 16 * (w + 2)), k3 = Lanes::load(K + 16 * (w + 3));
        for (int r = 0; r < NR; ++r) {
            a[r] = a[r].plus(k0, Lanes::all(q[r][w])).plus(k1, Lanes::all(q[r][w + 1]));
            b[r] = b[r].plus(k2, Lanes::all(q[r][w + 2])).plus(k3, Lanes::all(q[r][w + 3]));
        }
    }
    for (int r = 0; r < NR; ++r) (a[r] + b[r]).store((float*)&out[r]);
}

static const int LANE_ROWS = 2;  // query rows scored together on float lanes (AVX2 has 16 registers)

static void score_group_lanes(const float* const* q, int n, const float* K, int words, v16f* out) {
    if (n == 2) score_lanes<2>(q, K, words, out);
    else score_lanes<1>(q, K, words, out);
}

// acc[r] (d floats) += NR rows' probabilities p[r][0..15] x the 16 keys' values as floats, by pairs:
// V[((i * C + c) * 2 + o) * 16 + l] = head dim 16c + l of key 2i + 1 (o = 0), then of key 2i (o = 1),
// as widen_pairs lays out packed pairs; key 2i + 1 is added before key 2i (the pair order above).
template <int NR>
static inline void weigh_lanes(float* const* acc, const float* const* p, const float* V, int C) {
    for (int c = 0; c < C; ++c) {
        Lanes o[NR];
        for (int r = 0; r < NR; ++r) o[r] = Lanes::load(acc[r] + 16 * c);
        for (int i = 0; i < 8; ++i) {
            const float* at = V + (i * C + c) * 32;
            const Lanes odd = Lanes::load(at), even = Lanes::load(at + 16);
            for (int r = 0; r < NR; ++r) o[r] = o[r].plus(odd, Lanes::all(p[r][2 * i + 1])).plus(even, Lanes::all(p[r][2 * i]));
        }
        for (int r = 0; r < NR; ++r) o[r].store(acc[r] + 16 * c);
    }
}

// Packed bfloat16 pairs (pack_keys' or pack_values' words) widened into float words: out[2w] = word w's
// odd (high) element, out[2w + 1] its even (low) one, 16 lanes each.
static inline void widen_pairs(const v16u* in, int words, float* out) {
    for (int w = 0; w < words; ++w) {
        const v16u odd = in[w] & 0xFFFF0000u, even = in[w] << 16;
        memcpy(out + 32 * w, &odd, sizeof odd);
        memcpy(out + 32 * w + 16, &even, sizeof even);
    }
}

// A query or output element: float32 with a float32 cache, else bfloat16.
template <class T>
using Elem = std::conditional_t<sizeof(T) == 4, float, uint16_t>;

struct Block {
    int t0, n;       // tokens t0 .. t0 + n - 1
    int64_t slot, p0;  // their slot and the first one's position (the rest follow one by one)
};

struct Scratch {
    std::vector<float> scores, acc;
    std::vector<v16u> kp, vp;
    std::vector<float> qf, kf, vf;  // float lanes: query rows, a key block and its values widened
    std::vector<float> ks, vs;  // an int8 cache's scales of keys 0..valid-1, zeros to a multiple of 16
};

// The cache of one call: K and V of type T (uint16_t: bfloat16; int8_t: codes, with their scales).
template <class T>
struct CacheView {
    const T* k;
    const T* v;
    const float* k_scales;  // int8 only: the layer's K and V scale pointers (native_common.h)
    const float* v_scales;
    static constexpr bool coded = sizeof(T) == 1;
};

// An int8 cache's scales of the (slot, head) run's keys 0..valid-1 into w.ks, w.vs (16-key blocks)
// (scales [slots, max_len, 2, Hkv]: key j of (slot, h) at (slot * max_len + j) * 2 * Hkv + h)
template <class T>
static inline void load_block_scales(const CacheView<T>& c, int64_t slot, int h, int Hkv, int64_t max_len, int valid,
                                     Scratch& w) {
    if constexpr (CacheView<T>::coded) {
        const size_t padded = (size_t)(valid + 15) / 16 * 16, ss = 2 * (size_t)Hkv;
        const size_t at = (size_t)slot * max_len * ss + h;
        w.ks.assign(padded, 0.0f);
        w.vs.assign(padded, 0.0f);
        for (int j = 0; j < valid; ++j) {
            w.ks[j] = c.k_scales[at + j * ss];
            w.vs[j] = c.v_scales[at + j * ss];
        }
    } else {
        (void)c, (void)slot, (void)h, (void)Hkv, (void)max_len, (void)valid, (void)w;
    }
}

// Block scores (16 keys from j0) scaled as the cache asks: by each key's scale, then `scale`.
template <class T>
static inline v16f scaled_scores(v16f raw, const float* ks, int j0, float scale) {
    if constexpr (CacheView<T>::coded) return (raw * F32::load(ks + j0)) * scale;
    (void)ks, (void)j0;
    return raw * scale;
}

// 16 probabilities from p, times the values' scales for an int8 cache, into tmp (returned)
template <class T>
static inline const float* weighted_probs(const float* p, const float* vs, int j0, float* tmp) {
    if constexpr (CacheView<T>::coded) {
        F32::store(tmp, F32::load(p) * F32::load(vs + j0));
        return tmp;
    }
    (void)vs, (void)j0, (void)tmp;
    return p;
}

template <class T>
static void attend_block(const Block& blk, int h, const Elem<T>* q, int64_t q_row, const CacheView<T>& cache,
                         Elem<T>* out, int H, int Hkv, int d, int64_t max_len, float scale, Scratch& w) {
    constexpr bool f32 = sizeof(T) == 4;
    constexpr bool lanes = f32 || !PA_BF16_DOT;  // float lanes (score_lanes, weigh_lanes), else the dot product
    const int G = H / Hkv, R = blk.n * G, pairs = d / 2, C = d / 16;
    const int valid = (int)(blk.p0 + blk.n);  // keys the block's last token sees
    const int blocks = (valid + 15) / 16;
    const size_t stride = (size_t)blocks * 16;
    const size_t run = ((size_t)blk.slot * Hkv + h) * max_len;
    const T* K = cache.k + run * d;
    const T* V = cache.v + run * d;
    load_block_scales(cache, blk.slot, h, Hkv, max_len, valid, w);
    w.scores.resize((size_t)R * stride);
    w.acc.assign((size_t)R * d, 0.0f);
    w.kp.resize(f32 ? d : pairs);
    w.vp.resize((size_t)16 * C);
    if (lanes && !f32) {
        w.qf.resize((size_t)R * d);
        w.kf.resize((size_t)16 * d);
        w.vf.resize((size_t)256 * C);
    }

    const float* qrows[BLOCK_ROWS];  // float lanes: each row's words (a bfloat16 row widened, odd element first)
    const pair_t* prows[BLOCK_ROWS];  // the dot product: each row's bfloat16 pairs
    int len[BLOCK_ROWS];
    for (int i = 0; i < blk.n; ++i)
        for (int g = 0; g < G; ++g) {
            const int r = i * G + g;
            const Elem<T>* row = q + (size_t)(blk.t0 + i) * q_row + (size_t)(h * G + g) * d;
            len[r] = (int)(blk.p0 + i + 1);
            if constexpr (f32) {
                qrows[r] = row;
            } else if (lanes) {
                float* wide = w.qf.data() + (size_t)r * d;
                for (int p = 0; p < pairs; ++p) wide[2 * p] = bf16_to_f32(row[2 * p + 1]), wide[2 * p + 1] = bf16_to_f32(row[2 * p]);
                qrows[r] = wide;
            } else {
                prows[r] = (const pair_t*)row;
            }
        }

    for (int b = 0; b < blocks; ++b) {  // scores
        const int j0 = b * 16;
        pack_keys(K, d, j0, valid, w.kp.data());
        const float* Kf = (const float*)w.kp.data();  // a float32 cache's words are its floats
        if (lanes && !f32) {
            widen_pairs(w.kp.data(), pairs, w.kf.data());
            Kf = w.kf.data();
        }
        for (int r0 = 0; r0 < R;) {
            v16f s[GROUP_ROWS];
            int n;
            if (lanes) {
                n = std::min(LANE_ROWS, R - r0);
                score_group_lanes(qrows + r0, n, Kf, d, s);
            } else {
                n = std::min(GROUP_ROWS, R - r0);
#if PA_BF16_DOT
                score_group(prows + r0, n, w.kp.data(), pairs, s);
#endif
            }
            for (int r = 0; r < n; ++r) {
                const v16f x = scaled_scores<T>(s[r], w.ks.data(), j0, scale);
                memcpy(w.scores.data() + (size_t)(r0 + r) * stride + j0, &x, sizeof x);
            }
            r0 += n;
        }
    }

    float inv[BLOCK_ROWS];
    for (int r = 0; r < R; ++r) inv[r] = softmax_numerators(w.scores.data() + (size_t)r * stride, len[r]);

    for (int b = 0; b < blocks; ++b) {  // probabilities x V
        const int j0 = b * 16;
        pack_values(V, d, j0, valid, w.vp.data());
        const float* Vf = (const float*)w.vp.data();
        if (lanes && !f32) {
            widen_pairs(w.vp.data(), 8 * C, w.vf.data());
            Vf = w.vf.data();
        }
        float* acc[PV_ROWS];
        const float* pf[PV_ROWS];  // float lanes: the probabilities (rounded to bfloat16 for a bfloat16 or int8 cache)
        float rounded[PV_ROWS][16];
        v8u pp[PV_ROWS];  // the dot product: bfloat16 probability pairs
        float tmp[16];
        int n = 0;
        auto weigh = [&](auto rows_now) {
            constexpr int NR = decltype(rows_now)::value;
            if constexpr (lanes) {
                weigh_lanes<NR>(acc, pf, Vf, C);
            } else {
#if PA_BF16_DOT
                weigh_rows<NR>(acc, pp, w.vp.data(), C);
#endif
            }
        };
        for (int r = 0; r < R; ++r) {
            if (j0 >= len[r]) continue;  // a block this row does not see adds exactly nothing
            acc[n] = w.acc.data() + (size_t)r * d;
            const float* probs = w.scores.data() + (size_t)r * stride + j0;
            if constexpr (f32) {
                pf[n] = probs;
            } else if constexpr (lanes) {
                F32::store(rounded[n], round_bf16(F32::load(weighted_probs<T>(probs, w.vs.data(), j0, tmp))));
                pf[n] = rounded[n];
            } else {
#if PA_BF16_DOT
                pp[n] = prob_pairs(weighted_probs<T>(probs, w.vs.data(), j0, tmp));
#endif
            }
            if (++n == PV_ROWS) {
                weigh(std::integral_constant<int, PV_ROWS>{});
                n = 0;
            }
        }
        if (n == 3) weigh(std::integral_constant<int, 3>{});
        if (n == 2) weigh(std::integral_constant<int, 2>{});
        if (n == 1) weigh(std::integral_constant<int, 1>{});
    }

    for (int i = 0; i < blk.n; ++i)
        for (int g = 0; g < G; ++g) {
            const int r = i * G + g;
            Elem<T>* o = out + ((size_t)(blk.t0 + i) * H + (size_t)(h * G + g)) * d;
            for (int c = 0; c < C; ++c) {
                const v16f y = F32::load(w.acc.data() + (size_t)r * d + 16 * c) * inv[r];
                if constexpr (f32) F32::store(o + 16 * c, y);
                else BF16::store(o + 16 * c, y);
            }
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PA_AMX 1
// The same attention on AMX tiles (Sapphire Rapids and later, where the OS grants them). Each
// (slot, kv head) run's keys and values are packed once per call, for all the blocks and query heads
// that read them (pack_chunk); then one task per (block of <= 16 tokens, kv head, query head): the
// head's token rows are one tile, so a key block's scores for them are two tile products (tdpbf16ps
// over the head dimension's pairs, as pack_keys lays them out), and probabilities x values accumulate
// in up to six output tiles (16 head dims each) over 32 keys at a time. The softmax, the bfloat16
// rounding of the probabilities and the final scaling give attend_block's values (in two passes over
// a row: softmax_probabilities). A score or an output sum is the tile unit's fixed sequence of float32
// operations over that row's own q, keys and probabilities (exact zeros past its position add nothing),
// so a token's output still does not depend on its chunk, batch or block; it differs from
// attend_block's in the last bits (another summation order), and one machine runs one path for every
// prompt token (amx_granted).
// Tiles (all 16 rows x 64 bytes): 0-3 query pairs (0: probabilities), 4 keys or values, 5 scores,
// 5-7 and 1-3 output sums.
static const int AMX_TOKENS = 16;
static const int AMX_MAX_D = 128;  // 4 query tiles of 16 pairs

static bool amx_allowed = true;  // lm_prompt_attention_set_amx: tests run both paths on one machine
static bool amx_attention_applies(int d) { return amx_allowed && d <= AMX_MAX_D && d % 32 == 0 && amx_granted(); }

static AmxTileConfig attention_tiles() {
    AmxTileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    return c;
}

// Output tile c (0..5: tiles 5, 6, 7, 1, 2, 3): op 0 zeroes it, 1 adds tile 0 x tile 4, 2 stores it.
static inline void amx_out_tile(int c, int op, float* to) {
#define OUT_TILE(n)                                                  \
    if (op == 0) _tile_zero(n);                                      \
    else if (op == 1) _tile_dpbf16ps(n, 0, 4);                       \
    else TILE_STORE(n, to, 64);                                      \
    return;
    switch (c) {
        case 0: OUT_TILE(5)
        case 1: OUT_TILE(6)
        case 2: OUT_TILE(7)
        case 3: OUT_TILE(1)
        case 4: OUT_TILE(2)
        default: OUT_TILE(3)
    }
#undef OUT_TILE
}

// The keys and values of one run (consecutive tokens of one slot in a call) for one kv head, packed
// once for every task that reads them: keys 0..valid-1 of the run's last token, zeros on to the next
// multiple of 32, as pack_keys (kp: [2 * chunks][pairs]) and pack_values (vp: [chunks][16 key pairs][C])
// lay them out, and an int8 cache's scales (ks, vs: [chunks * 32], zeros past valid). A block of the run
// reads a prefix: keys past its own last token are the run's later tokens, written before the call,
// and meet probabilities of exactly zero.
struct PackedHead {
    const v16u* kp;
    const v16u* vp;
    const float* ks;
    const float* vs;
};

// One query head (g of kv head h) over one block of <= 16 tokens: its 16 token rows are one tile.
struct AmxScratch {
    std::vector<uint16_t> q, p;  // [16, d] the head's query rows (zero past the block), [16, keys] probabilities
    std::vector<float> scores;   // [16, blocks * 16]
    std::vector<float> sums;     // [16, 16] one output tile
};

// One row's raw scores s (keys 0..n-1) -> the bfloat16 numerators of its probabilities in p (through n
// rounded up to 16; an int8 cache's value scales applied) and 1 / their sum: the values of
// scaled_scores, softmax_numerators and weighted_probs in turn, in two passes over the row. The
// rounding to bfloat16 is the convert instruction's (nearest even; a denormal flushed to zero, which the
// tile product reads as zero anyway). Calling those three in their own passes instead gave the same
// bits 3-11% slower on the AMX Xeon VM (attention_kernels, builds alternating first, 2026-12-02).
template <class T>
static inline float softmax_probabilities(float* s, int n, const float* ks, const float* vs, float scale, uint16_t* p) {
    const int blocks = (n + 15) / 16;
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16i seen = lane < (n - (blocks - 1) * 16);  // the last block's lanes before n
    const float first = scaled_scores<T>(F32::load(s), ks, 0, scale)[0];
    v16f m = v16f{} + first;
    for (int b = 0; b < blocks; ++b) {  // scaled in place; the maximum (lanes past n count as key 0's)
        v16f x = scaled_scores<T>(F32::load(s + 16 * b), ks, 16 * b, scale);
        if (b == blocks - 1) x = seen ? x : first;
        F32::store(s + 16 * b, x);
        m = x > m ? x : m;
    }
    float mx = m[0];
    for (int l = 1; l < 16; ++l) mx = m[l] > mx ? m[l] : mx;
    v16f sum = v16f{};
    for (int b = 0; b < blocks; ++b) {
        v16f e = exp_clamped(F32::load(s + 16 * b) - mx);
        if (b == blocks - 1) e = seen ? e : 0.0f;
        sum = sum + e;
        if constexpr (CacheView<T>::coded) e = e * F32::load(vs + 16 * b);
        else (void)vs;
        _mm256_storeu_si256((__m256i*)(p + 16 * b), (__m256i)_mm512_cvtneps_pbh((__m512)e));
    }
    return 1.0f / total(sum);
}

template <class T>
static void attend_head_amx(const Block& blk, int h, int g, const uint16_t* q, int64_t q_row, const PackedHead& run,
                            uint16_t* out, int H, int Hkv, int d, float scale, AmxScratch& a) {
    const int G = H / Hkv, pairs = d / 2, C = d / 16, qt = d / 32;
    const int valid = (int)(blk.p0 + blk.n);
    const int blocks = (valid + 15) / 16, chunks = (valid + 31) / 32;  // key blocks of 16, chunks of 32
    const int keys = chunks * 32;
    const size_t stride = (size_t)blocks * 16;
    a.scores.resize((size_t)AMX_TOKENS * stride);
    a.q.assign((size_t)AMX_TOKENS * d, 0);
    a.p.resize((size_t)AMX_TOKENS * keys);
    a.sums.resize(16 * 16);
    for (int i = 0; i < blk.n; ++i)
        memcpy(a.q.data() + (size_t)i * d, q + (size_t)(blk.t0 + i) * q_row + (size_t)(h * G + g) * d,
               d * sizeof(uint16_t));
    for (int t = 0; t < qt; ++t) {
        const uint16_t* src = a.q.data() + 32 * t;
        switch (t) {  // tile numbers are immediates
            case 0: TILE_LOAD(0, src, d * sizeof(uint16_t)); break;
            case 1: TILE_LOAD(1, src, d * sizeof(uint16_t)); break;
            case 2: TILE_LOAD(2, src, d * sizeof(uint16_t)); break;
            default: TILE_LOAD(3, src, d * sizeof(uint16_t)); break;
        }
    }
    // raw scores, each key block's tile stored straight into the rows (read back only after every
    // block's store: a vector load right after a tile store of the same bytes waits for it)
    for (int b = 0; b < blocks; ++b) {
        _tile_zero(5);
        for (int t = 0; t < qt; ++t) {
            TILE_LOAD(4, run.kp + (size_t)b * pairs + 16 * t, 64);
            switch (t) {
                case 0: _tile_dpbf16ps(5, 0, 4); break;
                case 1: _tile_dpbf16ps(5, 1, 4); break;
                case 2: _tile_dpbf16ps(5, 2, 4); break;
                default: _tile_dpbf16ps(5, 3, 4); break;
            }
        }
        TILE_STORE(5, a.scores.data() + (size_t)b * 16, stride * sizeof(float));
    }

    float inv[AMX_TOKENS];
    for (int i = 0; i < AMX_TOKENS; ++i) {
        uint16_t* pr = a.p.data() + (size_t)i * keys;
        if (i >= blk.n) {
            memset(pr, 0, keys * sizeof(uint16_t));
            continue;
        }
        const int len = (int)(blk.p0 + i + 1);
        const int upto = (len + 15) / 16 * 16;
        inv[i] = softmax_probabilities<T>(a.scores.data() + (size_t)i * stride, len, run.ks, run.vs, scale, pr);
        memset(pr + upto, 0, (keys - upto) * sizeof(uint16_t));
    }

    for (int c0 = 0; c0 < C; c0 += 6) {  // probabilities x values: up to 6 output tiles (96 head dims) a pass
        const int nc = std::min(6, C - c0);
        for (int c = 0; c < nc; ++c) amx_out_tile(c, 0, 0);
        for (int k = 0; k < chunks; ++k) {
            TILE_LOAD(0, a.p.data() + 32 * k, keys * sizeof(uint16_t));
            for (int c = 0; c < nc; ++c) {
                TILE_LOAD(4, run.vp + (size_t)k * 16 * C + c0 + c, C * 64);
                amx_out_tile(c, 1, 0);
            }
        }
        for (int c = 0; c < nc; ++c) {
            amx_out_tile(c, 2, a.sums.data());
            for (int i = 0; i < blk.n; ++i) {
                uint16_t* o = out + ((size_t)(blk.t0 + i) * H + (size_t)(h * G + g)) * d + 16 * (c0 + c);
                BF16::store(o, F32::load(a.sums.data() + 16 * i) * inv[i]);
            }
        }
    }
}

// Keys 32k .. 32k+31 of one (slot, kv head) run into its PackedHead buffers (valid: the run's keys).
template <class T>
static void pack_chunk(const CacheView<T>& cache, int64_t slot, int h, int Hkv, int d, int64_t max_len, int valid,
                       int k, v16u* kp, v16u* vp, float* ks, float* vs) {
    const int pairs = d / 2, C = d / 16;
    const size_t run = ((size_t)slot * Hkv + h) * max_len;
    for (int half = 0; half < 2; ++half) {
        const int b = 2 * k + half;
        pack_keys(cache.k + run * d, d, b * 16, valid, kp + (size_t)b * pairs);
        pack_values(cache.v + run * d, d, b * 16, valid, vp + (size_t)b * 8 * C);
    }
    if constexpr (CacheView<T>::coded) {
        const size_t ss = 2 * (size_t)Hkv, at = (size_t)slot * max_len * ss + h;
        for (int j = 32 * k; j < 32 * k + 32; ++j) {
            ks[j] = j < valid ? cache.k_scales[at + j * ss] : 0.0f;
            vs[j] = j < valid ? cache.v_scales[at + j * ss] : 0.0f;
        }
    } else {
        (void)ks, (void)vs;
    }
}

// Every token of a call on AMX tiles: the runs' keys and values packed once (a pass over chunks of
// 32 keys), then one task per (block, kv head, query head), latest blocks first.
template <class T>
static void run_amx(const std::vector<Block>& blocks, const uint16_t* q, int64_t q_row, const CacheView<T>& cache,
                    uint16_t* out, int H, int Hkv, int d, int64_t max_len, float scale, int threads, bool parallel) {
    const int G = H / Hkv, pairs = d / 2, C = d / 16;
    struct Run {
        int64_t slot;
        int valid, chunks;
        size_t at;  // its first head's offset in the packed buffers, in chunks
    };
    std::vector<Run> runs;
    std::vector<int> run_of(blocks.size());
    size_t total = 0;  // chunks over all runs and heads
    for (size_t i = 0; i < blocks.size(); ++i) {
        const Block& b = blocks[i];
        const bool continues = i > 0 && b.slot == blocks[i - 1].slot && b.p0 == blocks[i - 1].p0 + blocks[i - 1].n;
        if (!continues) runs.push_back(Run{b.slot, 0, 0, 0});
        runs.back().valid = (int)(b.p0 + b.n);
        run_of[i] = (int)runs.size() - 1;
    }
    std::vector<size_t> first_unit(runs.size() + 1, 0);  // pack units (head, chunk) before each run
    for (size_t r = 0; r < runs.size(); ++r) {
        runs[r].chunks = (runs[r].valid + 31) / 32;
        runs[r].at = total;
        total += (size_t)Hkv * runs[r].chunks;
        first_unit[r + 1] = total;
    }
    const size_t kp_chunk = 2 * (size_t)pairs, vp_chunk = 16 * (size_t)C;  // v16u per chunk of 32 keys
    static thread_local std::vector<v16u> kp_all, vp_all;
    static thread_local std::vector<float> scales_all;
    kp_all.resize(total * kp_chunk);
    vp_all.resize(total * vp_chunk);
    if (CacheView<T>::coded) scales_all.resize(2 * total * 32);
    v16u* kp = kp_all.data();
    v16u* vp = vp_all.data();
    float* ks = CacheView<T>::coded ? scales_all.data() : nullptr;
    float* vs = CacheView<T>::coded ? scales_all.data() + total * 32 : nullptr;
    const int tasks = (int)blocks.size() * Hkv * G;
    auto pack = [&](int64_t u) {
        const int r = (int)(std::upper_bound(first_unit.begin(), first_unit.end(), (size_t)u) - first_unit.begin()) - 1;
        const Run& run = runs[r];
        const int h = (int)((u - run.at) / run.chunks), k = (int)((u - run.at) % run.chunks);
        const size_t head = run.at + (size_t)h * run.chunks;  // the head's first chunk
        pack_chunk(cache, run.slot, h, Hkv, d, max_len, run.valid, k, kp + head * kp_chunk, vp + head * vp_chunk,
                   ks ? ks + head * 32 : nullptr, vs ? vs + head * 32 : nullptr);
    };
    // One slot's chunk late in its prompt (its blocks' key counts within 25% of each other): its tasks
    // are about alike, so both loops split statically, head-major, in orders that give each thread the
    // kv heads its own tasks read (the last heads to the first thread), and the packed keys and values
    // stay in the cache of the core that packed them.
    int64_t fewest = INT64_MAX, most = 0;
    for (const Block& b : blocks) fewest = std::min<int64_t>(fewest, b.p0 + b.n), most = std::max<int64_t>(most, b.p0 + b.n);
    const bool head_major = runs.size() == 1 && 4 * fewest >= 3 * most;
    const int nb = (int)blocks.size();
#pragma omp parallel num_threads(threads) if (parallel)
    {
        if (head_major) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < (int64_t)total; ++u) pack((int64_t)total - 1 - u);
        } else {
#pragma omp for schedule(dynamic, 4)
            for (int64_t u = 0; u < (int64_t)total; ++u) pack(u);
        }
        // each thread's buffers kept from call to call (a late chunk's score rows are ~190 KB a thread):
        // allocated afresh every call they cost ~10% of it, with no page faults either way (16 tokens
        // after 2,900 keys, 30 layers: 11.6 -> 10.4 ms; 512 tokens after 2,000: 129 -> 117 ms)
        static thread_local AmxScratch a;
        AmxScope tiles(attention_tiles());
        auto task = [&](int i) {
            const int t = tasks - 1 - i;
            const int bi = head_major ? t / G % nb : t / (Hkv * G), h = head_major ? t / (nb * G) : t / G % Hkv, g = t % G;
            const Run& run = runs[run_of[bi]];
            const size_t head = run.at + (size_t)h * run.chunks;
            const PackedHead ph{kp + head * kp_chunk, vp + head * vp_chunk, ks ? ks + head * 32 : nullptr,
                                vs ? vs + head * 32 : nullptr};
            attend_head_amx<T>(blocks[bi], h, g, q, q_row, ph, out, H, Hkv, d, scale, a);
        };
        if (head_major) {
#pragma omp for schedule(static)
            for (int i = 0; i < tasks; ++i) task(i);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < tasks; ++i) task(i);
        }
    }
}
#endif

// Consecutive tokens of one slot at consecutive positions, at most per_block of them, into blocks.
static std::vector<Block> make_blocks(const int64_t* slots, const int64_t* pos, int T, int per_block) {
    std::vector<Block> blocks;
    for (int t = 0; t < T; ++t) {
        Block* last = blocks.empty() ? nullptr : &blocks.back();
        if (last && last->n < per_block && slots[t] == last->slot && pos[t] == last->p0 + last->n)
            ++last->n;
        else
            blocks.push_back(Block{t, 1, slots[t], pos[t]});
    }
    return blocks;
}

extern "C" int lm_prompt_attention_built(void) { return 1; }

// 1 when a head_dim of d takes the AMX tiles in this process.
extern "C" int lm_prompt_attention_amx(int d) {
#ifdef PA_AMX
    return amx_attention_applies(d) ? 1 : 0;
#else
    (void)d;
    return 0;
#endif
}

// on: whether the AMX tiles may serve (the default); returns the previous setting. For tests, which
// compare both paths on one machine; a server keeps one path for every prompt token.
extern "C" int lm_prompt_attention_set_amx(int on) {
#ifdef PA_AMX
    const int was = amx_allowed ? 1 : 0;
    amx_allowed = on != 0;
    return was;
#else
    (void)on;
    return 0;
#endif
}

// Every task of one call (blocks x kv heads), longest blocks (latest positions) first.
template <class T>
static void run_tasks(const std::vector<Block>& blocks, const Elem<T>* q, int64_t q_row, const CacheView<T>& cache,
                      Elem<T>* out, int H, int Hkv, int d, int64_t max_len, float scale, int threads, bool parallel) {
    const int tasks = (int)blocks.size() * Hkv;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        Scratch w;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < tasks; ++i) {
            const int t = tasks - 1 - i;
            attend_block(blocks[t / Hkv], t % Hkv, q, q_row, cache, out, H, Hkv, d, max_len, scale, w);
        }
    }
}

// The call on the path this process takes: AMX tiles (blocks of up to 16 tokens) or attend_block.
template <class T>
static void run_call(const int64_t* slots, const int64_t* pos, int T_, const Elem<T>* q, int64_t q_row,
                     const CacheView<T>& cache, Elem<T>* out, int H, int Hkv, int d, int64_t max_len, float scale,
                     int threads) {
    const int G = H / Hkv;
#ifdef PA_AMX
    const bool amx = sizeof(T) < 4 && amx_attention_applies(d);  // tiles take bfloat16 products only
    const int amx_tokens = AMX_TOKENS;  // a block's tokens fill one tile's rows at most
#else
    const bool amx = false;
    const int amx_tokens = 1;
#endif
    // attend_block: larger blocks share each packed key block among more rows; smaller ones keep a short
    // chunk's few blocks spread over the threads (a row's arithmetic is the same in any block)
    std::vector<Block> blocks = make_blocks(slots, pos, T_, amx ? amx_tokens : std::max(1, BLOCK_ROWS / G));
    if (!amx && (int)blocks.size() * Hkv < 4 * threads) blocks = make_blocks(slots, pos, T_, std::max(1, SMALL_BLOCK_ROWS / G));
    int64_t work = 0;
    for (const Block& b : blocks) work += (b.p0 + b.n) * b.n;
    const bool parallel = threads > 1 && (int)blocks.size() * Hkv * (amx ? G : 1) > 1 && work * H * d >= (1 << 16);
#ifdef PA_AMX
    if constexpr (sizeof(T) < 4)
        if (amx) return run_amx(blocks, q, q_row, cache, out, H, Hkv, d, max_len, scale, threads, parallel);
#endif
    run_tasks(blocks, q, q_row, cache, out, H, Hkv, d, max_len, scale, threads, parallel);
}

// 0: done; 1: a shape the kernel does not take (or not built); 2: a token's slot or position
// outside the cache. bf16: q, out and the cache are bfloat16 (or the cache int8 codes), else float32.
// k_scales, v_scales: null for a bfloat16 or float32 cache; else the layer's K and V scale pointers of
// an int8 cache (native_common.h).
extern "C" int lm_prompt_attention(int bf16, const void* q, int64_t q_row, const void* k_cache, const void* v_cache,
                                   const float* k_scales, const float* v_scales, const int64_t* slots,
                                   const int64_t* pos, void* out, int T, int H, int Hkv, int d, int64_t num_slots,
                                   int64_t max_len, float scale, int threads) {
    if (d % 32 != 0 || d / 2 > MAX_PAIRS || Hkv <= 0 || H % Hkv != 0 || H / Hkv > SMALL_BLOCK_ROWS) return 1;
    if ((k_scales == nullptr) != (v_scales == nullptr) || (k_scales && !bf16)) return 1;
    for (int t = 0; t < T; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots || pos[t] < 0 || pos[t] >= max_len) return 2;
    if (!bf16)
        run_call(slots, pos, T, (const float*)q, q_row,
                 CacheView<float>{(const float*)k_cache, (const float*)v_cache, nullptr, nullptr}, (float*)out, H, Hkv,
                 d, max_len, scale, threads);
    else if (k_scales)
        run_call(slots, pos, T, (const uint16_t*)q, q_row,
                 CacheView<int8_t>{(const int8_t*)k_cache, (const int8_t*)v_cache, k_scales, v_scales},
                 (uint16_t*)out, H, Hkv, d, max_len, scale, threads);
    else
        run_call(slots, pos, T, (const uint16_t*)q, q_row,
                 CacheView<uint16_t>{(const uint16_t*)k_cache, (const uint16_t*)v_cache, nullptr, nullptr},
                 (uint16_t*)out, H, Hkv, d, max_len, scale, threads);
    return 0;
}

#else

extern "C" int lm_prompt_attention_built(void) { return 0; }

extern "C" int lm_prompt_attention_amx(int) { return 0; }

extern "C" int lm_prompt_attention_set_amx(int) { return 0; }

extern "C" int lm_prompt_attention(int, const void*, int64_t, const void*, const void*, const float*, const float*,
                                   const int64_t*, const int64_t*, void*, int, int, int, int, int64_t, int64_t, float,
                                   int) {
    return 1;
}

#endif
