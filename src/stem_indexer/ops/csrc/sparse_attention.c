/* Block-sparse softmax attention on the CPU (ops/sparse_attention.py).
 *
 * One work item is one row (b, h, i): the block_size query tokens of query
 * block i of head h attend to the key blocks listed for the row, with the
 * token-level mask (keys j < kv_len; with causal, j <= t + kv_len - q_len).
 * The listed blocks (ascending) are consumed in steps of up to CHUNK_KEYS
 * keys; adjacent blocks form one piece, multiplied where it lies in K and V
 * (no gather):
 *
 *   S = (scale * log2 e) Q K_piece^T     one GEMM per piece, into a score tile
 *   online softmax per query row          base 2, running max and sum in fp32
 *   O = O * correction + P V_piece        one GEMM per piece
 *
 * Because the blocks are ascending and a query's last visible key is a single
 * bound, the keys a query sees in a step are a prefix of the step's columns:
 * each query row takes the exponential of that prefix and zeros the rest.
 * Keys at or past kv_len and query rows at or past q_len are cut from the GEMMs
 * (never read), so NaN or inf in padding cannot reach a valid output; a masked
 * probability is never multiplied with a padded value row.
 *
 * GEMMs are MKL's, exported by torch's libtorch_cpu.so and passed in by the
 * caller: Fortran sgemm_ (float32), cblas_gemm_bf16bf16f32 (bfloat16 operands,
 * float32 accumulation: P is rounded to bfloat16 as torch's flash kernel does).
 * On CPUs without bfloat16 hardware the caller asks for the `convert` mode
 * instead: each step's K and V pieces and each row's Q are widened to float32
 * in thread scratch and multiplied with sgemm_. Each thread runs MKL
 * single-threaded (MKL_Set_Num_Threads_Local), since the rows already share
 * the cores.
 *
 * Rows are handed out longest list first (dynamic schedule) so that the long
 * causal rows do not end up last on one thread. Built with -fopenmp where the
 * compiler has it (ops/native.py), serial otherwise.
 */
#include <math.h>
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
#define AVX2 __attribute__((target("avx2,fma")))
#endif

enum { F32 = 0, BF16 = 1 };                                /* dtype of q, k, v, out */
enum { ISA_AUTO = -1, ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { ERR_MEMORY = 1, ERR_ARGS = 2 };
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

#define CHUNK_KEYS 512 /* keys per online-softmax step (rounded to whole blocks) */
#define ALIGN 64

typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *,
                        const float *, const float *, const int *, const float *, const int *,
                        const float *, float *, const int *);
typedef void (*bgemm_t)(int, int, int, int, int, int, float, const uint16_t *, int,
                        const uint16_t *, int, float, float *, int);
typedef int (*threads_t)(int);

/* --------------------------------------------------------------------------
 * Row operations of the online softmax, per instruction set.
 *
 * max(s, c):               largest of s[0..c).
 * exp_f32(s, c, n, m):     s[j] = 2^(s[j] - m) for j < c, 0 for c <= j < n
 *                          (n rounded up to 16 may be written); the sum.
 * exp_bf16(s, c, n, m, p): the same into p as bfloat16 (nearest even); the
 *                          sum of the rounded values, so that the weights used
 *                          and the normaliser agree.
 * Exponents below -126 give 0 (a weight under 2^-126 of the row's largest).
 * -------------------------------------------------------------------------- */

struct rowops {
    float (*max)(const float *s, int c);
    float (*exp_f32)(float *s, int c, int n, float m);
    float (*exp_bf16)(const float *s, int c, int n, float m, uint16_t *p);
};

static inline uint16_t bf16_round(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
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
    return x > -126.0f ? exp2f(x) : 0.0f;
}

static float max_scalar(const float *s, int c)
{
    float m = -INFINITY;
    for (int j = 0; j < c; j++)
        m = s[j] > m ? s[j] : m;
    return m;
}

