/* Exact top-k selection and output rows of the CPU path (ops/native.py).
 *
 * One call writes the output rows of one tile of the work plan (query head,
 * query block pairs): sink ++ picks ++ window, into rows prefilled with -1.
 * A row whose budget covers its candidates is simply 0 .. s2-1. The picks are the
 * `take` candidates with the largest ranking keys (contract.rank_keys: the
 * float order with -0.0 == +0.0 and NaN as -inf, ties to the lower block),
 * found with a radix select over the row's own key range and emitted in one
 * ascending pass: no sort, no score is written. In a long row only the keys
 * at or above a floor judged from a sample of the row go through the radix
 * select and the emit (pick); the floor is checked, so it costs time when
 * wrong, never the result.
 *
 * Only integer operations on the score bits: the scores arrive rounded
 * (scale, then + vbias), so nothing here depends on floating-point flags.
 * Built with -fopenmp where the compiler has it (the loop over rows is then
 * shared by threads), serial otherwise.
 *
 * Also here: the bfloat16 score products (stem_scores_bf16, at the end), and
 * the widening of bfloat16 keys for float32 ones (stem_widen_bf16).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DIGIT_BITS 8
#define BUCKETS (1 << DIGIT_BITS)

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#include <immintrin.h>
#define X86_TARGETS 1 /* functions built for AVX-512 whatever the library's flags */
#else
#define X86_TARGETS 0
#endif

/* The selection's linear passes, ordering (scores to ranking keys, with
 * their range), gather (keep the keys of one bucket) and emit (write the
 * picks' indices), run on AVX-512 where the CPU has it (`vec`): the same
 * integers, only faster. stem_select_vector can force either
 * (tests/test_native.py runs both). */
static int select_vector = -1; /* -1: where the CPU has AVX-512 */

static int vector_passes(void)
{
#if X86_TARGETS
    int forced = __atomic_load_n(&select_vector, __ATOMIC_RELAXED);
    __builtin_cpu_init(); /* a library's constructors may not have run it */
    return forced >= 0 ? forced : __builtin_cpu_supports("avx512f") != 0;
#else
    return 0;
#endif
}

/* -1: AVX-512 where the CPU has it (the default), 0: never, 1: always (only
 * where the CPU has it); any other value changes nothing. Returns whether
 * the selection's passes now run on AVX-512. */
int stem_select_vector(int mode)
{
    if (mode >= -1 && mode <= 1)
        __atomic_store_n(&select_vector, mode, __ATOMIC_RELAXED);
#if X86_TARGETS
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f"))
        __atomic_store_n(&select_vector, 0, __ATOMIC_RELAXED);
#endif
    return vector_passes();
}

static int64_t gather_scalar(const uint32_t *src, int64_t m, uint32_t b_lo, uint32_t b_span,
                             uint32_t *dst, uint32_t *lo, uint32_t *hi)
{
    int64_t w = 0;
    uint32_t least = UINT32_MAX, most = 0;
    for (int64_t i = 0; i < m; i++) { /* in place from the second pass on (w <= i) */
        uint32_t v = src[i];
        dst[w] = v;
        bool in = v - b_lo <= b_span;
        w += in;
        least = in && v < least ? v : least;
        most = in && v > most ? v : most;
    }
    *lo = least;
    *hi = most;
    return w;
}

#if X86_TARGETS
#define SEL_TARGET __attribute__((target("avx512f")))

SEL_TARGET static int64_t gather_avx512(const uint32_t *src, int64_t m, uint32_t b_lo,
                                        uint32_t b_span, uint32_t *dst, uint32_t *lo,
                                        uint32_t *hi)
{
    const __m512i base = _mm512_set1_epi32((int)b_lo), span = _mm512_set1_epi32((int)b_span);
    __m512i most = _mm512_setzero_si512(), least = _mm512_set1_epi32(-1);
    int64_t w = 0;
    for (int64_t i = 0; i < m; i += 16) { /* in place too: the 16 are loaded first */
        __mmask16 in = m - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (m - i)) - 1u);
        __m512i v = _mm512_maskz_loadu_epi32(in, src + i);
        __mmask16 keep = _mm512_mask_cmple_epu32_mask(in, _mm512_sub_epi32(v, base), span);
        int got = __builtin_popcount(keep);
        _mm512_mask_storeu_epi32(dst + w, (__mmask16)((1u << got) - 1u),
                                 _mm512_maskz_compress_epi32(keep, v));
        most = _mm512_mask_max_epu32(most, keep, most, v);
        least = _mm512_mask_min_epu32(least, keep, least, v);
        w += got;
    }
    *lo = (uint32_t)_mm512_reduce_min_epu32(least);
    *hi = (uint32_t)_mm512_reduce_max_epu32(most);
    return w;
}
#endif

/* The keys of src[0..m) in [b_lo, b_lo + b_span] into dst, in order, with
 * their smallest and largest in *lo, *hi; returns how many. */
static int64_t gather(const uint32_t *src, int64_t m, uint32_t b_lo, uint32_t b_span,
                      uint32_t *dst, uint32_t *lo, uint32_t *hi, int vec)
{
#if X86_TARGETS
    if (vec)
        return gather_avx512(src, m, b_lo, b_span, dst, lo, hi);
#else
    (void)vec;
#endif
    return gather_scalar(src, m, b_lo, b_span, dst, lo, hi);
}

/* Unsigned key with the order of contract.rank_keys' score part. */
static inline uint32_t order_key(uint32_t bits, int precision)
{
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x007FFFFFu; /* NaN ranks as -inf */
    if (precision == 2) /* round to bfloat16, nearest even (as torch) */
        bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    if (bits == 0x80000000u)
        bits = 0; /* -0.0 ranks as +0.0 */
    return bits ^ ((uint32_t)((int32_t)bits >> 31) | 0x80000000u);
}

#if X86_TARGETS
/* kth_largest's walk down its four histograms (buckets [0, top]), 16
 * buckets at a time: the highest bucket of the group holding the k-th
 * largest key, k reduced by the keys in the groups above it. */
