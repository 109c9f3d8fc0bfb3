/* Two parts of cpu_paged_attention.c in their AVX-512 code, built on any x86-64 CPU: the paged
 * decode attention in its AVX-512 layout (VW = 16 floats a vector: 16-key chunks, their
 * transpose-add, 4-vector value passes) and the weight-only int8 linear's AVX512-VNNI path
 * (vpdpwssd over 4 rows of x at a time). The AVX-512 intrinsics those call are given here in plain
 * C over GCC's 64-byte vectors, the same results lane for lane, so a CPU without AVX-512 runs the
 * AVX-512 build's logic (slowly). Most sessions' machines are AVX2-only; the tests
 * (tests/test_cpu_attention.py, tests/test_decode_int8.py) compile this file and check the one
 * against the reference and the other against the native build to the bit, so a change to these
 * paths is tested where no AVX-512 CPU is. The rest of the file (EMBEDSERVE_EMULATED_AVX512 leaves
 * it out) calls many more AVX-512 intrinsics; its own tests run it on the CPUs that have them.
 *
 *     cc -O1 -march=native -fPIC -fopenmp -ffast-math -Wno-psabi -c kernels/avx512_emulated.c -o x.o
 *     cc -shared -fopenmp x.o -o x.so -lm      (-ffast-math not at the link: kernels/cbuild.py)
 *
 * (-O1: the tests build it so, in ~9 s where -O3 took 50.)
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef uint32_t emu_v16su __attribute__((vector_size(64)));

/* the decode attention's: widening loads and the fused multiply-add */
static inline __m512 emu_mm512_cvtph_ps(__m256i h) {      /* 16 IEEE halves -> floats, exactly */
    uint16_t u[16];
    float f[16];
    __m512 r;
    memcpy(u, &h, sizeof u);
    for (int i = 0; i < 16; i++) {
        _Float16 x;
        memcpy(&x, &u[i], sizeof x);
        f[i] = (float)x;
    }
    memcpy(&r, f, sizeof r);
    return r;
}
static inline __m512 emu_mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) { return a * b + c; }
/* the 256 bits of `a` as lanes of FROM, each widened to TO (zero- or sign-extended as FROM is) */
#define EMU_WIDEN(NAME, FROM, TO)                                                                   \
    static inline __m512i NAME(__m256i a) {                                                         \
        FROM v[32 / sizeof(FROM)];                                                                  \
        TO w[32 / sizeof(FROM)];                                                                    \
        __m512i r;                                                                                  \
        memcpy(v, &a, sizeof v);                                                                    \
        for (size_t i = 0; i < 32 / sizeof(FROM); i++) w[i] = v[i];                                 \
        memcpy(&r, w, sizeof r);                                                                    \
        return r;                                                                                   \
    }
EMU_WIDEN(emu_mm512_cvtepu16_epi32, uint16_t, uint32_t)
static inline __m512i emu_mm512_slli_epi32(__m512i a, unsigned s) { return (__m512i)((emu_v16su)a << s); }
static inline __m512 emu_mm512_castsi512_ps(__m512i a) { return (__m512)a; }

/* the int8 linear's: widening, broadcast, the int16 dot product into int32 lanes, the reductions */
static inline __m512i emu_mm512_setzero_si512(void) { return (__m512i){0, 0, 0, 0, 0, 0, 0, 0}; }
EMU_WIDEN(emu_mm512_cvtepi8_epi16, int8_t, int16_t)
EMU_WIDEN(emu_mm512_cvtepi32_epi64, int32_t, int64_t)
static inline __m512i emu_mm512_broadcast_i64x4(__m256i a) {
    __m512i r;
    memcpy(&r, &a, 32);
    memcpy((char *)&r + 32, &a, 32);
    return r;
}
static inline __m512i emu_mm512_dpwssd_epi32(__m512i src, __m512i a, __m512i b) {
    /* lane i: src + a[2i] b[2i] + a[2i+1] b[2i+1], int16 products in int32, wrapping as the instruction does */
    int32_t s[16];
    int16_t x[32], y[32];
    memcpy(s, &src, sizeof s);
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    for (int i = 0; i < 16; i++)
        s[i] = (int32_t)((uint32_t)s[i] + (uint32_t)((int32_t)x[2 * i] * y[2 * i])
                         + (uint32_t)((int32_t)x[2 * i + 1] * y[2 * i + 1]));
    memcpy(&src, s, sizeof s);
    return src;
}
static inline long long emu_mm512_reduce_add_epi64(__m512i a) {
    int64_t v[8], t = 0;
    memcpy(v, &a, sizeof v);
    for (int i = 0; i < 8; i++) t += v[i];
    return t;
}
static inline __m256i emu_mm512_extracti64x4_epi64(__m512i a, int hi) {
    __m256i r;
    memcpy(&r, (const char *)&a + (hi ? 32 : 0), 32);
    return r;
}

#define _mm512_cvtph_ps emu_mm512_cvtph_ps
#define _mm512_fmadd_ps emu_mm512_fmadd_ps
#define _mm512_cvtepu16_epi32 emu_mm512_cvtepu16_epi32
#define _mm512_slli_epi32 emu_mm512_slli_epi32
#define _mm512_castsi512_ps emu_mm512_castsi512_ps
#define _mm512_setzero_si512 emu_mm512_setzero_si512
#define _mm512_cvtepi8_epi16 emu_mm512_cvtepi8_epi16
#define _mm512_broadcast_i64x4 emu_mm512_broadcast_i64x4
#define _mm512_dpwssd_epi32 emu_mm512_dpwssd_epi32
#define _mm512_reduce_add_epi64 emu_mm512_reduce_add_epi64
#define _mm512_cvtepi32_epi64 emu_mm512_cvtepi32_epi64
#define _mm512_castsi512_si256(a) emu_mm512_extracti64x4_epi64(a, 0)
#define _mm512_extracti64x4_epi64 emu_mm512_extracti64x4_epi64
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VNNI__
#define __AVX512VNNI__ 1
#endif
#define EMBEDSERVE_EMULATED_AVX512 1
#include "cpu_paged_attention.c"
