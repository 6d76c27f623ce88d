/* Products with GGUF weights as the file stores them: y[m, n] = sum_k x[m, k] * W[n, k].
 *
 * W is read in its own GGUF block layout (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, and the float types
 * F32, F16, BF16): the codes and scales used are the stored ones, nothing is rounded. (tsq_repack
 * may permute the code bits within each 128-element group once, at load, so the SIMD product
 * needs no shuffles; it changes no value.) For the quantized types the input rows are quantized
 * per 32-element block to int8 with a float scale (as llama.cpp quantizes activations for its
 * legacy types) and laid out in groups of 128 (xgroup); each 16-element half-block contributes
 * dx * a * sum(qw * qx) with the integer sum exact, and each 32-element block of Q4_1/Q4_K
 * m * dx * sum(qx), the float terms accumulated in eight lanes in a fixed order (Q4_K's offsets
 * once per super-block, ahead of its products, in the same lanes). Float types multiply the
 * float32 input.
 *
 * Batch invariance: y[m, n] is computed by one fixed sequence of operations on row m of x and
 * row n of W, whatever the number of rows M, the tile a row lands in, or the thread that owns n.
 * Threads split the output columns only. So a row's result is the same in a 1-row decode and in
 * a 9-row verify, bit for bit, which is what keeps speculative output equal to plain output.
 *
 * One implementation of every type per instruction-set level (tsq.h TSQ_ISA): the plain C
 * reference (also the scalar level), AVX-512 VNNI/VL, AVX2 (avx2.h) and ARM NEON (neon.c). All take
 * the same exact integer sums and the same float steps in the same order: the reference performs
 * the SIMD paths' float steps lane by lane, so every level equals it bit for bit, the float types
 * included (tests compare them all). Compile with -ffp-contract=off: the scalar float terms must
 * not be fused differently in different places.
 */
#include "tsq.h"

int tsq_simd(void) { return TSQ_SIMD; }
int tsq_isa(void) { return TSQ_ISA; }

/* bytes of one weight row of K elements (-1 when K is not whole blocks) */
long tsq_row_bytes(int type, long k) {
    if (type < 0 || type >= T_COUNT || k % BLOCK_ELEMS[type]) return -1;
    return k / BLOCK_ELEMS[type] * BLOCK_BYTES[type];
}

/* ------------------------------------------------------------------ activation quantization */


/* max |v[i]| in 8 lanes (vectorizes; max is exact, so the lane split changes nothing).
 * Rounding below is rintf: round-to-nearest-even, inlined as one instruction (nearbyintf was a
 * libm call per element, ~4 ms per token on qwen2.5-coder-1.5b). */
static inline float absmax(const float *v, int n) {
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; i += 8)
        for (int j = 0; j < 8; j++) {
            const float a = fabsf(v[i + j]);
            l[j] = a > l[j] ? a : l[j]; /* vmaxps; fmaxf was a libm call (NaN rules) */
        }
    float a = 0.f;
    for (int j = 0; j < 8; j++) a = l[j] > a ? l[j] : a;
    return a;
}

static void quantize_row(const float *x, long k, xgroup *out) {
    if (k % QG) memset(out + k / QG, 0, sizeof(xgroup));
    for (long blk = 0; blk < k / QB; blk++) {
        const float *v = x + blk * QB;
        xgroup *g = out + blk / 4;
        const int b = (int)(blk % 4);
        const float amax = absmax(v, QB);
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
#if TSQ_HAS_AVX2
        /* the same steps, eight elements at a time: cvtps rounds to nearest even as rintf does */
        const __m256 vid = _mm256_set1_ps(id);
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        int32_t words[8];
        __m256i half[2];
        for (int h = 0; h < 2; h++) {
            const __m256i q0 = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * h), vid))));
            const __m256i q1 = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * h + 8), vid))));
            half[h] = _mm256_add_epi32(q0, q1);
#if TSQ_SIMD
            _mm_storel_epi64((__m128i *)(words + 4 * h), _mm256_cvtepi32_epi8(q0));
            _mm_storel_epi64((__m128i *)(words + 4 * h + 2), _mm256_cvtepi32_epi8(q1));
#else /* the same 16 bytes by packing (the values are in [-127, 127]: no saturation) */
            const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
            _mm_storeu_si128((__m128i *)(words + 4 * h),
                             _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1)));
#endif
        }
        int bsum = 0;
        for (int h = 0; h < 2; h++) {
            const int L = 4 * h + b;
            for (int j = 0; j < 4; j++) memcpy(g->q + 32 * j + 4 * L, words + 4 * h + j, 4);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(half[h]), _mm256_extracti128_si256(half[h], 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            const int sum = _mm_cvtsi128_si32(s4);
            g->d[L] = d;
            g->s[L] = sum;
            bsum += sum;
        }
        g->fs[b] = d * (float)bsum;
#else
        int bsum = 0;
        for (int h = 0; h < 2; h++) {
            const int L = 4 * h + b;
            int sum = 0;
            for (int e = 0; e < 16; e++) {
                int q = (int)rintf(v[16 * h + e] * id);
                q = q > 127 ? 127 : (q < -127 ? -127 : q);
                g->q[(e / 4) * 32 + 4 * L + e % 4] = (int8_t)q;
                sum += q;
            }
            g->d[L] = d;
            g->s[L] = sum;
            bsum += sum;
        }
        g->fs[b] = d * (float)bsum;
#endif
    }
    /* lanes 4..7 of fs: the next group's block sums in an even group, zero in an odd one */
    const long ng = n_groups(k);
    for (long gi = 0; gi < ng; gi++)
        for (int b = 0; b < 4; b++) out[gi].fs[4 + b] = (gi % 2 == 0 && gi + 1 < ng) ? out[gi + 1].fs[b] : 0.f;
}

/* bytes of one quantized input row of k elements */
long tsq_xrow_bytes(long k) { return n_groups(k) * (long)sizeof(xgroup); }

#if TSQ_SIMD
/* rows 2p and 2p+1 of xq (m rows of ng groups) as pair p of out, group by group (group g's m / 2
 * pairs side by side at out + g * (m / 2): a tile's pairs of one group are then a constant stride
 * apart, and its products advance one pointer a group where they advanced one a pair, 2-5% of a
 * 16- or 512-row forward of qwen2.5-coder-1.5b, scripts/ab_kernels.py), each
 * code sum s as -s 2^sh (the weight type's offset, offset_shift): exact integers, the shift the
 * 256-bit product does per row and group done once here, and the 512-bit product's integer sums
 * start from it where the 256-bit one subtracts s 2^sh after them (the same integer either way) */
static void pair_group(const xgroup *a, const xgroup *b, int sh, xpair *o) {
    for (int j = 0; j < 4; j++) {
        memcpy(o->q + 64 * j, a->q + 32 * j, 32);
        memcpy(o->q + 64 * j + 32, b->q + 32 * j, 32);
    }
    memcpy(o->d, a->d, sizeof a->d);
    memcpy(o->d + 8, b->d, sizeof b->d);
    for (int L = 0; L < 8; L++) {
        o->s[L] = -a->s[L] * (1 << sh);
        o->s[L + 8] = -b->s[L] * (1 << sh);
    }
    memcpy(o->fs, a->fs, sizeof a->fs);
    memcpy(o->fs + 8, b->fs, sizeof b->fs);
}

static void pair_rows(const xgroup *xq, long m, long ng, int sh, xpair *out) {
    /* called inside a parallel region, the pairs are shared out among its threads (one thread alone
     * did a prefill chunk's while the others waited, ~1% of a prefill); outside one, this thread
     * does them all */
#pragma omp for schedule(static)
    for (long p = 0; p < m / 2; p++)
        for (long g = 0; g < ng; g++) pair_group(xq + 2 * p * ng + g, xq + (2 * p + 1) * ng + g, sh, out + g * (m / 2) + p);
}

/* one input row paired with itself: for a lone row, two weight rows share each 512-bit register */
static void dup_row(const xgroup *xq, long ng, int sh, xpair *out) {
    for (long g = 0; g < ng; g++) pair_group(xq + g, xq + g, sh, out + g);
}

/* The calling thread's scratch for paired rows, kept between calls (a prefill chunk's pairs are
 * ~0.5 MB on the widest products; allocating that per product went through mmap each time). NULL
 * when memory runs out. */
static xpair *pair_scratch(long n) {
    static _Thread_local xpair *buf = NULL;
    static _Thread_local long cap = 0;
    if (n > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)n * sizeof(xpair));
        cap = buf ? n : 0;
    }
    return buf;
}
#endif

void tsq_quantize(const float *x, long m, long k, xgroup *out) {
#pragma omp parallel for schedule(static) if (m >= 4)
    for (long r = 0; r < m; r++) quantize_row(x + r * k, k, out + r * n_groups(k));
}

/* ------------------------------------------------------------------ dequantization (reference) */