SEL_TARGET static int skip_groups_avx512(uint32_t (*count)[BUCKETS], int top, int64_t *k)
{
    for (int base = top / 16 * 16; base > 0; base -= 16) {
        __mmask16 in = top - base >= 15 ? (__mmask16)0xFFFF
                                        : (__mmask16)((1u << (top - base + 1)) - 1u);
        __m512i sum = _mm512_maskz_loadu_epi32(in, count[0] + base);
        for (int h = 1; h < 4; h++)
            sum = _mm512_add_epi32(sum, _mm512_maskz_loadu_epi32(in, count[h] + base));
        int64_t total = (uint32_t)_mm512_reduce_add_epi32(sum);
        if (total >= *k)
            return top - base >= 15 ? base + 15 : top;
        *k -= total;
    }
    return top < 15 ? top : 15;
}
#endif

/* The k-th largest (1 <= k <= n) of keys[0..n), all in [lo, hi]: radix
 * select, DIGIT_BITS of the remaining range per pass, each pass on the
 * bucket the previous one chose (gathered into buf). Returns it; *ties gets
 * how many of the keys equal to it rank among the k largest, *equal how
 * many there are. */
static uint32_t kth_largest(const uint32_t *keys, int64_t n, int64_t k, uint32_t lo,
                            uint32_t hi, uint32_t *buf, int64_t *ties, int64_t *equal, int vec)
{
    const uint32_t *src = keys;
    int64_t m = n;
    /* Four interleaved histograms: runs of equal buckets (common, as nearby
     * floats share their high bits) do not serialise on one counter. */
    uint32_t count[4][BUCKETS];
    while (lo != hi) {
        int bits = 32 - __builtin_clz(hi - lo);
        int shift = bits > DIGIT_BITS ? bits - DIGIT_BITS : 0;
        int top = (int)((hi - lo) >> shift);
        for (int h = 0; h < 4; h++)
            memset(count[h], 0, sizeof(uint32_t) * (size_t)(top + 1));
        int64_t i = 0;
        for (; i + 4 <= m; i += 4)
            for (int h = 0; h < 4; h++)
                count[h][(src[i + h] - lo) >> shift]++;
        for (; i < m; i++)
            count[0][(src[i] - lo) >> shift]++;
        int d = top;
#if X86_TARGETS
        if (vec)
            d = skip_groups_avx512(count, top, &k);
#endif
        for (;;) { /* the buckets above d hold fewer than k keys */
            int64_t in_d = (int64_t)count[0][d] + count[1][d] + count[2][d] + count[3][d];
            if (in_d >= k)
                break;
            k -= in_d;
            d--;
        }
        uint32_t b_lo = lo + ((uint32_t)d << shift);
        uint32_t b_span = d == top ? hi - b_lo : (1u << shift) - 1u;
        m = gather(src, m, b_lo, b_span, buf, &lo, &hi, vec);
        src = buf;
    }
    *ties = k;
    *equal = m;
    return lo;
}

#if X86_TARGETS
/* emit on AVX-512. */
SEL_TARGET static void emit_avx512(const uint32_t *keys, const int32_t *at, int64_t n,
                                   int64_t take, uint32_t t, int64_t ties, int64_t first,
                                   int32_t *dst)
{
    const __m512i thr = _mm512_set1_epi32((int)t), base = _mm512_set1_epi32((int)first);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    int64_t w = 0;
    /* Exactly take of the n keys qualify: the loop stops at the chunk holding
     * the last. */
    for (int64_t j = 0; w < take; j += 16, idx = _mm512_add_epi32(idx, step)) {
        __mmask16 in = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        __m512i v = _mm512_maskz_loadu_epi32(in, keys + j);
        __mmask16 keep = _mm512_mask_cmpgt_epu32_mask(in, v, thr);
        __mmask16 eq = _mm512_mask_cmpeq_epu32_mask(in, v, thr);
        if (ties >= __builtin_popcount(eq)) {
            keep |= eq;
            ties -= ties == INT64_MAX ? 0 : __builtin_popcount(eq);
        } else {
            for (; ties > 0; ties--) { /* the first `ties` of them */
                keep |= eq & (__mmask16)-eq;
                eq &= (__mmask16)(eq - 1);
            }
        }
        int got = __builtin_popcount(keep);
        __m512i where = at ? _mm512_maskz_loadu_epi32(in, at + j) : idx;
        _mm512_mask_storeu_epi32(dst + w, (__mmask16)((1u << got) - 1u),
                                 _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(where, base)));
        w += got;
    }
}
#endif

#if X86_TARGETS
/* order_key of 16 score bits. */
SEL_TARGET static inline __m512i order_keys16(__m512i v, int precision)
{
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    const __m512i sign = _mm512_set1_epi32(INT32_MIN);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(v, abs), inf);
    if (precision == 2) /* round to bfloat16, nearest even */
        v = _mm512_and_si512(
            _mm512_add_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(0x7FFF)),
                             _mm512_and_si512(_mm512_srli_epi32(v, 16), _mm512_set1_epi32(1))),
            _mm512_set1_epi32((int)0xFFFF0000u));
    v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(v, sign), _mm512_setzero_si512());
    v = _mm512_xor_si512(v, _mm512_or_si512(_mm512_srai_epi32(v, 31), sign));
    return _mm512_mask_mov_epi32(v, nan, _mm512_set1_epi32(0x007FFFFF));
}

/* order_key of n scores into keys, 16 at a time; their smallest and
 * largest into *lo, *hi. */
SEL_TARGET static void order_keys_avx512(const uint32_t *bits, int64_t n, int precision,
                                         uint32_t *keys, uint32_t *lo, uint32_t *hi)
{
    __m512i most = _mm512_setzero_si512(), least = _mm512_set1_epi32(-1);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 in = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        __m512i v = order_keys16(_mm512_maskz_loadu_epi32(in, bits + j), precision);
        _mm512_mask_storeu_epi32(keys + j, in, v);
        most = _mm512_mask_max_epu32(most, in, most, v);
        least = _mm512_mask_min_epu32(least, in, least, v);
    }
    *lo = (uint32_t)_mm512_reduce_min_epu32(least);
    *hi = (uint32_t)_mm512_reduce_max_epu32(most);
}

