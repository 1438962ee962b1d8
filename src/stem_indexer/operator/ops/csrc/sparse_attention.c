/* Block-sparse softmax attention on the CPU (ops/sparse_attention.py).
 *
 * One work item is one row (b, h, i): the block_size query tokens of query
 * block i of head h attend to the key blocks listed for the row, with the
 * token-level mask (keys j < kv_len; with causal, j <= t + kv_len - q_len).
 * The listed blocks (ascending) are consumed in steps of up to STEP_KEYS
 * keys; adjacent blocks form one piece, multiplied in one GEMM:
 *
 *   S = Q K_piece^T                    one GEMM per piece, into a score tile
 *   online softmax per query row       scale folded in, base 2, running max
 *                                      and sum in float32
 *   O = O * correction + P V_piece     one GEMM per piece
 *
 * Because the blocks ascend and a query's last visible key is a single bound,
 * the keys a query sees in a step are a prefix of the step's columns: each
 * query row exponentiates that prefix and zeros the rest of its row of P.
 * Keys at or past kv_len and query rows at or past q_len are never read into
 * a product with a valid output (cut from the GEMMs, or packed as zeros), so
 * NaN or inf in padding cannot reach a valid output. Nor can a valid key a
 * query does not see (past its causal bound in the step): where such a key's
 * V row holds NaN or inf, which a GEMM would multiply by the weight 0, the
 * step's P V runs query by query over each query's own prefix (pv_exact).
 *
 * NaN and inf in what a query sees act as in dense softmax attention over
 * its visible keys, on every instruction set: a NaN or +inf score, or scores
 * all -inf, make the query's whole output NaN (-inf scores weigh 0
 * otherwise); NaN and inf in V reach the dimensions they are in (inf * 0 is
 * NaN there, as in a dense P V). Queries that see no key output 0.
 *
 * Three ways to multiply, chosen by the caller (GEMMs come from torch's
 * libtorch_cpu.so and are passed in as function pointers):
 *
 *   MODE_SGEMM  float32: MKL sgemm_ on Q, K, V where they lie.
 *   MODE_WIDEN  bfloat16 where torch's micro-kernel does not run (no
 *               bfloat16 dot products: AVX2) or is not the faster: each
 *               row's Q and each step's K/V pieces widened to float32 in
 *               thread scratch, then sgemm_.
 *   MODE_PACK32 bfloat16 as MODE_WIDEN, but K and V widened once per
 *               (batch, KV head) into shared float32 buffers (token-major),
 *               which the rows then read as MODE_SGEMM does: less widening
 *               where the rows of a KV head read its keys many times over,
 *               and the way a paged cache is read without the micro-kernel
 *               (any strided view of the pages).
 *   MODE_BRGEMM bfloat16 on a CPU with bfloat16 dot products (AMX, or
 *               AVX512-BF16): per (batch, KV head), K^T and V are packed
 *               once into VNNI layout (pairs of rows interleaved) in shared
 *               buffers, keys past kv_len as zeros; rows then call torch's
 *               at::native::cpublas::brgemm (oneDNN's micro-kernel, the one
 *               torch's own flash attention uses: AMX tiles, or vdpbf16ps)
 *               on whole blocks, and P is rounded to bfloat16 as torch's
 *               flash kernel does. The keys and values may also be packed
 *               straight from the pages of a paged cache whose halves lie
 *               in runs of words or of 16-bit elements (struct paged;
 *               vLLM's `amx` and `vec` layouts): stem_sparse_attention_paged.
 *
 * The rows already share the cores, so MKL must run serially in each thread:
 * inside an active libgomp region it does by itself (MKL_Get_Max_Threads()
 * is 1 there), and MKL_Set_Num_Threads_Local(1) makes that explicit for
 * nested-parallel settings. Rows are handed out longest list
 * first (dynamic schedule). Built with -fopenmp where the compiler has it
 * (ops/native.py), serial otherwise.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
#if defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10 /* AVX512-BF16 intrinsics */
#define HAVE_BF16_ISA 1
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx512bf16")))
#endif
#define AVX2 __attribute__((target("avx2,fma")))
#endif

enum { F32 = 0, BF16 = 1 };                   /* dtype of q, k, v, out */
enum { MODE_SGEMM, MODE_WIDEN, MODE_BRGEMM, MODE_PACK32 };
enum { ISA_AUTO = -1, ISA_SCALAR, ISA_AVX2, ISA_AVX512, ISA_AVX512BF16 };
enum { ERR_MEMORY = 1, ERR_ARGS = 2 };

#define STEP_KEYS 512 /* keys per online-softmax step (rounded to whole blocks) */
/* A query's running max stays while a step's scores exceed it by at most this
 * (base 2): its weights are then at most 2^LAZY_MAX, far inside float32 and
 * bfloat16 range, and the step skips its pass for the max (softmax_step). */
#define LAZY_MAX 8.0f
#define ALIGN 64

/* Fortran sgemm_; at::native::cpublas::brgemm (bfloat16, B in VNNI) and
 * brgemm_release; MKL_Set_Num_Threads_Local. */
typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *,
                        const float *, const float *, const int *, const float *, const int *,
                        const float *, float *, const int *);
typedef void (*brgemm_t)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                         const uint16_t *, const uint16_t *, float *, bool);
typedef void (*release_t)(bool);
typedef int (*threads_t)(int);

/* --------------------------------------------------------------------------
 * Row operations of the online softmax, per instruction set. The scores s are
 * raw products q.k; a is the scale in base-2 units.
 *
 * max(s, c, a):              the largest of s[j] * a over j < c.
 * exp_f32(s, c, n, a, m):    s[j] = 2^(s[j] * a - m) for j < c, 0 for c <= j < n
 *                            (up to n rounded to 16 may be written); the sum.
 * exp_bf16(s, c, n, a, m, p): the same into p as bfloat16 (nearest even), up
 *                            to n rounded to 32; the sum of the float32 values
 *                            (as torch's flash kernel). The exponential is a
 *                            degree-4 polynomial there (relative error 3e-6,
 *                            a thousandth of bfloat16's rounding step).
 * exp_bf16_top(.., p, top):  exp_bf16 in one pass, for a query whose running
 *                            max m is finite: *top = the largest s[j] * a - m
 *                            (AVX-512 only; the others leave it NULL).
 * Exponents at or below -126 give 0 (a weight under 2^-126 of the largest).
 * NaN propagates on every instruction set: max is NaN if any s[j] * a is,
 * and a NaN exponent gives a NaN weight (+inf - +inf is one).
 * -------------------------------------------------------------------------- */

struct rowops {
    float (*max)(const float *s, int c, float a);
    float (*exp_f32)(float *s, int c, int n, float a, float m);
    float (*exp_bf16)(const float *s, int c, int n, float a, float m, uint16_t *p);
    /* exp_bf16 with *top, the largest s[j] * a - m (NULL: not offered) */
    float (*exp_bf16_top)(const float *s, int c, int n, float a, float m, uint16_t *p,
                          float *top);
};

/* Nearest even; NaN stays NaN (truncated, quiet: adding to a NaN's payload
 * could carry into the sign or turn it into inf). */
static inline uint16_t bf16_round(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((b >> 16) | 0x40u);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

static inline float bf16_float(uint16_t h)
{
    uint32_t b = (uint32_t)h << 16;
    float x;
    memcpy(&x, &b, 4);
    return x;
}

static inline float exp2_clip(float x)
{
    return x <= -126.0f ? 0.0f : exp2f(x); /* NaN stays NaN */
}

static float max_scalar(const float *s, int c, float a)
{
    float m = -INFINITY;
    int nan = 0;
    for (int j = 0; j < c; j++) {
        float x = s[j] * a;
        nan |= x != x;
        m = x > m ? x : m;
    }
    return nan ? NAN : m;
}

static float exp_f32_scalar(float *s, int c, int n, float a, float m)
{
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        s[j] = j < c ? exp2_clip(s[j] * a - m) : 0.0f;
        sum += s[j];
    }
    return sum;
}

