/* blocks.c: a whole transformer block.
 * One llama-family block (llama, qwen2, qwen3, gemma3) for m rows at positions start..start+m-1,
 * in place on the residual h [m, d]. The same arithmetic as tsspec/models/base.py's torch path
 * (its reference), without a Python dispatch per operation. Every row is computed on its own:
 * norms, rope and activations per row, attention per (row, head) over the row's own key range in
 * a fixed order, products through tsq_matmul. So the block is batch invariant like its parts. */

#include "tsq.h"

int tsq_sizeof_linear(void) { return (int)sizeof(tsq_linear); }
int tsq_sizeof_layer(void) { return (int)sizeof(tsq_layer); }
int tsq_sizeof_config(void) { return (int)sizeof(tsq_config); }

/* y [m, n_total] = x [m, k] W.T (+ bias); xq: scratch for the quantized input */
static int linear_plain(const tsq_linear *L, const float *x, long m, float *y, xgroup *xq, int nt) {
    int have = 0;
    long col = 0;
    for (int i = 0; i < L->nparts; i++) {
        if (!is_float_type(L->type[i]) && !have) { tsq_quantize(x, m, L->k, xq); have = 1; }
        int rc = tsq_matmul(L->type[i], L->w[i], L->packed[i], L->row_bytes[i], L->n[i], L->k, x,
                            xq, m, y + col, L->n_total, nt, 1);
        if (rc) return rc;
        col += L->n[i];
    }
    if (L->bias)
        for (long r = 0; r < m; r++)
            for (long j = 0; j < L->n_total; j++) y[r * L->n_total + j] += L->bias[j];
    return 0;
}

/* linear_plain for prompt rows while the routes are on (prompt_tiles.c): the Q4_K and Q6_K parts in
 * the super-block arithmetic, Q4_0, Q4_1, Q5_0 and Q8_0 in the 32-element one (from the inputs every product
 * takes), the others as linear_plain takes them */
static int linear_prompt(const tsq_linear *L, const float *x, long m, float *y, xgroup *xq, int nt, int mode) {
    const long k = L->k;
    int8_t *q = NULL;
    float *dx = NULL;
    int16_t *xs = NULL;
    int rc = 0, have = 0;
    long col = 0;
    for (int i = 0; i < L->nparts && !rc; i++) {
        const int route = tsq_sb_takes(L->type[i], k);
        if (route == 1 && !q) {
            q = malloc((size_t)m * k);
            dx = malloc(sizeof(float) * m * (k / 256));
            xs = malloc(sizeof(int16_t) * m * (k / 32));
            if (!q || !dx || !xs) {
                rc = -2;
                break;
            }
            tsq_quantize_sb(x, m, k, q, dx, xs, nt);
        }
        if (route != 1 && !is_float_type(L->type[i]) && !have) {
            tsq_quantize(x, m, k, xq);
            have = 1;
        }
        if (route == 1)
            rc = tsq_matmul_sb_q(L->type[i], L->w[i], L->packed[i], L->row_bytes[i], L->n[i], k, q, dx, xs, m, y + col,
                                 L->n_total, nt, mode);
        else if (route == 2)
            rc = tsq_matmul_b32_q(L->type[i], L->w[i], L->packed[i], L->row_bytes[i], L->n[i], k, xq, m, y + col,
                                  L->n_total, nt, mode);
        else
            rc = tsq_matmul(L->type[i], L->w[i], L->packed[i], L->row_bytes[i], L->n[i], k, x, xq, m, y + col,
                            L->n_total, nt, 1);
        col += L->n[i];
    }
    free(q);
    free(dx);
    free(xs);
    if (!rc && L->bias)
        for (long r = 0; r < m; r++)
            for (long j = 0; j < L->n_total; j++) y[r * L->n_total + j] += L->bias[j];
    return rc;
}

/* linear_plain, with rows r where pr[r] is set (prompt rows; pr NULL: none) taken by the routes where
 * they are on and the layer has parts they take. Runs of rows alike go as one product each. */
int tsq_linear_apply_rows(const tsq_linear *L, const float *x, long m, float *y, xgroup *xq, int nt,
                          const uint8_t *pr) {
    const int mode = pr ? tsq_sb_product_mode() : -1;
    int any = 0;
    for (int i = 0; i < L->nparts; i++) any |= tsq_sb_takes(L->type[i], L->k);
    if (mode < 0 || !any) return linear_plain(L, x, m, y, xq, nt);
    int rc = 0;
    for (long a = 0, b; a < m && !rc; a = b) {
        for (b = a + 1; b < m && !pr[b] == !pr[a]; b++) {}
        rc = pr[a] ? linear_prompt(L, x + a * L->k, b - a, y + a * L->n_total, xq, nt, mode)
                   : linear_plain(L, x + a * L->k, b - a, y + a * L->n_total, xq, nt);
    }
    return rc;
}

int tsq_linear_apply(const tsq_linear *L, const float *x, long m, float *y, xgroup *xq, int nt) {
    return linear_plain(L, x, m, y, xq, nt);
}