/* one row of K elements to float32, exactly as ggml dequantizes it */
static void dequant_row(int type, const uint8_t *w, long k, float *y) {
    switch (type) {
    case T_F32: memcpy(y, w, k * 4); return;
    case T_F16: for (long i = 0; i < k; i++) y[i] = f16_to_f32(rd16(w + 2 * i)); return;
    case T_BF16: for (long i = 0; i < k; i++) y[i] = bf16_to_f32(rd16(w + 2 * i)); return;
    default: break;
    }
    long nb = k / BLOCK_ELEMS[type];
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * BLOCK_BYTES[type];
        float *o = y + b * BLOCK_ELEMS[type];
        if (type == T_Q4_0) {
            float d = f16_to_f32(rd16(p));
            for (int j = 0; j < 16; j++) {
                o[j] = ((p[2 + j] & 0xF) - 8) * d;
                o[j + 16] = ((p[2 + j] >> 4) - 8) * d;
            }
        } else if (type == T_Q4_1) {
            float d = f16_to_f32(rd16(p)), m = f16_to_f32(rd16(p + 2));
            for (int j = 0; j < 16; j++) {
                o[j] = (p[4 + j] & 0xF) * d + m;
                o[j + 16] = (p[4 + j] >> 4) * d + m;
            }
        } else if (type == T_Q5_0) {
            float d = f16_to_f32(rd16(p));
            uint32_t qh = rd32(p + 2);
            for (int j = 0; j < 16; j++) {
                int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
                o[j] = (((p[6 + j] & 0xF) | h0) - 16) * d;
                o[j + 16] = (((p[6 + j] >> 4) | h1) - 16) * d;
            }
        } else if (type == T_Q8_0) {
            float d = f16_to_f32(rd16(p));
            for (int j = 0; j < 32; j++) o[j] = (int8_t)p[2 + j] * d;
        } else if (type == T_Q4_K) {
            float d = f16_to_f32(rd16(p)), dmin = f16_to_f32(rd16(p + 2));
            const uint8_t *sc = p + 4, *q = p + 16;
            for (int j = 0; j < 4; j++) {
                int s0, m0, s1, m1;
                scale_min_k4(2 * j, sc, &s0, &m0);
                scale_min_k4(2 * j + 1, sc, &s1, &m1);
                float d1 = d * s0, c1 = dmin * m0, d2 = d * s1, c2 = dmin * m1;
                for (int l = 0; l < 32; l++) o[64 * j + l] = d1 * (q[32 * j + l] & 0xF) - c1;
                for (int l = 0; l < 32; l++) o[64 * j + 32 + l] = d2 * (q[32 * j + l] >> 4) - c2;
            }
        } else if (type == T_Q6_K) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            float d = f16_to_f32(rd16(p + 208));
            for (int h = 0; h < 2; h++) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    o[l] = d * sc[is] * q1;
                    o[l + 32] = d * sc[is + 2] * q2;
                    o[l + 64] = d * sc[is + 4] * q3;
                    o[l + 96] = d * sc[is + 6] * q4;
                }
                o += 128; ql += 64; qh += 32; sc += 8;
            }
        }
    }
}

/* ------------------------------------------------------------------ weight groups
 * The weights meet the input group by group: four 32-element blocks (a K-quant super-block is two
 * groups). Codes are taken unsigned, so that vpdpbusd (unsigned x signed) multiplies them: Q4_0's
 * c - 8 is read as c with offset 8, Q5_0's as offset 16, Q8_0's as c + 128 with offset 128, Q6_K's
 * as offset 32. The offset comes back exactly, in integers, through the input's half-block sums:
 * sum((c - o) q) = sum(c q) - o sum(q), o a power of two. Per lane L (= 4h + b, as in xgroup) a
 * group has a float scale a[L] (Q4_K: d * sc, Q6_K: d * sc of that 16-element half). Q4_1 and
 * Q4_K have float offsets per block that multiply the input's d * (its block's code sum),
 * xgroup.fs: Q4_1's four in lanes 0-3 of m (per group), Q4_K's super-block's eight in m[0..7]. */
typedef struct {
    uint8_t c[QG]; /* unsigned codes in element order; zero for blocks past the row's end */
    float a[8], m[8]; /* m: Q4_1 block b's offset in lane b (4..7 zero); Q4_K the super-block's eight */
} wgroup;

static inline int has_min(int type) { return type == T_Q4_1 || type == T_Q4_K; }

/* The code bits of weight group g as four 32-byte vectors B[b], in the order the SIMD extraction
 * reads them (legacy and Q4_K: B[b] is block or sub-block b, element order; Q6_K: sub-block u).
 * Q8_0 gives its stored bytes. pack_codes writes B back to the same bit positions. */
static void unpack_block(int type, const uint8_t *p, uint8_t c[32]) { /* one legacy block */
    if (type == T_Q8_0) { memcpy(c, p + 2, 32); return; }
    const uint8_t *qs = p + (type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : 6);
    for (int i = 0; i < 16; i++) { c[i] = qs[i] & 0xF; c[i + 16] = qs[i] >> 4; }
    if (type == T_Q5_0) { /* bit i of qh is element i's fifth bit */
        const uint32_t qh = rd32(p + 2);
        for (int i = 0; i < 32; i++) c[i] |= ((qh >> i) & 1) << 4;
    }
}

static void unpack_codes(int type, const uint8_t *w, long g, uint8_t B[4][32]) {
    if (type == T_Q4_K) {
        const uint8_t *q = w + (g / 2) * 144 + 16 + 64 * (g % 2);
        for (int i = 0; i < 32; i++) {
            B[0][i] = q[i] & 0xF; B[1][i] = q[i] >> 4;
            B[2][i] = q[32 + i] & 0xF; B[3][i] = q[32 + i] >> 4;
        }
    } else if (type == T_Q6_K) {
        const uint8_t *p = w + (g / 2) * 210, *ql = p + 64 * (g % 2), *qh = p + 128 + 32 * (g % 2);
        for (int u = 0; u < 4; u++)
            for (int i = 0; i < 32; i++) {
                const int v = ql[32 * (u & 1) + i];
                B[u][i] = (uint8_t)(((u < 2) ? (v & 0xF) : (v >> 4)) | (((qh[i] >> (2 * u)) & 3) << 4));
            }
    } else {
        for (int b = 0; b < 4; b++) unpack_block(type, w + (4 * g + b) * BLOCK_BYTES[type], B[b]);
    }
}

static void pack_codes(int type, uint8_t *w, long g, uint8_t B[4][32]) {
    if (type == T_Q4_K) {
        uint8_t *q = w + (g / 2) * 144 + 16 + 64 * (g % 2);
        for (int i = 0; i < 32; i++) {
            q[i] = (uint8_t)(B[0][i] | (B[1][i] << 4));
            q[32 + i] = (uint8_t)(B[2][i] | (B[3][i] << 4));
        }
    } else if (type == T_Q6_K) {
        uint8_t *p = w + (g / 2) * 210, *ql = p + 64 * (g % 2), *qh = p + 128 + 32 * (g % 2);
        for (int i = 0; i < 32; i++) {
            ql[i] = (uint8_t)((B[0][i] & 0xF) | ((B[2][i] & 0xF) << 4));
            ql[32 + i] = (uint8_t)((B[1][i] & 0xF) | ((B[3][i] & 0xF) << 4));
            qh[i] = (uint8_t)((B[0][i] >> 4) | ((B[1][i] >> 4) << 2) | ((B[2][i] >> 4) << 4) | ((B[3][i] >> 4) << 6));
        }
    } else {
        for (int b = 0; b < 4; b++) {
            uint8_t *p = w + (4 * g + b) * BLOCK_BYTES[type];
            if (type == T_Q8_0) { memcpy(p + 2, B[b], 32); continue; }
            uint8_t *qs = p + (type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : 6);
            for (int i = 0; i < 16; i++) qs[i] = (uint8_t)((B[b][i] & 0xF) | ((B[b][i + 16] & 0xF) << 4));
            if (type == T_Q5_0) {
                uint32_t qh = 0;
                for (int i = 0; i < 32; i++) qh |= (uint32_t)((B[b][i] >> 4) & 1) << i;
                memcpy(p + 2, &qh, 4);
            }
        }
    }
}

/* The transpose the products apply to a group's code vectors (transpose4): 4-byte word (h, b) of
 * out[j] is word (h, j) of B[b], h the 16-byte half. It is its own inverse. */
static void transpose_codes(uint8_t B[4][32], uint8_t out[4][32]) {
    for (int j = 0; j < 4; j++)
        for (int L = 0; L < 8; L++) memcpy(&out[j][4 * L], &B[L % 4][16 * (L / 4) + 4 * j], 4);
}

/* Whole groups of a row (k elements) as the products can use them without transposing. */
static inline long packable_groups(int type, long k) { return (type == T_Q4_K || type == T_Q6_K) ? k / 128 : k / QG; }

/* Weights stored for the products: a copy of n_rows rows of `type` (row_bytes each) in which every
 * whole group's code bits are stored transposed (transpose_codes), so the SIMD product reads the
 * words it multiplies with the extraction alone. Scales, and a short last group, stay as they are;
 * every value is unchanged (dequantization and products of packed rows equal the plain ones).
 * Applying it twice gives the stored layout back. Returns -1 for a type it does not pack. */
static void transpose_row(int type, uint8_t *row, long ng) {
    uint8_t B[4][32], T[4][32];
    for (long g = 0; g < ng; g++) {
        unpack_codes(type, row, g, B);
        transpose_codes(B, T);
        pack_codes(type, row, g, T);
    }
}

/* Q4_0, Q4_1 and Q8_0 go further: each whole group of four blocks becomes one record, the four f16
 * scales first (then Q4_1's four offsets), then the transposed code vectors T[0..3] (Q8_0: 32 bytes
 * each, stored XOR 0x80 as the product multiplies them; 4-bit: byte i holds T[0][i] | T[1][i] << 4,
 * byte 32 + i T[2][i] | T[3][i] << 4). The product then reads a group's scales with one load and its
 * codes with two, instead of gathering them block by block: on Intel cores the gather's shuffles
 * all queued on one port and bounded a one-row product (Q4_1 ran at 0.55x llama.cpp's decode). The
 * record has the four blocks' size and place, so a short last group stays as stored; values are
 * unchanged. Not its own inverse: tsq_unpack restores the file's layout. */

static void gm_pack(int type, const uint8_t *src, uint8_t *rec) { /* four stored blocks -> a record */
    const int bb = BLOCK_BYTES[type];
    uint8_t B[4][32], T[4][32];
    for (int b = 0; b < 4; b++) {
        memcpy(rec + 2 * b, src + b * bb, 2);
        if (type == T_Q4_1) memcpy(rec + 8 + 2 * b, src + b * bb + 2, 2);
    }
    unpack_codes(type, src, 0, B);
    transpose_codes(B, T);
    uint8_t *c = rec + gm_codes_at(type);
    for (int i = 0; i < 32; i++) {
        if (type == T_Q8_0) {
            for (int j = 0; j < 4; j++) c[32 * j + i] = T[j][i] ^ 0x80;
        } else {
            c[i] = (uint8_t)(T[0][i] | (T[1][i] << 4));
            c[32 + i] = (uint8_t)(T[2][i] | (T[3][i] << 4));
        }
    }
}

