/* prompt_tiles.c: Q4_K and Q6_K products with one float step per 256-element super-block, on
 * AMX-INT8 tiles (issue 47's super-block route), for prompt rows.
 *
 * The arithmetic (not the one the other products share: see products.c's header; this one rounds
 * otherwise, so only rows that every run forwards alike may take it, which prompt rows are):
 *   input rows quantized per 256-element super-block s: int8 codes x (|x| <= 127), one float
 *   dx = amax / 127, and the eight 32-element code sums xs_j (tsq_quantize_sb);
 *   per weight row and super-block, with sc_j and m_j its 6-bit sub-block scales and minimums,
 *   d and dmin its two f16 factors and q its 4-bit codes:
 *     S = sum_j sc_j * sum_{e in j} q_e x_e,   M = sum_j m_j * xs_j   (exact integers, |S| < 2^25)
 *     acc = fma((float)S, d * dx, acc);  acc = fma(-(float)M, dmin * dx, acc)
 *   in super-block order from acc = 0. sb_reference does exactly this one element at a time.
 *   Q6_K (sb_ref_q6k): S = sum_j sc_j * sum_{e in j} (q_e - 32) x_e over its sixteen
 *   16-element sub-blocks, sc_j signed bytes, and acc = fma((float)S, d * dx, acc): no M.
 *
 * On the tiles, sc = 8 sh + sl (sh, sl <= 7), so the A operands q sh and q sl (<= 105) fit a signed
 * byte; TDPBSSD sums them against the input codes exactly in any order, and S = 8 C_hi + C_lo. The
 * minimums leave the tiles: M by four VPDPWSSD a weight row from the 32-element sums as int16 pairs.
 * Q6_K's element products v = (q - 32) sc (|v| <= 4096) split as v = 128 hi + lo (lo = v & 127, hi
 * = v >> 7), each a signed byte: two A operands a chunk as for Q4_K, S = 128 C_hi + C_lo.
 * The weights stay as stored (the file's blocks, or tsq_repack's transposed codes): each 16-row panel's
 * super-block is unpacked in registers straight into the A operands (a byte permute through a
 * 128-entry table of q f, index q | f << 4), and the input's B operands take the same element order
 * (sb_perm), so no copy of the weights is kept. Per panel the next super-block is unpacked before
 * this one's tile products are issued, input tiles go in pairs (four accumulators, each A tile
 * loaded once for both), and a pair's float steps run after the next pair's products are issued
 * (a vector load right behind a tile store waits for it). Where a chunk's input operands outgrow
 * L2, panels go in groups that take each input tile in turn (sb_group_body). scripts/bf16_q4k.c measured this form as
 * a model before it was built here.
 *
 * mode 0 runs sb_reference (any CPU), 1 the tiles (AMX and the kernel's permission), 2 the same
 * sequence with the tile instructions done in C (any CPU with the AVX-512 level and VBMI), so the
 * tiles' data movement and float steps are tested where there are no tiles.
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "tsq.h"

#if TSQ_SIMD && defined(__AVX512VBMI__) && defined(__x86_64__) && defined(__GNUC__) &&                          \
    (__GNUC__ >= 11 || (defined(__clang__) && __clang_major__ >= 12))
#define SB_TILES 1
#include <immintrin.h>
#define SB_AMX __attribute__((target("amx-tile,amx-int8")))
#else
#define SB_TILES 0
#endif

#define SB 256
#define SB_TR 16                       /* rows of a tile: weight rows (A, C), input rows (C's columns) */
#define SB_OP (4 * 1024)               /* one A operand of a panel's super-block: 4 chunks x 16 rows x 64 */
#define SB_BT (4 * 1024)               /* one input tile's B operands of one super-block */
#ifndef SB_GROUP
#define SB_GROUP 8 /* panels that take each input tile in turn (where the input outgrows L2) */
#endif
#define SB_GRAB 4 /* panels a thread takes at a time otherwise */
#ifndef SB_L2_INPUT
#define SB_L2_INPUT (1L << 20) /* input operands (bytes) past which panels go in groups */
#endif
#define SB_BLOCK_BYTES (8L << 20)      /* input tiles a panel takes in one pass (512 rows of 8960: all of them) */

/* ------------------------------------------------------------------ the input, per super-block */

/* x [m, k] (k a multiple of 256) -> codes q [m, k], dx [m, k / 256], xs [m, k / 32] (the
 * 32-element sums of q). A row's result depends on that row alone. */
void tsq_quantize_sb(const float *x, long m, long k, int8_t *q, float *dx, int16_t *xs, int nt) {
    const long nsb = k / SB;
    if (nt < 1) nt = 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && m >= 4)
    for (long r = 0; r < m; r++)
        for (long s = 0; s < nsb; s++) {
            const float *v = x + r * k + s * SB;
            int8_t *o = q + r * k + s * SB;
            int16_t *sums = xs + (r * nsb + s) * 8;
#if TSQ_SIMD /* the same operations sixteen elements at a time (max is exact in any order) */
            __m512 mx = _mm512_setzero_ps();
            for (int i = 0; i < SB; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
            const float amax = _mm512_reduce_max_ps(mx);
#elif TSQ_HAS_AVX2 /* eight at a time */
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 mx = _mm256_setzero_ps();
            for (int i = 0; i < SB; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
            float amax = 0.0f;
            for (int i = 0; i < SB; i++) {
                const float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
#endif
            const float iscale = amax > 0.0f ? 127.0f / amax : 0.0f;
            dx[r * nsb + s] = amax > 0.0f ? amax / 127.0f : 0.0f;
#if TSQ_SIMD /* each code stored as a byte straight from its lane (|c| <= 127) */
            const __m512 is = _mm512_set1_ps(iscale), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
            for (int j = 0; j < 8; j++) {
                __m512i acc = _mm512_setzero_si512();
                for (int i = 0; i < 32; i += 16) {
                    __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(v + 32 * j + i), is),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
                    const __m512i c = _mm512_cvtps_epi32(t);
                    acc = _mm512_add_epi32(acc, c);
                    _mm_storeu_si128((__m128i *)(o + 32 * j + i), _mm512_cvtepi32_epi8(c));
                }
                sums[j] = (int16_t)_mm512_reduce_add_epi32(acc);
            }
#elif TSQ_HAS_AVX2
            const __m256 is = _mm256_set1_ps(iscale), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
            for (int j = 0; j < 8; j++) {
                __m256i acc = _mm256_setzero_si256();
                int32_t c32[32];
                for (int i = 0; i < 32; i += 8) {
                    __m256 t = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * j + i), is),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
                    const __m256i c = _mm256_cvtps_epi32(t);
                    acc = _mm256_add_epi32(acc, c);
                    _mm256_storeu_si256((__m256i *)(c32 + i), c);
                }
                for (int i = 0; i < 32; i++) o[32 * j + i] = (int8_t)c32[i];
                __m128i a4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
                a4 = _mm_add_epi32(a4, _mm_shuffle_epi32(a4, 0x4e));
                a4 = _mm_add_epi32(a4, _mm_shuffle_epi32(a4, 0xb1));
                sums[j] = (int16_t)_mm_cvtsi128_si32(a4);
            }
#else
            for (int j = 0; j < 8; j++) {
                int sum = 0;
                for (int i = 0; i < 32; i++) {
                    float t = rintf(v[32 * j + i] * iscale); /* to nearest, ties to even */
                    t = t < -127.0f ? -127.0f : t > 127.0f ? 127.0f : t;
                    const int c = (int)t;
                    o[32 * j + i] = (int8_t)c;
                    sum += c;
                }
                sums[j] = (int16_t)sum;
            }
#endif
        }
}

/* ------------------------------------------------------------------ the reference */

/* the 4-bit code of element e (0..255) of a Q4_K super-block whose codes start at qs, as stored
 * (packed: tsq_repack's transposed words, products.c transpose_codes) */
static inline int q4k_code(const uint8_t *qs, int packed, int e) {
    int byte, hi;
    if (!packed) {
        byte = 32 * (e / 64) + e % 32;
        hi = (e % 64) / 32;
    } else { /* group h, sub-block b of it, element i of that: word 4 (i / 16) + b of vector j */
        const int h = e / 128, b = (e % 128) / 32, i = e % 32, j = (i % 16) / 4;
        byte = 64 * h + 32 * (j / 2) + 4 * (4 * (i / 16) + b) + i % 4;
        hi = j & 1;
    }
    return hi ? qs[byte] >> 4 : qs[byte] & 15;
}

