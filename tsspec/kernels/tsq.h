/* tsq.h: what the native kernels' files share (products.c: the GGUF products; blocks.c: a whole
 * llama-family block forward over them; eagle.c: a trained draft head's step; amx.c: the AMX tile
 * product backend). One library is built from all of them (tsspec/kernels/__init__.py). */
#ifndef TSQ_H
#define TSQ_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* The instruction-set level a build is for. The library is built once per level
 * (tsspec/kernels/__init__.py LEVELS passes -DTSQ_ISA and that level's -march) and the loader picks
 * the one the CPU runs, so no build holds an instruction its level lacks. Without -DTSQ_ISA the
 * compiler's target macros choose. Every level gives every product the same bits. */
#define TSQ_ISA_SCALAR 0  /* the plain C reference */
#define TSQ_ISA_AVX2 1    /* x86-64-v3: AVX2, FMA, F16C */
#define TSQ_ISA_AVX512 2  /* AVX-512 VNNI/VL/BW */
#define TSQ_ISA_NEON 3    /* ARMv8-A Advanced SIMD */
#define TSQ_ISA_DOTPROD 4 /* ARMv8.2-A NEON with the dot product (SDOT/UDOT) */

/* what the compiler's target allows */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)
#define TSQ_CC_AVX512 1
#else
#define TSQ_CC_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TSQ_CC_AVX2 1
#else
#define TSQ_CC_AVX2 0
#endif
#ifndef TSQ_ISA
#if TSQ_CC_AVX512
#define TSQ_ISA TSQ_ISA_AVX512
#elif TSQ_CC_AVX2
#define TSQ_ISA TSQ_ISA_AVX2
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define TSQ_ISA TSQ_ISA_DOTPROD
#elif defined(__aarch64__)
#define TSQ_ISA TSQ_ISA_NEON
#else
#define TSQ_ISA TSQ_ISA_SCALAR
#endif
#endif

#if TSQ_ISA == TSQ_ISA_AVX512 && !TSQ_CC_AVX512
#error "TSQ_ISA avx512 needs a compiler target with AVX-512 VNNI, VL, BW, F16C and FMA"
#endif
#if TSQ_ISA == TSQ_ISA_AVX2 && !TSQ_CC_AVX2
#error "TSQ_ISA avx2 needs a compiler target with AVX2, FMA and F16C"
#endif
#if (TSQ_ISA == TSQ_ISA_NEON || TSQ_ISA == TSQ_ISA_DOTPROD) && !defined(__aarch64__)
#error "TSQ_ISA neon needs an AArch64 target"
#endif
#if TSQ_ISA == TSQ_ISA_DOTPROD && !defined(__ARM_FEATURE_DOTPROD)
#error "TSQ_ISA neon-dotprod needs a compiler target with +dotprod"
#endif

#define TSQ_SIMD (TSQ_ISA == TSQ_ISA_AVX512)                             /* the AVX-512 VNNI products */
#define TSQ_HAS_AVX2 (TSQ_ISA == TSQ_ISA_AVX2 || TSQ_ISA == TSQ_ISA_AVX512) /* 256-bit AVX2/FMA/F16C code */
#define TSQ_NEON (TSQ_ISA == TSQ_ISA_NEON || TSQ_ISA == TSQ_ISA_DOTPROD)
#if TSQ_HAS_AVX2
#include <immintrin.h>
#endif
#if TSQ_NEON
#include <arm_neon.h>
#endif

enum { T_F32 = 0, T_F16 = 1, T_BF16 = 2, T_Q4_0 = 3, T_Q4_1 = 4, T_Q5_0 = 5, T_Q8_0 = 6, T_Q4_K = 7,
       T_Q6_K = 8, T_COUNT = 9 };

#define QB 32   /* elements per activation block and per legacy weight block */
#define QG 128  /* elements per input group: four activation blocks, laid out for the products */
#define ROW_CHUNK 32 /* input rows per pass over the weights */

