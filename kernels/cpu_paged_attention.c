/* CPU kernels: paged decode attention, encoder attention over packed sequences, the encoder's
 * residual add + LayerNorm in one pass, the decoder's glue (RMSNorm, RoPE + K/V store,
 * SiLU * up), a small-batch linear (gemv_f32), its weight-only int8 twins (gemv_w8_f32 and
 * gemv_w8_bf16: int16 activations, integer sums) and a whole decode step's layers in one call
 * (decode_forward_f32; decode_forward_bf16 with int8 weights), in that order; and, where the
 * compiler targets AMX-BF16, the encoder's bf16 attention as tile products
 * (varlen_attention_bf16_amx). Vectors are of the machine's width (VW floats: 16 with AVX-512, 8 otherwise); GCC's
 * generic 16-float vectors on an AVX2-only CPU went through the stack.
 *
 * Paged decode attention: one query token per sequence reads its K/V straight from
 * the paged cache through its block table (no gather copy), all query heads of a KV head at
 * once (each K/V row is loaded once for the g heads that share it), float32 accumulation, two
 * passes (scores of every key, one softmax, then values: no online rescaling, so the result is
 * the reference's up to float32 summation order), a task per sequence when there are sequences
 * enough for the threads.
 *
 * Layout (kernels/reference.py): k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
 * block_tables int32 [num_seqs, bt_stride]; context_lens int32 [num_seqs]; q, out
 * [num_seqs, num_heads, head_dim] contiguous. Query head j of KV head h is head h * g + j.
 *
 * Built at first use by kernels/cpu_attention.py with the machine's compiler (-O3 -march=native
 * -ffast-math: vectorized expf; OpenMP over (sequence, KV head)); compared with kernels.reference in tests/test_cpu_attention.py.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_G 16
#define MAX_HD 256

#if defined(__AVX512F__)
#define VW 16          /* floats per vector register */
#define VCHUNK 32      /* value columns summed per pass: 8 rows x 2 zmm (hd 64: two passes) */
#else
#define VW 8           /* AVX2: 16 ymm registers, so 4 rows x 16 columns of values per pass */
#define VCHUNK 16
#endif
/* vectors of the machine's width: with only AVX2, GCC lowers a 64-byte vector type through the
 * stack (measured 3 GFLOP/s, 8x behind SDPA), so a 16-key block is 16 / VW native vectors */
typedef float vec __attribute__((vector_size(VW * 4), aligned(4)));

typedef uint16_t hvec __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t uvec __attribute__((vector_size(VW * 4)));
static inline vec bf16_vec(const uint16_t *p) {        /* VW bf16 -> floats, exactly */
#if VW == 16               /* one widening load and a shift (GCC's generic form took five ops) */
    return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif defined(__AVX2__)
    return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    const uvec u = __builtin_convertvector(*(const hvec *)p, uvec) << 16;
    vec f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}
static inline vec f32_vec(const float *p) {            /* VW floats, unaligned (vec's alignment is 4) */
    return *(const vec *)p;
}
/* IEEE half (a float16 KV cache beside float32 activations, as llama.cpp keeps one): F16C's
 * conversions (round to nearest even, as torch's .to(float16)), else GCC's _Float16 in software */
static inline float f16_to_f32(uint16_t v) {
#if defined(__F16C__)
    return _cvtsh_ss(v);
#else
    _Float16 h;
    memcpy(&h, &v, 2);
    return (float)h;
#endif
}
static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    const _Float16 h = (_Float16)f;
    uint16_t v;
    memcpy(&v, &h, 2);
    return v;
#endif
}
static inline vec f16_vec(const uint16_t *p) {        /* VW halves -> floats, exactly */
#if VW == 16
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vec f;
    for (int i = 0; i < VW; i++) f[i] = f16_to_f32(p[i]);
    return f;
#endif
}
typedef int32_t ivec __attribute__((vector_size(VW * 4)));
/* a * b + c as one fused instruction where the CPU has FMA: a chain of these stays a chain (with
 * -ffast-math GCC turned a dot product's chain of `+=` into a tree of multiplies and adds, a
 * third more instructions in the decode attention's scores) */
