// Products with GGUF weights in their own blocks: y[M, N] = x[M, K] W^T, where
// each of W's N rows is a row of GGUF blocks (Q8_0, Q4_0, Q4_1: 32 values per
// block; Q4_K, Q5_K, Q6_K: 256 per super-block), read where the file maps them.
// A block is widened to float32 in registers, 32 values at a time, with the
// same float operations as the reference dequantisation (gguf-py and
// transformers): the values are those, bit for bit, and x is multiplied as
// given (float32; bfloat16 rows widen exactly before the call). Each widened
// group is multiplied into up to ROW_TILE rows of x before the next is read.
// The output rows are split over OpenMP threads (torch's pool).
//
// Where the CPU has AVX-512 (see the AVX-512 section) blocks decode straight
// into registers and several weight rows run at once; elsewhere (and when
// gguf_gemm_avx512(0) asks for it) the portable loop rows_tile runs, built
// three times on x86-64 (AVX-512, AVX2 with FMA, and baseline SSE2) for the
// CPU to pick one when the library loads (target_clones). Built with
// -ffp-contract=off (native.EXTRA_FLAGS): no product of the dequantisation
// fuses with its add or subtract.
#include <stdint.h>
#include <string.h>
#include <omp.h>

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
#define ROW_TILE 8
#define GROUP 32

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(NO_RUNTIME_DISPATCH)
#define DISPATCH __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DISPATCH
#endif

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {   // subnormal: normalise
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Block sizes: (values, bytes).
static int block_values(int type) { return type >= T_Q4_K ? 256 : 32; }
static int block_bytes(int type) {
    switch (type) {
        case T_Q4_0: return 18;
        case T_Q4_1: return 20;
        case T_Q8_0: return 34;
        case T_Q4_K: return 144;
        case T_Q5_K: return 176;
        case T_Q6_K: return 210;
        default: return 0;
    }
}

static inline void scale_min_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The 32 values of group g (0..7 in a super-block; 0 for 32-value blocks) of block b.
static inline void widen(int type, const uint8_t *b, int g, float *restrict w) {
    switch (type) {
        case T_Q8_0: {
            const float d = half_to_float(b);
            const int8_t *q = (const int8_t *)(b + 2);
            for (int i = 0; i < 32; i++) w[i] = (float)q[i] * d;
            break;
        }
        case T_Q4_0: {
            const float d = half_to_float(b);
            const uint8_t *q = b + 2;
            for (int i = 0; i < 16; i++) {
                w[i] = d * (float)((int)(q[i] & 0xF) - 8);
                w[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
            }
            break;
        }
        case T_Q4_1: {
            const float d = half_to_float(b), m = half_to_float(b + 2);
            const uint8_t *q = b + 4;
            for (int i = 0; i < 16; i++) {
                w[i] = d * (float)(q[i] & 0xF) + m;
                w[i + 16] = d * (float)(q[i] >> 4) + m;
            }
            break;
        }
        case T_Q4_K:
        case T_Q5_K: {
            uint8_t sc, mn;
            scale_min_k4(b + 4, g, &sc, &mn);
            const float ds = half_to_float(b) * (float)sc, dm = half_to_float(b + 2) * (float)mn;
            const int shift = 4 * (g & 1);
            if (type == T_Q4_K) {
                const uint8_t *q = b + 16 + 32 * (g >> 1);
                for (int i = 0; i < 32; i++) w[i] = ds * (float)((q[i] >> shift) & 0xF) - dm;
            } else {
                const uint8_t *qh = b + 16, *q = b + 48 + 32 * (g >> 1);
                for (int i = 0; i < 32; i++)
                    w[i] = ds * (float)(((q[i] >> shift) & 0xF) | (((qh[i] >> g) & 1) << 4)) - dm;
            }
            break;
        }
        case T_Q6_K: {
            const float d = half_to_float(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            const int h = g >> 2, k = g & 3;   // half of 128 values, quarter of it
            const uint8_t *ql = b + 64 * h + 32 * (k & 1), *qh = b + 128 + 32 * h;
            const int lshift = 4 * (k >> 1), hshift = 2 * k;
            const float s0 = d * (float)sc[2 * g], s1 = d * (float)sc[2 * g + 1];
            for (int i = 0; i < 32; i++) {
                int q = (((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4)) - 32;
                w[i] = (i < 16 ? s0 : s1) * (float)q;
            }
            break;
        }
    }
}

// y[m0 .. m0 + rows, n0 .. n1) for output rows n0..n1 of one part (rows <= ROW_TILE):
// W row n is part row map[n] (map NULL: n), and lands in y's column y0 + n.
DISPATCH
static void rows_tile(int type, const float *x, int64_t K, const uint8_t *w, const int64_t *map,
                      float *y, int64_t ldy, int64_t y0, int64_t m0, int rows, int64_t n0, int64_t n1) {
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    const int64_t blocks = K / bv, row_bytes = blocks * bb;
    float wv[GROUP] __attribute__((aligned(64)));
    float acc[ROW_TILE][GROUP] __attribute__((aligned(64)));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + (map ? map[n] : n) * row_bytes;
        memset(acc, 0, sizeof(acc));
        for (int64_t blk = 0; blk < blocks; blk++) {
            const uint8_t *b = row + blk * bb;
            for (int g = 0; g < groups; g++) {
                widen(type, b, g, wv);
                const int64_t col = blk * bv + g * GROUP;
                for (int r = 0; r < rows; r++) {
                    const float *xr = x + (m0 + r) * K + col;
                    for (int i = 0; i < GROUP; i++) acc[r][i] += wv[i] * xr[i];
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            float s = 0.0f;
            for (int i = 0; i < GROUP; i++) s += acc[r][i];
            y[(m0 + r) * ldy + y0 + n] = s;
        }
    }
}

// ---------------------------------------------------------------- AVX-512
// Where the CPU has AVX-512 (BW, VL) with F16C and FMA, each block is decoded
// straight into registers, 16 values to a register: Q8_0's and Q6_K's quants
// widened to int32 (vpmovsxbd) and converted, then multiplied by the block's
// scale; a 4-bit type's 16 (Q5_K: 32) possible weights of a group computed
// from the scales, then looked up by each quant (vpermps). Every weight is the
// reference's own operations (multiply, then add or subtract), each rounded
// alone (the file is built with -ffp-contract=off: none fuses into an FMA). fp16
// scales convert with F16C, which is exact (subnormals included). WR weight
// rows are decoded together and each decoded register is multiplied into up
// to R rows of x with FMAs into R x WR accumulators, summed across lanes once
// at the end. A task's weight rows are read from memory once: every tile of x
// rows runs over a group of WR rows while they are still in cache.
#if defined(__x86_64__) && defined(__GNUC__) && (!defined(NO_RUNTIME_DISPATCH) || defined(__AVX512BW__))
#define HAVE_AVX512 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define INLINE512 static inline __attribute__((always_inline)) AVX512
#define WR_MAX 4                // weight rows decoded together


INLINE512 float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// float(q) for 16 signed bytes.
INLINE512 __m512 i8_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

// A block's (super-block's) scales that its groups share: for Q4_K/Q5_K the 8
// d * sc and dmin * m of scale_min_k4; for Q6_K the 16 d * sc.
typedef struct { float s[16], m[8]; } scales_t;

INLINE512 void block_scales(const int type, const uint8_t *b, scales_t *out) {
    if (type == T_Q4_K || type == T_Q5_K) {
        uint32_t u[4];
        memcpy(u, b + 4, 12);
        // scale_min_k4 for all 8 groups: scales in bytes 0..7, mins in 8..15.
        u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
        u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[2] = mins_lo;
        u[0] &= 0x3f3f3f3fu;
        const __m128i v = _mm_loadu_si128((const __m128i *)u);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
        _mm256_storeu_ps(out->s, _mm256_mul_ps(_mm256_set1_ps(h2f(b)), sc));
        _mm256_storeu_ps(out->m, _mm256_mul_ps(_mm256_set1_ps(h2f(b + 2)), mn));
    } else if (type == T_Q6_K) {
        const __m512 sc = i8_ps(_mm_loadu_si128((const __m128i *)(b + 192)));
        _mm512_storeu_ps(out->s, _mm512_mul_ps(_mm512_set1_ps(h2f(b + 208)), sc));
    }
}

// Values 0..15 (lo) and 16..31 (hi) of group g of block b, as widen() gives them.
INLINE512 void decode(const int type, const uint8_t *b, const int g, const scales_t *sc, __m512 *lo, __m512 *hi) {
    // 0..15: a 4-bit type's 16 possible weights are computed once per group,
    // with the reference's operations, and each value looked up (vpermps reads
    // the low 4 bits of each index, so no mask is needed).
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    switch (type) {
        case T_Q8_0: {
            const __m512 d = _mm512_set1_ps(h2f(b));
            *lo = _mm512_mul_ps(i8_ps(_mm_loadu_si128((const __m128i *)(b + 2))), d);
            *hi = _mm512_mul_ps(i8_ps(_mm_loadu_si128((const __m128i *)(b + 18))), d);
            break;
        }
        case T_Q4_0: {   // d * (q - 8)
            const __m512 t = _mm512_mul_ps(_mm512_set1_ps(h2f(b)), _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
            *lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), t);
            *hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(q, 4)), t);
            break;
        }
        case T_Q4_1: {   // d * q + m
            const __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(h2f(b)), iota), _mm512_set1_ps(h2f(b + 2)));
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
            *lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), t);
            *hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(q, 4)), t);
            break;
        }
        case T_Q4_K: {   // d * sc * q - dmin * m
            const __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(sc->s[g]), iota), _mm512_set1_ps(sc->m[g]));
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (g >> 1)));
            if (g & 1) v = _mm256_srli_epi16(v, 4);
            *lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)), t);
            *hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)), t);
            break;
        }
        case T_Q5_K: {   // as Q4_K, bit g of qh is bit 4 of q: 32 values, two tables
            const __m512 ds = _mm512_set1_ps(sc->s[g]), dm = _mm512_set1_ps(sc->m[g]);
            const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(ds, iota), dm);
            const __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(ds, _mm512_add_ps(iota, _mm512_set1_ps(16.0f))), dm);
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (g >> 1)));
            v = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), bit = _mm256_set1_epi8(1 << g);
            v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                    _mm256_set1_epi8(16)));
            *lo = _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)), t1);
            *hi = _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)), t1);
            break;
        }
        case T_Q6_K: {
            const int h = g >> 2, k = g & 3;
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (k & 1)));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i l = _mm256_and_si256(k >> 1 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0f));
            // bits 2k, 2k+1 of qh as bits 4, 5
            const __m256i hb = 2 * k <= 4 ? _mm256_slli_epi16(qh, 4 - 2 * k) : _mm256_srli_epi16(qh, 2 * k - 4);
            const __m256i v = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_and_si256(hb, _mm256_set1_epi8(0x30))),
                                              _mm256_set1_epi8(32));
            *lo = _mm512_mul_ps(_mm512_set1_ps(sc->s[2 * g]), i8_ps(_mm256_castsi256_si128(v)));
            *hi = _mm512_mul_ps(_mm512_set1_ps(sc->s[2 * g + 1]), i8_ps(_mm256_extracti128_si256(v, 1)));
            break;
        }
    }
}

