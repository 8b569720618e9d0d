// Weight-only matmul over GGUF's K-quant blocks as the file stores them: y[M, N] = x[M, K] @ W^T, W in
// super-blocks of 256 along K, each of one of
//   Q4_K: w = d sc_j q - dmin m_j   q in 0..15; 8 sub-blocks j of 32, 6-bit sc_j and m_j; float16 d, dmin
//   Q5_K: the same with q in 0..31
//   Q6_K: w = d sc_i (q - 32)       q in 0..63; 16 sub-blocks i of 16, int8 sc_i; float16 d
// A weight of several tensors fused along N (q|k|v, gate|up) may mix them: the packed weight
// (linear/quant_matmul.py pack_kquant) starts with a table of its segments (format, columns, byte offset), so one
// call serves a Q4_K_M file's Q4_K and Q6_K rows in their own types.
//
// Activations are quantized exactly as quant_matmul.cpp does it (qmm_quantize_row: per row and block
// of 32, step e = max|x| / 127, codes h and, "precise", remainder codes l; the same bits), so a K-quant
// sub-block of 32 (or two of 16) meets one activation block. Per (row, column, block of 32), exact
// integer dot products, then float steps in one fixed order (c = 256 h + l and u = e / 256 with two
// codes, c = h and u = e with one; Sx = the block's float sum of x):
//   Q4_K / Q5_K, two codes:  y += ((d sc_j) u) S(q c) + (-dmin m_j) Sx
//   Q4_K / Q5_K, one code:   y += ((d sc_j) e) (S(q h) - C S(h)) + (C d sc_j - dmin m_j) Sx
//                            (codes centred at C = 8 / 16, as quant_matmul.cpp centres Q4_1's: an
//                            activation's rounding meets products of at most C steps, not 2C)
//   Q6_K:                    y += ((d sc_2j) u) S'(q c - 32 c) + ((d sc_2j+1) u) S''(q c - 32 c)
//                            (S' over the block's first 16 values, S'' its last 16)
// d sc, dmin m and C d sc are exact in float32 (11-bit d times a 6- or 8-bit scale; C a power of 2),
// so each term has the roundings of (d sc) u, the fused multiply-adds, and C d sc - dmin m once.
// Every output element is summed over its blocks in order 0, 1, 2, ... from its own row and column
// only: a row's output is bitwise the same alone or among any rows, on any thread count (columns are
// split by group), and the AVX2 build gives the AVX-512 one's bits.
//
// Packed weight: int64 [segments S, K, then (GGML type, columns, byte offset) per segment], padded to
// 64 bytes; each segment's columns in groups of 16, a group's super-blocks one after another:
//   header  Q4_K/Q5_K: 16 float16 d, 16 float16 dmin, then the 12 scale bytes as planes (byte i of
//           column c at 64 + 16 i + c): 256 bytes. Q6_K: 16 float16 d, then the 16 int8 scales as
//           planes (at 32 + 16 i + c): 288 bytes.
//   then per block of 32 (8 per super-block):
//           the low 4 bits of the codes as quant_matmul.cpp packs int4 (4 chunks of 64: byte 4c+t of
//           chunk a holds column c's k = 8a+t in its low nibble and k = 8a+4+t in its high one), 256
//           bytes; Q5_K: + 64 bytes, bit j of byte b = bit 4 of the code at byte b of unpacked chunk j
//           (chunk 2a: the low nibbles of chunk a, 2a+1: the high ones); Q6_K: + 128 bytes, bits 2i,
//           2i+1 of byte b of plane p = bits 4, 5 of the code at byte b of unpacked chunk 4p+i.
// So a group's super-block holds 16 x the file's block bytes (144, 176, 210): nothing is added.
// Activations, block-major (block b of row r at (b M + r) 64 bytes: 32 h codes, then 32 l codes; steps,
// float sums at [b M + r]; four chain starts at [(b M + r) 4]), so a row tile's codes are constant
// offsets from one pointer.
// Paths as quant_matmul.cpp's: AVX-512 VNNI (zmm, 12-row tiles), AVX-VNNI or AVX2 (two ymm halves a
// group, 8-row tiles), and AMX tiles for calls of 12 rows or more where the OS grants them (tile_group).

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "native_common.h"

// quant_matmul.cpp's activation rows, shared so that both kernels quantize a row alike
void qmm_quantize_row(const void* x, int bf16, int64_t K, int8_t* xh, int8_t* xl, float* dx, float* sx, int32_t* sh,
                      int32_t* sl, int64_t cs, int64_t ss);
// and its rule for which calls take the AMX tiles (one setting: lm_qmm_set_amx)
bool qmm_takes_tiles(int64_t M);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KQ_PATH 3
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
#define KQ_PATH 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KQ_PATH 1
#else
#define KQ_PATH 0
#endif

