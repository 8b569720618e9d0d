// Shared by the native kernels (decode_attention.cpp, prompt_attention.cpp, fused_ops.cpp, logit_mask.cpp, row_max.cpp, quant_matmul.cpp):
// 16-lane float vectors (GCC vector extensions; AVX-512 or two AVX2 halves with -march=native),
// float32 / bfloat16 / int8 loads and stores, the int8 KV cache's row format, a fixed-order lane sum, e^x, the softmax numerators of one
// row, and a row loop split over OpenMP threads.
#pragma once

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

#if defined(__AMX_TILE__) || defined(LM_SOFT_TILES)
struct AmxTileConfig {  // the LDTILECFG layout, palette 1
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
#endif

#if defined(__AMX_TILE__)
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

// Whether AMX tiles work in this process: the OS must grant the tile state (Linux >= 5.16,
// arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), and a tile instruction must then run. A VM may list
// amx_* in cpuinfo and refuse the state, so the first tile instructions run in a forked child (no
// core dump) and a child killed by them means no. Asked once per process (one fork); otherwise the
// kernels (quant_matmul.cpp, kquant_matmul.cpp, prompt_attention.cpp) keep their AVX-512 paths.
static inline bool amx_probe() {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return false;
    const pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
        prctl(PR_SET_DUMPABLE, 0);
        AmxTileConfig c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        c.rows[0] = 16;
        c.colsb[0] = 64;
        _tile_loadconfig(&c);
        _tile_zero(0);
        _tile_release();
        _exit(0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return false;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

inline bool amx_granted() {  // one answer (one probe) per process, whichever kernel asks first
    static const bool granted = amx_probe();
    return granted;
}

// Tile loads and stores that tell the compiler which memory they read or write. The compiler's own
// _tile_loadd declares no memory read at all (a store to a buffer just before could in principle be
// dropped or moved past it), and its _tile_stored clobbers all memory, which kept every accumulator of
// the float steps after it in memory (a load and a store per fused multiply-add in quant_matmul's tile
// loop). Here a load reads, and a store writes, the memory from `base` on (its extent unknown to the
// compiler: whatever it knows lies there is ordered around the tile instruction, nothing else).
#define TILE_LOAD(t, base, stride)                                                                   \
    __asm__ volatile("tileloadd (%1,%2,1), %%tmm" #t : : "m"(*(const char(*)[])(base)),             \
                     "r"((const void*)(base)), "r"((long)(stride)))
#define TILE_STORE(t, base, stride)                                                                  \
    __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(*(char(*)[])(base)) : "r"((void*)(base)), \
                     "r"((long)(stride)))
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_CONFIG_LOAD(c) _tile_loadconfig(c)
#define TILE_CONFIG_STORE(c) _tile_storeconfig(c)
#define TILE_RELEASE() _tile_release()
#if defined(__AMX_INT8__)
#define LM_INT8_TILES 1  // the CPU's tiles (where the OS grants them: amx_granted)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#endif

#elif defined(LM_SOFT_TILES)
// A software tile unit, for tests on CPUs without AMX (a build with -DLM_SOFT_TILES; never the served
// one): the int8 kernels' tile code runs over these plain loops, so that its layouts, row padding and
// float steps are checked against the VNNI path's bits on every machine. What it cannot check is the
// CPU's own instructions, which the same tests check where the OS grants tiles. Semantics as the
// instruction set reference gives them: a load fills rows x colsb bytes and zeroes the rest of the
// tile; TDPBSUD/TDPBSSD add, per row m of the result and dword n of it, the products of A's row m
// (signed bytes) with B's column n (4 bytes a row of B: unsigned for BSUD, signed for BSSD) over
// A's colsb / 4 rows of B.
#define LM_INT8_TILES 2
struct SoftTiles {
    AmxTileConfig config;  // palette 0: released
    alignas(64) uint8_t data[8][16][64];
};
inline SoftTiles& soft_tiles() {
    static thread_local SoftTiles t;
    return t;
}
inline bool amx_granted() { return true; }
inline void soft_tile_load(int t, const void* base, long stride) {
    SoftTiles& s = soft_tiles();
    if (s.config.palette != 1) __builtin_trap();  // no tile config loaded: #UD on the CPU
    memset(s.data[t], 0, sizeof s.data[t]);
    for (int r = 0; r < s.config.rows[t]; ++r) memcpy(s.data[t][r], (const char*)base + r * stride, s.config.colsb[t]);
}
inline void soft_tile_store(int t, void* base, long stride) {
    SoftTiles& s = soft_tiles();
    for (int r = 0; r < s.config.rows[t]; ++r) memcpy((char*)base + r * stride, s.data[t][r], s.config.colsb[t]);
}
// The shapes the CPU requires of a tile product (it raises #UD otherwise: SIGILL): a tile config
// loaded, C rows = A rows, C colsb = B colsb, A colsb = 4 x B rows. A mismatch traps here as well.
template <bool B_SIGNED>
inline void soft_tile_dp(int c, int a, int b) {
    SoftTiles& s = soft_tiles();
    const AmxTileConfig& k = s.config;
    if (k.palette != 1 || k.rows[c] != k.rows[a] || k.colsb[c] != k.colsb[b] || k.colsb[a] != 4 * k.rows[b] ||
        k.rows[c] == 0)
        __builtin_trap();
    for (int m = 0; m < s.config.rows[c]; ++m)
        for (int n = 0; n < s.config.colsb[c] / 4; ++n) {
            int32_t sum;
            memcpy(&sum, s.data[c][m] + 4 * n, 4);
            for (int k = 0; k < s.config.colsb[a] / 4; ++k)
                for (int t = 0; t < 4; ++t) {
                    const int wb = B_SIGNED ? (int)(int8_t)s.data[b][k][4 * n + t] : (int)s.data[b][k][4 * n + t];
                    sum += (int)(int8_t)s.data[a][m][4 * k + t] * wb;
                }
            memcpy(s.data[c][m] + 4 * n, &sum, 4);
        }
}
#define TILE_LOAD(t, base, stride) soft_tile_load(t, base, stride)
#define TILE_STORE(t, base, stride) soft_tile_store(t, base, stride)
#define TILE_ZERO(t) memset(soft_tiles().data[t], 0, sizeof soft_tiles().data[t])
#define TILE_DPBSSD(c, a, b) soft_tile_dp<true>(c, a, b)
#define TILE_DPBSUD(c, a, b) soft_tile_dp<false>(c, a, b)
#define TILE_CONFIG_LOAD(c) (soft_tiles().config = *(c))
#define TILE_CONFIG_STORE(c) (*(c) = soft_tiles().config)
#define TILE_RELEASE() memset(&soft_tiles().config, 0, sizeof(AmxTileConfig))
#endif

#if defined(__AMX_TILE__) || defined(LM_SOFT_TILES)
// A kernel's tile shapes for the scope of one call on one thread; whatever tile setup the thread
// held before (another library's) is put back afterwards.
class AmxScope {
  public:
    explicit AmxScope(const AmxTileConfig& c) {
        TILE_CONFIG_STORE(&saved_);
        TILE_CONFIG_LOAD(&c);
    }
    ~AmxScope() {
        if (saved_.palette) TILE_CONFIG_LOAD(&saved_);
        else TILE_RELEASE();
    }
    AmxScope(const AmxScope&) = delete;
    AmxScope& operator=(const AmxScope&) = delete;

  private:
    AmxTileConfig saved_;
};

// The tile height for a call of M rows (int8 tiles: quant_matmul.cpp, kquant_matmul.cpp): its rows over
// as few tiles of <= 16 as hold them, rounded up to even (24 rows: 12 + 12; 8 rows: one tile of 8), so
// that no call pays the float steps of more padding rows than one.
const int AMX_ROWS = 16;
inline int amx_height(int64_t M) {
    const int64_t tiles = (M + AMX_ROWS - 1) / AMX_ROWS;
    return (int)(((M + tiles - 1) / tiles + 1) & ~1);
}
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

// AVX2 without AVX-512 (and LMSERVE_GENERIC_VECTORS unset): hot loops take 8-lane registers of their
// own. GCC keeps a 16-lane vector in memory there and turns its comparisons and ?: into 16 scalar steps,
// so the 16-lane code above runs load-op-store chains; the 8-lane paths give the same bits (the same
// operations lane by lane, fused where GCC fuses the 16-lane code), which tests check against the
// 16-lane code built for AVX2 with LMSERVE_GENERIC_VECTORS.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(LMSERVE_GENERIC_VECTORS)
#define LM_AVX2_PATHS 1
#else
#define LM_AVX2_PATHS 0
#endif

#if LM_AVX2_PATHS
struct Halves {  // a 16-lane vector as two 8-lane registers
    __m256 lo, hi;
};
static inline Halves halves(v16f x) {
    Halves h;
    memcpy(&h, &x, sizeof h);
    return h;
}
static inline v16f joined16(__m256 lo, __m256 hi) {
    const Halves h = {lo, hi};
    v16f r;
    memcpy(&r, &h, sizeof r);
    return r;
}

// x's bits plus what rounds them to bfloat16 (nearest, ties even): the rounded value in the high 16 bits
static inline __m256i bf16_rounding8(__m256 x) {
    const __m256i w = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(w, _mm256_set1_epi32(0x7FFF)), odd);
}
static inline __m256i nan_or(__m256 x, __m256i value) {  // x's NaN lanes (quieted: | 0x400000), value's in the rest
    return _mm256_blendv_epi8(value, _mm256_or_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x400000)),
                              _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// exp_clamped on 8 lanes: its clamps (a NaN passes them), then its steps as GCC contracts them (x c +
// magic, x - n c and p r + c fused; p (r r) + r fused, then + 1), 2^n's bits built as the 16-lane code's
template <bool HIGH = true>
static inline __m256 exp_clamped8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f), magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    if (HIGH) x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

