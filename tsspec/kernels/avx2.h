/* avx2.h: the quantized products at the AVX2 level (x86-64-v3: AVX2, FMA, F16C; Haswell and later,
 * every AMD since Zen 1). Included into products.c, whose weight readers (wgroup_simd, transpose4)
 * it shares with the AVX-512 VNNI path.
 *
 * The arithmetic is the reference's (products.c's header): per weight row, input row, group and
 * lane L, the exact integer sum over the lane's 16 code pairs less the weight offset times the
 * input's code sum, then acc[L] = fma(isum, a[L] * dx[L], acc[L]); Q4_K's offsets fma'd into acc
 * ahead of each super-block, Q4_1's into a second set of accumulators added at the end; sum8.
 * So every output equals the reference's, bit for bit.
 *
 * Without VNNI a lane's four-product sum is vpmaddubsw (unsigned byte x signed byte, adjacent pairs
 * added into a saturating int16) then vpmaddwd against ones (pairs of int16 into an exact int32).
 * The int16 step must never saturate, so each type's pair of products is bounded (inputs are int8
 * in [-127, 127], tsq_quantize clamps them there):
 *   Q4_0, Q4_1, Q4_K: codes 0..15, |pair| <= 2 * 15 * 127 = 3,810
 *   Q5_0:             codes 0..31, |pair| <= 2 * 31 * 127 = 7,874
 *   Q6_K:             codes 0..63, |pair| <= 2 * 63 * 127 = 16,002
 *   Q8_0:             taken unsigned (c + 128, up to 255) a pair could reach 2 * 255 * 127 = 64,770,
 *                     so Q8_0 goes signed: |c| (at most 128, read as an unsigned byte) against the
 *                     input with c's sign moved onto it (|q| <= 127), |pair| <= 2 * 128 * 127 =
 *                     32,512 <= 32,767. Its sum is then sum(c q) itself, the integer the reference
 *                     gets as sum((c + 128) q) - 128 sum(q).
 * vpmaddwd is the costlier step, so the int16 pair sums of several words are added first where
 * that cannot overflow either: all four words for the 4-bit types (4 * 3,810 = 15,240) and Q5_0
 * (4 * 7,874 = 31,496 <= 32,767), two words at a time for Q6_K (2 * 16,002 = 32,004), none for Q8_0.
 * The int32 lane sums are at most 16 * 128 * 127 in magnitude. tests/test_isa.py multiplies the
 * extreme codes against inputs of +-127 on every level against the reference.
 *
 * Tiles of up to AVX2_TILE input rows share each unpacked weight group; a longer product goes over
 * the weight rows in blocks that stay in L2 while its tiles pass. Threads take contiguous shares of the
 * weight rows. None of this changes the operations an output element goes through. */

#ifndef AVX2_TILE
/* The tallest tile of input rows (TSQ_TILES8). Each tile re-reads and unpacks the weights, so taller
 * is cheaper until the accumulators leave the 16 registers: on qwen2.5-coder-1.5b (ab_kernels.py)
 * tiles of up to 16 ran a 9-row product 0.96x but 16 rows 1.30x and 64 rows 1.25x the time of 8. */
#define AVX2_TILE 8
#endif
#define AVX2_TILES TSQ_TILES8

/* each lane's sum of four byte products (unsigned w, signed x) */
static inline __attribute__((always_inline)) __m256i dot4_avx2(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

/* One weight group against one input row (step256's arithmetic without VNNI). W as wgroup_simd
 * gives it: Q8_0's codes are c + 128 there, turned back to signed here. */
static inline __attribute__((always_inline)) void step_avx2(const int type, const int sh, const int mn,
                                                            const __m256i W[4], __m256 a, __m256 mw,
                                                            const xgroup *xg, __m256 *acc, __m256 *accm) {
    __m256i is = _mm256_setzero_si256();
    if (type == T_Q8_0) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int j = 0; j < 4; j++) {
            const __m256i c = _mm256_xor_si256(W[j], flip);
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xg->q + 32 * j));
            is = _mm256_add_epi32(is, dot4_avx2(_mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c)));
        }
    } else {
        __m256i p[4];
        for (int j = 0; j < 4; j++) p[j] = _mm256_maddubs_epi16(W[j], _mm256_loadu_si256((const __m256i *)(xg->q + 32 * j)));
        const __m256i ones = _mm256_set1_epi16(1);
        if (type == T_Q6_K) {
            is = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                                  _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
        } else {
            is = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
        }
        if (sh) is = _mm256_sub_epi32(is, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)xg->s), sh));
    }
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(a, _mm256_loadu_ps(xg->d)), *acc);
    if (mn) *accm = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xg->fs), *accm);
}