/* list_at_or_above on AVX-512. */
SEL_TARGET static int64_t list_at_or_above_avx512(const uint32_t *bits, int64_t n,
                                                  int precision, uint32_t bound, uint32_t *keys,
                                                  int32_t *at, uint32_t *hi)
{
    const __m512i base = _mm512_set1_epi32((int)bound), step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i most = _mm512_setzero_si512();
    int64_t l = 0;
    for (int64_t j = 0; j < n; j += 16, idx = _mm512_add_epi32(idx, step)) {
        __mmask16 in = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        __m512i v = order_keys16(_mm512_maskz_loadu_epi32(in, bits + j), precision);
        __mmask16 list = _mm512_mask_cmpge_epu32_mask(in, v, base);
        __mmask16 front = (__mmask16)((1u << __builtin_popcount(list)) - 1u);
        _mm512_mask_storeu_epi32(keys + l, front, _mm512_maskz_compress_epi32(list, v));
        _mm512_mask_storeu_epi32(at + l, front, _mm512_maskz_compress_epi32(list, idx));
        most = _mm512_mask_max_epu32(most, list, most, v);
        l += __builtin_popcount(list);
    }
    *hi = (uint32_t)_mm512_reduce_max_epu32(most);
    return l;
}
#endif

/* Rows of SAMPLED_MIN candidates or more are picked from a floor judged
 * from SAMPLE evenly spaced keys (pick). */
#define SAMPLE 128
#define SAMPLED_MIN 2048

static int64_t isqrt_up(int64_t x)
{
    int64_t r = 0;
    while (r * r < x)
        r++;
    return r;
}

/* Reorders s[0..n) so that s[r] is its r-th largest (0: the largest), with
 * none smaller before it and none larger after it (quickselect, the middle
 * element as pivot). */
static void nth_largest(uint32_t *s, int64_t n, int64_t r)
{
    int64_t a = 0, b = n - 1;
    while (a < b) {
        uint32_t p = s[a + (b - a) / 2];
        int64_t i = a, j = b;
        while (i <= j) {
            while (s[i] > p)
                i++;
            while (s[j] < p)
                j--;
            if (i <= j) {
                uint32_t x = s[i];
                s[i++] = s[j];
                s[j--] = x;
            }
        }
        if (r <= j)
            b = j;
        else if (r >= i)
            a = i;
        else
            return;
    }
}

#if X86_TARGETS
/* The rank-th largest (0: the largest) of the SAMPLE keys s, all in [lo,
 * hi]: the largest key with more than rank of s at or above it, by
 * bisection over [lo, hi], SAMPLE keys counted per step (no branch on the
 * keys, at most 32 steps). */
SEL_TARGET static uint32_t sample_rank_avx512(const uint32_t *s, int64_t rank, uint32_t lo,
                                              uint32_t hi)
{
    __m512i v[SAMPLE / 16];
    for (int g = 0; g < SAMPLE / 16; g++)
        v[g] = _mm512_loadu_si512(s + 16 * g);
    uint32_t a = lo, b = hi; /* more than rank keys at or above a; the answer in [a, b] */
    while (a < b) {
        uint32_t mid = a + (b - a) / 2 + 1;
        const __m512i m = _mm512_set1_epi32((int)mid);
        int64_t at_or_above = 0;
        for (int g = 0; g < SAMPLE / 16; g++)
            at_or_above += __builtin_popcount(_mm512_cmpge_epu32_mask(v[g], m));
        if (at_or_above > rank)
            a = mid;
        else
            b = mid - 1;
    }
    return a;
}
#endif

/* A key that most likely has at least take of the row's n keys at or above
 * it, and not many more, judged from the keys of SAMPLE evenly spaced scores:
 * with the sample's expected count above the take-th largest key r = take *
 * SAMPLE / n, the sample's key 2 sqrt(r) + 3 ranks below that. 0 (every key)
 * when that is past the sample or is the sample's least key. A floor too
 * high costs time, never the result (pick counts the keys above it). */
static uint32_t floor_key(const uint32_t *bits, int64_t n, int64_t take, int precision,
                          int vec)
{
    uint32_t s[SAMPLE], lo = UINT32_MAX, hi = 0;
    for (int64_t j = 0; j < SAMPLE; j++) {
        s[j] = order_key(bits[j * n / SAMPLE], precision);
        lo = s[j] < lo ? s[j] : lo;
        hi = s[j] > hi ? s[j] : hi;
    }
    int64_t r = (take * SAMPLE + n - 1) / n;
    int64_t rank = r + 2 * isqrt_up(r) + 3; /* 0 = the sample's largest */
    if (rank >= SAMPLE)
        return 0;
    uint32_t bound;
#if X86_TARGETS
    if (vec)
        bound = sample_rank_avx512(s, rank, lo, hi);
    else
#else
    (void)vec;
#endif
    {
        nth_largest(s, SAMPLE, rank);
        bound = s[rank];
    }
    return bound > lo ? bound : 0; /* at the least: most keys would be listed */
}

/* The keys (order_key) of the scores bits[0..n) at or above `bound` listed
 * in keys, in order, with their positions in at and their largest in *hi;
 * returns how many. One pass over the scores. */
static int64_t list_at_or_above(const uint32_t *bits, int64_t n, int precision, uint32_t bound,
                                uint32_t *keys, int32_t *at, uint32_t *hi, int vec)
{
#if X86_TARGETS
    if (vec)
        return list_at_or_above_avx512(bits, n, precision, bound, keys, at, hi);
#else
    (void)vec;
#endif
    int64_t l = 0;
    uint32_t most = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t v = order_key(bits[j], precision);
        bool in = v >= bound;
        keys[l] = v;
        at[l] = (int32_t)j;
        l += in;
        most = in && v > most ? v : most;
    }
    *hi = most;
    return l;
}

/* The `take` picks, ascending, into dst: of the n keys, those above t and
 * the first `ties` equal to it (INT64_MAX: all of them), each written as
 * first + its position, or first + at[its position] where at is given. */
static void emit(const uint32_t *keys, const int32_t *at, int64_t n, int64_t take, uint32_t t,
                 int64_t ties, int64_t first, int32_t *dst, int vec)
{
#if X86_TARGETS
    if (vec) {
        emit_avx512(keys, at, n, take, t, ties, first, dst);
        return;
    }
#else
    (void)vec;
#endif
    (void)n;
    int64_t w = 0;
    /* Exactly take keys qualify: the loop stops at the last (w == take). */
    for (int64_t j = 0; w < take; j++) {
        uint32_t v = keys[j];
        int64_t tie = (v == t) & (ties > 0);
        ties -= tie & (ties != INT64_MAX);
        dst[w] = (int32_t)(first + (at ? at[j] : j));
        w += (v > t) | tie;
    }
}

