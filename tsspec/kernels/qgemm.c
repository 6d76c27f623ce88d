/* Products with GGUF weights as the file stores them: y[m, n] = sum_k x[m, k] * W[n, k].
 *
 * W is read block by block in its own GGUF layout (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, and the
 * float types F32, F16, BF16): the codes and scales used are the stored ones, nothing is rounded
 * or repacked. For the quantized types the input rows are quantized per 32-element block to int8
 * with a float scale (as llama.cpp quantizes activations), each 32-element weight sub-block
 * contributes  dx * (a * sum(qw * qx) + c * sum(qx))  with the integer sum exact, and the float
 * terms are accumulated in a fixed order. Float weight types multiply the float32 input directly.
 *
 * Batch invariance: y[m, n] is computed by one fixed sequence of operations on row m of x and
 * row n of W, whatever the number of rows M, the tile a row lands in, or the thread that owns n.
 * Threads split the output columns only. So a row's result is the same in a 1-row decode and in
 * a 9-row verify, bit for bit, which is what keeps speculative output equal to plain output.
 *
 * Two implementations of every type: a plain C one (the reference, and the path on CPUs without
 * AVX-512 VNNI) and an AVX-512 VNNI/VL one. They agree to float rounding (tests compare them).
 * Compile with -ffp-contract=off: the scalar float terms must not be fused differently in
 * different places.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define TSQ_SIMD 1
#else
#define TSQ_SIMD 0
#endif

enum { T_F32 = 0, T_F16 = 1, T_BF16 = 2, T_Q4_0 = 3, T_Q4_1 = 4, T_Q5_0 = 5, T_Q8_0 = 6, T_Q4_K = 7,
       T_Q6_K = 8, T_COUNT = 9 };

#define QB 32   /* elements per activation block and per weight sub-block */
#define QK 256  /* elements per K-quant super-block */
#define ROW_CHUNK 32 /* input rows per pass over the weights */

/* one quantized activation block */
typedef struct {
    int8_t q[QB];
    float d;  /* x ~= d * q */
    float s;  /* d * sum(q): the block's contribution to a weight offset term */
} xblock;

static const int BLOCK_ELEMS[T_COUNT] = {1, 1, 1, 32, 32, 32, 32, 256, 256};
static const int BLOCK_BYTES[T_COUNT] = {4, 2, 2, 18, 20, 22, 34, 144, 210};

int tsq_simd(void) { return TSQ_SIMD; }
int tsq_xblock_bytes(void) { return (int)sizeof(xblock); }

/* bytes of one weight row of K elements (-1 when K is not whole blocks) */
long tsq_row_bytes(int type, long k) {
    if (type < 0 || type >= T_COUNT || k % BLOCK_ELEMS[type]) return -1;
    return k / BLOCK_ELEMS[type] * BLOCK_BYTES[type];
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* ------------------------------------------------------------------ activation quantization */

/* max |v[i]| in 8 lanes (vectorizes; max is exact, so the lane split changes nothing).
 * Rounding below is rintf: round-to-nearest-even, inlined as one instruction (nearbyintf was a
 * libm call per element, ~4 ms per token on qwen2.5-coder-1.5b). */
static inline float absmax(const float *v, int n) {
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; i += 8)
        for (int j = 0; j < 8; j++) l[j] = fmaxf(l[j], fabsf(v[i + j]));
    float a = 0.f;
    for (int j = 0; j < 8; j++) a = fmaxf(a, l[j]);
    return a;
}