/* out = x * rsqrt(mean(x^2) + eps) * w over n elements (out may alias x) */
void tsq_rms_norm_row(const float *x, const float *w, long n, float eps, float *out) {
    double ss = 0.0;
    for (long i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (long i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void rope_row(float *v, const float *c, const float *s, long half, int neox) {
    for (long i = 0; i < half; i++) {
        long ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        float a = v[ia], b = v[ib];
        v[ia] = a * c[i] - b * s[i];
        v[ib] = b * c[i] + a * s[i];
    }
}

/* e^x and tanh lane by lane, the operations exp8/tanh8 below do in each of their eight lanes (so
 * every level, SIMD or not, gets the same bits): e^x = 2^n e^r, n = round(x log2 e), r by Cody and
 * Waite's two-part ln 2, e^r by Cephes' degree-7 polynomial (about 1 ulp over the float range); x is
 * clamped to [-87, 88] first (e^-87 ~ 1.6e-38 stands for anything smaller, 88 for anything larger:
 * both only ever feed 1/(1 + e) or a softmax; NaN becomes -87, as the vector max/min leave it).
 * tanh is Cephes' tanhf: an odd polynomial below 0.625, else 1 - 2 / (e^2|x| + 1) with x's sign. */
static inline float exp1(float x) {
    x = x > -87.f ? x : -87.f;
    x = x < 88.f ? x : 88.f;
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float e;
    memcpy(&e, &bits, 4);
    return p * e;
}

static inline float tanh1(float x) {
    const float ax = fabsf(x), z = x * x;
    float p = -5.70498872745e-3f;
    p = fmaf(p, z, 2.06390887954e-2f);
    p = fmaf(p, z, -5.37397155531e-2f);
    p = fmaf(p, z, 1.33314422036e-1f);
    p = fmaf(p, z, -3.33332819422e-1f);
    if (ax < 0.625f) return fmaf(p * z, x, x);
    const float e = exp1(ax + ax);
    return copysignf(1.f - 2.f / (e + 1.f), x); /* the quotient's value is positive: only the sign moves */
}

/* a[i] = act(g[i]) * u[i], one element as each lane of tsq_act_row's vectors computes it */
static inline float act1(int gelu, float g, float u) {
    float act;
    if (gelu) {
        const float z = 0.7978845608028654f * fmaf(0.044715f, (g * g) * g, g);
        act = (0.5f * g) * (1.f + tanh1(z));
    } else {
        act = g / (1.f + exp1(0.f - g));
    }
    return act * u;
}

#if TSQ_HAS_AVX2
/* e^x for eight lanes: x = n ln2 + r, |r| <= ln2/2, e^r by Cephes' degree-7 polynomial (about 1 ulp
 * over the float range), 2^n through the exponent bits. x is clamped to [-87, 88]: e^-87 ~ 1.6e-38
 * stands for anything smaller, 88 for anything larger (both only ever feed 1/(1 + e)). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* tanh for eight lanes, Cephes' tanhf: an odd polynomial below 0.625, else 1 - 2 / (e^2|x| + 1) */
static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 ax = _mm256_andnot_ps(sign, x), z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    const __m256 e = exp8(_mm256_add_ps(ax, ax));
    const __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.f), _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f))));
    const __m256 large = _mm256_or_ps(big, _mm256_and_ps(sign, x)); /* tanh(-x) = -tanh(x) */
    return _mm256_blendv_ps(large, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

/* a[i] = act(g[i]) * u[i] over n elements, eight at a time (the tail element by element, act1's
 * same operations): silu is g / (1 + e^-g); gelu (tanh form) is 0.5 g (1 + tanh(sqrt(2/pi) (g +
 * 0.044715 g^3))), in the order torch and transformers compute it. */
void tsq_act_row(int gelu, const float *g, const float *u, float *a, long n) {
    const __m256 one = _mm256_set1_ps(1.f);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
        __m256 act;
        if (gelu) {
            const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
            const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                           _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, gv));
            act = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), gv), _mm256_add_ps(one, tanh8(z)));
        } else {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            act = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        }
        _mm256_storeu_ps(a + i, _mm256_mul_ps(act, uv));
    }
    for (; i < n; i++) a[i] = act1(gelu, g[i], u[i]);
}
#else
void tsq_act_row(int gelu, const float *g, const float *u, float *a, long n) {
    for (long i = 0; i < n; i++) a[i] = act1(gelu, g[i], u[i]);
}
#endif

/* Row j of a head's keys or values: position j's own slot, except that positions from `split` on
 * are a token tree's rows, at the slots map[j - split] (the row's ancestors, then itself). A chain
 * passes map NULL, and the compiler drops the test where it is the constant. */
static inline __attribute__((always_inline)) const float *kv_row(const float *b, long j, long hd, long split,
                                                               const long *map) {
    return b + (map && j >= split ? map[j - split] : j) * hd;
}

#if TSQ_HAS_AVX2
/* Query heads that share a KV head (grouped-query attention) are taken R at a time: each key and
 * value vector is loaded once for the R heads, where each head loaded all of them for itself (from
 * L2 or beyond once a layer's keys outgrow L1). Every head's scores, softmax and value sums keep
 * their operations and order, so R changes no bits. R is at most ATT_HEADS: the registers that a
 * block of four keys (scores) or of 32 outputs (values; 64 with AVX-512) for R heads needs, of the
 * 16 that AVX2 has and the 32 of AVX-512. */
#if TSQ_SIMD
#define ATT_HEADS 4
#else
#define ATT_HEADS 2
#endif

#if TSQ_SIMD
/* _mm256_hadd_ps's sums in each 128-bit lane of a 512-bit register: (a0+a1, a2+a3, b0+b1, b2+b3) */
static inline __m512 hadd512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
#endif

/* The scores of R heads (queries q[0..R)) against keys j0..j0+7 (c of them live; past the span a
 * valid row, masked to -inf): per head and key eight FMA chains over the head dimension, keys
 * 0-3 and 4-7 reduced apart by hadd ((0+1)+(2+3)), then added across the 128-bit halves. With
 * AVX-512, heads go two to a register (head r in the low half, r + 1 in the high, each key
 * broadcast to both): every lane does the 256-bit lane's FMA chain and the same sums, in half the
 * instructions; an odd last head takes the 256-bit path. */