/* the transposed code vectors of a record, as unpack_codes gives a stored group's (Q8_0: signed) */
static void gm_codes(int type, const uint8_t *rec, uint8_t T[4][32]) {
    const uint8_t *c = rec + gm_codes_at(type);
    for (int i = 0; i < 32; i++) {
        if (type == T_Q8_0) {
            for (int j = 0; j < 4; j++) T[j][i] = c[32 * j + i] ^ 0x80;
        } else {
            T[0][i] = c[i] & 0xF; T[1][i] = c[i] >> 4;
            T[2][i] = c[32 + i] & 0xF; T[3][i] = c[32 + i] >> 4;
        }
    }
}

static void gm_unpack(int type, const uint8_t *rec, uint8_t *dst) { /* a record -> four stored blocks */
    const int bb = BLOCK_BYTES[type];
    uint8_t B[4][32], T[4][32];
    gm_codes(type, rec, T);
    transpose_codes(T, B);
    for (int b = 0; b < 4; b++) {
        memcpy(dst + b * bb, rec + 2 * b, 2);
        if (type == T_Q4_1) memcpy(dst + b * bb + 2, rec + 8 + 2 * b, 2);
    }
    pack_codes(type, dst, 0, B);
}

static void repack_row(int type, uint8_t *row, long ng, int inverse) {
    if (!group_major(type)) { transpose_row(type, row, ng); return; } /* its own inverse */
    const long gb = 4L * BLOCK_BYTES[type];
    uint8_t tmp[4 * 34];
    for (long g = 0; g < ng; g++) {
        memcpy(tmp, row + g * gb, gb);
        if (inverse) gm_unpack(type, tmp, row + g * gb);
        else gm_pack(type, tmp, row + g * gb);
    }
}

/* nt threads (the caller's count: a repack inside the loader's pool of layer threads takes one,
 * or every pool thread opened a team as wide as the machine, 74 threads at once on 8 cores) */
static int repack_rows(int type, const uint8_t *w, long row_bytes, long n_rows, long k, uint8_t *out, int inverse,
                       int nt) {
    if (type < T_Q4_0 || type >= T_COUNT || tsq_row_bytes(type, k) != row_bytes) return -1;
    if (out != w) memcpy(out, w, (size_t)row_bytes * n_rows);
    const long ng = packable_groups(type, k);
    if (nt < 1) nt = 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (long n = 0; n < n_rows; n++) repack_row(type, out + n * row_bytes, ng, inverse);
    return 0;
}

int tsq_repack(int type, const uint8_t *w, long row_bytes, long n_rows, long k, uint8_t *out, int nt) {
    return repack_rows(type, w, row_bytes, n_rows, k, out, 0, nt);
}

/* the inverse of tsq_repack: rows as the file stores them */
int tsq_unpack(int type, const uint8_t *w, long row_bytes, long n_rows, long k, uint8_t *out, int nt) {
    return repack_rows(type, w, row_bytes, n_rows, k, out, 1, nt);
}

/* rows ids[0..n) of a [rows, K] weight (packed: stored by tsq_repack) to float32 out [n, K]
 * (embedding lookups: a tied output head and its embedding share one packed copy) */
int tsq_dequant_rows(int type, const uint8_t *w, int packed, long row_bytes, long k, const int64_t *ids, long n,
                     float *out) {
    uint8_t *tmp = packed && !is_float_type(type) ? malloc(row_bytes) : NULL;
    if (packed && !is_float_type(type) && !tmp) return -2;
    for (long i = 0; i < n; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        if (tmp) {
            memcpy(tmp, row, row_bytes);
            repack_row(type, tmp, packable_groups(type, k), 1);
            row = tmp;
        }
        dequant_row(type, row, k, out + i * k);
    }
    free(tmp);
    return 0;
}

/* group g of a weight row of nblocks 32-element blocks (packed: stored by tsq_repack) */
static void get_wgroup(int type, const uint8_t *w, long g, long nblocks, int packed, wgroup *o) {
    memset(o, 0, sizeof *o);
    uint8_t B[4][32];
    const int whole = (type == T_Q4_K || type == T_Q6_K) || 4 * g + 4 <= nblocks;
    if (packed && whole && group_major(type)) { /* a record (tsq_repack) */
        const uint8_t *rec = w + g * 4L * BLOCK_BYTES[type];
        uint8_t T[4][32];
        gm_codes(type, rec, T);
        transpose_codes(T, B);
        memcpy(o->c, B, QG);
        for (int i = 0; type == T_Q8_0 && i < QG; i++) o->c[i] ^= 0x80;
        for (int b = 0; b < 4; b++) {
            o->a[b] = o->a[b + 4] = f16_to_f32(rd16(rec + 2 * b));
            if (type == T_Q4_1) o->m[b] = f16_to_f32(rd16(rec + 8 + 2 * b));
        }
        return;
    }
    if (whole) {
        unpack_codes(type, w, g, B);
        if (packed) {
            uint8_t T[4][32];
            transpose_codes(B, T);
            memcpy(B, T, sizeof B);
        }
        memcpy(o->c, B, QG);
    } else { /* a short last group: the blocks there are */
        for (long b = 0; 4 * g + b < nblocks; b++) unpack_block(type, w + (4 * g + b) * BLOCK_BYTES[type], o->c + 32 * b);
    }
    if (type == T_Q8_0)
        for (int i = 0; i < QG; i++) o->c[i] ^= 0x80;
    if (type == T_Q4_K) {
        const uint8_t *p = w + (g / 2) * 144;
        const float d = f16_to_f32(rd16(p)), dmin = f16_to_f32(rd16(p + 2));
        for (int b = 0; b < 4; b++) {
            int sc, mn;
            scale_min_k4(4 * (int)(g % 2) + b, p + 4, &sc, &mn);
            o->a[b] = o->a[b + 4] = d * (float)sc;
        }
        for (int j = 0; j < 8; j++) { /* the super-block's eight offsets (its even group takes them) */
            int sc, mn;
            scale_min_k4(j, p + 4, &sc, &mn);
            o->m[j] = -(dmin * (float)mn);
        }
        return;
    }
    if (type == T_Q6_K) {
        const uint8_t *p = w + (g / 2) * 210;
        const int8_t *sc = (const int8_t *)(p + 192) + 8 * (g % 2);
        const float d = f16_to_f32(rd16(p + 208));
        for (int u = 0; u < 4; u++) {
            o->a[u] = d * (float)sc[2 * u];
            o->a[u + 4] = d * (float)sc[2 * u + 1];
        }
        return;
    }
    for (int b = 0; b < 4 && 4 * g + b < nblocks; b++) {
        const uint8_t *p = w + (4 * g + b) * BLOCK_BYTES[type];
        o->a[b] = o->a[b + 4] = f16_to_f32(rd16(p));
        if (type == T_Q4_1) o->m[b] = f16_to_f32(rd16(p + 2));
    }
}

/* Weight group g of a row as the tile backend (amx.c) takes it: lane L's 16 unsigned codes at
 * lanes[16 L ..] in element order (lane L = 4h + b: half h of block b, as in xgroup), its eight
 * lane scales a[] and the offsets m[] (wgroup's), all exactly as the reference reads them. */
void tsq_weight_group(int type, const uint8_t *w, long g, long nblocks, int packed, uint8_t lanes[QG], float a[8],
                      float m[8]) {
    wgroup wg;
    get_wgroup(type, w, g, nblocks, packed, &wg);
    for (int L = 0; L < 8; L++) memcpy(lanes + 16 * L, wg.c + 32 * (L % 4) + 16 * (L / 4), 16);
    memcpy(a, wg.a, sizeof wg.a);
    memcpy(m, wg.m, sizeof wg.m);
}

int tsq_offset_shift(int type) { return offset_shift(type); }

/* ------------------------------------------------------------------ reference products */

/* The SIMD product's arithmetic, one lane at a time (the same float steps, so the same result) */
static float dot_ref_q(int type, const uint8_t *w, long k, int packed, const xgroup *x) {
    float acc[8] = {0}, accm[8] = {0};
    const int sh = offset_shift(type);
    wgroup wg;
    for (long g = 0; g < n_groups(k); g++) {
        get_wgroup(type, w, g, k / QB, packed, &wg);
        if (type == T_Q4_K && g % 2 == 0) /* a super-block's offsets, into acc ahead of its products */
            for (int L = 0; L < 8; L++) acc[L] = fmaf(wg.m[L], x[g].fs[L], acc[L]);
        for (int L = 0; L < 8; L++) {
            const int b = L % 4, h = L / 4;
            int isum = 0;
            for (int e = 0; e < 16; e++) isum += wg.c[32 * b + 16 * h + e] * x[g].q[(e / 4) * 32 + 4 * L + e % 4];
            if (sh) isum -= x[g].s[L] * (1 << sh);
            acc[L] = fmaf((float)isum, wg.a[L] * x[g].d[L], acc[L]);
        }
        if (type == T_Q4_1) /* offsets per group, apart (lanes 4..7 of m are zero) */
            for (int L = 0; L < 8; L++) accm[L] = fmaf(wg.m[L], x[g].fs[L], accm[L]);
    }
    if (type == T_Q4_1)
        for (int L = 0; L < 8; L++) acc[L] += accm[L];
    return sum8(acc);
}
/* A float weight's element i */
static inline float wf(int type, const uint8_t *w, long i) {
    return type == T_F32 ? ((const float *)w)[i] : type == T_F16 ? f16_to_f32(rd16(w + 2 * i)) : bf16_to_f32(rd16(w + 2 * i));
}

