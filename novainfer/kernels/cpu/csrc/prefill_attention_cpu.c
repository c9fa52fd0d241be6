/* Causal attention of a step's new tokens (whole prompts, prompt chunks, the tokens after a cached prefix: the
 * i-th of a sequence's q new tokens sits at position seq_len - q + i) over the bfloat16 paged cache, float32
 * queries. AVX2+FMA; built with the other kernels by kernels/cpu/library.py, wrapped by ops.prefill_attention_bf16.
 *
 * Two passes on the worker pool (cpu_pool.c). First each (sequence, KV head) widens its cached K and V to
 * float32 once, K transposed ([D][L], so a vector holds 8 keys' scores) and V as is ([L][D]). Then each tile of
 * BQ query tokens x the query heads sharing a KV head (GQA without copying K/V per head) computes its scores
 * only up to its last token's position (masked key blocks skipped), an exact softmax per row (no online
 * rescaling: the whole row fits), and P V, each product register-blocked RB rows x 16 columns.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "simd_cpu.h"

#define BQ 16  /* query tokens per tile */
#define RB 6   /* rows (token, head) per register tile: 12 accumulators (8 left the FMAs waiting on each other) */

typedef struct {
    const float *q; int q_stride; const uint16_t *k_cache, *v_cache; const int32_t *block_tables; int bt_stride;
    const int32_t *q_start, *seq_lens; int S, nh, nkv, D, block_size, window; float scale, soft_cap;
    const float *sinks;               /* [nh] attention sink logits, or NULL */
    float *kv; const size_t *kv_off;  /* per sequence: nkv x (Kt [D][ldk], V [D/16][Lp][16]) at kv + kv_off[s] */
    const int *tiles; int ntiles;     /* tile i: sequence tiles[2i], first query tiles[2i + 1] */
    _Atomic int failed;
    float *out;
} pattn_job;

static inline int lp_of(int len) { return (len + 15) / 16 * 16; }
/* K^T's row stride: one cache line past Lp, so the D rows a block of keys reads do not fall in the same few L1
 * sets (at 512 keys a stride of 2 KB put all 64 in 2 sets of 8 ways: every register tile re-read them from L2) */
static inline int ldk_of(int len) { return lp_of(len) + 16; }

/* Sequence c / nkv, KV head c % nkv: K and V of positions 0..len-1 widened, zero up to Lp. */
static void widen_kv(void *arg, int c) {
    const pattn_job *j = arg;
    const int s = c / j->nkv, g = c % j->nkv, D = j->D, len = j->seq_lens[s], Lp = lp_of(len), bs = j->block_size;
    const int ldk = ldk_of(len);
    float *kt = j->kv + j->kv_off[s] + (size_t)g * (ldk + Lp) * D, *v = kt + (size_t)ldk * D;
    const int32_t *bt = j->block_tables + (size_t)s * j->bt_stride;
    for (int p0 = 0; p0 < Lp; p0 += 8) {
        const uint16_t *kr[8], *vr[8];
        for (int i = 0; i < 8; i++) {
            const int p = p0 + i;
            const size_t row = p < len ? ((size_t)bt[p / bs] * bs + p % bs) * j->nkv * D + (size_t)g * D : 0;
            kr[i] = p < len ? j->k_cache + row : NULL;
            vr[i] = p < len ? j->v_cache + row : NULL;
        }
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) {
                r[i] = kr[i] ? _mm256_castps_si256(load_bf16(kr[i] + d0)) : _mm256_setzero_si256();
                _mm256_storeu_ps(v + ((size_t)(d0 / 16) * Lp + p0 + i) * 16 + d0 % 16,
                                 vr[i] ? load_bf16(vr[i] + d0) : _mm256_setzero_ps());
            }
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (size_t)(d0 + i) * ldk + p0, _mm256_castsi256_ps(r[i]));
        }
    }
}