static inline vec fma_vec(vec a, vec b, vec c) {
#if VW == 16
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* e^x for x <= 0 in float32 (softmax terms), VW at a time: 2^n e^r with n = round(x / ln 2),
 * r = x - n ln 2 (in two parts), e^r by its Taylor series to r^6 (|r| <= ln 2 / 2: error < 2e-7);
 * lanes below -87 give e^-87 (~1.6e-38), not 0 */
static inline vec exp_vec(vec x) {
    const ivec low = x < -87.f;
    vec lowv = (vec){0} - 87.f;
    x = (vec)((low & (ivec)lowv) | (~low & (ivec)x));
    const ivec n = __builtin_convertvector(x * 1.44269504089f - 0.5f, ivec);   /* x <= 0: round */
    const vec nf = __builtin_convertvector(n, vec);
    const vec r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
    vec p = r * (1.f / 720) + (1.f / 120);
    p = p * r + (1.f / 24);
    p = p * r + (1.f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    return (vec)((ivec)p + ((n + 0) << 23));                    /* p * 2^n, n >= -126 */
}

static inline float hsum(vec a) {
    float z = 0.f;
    for (int i = 0; i < VW; i++) z += a[i];
    return z;
}

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

static inline void load_f16(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(src[i]);
}

static inline void store_f16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_f16(src[i]);
}

/* one (sequence, KV head): g query heads against the sequence's n cached keys; `hd` is a
 * compile-time constant where the caller passes one (64, 128), so the row loops unroll */
#define DEFINE_ATTEND(NAME, T, LOAD, STORE, TC, LOADC)                                               \
static inline __attribute__((always_inline)) int NAME(                                              \
        const T *q, const TC *k_cache, const TC *v_cache, const int32_t *table, int64_t n, T *out,  \
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
        const TC *kb = k_cache + ((int64_t)table[b] * block_size * kvh + h) * hd;                    \
        for (int64_t o = 0; o < block_size && t < n; o++, t++) {                                    \
            LOADC(kb + o * kvh * hd, row, hd);                                                       \
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
        const TC *vb = v_cache + ((int64_t)table[b] * block_size * kvh + h) * hd;                    \
        for (int64_t o = 0; o < block_size && t < n; o++, t++) {                                    \
            LOADC(vb + o * kvh * hd, row, hd);                                                       \
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

/* Lane i of the result: the sum of x[i]'s lanes, for VW vectors at once: a transpose-add tree of
 * VW - 1 adds and 2 (VW - 1) two-source shuffles (one horizontal sum per vector, as scalar adds,
 * had been most of the decode kernel's time) */
static inline vec sum_lanes(const vec *x) {
#if VW == 16
    vec y[8], z[4], w[2];
    for (int i = 0; i < 8; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif defined(__AVX__)
    /* AVX: horizontal adds pair neighbours within each 128-bit half; two rounds leave every
     * vector's sum split between the halves, and one cross-half add joins them (9 instructions,
     * where GCC's lowering of the generic tree below took ~34) */
    const __m256 t0 = _mm256_hadd_ps((__m256)x[0], (__m256)x[1]), t1 = _mm256_hadd_ps((__m256)x[2], (__m256)x[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)x[4], (__m256)x[5]), t3 = _mm256_hadd_ps((__m256)x[6], (__m256)x[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (vec)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    vec y[4], z[2];
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* The same in vectors of the machine's width, for hd a multiple of 2 * VW, read in place from the
 * paged cache (bf16 widened in registers), in two passes over the keys, a chunk of up to VW keys
 * at a time (`rows`: each key's offset in the cache, `cnt` of them), for `jn` (<= 4) query heads
 * of the KV head at offset `hoff` in a row. attend_scores: per key one K row load feeds every
 * head's dot product, kept as a vector of partial sums, and the chunk's VW vectors are reduced at
 * once (sum_lanes) into p (row j at p + j * ld; lanes past cnt hold garbage). attend_values: the
 * softmax weights from p, one V row load per key for every head, into the accumulators acc
 * (jn x hd). */
#define DEFINE_ATTEND_CHUNK(SCORES, VALUES, T, VLOAD)                                                \
static inline __attribute__((always_inline)) void SCORES(                                           \
        const T *k_cache, const int64_t *rows, int64_t cnt, int64_t hoff, const int jn,              \
        const int64_t hd, float scale, const float *qf, float *p, int64_t ld, const char *pf,       \
        const int64_t pfl) {                                                                        \
    const int64_t NV = hd / VW;                                                                     \
    vec part[4][VW];                                                                                \
    for (int64_t i = 0; i < VW; i++) {                                                              \
        if (pf) for (int64_t l = 0; l < pfl; l++) __builtin_prefetch(pf + (i * pfl + l) * 64, 0, 3); \
        const T *kr = k_cache + rows[i < cnt ? i : 0] + hoff;                                       \
        vec kv[MAX_HD / VW];                                                                        \
        for (int64_t u = 0; u < NV; u++) kv[u] = VLOAD(kr + u * VW);                                \
        for (int j = 0; j < jn; j++) {                                                              \
            const float *qj = qf + j * hd;                                                          \
            vec a = f32_vec(qj) * kv[0];                                                            \
            for (int64_t u = 1; u < NV; u++) a = fma_vec(f32_vec(qj + u * VW), kv[u], a);            \
            part[j][i] = a;                                                                         \
        }                                                                                           \
    }                                                                                               \
    for (int j = 0; j < jn; j++) *(vec *)(p + j * ld) = sum_lanes(part[j]) * scale;                 \
}                                                                                                   \
static inline __attribute__((always_inline)) void VALUES(                                           \
        const T *v_cache, const int64_t *rows, int64_t cnt, int64_t hoff, const int jn,              \
        const int64_t hd, const float *p, int64_t ld, float *acc, const char *pf, const int64_t pfl) { \
    const int64_t NV = hd / VW;                                                                     \
    /* columns in passes of CV vectors, so that jn x CV accumulators, jn weights and one value     \
     * vector stay in registers (3 heads x 4 on AVX2: 12 + 3 + 1 of 16 ymm; all hd at once had     \
     * spilled, and 2-vector passes did every weight's broadcast and row lookup four times per key);\
     * each element's sum runs over the keys in the same order either way */                     \
    const int64_t CV = (VW == 16 || jn <= 3) && NV % 4 == 0 ? 4 : 2;                                \
    for (int64_t u0 = 0; u0 < NV; u0 += CV) {                                                       \
        vec a[4][4];                                                                                \
        for (int j = 0; j < jn; j++)                                                                \
            for (int64_t u = 0; u < CV; u++) a[j][u] = f32_vec(acc + j * hd + (u0 + u) * VW);       \
        for (int64_t i = 0; i < cnt; i++) {                                                         \
            if (pf && u0 == 0)                                                                      \
                for (int64_t l = 0; l < pfl; l++) __builtin_prefetch(pf + (i * pfl + l) * 64, 0, 3); \
            const T *vr = v_cache + rows[i] + hoff + u0 * VW;                                       \
            vec w[4];                                                                               \
            for (int j = 0; j < jn; j++) w[j] = (vec){0} + p[j * ld + i];                           \
            for (int64_t u = 0; u < CV; u++) {                                                      \
                const vec vv = VLOAD(vr + u * VW);                                                  \
                for (int j = 0; j < jn; j++) a[j][u] = fma_vec(w[j], vv, a[j][u]);                  \
            }                                                                                       \
        }                                                                                           \
        for (int j = 0; j < jn; j++)                                                                \
            for (int64_t u = 0; u < CV; u++) *(vec *)(acc + j * hd + (u0 + u) * VW) = a[j][u];      \
    }                                                                                               \
}

/* CALL for every group of up to 4 query heads (jn of them, a constant) of KV heads h0 .. h0 + nk */
#define FOR_GROUPS(CALL)                                                                            \
    for (int64_t hh = 0; hh < nk; hh++)                                                             \
        for (int64_t j0 = 0; j0 < g; j0 += 4) {                                                     \
            const int64_t j = hh * g + j0, hoff = (h0 + hh) * hd;                                   \
            switch (g - j0 < 4 ? g - j0 : 4) {                                                      \
                case 4: { const int jn = 4; CALL; } break;                                          \
                case 3: { const int jn = 3; CALL; } break;                                          \
                case 2: { const int jn = 2; CALL; } break;                                          \
                default: { const int jn = 1; CALL; } break;                                         \
            }                                                                                       \
        }

/* the offset in a cache of token t's row (all KV heads) through the block table */
#define TOKEN_ROW(t) (((int64_t)table[(t) / block_size] * block_size + (t) % block_size) * row)
/* the rows of keys c .. c + cnt (c a multiple of VW, as every chunk's start is): one block-table
 * lookup where whole chunks lie in a block (block_size a multiple of VW), else one per key (a
 * 64-bit division each) */
#define CHUNK_ROWS(c, cnt)                                                                          \
    if (block_size % VW == 0) {                                                                     \
        const int64_t base_ = TOKEN_ROW(c);                                                         \
        for (int64_t i = 0; i < (cnt); i++) rows[i] = base_ + i * row;                              \
    } else {                                                                                        \
        for (int64_t i = 0; i < (cnt); i++) rows[i] = TOKEN_ROW((c) + i);                           \
    }
/* chunks prefetched ahead: 1, 2 and 4 measured alike from memory (study paged_decode) */
#define PF_DIST 2
/* the fewest keys (of the longest sequence) for which the kernel splits them between threads */
#define SPLIT_MIN_KEYS 256
/* software prefetch of the K or V rows of keys c .. c + VW (those past n skipped) for KV heads
 * h0 .. h0 + nk: a row's part is nk hd contiguous elements */
#define PREFETCH_CHUNK(CACHE, T, c)                                                                 \
    if ((c) < n) {                                                                                  \
        const int64_t c_ = (c), e_ = n - c_ < VW ? n - c_ : VW;                                     \
        const int64_t lines_ = ((int64_t)sizeof(T) * nk * hd + 63) / 64;                            \
        if (block_size % VW == 0) {  /* the chunk's rows at a fixed stride: one lookup, no bounds \
                                        per key (the loops per key had been a sixth of the        \
                                        instructions) */                                          \
            const char *r_ = (const char *)((CACHE) + TOKEN_ROW(c_) + h0 * hd);                     \
            const int64_t stride_ = (int64_t)sizeof(T) * row;                                       \
            for (int64_t t_ = 0; t_ < e_; t_++, r_ += stride_)                                      \
                for (int64_t l_ = 0; l_ < lines_; l_++) __builtin_prefetch(r_ + l_ * 64, 0, 3);     \
        } else {                                                                                    \
            for (int64_t t_ = c_; t_ < c_ + e_; t_++) {                                             \
                const char *r_ = (const char *)((CACHE) + TOKEN_ROW(t_) + h0 * hd);                 \
                for (int64_t l_ = 0; l_ < lines_; l_++) __builtin_prefetch(r_ + l_ * 64, 0, 3);     \
            }                                                                                       \
        }                                                                                           \
    }

/* The prefetch of chunk c (PF_DIST chunks ahead) spread over the keys of the chunk being read:
 * where a task reads whole token rows (all KV heads) and a chunk lies in one block, the chunk's
 * rows are one contiguous run of VW x row elements, and each (key, KV head) step of SCORES or
 * VALUES prefetches its own pfl lines of it (`pf`, PF_SLICE: KV head hh's share). Issued as one
 * burst per chunk instead (PREFETCH_CHUNK, still used for tasks of one KV head, whose rows are
 * strided), one long sequence from memory ran 1.3-1.5x slower on 2 AVX2 cores (1 or 2 threads):
 * a burst of 48 line fills queues behind the core's few miss buffers and stalls the loads after
 * it; spread, the misses overlap the arithmetic (study paged_decode). */
#define SPREAD_PREFETCH(CACHE, TC, c)                                                               \
    const char *pf_ = NULL;                                                                         \
    if (block_size % VW == 0 && nk * hd == row) {                                                   \
        if ((c) + VW <= n) pf_ = (const char *)((CACHE) + TOKEN_ROW(c));                           \
    } else PREFETCH_CHUNK(CACHE, TC, c)
#define PF_SLICE (pf_ && j0 == 0 ? pf_ + hh * VW * pfl * 64 : NULL)

/* KV heads h0 .. h0 + nk of one sequence, g query heads each: the scores of every head (keys a
 * chunk of VW at a time, and per chunk every KV head and every group of its query heads, so that
 * a block of the cache, each token's rows of all KV heads, is read whole and in order), the
 * softmax over each head's scores (one max, exp_vec, one sum: no rescaling), then the values in
 * the same order. K and V are read once, straight from the cache. Keys t0 .. n: the whole
 * context (t0 0, `part` NULL: the result normalized into `out`), or a split of it (`part`: per
 * query head its unnormalized sums, then their max score and softmax sum, hd + 2 floats, for the
 * caller to merge). `st`: per-thread state, nk g (2 hd + Lp + 2) floats, Lp = n - t0 rounded up
 * to VW. 64 SmolLM2 sequences at ~190 tokens, bf16,
 * 2-core AMX Xeon: 0.81 ms a layer before (K and V widened into float32 scratch first, then per
 * query head a dot product per key with a horizontal sum in scalar adds). */
#define DEFINE_ATTEND_HEADS(NAME, T, LOAD, STORE, TC, SCORES, VALUES)                                \
static inline __attribute__((always_inline)) void NAME(                                             \
        const T *q, const TC *k_cache, const TC *v_cache, const int32_t *table, int64_t t0, int64_t n, \
        T *out, float *part, int64_t kvh, int64_t h0, int64_t nk, int64_t g, const int64_t hd,       \
        int64_t block_size, float scale, float *st) {                                               \
    const int64_t NH = nk * g, row = kvh * hd, Lp = (n - t0 + VW - 1) / VW * VW;                    \
    const int64_t pfl = (hd * (int64_t)sizeof(TC) + 63) / 64;  /* cache lines of a key's head row */ \
    float *qf = st, *acc = qf + NH * hd, *p = acc + NH * hd;                                        \
    if (n <= t0) {                              /* an empty split: nothing to add */               \
        for (int64_t j = 0; j < NH; j++) {                                                          \
            memset(part + j * (hd + 2), 0, sizeof(float) * (size_t)(hd + 2));                       \
            part[j * (hd + 2) + hd] = -FLT_MAX;                                                     \
        }                                                                                           \
        return;                                                                                     \
    }                                                                                               \
    for (int64_t j = 0; j < NH; j++) {                                                              \
        LOAD(q + j * hd, qf + j * hd, hd);                                                          \
        memset(acc + j * hd, 0, sizeof(float) * (size_t)hd);                                        \
    }                                                                                               \
    int64_t rows[VW];                                                                               \
    for (int64_t c = t0; c < t0 + PF_DIST * VW; c += VW) PREFETCH_CHUNK(k_cache, TC, c)              \
    for (int64_t c = t0; c < n; c += VW) {                                                          \
        const int64_t cnt = n - c < VW ? n - c : VW;                                                \
        CHUNK_ROWS(c, cnt)                                                                          \
        SPREAD_PREFETCH(k_cache, TC, c + PF_DIST * VW)                                               \
        FOR_GROUPS(SCORES(k_cache, rows, cnt, hoff, jn, hd, scale, qf + j * hd, p + j * Lp + c - t0, Lp, \
                          PF_SLICE, pfl))                                                           \
    }                                                                                               \
    float *z = p + NH * Lp, *mv = z + NH;                                                           \
    for (int64_t c = t0; c < t0 + PF_DIST * VW; c += VW) PREFETCH_CHUNK(v_cache, TC, c)              \
    for (int64_t j = 0; j < NH; j++) {                                                              \
        float *pj = p + j * Lp, m = -FLT_MAX, zs = 0.f;                                             \
        for (int64_t t = 0; t < n - t0; t++) m = pj[t] > m ? pj[t] : m;                             \
        for (int64_t t = n - t0; t < Lp; t++) pj[t] = -FLT_MAX;                                     \
        for (int64_t c = 0; c < Lp; c += VW) {                                                      \
            const vec e = exp_vec(*(const vec *)(pj + c) - m);                                      \
            *(vec *)(pj + c) = e;                                                                   \
        }                                                                                           \
        for (int64_t t = 0; t < n - t0; t++) zs += pj[t];                                           \
        z[j] = zs;                                                                                  \
        mv[j] = m;                                                                                  \
    }                                                                                               \
    for (int64_t c = t0; c < n; c += VW) {                                                          \
        const int64_t cnt = n - c < VW ? n - c : VW;                                                \
        CHUNK_ROWS(c, cnt)                                                                          \
        SPREAD_PREFETCH(v_cache, TC, c + PF_DIST * VW)                                               \
        FOR_GROUPS(VALUES(v_cache, rows, cnt, hoff, jn, hd, p + j * Lp + c - t0, Lp, acc + j * hd, PF_SLICE, pfl)) \
    }                                                                                               \
    for (int64_t j = 0; j < NH; j++) {                                                              \
        if (part) {                  /* a split of the keys: unnormalized, with its max and sum */  \
            memcpy(part + j * (hd + 2), acc + j * hd, sizeof(float) * (size_t)hd);                  \
            part[j * (hd + 2) + hd] = mv[j];                                                        \
            part[j * (hd + 2) + hd + 1] = z[j];                                                     \
            continue;                                                                               \
        }                                                                                           \
        const float inv = z[j] > 0.f ? 1.f / z[j] : 0.f;                                            \
        for (int64_t i = 0; i < hd; i++) acc[j * hd + i] *= inv;                                    \
        STORE(out + j * hd, acc + j * hd, hd);                                                      \
    }                                                                                               \
}

/* returns 0, or a negative code: -1 a shape past MAX_G / MAX_HD, -2 out of memory.
 * Tasks: a whole sequence (all its KV heads) where there are sequences enough for the threads;
 * fewer sequences than twice the threads, with SPLIT_MIN_KEYS keys or more, each one's keys in
 * splits of whole 16-key runs (at least 2 x threads tasks in all), still all its KV heads a task,
 * merged after (flash-decoding: the splits' sums rescaled to the largest max); else one
 * (sequence, KV head), so that a few short sequences still use every thread (one thread: a
 * sequence a task, never split). A task reads whole token rows of the cache (all KV heads): one
 * long sequence from memory was 1.1-1.3x faster than with a task per (KV head, split) striding
 * over a third of each row (2 AVX2 cores, float16 cache). One sequence of 1,900 tokens, fp32,
 * 2 AVX2 cores: BENCHMARKS.md ("RAG-sized prompt"). */
#define DEFINE_KERNEL(NAME, ATTEND, ATTEND_HEADS, T, STORE, TC)                                      \
int NAME(const T *q, const TC *k_cache, const TC *v_cache, const int32_t *block_tables,             \
         int64_t bt_stride, const int32_t *context_lens, T *out, int64_t num_seqs, int64_t nh,       \
         int64_t kvh, int64_t hd, int64_t block_size, float scale, int num_threads) {                \
    const int64_t g = nh / kvh;                                                                     \
    if (g > MAX_G || hd > MAX_HD || g * kvh != nh) return -1;                                       \
    const int vec_path = hd >= 2 * VW && hd % (2 * VW) == 0;                                        \
    int64_t max_n = 0;                                                                              \
    for (int64_t s = 0; s < num_seqs; s++) max_n = context_lens[s] > max_n ? context_lens[s] : max_n; \
    const int split = vec_path && num_threads > 1 && num_seqs < 2 * num_threads && max_n >= SPLIT_MIN_KEYS; \
    const int64_t per = vec_path && (num_seqs >= 2 * num_threads || split || num_threads == 1) ? kvh : 1; \
    const int64_t tasks = kvh / per;                                                                \
    int64_t S = split ? (2 * num_threads + num_seqs - 1) / num_seqs : 1;                            \
    float *parts = S > 1 ? (float *)malloc(sizeof(float) * (size_t)(num_seqs * nh * S * (hd + 2))) : NULL; \
    if (!parts) S = 1;                                                                              \
    const int64_t Lp = (max_n + VW - 1) / VW * VW;                                                  \
    int failed = 0;                                                                                 \
    _Pragma("omp parallel num_threads(num_threads)")                                                \
    {                                                                                               \
        float *st = vec_path ? (float *)malloc(sizeof(float) * (size_t)((2 * hd + Lp + 2) * per * g)) : NULL; \
        _Pragma("omp for collapse(3) schedule(dynamic, 1)")                                         \
        for (int64_t s = 0; s < num_seqs; s++) {                                                    \
            for (int64_t k = 0; k < tasks; k++) {                                                   \
                for (int64_t sp = 0; sp < S; sp++) {                                                \
                    const int64_t h = k * per;                                                      \
                    const T *qs = q + (s * nh + h * g) * hd;                                        \
                    T *os = out + (s * nh + h * g) * hd;                                            \
                    const int32_t *table = block_tables + s * bt_stride;                            \
                    const int64_t n = context_lens[s], span = ((n + S - 1) / S + 15) & ~(int64_t)15; \
                    const int64_t t0 = sp * span < n ? sp * span : n, t1 = t0 + span < n ? t0 + span : n; \
                    float *part = S > 1 ? parts + ((s * tasks + k) * S + sp) * per * g * (hd + 2) : NULL; \
                    int rc = 0;                                                                     \
                    if (st && hd == 64)                                                             \
                        ATTEND_HEADS(qs, k_cache, v_cache, table, t0, t1, os, part, kvh, h, per, g, 64, block_size, scale, st); \
                    else if (st && hd == 128)                                                       \
                        ATTEND_HEADS(qs, k_cache, v_cache, table, t0, t1, os, part, kvh, h, per, g, 128, block_size, scale, st); \
                    else if (st)                                                                    \
                        ATTEND_HEADS(qs, k_cache, v_cache, table, t0, t1, os, part, kvh, h, per, g, hd, block_size, scale, st); \
                    else if (!part)           /* head sizes the vectors do not fit, or no state */ \
                        for (int64_t hh = h; hh < h + per && !rc; hh++)                            \
                            rc = ATTEND(q + (s * nh + hh * g) * hd, k_cache, v_cache, table, n,      \
                                        out + (s * nh + hh * g) * hd, kvh, hh, g, hd, block_size, scale); \
                    else                                                                            \
                        rc = -2;                                                                    \
                    if (rc) failed = 1;                                                             \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        if (S > 1) {                       /* each query head: its splits, rescaled to one max */  \
            _Pragma("omp for collapse(2) schedule(static)")                                         \
            for (int64_t s = 0; s < num_seqs; s++) {                                                \
                for (int64_t jh = 0; jh < nh; jh++) {                                               \
                    const int64_t k = jh / (per * g), jl = jh - k * per * g;                        \
                    const float *p0 = parts + ((s * tasks + k) * S * per * g + jl) * (hd + 2);       \
                    const int64_t step = per * g * (hd + 2);     /* from one split to the next */   \
                    float m = -FLT_MAX, zsum = 0.f, o[MAX_HD];                                      \
                    for (int64_t sp = 0; sp < S; sp++) m = p0[sp * step + hd] > m ? p0[sp * step + hd] : m; \
                    for (int64_t i = 0; i < hd; i++) o[i] = 0.f;                                    \
                    for (int64_t sp = 0; sp < S; sp++) {                                            \
                        const float *ps = p0 + sp * step;                                           \
                        if (ps[hd + 1] <= 0.f) continue;                  /* an empty split */     \
                        const float w = expf(ps[hd] - m);                                           \
                        zsum += w * ps[hd + 1];                                                     \
                        for (int64_t i = 0; i < hd; i++) o[i] += w * ps[i];                         \
                    }                                                                               \
                    const float inv = zsum > 0.f ? 1.f / zsum : 0.f;                                \
                    for (int64_t i = 0; i < hd; i++) o[i] *= inv;                                   \
                    STORE(out + (s * nh + jh) * hd, o, hd);                                         \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        free(st);                                                                                   \
    }                                                                                               \
    free(parts);                                                                                    \
    return failed ? -2 : 0;                                                                         \
}


DEFINE_ATTEND(attend_f32, float, load_f32, store_f32, float, load_f32)
DEFINE_ATTEND(attend_bf16, uint16_t, load_bf16, store_bf16, uint16_t, load_bf16)
DEFINE_ATTEND(attend_f32_kvbf16, float, load_f32, store_f32, uint16_t, load_bf16)
DEFINE_ATTEND(attend_f32_kvf16, float, load_f32, store_f32, uint16_t, load_f16)
DEFINE_ATTEND_CHUNK(attend_scores_f32, attend_values_f32, float, f32_vec)
DEFINE_ATTEND_CHUNK(attend_scores_bf16, attend_values_bf16, uint16_t, bf16_vec)
DEFINE_ATTEND_CHUNK(attend_scores_f16, attend_values_f16, uint16_t, f16_vec)
DEFINE_ATTEND_HEADS(attend_heads_f32, float, load_f32, store_f32, float, attend_scores_f32, attend_values_f32)
DEFINE_ATTEND_HEADS(attend_heads_bf16, uint16_t, load_bf16, store_bf16, uint16_t, attend_scores_bf16, attend_values_bf16)
DEFINE_ATTEND_HEADS(attend_heads_f32_kvbf16, float, load_f32, store_f32, uint16_t, attend_scores_bf16, attend_values_bf16)
DEFINE_ATTEND_HEADS(attend_heads_f32_kvf16, float, load_f32, store_f32, uint16_t, attend_scores_f16, attend_values_f16)
DEFINE_KERNEL(paged_decode_attention_f32, attend_f32, attend_heads_f32, float, store_f32, float)
DEFINE_KERNEL(paged_decode_attention_bf16, attend_bf16, attend_heads_bf16, uint16_t, store_bf16, uint16_t)
/* float32 activations over a 16-bit cache (`--kv-cache-dtype bfloat16|float16` for a float32
 * decoder): half the bytes per key, each row widened in registers as it is read */
DEFINE_KERNEL(paged_decode_attention_f32_kvbf16, attend_f32_kvbf16, attend_heads_f32_kvbf16, float, store_f32, uint16_t)
DEFINE_KERNEL(paged_decode_attention_f32_kvf16, attend_f32_kvf16, attend_heads_f32_kvf16, float, store_f32, uint16_t)
/* the floats per vector of this build's decode attention (16: the AVX-512 layout, 8: AVX2's) */
int decode_vector_width(void) { return VW; }

/* kernels/avx512_emulated.c builds the decode attention above and the weight-only int8 linear
 * below in their AVX-512 code on a CPU without AVX-512 (tests/test_cpu_attention.py,
 * tests/test_decode_int8.py): what lies between them, and the decode step after, is not part of
 * that build */
#ifndef EMBEDSERVE_EMULATED_AVX512
/* ---------------------------------------------------------------------------------------------
 * Encoder attention over packed sequences (no padding, no mask): qkv [T, 3 * nh * hd] holds each
 * token's q | k | v, sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1]; out [T, nh * hd];
 * hd a multiple of 16, at most 64. Per (sequence, head): K transposed to [hd, L] in float32, then
 * register-blocked: R query rows x 16 keys of scores per pass over hd (one K load feeds R FMAs,
 * no horizontal sums; R = 8 with AVX-512, 4 with AVX2: 8 independent accumulators either way,
 * which two FMA pipes of 4 cycles' latency need), softmax, and the values summed into R rows x hd
 * accumulators. GCC vector extensions (16 floats), so it builds on AVX2-only CPUs as well.
 */
#define NU (16 / VW)
#if VW == 16          /* 8 independent accumulators either way: 8 rows x 1 zmm, or 4 rows x 2 ymm */
#define R 8
#else
#define R 4
#endif

/* K of one (sequence, head) transposed for the score loop: kt[d * Lp + j] = K[j][d] as float, zero
 * for L <= j < Lp; `k` points at key 0's head slice, `row` elements apart. A vector gather takes VW
 * keys' element d (bf16: the 32-bit word holding elements 2p and 2p + 1, split by a shift and a
 * mask) where a scalar loop spent ~3 instructions per element: at the encoder's short sequences
 * that transpose was most of the kernel (profile: 2.6 us per (sequence, head) at 16 tokens). */
#if defined(__AVX512F__)
/* lanes j < n of 16 (none for n <= 0) */
static inline __mmask16 lanes16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u); }

static inline __m512i gather_index(int64_t stride) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)stride));
}
static inline void k_transpose_f32(const float *k, int64_t row, int64_t L, int64_t Lp, int64_t HD, float *kt) {
    const __m512i idx = gather_index(row);
    for (int64_t c = 0; c < Lp; c += 16) {
        const __mmask16 m = lanes16(L - c);
        const float *base = k + c * row;
        for (int64_t d = 0; d < HD; d++)
            _mm512_storeu_ps(kt + d * Lp + c, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, base + d, 4));
    }
}
static inline void k_transpose_bf16(const uint16_t *k, int64_t row, int64_t L, int64_t Lp, int64_t HD, float *kt) {
    const __m512i idx = gather_index(row / 2), hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t c = 0; c < Lp; c += 16) {
        const __mmask16 m = lanes16(L - c);
        const int *base = (const int *)(k + c * row);
        for (int64_t p = 0; p < HD / 2; p++) {
            const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + p, 4);
            _mm512_storeu_ps(kt + 2 * p * Lp + c, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
            _mm512_storeu_ps(kt + (2 * p + 1) * Lp + c, _mm512_castsi512_ps(_mm512_and_si512(w, hi)));
        }
    }
}
#elif defined(__AVX2__)
static inline __m256i gather_index(int64_t stride) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)stride));
}
static inline __m256i lanes_below(int64_t n) {     /* all-ones in lanes j < n */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline void k_transpose_f32(const float *k, int64_t row, int64_t L, int64_t Lp, int64_t HD, float *kt) {
    const __m256i idx = gather_index(row);
    for (int64_t c = 0; c < Lp; c += 8) {
        const __m256 m = _mm256_castsi256_ps(lanes_below(L - c));
        const float *base = k + c * row;
        for (int64_t d = 0; d < HD; d++)
            _mm256_storeu_ps(kt + d * Lp + c, _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base + d, idx, m, 4));
    }
}
static inline void k_transpose_bf16(const uint16_t *k, int64_t row, int64_t L, int64_t Lp, int64_t HD, float *kt) {
    const __m256i idx = gather_index(row / 2), hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t c = 0; c < Lp; c += 8) {
        const __m256i m = lanes_below(L - c);
        const int *base = (const int *)(k + c * row);
        for (int64_t p = 0; p < HD / 2; p++) {
            const __m256i w = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), base + p, idx, m, 4);
            _mm256_storeu_ps(kt + 2 * p * Lp + c, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            _mm256_storeu_ps(kt + (2 * p + 1) * Lp + c, _mm256_castsi256_ps(_mm256_and_si256(w, hi)));
        }
    }
}
#else
static inline void k_transpose_f32(const float *k, int64_t row, int64_t L, int64_t Lp, int64_t HD, float *kt) {
    for (int64_t j = 0; j < Lp; j++)
        for (int64_t d = 0; d < HD; d++) kt[d * Lp + j] = j < L ? k[j * row + d] : 0.f;
}
static inline void k_transpose_bf16(const uint16_t *k, int64_t row, int64_t L, int64_t Lp, int64_t HD, float *kt) {
    for (int64_t j = 0; j < Lp; j++)
        for (int64_t d = 0; d < HD; d++) kt[d * Lp + j] = j < L ? bf16_to_f32(k[j * row + d]) : 0.f;
}
#endif

#define DEFINE_HEAD(NAME, T, LOAD, STORE, KT)                                                             \
static inline __attribute__((always_inline)) void NAME(const T *qkv, T *out, int64_t start, int64_t L, \
        int64_t h, int64_t nh, const int64_t HD, float scale, float *buf) {                          \
    const int64_t H = nh * HD, row = 3 * H, Lp = (L + 15) / 16 * 16;                                \
    float *kt = buf, *v = kt + HD * Lp, *s = v + L * HD;                                            \
    KT(qkv + start * row + H + h * HD, row, L, Lp, HD, kt);                                         \
    for (int64_t j = 0; j < L; j++) LOAD(qkv + (start + j) * row + 2 * H + h * HD, v + j * HD, HD); \
    for (int64_t i0 = 0; i0 < L; i0 += R) {                                                         \
        const int64_t nr = L - i0 < R ? L - i0 : R;                                                 \
        float q[R][64];                                                                             \
        for (int64_t r = 0; r < R; r++) {                                                           \
            if (r < nr) { LOAD(qkv + (start + i0 + r) * row + h * HD, q[r], HD);                    \
                          for (int64_t d = 0; d < HD; d++) q[r][d] *= scale; }                      \
            else memset(q[r], 0, sizeof(q[r]));                                                     \
        }                                                                                           \
        for (int64_t c = 0; c < Lp; c += 16) {                    /* scores, R rows x 16 keys */   \
            vec a[R][NU];                                                                           \
            for (int r = 0; r < R; r++) for (int u = 0; u < NU; u++) a[r][u] = (vec){0};            \
            for (int64_t d = 0; d < HD; d++) {                                                      \
                vec kv[NU];                                                                         \
                for (int u = 0; u < NU; u++) kv[u] = *(const vec *)(kt + d * Lp + c + u * VW);      \
                for (int r = 0; r < R; r++) for (int u = 0; u < NU; u++) a[r][u] += q[r][d] * kv[u]; \
            }                                                                                       \
            for (int r = 0; r < R; r++) for (int u = 0; u < NU; u++)                                \
                *(vec *)(s + r * Lp + c + u * VW) = a[r][u];                                        \
        }                                                                                           \
        float inv[R];                                                                               \
        for (int64_t r = 0; r < R; r++) {                         /* softmax over the L real keys */ \
            float *sr = s + r * Lp, m = -FLT_MAX, z = 0.f;                                          \
            for (int64_t j = 0; j < L; j++) m = sr[j] > m ? sr[j] : m;                              \
            for (int64_t j = 0; j < L; j++) { sr[j] = expf(sr[j] - m); z += sr[j]; }                \
            inv[r] = 1.f / z;                                                                       \
        }                                                                                           \
        float res[R][64];                                                                           \
        for (int64_t k0 = 0; k0 < HD; k0 += VCHUNK) {             /* values: R rows x VCHUNK */    \
            const int64_t nv = (HD - k0 < VCHUNK ? HD - k0 : VCHUNK) / VW;                          \
            vec o[R][VCHUNK / VW];                                                                  \
            for (int r = 0; r < R; r++) for (int k = 0; k < VCHUNK / VW; k++) o[r][k] = (vec){0};   \
            for (int64_t j = 0; j < L; j++) {                                                       \
                const float *vj = v + j * HD + k0;                                                  \
                for (int64_t k = 0; k < nv; k++) {                                                  \
                    const vec vv = *(const vec *)(vj + VW * k);                                     \
                    for (int r = 0; r < R; r++) o[r][k] += s[r * Lp + j] * vv;                      \
                }                                                                                   \
            }                                                                                       \
            for (int r = 0; r < R; r++) for (int64_t k = 0; k < nv; k++) {                          \
                vec t = o[r][k] * inv[r];                                                           \
                memcpy(res[r] + k0 + VW * k, &t, sizeof(t));                                        \
            }                                                                                       \
        }                                                                                           \
        for (int64_t r = 0; r < nr; r++) STORE(out + (start + i0 + r) * H + h * HD, res[r], HD);    \
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

DEFINE_HEAD(varlen_head_f32, float, load_f32, store_f32, k_transpose_f32)
DEFINE_HEAD(varlen_head_bf16, uint16_t, load_bf16, store_bf16, k_transpose_bf16)
DEFINE_VARLEN(varlen_attention_f32, varlen_head_f32, float)
DEFINE_VARLEN(varlen_attention_bf16, varlen_head_bf16, uint16_t)

/* ------------------------------------------------------------ encoder attention on AMX tiles
 * The varlen kernel's contract for bf16 q/k/v with head_dim 32 or 64, where the compiler targets
 * AMX-BF16 (Intel Xeon from Sapphire Rapids): the scores (Q K^T) and the values' sum (P V) are
 * tile products, each tdpbf16ps a 16 x 16 x 32 block with float32 sums; the softmax runs in
 * float32 vectors between them. The probabilities enter P V rounded to bf16 (as SDPA's bf16
 * path does) and are normalized by the sum of those rounded values.
 *
 *   scores, per 16 query rows:  Q [16 x hd] (tile 1, and 3 for hd 64: read in place, rows 3H
 *                               apart) x K^T [hd x 16 keys] (tile 2: K's 32-bit bf16 pairs, gathered)
 *                               -> tile 0 [16 x 16] float32, stored into s [16 x L32]
 *   values:                     P [16 x 32 keys] (tile 1, bf16) x V [32 keys x 16 dims] (tiles
 *                               2, 3: key pairs interleaved) -> tiles 4..7 [16 x 16] float32
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_tilecfg;

/* 1 where this process may use AMX tiles: Linux hands out their state only on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once per process */
int amx_available(void) {
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

/* e^x for x <= 0 in float32 (softmax terms, rounded to bf16 after): 2^n e^r with n = round(x / ln 2),
 * r = x - n ln 2 (in two parts), e^r by its Taylor series to r^6 (|r| <= ln 2 / 2: error < 2e-7) */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __attribute__((always_inline)) void amx_head(const uint16_t *qkv, uint16_t *out, int64_t start,
        int64_t L, int64_t h, int64_t nh, const int64_t HD, float scale, char *buf) {
    const int64_t H = nh * HD, row = 3 * H, L16 = (L + 15) / 16 * 16, L32 = (L + 31) / 32 * 32;
    uint32_t *kb = (uint32_t *)buf;                       /* [L16 / 16][HD / 2][16]: K^T in bf16 pairs */
    uint16_t *vb = (uint16_t *)(kb + L16 * HD / 2);       /* [L32 / 32][HD / 16][16 pairs][32]: V */
    float *s = (float *)(vb + L32 * HD);                  /* [16][L32] scores */
    uint16_t *pb = (uint16_t *)(s + 16 * L32);            /* [16][L32] probabilities, bf16 */
    float *o = (float *)(pb + 16 * L32);                  /* [16][HD] a row block's P V */
    uint16_t *qp = (uint16_t *)(o + 16 * HD);             /* [16][HD] a short row block's queries */
    const uint16_t *k = qkv + start * row + H + h * HD, *v = k + H, *q = k - H;
    /* K^T: 16 keys' 32-bit pair p per gather, zero past the last key */
    const __m512i idx = gather_index(row / 2);
    for (int64_t c = 0; c < L16; c += 16) {
        const __mmask16 m = lanes16(L - c);
        const int *base = (const int *)(k + c * row);
        for (int64_t p = 0; p < HD / 2; p++)
            _mm512_storeu_si512(kb + (c / 16 * (HD / 2) + p) * 16,
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + p, 4));
    }
    /* V: keys j, j + 1 interleaved per 16-dim block: row (j / 2) of the block = v[j][d], v[j + 1][d], ... */
    uint16_t perm[2][32];
    for (int e = 0; e < 2; e++) for (int i = 0; i < 16; i++) { perm[e][2 * i] = (uint16_t)(16 * e + i);
                                                               perm[e][2 * i + 1] = (uint16_t)(32 + 16 * e + i); }
    const __m512i p0 = _mm512_loadu_si512(perm[0]), p1 = _mm512_loadu_si512(perm[1]);
    for (int64_t j = 0; j < L32; j += 2) {
        for (int64_t half = 0; half < HD / 32; half++) {
            const __m512i a = j < L ? _mm512_loadu_si512(v + j * row + 32 * half) : _mm512_setzero_si512();
            const __m512i b = j + 1 < L ? _mm512_loadu_si512(v + (j + 1) * row + 32 * half) : _mm512_setzero_si512();
            uint16_t *dst = vb + ((j / 32) * (HD / 16) + 2 * half) * 512 + (j % 32) / 2 * 32;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, p0, b));
            _mm512_storeu_si512(dst + 512, _mm512_permutex2var_epi16(a, p1, b));
        }
    }
    for (int64_t i0 = 0; i0 < L; i0 += 16) {
        const int64_t nr = L - i0 < 16 ? L - i0 : 16;
        const uint16_t *qs = q + i0 * row;
        int64_t qstride = row * 2;
        if (nr < 16) {                                    /* no reads past the sequence's rows */
            memset(qp, 0, 16 * HD * 2);
            for (int64_t r = 0; r < nr; r++) memcpy(qp + r * HD, qs + r * row, HD * 2);
            qs = qp;
            qstride = HD * 2;
        }
        _tile_loadd(1, qs, qstride);
        if (HD == 64) _tile_loadd(3, qs + 32, qstride);
        for (int64_t c = 0; c < L16; c += 32) {          /* two key blocks at a time: tiles 0 and 4 */
            const uint32_t *k0 = kb + c / 16 * (HD / 2) * 16, *k1 = k0 + HD / 2 * 16;
            const int two = c + 16 < L16;
            _tile_zero(0);
            _tile_loadd(2, k0, 64);
            _tile_dpbf16ps(0, 1, 2);
            if (two) { _tile_zero(4); _tile_loadd(5, k1, 64); _tile_dpbf16ps(4, 1, 5); }
            if (HD == 64) {
                _tile_loadd(2, k0 + 256, 64);
                _tile_dpbf16ps(0, 3, 2);
                if (two) { _tile_loadd(5, k1 + 256, 64); _tile_dpbf16ps(4, 3, 5); }
            }
            _tile_stored(0, s + c, L32 * 4);
            if (two) _tile_stored(4, s + c + 16, L32 * 4);
        }
        float inv[16];
        for (int64_t r = 0; r < 16; r++) {                /* softmax over the L real keys */
            const float *sr = s + r * L32;
            uint16_t *pr = pb + r * L32;
            if (r >= nr) { memset(pr, 0, L32 * 2); inv[r] = 0.f; continue; }
            __m512 vm = _mm512_set1_ps(-FLT_MAX), vz = _mm512_setzero_ps();
            for (int64_t j = 0; j < L; j += 16)
                vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(vm, lanes16(L - j), sr + j));
            const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm) * scale), sc = _mm512_set1_ps(scale);
            for (int64_t j = 0; j < L32; j += 16) {       /* zeros past the last key */
                const __mmask16 m = lanes16(L - j);
                const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, sr + j), sc, mx)));
                const __m256i b = (__m256i)_mm512_cvtneps_pbh(e);          /* round to nearest even */
                _mm256_storeu_si256((__m256i *)(pr + j), b);
                vz = _mm512_add_ps(vz, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
            }
            inv[r] = 1.f / _mm512_reduce_add_ps(vz);
        }
        _tile_zero(4); _tile_zero(5);
        if (HD == 64) { _tile_zero(6); _tile_zero(7); }
        for (int64_t kc = 0; kc < L32; kc += 32) {
            const uint16_t *vk = vb + (kc / 32) * (HD / 16) * 512;
            _tile_loadd(1, pb + kc, L32 * 2);
            _tile_loadd(2, vk, 64);
            _tile_dpbf16ps(4, 1, 2);
            _tile_loadd(3, vk + 512, 64);
            _tile_dpbf16ps(5, 1, 3);
            if (HD == 64) {
                _tile_loadd(2, vk + 1024, 64);
                _tile_dpbf16ps(6, 1, 2);
                _tile_loadd(3, vk + 1536, 64);
                _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, o, HD * 4);
        _tile_stored(5, o + 16, HD * 4);
        if (HD == 64) { _tile_stored(6, o + 32, HD * 4); _tile_stored(7, o + 48, HD * 4); }
        for (int64_t r = 0; r < nr; r++) {
            uint16_t *dst = out + (start + i0 + r) * H + h * HD;
            for (int64_t d = 0; d < HD; d++) dst[d] = f32_to_bf16(o[r * HD + d] * inv[r]);
        }
    }
}