/* one Q4_K super-block's float steps for one input row: acc in, acc out (xsr: the row's eight
 * 32-element code sums of this super-block) */
static float sb_ref_q4k(const uint8_t *blk, int packed, const int8_t *xc, const int16_t *xsr, float dxv, float acc) {
    int32_t S = 0, M = 0;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min_k4(j, blk + 4, &sc, &mn);
        int32_t isum = 0;
        for (int e = 32 * j; e < 32 * j + 32; e++) isum += q4k_code(blk + 16, packed, e) * xc[e];
        S += sc * isum;
        M += mn * xsr[j];
    }
    acc = fmaf((float)S, f16_to_f32(rd16(blk)) * dxv, acc);
    return fmaf(-(float)M, f16_to_f32(rd16(blk + 2)) * dxv, acc);
}

/* the 6-bit code of element e (0..255) of a Q6_K super-block blk, as stored (packed: tsq_repack's
 * transposed words, products.c transpose_codes: element 32 b + 16 hh + 4 j + r of a half sits in byte
 * 4 (4 hh + b) + r of its code vector j) */
static inline int q6k_code(const uint8_t *blk, int packed, int e) {
    const int h = e / 128, l = e % 128;
    int u, i; /* code vector u (0..3), byte i (0..31) of half h */
    if (!packed) {
        u = l / 32;
        i = l % 32;
    } else {
        const int b = l / 32, hh = (l % 32) / 16;
        u = (l % 16) / 4;
        i = 4 * (4 * hh + b) + l % 4;
    }
    const int v = blk[64 * h + 32 * (u & 1) + i], hi = (blk[128 + 32 * h + i] >> (2 * u)) & 3;
    return ((u < 2) ? (v & 15) : (v >> 4)) | (hi << 4);
}

/* Q6_K's super-block arithmetic, one super-block of one input row: S = sum_j sc_j * sum_{e in j}
 * (q_e - 32) x_e over its sixteen 16-element sub-blocks (sc_j the signed 8-bit scales; exact,
 * |S| < 2^28), then acc = fma((float)S, d * dx, acc) */
static float sb_ref_q6k(const uint8_t *blk, int packed, const int8_t *xc, float dxv, float acc) {
    int32_t S = 0;
    for (int j = 0; j < 16; j++) {
        int32_t isum = 0;
        for (int e = 16 * j; e < 16 * j + 16; e++) isum += (q6k_code(blk, packed, e) - 32) * xc[e];
        S += (int8_t)blk[192 + j] * isum;
    }
    return fmaf((float)S, f16_to_f32(rd16(blk + 208)) * dxv, acc);
}

/* the reference: every weight row against every input row, super-block by super-block from acc = 0 */
static void sb_reference(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const int8_t *q,
                         const float *dx, const int16_t *xs, long m, float *y, long ldy, int nt) {
    const long nsb = k / SB, bb = type == T_Q6_K ? 210 : 144;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && n >= 64)
    for (long i = 0; i < n; i++)
        for (long c = 0; c < m; c++) {
            float acc = 0.0f;
            for (long s = 0; s < nsb; s++) {
                const uint8_t *blk = w + i * row_bytes + s * bb;
                const int8_t *xc = q + c * k + s * SB;
                const float dxv = dx[c * nsb + s];
                acc = type == T_Q6_K ? sb_ref_q6k(blk, packed, xc, dxv, acc)
                                     : sb_ref_q4k(blk, packed, xc, xs + (c * nsb + s) * 8, dxv, acc);
            }
            y[c * ldy + i] = acc;
        }
}

#if SB_TILES
/* ------------------------------------------------------------------ the tiles */

/* Where the A operands' bytes come from. A panel's super-block is unpacked as chunks c = 2 h + nib
 * (h: the 128-element group, nib: low or high nibbles of its 64 stored bytes); byte p of chunk c is
 * super-block element perm[c][p], of sub-block perm[c][p] / 32. */
static void sb_perm(int type, int packed, int perm[4][64]) {
    for (int c = 0; c < 4; c++)
        for (int p = 0; p < 64; p++) {
            const int h = c / 2, nib = c % 2;
            if (type == T_Q6_K) { /* code vector u = 2 nib + p / 32 of half h, its byte i */
                const int u = 2 * nib + p / 32, i = p % 32, W = i / 4;
                perm[c][p] = packed ? 128 * h + 32 * (W % 4) + 16 * (W / 4) + 4 * u + i % 4 : 128 * h + 32 * u + i;
            } else if (!packed) {
                perm[c][p] = 64 * (2 * h + p / 32) + 32 * nib + p % 32;
            } else {
                const int j = nib + 2 * (p / 32), pp = p % 32, L = pp / 4;
                perm[c][p] = 128 * h + 32 * (L % 4) + 16 * (L / 4) + 4 * j + pp % 4;
            }
        }
}

typedef struct { /* the input tiles' operands, super-block major (a panel's pass over one super-block
                   reads them in one run) */
    int8_t *B;   /* [s][t][chunk 4][K/4 16][col 16][4] */
    int32_t *xp; /* [s][t][pair 4][col 16]: (xs_2q, xs_2q+1) as int16 pairs */
    float *dx;   /* [s][t][col 16] */
    long ntile;  /* tiles t */
} sb_input;

/* col[c] lane i = r[i] lane c: a 16 x 16 transpose of 32-bit elements in registers (unpacks, then
 * 128-bit lane moves) */
static inline __attribute__((always_inline)) void transpose16(const __m512 r[16], __m512 col[16]) {
    __m512 t[16], u[16];
    for (int k = 0; k < 8; k++) { /* lane L: rows 2k, 2k+1 at columns 4L, 4L+1 (lo) and 4L+2, 4L+3 (hi) */
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int g = 0; g < 4; g++) { /* u[4g + j], lane L: rows 4g..4g+3 at column 4L + j */
        u[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88),
                     v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
        col[j] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        col[j + 8] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
        col[j + 4] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        col[j + 12] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
}

/* the index of input tile t's operands for super-block s */
static inline long sb_at(const sb_input *in, long t, long s) { return s * in->ntile + t; }

static void sb_prepare(const int8_t *q, const float *dx, const int16_t *xs, long m, long k, const int perm[4][64],
                       const sb_input *in, int nt) {
    const long nsb = k / SB, ntile = (m + SB_TR - 1) / SB_TR;
    /* chunk c takes bytes of group c / 2 only: one two-table byte permute of that group's 128 codes
     * per input, then the tile's 16 inputs transposed as 4-byte words (B row kk holds each input's
     * word kk; in registers where sixteen 16-way scatters were: from 1.8% of a qwen2.5-coder-1.5b
     * prefill's perf samples to 1.0%, the products' time within noise) */
    uint8_t idxb[4][64] __attribute__((aligned(64)));
    for (int c = 0; c < 4; c++)
        for (int p = 0; p < 64; p++) idxb[c][p] = (uint8_t)(perm[c][p] - 128 * (c / 2));
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && ntile * nsb > 1)
    for (long ts = 0; ts < ntile * nsb; ts++) {
        const long t = ts / nsb, s = ts % nsb, at = sb_at(in, t, s);
        int8_t *B = in->B + at * SB_BT;
        int32_t *xp = in->xp + at * 64;
        float *d = in->dx + at * SB_TR;
        const long live = m - t * SB_TR < SB_TR ? m - t * SB_TR : SB_TR; /* input rows; the rest zero */
        for (int c = 0; c < 4; c++) {
            __m512 v[16], rows[16];
            for (int col = 0; col < SB_TR; col++) {
                const int8_t *x = q + (t * SB_TR + col) * k + s * SB + 128 * (c / 2);
                v[col] = col < live ? _mm512_castsi512_ps(_mm512_permutex2var_epi8(
                                          _mm512_loadu_si512(x), _mm512_load_si512(idxb[c]), _mm512_loadu_si512(x + 64)))
                                    : _mm512_setzero_ps();
            }
            transpose16(v, rows); /* B row kk: each input's 4-byte word kk */
            for (int kk = 0; kk < 16; kk++) _mm512_store_ps((float *)(B + c * 1024 + kk * 64), rows[kk]);
        }
        for (int col = 0; col < SB_TR; col++) {
            const long r = t * SB_TR + col;
            if (col >= live) {
                for (int p = 0; p < 4; p++) xp[p * 16 + col] = 0;
                d[col] = 0.0f;
                continue;
            }
            const int16_t *sums = xs + (r * nsb + s) * 8;
            for (int p = 0; p < 4; p++)
                xp[p * 16 + col] = (int32_t)(((uint32_t)(uint16_t)sums[2 * p + 1] << 16) | (uint16_t)sums[2 * p]);
            d[col] = dx[r * nsb + s];
        }
    }
}

