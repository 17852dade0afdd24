/* test_cp.c - CP split plans: every strategy on random batches (permutation, inverse, gathered
 * order, positions, balance), causal-work balance on 4k prompts, sglang's unit-test metadata,
 * and bad input.
 * Threading: single-threaded. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cp.h"
#include "test_util.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

static const pd_cp_strategy all_strategies[] = { PD_CP_STRATEGY_ROUND_ROBIN,
                                                 PD_CP_STRATEGY_INTERLEAVE,
                                                 PD_CP_STRATEGY_ZIGZAG };

static int32_t round_up(int32_t x, int32_t a) { return (x + a - 1) / a * a; }

static int expect_split(pd_cp_strategy s, const int32_t *lens, int32_t n, int32_t cp, int force)
{
    if (force)
        return 1;
    if (cp <= 1)
        return 0;
    int32_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        total += lens[i];
        if (s == PD_CP_STRATEGY_ZIGZAG && lens[i] < 2 * cp)
            return 0;
    }
    return total >= cp;
}

/* The rank that owns in-sequence offset t of a sequence of length len under zigzag. */
static int32_t zigzag_owner(int32_t len, int32_t cp, int32_t t)
{
    int32_t nb = 2 * cp, base = len / nb, rem = len % nb;
    int32_t b = 0, start = 0;
    for (; b < nb; b++) {
        int32_t sz = base + (b < rem);
        if (t < start + sz)
            break;
        start += sz;
    }
    return b < cp ? b : nb - 1 - b;
}

