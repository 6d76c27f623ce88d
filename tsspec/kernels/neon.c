/* neon.c: the products at the ARM64 levels: NEON with the dot product extension (ARMv8.2-A
 * +dotprod: Graviton 2 and later, Ampere, Apple M-series) and plain NEON (every AArch64 core).
 * Empty on other targets.
 *
 * The arithmetic is the reference's (products.c's header), so every output equals it bit for bit:
 * per weight row, input row, 128-element group and lane L (16 elements), the exact integer sum of
 * code times input code less the weight offset times the input's code sum, then
 * acc[L] = fma(isum, a[L] * dx[L], acc[L]); Q4_K's offsets into acc ahead of each super-block, Q4_1's
 * into a second set added at the end; the eight lanes reduced as sum8. A 256-bit x86 word is two
 * 128-bit registers here: lanes 0-3 and 4-7.
 *
 * Integer sums. Codes are taken as signed bytes: 0..15, 0..31 and 0..63 for the 4-, 5- and 6-bit
 * types (their offsets come off as on x86), Q8_0's stored signed codes as they are (no offset: the
 * sum is sum(c q) itself, the integer the reference gets as sum((c + 128) q) - 128 sum(q)).
 * - dotprod: SDOT adds each lane's four byte products into an int32 lane, exactly.
 * - plain NEON: SMULL makes int16 products (|c q| <= 128 * 127 = 16,256, no overflow), two pairwise
 *   widening adds make each lane's sum of four in int32, exactly.
 * Float products: eight fma chains (two registers) and sum8, plus the tail in order, as the
 * reference's dot_ref_f. */
#include "tsq.h"

#if TSQ_NEON

/* each int32 lane += the sum of its four byte products */
static inline __attribute__((always_inline)) int32x4_t dot4_neon(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if TSQ_ISA == TSQ_ISA_DOTPROD
    return vdotq_s32(acc, w, x);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x)), hi = vmull_high_s8(w, x);
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}

/* A group's four code words W[j] (xgroup's layout), each as its two halves [j][0] (lanes 0-3) and
 * [j][1] (lanes 4-7); lane scales a and Q4_1's offsets mw, halves likewise. */
typedef struct {
    int8x16_t W[4][2];
    float32x4_t a[2], mw[2];
} ngroup;

/* W[j] = word j of the four blocks' code vectors B[b] (a 4x4 transpose of 32-bit words per half) */
static inline __attribute__((always_inline)) void transpose4_neon(const uint8x16_t B[4][2], int8x16_t W[4][2]) {
    for (int h = 0; h < 2; h++) {
        const uint32x4_t b0 = vreinterpretq_u32_u8(B[0][h]), b1 = vreinterpretq_u32_u8(B[1][h]);
        const uint32x4_t b2 = vreinterpretq_u32_u8(B[2][h]), b3 = vreinterpretq_u32_u8(B[3][h]);
        const uint32x4_t t0 = vtrn1q_u32(b0, b1), t1 = vtrn2q_u32(b0, b1);
        const uint32x4_t t2 = vtrn1q_u32(b2, b3), t3 = vtrn2q_u32(b2, b3);
        W[0][h] = vreinterpretq_s8_u64(vtrn1q_u64(vreinterpretq_u64_u32(t0), vreinterpretq_u64_u32(t2)));
        W[1][h] = vreinterpretq_s8_u64(vtrn1q_u64(vreinterpretq_u64_u32(t1), vreinterpretq_u64_u32(t3)));
        W[2][h] = vreinterpretq_s8_u64(vtrn2q_u64(vreinterpretq_u64_u32(t0), vreinterpretq_u64_u32(t2)));
        W[3][h] = vreinterpretq_s8_u64(vtrn2q_u64(vreinterpretq_u64_u32(t1), vreinterpretq_u64_u32(t3)));
    }
}

static inline __attribute__((always_inline)) void words_as_is(const uint8x16_t B[4][2], int8x16_t W[4][2]) {
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 2; h++) W[j][h] = vreinterpretq_s8_u8(B[j][h]);
}