/* q f for f = 0..7 and q = 0..15, at f << 4 | q: the A operands' byte permute */
static const int8_t QF[128] __attribute__((aligned(64))) = {
#define QF_ROW(f) 0, f, 2 * f, 3 * f, 4 * f, 5 * f, 6 * f, 7 * f, 8 * f, 9 * f, 10 * f, 11 * f, 12 * f, 13 * f, 14 * f, 15 * f
    QF_ROW(0), QF_ROW(1), QF_ROW(2), QF_ROW(3), QF_ROW(4), QF_ROW(5), QF_ROW(6), QF_ROW(7)
#undef QF_ROW
};

typedef struct { /* a panel's weight rows' factors for one super-block */
    float d[SB_TR], dmin[SB_TR];
    int32_t mp[SB_TR][4]; /* (m_2q, m_2q+1) as int16 pairs */
} sb_meta;

/* Weight row r of a panel, super-block blk: its A operands (A + (op * 4 + c) * 1024 + r * 64, op 0
 * q sh, op 1 q sl) and factors. sel[c]: per byte of chunk c, the sub-block (0..7) it belongs to. */
static inline __attribute__((always_inline)) void sb_unpack_row(const uint8_t *blk, const __m512i sel[4], int8_t *A,
                                                                int r, sb_meta *meta) {
    uint64_t sc, mn; /* the eight 6-bit scales and minimums as bytes */
    scales_mins_k4(blk + 4, &sc, &mn);
    const uint64_t l3 = 0x0707070707070707ull;
    _mm_store_si128((__m128i *)meta->mp[r], _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn)));
    /* d and dmin by F16C (the reference's f16_to_f32 values; only a signalling NaN's payload could differ) */
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)rd32(blk)));
    meta->d[r] = _mm_cvtss_f32(dd);
    meta->dmin[r] = _mm_cvtss_f32(_mm_movehdup_ps(dd));
    /* f = (sc >> 3) << 4 for bytes 0-7, (sc & 7) << 4 for 8-15 */
    const __m512i F = _mm512_broadcast_i32x4(
        _mm_set_epi64x((long long)((sc & l3) << 4), (long long)(((sc >> 3) & l3) << 4)));
    const __m512i t0 = _mm512_load_si512(QF), t1 = _mm512_load_si512(QF + 64), m4 = _mm512_set1_epi8(15);
    const __m512i eight = _mm512_set1_epi8(8);
    for (int h = 0; h < 2; h++) {
        const __m512i Q = _mm512_loadu_si512(blk + 16 + 64 * h);
        const __m512i nibs[2] = {_mm512_and_si512(Q, m4), _mm512_and_si512(_mm512_srli_epi16(Q, 4), m4)};
        for (int nib = 0; nib < 2; nib++) {
            const int c = 2 * h + nib;
            const __m512i fh = _mm512_shuffle_epi8(F, sel[c]), fl = _mm512_shuffle_epi8(F, _mm512_add_epi8(sel[c], eight));
            _mm512_store_si512(A + c * 1024 + r * 64,
                               _mm512_permutex2var_epi8(t0, _mm512_or_si512(nibs[nib], fh), t1));
            _mm512_store_si512(A + SB_OP + c * 1024 + r * 64,
                               _mm512_permutex2var_epi8(t0, _mm512_or_si512(nibs[nib], fl), t1));
        }
    }
}

/* Q6_K's weight row r, super-block blk: two A operands a chunk from each element's exact product
 * v = (q - 32) sc (|v| <= 4096), v = 128 hi + lo with lo = v & 127 and hi = v >> 7 (-32..32), both
 * signed bytes: A + (op * 4 + chunk) * 1024 + r * 64 for op 0 (hi), 1 (lo); S = 128 C_hi + C_lo. sel[c]:
 * per byte of chunk c, its 16-element sub-block (0..15). Chunk 2 h + nib is code vectors 2 nib and
 * 2 nib + 1 of half h (q6k_codes512's vectors, one half at a time). Made here two to a register
 * rather than through products.c's q6k_codes512, which fills all of each of four vectors: taking a
 * half of each (same bits) made the Q6_K products 1.03-1.05x slower at 9 and 512 rows. (Three
 * operands, the scale's base-8 digits in -3..4 times q - 32, took 12 tile products a super-block
 * and input tile where these take 8.) */
static inline __attribute__((always_inline)) void sb_unpack_row_q6k(const uint8_t *blk, const __m512i sel[4],
                                                                    int8_t *A, int r, sb_meta *meta) {
    const __m512i SC = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk + 192)));
    meta->d[r] = _cvtsh_ss(rd16(blk + 208));
    const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3), k32 = _mm512_set1_epi8(32);
    const __m512i low7 = _mm512_set1_epi16(127);
    const __mmask64 odd = 0xAAAAAAAAAAAAAAAAULL;
    for (int h = 0; h < 2; h++) {
        const __m512i Q = _mm512_loadu_si512(blk + 64 * h);
        const __m512i QH = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
        for (int nib = 0; nib < 2; nib++) {
            const int c = 2 * h + nib;
            /* vector 2 nib in the low 256 bits, 2 nib + 1 in the high: qh's bits 4 nib (+ 2 above) */
            const __m512i shift = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(4 * nib)),
                                                          _mm512_set1_epi16((short)(4 * nib + 2)));
            const __m512i lo = nib ? _mm512_and_si512(_mm512_srli_epi16(Q, 4), m4) : _mm512_and_si512(Q, m4);
            const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(QH, shift), m3);
            const __m512i v = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)), k32);
            const __m512i sc = _mm512_shuffle_epi8(SC, sel[c]);
            /* even and odd bytes as signed 16-bit lanes, their exact products */
            const __m512i pe = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8),
                                                  _mm512_srai_epi16(_mm512_slli_epi16(sc, 8), 8));
            const __m512i po = _mm512_mullo_epi16(_mm512_srai_epi16(v, 8), _mm512_srai_epi16(sc, 8));
            _mm512_store_si512(A + c * 1024 + r * 64,
                               _mm512_mask_blend_epi8(odd, _mm512_srai_epi16(pe, 7),
                                                      _mm512_slli_epi16(_mm512_srai_epi16(po, 7), 8)));
            _mm512_store_si512(A + (4 + c) * 1024 + r * 64,
                               _mm512_mask_blend_epi8(odd, _mm512_and_si512(pe, low7),
                                                      _mm512_slli_epi16(_mm512_and_si512(po, low7), 8)));
        }
    }
}

/* a panel's super-block s: rows r0..r0 + nr of W, the rest zero (q6: Q6_K, else Q4_K) */
static inline __attribute__((always_inline)) void sb_unpack(const uint8_t *w, long row_bytes, long r0, long nr, long s,
                                                            const __m512i sel[4], int8_t *A, sb_meta *meta,
                                                            const int q6) {
    const long sbb = q6 ? 210 : 144;
    for (int r = 0; r < nr; r++) {
        const uint8_t *blk = w + (r0 + r) * row_bytes + s * sbb;
        /* the super-block after this one, every line of it: sixteen rows apart, no prefetcher sees them
         * as a stream (qwen2.5-coder-1.5b's shapes with weights past L3: products 0.88-0.97x the time);
         * after a row's last, the first of the row sixteen on, which the next panel starts with (a
         * prefetch past the matrix's end is only a hint) */
        const uint8_t *next = (s + 1) * sbb < row_bytes ? blk + sbb : w + (r0 + r + SB_TR) * row_bytes;
        for (long o = 0; o < sbb; o += 64) _mm_prefetch((const char *)next + o, _MM_HINT_T0);
        if (q6)
            sb_unpack_row_q6k(blk, sel, A, r, meta);
        else
            sb_unpack_row(blk, sel, A, r, meta);
    }
    for (int r = (int)nr; r < SB_TR; r++) {
        for (int c = 0; c < 8; c++) memset(A + c * 1024 + r * 64, 0, 64);
        meta->d[r] = meta->dmin[r] = 0.0f;
        memset(meta->mp[r], 0, sizeof meta->mp[r]);
    }
}