/* order_key of n scores into keys, with their range in *lo, *hi. */
static void order_keys(const uint32_t *bits, int64_t n, int precision, uint32_t *keys,
                       uint32_t *lo, uint32_t *hi, int vec)
{
#if X86_TARGETS
    if (vec) {
        order_keys_avx512(bits, n, precision, keys, lo, hi);
        return;
    }
#else
    (void)vec;
#endif
    *lo = UINT32_MAX;
    *hi = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t v = order_key(bits[j], precision);
        keys[j] = v;
        *lo = v < *lo ? v : *lo;
        *hi = v > *hi ? v : *hi;
    }
}

/* The picks of one row, ascending, into dst[0..take); 0 < take < n. keys
 * and buf: n entries each; at: n positions. In a row of SAMPLED_MIN keys or
 * more, only the keys at or above a floor (floor_key) are listed, in the
 * pass that turns the scores into keys, and only they go through the radix
 * select and are read again for the picks; a floor with fewer than take keys
 * at or above it costs the plain way besides. */
static void pick(const float *scores, int64_t n, int64_t take, int precision, int64_t first,
                 uint32_t *keys, uint32_t *buf, int32_t *at, int32_t *dst, int vec)
{
    const uint32_t *bits = (const uint32_t *)scores;
    uint32_t lo, hi, t;
    int64_t ties, equal;
    uint32_t bound = n >= SAMPLED_MIN ? floor_key(bits, n, take, precision, vec) : 0;
    if (bound > 0) {
        int64_t listed = list_at_or_above(bits, n, precision, bound, keys, at, &hi, vec);
        if (listed >= take) {
            t = kth_largest(keys, listed, take, bound, hi, buf, &ties, &equal, vec);
            emit(keys, at, listed, take, t, ties == equal ? INT64_MAX : ties, first, dst, vec);
            return;
        }
    }
    order_keys(bits, n, precision, keys, &lo, &hi, vec);
    t = kth_largest(keys, n, take, lo, hi, buf, &ties, &equal, vec);
    emit(keys, NULL, n, take, t, ties == equal ? INT64_MAX : ties, first, dst, vec);
}

#if X86_TARGETS
/* The first k entries of src to the 64-byte aligned dst, in whole lines of
 * streaming stores, -1 after them up to the end of the last line. */
SEL_TARGET static void stream_row(int32_t *dst, const int32_t *src, int64_t k)
{
    const __m512i none = _mm512_set1_epi32(-1);
    for (int64_t j = 0; j < k; j += 16) {
        __mmask16 in = k - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - j)) - 1u);
        _mm512_stream_si512((__m512i *)(dst + j), _mm512_mask_loadu_epi32(none, in, src + j));
    }
}
#endif

/* The output rows of one tile: row r = (n * c + i) * group + g for KV head
 * n, query block i of the tile and query g of the head's group (query head
 * n * group + g). Per query block i: s2 visible blocks, candidates
 * [sink_end, cand_end), take picks. Scores (float32) of query blocks
 * [ranked, c) only, rows of `width` columns, column 0 = key block lo.
 * Output row of (head h, query block i) at out + h * head_stride +
 * i * row_stride. Rows are shared by `threads` OpenMP threads
 * (the caller's runtime: torch's). Returns 0, or -1 when scratch memory is
 * unavailable. */
int stem_select_rows(int64_t nk, int64_t c, int64_t group, const int64_t *s2,
                     const int64_t *sink_end, const int64_t *cand_end, const int64_t *take,
                     const float *scores, int64_t ranked, int64_t lo, int64_t width,
                     int precision, int32_t *out, int64_t head_stride, int64_t row_stride,
                     int64_t kmax, int threads)
{
    int failed = 0;
    int64_t rows = nk * c * group;
    int vec = vector_passes();
    /* Rows of whole 64-byte lines are built aside and streamed out line by
     * line, the last line's tail as the -1 it holds already: the output was
     * filled by streaming stores, so ordinary stores would read each line
     * back in first. */
    bool stream = false;
#if X86_TARGETS
    stream = vec && kmax % 16 == 0 && row_stride % 16 == 0 && head_stride % 16 == 0 &&
             ((uintptr_t)out & 63) == 0;
#else
    (void)kmax;
#endif
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)(3 * width + 1));
        uint32_t *buf = keys + width;
        int32_t *at = (int32_t *)(buf + width);
        int32_t *aside = stream ? aligned_alloc(64, sizeof(int32_t) * (size_t)kmax) : NULL;
        failed = keys == NULL || (stream && aside == NULL);
#pragma omp for schedule(dynamic, 16)
        for (int64_t r = 0; r < rows; r++) {
            if (failed)
                continue;
            int64_t g = r % group, i = (r / group) % c, n = r / (group * c);
            int32_t *dst = out + (n * group + g) * head_stride + i * row_stride;
            int32_t *row = stream ? aside : dst;
            int64_t k = 0;
            int64_t n_cand = cand_end[i] - sink_end[i];
            if (take[i] >= n_cand) { /* every visible block */
                for (; k < s2[i]; k++)
                    row[k] = (int32_t)k;
            } else {
                for (; k < sink_end[i]; k++)
                    row[k] = (int32_t)k;
                if (take[i] > 0) {
                    const float *s =
                        scores + ((n * (c - ranked) + i - ranked) * group + g) * width;
                    pick(s + (sink_end[i] - lo), n_cand, take[i], precision, sink_end[i], keys,
                         buf, at, row + k, vec);
                    k += take[i];
                }
                for (int64_t j = cand_end[i]; j < s2[i]; k++, j++)
                    row[k] = (int32_t)j;
            }
#if X86_TARGETS
            if (stream)
                stream_row(dst, aside, k);
#endif
        }
#if X86_TARGETS
        if (stream)
            _mm_sfence(); /* the streamed rows are seen by every thread after the region */
#endif
        free(aside);
        free(keys);
    }
    return failed ? -1 : 0;
}

/* --------------------------------------------------------------------------
 * Large outputs filled with streaming stores: the op's index output is
 * hundreds of MiB at long lengths, and ordinary stores read every line in
 * before writing it (2-core AMX Xeon, 512 MiB: about 10 ms streamed on two
 * threads against 30 to 40 by torch's fill_).
 * -------------------------------------------------------------------------- */

