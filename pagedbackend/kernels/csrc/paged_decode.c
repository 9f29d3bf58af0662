/* Decode attention over the paged KV cache: one float32 query token per
 * sequence against every key it has, read in place through its block table
 * (no gather into a padded copy). The cache holds float32, bfloat16, int8 or
 * fp8 rows (kind KV_F32, KV_BF16, KV_I8, KV_E4M3, KV_E5M2; kernels/kv_cache_dtype.py;
 * an fp8 byte is widened exactly, by bit moves, through float16 or a table):
 * an int8 row is dim int8 values and then a float16 scale per GROUP of them,
 * dequantised on the way (a key group's scale multiplies its part of the dot
 * product; a value group's scale its values, an exact product, once for all
 * the query rows that sum them), so the cache is read at its own width. A
 * key row is widened once per tile for all query rows of its head (int8,
 * e4m3; the cheaper kinds at each use), a value row once per run of rows.
 *
 * q [n, heads, dim]; k_cache, v_cache [blocks, block_size, kv_heads, row];
 * tables [n, max_blocks] (int32); lens [n] (keys per sequence, >= 1);
 * out [n, heads, dim]. Query head j reads KV head j / (heads / kv_heads).
 * window > 0: a sliding window, the query sees its last `window` keys only
 * (the table entries of earlier positions are never read: their blocks may
 * have gone back to the pool); 0: every key. sinks (gpt-oss's attention
 * sinks, or NULL): a logit per query head that joins its softmax with no
 * value row, taking a share of the weight.
 *
 * One work item is a sequence (or, with few sequences, one KV head of one)
 * with its query heads: their scores against all its keys, an exact softmax
 * (max, exp, sum), then the weighted sum of the value rows; each cache row is
 * read once. Items are spread over OpenMP threads (torch's libgomp, as for
 * packed_gemm.c). Compiled (not linked) with -ffast-math (kernels.native) so that expf is
 * vectorised; nothing here relies on infinities or NaNs.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* The cache's element kinds. Each function below takes one, and every call
 * is inlined; but decode_kind's parallel region is outlined into a function
 * of its own before inlining, so in there the kind is a value, tested in the
 * loops (a branch that always goes the same way), not a constant. Switching
 * on it inside the region, for loops of each kind, measured mixed (e5m2 10 %
 * faster, e4m3 8 % slower, kernel alone at 16k context). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };
#define GROUP 16   /* int8 channels per scale (dim a multiple of it) */
#define IS_FP8(kind) ((kind) == KV_E4M3 || (kind) == KV_E5M2)
/* Kinds whose key rows the score pass widens once into a float32 tile for
 * all query rows of their head (int8's scale, e4m3's re-biasing: more than a
 * shift or two), the others widened at each use. */
#define WIDEN_ONCE(kind) ((kind) == KV_I8 || (kind) == KV_E4M3)

/* Bytes of one cache row (one token, one KV head) of dim values. */
static inline __attribute__((always_inline)) size_t row_bytes(int dim, int kind) {
    return kind == KV_I8 ? (size_t)dim + (size_t)dim / GROUP * 2 : kind == KV_BF16 ? (size_t)dim * 2
           : IS_FP8(kind) ? (size_t)dim : (size_t)dim * 4;
}

/* Every byte of each fp8 format as float32 (exact): e4m3fn (bias 7, three
 * mantissa bits, 0x7F/0xFF NaN, no infinities) and e5m2 (bias 15, two
 * mantissa bits, IEEE infinities and NaNs); filled when the library loads. */
static float fp8_values[2][256];

static float fp8_widen(unsigned int code, int mantissa, int bias, int ieee) {
    unsigned int e = (code & 0x7F) >> mantissa, m = code & ((1u << mantissa) - 1);
    unsigned int top = 0x7Fu >> mantissa;
    float v;
    if (e == 0) v = ldexpf((float)m, 1 - bias - mantissa);
    else if (ieee && e == top) v = m ? NAN : INFINITY;
    else if (!ieee && e == top && m == (1u << mantissa) - 1) v = NAN;
    else v = ldexpf((float)((1u << mantissa) | m), (int)e - bias - mantissa);
    return code & 0x80 ? -v : v;
}

