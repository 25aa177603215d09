/*
 * A step's routed (token, rank) pairs grouped by expert, as the experts kernels take them
 * (cpu_experts.c for bf16, cpu_quant.c for packed formats): pair p is token p / k's rank p % k,
 * routed to expert pair_expert[p]; only the experts in `chosen` (all when NULL) are kept.
 *
 * index holds at least 2P + 2E + 1 int64 and receives, for the M kept pairs in G groups (ascending
 * expert id, pairs in their order): out_rows = index[0, M) (each pair's p), rows = index[M, 2M) (its
 * token), expert_ids = index[2M, 2M + G), offsets = index[2M + G, 2M + 2G + 1).
 * Returns 0, ROUTED_BAD_EXPERT (an id outside [0, E)) or ROUTED_NO_MEMORY.
 */
#ifndef MOEDESK_ROUTED_PAIRS_H
#define MOEDESK_ROUTED_PAIRS_H

#include <stdint.h>
#include <stdlib.h>

#define ROUTED_BAD_EXPERT (-3)
#define ROUTED_NO_MEMORY (-4)

static int group_routed_pairs(const int64_t *pair_expert, int64_t P, int64_t k, const int64_t *chosen,
                              int64_t n_chosen, int64_t E, int64_t *index, int64_t *m, int64_t *g) {
    int64_t *count = calloc((size_t)(E > 0 ? E : 1), sizeof(int64_t));
    if (!count) return ROUTED_NO_MEMORY;
    const int64_t SKIP = -1; /* count[e] of experts not computed here */
    if (chosen) {
        for (int64_t e = 0; e < E; e++) count[e] = SKIP;
        for (int64_t i = 0; i < n_chosen; i++) {
            if (chosen[i] < 0 || chosen[i] >= E) { free(count); return ROUTED_BAD_EXPERT; }
            count[chosen[i]] = 0;
        }
    }
    int64_t M = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t e = pair_expert[p];
        if (e < 0 || e >= E) { free(count); return ROUTED_BAD_EXPERT; }
        if (count[e] != SKIP) { count[e]++; M++; }
    }
    int64_t G = 0;
    for (int64_t e = 0; e < E; e++) G += count[e] > 0;
    int64_t *out_rows = index, *rows = index + M, *expert_ids = index + 2 * M, *offsets = expert_ids + G;
    offsets[0] = 0;
    for (int64_t e = 0, grp = 0, at = 0; e < E; e++) { /* count[e] becomes the next free slot of e's group */
        if (count[e] <= 0) continue;
        expert_ids[grp] = e;
        const int64_t n = count[e];
        count[e] = at;
        at += n;
        offsets[++grp] = at;
    }
    for (int64_t p = 0; p < P; p++) {
        const int64_t e = pair_expert[p];
        if (count[e] == SKIP) continue;
        const int64_t i = count[e]++;
        out_rows[i] = p;
        rows[i] = p / k;
    }
    free(count);
    *m = M;
    *g = G;
    return 0;
}

#endif
