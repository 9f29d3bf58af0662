/* Decode attention over the paged KV cache, float32: one query token per
 * sequence against every key it has, read in place through its block table
 * (no gather into a padded copy).
 *
 * q [n, heads, dim]; k_cache, v_cache [blocks, block_size, kv_heads, dim];
 * tables [n, max_blocks] (int32); lens [n] (keys per sequence, >= 1);
 * out [n, heads, dim]. Query head j reads KV head j / (heads / kv_heads).
 * window > 0: a sliding window, the query sees its last `window` keys only
 * (the table entries of earlier positions are never read: their blocks may
 * have gone back to the pool); 0: every key.
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

/* Query heads [h0 * group, h1 * group) of one sequence against its keys
 * (KV heads h0..h1-1): every cache row of a position is read once, whole.
 * Inlined into each call site, so a constant head size (see paged_decode)
 * gives loops of known length over whole vectors. */
static inline __attribute__((always_inline)) void item(const float *q, const float *k_cache, const float *v_cache, float *out,
                 const int *table, int end, int first, int group, int kv_heads, int dim, int block_size,
                 float scale, int h0, int h1, float *scores) {
    int rows = (h1 - h0) * group;   /* query heads of this item */
    int len = end - first;          /* keys it sees: positions first..end-1 */
    table += first / block_size;    /* positions from the block that holds `first` on */
    first %= block_size;
    end = first + len;
    /* scores[r * len + t - first] = scale * q_r . k_t(head of r) */
    for (int t = first; t < end; t++) {
        size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
        for (int r = 0; r < rows; r++) {
            const float *k = k_cache + (slot * kv_heads + h0 + r / group) * dim;
            const float *qr = q + (size_t)r * dim;
            float dot = 0.f;
#pragma omp simd reduction(+:dot)
            for (int d = 0; d < dim; d++) dot += qr[d] * k[d];
            scores[(size_t)r * len + t - first] = dot * scale;
        }
    }
    for (int r = 0; r < rows; r++) {
        float *s = scores + (size_t)r * len;
        float top = s[0];
        for (int t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        float total = 0.f;
#pragma omp simd reduction(+:total)
        for (int t = 0; t < len; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        float inv = 1.f / total;
        for (int t = 0; t < len; t++) s[t] *= inv;
        float *o = out + (size_t)r * dim;
        for (int d = 0; d < dim; d++) o[d] = 0.f;
    }
    for (int t = first; t < end; t++) {
        size_t slot = (size_t)table[t / block_size] * block_size + t % block_size;
        for (int r = 0; r < rows; r++) {
            const float *v = v_cache + (slot * kv_heads + h0 + r / group) * dim;
            float p = scores[(size_t)r * len + t - first];
            float *o = out + (size_t)r * dim;
#pragma omp simd
            for (int d = 0; d < dim; d++) o[d] += p * v[d];
        }
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode(const float *q, const float *k_cache, const float *v_cache, float *out,
                 const int *tables, int max_blocks, const int *lens, int n, int heads,
                 int kv_heads, int dim, int block_size, float scale, int window, int threads) {
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
        float *scores = malloc(sizeof(float) * (size_t)per_item * group * (longest > 0 ? longest : 1));
        if (!scores) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < items; i++) {
                int s = i / (kv_heads / per_item), h0 = i % (kv_heads / per_item) * per_item;
                size_t row = (size_t)s * heads + (size_t)h0 * group;
                int first = window > 0 && lens[s] > window ? lens[s] - window : 0;
#define ITEM(d) item(q + row * (d), k_cache, v_cache, out + row * (d), tables + (size_t)s * max_blocks, \
                     lens[s], first, group, kv_heads, d, block_size, scale, h0, h0 + per_item, scores)
                switch (dim) {   /* the usual head sizes, specialised */
                case 64: ITEM(64); break;
                case 128: ITEM(128); break;
                default: ITEM(dim);
                }
#undef ITEM
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
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
