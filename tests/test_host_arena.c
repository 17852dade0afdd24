/* test_host_arena.c - pd_host_arena: pieces aligned and disjoint, chunks taken as needed and up
 * to the cap, gaps merged when pieces come back, and a random run against a model of the
 * pieces (on the CPU backend, whose host memory is malloc'ed). */
#include <stdint.h>
#include <string.h>

#include "pd_host_arena.h"
#include "test_util.h"

#define KB ((size_t)1024)

static kern_backend *be;

static void test_arena_basic(void)
{
    pd_err err;
    pd_host_arena *a = NULL;
    TEST_CHECK(pd_host_arena_create(be, 1024 * KB, 256 * KB, &a, &err) == PD_OK);
    TEST_CHECK(pd_host_arena_chunk_bytes(a) == 0);   /* nothing before the first piece */
    char *p1 = pd_host_arena_alloc(a, 100 * KB), *p2 = pd_host_arena_alloc(a, 100 * KB);
    TEST_CHECK(p1 != NULL && p2 != NULL && ((uintptr_t)p1 & 4095) == 0 && ((uintptr_t)p2 & 4095) == 0);
    TEST_CHECK(pd_host_arena_chunk_bytes(a) == 256 * KB);   /* both in the first chunk */
    TEST_CHECK(pd_host_arena_used_bytes(a) == 200 * KB);
    TEST_CHECK(pd_host_arena_owns(a, p1) && pd_host_arena_owns(a, p2) && !pd_host_arena_owns(a, p1 + 1));
    TEST_CHECK(!pd_host_arena_owns(NULL, p1) && pd_host_arena_alloc(NULL, 10) == NULL);
    /* a third does not fit the 56 KB left: a second chunk */
    char *p3 = pd_host_arena_alloc(a, 100 * KB);
    TEST_CHECK(p3 != NULL && pd_host_arena_chunk_bytes(a) == 512 * KB);
    /* larger than a chunk: a chunk of its own size */
    char *big = pd_host_arena_alloc(a, 300 * KB + 1);
    TEST_CHECK(big != NULL && pd_host_arena_chunk_bytes(a) == 512 * KB + 304 * KB);
    /* the cap (1024 KB) leaves 208 KB: a 256 KB piece is refused, 200 KB gets the rest */
    TEST_CHECK(pd_host_arena_alloc(a, 256 * KB) == NULL);
    char *last = pd_host_arena_alloc(a, 200 * KB);
    TEST_CHECK(last != NULL && pd_host_arena_chunk_bytes(a) == 1016 * KB);
    memset(p1, 1, 100 * KB);
    memset(p2, 2, 100 * KB);
    memset(p3, 3, 100 * KB);
    memset(big, 4, 300 * KB + 1);
    memset(last, 5, 200 * KB);
    TEST_CHECK(p1[100 * KB - 1] == 1 && p2[0] == 2 && p3[0] == 3 && big[300 * KB] == 4 && last[0] == 5);
    /* p1 then p2 back: their gap joins the chunk's tail into one of 256 KB, which a 256 KB piece
     * takes without a new chunk */
    pd_host_arena_free(a, p2);
    pd_host_arena_free(a, p1);
    TEST_CHECK(pd_host_arena_used_bytes(a) == 100 * KB + 304 * KB + 200 * KB);
    char *whole = pd_host_arena_alloc(a, 256 * KB);
    TEST_CHECK(whole == p1 && pd_host_arena_chunk_bytes(a) == 1016 * KB);
    pd_host_arena_free(a, whole);
    pd_host_arena_free(a, p3);
    pd_host_arena_free(a, big);
    pd_host_arena_free(a, last);
    TEST_CHECK(pd_host_arena_used_bytes(a) == 0);
    pd_host_arena_destroy(a);
    pd_host_arena_destroy(NULL);
    TEST_CHECK(pd_host_arena_create(be, 1024 * KB, 0, &a, &err) == PD_ERR_INVALID);
    /* reserve: whole chunks taken now, up to the cap; pieces then come from them */
    TEST_CHECK(pd_host_arena_create(be, 600 * KB, 256 * KB, &a, &err) == PD_OK);
    TEST_CHECK(pd_host_arena_reserve(a, 300 * KB) == 0 && pd_host_arena_chunk_bytes(a) == 512 * KB);
    char *r1 = pd_host_arena_alloc(a, 256 * KB);
    TEST_CHECK(r1 != NULL && pd_host_arena_chunk_bytes(a) == 512 * KB);
    TEST_CHECK(pd_host_arena_reserve(a, 256 * KB) == -1 && pd_host_arena_chunk_bytes(a) == 512 * KB);
    pd_host_arena_free(a, r1);
    pd_host_arena_destroy(a);
}

/* Random pieces in and out against a model: never overlapping, each keeps what was written
 * into it, and once all are back every chunk is one gap again (a chunk-sized piece fits each). */
static void test_arena_random(void)
{
    enum { N = 64, ROUNDS = 4000 };
    pd_err err;
    pd_host_arena *a = NULL;
    const size_t chunk = 512 * KB, cap = 8 * chunk;
    TEST_CHECK(pd_host_arena_create(be, cap, chunk, &a, &err) == PD_OK);
    char *p[N] = { 0 };
    size_t n[N] = { 0 };
    uint64_t s = 12345;
    int bad = 0, refused = 0;
    for (int r = 0; r < ROUNDS && a != NULL; r++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        int k = (int)((s >> 33) % N);
        if (p[k] != NULL) {
            for (size_t i = 0; i < n[k]; i += 997)
                bad += p[k][i] != (char)k;
            pd_host_arena_free(a, p[k]);
            p[k] = NULL;
            continue;
        }
        n[k] = 1 + (size_t)((s >> 13) % (200 * KB));
        if ((p[k] = pd_host_arena_alloc(a, n[k])) == NULL) {
            refused++;
            continue;
        }
        for (int j = 0; j < N; j++)   /* disjoint from every other piece */
            if (j != k && p[j] != NULL && p[k] < p[j] + n[j] && p[j] < p[k] + n[k])
                bad++;
        memset(p[k], k, n[k]);
    }
    TEST_CHECK_MSG(bad == 0, "%d overlaps or lost bytes", bad);
    TEST_CHECK(pd_host_arena_chunk_bytes(a) <= cap);
    printf("random: %d of %d allocations refused at the cap\n", refused, ROUNDS);
    for (int k = 0; k < N; k++)
        if (p[k] != NULL)
            pd_host_arena_free(a, p[k]);
    TEST_CHECK(pd_host_arena_used_bytes(a) == 0);
    size_t held = pd_host_arena_chunk_bytes(a);
    int chunks = (int)(held / chunk), whole = 0;
    char *q[16];
    for (int c = 0; c < chunks && c < 16; c++)
        whole += (q[c] = pd_host_arena_alloc(a, chunk)) != NULL;
    TEST_CHECK_MSG(whole == chunks && pd_host_arena_chunk_bytes(a) == held,
                   "%d of %d chunks whole again", whole, chunks);
    pd_host_arena_destroy(a);
}

int main(void)
{
    pd_err err;
    kern_backend_config bc = { .name = "cpu" };
    if (kern_backend_create(&bc, &be, &err) != PD_OK) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        return 1;
    }
    test_arena_basic();
    test_arena_random();
    kern_backend_destroy(be);
    TEST_DONE();
}
