/* Mixture-of-experts feed-forward for the CPU, float32: group the step's
 * tokens by expert, multiply each active expert once.
 *
 * out[t] = sum_j w[t, j] * (down_e(act(gate_up_e(x[t]) + b13_e)) + b2_e),
 * e = ids[t, j], over the top-k slots j of token t. A slot whose id is not in
 * [0, E) is skipped (an expert held by another rank under expert parallelism).
 *
 * Expert weights are packed as packed_gemm.c packs one linear weight, one
 * expert after another, with the intermediate size I padded to Ip, a whole
 * number of NB-column blocks (zero rows and columns): w13p[E][2 Ip / NB][H][NB]
 * holds gate block 0, up block 0, gate block 1, up block 1, ... so that a
 * thread which has just multiplied a gate block and its up block applies the
 * activation to those columns at once; w2p[E][ceil(H / NB)][Ip][NB]. A step
 * reads only the experts its tokens were routed to, each once, however many
 * of its tokens go there: the step's (token, slot) pairs are sorted by expert,
 * each expert's rows are gathered into one block of rows, and that block
 * multiplies the expert's packed weight through packed_gemm.c's run_blocks
 * (rows in register chunks, column blocks kept in cache). The packed weights
 * are float32, or bfloat16 (bf16 != 0: a checkpoint's bfloat16 experts kept
 * as published, widened exactly in registers; half the bytes, the same sums).
 *
 * Threads split columns, never experts: thread t multiplies its share of
 * every active expert's gate/up block pairs (then activates them), waits at
 * the one barrier, multiplies its share of every expert's down blocks, and
 * sums its output columns over each token's slots. Every thread gets the same
 * share of every expert, so a busy expert cannot leave a thread idle, and
 * beside the barrier only the region's end synchronises. Scratch memory is
 * the calling thread's (tensor-parallel ranks may be threads of one process)
 * plus one row buffer per worker thread, grown to the largest step seen.
 */
#include "packed_gemm.c"

#include <math.h>

#define ACT_SILU 0         /* silu(gate) * up */
#define ACT_SWIGLU_OAI 1   /* gpt-oss: clamped gate and up, gate * sigmoid(alpha * gate) * (up + 1) */

static __thread float *scratch = NULL;   /* shared by the team: [P][2 Ip] gate/up, [P][Ip] activated, [P][H] down */
static __thread size_t scratch_len = 0;
static __thread int *index_buf = NULL;   /* counts, offsets, order, slot rows */
static __thread size_t index_len = 0;
static __thread float *rows_buf = NULL;  /* one worker's gathered input rows */
static __thread size_t rows_len = 0;

static int grow(void **buf, size_t *len, size_t n, size_t elem) {
    if (*len >= n) return 0;
    free(*buf);
    *buf = aligned_alloc(64, (n * elem + 63) / 64 * 64);
    *len = *buf ? n : 0;
    return *buf ? 0 : -1;
}

/* [first, last) of n items for thread t of nt. */
INLINE void split(int n, int t, int nt, int *first, int *last) {
    *first = (int)((long)n * t / nt);
    *last = (int)((long)n * (t + 1) / nt);
}

/* The slot of a token's n-th smallest valid expert id (ties in slot
 * order), or -1 when it has fewer than n + 1 valid slots. */
static int slot_by_expert(const int *ids, int k, int n, int E) {
    int prev = -1, prev_slot = -1;
    for (int m = 0; m <= n; m++) {
        int best = -1;
        for (int j = 0; j < k; j++) {
            int e = ids[j];
            if (e < 0 || e >= E) continue;
            int after = e > prev || (e == prev && j > prev_slot);
            if (after && (best < 0 || e < ids[best])) best = j;
        }
        if (best < 0) return -1;
        prev = ids[best];
        prev_slot = best;
    }
    return prev_slot;
}

INLINE float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

INLINE float swiglu_oai(float g, float u, float alpha, float limit) {
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
    return g / (1.f + expf(-alpha * g)) * (u + 1.f);
}

/* Returns 0, or -1 when scratch memory could not be allocated. *bytes (when
 * not NULL) receives the bytes of expert weights the step read. b13 is [E][2I]
 * (gate, then up), unpadded. */