int varlen_attention_bf16_amx(const uint16_t *qkv, uint16_t *out, const int32_t *cu, int64_t num_seqs,
                              int64_t nh, int64_t hd, float scale, int num_threads) {
    if ((hd != 32 && hd != 64) || !amx_available()) return -1;
    int64_t lmax = 0;
    for (int64_t b = 0; b < num_seqs; b++) lmax = cu[b + 1] - cu[b] > lmax ? cu[b + 1] - cu[b] : lmax;
    const int64_t L16 = (lmax + 15) / 16 * 16, L32 = (lmax + 31) / 32 * 32;
    const size_t bytes = (size_t)(L16 * hd * 2 + L32 * hd * 2 + 16 * L32 * 4 + 16 * L32 * 2 + 16 * hd * 4
                                  + 16 * hd * 2 + 63) / 64 * 64;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        amx_tilecfg cfg;                                  /* every tile 16 rows x 64 bytes */
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
        _tile_loadconfig(&cfg);
        char *buf = (char *)aligned_alloc(64, bytes);     /* this thread's scratch, for the longest sequence */
        if (!buf) failed = 1;
        _Pragma("omp for collapse(2) schedule(dynamic, 1)")
        for (int64_t b = 0; b < num_seqs; b++) {
            for (int64_t h = 0; h < nh; h++) {
                const int64_t L = cu[b + 1] - cu[b];
                if (L <= 0 || !buf) continue;
                if (hd == 32) amx_head(qkv, out, cu[b], L, h, nh, 32, scale, buf);
                else amx_head(qkv, out, cu[b], L, h, nh, 64, scale, buf);
            }
        }
        free(buf);
        _tile_release();
    }
    return failed ? -2 : 0;
}
#else
int amx_available(void) { return 0; }
int varlen_attention_bf16_amx(const uint16_t *qkv, uint16_t *out, const int32_t *cu, int64_t num_seqs,
                              int64_t nh, int64_t hd, float scale, int num_threads) {
    (void)qkv; (void)out; (void)cu; (void)num_seqs; (void)nh; (void)hd; (void)scale; (void)num_threads;
    return -1;
}
#endif

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
/* the same VW at a time: round_vec_* rounds to T (bf16: to nearest even, NaN kept a NaN) and
 * stays a float; store_vec_* writes a rounded vector as T */