/* Checks every invariant of one plan; returns the number of failed checks. */
static int check_plan(const int32_t *lens, const int32_t *prefix, int32_t n, int32_t cp,
                      pd_cp_strategy strat, int force)
{
    int fails_before = test_n_fail;
    pd_cp_opts opts = { .strategy = strat, .cp_size = cp, .force_split = force };
    pd_cp_plan *p = NULL;
    pd_err err;
    pd_status st = pd_cp_plan_create(lens, prefix, n, &opts, &p, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK)
        return 1;

    int32_t T = 0;
    for (int32_t i = 0; i < n; i++)
        T += lens[i];
    int split = expect_split(strat, lens, n, cp, force);
    TEST_CHECK(p->split == split);
    TEST_CHECK(pd_cp_plan_would_split(lens, n, &opts) == split);
    TEST_CHECK(p->n_tokens == T && p->n_seqs == n && p->cp_size == cp);
    TEST_CHECK(p->n_slots == cp * p->n_local);
    TEST_CHECK(p->seq_start[0] == 0 && p->seq_start[n] == T);

    /* expected sequence id and position of every global token */
    int32_t *eseq = malloc((size_t)T * sizeof(int32_t));
    int32_t *epos = malloc((size_t)T * sizeof(int32_t));
    int32_t *seen = calloc((size_t)T, sizeof(int32_t));
    for (int32_t i = 0, g = 0; i < n; i++)
        for (int32_t t = 0; t < lens[i]; t++, g++) {
            eseq[g] = i;
            epos[g] = (prefix ? prefix[i] : 0) + t;
        }

    int bad_slot = 0, bad_map = 0;
    int32_t mx = 0, mn = INT32_MAX;
    for (int32_t r = 0; r < cp; r++) {
        const int32_t *sg = pd_cp_plan_rank_row(p, p->slot_global, r);
        const int32_t *ss = pd_cp_plan_rank_row(p, p->slot_seq, r);
        const int32_t *sp = pd_cp_plan_rank_row(p, p->slot_pos, r);
        int32_t nr = p->n_real[r];
        if (nr > mx) mx = nr;
        if (nr < mn) mn = nr;
        bad_slot += nr < 0 || nr > p->n_local;
        for (int32_t s = 0; s < p->n_local; s++) {
            int32_t g = sg[s];
            if (s >= nr) { /* padding: all three are -1 */
                bad_slot += g != -1 || ss[s] != -1 || sp[s] != -1;
                continue;
            }
            if (g < 0 || g >= T) {
                bad_slot++;
                continue;
            }
            bad_slot += ss[s] != eseq[g] || sp[s] != epos[g];
            if (split) {
                seen[g]++;
                bad_map += p->global_rank[g] != r || p->global_slot[g] != s;
                if (strat == PD_CP_STRATEGY_ZIGZAG)
                    bad_map += zigzag_owner(lens[eseq[g]], cp, g - p->seq_start[eseq[g]]) != r;
                else
                    bad_map += g != s * cp + r;
            } else {
                bad_map += g != s;
            }
        }
    }
    TEST_CHECK_MSG(bad_slot == 0, "%s cp %d T %d: %d bad slots", pd_cp_strategy_name(strat),
                   (int)cp, (int)T, bad_slot);
    TEST_CHECK_MSG(bad_map == 0, "%s cp %d T %d: %d bad mappings", pd_cp_strategy_name(strat),
                   (int)cp, (int)T, bad_map);

    if (split) {
        int dup = 0;
        for (int32_t g = 0; g < T; g++)
            dup += seen[g] != 1;
        TEST_CHECK_MSG(dup == 0, "%s cp %d T %d: %d tokens not exactly once",
                       pd_cp_strategy_name(strat), (int)cp, (int)T, dup);
        int32_t lim = strat == PD_CP_STRATEGY_ZIGZAG ? n : 1;
        TEST_CHECK_MSG(mx - mn <= lim, "%s cp %d T %d: real counts %d..%d",
                       pd_cp_strategy_name(strat), (int)cp, (int)T, (int)mn, (int)mx);
        int32_t want_local;
        if (strat == PD_CP_STRATEGY_ROUND_ROBIN)
            want_local = (T + cp - 1) / cp;
        else if (strat == PD_CP_STRATEGY_INTERLEAVE)
            want_local = round_up((T + cp - 1) / cp, cp);
        else
            want_local = round_up(mx, 2 * cp);
        TEST_CHECK_MSG(p->n_local == want_local, "%s cp %d T %d: n_local %d, want %d",
                       pd_cp_strategy_name(strat), (int)cp, (int)T, (int)p->n_local,
                       (int)want_local);
        TEST_CHECK(memcmp(p->gathered_to_global, p->slot_global,
                          (size_t)p->n_slots * sizeof(int32_t)) == 0);
        if (strat == PD_CP_STRATEGY_ROUND_ROBIN) {
            /* one transpose: [cp, n_local] -> [n_local, cp] is the padded global order */
            int bad_t = 0;
            for (int32_t k = 0; k < p->n_slots; k++) {
                int32_t r = k % cp, s = k / cp;
                int32_t g = p->slot_global[r * p->n_local + s];
                bad_t += g != (k < T ? k : -1);
            }
            TEST_CHECK(bad_t == 0);
        }
    } else {
        TEST_CHECK(p->n_local == T);
        int bad_r = 0;
        for (int32_t g = 0; g < T; g++)
            bad_r += p->global_rank[g] != 0 || p->global_slot[g] != g;
        for (int32_t j = 0; j < p->n_slots; j++)
            bad_r += p->gathered_to_global[j] != (j < T ? j : -1);
        TEST_CHECK(bad_r == 0);
    }
    int bad_g = 0;
    for (int32_t g = 0; g < T; g++) {
        int32_t j = p->global_to_gathered[g];
        bad_g += j != p->global_rank[g] * p->n_local + p->global_slot[g];
        bad_g += j < 0 || j >= p->n_slots || p->gathered_to_global[j] != g;
    }
    TEST_CHECK(bad_g == 0);

    /* shard every rank's rows, concatenate rank-major (the all-gather), gather back */
    enum { W = 3 };
    int32_t *x = malloc((size_t)T * W * sizeof(int32_t));
    int32_t *gath = malloc((size_t)p->n_slots * W * sizeof(int32_t));
    int32_t *back = malloc((size_t)T * W * sizeof(int32_t));
    for (int32_t i = 0; i < T * W; i++)
        x[i] = i * 7 + 1;
    for (int32_t r = 0; r < cp; r++)
        TEST_CHECK(pd_cp_shard_rows(p, r, x, gath + (size_t)r * p->n_local * W,
                                    W * sizeof(int32_t), &err) == PD_OK);
    int bad_pad = 0;
    for (int32_t j = 0; j < p->n_slots; j++)
        if (p->slot_global[j] < 0)
            bad_pad += gath[j * W] != 0;
    TEST_CHECK(bad_pad == 0);
    TEST_CHECK(pd_cp_gather_rows(p, gath, back, W * sizeof(int32_t), &err) == PD_OK);
    TEST_CHECK_MSG(memcmp(back, x, (size_t)T * W * sizeof(int32_t)) == 0,
                   "%s cp %d T %d: shard+gather mismatch", pd_cp_strategy_name(strat), (int)cp,
                   (int)T);

    /* work = sum of (pos + 1) over the real tokens a rank computes */
    int64_t *work = calloc((size_t)cp, sizeof(int64_t));
    pd_cp_plan_attn_work(p, work);
    int64_t tot = 0, all = 0;
    for (int32_t r = 0; r < cp; r++)
        tot += work[r];
    for (int32_t g = 0; g < T; g++)
        all += epos[g] + 1;
    TEST_CHECK(tot == (split ? all : all * cp));

    free(work);
    free(x);
    free(gath);
    free(back);
    free(eseq);
    free(epos);
    free(seen);
    pd_cp_plan_destroy(p);
    return test_n_fail - fails_before;
}

