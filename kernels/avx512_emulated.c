/* The paged decode attention of cpu_paged_attention.c in its AVX-512 layout (VW = 16 floats a
 * vector: 16-key chunks, its transpose-add, 4-vector value passes), built on any x86-64 CPU: the
 * five AVX-512 intrinsics that code calls are given here in plain C over GCC's 64-byte vectors, the
 * same results lane for lane, so a CPU without AVX-512 runs the AVX-512 build's logic (slowly).
 * Most sessions' machines are AVX2-only; tests/test_cpu_attention.py compiles this file and checks
 * it against the reference, so a change to the VW = 16 paths is tested where no AVX-512 CPU is.
 * Only the decode attention is built (EMBEDSERVE_DECODE_ATTENTION_ONLY): the rest of the file
 * calls many more AVX-512 intrinsics, and its own tests run it on the CPUs that have them.
 *
 *     cc -O1 -march=native -fPIC -fopenmp -ffast-math -Wno-psabi -shared kernels/avx512_emulated.c -o x.so -lm
 * (-O1: the test builds it so, in ~9 s where -O3 took 50)
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef uint32_t emu_v16su __attribute__((vector_size(64)));

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
static inline __m512i emu_mm512_cvtepu16_epi32(__m256i h) {  /* zero-extends 16 uint16 lanes */
    uint16_t u[16];
    uint32_t w[16];
    __m512i r;
    memcpy(u, &h, sizeof u);
    for (int i = 0; i < 16; i++) w[i] = u[i];
    memcpy(&r, w, sizeof r);
    return r;
}
static inline __m512i emu_mm512_slli_epi32(__m512i a, unsigned s) { return (__m512i)((emu_v16su)a << s); }
static inline __m512 emu_mm512_castsi512_ps(__m512i a) { return (__m512)a; }

#define _mm512_cvtph_ps emu_mm512_cvtph_ps
#define _mm512_fmadd_ps emu_mm512_fmadd_ps
#define _mm512_cvtepu16_epi32 emu_mm512_cvtepu16_epi32
#define _mm512_slli_epi32 emu_mm512_slli_epi32
#define _mm512_castsi512_ps emu_mm512_castsi512_ps
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#define EMBEDSERVE_DECODE_ATTENTION_ONLY 1
#include "cpu_paged_attention.c"
