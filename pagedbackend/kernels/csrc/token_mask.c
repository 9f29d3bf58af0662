/* Structured-output token masks applied to float32 logits in place.
 *
 * logits: rows of `stride` floats; bitmask [n, words] (int32, bit j of word
 * w allows token 32 * w + j, as xgrammar fills it); rows[i] is the logits
 * row that bitmask row i applies to. Every token of the first `vocab` whose
 * bit is 0 becomes -inf. A grammar inside free text allows nearly every
 * token and at a JSON delimiter nearly none, so most words are all ones
 * (skipped) or all zeros (32 stores); only mixed words look at their bits.
 * Rows go to OpenMP threads (torch's libgomp, as for packed_gemm.c).
 */
#include <math.h>
#include <stdint.h>

void apply_token_mask(float *logits, long stride, const int32_t *bitmask, int words,
                      const long *rows, int n, int vocab) {
#pragma omp parallel for schedule(static) if (n > 1)
    for (int i = 0; i < n; i++) {
        float *row = logits + rows[i] * stride;
        const uint32_t *bits = (const uint32_t *)(bitmask + (long)i * words);
        for (int w = 0; w < words; w++) {
            uint32_t word = bits[w];
            if (word == 0xffffffffu)
                continue;
            int start = w * 32, end = start + 32 < vocab ? start + 32 : vocab;
            if (word == 0) {
                for (int t = start; t < end; t++)
                    row[t] = -INFINITY;
            } else {
                for (int t = start; t < end; t++)
                    if (!((word >> (t - start)) & 1u))
                        row[t] = -INFINITY;
            }
        }
    }
}