/* The SIMD float product's arithmetic, lane by lane: eight fma chains over the whole groups of 8
 * (lane u takes elements 8t + u), reduced as sum8, plus the tail's products added in order. */
static float dot_ref_f(int type, const uint8_t *w, long k, const float *x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, tail = 0.f;
    const long k8 = k & ~7L;
    for (long i = 0; i < k8; i += 8)
        for (int u = 0; u < 8; u++) acc[u] = fmaf(wf(type, w, i + u), x[i + u], acc[u]);
    for (long i = k8; i < k; i++) tail += wf(type, w, i) * x[i];
    return sum8(acc) + tail;
}

/* ------------------------------------------------------------------ x86 products
 * What the AVX-512 VNNI and the AVX2 levels share (256-bit AVX2/FMA/F16C code): a weight group
 * unpacked into registers (wgroup_simd), the float products (dot_simd_f). Then each level's own
 * integer sums and drivers. */
#if TSQ_HAS_AVX2
#define TILE 4
/* A verify of up to 16 rows runs as ONE tile of that height when its input fits in L1: each weight
 * group is then unpacked once for all rows (as tiles of four, the fifth row paid a whole second
 * unpacking pass, ~0.6 of a one-row product). Longer inputs (prefill chunks) take tiles of 16 or 8
 * rows where that many fit in L1 whole, else tiles of four: on Zen 4 an 8-row tile over the
 * 8960-wide down projection ran 1.15-1.48x slower. Within a tile, rows go two to a 512-bit
 * register (xpair): a dpbusd of 512 bits costs what one of 256 does on the Intel kind (two per
 * cycle either way), so a pair of rows takes the instructions one row took. (On Zen 4, which
 * splits 512-bit operations in two, pairing should gain nothing; not measured there.) The tile
 * height changes no output element's operations. A tile too wide for L1 goes in k-chunks, its
 * accumulators parked between them (``state``, laid out for QTILE_MAX rows). Up to 17 rows (a
 * verify of 16 drafted tokens and the last accepted one) are one tile: as 16 and 1, the lone row
 * paid a second unpacking pass over every weight group. (Chunked tiles were at most 8 rows until
 * a 9-row verify over a down projection, chunked for its 8960 inputs, went as 8 and 1 the same
 * way.) */
#define QTILE_MAX 17
/* Weight bytes ahead of the one being read that each step asks the cache to fetch. The hardware
 * prefetchers stop at every 4 KiB page and a verify's small matrices are a few pages per thread,
 * so without it a one-row product over smollm2's blocks read ~10 GB/s from memory on an Intel
 * core (with 2 KiB ahead ~15). Every product asks through pf_ahead (below): one fetch per group or
 * super-block on the AVX-512 level, every line on AVX2; past a row's end it fetches the next row. 16 KiB ahead against 2 KiB (paired in one process, builds alternating per 8 steps,
 * Intel Xeon, 2 threads): decode step 0.83x the time on qwen2.5-coder-1.5b, 0.86x on gemma3-270m,
 * 0.94x on smollm2-135m; 5-row verify 0.94-0.96x; a 64-row prefill chunk 0.99x. 32 KiB was slower
 * on smollm2 (1.07x of 16), 8 KiB the same on qwen-1.5b. */
#ifndef PF_AHEAD
#define PF_AHEAD 16384
#endif
/* Ask for the `bytes` weight bytes at p, PF_AHEAD further on. On the AVX2 level every 64-byte line
 * of them: one request per super-block or group (144 bytes of Q4_K, 105 of a Q6_K half, 72-136 of a
 * legacy record) left the other lines to the hardware, and on an AMD EPYC (Zen 3) a one-row decode
 * step then stalled on those loads: qwen2.5-coder-1.5b 43.1 -> 32.4 ms a step with every line asked
 * for (scripts/ab_kernels.py, paired in one process). Intel's adjacent-line prefetcher fetches 128
 * bytes for one request; the AVX-512 level keeps the one request it was measured with there. */
static inline __attribute__((always_inline)) void pf_ahead(const void *p, const int bytes) {
#if TSQ_SIMD
    (void)bytes;
    _mm_prefetch((const char *)p + PF_AHEAD, _MM_HINT_T0);
#else
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + PF_AHEAD + o, _MM_HINT_T0);
#endif
}
/* (47 KiB of input rows in a 48 KiB L1: qwen2.5-coder-1.5b's 1536-wide rows fit 17 to a tile, 44.6
 * KiB; with 32 KiB they went 8 to a tile and 32-row Q4_K products took 1.2-1.3x longer, and with 44
 * KiB a 17-row verify (16 drafted tokens) was taken in k-chunks on every matrix, its accumulators
 * parked between them: a forward of qwen2.5-coder-1.5b's blocks and head 0.912x the time with 47,
 * gemma3-270m's 13 rows 0.974x, scripts/ab_kernels.py) */
static inline int one_q_tile(long m, long ng) {
    return m <= TILE || (m <= QTILE_MAX && m * ng * (long)sizeof(xgroup) <= 47 * 1024);
}


/* W[j] = word j of the four blocks b0..b3: a 4x4 transpose of 32-bit words in each 128-bit lane */
static inline __attribute__((always_inline)) void transpose4(__m256i b0, __m256i b1, __m256i b2, __m256i b3,
                                                             __m256i W[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(b0, b1), t1 = _mm256_unpackhi_epi32(b0, b1);
    const __m256i t2 = _mm256_unpacklo_epi32(b2, b3), t3 = _mm256_unpackhi_epi32(b2, b3);
    W[0] = _mm256_unpacklo_epi64(t0, t2);
    W[1] = _mm256_unpackhi_epi64(t0, t2);
    W[2] = _mm256_unpacklo_epi64(t1, t3);
    W[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* A Q4_K super-block's header at p: its two groups' sub-block scales (sc0: sub-blocks 0-3, sc1: 4-7,
 * as int32), its eight offsets -(dmin m) as floats, and d */
static inline __attribute__((always_inline)) void q4k_header(const uint8_t *p, __m128i *sc0, __m128i *sc1, __m256 *mw8,
                                                             float *d1) {
    uint64_t sc, mn;
    scales_mins_k4(p + 4, &sc, &mn);
    const __m128i s8 = _mm_cvtsi64_si128((long long)sc);
    *sc0 = _mm_cvtepu8_epi32(s8);
    *sc1 = _mm_cvtepu8_epi32(_mm_srli_si128(s8, 4));
    *d1 = _cvtsh_ss(rd16(p));
    *mw8 = _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(rd16(p + 2))),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
}

/* 0x10 in byte e where bit e of qh is set (Q5_0's fifth bits) */
static inline __attribute__((always_inline)) __m256i fifth_bits(uint32_t qh) {
#if TSQ_SIMD
    return _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10));
#else /* byte e takes byte e / 8 of qh, keeps its bit e % 8, and becomes 0x10 where that is set */
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), idx), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
#endif
}

/* Weight group g as four words W[j] laid out like xgroup (a 4x4 transpose of 32-bit words within
 * each 128-bit lane of the four blocks' code vectors), its scales a and offsets mw per lane. The
 * same values get_wgroup gives, in registers; shared by every input row of a tile. */
static inline __attribute__((always_inline)) void
wgroup_simd(const int type, const uint8_t *w, long g, long nblocks, int packed, __m256i W[4], __m256 *a,
            __m256 *mw) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i B[4];
    /* (Q4_K never comes here: dot_simd_q_t takes it a super-block at a time) */
    if (type == T_Q6_K) {
        const uint8_t *p = w + (g >> 1) * 210;
        const int gi = (int)(g & 1);
        pf_ahead(p + 105 * gi, 105);
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(p + 64 * gi));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(p + 64 * gi + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * gi));
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int u = 0; u < 4; u++) {
            const __m256i ql = (u & 1) ? ql1 : ql0;
            const __m256i lo = (u < 2) ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * u), m3);
            B[u] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        }
        /* lane 4h + u takes sc[2u + h] */
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + 8 * gi)));
        const __m256i s8 = _mm256_permutevar8x32_epi32(sc, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        *a = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(rd16(p + 208))), _mm256_cvtepi32_ps(s8));
        *mw = _mm256_setzero_ps();
    } else if (packed && group_major(type) && 4 * g + 4 <= nblocks) { /* a record (tsq_repack) */
        const uint8_t *rec = w + g * 4L * BLOCK_BYTES[type];
        pf_ahead(rec, 4 * BLOCK_BYTES[type]);
        /* lanes 0-3 and 4-7 both take blocks 0..3: the record's 8 bytes of scales, loaded twice */
        *a = _mm256_cvtph_ps(_mm_castpd_si128(_mm_loaddup_pd((const double *)rec)));
        /* Q4_1's offsets in lanes 0-3 only (xgroup.fs: lanes 4-7 belong to the next group) */
        *mw = type == T_Q4_1 ? _mm256_cvtph_ps(_mm_loadl_epi64((const __m128i *)(rec + 8))) : _mm256_setzero_ps();
        const uint8_t *c = rec + gm_codes_at(type);
        if (type == T_Q8_0) {
            for (int j = 0; j < 4; j++) W[j] = _mm256_loadu_si256((const __m256i *)(c + 32 * j));
        } else {
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)c), q1 = _mm256_loadu_si256((const __m256i *)(c + 32));
            W[0] = _mm256_and_si256(q0, m4);
            W[1] = _mm256_and_si256(_mm256_srli_epi16(q0, 4), m4);
            W[2] = _mm256_and_si256(q1, m4);
            W[3] = _mm256_and_si256(_mm256_srli_epi16(q1, 4), m4);
        }
        return;
    } else {
        /* The four blocks' f16 scales (and Q4_1's offsets) composed in a general register and moved
         * over once; each block's 16 code bytes broadcast to both lanes by the load unit and the high
         * lane shifted by a variable shift. (pinsrw per scale and vinserti128 per block all ran on
         * one shuffle port on Intel cores, which then bounded the product: 1.6x slower per weight
         * than Q4_K there.) The values are those of the block-by-block gather. */
        uint64_t hs = 0, ho = 0;
        const int bb = BLOCK_BYTES[type];
        pf_ahead(w + 4 * g * bb, 4 * bb);
        const __m256i hi4 = _mm256_setr_epi64x(0, 0, 4, 4);
#define LEGACY_BLOCK(b)                                                                               \
    do {                                                                                              \
        const uint8_t *p = w + (4 * g + (b)) * bb;                                                    \
        hs |= (uint64_t)rd16(p) << (16 * (b));                                                        \
        if (type == T_Q8_0) {                                                                         \
            B[b] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)), _mm256_set1_epi8((char)0x80)); \
        } else {                                                                                      \
            const __m256i t = _mm256_broadcastsi128_si256(                                            \
                _mm_loadu_si128((const __m128i *)(p + (type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : 6)))); \
            B[b] = _mm256_and_si256(_mm256_srlv_epi64(t, hi4), m4);                                   \
            if (type == T_Q5_0) /* bit e of qh is element e's fifth bit */                            \
                B[b] = _mm256_or_si256(B[b], fifth_bits(rd32(p + 2)));                                \
            if (type == T_Q4_1) ho |= (uint64_t)rd16(p + 2) << (16 * (b));                            \
        }                                                                                             \
    } while (0)
        if (4 * g + 4 <= nblocks) {
            LEGACY_BLOCK(0);
            LEGACY_BLOCK(1);
            LEGACY_BLOCK(2);
            LEGACY_BLOCK(3);
        } else { /* the row's last group, short of blocks */
            B[0] = B[1] = B[2] = B[3] = _mm256_setzero_si256();
            if (4 * g + 0 < nblocks) LEGACY_BLOCK(0);
            if (4 * g + 1 < nblocks) LEGACY_BLOCK(1);
            if (4 * g + 2 < nblocks) LEGACY_BLOCK(2);
        }