struct F32 {
    typedef float T;
    static inline v16f load(const float* p) { v16f r; memcpy(&r, p, sizeof r); return r; }
    static inline void store(float* p, v16f x) { memcpy(p, &x, sizeof x); }
};

static inline float bf16_to_f32(uint16_t h) {  // one bfloat16 widened, exactly
    const uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

struct BF16 {
    typedef uint16_t T;
    static inline v16f load(const uint16_t* p) {
        v16h h;
        memcpy(&h, p, sizeof h);
        v16u w = __builtin_convertvector(h, v16u) << 16;
        v16f r;
        memcpy(&r, &w, sizeof r);
        return r;
    }
    static inline void store(uint16_t* p, v16f x) {  // round to nearest even; a NaN stays a NaN
#if LM_AVX2_PATHS
        const Halves h = halves(x);  // the high halves of both, packed in order
        const __m256i lo = _mm256_srli_epi32(nan_or(h.lo, bf16_rounding8(h.lo)), 16);
        const __m256i hi = _mm256_srli_epi32(nan_or(h.hi, bf16_rounding8(h.hi)), 16);
        const __m256i packed = _mm256_packus_epi32(lo, hi);
        _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xD8));
#else
        v16u w;
        memcpy(&w, &x, sizeof w);
        v16u rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
        v16u quiet = (w >> 16) | 0x40u;
        v16u r = (x != x) ? quiet : rounded;
        v16h h = __builtin_convertvector(r, v16h);
        memcpy(p, &h, sizeof h);
#endif
    }
};