static float exp_bf16_scalar(const float *s, int c, int n, float a, float m, uint16_t *p)
{
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        float e = j < c ? exp2_clip(s[j] * a - m) : 0.0f;
        p[j] = bf16_round(e);
        sum += e;
    }
    return sum;
}

#ifdef HAVE_X86
/* 2^f for f in [0, 1), highest power first: least-squares fits of the
 * relative error, degree 6 (below 1e-8 before float32 rounding) or degree 4
 * (`low`, 2.7e-6). Both vector widths evaluate it with one fused
 * multiply-add per degree. */
static const float EXP2_POLY[2][7] = {
    {2.17022534e-4f, 1.24396884e-3f, 9.67884064e-3f, 5.54833412e-2f, 2.40229830e-1f,
     6.93147004e-1f, 1.0f},
    {1.35341650e-2f, 5.20114638e-2f, 2.41442755e-1f, 6.93003833e-1f, 1.00000262f}};
#define EXP2_DEGREE(low) ((low) ? 4 : 6)

/* 2^x in the lanes of `live`, 0 in the others: 2^floor(x) (vscalefps takes
 * the floor of its exponent) times EXP2_POLY on x - floor(x) (vreduceps,
 * one instruction). Lanes with x <= -126 give 0, NaN lanes NaN. */
AVX512 static inline __m512 exp2_512(__m512 x, int low, __mmask16 live)
{
    __mmask16 ok = _mm512_mask_cmp_ps_mask(live, x, _mm512_set1_ps(-126.0f), _CMP_NLE_UQ);
    __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(EXP2_POLY[low][0]);
    for (int d = 1; d <= EXP2_DEGREE(low); d++)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[low][d]));
    return _mm512_maskz_scalef_ps(ok, p, x);
}

/* Lanes j .. j+15 that lie below c. */
static inline __mmask16 head_mask(int j, int c)
{
    int left = c - j;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* 2^(s[j..j+15] * a - m), zero in lanes at or past c. */
AVX512 static inline __m512 exp_lanes_512(const float *s, int j, int c, __m512 a, __m512 m,
                                          int low)
{
    __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), a, m);
    return exp2_512(x, low, head_mask(j, c));
}

/* Four accumulators: one chain of vmaxps would wait on its 4-cycle latency.
 * vmaxps returns its second operand when either is NaN, so NaN lanes are
 * collected apart (the max is NaN if any). */
AVX512 static float max_512(const float *s, int c, float a)
{
    __m512 av = _mm512_set1_ps(a), acc[4];
    __mmask16 nan = 0;
    for (int l = 0; l < 4; l++)
        acc[l] = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 64 <= c; j += 64)
        for (int l = 0; l < 4; l++) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j + 16 * l), av);
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            acc[l] = _mm512_max_ps(acc[l], x);
        }
    for (; j < c; j += 16) {
        __mmask16 live = head_mask(j, c);
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), av);
        nan |= _mm512_mask_cmp_ps_mask(live, x, x, _CMP_UNORD_Q);
        acc[0] = _mm512_mask_max_ps(acc[0], live, acc[0], x);
    }
    if (nan)
        return NAN;
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(acc[0], acc[1]),
                                              _mm512_max_ps(acc[2], acc[3])));
}

/* The body of exp_f32 and exp_bf16 for one vector width, given as VEC: its
 * type, lanes, zero, broadcast, sum, horizontal sum and exp_lanes. Lanes j..
 * of the exponentials, e, are kept by KEEP (a statement): in s, or rounded
 * into p; LOW: the degree-4 polynomial. */
#define EXP_ROW(VEC, LOW, KEEP) EXP_ROW_(VEC, LOW, KEEP)
#define EXP_ROW_(T, LANES, ZERO, SET1, ADD, HSUM, EXP_LANES, LOW, KEEP)                      \
    T acc = ZERO(), av = SET1(a), mv = SET1(m);                                               \
    for (int j = 0; j < n; j += LANES) {                                                      \
        T e = EXP_LANES(s, j, c, av, mv, LOW);                                                \
        KEEP;                                                                                 \
        acc = ADD(acc, e);                                                                    \
    }                                                                                         \
    return HSUM(acc)
#define VEC_512 __m512, 16, _mm512_setzero_ps, _mm512_set1_ps, _mm512_add_ps,                \
                _mm512_reduce_add_ps, exp_lanes_512

/* e (>= 0, finite or NaN) as bfloat16, nearest even (NaN quiet, as bf16_round). */
AVX512 static inline __m256i bf16_512(__m512 e)
{
    __m512i b = _mm512_castps_si512(e), high = _mm512_srli_epi32(b, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(
        _mm512_set1_epi32(0x7FFF), _mm512_and_si512(high, _mm512_set1_epi32(1)))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q),
                              _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

AVX512 static float exp_f32_512(float *s, int c, int n, float a, float m)
{
    EXP_ROW(VEC_512, 0, _mm512_storeu_ps(s + j, e));
}

/* exp_bf16 for a query whose running max m is finite, one pass: *top is set
 * to the largest s[j] * a - m over j < c (a NaN there may be missed: the sum
 * is NaN then). */
AVX512 static float exp_bf16_top_512(const float *s, int c, int n, float a, float m,
                                     uint16_t *p, float *top)
{
    __m512 acc = _mm512_setzero_ps(), av = _mm512_set1_ps(a), mv = _mm512_set1_ps(m);
    __m512 hi = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16) {
        __mmask16 live = head_mask(j, c);
        __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), av, mv);
        hi = _mm512_mask_max_ps(hi, live, hi, x);
        __m512 e = exp2_512(x, 1, live);
        _mm256_storeu_si256((__m256i *)(p + j), bf16_512(e));
        acc = _mm512_add_ps(acc, e);
    }
    *top = _mm512_reduce_max_ps(hi);
    return _mm512_reduce_add_ps(acc);
}

/* exp_bf16 on AVX-512: the same pass, its largest exponent unused. */
AVX512 static float exp_bf16_512(const float *s, int c, int n, float a, float m, uint16_t *p)
{
    float top;
    return exp_bf16_top_512(s, c, n, a, m, p, &top);
}

#ifdef HAVE_BF16_ISA
/* With AVX512-BF16: one instruction rounds 32 values (nearest even). */
AVX512BF16 static float exp_bf16_top_512bf(const float *s, int c, int n, float a, float m,
                                           uint16_t *p, float *top)
{
    __m512 acc = _mm512_setzero_ps(), av = _mm512_set1_ps(a), mv = _mm512_set1_ps(m);
    __m512 hi = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 32) {
        __mmask16 live0 = head_mask(j, c), live1 = head_mask(j + 16, c);
        __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), av, mv);
        __m512 x1 = _mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), av, mv);
        hi = _mm512_mask_max_ps(_mm512_mask_max_ps(hi, live0, hi, x0), live1, hi, x1);
        __m512 e0 = exp2_512(x0, 1, live0), e1 = exp2_512(x1, 1, live1);
        _mm512_storeu_si512((void *)(p + j), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        acc = _mm512_add_ps(acc, _mm512_add_ps(e0, e1));
    }
    *top = _mm512_reduce_max_ps(hi);
    return _mm512_reduce_add_ps(acc);
}

AVX512BF16 static float exp_bf16_512bf(const float *s, int c, int n, float a, float m,
                                       uint16_t *p)
{
    float top;
    return exp_bf16_top_512bf(s, c, n, a, m, p, &top);
}
#endif

AVX2 static inline __m256 exp2_256(__m256 x0, int low)
{
    __m256 ok = _mm256_cmp_ps(x0, _mm256_set1_ps(-126.0f), _CMP_GT_OQ);
    __m256 x = _mm256_max_ps(x0, _mm256_set1_ps(-126.0f)); /* also NaN -> -126 */
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n), p = _mm256_set1_ps(EXP2_POLY[low][0]);
    for (int d = 1; d <= EXP2_DEGREE(low); d++)
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[low][d]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    __m256 r = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), ok);
    return _mm256_blendv_ps(r, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q)); /* NaN lanes NaN */
}

/* 2^(s[j..j+7] * a - m), zero in lanes at or past c. */
AVX2 static inline __m256 exp_lanes_256(const float *s, int j, int c, __m256 a, __m256 m, int low)
{
    __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 below = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), lane));
    return _mm256_and_ps(exp2_256(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), a, m), low), below);
}