#undef LEGACY_BLOCK
        /* lanes 0-3 and 4-7 both take blocks 0..3 */
        *a = _mm256_cvtph_ps(_mm_set1_epi64x((long long)hs));
        *mw = type == T_Q4_1 ? _mm256_cvtph_ps(_mm_cvtsi64_si128((long long)ho)) : _mm256_setzero_ps();
    }
    if (packed && (type == T_Q6_K || 4 * g + 4 <= nblocks)) { /* stored transposed */
        W[0] = B[0]; W[1] = B[1]; W[2] = B[2]; W[3] = B[3];
    } else {
        transpose4(B[0], B[1], B[2], B[3], W);
    }
}

/* ------------------------------------------------------------------ AVX-512 VNNI products */
#if TSQ_SIMD
/* the two 256-bit halves of a 512-bit register, and back */
static inline __m512 cat_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m256 lo_ps(__m512 v) { return _mm512_castps512_ps256(v); }
static inline __m256 hi_ps(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
static inline __m512 dup_ps(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }

/* 64 bytes of 4-bit codes, bytes 0-31 in q0 and 32-63 in q1 (per 256-bit half), as the four code
 * vectors the products read: the low nibbles of bytes 0-31, their high nibbles, then the same of
 * bytes 32-63. nibbles2: the codes at q in both halves of Z from broadcast loads (no shuffles);
 * W: the low halves, for a row that runs alone in 256 bits */
static inline __attribute__((always_inline)) void nibbles512(__m512i q0, __m512i q1, __m512i Z[4]) {
    const __m512i m4z = _mm512_set1_epi8(0x0F);
    Z[0] = _mm512_and_si512(q0, m4z);
    Z[2] = _mm512_and_si512(q1, m4z);
#ifdef __GFNI__
    /* each byte's high nibble in one instruction: an affine map over GF(2) whose matrix moves bits
     * 4-7 to 0-3 and clears the rest (the shift and mask below, one uop instead of two) */
    const __m512i hi = _mm512_set1_epi64(0x1020408000000000LL);
    Z[1] = _mm512_gf2p8affine_epi64_epi8(q0, hi, 0);
    Z[3] = _mm512_gf2p8affine_epi64_epi8(q1, hi, 0);
#else
    Z[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4z);
    Z[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4z);
#endif
}

static inline __attribute__((always_inline)) void nibbles2(const uint8_t *q, __m512i Z[4], __m256i W[4]) {
    nibbles512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q)),
               _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q + 32))), Z);
    for (int j = 0; j < 4; j++) W[j] = _mm512_castsi512_si256(Z[j]);
}

/* a weight group unpacked in 256 bits, broadcast to both halves of 512 */
static inline __attribute__((always_inline)) void dup_group(const __m256i W[4], __m256 a, __m256 mw, __m512i Z[4],
                                                            __m512 *az, __m512 *mwz) {
    for (int j = 0; j < 4; j++) Z[j] = _mm512_broadcast_i64x4(W[j]);
    *az = dup_ps(a);
    *mwz = dup_ps(mw);
}

/* The one step every product takes per weight group and input row: four vpdpbusd give each lane
 * the exact integer sum over its half-block, the weight offset comes off as an exact integer
 * (sh: offset_shift), then one float step (the scale product, one fma) and, for Q4_1 (mn), one
 * more fma into a second set of accumulators for its offsets. (Q4_K's offsets take one fma per
 * super-block in dot_simd_q_t instead: with one per group, paired in 512 bits with 16-row tiles,
 * its products ran 1.1x slower.) step256 is one row in 256 bits (its code sums shifted here); step512 two
 * rows side by side (an xpair, sums shifted ahead by pair_rows / dup_row), each lane doing exactly
 * step256's operations: whichever a row goes through, it gets the same bits. */
static inline __attribute__((always_inline)) void step256(const int sh, const int mn, const __m256i W[4], __m256 a,
                                                          __m256 mw, const xgroup *xg, __m256 *acc, __m256 *accm) {
    __m256i is = _mm256_dpbusd_epi32(_mm256_setzero_si256(), W[0], _mm256_loadu_si256((const __m256i *)xg->q));
    is = _mm256_dpbusd_epi32(is, W[1], _mm256_loadu_si256((const __m256i *)(xg->q + 32)));
    is = _mm256_dpbusd_epi32(is, W[2], _mm256_loadu_si256((const __m256i *)(xg->q + 64)));
    is = _mm256_dpbusd_epi32(is, W[3], _mm256_loadu_si256((const __m256i *)(xg->q + 96)));
    if (sh) is = _mm256_sub_epi32(is, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)xg->s), sh));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(a, _mm256_loadu_ps(xg->d)), *acc);
    if (mn) *accm = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xg->fs), *accm);
}

static inline __attribute__((always_inline)) void step512(const int sh, const int mn, const __m512i Z[4], __m512 az,
                                                          __m512 mwz, const xpair *xg, __m512 *acc, __m512 *accm) {
    __m512i is = _mm512_dpbusd_epi32(sh ? _mm512_loadu_si512(xg->s) : _mm512_setzero_si512(), Z[0],
                                     _mm512_loadu_si512(xg->q));
    is = _mm512_dpbusd_epi32(is, Z[1], _mm512_loadu_si512(xg->q + 64));
    is = _mm512_dpbusd_epi32(is, Z[2], _mm512_loadu_si512(xg->q + 128));
    is = _mm512_dpbusd_epi32(is, Z[3], _mm512_loadu_si512(xg->q + 192));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(az, _mm512_loadu_ps(xg->d)), *acc);
    if (mn) *accm = _mm512_fmadd_ps(mwz, _mm512_loadu_ps(xg->fs), *accm);
}

/* A Q6_K half super-block's four code vectors (the low 4 bits from ql0 / ql1, bits 4-5 from qh:
 * code vector u takes ql's low nibbles for u < 2, its high ones after, and qh's bits 2u, 2u + 1),
 * in every 256-bit half that the loads filled. With GFNI each byte's bits move in one affine map
 * (bits 2u, 2u + 1 of qh to 4, 5; bits 4-7 of ql to 0-3) and a ternary-logic op merges the low
 * nibble in: 10 instructions for the shifts and masks' 20. The same bytes either way. */
static inline __attribute__((always_inline)) void q6k_codes512(__m512i ql0, __m512i ql1, __m512i qh, __m512i Z[4]) {
    const __m512i m4z = _mm512_set1_epi8(0x0F);
#ifdef __GFNI__
    /* gf2p8affine: output bit i of a byte = parity(matrix byte 7 - i & input byte) */
    const __m512i hi4 = _mm512_set1_epi64(0x1020408000000000LL); /* bits 4-7 -> 0-3 */
    for (int u = 0; u < 4; u++) {
        const long long m = (long long)(((1ULL << (2 * u)) << 24) | ((1ULL << (2 * u + 1)) << 16)); /* 2u, 2u+1 -> 4, 5 */
        const __m512i h = _mm512_gf2p8affine_epi64_epi8(qh, _mm512_set1_epi64(m), 0);
        const __m512i ql = (u & 1) ? ql1 : ql0;
        if (u < 2) /* (ql & 0x0F) | h */
            Z[u] = _mm512_ternarylogic_epi32(ql, h, m4z, 0xEC);
        else
            Z[u] = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(ql, hi4, 0), h);
    }
#else
    const __m512i m3z = _mm512_set1_epi8(3);
    for (int u = 0; u < 4; u++) {
        const __m512i ql = (u & 1) ? ql1 : ql0;
        const __m512i lo = (u < 2) ? _mm512_and_si512(ql, m4z) : _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4z);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * u), m3z);
        Z[u] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
    }
#endif
}