/* 0x10 in byte e where bit e of the 16-bit half qh16 is set (Q5_0's fifth bits) */
static inline uint8x16_t fifth_bits_neon(uint32_t qh16) {
    static const uint8_t idx[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vqtbl1q_u8(vreinterpretq_u8_u32(vdupq_n_u32(qh16)), vld1q_u8(idx));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bit)), vdupq_n_u8(0x10));
}

/* The four lanes' f16 scales at p (lanes 0-3), widened */
static inline float32x4_t f16x4(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p))); }

/* group g of a legacy-type row (Q4_0, Q4_1, Q5_0, Q8_0) */
static inline __attribute__((always_inline)) void legacy_group(const int type, const uint8_t *w, long g, long nblocks,
                                                               int packed, ngroup *o) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    uint8x16_t B[4][2];
    if (packed && group_major(type) && 4 * g + 4 <= nblocks) { /* a record (tsq_repack): codes stored transposed */
        const uint8_t *rec = w + g * 4L * BLOCK_BYTES[type], *c = rec + gm_codes_at(type);
        o->a[0] = o->a[1] = f16x4(rec);
        o->mw[0] = type == T_Q4_1 ? f16x4(rec + 8) : vdupq_n_f32(0.f);
        o->mw[1] = vdupq_n_f32(0.f);
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                if (type == T_Q8_0) { /* stored as c ^ 0x80 (the unsigned form): back to signed */
                    B[j][h] = veorq_u8(vld1q_u8(c + 32 * j + 16 * h), vdupq_n_u8(0x80));
                } else {
                    const uint8x16_t q = vld1q_u8(c + 32 * (j / 2) + 16 * h);
                    B[j][h] = (j & 1) ? vshrq_n_u8(q, 4) : vandq_u8(q, m4);
                }
            }
        words_as_is(B, o->W);
        return;
    }
    const int bb = BLOCK_BYTES[type];
    float sc[4] = {0, 0, 0, 0}, mn[4] = {0, 0, 0, 0};
    for (int b = 0; b < 4; b++) {
        if (4 * g + b >= nblocks) { /* a short last group: the blocks past the row's end are zero */
            B[b][0] = B[b][1] = vdupq_n_u8(0);
            continue;
        }
        const uint8_t *p = w + (4 * g + b) * bb;
        sc[b] = f16_to_f32(rd16(p));
        if (type == T_Q8_0) {
            B[b][0] = vld1q_u8(p + 2);
            B[b][1] = vld1q_u8(p + 18);
            continue;
        }
        const uint8x16_t q = vld1q_u8(p + (type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : 6));
        B[b][0] = vandq_u8(q, m4);
        B[b][1] = vshrq_n_u8(q, 4);
        if (type == T_Q4_1) mn[b] = f16_to_f32(rd16(p + 2));
        if (type == T_Q5_0) { /* bit e of qh is element e's fifth bit */
            const uint32_t qh = rd32(p + 2);
            B[b][0] = vorrq_u8(B[b][0], fifth_bits_neon(qh & 0xFFFF));
            B[b][1] = vorrq_u8(B[b][1], fifth_bits_neon(qh >> 16));
        }
    }
    o->a[0] = o->a[1] = vld1q_f32(sc);
    o->mw[0] = vld1q_f32(mn);
    o->mw[1] = vdupq_n_f32(0.f);
    if (packed && 4 * g + 4 <= nblocks) /* stored transposed (tsq_repack) */
        words_as_is(B, o->W);
    else
        transpose4_neon(B, o->W);
}

