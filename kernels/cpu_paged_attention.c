/* CPU kernels: paged decode attention, encoder attention over packed sequences, and the
 * encoder's residual add + LayerNorm in one pass (the last two at the end of the file).
 *
 * Paged decode attention: one query token per sequence reads its K/V straight from
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
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = ((u >> 16) | 0x40u) & 0xffffu;                           /* NaN stays NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);   /* branch-free: vectorizes */
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

/* ---------------------------------------------------------------------------------------------
 * Encoder attention over packed sequences (no padding, no mask): qkv [T, 3 * nh * hd] holds each
 * token's q | k | v, sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1]; out [T, nh * hd];
 * hd a multiple of 16, at most 64. Per (sequence, head): K transposed to [hd, L] in float32, then
 * register-blocked: 4 query rows x 16 keys of scores per pass over hd (one K load feeds 4 FMAs,
 * no horizontal sums), softmax, and the values summed into 4 rows x hd accumulators. GCC vector
 * extensions (16 floats), so it builds on AVX2-only CPUs as well.
 */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define R 4

#define DEFINE_HEAD(NAME, T, LOAD, STORE)                                                             \
static inline __attribute__((always_inline)) void NAME(const T *qkv, T *out, int64_t start, int64_t L, \
        int64_t h, int64_t nh, const int64_t HD, float scale, float *buf) {                          \
    const int64_t H = nh * HD, row = 3 * H, Lp = (L + 15) / 16 * 16, NV = HD / 16;                  \
    float *kt = buf, *v = kt + HD * Lp, *s = v + L * HD;                                            \
    float tmp[64];                                                                                  \
    for (int64_t j = 0; j < L; j++) {                                                               \
        LOAD(qkv + (start + j) * row + H + h * HD, tmp, HD);                                        \
        for (int64_t d = 0; d < HD; d++) kt[d * Lp + j] = tmp[d];                                   \
        LOAD(qkv + (start + j) * row + 2 * H + h * HD, v + j * HD, HD);                             \
    }                                                                                               \
    for (int64_t j = L; j < Lp; j++) for (int64_t d = 0; d < HD; d++) kt[d * Lp + j] = 0.f;         \
    for (int64_t i0 = 0; i0 < L; i0 += R) {                                                         \
        const int64_t nr = L - i0 < R ? L - i0 : R;                                                 \
        float q[R][64];                                                                             \
        for (int64_t r = 0; r < R; r++) {                                                           \
            if (r < nr) { LOAD(qkv + (start + i0 + r) * row + h * HD, q[r], HD);                    \
                          for (int64_t d = 0; d < HD; d++) q[r][d] *= scale; }                      \
            else memset(q[r], 0, sizeof(q[r]));                                                     \
        }                                                                                           \
        for (int64_t c = 0; c < Lp; c += 16) {                    /* scores, 4 rows x 16 keys */   \
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                             \
            for (int64_t d = 0; d < HD; d++) {                                                      \
                const v16 kv = *(const v16 *)(kt + d * Lp + c);                                     \
                a0 += q[0][d] * kv; a1 += q[1][d] * kv; a2 += q[2][d] * kv; a3 += q[3][d] * kv;     \
            }                                                                                       \
            *(v16 *)(s + 0 * Lp + c) = a0; *(v16 *)(s + 1 * Lp + c) = a1;                           \
            *(v16 *)(s + 2 * Lp + c) = a2; *(v16 *)(s + 3 * Lp + c) = a3;                           \
        }                                                                                           \
        float inv[R];                                                                               \
        for (int64_t r = 0; r < R; r++) {                         /* softmax over the L real keys */ \
            float *sr = s + r * Lp, m = -FLT_MAX, z = 0.f;                                          \
            for (int64_t j = 0; j < L; j++) m = sr[j] > m ? sr[j] : m;                              \
            for (int64_t j = 0; j < L; j++) { sr[j] = expf(sr[j] - m); z += sr[j]; }                \
            inv[r] = 1.f / z;                                                                       \
        }                                                                                           \
        v16 o[R][4];                                              /* values: 4 rows x HD */        \
        for (int64_t r = 0; r < R; r++) for (int64_t k = 0; k < 4; k++) o[r][k] = (v16){0};         \
        for (int64_t j = 0; j < L; j++) {                                                           \
            const float *vj = v + j * HD;                                                           \
            for (int64_t k = 0; k < NV; k++) {                                                      \
                const v16 vv = *(const v16 *)(vj + 16 * k);                                         \
                for (int64_t r = 0; r < R; r++) o[r][k] += s[r * Lp + j] * vv;                      \
            }                                                                                       \
        }                                                                                           \
        for (int64_t r = 0; r < nr; r++) {                                                          \
            float res[64];                                                                          \
            for (int64_t k = 0; k < NV; k++) { v16 t = o[r][k] * inv[r]; memcpy(res + 16 * k, &t, 64); } \
            STORE(out + (start + i0 + r) * H + h * HD, res, HD);                                    \
        }                                                                                           \
    }                                                                                               \
}