// out[r * WR + i] = x row r . weight row i over K, for R rows of x (stride K)
// and the WR rows wr[i] of type; next[i]: the rows the following call reads
// (prefetched one group ahead: 1.2-2x the GB/s of no prefetch at one row of x
// over weights larger than the cache, AMD Zen 4).
INLINE512 void tile512(const int type, const int WR, const int R, const uint8_t *const *wr,
                       const uint8_t *const *next, const float *x, int64_t K, float *out) {
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    __m512 acc[WR_MAX * ROW_TILE];
    for (int i = 0; i < WR * R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < K / bv; blk++) {
        const int64_t off = blk * bb;
        scales_t sc[WR_MAX];
        for (int i = 0; i < WR; i++) {
            // the next group's block at this offset: one group ahead of its decode
            for (int p = 0; p < bb; p += 64) _mm_prefetch((const char *)next[i] + off + p, _MM_HINT_T0);
            block_scales(type, wr[i] + off, &sc[i]);
        }
#pragma GCC unroll 8
        for (int g = 0; g < groups; g++) {
            __m512 lo[WR_MAX], hi[WR_MAX];
#pragma GCC unroll 4
            for (int i = 0; i < WR; i++) decode(type, wr[i] + off, g, &sc[i], &lo[i], &hi[i]);
            const float *xc = x + blk * bv + g * GROUP;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m512 x0 = _mm512_loadu_ps(xc + r * K), x1 = _mm512_loadu_ps(xc + r * K + 16);
#pragma GCC unroll 4
                for (int i = 0; i < WR; i++) {
                    acc[r * WR + i] = _mm512_fmadd_ps(lo[i], x0, acc[r * WR + i]);
                    acc[r * WR + i] = _mm512_fmadd_ps(hi[i], x1, acc[r * WR + i]);
                }
            }
        }
    }
    for (int i = 0; i < WR * R; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

// The K values of a weight row, widened (gguf_get_rows).
INLINE512 void widen512(const int type, const uint8_t *row, int64_t K, float *out) {
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    for (int64_t blk = 0; blk < K / bv; blk++) {
        scales_t sc;
        block_scales(type, row + blk * bb, &sc);
        for (int g = 0; g < groups; g++) {
            __m512 lo, hi;
            decode(type, row + blk * bb, g, &sc, &lo, &hi);
            _mm512_storeu_ps(out + blk * bv + g * GROUP, lo);
            _mm512_storeu_ps(out + blk * bv + g * GROUP + 16, hi);
        }
    }
}

// One instance per type, weight rows together and x rows (all constants, so
// the accumulators stay in registers): 4 weight rows by 1..4 x rows, 2 by 5..8.
#define TILE_R(type, WR, R) case R: tile512(type, WR, R, wr, next, x, K, out); break;
#define TILE_TYPE(type)                                                                     \
    static AVX512 void tile_##type(int rows, const uint8_t *const *wr, const uint8_t *const *next, const float *x, \
                                   int64_t K, float *out) {                                 \
        switch (rows) {                                                                     \
            TILE_R(type, 4, 1) TILE_R(type, 4, 2) TILE_R(type, 4, 3) TILE_R(type, 4, 4)     \
            TILE_R(type, 2, 5) TILE_R(type, 2, 6) TILE_R(type, 2, 7) TILE_R(type, 2, 8)     \
        }                                                                                   \
    }                                                                                       \
    static AVX512 void widen_##type(const uint8_t *row, int64_t K, float *out) { widen512(type, row, K, out); }