static inline __attribute__((always_inline)) void scores8(const int R, const float *const *q, const float *kb, long j0,
                                                          long hd, long c, long split, const long *map, __m256 *s) {
    const float *kr[8];
    for (int p = 0; p < 8; p++) kr[p] = kv_row(kb, j0 + (p < c ? p : c - 1), hd, split, map);
    __m256 h[ATT_HEADS][2];
#if TSQ_SIMD
    const int r0 = R & ~1; /* heads 0..r0-1 in pairs, an odd last one in 256 bits */
    __m512 hz[ATT_HEADS / 2][2];
    for (int half = 0; half < 2; half++) {
        __m512 a[ATT_HEADS / 2][4];
        __m256 a1[4];
        for (int p = 0; p < 4; p++) {
            for (int r = 0; r < r0 / 2; r++) a[r][p] = _mm512_setzero_ps();
            a1[p] = _mm256_setzero_ps();
        }
        for (long i = 0; i < hd; i += 8) {
            __m512 kv[4];
            __m256 k1[4];
            for (int p = 0; p < 4; p++) {
                k1[p] = _mm256_loadu_ps(kr[4 * half + p] + i);
                /* the odd head reads the broadcast's low half: one load (two, taking k1 as loaded, read 1.09x at 3 heads) */
                if (r0) k1[p] = _mm512_castps512_ps256(kv[p] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(k1[p]))));
            }
            for (int r = 0; r < r0 / 2; r++) {
                const __m512 qv = _mm512_castpd_ps(_mm512_insertf64x4(
                    _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(q[2 * r] + i))),
                    _mm256_castps_pd(_mm256_loadu_ps(q[2 * r + 1] + i)), 1));
                for (int p = 0; p < 4; p++) a[r][p] = _mm512_fmadd_ps(qv, kv[p], a[r][p]);
            }
            if (R & 1) {
                const __m256 qv = _mm256_loadu_ps(q[r0] + i);
                for (int p = 0; p < 4; p++) a1[p] = _mm256_fmadd_ps(qv, k1[p], a1[p]);
            }
        }
        for (int r = 0; r < r0 / 2; r++) hz[r][half] = hadd512(hadd512(a[r][0], a[r][1]), hadd512(a[r][2], a[r][3]));
        if (R & 1) h[r0][half] = _mm256_hadd_ps(_mm256_hadd_ps(a1[0], a1[1]), _mm256_hadd_ps(a1[2], a1[3]));
    }
    for (int r = 0; r < r0 / 2; r++) {
        /* 128-bit lanes: hz[r][0] = (h_2r lo, hi, h_2r+1 lo, hi) for keys 0-3, hz[r][1] for 4-7 */
        const __m512 lo = _mm512_shuffle_f32x4(hz[r][0], hz[r][1], 0x88); /* lanes 0, 2 of each */
        const __m512 hi = _mm512_shuffle_f32x4(hz[r][0], hz[r][1], 0xDD); /* lanes 1, 3 of each */
        const __m512 sum = _mm512_add_ps(lo, hi), t = _mm512_shuffle_f32x4(sum, sum, 0xD8);
        s[2 * r] = _mm512_castps512_ps256(t);
        s[2 * r + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1));
    }
#else
    const int r0 = 0;
    for (int half = 0; half < 2; half++) {
        __m256 a[ATT_HEADS][4];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < 4; p++) a[r][p] = _mm256_setzero_ps();
        for (long i = 0; i < hd; i += 8) {
            __m256 kv[4];
            for (int p = 0; p < 4; p++) kv[p] = _mm256_loadu_ps(kr[4 * half + p] + i);
            for (int r = 0; r < R; r++) {
                const __m256 qv = _mm256_loadu_ps(q[r] + i);
                for (int p = 0; p < 4; p++) a[r][p] = _mm256_fmadd_ps(qv, kv[p], a[r][p]);
            }
        }
        for (int r = 0; r < R; r++)
            h[r][half] = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
    }
#endif
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    for (int r = 0; r < R; r++) {
        if (r >= r0)
            s[r] = _mm256_add_ps(_mm256_permute2f128_ps(h[r][0], h[r][1], 0x20), _mm256_permute2f128_ps(h[r][0], h[r][1], 0x31));
        if (c < 8) s[r] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[r], live);
    }
}

/* sc[0..n) = softmax of the n scores there: the max, e^(s - max) by exp8 summed in eight lanes
 * (position j in lane j % 8), each times 1/sum. sc has room for n rounded up to 8. */
static inline __attribute__((always_inline)) void softmax8(float *sc, long n, __m256 vmx) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 vs = _mm256_setzero_ps();
    for (long j = 0; j < n; j += 8) {
        const long c = n - j;
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mx));
        if (c < 8)
            e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)c),
                                                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
        _mm256_storeu_ps(sc + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    const __m256 inv = _mm256_set1_ps(1.f / hsum8(vs));
    for (long j = 0; j < n; j += 8) _mm256_storeu_ps(sc + j, _mm256_mul_ps(_mm256_loadu_ps(sc + j), inv));
}

/* o[r][i0 + 0..8U) = sum over j in [j0, j1) of p[r][j] v_(lo + j)[i0 + 0..8U) for R heads, each an
 * FMA chain in j order, started from o's values where cont (the chain's earlier positions, parked
 * there: a float stored and loaded back is the same float) and from zero otherwise; each value
 * vector loaded once for the R heads */