// x rounded to the nearest bfloat16 (even on ties) and widened back: what storing an
// intermediate result in a bfloat16 tensor does between two torch ops.
static inline v16f round_bf16(v16f x) {
#if LM_AVX2_PATHS
    const Halves h = halves(x);
    const __m256i top = _mm256_set1_epi32(-65536);  // the high 16 bits
    return joined16(_mm256_castsi256_ps(nan_or(h.lo, _mm256_and_si256(bf16_rounding8(h.lo), top))),
                    _mm256_castsi256_ps(nan_or(h.hi, _mm256_and_si256(bf16_rounding8(h.hi), top))));
#else
    v16u w;
    memcpy(&w, &x, sizeof w);
    v16u r = ((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16) << 16;
    r = (x != x) ? (w | 0x400000u) : r;
    v16f out;
    memcpy(&out, &r, sizeof out);
    return out;
#endif
}

static inline float total(v16f a) {  // the lanes of one vector, by a fixed tree
    v16f b = a + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    b = b + __builtin_shufflevector(b, b, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return b[0] + b[1];
}

// e^x (Cephes' single-precision polynomial after reduction by ln 2), lane by lane, for x in
// [-87, 88] (clamped there: below, a tiny positive value; above, ~1.6e38). HIGH false: for callers
// whose x is never above 0 (or NaN), the clamp from above left out, the same bits.
template <bool HIGH = true>
static inline v16f exp_clamped(v16f x) {
#if LM_AVX2_PATHS
    const Halves h = halves(x);
    return joined16(exp_clamped8<HIGH>(h.lo), exp_clamped8<HIGH>(h.hi));
#else
    const v16f lo = v16f{} - 87.0f, hi = v16f{} + 88.0f;
    x = (x < lo) ? lo : x;
    if (HIGH) x = (x > hi) ? hi : x;
    const v16f magic = v16f{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    v16f n = (x * 1.44269504088896341f + magic) - magic;
    v16f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16f p = v16f{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v16f y = p * (r * r) + r + 1.0f;
#ifdef __AVX512F__
    // y * 2^n by vscalefps: one instruction where building 2^n's bits takes a convert, an add, a shift
    // and a multiply; the same bits for every non-NaN float32 x (checked exhaustively, 2026-12-03)
    return (v16f)_mm512_scalef_ps((__m512)y, (__m512)n);
#else
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
#endif
#endif
}


// s[0 .. n) -> e^(s[j] - max) in place, zeros on to the next multiple of 16 (s has room for them);
// returns 1 / their sum, taken over blocks of 16 from index 0 and then by one fixed lane tree, so
// the result depends only on s[0 .. n).
static inline float softmax_numerators(float* s, int n) {
    const int blocks = (n + 15) / 16;
    for (int j = n; j < blocks * 16; ++j) s[j] = s[0];  // past the last: no effect on the maximum
#if LM_AVX2_PATHS
    __m256 m0 = _mm256_loadu_ps(s), m1 = _mm256_loadu_ps(s + 8);
    for (int b = 1; b < blocks; ++b) {  // m = x > m ? x : m
        const __m256 x0 = _mm256_loadu_ps(s + b * 16), x1 = _mm256_loadu_ps(s + b * 16 + 8);
        m0 = _mm256_blendv_ps(m0, x0, _mm256_cmp_ps(x0, m0, _CMP_GT_OQ));
        m1 = _mm256_blendv_ps(m1, x1, _mm256_cmp_ps(x1, m1, _CMP_GT_OQ));
    }
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, m0);
    _mm256_store_ps(lanes + 8, m1);
    float mx = lanes[0];
    for (int l = 1; l < 16; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
    const __m256 top = _mm256_set1_ps(mx);
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b) {
        __m256 p0 = exp_clamped8(_mm256_sub_ps(_mm256_loadu_ps(s + b * 16), top));
        __m256 p1 = exp_clamped8(_mm256_sub_ps(_mm256_loadu_ps(s + b * 16 + 8), top));
        const int valid = n - b * 16;  // lanes from here on are zeroed (the last block only)
        if (valid < 16) {
            const __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            p0 = _mm256_and_ps(p0, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), at)));
            p1 = _mm256_and_ps(p1, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - 8), at)));
        }
        _mm256_storeu_ps(s + b * 16, p0);
        _mm256_storeu_ps(s + b * 16 + 8, p1);
        sum0 = _mm256_add_ps(sum0, p0);
        sum1 = _mm256_add_ps(sum1, p1);
    }
    _mm256_store_ps(lanes, _mm256_add_ps(sum0, sum1));  // total()'s tree: lanes l + l+8, + l+4, + l+2, + l+1
    const float c0 = lanes[0] + lanes[4], c1 = lanes[1] + lanes[5], c2 = lanes[2] + lanes[6], c3 = lanes[3] + lanes[7];
    return 1.0f / ((c0 + c2) + (c1 + c3));