static void quantize_row(const float *x, long k, xblock *out) {
    for (long b = 0; b < k / QB; b++) {
        const float *v = x + b * QB;
        float amax = 0.f;
        amax = absmax(v, QB);
        float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < QB; i++) {
            int q = (int)rintf(v[i] * id);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            out[b].q[i] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

void tsq_quantize(const float *x, long m, long k, xblock *out) {
    for (long r = 0; r < m; r++) quantize_row(x + r * k, k, out + r * (k / QB));
}

/* Activation rows for the K-quant types, quantized per 256-element super-block to 13-bit
 * integers (|q| <= 4095, one float scale each): the integer sub-block scales of Q4_K/Q6_K then
 * apply inside the integer sums (16-bit products, vpmaddwd) and one float multiply serves a whole
 * super-block. 13 bits keep an outlier channel from flattening its 255 neighbours (int8 per 256,
 * llama.cpp's q8_K, cost up to 6.5 in the logits against transformers on qwen2.5-coder-1.5b) and
 * keep every int32 sum below 2^31 (proof in dot_simd_k_t). Row r occupies XK_BYTES(k) bytes:
 * q int16 [k], d float [k/256], b32 int32 [k/32] (sums of q per 32), b16 int32 [k/16] (per 16). */
#define XK_MAX 4095
#define XK_BYTES(k) (2 * (k) + (k) / QK * 100)
typedef struct {
    const int16_t *q;
    const float *d;
    const int32_t *b32, *b16;
} xkrow;

static inline xkrow xk_row(const uint8_t *buf, long k, long r) {
    const uint8_t *base = buf + r * XK_BYTES(k);
    long ns = k / QK;
    xkrow v = {(const int16_t *)base, (const float *)(base + 2 * k), (const int32_t *)(base + 2 * k + 4 * ns),
               (const int32_t *)(base + 2 * k + 36 * ns)};
    return v;
}

void tsq_quantize_k(const float *x, long m, long k, uint8_t *out) {
    long ns = k / QK;
    for (long r = 0; r < m; r++) {
        const float *xr = x + r * k;
        uint8_t *base = out + r * XK_BYTES(k);
        int16_t *q = (int16_t *)base;
        float *dd = (float *)(base + 2 * k);
        int32_t *b32 = (int32_t *)(base + 2 * k + 4 * ns), *b16 = (int32_t *)(base + 2 * k + 36 * ns);
        for (long sb = 0; sb < ns; sb++) {
            const float *v = xr + sb * QK;
            float amax = 0.f;
            amax = absmax(v, QK);
            float id = amax > 0.f ? (float)XK_MAX / amax : 0.f;
            dd[sb] = amax / (float)XK_MAX;
            for (int i = 0; i < QK; i++) {
                int qi = (int)rintf(v[i] * id);
                q[sb * QK + i] = (int16_t)(qi > XK_MAX ? XK_MAX : (qi < -XK_MAX ? -XK_MAX : qi));
            }
            for (int t = 0; t < 16; t++) {
                int sum = 0;
                for (int i = 0; i < 16; i++) sum += q[sb * QK + 16 * t + i];
                b16[sb * 16 + t] = sum;
            }
            for (int t = 0; t < 8; t++) b32[sb * 8 + t] = b16[sb * 16 + 2 * t] + b16[sb * 16 + 2 * t + 1];
        }
    }
}

/* which input form a weight type multiplies: 0 float32, 1 per-32 blocks, 2 per-256 super-blocks */
int tsq_act_kind(int type) {
    if (type == T_F32 || type == T_F16 || type == T_BF16) return 0;
    return (type == T_Q4_K || type == T_Q6_K) ? 2 : 1;
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

/* rows ids[0..n) of a [rows, K] weight to float32 out [n, K] (embedding lookups, tests) */
void tsq_dequant_rows(int type, const uint8_t *w, long row_bytes, long k, const int64_t *ids, long n,
                      float *out) {
    for (long i = 0; i < n; i++) dequant_row(type, w + ids[i] * row_bytes, k, out + i * k);
}

/* ------------------------------------------------------------------ weight sub-blocks
 * A legacy-type weight row (Q4_0, Q4_1, Q5_0, Q8_0) is a sequence of 32-element blocks. Block j
 * gives int8 codes c[32] (signed; unsigned 0..15 for Q4_1) and float scale and offset such that
 * w = a * c + off. (The K-quants have their own reference, dot_ref_k.) */

typedef struct {
    int8_t c[QB];
    float a;   /* the block's scale */
    float off; /* additive offset (Q4_1's min), 0 otherwise */
} subblock;

static inline void get_subblock(int type, const uint8_t *w, long j, subblock *s) {
    const uint8_t *p = w + j * BLOCK_BYTES[type];
    s->a = f16_to_f32(rd16(p));
    s->off = 0.f;
    if (type == T_Q4_0) {
        for (int i = 0; i < 16; i++) { s->c[i] = (p[2 + i] & 0xF) - 8; s->c[i + 16] = (p[2 + i] >> 4) - 8; }
    } else if (type == T_Q4_1) {
        s->off = f16_to_f32(rd16(p + 2));
        for (int i = 0; i < 16; i++) { s->c[i] = p[4 + i] & 0xF; s->c[i + 16] = p[4 + i] >> 4; }
    } else if (type == T_Q5_0) {
        uint32_t qh = rd32(p + 2);
        for (int i = 0; i < 16; i++) {
            s->c[i] = (int8_t)(((p[6 + i] & 0xF) | (((qh >> i) << 4) & 0x10)) - 16);
            s->c[i + 16] = (int8_t)(((p[6 + i] >> 4) | ((qh >> (i + 12)) & 0x10)) - 16);
        }
    } else { /* Q8_0 */
        memcpy(s->c, p + 2, 32);
    }
}

/* ------------------------------------------------------------------ reference products */

static float dot_ref_q(int type, const uint8_t *w, long k, const xblock *x) {
    float acc = 0.f, off = 0.f;
    subblock s;
    for (long j = 0; j < k / QB; j++) {
        get_subblock(type, w, j, &s);
        int isum = 0;
        for (int i = 0; i < QB; i++) isum += s.c[i] * x[j].q[i];
        acc += (float)isum * (s.a * x[j].d);
        off += s.off * x[j].s;
    }
    return acc + off;
}

/* Q4_K / Q6_K against per-256 input: integer sums per super-block, one float step each */
static float dot_ref_k(int type, const uint8_t *w, long k, xkrow x) {
    float acc = 0.f, off = 0.f;
    for (long sb = 0; sb < k / QK; sb++) {
        const int16_t *xq = x.q + sb * QK;
        const float dx = x.d[sb];
        if (type == T_Q4_K) {
            const uint8_t *p = w + sb * 144;
            float d = f16_to_f32(rd16(p)), dmin = f16_to_f32(rd16(p + 2));
            int total = 0, mins = 0;
            for (int t = 0; t < 8; t++) {
                int sc, m;
                scale_min_k4(t, p + 4, &sc, &m);
                const uint8_t *q = p + 16 + 32 * (t / 2);
                int isum = 0;
                for (int i = 0; i < 32; i++) isum += ((t & 1) ? (q[i] >> 4) : (q[i] & 0xF)) * xq[32 * t + i];
                total += sc * isum;
                mins += m * x.b32[sb * 8 + t];
            }
            acc += (float)total * (d * dx);
            off += (float)mins * (-(dmin * dx));
        } else {
            const uint8_t *p = w + sb * 210;
            const int8_t *scs = (const int8_t *)(p + 192);
            float d = f16_to_f32(rd16(p + 208));
            int total = 0, corr = 0;
            for (int t = 0; t < 8; t++) {
                int h = t / 4, u = t % 4;
                const uint8_t *ql = p + 64 * h + (u & 1) * 32, *qh = p + 128 + 32 * h;
                for (int half = 0; half < 2; half++) {
                    int isum = 0;
                    for (int i = 16 * half; i < 16 * half + 16; i++) {
                        int lo = (u < 2) ? (ql[i] & 0xF) : (ql[i] >> 4);
                        isum += (lo | (((qh[i] >> (2 * u)) & 3) << 4)) * xq[32 * t + i];
                    }
                    int sc = scs[8 * h + 2 * u + half];
                    total += sc * isum;
                    corr += sc * x.b16[sb * 16 + 2 * t + half];
                }
            }
            acc += (float)total * (d * dx);
            off += (float)corr * (-32.f * (d * dx));
        }
    }
    return acc + off;
}

static float dot_ref_f(int type, const uint8_t *w, long k, const float *x) {
    float acc = 0.f;
    for (long i = 0; i < k; i++) {
        float v = type == T_F32 ? ((const float *)w)[i]
                : type == T_F16 ? f16_to_f32(rd16(w + 2 * i)) : bf16_to_f32(rd16(w + 2 * i));
        acc += v * x[i];
    }
    return acc;
}

/* ------------------------------------------------------------------ AVX-512 VNNI products */
#if TSQ_SIMD
#define TILE 4

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One weight block against the rows of a tile: the per-row step shared by the legacy types.
 * c: codes (int8; unsigned 0..15 when uns), av: the block's scale, o: its offset. */
#define ROW_STEP(r)                                                                                   \
    do {                                                                                              \
        const xblock *xb = x + (r) * xstride + j;                                                     \
        __m256i xq = _mm256_loadu_si256((const __m256i *)xb->q);                                      \
        __m256i p = _mm256_dpbusd_epi32(zero, cu, uns ? xq : _mm256_sign_epi8(xq, c));                \
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(av, _mm256_set1_ps(xb->d)), acc[r]); \
        if (uns) off[r] += o * xb->s;                                                                 \
    } while (0)

static inline __attribute__((always_inline)) void
dot_simd_q_t(const int type, const int tr, const uint8_t *w, long k, const xblock *x, long xstride, float *y,
             long ldy) {
    __m256 acc[TILE];
    float off[TILE];
    for (int r = 0; r < tr; r++) { acc[r] = _mm256_setzero_ps(); off[r] = 0.f; }
    const __m256i zero = _mm256_setzero_si256(), m4 = _mm256_set1_epi8(0x0F);
    const int uns = (type == T_Q4_1 || type == T_Q4_K);
    if (type <= T_Q8_0) {
        const int bb = BLOCK_BYTES[type];
        for (long j = 0; j < k / QB; j++) {
            const uint8_t *p = w + j * bb;
            __m256 av = _mm256_set1_ps(_cvtsh_ss(rd16(p)));
            float o = 0.f;
            __m256i c;
            if (type == T_Q8_0) {
                c = _mm256_loadu_si256((const __m256i *)(p + 2));
            } else {
                const uint8_t *qs = p + (type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : 6);
                __m128i t = _mm_loadu_si128((const __m128i *)qs);
                c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), m4);
                if (type == T_Q4_0) {
                    c = _mm256_sub_epi8(c, _mm256_set1_epi8(8));
                } else if (type == T_Q4_1) {
                    o = _cvtsh_ss(rd16(p + 2));
                } else { /* Q5_0: bit i of qh is element i's fifth bit */
                    __mmask32 hb = (__mmask32)rd32(p + 2);
                    c = _mm256_or_si256(c, _mm256_maskz_mov_epi8(hb, _mm256_set1_epi8(0x10)));
                    c = _mm256_sub_epi8(c, _mm256_set1_epi8(16));
                }
            }
            __m256i cu = uns ? c : _mm256_abs_epi8(c);
            for (int r = 0; r < tr; r++) ROW_STEP(r);
        }
    }
    for (int r = 0; r < tr; r++) y[r * ldy] = hsum8(acc[r]) + off[r];
}