#if X86_TARGETS
__attribute__((target("avx512f"))) static void stream_avx512(uint32_t *p, int64_t lines,
                                                             uint32_t value, int threads)
{
    const __m512i v = _mm512_set1_epi32((int)value);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < lines; i++)
        _mm512_stream_si512((__m512i *)(p + 16 * i), v);
    _mm_sfence();
}

__attribute__((target("avx2"))) static void stream_avx2(uint32_t *p, int64_t lines,
                                                        uint32_t value, int threads)
{
    const __m256i v = _mm256_set1_epi32((int)value);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < lines; i++) {
        _mm256_stream_si256((__m256i *)(p + 16 * i), v);
        _mm256_stream_si256((__m256i *)(p + 16 * i + 8), v);
    }
    _mm_sfence();
}
#endif

/* words 32-bit words from p set to value, the whole 64-byte lines inside
 * them with streaming stores (AVX-512 or AVX2; ordinary stores elsewhere),
 * shared by `threads` OpenMP threads. isa: -1 the best this CPU has, 0
 * ordinary stores, 1 AVX2, 2 AVX-512 (tests; one the CPU lacks stores
 * ordinarily). */
void stem_fill32(uint32_t *p, int64_t words, uint32_t value, int threads, int isa)
{
    int64_t head = (int64_t)((64 - ((uintptr_t)p & 63)) & 63) / 4;
    head = head < words ? head : words;
    int64_t lines = (words - head) / 16;
    for (int64_t i = 0; i < head; i++)
        p[i] = value;
    uint32_t *body = p + head;
    bool streamed = false;
#if X86_TARGETS
    __builtin_cpu_init();
    bool avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
    if (((uintptr_t)p & 3) == 0) { /* then body is 64-byte aligned */
        if (avx512 && (isa == -1 || isa == 2)) {
            stream_avx512(body, lines, value, threads);
            streamed = true;
        } else if (avx2 && (isa == -1 || isa == 1)) {
            stream_avx2(body, lines, value, threads);
            streamed = true;
        }
    }
#else
    (void)isa;
#endif
    if (!streamed) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < 16 * lines; i++)
            body[i] = value;
    }
    for (int64_t i = head + 16 * lines; i < words; i++)
        p[i] = value;
}

/* Elements widened by one thread at a time in stem_widen_bf16. */
#define WIDEN_PIECE (1 << 14)

/* dst[s * n + j] = src[s * ld + j], bfloat16 widened to float32 (exactly:
 * the bits moved up), for s < segs and j < n, shared by `threads` OpenMP
 * threads; dst is float32 seen as its bits. Returns the largest magnitude
 * read as the 15 low bits of a bfloat16 (0x7F80 inf, above it NaN): the
 * bound on the products of these keys found in the pass that converts
 * them. */
uint32_t stem_widen_bf16(const uint16_t *src, int64_t segs, int64_t n, int64_t ld,
                         uint32_t *dst, int threads)
{
    int64_t pieces = (n + WIDEN_PIECE - 1) / WIDEN_PIECE;
    int most = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : most)
    for (int64_t t = 0; t < segs * pieces; t++) {
        int64_t s = t / pieces, j0 = t % pieces * WIDEN_PIECE;
        int64_t j1 = j0 + WIDEN_PIECE < n ? j0 + WIDEN_PIECE : n;
        const uint16_t *in = src + s * ld;
        uint32_t *out = dst + s * n;
        int16_t m = 0; /* magnitudes as non-negative int16: their order is the values' */
        for (int64_t j = j0; j < j1; j++) {
            out[j] = (uint32_t)in[j] << 16;
            int16_t a = (int16_t)(in[j] & 0x7FFF);
            m = a > m ? a : m;
        }
        most = m > most ? m : most;
    }
    return (uint32_t)most;
}

/* --------------------------------------------------------------------------
 * bfloat16 products of the scores, on torch's at::native::cpublas::brgemm
 * (oneDNN's micro-kernel; on CPUs with bfloat16 dot products): products of
 * two bfloat16 values are exact in float32, and summed in float32.
 * -------------------------------------------------------------------------- */

typedef void (*brgemm_t)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                         const uint16_t *, const uint16_t *, float *, bool);
typedef void (*release_t)(bool);

/* One call's block: SCORE_ROWS rows (fewer at the end) by SCORE_COLS keys,
 * with leading dimension SCORE_COLS for B and for C (a tile in the thread's
 * cache): the calls then take at most SCORE_ROWS configurations per K, all
 * made by ops/native.py's probe first (an exception in one could not unwind
 * through C and OpenMP). */
#define SCORE_ROWS 32
#define SCORE_COLS 64