static float exp_f32_scalar(float *s, int c, int n, float m)
{
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        s[j] = j < c ? exp2_clip(s[j] - m) : 0.0f;
        sum += s[j];
    }
    return sum;
}

static float exp_bf16_scalar(const float *s, int c, int n, float m, uint16_t *p)
{
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        p[j] = j < c ? bf16_round(exp2_clip(s[j] - m)) : 0;
        sum += bf16_float(p[j]);
    }
    return sum;
}

#ifdef HAVE_X86
/* 2^x with the Cephes exp2f polynomial on [-1/2, 1/2] (relative error
 * below 2e-7); lanes with x <= -126 (and NaN) give 0. */
AVX512 static inline __m512 exp2_512(__m512 x)
{
    __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(ok, p, n);
}

static inline __mmask16 head_mask(int j, int c)
{
    int left = c - j;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

AVX512 static float max_512(const float *s, int c)
{
    __m512 acc = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= c; j += 16)
        acc = _mm512_max_ps(acc, _mm512_loadu_ps(s + j));
    if (j < c)
        acc = _mm512_mask_max_ps(acc, head_mask(j, c), acc, _mm512_loadu_ps(s + j));
    return _mm512_reduce_max_ps(acc);
}

AVX512 static float exp_f32_512(float *s, int c, int n, float m)
{
    __m512 acc = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
    for (int j = 0; j < n; j += 16) {
        __m512 p = _mm512_maskz_mov_ps(head_mask(j, c),
                                       exp2_512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
        _mm512_storeu_ps(s + j, p);
        acc = _mm512_add_ps(acc, p);
    }
    return _mm512_reduce_add_ps(acc);
}

AVX512 static float exp_bf16_512(const float *s, int c, int n, float m, uint16_t *p)
{
    __m512 acc = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (int j = 0; j < n; j += 16) {
        __m512 e = _mm512_maskz_mov_ps(head_mask(j, c),
                                       exp2_512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
        __m512i b = _mm512_castps_si512(e); /* round to nearest even (e >= 0, finite) */
        b = _mm512_add_epi32(b, _mm512_add_epi32(half, _mm512_and_si512(
                                                           _mm512_srli_epi32(b, 16), one)));
        b = _mm512_srli_epi32(b, 16);
        _mm256_storeu_si256((__m256i *)(p + j), _mm512_cvtepi32_epi16(b));
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
    }
    return _mm512_reduce_add_ps(acc);
}

AVX2 static inline __m256 exp2_256(__m256 x)
{
    __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f)); /* also NaN -> -126 */
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), ok);
}

AVX2 static inline __m256 lanes_below(int j, int c)
{
    __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), lane));
}

AVX2 static float hsum_256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

AVX2 static float max_256(const float *s, int c)
{
    __m256 acc = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= c; j += 8)
        acc = _mm256_max_ps(acc, _mm256_loadu_ps(s + j));
    float m = max_scalar(s + j, c - j);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++)
        m = lanes[l] > m ? lanes[l] : m;
    return m;
}

AVX2 static float exp_f32_256(float *s, int c, int n, float m)
{
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (int j = 0; j < n; j += 8) {
        __m256 p = _mm256_and_ps(exp2_256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)),
                                 lanes_below(j, c));
        _mm256_storeu_ps(s + j, p);
        acc = _mm256_add_ps(acc, p);
    }
    return hsum_256(acc);
}

AVX2 static float exp_bf16_256(const float *s, int c, int n, float m, uint16_t *p)
{
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    for (int j = 0; j < n; j += 8) {
        __m256 e = _mm256_and_ps(exp2_256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)),
                                 lanes_below(j, c));
        __m256i b = _mm256_castps_si256(e);
        b = _mm256_add_epi32(b, _mm256_add_epi32(half, _mm256_and_si256(
                                                           _mm256_srli_epi32(b, 16), one)));
        b = _mm256_srli_epi32(b, 16);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b),
                                          _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i *)(p + j), packed);
        acc = _mm256_add_ps(acc, _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
    }
    return hsum_256(acc);
}
#endif