/* nrows weight rows (rb bytes apart; results to y[0..nrows)) against the tr input rows of a tile
 * (rows xstride groups apart), over groups [g0, g1). Rows 0..2*(tr/2)-1 are read as pairs from xp
 * (pair p of group g at xp[g * ps + p]; pair_rows), two rows per 512-bit instruction; an odd last
 * row from x, in 256 bits. Each lane does the same operations either way, so a row's result does
 * not depend on whether it shared a register. With a state ([nrows][QTILE_MAX * 16]) the accumulators
 * start from it unless g0 == 0 and are parked there unless g1 is the row's end, so a product taken
 * in k-chunks does the same float steps as one taken whole. */
static inline __attribute__((always_inline)) void
dot_simd_q_t(const int type, const int tr, const uint8_t *w, long k, int packed, const xgroup *x, const xpair *xp,
             long xstride, long ps, const int chunked, long g0, long g1, float *state, float *y, long ldy, long nrows,
             long rb) {
    const long ng = n_groups(k), nblocks = k / QB;
    const int np = tr / 2, odd = tr & 1, ro = tr - 1; /* pairs; the odd row, if any, is row ro */
    if (!chunked) { g0 = 0; g1 = ng; }
    const int first = !chunked || g0 == 0, last = !chunked || g1 == ng;
    for (long n = 0; n < nrows; n++, w += rb, y++, state += chunked ? QTILE_MAX * 16 : 0) {
    __m512 accz[QTILE_MAX / 2], accmz[QTILE_MAX / 2];
    __m256 acc1 = _mm256_setzero_ps(), accm1 = _mm256_setzero_ps();
    for (int p = 0; p < np; p++) {
        accz[p] = first ? _mm512_setzero_ps() : cat_ps(_mm256_loadu_ps(state + 32 * p), _mm256_loadu_ps(state + 32 * p + 16));
        accmz[p] = first ? _mm512_setzero_ps() : cat_ps(_mm256_loadu_ps(state + 32 * p + 8), _mm256_loadu_ps(state + 32 * p + 24));
    }
    if (odd && !first) {
        acc1 = _mm256_loadu_ps(state + 16 * ro);
        accm1 = _mm256_loadu_ps(state + 16 * ro + 8);
    }
    /* mg: offsets taken per group (Q4_1); Q4_K takes its super-block's at once, below */
    const int sh = offset_shift(type), mg = type == T_Q4_1;
    /* W, a, mw: a weight group for one row (256 bits); Z, az, mwz: the same in both halves of 512 */
#define ROWS(W, a, mw, Z, az, mwz, g)                                                                 \
    for (int p = 0; p < np; p++) step512(sh, mg, Z, az, mwz, xp + (g) * ps + p, &accz[p], &accmz[p]); \
    if (odd) step256(sh, mg, W, a, mw, x + ro * xstride + (g), &acc1, &accm1);
    if (type == T_Q4_K) { /* a super-block (two groups) at a time: its scales unpacked once */
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        for (long sb = g0 / 2; sb < g1 / 2; sb++) {
            const uint8_t *p = w + sb * 144;
            pf_ahead(p, 144);
            __m128i sc0, sc1;
            __m256 mw8;
            float d1;
            q4k_header(p, &sc0, &sc1, &mw8, &d1);
            { /* the eight sub-blocks' offsets against the input's eight block sums (the even group's
               * fs), into the same accumulators, ahead of the super-block's products: one step per
               * super-block and no second set of accumulators */
                const __m512 mwz8 = dup_ps(mw8);
                for (int q = 0; q < np; q++)
                    accz[q] = _mm512_fmadd_ps(mwz8, _mm512_loadu_ps(xp[2 * sb * ps + q].fs), accz[q]);
                if (odd) acc1 = _mm256_fmadd_ps(mw8, _mm256_loadu_ps(x[ro * xstride + 2 * sb].fs), acc1);
            }
            for (int gi = 0; gi < 2; gi++) {
                const __m128i sc = gi ? sc1 : sc0;
                const uint8_t *q = p + 16 + 64 * gi;
                __m256i W[4];
                __m256 a, mw = _mm256_setzero_ps();
                __m512i Z[4];
                __m512 az, mwz = _mm512_setzero_ps();
                if (np && packed) { /* unpacked in 512 bits from broadcast loads: no shuffles */
                    az = _mm512_mul_ps(_mm512_set1_ps(d1), _mm512_cvtepi32_ps(_mm512_broadcast_i32x4(sc)));
                    nibbles2(q, Z, W);
                    a = lo_ps(az);
                } else {
                    a = _mm256_mul_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(_mm256_broadcastsi128_si256(sc)));
                    const __m256i q0 = _mm256_loadu_si256((const __m256i *)q), q1 = _mm256_loadu_si256((const __m256i *)(q + 32));
                    W[0] = _mm256_and_si256(q0, m4);
                    W[1] = _mm256_and_si256(_mm256_srli_epi16(q0, 4), m4);
                    W[2] = _mm256_and_si256(q1, m4);
                    W[3] = _mm256_and_si256(_mm256_srli_epi16(q1, 4), m4);
                    if (!packed) transpose4(W[0], W[1], W[2], W[3], W);
                    if (np) dup_group(W, a, mw, Z, &az, &mwz);
                }
                ROWS(W, a, mw, Z, az, mwz, 2 * sb + gi)
            }
        }
    } else {
        for (long g = g0; g < g1; g++) {
            __m256i W[4];
            __m256 a, mw;
            __m512i Z[4];
            __m512 az, mwz;
            if (np && packed && group_major(type) && 4 * g + 4 <= nblocks) {
                /* a record (tsq_repack) in 512 bits from broadcast loads, as wgroup_simd reads it */
                const uint8_t *rec = w + g * 4L * BLOCK_BYTES[type];
                pf_ahead(rec, 4 * BLOCK_BYTES[type]);
                uint64_t sc8, mn8;
                memcpy(&sc8, rec, 8);
                memcpy(&mn8, rec + 8, 8);
                az = _mm512_cvtph_ps(_mm256_set1_epi64x((long long)sc8));
                mwz = type == T_Q4_1 ? _mm512_cvtph_ps(_mm256_setr_epi64x((long long)mn8, 0, (long long)mn8, 0))
                                     : _mm512_setzero_ps();
                const uint8_t *c = rec + gm_codes_at(type);
                if (type == T_Q8_0) {
                    for (int j = 0; j < 4; j++) {
                        Z[j] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(c + 32 * j)));
                        W[j] = _mm512_castsi512_si256(Z[j]);
                    }
                } else {
                    nibbles2(c, Z, W);
                }
                a = lo_ps(az);
                mw = lo_ps(mwz);
            } else if (np && packed && type == T_Q6_K) {
                /* a stored-transposed Q6_K half super-block in 512 bits from broadcast loads, the
                 * codes wgroup_simd makes; its scales made there and broadcast */
                const uint8_t *p = w + (g >> 1) * 210;
                const int gi = (int)(g & 1);
                pf_ahead(p + 105 * gi, 105);
                const __m512i ql0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 64 * gi)));
                const __m512i ql1 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 64 * gi + 32)));
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * gi)));
                q6k_codes512(ql0, ql1, qh, Z);
                for (int u = 0; u < 4; u++) W[u] = _mm512_castsi512_si256(Z[u]);
                const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + 8 * gi)));
                const __m256i s8 = _mm256_permutevar8x32_epi32(sc, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
                a = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(rd16(p + 208))), _mm256_cvtepi32_ps(s8));
                mw = _mm256_setzero_ps();
                az = dup_ps(a);
                mwz = _mm512_setzero_ps();
            } else {
                wgroup_simd(type, w, g, nblocks, packed, W, &a, &mw);
                if (np) dup_group(W, a, mw, Z, &az, &mwz);
            }
            ROWS(W, a, mw, Z, az, mwz, g)
        }
    }
#undef ROWS
    if (!last) {
        for (int p = 0; p < np; p++) {
            _mm256_storeu_ps(state + 32 * p, lo_ps(accz[p]));
            _mm256_storeu_ps(state + 32 * p + 16, hi_ps(accz[p]));
            _mm256_storeu_ps(state + 32 * p + 8, lo_ps(accmz[p]));
            _mm256_storeu_ps(state + 32 * p + 24, hi_ps(accmz[p]));
        }
        if (odd) {
            _mm256_storeu_ps(state + 16 * ro, acc1);
            _mm256_storeu_ps(state + 16 * ro + 8, accm1);
        }
        continue;
    }
    for (int p = 0; p < np; p++) {
        const __m512 s = mg ? _mm512_add_ps(accz[p], accmz[p]) : accz[p];
        y[2 * p * ldy] = hsum8(lo_ps(s));
        y[(2 * p + 1) * ldy] = hsum8(hi_ps(s));
    }
    if (odd) y[ro * ldy] = hsum8(mg ? _mm256_add_ps(acc1, accm1) : acc1);
    }
}

/* The kernels are specialised for a compile-time tile height; this maps a runtime one onto them. */
#define TILES_1_TO_7(CALL)                                                                            \
    case 1: CALL(1); break;                                                                           \
    case 2: CALL(2); break;                                                                           \
    case 3: CALL(3); break;                                                                           \
    case 4: CALL(4); break;                                                                           \
    case 5: CALL(5); break;                                                                           \
    case 6: CALL(6); break;                                                                           \
    case 7: CALL(7); break;
#define FOR_TILE(tr, CALL)                                                                            \
    switch (tr) {                                                                                     \
    TILES_1_TO_7(CALL)                                                                                \
    case 8: CALL(8); break;                                                                           \
    case 9: CALL(9); break;                                                                           \
    case 10: CALL(10); break;                                                                         \
    case 11: CALL(11); break;                                                                         \
    case 12: CALL(12); break;                                                                         \
    case 13: CALL(13); break;                                                                         \
    case 14: CALL(14); break;                                                                         \
    case 15: CALL(15); break;                                                                         \
    case 16: CALL(16); break;                                                                         \
    default: CALL(17); break;                                                                         \
    }