/* group g (half gi = g % 2 of super-block g / 2) of a Q6_K row */
static inline __attribute__((always_inline)) void q6k_group(const uint8_t *w, long g, int packed, ngroup *o) {
    const uint8_t *p = w + (g >> 1) * 210;
    const int gi = (int)(g & 1);
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3);
    uint8x16_t B[4][2];
    for (int h = 0; h < 2; h++) {
        const uint8x16_t ql0 = vld1q_u8(p + 64 * gi + 16 * h), ql1 = vld1q_u8(p + 64 * gi + 32 + 16 * h);
        const uint8x16_t qh = vld1q_u8(p + 128 + 32 * gi + 16 * h);
        for (int u = 0; u < 4; u++) {
            const uint8x16_t ql = (u & 1) ? ql1 : ql0;
            const uint8x16_t lo = u < 2 ? vandq_u8(ql, m4) : vshrq_n_u8(ql, 4);
            const uint8x16_t hi = vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(-2 * u))), m3);
            B[u][h] = vorrq_u8(lo, vshlq_n_u8(hi, 4));
        }
    }
    const int8_t *sc = (const int8_t *)(p + 192) + 8 * gi;
    const float d = f16_to_f32(rd16(p + 208));
    float a[8];
    for (int u = 0; u < 4; u++) { /* lane 4h + u takes sc[2u + h] */
        a[u] = d * (float)sc[2 * u];
        a[u + 4] = d * (float)sc[2 * u + 1];
    }
    o->a[0] = vld1q_f32(a);
    o->a[1] = vld1q_f32(a + 4);
    o->mw[0] = o->mw[1] = vdupq_n_f32(0.f);
    if (packed)
        words_as_is(B, o->W);
    else
        transpose4_neon(B, o->W);
}

/* One weight group against one input row */
static inline __attribute__((always_inline)) void step_neon(const int sh, const int mn, const ngroup *wg,
                                                            const xgroup *xg, float32x4_t acc[2], float32x4_t accm[2]) {
    for (int h = 0; h < 2; h++) {
        int32x4_t is = vdupq_n_s32(0);
        for (int j = 0; j < 4; j++) is = dot4_neon(is, wg->W[j][h], vld1q_s8(xg->q + 32 * j + 16 * h));
        if (sh) is = vsubq_s32(is, vshlq_s32(vld1q_s32(xg->s + 4 * h), vdupq_n_s32(sh)));
        acc[h] = vfmaq_f32(acc[h], vcvtq_f32_s32(is), vmulq_f32(wg->a[h], vld1q_f32(xg->d + 4 * h)));
        if (mn) accm[h] = vfmaq_f32(accm[h], wg->mw[h], vld1q_f32(xg->fs + 4 * h));
    }
}