/* The tile products of one super-block for input tiles b0 and (pair) b1: c[0], c[1] = C_hi, C_lo of
 * b0; c[2], c[3] those of b1. tmm0-3 the sums, tmm4/5 A_hi/A_lo of a chunk, tmm6/7 B of b0/b1. */
static const struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} SB_CFG = {.palette_id = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

static SB_AMX void sb_tiles_begin(void) { _tile_loadconfig(&SB_CFG); }
static SB_AMX void sb_tiles_end(void) { _tile_release(); }

static inline SB_AMX void sb_products_hw(const int8_t *A, const int8_t *b0, const int8_t *b1, int pair,
                                         int32_t (*c)[256]) {
    _tile_zero(0);
    _tile_zero(1);
    if (pair) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int ch = 0; ch < 4; ch++) {
        _tile_loadd(4, A + ch * 1024, 64);
        _tile_loadd(5, A + SB_OP + ch * 1024, 64);
        _tile_loadd(6, b0 + ch * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 5, 6);
        if (pair) {
            _tile_loadd(7, b1 + ch * 1024, 64);
            _tile_dpbssd(2, 4, 7);
            _tile_dpbssd(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (pair) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
    }
}

/* TDPBSSD in C: c[r][n] += sum over kk < 64 of A[r][kk] B[kk / 4][4 n + kk % 4], signed bytes;
 * integer sums, so the instruction's result */
static void sb_dp_emu(const int8_t *A, const int8_t *B, int32_t *c) {
    for (int r = 0; r < SB_TR; r++)
        for (int n = 0; n < SB_TR; n++) {
            int32_t s = 0;
            for (int kk = 0; kk < 64; kk++) s += (int32_t)A[r * 64 + kk] * B[(kk / 4) * 64 + 4 * n + kk % 4];
            c[r * SB_TR + n] += s;
        }
}

static void sb_products_emu(const int8_t *A, const int8_t *b0, const int8_t *b1, int pair, int32_t (*c)[256]) {
    for (int u = 0; u < (pair ? 4 : 2); u++) memset(c[u], 0, sizeof c[u]);
    for (int ch = 0; ch < 4; ch++) {
        sb_dp_emu(A + ch * 1024, b0 + ch * 1024, c[0]);
        sb_dp_emu(A + SB_OP + ch * 1024, b0 + ch * 1024, c[1]);
        if (pair) {
            sb_dp_emu(A + ch * 1024, b1 + ch * 1024, c[2]);
            sb_dp_emu(A + SB_OP + ch * 1024, b1 + ch * 1024, c[3]);
        }
    }
}

/* Q6_K's float step for weight row r against 16 inputs: acc = fma(128 C_hi + C_lo, d dx, acc), acc 0
 * at the first super-block (first: a is not read) */
static inline __attribute__((always_inline)) void sb_float_step6(const sb_meta *meta, int r, const int32_t *chi,
                                                                 const int32_t *clo, __m512 dx, float *a,
                                                                 const int first) {
    const __m512i si = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(chi), 7), _mm512_load_si512(clo));
    _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(_mm512_set1_ps(meta->d[r]), dx),
                                       first ? _mm512_setzero_ps() : _mm512_load_ps(a)));
}

/* one weight row's float steps for one input tile and super-block (the reference's, 16 inputs at
 * once): acc = fma(S, d dx, acc), acc = fma(-M, dmin dx, acc); acc 0 at the first (a not read) */
static inline __attribute__((always_inline)) void sb_float_step(const sb_meta *meta, int r, const int32_t *chi,
                                                                const int32_t *clo, const int32_t *xp, __m512 dx,
                                                                float *a, const int first) {
    const __m512i si = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(chi), 3), _mm512_load_si512(clo));
    __m512i mi = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_load_si512(xp), _mm512_set1_epi32(meta->mp[r][0]));
    mi = _mm512_dpwssd_epi32(mi, _mm512_load_si512(xp + 16), _mm512_set1_epi32(meta->mp[r][1]));
    mi = _mm512_dpwssd_epi32(mi, _mm512_load_si512(xp + 32), _mm512_set1_epi32(meta->mp[r][2]));
    mi = _mm512_dpwssd_epi32(mi, _mm512_load_si512(xp + 48), _mm512_set1_epi32(meta->mp[r][3]));
    __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(_mm512_set1_ps(meta->d[r]), dx),
                               first ? _mm512_setzero_ps() : _mm512_load_ps(a));
    v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mi), _mm512_mul_ps(_mm512_set1_ps(meta->dmin[r]), dx), v);
    _mm512_store_ps(a, v);
}

/* a[r][c] (16 x 16) to y[c * ldy + r] for r < nr, c < nc: in registers (transpose16), one masked
 * store per input row where 256 scalar stores were */
