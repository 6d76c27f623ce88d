/* amx.c: the quantized products on Intel AMX-INT8 tiles, a backend beside products.c's.
 *
 * The arithmetic is the one every product performs (products.c's header): per weight row, input
 * row, 128-element group and lane L (the 16 elements of one half-block), the exact integer sum of
 * code times input code, less the weight offset times the input's code sum (an exact integer), then
 * one float step acc[L] = fma(isum, a[L] * dx[L], acc[L]); Q4_K's eight offsets fma'd into acc ahead
 * of each super-block's products, Q4_1's into a second set of accumulators added at the end; the
 * eight lanes reduced by sum8. Only the integer sums move to the tiles: a tile product's int32 sums
 * are exact, so the result is the reference's and the VNNI path's bit for bit.
 *
 * One tile product per (16 weight rows, 16 input rows, lane): A = 16 weight rows x the lane's 16
 * codes (K = 16), B = the 16 input rows' 16 signed codes in the four-byte groups the instruction
 * reads, C = the 16 x 16 int32 lane sums. The sums are taken per lane, not over whole rows of 64,
 * because each lane has its own pair of scales. The scalar panel (levels below AVX-512, emulated
 * only) takes the codes unsigned with TDPBUSD and subtracts the offset's integer; the AVX-512
 * panel takes them signed, c - 2^sh, with TDPBSSD: the same integer, one step less per lane.
 *
 * emulate = 1 runs the same sequence with the tile instructions done in C (tile_dp below), bit for
 * bit what the hardware computes (integer sums), so the backend's data movement and float steps are
 * tested on every CPU; emulate = 0 needs AMX and the kernel's permission (tsq_amx_init).
 *
 * Three things the hardware is strict about, all kept here: the tile configuration is a constant,
 * fully zeroed structure (a non-zero reserved byte, or a configuration the compiler drops as dead
 * stores, makes LDTILECFG fault: llama.cpp b11434's crash on these CPUs); it is per thread, so
 * every OpenMP thread loads it before its first tile instruction (else SIGILL on the workers); and
 * the permission is asked for once per process before any thread issues a tile instruction.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "tsq.h"

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || (defined(__clang__) && __clang_major__ >= 12))
#define TSQ_AMX_BUILD 1
#include <cpuid.h>
#include <immintrin.h> /* the tile intrinsics, whatever level the rest of the library is built for */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#else
#define TSQ_AMX_BUILD 0
#endif

#define TR 16 /* rows of a tile: weight rows (A, C) and input rows (C's columns) */

/* ------------------------------------------------------------------ detection and permission */

enum { AMX_OK = 0, AMX_NO_CPU = 1, AMX_NO_OS = 2, AMX_REFUSED = 3, AMX_NOT_BUILT = 4 };

static int amx_state = -1; /* tsq_amx_init's answer, once */
static int amx_use = 0;    /* tsq_amx_use: 1 while the products take the tiles */
static long amx_min_rows = 1 << 30;

/* What this process may do with AMX: 0 usable (the kernel granted the tile data), 1 not on this
 * CPU (CPUID), 2 the OS does not enable the tile state (XCR0), 3 the kernel refused the permission,
 * 4 this build has no AMX code. Asks for the permission the first time; call it on the main thread
 * before any product runs (the Python side does, when it loads the library). */
int tsq_amx_init(void) {
    if (amx_state >= 0) return amx_state;
#if TSQ_AMX_BUILD
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) {
        amx_state = AMX_NO_CPU; /* AMX-TILE is EDX bit 24, AMX-INT8 bit 25 */
    } else if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) {
        amx_state = AMX_NO_OS; /* no OSXSAVE: XGETBV is not there to ask */
    } else {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if (((lo >> 17) & 3) != 3) amx_state = AMX_NO_OS; /* XTILECFG and XTILEDATA */
        else amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0
                             ? AMX_OK : AMX_REFUSED;
    }
