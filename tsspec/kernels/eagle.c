/* eagle.c: a trained draft head's step over the same products and block pieces. */
#include "tsq.h"

/* A trained per-token draft head (tsspec-eagle; tsspec/drafters/eagle.py's head_step is the
 * reference): for m rows of token embeddings e and hidden rows h (both [m, d]),
 *   x  = fc([norm(e, enorm), norm(h, hnorm)]);  x += down(act(gate(y)) * up(y)), y = norm(x, ffn_norm)
 *   h' = norm(x, out_norm);  logits = head(h')   (the trunk's rows of the draft vocabulary)
 * into h_out [m, d] and logits [m, head.n_total]. One call where torch ran ~15 small operations a
 * draft token; the products are the trunk's (batch invariant, so row r's bits do not depend on m). */
typedef struct {
    tsq_linear fc, gate_up, down, head; /* gate_up: the gate's rows, then the up rows */
    const float *enorm, *hnorm, *ffn_norm, *out_norm;
    long ffn;
    float eps;
    int act; /* 0 silu, 1 gelu (tanh) */
} tsq_eagle;

int tsq_sizeof_eagle(void) { return (int)sizeof(tsq_eagle); }

int tsq_eagle_step(const tsq_eagle *E, const float *e, const float *h, long m, float *h_out, float *logits, int nt) {
    const long d = E->fc.n_total, f = E->ffn;
    if (E->fc.k != 2 * d || E->gate_up.k != d || E->gate_up.n_total != 2 * f || E->down.k != f ||
        E->down.n_total != d || E->head.k != d || m < 1)
        return -3;
    const long kmax = 2 * d > f ? 2 * d : f;
    float *cat = malloc(sizeof(float) * m * kmax); /* the fc input, later the activation */
    float *x = malloc(sizeof(float) * m * d), *y = malloc(sizeof(float) * m * d);
    float *gu = malloc(sizeof(float) * m * 2 * f);
    xgroup *xq = malloc((size_t)tsq_xrow_bytes(kmax) * m);
    int rc = 0;
    if (!cat || !x || !y || !gu || !xq) { rc = -2; goto done; }
    for (long r = 0; r < m; r++) {
        tsq_rms_norm_row(e + r * d, E->enorm, d, E->eps, cat + r * 2 * d);
        tsq_rms_norm_row(h + r * d, E->hnorm, d, E->eps, cat + r * 2 * d + d);
    }
    if ((rc = tsq_linear_apply(&E->fc, cat, m, x, xq, nt))) goto done;
    for (long r = 0; r < m; r++) tsq_rms_norm_row(x + r * d, E->ffn_norm, d, E->eps, y + r * d);
    if ((rc = tsq_linear_apply(&E->gate_up, y, m, gu, xq, nt))) goto done;
    for (long r = 0; r < m; r++) tsq_act_row(E->act, gu + r * 2 * f, gu + r * 2 * f + f, cat + r * f, f);
    if ((rc = tsq_linear_apply(&E->down, cat, m, y, xq, nt))) goto done;
    for (long r = 0; r < m; r++) {
        for (long i = 0; i < d; i++) x[r * d + i] += y[r * d + i];
        tsq_rms_norm_row(x + r * d, E->out_norm, d, E->eps, h_out + r * d);
    }
    rc = tsq_linear_apply(&E->head, h_out, m, logits, xq, nt);
done:
    free(cat); free(x); free(y); free(gu); free(xq);
    return rc;
}

