/* helpers_overflow.c -- the block-count helpers overflow int64 (undefined behaviour) on extreme
 * configs; the harness computes Nc and nb itself until they are fixed. Build and run: see
 * README.md beside this file. */
#include "nsa.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    int which = argc > 1 ? atoi(argv[1]) : 1;
    nsa_config c = nsa_config_default();
    if (which == 1) { /* invalid config: T - cmp_len overflows in nsa_rule_num_cmp */
        c.cmp_len = INT64_MIN, c.cmp_stride = 3;
        fprintf(stderr, "validate %d\n", (int)nsa_config_validate(&c));
        fprintf(stderr, "Nc %lld\n", (long long)nsa_num_cmp_blocks(&c, 9));
    } else { /* a config nsa_config_validate accepts: T + slc_block - 1 overflows in nsa_rule_num_slc */
        c.cmp_len = 1, c.cmp_stride = 1, c.slc_block = INT64_MAX, c.slc_topk = 1, c.n_init = 0, c.n_local = 0;
        fprintf(stderr, "validate %d\n", (int)nsa_config_validate(&c));
        fprintf(stderr, "nb %lld\n", (long long)nsa_num_slc_blocks(&c, 9));
    }
    return 0;
}