/* sc[r][c - c0] = scale * q_r . k_c for mr rows and keys c0..c1 (multiples of 16 apart). */
static inline __attribute__((always_inline)) void scores(const float *const *qr, const int mr, const float *kt, int ldk,
                                                         int D, int c0, int c1, float scale, float *sc, int W) {
    for (int c = c0; c < c1; c += 16) {
        __m256 a[RB][2];
        for (int m = 0; m < mr; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 k0 = _mm256_loadu_ps(kt + (size_t)d * ldk + c), k1 = _mm256_loadu_ps(kt + (size_t)d * ldk + c + 8);
            for (int m = 0; m < mr; m++) {
                const __m256 qb = _mm256_broadcast_ss(qr[m] + d);
                a[m][0] = _mm256_fmadd_ps(qb, k0, a[m][0]);
                a[m][1] = _mm256_fmadd_ps(qb, k1, a[m][1]);
            }
        }
        const __m256 sv = _mm256_set1_ps(scale);
        for (int m = 0; m < mr; m++) {
            _mm256_storeu_ps(sc + (size_t)m * W + c - c0, _mm256_mul_ps(a[m][0], sv));
            _mm256_storeu_ps(sc + (size_t)m * W + c - c0 + 8, _mm256_mul_ps(a[m][1], sv));
        }
    }
}

/* o_r[d0..d0+16] = sum_c p[r][c] v_c / norm_r for mr rows, keys c0..c1. */
static inline __attribute__((always_inline)) void weigh(const float *p, int W, const int mr, const float *v, int Lp,
                                                        int c0, int c1, int d0, const float *inv, float *const *orow) {
    __m256 a[RB][2];
    for (int m = 0; m < mr; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
    for (int c = c0; c < c1; c++) {
        const float *vc = v + ((size_t)(d0 / 16) * Lp + c) * 16;  /* 16 dims of key c: one line, keys in a row */
        const __m256 v0 = _mm256_loadu_ps(vc), v1 = _mm256_loadu_ps(vc + 8);
        for (int m = 0; m < mr; m++) {
            const __m256 pb = _mm256_broadcast_ss(p + (size_t)m * W + c - c0);
            a[m][0] = _mm256_fmadd_ps(pb, v0, a[m][0]);
            a[m][1] = _mm256_fmadd_ps(pb, v1, a[m][1]);
        }
    }
    for (int m = 0; m < mr; m++) {
        const __m256 s = _mm256_set1_ps(inv[m]);
        _mm256_storeu_ps(orow[m] + d0, _mm256_mul_ps(a[m][0], s));
        _mm256_storeu_ps(orow[m] + d0 + 8, _mm256_mul_ps(a[m][1], s));
    }
}

static __thread float *sc_buf;
static __thread size_t sc_cap;

/* Tile (c / nkv) of the tiles list, KV head c % nkv. */
static void attend_tile(void *arg, int c) {
    pattn_job *j = arg;
    const int ti = j->ntiles - 1 - c / j->nkv, g = c % j->nkv;  /* the longest rows first: better balance */
    const int s = j->tiles[2 * ti], t0 = j->tiles[2 * ti + 1], D = j->D, group = j->nh / j->nkv;
    const int len = j->seq_lens[s], qlen = j->q_start[s + 1] - j->q_start[s], Lp = lp_of(len), ldk = ldk_of(len);
    const int nt = qlen - t0 < BQ ? qlen - t0 : BQ, R = nt * group, first = len - qlen + t0, last = first + nt - 1;
    const int lo0 = j->window > 0 && first - j->window + 1 > 0 ? first - j->window + 1 : 0;
    const int c0 = lo0 / 16 * 16, c1 = lp_of(last + 1), W = c1 - c0;
    const float *kt = j->kv + j->kv_off[s] + (size_t)g * (ldk + Lp) * D, *v = kt + (size_t)ldk * D;
    const size_t need = (size_t)R * W + R;
    if (need > sc_cap) {
        free(sc_buf);
        sc_buf = malloc(sizeof(float) * need);
        sc_cap = sc_buf ? need : 0;
        if (!sc_buf) { atomic_store(&j->failed, 1); return; }
    }
    float *sc = sc_buf, *inv = sc_buf + (size_t)R * W;
    const float *qr[RB];
    float *orow[RB];
#define ROW_PTRS(r0, mr) for (int m = 0; m < (mr); m++) { \
        const size_t tok = (size_t)j->q_start[s] + t0 + ((r0) + m) / group, head = (size_t)g * group + ((r0) + m) % group; \
        qr[m] = j->q + tok * j->q_stride + head * D; orow[m] = j->out + (tok * j->nh + head) * D; }
    for (int r0 = 0; r0 < R; r0 += RB) {
        const int mr = R - r0 < RB ? R - r0 : RB;
        ROW_PTRS(r0, mr)
        if (mr == RB) scores(qr, RB, kt, ldk, D, c0, c1, j->scale, sc + (size_t)r0 * W, W);
        else for (int m = 0; m < mr; m++) scores(qr + m, 1, kt, ldk, D, c0, c1, j->scale, sc + (size_t)(r0 + m) * W, W);
    }
    for (int r = 0; r < R; r++) {
        const int pos = first + r / group, lo = j->window > 0 && pos - j->window + 1 > lo0 ? pos - j->window + 1 : lo0;
        float mx;
        inv[r] = softmax_row(sc + (size_t)r * W, W, lo - c0, pos - c0, j->soft_cap, &mx);
        if (j->sinks) inv[r] = sink_inv(inv[r], mx, j->sinks[g * group + r % group]);
    }
    for (int r0 = 0; r0 < R; r0 += RB) {
        const int mr = R - r0 < RB ? R - r0 : RB;
        ROW_PTRS(r0, mr)
        for (int d0 = 0; d0 < D; d0 += 16) {
            if (mr == RB) weigh(sc + (size_t)r0 * W, W, RB, v, Lp, c0, c1, d0, inv + r0, orow);
            else for (int m = 0; m < mr; m++) weigh(sc + (size_t)(r0 + m) * W, W, 1, v, Lp, c0, c1, d0, inv + r0 + m, orow + m);
        }
    }
#undef ROW_PTRS
}