static inline __attribute__((always_inline)) void value_sum(const int R, const float *const *p, const float *vb, long lo,
                                                            long i0, long j0, long j1, int cont, long hd, long split,
                                                            const long *map, float *const *o, const int U) {
    __m256 a[ATT_HEADS][8];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++) a[r][u] = cont ? _mm256_loadu_ps(o[r] + i0 + 8 * u) : _mm256_setzero_ps();
    for (long j = j0; j < j1; j++) {
        const float *v = kv_row(vb, lo + j, hd, split, map) + i0;
        __m256 vv[8];
        for (int u = 0; u < U; u++) vv[u] = _mm256_loadu_ps(v + 8 * u);
        for (int r = 0; r < R; r++) {
            const __m256 pj = _mm256_set1_ps(p[r][j]);
            for (int u = 0; u < U; u++) a[r][u] = _mm256_fmadd_ps(pj, vv[u], a[r][u]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++) _mm256_storeu_ps(o[r] + i0 + 8 * u, a[r][u]);
}

#if TSQ_SIMD
/* value_sum sixteen outputs to a register: each output is still one FMA chain in j order (a lane
 * per output), so the width changes no bits, and half the instructions */
static inline __attribute__((always_inline)) void value_sum16(const int R, const float *const *p, const float *vb,
                                                              long lo, long i0, long j0, long j1, int cont, long hd,
                                                              long split, const long *map, float *const *o, const int U) {
    __m512 a[ATT_HEADS][8];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++) a[r][u] = cont ? _mm512_loadu_ps(o[r] + i0 + 16 * u) : _mm512_setzero_ps();
    for (long j = j0; j < j1; j++) {
        const float *v = kv_row(vb, lo + j, hd, split, map) + i0;
        __m512 vv[8];
        for (int u = 0; u < U; u++) vv[u] = _mm512_loadu_ps(v + 16 * u);
        for (int r = 0; r < R; r++) {
            const __m512 pj = _mm512_set1_ps(p[r][j]);
            for (int u = 0; u < U; u++) a[r][u] = _mm512_fmadd_ps(pj, vv[u], a[r][u]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++) _mm512_storeu_ps(o[r] + i0 + 16 * u, a[r][u]);
}
#endif

/* Consecutive rows of one sequence that attend over the same first position go through the
 * attention together, up to ATT_ROWS of them: each block of keys, and of values, is read from L2 or
 * beyond once for all of them and then from L1 (row by row, re-reading the cache took about half of
 * a 512-row chunk after 3.5k positions). Every row keeps its operations and their order: its own
 * scores, softmax and value chains, parked in its outputs between blocks of positions. A token
 * tree's rows, each with its own path (maps[b]), share the cache's positions before split. */
#define ATT_ROWS 8
#define ATT_SPAN 64 /* positions per block of values: 64 of them, 64 outputs wide, are 16 KiB */

/* R heads' attention for B rows (row b: queries q[b * ATT_HEADS + r], outputs o[..], scratch sc[..]
 * of hi[b] - lo + 1 scores rounded up to 8) over positions [lo, hi[b]] of one KV head (hd a multiple
 * of 8; maps NULL for a chain, else row b's tree path maps[b]). Outputs in registers across a block
 * of positions (all of them for one row): 64 at a time for one head (32 for several), then 32, then
 * 8; with AVX-512 128 (64), 64, 16, then 8. */
static inline __attribute__((always_inline)) void attend_rows_r(const int R, const int B, const float *const *q,
                                                                const float *kb, const float *vb, long lo,
                                                                const long *hi, long hd, long split,
                                                                const long *const *maps, float *const *sc,
                                                                float *const *o) {
    long n[ATT_ROWS], nmax = 0;
    __m256 vmx[ATT_ROWS][ATT_HEADS];
    for (int b = 0; b < B; b++) {
        n[b] = hi[b] - lo + 1;
        nmax = n[b] > nmax ? n[b] : nmax;
        for (int r = 0; r < R; r++) vmx[b][r] = _mm256_set1_ps(-INFINITY);
    }
    for (long j = 0; j < nmax; j += 8)
        for (int b = 0; b < B; b++) {
            if (j >= n[b]) continue;
            __m256 s[ATT_HEADS];
            scores8(R, q + b * ATT_HEADS, kb, lo + j, hd, n[b] - j, split, maps ? maps[b] : NULL, s);
            for (int r = 0; r < R; r++) {
                _mm256_storeu_ps(sc[b * ATT_HEADS + r] + j, s[r]);
                vmx[b][r] = _mm256_max_ps(vmx[b][r], s[r]);
            }
        }
    for (int b = 0; b < B; b++)
        for (int r = 0; r < R; r++) softmax8(sc[b * ATT_HEADS + r], n[b], vmx[b][r]);
    const float *const *p = (const float *const *)sc;
    const long span = B > 1 ? ATT_SPAN : nmax;
/* the value sums over one stretch of outputs from i0, block of positions by block, row by row */
#define VALUES(SUM, RR, U)                                                                         \
    for (long j0 = 0; j0 < nmax; j0 += span)                                                          \
        for (int b = 0; b < B; b++)                                                                   \
            if (j0 < n[b])                                                                            \
                SUM(RR, p + b * ATT_HEADS, vb, lo, i0, j0, j0 + span < n[b] ? j0 + span : n[b], j0 > 0, hd, \
                    split, maps ? maps[b] : NULL, o + b * ATT_HEADS, U);
    long i0 = 0;
#if TSQ_SIMD
    if (R == 1)
        for (; i0 + 128 <= hd; i0 += 128) { VALUES(value_sum16, 1, 8) }
    for (; i0 + 64 <= hd; i0 += 64) { VALUES(value_sum16, R, 4) }
    for (; i0 + 16 <= hd; i0 += 16) { VALUES(value_sum16, R, 1) }
#else
    if (R == 1)
        for (; i0 + 64 <= hd; i0 += 64) { VALUES(value_sum, 1, 8) }
    for (; i0 + 32 <= hd; i0 += 32) { VALUES(value_sum, R, 4) }
#endif
    for (; i0 < hd; i0 += 8) { VALUES(value_sum, R, 1) }
#undef VALUES
}

/* a chain's rows (maps NULL, which the compiler folds) or a tree's */
#define ATTEND_ROWS(MAPS)                                                                             \
    switch (R) {                                                                                      \
    case 1: attend_rows_r(1, B, q, kb, vb, lo, hi, hd, split, MAPS, sc, o); break;                    \
    case 2: attend_rows_r(2, B, q, kb, vb, lo, hi, hd, split, MAPS, sc, o); break;                    \
    case 3: if (ATT_HEADS > 2) attend_rows_r(3, B, q, kb, vb, lo, hi, hd, split, MAPS, sc, o); break; \
    default: if (ATT_HEADS > 2) attend_rows_r(4, B, q, kb, vb, lo, hi, hd, split, MAPS, sc, o); break; \
    }
static void attend_rows(int R, int B, const float *const *q, const float *kb, const float *vb, long lo, const long *hi,
                        long hd, long split, const long *const *maps, float *const *sc, float *const *o) {
    if (maps) {
        ATTEND_ROWS(maps)
    } else {
        ATTEND_ROWS(NULL)
    }
}
#undef ATTEND_ROWS
#else
#define ATT_HEADS 1
#define ATT_ROWS 1
#endif

/* One query row's attention over positions [lo, hi] of one KV head: o = softmax(q . k_j) v_j.
 * Each row's float steps depend only on its own span, never on other rows (batch invariance).
 * Head dimensions that are a multiple of 8: a score is eight FMA chains over the head dimension
 * (lane u takes elements 8t + u) reduced ((0+1)+(2+3))+((4+5)+(6+7)); e^(s - max) by exp1's
 * steps, summed in eight lanes (position j in lane j % 8) reduced as sum8; each value element an
 * FMA chain in position order. The AVX2 code (attend_rows, which forward_rows calls for those
 * head dimensions instead of this) does it eight positions or outputs at a time, the plain code
 * here one lane at a time: the same operations, so the same bits. Other head dimensions take a
 * plain loop of their own. sc: scratch for hi - lo + 1 scores, rounded up to 8. */
static inline __attribute__((always_inline)) void attend_row(const float *q, const float *kb, const float *vb, long lo,
                                                            long hi, long hd, long split, const long *map, float *sc,
                                                            float *o) {
    const long n = hi - lo + 1;
#if !TSQ_HAS_AVX2
    if (hd % 8 == 0) { /* the AVX2 code's operations, one lane at a time */
        float mx = -INFINITY;
        for (long j = 0; j < n; j++) {
            const float *k = kv_row(kb, lo + j, hd, split, map);
            float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (long i = 0; i < hd; i += 8)
                for (int u = 0; u < 8; u++) l[u] = fmaf(q[i + u], k[i + u], l[u]);
            sc[j] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
            mx = sc[j] > mx ? sc[j] : mx;
        }
        float vs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (long j = 0; j < n; j++) {
            sc[j] = exp1(sc[j] - mx);
            vs[j % 8] += sc[j];
        }
        const float inv = 1.f / sum8(vs);
        for (long j = 0; j < n; j++) sc[j] = sc[j] * inv;
        for (long i = 0; i < hd; i++) {
            float a = 0.f;
            for (long j = 0; j < n; j++) a = fmaf(sc[j], kv_row(vb, lo + j, hd, split, map)[i], a);
            o[i] = a;
        }
        return;
    }
#endif
    float mx = -INFINITY;
    for (long j = 0; j < n; j++) {
        const float *k = kv_row(kb, lo + j, hd, split, map);
        float l[8] = {0, 0, 0, 0, 0, 0, 0, 0}, t = 0.f;
        long i = 0;
        for (; i + 8 <= hd; i += 8)
            for (int u = 0; u < 8; u++) l[u] += q[i + u] * k[i + u];
        for (; i < hd; i++) t += q[i] * k[i];
        sc[j] = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])) + t;
        if (sc[j] > mx) mx = sc[j];
    }
    float sum = 0.f;
    for (long j = 0; j < n; j++) {
        sc[j] = expf(sc[j] - mx);
        sum += sc[j];
    }
    for (long j = 0; j < n; j++) sc[j] = sc[j] / sum;
    for (long i = 0; i < hd; i++) o[i] = 0.f;
    for (long j = 0; j < n; j++) {
        const float *v = kv_row(vb, lo + j, hd, split, map);
        for (long i = 0; i < hd; i++) o[i] += sc[j] * v[i];
    }
}