static void dot_simd_q(int type, const uint8_t *w, long k, int pk, const xgroup *x, const xpair *xp, long xs, long ps,
                       int tr, long g0, long g1, float *st, float *y, long ldy, long nrows, long rb) {
#define Q40(n) dot_simd_q_t(T_Q4_0, n, w, k, pk, x, xp, xs, ps, CH, g0, g1, st, y, ldy, nrows, rb)
#define Q41(n) dot_simd_q_t(T_Q4_1, n, w, k, pk, x, xp, xs, ps, CH, g0, g1, st, y, ldy, nrows, rb)
#define Q50(n) dot_simd_q_t(T_Q5_0, n, w, k, pk, x, xp, xs, ps, CH, g0, g1, st, y, ldy, nrows, rb)
#define Q80(n) dot_simd_q_t(T_Q8_0, n, w, k, pk, x, xp, xs, ps, CH, g0, g1, st, y, ldy, nrows, rb)
#define Q4K(n) dot_simd_q_t(T_Q4_K, n, w, k, pk, x, xp, xs, ps, CH, g0, g1, st, y, ldy, nrows, rb)
#define Q6K(n) dot_simd_q_t(T_Q6_K, n, w, k, pk, x, xp, xs, ps, CH, g0, g1, st, y, ldy, nrows, rb)
#define ALL_TYPES(FOR)                                                                                \
    switch (type) {                                                                                   \
    case T_Q4_0: FOR(tr, Q40) break;                                                                  \
    case T_Q4_1: FOR(tr, Q41) break;                                                                  \
    case T_Q5_0: FOR(tr, Q50) break;                                                                  \
    case T_Q8_0: FOR(tr, Q80) break;                                                                  \
    case T_Q4_K: FOR(tr, Q4K) break;                                                                  \
    default: FOR(tr, Q6K) break;                                                                      \
    }
    /* st: the product goes in k-chunks [g0, g1) (specialised apart: the whole-row kernel keeps
     * no bookkeeping) */
    if (st) {
#define CH 1
        ALL_TYPES(FOR_TILE)
#undef CH
    } else {
#define CH 0
        ALL_TYPES(FOR_TILE)
#undef CH
    }
#undef ALL_TYPES
#undef Q40
#undef Q41
#undef Q50
#undef Q80
#undef Q4K
#undef Q6K
}

/* 32 bytes of row a in the low half of a 512-bit register, the same bytes of row b in the high half */
static inline __attribute__((always_inline)) __m512i side_by_side(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* A lone input row against pairs of weight rows: rows n and n + 1 go side by side in the two halves
 * of each 512-bit register (their records, tsq_repack, loaded into the halves), the input row
 * duplicated into both (dup_row, xd). Each lane does what dot_simd_q_t's 256-bit product does
 * for one row: the same integer sums, the same float steps in the same order, so a row's result
 * does not depend on its neighbour (a row count that is odd ends with one row through that
 * product). The row's last group, short of whole records (k = 576 leaves two blocks), goes in
 * 256 bits per half, as there. For the record types (Q4_0, Q4_1, Q8_0). */
static inline __attribute__((always_inline)) void
dot_pairw_t(const int type, const uint8_t *w, long k, const xgroup *x, const xpair *xd, long nrows, long rb,
            float *y) {
    const long ng = n_groups(k), nblocks = k / QB, nrec = nblocks / 4;
    const int sh = offset_shift(type), mn = has_min(type), bb = BLOCK_BYTES[type], c0 = gm_codes_at(type);
    long n = 0;
    for (; n + 2 <= nrows; n += 2) {
        const uint8_t *wa = w + n * rb, *wb = wa + rb;
        __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
        for (long g = 0; g < nrec; g++) {
            const uint8_t *ra = wa + g * 4L * bb, *rc = wb + g * 4L * bb;
            pf_ahead(ra, 4 * bb);
            pf_ahead(rc, 4 * bb);
            /* qwords: row a's scales, its offsets (Q4_1; else codes, unused), row b's, its offsets */
            const __m256i hd = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)ra)),
                                                       _mm_loadu_si128((const __m128i *)rc), 1);
            __m512 az, mwz = _mm512_setzero_ps();
            if (mn) { /* the offsets too: all sixteen converted at once, then each set put in place */
                const __m512 f = _mm512_cvtph_ps(hd);
                az = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11, 8, 9, 10, 11), f);
                mwz = _mm512_maskz_permutexvar_ps(0x0F0F, _mm512_setr_epi32(4, 5, 6, 7, 0, 0, 0, 0, 12, 13, 14, 15, 0, 0, 0, 0), f);
            } else {
                az = _mm512_cvtph_ps(_mm256_permute4x64_epi64(hd, 0xA0));
            }
            __m512i Z[4];
            if (type == T_Q8_0) {
                for (int j = 0; j < 4; j++) Z[j] = side_by_side(ra + c0 + 32 * j, rc + c0 + 32 * j);
            } else {
                nibbles512(side_by_side(ra + c0, rc + c0), side_by_side(ra + c0 + 32, rc + c0 + 32), Z);
            }
            step512(sh, mn, Z, az, mwz, xd + g, &acc, &accm);
        }
        __m256 acc_a = lo_ps(acc), acc_b = hi_ps(acc), accm_a = lo_ps(accm), accm_b = hi_ps(accm);
        for (long g = nrec; g < ng; g++) { /* the short last group, each row in 256 bits */
            __m256i W[4];
            __m256 a, mw;
            wgroup_simd(type, wa, g, nblocks, 1, W, &a, &mw);
            step256(sh, mn, W, a, mw, x + g, &acc_a, &accm_a);
            wgroup_simd(type, wb, g, nblocks, 1, W, &a, &mw);
            step256(sh, mn, W, a, mw, x + g, &acc_b, &accm_b);
        }
        y[n] = hsum8(mn ? _mm256_add_ps(acc_a, accm_a) : acc_a);
        y[n + 1] = hsum8(mn ? _mm256_add_ps(acc_b, accm_b) : acc_b);
    }
    if (n < nrows) dot_simd_q(type, w + n * rb, k, 1, x, NULL, ng, 0, 1, 0, ng, NULL, y + n, 1, 1, rb);
}

/* dot_pairw_t for a record type (group_major) */
static void dot_pairw(int type, const uint8_t *w, long k, const xgroup *x, const xpair *xd, long nrows, long rb,
                      float *y) {
    switch (type) {
    case T_Q4_0: dot_pairw_t(T_Q4_0, w, k, x, xd, nrows, rb, y); break;
    case T_Q4_1: dot_pairw_t(T_Q4_1, w, k, x, xd, nrows, rb, y); break;
    default: dot_pairw_t(T_Q8_0, w, k, x, xd, nrows, rb, y); break;
    }
}

/* A weight row's ng groups for the tile backend's AVX-512 panels (amx.c), unpacked as its tiles take
 * them: group g's lane L (elements 16h..16h+15 of block b, L = 4h + b; Q8_0's codes unsigned, as the
 * products multiply them) at codes + L * lane_stride + g * group_stride, 16 bytes; the group's eight
 * lane scales at a + g * ab_stride and its offsets at m + g * ab_stride. The values are
 * tsq_weight_group's (a test compares them), read in registers, less `off` per code (mod 256): the
 * type's offset 2^offset_shift, so that the codes are the signed values c - 2^sh, or 0. The stored
 * layout (tsq_repack) holds each group's code words transposed, which transpose4 undoes. */
TSQ_INTERNAL void tsq_weight_row_simd(int type, const uint8_t *w, long ng, long nblocks, int packed, uint8_t *codes,
                                      long lane_stride, long group_stride, float *a, float *m, long ab_stride,
                                      int off) {
    const __m256i offv = _mm256_set1_epi8((char)off);
    __m128i sc[2] = {_mm_setzero_si128(), _mm_setzero_si128()};
    __m256 mw8 = _mm256_setzero_ps();
    float d1 = 0.f;
    for (long g = 0; g < ng; g++) {
        __m256i W[4], B[4];
        __m256 av, mv;
        if (type == T_Q4_K) {
            const uint8_t *p = w + (g >> 1) * 144;
            if (!(g & 1)) q4k_header(p, &sc[0], &sc[1], &mw8, &d1);
            const __m128 a4 = _mm_mul_ps(_mm_set1_ps(d1), _mm_cvtepi32_ps(sc[g & 1]));
            av = _mm256_set_m128(a4, a4);
            mv = mw8;
            __m512i Z[4];
            nibbles2(p + 16 + 64 * (g & 1), Z, W); /* the VNNI path's nibble reader */
            if (packed) {
                transpose4(W[0], W[1], W[2], W[3], B);
            } else {
                for (int j = 0; j < 4; j++) B[j] = W[j];
            }
        } else {
            wgroup_simd(type, w, g, nblocks, packed, W, &av, &mv);
            transpose4(W[0], W[1], W[2], W[3], B);
        }
        if (off)
            for (int b = 0; b < 4; b++) B[b] = _mm256_sub_epi8(B[b], offv);
        uint8_t *c = codes + g * group_stride;
        for (int b = 0; b < 4; b++) { /* block b: lane b (its first half), lane 4 + b (its second) */
            _mm_storeu_si128((__m128i *)(c + b * lane_stride), _mm256_castsi256_si128(B[b]));
            _mm_storeu_si128((__m128i *)(c + (4 + b) * lane_stride), _mm256_extracti128_si256(B[b], 1));
        }
        _mm256_storeu_ps(a + g * ab_stride, av);
        _mm256_storeu_ps(m + g * ab_stride, mv);
    }
}

#endif /* TSQ_SIMD */

#if TSQ_ISA == TSQ_ISA_AVX2
#include "avx2.h"
#endif