static inline vec round_vec_f32(vec v) { return v; }
static inline vec round_vec_bf16(vec v) {
    uvec u;
    memcpy(&u, &v, sizeof u);
    const uvec r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u, nan = (u | 0x400000u) & 0xffff0000u;
    const uvec isnan = (uvec)((u & 0x7fffffffu) > 0x7f800000u);
    const uvec out = (nan & isnan) | (r & ~isnan);
    memcpy(&v, &out, sizeof v);
    return v;
}
static inline void store_vec_f32(float *p, vec v) { memcpy(p, &v, sizeof v); }
static inline void store_vec_bf16(uint16_t *p, vec v) {
    uvec u;
    memcpy(&u, &v, sizeof u);
    const hvec h = __builtin_convertvector(u >> 16, hvec);
    memcpy(p, &h, sizeof h);
}

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

/* ---------------------------------------------------------------------------------------------
 * The decoder's glue between its matmuls, one call each instead of 4-12 torch ops (at one to a
 * few dozen rows per decode step, torch's per-op dispatch costs more than the arithmetic):
 *
 *   rms_norm:     [x <- x + r;]  out = round(round(x * rstd) * w)     (HF's order; r may be NULL)
 *   rope_store:   q_out = rope(q); k_cache[slot] = rope(k); v_cache[slot] = v   (rotate-half)
 *   silu_mul:     out = round(round(silu(g)) * u) for gu = [g | u]
 *
 * Each step is rounded to T where torch's ops round (bf16), statistics in float32. Products
 * are not contracted into FMAs here, so that fp32 results are torch's to the last bit wherever
 * the math library agrees (rstd in double; expf may differ from torch's by an ulp).
 */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* rows of H a multiple of VW (SmolLM2's 576) in vectors, read and written in place: ~4x the
 * scalar loops' speed at 64 x 576 bf16 (the scalar form held each row in two stack arrays) */
#define DEFINE_RMS(NAME, T, LOAD, STORE, ROUND, VLOAD, VROUND, VSTORE)                                \
int NAME(T *x, const T *r, const T *w, T *out, int64_t rows, int64_t H, float eps, int num_threads) { \
    if (H > MAX_H) return -1;                                                                       \
    float wf[MAX_H];                                                                                \
    LOAD(w, wf, H);                                                                                 \
    if (H % VW == 0) {                                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * H >= 65536)") \
        for (int64_t t = 0; t < rows; t++) {                                                        \
            T *xt = x + t * H;                                                                      \
            vec ss = (vec){0};                                                                      \
            for (int64_t i = 0; i < H; i += VW) {                                                   \
                vec v = VLOAD(xt + i);                                                              \
                if (r) {                                                                            \
                    v = VROUND(v + VLOAD(r + t * H + i));                                           \
                    VSTORE(xt + i, v);                                                              \
                }                                                                                   \
                ss += v * v;                                                                        \
            }                                                                                       \
            const float var = hsum(ss) / (float)H;                                           \
            const float rstd = (float)(1.0 / sqrt((double)(var + eps)));                            \
            for (int64_t i = 0; i < H; i += VW)                                                     \
                VSTORE(out + t * H + i, VROUND(VROUND(VLOAD(xt + i) * rstd) * f32_vec(wf + i)));    \
        }                                                                                           \
        return 0;                                                                                   \
    }                                                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * H >= 65536)")    \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        float v[MAX_H], u[MAX_H];                                                                   \
        LOAD(x + t * H, v, H);                                                                      \
        if (r) {                                                                                    \
            LOAD(r + t * H, u, H);                                                                  \
            for (int64_t i = 0; i < H; i++) v[i] = ROUND(v[i] + u[i]);                              \
            STORE(x + t * H, v, H);                                                                 \
        }                                                                                           \
        float ss = 0.f;                                                                             \
        for (int64_t i = 0; i < H; i++) ss += v[i] * v[i];                                          \
        const float var = ss / (float)H;                                                            \
        const float rstd = (float)(1.0 / sqrt((double)(var + eps)));                                \
        for (int64_t i = 0; i < H; i++) v[i] = ROUND(ROUND(v[i] * rstd) * wf[i]);                   \
        STORE(out + t * H, v, H);                                                                   \
    }                                                                                               \
    return 0;                                                                                       \
}