/* Blocks [l0, l1) over m rows that belong to ns sequences: rows [row0[s], row0[s+1]) are sequence
 * s's, at positions start[s].. of its own cache (kc[s], vc[s], cap[s] positions per layer and head).
 * Every product runs once over all m rows (batch invariant: a row's result never depends on the
 * others); each row's rope, cache write and attention read only its own sequence's positions. A
 * lone forward is the case ns = 1, so both run exactly this code. */
/* Row r's residual entering layer tap_at[j] (tap_at[j] == l1: after the last) into tap_out at
 * (r * ntap + j) * d: a drafter's tapped rows without splitting the forward into several calls */
static void copy_taps(const float *h, long m, long d, int li, const int *tap_at, int ntap, float *tap_out) {
    for (int j = 0; j < ntap; j++)
        if (tap_at[j] == li)
            for (long r = 0; r < m; r++) memcpy(tap_out + (r * ntap + j) * d, h + r * d, sizeof(float) * d);
}

/* Token trees (tree NULL: every sequence's rows are a chain). A tree row is written to its own slot,
 * start + its index, and takes the position tree->pos[r]: rope, the window and attention take that
 * position, attention reading the cache's first tree->base[s] slots and then the pos - base + 1
 * slots tree->path[tree->off[r]..] in order (its ancestors' and its own, root first), so it gets the
 * bits a chain of its path would give it. The caller lays the paths out (Python's tree_layout); an
 * ancestor may sit in a slot an earlier forward wrote (a tree grown over several forwards). */