static inline uint32_t load32(const uint16_t *p)
{
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* The larger magnitude bits (sign cleared) of the two bfloat16 in w. */
static inline uint32_t pair_max(uint32_t w)
{
    uint32_t lo = w & 0x7FFFu, hi = (w >> 16) & 0x7FFFu;
    return lo > hi ? lo : hi;
}

/* The largest magnitude bits among `count` contiguous bf16 values. */
static uint32_t values_max(const uint16_t *a, int64_t count)
{
    uint32_t most = 0;
    for (int64_t x = 0; x < count; x++) {
        uint32_t v = a[x] & 0x7FFFu;
        most = v > most ? v : most;
    }
    return most;
}

/* Keys [0, valid) of `keys` (row stride `row`) into pk in VNNI pairs:
 * pk[w][j] = elements 2w, 2w + 1 of key j, zero for j >= valid. Returns
 * the largest magnitude bits among the elements read. */
static uint32_t pack_keys(const uint16_t *keys, int64_t row, int64_t k, int64_t valid,
                          uint32_t *pk)
{
    uint32_t most = 0;
    for (int64_t j = 0; j < SCORE_COLS; j++) /* key by key: one sequential stream at a time */
        for (int64_t w = 0; w < k / 2; w++) {
            uint32_t v = j < valid ? load32(keys + j * row + 2 * w) : 0;
            uint32_t m = pair_max(v);
            most = m > most ? m : most;
            pk[w * SCORE_COLS + j] = v;
        }
    return most;
}

/* The tasks of a score call: (key head h, SCORE_COLS keys from j0, units
 * [u0, u1) of (query head of the group, SCORE_ROWS rows)), with the units
 * split in parts when there are too few key tiles to share the threads. */
typedef struct {
    int64_t nt, mt, units, groups, per, tasks;
} score_split;

static score_split split_scores(int64_t heads, int64_t group, int64_t m, int64_t n, int threads)
{
    score_split s;
    s.nt = (n + SCORE_COLS - 1) / SCORE_COLS;
    s.mt = (m + SCORE_ROWS - 1) / SCORE_ROWS;
    s.units = group * s.mt;
    s.groups = 1;
    while (s.groups < s.units && heads * s.nt * s.groups < 2 * (int64_t)threads)
        s.groups++;
    s.per = (s.units + s.groups - 1) / s.groups;
    s.tasks = heads * s.nt * s.groups;
    return s;
}

/* Task t of s: its key head, first key, keys in the tile and units; false
 * when it has no unit. */
static bool score_task(const score_split *s, int64_t t, int64_t n, int64_t *h, int64_t *j0,
                       int64_t *valid, int64_t *u0, int64_t *u1)
{
    int64_t part = t % s->groups;
    *h = t / (s->nt * s->groups);
    *j0 = t / s->groups % s->nt * SCORE_COLS;
    *valid = n - *j0 < SCORE_COLS ? n - *j0 : SCORE_COLS;
    *u0 = part * s->per;
    *u1 = *u0 + s->per < s->units ? *u0 + s->per : s->units;
    return *u0 < *u1;
}

#if X86_TARGETS
/* A whole tile row of SCORE_COLS products scaled and biased (two roundings:
 * no fused multiply-add from intrinsics) and written to the 64-byte aligned
 * o with streaming stores: the scores are read back by the selection long
 * after, so reading their lines in before writing them would only double
 * the memory traffic. */
__attribute__((target("avx512f"))) static void store_row_streamed(const float *p, float scale,
                                                                 const float *bias, float *o)
{
    const __m512 f = _mm512_set1_ps(scale);
    for (int x = 0; x < SCORE_COLS; x += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(p + x), f);
        if (bias)
            v = _mm512_add_ps(v, _mm512_loadu_ps(bias + x));
        _mm512_stream_ps(o + x, v);
    }
}
#endif

/* SCORE_ROWS or fewer rows of a (row stride k) times the packed keys pk by
 * torch's micro-kernel into the thread's tile, then scaled, biased and
 * stored into out (row stride ldo), columns [0, valid); streamed where
 * `stream` and a row is whole and 64-byte aligned (the caller fences). */
static void brgemm_rows(brgemm_t brgemm, int64_t rows, int64_t k, const uint16_t *a,
                        const uint32_t *pk, float *tile, float scale, const float *bias,
                        int64_t valid, float *out, int64_t ldo, bool stream)
{
    brgemm(rows, SCORE_COLS, k, k, SCORE_COLS, SCORE_COLS, false, a, (const uint16_t *)pk, tile,
           true);
    for (int64_t r = 0; r < rows; r++) {
#if X86_TARGETS
        if (stream && valid == SCORE_COLS && ((uintptr_t)(out + r * ldo) & 63) == 0) {
            store_row_streamed(tile + r * SCORE_COLS, scale, bias, out + r * ldo);
            continue;
        }
#else
        (void)stream;
#endif
        const float *p = tile + r * SCORE_COLS;
        float *o = out + r * ldo;
        if (bias)
            for (int64_t x = 0; x < valid; x++) {
                float scaled = p[x] * scale;
                o[x] = scaled + bias[x];
            }
        else
            for (int64_t x = 0; x < valid; x++)
                o[x] = p[x] * scale;
    }
}

/* --------------------------------------------------------------------------
 * The same products on the CPU's own bfloat16 dot product instruction
 * (AVX512-BF16's vdpbf16ps: AMD Zen 4 and 5, Intel Cooper Lake), without
 * torch's micro-kernel: the keys are packed in VNNI pairs by 16 x 16
 * transposes in registers (the scalar packing above cost a third of the
 * products' time), and a register tile of DP_ROWS query rows by 64 keys
 * holds its sums over the whole k, then is scaled, biased and stored.
 * Compiled for that instruction set whatever the library's flags (a target
 * attribute); ops/native.py calls it only where /proc/cpuinfo lists
 * avx512_bf16. stem_scores_dp_built() says whether this compiler built it.
 * -------------------------------------------------------------------------- */

#if X86_TARGETS
#define DP_BUILT 1
#define DP_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define DP_ROWS 6 /* 6 x 4 accumulators, 4 key vectors, 1 broadcast: 29 of 32 registers */

/* pack_keys on 16 x 16 blocks of (key, pair) in registers (and the same
 * largest magnitude bits returned). */