__attribute__((constructor)) static void fp8_tables(void) {
    for (unsigned int c = 0; c < 256; c++) {
        fp8_values[0][c] = fp8_widen(c, 3, 7, 0);
        fp8_values[1][c] = fp8_widen(c, 2, 15, 1);
    }
}

/* x as an fp8 byte: clamped to the format's largest finite magnitude, then
 * rounded to nearest even (torch's conversion after that clamp). */
static inline unsigned char fp8_narrow(float x, int kind) {
    int mantissa = kind == KV_E4M3 ? 3 : 2, bias = kind == KV_E4M3 ? 7 : 15;
    float top = kind == KV_E4M3 ? 448.f : 57344.f;
    unsigned int bits;
    memcpy(&bits, &x, sizeof bits);
    unsigned char sign = (unsigned char)((bits >> 24) & 0x80);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned char)(sign | 0x7F);   /* NaN: both formats, as torch writes it */
    float a = fabsf(x);
    if (a > top) a = top;
    if (a < ldexpf(1.f, 1 - bias))   /* subnormal range: whole steps of 2^(1-bias-mantissa) */
        return (unsigned char)(sign | (unsigned int)rintf(ldexpf(a, bias - 1 + mantissa)));
    memcpy(&bits, &a, sizeof bits);
    int drop = 23 - mantissa;
    bits = (bits + (1u << (drop - 1)) - 1u + ((bits >> drop) & 1u)) >> drop;
    return (unsigned char)(sign | (bits - ((unsigned int)(127 - bias) << mantissa)));
}

/* Element d of a cache row, as float32 (before its scale). */
static inline __attribute__((always_inline)) float scalar_at(const char *row, int d, int kind) {
    if (kind == KV_F32) return ((const float *)row)[d];
    if (kind == KV_BF16) {
        unsigned int bits = (unsigned int)((const unsigned short *)row)[d] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    if (IS_FP8(kind)) return fp8_values[kind - KV_E4M3][((const unsigned char *)row)[d]];
    return (float)((const signed char *)row)[d];
}

/* A float16's bits as float32 (exact) for the finite, non-negative values
 * an int8 row's scales hold: with F16C one vcvtph2ps; else a subnormal as
 * its mantissa times 2^-24 (no float32 subnormal on the way), a normal by
 * moving its exponent and mantissa into float32's places and re-biasing the
 * exponent (127 - 15). */
#if defined(__F16C__)
#include <immintrin.h>
#endif
static inline __attribute__((always_inline)) float half_to_float(unsigned short h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    if ((h & 0x7C00u) == 0) return (float)(h & 0x3FFu) * 0x1p-24f;
    unsigned int bits = ((unsigned int)(h & 0x7FFFu) << 13) + (112u << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* An int8 group's scale, as float16 bits: the smallest float16 s <= 65504
 * with 127 * s >= absmax (kernels/kv_cache_dtype.py's int8_scales). The
 * float16 nearest absmax / 127 is the candidate, one step short at most;
 * 127 * s is exact in float32 (11 by 7 significant bits), so the test for
 * that step does not hang on how absmax / 127 was rounded. */
static inline unsigned short int8_scale(float absmax) {
    float x = absmax / 127.f;
    x = x < 65504.f ? x : 65504.f;
    unsigned short h;
    if (x < 0x1p-14f) {   /* subnormal: whole steps of 2^-24 (1024 steps: 2^-14, the smallest normal) */
        h = (unsigned short)rintf(x * 0x1p24f);
    } else {              /* to nearest even, dropping 13 of float32's mantissa bits */
        unsigned int bits;
        memcpy(&bits, &x, sizeof bits);
        h = (unsigned short)((bits + 0xFFFu + ((bits >> 13) & 1u) - (112u << 23)) >> 13);
    }
    if (half_to_float(h) * 127.f < absmax && h < 0x7BFFu) h++;
    return h;
}

/* The scale of channel d's group in a cache row: one of the float16s after
 * an int8 row's values, else 1. */
static inline __attribute__((always_inline)) float scale_at(const char *row, int dim, int d, int kind) {
    if (kind != KV_I8) return 1.f;
    unsigned short h;
    memcpy(&h, row + dim + (size_t)(d / GROUP) * 2, sizeof h);
    return half_to_float(h);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define VECTOR_PATH 1
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vfma _mm512_fmadd_ps
#define vadd _mm512_add_ps
#define vmul _mm512_mul_ps
/* sums[j] = the sum of p[j]'s lanes, for 16 vectors: three levels of pairwise
 * shuffles and adds, about three instructions a sum instead of a reduction
 * of its own each. */
static inline __attribute__((always_inline)) vec lane_sums(vec *p) {
    vec c[8], g[4], w[2];
    for (int i = 0; i < 8; i++)   /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                             _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++)   /* per 128-bit lane: four vectors' partial sums */
        g[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)   /* 128-bit lanes added in pairs */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(g[2 * i], g[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(g[2 * i], g[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
/* LANES elements of a cache row from element d, as float32 (kind: see below). */
static inline __attribute__((always_inline)) vec vector_at(const char *row, int d, int kind) {
    if (kind == 0) return _mm512_loadu_ps((const float *)row + d);
    if (kind == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const unsigned short *)row + d))), 16));
    if (kind == KV_E5M2)   /* a float16's top byte (exact) */
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + d))), 8));
    if (kind == KV_E4M3) {   /* sign-extended, its seven bits moved to float32's exponent and mantissa
                                (bias 127 - 7 short: times 2^120; exact, subnormals too). NaN (0x7F/0xFF)
                                reads 480 here, NaN through scalar_at's table. */
        __m512i x = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))), 20);
        x = _mm512_and_si512(x, _mm512_set1_epi32((int)0x87F00000u));
        return _mm512_mul_ps(_mm512_castsi512_ps(x), _mm512_set1_ps(0x1p120f));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
}
#else
#define LANES 8
typedef __m256 vec;
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vfma _mm256_fmadd_ps
#define vadd _mm256_add_ps
#define vmul _mm256_mul_ps
/* sums[j] = the sum of p[j]'s lanes, for 8 vectors (as above, two lanes of 128 bits). */
static inline __attribute__((always_inline)) vec lane_sums(vec *p) {
    vec c[4], g[2];
    for (int i = 0; i < 4; i++)
        c[i] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                             _mm256_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        g[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(g[0], g[1], 0x20), _mm256_permute2f128_ps(g[0], g[1], 0x31));
}
static inline __attribute__((always_inline)) vec vector_at(const char *row, int d, int kind) {
    if (kind == 0) return _mm256_loadu_ps((const float *)row + d);
    if (kind == 1)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const unsigned short *)row + d))), 16));
    if (IS_FP8(kind))
        return _mm256_i32gather_ps(fp8_values[kind - KV_E4M3],
                                   _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))), 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))));
}
#endif
/* Accumulators the value pass keeps in registers: rows x (dim / LANES), half
 * the vector registers (32 with AVX-512, 16 with AVX2). */