static inline __attribute__((always_inline)) void sb_store_transposed(const float *a, float *y, long ldy, int nr,
                                                                      int nc) {
    __m512 r[16], col[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(a + 16 * i);
    transpose16(r, col);
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    for (int c = 0; c < nc; c++) _mm512_mask_storeu_ps(y + c * ldy, k, col[c]);
}

/* A group of np panels (weight rows from p0 * 16, n in all) against input tiles t0..t1: panel g's
 * results in acc + g * (t1 - t0) * 256 ([(t - t0) * 16 + r][16]), then written to y. The panels take
 * each input tile in turn, so a super-block's input operands come from memory once for the group
 * rather than once a panel (they outgrow L2 at wide k: 512 rows of 8960 are 4.5 MB). A2: each
 * panel's two super-blocks' operands (2 x 2 SB_OP apiece), meta2 their factors (2 apiece). q6: the
 * weights are Q6_K, else Q4_K (two operands either way, input tiles in pairs; only the float steps
 * differ). Each panel's arithmetic is the one-panel order: its products and float steps, super-block
 * by super-block, input tile by input tile. */
static inline __attribute__((always_inline)) void
sb_group_body(const uint8_t *w, long row_bytes, long n, long p0, int np, long k, const sb_input *in, long t0, long t1,
              long m, const __m512i sel[4], int8_t *A2, sb_meta *meta2, float *acc, float *y, long ldy, const int hw,
              const int q6) {
    const long nsb = k / SB, nt = t1 - t0;
    int32_t C[SB_GROUP][2][4][256] __attribute__((aligned(64)));
    long nr[SB_GROUP];
    for (int g = 0; g < np; g++) {
        const long r0 = (p0 + g) * SB_TR;
        nr[g] = n - r0 < SB_TR ? n - r0 : SB_TR;
    }
    for (int g = 0; g < np; g++)
        sb_unpack(w, row_bytes, (p0 + g) * SB_TR, nr[g], 0, sel, A2 + g * 4 * SB_OP, meta2 + 2 * g, q6);
    for (long s = 0; s < nsb; s++) {
        if (s + 1 < nsb)
            for (int g = 0; g < np; g++)
                sb_unpack(w, row_bytes, (p0 + g) * SB_TR, nr[g], s + 1, sel,
                          A2 + g * 4 * SB_OP + ((s + 1) & 1) * 2 * SB_OP, meta2 + 2 * g + ((s + 1) & 1), q6);
        long prev = -1;
        for (long t = 0; t < nt + 2; t += 2) {
            for (int g = 0; g < np; g++) {
                const int8_t *A = A2 + g * 4 * SB_OP + (s & 1) * 2 * SB_OP;
                const sb_meta *meta = meta2 + 2 * g + (s & 1);
                float *ag = acc + g * nt * SB_TR * SB_TR;
                if (t < nt) {
                    const int pair = t + 1 < nt;
                    const long ts0 = sb_at(in, t0 + t, s), ts1 = pair ? sb_at(in, t0 + t + 1, s) : ts0;
                    int32_t (*c)[256] = C[g][(t / 2) & 1];
                    if (hw)
                        sb_products_hw(A, in->B + ts0 * SB_BT, in->B + ts1 * SB_BT, pair, c);
                    else
                        sb_products_emu(A, in->B + ts0 * SB_BT, in->B + ts1 * SB_BT, pair, c);
                }
                if (prev >= 0) {
                    int32_t (*c)[256] = C[g][(prev / 2) & 1];
                    for (int u = 0; u <= (prev + 1 < nt); u++) {
                        const long ts = sb_at(in, t0 + prev + u, s);
                        const __m512 dx = _mm512_load_ps(in->dx + ts * SB_TR);
                        const int32_t *xp = in->xp + ts * 64;
                        for (int r = 0; r < SB_TR; r++) {
                            float *a = ag + ((prev + u) * SB_TR + r) * SB_TR;
                            if (q6)
                                sb_float_step6(meta, r, c[2 * u] + r * SB_TR, c[2 * u + 1] + r * SB_TR, dx, a, s == 0);
                            else
                                sb_float_step(meta, r, c[2 * u] + r * SB_TR, c[2 * u + 1] + r * SB_TR, xp, dx, a,
                                              s == 0);
                        }
                    }
                }
            }
            prev = t < nt ? t : -1;
        }
    }
    for (int g = 0; g < np; g++)
        for (long t = 0; t < nt; t++) {
            const long left = m - (t0 + t) * SB_TR;
            sb_store_transposed(acc + (g * nt + t) * SB_TR * SB_TR, y + (t0 + t) * SB_TR * ldy + (p0 + g) * SB_TR,
                                ldy, (int)nr[g], left < SB_TR ? (int)left : SB_TR);
        }
}

/* the body for each weight type, and for one panel alone (its own code: a loop over a group of one
 * costs that panel's products about 8%) */
#define SB_GROUP_CASES(hw)                                                                                     \
    if (q6 && np == 1)                                                                                         \
        sb_group_body(w, row_bytes, n, p0, 1, k, in, t0, t1, m, sel, A2, meta2, acc, y, ldy, hw, 1);           \
    else if (q6)                                                                                               \
        sb_group_body(w, row_bytes, n, p0, np, k, in, t0, t1, m, sel, A2, meta2, acc, y, ldy, hw, 1);          \
    else if (np == 1)                                                                                          \
        sb_group_body(w, row_bytes, n, p0, 1, k, in, t0, t1, m, sel, A2, meta2, acc, y, ldy, hw, 0);           \
    else                                                                                                       \
        sb_group_body(w, row_bytes, n, p0, np, k, in, t0, t1, m, sel, A2, meta2, acc, y, ldy, hw, 0);

static void sb_group_emu(const uint8_t *w, long row_bytes, long n, long p0, int np, long k, const sb_input *in,
                         long t0, long t1, long m, const __m512i sel[4], int8_t *A2, sb_meta *meta2, float *acc,
                         float *y, long ldy, int q6) {
    SB_GROUP_CASES(0)
}

static SB_AMX void sb_group_hw(const uint8_t *w, long row_bytes, long n, long p0, int np, long k, const sb_input *in,
                               long t0, long t1, long m, const __m512i sel[4], int8_t *A2, sb_meta *meta2, float *acc,
                               float *y, long ldy, int q6) {
    SB_GROUP_CASES(1)
}
#undef SB_GROUP_CASES

/* the next work item of a team's shared counter (items go a few at a time to whichever thread is free: the
 * two cores of a shared host seldom run alike) */
static inline long sb_grab(long *next) {
    long i;
#pragma omp atomic capture
    i = (*next)++;
    return i;
}

/* The calling thread's block for the input operands, kept from one product to the next (grown, never
 * shrunk) and freed when the thread ends: fresh pages for each product's 0.8-4.5 MB cost a
 * qwen2.5-coder-1.5b prefill ~1.5% in page faults. Per thread, so concurrent forwards never share
 * it; NULL where memory runs out. */
typedef struct {
    int8_t *block;
    size_t have;
} sb_block;

static pthread_key_t sb_key;
static int sb_key_ok;
static pthread_once_t sb_key_once = PTHREAD_ONCE_INIT;

static void sb_block_free(void *p) {
    free(((sb_block *)p)->block);
    free(p);
}

static void sb_key_make(void) {
    sb_key_ok = pthread_key_create(&sb_key, sb_block_free) == 0;
}

static int8_t *sb_scratch(size_t bytes) {
    pthread_once(&sb_key_once, sb_key_make);
    if (!sb_key_ok) return NULL;
    sb_block *b = pthread_getspecific(sb_key);
    if (!b) {
        if (!(b = calloc(1, sizeof *b)) || pthread_setspecific(sb_key, b)) {
            free(b);
            return NULL;
        }
    }
    if (bytes > b->have) {
        free(b->block);
        b->have = 0;
        b->block = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        if (b->block) b->have = bytes;
    }
    return b->block;
}

static int sb_tiles(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const int8_t *q,
                    const float *dx, const int16_t *xs, long m, float *y, long ldy, int nt, int hw) {
    const long nsb = k / SB, ntile = (m + SB_TR - 1) / SB_TR, npanel = (n + SB_TR - 1) / SB_TR;
    const int q6 = type == T_Q6_K;
    int perm[4][64];
    sb_perm(type, packed, perm);
    const size_t nts = (size_t)ntile * nsb, per_ts = SB_BT + 64 * 4 + SB_TR * 4; /* B, xp, dx */
    int8_t *ops = sb_scratch(nts * per_ts);
    if (!ops) return -2;
    sb_input in = {ops, (int32_t *)(ops + nts * SB_BT), (float *)(ops + nts * (SB_BT + 64 * 4)), ntile};
    int rc = 0;
    sb_prepare(q, dx, xs, m, k, (const int (*)[64])perm, &in, nt);
    /* per chunk, each byte's sub-block: the same for every row of a layout */
    uint8_t selb[4][64] __attribute__((aligned(64)));
    for (int c = 0; c < 4; c++)
        for (int p = 0; p < 64; p++) selb[c][p] = (uint8_t)(perm[c][p] / (q6 ? 16 : 32));
    const __m512i sel[4] = {_mm512_load_si512(selb[0]), _mm512_load_si512(selb[1]), _mm512_load_si512(selb[2]),
                            _mm512_load_si512(selb[3])};
    long tb = SB_BLOCK_BYTES / (long)(nsb * per_ts);
    tb = tb < 2 ? 2 : tb & ~1L;
    /* panels handed out a few at a time (the two cores of a shared host seldom run alike; a static
     * split leaves one waiting): each panel's result is its own, whoever computes it. Input operands
     * that fit L2 beside the panels' work stay there from one panel to the next: then the panels of a
     * share go one at a time (all together would crowd L1 with their results and operands); past
     * that, together */
    const int together = nts * SB_BT > SB_L2_INPUT;
    /* groups of at most SB_GROUP, as even as the threads' count of them allows (56 panels: 8 of 7) */
    const long rounds = (npanel + (long)nt * SB_GROUP - 1) / ((long)nt * SB_GROUP);
    const int span = together ? (int)((npanel + nt * rounds - 1) / (nt * rounds)) : SB_GRAB;
    const long ngroup = (npanel + span - 1) / span, nblk = (ntile + tb - 1) / tb, items = nblk * ngroup;
    long next = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && ngroup > 1)
    {
        const long tbe = tb < ntile ? tb : ntile, gmax = together ? span : 1; /* panels at once */
        int8_t *A2 = aligned_alloc(64, gmax * 4 * SB_OP);
        sb_meta *meta2 = aligned_alloc(64, gmax * 2 * sizeof(sb_meta));
        float *acc = aligned_alloc(64, sizeof(float) * gmax * tbe * SB_TR * SB_TR);
        if (!A2 || !meta2 || !acc) {
#pragma omp atomic write
            rc = -2;
        } else {
            if (hw) sb_tiles_begin();
            for (long i; (i = sb_grab(&next)) < items;) {
                const long t0 = i / ngroup * tb, p0 = i % ngroup * span;
                const int np = (int)(npanel - p0 < span ? npanel - p0 : span);
                const long t1 = t0 + tb < ntile ? t0 + tb : ntile;
                for (int g = 0; g < np; g += together ? np : 1) {
                    const int ng = together ? np : 1;
                    if (hw)
                        sb_group_hw(w, row_bytes, n, p0 + g, ng, k, &in, t0, t1, m, sel, A2, meta2, acc, y, ldy, q6);
                    else
                        sb_group_emu(w, row_bytes, n, p0 + g, ng, k, &in, t0, t1, m, sel, A2, meta2, acc, y, ldy, q6);
                }
            }
            if (hw) sb_tiles_end();
        }
        free(A2);
        free(meta2);
        free(acc);
    }
    return rc;
}
#endif