/* The row operations for `isa` (ISA_AUTO: the best this CPU runs); -1 if
 * the requested set is not available here. */
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
#endif
    if (isa == ISA_AUTO)
        isa = best;
    if (isa < ISA_SCALAR || isa > best)
        return -1;
    *ops = (struct rowops){max_scalar, exp_f32_scalar, exp_bf16_scalar};
#ifdef HAVE_X86
    if (isa == ISA_AVX2)
        *ops = (struct rowops){max_256, exp_f32_256, exp_bf16_256};
    if (isa == ISA_AVX512)
        *ops = (struct rowops){max_512, exp_f32_512, exp_bf16_512};
#endif
    return 0;
}

/* --------------------------------------------------------------------------
 * The problem, per-thread scratch, one step's pieces.
 * -------------------------------------------------------------------------- */

struct job {
    const void *q, *k, *v;
    void *out;
    int64_t hq, hkv, sq, skv, dim, bs, qmax, width;
    const int64_t *idx, *lengths, *q_lens, *kv_lens;
    int causal, dtype, convert; /* convert: bfloat16 computed in float32 with sgemm_ */
    float alpha;                /* scale * log2(e): scores in base-2 units */
    int step_blocks, ld;        /* blocks per step; row stride of the score tiles */
    sgemm_t sgemm;
    bgemm_t bgemm;
    struct rowops ops;
};

struct piece {
    int64_t key; /* first key (token index in the sequence) */
    int n, col;  /* keys, first column in the step */
};

struct scratch {
    float *s, *o, *m, *l, *q32, *k32, *v32;
    uint16_t *p;
    struct piece *pieces;
};

/* Where one row's computation stands. */
struct row {
    const void *q;          /* its first query token (float32 scratch when converting) */
    const char *k, *v;      /* its KV head's first key */
    int nq;                 /* valid query tokens */
    int64_t lim0;           /* with causal: keys < lim0 + t are visible to query t */
    int np, ncols, nblocks; /* the current step */
};

static void *alloc(size_t bytes)
{
    return aligned_alloc(ALIGN, (bytes + ALIGN - 1) / ALIGN * ALIGN);
}

static void scratch_free(struct scratch *sc)
{
    free(sc->s), free(sc->o), free(sc->m), free(sc->l), free(sc->p), free(sc->pieces);
    free(sc->q32), free(sc->k32), free(sc->v32);
}

static int scratch_init(const struct job *jb, struct scratch *sc)
{
    size_t bs = (size_t)jb->bs, d = (size_t)jb->dim, ld = (size_t)jb->ld;
    int bf16 = jb->dtype == BF16 && !jb->convert, conv = jb->convert;
    memset(sc, 0, sizeof *sc);
    sc->s = alloc(bs * ld * sizeof(float));
    sc->o = alloc(bs * d * sizeof(float));
    sc->m = alloc(bs * sizeof(float));
    sc->l = alloc(bs * sizeof(float));
    sc->pieces = alloc((size_t)jb->step_blocks * sizeof(struct piece));
    sc->p = bf16 ? alloc(bs * ld * sizeof(uint16_t)) : NULL;
    sc->q32 = conv ? alloc(bs * d * sizeof(float)) : NULL;
    sc->k32 = conv ? alloc(ld * d * sizeof(float)) : NULL;
    sc->v32 = conv ? alloc(ld * d * sizeof(float)) : NULL;
    int ok = sc->s && sc->o && sc->m && sc->l && sc->pieces && (!bf16 || sc->p) &&
             (!conv || (sc->q32 && sc->k32 && sc->v32));
    if (!ok)
        scratch_free(sc);
    return ok;
}

/* --------------------------------------------------------------------------
 * GEMMs, row-major: sgemm_ is column-major, so each product is asked for
 * transposed (C^T = B^T A^T).
 * -------------------------------------------------------------------------- */

