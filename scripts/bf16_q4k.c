/* Issue 47's untried routes, measured before anyone builds them: Q4_K products on the AMX tiles with
 * one float step per 256-element super-block, exact, in three forms (BF16 tiles, INT8 tiles, INT8
 * scheduled). A stand-alone model, not a kernel of tsspec's: it takes its own layout (a load-time
 * repack would give it) and checks itself against an exact integer reference. scripts/bf16_route.py builds it,
 * checks it and times it beside tsspec's own VNNI product and tile panel on the same shapes.
 *
 * The arithmetic (the change the issue proposes; tsspec's canonical arithmetic today takes a float
 * step per 16-element lane instead):
 *   inputs quantized per super-block: int8 codes x (|x| <= 127), one float dx, and the 32-element
 *   sums xs_j;
 *   S = sum_j sc_j * sum_{k in j} q_k x_k   (sc_j the 6-bit sub-block scale, q_k the 4-bit code)
 *   M = sum_j m_j * xs_j                    (m_j the 6-bit sub-block minimum)
 *   acc = fma((float)S, d * dx, acc); acc = fma(-(float)M, dmin * dx, acc)   per super-block.
 * Both forms split the scale, sc = 8 sh + sl (sh, sl <= 7), so that A_hi = q sh and A_lo = q sl
 * (<= 105) are exact operands, and S = 8 C_hi + C_lo.
 * - BF16 (TDPBF16PS): A_hi, A_lo and the input codes are exact bf16 integers; every partial sum
 *   stays an integer below 2^24 (7 * 15 * 127 * 256 = 3.4M), so the fp32 sums are exact in any
 *   order, and fma(8, C_hi, C_lo) rounds S once, as (float)S does. The minimums ride one more
 *   product: A_m = (m_j, m_j), B_m = (64 xh_j, xl_j) with xs = 64 xh + xl, 0 <= xl < 64, all exact
 *   bf16 integers, sums <= 63 * 4064 * 8. The unpack maps 32 codes at a time through two 16-entry
 *   bf16 tables (VPERMW).
 * - INT8 (TDPBSSD), further down: A_hi and A_lo fit a signed byte, a byte-table lookup (VPSHUFB)
 *   makes them, and the int32 sums are exact by construction.
 * - INT8 scheduled (i8b_*): the same with the minimums on VPDPWSSD, input tiles in pairs and the
 *   unpack and float steps one step ahead of or behind the tile products.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <unistd.h>
#include <sys/syscall.h>

#define QK 256

typedef struct { /* one weight row's super-block, as a load-time repack would store it */
    uint8_t qs[128]; /* GGUF order: 32-byte groups, low nibbles sub-block 2g, high 2g+1 */
    uint8_t sh[8], sl[8], m[8];
    float d, dmin;
    int16_t m16[8]; /* the minimums again as int16 pairs, for VPDPWSSD (the INT8 form's second schedule) */
} wblock;

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* tmm0 C_hi, tmm1 C_lo, tmm2 C_m (16 x 64 B); tmm3 A_hi, tmm4 A_lo (16 x 64 B); tmm5 B (16 x 64 B);
 * tmm6 A_m (16 x 32 B); tmm7 B_m (8 x 64 B) */
static const tilecfg CFG = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 32, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 8},
};

static uint16_t TAB[8][32] __attribute__((aligned(64))); /* bf16(q * f), f = 0..7, q = 0..15 */