#else
    amx_state = AMX_NOT_BUILT;
#endif
    return amx_state;
}

/* Switch the tile products on (1: the hardware; 2: their emulation, for tests on any CPU) or off
 * (0) for tsq_matmul's quantized products of at least min_rows input rows. -> 0, or the
 * tsq_amx_init code that forbids switching the hardware on. */
int tsq_amx_use(int on, long min_rows) {
    if (on == 1 && tsq_amx_init() != AMX_OK) return tsq_amx_init();
    amx_use = on;
    amx_min_rows = min_rows < 1 ? 1 : min_rows;
    return 0;
}

/* 0: products of m rows keep the other paths; 1: the hardware tiles take them; 2: the emulation */
TSQ_INTERNAL int tsq_amx_on(long m) { return m >= amx_min_rows ? amx_use : 0; }

/* ------------------------------------------------------------------ the tiles, real and emulated */

/* A tile's working set: the configured shapes are C (tmm0) 16 rows x 64 bytes, A (tmm1) 16 x 16,
 * B (tmm2) 4 x 64. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

#if TSQ_AMX_BUILD
/* The configuration LDTILECFG reads: a constant, so it is complete before any thread can read it
 * (it was a static that every thread zeroed and filled as it began: a thread loading it while
 * another had just zeroed it got palette 0, and its next tile instruction faulted), and the
 * compiler cannot drop its stores as dead. Every byte not set here is zero, reserved ones too. */
static const tilecfg TILE_CFG = {
    .palette_id = 1,
    .colsb = {4 * TR, 16, 4 * TR, 4 * TR, 16, 4 * TR, 4 * TR, 16},
    .rows = {TR, TR, 4, TR, TR, 4, TR, TR},
};
/* Tile configuration is per thread: every thread that issues a tile instruction calls this first
 * (tsq_matmul_tiles does, inside its parallel region). */
static AMX_TARGET void tiles_begin(void) { _tile_loadconfig(&TILE_CFG); }
static AMX_TARGET void tiles_end(void) { _tile_release(); }
#if !TSQ_SIMD /* the scalar panel's (the AVX-512 level's panel_simd takes tile_ss_0/3/6) */
/* c[16][16] = A (16 rows x 16 codes, `as` bytes apart) . B (4 rows x 64 bytes) */
static AMX_TARGET void tile_dp_hw(const uint8_t *A, long as, const int8_t *B, int32_t *c) {
    _tile_zero(0);
    _tile_loadd(1, A, as);
    _tile_loadd(2, B, 4 * TR);
    _tile_dpbusd(0, 1, 2);
    _tile_stored(0, c, 4 * TR);
}
#endif
/* panel_simd's products: signed codes (c - 2^sh) against the signed input codes, TDPBSSD. A
 * product's float steps wait for its TDPBSSD and tile store, so panel_simd issues each product
 * PIPE - 1 ahead, product j on tile set j % 3: C tmm0/3/6, A tmm1/4/7, B tmm2/5/2 (sets 0 and 2
 * share tmm2, so a load into it waits until the product two before has read it). Measured: one,
 * two or three products in flight ran alike (perf: ~45% of the panel's time on tile stores
 * retiring either way); kept at three, the most the eight tiles allow. */
#define PIPE 3 /* lane_product's switch names the three sets */
#define XT_BLOCK_BYTES (2L << 20) /* input tiles a panel takes in one pass (tsq_matmul_tiles) */
#define TILE_SS(C, A, B)                                                                           \
    static inline AMX_TARGET void tile_ss_##C(const int8_t *a, const int8_t *b, int32_t *c) {     \
        _tile_zero(C);                                                                             \
        _tile_loadd(A, a, 16);                                                                     \
        _tile_loadd(B, b, 4 * TR);                                                                 \
        _tile_dpbssd(C, A, B);                                                                     \
        _tile_stored(C, c, 4 * TR);                                                                \
    }