#if defined(__AVX512F__)
#define ACCUMULATORS 16
#else
#define ACCUMULATORS 8
#endif

/* Rows are fetched into the cache (prefetch) one tile or chunk of keys ahead:
 * a row sits in a block anywhere in the pool, and without it each pass waits
 * on memory at every row it loads. Each pass fetches the next tile's rows a
 * head at a time, beside its work on that head, not all at once: a burst of
 * a whole tile's lines fills the core's queue of misses and stalls it. Every
 * line of [p, p + bytes) (rows need not start on a line). */
#define PREFETCH_LINES(p, bytes, locality) do { \
        const char *line_ = (const char *)((size_t)(p) & ~(size_t)63), *end_ = (p) + (bytes); \
        for (; line_ < end_; line_ += 64) __builtin_prefetch(line_, 0, locality); \
    } while (0)
static inline __attribute__((always_inline)) void prefetch_bytes(const char *p, size_t bytes) {
    PREFETCH_LINES(p, bytes, 3);
}

/* Key rows also go to L2 FAR_TILES tiles ahead, a tile's rows of the item's
 * heads at once, for the kinds whose pass waits on memory rather than on its
 * arithmetic: float32 (read in place) and bfloat16. The fp8 and int8 passes,
 * busy widening, gain nothing from it (0.96-1.04x). On a 2-core AMD Zen 4,
 * 4 sequences of 4,096 and 16,384 keys, SmolLM2's heads, interleaved with
 * the kernel before (`bench kv_cache_dtype --parts kernel --against`): float32
 * 1.13-1.25x, bfloat16 1.12-1.24x. Items of fewer than FAR_MIN_KEYS keys,
 * whose rows the caches often still hold, skip it (256 keys: 0.93x with it). */