/* ------------------------------------------------------------ Q4_0, Q4_1, Q5_0, Q8_0: one float step a block */

/* The 32-element route: prompt rows' products of the legacy types, whose f16 scale per 32 elements
 * keeps a float step per block (no integer form spans more). Inputs are quantized as every product
 * takes them (tsq_quantize: per 32-element block, int8 codes and a float dx, in xgroup's layout);
 * per weight row, input row and block j, with w the block's codes less the type's offset, d its
 * scale and (Q4_1) mn its minimum:
 *     S = sum_e w_e x_e (exact),  acc = fma((float)S, d * dx, acc)
 *     Q4_1 then: X = sum_e x_e (exact),  acc = fma((float)X, mn * dx, acc)
 * in block order from acc = 0 (the shared products take a float step per 16-element half, in eight
 * lanes). Rows need not be whole 128-element groups: a short last group's blocks are read one by one. b32_reference does this one element at a time. On the tiles each block is one TDPBSSD of
 * K = 32: a 16-row panel's codes in element order as A (16 x 32 bytes), an input tile's as B (8
 * words x 16 inputs), then the float step from the stored sums, the panel's sixteen accumulators of
 * one input tile held in registers across the blocks. */

/* the arithmetic one element at a time, the weights read through products.c's group reader
 * (tsq_weight_group: lane L = 4 h + b holds half h of block b, codes unsigned, the type's offset
 * 1 << tsq_offset_shift) and the inputs as dot_ref_q reads an xgroup */
static void b32_reference(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const xgroup *xq,
                          long m, float *y, long ldy, int nt) {
    const long nb = k / QB, ng = n_groups(k);
    const int sh = tsq_offset_shift(type), off = sh ? 1 << sh : 0;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && n >= 64)
    for (long i = 0; i < n; i++)
        for (long c = 0; c < m; c++) {
            float acc = 0.0f;
            for (long g = 0; g < ng; g++) {
                uint8_t lanes[QG];
                float a[8], mn[8];
                tsq_weight_group(type, w + i * row_bytes, g, nb, packed, lanes, a, mn);
                const xgroup *x = xq + c * ng + g;
                for (int b = 0; b < 4 && 4 * g + b < nb; b++) {
                    int32_t S = 0, X = 0;
                    for (int h = 0; h < 2; h++) {
                        const int L = 4 * h + b;
                        for (int e = 0; e < 16; e++) {
                            const int xv = x->q[(e / 4) * 32 + 4 * L + e % 4];
                            S += (lanes[16 * L + e] - off) * xv;
                            X += xv;
                        }
                    }
                    acc = fmaf((float)S, a[b] * x->d[b], acc);
                    if (type == T_Q4_1) acc = fmaf((float)X, mn[b] * x->d[b], acc);
                }
            }
            y[c * ldy + i] = acc;
        }
}

#if SB_TILES
/* 4-byte word w (0..7) of block b of a group sits at word 8 (w % 4) + 4 (w / 4) + b of its 128 bytes
 * in an input group and in a packed Q5_0 or Q8_0 group (both transposed so: products.c
 * transpose_codes); a packed Q4_0 or Q4_1 record holds that order's words as low nibbles (code vectors 0, 2)
 * and high nibbles (1, 3). b32_index: the dword permutes that take a group's two 64-byte halves (as
 * loaded, or as unpacked from nibbles) to blocks (0, 1) and (2, 3) in element order. */
static inline int b32_word(int b, int wd) { return 8 * (wd % 4) + 4 * (wd / 4) + b; }

static void b32_index(int src_q4, __m512i idx[2]) { /* src_q4: packed Q4_0/Q4_1 (lo nibbles, then hi) */
    int32_t v[2][16] __attribute__((aligned(64)));
    for (int p = 0; p < 2; p++)
        for (int l = 0; l < 16; l++) {
            const int t = b32_word(2 * p + l / 8, l % 8), j = t / 8, L = t % 8;
            v[p][l] = src_q4 ? (j & 1) * 16 + (j >> 1) * 8 + L : t;
        }
    idx[0] = _mm512_load_si512(v[0]);
    idx[1] = _mm512_load_si512(v[1]);
}

/* one stored Q4_0/Q4_1/Q5_0 block's 32 codes in element order (no offset taken) */
static inline __m256i b32_block4(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

static inline __m256i b32_block(int type, const uint8_t *p) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(p + 2));
    if (type == T_Q4_0) return b32_block4(p + 2);
    if (type == T_Q4_1) return b32_block4(p + 4);
    return _mm256_mask_add_epi8(b32_block4(p + 6), (__mmask32)rd32(p + 2), b32_block4(p + 6), _mm256_set1_epi8(16));
}

/* Weight rows r0.. r0 + nr of a panel, all nb blocks (ng groups, the last possibly short): A + ((2 g + p) *
 * 16 + r) * 64 holds row r's blocks 4 g + 2 p (bytes 0-31) and 4 g + 2 p + 1 (32-63), codes less the
 * offset, in element order; dw[j * 16 + r] block j's scale, dm[j * 16 + r] its minimum (Q4_1). Rows
 * past nr, and blocks past a short group's end, are zero. */
static inline __attribute__((always_inline)) void b32_unpack(int type, const uint8_t *w, int packed, long row_bytes,
                                                             long r0, long nr, long nb, const __m512i idx[2],
                                                             int8_t *A, float *dw, float *dm) {
    const long bb = BLOCK_BYTES[type], ng = (nb + 3) / 4;
    const __m512i off = _mm512_set1_epi8(type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0);
    for (int r = 0; r < SB_TR; r++)
        for (long g = 0; g < ng; g++) {
            int8_t *a = A + (2 * g * SB_TR + r) * 64;
            const int have = nb - 4 * g < 4 ? (int)(nb - 4 * g) : 4; /* blocks in this group */
            if (r >= nr) {
                _mm512_store_si512(a, _mm512_setzero_si512());
                _mm512_store_si512(a + SB_TR * 64, _mm512_setzero_si512());
                for (int b = 0; b < have; b++) dw[(4 * g + b) * SB_TR + r] = dm[(4 * g + b) * SB_TR + r] = 0.0f;
                continue;
            }
            const uint8_t *grp = w + (r0 + r) * row_bytes + 4 * g * bb;
            __m512i z0, z1;
            if (packed && have == 4 && type != T_Q5_0) { /* a record: four scales (Q4_1: four minimums), codes */
                for (int b = 0; b < 4; b++) {
                    dw[(4 * g + b) * SB_TR + r] = _cvtsh_ss(rd16(grp + 2 * b));
                    dm[(4 * g + b) * SB_TR + r] = type == T_Q4_1 ? _cvtsh_ss(rd16(grp + 8 + 2 * b)) : 0.0f;
                }
                if (type == T_Q8_0) {
                    const __m512i x80 = _mm512_set1_epi8((char)0x80);
                    z0 = _mm512_xor_si512(_mm512_loadu_si512(grp + 8), x80);
                    z1 = _mm512_xor_si512(_mm512_loadu_si512(grp + 72), x80);
                } else {
                    const __m512i c = _mm512_loadu_si512(grp + gm_codes_at(type)), m4 = _mm512_set1_epi8(15);
                    z0 = _mm512_and_si512(c, m4);
                    z1 = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
                }
            } else { /* stored blocks: a packed Q5_0 group's hold the transposed vectors, a short group's its own */
                __m256i v[4];
                for (int b = 0; b < 4; b++) {
                    v[b] = b < have ? b32_block(type, grp + b * bb) : _mm256_setzero_si256();
                    if (b >= have) continue;
                    dw[(4 * g + b) * SB_TR + r] = _cvtsh_ss(rd16(grp + b * bb));
                    dm[(4 * g + b) * SB_TR + r] = type == T_Q4_1 ? _cvtsh_ss(rd16(grp + b * bb + 2)) : 0.0f;
                }
                z0 = _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1);
                z1 = _mm512_inserti64x4(_mm512_castsi256_si512(v[2]), v[3], 1);
            }
            if (packed && have == 4) {
                const __m512i n0 = _mm512_permutex2var_epi32(z0, idx[0], z1);
                z1 = _mm512_permutex2var_epi32(z0, idx[1], z1);
                z0 = n0;
            }
            _mm512_store_si512(a, _mm512_sub_epi8(z0, off));
            _mm512_store_si512(a + SB_TR * 64, _mm512_sub_epi8(z1, off));
        }
}