#define DEFINE_ROPE_STORE(NAME, T, LOAD, STORE, TC, STOREC)                                           \
int NAME(const T *qkv, const float *cos_t, const float *sin_t, TC *k_cache, TC *v_cache,            \
         const int64_t *slots, int64_t num_slots, T *q_out, int64_t rows, int64_t nh, int64_t kvh,    \
         int64_t hd, int num_threads) {                                                             \
    if (hd > MAX_HD || hd % 2) return -1;                                                           \
    for (int64_t t = 0; t < rows; t++) if (slots[t] < 0 || slots[t] >= num_slots) return -3;        \
    const int64_t row = (nh + 2 * kvh) * hd, half = hd / 2;                                         \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows >= 64)")           \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        const float *c = cos_t + t * half, *s = sin_t + t * half;                                   \
        float a[MAX_HD], o[MAX_HD];                                                                 \
        for (int64_t hh = 0; hh < nh + kvh; hh++) {                                                 \
            LOAD(qkv + t * row + hh * hd, a, hd);                                                   \
            for (int64_t i = 0; i < half; i++) {                                                    \
                const float p = a[i] * c[i], q2 = a[i + half] * s[i];                               \
                const float p2 = a[i + half] * c[i], q1 = a[i] * s[i];                              \
                o[i] = p - q2;                                                                      \
                o[i + half] = p2 + q1;                                                              \
            }                                                                                       \
            if (hh < nh) STORE(q_out + (t * nh + hh) * hd, o, hd);                                  \
            else STOREC(k_cache + (slots[t] * kvh + hh - nh) * hd, o, hd);                          \
        }                                                                                           \
        if (sizeof(T) == sizeof(TC))                         /* the cache in the activations' dtype */ \
            memcpy(v_cache + slots[t] * kvh * hd, qkv + t * row + (nh + kvh) * hd, sizeof(T) * (size_t)(kvh * hd)); \
        else                                                                                        \
            for (int64_t i = 0; i < kvh * hd; i += hd) {          /* rounded to the cache's dtype */ \
                LOAD(qkv + t * row + (nh + kvh) * hd + i, a, hd);                                   \
                STOREC(v_cache + slots[t] * kvh * hd + i, a, hd);                                   \
            }                                                                                       \
    }                                                                                               \
    return 0;                                                                                       \
}

/* I a multiple of VW: in vectors, e^-|g| by exp_vec (within 2e-7 of expf), silu(g) = g / (1 + e)
 * for g >= 0 and g e / (1 + e) below (the same value, no overflow); ~3x the scalar loop with
 * libmvec's expf at 64 x 1536 bf16 */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND, VLOAD, VROUND, VSTORE)                           \