#define DEFINE_VARLEN(NAME, HEAD, T)                                                                  \
int NAME(const T *qkv, T *out, const int32_t *cu, int64_t num_seqs, int64_t nh, int64_t hd,          \
         float scale, int num_threads) {                                                            \
    if (hd % 16 || hd > 64) return -1;                                                              \
    int failed = 0;                                                                                 \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")           \
    for (int64_t b = 0; b < num_seqs; b++) {                                                        \
        for (int64_t h = 0; h < nh; h++) {                                                          \
            const int64_t start = cu[b], L = cu[b + 1] - start, Lp = (L + 15) / 16 * 16;            \
            if (L <= 0) continue;                                                                   \
            float *buf = (float *)malloc(sizeof(float) * (size_t)(hd * Lp + L * hd + R * Lp + 16));  \
            if (!buf) { failed = 1; continue; }                                                     \
            if (hd == 32) HEAD(qkv, out, start, L, h, nh, 32, scale, buf);                          \
            else if (hd == 64) HEAD(qkv, out, start, L, h, nh, 64, scale, buf);                     \
            else HEAD(qkv, out, start, L, h, nh, hd, scale, buf);                                   \
            free(buf);                                                                              \
        }                                                                                           \
    }                                                                                               \
    return failed ? -2 : 0;                                                                         \
}

DEFINE_HEAD(varlen_head_f32, float, load_f32, store_f32)
DEFINE_HEAD(varlen_head_bf16, uint16_t, load_bf16, store_bf16)
DEFINE_VARLEN(varlen_attention_f32, varlen_head_f32, float)
DEFINE_VARLEN(varlen_attention_bf16, varlen_head_bf16, uint16_t)

/* ---------------------------------------------------------------------------------------------
 * The encoder's residual and LayerNorm in one pass: out[t] = LN(x[t] + y[t]) * w + b over the
 * H features of each of `rows` tokens. The sum is rounded to T first (what torch's `x + y` gives
 * in that dtype), mean and variance in float32, the result rounded once. torch runs these as an
 * add and a layer_norm, each a pass over (T, H) in memory, ~0.36 ms for MiniLM's 3,600 x 384 in
 * bf16 against ~0.05 ms here (memory-bound).
 */
#define MAX_H 4096
static inline float round_f32(float v) { return v; }
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

#define DEFINE_ADD_LN(NAME, T, LOAD, STORE, ROUND)                                                    \
int NAME(const T *x, const T *y, const T *w, const T *b, T *out, int64_t rows, int64_t H, float eps, \
         int num_threads) {                                                                         \
    if (H > MAX_H) return -1;                                                                       \
    float wf[MAX_H], bf[MAX_H];                                                                     \
    LOAD(w, wf, H);                                                                                 \
    LOAD(b, bf, H);                                                                                 \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                          \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        float v[MAX_H], u[MAX_H];                                                                   \
        LOAD(x + t * H, v, H);                                                                      \
        LOAD(y + t * H, u, H);                                                                      \
        float sum = 0.f;                                                                            \
        for (int64_t i = 0; i < H; i++) { v[i] = ROUND(v[i] + u[i]); sum += v[i]; }                 \
        const float mean = sum / (float)H;                                                          \
        float var = 0.f;                                                                            \
        for (int64_t i = 0; i < H; i++) { const float d = v[i] - mean; var += d * d; }              \
        const float rstd = 1.f / sqrtf(var / (float)H + eps), shift = -rstd * mean;                 \
        for (int64_t i = 0; i < H; i++) v[i] = (v[i] * rstd + shift) * wf[i] + bf[i];  /* torch's */ \
        STORE(out + t * H, v, H);                                                                   \
    }                                                                                               \
    return 0;                                                                                       \
}

DEFINE_ADD_LN(add_layer_norm_f32, float, load_f32, store_f32, round_f32)
DEFINE_ADD_LN(add_layer_norm_bf16, uint16_t, load_bf16, store_bf16, round_bf16)