#else
    v16f m;
    memcpy(&m, s, sizeof m);
    for (int b = 1; b < blocks; ++b) {
        v16f x;
        memcpy(&x, s + b * 16, sizeof x);
        m = x > m ? x : m;
    }
    float mx = m[0];
    for (int l = 1; l < 16; ++l) mx = m[l] > mx ? m[l] : mx;
    v16f sum = v16f{};
    for (int b = 0; b < blocks; ++b) {
        v16f x;
        memcpy(&x, s + b * 16, sizeof x);
        v16f p = exp_clamped(x - mx);
        for (int l = n - b * 16; l < 16; ++l) p[l] = 0.0f;  // a no-op but in the last block
        memcpy(s + b * 16, &p, sizeof p);
        sum = sum + p;
    }
    return 1.0f / total(sum);
#endif
}

// body(r) for r in [0, rows), split over `threads` OpenMP threads once the rows hold enough work to
// pay for waking them (each row's result never depends on how the rows were split). From 16K
// elements: a layer's norms, RoPE and SwiGLU at 24 rows 1.68 -> 1.35 ms over 30 layers, 32 rows 2.21 ->
// 1.33, 64 rows 3.28 -> 2.32 against 64K (the AMX Xeon VM, 2 threads, alternating, 2026-12-03); 8K
// gained nothing more, and 8 or 512 rows do not move.
template <class Body>
static void for_rows(int rows, int64_t work_per_row, int threads, Body body) {
    const bool parallel = threads > 1 && rows > 1 && rows * work_per_row >= (1 << 14);
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int r = 0; r < rows; ++r) body(r);
}

