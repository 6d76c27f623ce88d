/* arm_harness.c: the NEON products against the plain C reference, bit for bit, built with the
 * kernel sources for one ARM level and run under qemu-aarch64 by scripts/arm_check.sh.
 *
 * For every quantized type (stored and repacked by tsq_repack) and every float type, random weight
 * rows with sane f16 scales (random bytes elsewhere, so every code value occurs), plus blocks of the
 * extreme codes, against random inputs and inputs whose codes are all +-127; rows 1..64 and threads
 * 1 and 2: tsq_matmul's NEON product must equal its reference (use_simd = 0) in every bit. The
 * activation (tsq_act_row) is checked against libm's functions to a tolerance, as a sanity check of
 * the scalar mirror the ARM levels run. Prints one line per failure, then "N passed, M failed". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "tsq.h"

int tsq_repack(int type, const uint8_t *w, long row_bytes, long n_rows, long k, uint8_t *out, int nt);
int tsq_isa(void);

static uint64_t rng_state = 88172645463325252ULL;
static uint32_t rnd(void) { /* xorshift64 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static float rndf(void) { return (float)(rnd() % 2000001) / 1000000.f - 1.f; } /* [-1, 1] */

static uint16_t f32_to_f16(float f) { /* small normal values only (the scales here) */
    uint32_t b;
    memcpy(&b, &f, 4);
    const uint32_t sign = (b >> 16) & 0x8000;
    const int exp = (int)((b >> 23) & 0xff) - 127 + 15;
    if (exp <= 0) return (uint16_t)sign;
    return (uint16_t)(sign | (exp << 10) | ((b >> 13) & 0x3ff));
}

static void put16(uint8_t *p, float v) { const uint16_t h = f32_to_f16(v); memcpy(p, &h, 2); }

/* n rows of k elements of `type`: random bytes, scales set small and finite; extreme: every code
 * at its largest or smallest value */
static void random_rows(int type, long n, long k, int extreme, uint8_t *w) {
    const long rb = tsq_row_bytes(type, k), bb = BLOCK_BYTES[type];
    if (is_float_type(type)) {
        for (long i = 0; i < n * k; i++) {
            const float v = rndf() * 0.05f;
            if (type == T_F32) memcpy(w + 4 * i, &v, 4);
            else if (type == T_F16) put16(w + 2 * i, v);
            else { uint32_t b; memcpy(&b, &v, 4); const uint16_t h = (uint16_t)(b >> 16); memcpy(w + 2 * i, &h, 2); }
        }
        return;
    }
    for (long i = 0; i < n * rb; i++) w[i] = (uint8_t)rnd();
    for (long b = 0; b < n * rb / bb; b++) {
        uint8_t *p = w + b * bb;
        const int hi = rnd() & 1;
        if (extreme) memset(p, hi ? 0xFF : 0x00, bb);
        if (extreme && type == T_Q8_0) memset(p + 2, hi ? 0x80 : 0x7F, 32);
        if (extreme && type == T_Q6_K) memset(p + 192, hi ? 0x7F : 0x80, 16);
        if (extreme && type == T_Q4_K) memset(p + 4, 63, 12);
        const float s = (float)(rnd() % 1000) * 1e-5f + 1e-4f;
        if (type == T_Q6_K) put16(p + 208, s);
        else put16(p, s);
        if (type == T_Q4_1) put16(p + 2, -s);
        if (type == T_Q4_K) put16(p + 2, s);
    }
}

static int passed = 0, failed = 0;

static void check(int type, int packed, int extreme, long n, long k) {
    const long rb = tsq_row_bytes(type, k), M = 64;
    uint8_t *w = malloc(n * rb), *wp = malloc(n * rb);
    float *x = malloc(sizeof(float) * M * k), *ref = malloc(sizeof(float) * M * n), *y = malloc(sizeof(float) * M * n);
    xgroup *xq = malloc(tsq_xrow_bytes(k) * M);
    random_rows(type, n, k, extreme, w);
    if (packed && tsq_repack(type, w, rb, n, k, wp, 1)) { printf("FAIL repack type %d\n", type); failed++; return; }
    const uint8_t *wu = packed ? wp : w;
    for (long i = 0; i < M * k; i++) x[i] = extreme ? ((i / 32) % 3 == 0 ? -3.f : 3.f) : rndf() * 3.f;
    tsq_quantize(x, M, k, xq);
    tsq_matmul(type, wu, packed, rb, n, k, x, xq, M, ref, n, 1, 0);
    const long rows[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64};
    for (unsigned ri = 0; ri < sizeof rows / sizeof rows[0]; ri++)
        for (int nt = 1; nt <= 2; nt++) {
            const long m = rows[ri];
            for (long i = 0; i < m * n; i++) y[i] = NAN;
            tsq_matmul(type, wu, packed, rb, n, k, x, xq, m, y, n, nt, 1);
            if (memcmp(y, ref, sizeof(float) * m * n)) {
                long at = 0;
                while (!memcmp(y + at, ref + at, 4)) at++;
                printf("FAIL type %d packed %d extreme %d rows %ld threads %d: [%ld] %.9g vs %.9g\n", type, packed,
                       extreme, m, nt, at, y[at], ref[at]);
                failed++;
            } else {
                passed++;
            }
        }
    free(w); free(wp); free(x); free(ref); free(y); free(xq);
}

static void check_act(void) {
    float g[37], u[37], a[37];
    for (int i = 0; i < 37; i++) { g[i] = rndf() * 8.f; u[i] = rndf(); }
    for (int gelu = 0; gelu <= 1; gelu++) {
        tsq_act_row(gelu, g, u, a, 37);
        int ok = 1;
        for (int i = 0; i < 37; i++) {
            const float want = (gelu ? 0.5f * g[i] * (1.f + tanhf(0.7978845608f * (g[i] + 0.044715f * g[i] * g[i] * g[i])))
                                     : g[i] / (1.f + expf(-g[i]))) * u[i];
            if (fabsf(a[i] - want) > 1e-5f * (1.f + fabsf(want))) ok = 0;
        }
        if (ok) passed++;
        else { printf("FAIL activation %s\n", gelu ? "gelu" : "silu"); failed++; }
    }
}

int main(void) {
    const int types[] = {T_Q4_0, T_Q4_1, T_Q5_0, T_Q8_0, T_Q4_K, T_Q6_K};
    printf("level %d\n", tsq_isa());
    for (unsigned t = 0; t < sizeof types / sizeof types[0]; t++) {
        const int type = types[t];
        const long k = (type == T_Q4_K || type == T_Q6_K) ? 768 : 608; /* 608: a short last group */
        for (int packed = 0; packed <= 1; packed++)
            for (int extreme = 0; extreme <= 1; extreme++) check(type, packed, extreme, 67, k);
    }
    const int ftypes[] = {T_F32, T_F16, T_BF16};
    for (unsigned t = 0; t < 3; t++) check(ftypes[t], 0, 0, 67, 603);
    check_act();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