/* One group of an input row: four 32-element blocks quantized to int8 (x ~= d * q, per block, as
 * llama.cpp quantizes activations for its legacy types), stored interleaved. Call lane L = 4h + b
 * the half-block h (elements 16h..16h+15) of block b; word j of the group (bytes 32j..32j+31)
 * holds in lane L elements 32b + 16h + 4j .. +3. A weight group transposed the same way meets it
 * in four vpdpbusd that leave in lane L the exact integer sum over one half-block: no horizontal
 * reduction, one float step per eight half-blocks and row. Blocks past a row's end are zero. */
typedef struct {
    int8_t q[QG];
    float d[8];   /* lane L: its block's scale */
    int32_t s[8]; /* lane L: the sum of its 16 codes (for the weight offsets) */
    /* for Q4_1/Q4_K's float offsets, per block: fs[b] = d * (sum of block b's 32 codes) for this
     * group's blocks b = 0..3; fs[4 + b] the next group's fs[b] in an even group (0 past the row's
     * end), 0 in an odd one. So a Q4_K super-block (an even group and the next) has its eight
     * sub-blocks' sums in one vector, and takes its offsets in one step instead of two. */
    float fs[8];
} xgroup;

/* Two input rows' group g side by side, for the 512-bit products: word j (bytes 64j..64j+63) is
 * row a's word j then row b's, and each per-lane array holds row a's eight lanes then row b's. A
 * weight group broadcast to both halves of a 512-bit register then meets two rows in each
 * instruction, every lane doing what the 256-bit product does for its row alone. */
typedef struct {
    int8_t q[2 * QG];
    float d[16];
    int32_t s[16]; /* -s 2^sh: the negated lane sums times the weight offset (pair_rows) */
    float fs[16];
} xpair;

static const int BLOCK_ELEMS[T_COUNT] = {1, 1, 1, 32, 32, 32, 32, 256, 256};
static const int BLOCK_BYTES[T_COUNT] = {4, 2, 2, 18, 20, 22, 34, 144, 210};

static inline int is_float_type(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }
static inline long n_groups(long k) { return (k + QG - 1) / QG; }

#define TSQ_INTERNAL __attribute__((visibility("hidden")))

/* The calling OpenMP thread's contiguous share [*lo, *hi) of n items (all of them outside a team):
 * the column split every product takes, so a thread's share never depends on the rows. */
static inline void thread_share(long n, long *lo, long *hi) {
    *lo = 0;
    *hi = n;
#ifdef _OPENMP
    const long nt = omp_get_num_threads(), per = (n + nt - 1) / nt;
    *lo = omp_get_thread_num() * per;
    *hi = *lo + per < n ? *lo + per : n;
#endif
}

/* The reduction of eight lanes every product uses: (0+4, 1+5, 2+6, 3+7), then pairs, then the two. */
static inline float sum8(const float *v) {
    const float s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
    return (s0 + s2) + (s1 + s3);
}

#if TSQ_HAS_AVX2
static inline float hsum8(__m256 v) { /* sum8's order */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ------------------------------------------------------------------ readers every level shares */

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

/* scale_min_k4's values for all eight j at once, one byte each in j order (sc: the scales, mn: the
 * minimums; q the 12 header bytes, a super-block's byte 4 on), four at a time in 32-bit words: j < 4
 * the low six bits of bytes 0-3 (scales) and 4-7 (minimums), j >= 4 the low (scales) or high
 * (minimums) nibbles of bytes 8-11 with the top two bits of bytes 0-3 / 4-7 above them. The SIMD
 * readers widen these bytes (products.c q4k_header, prompt_tiles.c sb_unpack_row). */
static inline void scales_mins_k4(const uint8_t *q, uint64_t *sc, uint64_t *mn) {
    const uint32_t u0 = rd32(q), u1 = rd32(q + 4), u2 = rd32(q + 8);
    *sc = (uint64_t)(u0 & 0x3f3f3f3fu) | (uint64_t)((u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4)) << 32;
    *mn = (uint64_t)(u1 & 0x3f3f3f3fu) | (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4)) << 32;
}