/* Q4_K / Q6_K against 13-bit per-256 input rows. Each 32-element sub-block's codes are widened
 * to int16 and multiplied by its integer sub-scale once (shared by every input row); per input row
 * two vpdpwssd add the products into int32 lanes, and one float FMA per super-block applies
 * d * dx. Bounds: Q4_K |code*scale| <= 15*63, Q6_K <= 63*128; |x| <= 4095; a lane sums 32
 * products per super-block: 32 * 8064 * 4095 < 2^31. Offsets (Q4_K mins, Q6_K's -32) go through
 * the input's block sums, in float. */
static inline __attribute__((always_inline)) void
dot_simd_k_t(const int type, const int tr, const uint8_t *w, long k, const uint8_t *x, float *y, long ldy,
             long r0) {
    __m256 acc[TILE];
    float off[TILE];
    xkrow xr[TILE];
    for (int r = 0; r < tr; r++) {
        acc[r] = _mm256_setzero_ps();
        off[r] = 0.f;
        xr[r] = xk_row(x, k, r0 + r);
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (long sb = 0; sb < k / QK; sb++) {
        __m256i sumi[TILE];
        for (int r = 0; r < tr; r++) sumi[r] = _mm256_setzero_si256();
#define K_SUB(codes, t, sclo, schi)                                                                   \
    do {                                                                                              \
        const __m256i wa = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(codes)), sclo); \
        const __m256i wb = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(codes, 1)), schi); \
        for (int r = 0; r < tr; r++) {                                                                \
            const int16_t *xq = xr[r].q + sb * QK + 32 * (t);                                        \
            sumi[r] = _mm256_dpwssd_epi32(sumi[r], wa, _mm256_loadu_si256((const __m256i *)xq));        \
            sumi[r] = _mm256_dpwssd_epi32(sumi[r], wb, _mm256_loadu_si256((const __m256i *)(xq + 16))); \
        }                                                                                             \
    } while (0)
        if (type == T_Q4_K) {
            const uint8_t *p = w + sb * 144;
            const float d = _cvtsh_ss(rd16(p)), dmin = _cvtsh_ss(rd16(p + 2));
            const uint8_t *q6 = p + 4;
            int sc[8], mn[8];
            for (int t = 0; t < 4; t++) {
                sc[t] = q6[t] & 63;
                mn[t] = q6[t + 4] & 63;
                sc[t + 4] = (q6[t + 8] & 0xF) | ((q6[t] >> 6) << 4);
                mn[t + 4] = (q6[t + 8] >> 4) | ((q6[t + 4] >> 6) << 4);
            }
            for (int pr = 0; pr < 4; pr++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * pr));
                const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                const __m256i s0 = _mm256_set1_epi16((short)sc[2 * pr]), s1 = _mm256_set1_epi16((short)sc[2 * pr + 1]);
                K_SUB(lo, 2 * pr, s0, s0);
                K_SUB(hi, 2 * pr + 1, s1, s1);
            }
            for (int r = 0; r < tr; r++) {
                const float dx = xr[r].d[sb];
                const int32_t *b32 = xr[r].b32 + sb * 8;
                int mins = 0;
                for (int t = 0; t < 8; t++) mins += mn[t] * b32[t];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * dx), acc[r]);
                off[r] += (float)mins * (-(dmin * dx));
            }
        } else { /* Q6_K */
            const uint8_t *p = w + sb * 210;
            const int8_t *scs = (const int8_t *)(p + 192);
            const float d = _cvtsh_ss(rd16(p + 208));
            const __m256i m3 = _mm256_set1_epi8(3);
            for (int h = 0; h < 2; h++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
                for (int u = 0; u < 4; u++) {
                    const int8_t *sc = scs + 8 * h + 2 * u;
                    const __m256i ql = (u & 1) ? ql1 : ql0;
                    const __m256i lo = (u < 2) ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * u), m3);
                    const __m256i c = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)); /* 0..63 */
                    K_SUB(c, 4 * h + u, _mm256_set1_epi16(sc[0]), _mm256_set1_epi16(sc[1]));
                }
            }
            for (int r = 0; r < tr; r++) {
                const float dx = xr[r].d[sb];
                const int32_t *b16 = xr[r].b16 + sb * 16;
                int corr = 0; /* the -32 of every code: sum over halves of scale * input sum */
                for (int t = 0; t < 16; t++) corr += scs[t] * b16[t];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * dx), acc[r]);
                off[r] += (float)corr * (-32.f * (d * dx));
            }
        }
