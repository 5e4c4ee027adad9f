/*
 * copy-ceiling: the bare copy that a 128 KiB sequential read at QD8 does, without a device.
 *
 *   cc -O2 -o /tmp/copy-ceiling bench/copy-ceiling.c && taskset -c 1 /tmp/copy-ceiling [KIND]
 *
 * A RAM namespace serving 128 KiB reads copies 128 KiB at a time from consecutive places of a
 * 1 GiB store into one of the (at QD8) eight buffers the client has in flight. This does the
 * same with nothing around it: 128 KiB blocks of a 1 GiB source, filled first (on 2 MiB pages
 * when the system has them free, as a namespace with `ram_pages=2m` is), into eight 128 KiB
 * buffers in turn, by seven copy kinds: glibc's memcpy (what umdev and SPDK's target both
 * call), `rep movsb`, AVX2 and AVX-512 loops of four vectors, AVX2 non-temporal stores, and
 * two that ask for the source ahead of the copy: memcpy page by page, each 4 KiB page after
 * `prefetcht0` of the next page's 64 lines (`pages`), and `rep movsb` 1 KiB at a time with
 * the lines 4 KiB ahead asked for first (`ahead`). It prints each kind's GB/s per pass,
 * ROUNDS passes alternating the kinds, and the median; with a KIND (`memcpy`, `movsb`,
 * `avx2`, `avx512`, `stream`, `pages`, `ahead`), only that kind's row.
 * bench/spdk-compare runs `copy-ceiling memcpy` on the servers' CPU in each round and sets
 * each server's 128 KiB read GB/s against it: the share of the bare copy left after
 * everything else a command does.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define BLOCK (128 * 1024)
#define BUFFERS 8
#define SOURCE (1UL << 30)
#define ROUNDS 5

typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void copy_memcpy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }

static void copy_movsb(char *dst, const char *src, size_t n)
{
    asm volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}

__attribute__((target("avx2"))) static void copy_avx2(char *dst, const char *src, size_t n)
{
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const void *)(src + i));
        __m256i b = _mm256_loadu_si256((const void *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const void *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const void *)(src + i + 96));
        _mm256_storeu_si256((void *)(dst + i), a);
        _mm256_storeu_si256((void *)(dst + i + 32), b);
        _mm256_storeu_si256((void *)(dst + i + 64), c);
        _mm256_storeu_si256((void *)(dst + i + 96), d);
    }
}

__attribute__((target("avx512f"))) static void copy_avx512(char *dst, const char *src, size_t n)
{
    for (size_t i = 0; i < n; i += 256) {
        __m512i a = _mm512_loadu_si512((const void *)(src + i));
        __m512i b = _mm512_loadu_si512((const void *)(src + i + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + i + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + i + 192));
        _mm512_storeu_si512((void *)(dst + i), a);
        _mm512_storeu_si512((void *)(dst + i + 64), b);
        _mm512_storeu_si512((void *)(dst + i + 128), c);
        _mm512_storeu_si512((void *)(dst + i + 192), d);
    }
}

/* Destination aligned to 64 bytes (the buffers are page aligned). */
__attribute__((target("avx2"))) static void copy_stream(char *dst, const char *src, size_t n)
{
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const void *)(src + i));
        __m256i b = _mm256_loadu_si256((const void *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const void *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const void *)(src + i + 96));
        _mm256_stream_si256((void *)(dst + i), a);
        _mm256_stream_si256((void *)(dst + i + 32), b);
        _mm256_stream_si256((void *)(dst + i + 64), c);
        _mm256_stream_si256((void *)(dst + i + 96), d);
    }
    _mm_sfence();
}

#define PAGE 4096

/* glibc's, called: with a constant size the compiler would inline a copy of its own. */
static void *(*volatile page_copy)(void *, const void *, size_t) = memcpy;

static void copy_pages(char *dst, const char *src, size_t n)
{
    for (size_t at = 0; at < n; at += PAGE) {
        if (at + PAGE < n)
            for (size_t line = 0; line < PAGE; line += 64)
                _mm_prefetch(src + at + PAGE + line, _MM_HINT_T0);
        page_copy(dst + at, src + at, PAGE);
    }
}