#define FAR_TILES 3
#define FAR_MIN_KEYS 2048
#define FAR_FETCH(kind) ((kind) == KV_F32 || (kind) == KV_BF16)
static inline __attribute__((always_inline)) void prefetch_l2(const char *p, size_t bytes) {
    PREFETCH_LINES(p, bytes, 2);
}

/* LANES values of a cache row from element d as float32, its group's
 * scale applied (int8: exact, an int8 times a float16 fits float32's
 * mantissa). */
static inline __attribute__((always_inline)) vec scaled_at(const char *row, int dim, int d, int kind) {
    vec x = vector_at(row, d, kind);
    return kind == KV_I8 ? vmul(x, vset1(scale_at(row, dim, d, kind))) : x;
}

/* Keys a value pass takes at a time: up to a block's end, at most this many,
 * so that the chunk's rows of all the item's heads stay in L1 while each
 * head's runs of query rows read them. */
#define CHUNK_KEYS 16

/* Query rows [r0, r0 + R) of KV head h (R a constant, R * dim / LANES <=
 * ACCUMULATORS, all rows of one head), keys of one chunk: slots slot0.. of
 * positions t0..t1-1: acc (in out) += p_r[t] v_t, each value vector widened
 * once for the R rows. */
static inline __attribute__((always_inline)) void weigh_chunk(
        const char *v_cache, float *out, size_t slot0, int t0, int t1, int kv_heads, int dim, int h,
        int r0, int R, const float *scores, int len, int first, const char *next, int next_keys, int kind) {
    vec acc[ACCUMULATORS];
    int chunks = dim / LANES;
    size_t rb = row_bytes(dim, kind);
    if (R * chunks > ACCUMULATORS) __builtin_unreachable();   /* the caller's runs fit */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int c = 0; c < chunks; c++) acc[r * chunks + c] = vload(out + (size_t)(r0 + r) * dim + c * LANES);
    const float *w = scores + (size_t)r0 * len + t0 - first;
    for (int t = t0; t < t1; t++, w++) {
        const char *v = v_cache + ((slot0 + (size_t)(t - t0)) * kv_heads + h) * rb;
        if (t - t0 < next_keys) prefetch_bytes(next + (size_t)(t - t0) * kv_heads * rb, rb);
#pragma GCC unroll 16
        for (int c = 0; c < chunks; c++) {
            vec x = scaled_at(v, dim, c * LANES, kind);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r * chunks + c] = vfma(vset1(w[(size_t)r * len]), x, acc[r * chunks + c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int c = 0; c < chunks; c++) vstore(out + (size_t)(r0 + r) * dim + c * LANES, acc[r * chunks + c]);
}

/* o_r = norms[r] * sum_t p_r[t] v_t for the item's rows (KV heads h0..h1-1):
 * keys a chunk at a time (within one block, so its rows lie together), and
 * in each chunk every head's rows in runs of as many as the accumulators
 * hold, so that each value row is read from memory once and widened once
 * per run. */
static inline __attribute__((always_inline)) void weigh_values(
        const char *v_cache, float *out, const int *table, int first, int end, int group,
        int kv_heads, int dim, int block_size, int h0, int h1, const float *scores,
        const float *norms, int len, int kind) {
    size_t rb = row_bytes(dim, kind);
    int rows = (h1 - h0) * group;
    int per = ACCUMULATORS / (dim / LANES);
    per = per > 4 ? 4 : per;
    memset(out, 0, sizeof(float) * (size_t)rows * dim);
    for (int t0 = first; t0 < end;) {
        int t1 = (t0 / block_size + 1) * block_size;
        t1 = t1 > end ? end : t1;
        t1 = t1 - t0 > CHUNK_KEYS ? t0 + CHUNK_KEYS : t1;
        size_t slot0 = (size_t)table[t0 / block_size] * block_size + t0 % block_size;
        int next_keys = 0;   /* the next chunk's rows, fetched a head at a time by the runs of its first rows */
        size_t next = 0;
        if (t1 < end) {
            int n1 = (t1 / block_size + 1) * block_size;
            n1 = n1 > end ? end : n1;
            next_keys = n1 - t1 > CHUNK_KEYS ? CHUNK_KEYS : n1 - t1;
            next = (size_t)table[t1 / block_size] * block_size + t1 % block_size;
        }
        for (int h = h0; h < h1; h++)
            for (int r0 = (h - h0) * group; r0 < (h - h0 + 1) * group;) {
                int run = (h - h0 + 1) * group - r0 < per ? (h - h0 + 1) * group - r0 : per;
#define WEIGH(R) weigh_chunk(v_cache, out, slot0, t0, t1, kv_heads, dim, h, r0, R, scores, len, first, \
                                 v_cache + (next * kv_heads + h) * rb, r0 == (h - h0) * group ? next_keys : 0, kind)
                switch (run) {
                case 4: WEIGH(4); break;
                case 3: WEIGH(3); break;
                case 2: WEIGH(2); break;
                default: WEIGH(1);
                }
#undef WEIGH
                r0 += run;
            }
        t0 = t1;
    }
    for (int r = 0; r < rows; r++) {
        vec norm = vset1(norms[r]);
        for (int c = 0; c < dim / LANES; c++)
            vstore(out + (size_t)r * dim + c * LANES, vmul(vload(out + (size_t)r * dim + c * LANES), norm));
    }
}
#endif