typedef struct {
    const long *base; /* [ns] */
    const long *pos;  /* [m] */
    const long *off;  /* [m] */
    const long *path; /* [npath] */
    long npath;
} tree_rows;

/* the first position a row at pos attends to: pos - window + 1 under a sliding window */
static inline long att_lo(long window, long pos) { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }

static int forward_rows(const tsq_config *c, const tsq_layer *layers, int l0, int l1, float *h, long m, long ns,
                        const long *row0, const long *start, float *const *kc, float *const *vc, const long *cap,
                        const float *const *cos_t, const float *const *sin_t, int nt, const int *tap_at, int ntap,
                        float *tap_out, const tree_rows *tree, const uint8_t *prompt) {
    const long d = c->d_model, hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv, f = c->ffn_dim;
    const long qd = nh * hd, kvd = nkv * hd, rep = nh / nkv;
    if (nt < 1) nt = 1;
    if (ns < 1 || row0[0] != 0 || row0[ns] != m || ntap < 0 || (ntap > 0 && !tap_out)) return -3;
    for (int j = 0; j < ntap; j++)
        if (tap_at[j] < l0 || tap_at[j] > l1) return -3;
    long kmax = d > qd ? d : qd;
    if (f > kmax) kmax = f;
    float *x = malloc(sizeof(float) * m * kmax);
    float *qkv = malloc(sizeof(float) * m * (qd + 2 * kvd));
    float *att = malloc(sizeof(float) * m * qd);
    float *gu = malloc(sizeof(float) * m * 2 * f);
    float *y = malloc(sizeof(float) * m * d);
    xgroup *xq = malloc((size_t)tsq_xrow_bytes(kmax) * m);
    long *rseq = malloc(sizeof(long) * m), *rpos = malloc(sizeof(long) * m), *rslot = malloc(sizeof(long) * m);
    long *blk = malloc(sizeof(long) * (m + 1)); /* a layer's blocks of rows for the attention */
    uint8_t *pr = prompt ? calloc(m, 1) : NULL; /* prompt rows (tsq_linear_apply_rows) */
    float *scores = NULL; /* attention scratch, maxpos + 8 floats per head and row a thread takes at once */
    int rc = 0;
    if (!x || !qkv || !att || !gu || !y || !xq || !rseq || !rpos || !rslot || !blk || (prompt && !pr)) { rc = -2; goto done; }
    long maxpos = 0;
    for (long s = 0; s < ns; s++) {
        if (row0[s + 1] < row0[s] || start[s] < 0 || start[s] + row0[s + 1] - row0[s] > cap[s]) { rc = -3; goto done; }
        if (tree && (tree->base[s] < 0 || tree->base[s] > start[s])) { rc = -3; goto done; }
        for (long r = row0[s]; r < row0[s + 1]; r++) {
            rseq[r] = s;
            rslot[r] = start[s] + r - row0[s];
            rpos[r] = tree ? tree->pos[r] : rslot[r];
            if (tree) { /* a path within the paths given, ending at the row's own slot, every slot written */
                const long b = tree->base[s], n = rpos[r] - b + 1, o = tree->off[r];
                if (rpos[r] < b || rpos[r] > rslot[r] || o < 0 || o + n > tree->npath || tree->path[o + n - 1] != rslot[r]) {
                    rc = -3;
                    goto done;
                }
                for (long j = 0; j < n; j++)
                    if (tree->path[o + j] < b || tree->path[o + j] > rslot[r]) { rc = -3; goto done; }
            }
            if (rpos[r] > maxpos) maxpos = rpos[r];
            if (pr) pr[r] = prompt[s] != 0;
        }
    }
    if (!(scores = malloc(sizeof(float) * (maxpos + 8) * ATT_HEADS * ATT_ROWS * nt))) { rc = -2; goto done; }
    for (int li = l0; li < l1 && !rc; li++) {
        const tsq_layer *L = layers + li;
        /* the attention's blocks of rows (attend_rows): consecutive rows of one sequence whose
         * spans start at the same position (a sliding window moves each row's start), up to
         * ATT_ROWS; block i is rows [blk[i], blk[i + 1]) */
        long nblk = 0;
        for (long r = 0; r < m; r++)
            if (r == 0 || r - blk[nblk - 1] >= ATT_ROWS || rseq[r] != rseq[r - 1] ||
                att_lo(L->window, rpos[r]) != att_lo(L->window, rpos[r - 1]))
                blk[nblk++] = r;
        blk[nblk] = m;
        /* attention's work items: a block of rows, a KV head, and a share of its rep query heads
         * (nshare shares of hs, at most ATT_HEADS, the last possibly smaller): enough shares for
         * every thread to have one */
        long nshare = (rep + ATT_HEADS - 1) / ATT_HEADS;
        while (nshare < rep && nblk * nkv * nshare < nt) nshare++;
        const long hs = (rep + nshare - 1) / nshare;
        nshare = (rep + hs - 1) / hs;
        const float *ct = cos_t[L->rope], *st = sin_t[L->rope];
        copy_taps(h, m, d, li, tap_at, ntap, tap_out);
        #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && m >= 4)
        for (long r = 0; r < m; r++) tsq_rms_norm_row(h + r * d, L->attn_norm, d, c->eps, x + r * d);
        if ((rc = tsq_linear_apply_rows(&L->qkv, x, m, qkv, xq, nt, pr))) break;
        const long w3 = qd + 2 * kvd;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && m >= 4)
        for (long r = 0; r < m; r++) {
            float *q = qkv + r * w3, *k = q + qd, *v = k + kvd;
            const long s = rseq[r], pos = rpos[r], cp = cap[s];
            float *kl = kc[s] + (long)li * nkv * cp * hd, *vl = vc[s] + (long)li * nkv * cp * hd;
            for (long hh = 0; hh < nh; hh++) {
                if (L->q_norm) tsq_rms_norm_row(q + hh * hd, L->q_norm, hd, c->eps, q + hh * hd);
                rope_row(q + hh * hd, ct + pos * c->rope_half, st + pos * c->rope_half, c->rope_half, c->rope_neox);
                for (long i = 0; i < hd; i++) q[hh * hd + i] *= c->q_scale;
            }
            for (long hh = 0; hh < nkv; hh++) {
                if (L->k_norm) tsq_rms_norm_row(k + hh * hd, L->k_norm, hd, c->eps, k + hh * hd);
                rope_row(k + hh * hd, ct + pos * c->rope_half, st + pos * c->rope_half, c->rope_half, c->rope_neox);
                memcpy(kl + (hh * cp + rslot[r]) * hd, k + hh * hd, sizeof(float) * hd);
                memcpy(vl + (hh * cp + rslot[r]) * hd, v + hh * hd, sizeof(float) * hd);
            }
        }
#pragma omp parallel num_threads(nt) if (nt > 1 && m * nh > 1)
        {
#ifdef _OPENMP
            float *sc0 = scores + (maxpos + 8) * ATT_HEADS * ATT_ROWS * omp_get_thread_num();
#else
            float *sc0 = scores;
#endif
            /* (block of rows, KV head, share of its query heads) dealt out one at a time: a
             * prompt's later rows attend over more positions, and contiguous shares left one
             * thread with most of the work */
#pragma omp for schedule(static, 1)
            for (long t = 0; t < nblk * nkv * nshare; t++) {
                const long i = t / (nkv * nshare), g = t / nshare % nkv, h0 = g * rep + t % nshare * hs;
                const long r0 = blk[i], nb = blk[i + 1] - r0, s = rseq[r0], cp = cap[s];
                const long lo = att_lo(L->window, rpos[r0]);
                const int nr = (int)(h0 + hs <= (g + 1) * rep ? hs : (g + 1) * rep - h0);
                const float *kb = kc[s] + ((long)li * nkv + g) * cp * hd, *vb = vc[s] + ((long)li * nkv + g) * cp * hd;
                const long split = tree ? tree->base[s] : 0;
                const float *q[ATT_ROWS * ATT_HEADS];
                float *o[ATT_ROWS * ATT_HEADS], *sc[ATT_ROWS * ATT_HEADS];
                long hi[ATT_ROWS];
                const long *maps[ATT_ROWS];
                for (int b = 0; b < nb; b++) {
                    hi[b] = rpos[r0 + b];
                    maps[b] = tree ? tree->path + tree->off[r0 + b] : NULL;
                    for (int j = 0; j < nr; j++) {
                        q[b * ATT_HEADS + j] = qkv + (r0 + b) * w3 + (h0 + j) * hd;
                        o[b * ATT_HEADS + j] = att + (r0 + b) * qd + (h0 + j) * hd;
                        sc[b * ATT_HEADS + j] = sc0 + (maxpos + 8) * (b * ATT_HEADS + j);
                    }
                }
#if TSQ_HAS_AVX2
                if (hd % 8 == 0) {
                    attend_rows(nr, (int)nb, q, kb, vb, lo, hi, hd, split, tree ? maps : NULL, sc, o);
                    continue;
                }
#endif
                for (int b = 0; b < nb; b++)
                    for (int j = 0; j < nr; j++) {
                        const int k = b * ATT_HEADS + j;
                        if (tree)
                            attend_row(q[k], kb, vb, lo, hi[b], hd, split, maps[b], sc[k], o[k]);
                        else
                            attend_row(q[k], kb, vb, lo, hi[b], hd, 0, NULL, sc[k], o[k]);
                    }
            }
        }
        if ((rc = tsq_linear_apply_rows(&L->o, att, m, y, xq, nt, pr))) break;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && m >= 4)
        for (long r = 0; r < m; r++) {
            if (L->post_attn_norm) tsq_rms_norm_row(y + r * d, L->post_attn_norm, d, c->eps, y + r * d);
            for (long i = 0; i < d; i++) h[r * d + i] += y[r * d + i];
            tsq_rms_norm_row(h + r * d, L->ffn_norm, d, c->eps, x + r * d);
        }
        if ((rc = tsq_linear_apply_rows(&L->gate_up, x, m, gu, xq, nt, pr))) break;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && m >= 4)
        for (long r = 0; r < m; r++) tsq_act_row(c->act == 1, gu + r * 2 * f, gu + r * 2 * f + f, x + r * f, f);
        if ((rc = tsq_linear_apply_rows(&L->down, x, m, y, xq, nt, pr))) break;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && m >= 4)
        for (long r = 0; r < m; r++) {
            if (L->post_ffn_norm) tsq_rms_norm_row(y + r * d, L->post_ffn_norm, d, c->eps, y + r * d);
            for (long i = 0; i < d; i++) h[r * d + i] += y[r * d + i];
        }
    }
    if (!rc) copy_taps(h, m, d, l1, tap_at, ntap, tap_out);