#undef K_SUB
    }
    for (int r = 0; r < tr; r++) y[r * ldy] = hsum8(acc[r]) + off[r];
}

/* The kernels are specialised for a compile-time tile height; this maps a runtime one onto them. */
#define FOR_TILE(tr, CALL)                                                                            \
    switch (tr) {                                                                                     \
    case 1: CALL(1); break;                                                                           \
    case 2: CALL(2); break;                                                                           \
    case 3: CALL(3); break;                                                                           \
    default: CALL(4); break;                                                                          \
    }

static void dot_simd_k(int type, const uint8_t *w, long k, const uint8_t *x, long r0, int tr, float *y, long ldy) {
#define K4(n) dot_simd_k_t(T_Q4_K, n, w, k, x, y, ldy, r0)
#define K6(n) dot_simd_k_t(T_Q6_K, n, w, k, x, y, ldy, r0)
    if (type == T_Q4_K) { FOR_TILE(tr, K4) } else { FOR_TILE(tr, K6) }
#undef K4
#undef K6
}

static void dot_simd_q(int type, const uint8_t *w, long k, const xblock *x, long xs, int tr, float *y, long ldy) {
#define Q40(n) dot_simd_q_t(T_Q4_0, n, w, k, x, xs, y, ldy)
#define Q41(n) dot_simd_q_t(T_Q4_1, n, w, k, x, xs, y, ldy)
#define Q50(n) dot_simd_q_t(T_Q5_0, n, w, k, x, xs, y, ldy)
#define Q80(n) dot_simd_q_t(T_Q8_0, n, w, k, x, xs, y, ldy)
    switch (type) {
    case T_Q4_0: FOR_TILE(tr, Q40) break;
    case T_Q4_1: FOR_TILE(tr, Q41) break;
    case T_Q5_0: FOR_TILE(tr, Q50) break;
    default: FOR_TILE(tr, Q80) break;
    }
#undef Q40
#undef Q41
#undef Q50
#undef Q80
}

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