int NAME(const T *gu, T *out, int64_t rows, int64_t I, int num_threads) {                            \
    if (I % VW == 0) {                                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * I >= 65536)") \
        for (int64_t t = 0; t < rows; t++)                                                          \
            for (int64_t i = 0; i < I; i += VW) {                                                   \
                const vec g = VLOAD(gu + t * 2 * I + i), u = VLOAD(gu + t * 2 * I + I + i);         \
                const ivec neg = g < 0.f;                                                           \
                const vec mag = (vec)(((ivec)g & ~neg) | ((ivec)((vec){0} - g) & neg));             \
                const vec e = exp_vec((vec){0} - mag);                                              \
                const vec num = (vec)(((ivec)g & ~neg) | ((ivec)(g * e) & neg));                    \
                VSTORE(out + t * I + i, VROUND(VROUND(num / (1.f + e)) * u));                       \
            }                                                                                       \
        return 0;                                                                                   \
    }                                                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * I >= 65536)")    \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        float g[256], u[256];                                                                       \
        for (int64_t i0 = 0; i0 < I; i0 += 256) {                                                   \
            const int64_t n = I - i0 < 256 ? I - i0 : 256;                                          \
            LOAD(gu + t * 2 * I + i0, g, n);                                                        \
            LOAD(gu + t * 2 * I + I + i0, u, n);                                                    \
            for (int64_t i = 0; i < n; i++) g[i] = ROUND(ROUND(g[i] / (1.f + expf(-g[i]))) * u[i]); \
            STORE(out + t * I + i0, g, n);                                                          \
        }                                                                                           \
    }                                                                                               \
    return 0;                                                                                       \
}

DEFINE_RMS(rms_norm_f32, float, load_f32, store_f32, round_f32, f32_vec, round_vec_f32, store_vec_f32)
DEFINE_RMS(rms_norm_bf16, uint16_t, load_bf16, store_bf16, round_bf16, bf16_vec, round_vec_bf16, store_vec_bf16)
DEFINE_ROPE_STORE(rope_store_f32, float, load_f32, store_f32, float, store_f32)
DEFINE_ROPE_STORE(rope_store_bf16, uint16_t, load_bf16, store_bf16, uint16_t, store_bf16)
DEFINE_ROPE_STORE(rope_store_f32_kvbf16, float, load_f32, store_f32, uint16_t, store_bf16)
DEFINE_ROPE_STORE(rope_store_f32_kvf16, float, load_f32, store_f32, uint16_t, store_f16)
DEFINE_SILU_MUL(silu_mul_f32, float, load_f32, store_f32, round_f32, f32_vec, round_vec_f32, store_vec_f32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, load_bf16, store_bf16, round_bf16, bf16_vec, round_vec_bf16, store_vec_bf16)

#pragma GCC pop_options

/* ---------------------------------------------------------------- small-batch linear (fp32)
 * y (M, N) = x (M, K) W^T + b for the few rows of a decode step, W row-major (N, K) as the
 * checkpoint has it. A step of one to a few sequences is bound by reading the weights once: here
 * blocks of 8 weight rows are dot-multiplied with each x row (8 accumulators of VW floats, one x
 * load per 8 FMAs), the block staying in L1/L2 for the next x row; threads take contiguous runs of
 * blocks. oneDNN's packed weights read at ~10.6 GB/s on the 2-core AVX2 EPYC where this reads
 * ~14.7 (SmolLM2's 30 layers + head, cold caches; kernels/cpu_attention.py has the crossover). */
#define WLD(p) (*(const vec *)(p))

static inline float dot_tail(const float *a, const float *b, int64_t k0, int64_t K) {
    float s = 0.f;
    for (int64_t k = k0; k < K; k++) s += a[k] * b[k];
    return s;
}

int gemv_f32(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
             int num_threads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    const int64_t nb = (N + 7) / 8, kv = K - K % VW;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t n0 = blk * 8;
        if (N - n0 >= 8) {
            const float *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K, *w4 = w3 + K,
                        *w5 = w4 + K, *w6 = w5 + K, *w7 = w6 + K;
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * K;
                vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                for (int64_t k = 0; k < kv; k += VW) {
                    const vec xv = WLD(xm + k);
                    a0 += WLD(w0 + k) * xv; a1 += WLD(w1 + k) * xv; a2 += WLD(w2 + k) * xv;
                    a3 += WLD(w3 + k) * xv; a4 += WLD(w4 + k) * xv; a5 += WLD(w5 + k) * xv;
                    a6 += WLD(w6 + k) * xv; a7 += WLD(w7 + k) * xv;
                }
                float *ym = y + m * N + n0;
                ym[0] = hsum(a0) + dot_tail(w0, xm, kv, K); ym[1] = hsum(a1) + dot_tail(w1, xm, kv, K);
                ym[2] = hsum(a2) + dot_tail(w2, xm, kv, K); ym[3] = hsum(a3) + dot_tail(w3, xm, kv, K);
                ym[4] = hsum(a4) + dot_tail(w4, xm, kv, K); ym[5] = hsum(a5) + dot_tail(w5, xm, kv, K);
                ym[6] = hsum(a6) + dot_tail(w6, xm, kv, K); ym[7] = hsum(a7) + dot_tail(w7, xm, kv, K);
                if (b)
                    for (int j = 0; j < 8; j++) ym[j] += b[n0 + j];
            }
        } else {                                       /* the last < 8 rows */
            for (int64_t n = n0; n < N; n++)
                for (int64_t m = 0; m < M; m++) {
                    const float *xm = x + m * K, *wn = w + n * K;
                    vec a = {0};
                    for (int64_t k = 0; k < kv; k += VW) a += WLD(wn + k) * WLD(xm + k);
                    y[m * N + n] = hsum(a) + dot_tail(wn, xm, kv, K) + (b ? b[n] : 0.f);
                }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- small-batch linear (bf16)
 * y (M, N) float32 = x (M, K) W^T + b with x and W bfloat16 (W row-major (N, K)), the products
 * summed in float32: a bf16 decoder's linears for a few rows, reading the weights' bytes once
 * (half of fp32's). With AVX512-BF16 (vdpbf16ps: 32 bf16 products per instruction into 16 float
 * sums) blocks of 8 weight rows are dotted with each x row as gemv_f32 does, K's tail through
 * masked loads; elsewhere the weights are widened to float in registers (exact) and FMA'd. The
 * caller rounds y to bf16 (nearest even) as torch's bf16 matmul rounds its float sums. */
int gemv_bf16_native(void) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define BLD(p, mask) ((__m512bh)_mm512_maskz_loadu_epi16((mask), (p)))
#define BF16_PREFETCH 2048     /* bytes ahead of the row being read */
static inline float dot_bf16_row(const uint16_t *wn, const uint16_t *xm, int64_t K, int64_t kv, __mmask32 tail) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 128 <= kv; k += 128) {
        _mm_prefetch((const char *)(wn + k) + BF16_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(wn + k) + BF16_PREFETCH + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)(wn + k) + BF16_PREFETCH + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)(wn + k) + BF16_PREFETCH + 192, _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, BLD(wn + k, (__mmask32)~0u), BLD(xm + k, (__mmask32)~0u));
        a1 = _mm512_dpbf16_ps(a1, BLD(wn + k + 32, (__mmask32)~0u), BLD(xm + k + 32, (__mmask32)~0u));
        a2 = _mm512_dpbf16_ps(a2, BLD(wn + k + 64, (__mmask32)~0u), BLD(xm + k + 64, (__mmask32)~0u));
        a3 = _mm512_dpbf16_ps(a3, BLD(wn + k + 96, (__mmask32)~0u), BLD(xm + k + 96, (__mmask32)~0u));
    }
    for (; k < kv; k += 32) {
        _mm_prefetch((const char *)(wn + k) + BF16_PREFETCH, _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, BLD(wn + k, (__mmask32)~0u), BLD(xm + k, (__mmask32)~0u));
    }
    if (tail) a1 = _mm512_dpbf16_ps(a1, BLD(wn + kv, tail), BLD(xm + kv, tail));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* four x rows against one weight row: each weight vector loaded once for the four (rows past M
 * repeat the last one; their sums are dropped) */
static inline void dot_bf16_row4(const uint16_t *wn, const uint16_t *const *xs, int64_t kv, __mmask32 tail,
                                 float *s) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < kv; k += 32) {
        if (!(k & 63)) _mm_prefetch((const char *)(wn + k) + BF16_PREFETCH, _MM_HINT_T0);
        const __m512bh wv = BLD(wn + k, (__mmask32)~0u);
        a0 = _mm512_dpbf16_ps(a0, wv, BLD(xs[0] + k, (__mmask32)~0u));
        a1 = _mm512_dpbf16_ps(a1, wv, BLD(xs[1] + k, (__mmask32)~0u));
        a2 = _mm512_dpbf16_ps(a2, wv, BLD(xs[2] + k, (__mmask32)~0u));
        a3 = _mm512_dpbf16_ps(a3, wv, BLD(xs[3] + k, (__mmask32)~0u));
    }
    if (tail) {
        const __m512bh wv = BLD(wn + kv, tail);
        a0 = _mm512_dpbf16_ps(a0, wv, BLD(xs[0] + kv, tail));
        a1 = _mm512_dpbf16_ps(a1, wv, BLD(xs[1] + kv, tail));
        a2 = _mm512_dpbf16_ps(a2, wv, BLD(xs[2] + kv, tail));
        a3 = _mm512_dpbf16_ps(a3, wv, BLD(xs[3] + kv, tail));
    }
    s[0] = _mm512_reduce_add_ps(a0); s[1] = _mm512_reduce_add_ps(a1);
    s[2] = _mm512_reduce_add_ps(a2); s[3] = _mm512_reduce_add_ps(a3);
}

int gemv_bf16(const uint16_t *x, const uint16_t *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
              int num_threads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    const int64_t nb = (N + 7) / 8, kv = K - K % 32;
    const __mmask32 tail = (__mmask32)((1ull << (K % 32)) - 1);
    /* a weight row at a time (one sequential stream per thread, prefetched ahead), dotted with
     * every x row (four at a time) while it sits in L1 */
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t n1 = blk * 8 + 8 < N ? blk * 8 + 8 : N;
        for (int64_t n = blk * 8; n < n1; n++) {
            const float bn = b ? b[n] : 0.f;
            if (M == 1) {
                y[n] = dot_bf16_row(w + n * K, x, K, kv, tail) + bn;
                continue;
            }
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const uint16_t *xs[4];
                float s4[4];
                for (int i = 0; i < 4; i++) xs[i] = x + (m0 + i < M ? m0 + i : M - 1) * K;
                dot_bf16_row4(w + n * K, xs, kv, tail, s4);
                for (int64_t i = 0; i < 4 && m0 + i < M; i++) y[(m0 + i) * N + n] = s4[i] + bn;
            }
        }
    }
    return 0;
}
#else
int gemv_bf16(const uint16_t *x, const uint16_t *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
              int num_threads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    const int64_t kv = K - K % VW;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *xm = x + m * K;
            vec a = {0};
            for (int64_t k = 0; k < kv; k += VW) a += bf16_vec(wn + k) * bf16_vec(xm + k);
            float s = hsum(a);
            for (int64_t k = kv; k < K; k++) s += bf16_to_f32(wn[k]) * bf16_to_f32(xm[k]);
            y[m * N + n] = s + (b ? b[n] : 0.f);
        }
    }
    return 0;
}
#endif

#endif  /* EMBEDSERVE_EMULATED_AVX512 */

/* ---------------------------------------------------------------- weight-only int8 linear
 * y (M, N) = (x (M, K) q^T) * scale + b, q int8 per output channel (w ≈ q[n] * scale[n]), x float32
 * (gemv_w8_f32) or bfloat16 (gemv_w8_bf16), y float32: the decoder's linears with a quarter of fp32's
 * weight bytes. q is stored blocked, [N/8][K/16][8 rows][16 columns] (W8_ROWS x W8_COLS; N and K
 * zero-padded to those multiples by kernels/cpu_attention.pack_w8), so a block of 8 output rows
 * reads one contiguous run of bytes: read row by row, 8 streams each consumed 8 bytes at a time, a
 * float loop ran at 2.7 GB/s per core on the AVX2 EPYC (the prefetchers lose them), blocked it
 * streams. The scale is applied once per output, after the sum. */