DP_TARGET static uint32_t dp_pack_keys(const uint16_t *keys, int64_t row, int64_t k,
                                       int64_t valid, uint32_t *pk)
{
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
    __m512i most = _mm512_setzero_si512();
    int64_t pairs = k / 2;
    /* 16 keys at a time along the whole of k: 16 sequential streams from
     * memory, which the hardware prefetchers follow (64 streams, one per key
     * of the tile, took half as long again). */
    for (int64_t j0 = 0; j0 < SCORE_COLS; j0 += 16) {
        for (int64_t w0 = 0; w0 < pairs; w0 += 16) {
            int64_t left = pairs - w0 < 16 ? pairs - w0 : 16;
            __mmask16 in = (__mmask16)(left == 16 ? 0xFFFFu : (1u << left) - 1u);
            __m512i r[16], t[16], u[16];
            for (int j = 0; j < 16; j++)
                r[j] = j0 + j < valid
                           ? _mm512_maskz_loadu_epi32(in, keys + (j0 + j) * row + 2 * w0)
                           : _mm512_setzero_si512();
            for (int j = 0; j < 16; j++)
                most = _mm512_max_epu16(most, _mm512_and_si512(r[j], magnitude));
            for (int j = 0; j < 16; j += 2) {
                t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
                t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
            }
            for (int j = 0; j < 16; j += 4) { /* u[j + x]: column 4L + x of rows j..j+3 */
                u[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
                u[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
                u[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
                u[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
            }
            for (int x = 0; x < 4; x++) {
                __m512i v0 = _mm512_shuffle_i32x4(u[x], u[4 + x], 0x88);
                __m512i v1 = _mm512_shuffle_i32x4(u[x], u[4 + x], 0xDD);
                __m512i v2 = _mm512_shuffle_i32x4(u[8 + x], u[12 + x], 0x88);
                __m512i v3 = _mm512_shuffle_i32x4(u[8 + x], u[12 + x], 0xDD);
                __m512i col[4] = {_mm512_shuffle_i32x4(v0, v2, 0x88),  /* pair x */
                                  _mm512_shuffle_i32x4(v1, v3, 0x88),  /* pair 4 + x */
                                  _mm512_shuffle_i32x4(v0, v2, 0xDD),  /* pair 8 + x */
                                  _mm512_shuffle_i32x4(v1, v3, 0xDD)}; /* pair 12 + x */
                for (int q = 0; q < 4; q++)
                    if (4 * q + x < left)
                        _mm512_store_si512(pk + (w0 + 4 * q + x) * SCORE_COLS + j0, col[q]);
            }
        }
    }
    most = _mm512_max_epu32(_mm512_srli_epi32(most, 16),
                            _mm512_and_si512(most, _mm512_set1_epi32(0xFFFF)));
    return (uint32_t)_mm512_reduce_max_epu32(most);
}

/* values_max on AVX-512. */
DP_TARGET static uint32_t dp_values_max(const uint16_t *a, int64_t count)
{
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
    __m512i most = _mm512_setzero_si512();
    for (int64_t x = 0; x < count; x += 32) {
        __mmask32 in = count - x >= 32 ? (__mmask32)0xFFFFFFFFu
                                       : (__mmask32)((1u << (count - x)) - 1u);
        most = _mm512_max_epu16(most, _mm512_and_si512(_mm512_maskz_loadu_epi16(in, a + x),
                                                       magnitude));
    }
    most = _mm512_max_epu32(_mm512_srli_epi32(most, 16),
                            _mm512_and_si512(most, _mm512_set1_epi32(0xFFFF)));
    return (uint32_t)_mm512_reduce_max_epu32(most);
}

/* rows (1..DP_ROWS, a constant where inlined) rows of a (row stride lda
 * elements) times the packed keys pk (k/2 pairs of 64 keys), scaled, biased
 * and stored into out (row stride ldo), columns [0, valid); with streaming
 * stores where `stream` and a row is whole and 64-byte aligned (as
 * brgemm_rows; the caller fences). */
DP_TARGET static inline __attribute__((always_inline)) void
dp_tile(const int rows, int64_t pairs, const uint16_t *a, int64_t lda, const uint32_t *pk,
        float scale, const float *bias, int64_t valid, float *out, int64_t ldo, bool stream)
{
    __m512 acc[DP_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (int64_t w = 0; w < pairs; w++) {
        const uint32_t *b = pk + w * SCORE_COLS;
        __m512bh b0 = (__m512bh)_mm512_load_si512(b), b1 = (__m512bh)_mm512_load_si512(b + 16),
                 b2 = (__m512bh)_mm512_load_si512(b + 32),
                 b3 = (__m512bh)_mm512_load_si512(b + 48);
        for (int r = 0; r < rows; r++) {
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)load32(a + r * lda + 2 * w));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, b2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, b3);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int c = 0; c < 4; c++) {
        int64_t left = valid - 16 * c;
        if (left <= 0)
            break;
        __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 v = _mm512_mul_ps(acc[r][c], s); /* rounded, */
            if (bias)
                v = _mm512_add_ps(v, add); /* then rounded again */
            float *o = out + r * ldo + 16 * c;
            if (stream && valid == SCORE_COLS && ((uintptr_t)(out + r * ldo) & 63) == 0)
                _mm512_stream_ps(o, v);
            else
                _mm512_mask_storeu_ps(o, keep, v);
        }
    }
}

#define DP_TILE(R)                                                                           \
    dp_tile(R, pairs, a + r * lda, lda, pk, scale, bias, valid, out + r * ldo, ldo, stream)

DP_TARGET static void dp_rows(int64_t rows, int64_t pairs, const uint16_t *a, int64_t lda,
                              const uint32_t *pk, float scale, const float *bias, int64_t valid,
                              float *out, int64_t ldo, bool stream)
{
    int64_t r = 0;
    for (; r + DP_ROWS <= rows; r += DP_ROWS)
        DP_TILE(DP_ROWS);
    switch (rows - r) {
    case 5: DP_TILE(5); break;
    case 4: DP_TILE(4); break;
    case 3: DP_TILE(3); break;
    case 2: DP_TILE(2); break;
    case 1: DP_TILE(1); break;
    default: break;
    }
}
#undef DP_TILE
#else
#define DP_BUILT 0
#endif

int stem_scores_dp_built(void) { return DP_BUILT; }

/* Whether the keys are packed (and the query rows' magnitudes found) on
 * AVX-512 for torch's micro-kernel too: with the selection's vector passes
 * (stem_select_vector forces both ways), on a CPU with AVX-512BW. The same
 * packed words either way; on an AMX Xeon the scalar packing took longer
 * than the tile products it fed. */
static bool vector_packing(void)
{
#if DP_BUILT
    return vector_passes() && __builtin_cpu_supports("avx512bw");
#else
    return false;
#endif
}

/* The keys packed (on AVX-512 where vec), the largest magnitude of query
 * rows, the products: on vdpbf16ps (dp) or by torch's micro-kernel. */
static uint32_t pack_tile(bool vec, const uint16_t *keys, int64_t row, int64_t k, int64_t valid,
                          uint32_t *pk)
{
    (void)vec;
#if DP_BUILT
    if (vec)
        return dp_pack_keys(keys, row, k, valid, pk);
#endif
    return pack_keys(keys, row, k, valid, pk);
}

static uint32_t rows_max(bool vec, const uint16_t *a, int64_t count)
{
    (void)vec;
#if DP_BUILT
    if (vec)
        return dp_values_max(a, count);
#endif
    return values_max(a, count);
}

/* The products of stem_scores_bf16 (its arguments and results), by torch's
 * micro-kernel brgemm (then release) or, with brgemm NULL, on vdpbf16ps.
 * Each task packs SCORE_COLS keys of one head, then multiplies them with
 * SCORE_ROWS rows at a time of every query head of the group. */
static int scores(brgemm_t brgemm, release_t release, int64_t heads, int64_t group, int64_t m,
                  int64_t n, int64_t k, const uint16_t *a, int64_t a_head, int64_t a_sub,
                  const uint16_t *keys, int64_t key_head, int64_t key_row, float *out,
                  int64_t out_head, int64_t out_row, int64_t out_sub, float scale,
                  const float *bias, int64_t bias_head, int threads, bool stream,
                  bool scan, uint32_t *magnitudes)
{
    if (heads < 0 || group < 1 || m < 0 || n < 0 || k < 2 || k % 2 || key_row < k)
        return -1;
    bool dp = brgemm == NULL;
    bool vec = dp || vector_packing();
#if X86_TARGETS
    stream = stream && __builtin_cpu_supports("avx512f");
#else
    stream = false;
#endif
    score_split split = split_scores(heads, group, m, n, threads);
    int64_t mt = split.mt;
    /* the packed keys (whole 16-pair blocks, 64-byte aligned), then the tile */
    size_t packed = sizeof(uint32_t) * (size_t)((k / 2 + 15) / 16 * 16) * SCORE_COLS;
    size_t bytes = packed + sizeof(float) * SCORE_ROWS * SCORE_COLS;
    int failed = 0;
    uint32_t most = 0, most_a = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed) reduction(max : most, most_a)
    {
        uint32_t *pk = aligned_alloc(64, (bytes + 63) / 64 * 64);
        float *tile = (float *)((char *)pk + packed);
        failed = pk == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < split.tasks; t++) {
            int64_t h, j0, valid, u0, u1;
            if (failed || !score_task(&split, t, n, &h, &j0, &valid, &u0, &u1))
                continue;
            uint32_t seen = pack_tile(vec, keys + h * key_head + j0 * key_row, key_row, k, valid,
                                      pk);
            most = seen > most ? seen : most;
            const float *b = bias ? bias + h * bias_head + j0 : NULL;
            for (int64_t u = u0; u < u1; u++) {
                int64_t g = u / mt, i0 = u % mt * SCORE_ROWS;
                int64_t rows = m - i0 < SCORE_ROWS ? m - i0 : SCORE_ROWS;
                const uint16_t *ai = a + h * a_head + g * a_sub + i0 * k;
                float *o = out + h * out_head + i0 * out_row + g * out_sub + j0;
                if (j0 == 0 && scan) {
                    uint32_t a_seen = rows_max(vec, ai, rows * k);
                    most_a = a_seen > most_a ? a_seen : most_a;
                }
#if DP_BUILT
                if (dp) {
                    dp_rows(rows, k / 2, ai, k, pk, scale, b, valid, o, out_row, stream);
                    continue;
                }
#endif
                brgemm_rows(brgemm, rows, k, ai, pk, tile, scale, b, valid, o, out_row, stream);
            }
        }
#if X86_TARGETS
        if (stream)
            _mm_sfence(); /* the streamed scores are seen by every thread after the region */
#endif
        free(pk);
        if (release)
            release(true);
    }
    magnitudes[0] = most;
    magnitudes[1] = most_a;
    return failed ? -2 : 0;
}