static void test_cp_random_batches(void)
{
    int32_t lens[8], prefix[8];
    int failed_cases = 0, cases = 0;
    for (int32_t T = 1; T <= 200; T++) {
        for (int rep = 0; rep < 3; rep++) {
            /* rep 0: one sequence; others: up to 8 sequences of random lengths summing to T */
            int32_t n = rep == 0 ? 1 : 1 + (int32_t)(rng() % (uint32_t)(T < 8 ? T : 8));
            int32_t left = T;
            for (int32_t i = 0; i < n; i++) {
                int32_t rest = n - 1 - i;
                int32_t len = i == n - 1 ? left : 1 + (int32_t)(rng() % (uint32_t)(left - rest));
                lens[i] = len;
                left -= len;
                prefix[i] = rep == 2 ? (int32_t)(rng() % 50) : 0;
            }
            for (int32_t cp = 1; cp <= 8; cp++)
                for (int si = 0; si < 3; si++)
                    for (int force = 0; force < 2; force++) {
                        cases++;
                        failed_cases += check_plan(lens, rep == 2 ? prefix : NULL, n, cp,
                                                   all_strategies[si], force) != 0;
                    }
        }
    }
    printf("random batches: %d plans checked, %d with failures\n", cases, failed_cases);
}

static void test_cp_balance_4k(void)
{
    /* one 4k prompt, and 4k-token batches of several long sequences */
    int32_t batches[4][5] = { { 4096 }, { 1024, 2048, 1024 }, { 1500, 1300, 1296 },
                              { 0 } };
    int32_t nb[4] = { 1, 3, 3, 0 };
    int32_t left = 4096;
    for (int i = 0; i < 4; i++) {
        int32_t len = i == 3 ? left : 512 + (int32_t)(rng() % 512);
        batches[3][i] = len;
        left -= len;
    }
    nb[3] = 4;
    for (int b = 0; b < 4; b++)
        for (int32_t cp = 2; cp <= 8; cp++)
            for (int si = 0; si < 3; si++) {
                pd_cp_opts o = { .strategy = all_strategies[si], .cp_size = cp };
                pd_cp_plan *p = NULL;
                pd_err err;
                TEST_CHECK(pd_cp_plan_create(batches[b], NULL, nb[b], &o, &p, &err) == PD_OK);
                if (p == NULL)
                    continue;
                TEST_CHECK(p->split);
                int64_t w[8], mx = 0, mn = INT64_MAX, sum = 0;
                pd_cp_plan_attn_work(p, w);
                for (int32_t r = 0; r < cp; r++) {
                    mx = w[r] > mx ? w[r] : mx;
                    mn = w[r] < mn ? w[r] : mn;
                    sum += w[r];
                }
                double mean = (double)sum / cp;
                double spread = (double)(mx - mn) / mean;
                TEST_CHECK_MSG(spread <= 0.10, "batch %d %s cp %d: work spread %.3f", b,
                               pd_cp_strategy_name(o.strategy), (int)cp, spread);
                if (b == 0 && cp == 8)
                    printf("4k prompt cp 8 %-17s work spread %.4f\n",
                           pd_cp_strategy_name(o.strategy), spread);
                pd_cp_plan_destroy(p);
            }
}