namespace {

const int QB = 32;       // activation block along K
const int QK_K = 256;    // super-block along K
const int SUB = QK_K / QB;  // blocks of 32 in a super-block
const int COLS = 16;     // output columns per packed group
const int ROW_TILE = KQ_PATH == 3 ? 12 : 8;
const int OWN_ROWS_MAX = 8;  // calls of up to this many rows: every thread quantizes them all (as quant_matmul.cpp)
const int MAX_SEGMENTS = 16;
const int PREFETCH_BYTES = 8192;  // quant_matmul.cpp's distance and hint (measured there)

enum Format { Q4K = 0, Q5K = 1, Q6K = 2 };
const int GGML_TYPE[3] = {12, 13, 14};
const int HEADER_BYTES[3] = {256, 256, 288};
const int BLOCK_BYTES[3] = {256, 320, 384};
const int CENTRE[3] = {8, 16, 32};

inline int64_t group_bytes(int f, int64_t K) { return K / QK_K * (HEADER_BYTES[f] + SUB * BLOCK_BYTES[f]); }

inline void prefetch_ahead(const uint8_t* g, int bytes) {
    for (int c = 0; c < bytes; c += 64) _mm_prefetch((const char*)g + PREFETCH_BYTES + c, _MM_HINT_T1);
}

typedef uint8_t v64b __attribute__((vector_size(64)));

// Q4_K / Q5_K: a super-block's 6-bit scales and minimums as bytes, sc[j][c] and mn[j][c] for sub-block j
// and column c, from the 12 planes (ggml's packing: bytes 0-3 hold sc 0-3 and the top bits of sc 4-7,
// bytes 4-7 the same for the minimums, bytes 8-11 the low 4 bits of sc 4-7 and of m 4-7).
struct alignas(64) ScaleBytes {
    uint8_t sc[SUB][COLS], mn[SUB][COLS];
};

inline void scale_bytes(const uint8_t* planes, ScaleBytes& s) {
    v64b a, b, c;  // planes 0-3, 4-7, 8-11
    memcpy(&a, planes, 64);
    memcpy(&b, planes + 64, 64);
    memcpy(&c, planes + 128, 64);
    const v64b sc_lo = a & 63, mn_lo = b & 63;
    const v64b sc_hi = (c & 15) | ((a >> 2) & 0x30), mn_hi = (c >> 4) | ((b >> 2) & 0x30);
    memcpy(s.sc[0], &sc_lo, 64);
    memcpy(s.sc[4], &sc_hi, 64);
    memcpy(s.mn[0], &mn_lo, 64);
    memcpy(s.mn[4], &mn_hi, 64);
}

// The activation unit of a row-block of step e (quant_matmul.cpp's unit_of)
inline float unit_of(bool precise, float e) { return precise ? e * (1.0f / 256.0f) : e; }

// chunk j (0..7) of a block's unpacked codes holds k = 8(j/2) + 4(j%2) + t at byte 4c + t
inline int chunk_k(int j) { return 8 * (j / 2) + 4 * (j % 2); }

struct Acts {  // a call's quantized rows, block-major (the header)
    const int8_t* codes;    // [KB, M, 64]: h, then l
    const float *dx, *sx;   // [KB, M]
    const int32_t* starts;  // [KB, M, 4]: where a row-block's integer sums start (row_starts)
    int64_t M, KB;
    bool precise;
};

// A row's chain starts per block: minus what the codes' offsets add to the integer sums, so each sum
// ends exact over the centred codes. [0] Q4_K and [1] Q5_K with one code (-C S h; two codes: 0, the
// codes are not centred); [2], [3] Q6_K's two halves (-32 S c over each 16).
void row_starts(const int8_t* codes, int64_t M, int64_t r, int64_t KB, bool precise, int32_t* starts) {
    for (int64_t b = 0; b < KB; ++b) {
        const int8_t* c = codes + (b * M + r) * 64;
        int32_t h0 = 0, h1 = 0, l0 = 0, l1 = 0;  // the code sums of each half (scalars: they vectorize)
        for (int t = 0; t < 16; ++t) {
            h0 += c[t];
            h1 += c[16 + t];
            l0 += c[32 + t];  // remainder codes (unused with one code)
            l1 += c[48 + t];
        }
        int32_t* s = starts + (b * M + r) * 4;
        s[0] = precise ? 0 : -8 * (h0 + h1);
        s[1] = precise ? 0 : -16 * (h0 + h1);
        s[2] = -32 * (precise ? 256 * h0 + l0 : h0);
        s[3] = -32 * (precise ? 256 * h1 + l1 : h1);
    }
}

struct RowBuffers {  // one thread's buffers for a call's quantized rows, kept from call to call
    std::vector<int8_t> codes;
    std::vector<float> floats;
    std::vector<int32_t> ints;
    Acts acts(int64_t M, int64_t K, bool precise) {
        const int64_t KB = K / QB, pad = 16;  // a tile's rows past the last block's last row (tile_group)
        codes.resize((size_t)((M * KB + pad) * 64));
        floats.resize((size_t)(2 * M * KB + pad));
        ints.resize((size_t)(6 * M * KB + 4 * pad));  // starts, then quantize_row's code sums (scratch)
        return Acts{codes.data(), floats.data(), floats.data() + M * KB, ints.data(), M, KB, precise};
    }
    void quantize(const void* x, int bf16, int64_t K, int64_t M, int64_t r, bool precise) {
        const int64_t KB = K / QB;
        int8_t* c = codes.data();
        int32_t* scratch = ints.data() + 4 * M * KB;
        qmm_quantize_row(x, bf16, K, c + r * 64, precise ? c + r * 64 + 32 : nullptr, floats.data() + r,
                         floats.data() + M * KB + r, scratch + r, scratch + M * KB + r, M * 64, M);
        row_starts(c, M, r, KB, precise, ints.data());
    }
};

#if KQ_PATH == 3
typedef int32_t __attribute__((may_alias)) int32_alias;

// The vector operations the kernel takes, over the lanes one register holds: a group's 16 columns in one
// zmm (AVX-512), or in two ymm halves of 8 (AVX2 / AVX-VNNI). One implementation below serves both, so
// the two builds do the same float operations per lane in the same order (the same bits).
struct V {
    typedef __m512i I;
    typedef __m512 F;
    static const int LANES = 16, HALVES = 1;
    static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
    static I bytes(char b) { return _mm512_set1_epi8(b); }
    static I and_(I a, I b) { return _mm512_and_si512(a, b); }
    static I or_(I a, I b) { return _mm512_or_si512(a, b); }
    static I shift_bits(I v, int s) {  // within 16-bit lanes: left by s, right by -s
        return s > 0 ? _mm512_slli_epi16(v, s) : (s < 0 ? _mm512_srli_epi16(v, -s) : v);
    }
    static I start(const int32_t* p) { return _mm512_set1_epi32(*p); }  // a broadcast from memory
    static I zero() { return _mm512_setzero_si512(); }
    static I join(I h, I l) { return _mm512_add_epi32(_mm512_slli_epi32(h, 8), l); }  // 256 h + l
    // acc += w (unsigned bytes) x the 4 signed codes at p, broadcast from the instruction's memory operand
    static I dot(I acc, I w, const int8_t* p) {
        asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_alias*)p));
        return acc;
    }
    static F fzero() { return _mm512_setzero_ps(); }
    static F set1(float v) { return _mm512_set1_ps(v); }
    static F floats(I v) { return _mm512_cvtepi32_ps(v); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
    static F halfs(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    template <bool SIGNED>
    static F byte_floats(const uint8_t* p) {  // exact
        const __m128i b = _mm_loadu_si128((const __m128i*)p);
        return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
    }
    static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#elif KQ_PATH >= 1
struct V {
    typedef __m256i I;
    typedef __m256 F;
    static const int LANES = 8, HALVES = 2;
    static I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
    static I bytes(char b) { return _mm256_set1_epi8(b); }
    static I and_(I a, I b) { return _mm256_and_si256(a, b); }
    static I or_(I a, I b) { return _mm256_or_si256(a, b); }
    static I shift_bits(I v, int s) { return s > 0 ? _mm256_slli_epi16(v, s) : (s < 0 ? _mm256_srli_epi16(v, -s) : v); }
    static I start(const int32_t* p) { return _mm256_set1_epi32(*p); }
    static I zero() { return _mm256_setzero_si256(); }
    static I join(I h, I l) { return _mm256_add_epi32(_mm256_slli_epi32(h, 8), l); }
    // u8 codes x s8 activations, 4 products per int32 lane, added on (codes <= 63: maddubs's pairs stay
    // within int16)
    static I dot(I acc, I w, const int8_t* p) {
        int32_t x;
        memcpy(&x, p, 4);
#if KQ_PATH == 2
        return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(x));
#else
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x)),
                                                       _mm256_set1_epi16(1)));