static int is_float_type(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }

/* y[m, n] (row stride ldy) = x[m, :] . W[n, :] for W [n_rows, k] of `type` with rows row_bytes
 * apart. For quantized types `xq` holds x quantized by tsq_quantize ([m, k/32] blocks) and `x`
 * is unused; for float types `x` is float32 [m, k]. use_simd = 0 forces the reference. */
int tsq_matmul(int type, const uint8_t *w, long row_bytes, long n_rows, long k, const float *x,
               const void *xqv, long m, float *y, long ldy, int n_threads, int use_simd) {
    const xblock *xq = (const xblock *)xqv;          /* per-32 input (legacy types) */
    const uint8_t *xk = (const uint8_t *)xqv;        /* per-256 input (K-quants) */
    const int kq = tsq_act_kind(type) == 2;
    if (type < 0 || type >= T_COUNT || k % (is_float_type(type) ? 1 : QB) || k % BLOCK_ELEMS[type])
        return -1;
    int fl = is_float_type(type);
    long nb = k / QB;
#if !TSQ_SIMD
    use_simd = 0;
#endif
    if (n_threads < 1) n_threads = 1;
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
                                   : kq ? dot_ref_k(type, wr, k, xk_row(xk, k, r)) : dot_ref_q(type, wr, k, xq + r * nb);
                continue;
            }