#define W8_ROWS 8
#define W8_COLS 16
/* software prefetch this many bytes ahead of the block being read: the hardware prefetchers
 * alone left a one-row loop at ~11.5 GB/s on 2 AVX2 EPYC cores, against ~16 for a plain fp32
 * read; 1,536 bytes (12 column blocks) ahead measured +12 % and +25 % in two interleaved runs
 * (384 to 2,048 bytes all helped). Past the last block it reads ahead harmlessly (no fault). */
#define W8_PREFETCH 1536
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

int w8_layout(void) { return W8_ROWS * 100 + W8_COLS; }     /* what pack_w8 checks it packs for */

/* The arithmetic, in integers: each row of x is scaled by a power of two 2^s (s from its largest
 * |x|: every |x| * 2^s < 2^15) and rounded to int16, so every value within 2^7 of the row's largest
 * (its top 8 binades) keeps bf16's precision or better and every value's error is at most 2^-15 of
 * the row's largest (half a step of 2^(e-15), max < 2^e; 2^-14 for a float32 just under 2^e, held at
 * 2^15 - 1; summed over a row: a ~2^-15 sqrt(K) fraction of x's norm at most, far under
 * the int8 weights' own error); the int8 x int16 products are then summed exactly in int32
 * (AVX512-VNNI vpdpwssd, 32 weights per instruction, or AVX2 vpmaddwd, 16) and
 * y = (float)(sum * scale[n] * 2^-s, in double) + b. Per 32 weights that is one sign-extending
 * load and one dot product where a float loop spends six instructions (widen, convert, FMA per 16),
 * which kept a bf16 step of one sequence under the memory bandwidth (Zen 4: ~21 of 30 GB/s). On 2
 * AVX2 cores against that float loop (CHANGELOG): 1.05x at one row over the layers' weights (both
 * ~25 GB/s, memory-bound), 1.45-1.69x on the cache-resident head, 1.1-2.0x at 2 to 107 rows. The
 * integer sums are the same on every ISA path, so every build gives the same y to the bit.
 * Overflow: |q| <= 127 and |xq| <= 32,767, so a lane's sum of K/8 products stays under 2^31
 * for K-chunks of up to W8I_KC = 4,096 columns; longer rows add the chunks in int64. */
#define W8I_KC 4096
#define W8I_MG 4       /* rows of x per pass over a block (the AVX-512 path: 4 x 4 accumulators) */
/* one row of x (K values, bf16 when xb, else float32 xf) to int16 * 2^-s, s from its largest |x|;
 * a row of zeros has xs 0, a row with an inf or NaN has xs NaN (and zeros), so its outputs come out
 * NaN as a float sum's would. Vectorized on AVX2 (AVX-512 builds too): the largest |x| as an
 * unsigned max of the values' bits, then x * 2^(15-e) in float32 (a power of two: exact while the
 * product is normal) rounded to nearest-even by cvtps, the same integers as the scalar lrint in
 * double; rows whose largest |x| is under 2^-100 (the scale past ~2^115, where a subnormal x could
 * round to 1 and flush-to-zero would matter) keep the scalar loop. */
static void quant_row_i16(const uint16_t *xb, const float *xf, int64_t K, int16_t *qm, double *xs) {
    uint32_t top = 0;          /* the largest |x|'s bits (in this order; inf and NaN above every finite value) */
    int64_t k = 0;
#if defined(__AVX2__)
    if (xb) {
        __m256i mx = _mm256_setzero_si256();
        for (; k + 16 <= K; k += 16)
            mx = _mm256_max_epu16(mx, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xb + k)),
                                                       _mm256_set1_epi16(0x7fff)));
        uint16_t lanes[16];
        _mm256_storeu_si256((__m256i *)lanes, mx);
        for (int i = 0; i < 16; i++) top = (uint32_t)lanes[i] << 16 > top ? (uint32_t)lanes[i] << 16 : top;
    } else {
        __m256i mx = _mm256_setzero_si256();
        for (; k + 8 <= K; k += 8)
            mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xf + k)),
                                                       _mm256_set1_epi32(0x7fffffff)));
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, mx);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    }
#endif
    for (; k < K; k++) {
        uint32_t u;
        if (xb) u = (uint32_t)xb[k] << 16;
        else memcpy(&u, xf + k, sizeof u);
        u &= 0x7fffffffu;
        top = u > top ? u : top;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    if (top >= 0x7f800000u) {         /* inf or NaN: bits, which -ffast-math cannot assume away */
        *xs = NAN;
        for (k = 0; k < K; k++) qm[k] = 0;
        return;
    }
    int e = 0;
    if (amax > 0.f) frexpf(amax, &e);     /* max|x| < 2^e */
    const double mul = amax > 0.f ? ldexp(1.0, 15 - e) : 0.0;       /* double: 2^(15-e) may pass float's range */
    *xs = amax > 0.f ? ldexp(1.0, e - 15) : 0.0;
    k = 0;
#if defined(__AVX2__)
    if (e >= -100) {
        const __m256 mv = _mm256_set1_ps((float)mul);
        const __m256i lo = _mm256_set1_epi16(-32767);
        for (; k + 16 <= K; k += 16) {
            __m256 a, b;
            if (xb) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(xb + k));
                a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
                b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
            } else {
                a = _mm256_loadu_ps(xf + k);
                b = _mm256_loadu_ps(xf + k + 8);
            }
            /* packs saturates 2^15 (a float32 just under 2^e rounds to it) to 2^15 - 1; -2^15 held at -(2^15 - 1) */
            const __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a, mv)),
                                                 _mm256_cvtps_epi32(_mm256_mul_ps(b, mv)));
            _mm256_storeu_si256((__m256i *)(qm + k), _mm256_max_epi16(_mm256_permute4x64_epi64(p, 0xD8), lo));
        }
    }
#endif
    for (; k < K; k++) {       /* a float32 just under 2^e would round to 2^15: held at 2^15 - 1 */
        const long v = lrint((double)(xb ? bf16_to_f32(xb[k]) : xf[k]) * mul);
        qm[k] = (int16_t)(v > 32767 ? 32767 : v < -32767 ? -32767 : v);
    }
}

/* sums (MG x 8 int64) of one 8-row block against MG int16 rows of x, columns [c0, c1) */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define W8I_PATH 2
static inline __attribute__((always_inline)) void w8i_block(const int8_t *base, const int16_t *const *xr, int mg,
                                                            int64_t c0, int64_t c1, int64_t *sums) {
    __m512i acc[W8I_MG][4];
    for (int i = 0; i < W8I_MG; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t c = c0; c < c1; c += W8_COLS) {
        const int8_t *p = base + c * W8_ROWS;
        __builtin_prefetch(p + W8_PREFETCH);
        __builtin_prefetch(p + W8_PREFETCH + 64);
        __m512i w[4];     /* rows 2j and 2j+1, 16 columns each, widened to int16 */
        for (int j = 0; j < 4; j++) w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * j)));
        for (int i = 0; i < W8I_MG; i++) {
            if (i >= mg) break;
            const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xr[i] + c)));
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], w[j], xv);
        }
    }
    for (int i = 0; i < mg; i++)
        for (int j = 0; j < 4; j++) {
            sums[i * 8 + 2 * j] += _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[i][j])));
            sums[i * 8 + 2 * j + 1] += _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[i][j], 1)));
        }
}
#elif defined(__AVX2__)
#define W8I_PATH 1
static inline void w8i_reduce8(__m256i a, int64_t *sum) {     /* one row's 8 int32 lanes into its int64 sum */
    const __m256i w = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)),
                                       _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    *sum += _mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1);
}
/* more rows of x go in pairs, the block's rows in halves of 4: each widened weight vector serves both
 * rows of x (8 accumulators + 2 x + 1 w of the 16 ymm registers); an odd last row pairs with itself */
static inline void w8i_block(const int8_t *base, const int16_t *const *xr, int mg, int64_t c0, int64_t c1,
                             int64_t *sums) {
    if (mg == 1) {           /* one row of x: the whole block's 8 rows in one pass, 8 accumulators */
        __m256i acc[W8_ROWS];
        for (int j = 0; j < W8_ROWS; j++) acc[j] = _mm256_setzero_si256();
        for (int64_t c = c0; c < c1; c += W8_COLS) {
            const int8_t *p = base + c * W8_ROWS;
            __builtin_prefetch(p + W8_PREFETCH);
            __builtin_prefetch(p + W8_PREFETCH + 64);
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xr[0] + c));
            for (int j = 0; j < W8_ROWS; j++)
                acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + W8_COLS * j))), xv));
        }
        for (int j = 0; j < W8_ROWS; j++) w8i_reduce8(acc[j], sums + j);
        return;
    }
    for (int i = 0; i < mg; i += 2) {
        const int two = i + 1 < mg;
        const int16_t *x0 = xr[i], *x1 = xr[two ? i + 1 : i];
        for (int half = 0; half < 2; half++) {
            __m256i a0[4], a1[4];
            for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm256_setzero_si256();
            for (int64_t c = c0; c < c1; c += W8_COLS) {
                const int8_t *p = base + c * W8_ROWS + half * 4 * W8_COLS;
                __builtin_prefetch(p + W8_PREFETCH);
                const __m256i xv0 = _mm256_loadu_si256((const __m256i *)(x0 + c));
                const __m256i xv1 = _mm256_loadu_si256((const __m256i *)(x1 + c));
                for (int j = 0; j < 4; j++) {
                    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + W8_COLS * j)));
                    a0[j] = _mm256_add_epi32(a0[j], _mm256_madd_epi16(w, xv0));
                    a1[j] = _mm256_add_epi32(a1[j], _mm256_madd_epi16(w, xv1));
                }
            }
            for (int j = 0; j < 4; j++) {
                w8i_reduce8(a0[j], sums + i * 8 + half * 4 + j);
                if (two) w8i_reduce8(a1[j], sums + (i + 1) * 8 + half * 4 + j);
            }
        }
    }
}
#else
#define W8I_PATH 0
static void w8i_block(const int8_t *base, const int16_t *const *xr, int mg, int64_t c0, int64_t c1, int64_t *sums) {
    for (int i = 0; i < mg; i++)
        for (int j = 0; j < W8_ROWS; j++) {
            int64_t s = 0;
            for (int64_t c = c0; c < c1; c += W8_COLS)
                for (int t = 0; t < W8_COLS; t++) s += (int32_t)base[c * W8_ROWS + j * W8_COLS + t] * xr[i][c + t];
            sums[i * 8 + j] += s;
        }
}
#endif

/* which integer path this build sums with: 2 AVX512-VNNI, 1 AVX2, 0 the scalar loop */
int w8_int_path(void) { return W8I_PATH; }