/* sglang test_cp_strategy_unit.py: test_interleave_metadata_supports_shared_padding and
 * test_interleave_shards_hidden_states_and_position_ids. */
static void test_cp_sglang_interleave(void)
{
    int32_t len = 10;
    pd_cp_opts o = { .strategy = PD_CP_STRATEGY_INTERLEAVE, .cp_size = 4 };
    pd_cp_plan *p = NULL;
    pd_err err;
    TEST_CHECK(pd_cp_plan_create(&len, NULL, 1, &o, &p, &err) == PD_OK);
    int32_t want_real[4] = { 3, 3, 2, 2 };
    TEST_CHECK(memcmp(p->n_real, want_real, sizeof(want_real)) == 0);
    TEST_CHECK(p->n_local == 4);
    for (int32_t r = 0; r < 4; r++) {
        const int32_t *sg = pd_cp_plan_rank_row(p, p->slot_global, r);
        for (int32_t s = 0; s < 4; s++)
            TEST_CHECK(sg[s] == (s < want_real[r] ? r + 4 * s : -1));
    }
    pd_cp_plan_destroy(p);

    /* explicit align 1: padded to the plain maximum, 3 */
    o.align = 1;
    TEST_CHECK(pd_cp_plan_create(&len, NULL, 1, &o, &p, &err) == PD_OK);
    TEST_CHECK(p->n_local == 3);
    pd_cp_plan_destroy(p);

    len = 8;
    o.align = 0;
    TEST_CHECK(pd_cp_plan_create(&len, NULL, 1, &o, &p, &err) == PD_OK);
    for (int32_t r = 0; r < 4; r++) {
        const int32_t *sg = pd_cp_plan_rank_row(p, p->slot_global, r);
        const int32_t *sp = pd_cp_plan_rank_row(p, p->slot_pos, r);
        TEST_CHECK(sg[0] == r && sg[1] == r + 4 && sp[0] == r && sp[1] == r + 4);
    }
    pd_cp_plan_destroy(p);

    /* sglang's can_apply: interleave needs T >= cp */
    len = 3;
    TEST_CHECK(pd_cp_plan_would_split(&len, 1, &o) == 0);
    len = 4;
    TEST_CHECK(pd_cp_plan_would_split(&len, 1, &o) == 1);
}

/* sglang test_zigzag_metadata_for_batched_sequences (seq_lens include the cached prefix, so
 * prefix = seq_len - extend_len) plus its activation and padding tests. */
