// Batch-invariant int4 x int8 matmul (MatMulNBits semantics: symmetric int4, blocks of 32, int8 activations
// quantized per row per block). Every output element is computed by the same instruction sequence whatever
// the number of rows or threads, so a row's result does not depend on the batch it is in. Built with AVX-512
// VNNI where the compiler targets it (one vpdpbusd multiplies 16 columns by 4 inputs), else with AVX2
// (vpmaddubsw pairs summed in 16 bits over a block, then vpmaddwd: 8 columns by 32 inputs).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#define BLK 32
#ifdef __AVX512VNNI__
#define GC 16   // columns per group (one zmm of int32 lanes)
#define RC 8    // rows per register tile
#else
#define GC 8    // columns per group (one ymm of int32 lanes)
#define RC 4    // rows per register tile: 8 unpacked weight registers + 4 accumulators + temporaries of 16
#endif

// packed: [N][K/32][16] bytes, element k of a block = (byte[k/2] >> 4*(k%2)) & 15; scales [N][K/32]
// repacked: [G][B][4][4*GC] bytes; lane j, byte t of chunk v: low nibble w[GC*g+j][32b+4v+t], high w[..][32b+16+4v+t]
void q4_repack(const uint8_t* packed, const float* scales, int N, int K, uint8_t* out, float* out_scales) {
    int B = K / BLK, G = N / GC;
    for (int g = 0; g < G; g++) for (int b = 0; b < B; b++) {
        uint8_t* dst = out + ((size_t)g * B + b) * 16 * GC;
        for (int v = 0; v < 4; v++) for (int j = 0; j < GC; j++) for (int t = 0; t < 4; t++) {
            int n = g * GC + j;
            const uint8_t* blk = packed + ((size_t)n * B + b) * 16;
            int k0 = 4 * v + t, k1 = 16 + 4 * v + t;
            uint8_t lo = (blk[k0 / 2] >> (4 * (k0 % 2))) & 15, hi = (blk[k1 / 2] >> (4 * (k1 % 2))) & 15;
            dst[v * 4 * GC + j * 4 + t] = lo | (hi << 4);
        }
        for (int j = 0; j < GC; j++) out_scales[((size_t)g * B + b) * GC + j] = scales[(size_t)(g * GC + j) * B + b];
    }
}

// per row, per block: int8 values, their sum, and the scale
static void quantize_rows(const float* A, int M, int K, int8_t* aq, int32_t* asum, float* ascale) {
    int B = K / BLK;
    for (int m = 0; m < M; m++) for (int b = 0; b < B; b++) {
        const float* x = A + (size_t)m * K + b * BLK;
        float amax = 0.f;
        for (int i = 0; i < BLK; i++) amax = fmaxf(amax, fabsf(x[i]));
        float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int s = 0;
        for (int i = 0; i < BLK; i++) {
            int q = (int)nearbyintf(x[i] * inv);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            aq[(size_t)m * K + b * BLK + i] = (int8_t)q; s += q;
        }
        asum[m * B + b] = s; ascale[m * B + b] = scale;
    }
}