TILE_SS(0, 1, 2)
TILE_SS(3, 4, 5)
TILE_SS(6, 7, 2)
#undef TILE_SS
#endif

/* A tile product on zeroed accumulators, in C: c[r][n] = sum over kk < 16 of A[r][kk] times
 * B[kk / 4][4 n + kk % 4] (signed), A's rows `as` bytes apart and its bytes unsigned (TDPBUSD: the
 * scalar panel's codes) or signed (TDPBSSD: the AVX-512 panel's c - 2^sh); integer sums, so the
 * same as the instruction's. */
static void tile_emu(const void *A, long as, int a_signed, const int8_t *B, int32_t *c) {
    for (int r = 0; r < TR; r++)
        for (int n = 0; n < TR; n++) {
            int32_t s = 0;
            for (int kk = 0; kk < 16; kk++) {
                const int32_t a = a_signed ? ((const int8_t *)A)[r * as + kk] : ((const uint8_t *)A)[r * as + kk];
                s += a * (int32_t)B[(kk / 4) * 4 * TR + 4 * n + kk % 4];
            }
            c[r * TR + n] = s;
        }
}

/* ------------------------------------------------------------------ the product */

/* One input tile's view of group g: per lane L, B (4 x 64 bytes: input row n's codes 4j..4j+3 of
 * the lane at row j, bytes 4n..4n+3), and per lane and input row its scale, its code sum times
 * 2^sh and its block sums (xgroup's d, s, fs); rows past m are zero. */
typedef struct {
    int8_t B[8][4][4 * TR];
    float d[8][TR], fs[8][TR];
    int32_t s[8][TR];
} xtile;

static void make_xtile(const xgroup *xq, long ng, long g, long n0, long nr, int sh, xtile *t) {
    memset(t, 0, sizeof *t);
    for (long n = 0; n < nr; n++) {
        const xgroup *x = xq + (n0 + n) * ng + g;
        for (int L = 0; L < 8; L++) {
            for (int j = 0; j < 4; j++) memcpy(&t->B[L][j][4 * n], x->q + 32 * j + 4 * L, 4);
            t->d[L][n] = x->d[L];
#if !TSQ_SIMD /* the AVX-512 panel takes the codes signed: the offset is inside its tile sums */
            t->s[L][n] = sh ? x->s[L] * (1 << sh) : 0; /* the reference subtracts no offset where sh is 0 */
#else
            (void)sh;
#endif
            t->fs[L][n] = x->fs[L];
        }
    }
}

#if !TSQ_SIMD /* (the AVX-512 level takes panel_simd below) */
/* Weight rows [r0, r1) (at most TR) against every input row, all groups: acc/accm [tiles][TR rows]
 * [8 lanes][TR inputs] scratch; y[n * ldy + r] for the real rows and inputs. */