static void test_cp_sglang_zigzag(void)
{
    struct {
        int32_t cp, n;
        int32_t seq[3], ext[3];
    } cases[] = {
        { 4, 2, { 11, 13 }, { 9, 10 } },
        { 2, 1, { 8 }, { 8 } },
        { 4, 3, { 100000, 200000, 80 }, { 100000, 200000, 64 } },
        { 4, 3, { 100005, 200011, 25 }, { 100000, 200000, 16 } },
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        int32_t cp = cases[c].cp, n = cases[c].n, nb = 2 * cp;
        int32_t prefix[3];
        for (int32_t i = 0; i < n; i++)
            prefix[i] = cases[c].seq[i] - cases[c].ext[i];
        pd_cp_opts o = { .strategy = PD_CP_STRATEGY_ZIGZAG, .cp_size = cp };
        pd_cp_plan *p = NULL;
        pd_err err;
        TEST_CHECK(pd_cp_plan_create(cases[c].ext, prefix, n, &o, &p, &err) == PD_OK);
        if (p == NULL)
            continue;
        TEST_CHECK(p->split);
        /* sglang's split_list, per_rank_actual_token, max_rank_len */
        int32_t bs[3][16], bstart[3][16];
        for (int32_t i = 0; i < n; i++) {
            int32_t L = cases[c].ext[i], base = L / nb, rem = L % nb, acc = 0;
            for (int32_t b = 0; b < nb; b++) {
                bs[i][b] = base + (b < rem ? 1 : 0);
                bstart[i][b] = acc;
                acc += bs[i][b];
            }
        }
        int32_t mx = 0;
        for (int32_t r = 0; r < cp; r++) {
            int32_t want = 0;
            for (int32_t i = 0; i < n; i++)
                want += bs[i][r] + bs[i][nb - 1 - r];
            TEST_CHECK(p->n_real[r] == want);
            mx = want > mx ? want : mx;
        }
        TEST_CHECK(p->n_local == round_up(mx, nb));
        for (int32_t r = 0; r < cp; r++) {
            /* zigzag_index order: block r of each sequence, then block nb-1-r of each */
            const int32_t *sg = pd_cp_plan_rank_row(p, p->slot_global, r);
            const int32_t *sp = pd_cp_plan_rank_row(p, p->slot_pos, r);
            int32_t s = 0, bad = 0;
            for (int half = 0; half < 2; half++)
                for (int32_t i = 0; i < n; i++) {
                    int32_t b = half == 0 ? r : nb - 1 - r;
                    for (int32_t t = 0; t < bs[i][b]; t++, s++)
                        bad += sg[s] != p->seq_start[i] + bstart[i][b] + t;
                    /* kv_len_prev / kv_len_next: the causal window of the block's last query */
                    int32_t kv = prefix[i] + bstart[i][b] + bs[i][b];
                    bad += bs[i][b] > 0 && sp[s - 1] + 1 != kv;
                }
            TEST_CHECK_MSG(bad == 0, "zigzag case %zu rank %d: %d mismatches", c, (int)r, bad);
        }
        pd_cp_plan_destroy(p);
    }

    /* test_enable_cp_v2_and_is_cp_v2_active: cp 4, [8] splits, [7] runs without CP */
    pd_cp_opts o = { .strategy = PD_CP_STRATEGY_ZIGZAG, .cp_size = 4 };
    int32_t l8 = 8, l7 = 7;
    TEST_CHECK(pd_cp_plan_would_split(&l8, 1, &o) == 1);
    TEST_CHECK(pd_cp_plan_would_split(&l7, 1, &o) == 0);
    int32_t mixed[2] = { 100, 7 }; /* one short extend keeps the whole batch off CP */
    TEST_CHECK(pd_cp_plan_would_split(mixed, 2, &o) == 0);

    /* test_zigzag_padding_aligns_local_tensors: cp 2, real [7, 6] -> 8 slots each */
    int32_t l13 = 13;
    o.cp_size = 2;
    pd_cp_plan *p = NULL;
    pd_err err;
    TEST_CHECK(pd_cp_plan_create(&l13, NULL, 1, &o, &p, &err) == PD_OK);
    TEST_CHECK(p->n_real[0] == 7 && p->n_real[1] == 6 && p->n_local == 8);
    pd_cp_plan_destroy(p);
}

static void test_cp_short(void)
{
    /* T = 1 and T < cp: replicated by sglang's rule; force_split leaves ranks with padding only */
    for (int32_t cp = 1; cp <= 8; cp++)
        for (int si = 0; si < 3; si++) {
            int32_t one = 1;
            pd_cp_opts o = { .strategy = all_strategies[si], .cp_size = cp };
            pd_cp_plan *p = NULL;
            pd_err err;
            TEST_CHECK(pd_cp_plan_create(&one, NULL, 1, &o, &p, &err) == PD_OK);
            TEST_CHECK(!p->split && p->n_local == 1 && p->global_to_gathered[0] == 0);
            pd_cp_plan_destroy(p);
            o.force_split = 1;
            TEST_CHECK(pd_cp_plan_create(&one, NULL, 1, &o, &p, &err) == PD_OK);
            TEST_CHECK(p->split && p->n_real[0] == 1 && p->global_rank[0] == 0);
            for (int32_t r = 1; r < cp; r++)
                TEST_CHECK(p->n_real[r] == 0);
            pd_cp_plan_destroy(p);
        }
}