static inline uint16_t bf16_of_int(int v) { /* exact for integers of at most 8 significant bits */
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* -> 0 once the kernel grants the tile data (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
int bf16_init(void) {
    for (int f = 0; f < 8; f++)
        for (int q = 0; q < 32; q++) TAB[f][q] = bf16_of_int(q < 16 ? q * f : 0);
    return (int)syscall(SYS_arch_prctl, 0x1023, 18);
}

/* One input tile's B operands (16 input rows, `valid` of them real), prepared once per product:
 * Bt[sb][j][p][c][2] = the codes x[c][256 sb + 32 j + 2p + (0, 1)]; Bm[sb][p][c][2] = the minimums'
 * pairs; dxv[sb][c] = dx[c][sb]. x is int8 [valid][k], dx float [valid][k / 256]. */
void bf16_prepare(const int8_t *x, const float *dx, long k, long valid, uint16_t *Bt, uint16_t *Bm, float *dxv) {
    long nsb = k / QK;
    for (long sb = 0; sb < nsb; sb++) {
        for (int j = 0; j < 8; j++)
            for (int p = 0; p < 16; p++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++) {
                        int v = c < valid ? x[c * k + sb * QK + 32 * j + 2 * p + e] : 0;
                        Bt[(((sb * 8 + j) * 16 + p) * 16 + c) * 2 + e] = bf16_of_int(v);
                    }
        for (int c = 0; c < 16; c++) {
            for (int j = 0; j < 8; j++) {
                int s = 0;
                if (c < valid)
                    for (int i = 0; i < 32; i++) s += x[c * k + sb * QK + 32 * j + i];
                int xh = (int)floor(s / 64.0), xl = s - 64 * xh;
                int p = j / 2, e = j % 2;
                Bm[((sb * 8 + p) * 16 + c) * 2 + e] = bf16_of_int(64 * xh);
                Bm[((sb * 8 + p + 4) * 16 + c) * 2 + e] = bf16_of_int(xl);
            }
            dxv[sb * 16 + c] = c < valid ? dx[c * nsb + sb] : 0.0f;
        }
    }
}

/* a panel's accumulators (acc[t][r][c]: input tile t, weight row r0 + r, input 16 t + c) into y[c][i] */
static void write_panel(const float *acc, long nt, long r0, long n, long m, float *y) {
    for (long t = 0; t < nt; t++)
        for (int r = 0; r < 16 && r0 + r < n; r++)
            for (int c = 0; c < 16 && t * 16 + c < m; c++) y[(t * 16 + c) * n + r0 + r] = acc[(t * 16 + r) * 16 + c];
}

/* y[c][i] for c < m input rows and i < n weight rows (W: [n][k / 256] blocks), the B operands of
 * ceil(m / 16) input tiles from bf16_prepare, one after another. One thread. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void bf16_matmul(const wblock *W, long n, long k, const uint16_t *Bt, const uint16_t *Bm, const float *dxv, long m,
                 float *y, int nth) {
    long nsb = k / QK, nt = (m + 15) / 16;
#pragma omp parallel num_threads(nth)
    {
    uint16_t *A = aligned_alloc(64, 2 * 8 * 1024 + 512);
    uint16_t *Am = A + 2 * 8 * 512;
    float *acc = aligned_alloc(64, nt * 16 * 16 * sizeof(float));
    float C[3][16][16] __attribute__((aligned(64)));
    _tile_loadconfig(&CFG);
    const __m256i m4 = _mm256_set1_epi8(15);
#pragma omp for schedule(static)
    for (long r0 = 0; r0 < n; r0 += 16) {
        memset(acc, 0, nt * 16 * 16 * sizeof(float));
        for (long sb = 0; sb < nsb; sb++) {
            for (int r = 0; r < 16; r++) { /* the 16 weight rows' A tiles, once per super-block */
                const wblock *b = &W[(r0 + r) * nsb + sb];
                for (int g = 0; g < 4; g++) {
                    __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * g));
                    __m256i h[2] = {_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4)};
                    for (int e = 0; e < 2; e++) {
                        int j = 2 * g + e;
                        __m512i idx = _mm512_cvtepu8_epi16(h[e]);
                        _mm512_store_si512(A + j * 512 + r * 32,
                                           _mm512_permutexvar_epi16(idx, _mm512_load_si512(TAB[b->sh[j]])));
                        _mm512_store_si512(A + 8 * 512 + j * 512 + r * 32,
                                           _mm512_permutexvar_epi16(idx, _mm512_load_si512(TAB[b->sl[j]])));
                    }
                }
                __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b->m)));
                __m128bh mh = _mm256_cvtneps_pbh(mf);
                _mm_store_si128((__m128i *)(Am + r * 16), (__m128i)mh);
                _mm_store_si128((__m128i *)(Am + r * 16 + 8), (__m128i)mh);
            }
            for (long t = 0; t < nt; t++) {
                const uint16_t *bt = Bt + (t * nsb + sb) * 8 * 512;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                for (int j = 0; j < 8; j++) {
                    _tile_loadd(5, bt + j * 512, 64);
                    _tile_loadd(3, A + j * 512, 64);
                    _tile_dpbf16ps(0, 3, 5);
                    _tile_loadd(4, A + 8 * 512 + j * 512, 64);
                    _tile_dpbf16ps(1, 4, 5);
                }
                _tile_loadd(6, Am, 32);
                _tile_loadd(7, Bm + (t * nsb + sb) * 256, 64);
                _tile_dpbf16ps(2, 6, 7);
                _tile_stored(0, C[0], 64);
                _tile_stored(1, C[1], 64);
                _tile_stored(2, C[2], 64);
                const __m512 dx = _mm512_loadu_ps(dxv + (t * nsb + sb) * 16), eight = _mm512_set1_ps(8.0f);
                for (int r = 0; r < 16; r++) {
                    const wblock *b = &W[(r0 + r) * nsb + sb];
                    float *a = acc + (t * 16 + r) * 16;
                    __m512 s = _mm512_fmadd_ps(eight, _mm512_load_ps(C[0][r]), _mm512_load_ps(C[1][r]));
                    __m512 v = _mm512_fmadd_ps(s, _mm512_mul_ps(_mm512_set1_ps(b->d), dx), _mm512_load_ps(a));
                    v = _mm512_fnmadd_ps(_mm512_load_ps(C[2][r]), _mm512_mul_ps(_mm512_set1_ps(b->dmin), dx), v);
                    _mm512_store_ps(a, v);
                }
            }
        }
        write_panel(acc, nt, r0, n, m, y);
    }
    _tile_release();
    free(A);
    free(acc);
    }
}