#ifdef VECTOR_PATH
/* rows[j] = the cache row (all heads; stride bytes a slot) of position
 * pos + j for the LANES positions from pos, those from `end` on repeating the
 * first; (*b, *o) the block and offset of pos, advanced past the last one
 * looked up (no division a key). */
static inline __attribute__((always_inline)) void tile_rows(const char **rows, const char *cache, const int *table,
                                                            int *b, int *o, int pos, int end, int block_size,
                                                            size_t stride) {
    for (int j = 0; j < LANES; j++) {
        if (pos + j >= end) {
            rows[j] = j ? rows[0] : cache;
            continue;
        }
        rows[j] = cache + ((size_t)table[*b] * block_size + *o) * stride;
        if (++*o == block_size) {
            *o = 0;
            ++*b;
        }
    }
}

#endif

/* Query heads [h0 * group, h1 * group) of one sequence against its keys
 * (KV heads h0..h1-1): every cache row of a position is read once, whole.
 * Inlined into each call site, so a constant head size (see paged_decode)
 * gives loops of known length over whole vectors, and a constant kind loops
 * for that cache format. With AVX-512 or AVX2, a constant head size
 * (vector_dim) a multiple of the vector's, the scores come LANES keys at a
 * time (one row of partial sums per key, added across lanes for all of them
 * at once) and the weighted sum of values is held in registers. */