#endif
    }
    static F fzero() { return _mm256_setzero_ps(); }
    static F set1(float v) { return _mm256_set1_ps(v); }
    static F floats(I v) { return _mm256_cvtepi32_ps(v); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
    static F halfs(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    template <bool SIGNED>
    static F byte_floats(const uint8_t* p) {
        const __m128i b = _mm_loadl_epi64((const __m128i*)p);
        return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
    }
    static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif

#if KQ_PATH >= 1
// Columns LANES h .. of a block's codes, unpacked: chunk j's byte 4c + t is column c's code at
// k = chunk_k(j) + t (a half of each 64-byte chunk on the ymm paths).
template <int F>
inline void unpack(const uint8_t* g, int h, V::I w[8]) {
    const int at = 4 * V::LANES * h;
    const V::I low = V::bytes(0x0F);
    for (int a = 0; a < 4; ++a) {
        const V::I p = V::load(g + 64 * a + at);
        w[2 * a] = V::and_(p, low);
        w[2 * a + 1] = V::and_(V::shift_bits(p, -4), low);
    }
    if (F == Q5K) {
        const V::I hb = V::load(g + 256 + at), bit = V::bytes(0x10);
        for (int j = 0; j < 8; ++j) w[j] = V::or_(w[j], V::and_(V::shift_bits(hb, 4 - j), bit));
    } else if (F == Q6K) {
        const V::I bits = V::bytes(0x30);
        for (int p = 0; p < 2; ++p) {
            const V::I hp = V::load(g + 256 + 64 * p + at);
            for (int i = 0; i < 4; ++i) w[4 * p + i] = V::or_(w[4 * p + i], V::and_(V::shift_bits(hp, 4 - 2 * i), bits));
        }
    }
}

// The integer sum of chunks j0 .. j1 - 1 of a row-block: c = h (xl null) from `start`, or 256 h + l with
// `start` added to the l chain.
template <int F>
inline V::I chunk_sum(const V::I w[8], int j0, int j1, const int8_t* xh, const int8_t* xl, const int32_t* start) {
#if KQ_PATH == 1
    // maddubs's int16 pair sums (|q x| <= 2 x 63 x 128 at most) of RUN chunks add up within int16 (Q4_K's
    // codes 0..15: all 8, Q5_K's 0..31: 4, Q6_K's 0..63: 2), then one widening madd a run: the same exact
    // sums with fewer multiplies
    constexpr int RUN = F == Q4K ? 8 : F == Q5K ? 4 : 2;
    const V::I ones = _mm256_set1_epi16(1);
    auto chain = [&](V::I s, const int8_t* x) {
        for (int j = j0; j < j1; j += RUN) {
            V::I s16 = _mm256_setzero_si256();
            for (int i = j; i < j + RUN && i < j1; ++i) {
                int32_t xi;
                memcpy(&xi, x + chunk_k(i), 4);
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(xi)));
            }
            s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, ones));
        }
        return s;
    };
    if (!xl) return chain(V::start(start), xh);
    return V::join(chain(V::zero(), xh), chain(V::start(start), xl));