int fused_moe(const float *x, int T, int H, int I, const int *ids, const float *weights, int k, int E,
              const void *w13p, const void *w2p, const float *b13, const float *b2, int act,
              float alpha, float limit, float *out, int threads, long long *bytes, int bf16) {
    int pairs1 = (I + NB - 1) / NB, Ip = pairs1 * NB, N1 = 2 * Ip, B2 = (H + NB - 1) / NB;
    size_t e13 = (size_t)N1 * H, e2 = (size_t)B2 * NB * Ip;   /* weights per packed expert */
    size_t wb = bf16 ? 2 : sizeof(float);                      /* bytes per weight */
    if (bytes) *bytes = 0;
    if (T <= 0) return 0;
    if (grow((void **)&index_buf, &index_len, (size_t)3 * E + 2 + 2 * (size_t)T * k, sizeof(int))) return -1;
    int *count = index_buf, *offset = count + E, *fill = offset + E + 1;
    int *order = fill + E + 1, *row_of = order + (size_t)T * k;
    memset(count, 0, sizeof(int) * E);
    for (size_t p = 0; p < (size_t)T * k; p++)
        if (ids[p] >= 0 && ids[p] < E) count[ids[p]]++;
    offset[0] = 0;
    for (int e = 0; e < E; e++) offset[e + 1] = offset[e] + count[e];
    int P = offset[E];
    memcpy(fill, offset, sizeof(int) * E);
    for (size_t p = 0; p < (size_t)T * k; p++) {   /* pairs by expert, tokens in order */
        int e = ids[p];
        row_of[p] = e >= 0 && e < E ? fill[e]++ : -1;
        if (row_of[p] >= 0) order[row_of[p]] = (int)p;
    }
    if (P == 0) {
        memset(out, 0, sizeof(float) * (size_t)T * H);
        return 0;
    }
    if (grow((void **)&scratch, &scratch_len, (size_t)P * (N1 + Ip + H), sizeof(float))) return -1;
    float *h1 = scratch, *h2 = h1 + (size_t)P * N1, *down = h2 + (size_t)P * Ip;
    int active[E > 0 ? E : 1], nact = 0;
    for (int e = 0; e < E; e++) {
        if (!count[e]) continue;
        active[nact++] = e;
        if (bytes) *bytes += (long long)((e13 + e2) * wb);
    }
    if (threads < 1) threads = 1;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(|: failed)
#endif
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        int t = 0, nt = 1;
#endif
        int p0, p1, c0, c1;
        split(pairs1, t, nt, &p0, &p1);
        split(B2, t, nt, &c0, &c1);
        /* Gate/up block pairs [p0, p1) of every active expert, then their activation. */
        int largest = 0;
        for (int a = 0; a < nact; a++) largest = count[active[a]] > largest ? count[active[a]] : largest;
        failed = p0 < p1 && grow((void **)&rows_buf, &rows_len, (size_t)largest * H, sizeof(float));
        for (int a = 0; a < nact && p0 < p1 && !failed; a++) {
            int e = active[a], n = count[e];
            for (int r = 0; r < n; r++)
                memcpy(rows_buf + (size_t)r * H, x + (size_t)(order[offset[e] + r] / k) * H, sizeof(float) * H);
            float *g1 = h1 + (size_t)offset[e] * N1;
            const void *we = (const char *)w13p + (size_t)e * e13 * wb;
            if (bf16) run_blocks(rows_buf, we, W_BF16, NULL, g1, n, H, N1, 2 * p0, 2 * p1);
            else run_blocks(rows_buf, we, W_F32, NULL, g1, n, H, N1, 2 * p0, 2 * p1);
            const float *bg = b13 ? b13 + (size_t)e * 2 * I : NULL;
            for (int r = 0; r < n; r++) {
                const float *g = g1 + (size_t)r * N1;
                float *o = h2 + (size_t)(offset[e] + r) * Ip;
                for (int j = p0; j < p1; j++) {
                    const float *gj = g + (size_t)2 * j * NB, *uj = gj + NB;
                    int base = j * NB;
                    if (bg && base + NB <= I) {
                        if (act == ACT_SWIGLU_OAI)
                            for (int i = 0; i < NB; i++)
                                o[base + i] = swiglu_oai(gj[i] + bg[base + i], uj[i] + bg[I + base + i], alpha, limit);
                        else
                            for (int i = 0; i < NB; i++)
                                o[base + i] = silu_mul(gj[i] + bg[base + i], uj[i] + bg[I + base + i]);
                    } else if (bg) {   /* the padded last block: no bias past I (zero weights: act(0, 0) = 0) */
                        for (int i = 0; i < NB; i++) {
                            float gb = base + i < I ? bg[base + i] : 0.f, ub = base + i < I ? bg[I + base + i] : 0.f;
                            o[base + i] = act == ACT_SWIGLU_OAI ? swiglu_oai(gj[i] + gb, uj[i] + ub, alpha, limit)
                                                                : silu_mul(gj[i] + gb, uj[i] + ub);
                        }
                    } else if (act == ACT_SWIGLU_OAI) {
                        for (int i = 0; i < NB; i++) o[base + i] = swiglu_oai(gj[i], uj[i], alpha, limit);
                    } else {
                        for (int i = 0; i < NB; i++) o[base + i] = silu_mul(gj[i], uj[i]);
                    }
                }
            }
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        /* Down blocks [c0, c1) of every active expert (whole activated rows are ready). */
        for (int a = 0; a < nact && c0 < c1; a++) {
            int e = active[a];
            const void *we = (const char *)w2p + (size_t)e * e2 * wb;
            if (bf16) run_blocks(h2 + (size_t)offset[e] * Ip, we, W_BF16, NULL,
                                 down + (size_t)offset[e] * H, count[e], Ip, H, c0, c1);
            else run_blocks(h2 + (size_t)offset[e] * Ip, we, W_F32, NULL,
                            down + (size_t)offset[e] * H, count[e], Ip, H, c0, c1);
        }
        /* This thread's output columns: each token's slots summed. */
        int h0 = c0 * NB, hn = (c1 * NB < H ? c1 * NB : H) - h0;
        for (int tok = 0; tok < T && hn > 0; tok++) {
            float *o = out + (size_t)tok * H + h0;
            memset(o, 0, sizeof(float) * hn);
            for (int n = 0; n < k; n++) {
                /* Slots by ascending expert (rows of one token are in expert
                 * order), as Hugging Face's experts add them up. */
                int j = slot_by_expert(ids + (size_t)tok * k, k, n, E);
                if (j < 0) break;
                float w = weights[(size_t)tok * k + j];
                const float *y = down + (size_t)row_of[(size_t)tok * k + j] * H + h0;
                const float *bd = b2 ? b2 + (size_t)ids[(size_t)tok * k + j] * H + h0 : NULL;
                if (bd) {
                    for (int h = 0; h < hn; h++) o[h] += w * (y[h] + bd[h]);
                } else {
                    for (int h = 0; h < hn; h++) o[h] += w * y[h];
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* Output columns per packed block (the packing's NB). */
int fused_moe_block_cols(void) { return NB; }