#if TSQ_SIMD
            for (long r = c0; r < c1; r += TILE) {
                int tr = (int)(c1 - r < TILE ? c1 - r : TILE);
                if (fl)
                    dot_simd_f(type, wr, k, x + r * k, k, tr, y + r * ldy + n, ldy);
                else if (kq)
                    dot_simd_k(type, wr, k, xk, r, tr, y + r * ldy + n, ldy);
                else
                    dot_simd_q(type, wr, k, xq + r * nb, nb, tr, y + r * ldy + n, ldy);
            }
#endif
        }
    }
    return 0;
}

/* ================================================================== a whole transformer block
 * One llama-family block (llama, qwen2, qwen3, gemma3) for m rows at positions start..start+m-1,
 * in place on the residual h [m, d]. The same arithmetic as tsspec/models/base.py's torch path
 * (its reference), without a Python dispatch per operation. Every row is computed on its own:
 * norms, rope and activations per row, attention per (row, head) over the row's own key range in
 * a fixed order, products through tsq_matmul. So the block is batch invariant like its parts. */

#define MAX_PARTS 4

typedef struct {
    int nparts;
    int type[MAX_PARTS];
    const uint8_t *w[MAX_PARTS];
    long row_bytes[MAX_PARTS];
    long n[MAX_PARTS];
    long k, n_total;
    const float *bias; /* [n_total] or NULL */
} tsq_linear;

typedef struct {
    tsq_linear qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm;
    const float *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm; /* NULL when absent */
    long window; /* sliding window (0: global attention) */
    int rope;    /* index of this layer's rope tables */
} tsq_layer;

typedef struct {
    long d_model, n_heads, n_kv, head_dim, ffn_dim, rope_half;
    int rope_neox, act; /* act: 0 silu, 1 gelu (tanh) */
    float eps, q_scale;
} tsq_config;

int tsq_sizeof_linear(void) { return (int)sizeof(tsq_linear); }
int tsq_sizeof_layer(void) { return (int)sizeof(tsq_layer); }
int tsq_sizeof_config(void) { return (int)sizeof(tsq_config); }