/* A weight's offset as a power of two (products.c, weight groups): Q4_0's c - 8, Q5_0's c - 16,
 * Q8_0's c - 128 (codes taken unsigned), Q6_K's c - 32 */
static inline int offset_shift(int type) {
    return type == T_Q4_0 ? 3 : type == T_Q5_0 ? 4 : type == T_Q8_0 ? 7 : type == T_Q6_K ? 5 : 0;
}
/* Q4_0, Q4_1 and Q8_0 groups repacked as records (products.c, tsq_repack): the record types, and
 * where a record's codes start */
static inline int group_major(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0; }
static inline int gm_codes_at(int type) { return type == T_Q4_1 ? 16 : 8; }

/* CALL(T, n) with the runtime quantized type `type` and tile height `tr` (1..4, or 1..8) as
 * compile-time constants: the dispatch of the kernels specialised for both (avx2.h, neon.c) */
#define TSQ_TILES4(T, tr, CALL)                                                                   \
    switch (tr) {                                                                                 \
    case 1: CALL(T, 1); break;                                                                    \
    case 2: CALL(T, 2); break;                                                                    \
    case 3: CALL(T, 3); break;                                                                    \
    default: CALL(T, 4); break;                                                                   \
    }
#define TSQ_TILES8(T, tr, CALL)                                                                   \
    switch (tr) {                                                                                 \
    case 1: CALL(T, 1); break;                                                                    \
    case 2: CALL(T, 2); break;                                                                    \
    case 3: CALL(T, 3); break;                                                                    \
    case 4: CALL(T, 4); break;                                                                    \
    case 5: CALL(T, 5); break;                                                                    \
    case 6: CALL(T, 6); break;                                                                    \
    case 7: CALL(T, 7); break;                                                                    \
    default: CALL(T, 8); break;                                                                   \
    }
#define TSQ_DISPATCH(type, tr, TILES, CALL)                                                       \
    switch (type) {                                                                               \
    case T_Q4_0: TILES(T_Q4_0, tr, CALL) break;                                                   \
    case T_Q4_1: TILES(T_Q4_1, tr, CALL) break;                                                   \
    case T_Q5_0: TILES(T_Q5_0, tr, CALL) break;                                                   \
    case T_Q8_0: TILES(T_Q8_0, tr, CALL) break;                                                   \
    case T_Q4_K: TILES(T_Q4_K, tr, CALL) break;                                                   \
    default: TILES(T_Q6_K, tr, CALL) break;                                                       \
    }
#define TSQ_DISPATCH4(type, tr, CALL) TSQ_DISPATCH(type, tr, TSQ_TILES4, CALL)

/* y[m, n_rows] = the quantized input xq against W's rows (tsq_matmul's contract) through `dot`,
 * which multiplies up to `tmax` input rows against a run of weight rows (avx2.h, neon.c): the m
 * rows go as the fewest tiles of at most tmax rows, of heights that differ by one at most, over
 * blocks of weight rows that stay in L2 (block_bytes); threads take contiguous shares of the weight
 * rows. Each tile pays a pass over the weights and their unpacking, which costs about what a
 * one-row product does, so a 5-row verify as tiles of 4 and 1 paid nearly two steps' unpacking.
 * No output element's operations depend on the tiling. */
typedef void (*tsq_dot_tile)(int type, int tr, const uint8_t *w, long k, int packed, const xgroup *x, long xstride,
                         float *y, long ldy, long nrows, long rb);