/* s[nq, n] (row stride jb->ld) = alpha * q[nq, D] k[n, D]^T */
static void gemm_qk(const struct job *jb, int nq, int n, const void *q, const void *k, float *s)
{
    int d = (int)jb->dim, ld = jb->ld;
    if (jb->dtype == BF16 && !jb->convert) {
        jb->bgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, nq, n, d, jb->alpha, q, d, k,
                  d, 0.0f, s, ld);
    } else {
        const float zero = 0.0f;
        jb->sgemm("T", "N", &n, &nq, &d, &jb->alpha, k, &d, q, &d, &zero, s, &ld);
    }
}

/* o[nq, D] += p[nq, n] (row stride jb->ld) v[n, D] */
static void gemm_pv(const struct job *jb, int nq, int n, const void *p, const void *v, float *o)
{
    int d = (int)jb->dim, ld = jb->ld;
    if (jb->dtype == BF16 && !jb->convert) {
        jb->bgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_NO_TRANS, nq, d, n, 1.0f, p, ld, v, d,
                  1.0f, o, d);
    } else {
        const float one = 1.0f;
        jb->sgemm("N", "N", &d, &nq, &n, &one, v, &d, p, &ld, &one, o, &d);
    }
}

/* --------------------------------------------------------------------------
 * One row: steps of listed blocks, online softmax, output.
 * -------------------------------------------------------------------------- */

static void widen(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        dst[j] = bf16_float(src[j]);
}

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

/* Online softmax over the step's scores: running max m and sum l per query,
 * output rows rescaled when the max grows; probabilities left in the score
 * tile (float32) or in sc->p (bfloat16). */
static void softmax_step(const struct job *jb, struct scratch *sc, const struct row *rw)
{
    int ld = jb->ld, d = (int)jb->dim, n = rw->ncols, bf16 = sc->p != NULL;
    const struct piece *last = &sc->pieces[rw->np - 1];
    int all = !jb->causal || last->key + last->n <= rw->lim0; /* every query sees all */
    for (int t = 0; t < rw->nq; t++) {
        float *s = sc->s + (size_t)t * ld;
        int c = all ? n : visible(sc, rw, t);
        float mx = c ? jb->ops.max(s, c) : -INFINITY;
        float m_new = mx > sc->m[t] ? mx : sc->m[t];
        if (m_new == -INFINITY) { /* nothing visible yet: zero weights */
            if (bf16)
                memset(sc->p + (size_t)t * ld, 0, (size_t)n * sizeof(uint16_t));
            else
                memset(s, 0, (size_t)n * sizeof(float));
            continue;
        }
        float sum = bf16 ? jb->ops.exp_bf16(s, c, n, m_new, sc->p + (size_t)t * ld)
                         : jb->ops.exp_f32(s, c, n, m_new);
        float corr = exp2f(sc->m[t] - m_new); /* 0 when m was -inf */
        if (corr != 1.0f) {
            float *o = sc->o + (size_t)t * d;
            for (int j = 0; j < d; j++)
                o[j] *= corr;
        }
        sc->l[t] = sc->l[t] * corr + sum;
        sc->m[t] = m_new;
    }
}