/* y [m, n_total] = x [m, k] W.T (+ bias); xq, xk: scratch for the two quantized input forms */
static int linear_apply(const tsq_linear *L, const float *x, long m, float *y, xblock *xq, uint8_t *xk, int nt) {
    int have32 = 0, have256 = 0;
    long col = 0;
    for (int i = 0; i < L->nparts; i++) {
        int kind = tsq_act_kind(L->type[i]);
        if (kind == 1 && !have32) { tsq_quantize(x, m, L->k, xq); have32 = 1; }
        if (kind == 2 && !have256) { tsq_quantize_k(x, m, L->k, xk); have256 = 1; }
        int rc = tsq_matmul(L->type[i], L->w[i], L->row_bytes[i], L->n[i], L->k, x,
                            kind == 2 ? (const void *)xk : (const void *)xq, m, y + col, L->n_total, nt, 1);
        if (rc) return rc;
        col += L->n[i];
    }
    if (L->bias)
        for (long r = 0; r < m; r++)
            for (long j = 0; j < L->n_total; j++) y[r * L->n_total + j] += L->bias[j];
    return 0;
}

/* out = x * rsqrt(mean(x^2) + eps) * w over n elements (out may alias x) */
static void rms_norm_row(const float *x, const float *w, long n, float eps, float *out) {
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

/* dot product in 8 independent lanes then a fixed reduction: vectorizable, order fixed */
static inline float dot8(const float *a, const float *b, long n) {
#if TSQ_SIMD
    if (n % 16 == 0) { /* two FMA chains, then a fixed reduction */
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (long i = 0; i < n; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        return hsum8(_mm256_add_ps(s0, s1));
    }
#endif
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) l[j] += a[i + j] * b[i + j];
    float t = 0.f;
    for (; i < n; i++) t += a[i] * b[i];
    return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])) + t;
}

/* o[0..hd) = sum over j in [lo, hi] of p[j] * v[j * hd + i], accumulated in j order */
static inline void weighted_sum(const float *p, const float *v, long lo, long hi, long hd, float *o) {
#if TSQ_SIMD
    if (hd % 32 == 0) { /* 32 outputs at a time stay in registers across all positions */
        for (long i0 = 0; i0 < hd; i0 += 32) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (long j = lo; j <= hi; j++) {
                const float *vv = v + j * hd + i0;
                const __m256 pj = _mm256_set1_ps(p[j]);
                a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vv), a0);
                a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vv + 8), a1);
                a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vv + 16), a2);
                a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vv + 24), a3);
            }
            _mm256_storeu_ps(o + i0, a0);
            _mm256_storeu_ps(o + i0 + 8, a1);
            _mm256_storeu_ps(o + i0 + 16, a2);
            _mm256_storeu_ps(o + i0 + 24, a3);
        }
        return;
    }
#endif
    for (long i = 0; i < hd; i++) o[i] = 0.f;
    for (long j = lo; j <= hi; j++)
        for (long i = 0; i < hd; i++) o[i] += p[j] * v[j * hd + i];
}