done:
    free(x); free(qkv); free(att); free(gu); free(y); free(xq); free(rseq); free(rpos); free(rslot); free(blk); free(scores); free(pr);
    return rc;
}

/* The trunk's output: the final norm and the head's product over m rows of the residual h (d =
 * head->k wide) into logits [m, head->n_total]. One native call where the final norm (torch) and
 * the head (a second call) were: after the blocks have streamed their weights through the caches,
 * torch's few small operations on a lone row cost ~0.1 ms a token, a norm here ~2 us. */
int tsq_output(const tsq_linear *head, const float *norm_w, float eps, const float *h, long m, float *logits, int nt) {
    const long d = head->k;
    float *x = malloc(sizeof(float) * m * d);
    xgroup *xq = malloc((size_t)tsq_xrow_bytes(d) * m);
    int rc = 0;
    if (!x || !xq) {
        rc = -2;
    } else {
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && m >= 4)
        for (long r = 0; r < m; r++) tsq_rms_norm_row(h + r * d, norm_w, d, eps, x + r * d);
        rc = tsq_linear_apply(head, x, m, logits, xq, nt);
    }
    free(x);
    free(xq);
    return rc;
}

/* One sequence: blocks [l0, l1) on m rows at positions start.. of the cache kc/vc. */
int tsq_forward(const tsq_config *c, const tsq_layer *layers, int l0, int l1, float *h, long m, long start,
                float *kc, float *vc, long cap, const float *const *cos_t, const float *const *sin_t,
                int nt) {
    const long row0[2] = {0, m};
    float *const k1[1] = {kc}, *const v1[1] = {vc};
    return forward_rows(c, layers, l0, l1, h, m, 1, row0, &start, k1, v1, &cap, cos_t, sin_t, nt, NULL, 0, NULL, NULL, NULL);
}