static void panel(int type, const uint8_t *w, int packed, long row_bytes, long r0, long r1, long k,
                  const xtile *xt, long ntile, long m, float *acc, float *accm, float *y, long ldy, int emulate) {
    const long ng = n_groups(k), nblocks = k / QB;
    const int mg = type == T_Q4_1;
    uint8_t lanes[TR][QG];
    float a[TR][8], mn[TR][8];
    int32_t c[TR * TR];
    memset(acc, 0, sizeof(float) * ntile * TR * 8 * TR);
    if (mg) memset(accm, 0, sizeof(float) * ntile * TR * 8 * TR);
    memset(lanes, 0, sizeof lanes);
    memset(a, 0, sizeof a);
    memset(mn, 0, sizeof mn);
    for (long g = 0; g < ng; g++) {
        for (long r = r0; r < r1; r++)
            tsq_weight_group(type, w + r * row_bytes, g, nblocks, packed, lanes[r - r0], a[r - r0], mn[r - r0]);
        for (long t = 0; t < ntile; t++) {
            const xtile *x = xt + t * ng + g;
            float *A = acc + t * TR * 8 * TR, *M = accm + t * TR * 8 * TR;
            if (type == T_Q4_K && g % 2 == 0) /* a super-block's offsets, into acc ahead of its products */
                for (int r = 0; r < TR; r++)
                    for (int L = 0; L < 8; L++)
                        for (int n = 0; n < TR; n++)
                            A[(r * 8 + L) * TR + n] = fmaf(mn[r][L], x->fs[L][n], A[(r * 8 + L) * TR + n]);
            for (int L = 0; L < 8; L++) {
#if TSQ_AMX_BUILD
                if (!emulate) tile_dp_hw(&lanes[0][16 * L], QG, &x->B[L][0][0], c);
                else
#endif
                    tile_emu(&lanes[0][16 * L], QG, 0, &x->B[L][0][0], c);
                for (int r = 0; r < TR; r++) {
                    float *ar = A + (r * 8 + L) * TR;
                    const float aL = a[r][L];
                    for (int n = 0; n < TR; n++)
                        ar[n] = fmaf((float)(c[r * TR + n] - x->s[L][n]), aL * x->d[L][n], ar[n]);
                }
            }
            if (mg) /* offsets per group, apart (lanes 4..7 of m are zero) */
                for (int r = 0; r < TR; r++)
                    for (int L = 0; L < 8; L++)
                        for (int n = 0; n < TR; n++)
                            M[(r * 8 + L) * TR + n] = fmaf(mn[r][L], x->fs[L][n], M[(r * 8 + L) * TR + n]);
        }
    }
    for (long t = 0; t < ntile; t++)
        for (long r = r0; r < r1; r++)
            for (int n = 0; n < TR && t * TR + n < m; n++) {
                float v[8];
                for (int L = 0; L < 8; L++) {
                    v[L] = acc[((t * TR + (r - r0)) * 8 + L) * TR + n];
                    if (mg) v[L] += accm[((t * TR + (r - r0)) * 8 + L) * TR + n];
                }
                y[(t * TR + n) * ldy + r] = sum8(v);
            }
}
#endif

#if TSQ_SIMD
/* The same panel on the AVX-512 level, in the same operations per output element, arranged for
 * speed:
 * - each weight row's groups are unpacked once per product (tsq_weight_row_simd), lane-major:
 *   codes[L][g] is the A tile of lane L of group g (TR rows of 16 codes, 256 contiguous bytes),
 *   wa[g][r][L] its scales and wm[g][r][L] its offsets;
 * - per input tile and lane, the TR weight rows' accumulators (one 512-bit register per row: the
 *   tile's sixteen inputs) stay in registers across all groups; after each group's tile product,
 *   one fma per row: fma(isum - 2^sh s, a * d, acc), the scalar panel's step element for element
 *   (the tile gives isum - 2^sh s directly, the codes taken signed). An
 *   accumulator (row, lane, input) sees the same steps in the same order as there: Q4_K's offsets
 *   at each even group ahead of its product, then the product. Q4_1's offsets, a separate sum,
 *   are taken at the end, group by group, as the scalar panel's second accumulators take them.
 * The scalar panel unpacked with the reference's byte reader and kept its accumulators in memory,
 * one element at a time: 10 to 31 times slower than VNNI on real tiles. */
/* one lane's tile product (A: TR rows of 16 signed codes, contiguous; B: an xtile's lane) into c,
 * product j of a sequence on tile set j % 3, or emulated */