static inline float gelu_tanh(float x) {
    const float k = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

int tsq_forward(const tsq_config *c, const tsq_layer *layers, int l0, int l1, float *h, long m, long start,
                float *kc, float *vc, long cap, const float *const *cos_t, const float *const *sin_t,
                int nt) {
    const long d = c->d_model, hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv, f = c->ffn_dim;
    const long qd = nh * hd, kvd = nkv * hd, rep = nh / nkv;
    if (nt < 1) nt = 1;
    long kmax = d > qd ? d : qd;
    if (f > kmax) kmax = f;
    float *x = malloc(sizeof(float) * m * kmax);
    float *qkv = malloc(sizeof(float) * m * (qd + 2 * kvd));
    float *att = malloc(sizeof(float) * m * qd);
    float *gu = malloc(sizeof(float) * m * 2 * f);
    float *y = malloc(sizeof(float) * m * d);
    xblock *xq = malloc(sizeof(xblock) * m * (kmax / QB + 1));
    uint8_t *xk = malloc((size_t)XK_BYTES(kmax + QK) * m);
    int rc = 0;
    if (!x || !qkv || !att || !gu || !y || !xq || !xk) { rc = -2; goto done; }
    for (int li = l0; li < l1 && !rc; li++) {
        const tsq_layer *L = layers + li;
        float *kl = kc + (long)li * nkv * cap * hd, *vl = vc + (long)li * nkv * cap * hd;
        const float *ct = cos_t[L->rope], *st = sin_t[L->rope];
        for (long r = 0; r < m; r++) rms_norm_row(h + r * d, L->attn_norm, d, c->eps, x + r * d);
        if ((rc = linear_apply(&L->qkv, x, m, qkv, xq, xk, nt))) break;
        const long w3 = qd + 2 * kvd;
        for (long r = 0; r < m; r++) {
            float *q = qkv + r * w3, *k = q + qd, *v = k + kvd;
            long pos = start + r;
            for (long hh = 0; hh < nh; hh++) {
                if (L->q_norm) rms_norm_row(q + hh * hd, L->q_norm, hd, c->eps, q + hh * hd);
                rope_row(q + hh * hd, ct + pos * c->rope_half, st + pos * c->rope_half, c->rope_half, c->rope_neox);
                for (long i = 0; i < hd; i++) q[hh * hd + i] *= c->q_scale;
            }
            for (long hh = 0; hh < nkv; hh++) {
                if (L->k_norm) rms_norm_row(k + hh * hd, L->k_norm, hd, c->eps, k + hh * hd);
                rope_row(k + hh * hd, ct + pos * c->rope_half, st + pos * c->rope_half, c->rope_half, c->rope_neox);
                memcpy(kl + (hh * cap + pos) * hd, k + hh * hd, sizeof(float) * hd);
                memcpy(vl + (hh * cap + pos) * hd, v + hh * hd, sizeof(float) * hd);
            }
        }
#pragma omp parallel num_threads(nt) if (nt > 1 && m * nh > 1)
        {
            float *sc = malloc(sizeof(float) * (start + m));
#pragma omp for schedule(static)
            for (long t = 0; t < m * nh; t++) {
                long r = t / nh, hh = t % nh, g = hh / rep, pos = start + r;
                long lo = L->window > 0 && pos - L->window + 1 > 0 ? pos - L->window + 1 : 0;
                const float *q = qkv + r * w3 + hh * hd;
                const float *kb = kl + g * cap * hd, *vb = vl + g * cap * hd;
                float mx = -INFINITY;
                for (long j = lo; j <= pos; j++) {
                    sc[j] = dot8(q, kb + j * hd, hd);
                    if (sc[j] > mx) mx = sc[j];
                }
                float sum = 0.f;
                for (long j = lo; j <= pos; j++) {
                    sc[j] = expf(sc[j] - mx);
                    sum += sc[j];
                }
                float *o = att + r * qd + hh * hd;
                for (long j = lo; j <= pos; j++) sc[j] = sc[j] / sum;
                weighted_sum(sc, vb, lo, pos, hd, o);
            }
            free(sc);
        }
        if ((rc = linear_apply(&L->o, att, m, y, xq, xk, nt))) break;
        for (long r = 0; r < m; r++) {
            if (L->post_attn_norm) rms_norm_row(y + r * d, L->post_attn_norm, d, c->eps, y + r * d);
            for (long i = 0; i < d; i++) h[r * d + i] += y[r * d + i];
            rms_norm_row(h + r * d, L->ffn_norm, d, c->eps, x + r * d);
        }
        if ((rc = linear_apply(&L->gate_up, x, m, gu, xq, xk, nt))) break;
        for (long r = 0; r < m; r++) {
            const float *g = gu + r * 2 * f, *u = g + f;
            float *a = x + r * f;
            for (long i = 0; i < f; i++) {
                float gv = g[i];
                float act = c->act == 1 ? gelu_tanh(gv) : gv / (1.0f + expf(-gv));
                a[i] = act * u[i];
            }
        }
        if ((rc = linear_apply(&L->down, x, m, y, xq, xk, nt))) break;
        for (long r = 0; r < m; r++) {
            if (L->post_ffn_norm) rms_norm_row(y + r * d, L->post_ffn_norm, d, c->eps, y + r * d);
            for (long i = 0; i < d; i++) h[r * d + i] += y[r * d + i];
        }
    }
done:
    free(x); free(qkv); free(att); free(gu); free(y); free(xq); free(xk);
    return rc;
}