static void test_cp_errors(void)
{
    pd_cp_plan *p = (pd_cp_plan *)(uintptr_t)0x1;
    pd_err err;
    int32_t lens[3] = { 5, 0, 3 }, neg = -2, ok = 4, pre = -1;
    pd_cp_opts o = { .strategy = PD_CP_STRATEGY_ZIGZAG, .cp_size = 2 };
    TEST_CHECK(pd_cp_plan_create(lens, NULL, 0, &o, &p, &err) == PD_ERR_INVALID); /* T = 0 */
    TEST_CHECK(pd_cp_plan_create(NULL, NULL, 1, &o, &p, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_cp_plan_create(lens, NULL, 3, &o, &p, &err) == PD_ERR_INVALID); /* zero len */
    TEST_CHECK(pd_cp_plan_create(&neg, NULL, 1, &o, &p, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_cp_plan_create(&ok, &pre, 1, &o, &p, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_cp_plan_create(&ok, NULL, 1, NULL, &p, &err) == PD_ERR_INVALID);
    int32_t bad_cp[] = { 0, -1, PD_CP_MAX_SIZE + 1 };
    for (int i = 0; i < 3; i++) {
        o.cp_size = bad_cp[i];
        TEST_CHECK(pd_cp_plan_create(&ok, NULL, 1, &o, &p, &err) == PD_ERR_INVALID);
        TEST_CHECK(err.code == PD_ERR_INVALID && err.msg[0] != '\0');
    }
    o.cp_size = 2;
    o.align = -1;
    TEST_CHECK(pd_cp_plan_create(&ok, NULL, 1, &o, &p, &err) == PD_ERR_INVALID);
    o.align = 0;
    o.strategy = (pd_cp_strategy)7;
    TEST_CHECK(pd_cp_plan_create(&ok, NULL, 1, &o, &p, &err) == PD_ERR_INVALID);
    int32_t huge[2] = { INT32_MAX / 2, INT32_MAX / 2 };
    o.strategy = PD_CP_STRATEGY_INTERLEAVE;
    TEST_CHECK(pd_cp_plan_create(huge, NULL, 2, &o, &p, &err) == PD_ERR_INVALID);
    TEST_CHECK(p == (pd_cp_plan *)(uintptr_t)0x1); /* untouched on error */
    TEST_CHECK(pd_cp_plan_would_split(lens, 0, &o) == 0);
    pd_cp_plan_destroy(NULL);

    TEST_CHECK(pd_cp_shard_rows(NULL, 0, NULL, NULL, 4, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_cp_gather_rows(NULL, NULL, NULL, 4, &err) == PD_ERR_INVALID);
}

static void test_cp_names(void)
{
    for (int si = 0; si < 3; si++) {
        pd_cp_strategy s;
        pd_err err;
        TEST_CHECK(pd_cp_strategy_parse(pd_cp_strategy_name(all_strategies[si]), &s, &err) ==
                   PD_OK);
        TEST_CHECK(s == all_strategies[si]);
    }
    TEST_CHECK(strcmp(pd_cp_strategy_name(PD_CP_STRATEGY_ROUND_ROBIN), "round-robin-split") == 0);
    TEST_CHECK(strcmp(pd_cp_strategy_name(PD_CP_STRATEGY_INTERLEAVE), "interleave") == 0);
    TEST_CHECK(strcmp(pd_cp_strategy_name(PD_CP_STRATEGY_ZIGZAG), "zigzag") == 0);
    TEST_CHECK(strcmp(pd_cp_strategy_name((pd_cp_strategy)99), "unknown") == 0);
    pd_cp_strategy s = PD_CP_STRATEGY_ZIGZAG;
    pd_err err;
    TEST_CHECK(pd_cp_strategy_parse("round-robin", &s, &err) == PD_ERR_INVALID);
    TEST_CHECK(pd_cp_strategy_parse(NULL, &s, &err) == PD_ERR_INVALID);
    TEST_CHECK(s == PD_CP_STRATEGY_ZIGZAG);
}

int main(void)
{
    test_cp_names();
    test_cp_errors();
    test_cp_short();
    test_cp_sglang_interleave();
    test_cp_sglang_zigzag();
    test_cp_random_batches();
    test_cp_balance_4k();
    TEST_DONE();
}
