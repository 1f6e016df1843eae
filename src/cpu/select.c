/* select.c -- top-n of one importance row (spec 3): forced blocks first, then larger
 * importance, ties to the lower index; output ascending, -1 padded. */
#include "common.h"

int64_t select_top_n(const float *imp, int64_t cur, const nsa_config *c, int32_t *out)
{
    const int64_t n = c->slc_topk;
    int64_t kept = 0;
    /* out[0..kept) holds the best so far in rank order (best first) */
    for (int64_t j = 0; j <= cur; j++) {
        const int fj = nsa_rule_forced(j, cur, c->n_init, c->n_local);
        int64_t pos;
        if (kept < n) {
            pos = kept++;
        } else {
            const int64_t w = out[n - 1];
            if (!nsa_rule_ranks_above(fj, imp[j], j, nsa_rule_forced(w, cur, c->n_init, c->n_local), imp[w], w))
                continue;
            pos = n - 1;
        }
        while (pos > 0) {
            const int64_t a = out[pos - 1];
            if (!nsa_rule_ranks_above(fj, imp[j], j, nsa_rule_forced(a, cur, c->n_init, c->n_local), imp[a], a)) break;
            out[pos] = out[pos - 1];
            pos--;
        }
        out[pos] = (int32_t)j;
    }
    /* ascending block order, then padding */
    for (int64_t i = 1; i < kept; i++) {
        int32_t v = out[i];
        int64_t k = i;
        while (k > 0 && out[k - 1] > v) {
            out[k] = out[k - 1];
            k--;
        }
        out[k] = v;
    }
    for (int64_t i = kept; i < n; i++) out[i] = -1;
    return kept;
}