/* Several sequences' rows in one pass (see forward_rows): row0[ns + 1], start/kc/vc/cap[ns]; and
 * the residual entering each layer of tap_at[0..ntap) (in [l0, l1]; l1: after the last) copied
 * into tap_out [m, ntap * d], tap j of row r at (r * ntap + j) * d (ntap 0: no taps, tap_out NULL) */
int tsq_forward_batch_taps(const tsq_config *c, const tsq_layer *layers, int l0, int l1, float *h, long m, long ns,
                           const long *row0, const long *start, float *const *kc, float *const *vc, const long *cap,
                           const float *const *cos_t, const float *const *sin_t, int nt, const int *tap_at,
                           int ntap, float *tap_out) {
    return forward_rows(c, layers, l0, l1, h, m, ns, row0, start, kc, vc, cap, cos_t, sin_t, nt, tap_at, ntap,
                        tap_out, NULL, NULL);
}

/* tsq_forward with the rows marked as prompt rows when `prompt` is set (prompt_tiles.c) */
int tsq_forward_prompt(const tsq_config *c, const tsq_layer *layers, int l0, int l1, float *h, long m, long start,
                       float *kc, float *vc, long cap, const float *const *cos_t, const float *const *sin_t, int nt,
                       int prompt) {
    const long row0[2] = {0, m};
    float *const k1[1] = {kc}, *const v1[1] = {vc};
    const uint8_t p1[1] = {(uint8_t)(prompt != 0)};
    return forward_rows(c, layers, l0, l1, h, m, 1, row0, &start, k1, v1, &cap, cos_t, sin_t, nt, NULL, 0, NULL, NULL,
                        p1);
}

/* tsq_forward_batch_taps with prompt[s] set where sequence s's rows are prompt rows */
int tsq_forward_batch_prompt(const tsq_config *c, const tsq_layer *layers, int l0, int l1, float *h, long m, long ns,
                             const long *row0, const long *start, float *const *kc, float *const *vc, const long *cap,
                             const float *const *cos_t, const float *const *sin_t, int nt, const int *tap_at,
                             int ntap, float *tap_out, const uint8_t *prompt) {
    return forward_rows(c, layers, l0, l1, h, m, ns, row0, start, kc, vc, cap, cos_t, sin_t, nt, tap_at, ntap,
                        tap_out, NULL, prompt);
}

/* tsq_forward_batch_taps with token trees, laid out as forward_rows takes them: base[ns], pos[m],
 * off[m] and path[npath] */
int tsq_forward_tree(const tsq_config *c, const tsq_layer *layers, int l0, int l1, float *h, long m, long ns,
                     const long *row0, const long *start, float *const *kc, float *const *vc, const long *cap,
                     const float *const *cos_t, const float *const *sin_t, int nt, const int *tap_at, int ntap,
                     float *tap_out, const long *base, const long *pos, const long *off, const long *path,
                     long npath) {
    const tree_rows t = {base, pos, off, path, npath};
    return forward_rows(c, layers, l0, l1, h, m, ns, row0, start, kc, vc, cap, cos_t, sin_t, nt, tap_at, ntap,
                        tap_out, &t, NULL);
}

/* tsq_forward_tree with prompt[s] set where sequence s's rows are prompt rows (a sequence's prompt
 * chunk sharing a forward with another's token tree) */
int tsq_forward_tree_prompt(const tsq_config *c, const tsq_layer *layers, int l0, int l1, float *h, long m, long ns,
                            const long *row0, const long *start, float *const *kc, float *const *vc, const long *cap,
                            const float *const *cos_t, const float *const *sin_t, int nt, const int *tap_at,
                            int ntap, float *tap_out, const long *base, const long *pos, const long *off,
                            const long *path, long npath, const uint8_t *prompt) {
    const tree_rows t = {base, pos, off, path, npath};
    return forward_rows(c, layers, l0, l1, h, m, ns, row0, start, kc, vc, cap, cos_t, sin_t, nt, tap_at, ntap,
                        tap_out, &t, prompt);
}