#else
    V::I s = V::start(start);
    if (!xl) {
        for (int j = j0; j < j1; ++j) s = V::dot(s, w[j], xh + chunk_k(j));
        return s;
    }
    V::I hs = V::zero();
    for (int j = j0; j < j1; ++j) {
        hs = V::dot(hs, w[j], xh + chunk_k(j));
        s = V::dot(s, w[j], xl + chunk_k(j));
    }
    return V::join(hs, s);
#endif
}

// Block j's float steps (columns LANES h ..) in the super-block whose header is at hdr: s0, s1 its
// sub-blocks' d sc (Q6_K: its two halves; else both the same) and mt, what multiplies its float sum of x
// (Q4_K / Q5_K): C d sc - dmin m rounded once (C d sc and dmin m are exact), or - dmin m with two codes.
template <int F, bool PRECISE>
inline void block_steps(const uint8_t* hdr, const ScaleBytes& sb, int j, int h, V::F& s0, V::F& s1, V::F& mt) {
    const int c = V::LANES * h;
    const V::F d = V::halfs(hdr + 2 * c);
    if (F == Q6K) {
        s0 = V::mul(d, V::byte_floats<true>(hdr + 32 + 32 * j + c));
        s1 = V::mul(d, V::byte_floats<true>(hdr + 48 + 32 * j + c));
        mt = V::fzero();
        return;
    }
    const V::F dmin = V::halfs(hdr + 32 + 2 * c);
    s0 = s1 = V::mul(d, V::byte_floats<false>(sb.sc[j] + c));
    const V::F base = PRECISE ? V::fzero() : V::mul(V::set1((float)CENTRE[F]), s0);
    mt = V::fnmadd(dmin, V::byte_floats<false>(sb.mn[j] + c), base);
}

// rows r0 .. r0 + R - 1 of one column group over all super-blocks (R <= ROW_TILE): accumulators in
// registers, each block's codes unpacked and its steps formed once for the R rows.
template <int R, int F, bool PRECISE>
void group_rows(const uint8_t* g, const Acts& a, int64_t r0, float out[][COLS]) {
    V::F acc[R][V::HALVES];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < V::HALVES; ++h) acc[r][h] = V::fzero();
    const int64_t M = a.M;
    const int8_t* c = a.codes + r0 * 64;
    const float* dx = a.dx + r0;
    const float* sx = a.sx + r0;
    const int32_t* st = a.starts + r0 * 4;
    ScaleBytes sb;
    for (int64_t s = 0; s < a.KB / SUB; ++s) {
        const uint8_t* hdr = g;
        prefetch_ahead(g, HEADER_BYTES[F]);  // the blocks' prefetches cover their own bytes only
        if (F != Q6K) scale_bytes(hdr + 64, sb);
        g += HEADER_BYTES[F];
        for (int j = 0; j < SUB; ++j, g += BLOCK_BYTES[F], c += M * 64, dx += M, sx += M, st += M * 4) {
            prefetch_ahead(g, BLOCK_BYTES[F]);
            for (int h = 0; h < V::HALVES; ++h) {
                V::I w[8];
                unpack<F>(g, h, w);
                V::F s0, s1, mt;
                block_steps<F, PRECISE>(hdr, sb, j, h, s0, s1, mt);
#pragma GCC unroll 12
                for (int r = 0; r < R; ++r) {
                    const int8_t* xh = c + r * 64;
                    const int8_t* xl = PRECISE ? xh + 32 : nullptr;
                    const V::F u = V::set1(unit_of(PRECISE, dx[r]));
                    V::F& y = acc[r][h];
                    if (F == Q6K) {
                        const V::I lo = chunk_sum<F>(w, 0, 4, xh, xl, st + 4 * r + 2);
                        const V::I hi = chunk_sum<F>(w, 4, 8, xh, xl, st + 4 * r + 3);
                        y = V::fmadd(V::floats(lo), V::mul(s0, u), y);
                        y = V::fmadd(V::floats(hi), V::mul(s1, u), y);
                    } else {
                        y = V::fmadd(V::floats(chunk_sum<F>(w, 0, 8, xh, xl, st + 4 * r + F)), V::mul(s0, u), y);
                        y = V::fmadd(mt, V::set1(sx[r]), y);
                    }
                }
            }
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < V::HALVES; ++h) V::store(out[r] + V::LANES * h, acc[r][h]);
}
#endif

