/* Batched LoRA for one projection over the adapter pool (Punica's SGMV idea:
 * the step's tokens grouped by adapter, each group multiplied by its own
 * adapter's weights in one pass).
 *
 * The pool holds rank pages: page p is row p of A [pages, in] (a row of a
 * LoRA A) and row p of B [pages, out] (a column of a LoRA B, its scaling
 * folded in). An adapter of rank r owns r pages, anywhere in the pool.
 * segs [nseg, 4] lists, per segment, where its rows start in `rows`, how many
 * rows it has, where its pages start in `pages`, and its rank. For each:
 *
 *     S = x[rows] @ A[pages]^T          (shrink: rows x rank)
 *     y[rows] += S @ B[pages]            (expand)
 *
 * x rows are `ldx` floats apart, y rows `ldy` (y may be a column slice of a
 * merged projection's output). Segments write disjoint rows, so the expand
 * splits over (segment, column block) and the shrink over (segment, page);
 * both go to OpenMP threads (torch's libgomp, as for packed_gemm.c). The
 * shrink reads each A row once per segment and the expand each B row once
 * per column block: the adapters' weights stream from memory once a step.
 */
#include <stdint.h>
#include <stdlib.h>

#define COLUMN_BLOCK 128

enum { ROW_START = 0, NUM_ROWS = 1, PAGE_START = 2, RANK = 3 };

int lora_sgmv_f32(const float *x, long ldx, long in, float *y, long ldy, long out,
                  const float *A, const float *B, const int32_t *rows, const int32_t *pages,
                  const int32_t *segs, int nseg) {
    if (nseg <= 0)
        return 0;
    /* Per segment: its first shrink work item and where its S starts. */
    long *first = malloc(sizeof(long) * (size_t)(2 * nseg + 2));
    if (!first)
        return -1;
    long *s_start = first + nseg + 1;
    long items = 0, floats = 0;
    for (int i = 0; i < nseg; i++) {
        first[i] = items;
        s_start[i] = floats;
        items += segs[4 * i + RANK];
        floats += (long)segs[4 * i + RANK] * segs[4 * i + NUM_ROWS];
    }
    first[nseg] = items;
    float *scratch = malloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    if (!scratch) {
        free(first);
        return -1;
    }

#pragma omp parallel for schedule(static) if (items > 1)
    for (long w = 0; w < items; w++) {
        int lo = 0, hi = nseg - 1;   /* the segment holding work item w */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (first[mid] <= w)
                lo = mid;
            else
                hi = mid - 1;
        }
        const int32_t *seg = segs + 4 * lo;
        int j = (int)(w - first[lo]), rank = seg[RANK], n = seg[NUM_ROWS];
        const float *a = A + (long)pages[seg[PAGE_START] + j] * in;
        float *s = scratch + s_start[lo];
        for (int t = 0; t < n; t++) {
            const float *xr = x + (long)rows[seg[ROW_START] + t] * ldx;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long k = 0; k < in; k++)
                acc += xr[k] * a[k];
            s[(long)t * rank + j] = acc;
        }
    }

    long blocks = (out + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel for schedule(static) if (nseg * blocks > 1)
    for (long w = 0; w < nseg * blocks; w++) {
        int i = (int)(w / blocks);
        long c0 = (w % blocks) * COLUMN_BLOCK;
        long c1 = c0 + COLUMN_BLOCK < out ? c0 + COLUMN_BLOCK : out;
        const int32_t *seg = segs + 4 * i;
        int rank = seg[RANK], n = seg[NUM_ROWS];
        const float *s = scratch + s_start[i];
        float acc[COLUMN_BLOCK];
        for (int t = 0; t < n; t++) {
            for (long c = 0; c < c1 - c0; c++)
                acc[c] = 0.0f;
            for (int j = 0; j < rank; j++) {
                float sv = s[(long)t * rank + j];
                const float *b = B + (long)pages[seg[PAGE_START] + j] * out + c0;
#pragma omp simd
                for (long c = 0; c < c1 - c0; c++)
                    acc[c] += sv * b[c];
            }
            float *yr = y + (long)rows[seg[ROW_START] + t] * ldy + c0;
#pragma omp simd
            for (long c = 0; c < c1 - c0; c++)
                yr[c] += acc[c];
        }
    }
    free(scratch);
    free(first);
    return 0;
}