/* nrows weight rows (rb bytes apart; results to y[0..nrows)) against tr input rows (xstride groups
 * apart; row r's results at y[r * ldy]) over all groups */
static inline __attribute__((always_inline)) void dot_avx2_t(const int type, const int tr, const uint8_t *w,
                                                             long k, int packed, const xgroup *x, long xstride,
                                                             float *y, long ldy, long nrows, long rb) {
    const long ng = n_groups(k), nblocks = k / QB;
    const int sh = offset_shift(type), mg = type == T_Q4_1;
    for (long n = 0; n < nrows; n++, w += rb, y++) {
        __m256 acc[AVX2_TILE], accm[AVX2_TILE];
        for (int r = 0; r < tr; r++) acc[r] = accm[r] = _mm256_setzero_ps();
        if (type == T_Q4_K) { /* a super-block (two groups) at a time, its scales unpacked once */
            const __m256i m4 = _mm256_set1_epi8(0x0F);
            for (long sb = 0; sb < ng / 2; sb++) {
                const uint8_t *p = w + sb * 144;
                pf_ahead(p, 144);
                __m128i sc0, sc1;
                __m256 mw8;
                float d1;
                q4k_header(p, &sc0, &sc1, &mw8, &d1);
                for (int r = 0; r < tr; r++)
                    acc[r] = _mm256_fmadd_ps(mw8, _mm256_loadu_ps(x[r * xstride + 2 * sb].fs), acc[r]);
                for (int gi = 0; gi < 2; gi++) {
                    const __m256 a = _mm256_mul_ps(_mm256_set1_ps(d1),
                                                   _mm256_cvtepi32_ps(_mm256_broadcastsi128_si256(gi ? sc1 : sc0)));
                    const uint8_t *q = p + 16 + 64 * gi;
                    const __m256i q0 = _mm256_loadu_si256((const __m256i *)q), q1 = _mm256_loadu_si256((const __m256i *)(q + 32));
                    __m256i W[4];
                    W[0] = _mm256_and_si256(q0, m4);
                    W[1] = _mm256_and_si256(_mm256_srli_epi16(q0, 4), m4);
                    W[2] = _mm256_and_si256(q1, m4);
                    W[3] = _mm256_and_si256(_mm256_srli_epi16(q1, 4), m4);
                    if (!packed) transpose4(W[0], W[1], W[2], W[3], W);
                    for (int r = 0; r < tr; r++)
                        step_avx2(type, 0, 0, W, a, _mm256_setzero_ps(), x + r * xstride + 2 * sb + gi, &acc[r], &accm[r]);
                }
            }
        } else {
            for (long g = 0; g < ng; g++) {
                __m256i W[4];
                __m256 a, mw;
                wgroup_simd(type, w, g, nblocks, packed, W, &a, &mw);
                for (int r = 0; r < tr; r++) step_avx2(type, sh, mg, W, a, mw, x + r * xstride + g, &acc[r], &accm[r]);
            }
        }
        for (int r = 0; r < tr; r++) y[r * ldy] = hsum8(mg ? _mm256_add_ps(acc[r], accm[r]) : acc[r]);
    }
}

static void dot_avx2(int type, int tr, const uint8_t *w, long k, int pk, const xgroup *x, long xs, float *y, long ldy,
                     long nrows, long rb) {
#define A2(T, n) dot_avx2_t(T, n, w, k, pk, x, xs, y, ldy, nrows, rb)
    TSQ_DISPATCH(type, tr, AVX2_TILES, A2)
#undef A2
}

#ifndef AVX2_BLOCK_BYTES
#define AVX2_BLOCK_BYTES (128 * 1024) /* weight bytes a block of rows may span and stay in L2 */
#endif

static int matmul_avx2(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k,
                       const xgroup *xq, long m, float *y, long ldy, int n_threads) {
    return tsq_matmul_rowtiles(dot_avx2, AVX2_BLOCK_BYTES, AVX2_TILE, type, w, packed, row_bytes, n_rows, k, xq, m, y, ldy, n_threads);
}