typedef struct { /* the input tiles' operands: B [t][j][8 words][16 inputs x 4]; dx, and the blocks' code sums
                   as floats (exact: |X| <= 4064), [t][j][16] */
    int8_t *B;
    float *dx, *xs;
    long nb;
} b32_input;

static void b32_prepare(const xgroup *xq, long m, long k, const b32_input *in, int q41, int nt) {
    const long ng = n_groups(k), nb = in->nb, ntile = (m + SB_TR - 1) / SB_TR;
    __m512i idx[2];
    b32_index(0, idx);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && ntile * ng > 1)
    for (long tg = 0; tg < ntile * ng; tg++) {
        const long t = tg / ng, g = tg % ng, live = m - t * SB_TR < SB_TR ? m - t * SB_TR : SB_TR;
        for (int p = 0; p < 2 && 4 * g + 2 * p < nb; p++) {
            __m512 v[16], rows[16];
            for (int col = 0; col < SB_TR; col++) {
                const int8_t *q = xq[(t * SB_TR + col) * ng + g].q;
                v[col] = col < live ? _mm512_castsi512_ps(_mm512_permutex2var_epi32(
                                          _mm512_loadu_si512(q), idx[p], _mm512_loadu_si512(q + 64)))
                                    : _mm512_setzero_ps();
            }
            transpose16(v, rows); /* rows 0-7: block 4 g + 2 p's words, 8-15: the next block's */
            float *B = (float *)(in->B + (t * nb + 4 * g + 2 * p) * 512);
            for (int kk = 0; kk < (4 * g + 2 * p + 1 < nb ? 16 : 8); kk++) _mm512_store_ps(B + 16 * kk, rows[kk]);
        }
        for (int b = 0; b < 4 && 4 * g + b < nb; b++)
            for (int col = 0; col < SB_TR; col++) {
                const long at = (t * nb + 4 * g + b) * SB_TR + col;
                const xgroup *x = xq + (t * SB_TR + col) * ng + g;
                in->dx[at] = col < live ? x->d[b] : 0.0f;
                if (q41) in->xs[at] = col < live ? (float)(x->s[b] + x->s[4 + b]) : 0.0f; /* its two halves */
            }
    }
}

/* tiles 0/1 the sums, 2/3 A (16 x 32 bytes), 4/5 B (8 x 64): even blocks take 0, 2, 4, odd 1, 3, 5 */
static const struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} B32_CFG = {.palette_id = 1, .colsb = {64, 64, 32, 32, 64, 64}, .rows = {16, 16, 16, 16, 8, 8}};

static SB_AMX void b32_tiles_begin(void) { _tile_loadconfig(&B32_CFG); }

/* TDPBSSD of K = 32 in C: c[r][n] = sum over kk < 32 of A[r][kk] B[kk / 4][4 n + kk % 4] (A rows 64 apart) */
static void b32_dp_emu(const int8_t *A, const int8_t *B, int32_t *c) {
    for (int r = 0; r < SB_TR; r++)
        for (int n = 0; n < SB_TR; n++) {
            int32_t s = 0;
            for (int kk = 0; kk < 32; kk++) s += (int32_t)A[r * 64 + kk] * B[(kk / 4) * 64 + 4 * n + kk % 4];
            c[r * SB_TR + n] = s;
        }
}

/* one block's product C = A B on the tiles: even blocks in tiles 0 (sums), 2 (A), 4 (B), odd ones in 1,
 * 3, 5 (the tile numbers are the instructions' immediates) */
static inline SB_AMX void b32_product_hw(const int8_t *A, const int8_t *B, int32_t *C, const int odd) {
    if (odd) {
        _tile_loadd(3, A, 64);
        _tile_loadd(5, B, 64);
        _tile_zero(1);
        _tile_dpbssd(1, 3, 5);
        _tile_stored(1, C, 64);
    } else {
        _tile_loadd(2, A, 64);
        _tile_loadd(4, B, 64);
        _tile_zero(0);
        _tile_dpbssd(0, 2, 4);
        _tile_stored(0, C, 64);
    }
}

/* one panel (weight rows p * 16 .. + nr) against input tiles t0..t1: block j's product issued before
 * block j - 1's float step reads its stored sums (a vector load right behind a tile store waits) */
static inline __attribute__((always_inline)) void b32_panel(const int8_t *A, const float *dw, const float *dm,
                                                            const b32_input *in, long t0, long t1, long m, long nr,
                                                            float *y, long ldy, const int hw, const int q41) {
    const long nb = in->nb;
    int32_t C[2][256] __attribute__((aligned(64)));
    for (long t = t0; t < t1; t++) {
        __m512 acc[SB_TR];
        for (int r = 0; r < SB_TR; r++) acc[r] = _mm512_setzero_ps();
        for (long j = 0; j <= nb; j++) {
            if (j < nb) {
                const int8_t *a = A + ((j / 2) * SB_TR) * 64 + 32 * (j % 2), *b = in->B + (t * nb + j) * 512;
                if (hw)
                    b32_product_hw(a, b, C[j & 1], (int)(j & 1));
                else
                    b32_dp_emu(a, b, C[j & 1]);
            }
            if (j > 0) {
                const long i = j - 1;
                const __m512 dx = _mm512_load_ps(in->dx + (t * nb + i) * SB_TR);
                const int32_t *c = C[i & 1];
                for (int r = 0; r < SB_TR; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + r * SB_TR)),
                                             _mm512_mul_ps(_mm512_set1_ps(dw[i * SB_TR + r]), dx), acc[r]);
                if (q41) { /* the minimums: fma(X, mn dx, acc) */
                    const __m512 xs = _mm512_load_ps(in->xs + (t * nb + i) * SB_TR);
                    for (int r = 0; r < SB_TR; r++)
                        acc[r] = _mm512_fmadd_ps(xs, _mm512_mul_ps(_mm512_set1_ps(dm[i * SB_TR + r]), dx), acc[r]);
                }
            }
        }
        __m512 col[SB_TR];
        transpose16(acc, col);
        const long left = m - t * SB_TR;
        const __mmask16 km = (__mmask16)((1u << nr) - 1);
        for (int c = 0; c < (left < SB_TR ? left : SB_TR); c++) _mm512_mask_storeu_ps(y + (t * SB_TR + c) * ldy, km, col[c]);
    }
}

/* each form for Q4_1 (the minimums' float steps) and the others */
static void b32_panel_emu(const int8_t *A, const float *dw, const float *dm, const b32_input *in, long t0, long t1,
                          long m, long nr, float *y, long ldy, int q41) {
    if (q41)
        b32_panel(A, dw, dm, in, t0, t1, m, nr, y, ldy, 0, 1);
    else
        b32_panel(A, dw, dm, in, t0, t1, m, nr, y, ldy, 0, 0);
}

static SB_AMX void b32_panel_hw(const int8_t *A, const float *dw, const float *dm, const b32_input *in, long t0,
                                long t1, long m, long nr, float *y, long ldy, int q41) {
    if (q41)
        b32_panel(A, dw, dm, in, t0, t1, m, nr, y, ldy, 1, 1);
    else
        b32_panel(A, dw, dm, in, t0, t1, m, nr, y, ldy, 1, 0);
}