static inline __attribute__((always_inline)) void lane_product(const int8_t *A, const int8_t *B, int32_t *c, long j,
                                                                const int emulate) {
#if TSQ_AMX_BUILD
    if (!emulate) {
        switch (j % 3) {
        case 0: tile_ss_0(A, B, c); break;
        case 1: tile_ss_3(A, B, c); break;
        default: tile_ss_6(A, B, c); break;
        }
        return;
    }
#endif
    (void)j;
    (void)emulate;
    tile_emu(A, 16, 1, B, c);
}
static inline __attribute__((always_inline)) void
panel_simd_body(int type, const uint8_t *w, int packed, long row_bytes, long r0, long r1, long k, const xtile *xt,
                long t0, long t1, long m, uint8_t *codes, float *wa, float *wm, float *acc, float *y, long ldy,
                const int emulate) {
    const long ng = n_groups(k), nblocks = k / QB, nr = r1 - r0;
    const int mg = type == T_Q4_1, kq = type == T_Q4_K, sh = tsq_offset_shift(type);
    for (long r = 0; r < nr; r++)
        tsq_weight_row_simd(type, w + (r0 + r) * row_bytes, ng, nblocks, packed, codes + r * 16, ng * TR * 16, TR * 16,
                            wa + r * 8, wm + r * 8, TR * 8, sh ? 1 << sh : 0);
    if (nr < TR) /* a short panel's missing rows: zero codes and scales (their sums are not stored) */
        for (long g = 0; g < ng; g++) {
            for (int L = 0; L < 8; L++) memset(codes + ((L * ng + g) * TR + nr) * 16, 0, (TR - nr) * 16);
            memset(wa + (g * TR + nr) * 8, 0, sizeof(float) * (TR - nr) * 8);
            memset(wm + (g * TR + nr) * 8, 0, sizeof(float) * (TR - nr) * 8);
        }
    int32_t c[PIPE][TR * TR] __attribute__((aligned(64)));
    /* The tile products in one sequence, j = ((t - t0) * 8 + L) * ng + g, each issued PIPE - 1
     * ahead of its float steps, across lanes and input tiles (restarting the pipeline at every
     * lane left a 12-group lane of a 1536-wide row waiting at its start) */
    const long nj = (t1 - t0) * 8 * ng;
    long it = t0, iL = 0, ig = 0, j = 0; /* it, iL, ig: the next product to issue */
#define ISSUE_NEXT(J)                                                                              \
    do {                                                                                           \
        lane_product((const int8_t *)codes + (iL * ng + ig) * TR * 16, &xt[it * ng + ig].B[iL][0][0], \
                     c[(J) % PIPE], (J), emulate);                                                 \
        if (++ig == ng) {                                                                          \
            ig = 0;                                                                                \
            if (++iL == 8) { iL = 0; it++; }                                                       \
        }                                                                                          \
    } while (0)
    for (long q = 0; q < PIPE - 1 && q < nj; q++) ISSUE_NEXT(q);
    for (long t = t0; t < t1; t++) {
        const xtile *xt_t = xt + t * ng;
        for (int L = 0; L < 8; L++) {
            __m512 ac[TR];
            for (int r = 0; r < TR; r++) ac[r] = _mm512_setzero_ps();
            for (long g = 0; g < ng; g++, j++) {
                const xtile *x = xt_t + g;
                const float *a = wa + g * TR * 8 + L; /* row r's scale at a[8 r] */
                if (kq && g % 2 == 0) { /* a super-block's offsets, ahead of its products */
                    const __m512 fs = _mm512_load_ps(x->fs[L]);
                    const float *mn = wm + g * TR * 8 + L;
                    for (int r = 0; r < TR; r++) ac[r] = _mm512_fmadd_ps(_mm512_set1_ps(mn[8 * r]), fs, ac[r]);
                }
                if (j + PIPE - 1 < nj) ISSUE_NEXT(j + PIPE - 1); /* into its own buffer */
                const int32_t *cg = c[j % PIPE];
                const __m512 d = _mm512_load_ps(x->d[L]);
                for (int r = 0; r < TR; r++) /* cg: the exact isum - 2^sh s (the codes came signed) */
                    ac[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cg + r * TR)),
                                            _mm512_mul_ps(_mm512_set1_ps(a[8 * r]), d), ac[r]);
            }
            for (int r = 0; r < TR; r++) _mm512_store_ps(acc + (r * 8 + L) * TR, ac[r]);
        }
        const long nn = m - t * TR < TR ? m - t * TR : TR;
        for (long r = 0; r < nr; r++) { /* sum8's order, sixteen inputs at a time */
            __m512 v[8];
            for (int L = 0; L < 8; L++) {
                v[L] = _mm512_load_ps(acc + (r * 8 + L) * TR);
                if (mg) { /* offsets per group, apart (lanes 4..7 of m are zero) */
                    __m512 om = _mm512_setzero_ps();
                    for (long g = 0; g < ng; g++)
                        om = _mm512_fmadd_ps(_mm512_set1_ps(wm[(g * TR + r) * 8 + L]), _mm512_load_ps(xt_t[g].fs[L]), om);
                    v[L] = _mm512_add_ps(v[L], om);
                }
            }
            const __m512 s0 = _mm512_add_ps(v[0], v[4]), s1 = _mm512_add_ps(v[1], v[5]);
            const __m512 s2 = _mm512_add_ps(v[2], v[6]), s3 = _mm512_add_ps(v[3], v[7]);
            float out[TR] __attribute__((aligned(64)));
            _mm512_store_ps(out, _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3)));
            for (long n = 0; n < nn; n++) y[(t * TR + n) * ldy + r0 + r] = out[n];
        }
    }
}
#undef ISSUE_NEXT