static inline int tsq_matmul_rowtiles(tsq_dot_tile dot, long block_bytes, int tmax, int type, const uint8_t *w, int packed,
                                    long row_bytes, long n_rows, long k, const xgroup *xq, long m, float *y, long ldy,
                                    int n_threads) {
    const long ng = n_groups(k), ntiles = (m + tmax - 1) / tmax;
    long nb = m <= tmax ? n_rows : block_bytes / row_bytes;
    if (nb < 4) nb = 4;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1 && n_rows >= 64)
    {
        long n0, n1;
        thread_share(n_rows, &n0, &n1);
        for (long b0 = n0; b0 < n1; b0 += nb) {
            const long b1 = n1 - b0 < nb ? n1 : b0 + nb;
            for (long t = 0, r = 0; t < ntiles; t++) {
                const int tr = (int)(m / ntiles + (t < m % ntiles));
                dot(type, tr, w + b0 * row_bytes, k, packed, xq + r * ng, ng, y + r * ldy + b0, ldy, b1 - b0,
                    row_bytes);
                r += tr;
            }
        }
    }
    return 0;
}

/* A product's weight as the block engine and the draft head take it: up to MAX_PARTS GGUF matrices
 * stacked along N, one product's output columns after another's. */
#define MAX_PARTS 4

typedef struct {
    int nparts;
    int type[MAX_PARTS];
    int packed[MAX_PARTS]; /* 1: w stored by tsq_repack */
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

/* products.c */
int tsq_isa(void);
long tsq_xrow_bytes(long k);
long tsq_row_bytes(int type, long k);
void tsq_quantize(const float *x, long m, long k, xgroup *out);
int tsq_matmul(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k, const float *x,
               const void *xqv, long m, float *y, long ldy, int n_threads, int use_simd);

/* products.c, for the tile backend (amx.c) and the 32-element route's reference (prompt_tiles.c) */
TSQ_INTERNAL void tsq_weight_group(int type, const uint8_t *w, long g, long nblocks, int packed, uint8_t lanes[QG],
                                   float a[8], float m[8]);
TSQ_INTERNAL int tsq_offset_shift(int type);
#if TSQ_SIMD
TSQ_INTERNAL void tsq_weight_row_simd(int type, const uint8_t *w, long ng, long nblocks, int packed, uint8_t *codes,
                                      long lane_stride, long group_stride, float *a, float *m, long ab_stride,
                                      int off);
#endif

/* amx.c: the AMX-INT8 tile products (tsq_matmul hands them the multi-row quantized products while
 * tsq_amx_use has switched them on) */
TSQ_INTERNAL int tsq_amx_on(long m);
int tsq_amx_init(void);
TSQ_INTERNAL int tsq_matmul_tiles(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k,
                                  const xgroup *xq, long m, float *y, long ldy, int n_threads, int emulate);

/* blocks.c: the pieces of a block the draft head's step reuses */
TSQ_INTERNAL int tsq_linear_apply(const tsq_linear *L, const float *x, long m, float *y, xgroup *xq, int nt);
TSQ_INTERNAL int tsq_linear_apply_rows(const tsq_linear *L, const float *x, long m, float *y, xgroup *xq, int nt,
                                       const uint8_t *pr);

/* prompt_tiles.c: prompt rows' products in the super-block (Q4_K, Q6_K) and 32-element (Q4_0, Q4_1,
 * Q5_0, Q8_0) arithmetic */
void tsq_quantize_sb(const float *x, long m, long k, int8_t *q, float *dx, int16_t *xs, int nt);
int tsq_matmul_sb_q(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const int8_t *q,
                    const float *dx, const int16_t *xs, long m, float *y, long ldy, int nt, int mode);
TSQ_INTERNAL int tsq_sb_product_mode(void);
int tsq_matmul_b32_q(int type, const uint8_t *w, int packed, long row_bytes, long n, long k, const xgroup *xq, long m,
                     float *y, long ldy, int nt, int mode);
TSQ_INTERNAL int tsq_sb_takes(int type, long k);
TSQ_INTERNAL void tsq_rms_norm_row(const float *x, const float *w, long n, float eps, float *out);
void tsq_act_row(int gelu, const float *g, const float *u, float *a, long n);

#endif