static int b32_tiles(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const xgroup *xq, long m,
                     float *y, long ldy, int nt, int hw) {
    const long nb = k / QB, ng = n_groups(k), ntile = (m + SB_TR - 1) / SB_TR, npanel = (n + SB_TR - 1) / SB_TR;
    const size_t per_t = (size_t)nb * (512 + 2 * SB_TR * 4); /* an input tile's B, dx and code sums */
    int8_t *ops = sb_scratch(ntile * per_t);
    if (!ops) return -2;
    b32_input in = {ops, (float *)(ops + ntile * nb * 512), (float *)(ops + ntile * nb * (512 + SB_TR * 4)), nb};
    const int q41 = type == T_Q4_1;
    b32_prepare(xq, m, k, &in, q41, nt);
    __m512i idx[2];
    b32_index(packed && (type == T_Q4_0 || type == T_Q4_1), idx);
    long tb = SB_BLOCK_BYTES / 4 / (long)per_t; /* input tiles a pass: their operands stay in L2 */
    tb = tb < 1 ? 1 : tb;
    const long nblk = (ntile + tb - 1) / tb, items = nblk * npanel;
    long next = 0;
    int rc = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && npanel > 1)
    {
        int8_t *A = aligned_alloc(64, ng * 2 * SB_TR * 64);
        float *dw = aligned_alloc(64, sizeof(float) * nb * SB_TR), *dm = aligned_alloc(64, sizeof(float) * nb * SB_TR);
        long have = -1; /* the panel A holds */
        if (!A || !dw || !dm) {
#pragma omp atomic write
            rc = -2;
        } else {
            if (hw) b32_tiles_begin();
            for (long i; (i = sb_grab(&next)) < items;) {
                const long p = i % npanel, t0 = i / npanel * tb, t1 = t0 + tb < ntile ? t0 + tb : ntile;
                const long nr = n - p * SB_TR < SB_TR ? n - p * SB_TR : SB_TR;
                if (p != have) b32_unpack(type, w, packed, row_bytes, p * SB_TR, nr, nb, idx, A, dw, dm);
                have = p;
                if (hw)
                    b32_panel_hw(A, dw, dm, &in, t0, t1, m, nr, y + p * SB_TR, ldy, q41);
                else
                    b32_panel_emu(A, dw, dm, &in, t0, t1, m, nr, y + p * SB_TR, ldy, q41);
            }
            if (hw) sb_tiles_end();
        }
        free(A);
        free(dw);
        free(dm);
    }
    return rc;
}
#endif

/* whether the 32-element route takes this type */
static int b32_type(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q8_0; }

/* y [m, n] = the legacy-type rows w against x quantized by tsq_quantize (xq: m rows of xgroups) in the
 * 32-element arithmetic. mode: 0 the reference, 1 the tiles, 2 the tiles emulated. -> 0; -1 for what
 * it does not take; -2 out of memory. */
int tsq_matmul_b32_q(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const xgroup *xq, long m,
                     float *y, long ldy, int nt, int mode) {
    if (!b32_type(type) || k % QB || row_bytes != tsq_row_bytes(type, k) || m < 0 || n < 0 || ldy < n) return -1;
    if (nt < 1) nt = 1;
    if (m == 0 || n == 0) return 0;
    if (mode == 0) {
        b32_reference(type, w, packed, row_bytes, n, k, xq, m, y, ldy, nt);
        return 0;
    }
#if SB_TILES
    if (mode == 2) return b32_tiles(type, w, packed, row_bytes, n, k, xq, m, y, ldy, nt, 0);
    if (mode == 1 && tsq_amx_init() == 0) return b32_tiles(type, w, packed, row_bytes, n, k, xq, m, y, ldy, nt, 1);
#endif
    return -1;
}

/* ------------------------------------------------------------------ the switch */

static int sb_use = 0; /* tsq_sb_use */

/* Prompt rows' Q4_K and Q6_K products (tsq_linear_apply_rows) in the super-block arithmetic: 0 off, 1 on
 * the tiles, 2 on their emulation, 3 through the reference (2 and 3: tests, on any CPU with that
 * mode). Switch it between forwards only. -> 0, or -1 where the mode cannot run here. */
int tsq_sb_use(int mode) {
    if (mode < 0 || mode > 3) return -1;
#if SB_TILES
    if (mode == 1 && tsq_amx_init() != 0) return -1;
#else
    if (mode == 1 || mode == 2) return -1;
#endif
    sb_use = mode;
    return 0;
}

int tsq_sb_in_use(void) { return sb_use; }

#define SB_ALL_TYPES ((1 << T_Q4_K) | (1 << T_Q6_K) | (1 << T_Q4_0) | (1 << T_Q4_1) | (1 << T_Q5_0) | (1 << T_Q8_0))
static int sb_types = SB_ALL_TYPES; /* tsq_sb_types */

/* Which weight types prompt rows take on the routes while they are on: a mask of 1 << type over Q4_K
 * and Q6_K (the super-block route) and Q4_0, Q4_1, Q5_0, Q8_0 (the 32-element route); all by default
 * (scripts/ab_prompt_tiles.py compares). -> the mask before, or -1 for another type's bit. Switch
 * it between forwards only. */
int tsq_sb_types(int mask) {
    if (mask & ~SB_ALL_TYPES) return -1;
    const int was = sb_types;
    sb_types = mask;
    return was;
}

/* which route prompt rows' products of this weight type and row length take while the routes are
 * on: 1 the super-block route, 2 the 32-element one, 0 neither */
TSQ_INTERNAL int tsq_sb_takes(int type, long k) {
    if (!((sb_types >> type) & 1)) return 0;
    if (type == T_Q4_K || type == T_Q6_K) return k % SB == 0;
    return b32_type(type) && k % QB == 0 ? 2 : 0;
}

/* tsq_matmul_sb_q's mode for prompt rows' products, -1 while the route is off */
TSQ_INTERNAL int tsq_sb_product_mode(void) { return sb_use == 0 ? -1 : sb_use == 3 ? 0 : sb_use; }

/* 1 where this build has the tile form (mode 2 then runs on this CPU; mode 1 also needs AMX) */
int tsq_sb_tiles_built(void) { return SB_TILES; }

/* y [m, n] (row stride ldy) = x's rows against n Q4_K or Q6_K weight rows w in the super-block arithmetic,
 * x already quantized by tsq_quantize_sb. mode: 0 the reference, 1 the tiles, 2 the tiles
 * emulated. -> 0; -1 for what it does not take (another type, k not whole super-blocks, row_bytes
 * wrong, a mode this build or CPU lacks); -2 out of memory. */
int tsq_matmul_sb_q(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const int8_t *q,
                    const float *dx, const int16_t *xs, long m, float *y, long ldy, int nt, int mode) {
    if ((type != T_Q4_K && type != T_Q6_K) || k % SB || row_bytes != k / SB * (type == T_Q4_K ? 144 : 210) || m < 0 ||
        n < 0 || ldy < n)
        return -1;
    if (nt < 1) nt = 1;
    if (m == 0 || n == 0) return 0;
    if (mode == 0) {
        sb_reference(type, w, packed, row_bytes, n, k, q, dx, xs, m, y, ldy, nt);
        return 0;
    }
#if SB_TILES
    if (mode == 2) return sb_tiles(type, w, packed, row_bytes, n, k, q, dx, xs, m, y, ldy, nt, 0);
    if (mode == 1 && tsq_amx_init() == 0)
        return sb_tiles(type, w, packed, row_bytes, n, k, q, dx, xs, m, y, ldy, nt, 1);
#endif
    return -1;
}

/* tsq_matmul_sb_q (tsq_matmul_b32_q for the legacy types) from float rows x [m, k]: quantizes them
 * first (scratch of its own) */
int tsq_matmul_sb(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const float *x, long m,
                  float *y, long ldy, int nt, int mode) {
    if (b32_type(type)) { /* the 32-element route, from the inputs every product takes */
        if (k % QB || m < 0) return -1;
        xgroup *xq = aligned_alloc(64, sizeof(xgroup) * (m * n_groups(k) + 1));
        if (!xq) return -2;
        tsq_quantize(x, m, k, xq);
        const int rc = tsq_matmul_b32_q(type, w, packed, row_bytes, n, k, xq, m, y, ldy, nt, mode);
        free(xq);
        return rc;
    }
    if (k % SB || m < 0) return -1;
    int8_t *q = malloc((size_t)m * k + 1);
    float *dx = malloc(sizeof(float) * (m * (k / SB) + 1));
    int16_t *xs = malloc(sizeof(int16_t) * (m * (k / 32) + 1));
    int rc = -2;
    if (q && dx && xs) {
        tsq_quantize_sb(x, m, k, q, dx, xs, nt);
        rc = tsq_matmul_sb_q(type, w, packed, row_bytes, n, k, q, dx, xs, m, y, ldy, nt, mode);
    }
    free(q);
    free(dx);
    free(xs);
    return rc;
}