#ifdef __AVX512VNNI__
static inline void tile(const uint8_t* w, const float* ws, int B, const int8_t* aq, const int32_t* asum,
                        const float* ascale, int K, int rows, float* Y, int N, int col) {
    __m512 acc[RC];
    for (int r = 0; r < RC; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    for (int b = 0; b < B; b++) {
        const uint8_t* p = w + (size_t)b * 16 * GC;
        __m512i P0 = _mm512_loadu_si512(p), P1 = _mm512_loadu_si512(p + 64), P2 = _mm512_loadu_si512(p + 128), P3 = _mm512_loadu_si512(p + 192);
        __m512i R0 = _mm512_and_si512(P0, low), R4 = _mm512_and_si512(_mm512_srli_epi16(P0, 4), low);
        __m512i R1 = _mm512_and_si512(P1, low), R5 = _mm512_and_si512(_mm512_srli_epi16(P1, 4), low);
        __m512i R2 = _mm512_and_si512(P2, low), R6 = _mm512_and_si512(_mm512_srli_epi16(P2, 4), low);
        __m512i R3 = _mm512_and_si512(P3, low), R7 = _mm512_and_si512(_mm512_srli_epi16(P3, 4), low);
        __m512 sc = _mm512_loadu_ps(ws + (size_t)b * GC);
        for (int r = 0; r < rows; r++) {
            const int32_t* a = (const int32_t*)(aq + (size_t)r * K + b * BLK);
            __m512i s = _mm512_set1_epi32(-8 * asum[r * (K / BLK) + b]);
            s = _mm512_dpbusd_epi32(s, R0, _mm512_set1_epi32(a[0]));
            s = _mm512_dpbusd_epi32(s, R1, _mm512_set1_epi32(a[1]));
            s = _mm512_dpbusd_epi32(s, R2, _mm512_set1_epi32(a[2]));
            s = _mm512_dpbusd_epi32(s, R3, _mm512_set1_epi32(a[3]));
            s = _mm512_dpbusd_epi32(s, R4, _mm512_set1_epi32(a[4]));
            s = _mm512_dpbusd_epi32(s, R5, _mm512_set1_epi32(a[5]));
            s = _mm512_dpbusd_epi32(s, R6, _mm512_set1_epi32(a[6]));
            s = _mm512_dpbusd_epi32(s, R7, _mm512_set1_epi32(a[7]));
            __m512 scale = _mm512_mul_ps(sc, _mm512_set1_ps(ascale[r * (K / BLK) + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(Y + (size_t)r * N + col, acc[r]);
}
#else
static inline void tile(const uint8_t* w, const float* ws, int B, const int8_t* aq, const int32_t* asum,
                        const float* ascale, int K, int rows, float* Y, int N, int col) {
    __m256 acc[RC];
    for (int r = 0; r < RC; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < B; b++) {
        const uint8_t* p = w + (size_t)b * 16 * GC;
        __m256i P0 = _mm256_loadu_si256((const __m256i*)p), P1 = _mm256_loadu_si256((const __m256i*)(p + 32));
        __m256i P2 = _mm256_loadu_si256((const __m256i*)(p + 64)), P3 = _mm256_loadu_si256((const __m256i*)(p + 96));
        __m256i R0 = _mm256_and_si256(P0, low), R4 = _mm256_and_si256(_mm256_srli_epi16(P0, 4), low);
        __m256i R1 = _mm256_and_si256(P1, low), R5 = _mm256_and_si256(_mm256_srli_epi16(P1, 4), low);
        __m256i R2 = _mm256_and_si256(P2, low), R6 = _mm256_and_si256(_mm256_srli_epi16(P2, 4), low);
        __m256i R3 = _mm256_and_si256(P3, low), R7 = _mm256_and_si256(_mm256_srli_epi16(P3, 4), low);
        __m256 sc = _mm256_loadu_ps(ws + (size_t)b * GC);
        for (int r = 0; r < rows; r++) {  // the same instructions for every row: two chains, summed once
            const int32_t* a = (const int32_t*)(aq + (size_t)r * K + b * BLK);
            // each 16-bit sum is at most 8 x 2 x 15 x 127 = 30480: no saturation
            __m256i h0 = _mm256_maddubs_epi16(R0, _mm256_set1_epi32(a[0]));
            __m256i h1 = _mm256_maddubs_epi16(R4, _mm256_set1_epi32(a[4]));
            h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(R1, _mm256_set1_epi32(a[1])));
            h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(R5, _mm256_set1_epi32(a[5])));
            h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(R2, _mm256_set1_epi32(a[2])));
            h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(R6, _mm256_set1_epi32(a[6])));
            h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(R3, _mm256_set1_epi32(a[3])));
            h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(R7, _mm256_set1_epi32(a[7])));
            __m256i s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(h0, h1), ones),
                                         _mm256_set1_epi32(-8 * asum[r * (K / BLK) + b]));
            __m256 scale = _mm256_mul_ps(sc, _mm256_set1_ps(ascale[r * (K / BLK) + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(Y + (size_t)r * N + col, acc[r]);
}
#endif

void q4_matmul(const float* A, int M, int K, int N, const uint8_t* w, const float* ws, float* Y, int threads,
               int8_t* aq, int32_t* asum, float* ascale) {
    int B = K / BLK, G = N / GC;
    quantize_rows(A, M, K, aq, asum, ascale);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < G; g++) {
        for (int r0 = 0; r0 < M; r0 += RC) {
            int rows = M - r0 < RC ? M - r0 : RC;
            tile(w + (size_t)g * B * 16 * GC, ws + (size_t)g * B * GC, B, aq + (size_t)r0 * K, asum + r0 * B, ascale + r0 * B, K, rows,
                 Y + (size_t)r0 * N, N, g * GC);
        }
    }
}