/* ---- the same arithmetic on INT8 tiles (TDPBSSD), for the unpack's sake: A_hi = q sh and A_lo = q sl
 * fit a signed byte (<= 105), so a byte-table lookup (VPSHUFB) makes them, a quarter of the bytes
 * the bf16 operands take; the minimums ride the same B tiles with A_m = m_j spread over the 32
 * codes of sub-block j (M = sum_k m_j(k) x_k). Integer sums are exact in any order: C_hi, C_lo and
 * C_m are S's halves and M, and the float steps are the BF16 route's, so bf16_reference checks both.
 * Both matmuls split the weight rows' 16-row panels over nth OpenMP threads, each with its own tiles.
 * B tiles: Bq[sb][c][p][n][4] = x[n][256 sb + 64 c + 4 p + (0..3)], 16 input rows. */
static const tilecfg CFG8 = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 0},
    .rows = {16, 16, 16, 16, 16, 16, 16, 0},
};
static int8_t TAB8[8][16] __attribute__((aligned(64))); /* q * f, f = 0..7 */

void i8_prepare(const int8_t *x, const float *dx, long k, long valid, int8_t *Bq, float *dxv) {
    long nsb = k / QK;
    for (int f = 0; f < 8; f++)
        for (int q = 0; q < 16; q++) TAB8[f][q] = (int8_t)(q * f);
    for (long sb = 0; sb < nsb; sb++) {
        for (int c4 = 0; c4 < 4; c4++)
            for (int p = 0; p < 16; p++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 4; e++)
                        Bq[(((sb * 4 + c4) * 16 + p) * 16 + c) * 4 + e] =
                            c < valid ? x[c * k + sb * QK + 64 * c4 + 4 * p + e] : 0;
        for (int c = 0; c < 16; c++) dxv[sb * 16 + c] = c < valid ? dx[c * nsb + sb] : 0.0f;
    }
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
__attribute__((target("avx512f,avx512bw,avx512vl")))
/* the A operands of 16 weight rows' super-block sb: A[c][r] = q sh, A[4 + c][r] = q sl (chunk c of 64
 * codes, 64 bytes a row), and where Am is given, Am[c][r] = the chunk's minimums spread over its
 * codes (m_2c over bytes 0..31, m_2c+1 over 32..63) */
static inline void unpack8(const wblock *W, long nsb, long r0, long sb, int8_t *A, int8_t *Am) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int r = 0; r < 16; r++) {
        const wblock *b = &W[(r0 + r) * nsb + sb];
        for (int c4 = 0; c4 < 4; c4++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * c4));
            __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, m4)),
                                               _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), 1);
            int j = 2 * c4;
            __m512i th = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)TAB8[b->sh[j]]))),
                _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)TAB8[b->sh[j + 1]])), 1);
            __m512i tl = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)TAB8[b->sl[j]]))),
                _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)TAB8[b->sl[j + 1]])), 1);
            _mm512_store_si512(A + c4 * 1024 + r * 64, _mm512_shuffle_epi8(th, codes));
            _mm512_store_si512(A + (4 + c4) * 1024 + r * 64, _mm512_shuffle_epi8(tl, codes));
            if (Am) {
                /* pshufb indices: each 128-bit lane of mv holds m_0..m_7 */
                const __m512i mv = _mm512_broadcast_i32x4(_mm_loadl_epi64((const __m128i *)b->m));
                const __m512i spread =
                    _mm512_inserti64x4(_mm512_set1_epi8((char)j), _mm256_set1_epi8((char)(j + 1)), 1);
                _mm512_store_si512(Am + c4 * 1024 + r * 64, _mm512_shuffle_epi8(mv, spread));
            }
        }
    }
}