AVX2 static float hsum_256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

AVX2 static float max_256(const float *s, int c, float a)
{
    __m256 acc = _mm256_set1_ps(-INFINITY), av = _mm256_set1_ps(a), nan = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= c; j += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), av);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        acc = _mm256_max_ps(acc, x);
    }
    float m = max_scalar(s + j, c - j, a), lanes[8]; /* NaN if the tail has one */
    if (_mm256_movemask_ps(nan))
        return NAN;
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++)
        m = lanes[l] > m ? lanes[l] : m;
    return m;
}

#define VEC_256 __m256, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_add_ps, hsum_256,      \
                exp_lanes_256

/* bf16_512 on 8 lanes. */
AVX2 static inline __m128i bf16_256(__m256 e)
{
    __m256i b = _mm256_castps_si256(e), high = _mm256_srli_epi32(b, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(
        _mm256_set1_epi32(0x7FFF), _mm256_and_si256(high, _mm256_set1_epi32(1)))), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(e, e, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

AVX2 static float exp_f32_256(float *s, int c, int n, float a, float m)
{
    EXP_ROW(VEC_256, 0, _mm256_storeu_ps(s + j, e));
}

AVX2 static float exp_bf16_256(const float *s, int c, int n, float a, float m, uint16_t *p)
{
    EXP_ROW(VEC_256, 1, _mm_storeu_si128((__m128i *)(p + j), bf16_256(e)));
}
#endif

/* The row operations for `isa` (ISA_AUTO: the best this CPU runs); -1 if
 * the requested set does not run here. */
static int pick_rowops(int isa, struct rowops *ops)
{
    int best = ISA_SCALAR;
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        best = ISA_AVX2;
    if (best == ISA_AVX2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl"))
        best = ISA_AVX512;
#ifdef HAVE_BF16_ISA
    if (best == ISA_AVX512 && __builtin_cpu_supports("avx512bf16"))
        best = ISA_AVX512BF16;
#endif
#endif
    if (isa == ISA_AUTO)
        isa = best;
    if (isa < ISA_SCALAR || isa > best)
        return -1;
    *ops = (struct rowops){max_scalar, exp_f32_scalar, exp_bf16_scalar, NULL};
#ifdef HAVE_X86
    if (isa == ISA_AVX2)
        *ops = (struct rowops){max_256, exp_f32_256, exp_bf16_256, NULL};
    if (isa == ISA_AVX512)
        *ops = (struct rowops){max_512, exp_f32_512, exp_bf16_512, exp_bf16_top_512};
#endif
#ifdef HAVE_BF16_ISA
    if (isa == ISA_AVX512BF16)
        *ops = (struct rowops){max_512, exp_f32_512, exp_bf16_512bf, exp_bf16_top_512bf};
#endif
    return 0;
}

/* --------------------------------------------------------------------------
 * The problem, per-thread scratch, one step's pieces.
 * -------------------------------------------------------------------------- */

/* Where the keys (or the values) lie in one (page, KV head) block of a paged
 * cache: element (t, d), t the token's offset in its page, at
 *   off + (t / a) * s0 + (t % a) * s1 + (d / b) * s2 + (d % b) * s3. */
struct kv_view {
    int64_t off, a, s0, s1, b, s2, s3;
};

/* K and V packed straight from a paged cache of bfloat16 blocks, (page p,
 * KV head h) at cache + p * page_stride + h * head_stride. MODE_PACK32
 * widens any strided view element by element (pack_paged32). MODE_BRGEMM
 * packs each half in one of two ways (pack_kinds), or the views are
 * refused:
 *   PACK_WORDS   the half already holds the micro-kernel's 32-bit words in
 *                runs: keys, 16 tokens' words of a pair of dimensions;
 *                values, b dimensions' words of a pair of tokens (vLLM's
 *                `amx` layout): line copies.
 *   PACK_HALVES  the half holds runs of 16-bit elements along the axis the
 *                words run on: keys, 16 tokens of one dimension; values,
 *                dimensions of one token (vLLM's `vec` layout: keys
 *                transposed, values row-major): two runs interleaved. */
enum { PACK_NONE, PACK_WORDS, PACK_HALVES };

struct paged {
    const uint16_t *cache;
    const int64_t *table; /* [B, table_w]: the page of tokens [n * page, (n + 1) * page) */
    int64_t table_w, page, page_stride, head_stride;
    struct kv_view k, v;
    int kind_k, kind_v; /* PACK_WORDS or PACK_HALVES */
    int64_t run_v;      /* PACK_HALVES values: dimensions per contiguous run */
    int64_t *dk, *dv;   /* MODE_PACK32: dimension d's offset in a token's keys, values */
};

struct job {
    const void *q, *k, *v;
    void *out;
    float *lse; /* [B, Hq, Sq] natural log-sum-exp of the attended scores, or NULL */
    int64_t batch, hq, hkv, sq, skv, dim, bs, qmax, width;
    const int64_t *idx, *lengths, *q_lens, *kv_lens;
    int causal, dtype, mode;
    float alpha;               /* scale * log2(e): scores in base-2 units */
    float cap_in, cap_out;     /* soft-capping: s -> cap_out * tanh(s * cap_in); 0: none */
    int step_blocks, step_keys; /* per step; the K chunk of MODE_BRGEMM */
    int ld_s, ld_p;            /* row strides of the score and bf16 P tiles */
    sgemm_t sgemm;
    brgemm_t brgemm;
    struct rowops ops;
    uint16_t *kp, *vp; /* MODE_BRGEMM: the current KV head packed (see pack_chunk) */
    float *kf, *vf;    /* MODE_PACK32: the current KV head in float32 [keys, D] */
    const struct paged *paged; /* K and V read from a paged cache (k, v NULL); or NULL */
};

struct piece {
    int64_t key; /* first key (token index in the sequence) */
    int n, col;  /* keys, first column in the step */
};

struct scratch {
    float *s, *o, *m, *l, *q32, *k32, *v32;
    uint16_t *p;
    unsigned char *seen; /* per query: saw a key (its output is softmax, not 0) */
    struct piece *pieces;
};

/* Where one row's computation stands. */
struct row {
    const void *q;          /* its first query token (float32 scratch when widening) */
    const char *k, *v;      /* its KV head's first key */
    int nq;                 /* valid query tokens */
    int64_t b;              /* its batch */
    int64_t lim0;           /* with causal: keys < lim0 + t are visible to query t */
    int np, ncols, nblocks; /* the current step */
};

static size_t esize(const struct job *jb)
{
    return jb->dtype == F32 ? 4 : 2;
}

/* The rows read K and V as float32 (where they lie, or widened once). */
static int kv_f32(const struct job *jb)
{
    return jb->dtype == F32 || jb->mode == MODE_PACK32;
}

/* Bytes per element of the K and V the rows read (rw->k, rw->v). */
static size_t kv_esize(const struct job *jb)
{
    return kv_f32(jb) ? 4 : 2;
}

/* K and V are packed per (batch, KV head) before its rows run. */
static int packs(const struct job *jb)
{
    return jb->mode == MODE_BRGEMM || jb->mode == MODE_PACK32;
}

static void *alloc(size_t bytes)
{
    return aligned_alloc(ALIGN, (bytes + ALIGN - 1) / ALIGN * ALIGN);
}

static void scratch_free(struct scratch *sc)
{
    free(sc->s), free(sc->o), free(sc->m), free(sc->l), free(sc->p), free(sc->pieces);
    free(sc->seen);
    free(sc->q32), free(sc->k32), free(sc->v32);
}

static int scratch_init(const struct job *jb, struct scratch *sc)
{
    size_t bs = (size_t)jb->bs, d = (size_t)jb->dim, keys = (size_t)jb->ld_s;
    int packed = jb->mode == MODE_BRGEMM, widen = jb->mode == MODE_WIDEN;
    int wide_q = widen || jb->mode == MODE_PACK32;
    memset(sc, 0, sizeof *sc);
    sc->s = alloc(bs * (size_t)jb->ld_s * sizeof(float));
    sc->o = alloc(bs * d * sizeof(float));
    sc->m = alloc(bs * sizeof(float));
    sc->l = alloc(bs * sizeof(float));
    sc->seen = alloc(bs);
    sc->pieces = alloc((size_t)jb->step_blocks * sizeof(struct piece));
    sc->p = packed ? alloc(bs * (size_t)jb->ld_p * sizeof(uint16_t)) : NULL;
    sc->q32 = wide_q ? alloc(bs * d * sizeof(float)) : NULL;
    sc->k32 = widen ? alloc(keys * d * sizeof(float)) : NULL;
    sc->v32 = widen ? alloc(keys * d * sizeof(float)) : NULL;
    int ok = sc->s && sc->o && sc->m && sc->l && sc->seen && sc->pieces && (!packed || sc->p) &&
             (!wide_q || sc->q32) && (!widen || (sc->k32 && sc->v32));
    if (!ok)
        scratch_free(sc);
    return ok;
}

/* --------------------------------------------------------------------------
 * MODE_BRGEMM packing, one chunk of step_keys keys of one KV head at a time, into
 * the VNNI layout brgemm reads for B (pairs along the reduced dimension):
 *   kp[c][d / 2][j][d % 2] = K[c * step_keys + j][d]   (K^T, pairs of d)
 *   vp[key / 2][d][key % 2] = V[key][d]                (pairs of keys)
 * Keys at or past kv_len are zeros. Seen as 32-bit words, the first is the
 * transpose of K[keys][D / 2] and the second interleaves rows two by two.
 * -------------------------------------------------------------------------- */

static inline uint32_t load32(const uint16_t *p)
{
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* kc keys from k (row stride d), the first `valid` of them real. */
static void pack_k(const uint16_t *k, int64_t d, int64_t kc, int64_t valid, uint32_t *out)
{
    for (int64_t j0 = 0; j0 < kc; j0 += 16) { /* 16 rows at a time: one line per row */
        int64_t j1 = j0 + 16 < kc ? j0 + 16 : kc;
        for (int64_t w = 0; w < d / 2; w++)
            for (int64_t j = j0; j < j1; j++)
                out[w * kc + j] = j < valid ? load32(k + j * d + 2 * w) : 0;
    }
}

static void pack_v(const uint16_t *v, int64_t d, int64_t kc, int64_t valid, uint32_t *out)
{
    for (int64_t j = 0; j < kc; j += 2, out += d) {
        const uint16_t *r0 = v + j * d, *r1 = r0 + d;
        int live0 = j < valid, live1 = j + 1 < valid;
        for (int64_t e = 0; e < d; e++)
            out[e] = (live0 ? r0[e] : 0u) | (live1 ? (uint32_t)r1[e] << 16 : 0u);
    }
}

static void widen(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        dst[j] = bf16_float(src[j]);
}

/* Element (t, d)'s place in its block. */
static inline int64_t view_at(const struct kv_view *x, int64_t t, int64_t d)
{
    return x->off + t / x->a * x->s0 + t % x->a * x->s1 + d / x->b * x->s2 + d % x->b * x->s3;
}

/* How each half of the pages is packed (struct paged); 0 where one cannot be. */
static int pack_kinds(struct paged *pg, int64_t dim)
{
    const struct kv_view *k = &pg->k, *v = &pg->v;
    if (pg->page < 16 || pg->page % 16 || k->a < 1 || k->b < 1 || v->a < 1 || v->b < 1 ||
        pg->page % k->a || pg->page % v->a || dim % k->b || dim % v->b)
        return 0;
    /* keys: 16 tokens' words adjacent, or 16 tokens of a dimension adjacent */
    if (k->a % 16 == 0 && k->s1 == 2 && k->b % 2 == 0 && k->s3 == 1)
        pg->kind_k = PACK_WORDS;
    else if (k->a == 1 ? k->s0 == 1 : k->a % 16 == 0 && k->s1 == 1)
        pg->kind_k = PACK_HALVES;
    /* values: a token pair's words adjacent along d, or a token's dimensions */
    if (v->a % 2 == 0 && v->s1 == 1 && v->s3 == 2)
        pg->kind_v = PACK_WORDS;
    else if (v->b == 1 ? v->s2 == 1 : v->s3 == 1) {
        pg->kind_v = PACK_HALVES;
        pg->run_v = v->b == 1 ? dim : v->b;
    }
    return pg->kind_k != PACK_NONE && pg->kind_v != PACK_NONE;
}

/* out[i] = lo[i] | hi[i] << 16: two runs of 16-bit elements as 32-bit words. */
static void interleave(uint32_t *out, const uint16_t *lo, const uint16_t *hi, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = lo[i] | (uint32_t)hi[i] << 16;
}

/* pack_chunk's copy from the pages, 16 keys at a time (one page holds them
 * all): their K^T words (per pair of dimensions, one 64-byte line) and their
 * 8 V rows of pairs; keys past kv_len are zeros and their pages are never
 * read. */
static void pack_paged(const struct job *jb, int64_t b, int64_t h, int64_t first,
                       int64_t valid)
{
    const struct paged *pg = jb->paged;
    const struct kv_view *kv = &pg->k, *vv = &pg->v;
    int64_t d = jb->dim, kc = jb->step_keys;
    uint32_t *kp = (uint32_t *)(jb->kp + first * d), *vp = (uint32_t *)(jb->vp + first * d);
    for (int64_t j0 = 0; j0 < kc; j0 += 16) {
        uint32_t *vrows = vp + j0 / 2 * d;
        if (j0 >= valid) {
            for (int64_t w = 0; w < d / 2; w++)
                memset(kp + w * kc + j0, 0, 64);
            memset(vrows, 0, (size_t)8 * d * sizeof(uint32_t));
            continue;
        }
        int64_t tok = first + j0, t = tok % pg->page;
        const uint16_t *blk = pg->cache + pg->table[b * pg->table_w + tok / pg->page] *
                                              pg->page_stride + h * pg->head_stride;
        for (int64_t w = 0; w < d / 2; w++) {
            const uint16_t *lo = blk + view_at(kv, t, 2 * w);
            if (pg->kind_k == PACK_WORDS)
                memcpy(kp + w * kc + j0, lo, 64);
            else
                interleave(kp + w * kc + j0, lo, blk + view_at(kv, t, 2 * w + 1), 16);
        }
        for (int64_t pair = 0; pair < 8; pair++) {
            int64_t tt = t + 2 * pair;
            uint32_t *row = vrows + pair * d;
            if (pg->kind_v == PACK_WORDS)
                for (int64_t g = 0; g < d; g += vv->b)
                    memcpy(row + g, blk + view_at(vv, tt, g), (size_t)vv->b * sizeof(uint32_t));
            else
                for (int64_t g = 0; g < d; g += pg->run_v)
                    interleave(row + g, blk + view_at(vv, tt, g), blk + view_at(vv, tt + 1, g),
                               pg->run_v);
        }
        for (int64_t j = valid - j0; j < 16; j++) { /* past kv_len (j0 < valid here) */
            for (int64_t w = 0; w < d / 2; w++)
                kp[w * kc + j0 + j] = 0;
            uint16_t *half = (uint16_t *)(vrows + j / 2 * d) + j % 2;
            for (int64_t e = 0; e < d; e++)
                half[2 * e] = 0;
        }
    }
}

/* MODE_PACK32: keys [first, first + n) of KV head h of batch b, widened
 * from the pages into kf and vf; any strided view (dk, dv: each dimension's
 * offset in a token's keys and values). */
static void pack_paged32(const struct job *jb, int64_t b, int64_t h, int64_t first, int64_t n)
{
    const struct paged *pg = jb->paged;
    const struct kv_view *kv = &pg->k, *vv = &pg->v;
    int64_t d = jb->dim;
    for (int64_t tok = first; tok < first + n; tok++) {
        int64_t t = tok % pg->page;
        const uint16_t *blk = pg->cache + pg->table[b * pg->table_w + tok / pg->page] *
                                              pg->page_stride + h * pg->head_stride;
        const uint16_t *k = blk + kv->off + t / kv->a * kv->s0 + t % kv->a * kv->s1;
        const uint16_t *v = blk + vv->off + t / vv->a * vv->s0 + t % vv->a * vv->s1;
        float *kf = jb->kf + tok * d, *vf = jb->vf + tok * d;
        for (int64_t e = 0; e < d; e++)
            kf[e] = bf16_float(k[pg->dk[e]]);
        for (int64_t e = 0; e < d; e++)
            vf[e] = bf16_float(v[pg->dv[e]]);
    }
}

/* MODE_PACK32's chunk: its keys below kv_len widened, the rest zeros. */
static void pack_chunk32(const struct job *jb, int64_t slice, int64_t c, int64_t valid)
{
    int64_t d = jb->dim, kc = jb->step_keys, at = c * kc, b = slice / jb->hkv;
    int64_t n = valid < 0 ? 0 : valid < kc ? valid : kc;
    if (jb->paged)
        pack_paged32(jb, b, slice % jb->hkv, at, n);
    else {
        int64_t from = (slice * jb->skv + at) * d;
        widen(jb->kf + at * d, (const uint16_t *)jb->k + from, n * d);
        widen(jb->vf + at * d, (const uint16_t *)jb->v + from, n * d);
    }
    memset(jb->kf + (at + n) * d, 0, (size_t)((kc - n) * d) * sizeof(float));
    memset(jb->vf + (at + n) * d, 0, (size_t)((kc - n) * d) * sizeof(float));
}

static void pack_chunk(const struct job *jb, int64_t slice, int64_t c)
{
    int64_t d = jb->dim, kc = jb->step_keys, b = slice / jb->hkv;
    int64_t valid = jb->kv_lens[b] - c * kc; /* keys of the chunk below kv_len */
    if (jb->mode == MODE_PACK32) {
        pack_chunk32(jb, slice, c, valid);
        return;
    }
    if (jb->paged) {
        pack_paged(jb, b, slice % jb->hkv, c * kc, valid);
        return;
    }
    int64_t at = (slice * jb->skv + c * kc) * d;
    pack_k((const uint16_t *)jb->k + at, d, kc, valid, (uint32_t *)(jb->kp + c * kc * d));
    pack_v((const uint16_t *)jb->v + at, d, kc, valid, (uint32_t *)(jb->vp + c * kc * d));
}

/* --------------------------------------------------------------------------
 * GEMMs, row-major. sgemm_ is column-major, so each product is asked for
 * transposed (C^T = B^T A^T).
 * -------------------------------------------------------------------------- */

/* s[nq, n] (row stride ld_s) = q[nq, D] k[n, D]^T, float32 */
static void sgemm_qk(const struct job *jb, int nq, int n, const float *q, const float *k, float *s)
{
    int d = (int)jb->dim, ld = jb->ld_s;
    const float one = 1.0f, zero = 0.0f;
    jb->sgemm("T", "N", &n, &nq, &d, &one, k, &d, q, &d, &zero, s, &ld);
}

/* o[nq, D] += p[nq, n] (row stride ld_s) v[n, D], float32 */
static void sgemm_pv(const struct job *jb, int nq, int n, const float *p, const float *v, float *o)
{
    int d = (int)jb->dim, ld = jb->ld_s;
    const float one = 1.0f;
    jb->sgemm("N", "N", &d, &nq, &n, &one, v, &d, p, &ld, &one, o, &d);
}

/* S for keys [key, key + n) of the packed KV head, n whole blocks, split
 * where the keys cross a chunk of kp. */
static void brgemm_qk(const struct job *jb, const struct row *rw, int64_t key, int n, float *s)
{
    int64_t d = jb->dim, kc = jb->step_keys;
    while (n > 0) {
        int64_t c = key / kc, at = key - c * kc;
        int part = (int)(kc - at < n ? kc - at : n);
        jb->brgemm(rw->nq, part, d, d, kc, jb->ld_s, false, rw->q, jb->kp + c * kc * d + 2 * at,
                   s, true);
        key += part, s += part, n -= part;
    }
}

/* --------------------------------------------------------------------------
 * One row: steps of listed blocks, online softmax, output.
 * -------------------------------------------------------------------------- */

/* Keys of the step that query t sees: a prefix of its columns (the pieces
 * ascend and every visible key lies below one bound). */
static int visible(const struct scratch *sc, const struct row *rw, int t)
{
    int64_t lim = rw->lim0 + t;
    int c = 0;
    for (int p = 0; p < rw->np; p++) {
        int64_t left = lim - sc->pieces[p].key;
        if (left <= 0)
            break;
        c += left < sc->pieces[p].n ? (int)left : sc->pieces[p].n;
    }
    return c;
}

/* Every query of the row sees every column of the step. */
static int sees_all(const struct job *jb, const struct scratch *sc, const struct row *rw)
{
    const struct piece *last = &sc->pieces[rw->np - 1];
    return !jb->causal || last->key + last->n <= rw->lim0;
}

/* Online softmax over the step's scores: running max m and sum l per query,
 * output rows rescaled when the max grows; probabilities left in the score
 * tile (float32) or in sc->p (bfloat16), zero from column c up to n. With
 * bfloat16 on AVX-512, a query past its first step keeps its max while the
 * step's scores stay within LAZY_MAX of it: one pass over the scores instead
 * of two, and no rescaling. */
static void softmax_step(const struct job *jb, struct scratch *sc, const struct row *rw, int n)
{
    int d = (int)jb->dim, bf16 = sc->p != NULL;
    int all = sees_all(jb, sc, rw);
    for (int t = 0; t < rw->nq; t++) {
        float *s = sc->s + (size_t)t * jb->ld_s;
        int c = all ? rw->ncols : visible(sc, rw, t);
        if (jb->cap_in != 0.0f) /* scale * s -> cap * tanh(scale * s / cap), in s units */
            for (int j = 0; j < c; j++)
                s[j] = jb->cap_out * tanhf(s[j] * jb->cap_in);
        uint16_t *p = bf16 ? sc->p + (size_t)t * jb->ld_p : NULL;
        if (bf16 && jb->ops.exp_bf16_top && isfinite(sc->m[t])) {
            /* One pass against the running max, kept while no score exceeds
             * it by more than LAZY_MAX (weights up to 2^LAZY_MAX then). A NaN
             * score needs no check: its weight is NaN, so are l and, through
             * P V, every dimension of the output, as below. */
            float top, sum = jb->ops.exp_bf16_top(s, c, n, jb->alpha, sc->m[t], p, &top);
            if (top <= LAZY_MAX) {
                sc->seen[t] |= c > 0;
                sc->l[t] += sum;
                continue;
            }
        }
        float mx = c ? jb->ops.max(s, c, jb->alpha) : -INFINITY;
        /* NaN once a NaN score was seen (then every weight is NaN) */
        float m_new = mx != mx || sc->m[t] != sc->m[t] ? NAN : mx > sc->m[t] ? mx : sc->m[t];
        sc->seen[t] |= c > 0;
        if (m_new == -INFINITY) { /* nothing visible, or only -inf scores, yet: zero weights */
            if (bf16)
                memset(sc->p + (size_t)t * jb->ld_p, 0, (size_t)n * sizeof(uint16_t));
            else
                memset(s, 0, (size_t)n * sizeof(float));
            continue;
        }
        float sum = bf16 ? jb->ops.exp_bf16(s, c, n, jb->alpha, m_new, p)
                         : jb->ops.exp_f32(s, c, n, jb->alpha, m_new);
        float corr = exp2f(sc->m[t] - m_new); /* 0 when m was -inf; NaN from inf - inf */
        if (corr != 1.0f) {
            float *o = sc->o + (size_t)t * d;
            for (int j = 0; j < d; j++)
                o[j] *= corr;
        }
        sc->l[t] = sc->l[t] * corr + sum;
        sc->m[t] = m_new;
    }
}

static int finite_rows(const struct job *jb, const char *x, int64_t n)
{
    int64_t count = n * jb->dim;
    if (kv_f32(jb)) {
        const uint32_t *w = (const uint32_t *)x;
        for (int64_t j = 0; j < count; j++)
            if ((w[j] & 0x7F800000u) == 0x7F800000u)
                return 0;
    } else {
        const uint16_t *h = (const uint16_t *)x;
        for (int64_t j = 0; j < count; j++)
            if ((h[j] & 0x7F80u) == 0x7F80u)
                return 0;
    }
    return 1;
}

/* MODE_BRGEMM: V's element (key, e) in the packed values (pairs of keys). */
static inline uint16_t packed_v(const struct job *jb, int64_t key, int64_t e)
{
    return jb->vp[(key & ~(int64_t)1) * jb->dim + 2 * e + (key & 1)];
}

/* finite_rows of V's rows [key, key + n), read where the step reads them. */
static int finite_v(const struct job *jb, const struct row *rw, int64_t key, int64_t n)
{
    if (jb->mode != MODE_BRGEMM)
        return finite_rows(jb, rw->v + (size_t)key * jb->dim * kv_esize(jb), n);
    for (int64_t j = key; j < key + n; j++)
        for (int64_t e = 0; e < jb->dim; e++)
            if ((packed_v(jb, j, e) & 0x7F80u) == 0x7F80u)
                return 0;
    return 1;
}

/* Whether P V may go through a GEMM: no query has an invisible column whose
 * V row holds NaN or inf (weighted 0, it would still give NaN). The columns
 * some query does not see are those from the first query's count up to
 * `ncols` (past the last visible key: whole blocks with MODE_BRGEMM, keys past
 * kv_len packed as zeros there). */
static int gemm_pv_ok(const struct job *jb, const struct scratch *sc, const struct row *rw,
                      int ncols, int64_t kv_len)
{
    int all = sees_all(jb, sc, rw);
    if (all && ncols == rw->ncols)
        return 1;
    int c0 = all ? rw->ncols : visible(sc, rw, 0);
    for (int p = 0; p < rw->np; p++) {
        const struct piece *pc = &sc->pieces[p];
        int64_t end = pc->col + pc->n + (p == rw->np - 1 ? ncols - rw->ncols : 0);
        int64_t a = c0 > pc->col ? c0 : pc->col; /* columns [a, end) of this piece */
        int64_t key = pc->key + (a - pc->col), e = pc->key + (end - pc->col);
        e = e < kv_len ? e : kv_len;
        if (key < e && !finite_v(jb, rw, key, e - key))
            return 0;
    }
    return 1;
}

/* o[t] += P[t, :c_t] V of its visible columns, query by query, float32
 * (the GEMM's replacement when gemm_pv_ok says no). */
static void pv_exact(const struct job *jb, const struct scratch *sc, const struct row *rw)
{
    int64_t d = jb->dim;
    int all = sees_all(jb, sc, rw);
    for (int t = 0; t < rw->nq; t++) {
        int c = all ? rw->ncols : visible(sc, rw, t);
        float *o = sc->o + (size_t)t * d;
        for (int p = 0; p < rw->np; p++) {
            const struct piece *pc = &sc->pieces[p];
            for (int j = 0; j < pc->n && pc->col + j < c; j++) {
                int col = pc->col + j;
                float w = sc->p ? bf16_float(sc->p[(size_t)t * jb->ld_p + col])
                                : sc->s[(size_t)t * jb->ld_s + col];
                int64_t at = (pc->key + j) * d;
                if (jb->mode == MODE_BRGEMM) {
                    for (int64_t e = 0; e < d; e++)
                        o[e] += w * bf16_float(packed_v(jb, pc->key + j, e));
                } else if (kv_f32(jb)) {
                    const float *v = (const float *)rw->v + at;
                    for (int64_t e = 0; e < d; e++)
                        o[e] += w * v[e];
                } else {
                    const uint16_t *v = (const uint16_t *)rw->v + at;
                    for (int64_t e = 0; e < d; e++)
                        o[e] += w * bf16_float(v[e]);
                }
            }
        }
    }
}

/* MODE_BRGEMM: whole blocks (the row's last piece may end inside one; the rest
 * of that block is computed on packed keys and weighted 0). */
static void step_brgemm(const struct job *jb, struct scratch *sc, const struct row *rw)
{
    int bs = (int)jb->bs, d = (int)jb->dim;
    int n = (rw->ncols + bs - 1) / bs * bs;
    for (int p = 0; p < rw->np; p++) {
        const struct piece *pc = &sc->pieces[p];
        brgemm_qk(jb, rw, pc->key, (pc->n + bs - 1) / bs * bs, sc->s + pc->col);
    }
    softmax_step(jb, sc, rw, n);
    if (!gemm_pv_ok(jb, sc, rw, n, jb->kv_lens[rw->b])) {
        pv_exact(jb, sc, rw);
        return;
    }
    for (int p = 0; p < rw->np; p++) {
        const struct piece *pc = &sc->pieces[p];
        jb->brgemm(rw->nq, d, (pc->n + bs - 1) / bs * bs, jb->ld_p, d, d, true,
                   sc->p + pc->col, jb->vp + pc->key * d, sc->o, true);
    }
}

/* MODE_WIDEN: the pieces widened into one contiguous float32 run. */
static void step_widen(const struct job *jb, struct scratch *sc, const struct row *rw)
{
    int64_t d = jb->dim;
    for (int p = 0; p < rw->np; p++) {
        const struct piece *pc = &sc->pieces[p];
        widen(sc->k32 + pc->col * d, (const uint16_t *)rw->k + pc->key * d, pc->n * d);
        widen(sc->v32 + pc->col * d, (const uint16_t *)rw->v + pc->key * d, pc->n * d);
    }
    sgemm_qk(jb, rw->nq, rw->ncols, rw->q, sc->k32, sc->s);
    softmax_step(jb, sc, rw, rw->ncols);
    if (gemm_pv_ok(jb, sc, rw, rw->ncols, jb->kv_lens[rw->b]))
        sgemm_pv(jb, rw->nq, rw->ncols, sc->s, sc->v32, sc->o);
    else
        pv_exact(jb, sc, rw);
}

/* MODE_SGEMM: K and V read where they lie (MODE_PACK32: as widened once). */
static void step_sgemm(const struct job *jb, struct scratch *sc, const struct row *rw)
{
    int64_t d = jb->dim;
    for (int p = 0; p < rw->np; p++) {
        const struct piece *pc = &sc->pieces[p];
        sgemm_qk(jb, rw->nq, pc->n, rw->q, (const float *)rw->k + pc->key * d, sc->s + pc->col);
    }
    softmax_step(jb, sc, rw, rw->ncols);
    if (!gemm_pv_ok(jb, sc, rw, rw->ncols, jb->kv_lens[rw->b])) {
        pv_exact(jb, sc, rw);
        return;
    }
    for (int p = 0; p < rw->np; p++) {
        const struct piece *pc = &sc->pieces[p];
        sgemm_pv(jb, rw->nq, pc->n, sc->s + pc->col, (const float *)rw->v + pc->key * d, sc->o);
    }
}

static void step(const struct job *jb, struct scratch *sc, struct row *rw)
{
    if (jb->mode == MODE_BRGEMM)
        step_brgemm(jb, sc, rw);
    else if (jb->mode == MODE_WIDEN)
        step_widen(jb, sc, rw);
    else
        step_sgemm(jb, sc, rw); /* MODE_SGEMM, MODE_PACK32 */
    rw->np = rw->ncols = rw->nblocks = 0;
}

/* Add keys [a, e) to the step, extending the last piece when adjacent. */
static void add_keys(struct scratch *sc, struct row *rw, int64_t a, int64_t e)
{
    struct piece *last = rw->np ? &sc->pieces[rw->np - 1] : NULL;
    if (last && last->key + last->n == a)
        last->n += (int)(e - a);
    else
        sc->pieces[rw->np++] = (struct piece){a, (int)(e - a), rw->ncols};
    rw->ncols += (int)(e - a);
    rw->nblocks++;
}

/* A query's log-sum-exp (natural log) as torch.logsumexp of its scaled
 * scores: -inf where it saw nothing or only -inf, +inf with a +inf score,
 * NaN with a NaN score. */
static float query_lse(const struct scratch *sc, int t)
{
    float m = sc->m[t], l = sc->l[t];
    if (m == INFINITY)
        return INFINITY;
    if (m != m || l != l)
        return NAN;
    return l > 0.0f ? (m + log2f(l)) * 0.69314718f : -INFINITY;
}

/* Normalised output rows (zero where nothing was visible; NaN where the
 * weights are: a NaN or +inf score, or only -inf scores), zero padding rows;
 * with jb->lse, each query's log-sum-exp (query_lse; -inf on padding rows)
 * at lse. */
static void write_out(const struct job *jb, const struct scratch *sc, void *out, float *lse,
                      int nq, int rows)
{
    int64_t d = jb->dim;
    if (lse != NULL)
        for (int t = 0; t < rows; t++)
            lse[t] = t < nq && sc->seen[t] ? query_lse(sc, t) : -INFINITY;
    for (int t = 0; t < nq; t++) {
        float l = sc->l[t];
        if (!sc->seen[t]) {
            memset((char *)out + (size_t)t * d * esize(jb), 0, (size_t)d * esize(jb));
            continue;
        }
        float inv = l > 0.0f ? 1.0f / l : NAN; /* l NaN, or 0 after only -inf scores */
        const float *o = sc->o + t * d;
        if (jb->dtype == F32) {
            float *dst = (float *)out + t * d;
            for (int64_t j = 0; j < d; j++)
                dst[j] = o[j] * inv;
        } else {
            uint16_t *dst = (uint16_t *)out + t * d;
            for (int64_t j = 0; j < d; j++)
                dst[j] = bf16_round(o[j] * inv);
        }
    }
    memset((char *)out + (size_t)nq * d * esize(jb), 0, (size_t)(rows - nq) * d * esize(jb));
}

/* Start row (b, h, i): its pointers and running state; 0 if it sees nothing. */
static int row_init(const struct job *jb, struct scratch *sc, int64_t row, struct row *rw,
                    int64_t *hi)
{
    int64_t i = row % jb->qmax, bh = row / jb->qmax, b = bh / jb->hq, h = bh % jb->hq;
    int64_t d = jb->dim, r0 = i * jb->bs, qlen = jb->q_lens[b], kvlen = jb->kv_lens[b];
    int64_t rows = jb->sq - r0 < jb->bs ? jb->sq - r0 : jb->bs;
    int64_t nq = qlen - r0 < 0 ? 0 : qlen - r0 < rows ? qlen - r0 : rows;
    *rw = (struct row){.nq = (int)nq, .b = b, .lim0 = r0 + kvlen - qlen + 1};
    *hi = kvlen; /* no key at or past hi is visible to any of the row's queries */
    if (jb->causal && rw->lim0 + nq - 1 < *hi)
        *hi = rw->lim0 + nq - 1;
    if (nq == 0 || *hi <= 0 || jb->lengths[row] == 0)
        return 0;
    const char *q = (const char *)jb->q + (size_t)(bh * jb->sq + r0) * d * esize(jb);
    rw->q = q;
    if (jb->mode == MODE_WIDEN || jb->mode == MODE_PACK32) {
        widen(sc->q32, (const uint16_t *)q, nq * d);
        rw->q = sc->q32;
    }
    if (jb->mode == MODE_PACK32) { /* the current KV head, widened */
        rw->k = (const char *)jb->kf;
        rw->v = (const char *)jb->vf;
    } else if (!jb->paged) { /* paged: MODE_BRGEMM reads only the packed K and V */
        int64_t kv_off = (b * jb->hkv + h / (jb->hq / jb->hkv)) * jb->skv * d *
                         (int64_t)esize(jb);
        rw->k = (const char *)jb->k + kv_off;
        rw->v = (const char *)jb->v + kv_off;
    }
    for (int t = 0; t < nq; t++)
        sc->m[t] = -INFINITY, sc->l[t] = 0.0f, sc->seen[t] = 0;
    memset(sc->o, 0, (size_t)nq * d * sizeof(float));
    return 1;
}

static void attend_row(const struct job *jb, struct scratch *sc, int64_t row)
{
    int64_t i = row % jb->qmax, bh = row / jb->qmax, r0 = i * jb->bs, hi;
    int rows = (int)(jb->sq - r0 < jb->bs ? jb->sq - r0 : jb->bs);
    void *out = (char *)jb->out + (size_t)(bh * jb->sq + r0) * jb->dim * esize(jb);
    float *lse = jb->lse != NULL ? jb->lse + bh * jb->sq + r0 : NULL;
    struct row rw;
    if (!row_init(jb, sc, row, &rw, &hi)) {
        memset(out, 0, (size_t)rows * jb->dim * esize(jb));
        for (int t = 0; lse != NULL && t < rows; t++)
            lse[t] = -INFINITY;
        return;
    }
    const int64_t *list = jb->idx + row * jb->width;
    for (int64_t s = 0; s < jb->lengths[row]; s++) {
        int64_t a = list[s] * jb->bs, e = a + jb->bs < hi ? a + jb->bs : hi;
        if (e <= a)
            break; /* ascending: no later block is visible either */
        add_keys(sc, &rw, a, e);
        if (rw.nblocks == jb->step_blocks)
            step(jb, sc, &rw);
    }
    if (rw.nblocks)
        step(jb, sc, &rw);
    write_out(jb, sc, out, lse, rw.nq, rows);
}

/* --------------------------------------------------------------------------
 * Scheduling. MODE_BRGEMM and MODE_PACK32 go one (batch, KV head) at a time:
 * its K/V packed by all threads, then its rows; the other modes share all
 * rows at once.
 * -------------------------------------------------------------------------- */

/* Rows [r0, r1) ordered by list length, longest first (counting sort). */
static void order_rows(const struct job *jb, int64_t r0, int64_t r1, int64_t *order,
                       int64_t *count)
{
    int64_t w = jb->width;
    memset(count, 0, (size_t)(w + 2) * sizeof(int64_t));
    for (int64_t r = r0; r < r1; r++)
        count[w - jb->lengths[r] + 1]++;
    for (int64_t x = 1; x <= w + 1; x++)
        count[x] += count[x - 1];
    for (int64_t r = r0; r < r1; r++)
        order[count[w - jb->lengths[r]]++] = r;
}

/* Every thread runs this: the slices in turn, with their packing if any.
 * A thread without scratch still meets every barrier; returns whether it had. */
static int run_slices(const struct job *jb, const int64_t *order, int64_t nslices,
                      int64_t per_slice)
{
    struct scratch sc;
    int ok = scratch_init(jb, &sc);
    int64_t padded = (jb->skv + jb->bs - 1) / jb->bs * jb->bs;
    int64_t nchunks = (padded + jb->step_keys - 1) / jb->step_keys;
    for (int64_t sl = 0; sl < nslices; sl++) {
        if (packs(jb)) {
#pragma omp for schedule(static)
            for (int64_t c = 0; c < nchunks; c++)
                pack_chunk(jb, sl, c);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = sl * per_slice; r < (sl + 1) * per_slice; r++)
            if (ok)
                attend_row(jb, &sc, order[r]);
    }
    if (ok)
        scratch_free(&sc);
    return ok;
}

static int run(const struct job *jb, threads_t threads, release_t release, int nthreads)
{
    int64_t nrows = jb->batch * jb->hq * jb->qmax;
    int64_t nslices = packs(jb) ? jb->batch * jb->hkv : 1;
    int64_t per_slice = nslices ? nrows / nslices : 0;
    int64_t *order = malloc((size_t)(nrows ? nrows : 1) * sizeof(int64_t));
    int64_t *count = malloc((size_t)(jb->width + 2) * sizeof(int64_t));
    int failed = !order || !count;
    for (int64_t sl = 0; !failed && sl < nslices; sl++)
        order_rows(jb, sl * per_slice, (sl + 1) * per_slice, order + sl * per_slice, count);
    free(count);
    if (failed) {
        free(order);
        return ERR_MEMORY;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int prev = threads ? threads(1) : 0; /* MKL serial inside this thread */
        int ok = run_slices(jb, order, nslices, per_slice);
        if (jb->mode == MODE_BRGEMM)
            release(true); /* the tile state brgemm configured (AMX) */
        if (threads)
            threads(prev);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
    }
    free(order);
    return failed ? ERR_MEMORY : 0;
}

/* Checks the sizes, sets up and runs the job; jb holds the problem. */
static int attention(struct job *jb, double scale, double softcap, void *const *blas, int isa,
                     int nthreads)
{
    int64_t batch = jb->batch, hq = jb->hq, hkv = jb->hkv, sq = jb->sq, skv = jb->skv;
    int64_t dim = jb->dim, bs = jb->bs;
    int mode = jb->mode, dtype = jb->dtype, packed = mode == MODE_BRGEMM;
    jb->alpha = (float)(scale * 1.4426950408889634);
    jb->cap_in = softcap > 0 ? (float)(scale / softcap) : 0.0f;
    jb->cap_out = softcap > 0 ? (float)(softcap / scale) : 0.0f;
    jb->sgemm = (sgemm_t)blas[0], jb->brgemm = (brgemm_t)blas[1];
    if (batch < 0 || hq < 1 || hkv < 1 || hq % hkv || sq < 0 || skv < 0 || dim < 1 ||
        softcap < 0 || (softcap > 0 && scale == 0) ||
        bs < 1 || jb->width < 0 || dim > 65536 || bs > 65536 ||
        (dtype == F32) != (mode == MODE_SGEMM) || (dtype != F32 && dtype != BF16) ||
        (mode != MODE_SGEMM && mode != MODE_WIDEN && mode != MODE_PACK32 && !packed) ||
        (packed ? !jb->brgemm || !blas[2] || dim % 2 || bs % 2 : !jb->sgemm) ||
        (jb->paged && !packs(jb)) ||
        pick_rowops(isa, &jb->ops))
        return ERR_ARGS;
    jb->qmax = (sq + bs - 1) / bs;
    jb->step_blocks = bs >= STEP_KEYS ? 1 : (int)(STEP_KEYS / bs);
    jb->step_keys = jb->step_blocks * (int)bs;
    if (jb->paged && packed && jb->step_keys % 16)
        return ERR_ARGS; /* pack_paged copies 16 keys at a time */
    /* Strides off powers of two (cache sets), rows on 64-byte lines (AMX loads). */
    jb->ld_s = (jb->step_keys + 15) / 16 * 16 + 16;
    jb->ld_p = (jb->step_keys + 31) / 32 * 32 + 32;
    if (packs(jb)) {
        size_t keys = (size_t)(((skv + bs - 1) / bs * bs + jb->step_keys - 1) /
                               jb->step_keys * jb->step_keys);
        size_t size = packed ? sizeof(uint16_t) : sizeof(float);
        void *k = alloc(keys * (size_t)dim * size), *v = alloc(keys * (size_t)dim * size);
        if (packed)
            jb->kp = k, jb->vp = v;
        else
            jb->kf = k, jb->vf = v;
    }
    int err = packs(jb) && !(packed ? jb->kp && jb->vp : jb->kf && jb->vf)
                  ? ERR_MEMORY
                  : run(jb, (threads_t)blas[3], (release_t)blas[2], nthreads < 1 ? 1 : nthreads);
    free(jb->kp), free(jb->vp), free(jb->kf), free(jb->vf);
    return err;
}

/* q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D], out [B, Hq, Sq, D]: contiguous,
 * one dtype (F32 or BF16). idx [B, Hq, Qmax, width] int64, each row's first
 * lengths[b, h, i] entries ascending, in [0, ceil(Skv / bs)), no duplicates;
 * q_lens, kv_lens [B]. mode: MODE_SGEMM for F32, MODE_WIDEN, MODE_PACK32 or
 * MODE_BRGEMM for BF16 (MODE_BRGEMM needs bfloat16 dot products, even D and
 * bs). blas:
 * {sgemm_, brgemm, brgemm_release, MKL_Set_Num_Threads_Local}, the last may
 * be NULL and the brgemm pair when not MODE_BRGEMM. isa: ISA_AUTO, or a set to force (tests).
 * Returns 0, ERR_MEMORY, or ERR_ARGS (bad sizes, missing GEMM, isa not here). */
int stem_sparse_attention(const void *q, const void *k, const void *v, void *out, float *lse,
                          int64_t batch, int64_t hq, int64_t hkv, int64_t sq, int64_t skv,
                          int64_t dim, int64_t bs, const int64_t *idx, int64_t width,
                          const int64_t *lengths, const int64_t *q_lens, const int64_t *kv_lens,
                          int causal, double scale, double softcap, int dtype, int mode,
                          void *const *blas, int isa, int nthreads)
{
    struct job jb = {.q = q, .k = k, .v = v, .out = out, .lse = lse, .batch = batch, .hq = hq,
                     .hkv = hkv, .sq = sq, .skv = skv, .dim = dim, .bs = bs, .width = width,
                     .idx = idx, .lengths = lengths, .q_lens = q_lens, .kv_lens = kv_lens,
                     .causal = causal, .dtype = dtype, .mode = mode};
    return attention(&jb, scale, softcap, blas, isa, nthreads);
}

/* As stem_sparse_attention in bfloat16, MODE_BRGEMM or MODE_PACK32, with K
 * and V packed straight from the pages of a paged cache (struct paged):
 * cache, table [B, table_w] int64 (the pages of each sequence's first
 * ceil(kv_len / page) runs of tokens, each in [0, pages)), the strides in
 * elements, and views[14]: the keys' kv_view then the values' (off, a, s0,
 * s1, b, s2, s3), each element inside a (page, KV head) block (the caller
 * checks). skv: at least the largest kv_len. ERR_ARGS also where, in
 * MODE_BRGEMM, a half cannot be packed by runs (pack_kinds). */
int stem_sparse_attention_paged(const void *q, const void *cache, const int64_t *table,
                                int64_t table_w, int64_t page, int64_t page_stride,
                                int64_t head_stride, const int64_t *views, void *out,
                                float *lse, int64_t batch, int64_t hq, int64_t hkv, int64_t sq,
                                int64_t skv, int64_t dim, int64_t bs, const int64_t *idx,
                                int64_t width, const int64_t *lengths, const int64_t *q_lens,
                                const int64_t *kv_lens, int causal, double scale,
                                double softcap, int mode, void *const *blas, int isa,
                                int nthreads)
{
    const int64_t *kw = views, *vw = views + 7;
    struct paged pg = {.cache = cache, .table = table, .table_w = table_w, .page = page,
                       .page_stride = page_stride, .head_stride = head_stride,
                       .k = {kw[0], kw[1], kw[2], kw[3], kw[4], kw[5], kw[6]},
                       .v = {vw[0], vw[1], vw[2], vw[3], vw[4], vw[5], vw[6]}};
    if (mode == MODE_BRGEMM ? !pack_kinds(&pg, dim)
                            : mode != MODE_PACK32 || page < 1 || dim < 1 || dim > 65536 ||
                                  pg.k.a < 1 || pg.k.b < 1 || pg.v.a < 1 || pg.v.b < 1)
        return ERR_ARGS;
    struct job jb = {.q = q, .out = out, .lse = lse, .batch = batch, .hq = hq, .hkv = hkv,
                     .sq = sq, .skv = skv, .dim = dim, .bs = bs, .width = width, .idx = idx,
                     .lengths = lengths, .q_lens = q_lens, .kv_lens = kv_lens,
                     .causal = causal, .dtype = BF16, .mode = mode, .paged = &pg};
    int err = 0;
    if (mode == MODE_PACK32) { /* each dimension's offset in a token's keys, values */
        pg.dk = malloc((size_t)dim * sizeof(int64_t));
        pg.dv = malloc((size_t)dim * sizeof(int64_t));
        err = !pg.dk || !pg.dv;
        for (int64_t e = 0; !err && e < dim; e++) {
            pg.dk[e] = e / pg.k.b * pg.k.s2 + e % pg.k.b * pg.k.s3;
            pg.dv[e] = e / pg.v.b * pg.v.s2 + e % pg.v.b * pg.v.s3;
        }
    }
    if (!err)
        err = attention(&jb, scale, softcap, blas, isa, nthreads);
    else
        err = ERR_MEMORY;
    free(pg.dk), free(pg.dv);
    return err;
}