// The int8 KV cache (kv_cache.py): one position's K or V of one head is d int8 codes and one
// float32 scale, scale = max|x| / 127 and code = x / scale rounded to nearest even, clamped to
// [-127, 127] (all codes 0 when the row is all zeros). A row's codes depend on that row alone, so
// the cache stays batch-invariant; KVCache.write computes the same steps with torch, bitwise.
// A layer's scales are [slots, max_len, 2, Hkv] (a position's K then V scales of every head): the
// kernels take the K and V scale pointers of a layer (V = K + Hkv) and step 2 * Hkv per position.
struct I8 {  // a cache row's codes widened to float32 (exactly: |code| <= 127)
    typedef int8_t T;
    static inline v16f load(const int8_t* p) {
#if defined(__AVX512F__)
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else  // two AVX2 halves
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
        struct { __m256 a, b; } f = {lo, hi};
#endif
        v16f r;
        memcpy(&r, &f, sizeof r);
        return r;
    }
};

static inline void quantize_kv_row(const uint16_t* x, int d, int8_t* codes, float* scale) {
    float amax = 0.0f;
    for (int i = 0; i < d; ++i) {
        float f = bf16_to_f32(x[i]);
        f = f < 0.0f ? -f : f;
        amax = f > amax ? f : amax;
    }
    const float s = amax / 127.0f;
    *scale = s;
    for (int i = 0; i < d; ++i) {
        const float f = bf16_to_f32(x[i]);
        float r = s > 0.0f ? __builtin_rintf(f / s) : 0.0f;
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        codes[i] = (int8_t)r;
    }
}

// n (<= 16) float32 scales p[0], p[stride], ... into a vector, zeros past them
static inline v16f load_scales(const float* p, int n, int stride) {
    v16f r = v16f{};
    for (int l = 0; l < n && l < 16; ++l) r[l] = p[(size_t)l * stride];
    return r;
}