#if KQ_PATH == 3 && defined(LM_INT8_TILES)
#define KQ_AMX 1
// AMX tiles for calls of enough rows (qmm_takes_tiles: the rule and setting quant_matmul.cpp's tiles
// follow), rows in tiles of one even height T <= 16 (amx_height). Per block of 32, the tile unit takes
// the integer sums that group_rows' chains take (tdpbsud: the activation codes signed, the weight codes
// unsigned as unpack() gives them), and the chain's start is added to the tile's sum afterwards: the
// same integers. The float steps are group_rows', in its order, so a row's output is bitwise the VNNI
// path's whichever path a call takes (batch invariance holds across the switch).
// The unpacked chunks are the tile's rows as they stand: chunk j holds k = 4j + t of column c at byte
// 4c + t, which is a B tile's row j (k / 4 = j). The activation codes are block-major (row r of block b
// at (b M + r) 64 bytes: h, then l), so a block's A tile is T rows of 32 bytes at stride 64.
// Tiles: 0 / 1 and 5 / 6 the sums of h / l codes (T rows x 16 int32); 2 / 3 the h / l codes (T x 32);
// 4 and 7 the weight codes (8 rows x 64). Q4_K / Q5_K alternate sums 0 / 1 and 5 / 6 from block to block;
// Q6_K's two halves of 16 (each with its own scale) take tile 4 with rows 4..7 zero and tile 7 with
// rows 0..3 zero, their sums in 0 / 1 and 5 / 6.
// Not measured on an AMX CPU yet (none has been at hand since this path was written): the row rule is
// quant_matmul.cpp's, measured for its int4 and int8 tiles.
AmxTileConfig kq_tiles(int T) {
    AmxTileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t : {0, 1, 5, 6}) {
        c.rows[t] = (uint8_t)T;
        c.colsb[t] = 64;
    }
    c.rows[2] = c.rows[3] = (uint8_t)T;
    c.colsb[2] = c.colsb[3] = QB;
    c.rows[4] = c.rows[7] = QB / 4;
    c.colsb[4] = c.colsb[7] = 64;
    return c;
}

// One block's weight codes for the tiles: rows 0..7 tile 4's, 8..15 tile 7's (Q6_K only).
struct alignas(64) KqTileCodes {
    uint8_t rows[2 * QB / 4][64];
};

// The header of the super-block that holds block b (of 32, counted from the group's first), and block b's bytes.
template <int F>
inline const uint8_t* header_of(const uint8_t* g, int64_t b) {
    return g + (b / SUB) * (HEADER_BYTES[F] + SUB * BLOCK_BYTES[F]);
}
template <int F>
inline const uint8_t* block_at(const uint8_t* g, int64_t b) {
    return header_of<F>(g, b) + HEADER_BYTES[F] + (b % SUB) * BLOCK_BYTES[F];
}

// Block b's codes into `out`. Q6_K: the first half's chunks in tile 4 (rows 0..3), the second's in tile 7
// (its rows 4..7), and with zero_halves the other rows zeroed (a buffer another format may have written).
template <int F>
inline void tile_unpack(const uint8_t* g, int64_t b, KqTileCodes& out, bool zero_halves) {
    const uint8_t* blk = block_at<F>(g, b);
    if (b % SUB == 0) prefetch_ahead(blk - HEADER_BYTES[F], HEADER_BYTES[F]);
    prefetch_ahead(blk, BLOCK_BYTES[F]);
    V::I w[8];
    unpack<F>(blk, 0, w);
    for (int j = 0; j < 8; ++j) _mm512_store_si512(out.rows[F == Q6K && j >= 4 ? 8 + j : j], w[j]);
    if (F == Q6K && zero_halves)
        for (int row = 4; row < 12; ++row) _mm512_store_si512(out.rows[row], V::zero());
}

// The tile sums of block b of rows r0 .. r0 + T - 1 into sums[half][code][row][column] (half: Q6_K's; code:
// h, l), from its codes unpacked in `codes`.
template <int F, bool PRECISE, int T>
inline void tile_sums(const Acts& a, int64_t r0, int64_t b, const KqTileCodes& codes, int32_t (*sums)[2][T][COLS]) {
    const int8_t* x = a.codes + (b * a.M + r0) * 64;
    TILE_LOAD(2, x, 64);
    if (PRECISE) TILE_LOAD(3, x + 32, 64);
    TILE_LOAD(4, codes.rows[0], 64);
#define KQ_SUMS(H, L, B, half)                  \
    TILE_ZERO(H);                               \
    TILE_DPBSUD(H, 2, B);                       \
    TILE_STORE(H, sums[half][0], 64);           \
    if (PRECISE) {                              \
        TILE_ZERO(L);                           \
        TILE_DPBSUD(L, 3, B);                   \
        TILE_STORE(L, sums[half][1], 64);       \
    }
    if (F == Q6K) {
        TILE_LOAD(7, codes.rows[8], 64);
        KQ_SUMS(0, 1, 4, 0)
        KQ_SUMS(5, 6, 7, 1)
    } else if (b & 1) {
        KQ_SUMS(5, 6, 4, 0)
    } else {
        KQ_SUMS(0, 1, 4, 0)
    }
#undef KQ_SUMS
}