/* unpack_only: the weights' A operands only, no tile product or float step (y is left as it was):
 * what the unpack alone costs */
void i8_matmul(const wblock *W, long n, long k, const int8_t *Bq, const float *dxv, long m, float *y, int nth,
               int unpack_only) {
    long nsb = k / QK, nt = (m + 15) / 16;
#pragma omp parallel num_threads(nth)
    {
    int8_t *A = aligned_alloc(64, 3 * 4 * 1024); /* [hi, lo, m][chunk][row][64] */
    float *acc = aligned_alloc(64, nt * 16 * 16 * sizeof(float));
    int32_t C[3][16][16] __attribute__((aligned(64)));
    _tile_loadconfig(&CFG8);
#pragma omp for schedule(static)
    for (long r0 = 0; r0 < n; r0 += 16) {
        memset(acc, 0, nt * 16 * 16 * sizeof(float));
        for (long sb = 0; sb < nsb; sb++) {
            unpack8(W, nsb, r0, sb, A, A + 8 * 1024);
            for (long t = 0; t < (unpack_only ? 0 : nt); t++) {
                const int8_t *bq = Bq + (t * nsb + sb) * 4 * 1024;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                for (int c4 = 0; c4 < 4; c4++) {
                    _tile_loadd(6, bq + c4 * 1024, 64);
                    _tile_loadd(3, A + (0 * 4 + c4) * 1024, 64);
                    _tile_dpbssd(0, 3, 6);
                    _tile_loadd(4, A + (1 * 4 + c4) * 1024, 64);
                    _tile_dpbssd(1, 4, 6);
                    _tile_loadd(5, A + (2 * 4 + c4) * 1024, 64);
                    _tile_dpbssd(2, 5, 6);
                }
                _tile_stored(0, C[0], 64);
                _tile_stored(1, C[1], 64);
                _tile_stored(2, C[2], 64);
                const __m512 dx = _mm512_loadu_ps(dxv + (t * nsb + sb) * 16);
                for (int r = 0; r < 16; r++) {
                    const wblock *b = &W[(r0 + r) * nsb + sb];
                    float *a = acc + (t * 16 + r) * 16;
                    __m512i si = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(C[0][r]), 3),
                                                  _mm512_load_si512(C[1][r]));
                    __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(_mm512_set1_ps(b->d), dx),
                                               _mm512_load_ps(a));
                    v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C[2][r])),
                                         _mm512_mul_ps(_mm512_set1_ps(b->dmin), dx), v);
                    _mm512_store_ps(a, v);
                }
            }
        }
        if (!unpack_only) write_panel(acc, nt, r0, n, m, y);
    }
    _tile_release();
    free(A);
    free(acc);
    }
}