/* One step: scores, softmax, values, for the pieces gathered in sc. */
static void step(const struct job *jb, struct scratch *sc, struct row *rw)
{
    int64_t d = jb->dim;
    size_t esz = jb->dtype == F32 ? 4 : 2;
    if (jb->convert) { /* widen the pieces into one contiguous float32 run */
        for (int p = 0; p < rw->np; p++) {
            const struct piece *pc = &sc->pieces[p];
            widen(sc->k32 + pc->col * d, (const uint16_t *)(rw->k + pc->key * d * esz), pc->n * d);
            widen(sc->v32 + pc->col * d, (const uint16_t *)(rw->v + pc->key * d * esz), pc->n * d);
        }
        gemm_qk(jb, rw->nq, rw->ncols, rw->q, sc->k32, sc->s);
    } else {
        for (int p = 0; p < rw->np; p++) {
            const struct piece *pc = &sc->pieces[p];
            gemm_qk(jb, rw->nq, pc->n, rw->q, rw->k + pc->key * d * esz, sc->s + pc->col);
        }
    }
    softmax_step(jb, sc, rw);
    if (jb->convert) {
        gemm_pv(jb, rw->nq, rw->ncols, sc->s, sc->v32, sc->o);
    } else {
        for (int p = 0; p < rw->np; p++) {
            const struct piece *pc = &sc->pieces[p];
            const void *pm = sc->p ? (const void *)(sc->p + pc->col) : sc->s + pc->col;
            gemm_pv(jb, rw->nq, pc->n, pm, rw->v + pc->key * d * esz, sc->o);
        }
    }
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

/* Normalised output rows (zero where nothing was visible), zero padding rows. */
static void write_out(const struct job *jb, const struct scratch *sc, void *out, int nq,
                      int rows)
{
    int64_t d = jb->dim;
    for (int t = 0; t < nq; t++) {
        float inv = sc->l[t] > 0.0f ? 1.0f / sc->l[t] : 0.0f;
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
    size_t esz = jb->dtype == F32 ? 4 : 2;
    memset((char *)out + (size_t)nq * d * esz, 0, (size_t)(rows - nq) * d * esz);
}

static void attend_row(const struct job *jb, struct scratch *sc, int64_t row)
{
    int64_t i = row % jb->qmax, bh = row / jb->qmax, b = bh / jb->hq, h = bh % jb->hq;
    int64_t d = jb->dim, bs = jb->bs, r0 = i * bs, qlen = jb->q_lens[b];
    int64_t kvlen = jb->kv_lens[b];
    size_t esz = jb->dtype == F32 ? 4 : 2;
    int rows = (int)(jb->sq - r0 < bs ? jb->sq - r0 : bs);
    int64_t nq64 = qlen - r0 < 0 ? 0 : qlen - r0;
    struct row rw = {.nq = (int)(nq64 < rows ? nq64 : rows), .lim0 = r0 + kvlen - qlen + 1};
    char *out = (char *)jb->out + (size_t)(bh * jb->sq + r0) * d * esz;
    int64_t hi = kvlen; /* no key at or past hi is visible to any of the row's queries */
    if (jb->causal && rw.lim0 + rw.nq - 1 < hi)
        hi = rw.lim0 + rw.nq - 1;
    int64_t len = jb->lengths[row];
    if (rw.nq == 0 || hi <= 0 || len == 0) {
        memset(out, 0, (size_t)rows * d * esz);
        return;
    }
    const char *q = (const char *)jb->q + (size_t)(bh * jb->sq + r0) * d * esz;
    rw.q = q;
    if (jb->convert) {
        widen(sc->q32, (const uint16_t *)q, rw.nq * d);
        rw.q = sc->q32;
    }
    int64_t kv_off = (b * jb->hkv + h / (jb->hq / jb->hkv)) * jb->skv * d * (int64_t)esz;
    rw.k = (const char *)jb->k + kv_off;
    rw.v = (const char *)jb->v + kv_off;
    for (int t = 0; t < rw.nq; t++)
        sc->m[t] = -INFINITY, sc->l[t] = 0.0f;
    memset(sc->o, 0, (size_t)rw.nq * d * sizeof(float));

    const int64_t *list = jb->idx + row * jb->width;
    for (int64_t s = 0; s < len; s++) {
        int64_t a = list[s] * bs, e = a + bs < hi ? a + bs : hi;
        if (e <= a)
            break; /* ascending: no later block is visible either */
        add_keys(sc, &rw, a, e);
        if (rw.nblocks == jb->step_blocks)
            step(jb, sc, &rw);
    }
    if (rw.nblocks)
        step(jb, sc, &rw);
    write_out(jb, sc, out, rw.nq, rows);
}

/* --------------------------------------------------------------------------
 * Entry point.
 * -------------------------------------------------------------------------- */

/* Rows ordered by list length, longest first (counting sort); NULL on no memory. */
static int64_t *order_rows(const struct job *jb, int64_t nrows)
{
    int64_t *order = malloc((size_t)(nrows ? nrows : 1) * sizeof(int64_t));
    int64_t *start = calloc((size_t)jb->width + 2, sizeof(int64_t));
    if (!order || !start) {
        free(order), free(start);
        return NULL;
    }
    for (int64_t r = 0; r < nrows; r++)
        start[jb->width - jb->lengths[r] + 1]++;
    for (int64_t w = 1; w <= jb->width + 1; w++)
        start[w] += start[w - 1];
    for (int64_t r = 0; r < nrows; r++)
        order[start[jb->width - jb->lengths[r]]++] = r;
    free(start);
    return order;
}

static int run_rows(const struct job *jb, const int64_t *order, int64_t nrows, threads_t threads,
                    int nthreads)
{
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        struct scratch sc;
        int ok = scratch_init(jb, &sc);
        int prev = threads ? threads(1) : 0; /* MKL serial inside this thread */
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < nrows; r++)
            if (ok)
                attend_row(jb, &sc, order[r]);
        if (threads)
            threads(prev);
        if (ok) {
            scratch_free(&sc);
        } else {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? ERR_MEMORY : 0;
}

/* q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D], out [B, Hq, Sq, D]: contiguous,
 * one dtype (F32 or BF16). idx [B, Hq, Qmax, width] int64, each row's first
 * lengths[b, h, i] entries ascending, in [0, ceil(Skv / bs)), no duplicates;
 * q_lens, kv_lens [B]. blas: {sgemm_, cblas_gemm_bf16bf16f32 (may be NULL
 * when not used), MKL_Set_Num_Threads_Local (may be NULL)}. convert: compute
 * BF16 in float32 with sgemm_. isa: ISA_AUTO, or a set to force (tests).
 * Returns 0, ERR_MEMORY, or ERR_ARGS (bad sizes, missing GEMM, isa not here). */
int stem_sparse_attention(const void *q, const void *k, const void *v, void *out, int64_t batch,
                          int64_t hq, int64_t hkv, int64_t sq, int64_t skv, int64_t dim,
                          int64_t bs, const int64_t *idx, int64_t width, const int64_t *lengths,
                          const int64_t *q_lens, const int64_t *kv_lens, int causal, double scale,
                          int dtype, int convert, void *const *blas, int isa, int nthreads)
{
    struct job jb = {q, k, v, out, hq, hkv, sq, skv, dim, bs, (sq + bs - 1) / bs, width,
                     idx, lengths, q_lens, kv_lens, causal, dtype, convert && dtype == BF16,
                     (float)(scale * 1.4426950408889634)};
    jb.sgemm = (sgemm_t)blas[0];
    jb.bgemm = (bgemm_t)blas[1];
    if (batch < 0 || hq < 1 || hkv < 1 || hq % hkv || sq < 0 || skv < 0 || dim < 1 || bs < 1 ||
        dim > INT32_MAX / 4 || bs > CHUNK_KEYS * 64 || (dtype != F32 && dtype != BF16) ||
        !jb.sgemm || (dtype == BF16 && !jb.convert && !jb.bgemm) || pick_rowops(isa, &jb.ops))
        return ERR_ARGS;
    jb.step_blocks = bs >= CHUNK_KEYS ? 1 : (int)(CHUNK_KEYS / bs);
    jb.ld = (int)((jb.step_blocks * bs + 15) / 16 * 16);
    int64_t nrows = batch * hq * jb.qmax;
    int64_t *order = order_rows(&jb, nrows);
    if (!order)
        return ERR_MEMORY;
    int err = run_rows(&jb, order, nrows, (threads_t)blas[2], nthreads < 1 ? 1 : nthreads);
    free(order);
    return err;
}