/* For each of `heads` key heads h, each of its `group` query heads g, each
 * row i < m and each key j < n:
 *     out[h][i][g][j] = (a[h][g][i] . keys[h][j]) * scale + bias[h][j]
 * in float32, rounded after the product and again after the sum (the
 * contract's two roundings; built with -ffp-contract=off, so never one fused
 * multiply-add), without the bias where `bias` is NULL. Rows of a are k
 * bf16 long and contiguous (query head (h, g) at a + h * a_head + g *
 * a_sub); keys[h] holds n keys of k bf16 (row stride key_row), k even; out
 * row (h, i, g) at out + h * out_head + i * out_row + g * out_sub, only
 * columns [0, n) written. Each task packs SCORE_COLS keys of one head in VNNI
 * pairs (in cache) and multiplies them with a group of rows of every query
 * head of the group, tile by tile into the thread's SCORE_ROWS x SCORE_COLS
 * product, which is scaled, biased and stored while in cache.
 * magnitudes[0] gets the largest magnitude among the keys' elements read,
 * magnitudes[1] among the query rows' (read once more, from cache, by the
 * tasks of the first key tile; 0 without `scan`, for rows whose magnitude
 * the caller already has), each as the bits of a bfloat16 with its sign
 * cleared (0x7F80 and above: inf or NaN): whether some product may overflow
 * float32 is then known without another pass over the inputs (ops/cpu.py).
 * stream: rows of a tile that are whole and 64-byte aligned are written
 * with streaming stores (AVX-512), for outputs read back long after, by
 * which time ordinary stores' lines would have left the caches anyway.
 * fns: {brgemm, brgemm_release}. Returns 0, -1 for arguments the probe did
 * not cover, -2 without memory. */
int stem_scores_bf16(void *const *fns, int64_t heads, int64_t group, int64_t m, int64_t n,
                     int64_t k, const uint16_t *a, int64_t a_head, int64_t a_sub,
                     const uint16_t *keys, int64_t key_head, int64_t key_row, float *out,
                     int64_t out_head, int64_t out_row, int64_t out_sub, float scale,
                     const float *bias, int64_t bias_head, int threads, int stream,
                     int scan, uint32_t *magnitudes)
{
    brgemm_t brgemm = (brgemm_t)fns[0];
    release_t release = (release_t)fns[1];
    if (!brgemm || !release)
        return -1;
    return scores(brgemm, release, heads, group, m, n, k, a, a_head, a_sub, keys, key_head,
                  key_row, out, out_head, out_row, out_sub, scale, bias, bias_head, threads,
                  stream != 0, scan != 0, magnitudes);
}

/* stem_scores_bf16's products (arguments, results, magnitudes and return
 * codes as there, without fns) on vdpbf16ps; -1 where this compiler did not build it. */
int stem_scores_dp(int64_t heads, int64_t group, int64_t m, int64_t n, int64_t k,
                   const uint16_t *a, int64_t a_head, int64_t a_sub, const uint16_t *keys,
                   int64_t key_head, int64_t key_row, float *out, int64_t out_head,
                   int64_t out_row, int64_t out_sub, float scale, const float *bias,
                   int64_t bias_head, int threads, int stream, int scan,
                   uint32_t *magnitudes)
{
    if (!DP_BUILT)
        return -1;
    return scores(NULL, NULL, heads, group, m, n, k, a, a_head, a_sub, keys, key_head, key_row,
                  out, out_head, out_row, out_sub, scale, bias, bias_head, threads, stream != 0,
                  scan != 0, magnitudes);
}