static inline __attribute__((always_inline)) void item(const float *q, const char *k_cache, const char *v_cache, float *out,
                 const int *table, int end, int first, int group, int kv_heads, int dim, int block_size,
                 float scale, int h0, int h1, const float *sinks, float *scores, int vector_dim, int kind) {
    int rows = (h1 - h0) * group;   /* query heads of this item */
    int len = end - first;          /* keys it sees: positions first..end-1 */
    float *norms = scores + (size_t)rows * len;   /* 1 / each row's softmax total */
    size_t rb = row_bytes(dim, kind);
    table += first / block_size;    /* positions from the block that holds `first` on */
    first %= block_size;
    end = first + len;
#ifdef VECTOR_PATH
    int vectorised = vector_dim && dim % LANES == 0 && dim >= LANES && dim / LANES <= ACCUMULATORS;
#else
    int vectorised = 0;
    (void)vector_dim;
#endif
    /* scores[r * len + t - first] = scale * q_r . k_t(head of r) */
    if (!vectorised) {
        for (int t = first; t < end; t++) {
            size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
            for (int r = 0; r < rows; r++) {
                const char *k = k_cache + (slot * kv_heads + h0 + r / group) * rb;
                const float *qr = q + (size_t)r * dim;
                float dot = 0.f;
                for (int g = 0; g < dim; g += (kind == KV_I8 ? GROUP : dim)) {
                    float part = 0.f;
                    int end_g = kind == KV_I8 ? g + GROUP : dim;
#pragma omp simd reduction(+:part)
                    for (int d = g; d < end_g; d++) part += qr[d] * scalar_at(k, d, kind);
                    dot += part * scale_at(k, dim, g, kind);
                }
                scores[(size_t)r * len + t - first] = dot * scale;
            }
        }
    }
#ifdef VECTOR_PATH
    else {
        int chunks = dim / LANES;
        /* LANES rows of dim <= 256, widened; an int8 row's scales beside (applied to
           each group's partial sum, as the rows are read in place) */
        float tile[LANES * 256] __attribute__((aligned(64))), tile_scales[LANES * 256 / GROUP];
        /* rows of the tile in hand and of the next one (fetched meanwhile); (tb, to):
           the block and offset of the next position to look up */
        const char *keys[LANES], *ahead[LANES], *far[LANES];
        int tb = first / block_size, to = first % block_size;
        /* (fb, fo): the block and offset of the next position fetched FAR_TILES ahead */
        int fb = (first + FAR_TILES * LANES) / block_size, fo = (first + FAR_TILES * LANES) % block_size;
        tile_rows(keys, k_cache, table, &tb, &to, first, end, block_size, (size_t)kv_heads * rb);
        for (int t0 = first; t0 < end; t0 += LANES) {
            int count = end - t0 < LANES ? end - t0 : LANES;
            if (t0 + LANES < end) {   /* the next tile's rows of this item's heads */
                tile_rows(ahead, k_cache, table, &tb, &to, t0 + LANES, end, block_size, (size_t)kv_heads * rb);
            }
            int tf = t0 + FAR_TILES * LANES;
            if (FAR_FETCH(kind) && len >= FAR_MIN_KEYS && tf < end) {
                tile_rows(far, k_cache, table, &fb, &fo, tf, end, block_size, (size_t)kv_heads * rb);
                for (int j = 0; j < LANES && tf + j < end; j++) prefetch_l2(far[j] + (size_t)h0 * rb, (size_t)(h1 - h0) * rb);
            }
            for (int h = h0; h < h1; h++) {
                if (t0 + LANES < end)   /* the next tile's rows of this head, a head at a time */
                    for (int j = 0; j < LANES && t0 + LANES + j < end; j++) prefetch_bytes(ahead[j] + (size_t)h * rb, rb);
                /* the tile's rows of head h as float32, widened (and scaled) once for the
                   head's `group` query rows; a float32 cache is read in place */
                const float *kp[LANES];
                for (int j = 0; j < LANES; j++) {
                    const char *k = keys[j] + (size_t)h * rb;
                    if (!WIDEN_ONCE(kind)) {
                        kp[j] = (const float *)k;   /* read in place (a float32 cache) or widened per use */
                    } else {
#pragma GCC unroll 16
                        for (int c = 0; c < chunks; c++) vstore(tile + j * dim + c * LANES, vector_at(k, c * LANES, kind));
                        if (kind == KV_I8)
                            for (int g = 0; g < dim / GROUP; g++) tile_scales[j * (dim / GROUP) + g] = scale_at(k, dim, g * GROUP, kind);
                        kp[j] = tile + j * dim;
                    }
                }
                for (int r = (h - h0) * group; r < (h - h0 + 1) * group; r++) {
                    const float *qr = q + (size_t)r * dim;
                    vec part[LANES];
#pragma GCC unroll 16
                    for (int j = 0; j < LANES; j++) {
                        vec a = vzero();
                        if (kind == KV_I8) {   /* each group's partial sum times its scale */
#pragma GCC unroll 16
                            for (int g = 0; g < dim; g += GROUP) {
                                vec ag = vzero();
                                for (int c = g / LANES; c < (g + GROUP) / LANES; c++)
                                    ag = vfma(vload(qr + c * LANES), vload(kp[j] + c * LANES), ag);
                                a = vfma(ag, vset1(tile_scales[j * (dim / GROUP) + g / GROUP]), a);
                            }
                        } else {
#pragma GCC unroll 16
                            for (int c = 0; c < chunks; c++)
                                a = vfma(vload(qr + c * LANES), WIDEN_ONCE(kind) ? vload(kp[j] + c * LANES)
                                         : vector_at((const char *)kp[j], c * LANES, kind), a);
                        }
                        part[j] = a;
                    }
                    float sums[LANES];
                    vstore(sums, lane_sums(part));
                    for (int j = 0; j < count; j++) scores[(size_t)r * len + t0 + j - first] = sums[j] * scale;
                }
            }
            memcpy(keys, ahead, sizeof keys);
        }
    }
#endif
    for (int r = 0; r < rows; r++) {
        float *s = scores + (size_t)r * len;
        float top = s[0];
        for (int t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        if (sinks && sinks[r] > top) top = sinks[r];
        /* A sink is one more logit in the softmax, with no value row. */
        float total = sinks ? expf(sinks[r] - top) : 0.f;
#pragma omp simd reduction(+:total)
        for (int t = 0; t < len; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        float inv = 1.f / total;
        if (vectorised)
            norms[r] = inv;   /* applied to the weighted sum instead */
        else
            for (int t = 0; t < len; t++) s[t] *= inv;
    }
#ifdef VECTOR_PATH
    if (vectorised) {
        weigh_values(v_cache, out, table, first, end, group, kv_heads, dim, block_size, h0, h1, scores, norms,
                     len, kind);
        return;
    }
#endif
    for (int r = 0; r < rows; r++) {
        float *o = out + (size_t)r * dim;
        for (int d = 0; d < dim; d++) o[d] = 0.f;
    }
    for (int t = first; t < end; t++) {
        size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
        for (int r = 0; r < rows; r++) {
            const char *v = v_cache + (slot * kv_heads + h0 + r / group) * rb;
            float p = scores[(size_t)r * len + t - first];
            float *o = out + (size_t)r * dim;
            for (int g = 0; g < dim; g += (kind == KV_I8 ? GROUP : dim)) {
                float pg = p * scale_at(v, dim, g, kind);
                int end_g = kind == KV_I8 ? g + GROUP : dim;
#pragma omp simd
                for (int d = g; d < end_g; d++) o[d] += pg * scalar_at(v, d, kind);
            }
        }
    }
}

/* The decode attention of a cache of `kind` (inlined into each entry point
 * below with its constant kind). */
static inline __attribute__((always_inline)) int decode_kind(
        const float *q, const char *k_cache, const char *v_cache, float *out, const int *tables,
        int max_blocks, const int *lens, int n, int heads, int kv_heads, int dim, int block_size,
        float scale, int window, const float *sinks, int threads, int kind) {
    int group = heads / kv_heads, longest = 0, failed = 0;
    for (int s = 0; s < n; s++) longest = lens[s] > longest ? lens[s] : longest;
    if (window > 0 && longest > window) longest = window;
    if (threads < 1) threads = 1;
    /* A whole sequence per item when there are enough of them to keep every
     * thread busy, else one KV head per item. */
    int per_item = n >= 2 * threads ? kv_heads : 1;
    int items = n * (kv_heads / per_item);
    if (threads > items) threads = items;
#pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)per_item * group * ((longest > 0 ? longest : 1) + 1));
        if (!scores) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < items; i++) {
                int s = i / (kv_heads / per_item), h0 = i % (kv_heads / per_item) * per_item;
                size_t row = (size_t)s * heads + (size_t)h0 * group;
                int first = window > 0 && lens[s] > window ? lens[s] - window : 0;
#define ITEM(d, vector) item(q + row * (d), k_cache, v_cache, out + row * (d), tables + (size_t)s * max_blocks, \
                     lens[s], first, group, kv_heads, d, block_size, scale, h0, h0 + per_item, \
                     sinks ? sinks + (size_t)h0 * group : NULL, scores, vector, kind)
                switch (dim) {   /* the usual head sizes, specialised (and vectorised by hand) */
                case 32: ITEM(32, 1); break;
                case 64: ITEM(64, 1); break;
                case 128: ITEM(128, 1); break;
                case 256: ITEM(256, 1); break;
                default: ITEM(dim, 0);
                }
#undef ITEM
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}

/* Returns 0, or -1 when scratch memory could not be allocated. sinks: one
 * logit per query head (attention sinks), or NULL. A float32 cache. */
int paged_decode(const float *q, const float *k_cache, const float *v_cache, float *out,
                 const int *tables, int max_blocks, const int *lens, int n, int heads,
                 int kv_heads, int dim, int block_size, float scale, int window, const float *sinks,
                 int threads) {
    return decode_kind(q, (const char *)k_cache, (const char *)v_cache, out, tables, max_blocks, lens, n,
                       heads, kv_heads, dim, block_size, scale, window, sinks, threads, KV_F32);
}

/* paged_decode for a cache of `kind` (KV_F32, KV_BF16, KV_I8, KV_E4M3 or KV_E5M2); -2 for another kind. */
int paged_decode_kv(const float *q, const void *k_cache, const void *v_cache, float *out,
                    const int *tables, int max_blocks, const int *lens, int n, int heads,
                    int kv_heads, int dim, int block_size, float scale, int window, const float *sinks,
                    int threads, int kind) {
    if (kind == KV_I8 && dim % GROUP) return -2;
#define DECODE(K) decode_kind(q, k_cache, v_cache, out, tables, max_blocks, lens, n, heads, kv_heads, dim, \
                              block_size, scale, window, sinks, threads, K)
    switch (kind) {
    case KV_F32: return DECODE(KV_F32);
    case KV_BF16: return DECODE(KV_BF16);
    case KV_I8: return DECODE(KV_I8);
    case KV_E4M3: return DECODE(KV_E4M3);
    case KV_E5M2: return DECODE(KV_E5M2);
    default: return -2;
    }
#undef DECODE
}

