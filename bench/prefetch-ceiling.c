/*
 * prefetch-ceiling: the bare copy that 4 KiB random reads of a RAM namespace do, by prefetch kind.
 *
 *   cc -O2 -o /tmp/prefetch-ceiling bench/prefetch-ceiling.c && taskset -c 1 /tmp/prefetch-ceiling
 *
 * A RAM namespace serving 4 KiB random reads at QD32 copies a page from a random place of a
 * 1 GiB store into one of the client's 32 buffers; umdev's worker asks for the next queued
 * read's page while it runs the current one (the look-ahead, devices/src/nvme/worker.rs).
 * This does the same with nothing around it: random 4 KiB pages of a 1 GiB source (hugetlb
 * pages when the pool has them, else transparent huge pages), filled first, into 32 buffers
 * in turn, 4M copies per pass with glibc's memcpy, by prefetch kind: none; the next page's 64
 * lines asked for with prefetcht0, prefetcht1 or prefetchnta before the current page is
 * copied; and prefetcht1 two pages ahead. Each kind but the first also asks for the current
 * page's lines with prefetcht0 just before its copy, as umdev's copy does. It prints which
 * pages the source got, then each kind's million pages per second, three passes alternating
 * the kinds.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define PAGE 4096
#define SOURCE (1UL << 30)
#define BUFFERS 32
#define COPIES 4000000
#define PASSES 3

enum kind { NONE, T0_NEXT, T1_NEXT, NTA_NEXT, T1_TWO_AHEAD, KINDS };
static const char *names[KINDS] = {"none", "t0-next", "t1-next", "nta-next", "t1-two-ahead"};

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One loop per hint: the hint of a prefetch instruction is part of the instruction. */
#define ASK(page, hint)                                                                         \
    do {                                                                                        \
        for (int o = 0; o < PAGE; o += 64)                                                      \
            _mm_prefetch((page) + o, hint);                                                     \
    } while (0)

/* Inline in the loop: a call to a function of nothing but prefetches is dropped by GCC as one
 * without effects. */
static inline __attribute__((always_inline)) void ask(const char *page, enum kind k)
{
    switch (k) {
    case T0_NEXT:
        ASK(page, _MM_HINT_T0);
        break;
    case NTA_NEXT:
        ASK(page, _MM_HINT_NTA);
        break;
    default:
        ASK(page, _MM_HINT_T1);
        break;
    }
}

/* glibc's, called: with a constant size the compiler would inline a copy of its own. */
static void *(*volatile copy)(void *, const void *, size_t) = memcpy;

int main(void)
{
    const char *pages = "hugetlb 2 MiB pages";
    char *src = mmap(NULL, SOURCE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (src == MAP_FAILED) {
        pages = "transparent huge pages where the kernel gives them (the hugetlb pool is too small)";
        src = mmap(NULL, SOURCE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (src == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        madvise(src, SOURCE, MADV_HUGEPAGE);
    }
    memset(src, 1, SOURCE);
    char *dst = aligned_alloc(PAGE, BUFFERS * PAGE);
    unsigned *at = malloc(COPIES * sizeof(unsigned));
    if (!dst || !at) {
        perror("malloc");
        return 1;
    }
    memset(dst, 0, BUFFERS * PAGE);
    printf("random 4 KiB pages of a 1 GiB source on %s into %d buffers; M pages/s per pass\n", pages, BUFFERS);
    srand(1);
    for (int i = 0; i < COPIES; i++)
        at[i] = (unsigned)rand() % (SOURCE / PAGE);
    for (int pass = 0; pass < PASSES; pass++) {
        for (enum kind k = NONE; k < KINDS; k++) {
            int ahead = k == T1_TWO_AHEAD ? 2 : 1;
            double t = now();
            for (int i = 0; i < COPIES; i++) {
                const char *s = src + (size_t)at[i] * PAGE;
                if (k != NONE) {
                    if (i + ahead < COPIES)
                        ask(src + (size_t)at[i + ahead] * PAGE, k);
                    ASK(s, _MM_HINT_T0);
                }
                copy(dst + (size_t)(i % BUFFERS) * PAGE, s, PAGE);
            }
            printf("%-13s %.2f M pages/s\n", names[k], COPIES / (now() - t) / 1e6);
            fflush(stdout);
        }
    }
    return 0;
}
