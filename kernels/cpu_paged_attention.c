/* Paged decode attention for the CPU: one query token per sequence reads its K/V straight from
 * the paged cache through its block table (no gather copy), all query heads of a KV head at
 * once (each K/V row is loaded once for the g heads that share it), float32 accumulation.
 *
 * Layout (kernels/reference.py): k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
 * block_tables int32 [num_seqs, bt_stride]; context_lens int32 [num_seqs]; q, out
 * [num_seqs, num_heads, head_dim] contiguous. Query head j of KV head h is head h * g + j.
 *
 * Built at first use by kernels/cpu_attention.py with the machine's compiler (-O3 -march=native
 * -ffast-math: vectorized expf; OpenMP over (sequence, KV head)); compared with kernels.reference in tests/test_cpu_attention.py.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_G 16
#define MAX_HD 256

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void load_f32(const float *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = src[i];
}

static inline void load_bf16(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline void store_f32(float *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = src[i];
}

static inline void store_bf16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

/* one (sequence, KV head): g query heads against the sequence's n cached keys; `hd` is a
 * compile-time constant where the caller passes one (64, 128), so the row loops unroll */
#define DEFINE_ATTEND(NAME, T, LOAD, STORE)                                                          \
static inline __attribute__((always_inline)) int NAME(                                              \
        const T *q, const T *k_cache, const T *v_cache, const int32_t *table, int64_t n, T *out,    \
        int64_t kvh, int64_t h, int64_t g, const int64_t hd, int64_t block_size, float scale) {     \
    float qf[MAX_G * MAX_HD], acc[MAX_G * MAX_HD], row[MAX_HD], mx[MAX_G], sum[MAX_G];              \
    float stack_p[MAX_G * 512];                                                                     \
    float *p = g * n <= MAX_G * 512 ? stack_p : (float *)malloc(sizeof(float) * (size_t)(g * n));  \
    if (!p) return -2;                                                                              \
    for (int64_t j = 0; j < g; j++) {                                                               \
        LOAD(q + j * hd, qf + j * hd, hd);                                                          \
        mx[j] = -FLT_MAX;                                                                           \
    }                                                                                               \
    for (int64_t b = 0, t = 0; t < n; b++) {            /* scores: q . k for every key */          \
        const T *kb = k_cache + ((int64_t)table[b] * block_size * kvh + h) * hd;                    \
        for (int64_t o = 0; o < block_size && t < n; o++, t++) {                                    \
            LOAD(kb + o * kvh * hd, row, hd);                                                       \
            for (int64_t j = 0; j < g; j++) {                                                       \
                const float *qj = qf + j * hd;                                                      \
                float d = 0.f;                                                                      \
                for (int64_t i = 0; i < hd; i++) d += qj[i] * row[i];                               \
                d *= scale;                                                                         \
                p[j * n + t] = d;                                                                   \
                mx[j] = d > mx[j] ? d : mx[j];                                                      \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    for (int64_t j = 0; j < g; j++) {                   /* softmax numerators and sums */          \
        float *pj = p + j * n, m = mx[j], z = 0.f;                                                  \
        for (int64_t t = 0; t < n; t++) { pj[t] = expf(pj[t] - m); z += pj[t]; }                    \
        sum[j] = z;                                                                                 \
        memset(acc + j * hd, 0, sizeof(float) * (size_t)hd);                                        \
    }                                                                                               \
    for (int64_t b = 0, t = 0; t < n; b++) {            /* weighted sum of the values */           \
        const T *vb = v_cache + ((int64_t)table[b] * block_size * kvh + h) * hd;                    \
        for (int64_t o = 0; o < block_size && t < n; o++, t++) {                                    \
            LOAD(vb + o * kvh * hd, row, hd);                                                       \
            for (int64_t j = 0; j < g; j++) {                                                       \
                const float w = p[j * n + t];                                                       \
                float *aj = acc + j * hd;                                                           \
                for (int64_t i = 0; i < hd; i++) aj[i] += w * row[i];                               \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    for (int64_t j = 0; j < g; j++) {                                                               \
        const float inv = sum[j] > 0.f ? 1.f / sum[j] : 0.f;                                        \
        for (int64_t i = 0; i < hd; i++) acc[j * hd + i] *= inv;                                    \
        STORE(out + j * hd, acc + j * hd, hd);                                                      \
    }                                                                                               \
    if (p != stack_p) free(p);                                                                      \
    return 0;                                                                                       \
}

/* returns 0, or a negative code: -1 a shape past MAX_G / MAX_HD, -2 out of memory */
#define DEFINE_KERNEL(NAME, ATTEND, T)                                                               \
int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,               \
         int64_t bt_stride, const int32_t *context_lens, T *out, int64_t num_seqs, int64_t nh,       \
         int64_t kvh, int64_t hd, int64_t block_size, float scale, int num_threads) {                \
    const int64_t g = nh / kvh;                                                                     \
    if (g > MAX_G || hd > MAX_HD || g * kvh != nh) return -1;                                       \
    int failed = 0;                                                                                 \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")           \
    for (int64_t s = 0; s < num_seqs; s++) {                                                        \
        for (int64_t h = 0; h < kvh; h++) {                                                         \
            const T *qs = q + (s * nh + h * g) * hd;                                                \
            T *os = out + (s * nh + h * g) * hd;                                                    \
            const int32_t *table = block_tables + s * bt_stride;                                    \
            const int64_t n = context_lens[s];                                                      \
            int rc;                                                                                 \
            if (hd == 64)                                                                           \
                rc = ATTEND(qs, k_cache, v_cache, table, n, os, kvh, h, g, 64, block_size, scale);  \
            else if (hd == 128)                                                                     \
                rc = ATTEND(qs, k_cache, v_cache, table, n, os, kvh, h, g, 128, block_size, scale); \
            else                                                                                    \
                rc = ATTEND(qs, k_cache, v_cache, table, n, os, kvh, h, g, hd, block_size, scale);  \
            if (rc) failed = 1;                                                                     \
        }                                                                                           \
    }                                                                                               \
    return failed ? -2 : 0;                                                                         \
}

DEFINE_ATTEND(attend_f32, float, load_f32, store_f32)
DEFINE_ATTEND(attend_bf16, uint16_t, load_bf16, store_bf16)
DEFINE_KERNEL(paged_decode_attention_f32, attend_f32, float)
DEFINE_KERNEL(paged_decode_attention_bf16, attend_bf16, uint16_t)
