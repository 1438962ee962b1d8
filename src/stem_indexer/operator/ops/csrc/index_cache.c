/*
 * The indexer cache's write (stem_indexer/pipeline/index_cache.py, IndexCache.write)
 * as one pass: what the torch path does in a dozen operations per layer,
 * for a serving engine's decode steps, where the fixed cost of each
 * operation is most of the work.
 *
 * The caller's WritePlan decides everything (which pages start afresh, what
 * each page's count and tag become, where each token's sums and maxima go);
 * this file only carries it out, in the torch path's order:
 *
 *   1. the restarted pages' sums and maxima are zeroed;
 *   2. the touched pages' counts and the tagged pages' tags are stored;
 *   3. each token's key is added, token after token in write order, to its
 *      group's float32 sums (the order of index_add_, so the same bits);
 *   4. each token's value norms (computed by the caller with torch, the
 *      reduction the one-shot path uses) raise its run's maxima.
 *
 * stem_index_write_layers carries it out for one layer (IndexCache.write)
 * or for several layers of one step (WriteStage.flush: one call where a
 * decode step would make one per layer); stem_stage_rows copies a layer's
 * keys and values aside until then.
 *
 * Keys are float32, bfloat16 or float16, any token and head strides, unit
 * stride along the head dimension. Every index was checked by the plan
 * (pages in [0, num_pages)); the function trusts them. Returns 0.
 */

#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);          /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);  /* normal */
    } else if (man == 0) {
        bits = sign;                                       /* zero */
    } else {                                               /* subnormal: normalise */
        uint32_t e = 113u;
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void write_one(
    const void *key, int dtype, int64_t key_t_stride, int64_t key_h_stride,
    const float *norms, const int64_t *sources, int64_t tokens, int64_t heads, int64_t dim,
    const int64_t *k_index, const int64_t *v_index,
    const int64_t *restart, int64_t restarts, int64_t stride, int64_t runs,
    const int64_t *touched, const int32_t *after, int64_t num_touched,
    const int64_t *tag_pages, const int64_t *tag_rows, const int64_t *tags, int64_t num_tags,
    float *ksum, float *vmax, int32_t *filled, int64_t *tag)
{
    const int64_t k_page = stride * heads * dim, v_page = runs * heads;
    for (int64_t r = 0; r < restarts; r++) {
        memset(ksum + restart[r] * k_page, 0, (size_t)k_page * sizeof(float));
        memset(vmax + restart[r] * v_page, 0, (size_t)v_page * sizeof(float));
    }
    for (int64_t i = 0; i < num_touched; i++)
        filled[touched[i]] = after[i];
    if (tag != NULL)
        for (int64_t i = 0; i < num_tags; i++)
            tag[tag_pages[i]] = tags == NULL ? 0 : tags[tag_rows[i]];
    /* Each token's sums are a row on a page of its own (a decode step's
     * tokens belong to different sequences): its cache lines are fetched a
     * few tokens ahead, so that their misses overlap. */
    const int64_t ahead = 6, row_bytes = heads * dim * (int64_t)sizeof(float);
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t src = sources == NULL ? t : sources[t];
        float *dst = ksum + k_index[t] * heads * dim;
        if (t + ahead < tokens) {
            const char *next = (const char *)(ksum + k_index[t + ahead] * heads * dim);
            for (int64_t b = 0; b < row_bytes; b += 64)
                __builtin_prefetch(next + b, 1, 3);
            __builtin_prefetch(vmax + v_index[t + ahead] * heads, 1, 3);
        }
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = src * key_t_stride + h * key_h_stride;
            float *row = dst + h * dim;
            if (dtype == 0) {
                const float *k = (const float *)key + at;
                for (int64_t d = 0; d < dim; d++)
                    row[d] += k[d];
            } else if (dtype == 1) {
                const uint16_t *k = (const uint16_t *)key + at;
                for (int64_t d = 0; d < dim; d++)
                    row[d] += from_bf16(k[d]);
            } else {
                const uint16_t *k = (const uint16_t *)key + at;
                for (int64_t d = 0; d < dim; d++)
                    row[d] += from_f16(k[d]);
            }
        }
        float *vm = vmax + v_index[t] * heads;
        const float *n = norms + src * heads;
        for (int64_t h = 0; h < heads; h++)
            if (n[h] > vm[h] || n[h] != n[h])  /* amax propagates NaN */
                vm[h] = n[h];
    }
}

/*
 * One step's write into several layers' caches at once (WriteStage.flush):
 * layer l's keys and value norms are rows l of key and norms (strides
 * key_l_stride, norms_l_stride, in elements), its cache's tensors at
 * caches[4 * l + 0 .. 3] (ksum, vmax, filled, tag; tag may be 0). The plan
 * was made against one layer's cache: a layer whose touched pages do not
 * hold the counts it assumed (before) is left untouched and reported with
 * ok[l] = 0, for the caller to write on its own; ok[l] = 1 otherwise.
 */
int stem_index_write_layers(
    int64_t layers, const int64_t *caches, const int32_t *before, int32_t *ok,
    const void *key, int dtype, int64_t key_l_stride, int64_t key_t_stride,
    int64_t key_h_stride, const float *norms, int64_t norms_l_stride,
    const int64_t *sources, int64_t tokens, int64_t heads, int64_t dim,
    const int64_t *k_index, const int64_t *v_index,
    const int64_t *restart, int64_t restarts, int64_t stride, int64_t runs,
    const int64_t *touched, const int32_t *after, int64_t num_touched,
    const int64_t *tag_pages, const int64_t *tag_rows, const int64_t *tags, int64_t num_tags)
{
    const size_t width = dtype == 0 ? 4 : 2;
    for (int64_t l = 0; l < layers; l++) {
        int32_t *filled = (int32_t *)(intptr_t)caches[4 * l + 2];
        ok[l] = 1;
        for (int64_t i = 0; i < num_touched && ok[l]; i++)
            ok[l] = filled[touched[i]] == before[i];
        if (!ok[l])
            continue;
        write_one((const char *)key + (size_t)(l * key_l_stride) * width, dtype,
                  key_t_stride, key_h_stride, norms + l * norms_l_stride, sources, tokens,
                  heads, dim, k_index, v_index, restart, restarts, stride, runs, touched,
                  after, num_touched, tag_pages, tag_rows, tags, num_tags,
                  (float *)(intptr_t)caches[4 * l], (float *)(intptr_t)caches[4 * l + 1],
                  filled, (int64_t *)(intptr_t)caches[4 * l + 3]);
    }
    return 0;
}

/*
 * A layer's turn in a staged step (WriteStage.put): rows t < tokens of key
 * and value (any token and head strides, in elements; unit stride along the
 * head dimension), each heads x dim of width bytes, copied to dst_key and
 * dst_value, contiguous [tokens, heads, dim].
 */
int stem_stage_rows(
    void *dst_key, void *dst_value, const void *key, const void *value, int64_t width,
    int64_t tokens, int64_t heads, int64_t dim, int64_t key_t_stride, int64_t key_h_stride,
    int64_t value_t_stride, int64_t value_h_stride)
{
    const size_t row = (size_t)(dim * width);
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const size_t at = (size_t)((t * heads + h) * dim * width);
            memcpy((char *)dst_key + at,
                   (const char *)key + (size_t)((t * key_t_stride + h * key_h_stride) * width),
                   row);
            memcpy((char *)dst_value + at,
                   (const char *)value
                       + (size_t)((t * value_t_stride + h * value_h_stride) * width), row);
        }
    return 0;
}