/* the body with the tile instructions inlined (the hardware) or emulated, each its own function */
static void panel_simd_emu(int type, const uint8_t *w, int packed, long row_bytes, long r0, long r1, long k,
                           const xtile *xt, long t0, long t1, long m, uint8_t *codes, float *wa, float *wm, float *acc,
                           float *y, long ldy) {
    panel_simd_body(type, w, packed, row_bytes, r0, r1, k, xt, t0, t1, m, codes, wa, wm, acc, y, ldy, 1);
}
#if TSQ_AMX_BUILD
static AMX_TARGET void panel_simd_hw(int type, const uint8_t *w, int packed, long row_bytes, long r0, long r1, long k,
                                     const xtile *xt, long t0, long t1, long m, uint8_t *codes, float *wa, float *wm,
                                     float *acc, float *y, long ldy) {
    panel_simd_body(type, w, packed, row_bytes, r0, r1, k, xt, t0, t1, m, codes, wa, wm, acc, y, ldy, 0);
}
#endif
static void panel_simd(int type, const uint8_t *w, int packed, long row_bytes, long r0, long r1, long k,
                       const xtile *xt, long t0, long t1, long m, uint8_t *codes, float *wa, float *wm, float *acc,
                       float *y, long ldy, int emulate) {
#if TSQ_AMX_BUILD
    if (!emulate) {
        panel_simd_hw(type, w, packed, row_bytes, r0, r1, k, xt, t0, t1, m, codes, wa, wm, acc, y, ldy);
        return;
    }
#endif
    panel_simd_emu(type, w, packed, row_bytes, r0, r1, k, xt, t0, t1, m, codes, wa, wm, acc, y, ldy);
}
#endif

/* y[m, n_rows] (row stride ldy) = the quantized input xq (m rows) against W's rows, on tiles (real
 * or emulated); the same bits as tsq_matmul's other paths. Threads take contiguous shares of the
 * weight rows, whole panels of 16. -> 0, -1 for a type it does not take, -2 out of memory. */