static void copy_ahead(char *dst, const char *src, size_t n)
{
    for (size_t at = 0; at < n; at += 1024) {
        /* Past the block's end too: a prefetch is a hint, and the source runs on. */
        for (size_t line = 0; line < 1024; line += 64)
            _mm_prefetch(src + at + PAGE + line, _MM_HINT_T0);
        copy_movsb(dst + at, src + at, 1024);
    }
}

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    static const struct {
        const char *name;
        const char *arg;
        copy_fn fn;
        int needs_avx512;
    } kinds[] = {
        {"memcpy", "memcpy", copy_memcpy, 0}, {"rep movsb", "movsb", copy_movsb, 0},
        {"avx2", "avx2", copy_avx2, 0},       {"avx512", "avx512", copy_avx512, 1},
        {"avx2 stream", "stream", copy_stream, 0}, {"pages", "pages", copy_pages, 0},
        {"ahead", "ahead", copy_ahead, 0},
    };
    enum { KINDS = sizeof(kinds) / sizeof(kinds[0]) };
    double gbps[KINDS][ROUNDS];
    int wanted[KINDS];
    int huge = 1;

    int any = 0;
    for (int k = 0; k < KINDS; k++) {
        wanted[k] = argc < 2 || strcmp(argv[1], kinds[k].arg) == 0;
        any |= wanted[k];
    }
    if (argc > 2 || !any) {
        fprintf(stderr, "usage: copy-ceiling [memcpy|movsb|avx2|avx512|stream|pages|ahead]\n");
        return 2;
    }

    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) {
        fprintf(stderr, "copy-ceiling: this CPU has no AVX2\n");
        return 77;
    }
    char *src = mmap(NULL, SOURCE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB,
                     -1, 0);
    if (src == MAP_FAILED) {
        huge = 0;
        src = mmap(NULL, SOURCE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (src == MAP_FAILED) {
            perror("copy-ceiling: mmap");
            return 1;
        }
    }
    char *dst = aligned_alloc(4096, BUFFERS * BLOCK);
    if (dst == NULL) {
        perror("copy-ceiling: aligned_alloc");
        return 1;
    }
    memset(src, 0x5a, SOURCE);
    memset(dst, 0, BUFFERS * BLOCK);

    for (int round = 0; round < ROUNDS; round++) {
        for (int i = 0; i < KINDS; i++) {
            /* Alternate the order between rounds. */
            int k = round % 2 ? KINDS - 1 - i : i;
            if (!wanted[k] || (kinds[k].needs_avx512 && !__builtin_cpu_supports("avx512f"))) {
                gbps[k][round] = 0;
                continue;
            }
            double start = seconds();
            size_t n = 0;
            for (size_t at = 0; at < SOURCE; at += BLOCK, n++)
                kinds[k].fn(dst + (n % BUFFERS) * BLOCK, src + at, BLOCK);
            gbps[k][round] = SOURCE / (seconds() - start) / 1e9;
        }
    }

    printf("128 KiB blocks of a 1 GiB source (%s pages) into %d buffers in turn; GB/s over %d "
           "passes\n",
           huge ? "2 MiB" : "4 KiB", BUFFERS, ROUNDS);
    printf("%-12s %8s   passes\n", "kind", "median");
    for (int k = 0; k < KINDS; k++) {
        if (!wanted[k])
            continue;
        printf("%-12s", kinds[k].name);
        if (gbps[k][0] == 0) {
            printf(" %8s\n", "-");
            continue;
        }
        double sorted[ROUNDS];
        memcpy(sorted, gbps[k], sizeof(sorted));
        qsort(sorted, ROUNDS, sizeof(double), by_value);
        printf(" %8.1f  ", sorted[ROUNDS / 2]);
        for (int r = 0; r < ROUNDS; r++)
            printf(" %.1f", gbps[k][r]);
        printf("\n");
    }
    return 0;
}