TILE_TYPE(T_Q8_0)
TILE_TYPE(T_Q4_0)
TILE_TYPE(T_Q4_1)
TILE_TYPE(T_Q4_K)
TILE_TYPE(T_Q5_K)
TILE_TYPE(T_Q6_K)
#define BY_TYPE(type, CALL)                                                                  \
    switch (type) {                                                                          \
        case T_Q8_0: CALL(T_Q8_0); break;                                                    \
        case T_Q4_0: CALL(T_Q4_0); break;                                                    \
        case T_Q4_1: CALL(T_Q4_1); break;                                                    \
        case T_Q4_K: CALL(T_Q4_K); break;                                                    \
        case T_Q5_K: CALL(T_Q5_K); break;                                                    \
        case T_Q6_K: CALL(T_Q6_K); break;                                                    \
    }

static void widen_row512(int type, const uint8_t *row, int64_t K, float *out) {
#define WIDEN_CALL(t) widen_##t(row, K, out)
    BY_TYPE(type, WIDEN_CALL)
}

// y[0 .. M, y0 + n0 .. y0 + n1) of one part (as rows_tile, all rows of x): 4
// weight rows at a time (the last group repeats its last row, not stored twice),
// each run over every tile of x rows.
static AVX512 void rows_avx512(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, const int64_t *map,
                               float *y, int64_t ldy, int64_t y0, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / block_values(type) * block_bytes(type);
    for (int64_t n = n0; n < n1; n += WR_MAX) {
        const uint8_t *wr[2 * WR_MAX];   // this group's rows, then the next group's (prefetched)
        for (int i = 0; i < 2 * WR_MAX; i++) {
            const int64_t row = n + i < n1 ? n + i : n1 - 1;
            wr[i] = w + (map ? map[row] : row) * row_bytes;
        }
        for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int rows = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
            const int per = rows <= 4 ? 4 : 2;   // weight rows per call: 4 for 1..4 x rows, 2 for 5..8
            for (int h = 0; h < WR_MAX; h += per) {
                float out[WR_MAX * ROW_TILE];
                const uint8_t *const *part = wr + h;
                const float *xt = x + m0 * K;
#define TILE_CALL(t) tile_##t(rows, part, part + WR_MAX, xt, K, out)
                BY_TYPE(type, TILE_CALL)
                for (int r = 0; r < rows; r++)
                    for (int i = 0; i < per && n + h + i < n1; i++)
                        y[(m0 + r) * ldy + y0 + n + h + i] = out[r * per + i];
            }
        }
    }
}