// rows r0 .. r0 + R - 1 (R <= T; the activation buffers hold T rows past r0) of one column group over all
// super-blocks, on tiles of height T; a padding row's outputs are thrown away. `codes`: room for the
// group's blocks unpacked, shared by the call's row tiles over this group (null: a ring of three here);
// `fill`: this tile unpacks them (the group's first), else they are there already (quant_matmul.cpp's
// int4 tiles took 32 rows 12.1 -> 11.3 ms that way).
template <int F, bool PRECISE, int T>
void tile_group(const uint8_t* g, const Acts& a, int64_t r0, int R, float out[][COLS], KqTileCodes* codes, bool fill) {
    alignas(64) int32_t sums[2][2][2][T][COLS];  // [block parity][half][code][row][column]
    // codes unpacked two blocks ahead: a tile load of bytes that vector stores have just written waits
    // for them to reach the cache (measured for quant_matmul.cpp's tiles), so the stores get a block's
    // float steps to land
    KqTileCodes ring[3];
    if (F == Q6K && !codes) memset(ring, 0, sizeof ring);  // the halves' zero rows
    const bool unpack = fill || !codes;
    auto block_codes = [&](int64_t b) -> KqTileCodes& { return codes ? codes[b] : ring[b % 3]; };
    V::F acc[T];
#pragma GCC unroll 16
    for (int r = 0; r < T; ++r) acc[r] = V::fzero();
    const int64_t M = a.M, KB = a.KB;
    if (unpack) {
        tile_unpack<F>(g, 0, block_codes(0), codes);
        if (KB > 1) tile_unpack<F>(g, 1, block_codes(1), codes);
    }
    tile_sums<F, PRECISE, T>(a, r0, 0, block_codes(0), sums[0]);
    ScaleBytes sb;
    const uint8_t* hdr = g;
    for (int64_t b = 0; b < KB; ++b) {
        const int p = (int)(b & 1), j = (int)(b % SUB);
        if (b + 1 < KB) tile_sums<F, PRECISE, T>(a, r0, b + 1, block_codes(b + 1), sums[1 - p]);
        if (unpack && b + 2 < KB) tile_unpack<F>(g, b + 2, block_codes(b + 2), codes);
        if (j == 0) {
            hdr = header_of<F>(g, b);
            if (F != Q6K) scale_bytes(hdr + 64, sb);
        }
        V::F s0, s1, mt;
        block_steps<F, PRECISE>(hdr, sb, j, 0, s0, s1, mt);
        const float* dx = a.dx + b * M + r0;
        const float* sx = a.sx + b * M + r0;
        const int32_t* st = a.starts + (b * M + r0) * 4;
        // all T rows: a fixed count keeps acc[] in registers
#pragma GCC unroll 16
        for (int r = 0; r < T; ++r) {
            const V::F u = V::set1(unit_of(PRECISE, dx[r]));
            auto sum = [&](int half, int start) {  // group_rows' chain_sum: 256 h + (l + start), or h + start
                const V::I h = _mm512_load_si512(sums[p][half][0][r]);
                const V::I s = V::start(st + 4 * r + start);
                return PRECISE ? V::join(h, _mm512_add_epi32(_mm512_load_si512(sums[p][half][1][r]), s))
                               : _mm512_add_epi32(h, s);
            };
            if (F == Q6K) {
                acc[r] = V::fmadd(V::floats(sum(0, 2)), V::mul(s0, u), acc[r]);
                acc[r] = V::fmadd(V::floats(sum(1, 3)), V::mul(s1, u), acc[r]);
            } else {
                acc[r] = V::fmadd(V::floats(sum(0, F)), V::mul(s0, u), acc[r]);
                acc[r] = V::fmadd(mt, V::set1(sx[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) V::store(out[r], acc[r]);
}

typedef void (*TileFn)(const uint8_t*, const Acts&, int64_t, int, float[][COLS], KqTileCodes*, bool);

template <int F, bool PRECISE>
TileFn tile_height_fn(int T) {  // T even, 2..16
    switch (T) {
        case 2: return tile_group<F, PRECISE, 2>; case 4: return tile_group<F, PRECISE, 4>;
        case 6: return tile_group<F, PRECISE, 6>; case 8: return tile_group<F, PRECISE, 8>;
        case 10: return tile_group<F, PRECISE, 10>; case 12: return tile_group<F, PRECISE, 12>;
        case 14: return tile_group<F, PRECISE, 14>; default: return tile_group<F, PRECISE, 16>;
    }
}

TileFn tile_fn_of(int f, bool precise, int T) {
    if (precise)
        return f == Q4K ? tile_height_fn<Q4K, true>(T) : (f == Q5K ? tile_height_fn<Q5K, true>(T) : tile_height_fn<Q6K, true>(T));
    return f == Q4K ? tile_height_fn<Q4K, false>(T) : (f == Q5K ? tile_height_fn<Q5K, false>(T) : tile_height_fn<Q6K, false>(T));
}
#endif

#if KQ_PATH >= 1
typedef void (*GroupFn)(const uint8_t*, const Acts&, int64_t, float[][COLS]);

template <int F, bool PRECISE>
GroupFn tile_fn(int R) {
    switch (R) {
        case 1: return group_rows<1, F, PRECISE>; case 2: return group_rows<2, F, PRECISE>;
        case 3: return group_rows<3, F, PRECISE>; case 4: return group_rows<4, F, PRECISE>;
        case 5: return group_rows<5, F, PRECISE>; case 6: return group_rows<6, F, PRECISE>;
        case 7: return group_rows<7, F, PRECISE>;
#if KQ_PATH == 3
        case 8: return group_rows<8, F, PRECISE>; case 9: return group_rows<9, F, PRECISE>;
        case 10: return group_rows<10, F, PRECISE>; case 11: return group_rows<11, F, PRECISE>;
#endif
        default: return group_rows<ROW_TILE, F, PRECISE>;
    }
}

template <bool PRECISE>
GroupFn group_fn(int f, int R) {
    return f == Q4K ? tile_fn<Q4K, PRECISE>(R) : (f == Q5K ? tile_fn<Q5K, PRECISE>(R) : tile_fn<Q6K, PRECISE>(R));
}

struct Segment {
    int format;
    int64_t first_group, groups;
    const uint8_t* data;
};

// The packed weight's segment table, checked against the call's K and N: the segments, or 0 when it
// does not describe a weight of this shape.
int read_segments(const uint8_t* w, int64_t K, int64_t N, Segment* seg) {
    const int64_t* t = (const int64_t*)w;
    const int64_t count = t[0];
    if (count < 1 || count > MAX_SEGMENTS || t[1] != K) return 0;
    int64_t cols = 0;
    for (int s = 0; s < count; ++s) {
        const int64_t type = t[2 + 3 * s], n = t[3 + 3 * s], offset = t[4 + 3 * s];
        int f = -1;
        for (int i = 0; i < 3; ++i) f = GGML_TYPE[i] == type ? i : f;
        if (f < 0 || n <= 0 || n % COLS || offset < 0) return 0;
        seg[s] = Segment{f, cols / COLS, n / COLS, w + offset};
        cols += n;
    }
    return cols == N ? (int)count : 0;
}

// The segment that holds column group gi.
inline const Segment& segment_of(const Segment* seg, int64_t gi) {
    int s = 0;
    while (gi >= seg[s].first_group + seg[s].groups) ++s;
    return seg[s];
}

int matmul(int precise, const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* w, int64_t N, void* y,
           int y_bf16, int threads) {
    Segment seg[MAX_SEGMENTS];
    const int count = K > 0 && K % QK_K == 0 && M >= 0 ? read_segments(w, K, N, seg) : 0;
    if (!count) return 1;
    const bool pr = precise != 0;
    static thread_local RowBuffers call_rows;  // the calling thread's, by reference (see quant_matmul.cpp)
    RowBuffers& shared = call_rows;
    const Acts a = shared.acts(M, K, pr);
    const size_t x_row = (size_t)K * (x_bf16 ? 2 : 4);
    const bool own_rows = M <= OWN_ROWS_MAX;
    const int64_t tiles = (M + ROW_TILE - 1) / ROW_TILE, groups = N / COLS;
#ifdef KQ_AMX
    const bool amx = qmm_takes_tiles(M);
    const int T = amx ? amx_height(M) : 0;
#endif
    auto store = [&](int64_t r0, int R, int64_t gi, float out[][COLS]) {
        for (int r = 0; r < R; ++r) {  // a group's 16 outputs of a row: bfloat16 (nearest even) or float32
            const int64_t at = (r0 + r) * N + gi * COLS;
            if (y_bf16) BF16::store((uint16_t*)y + at, F32::load(out[r]));
            else memcpy((float*)y + at, out[r], sizeof out[r]);
        }
    };
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        Acts rows_here = a;
        if (own_rows) {  // a few rows: every thread quantizes them all into its own buffers (no waiting)
            static thread_local RowBuffers own;
            rows_here = own.acts(M, K, pr);
            for (int64_t r = 0; r < M; ++r) own.quantize((const char*)x + r * x_row, x_bf16, K, M, r, pr);
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; ++r) shared.quantize((const char*)x + r * x_row, x_bf16, K, M, r, pr);
        }
#ifdef KQ_AMX
        if (amx) {
            AmxScope scope(kq_tiles(T));
            // several row tiles: a group's first unpacks its codes for all of them
            std::vector<KqTileCodes> codes(M > T ? (size_t)a.KB : 0);
#pragma omp for schedule(static)
            for (int64_t gi = 0; gi < groups; ++gi) {
                const Segment& sg = segment_of(seg, gi);
                const uint8_t* g = sg.data + (gi - sg.first_group) * group_bytes(sg.format, K);
                const TileFn fn = tile_fn_of(sg.format, pr, T);
                float out[AMX_ROWS][COLS];
                for (int64_t r0 = 0; r0 < M; r0 += T) {
                    const int R = (int)(M - r0 < T ? M - r0 : T);
                    fn(g, rows_here, r0, R, out, codes.empty() ? nullptr : codes.data(), r0 == 0);
                    store(r0, R, gi, out);
                }
            }
        } else
#endif
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < groups; ++gi) {
            const Segment& sg = segment_of(seg, gi);
            const uint8_t* g = sg.data + (gi - sg.first_group) * group_bytes(sg.format, K);
            float out[ROW_TILE][COLS];
            for (int64_t t = 0, r0 = 0; t < tiles; ++t) {  // rows in tiles of even sizes
                const int R = (int)(M / tiles + (t < M % tiles));
                (pr ? group_fn<true>(sg.format, R) : group_fn<false>(sg.format, R))(g, rows_here, r0, out);
                store(r0, R, gi, out);
                r0 += R;
            }
        }
    }
    return 0;
}
#endif

}  // namespace

extern "C" {

// 3: AVX-512 VNNI, 2: AVX-VNNI (ymm), 1: AVX2, 0: not built.
int lm_kqmm_path() { return KQ_PATH; }

// y [M, N] (bfloat16 when y_bf16, else float32) = x [M, K] (bfloat16 / float32, rows packed) times the
// packed K-quant weight's transpose; precise: remainder codes too. Returns 0, 1 for a weight or shape it
// does not take, 2 when built without a path. lm_qmm passes its calls here for bits = 256.
int lm_kqmm(int precise, const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* w, int64_t N, void* y,
            int y_bf16, int threads) {
#if KQ_PATH >= 1
    return matmul(precise, x, x_bf16, M, K, w, N, y, y_bf16, threads);
#else
    (void)precise; (void)x; (void)x_bf16; (void)M; (void)K; (void)w; (void)N; (void)y; (void)y_bf16; (void)threads;
    return 2;
#endif
}
}

// ---- packing: a tensor's file bytes into the layout above -------------------------------------------
namespace {

const int FILE_BLOCK_BYTES[3] = {144, 176, 210};  // a super-block in the file

int format_of(int ggml_type) {
    for (int f = 0; f < 3; f++)
        if (GGML_TYPE[f] == ggml_type) return f;
    return -1;
}

// The 256 codes of one super-block (one row) in weight order, from its bytes.
void unpack_codes(int f, const uint8_t* b, uint8_t* q) {
    if (f == Q6K) {  // ql [0:128), qh [128:192): halves n of 128, runs r of 32
        for (int n = 0; n < 2; n++)
            for (int r = 0; r < 4; r++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t lo = b[64 * n + 32 * (r & 1) + l];
                    const int low = r < 2 ? lo & 15 : lo >> 4;
                    const int high = (b[128 + 32 * n + l] >> (2 * r)) & 3;
                    q[128 * n + 32 * r + l] = (uint8_t)(low | (high << 4));
                }
        return;
    }
    const uint8_t* qs = b + (f == Q4K ? 16 : 48);  // runs r of 32 bytes: sub-block 2r low nibbles, 2r+1 high
    for (int sb = 0; sb < 8; sb++)
        for (int l = 0; l < 32; l++) {
            const uint8_t byte = qs[32 * (sb / 2) + l];
            int code = sb % 2 ? byte >> 4 : byte & 15;
            if (f == Q5K) code |= ((b[16 + l] >> sb) & 1) << 4;
            q[32 * sb + l] = (uint8_t)code;
        }
}

// One group's super-block s: 16 rows' bytes (row c at rows[c]) -> header, then 8 blocks of 32.
void pack_superblock(int f, const uint8_t* const* rows, int64_t at, uint8_t* out) {
    uint8_t q[COLS][QK_K];
    for (int c = 0; c < COLS; c++) unpack_codes(f, rows[c] + at, q[c]);
    if (f == Q6K) {
        for (int c = 0; c < COLS; c++) {
            memcpy(out + 2 * c, rows[c] + at + 208, 2);
            for (int i = 0; i < 16; i++) out[32 + 16 * i + c] = rows[c][at + 192 + i];
        }
    } else {
        for (int c = 0; c < COLS; c++) {
            memcpy(out + 2 * c, rows[c] + at, 2);
            memcpy(out + 32 + 2 * c, rows[c] + at + 2, 2);
            for (int i = 0; i < 12; i++) out[64 + 16 * i + c] = rows[c][at + 4 + i];
        }
    }
    out += HEADER_BYTES[f];
    for (int j = 0; j < SUB; j++) {
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < COLS; c++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t* qc = q[c] + 32 * j + 8 * a;
                    out[64 * a + 4 * c + t] = (uint8_t)((qc[t] & 15) | ((qc[4 + t] & 15) << 4));
                }
        uint8_t* extra = out + 256;
        if (f != Q4K) memset(extra, 0, BLOCK_BYTES[f] - 256);
        for (int chunk = 0; chunk < 8 && f != Q4K; chunk++) {  // chunk 2a + h: k = 8a + 4h + t
            const int a = chunk / 2, h = chunk % 2;
            for (int c = 0; c < COLS; c++)
                for (int t = 0; t < 4; t++) {
                    const int hi = q[c][32 * j + 8 * a + 4 * h + t] >> 4;
                    if (f == Q5K) extra[4 * c + t] |= (uint8_t)((hi & 1) << chunk);
                    else extra[64 * (chunk / 4) + 4 * c + t] |= (uint8_t)((hi & 3) << (2 * (chunk % 4)));
                }
        }
        out += BLOCK_BYTES[f];
    }
}

}  // namespace

extern "C" {

// One tensor's rows as the file stores them (raw [N, K/256 * block bytes], GGML type Q4_K, Q5_K or Q6_K)
// -> its groups in the packed layout (out [N/16 * K/256 * 16 * block bytes]). Returns 0, or 1 for a type or
// shape it does not take. Groups are independent: split over `threads`.
int lm_kquant_pack(const uint8_t* raw, int64_t N, int64_t K, int ggml_type, uint8_t* out, int threads) {
    const int f = format_of(ggml_type);
    if (f < 0 || N % COLS || K % QK_K) return 1;
    const int64_t S = K / QK_K, bb = FILE_BLOCK_BYTES[f], row_bytes = S * bb, group_bytes = COLS * row_bytes;
    for_rows((int)(N / COLS), group_bytes, threads, [&](int g) {
        const uint8_t* rows[COLS];
        for (int c = 0; c < COLS; c++) rows[c] = raw + (int64_t(g) * COLS + c) * row_bytes;
        for (int64_t s = 0; s < S; s++) pack_superblock(f, rows, s * bb, out + g * group_bytes + s * COLS * bb);
    });
    return 0;
}
}