/* q [T, nh, D] (row stride q_stride; sequence s's tokens q_start[s]..q_start[s+1]) against the bf16 cache through
 * block tables [S, bt_stride]; out [T, nh, D]. window > 0: a query at p sees keys > p - window; soft_cap > 0: scores
 * capped as cap * tanh(x / cap); sinks (NULL: none) holds each head's sink logit. D must be a multiple of 16.
 * Returns KV_OK, KV_NO_MEMORY, or (reading nothing) the error of a bad index: check_block_tables' for a cache of
 * num_blocks blocks, KV_BAD_QUERIES for a sequence whose new tokens are not within 0..T, in order, and at most its
 * length. */
int prefill_attention_bf16(const float *q, int q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *block_tables, int bt_stride, const int32_t *q_start, const int32_t *seq_lens,
                           int S, int nh, int nkv, int D, int block_size, float scale, int window, float soft_cap,
                           const float *sinks, float *out, int nthreads, int T, int num_blocks, int *where) {
    int rc = check_block_tables(block_tables, bt_stride, seq_lens, S, block_size, num_blocks, where);
    if (rc) return rc;
    for (int s = 0; s < S; s++)
        if (q_start[s] < 0 || q_start[s + 1] < q_start[s] || q_start[s + 1] > T ||
            q_start[s + 1] - q_start[s] > seq_lens[s]) {
            if (where) where[0] = s;
            return KV_BAD_QUERIES;
        }
    pattn_job j = {q, q_stride, k_cache, v_cache, block_tables, bt_stride, q_start, seq_lens, S, nh, nkv, D, block_size,
                   window, scale, soft_cap, sinks, NULL, NULL, NULL, 0, 0, out};
    size_t *off = malloc(sizeof(size_t) * (S + 1));
    int ntiles = 0;
    if (!off) return KV_NO_MEMORY;
    off[0] = 0;
    for (int s = 0; s < S; s++) {
        off[s + 1] = off[s] + (size_t)nkv * (ldk_of(seq_lens[s]) + lp_of(seq_lens[s])) * D;
        ntiles += (q_start[s + 1] - q_start[s] + BQ - 1) / BQ;
    }
    int *tiles = malloc(sizeof(int) * 2 * (ntiles + 1));
    j.kv = malloc(sizeof(float) * (off[S] + 1));
    rc = KV_NO_MEMORY;
    if (tiles && j.kv) {
        int n = 0;
        for (int s = 0; s < S; s++)
            for (int t0 = 0; t0 < q_start[s + 1] - q_start[s]; t0 += BQ) { tiles[2 * n] = s; tiles[2 * n + 1] = t0; n++; }
        j.kv_off = off; j.tiles = tiles; j.ntiles = ntiles;
        pool_run(widen_kv, &j, S * nkv, nthreads);
        atomic_store(&j.failed, 0);
        pool_run(attend_tile, &j, ntiles * nkv, nthreads);
        rc = atomic_load(&j.failed) ? KV_NO_MEMORY : KV_OK;
    }
    free(off); free(tiles); free(j.kv);
    return rc;
}