/* Store the step's keys and values, rows of `row` floats, at their cache
 * slots (k_cache, v_cache [slots, row]). Token t's row starts at
 * key + t * key_stride (value + t * value_stride): the step's V is a slice of
 * the fused QKV projection's output, whose rows lie apart. Returns 0, or -1
 * without writing anything when a slot lies outside 0..num_slots-1 (the
 * caller reports it). */
int paged_write(const float *key, const float *value, float *k_cache, float *v_cache,
                const long long *slots, int tokens, int row, long long num_slots,
                long long key_stride, long long value_stride) {
    for (int t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int t = 0; t < tokens; t++) {
        memcpy(k_cache + slots[t] * row, key + t * key_stride, sizeof(float) * (size_t)row);
        memcpy(v_cache + slots[t] * row, value + t * value_stride, sizeof(float) * (size_t)row);
    }
    return 0;
}

/* One head's dim floats as a cache row of `kind`: copied, rounded to
 * bfloat16 (to nearest even, as torch), or quantised to int8 with an absmax
 * scale per GROUP after the values (kernels/kv_cache_dtype.py's rule: the
 * float16 at or above absmax / 127, at most 65504). */
static void encode_row(const float *x, char *row, int dim, int kind) {
    if (kind == KV_F32) {
        memcpy(row, x, sizeof(float) * (size_t)dim);
    } else if (kind == KV_BF16) {
        unsigned short *o = (unsigned short *)row;
        for (int d = 0; d < dim; d++) {
            unsigned int bits;
            memcpy(&bits, x + d, sizeof bits);
            o[d] = (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
        }
    } else if (IS_FP8(kind)) {
        for (int d = 0; d < dim; d++) ((unsigned char *)row)[d] = fp8_narrow(x[d], kind);
    } else {
        for (int g = 0; g < dim; g += GROUP) {
            float absmax = 0.f;
            for (int d = g; d < g + GROUP; d++) absmax = fabsf(x[d]) > absmax ? fabsf(x[d]) : absmax;
            unsigned short h = int8_scale(absmax);
            float s = half_to_float(h), inv = s > 0.f ? 1.f / s : 0.f;
            for (int d = g; d < g + GROUP; d++) {
                float v = x[d] * inv;
                v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;   /* before rounding: a saturated group */
                row[d] = (signed char)rintf(v);
            }
            memcpy(row + dim + (size_t)(g / GROUP) * 2, &h, sizeof h);
        }
    }
}

/* paged_write for a cache of `kind`: kv_heads rows of dim floats per token,
 * each encoded as one cache row. Returns 0, -1 (a slot out of range; nothing
 * written) or -2 (another kind). */
int paged_write_kv(const float *key, const float *value, void *k_cache, void *v_cache,
                   const long long *slots, int tokens, int kv_heads, int dim, long long num_slots,
                   long long key_stride, long long value_stride, int kind) {
    if (kind < KV_F32 || kind > KV_E5M2 || (kind == KV_I8 && dim % GROUP)) return -2;
    for (int t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    size_t rb = row_bytes(dim, kind);
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < kv_heads; h++) {
            size_t at = ((size_t)slots[t] * kv_heads + h) * rb;
            encode_row(key + t * key_stride + (size_t)h * dim, (char *)k_cache + at, dim, kind);
            encode_row(value + t * value_stride + (size_t)h * dim, (char *)v_cache + at, dim, kind);
        }
    return 0;
}