/* ---- the INT8 form, scheduled: the minimums leave the tiles (M by four VPDPWSSD a weight row, from the
 * inputs' 32-element sums packed as int16 pairs, Xp[sb][q][c] = (xs_2q, xs_2q+1) of input c), so the
 * unpack writes 2 bytes a weight; and input tiles go in pairs, each A tile loaded once for both,
 * four independent accumulator chains (C_hi and C_lo of two input tiles). */
static const tilecfg CFG8B = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

void i8b_prepare(const int8_t *x, const float *dx, long k, long valid, int8_t *Bq, int32_t *Xp, float *dxv) {
    long nsb = k / QK;
    i8_prepare(x, dx, k, valid, Bq, dxv);
    for (long sb = 0; sb < nsb; sb++)
        for (int q = 0; q < 4; q++)
            for (int c = 0; c < 16; c++) {
                int xs[2] = {0, 0};
                if (c < valid)
                    for (int e = 0; e < 2; e++)
                        for (int i = 0; i < 32; i++) xs[e] += x[c * k + sb * QK + 32 * (2 * q + e) + i];
                Xp[(sb * 4 + q) * 16 + c] = (int32_t)(((uint32_t)(uint16_t)xs[1] << 16) | (uint16_t)xs[0]);
            }
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
static inline void float_step8(const wblock *b, const int32_t *chi, const int32_t *clo, const int32_t *xp,
                               __m512 dx, float *a) {
    __m512i si = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(chi), 3), _mm512_load_si512(clo));
    const int32_t *mp = (const int32_t *)b->m16;
    __m512i mi = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xp), _mm512_set1_epi32(mp[0]));
    mi = _mm512_dpwssd_epi32(mi, _mm512_loadu_si512(xp + 16), _mm512_set1_epi32(mp[1]));
    mi = _mm512_dpwssd_epi32(mi, _mm512_loadu_si512(xp + 32), _mm512_set1_epi32(mp[2]));
    mi = _mm512_dpwssd_epi32(mi, _mm512_loadu_si512(xp + 48), _mm512_set1_epi32(mp[3]));
    __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(_mm512_set1_ps(b->d), dx), _mm512_load_ps(a));
    v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mi), _mm512_mul_ps(_mm512_set1_ps(b->dmin), dx), v);
    _mm512_store_ps(a, v);
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
void i8b_matmul(const wblock *W, long n, long k, const int8_t *Bq, const int32_t *Xp, const float *dxv, long m,
                float *y, int nth) {
    long nsb = k / QK, nt = (m + 15) / 16;
#pragma omp parallel num_threads(nth)
    {
    int8_t *A2 = aligned_alloc(64, 2 * 2 * 4 * 1024); /* two of [hi, lo][chunk][row][64], by super-block parity */
    float *acc = aligned_alloc(64, nt * 16 * 16 * sizeof(float));
    int32_t C[2][4][16][16] __attribute__((aligned(64)));
    _tile_loadconfig(&CFG8B);
#pragma omp for schedule(static)
    for (long r0 = 0; r0 < n; r0 += 16) {
        memset(acc, 0, nt * 16 * 16 * sizeof(float));
        /* super-block sb + 1 is unpacked before sb's tile products are issued, into the other
         * buffer: a tile load right behind the vector stores that wrote its rows waits for them */
        unpack8(W, nsb, r0, 0, A2, NULL);
        for (long sb = 0; sb < nsb; sb++) {
            int8_t *A = A2 + (sb & 1) * 8 * 1024;
            if (sb + 1 < nsb) unpack8(W, nsb, r0, sb + 1, A2 + ((sb + 1) & 1) * 8 * 1024, NULL);
            /* pair p's float steps run after pair p + 1's tile products are issued: its tile stores
             * have then long reached L1 (a vector load right behind a tile store waits for it) */
            long prev = -1;
            for (long t = 0; t < nt + 2; t += 2) {
                if (t < nt) {
                    const int pair = t + 1 < nt;
                    int32_t (*c)[16][16] = C[(t / 2) & 1];
                    const int8_t *bq0 = Bq + (t * nsb + sb) * 4 * 1024, *bq1 = Bq + ((t + 1) * nsb + sb) * 4 * 1024;
                    _tile_zero(0);
                    _tile_zero(1);
                    if (pair) {
                        _tile_zero(2);
                        _tile_zero(3);
                    }
                    for (int c4 = 0; c4 < 4; c4++) {
                        _tile_loadd(4, A + c4 * 1024, 64);
                        _tile_loadd(5, A + (4 + c4) * 1024, 64);
                        _tile_loadd(6, bq0 + c4 * 1024, 64);
                        _tile_dpbssd(0, 4, 6);
                        _tile_dpbssd(1, 5, 6);
                        if (pair) {
                            _tile_loadd(7, bq1 + c4 * 1024, 64);
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
                if (prev >= 0) {
                    int32_t (*c)[16][16] = C[(prev / 2) & 1];
                    for (int u = 0; u <= (prev + 1 < nt); u++) {
                        const __m512 dx = _mm512_loadu_ps(dxv + ((prev + u) * nsb + sb) * 16);
                        const int32_t *xp = Xp + ((prev + u) * nsb + sb) * 64;
                        for (int r = 0; r < 16; r++)
                            float_step8(&W[(r0 + r) * nsb + sb], c[2 * u][r], c[2 * u + 1][r], xp, dx,
                                        acc + ((prev + u) * 16 + r) * 16);
                    }
                }
                prev = t < nt ? t : -1;
            }
        }
        write_panel(acc, nt, r0, n, m, y);
    }
    _tile_release();
    free(A2);
    free(acc);
    }
}

/* The same products in exact integers and the same float steps, one element at a time. */
void bf16_reference(const wblock *W, long n, long k, const int8_t *x, const float *dx, long m, float *y) {
    long nsb = k / QK;
    for (long c = 0; c < m; c++)
        for (long i = 0; i < n; i++) {
            float acc = 0.0f;
            for (long sb = 0; sb < nsb; sb++) {
                const wblock *b = &W[i * nsb + sb];
                const int8_t *xs = x + c * k + sb * QK;
                long S = 0, M = 0;
                for (int j = 0; j < 8; j++) {
                    long isum = 0, xsum = 0;
                    for (int e = 0; e < 32; e++) {
                        int byte = b->qs[32 * (j / 2) + e];
                        int q = (j % 2) ? byte >> 4 : byte & 15;
                        isum += q * xs[32 * j + e];
                        xsum += xs[32 * j + e];
                    }
                    S += (8 * b->sh[j] + b->sl[j]) * isum;
                    M += b->m[j] * xsum;
                }
                float d = dx[c * nsb + sb];
                acc = fmaf((float)S, b->d * d, acc);
                acc = fmaf(-(float)M, b->dmin * d, acc);
            }
            y[c * n + i] = acc;
        }
}