static int avx512_usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}
#else
#define HAVE_AVX512 0
static int avx512_usable(void) { return 0; }
#endif

// -1: not yet decided; then 1 where the AVX-512 path runs, 0 where rows_tile does.
static int use_avx512 = -1;

// Which path gguf_gemm_parts takes: on = 1 asks for the AVX-512 one (taken
// only where the CPU has it), 0 for the portable one, -1 leaves it; returns
// the path now taken (1: AVX-512).
int gguf_gemm_avx512(int on) {
    if (on >= 0) use_avx512 = on && avx512_usable();
    else if (use_avx512 < 0) use_avx512 = avx512_usable();
    return use_avx512;
}

// y[M, sum(rows)] = x[M, K] W^T with W the rows of parts 0..parts-1 one after
// another (part p: rows[p] rows of GGUF blocks of types[p] at w[p], read
// through maps[p] when not NULL). 0, or -1 for a type or K a part does not take.
int gguf_gemm_parts(const float *x, int64_t M, int64_t K, int parts, const uint8_t *const *w,
                    const int64_t *const *maps, const int *types, const int64_t *rows, float *y, int threads) {
    int64_t N = 0, chunks = 0;
    for (int p = 0; p < parts; p++) {
        if (!block_bytes(types[p]) || K % block_values(types[p])) return -1;
        N += rows[p];
    }
    // Output rows per task: a few tasks per thread, at least 4 rows each.
    int64_t chunk = N / ((int64_t)threads * 4);
    if (chunk < 4) chunk = 4;
    const int wide = gguf_gemm_avx512(-1);
    if (wide) chunk = (chunk + 3) / 4 * 4;   // whole groups of 4 weight rows
    for (int p = 0; p < parts; p++) chunks += (rows[p] + chunk - 1) / chunk;
    // The AVX-512 path runs every x row in one task; rows_tile ROW_TILE of them.
    const int64_t tiles = wide ? 1 : (M + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t c = 0; c < chunks; c++) {
            int p = 0;
            int64_t local = c, y0 = 0;
            while (local >= (rows[p] + chunk - 1) / chunk) {
                local -= (rows[p] + chunk - 1) / chunk;
                y0 += rows[p];
                p++;
            }
            const int64_t n0 = local * chunk, n1 = n0 + chunk < rows[p] ? n0 + chunk : rows[p];
#if HAVE_AVX512
            if (wide) {
                rows_avx512(types[p], x, M, K, w[p], maps[p], y, N, y0, n0, n1);
                continue;
            }
#endif
            const int64_t m0 = t * ROW_TILE;
            const int tile_rows = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
            rows_tile(types[p], x, K, w[p], maps[p], y, N, y0, m0, tile_rows, n0, n1);
        }
    }
    return 0;
}

// out[i, K] = the widened row ids[i] of W (an embedding lookup); 0, or -1 as above
// or for an id outside 0..N-1.
int gguf_get_rows(const uint8_t *w, const int64_t *ids, float *out, int64_t count, int64_t K, int64_t N,
                  int64_t row_bytes, int type) {
    if (!block_bytes(type) || K % block_values(type) || row_bytes != K / block_values(type) * block_bytes(type))
        return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    const int wide = gguf_gemm_avx512(-1);
    (void)wide;
    // Threads for a whole weight (a long prefill widens every row), not for a few tokens.
#pragma omp parallel for schedule(static) if (count * K >= (1 << 20))
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
#if HAVE_AVX512
        if (wide) {
            widen_row512(type, row, K, out + i * K);
            continue;
        }
#endif
        for (int64_t blk = 0; blk < K / bv; blk++)
            for (int g = 0; g < groups; g++)
                widen(type, row + blk * bb, g, out + i * K + blk * bv + g * GROUP);
    }
    return 0;
}