/* sum8's order over two halves: (0+4, 1+5, 2+6, 3+7), then pairs, then the two */
static inline float hsum8_neon(float32x4_t lo, float32x4_t hi) {
    const float32x4_t s = vaddq_f32(lo, hi);
    const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

#define NTILE 4

static inline __attribute__((always_inline)) void dot_neon_t(const int type, const int tr, const uint8_t *w, long k,
                                                             int packed, const xgroup *x, long xstride, float *y,
                                                             long ldy, long nrows, long rb) {
    const long ng = n_groups(k), nblocks = k / QB;
    /* Q8_0's signed codes carry no offset here (see the header) */
    const int sh = type == T_Q8_0 ? 0 : offset_shift(type), mg = type == T_Q4_1;
    for (long n = 0; n < nrows; n++, w += rb, y++) {
        float32x4_t acc[NTILE][2], accm[NTILE][2];
        for (int r = 0; r < tr; r++) acc[r][0] = acc[r][1] = accm[r][0] = accm[r][1] = vdupq_n_f32(0.f);
        ngroup wg;
        if (type == T_Q4_K) {
            const uint8x16_t m4 = vdupq_n_u8(0x0F);
            for (long sb = 0; sb < ng / 2; sb++) {
                const uint8_t *p = w + sb * 144;
                const float d = f16_to_f32(rd16(p)), dmin = f16_to_f32(rd16(p + 2));
                float sc[8], m8[8];
                for (int j = 0; j < 8; j++) {
                    int s, m;
                    scale_min_k4(j, p + 4, &s, &m);
                    sc[j] = d * (float)s;
                    m8[j] = -(dmin * (float)m);
                }
                const float32x4_t mlo = vld1q_f32(m8), mhi = vld1q_f32(m8 + 4);
                for (int r = 0; r < tr; r++) { /* the super-block's offsets, ahead of its products */
                    const float *fs = x[r * xstride + 2 * sb].fs;
                    acc[r][0] = vfmaq_f32(acc[r][0], mlo, vld1q_f32(fs));
                    acc[r][1] = vfmaq_f32(acc[r][1], mhi, vld1q_f32(fs + 4));
                }
                for (int gi = 0; gi < 2; gi++) {
                    const uint8_t *q = p + 16 + 64 * gi;
                    uint8x16_t B[4][2];
                    for (int h = 0; h < 2; h++) {
                        const uint8x16_t q0 = vld1q_u8(q + 16 * h), q1 = vld1q_u8(q + 32 + 16 * h);
                        B[0][h] = vandq_u8(q0, m4);
                        B[1][h] = vshrq_n_u8(q0, 4);
                        B[2][h] = vandq_u8(q1, m4);
                        B[3][h] = vshrq_n_u8(q1, 4);
                    }
                    if (packed)
                        words_as_is(B, wg.W);
                    else
                        transpose4_neon(B, wg.W);
                    wg.a[0] = wg.a[1] = vld1q_f32(sc + 4 * gi);
                    for (int r = 0; r < tr; r++) step_neon(0, 0, &wg, x + r * xstride + 2 * sb + gi, acc[r], accm[r]);
                }
            }
        } else {
            for (long g = 0; g < ng; g++) {
                if (type == T_Q6_K)
                    q6k_group(w, g, packed, &wg);
                else
                    legacy_group(type, w, g, nblocks, packed, &wg);
                for (int r = 0; r < tr; r++) step_neon(sh, mg, &wg, x + r * xstride + g, acc[r], accm[r]);
            }
        }
        for (int r = 0; r < tr; r++)
            y[r * ldy] = mg ? hsum8_neon(vaddq_f32(acc[r][0], accm[r][0]), vaddq_f32(acc[r][1], accm[r][1]))
                            : hsum8_neon(acc[r][0], acc[r][1]);
    }
}

static void dot_neon(int type, int tr, const uint8_t *w, long k, int pk, const xgroup *x, long xs, float *y, long ldy,
                     long nrows, long rb) {
#define NE(T, n) dot_neon_t(T, n, w, k, pk, x, xs, y, ldy, nrows, rb)
    TSQ_DISPATCH4(type, tr, NE)
#undef NE
}

#define NEON_BLOCK_BYTES (128 * 1024) /* weight bytes a block of rows may span and stay in L2 */

/* y[m, n_rows] = the quantized input xq against W's rows (tsq_matmul's contract) */
TSQ_INTERNAL int tsq_matmul_neon(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k,
                                 const xgroup *xq, long m, float *y, long ldy, int n_threads) {
    return tsq_matmul_rowtiles(dot_neon, NEON_BLOCK_BYTES, NTILE, type, w, packed, row_bytes, n_rows, k, xq, m, y, ldy,
                             n_threads);
}

/* y[0] = x . W's row w of k float elements (dot_ref_f's operations) */
TSQ_INTERNAL void tsq_dot_neon_f(int type, const uint8_t *w, long k, const float *x, float *y) {
    float32x4_t lo = vdupq_n_f32(0.f), hi = vdupq_n_f32(0.f);
    const long k8 = k & ~7L;
    for (long i = 0; i < k8; i += 8) {
        float32x4_t w0, w1;
        if (type == T_F32) {
            w0 = vld1q_f32((const float *)w + i);
            w1 = vld1q_f32((const float *)w + i + 4);
        } else if (type == T_F16) {
            w0 = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + 2 * i)));
            w1 = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + 2 * i + 8)));
        } else {
            w0 = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(w + 2 * i)), 16));
            w1 = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(w + 2 * i + 8)), 16));
        }
        lo = vfmaq_f32(lo, w0, vld1q_f32(x + i));
        hi = vfmaq_f32(hi, w1, vld1q_f32(x + i + 4));
    }
    float tail = 0.f;
    for (long i = k8; i < k; i++) {
        const float v = type == T_F32 ? ((const float *)w)[i]
                      : type == T_F16 ? f16_to_f32(rd16(w + 2 * i)) : bf16_to_f32(rd16(w + 2 * i));
        tail += v * x[i];
    }
    *y = hsum8_neon(lo, hi) + tail;
}

#endif /* TSQ_NEON */