static int gemv_w8_i16(const uint16_t *xb, const float *xf, const int8_t *q, const float *scale, const float *b,
                       float *y, int64_t M, int64_t N, int64_t Kp, int num_threads) {
    if (M < 1 || N < 1 || Kp < W8_COLS || Kp % W8_COLS) return -1;
    int16_t *xq = malloc((size_t)(M * Kp) * sizeof *xq);
    double *xs = malloc((size_t)M * sizeof *xs);
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -2;
    }
    const int64_t nb = (N + W8_ROWS - 1) / W8_ROWS;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        _Pragma("omp for schedule(static)")      /* the rows to int16 split between the threads too */
        for (int64_t m = 0; m < M; m++)
            quant_row_i16(xb ? xb + m * Kp : NULL, xb ? NULL : xf + m * Kp, Kp, xq + m * Kp, xs + m);
        _Pragma("omp for schedule(static)")
        for (int64_t blk = 0; blk < nb; blk++) {
            const int64_t n0 = blk * W8_ROWS, rows = N - n0 >= W8_ROWS ? W8_ROWS : N - n0;
            const int8_t *base = q + blk * W8_ROWS * Kp;
            for (int64_t m0 = 0; m0 < M; m0 += W8I_MG) {
                const int mg = M - m0 < W8I_MG ? (int)(M - m0) : W8I_MG;
                const int16_t *xr[W8I_MG];
                int64_t sums[W8I_MG * 8] = {0};
                for (int i = 0; i < W8I_MG; i++) xr[i] = xq + (m0 + (i < mg ? i : 0)) * Kp;
                for (int64_t c0 = 0; c0 < Kp; c0 += W8I_KC) {
                    const int64_t c1 = Kp - c0 < W8I_KC ? Kp : c0 + W8I_KC;
                    if (mg == 1) w8i_block(base, xr, 1, c0, c1, sums);   /* one row: its own, unrolled copy */
                    else w8i_block(base, xr, mg, c0, c1, sums);
                }
                /* in double, one rounding whatever order -ffast-math picks (xs is a power of two) */
                for (int i = 0; i < mg; i++)
                    for (int64_t j = 0; j < rows; j++)
                        y[(m0 + i) * N + n0 + j] = (float)((double)sums[i * 8 + j] * scale[n0 + j] * xs[m0 + i])
                                                   + (b ? b[n0 + j] : 0.f);
            }
        }
    }
    free(xq);
    free(xs);
    return 0;
}

int gemv_w8_bf16(const uint16_t *x, const int8_t *q, const float *scale, const float *b, float *y, int64_t M,
                 int64_t N, int64_t Kp, int num_threads) {
    return gemv_w8_i16(x, NULL, q, scale, b, y, M, N, Kp, num_threads);
}

int gemv_w8_f32(const float *x, const int8_t *q, const float *scale, const float *b, float *y, int64_t M,
                 int64_t N, int64_t Kp, int num_threads) {
    return gemv_w8_i16(NULL, x, q, scale, b, y, M, N, Kp, num_threads);
}

#ifndef EMBEDSERVE_EMULATED_AVX512
/* ---------------------------------------------------------------- one decode step, all layers
 * The decoder's forward for a step whose every sequence brings one token (T sequences), float32
 * activations, in one call: per layer the same kernels as the Python glue path (residual add +
 * RMSNorm, the qkv linear, RoPE + K/V store, paged attention, o, RMSNorm, gate|up, SiLU * up,
 * down), in the same order, so the result is that path's to the bit. What it saves is the
 * interpreter: ~10 ctypes calls, their argument checks and their tensors per layer (~25-40 us
 * each on the AVX2 EPYC, ~12 ms of a 30 ms SmolLM2 step in int8). Each linear is fp32
 * row-major (gemv_f32) or int8 blocked (gemv_w8_f32, K a multiple of 16). */
typedef struct {
    const void *w;                    /* float or bf16 (N, K) row-major, or int8 blocked (gemv_w8_f32) */
    const float *scale, *bias;        /* scale: int8 only; bias or NULL */
    int64_t n, k, kind;               /* kind 0: fp32, 1: int8, 2: bf16 (bf16 activations only) */
} es_linear;

static int es_linear_run(const es_linear *l, const float *x, float *y, int64_t M, int threads) {
    if (l->kind == 1) return gemv_w8_f32(x, (const int8_t *)l->w, l->scale, l->bias, y, M, l->n, l->k, threads);
    if (l->kind != 0) return -4;
    return gemv_f32(x, (const float *)l->w, l->bias, y, M, l->n, l->k, threads);
}

/* kv: the caches' dtype, 0 float32, 1 bfloat16, 2 float16 (rope_store and attention of that pair) */
static inline int rope_store_kv_f32(int64_t kv, const float *qkv, const float *cos_t, const float *sin_t, void *kc,
                                    void *vc, const int64_t *slots, int64_t num_slots, float *q, int64_t T, int64_t nh,
                                    int64_t kvh, int64_t hd, int threads) {
    if (kv == 1) return rope_store_f32_kvbf16(qkv, cos_t, sin_t, kc, vc, slots, num_slots, q, T, nh, kvh, hd, threads);
    if (kv == 2) return rope_store_f32_kvf16(qkv, cos_t, sin_t, kc, vc, slots, num_slots, q, T, nh, kvh, hd, threads);
    return rope_store_f32(qkv, cos_t, sin_t, kc, vc, slots, num_slots, q, T, nh, kvh, hd, threads);
}
static inline int attention_kv_f32(int64_t kv, const float *q, const void *kc, const void *vc, const int32_t *bt,
                                   int64_t bt_stride, const int32_t *ctx, float *o, int64_t T, int64_t nh, int64_t kvh,
                                   int64_t hd, int64_t block_size, float scale, int threads) {
    if (kv == 1)
        return paged_decode_attention_f32_kvbf16(q, kc, vc, bt, bt_stride, ctx, o, T, nh, kvh, hd, block_size, scale, threads);
    if (kv == 2)
        return paged_decode_attention_f32_kvf16(q, kc, vc, bt, bt_stride, ctx, o, T, nh, kvh, hd, block_size, scale, threads);
    return paged_decode_attention_f32(q, kc, vc, bt, bt_stride, ctx, o, T, nh, kvh, hd, block_size, scale, threads);
}

int decode_forward_f32(float *x, float *out, const es_linear *lins, const float *const *norms,
                       void *const *k_caches, void *const *v_caches, const float *cos_t, const float *sin_t,
                       const int64_t *slots, int64_t num_slots, const int32_t *block_tables, int64_t bt_stride,
                       const int32_t *context_lens, int64_t T, int64_t H, int64_t I, int64_t L, int64_t nh,
                       int64_t kvh, int64_t hd, int64_t block_size, int64_t kv, float eps, float scale,
                       float *scratch, int threads) {
    const int64_t qkv_w = (nh + 2 * kvh) * hd;
    float *h = scratch, *qkv = h + T * H, *q = qkv + T * qkv_w, *o = q + T * nh * hd, *gu = o + T * nh * hd,
          *act = gu + T * 2 * I, *res = act + T * I;
    const float *r = NULL;
    int rc = 0;
    for (int64_t l = 0; l < L && !rc; l++) {
        const es_linear *lin = lins + 4 * l;
        if ((rc = rms_norm_f32(x, r, norms[2 * l], h, T, H, eps, threads))) break;
        if ((rc = es_linear_run(lin, h, qkv, T, threads))) break;
        if ((rc = rope_store_kv_f32(kv, qkv, cos_t, sin_t, k_caches[l], v_caches[l], slots, num_slots, q, T, nh, kvh,
                                    hd, threads))) break;
        if ((rc = attention_kv_f32(kv, q, k_caches[l], v_caches[l], block_tables, bt_stride, context_lens, o,
                                   T, nh, kvh, hd, block_size, scale, threads))) break;
        if ((rc = es_linear_run(lin + 1, o, res, T, threads))) break;
        if ((rc = rms_norm_f32(x, res, norms[2 * l + 1], h, T, H, eps, threads))) break;
        if ((rc = es_linear_run(lin + 2, h, gu, T, threads))) break;
        if ((rc = silu_mul_f32(gu, act, T, I, threads))) break;
        if ((rc = es_linear_run(lin + 3, act, res, T, threads))) break;
        r = res;
    }
    if (!rc) rc = rms_norm_f32(x, r, norms[2 * L], out, T, H, eps, threads);
    return rc;
}

/* The same step with bfloat16 activations and K/V cache (a bf16 decoder): the bf16 glue kernels,
 * and each linear either int8 (kind 1, `--decode-weights int8`: gemv_w8_bf16, what
 * `kernels.cpu_attention.gemv_w8` does for bf16 rows from Python) or bf16 row-major (kind 2, native weights:
 * gemv_bf16, what `kernels.cpu_attention.gemv_bf16` does), its float output rounded to bf16
 * (nearest even), so the step equals the per-op path to the bit. s16 holds the bf16 intermediates
 * (as decode_forward_f32's scratch), s32 one linear's float output (T x max(qkv, H, 2I)). Returns -4
 * for an fp32 linear (kind 0). */
static int es_linear_bf16(const es_linear *l, const uint16_t *x, uint16_t *y, int64_t M, float *yf, int threads) {
    const int64_t nn = M * l->n;
    int rc;
    if (l->kind == 2) {
        rc = gemv_bf16(x, (const uint16_t *)l->w, l->bias, yf, M, l->n, l->k, threads);
    } else if (l->kind == 1) {
        rc = gemv_w8_bf16(x, (const int8_t *)l->w, l->scale, l->bias, yf, M, l->n, l->k, threads);
    } else {
        return -4;
    }
    if (!rc)
        for (int64_t i = 0; i < nn; i++) y[i] = f32_to_bf16(yf[i]);
    return rc;
}

int decode_forward_bf16(uint16_t *x, uint16_t *out, const es_linear *lins, const uint16_t *const *norms,
                        uint16_t *const *k_caches, uint16_t *const *v_caches, const float *cos_t, const float *sin_t,
                        const int64_t *slots, int64_t num_slots, const int32_t *block_tables, int64_t bt_stride,
                        const int32_t *context_lens, int64_t T, int64_t H, int64_t I, int64_t L, int64_t nh,
                        int64_t kvh, int64_t hd, int64_t block_size, int64_t kv, float eps, float scale,
                        uint16_t *s16, float *s32, int threads) {
    if (kv != 1) return -5;                               /* a bf16 decoder's cache is bf16 */
    const int64_t qkv_w = (nh + 2 * kvh) * hd;
    uint16_t *h = s16, *qkv = h + T * H, *q = qkv + T * qkv_w, *o = q + T * nh * hd, *gu = o + T * nh * hd,
             *act = gu + T * 2 * I, *res = act + T * I;
    float *yf = s32;
    const uint16_t *r = NULL;
    int rc = 0;
    for (int64_t l = 0; l < L && !rc; l++) {
        const es_linear *lin = lins + 4 * l;
        if ((rc = rms_norm_bf16(x, r, norms[2 * l], h, T, H, eps, threads))) break;
        if ((rc = es_linear_bf16(lin, h, qkv, T, yf, threads))) break;
        if ((rc = rope_store_bf16(qkv, cos_t, sin_t, k_caches[l], v_caches[l], slots, num_slots, q, T, nh, kvh, hd,
                                  threads))) break;
        if ((rc = paged_decode_attention_bf16(q, k_caches[l], v_caches[l], block_tables, bt_stride, context_lens, o,
                                              T, nh, kvh, hd, block_size, scale, threads))) break;
        if ((rc = es_linear_bf16(lin + 1, o, res, T, yf, threads))) break;
        if ((rc = rms_norm_bf16(x, res, norms[2 * l + 1], h, T, H, eps, threads))) break;
        if ((rc = es_linear_bf16(lin + 2, h, gu, T, yf, threads))) break;
        if ((rc = silu_mul_bf16(gu, act, T, I, threads))) break;
        if ((rc = es_linear_bf16(lin + 3, act, res, T, yf, threads))) break;
        r = res;
    }
    if (!rc) rc = rms_norm_bf16(x, r, norms[2 * L], out, T, H, eps, threads);
    return rc;
}
#endif  /* EMBEDSERVE_EMULATED_AVX512 */