static inline __m256 load8_f(int type, const uint8_t *w, long i) {
    if (type == T_F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)(w + 2 * i));
    if (type == T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static void dot_simd_f(int type, const uint8_t *w, long k, const float *x, long xstride, int tr, float *y,
                       long ldy) {
    __m256 acc[TILE];
    float tail[TILE];
    for (int r = 0; r < tr; r++) { acc[r] = _mm256_setzero_ps(); tail[r] = 0.f; }
    long k8 = k & ~7L;
    for (long i = 0; i < k8; i += 8) {
        __m256 wv = load8_f(type, w, i);
        for (int r = 0; r < tr; r++)
            acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * xstride + i), acc[r]);
    }
    for (long i = k8; i < k; i++) {
        float v = type == T_F32 ? ((const float *)w)[i]
                : type == T_F16 ? f16_to_f32(rd16(w + 2 * i)) : bf16_to_f32(rd16(w + 2 * i));
        for (int r = 0; r < tr; r++) tail[r] += v * x[r * xstride + i];
    }
    for (int r = 0; r < tr; r++) y[r * ldy] = hsum8(acc[r]) + tail[r];
}
#endif

/* ------------------------------------------------------------------ driver */

#if TSQ_SIMD
static int matmul_blocked(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k,
                          const xgroup *xq, long m, float *y, long ldy, int n_threads);
#endif
#if TSQ_NEON
TSQ_INTERNAL int tsq_matmul_neon(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k,
                                 const xgroup *xq, long m, float *y, long ldy, int n_threads);
TSQ_INTERNAL void tsq_dot_neon_f(int type, const uint8_t *w, long k, const float *x, float *y);
#endif

/* y[m, n] (row stride ldy) = x[m, :] . W[n, :] for W [n_rows, k] of `type` with rows row_bytes
 * apart. For quantized types `xq` holds x quantized by tsq_quantize (m rows of xgroups) and `x`
 * is unused; for float types `x` is float32 [m, k]. use_simd = 0 forces the reference. */
int tsq_matmul(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k, const float *x,
               const void *xqv, long m, float *y, long ldy, int n_threads, int use_simd) {
    const xgroup *xq = (const xgroup *)xqv;
    if (type < 0 || type >= T_COUNT || k % (is_float_type(type) ? 1 : QB) || k % BLOCK_ELEMS[type])
        return -1;
    const int fl = is_float_type(type);
    const long ng = n_groups(k);
    if (n_threads < 1) n_threads = 1;
    /* the tile backend (amx.c), while switched on (2: its emulation, on any build) */
    const int tiles = use_simd && !fl ? tsq_amx_on(m) : 0;
    if (tiles)
        return tsq_matmul_tiles(type, w, packed, row_bytes, n_rows, k, xq, m, y, ldy, n_threads, tiles == 2);
#if TSQ_ISA == TSQ_ISA_AVX2
    if (use_simd && !fl) return matmul_avx2(type, w, packed, row_bytes, n_rows, k, xq, m, y, ldy, n_threads);
#elif TSQ_NEON
    if (use_simd && !fl) return tsq_matmul_neon(type, w, packed, row_bytes, n_rows, k, xq, m, y, ldy, n_threads);
#endif
#if TSQ_ISA == TSQ_ISA_SCALAR
    use_simd = 0;
#endif
#if TSQ_SIMD
    if (use_simd && !fl && !one_q_tile(m, ng))
        return matmul_blocked(type, w, packed, row_bytes, n_rows, k, xq, m, y, ldy, n_threads);
    if (use_simd && !fl) { /* one tile: each thread takes a contiguous share of the weight rows */
        xpair *xp = NULL;
        const int pairw = m == 1 && packed && group_major(type); /* weight rows pair up (dot_pairw) */
        if (m >= 2 || pairw) {
            if (!(xp = pair_scratch((pairw ? 1 : m / 2) * ng))) return -2;
            if (pairw)
                dup_row(xq, ng, offset_shift(type), xp);
            else
                pair_rows(xq, m, ng, offset_shift(type), xp);
        }
#pragma omp parallel num_threads(n_threads) if (n_threads > 1 && n_rows >= 64)
        {
            long n0, n1;
            thread_share(n_rows, &n0, &n1);
            if (n0 < n1 && pairw)
                dot_pairw(type, w + n0 * row_bytes, k, xq, xp, n1 - n0, row_bytes, y + n0);
            else if (n0 < n1)
                dot_simd_q(type, w + n0 * row_bytes, k, packed, xq, xp, ng, m / 2, (int)m, 0, ng, NULL, y + n0, ldy, n1 - n0,
                           row_bytes);
        }
        return 0;
    }
#endif
    /* Input rows in chunks that stay in L1/L2 while every weight row streams past them (a long
     * prefill); within a chunk, tiles of TILE rows share each unpacked weight block. Neither
     * changes the operations any one output element goes through. */
    for (long c0 = 0; c0 < m; c0 += ROW_CHUNK) {
        const long c1 = m - c0 < ROW_CHUNK ? m : c0 + ROW_CHUNK;
#pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1 && n_rows >= 64)
        for (long n = 0; n < n_rows; n++) {
            const uint8_t *wr = w + n * row_bytes;
            if (!use_simd) {
                for (long r = c0; r < c1; r++)
                    y[r * ldy + n] = fl ? dot_ref_f(type, wr, k, x + r * k)
                                   : dot_ref_q(type, wr, k, packed, xq + r * ng);
                continue;
            }
#if TSQ_HAS_AVX2
            for (long r = c0; r < c1; r += TILE) {
                int tr = (int)(c1 - r < TILE ? c1 - r : TILE);
                dot_simd_f(type, wr, k, x + r * k, k, tr, y + r * ldy + n, ldy);
            }
#elif TSQ_NEON
            for (long r = c0; r < c1; r++) tsq_dot_neon_f(type, wr, k, x + r * k, y + r * ldy + n);
#endif
        }
    }
    return 0;
}

#if TSQ_SIMD
#ifndef BLOCK_BYTES_L2
#define BLOCK_BYTES_L2 (128 * 1024) /* weight bytes a block of rows may span and stay in L2 */
#endif
#define MAX_BLOCK_ROWS 256
#define STATE_ROWS (MAX_BLOCK_ROWS * 8 / QTILE_MAX) /* ~128 KiB of parked accumulators a thread */
#ifndef TILE_BYTES_L1
#define TILE_BYTES_L1 (32 * 1024) /* input bytes a k-chunk of a tile may span and stay in L1 */
#endif
/* More than one tile of quantized rows (a prefill chunk, a long verify): weight rows in blocks that
 * stay in L2 while each tile of input rows, which stays in L1, passes over the block. (Taken the
 * other way round, every weight row streamed the whole chunk's input from L2.) A tile too long for
 * L1 (a down projection's 8960 inputs are 15.7 KB a row) goes over the block in k-chunks, its
 * accumulators parked in between. Only the loop order differs from tsq_matmul's: each output
 * element gets the same operations in the same order. */
static int matmul_blocked(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k,
                          const xgroup *xq, long m, float *y, long ldy, int n_threads) {
    const long ng = n_groups(k);
    long nb = BLOCK_BYTES_L2 / row_bytes;
    nb = nb < 4 ? 4 : nb > MAX_BLOCK_ROWS ? MAX_BLOCK_ROWS : nb;
    if (n_threads > 1 && n_rows >= 64) {
        /* as many blocks per thread for every thread: with the L2 size alone a small matrix (a k/v
         * projection of 192 rows in one 256-row block) ran on one thread while the other waited */
        long nblk = (n_rows + nb - 1) / nb;
        nblk = (nblk + n_threads - 1) / n_threads * n_threads;
        nb = (n_rows + nblk - 1) / nblk;
    }
    /* tiles of 16 rows (even heights: a tile's rows pair up from its first), in k-chunks where 16
     * rows do not fit in L1 whole (a down projection's 8960 inputs are 15.7 KB a row). With tiles of
     * four and no chunks, a 5-row verify over such a matrix unpacked every weight group twice, the
     * fifth row alone. */
    const long th = m <= QTILE_MAX ? m : 16; /* longer inputs in tiles of 16: whole pairs */
    long kc = ng;
    if (!one_q_tile(th < m ? th : m, ng)) {
        kc = TILE_BYTES_L1 / (th * (long)sizeof(xgroup)); /* groups per k-chunk; even: Q4_K goes in pairs */
        kc = kc < 2 ? 2 : kc & ~1L;
        if (nb > STATE_ROWS) nb = STATE_ROWS; /* the parked accumulators' room (only wide rows chunk: nb is small) */
    }
    xpair *xp = pair_scratch(ROW_CHUNK / 2 * ng);
    if (!xp) return -2;
    for (long c0 = 0; c0 < m; c0 += ROW_CHUNK) {
        const long c1 = m - c0 < ROW_CHUNK ? m : c0 + ROW_CHUNK;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1 && n_rows >= 64)
        {
            pair_rows(xq + c0 * ng, c1 - c0, ng, offset_shift(type), xp); /* tiles start at even rows of the chunk */
            /* blocks handed out one at a time: a shared host's two cores seldom run alike, and a
             * static split leaves the faster one waiting (each block's outputs are its own) */
#pragma omp for schedule(dynamic, 1)
            for (long b0 = 0; b0 < n_rows; b0 += nb) {
                const long b1 = n_rows - b0 < nb ? n_rows : b0 + nb;
                float state[STATE_ROWS][QTILE_MAX * 16];
                for (long r = c0; r < c1; r += th) {
                    const int tr = (int)(c1 - r < th ? c1 - r : th);
                    for (long g0 = 0; g0 < ng; g0 += kc) {
                        const long g1 = ng - g0 < kc ? ng : g0 + kc;
                        dot_simd_q(type, w + b0 * row_bytes, k, packed, xq + r * ng, xp + (r - c0) / 2, ng, (c1 - c0) / 2, tr, g0,
                                   g1, kc < ng ? state[0] : NULL, y + r * ldy + b0, ldy, b1 - b0, row_bytes);
                    }
                }
            }
        }
    }
    return 0;
}
#endif
