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
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define TSQ_SIMD 1
#else
#define TSQ_SIMD 0
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
    int32_t s[16];
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

#if TSQ_SIMD
static inline float hsum8(__m256 v) { /* sum8's order */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

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
long tsq_xrow_bytes(long k);
void tsq_quantize(const float *x, long m, long k, xgroup *out);
int tsq_matmul(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k, const float *x,
               const void *xqv, long m, float *y, long ldy, int n_threads, int use_simd);

/* products.c, for the tile backend */
TSQ_INTERNAL void tsq_weight_group(int type, const uint8_t *w, long g, long nblocks, int packed, uint8_t lanes[QG],
                                   float a[8], float m[8]);
TSQ_INTERNAL int tsq_offset_shift(int type);

/* amx.c: the AMX-INT8 tile products (tsq_matmul hands them the multi-row quantized products while
 * tsq_amx_use has switched them on) */
TSQ_INTERNAL int tsq_amx_on(long m);
TSQ_INTERNAL int tsq_matmul_tiles(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k,
                                  const xgroup *xq, long m, float *y, long ldy, int n_threads, int emulate);

/* blocks.c: the pieces of a block the draft head's step reuses */
TSQ_INTERNAL int tsq_linear_apply(const tsq_linear *L, const float *x, long m, float *y, xgroup *xq, int nt);
TSQ_INTERNAL void tsq_rms_norm_row(const float *x, const float *w, long n, float eps, float *out);
TSQ_INTERNAL void tsq_act_row(int gelu, const float *g, const float *u, float *a, long n);

#endif