TSQ_INTERNAL int tsq_matmul_tiles(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k,
                                  const xgroup *xq, long m, float *y, long ldy, int n_threads, int emulate) {
    if (is_float_type(type) || type < 0 || type >= T_COUNT || k % QB) return -1;
#if TSQ_AMX_BUILD
    if (!emulate && tsq_amx_init() != AMX_OK) return -1;
#else
    if (!emulate) return -1;
#endif
    const long ng = n_groups(k), ntile = (m + TR - 1) / TR, npanel = (n_rows + TR - 1) / TR;
    const int sh = tsq_offset_shift(type);
    xtile *xt = aligned_alloc(64, sizeof(xtile) * ntile * ng);
    if (!xt) return -2;
    for (long t = 0; t < ntile; t++)
        for (long g = 0; g < ng; g++) make_xtile(xq, ng, g, t * TR, m - t * TR < TR ? m - t * TR : TR, sh, xt + t * ng + g);
    int rc = 0;
    if (n_threads < 1) n_threads = 1;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1 && npanel > 1)
    {
        long p0, p1;
        thread_share(npanel, &p0, &p1);
#if TSQ_SIMD /* one input tile's sums, and the panel's unpacked groups */
        const size_t accn = (size_t)TR * 8 * TR;
        uint8_t *codes = p0 < p1 ? aligned_alloc(64, (size_t)ng * TR * QG) : NULL;
        float *wa = p0 < p1 ? aligned_alloc(64, sizeof(float) * ng * TR * 8) : NULL;
        float *wm = p0 < p1 ? aligned_alloc(64, sizeof(float) * ng * TR * 8) : NULL;
        float *acc = p0 < p1 ? aligned_alloc(64, sizeof(float) * accn) : NULL;
        float *accm = NULL;
        const int short_of = p0 < p1 && (!codes || !wa || !wm);
#else
        const size_t accn = (size_t)ntile * TR * 8 * TR;
        float *acc = p0 < p1 ? malloc(sizeof(float) * accn) : NULL;
        float *accm = p0 < p1 && type == T_Q4_1 ? malloc(sizeof(float) * accn) : NULL;
        const int short_of = 0;
#endif
        if (p0 < p1 && (short_of || !acc || (TSQ_SIMD == 0 && type == T_Q4_1 && !accm))) {
#pragma omp atomic write
            rc = -2;
        } else if (p0 < p1) {
#if TSQ_AMX_BUILD
            if (!emulate) tiles_begin();
#endif
#if TSQ_SIMD
            /* the input tiles in blocks whose quantized rows stay in L2 (each panel re-reads its
             * block's tiles once per lane): over a 512-row prefill of qwen2.5-coder-1.5b's
             * 8960-wide down projection they were 7.8 MB, streamed from L3 for every panel */
            const long fit = XT_BLOCK_BYTES / (ng * (long)sizeof(xtile)), tb = fit > 1 ? fit : 1;
            for (long t0 = 0; t0 < ntile; t0 += tb)
                for (long p = p0; p < p1; p++) {
                    const long r0 = p * TR, r1 = r0 + TR < n_rows ? r0 + TR : n_rows;
                    panel_simd(type, w, packed, row_bytes, r0, r1, k, xt, t0, t0 + tb < ntile ? t0 + tb : ntile, m,
                               codes, wa, wm, acc, y, ldy, emulate);
                }
#else
            for (long p = p0; p < p1; p++) {
                const long r0 = p * TR, r1 = r0 + TR < n_rows ? r0 + TR : n_rows;
                panel(type, w, packed, row_bytes, r0, r1, k, xt, ntile, m, acc, accm, y, ldy, emulate);
            }
#endif
#if TSQ_AMX_BUILD
            if (!emulate) tiles_end();
#endif
        }
        free(acc);
        free(accm);
#if TSQ_SIMD
        free(codes);
        free(wa);
        free(wm);
#endif
    }
    free(xt);
    return rc;
}

/* The tile product called directly (tests, and tsspec info's self-check): the same arguments as
 * tsq_matmul for a quantized type, emulate as above. */
int tsq_matmul_amx(int type, const uint8_t *w, int packed, long row_bytes, long n_rows, long k, const void *xqv,
                   long m, float *y, long ldy, int n_threads, int emulate) {
    return tsq_matmul_tiles(type, w, packed, row_bytes, n_rows, k, (const xgroup *)xqv, m, y, ldy, n_threads, emulate);
}
