// GroupQueryAttention for the CPU that reads each key/value head once per pass.
//
// A drop-in for ONNX Runtime's com.microsoft GroupQueryAttention as edge-spec's graphs use it (same
// inputs, outputs and attributes; registered in the domain "ai.edge_spec").  ORT's CPU kernel works one
// query head at a time, so a key/value head shared by g query heads is streamed g times; here the g query
// heads of every new row are scored against each key as it is read, and each value row is read once.
//
// Batch invariance: the output of one query row depends on that row's inputs and its causal window
// alone.  Every dot product, softmax sum and value sum runs in a fixed order over absolute cache
// positions, whatever number of rows shares the pass, however the rows are split between threads.
//
// Two paths, chosen once at load: AVX2+FMA (compiled per function with target attributes, so the
// library itself is generic x86-64) and a portable scalar one.  Both are deterministic; they round
// differently from each other, and a process only ever uses one.  On CPUs with AVX-512 the AVX2 path's
// scores, softmax and value sums run on 512-bit kernels that give its bits (EDGE_SPEC_NATIVE_AVX512=0: the AVX2
// ones); a prompt's pass scores with keys in the lanes, a decode or verify pass with query vectors in them.
//
// The cache is float32, or float16 where the graph types it so (the same op name, registered a second time for
// float16 past and present key and value): half the bytes a pass reads.  Each new key and value is rounded to
// float16 as it is written, before any row reads it, and each tile of 32 positions is read back exactly into
// float32 scratch that the kernels above read, so every path keeps its bits and its batch invariance.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define ES_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include "edge_spec_op.h"
#include "onnxruntime_c_api.h"

namespace edge_spec {
OrtCustomOp* gguf_matmul_op(const OrtApi* api);  // gguf_matmul.cc
const char* gguf_matmul_path();
bool gguf_one_row_prefetch();
void gguf_set_one_row_prefetch(int choice);
void gguf_set_far_rows(int rows);
bool gguf_far_prefetch();
const char* gguf_far_prefetch_words();
const char* gguf_matmul_prompt_path();
}  // namespace edge_spec

namespace {

constexpr uint32_t kApiVersion = 17;  // KernelContext_ParallelFor came with 1.17
const OrtApi* g_api = nullptr;
bool g_use_avx2 = false;
bool g_use_avx512 = false;  // the scores' and value sums' AVX-512 kernels (same bits as the AVX2 ones)
bool g_use_amx = false;  // the prompt path (prompt_path_here)

// ---------------------------------------------------------------------------------------------------
// kernels

float hsum_scalar(const float* lanes) {  // the AVX path's reduction order, for its tails
  float a = (lanes[0] + lanes[4]) + (lanes[2] + lanes[6]);
  float b = (lanes[1] + lanes[5]) + (lanes[3] + lanes[7]);
  return a + b;
}

float dot_scalar(const float* q, const float* k, int n) {
  float acc = 0.f;
  for (int i = 0; i < n; ++i) acc += q[i] * k[i];
  return acc;
}

#ifdef ES_X86
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                  // (0+4, 1+5, 2+6, 3+7)
  __m128 sh = _mm_movehl_ps(s, s);                // (2+6, 3+7, ..)
  __m128 s2 = _mm_add_ps(s, sh);                  // ((0+4)+(2+6), (1+5)+(3+7))
  __m128 s3 = _mm_shuffle_ps(s2, s2, 0x55);
  return _mm_cvtss_f32(_mm_add_ss(s2, s3));
}

// the most rows of a decode or verify pass: its work items take blocks of 4 rows, and it asks for keys ahead
constexpr int kFewRows = 16;

#ifdef ES_X86
// Keys a score kernel asks for ahead of the four it multiplies, in a pass of at most kFewRows rows, in the first
// block of query vectors to meet each tile of keys (the block that reads them from memory; the others find them
// in L1).  Such a pass reads every key once, and with the hardware prefetcher alone its scores waited on memory.
// A float32 cache's kernels read the cache itself and ask 16 keys ahead: one-row and five-row attention after
// 2,800 tokens about 10% faster on a Zen 4 EPYC (5% on its AVX2 kernels).  A float16 cache is read back a tile
// at a time, so its AVX-512 kernels ask for the next tile's keys, 32 ahead: on the same CPU the op alone after
// 2,800 tokens 1.15-1.20x faster over one row, 1.09x over five (its cache on 4 KiB pages), a whole pass of the
// default target on the runtime's 2 MiB pages 1.02-1.04x over one to nine rows (16 ahead gained nothing, 64 as
// much as 32, the whole next tile at once less, the next tile's values as well nothing more).  Its AVX2
// kernels do not: there the op alone was 0.92-1.06x.  A prefetch past the cache's end never faults.
struct Ahead {
  const char* rows = nullptr;  // row 0 of what is read ahead (nullptr: nothing)
  size_t stride = 0;  // bytes a row
  int distance = 0;  // rows ahead of the one worked on
};

constexpr int kKeysAhead = 16;

inline void prefetch_rows(const Ahead& ahead, int t) {
  if (ahead.rows == nullptr) return;
  const char* from = ahead.rows + static_cast<size_t>(t + ahead.distance) * ahead.stride;
  for (size_t line = 0; line < 4 * ahead.stride; line += 64) _mm_prefetch(from + line, _MM_HINT_T0);
}
#endif

// dots of NQ query vectors with NK consecutive keys from k: acc lane j sums q[8c+j]*k[8c+j] over c in order,
// then hsum256, whatever NQ and NK (so every block shape gives the same bits).  HC: the head size in 8-float
// chunks when known at compile time (the loop unrolls into registers), else 0.
template <int NQ, int NK, int HC>
__attribute__((target("avx2,fma"), always_inline)) inline void dots_avx(const float* const* q, const float* k, int h,
                                                                        float* out) {
  const int chunks = HC ? HC : h / 8;
  __m256 acc[NQ][NK];
  for (int j = 0; j < NQ; ++j)
    for (int t = 0; t < NK; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int c = 0; c < chunks; ++c) {
    __m256 x[NK];
    for (int t = 0; t < NK; ++t) x[t] = _mm256_loadu_ps(k + static_cast<size_t>(t) * h + 8 * c);
    for (int j = 0; j < NQ; ++j) {
      const __m256 qv = _mm256_loadu_ps(q[j] + 8 * c);
      for (int t = 0; t < NK; ++t) acc[j][t] = _mm256_fmadd_ps(qv, x[t], acc[j][t]);
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int t = 0; t < NK; ++t) out[j * NK + t] = hsum256(acc[j][t]);
}

// scores[i][t - first] = alpha * q_i . k_t for the NQ query vectors from i0 and keys [t0, t1): four keys a
// step (three query vectors by four keys keep the most products per load in AVX2's sixteen registers), then
// the tail two and one at a time
template <int NQ, int HC>
__attribute__((target("avx2,fma"))) void score_block_avx(const float* const* q, const float* K, int t0, int t1,
                                                         int h, float alpha, float* row, size_t span,
                                                         const Ahead& ahead) {
  float d[NQ * 4];
  int t = t0;
  for (; t + 3 < t1; t += 4) {
    prefetch_rows(ahead, t);
    dots_avx<NQ, 4, HC>(q, K + static_cast<size_t>(t) * h, h, d);
    for (int j = 0; j < NQ; ++j)
      for (int u = 0; u < 4; ++u) row[j * span + t + u] = alpha * d[j * 4 + u];
  }
  for (; t + 1 < t1; t += 2) {
    dots_avx<NQ, 2, HC>(q, K + static_cast<size_t>(t) * h, h, d);
    for (int j = 0; j < NQ; ++j)
      for (int u = 0; u < 2; ++u) row[j * span + t + u] = alpha * d[j * 2 + u];
  }
  if (t < t1) {
    dots_avx<NQ, 1, HC>(q, K + static_cast<size_t>(t) * h, h, d);
    for (int j = 0; j < NQ; ++j) row[j * span + t] = alpha * d[j];
  }
}

constexpr int kScoreQueries = 3;  // query vectors a score block takes (see score_block_avx)

template <int HC>
void score_avx(const float* const* q, int m, const float* K, int t0, int t1, int h, float alpha, float* row,
               size_t span, const Ahead& ahead) {
  switch (m) {
    case 1: score_block_avx<1, HC>(q, K, t0, t1, h, alpha, row, span, ahead); break;
    case 2: score_block_avx<2, HC>(q, K, t0, t1, h, alpha, row, span, ahead); break;
    default: score_block_avx<kScoreQueries, HC>(q, K, t0, t1, h, alpha, row, span, ahead); break;
  }
}

// AVX-512: two query vectors share a register, q[2p] in its low eight lanes and q[2p + 1] in its high eight,
// each 8-float chunk of a key broadcast to both halves.  Each half then sums what dots_avx's 8-lane
// accumulator sums, in the same order, and the reduction below follows hsum256's tree lane for lane, so
// the scores have the AVX2 path's bits at half its multiplies.
//
// pairs: the query vectors packed by pack_query_pairs, [pair][chunk][16].
constexpr int kScorePairs = 4;  // query pairs a 512-bit score block takes: 16 accumulators with 4 keys
#define ES_AVX512_ATTENTION "avx512f,avx512vl,avx2,fma"

void pack_query_pairs(const float* const* q, int nq, int h, float* pairs, int padded_pairs) {
  const int chunks = h / 8;
  for (int p = 0; p < padded_pairs; ++p)
    for (int c = 0; c < chunks; ++c)
      for (int half = 0; half < 2; ++half) {
        float* dst = pairs + (static_cast<size_t>(p) * chunks + c) * 16 + 8 * half;
        const int i = 2 * p + half;
        if (i < nq)
          std::memcpy(dst, q[i] + 8 * c, sizeof(float) * 8);
        else
          std::memset(dst, 0, sizeof(float) * 8);
      }
}

// hsum256's tree on eight accumulators at once: a[4p + u] holds query pair p (of two) against key u (of four);
// returns the 16 sums as [query 0: keys 0-3 | query 1 | query 2 | query 3], queries 2p and 2p + 1 of pair p
__attribute__((target(ES_AVX512_ATTENTION), always_inline)) inline __m512 reduce_pairs(const __m512* a) {
  __m512 w[2];
  for (int p = 0; p < 2; ++p) {
    __m512 s[2];
    for (int h = 0; h < 2; ++h) {  // lanes i + (i + 4) of each half: [q0 k, q1 k, q0 k+1, q1 k+1]
      const __m512 x = a[4 * p + 2 * h], y = a[4 * p + 2 * h + 1];
      s[h] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    }
    // (s0 + s2, s1 + s3) of each block: [q0 k0 | q1 k0 | q0 k1 | q1 k1] with k2, k3 beside
    w[p] = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // (s0 + s2) + (s1 + s3): blocks [q0 k0, q0 k2, q2 k0, q2 k2], [q1 ..], [q0 k1, q0 k3, ..], [q1 k1, ..]
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 4, 12, 5, 13, 2, 10, 3, 11, 6, 14, 7, 15);
  return _mm512_permutexvar_ps(order, z);
}

// scores of the query pairs' vectors (m of them, m <= 2 * NP) with keys [t0, t1), as score_block_avx; NP: the
// pairs multiplied (a block of fewer queries skips the padded pairs' products; the reduction still takes two)
template <int HC, int NP = kScorePairs>
__attribute__((target(ES_AVX512_ATTENTION))) void score_pairs_avx512(const float* pairs, int m, const float* K,
                                                                     int t0, int t1, int h, float alpha, float* row,
                                                                     size_t span, const Ahead& ahead) {
  const int chunks = HC ? HC : h / 8;
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int t = t0; t < t1; t += 4) {
    prefetch_rows(ahead, t);
    const int keys = std::min(4, t1 - t);
    const float* k[4];
    for (int u = 0; u < 4; ++u) k[u] = K + static_cast<size_t>(t + std::min(u, keys - 1)) * h;
    __m512 acc[kScorePairs][4];
    for (int p = 0; p < kScorePairs; ++p)
      for (int u = 0; u < 4; ++u) acc[p][u] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      __m512 x[4];
      for (int u = 0; u < 4; ++u)  // vbroadcastf64x4: AVX-512F's 256-bit broadcast
        x[u] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(k[u] + 8 * c))));
      for (int p = 0; p < NP; ++p) {
        const __m512 qv = _mm512_loadu_ps(pairs + (static_cast<size_t>(p) * chunks + c) * 16);
        for (int u = 0; u < 4; ++u) acc[p][u] = _mm512_fmadd_ps(qv, x[u], acc[p][u]);
      }
    }
    const __mmask8 lanes = static_cast<__mmask8>((1u << keys) - 1);
    for (int g = 0; g < (NP + 1) / 2; ++g) {
      const __m512 d = _mm512_mul_ps(scale, reduce_pairs(&acc[2 * g][0]));
      const __m128 v[4] = {_mm512_castps512_ps128(d), _mm512_extractf32x4_ps(d, 1), _mm512_extractf32x4_ps(d, 2),
                           _mm512_extractf32x4_ps(d, 3)};
      for (int j = 0; j < 4 && 4 * g + j < m; ++j) {
        float* dst = row + static_cast<size_t>(4 * g + j) * span + t;
        if (keys == 4)
          _mm_storeu_ps(dst, v[j]);
        else
          _mm_mask_storeu_ps(dst, lanes, v[j]);
      }
    }
  }
}

// A prompt's pass (more than kFewRows rows) scores with the keys in the lanes instead: a tile of 32 keys is
// turned into kt[d][32] (dimension-major), and for each lane j of dots_avx's accumulator, query i's
// acc_j = sum over c in order of q_i[8c + j] * k[8c + j] runs for 32 keys at once, one fused multiply-add per
// chunk as there, from zero.  The eight acc_j are then added in hsum256's tree, lane for lane: the same bits
// again, without the shuffles that turn 8-lane sums into scores (a fifth of the pair kernel's work).  Twelve
// query vectors (two rows' heads) share each key vector loaded.
constexpr int kKeyLanes = 32;  // keys a transposed tile holds: two 16-lane vectors
constexpr int kLaneQueries = 12;  // query vectors a block of score_lanes_avx512: 24 accumulators

// kt[d * 32 + u] = k[u * h + d] for u < n keys (zeros for u in [n, 32)); h a multiple of 16.  Key is float
// (a float32 cache's keys) or uint16_t (a float16 cache's, read back exactly on the way)
template <class Key>
__attribute__((target(ES_AVX512_ATTENTION ",f16c"))) void transpose_keys(const Key* k, int n, int h, float* kt) {
  for (int u0 = 0; u0 < kKeyLanes; u0 += 16) {
    for (int d0 = 0; d0 < h; d0 += 16) {
      __m512 r[16];
      for (int u = 0; u < 16; ++u) {
        const Key* row = k + static_cast<size_t>(u0 + u) * h + d0;
        if (u0 + u >= n)
          r[u] = _mm512_setzero_ps();
        else if constexpr (std::is_same_v<Key, float>)
          r[u] = _mm512_loadu_ps(row);
        else
          r[u] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
      }
      __m512 t[16];
      for (int u = 0; u < 16; u += 2) {
        t[u] = _mm512_unpacklo_ps(r[u], r[u + 1]);
        t[u + 1] = _mm512_unpackhi_ps(r[u], r[u + 1]);
      }
      for (int u = 0; u < 16; u += 4) {
        for (int v = 0; v < 2; ++v) {  // t[u + v]: dimensions 4l + 2v and 4l + 2v + 1 of keys u, u + 1
          const __m512d x = _mm512_castps_pd(t[u + v]), y = _mm512_castps_pd(t[u + v + 2]);
          r[u + 2 * v] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
          r[u + 2 * v + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        }
      }
      // r[4a + b]: in each 128-bit lane l, dimension 4l + b of keys 4a .. 4a + 3
      for (int a = 0; a < 4; a += 2)
        for (int b = 0; b < 4; ++b) {
          t[4 * a + b] = _mm512_shuffle_f32x4(r[4 * a + b], r[4 * a + 4 + b], 0x88);
          t[4 * a + 4 + b] = _mm512_shuffle_f32x4(r[4 * a + b], r[4 * a + 4 + b], 0xDD);
        }
      // t[4x + b]: dimensions 4x + b and 8 + 4x + b of keys 0-7; t[8 + 4x + b]: the same of keys 8-15
      for (int b = 0; b < 4; ++b)
        for (int x = 0; x < 2; ++x) {
          const __m512 lo = t[4 * x + b], hi = t[8 + 4 * x + b];
          _mm512_storeu_ps(kt + static_cast<size_t>(d0 + 4 * x + b) * kKeyLanes + u0, _mm512_shuffle_f32x4(lo, hi, 0x88));
          _mm512_storeu_ps(kt + static_cast<size_t>(d0 + 8 + 4 * x + b) * kKeyLanes + u0, _mm512_shuffle_f32x4(lo, hi, 0xDD));
        }
    }
  }
}

// scores of a block's query vectors with a transposed tile's keys: out[i][u] = alpha * q_i . k_u for i < m, u < n
// (qt: the block's kLaneQueries vectors, dimension-major, zeros past the m it has).  partial: scratch for the
// eight lanes' sums, [8][kLaneQueries][2][16]
template <int HC>
__attribute__((target(ES_AVX512_ATTENTION))) void score_lanes_avx512(const float* qt, int m, const float* kt, int h,
                                                                     float alpha, float* const* out, int n,
                                                                     float* partial) {
  constexpr int NQ = kLaneQueries;
  const int chunks = HC ? HC : h / 8;
  for (int j = 0; j < 8; ++j) {
    __m512 acc[NQ][2];
    for (int i = 0; i < NQ; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      const float* row = kt + static_cast<size_t>(8 * c + j) * kKeyLanes;
      const float* qd = qt + static_cast<size_t>(8 * c + j) * kLaneQueries;
      const __m512 k0 = _mm512_loadu_ps(row), k1 = _mm512_loadu_ps(row + 16);
      for (int i = 0; i < NQ; ++i) {
        const __m512 b = _mm512_set1_ps(qd[i]);
        acc[i][0] = _mm512_fmadd_ps(b, k0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(b, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < NQ; ++i) {
      _mm512_storeu_ps(partial + ((j * NQ + i) * 2) * 16, acc[i][0]);
      _mm512_storeu_ps(partial + ((j * NQ + i) * 2 + 1) * 16, acc[i][1]);
    }
  }
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int i = 0; i < m; ++i)
    for (int z = 0; z < 2 && 16 * z < n; ++z) {
      __m512 l[8];
      for (int j = 0; j < 8; ++j) l[j] = _mm512_loadu_ps(partial + ((j * NQ + i) * 2 + z) * 16);
      const __m512 a = _mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6]));
      const __m512 b = _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7]));
      const int keys = std::min(16, n - 16 * z);
      _mm512_mask_storeu_ps(out[i] + 16 * z, static_cast<__mmask16>((1u << keys) - 1u), _mm512_mul_ps(scale, _mm512_add_ps(a, b)));
    }
}

// f(std::integral_constant<int, HC>{}): HC the head size in 8-float chunks for the head sizes the score kernels
// unroll (128 and 64), else 0 (their loop over chunks)
template <class F>
void with_head_chunks(int h, F&& f) {
  if (h == 128)
    f(std::integral_constant<int, 16>{});
  else if (h == 64)
    f(std::integral_constant<int, 8>{});
  else
    f(std::integral_constant<int, 0>{});
}

// exp(x) for x <= 0 (scores minus their maximum): x = n ln 2 + r, exp(r) by Cephes' expf polynomial, 2^n in
// the exponent bits; 0 below the float range, as expf gives.
constexpr float kExpLowest = -87.33654f;
constexpr float kLog2E = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                               4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

__attribute__((target("avx2,fma"))) inline __m256 exp_avx(__m256 x) {
  const __m256 lower = _mm256_set1_ps(kExpLowest);
  __m256 underflow = _mm256_cmp_ps(x, lower, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lower);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, result);
}

// e[i] = exp(e[i] - mx) for i in [0, n); returns their sum (8 lanes in order, then hsum256, then the tail).
__attribute__((target("avx2,fma"))) float exp_sum_avx(float* e, int n, float mx) {
  __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = exp_avx(_mm256_sub_ps(_mm256_loadu_ps(e + i), m));
    _mm256_storeu_ps(e + i, v);
    acc = _mm256_add_ps(acc, v);
  }
  float sum = hsum256(acc);
  if (i < n) {
    float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float lanes[8];
    std::memcpy(tail, e + i, sizeof(float) * (n - i));
    for (int j = n - i; j < 8; ++j) tail[j] = -std::numeric_limits<float>::infinity();
    __m256 v = exp_avx(_mm256_sub_ps(_mm256_loadu_ps(tail), m));
    _mm256_storeu_ps(lanes, v);
    std::memcpy(e + i, lanes, sizeof(float) * (n - i));
    sum += hsum_scalar(lanes);
  }
  return sum;
}

// the largest of e[0..n) (exact whatever the order, so the same as the scalar loop's)
__attribute__((target("avx2,fma"))) float max_avx(const float* e, int n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(e + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float mx = lanes[0];
  for (int j = 1; j < 8; ++j) mx = std::max(mx, lanes[j]);
  for (; i < n; ++i) mx = std::max(mx, e[i]);
  return mx;
}

// e[i] *= s for i in [0, n) (one rounding per element, as the scalar loop's)
__attribute__((target("avx2,fma"))) void scale_avx(float* e, int n, float s) {
  const __m256 f = _mm256_set1_ps(s);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(e + i, _mm256_mul_ps(_mm256_loadu_ps(e + i), f));
  for (; i < n; ++i) e[i] *= s;
}

// out[0..h) += sum over t of p[t] * v[t * stride ..], t in order (h a multiple of 8)
__attribute__((target("avx2,fma"))) void weighted_sum_avx(float* out, const float* p, const float* v, int count,
                                                          int h) {
  for (int c = 0; c < h; c += 64) {
    const int lanes = std::min(64, h - c) / 8;
    __m256 acc[8];
    for (int j = 0; j < lanes; ++j) acc[j] = _mm256_loadu_ps(out + c + 8 * j);
    const float* row = v + c;
    if (lanes == 8) {
      for (int t = 0; t < count; ++t, row += h) {
        __m256 w = _mm256_broadcast_ss(p + t);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * j), acc[j]);
      }
    } else {
      for (int t = 0; t < count; ++t, row += h) {
        __m256 w = _mm256_broadcast_ss(p + t);
        for (int j = 0; j < lanes; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * j), acc[j]);
      }
    }
    for (int j = 0; j < lanes; ++j) _mm256_storeu_ps(out + c + 8 * j, acc[j]);
  }
}

// weighted_sum_avx for three query vectors with the same window: each value row loaded once for the three.
// Every output element sums the same products in the same order as weighted_sum_avx (same bits).
__attribute__((target("avx2,fma"))) void weighted_sum3_avx(float* const* out, const float* const* p, const float* v,
                                                           int count, int h) {
  for (int c = 0; c < h; c += 32) {  // h a multiple of 32
    __m256 a[3][4];
    for (int j = 0; j < 3; ++j)
      for (int l = 0; l < 4; ++l) a[j][l] = _mm256_loadu_ps(out[j] + c + 8 * l);
    const float* row = v + c;
    for (int t = 0; t < count; ++t, row += h) {
      const __m256 x0 = _mm256_loadu_ps(row), x1 = _mm256_loadu_ps(row + 8);
      const __m256 x2 = _mm256_loadu_ps(row + 16), x3 = _mm256_loadu_ps(row + 24);
      for (int j = 0; j < 3; ++j) {
        const __m256 w = _mm256_broadcast_ss(p[j] + t);
        a[j][0] = _mm256_fmadd_ps(w, x0, a[j][0]);
        a[j][1] = _mm256_fmadd_ps(w, x1, a[j][1]);
        a[j][2] = _mm256_fmadd_ps(w, x2, a[j][2]);
        a[j][3] = _mm256_fmadd_ps(w, x3, a[j][3]);
      }
    }
    for (int j = 0; j < 3; ++j)
      for (int l = 0; l < 4; ++l) _mm256_storeu_ps(out[j] + c + 8 * l, a[j][l]);
  }
}

// weighted_sum_avx for NQ query vectors with the same window, on 16 lanes: every output element sums the same
// products in the same order (same bits).  Each 64-float slice of a value row is loaded into registers once
// for the NQ vectors (kept there: folded into each multiply, the loads would outnumber the multiplies).
template <int NQ>
__attribute__((target(ES_AVX512_ATTENTION))) void weighted_sums_avx512(float* const* out, const float* const* p,
                                                                       const float* v, int count, int h) {
  for (int c = 0; c < h; c += 64) {  // h a multiple of 64
    __m512 a[NQ][4];
    for (int j = 0; j < NQ; ++j)
      for (int l = 0; l < 4; ++l) a[j][l] = _mm512_loadu_ps(out[j] + c + 16 * l);
    const float* row = v + c;
    for (int t = 0; t < count; ++t, row += h) {
      __m512 x0 = _mm512_loadu_ps(row), x1 = _mm512_loadu_ps(row + 16);
      __m512 x2 = _mm512_loadu_ps(row + 32), x3 = _mm512_loadu_ps(row + 48);
      asm("" : "+v"(x0), "+v"(x1), "+v"(x2), "+v"(x3));
      for (int j = 0; j < NQ; ++j) {
        const __m512 w = _mm512_set1_ps(p[j][t]);
        a[j][0] = _mm512_fmadd_ps(w, x0, a[j][0]);
        a[j][1] = _mm512_fmadd_ps(w, x1, a[j][1]);
        a[j][2] = _mm512_fmadd_ps(w, x2, a[j][2]);
        a[j][3] = _mm512_fmadd_ps(w, x3, a[j][3]);
      }
    }
    for (int j = 0; j < NQ; ++j)
      for (int l = 0; l < 4; ++l) _mm512_storeu_ps(out[j] + c + 16 * l, a[j][l]);
  }
}

// The softmax's three steps on 16 lanes where the CPU has AVX-512, with the 8-lane functions' bits: the largest
// score is exact in any order, exp and the scaling round each element alone, and exp_sum_avx512 adds each
// 16-lane result to the same 8-lane accumulator half by half, in exp_sum_avx's order.
__attribute__((target(ES_AVX512_ATTENTION))) inline __m512 exp_avx512(__m512 x) {
  const __m512 lower = _mm512_set1_ps(kExpLowest);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lower, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lower);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(e));
}

__attribute__((target(ES_AVX512_ATTENTION))) float exp_sum_avx512(float* e, int n, float mx) {
  const __m512 m = _mm512_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(e + i), m));
    _mm512_storeu_ps(e + i, v);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(v));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  if (i + 8 <= n) {
    const __m256 v = _mm512_castps512_ps256(exp_avx512(_mm512_castps256_ps512(_mm256_sub_ps(_mm256_loadu_ps(e + i), _mm512_castps512_ps256(m)))));
    _mm256_storeu_ps(e + i, v);
    acc = _mm256_add_ps(acc, v);
    i += 8;
  }
  float sum = hsum256(acc);
  if (i < n) {
    alignas(64) float lanes[16];
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), tail, e + i);
    const __m512 v = exp_avx512(_mm512_sub_ps(x, m));
    _mm512_mask_storeu_ps(e + i, tail, v);
    _mm512_store_ps(lanes, v);
    sum += hsum_scalar(lanes);
  }
  return sum;
}

__attribute__((target(ES_AVX512_ATTENTION))) float max_avx512(const float* e, int n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(e + i));
  if (i < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, static_cast<__mmask16>((1u << (n - i)) - 1u), e + i));
  return _mm512_reduce_max_ps(m);
}

__attribute__((target(ES_AVX512_ATTENTION))) void scale_avx512(float* e, int n, float s) {
  const __m512 f = _mm512_set1_ps(s);
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(e + i, _mm512_mul_ps(_mm512_loadu_ps(e + i), f));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(e + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, e + i), f));
  }
}

constexpr int kValueQueries = 6;  // query vectors weighted_sums_avx512 takes at most: 24 accumulators

void value_sums_avx512(int n, float* const* out, const float* const* p, const float* v, int count, int h) {
  switch (n) {
    case 1: weighted_sums_avx512<1>(out, p, v, count, h); break;
    case 2: weighted_sums_avx512<2>(out, p, v, count, h); break;
    case 3: weighted_sums_avx512<3>(out, p, v, count, h); break;
    case 4: weighted_sums_avx512<4>(out, p, v, count, h); break;
    case 5: weighted_sums_avx512<5>(out, p, v, count, h); break;
    default: weighted_sums_avx512<kValueQueries>(out, p, v, count, h); break;
  }
}
#endif

// ---------------------------------------------------------------------------------------------------
// the op

struct Attrs {
  int num_heads = 0;
  int kv_num_heads = 0;
  float scale = 0.f;
  float softcap = 0.f;
  bool do_rotary = false;
  bool rotary_interleaved = false;
  int local_window = -1;
};

struct Tensor {
  const OrtValue* value = nullptr;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

using Error = edge_spec::OpError;

void check(OrtStatus* status) { edge_spec::check_status(g_api, status); }

void require(bool ok, const std::string& message) {
  if (!ok) throw Error{"edge_spec.GroupQueryAttention: " + message};
}

Tensor input(OrtKernelContext* context, size_t index) {
  Tensor t;
  size_t count = 0;
  check(g_api->KernelContext_GetInputCount(context, &count));
  if (index >= count) return t;
  check(g_api->KernelContext_GetInput(context, index, &t.value));
  if (t.value == nullptr) return t;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(g_api->GetTensorTypeAndShape(t.value, &info));
  size_t dims = 0;
  OrtStatus* status = g_api->GetDimensionsCount(info, &dims);
  if (status == nullptr) {
    t.shape.resize(dims);
    if (dims) status = g_api->GetDimensions(info, t.shape.data(), dims);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  check(status);
  void* data = nullptr;
  check(g_api->GetTensorMutableData(const_cast<OrtValue*>(t.value), &data));
  t.data = data;
  return t;
}

void* output_data(OrtKernelContext* context, size_t index, const std::vector<int64_t>& shape) {
  OrtValue* value = nullptr;
  check(g_api->KernelContext_GetOutput(context, index, shape.data(), shape.size(), &value));
  void* data = nullptr;
  check(g_api->GetTensorMutableData(value, &data));
  return data;
}

float* output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& shape) {
  return static_cast<float*>(output_data(context, index, shape));
}

// rotary embedding of one head vector (ORT's RotaryEmbedding: half-split or interleaved pairs)
void rotate(const float* in, float* out, int head, int rotary_dim, const float* cos, const float* sin,
            bool interleaved) {
  const int half = rotary_dim / 2;
  if (interleaved) {
    for (int i = 0; i < half; ++i) {
      const float x = in[2 * i], y = in[2 * i + 1];
      out[2 * i] = x * cos[i] - y * sin[i];
      out[2 * i + 1] = y * cos[i] + x * sin[i];
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float x = in[i], y = in[i + half];
      out[i] = x * cos[i] - y * sin[i];
      out[i + half] = y * cos[i] + x * sin[i];
    }
  }
  for (int i = rotary_dim; i < head; ++i) out[i] = in[i];
}

// ---------------------------------------------------------------------------------------------------
// a float16 cache (the op "GroupQueryAttention" over float16 past/present key and value): keys and values are
// rounded to float16 (nearest, ties to even) as they are written, and every pass reads them back exactly, tile
// by tile, into float32 scratch that the float32 kernels then read.  A row's keys and values are rounded before
// any row of its pass reads them, so batch invariance holds as with a float32 cache.  The conversions give the
// same bits on every path (F16C's, and the portable ones: the rounding below, edge_spec::half_bits_to_float back).

uint16_t float_to_half_scalar(float f) {  // round to nearest, ties to even, as F16C's _MM_FROUND_TO_NEAREST_INT
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN (quiet), infinity
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest half: infinity
  if (x < 0x38800000u) {  // below the smallest normal half: a subnormal (or zero)
    if (x < 0x33000000u) return sign;  // under half the smallest subnormal: zero
    const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // the 24-bit significand shifted to units of 2^-24
    uint32_t h = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  uint32_t h = ((x >> 13) - (112u << 10));  // rebias the exponent: 127 - 15 = 112
  const uint32_t rest = x & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return sign | static_cast<uint16_t>(h);
}

#ifdef ES_X86
// far: bytes past src to ask for into L2, one line for each 64 bytes converted (0: nothing)
__attribute__((target("avx2,f16c"))) void half_to_float_f16c(const uint16_t* src, float* dst, size_t n,
                                                            size_t far = 0) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (far != 0 && i % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(src + i) + far, _MM_HINT_T1);
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = edge_spec::half_bits_to_float(src[i]);
}

__attribute__((target("avx2,f16c"))) void float_to_half_f16c(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = float_to_half_scalar(src[i]);
}

__attribute__((target("avx512f"))) void half_to_float_avx512(const uint16_t* src, float* dst, size_t n,
                                                             size_t far = 0) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (far != 0 && i % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(src + i) + far, _MM_HINT_T1);
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
  half_to_float_f16c(src + i, dst + i, n - i);
}
#endif

bool g_use_f16c = false;

void half_to_float(const uint16_t* src, float* dst, size_t n, size_t far = 0) {
#ifdef ES_X86
  if (g_use_f16c && g_use_avx512) return half_to_float_avx512(src, dst, n, far);
  if (g_use_f16c) return half_to_float_f16c(src, dst, n, far);
#endif
  for (size_t i = 0; i < n; ++i) dst[i] = edge_spec::half_bits_to_float(src[i]);
}

void float_to_half(const float* src, uint16_t* dst, size_t n) {
#ifdef ES_X86
  if (g_use_f16c) return float_to_half_f16c(src, dst, n);
#endif
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_half_scalar(src[i]);
}

struct Pass {  // what one call's work items share
  const Attrs* attrs;
  int batch, rows, head, group, capacity;
  float alpha;
  const float* q;  // rotated queries [B, N, S, H]
  const float* keys;  // present key [B, kvN, capacity, H] (float32 cache)
  const float* values;
  const uint16_t* half_keys;  // or the same in float16 (keys null)
  const uint16_t* half_values;
  const int32_t* seqlens;
  const float* bias;  // attention bias or nullptr
  int64_t bias_b, bias_n, bias_t;
  float* out;  // [B, S, N * H]
  int row_block, blocks_per_head;
  bool avx;  // the AVX2 kernels (a head size that is a multiple of 8, on a CPU that has them)
  bool avx512;  // and the scores' and value sums' AVX-512 kernels, which give the same bits
};

constexpr int kCacheTile = 32;  // keys or value rows a tile: what stays in L1 while every query reads it

// On Intel's cores (where the matmuls' far prefetch is on by the vendor's rule: gguf_far_prefetch,
// EDGE_SPEC_NATIVE_FAR_PREFETCH) a decode or verify pass over a float16 cache asks, as it reads each tile of keys
// or values back, for the tile kFarTiles on into L2, beside the keys' next tile into L1 (Ahead).  A one-row pass
// of the default target after 2,800 tokens 1.03x faster on an Intel Xeon with AMX (1.04x on the AVX2 kernels),
// nothing after 256; 2 tiles on as much, 8 no more, 64 slower (a read ahead that runs past a window's end costs
// bandwidth no row uses).
constexpr int kFarTiles = 4;
bool g_read_back_ahead = false;  // whether such passes ask for tiles kFarTiles on

struct Scratch {
  std::vector<float> scores, acc, pairs, tile;  // tile: a float16 cache's keys or values read back
  std::vector<float> queries, kt, partial;  // a prompt pass's query blocks and transposed key tile, its lanes' sums
};

thread_local Scratch t_scratch;

// one (batch, kv head, block of rows): every grouped query head of those rows
void attend(const Pass& P, size_t item) {
  const Attrs& A = *P.attrs;
  const int blocks = P.blocks_per_head;
  const int b = static_cast<int>(item / (A.kv_num_heads * blocks));
  const int g = static_cast<int>(item / blocks % A.kv_num_heads);
  const int r0 = static_cast<int>(item % blocks) * P.row_block;
  const int r1 = std::min(P.rows, r0 + P.row_block);
  if (r0 >= r1) return;
  const int H = P.head, G = P.group;
  const int total = P.seqlens[b] + 1;
  const int past = total - P.rows;
  const size_t head_base = (static_cast<size_t>(b) * A.kv_num_heads + g) * P.capacity * H;
  const bool half = P.keys == nullptr;  // a float16 cache: each tile read back into scratch.tile first
  const float* K = half ? nullptr : P.keys + head_base;
  const float* V = half ? nullptr : P.values + head_base;
  Scratch& scratch = t_scratch;
  // a decode or verify pass reads its float16 keys and values once: each tile's read-back asks for the bytes
  // kFarTiles tiles on (see g_read_back_ahead)
  const size_t far_bytes = g_read_back_ahead && P.rows <= kFewRows ? sizeof(uint16_t) * kFarTiles * kCacheTile * H : 0;
  // rows [t0, t1) of a head's keys or values as float32, indexed by absolute position like the cache
  auto rows = [&](const float* cache, const uint16_t* half_cache, int t0, int t1) -> const float* {
    if (!half) return cache;
    scratch.tile.resize(static_cast<size_t>(kCacheTile) * H);
    half_to_float(half_cache + head_base + static_cast<size_t>(t0) * H, scratch.tile.data(),
                  static_cast<size_t>(t1 - t0) * H, far_bytes);
    return scratch.tile.data() - static_cast<ptrdiff_t>(t0) * H;
  };

  // each query vector (row s, head n) and its window [lo, hi) of key positions
  const int nq = (r1 - r0) * G;
  std::vector<const float*> qs(nq);
  std::vector<int> lo(nq), hi(nq), head_of(nq), row_of(nq);
  int first = total, last = 0;
  for (int s = r0; s < r1; ++s) {
    const int causal = past + s + 1;
    int start = 0;
    if (A.local_window > 0 && causal > A.local_window) start = causal - A.local_window;
    for (int j = 0; j < G; ++j) {
      const int i = (s - r0) * G + j, n = g * G + j;
      qs[i] = P.q + ((static_cast<size_t>(b) * A.num_heads + n) * P.rows + s) * H;
      lo[i] = start;
      hi[i] = causal;
      head_of[i] = n;
      row_of[i] = s;
    }
    first = std::min(first, start);
    last = std::max(last, causal);
  }
  const int span = last - first;
  scratch.scores.resize(static_cast<size_t>(nq) * span);
  float* scores = scratch.scores.data();  // [nq, span], column t - first

  // scores: each key read once for all nq query vectors
#ifdef ES_X86
  // a decode or verify pass reads its keys from memory once: the first block of query vectors asks for them ahead
  const bool few = P.rows <= kFewRows;
  Ahead keys_ahead;
  if (few && half && P.avx512)
    keys_ahead = {reinterpret_cast<const char*>(P.half_keys + head_base), sizeof(uint16_t) * H, kCacheTile};
  else if (few && !half)
    keys_ahead = {reinterpret_cast<const char*>(K), sizeof(float) * H, kKeysAhead};
  // keys in tiles that stay in L1 while every block of query vectors is scored against them
  constexpr int kKeyTile = kCacheTile;
  static_assert(kKeyTile == kKeyLanes, "a transposed tile holds a cache tile's keys");
  if (P.avx512 && !few && H % 16 == 0) {
    scratch.kt.resize(static_cast<size_t>(kKeyLanes) * H);
    scratch.partial.resize(8 * kLaneQueries * 2 * 16);
    const int qblocks = (nq + kLaneQueries - 1) / kLaneQueries;
    scratch.queries.assign(static_cast<size_t>(qblocks) * H * kLaneQueries, 0.f);  // the last block padded with zeros
    float* qt = scratch.queries.data();  // [block][d][kLaneQueries]: each block's query vectors, dimension-major
    for (int i = 0; i < nq; ++i)
      for (int d = 0; d < H; ++d) qt[(static_cast<size_t>(i / kLaneQueries) * H + d) * kLaneQueries + i % kLaneQueries] = qs[i][d];
    for (int t0 = first; t0 < last; t0 += kKeyTile) {
      const int t1 = std::min(last, t0 + kKeyTile);
      if (half)
        transpose_keys(P.half_keys + head_base + static_cast<size_t>(t0) * H, t1 - t0, H, scratch.kt.data());
      else
        transpose_keys(K + static_cast<size_t>(t0) * H, t1 - t0, H, scratch.kt.data());
      for (int i0 = 0; i0 < nq; i0 += kLaneQueries) {
        const int m = std::min(kLaneQueries, nq - i0);
        float* out[kLaneQueries];
        for (int i = 0; i < m; ++i) out[i] = scores + static_cast<size_t>(i0 + i) * span + (t0 - first);
        with_head_chunks(H, [&](auto hc) {
          score_lanes_avx512<decltype(hc)::value>(qt + static_cast<size_t>(i0) * H, m, scratch.kt.data(), H, P.alpha,
                                                  out, t1 - t0, scratch.partial.data());
        });
      }
    }
  } else if (P.avx512) {
    constexpr int kBlock = 2 * kScorePairs;
    const int chunks = H / 8, blocks = (nq + kBlock - 1) / kBlock;
    scratch.pairs.resize(static_cast<size_t>(blocks) * kScorePairs * chunks * 16);
    pack_query_pairs(qs.data(), nq, H, scratch.pairs.data(), blocks * kScorePairs);
    for (int t0 = first; t0 < last; t0 += kKeyTile) {
      const int t1 = std::min(last, t0 + kKeyTile);
      const float* Kt = rows(K, P.half_keys, t0, t1);
      for (int i0 = 0; i0 < nq; i0 += kBlock) {
        const float* pairs = scratch.pairs.data() + static_cast<size_t>(i0 / 2) * chunks * 16;
        const int m = std::min(kBlock, nq - i0);
        float* row = scores + static_cast<size_t>(i0) * span - first;
        const Ahead& ahead = i0 == 0 ? keys_ahead : Ahead{};
        with_head_chunks(H, [&](auto hc) {
          constexpr int HC = decltype(hc)::value;
          switch ((m + 1) / 2) {
            case 1: score_pairs_avx512<HC, 1>(pairs, m, Kt, t0, t1, H, P.alpha, row, span, ahead); break;
            case 2: score_pairs_avx512<HC, 2>(pairs, m, Kt, t0, t1, H, P.alpha, row, span, ahead); break;
            case 3: score_pairs_avx512<HC, 3>(pairs, m, Kt, t0, t1, H, P.alpha, row, span, ahead); break;
            default: score_pairs_avx512<HC>(pairs, m, Kt, t0, t1, H, P.alpha, row, span, ahead); break;
          }
        });
      }
    }
  } else if (P.avx) {
    for (int t0 = first; t0 < last; t0 += kKeyTile) {
      const int t1 = std::min(last, t0 + kKeyTile);
      const float* Kt = rows(K, P.half_keys, t0, t1);
      for (int i0 = 0; i0 < nq; i0 += kScoreQueries) {
        const int m = std::min(kScoreQueries, nq - i0);
        float* row = scores + static_cast<size_t>(i0) * span - first;
        with_head_chunks(H, [&](auto hc) {
          score_avx<decltype(hc)::value>(qs.data() + i0, m, Kt, t0, t1, H, P.alpha, row, span,
                                         i0 == 0 ? keys_ahead : Ahead{});
        });
      }
    }
  } else
#endif
  {
    for (int t = first; t < last; ++t) {
      const float* k = rows(K, P.half_keys, t, t + 1) + static_cast<size_t>(t) * H;
      for (int i = 0; i < nq; ++i) scores[static_cast<size_t>(i) * span + (t - first)] = P.alpha * dot_scalar(qs[i], k, H);
    }
  }

  // softmax of each query vector over its own window (softcap, then bias, as ORT applies them)
  for (int i = 0; i < nq; ++i) {
    float* e = scores + static_cast<size_t>(i) * span + (lo[i] - first);
    const int n = hi[i] - lo[i];
    if (A.softcap > 0.f)
      for (int t = 0; t < n; ++t) e[t] = A.softcap * std::tanh(e[t] / A.softcap);
    if (P.bias != nullptr) {
      const float* brow = P.bias;
      if (P.bias_b != 1) brow += static_cast<size_t>(b) * P.bias_n * P.rows * P.bias_t;
      if (P.bias_n != 1) brow += static_cast<size_t>(head_of[i]) * P.rows * P.bias_t;
      brow += static_cast<size_t>(row_of[i]) * P.bias_t;
      if (P.bias_t == 1) {
        for (int t = 0; t < n; ++t) e[t] += brow[0];
      } else {
        for (int t = 0; t < n; ++t) e[t] += brow[lo[i] + t];
      }
    }
#ifdef ES_X86
    if (P.avx512) {
      scale_avx512(e, n, 1.f / exp_sum_avx512(e, n, max_avx512(e, n)));
      continue;
    }
    if (P.avx) {
      scale_avx(e, n, 1.f / exp_sum_avx(e, n, max_avx(e, n)));
      continue;
    }
#endif
    float mx = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) mx = std::max(mx, e[t]);
    float sum = 0.f;
    for (int t = 0; t < n; ++t) {
      e[t] = std::exp(e[t] - mx);
      sum += e[t];
    }
    const float inv = 1.f / sum;
    for (int t = 0; t < n; ++t) e[t] *= inv;
  }

  // values: for each query vector, its probabilities times the value rows of its window, in order
  scratch.acc.assign(static_cast<size_t>(nq) * H, 0.f);
  float* acc = scratch.acc.data();
  constexpr int kTile = kCacheTile;  // value rows per tile: read from memory once, then from L1 for every query
  for (int t0 = first; t0 < last; t0 += kTile) {
    const int t1 = std::min(last, t0 + kTile);
    const float* Vt = rows(V, P.half_values, t0, t1);
    for (int i = 0; i < nq; ++i) {
      const int a = std::max(t0, lo[i]), z = std::min(t1, hi[i]);
      if (a >= z) continue;
      const float* p = scores + static_cast<size_t>(i) * span + (a - first);
      const float* v = Vt + static_cast<size_t>(a) * H;
      float* o = acc + static_cast<size_t>(i) * H;
#ifdef ES_X86
      if (P.avx) {
        // the heads of one row share its window: several at a time where the row has them
        if (P.avx512 && H % 64 == 0) {
          const int n = std::min(kValueQueries, G - i % G);
          float* outs[kValueQueries];
          const float* ps[kValueQueries];
          for (int j = 0; j < n; ++j) {
            outs[j] = o + static_cast<size_t>(j) * H;
            ps[j] = p + static_cast<size_t>(j) * span;
          }
          value_sums_avx512(n, outs, ps, v, z - a, H);
          i += n - 1;
        } else if ((i % G) + 3 <= G && H % 32 == 0) {
          float* outs[3] = {o, o + H, o + 2 * H};
          const float* ps[3] = {p, p + span, p + 2 * span};
          weighted_sum3_avx(outs, ps, v, z - a, H);
          i += 2;
        } else {
          weighted_sum_avx(o, p, v, z - a, H);
        }
        continue;
      }
#endif
      for (int t = 0; t < z - a; ++t)
        for (int h = 0; h < H; ++h) o[h] += p[t] * v[static_cast<size_t>(t) * H + h];
    }
  }
  for (int i = 0; i < nq; ++i) {
    float* o = P.out + (static_cast<size_t>(b) * P.rows + row_of[i]) * A.num_heads * H + static_cast<size_t>(head_of[i]) * H;
    std::memcpy(o, acc + static_cast<size_t>(i) * H, sizeof(float) * H);
  }
}

void run_item(void* pass, size_t item) { attend(*static_cast<const Pass*>(pass), item); }

// ---------------------------------------------------------------------------------------------------
// the prompt path: bfloat16 products for a graph that reads prompts (attribute bf16_products = 1)
//
// A pass of hundreds of rows is bound by arithmetic, not by reading the cache.  Queries (scaled), keys,
// values and the softmax weights are rounded to bfloat16 and multiplied on AMX's tiles, accumulated in
// float32: 16 query vectors against 32 keys, then their weights against 16 value pairs, per instruction
// pair.  AVX-512's pairwise bfloat16 dot products run at float32's FMA rate on the same CPUs, so they buy
// nothing over ORT's float32 GEMMs; the tiles do.  Keys and values are packed once per pass into the
// layouts the tiles read, and each block of rows scores only the keys of its causal window.  Not
// batch-invariant, and it rounds: only a graph whose outputs are allowed to differ (a prompt reader) asks
// for it, and the decoded rows keep the float32 path above.

#ifdef ES_X86

constexpr int kKeyTileBf16 = 32;  // keys per packed tile: two AMX tiles of 16 columns

struct PromptPass {  // a prompt pass: the call's Pass, and the packed keys and values its work items read
  const Pass* pass;
  int tiles, pairs;  // key tiles of kKeyTileBf16 and key pairs packed per (batch, kv head)
  uint32_t* kpack;  // [B * kvN][tiles][H / 2][32]: bf16 pairs (k[t][2p], k[t][2p + 1])
  uint16_t* vpack;  // [B * kvN][pairs][H][2]: (v[2j][d], v[2j + 1][d])
  int row_block, blocks_per_head;
};

// pack one (batch, kv head)'s keys and values of [0, total), zeros after
// out[p] = the bf16 pair (scale * x[2p], scale * x[2p + 1]) for p < HP, a multiple of 16 (VCVTNE2PS2BF16)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void bf16_pairs(const float* x, float scale,
                                                                              uint32_t* out, int HP) {
  const __m512 f = _mm512_set1_ps(scale);
  for (int c = 0; c < HP; c += 16) {
    const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(x + 2 * c), f);
    const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(x + 2 * c + 16), f);
    _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// pack one (batch, kv head)'s keys and values of [0, total), zeros after
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void pack_head(const PromptPass& R, size_t item) {
  const Pass& P = *R.pass;
  const Attrs& A = *P.attrs;
  const int b = static_cast<int>(item / A.kv_num_heads), g = static_cast<int>(item % A.kv_num_heads);
  const int H = P.head, HP = H / 2, total = P.seqlens[b] + 1;
  const float* K = P.keys + (static_cast<size_t>(b) * A.kv_num_heads + g) * P.capacity * H;
  const float* V = P.values + (static_cast<size_t>(b) * A.kv_num_heads + g) * P.capacity * H;
  uint32_t* kp = R.kpack + item * static_cast<size_t>(R.tiles) * HP * kKeyTileBf16;
  uint16_t* vp = R.vpack + item * static_cast<size_t>(R.pairs) * H * 2;
  const int keys = R.tiles * kKeyTileBf16;
  uint32_t pairs[64];  // one key's bf16 pairs (H <= 128)
  for (int t = 0; t < keys; ++t) {
    uint32_t* tile = kp + static_cast<size_t>(t / kKeyTileBf16) * HP * kKeyTileBf16 + t % kKeyTileBf16;
    if (t < total)
      bf16_pairs(K + static_cast<size_t>(t) * H, 1.f, pairs, HP);
    else
      std::memset(pairs, 0, sizeof(uint32_t) * HP);
    for (int p = 0; p < HP; ++p) tile[static_cast<size_t>(p) * kKeyTileBf16] = pairs[p];
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int j = 0; j < R.pairs; ++j) {
    uint32_t* row = reinterpret_cast<uint32_t*>(vp + static_cast<size_t>(j) * H * 2);  // (v[2j][d], v[2j + 1][d])
    const float* v0 = V + static_cast<size_t>(2 * j) * H;
    const float* v1 = v0 + H;
    const bool has0 = 2 * j < total, has1 = 2 * j + 1 < total;
    for (int d = 0; d < H; d += 16) {
      const __m256i a = (__m256i)_mm512_cvtneps_pbh(has0 ? _mm512_loadu_ps(v0 + d) : zero);
      const __m256i c = (__m256i)_mm512_cvtneps_pbh(has1 ? _mm512_loadu_ps(v1 + d) : zero);
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(c), 16));
      _mm512_storeu_si512(row + d, pair);
    }
  }
}

void run_pack(void* pass, size_t item) { pack_head(*static_cast<const PromptPass*>(pass), item); }

__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {  // exp_avx, 16 lanes
  const __m512 lower = _mm512_set1_ps(kExpLowest);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lower, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lower);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// e[0..n) = bf16(exp(s[0..n) - max)), zeros on to `padded`; returns the sum of the rounded weights
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) float softmax_weights_bf16(const float* s, int n, int padded,
                                                                                 uint16_t* e) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int t = 0;
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  float mx = _mm512_reduce_max_ps(m);
  for (int i = t; i < n; ++i) mx = std::max(mx, s[i]);
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t < padded; t += 16) {
    const int left = n - t;
    const __mmask16 live = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                      : (left <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << left) - 1));
    const __m512 x = _mm512_maskz_loadu_ps(live, s + t);
    const __m512 w = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, mv)));
    const __m256bh h = _mm512_cvtneps_pbh(w);
    const __m256i hi = (__m256i)h;
    const int keep = std::min(16, padded - t);
    if (keep == 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + t), hi);
    else
      _mm256_mask_storeu_epi16(e + t, static_cast<__mmask16>((1u << keep) - 1), hi);
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
  }
  return _mm512_reduce_add_ps(sum);
}

struct PromptScratch {
  std::vector<uint32_t> q;
  std::vector<float> scores, acc;
  std::vector<uint16_t> weights;
};

thread_local PromptScratch t_prompt;


// sc[0..n) += the row's attention bias (one value for every key where the bias has one column)
__attribute__((target("avx512f"))) void add_bias(float* sc, const float* brow, bool one, int n) {
  int t = 0;
  if (one) {
    const __m512 v = _mm512_set1_ps(brow[0]);
    for (; t + 16 <= n; t += 16) _mm512_storeu_ps(sc + t, _mm512_add_ps(_mm512_loadu_ps(sc + t), v));
    for (; t < n; ++t) sc[t] += brow[0];
    return;
  }
  for (; t + 16 <= n; t += 16)
    _mm512_storeu_ps(sc + t, _mm512_add_ps(_mm512_loadu_ps(sc + t), _mm512_loadu_ps(brow + t)));
  for (; t < n; ++t) sc[t] += brow[t];
}

// AMX's tile unit does the products (16 x 32 bf16 times 32 x 16 per instruction): query
// vectors 16 at a time against 32 keys per packed tile, then their weights against 16 value pairs a step.

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void attend_amx(const PromptPass& R,
                                                                                                   size_t item) {
  const Pass& P = *R.pass;
  const Attrs& A = *P.attrs;
  const int blocks = R.blocks_per_head;
  const int b = static_cast<int>(item / (A.kv_num_heads * blocks));
  const int g = static_cast<int>(item / blocks % A.kv_num_heads);
  const int r0 = static_cast<int>(item % blocks) * R.row_block;
  const int r1 = std::min(P.rows, r0 + R.row_block);
  const int H = P.head, HP = H / 2, G = P.group;
  const int total = P.seqlens[b] + 1, past = total - P.rows;
  const size_t head_item = static_cast<size_t>(b) * A.kv_num_heads + g;
  const uint32_t* kp = R.kpack + head_item * static_cast<size_t>(R.tiles) * HP * kKeyTileBf16;
  const uint16_t* vp = R.vpack + head_item * static_cast<size_t>(R.pairs) * H * 2;
  const size_t ld = static_cast<size_t>(R.tiles) * kKeyTileBf16;
  PromptScratch& w = t_prompt;
  w.q.resize(16 * static_cast<size_t>(HP));
  w.scores.resize(16 * ld);
  w.weights.resize(16 * ld);
  w.acc.resize(16 * static_cast<size_t>(H));
  const edge_spec::TileConfig config = edge_spec::full_tiles();
  edge_spec::load_tile_config(config);
  const int vectors = (r1 - r0) * G;
  for (int v0 = 0; v0 < vectors; v0 += 16) {
    const int m = std::min(16, vectors - v0);
    int end = 0;
    for (int i = 0; i < 16; ++i) {
      uint32_t* qrow = w.q.data() + static_cast<size_t>(i) * HP;
      if (i >= m) {
        std::memset(qrow, 0, sizeof(uint32_t) * HP);
        continue;
      }
      const int s = r0 + (v0 + i) / G, n = g * G + (v0 + i) % G;
      end = std::max(end, past + s + 1);
      bf16_pairs(P.q + ((static_cast<size_t>(b) * A.num_heads + n) * P.rows + s) * H, P.alpha, qrow, HP);
    }
    const int tiles = (end + kKeyTileBf16 - 1) / kKeyTileBf16;
    const int steps = HP / 16;  // 32 head dimensions a step
    const int qstride = HP * 4;
    const uint32_t* qb = w.q.data();
    _tile_loadd(4, qb, qstride);
    _tile_loadd(5, qb + 16, qstride);
    if (steps > 2) {
      _tile_loadd(6, qb + 32, qstride);
      _tile_loadd(7, qb + 48, qstride);
    }
    for (int u = 0; u < tiles; ++u) {
      const uint32_t* tile = kp + static_cast<size_t>(u) * HP * kKeyTileBf16;
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, tile, kKeyTileBf16 * 4);
      _tile_loadd(3, tile + 16, kKeyTileBf16 * 4);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
      _tile_loadd(2, tile + 16 * kKeyTileBf16, kKeyTileBf16 * 4);
      _tile_loadd(3, tile + 16 * kKeyTileBf16 + 16, kKeyTileBf16 * 4);
      _tile_dpbf16ps(0, 5, 2);
      _tile_dpbf16ps(1, 5, 3);
      if (steps > 2) {
        _tile_loadd(2, tile + 32 * kKeyTileBf16, kKeyTileBf16 * 4);
        _tile_loadd(3, tile + 32 * kKeyTileBf16 + 16, kKeyTileBf16 * 4);
        _tile_dpbf16ps(0, 6, 2);
        _tile_dpbf16ps(1, 6, 3);
        _tile_loadd(2, tile + 48 * kKeyTileBf16, kKeyTileBf16 * 4);
        _tile_loadd(3, tile + 48 * kKeyTileBf16 + 16, kKeyTileBf16 * 4);
        _tile_dpbf16ps(0, 7, 2);
        _tile_dpbf16ps(1, 7, 3);
      }
      float* s = w.scores.data() + static_cast<size_t>(u) * kKeyTileBf16;
      _tile_stored(0, s, static_cast<long>(ld * 4));
      _tile_stored(1, s + 16, static_cast<long>(ld * 4));
    }
    const int padded = tiles * kKeyTileBf16;
    float sums[16];
    for (int i = 0; i < 16; ++i) {
      uint16_t* e = w.weights.data() + i * ld;
      if (i >= m) {
        std::memset(e, 0, sizeof(uint16_t) * padded);
        sums[i] = 1.f;
        continue;
      }
      const int s = r0 + (v0 + i) / G, n = g * G + (v0 + i) % G, window = past + s + 1;
      float* sc = w.scores.data() + i * ld;
      if (P.bias != nullptr) {
        const float* brow = P.bias;
        if (P.bias_b != 1) brow += static_cast<size_t>(b) * P.bias_n * P.rows * P.bias_t;
        if (P.bias_n != 1) brow += static_cast<size_t>(n) * P.rows * P.bias_t;
        brow += static_cast<size_t>(s) * P.bias_t;
        add_bias(sc, brow, P.bias_t == 1, window);
      }
      sums[i] = softmax_weights_bf16(sc, window, padded, e);
    }
    for (int d0 = 0; d0 < H; d0 += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int j0 = 0; j0 < padded / 2; j0 += 16) {  // 16 key pairs a step
        _tile_loadd(4, w.weights.data() + 2 * j0, static_cast<long>(ld * 2));
        const uint16_t* vrow = vp + static_cast<size_t>(j0) * H * 2 + static_cast<size_t>(d0) * 2;
        _tile_loadd(5, vrow, H * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, vrow + 32, H * 4);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, vrow + 64, H * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, vrow + 96, H * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
      float* acc = w.acc.data() + d0;
      _tile_stored(0, acc, H * 4);
      _tile_stored(1, acc + 16, H * 4);
      _tile_stored(2, acc + 32, H * 4);
      _tile_stored(3, acc + 48, H * 4);
    }
    for (int i = 0; i < m; ++i) {
      const int s = r0 + (v0 + i) / G, n = g * G + (v0 + i) % G;
      float* o = P.out + (static_cast<size_t>(b) * P.rows + s) * A.num_heads * H + static_cast<size_t>(n) * H;
      const float inv = 1.f / sums[i];
      const float* a = w.acc.data() + static_cast<size_t>(i) * H;
      for (int d = 0; d < H; ++d) o[d] = a[d] * inv;
    }
  }
  _tile_release();
}

void run_item_amx(void* pass, size_t item) { attend_amx(*static_cast<const PromptPass*>(pass), item); }
#endif

struct Kernel {
  Attrs attrs;
  bool bf16_products = false;  // a prompt graph's op: the bfloat16 path where the CPU has it
  bool half_cache = false;  // past and present key and value in float16 (the op registered for them)
  int threads = 0;  // the session's threads, where the graph says (a float16 cache's blocks of rows follow them)
};

int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  return edge_spec::attribute_int(g_api, info, name, fallback);
}

float attr_float(const OrtKernelInfo* info, const char* name, float fallback) {
  return edge_spec::attribute_float(g_api, info, name, fallback);
}

void compute(const Kernel& kernel, OrtKernelContext* context) {
  const Attrs& A = kernel.attrs;
  Tensor query = input(context, 0), key = input(context, 1), value = input(context, 2);
  Tensor past_key = input(context, 3), past_value = input(context, 4);
  Tensor seqlens = input(context, 5), total_len = input(context, 6);
  Tensor cos = input(context, 7), sin = input(context, 8);
  Tensor position_ids = input(context, 9), bias = input(context, 10);
  Tensor head_sink = input(context, 11);
  require(head_sink.value == nullptr, "head_sink is not supported");
  require(query.shape.size() == 3, "query must be [batch, sequence, hidden]");
  require(past_key.value != nullptr && past_value.value != nullptr, "past_key and past_value are required");
  require(past_key.shape.size() == 4 && past_key.shape == past_value.shape, "past key/value must be [B, kvN, L, H]");
  const int B = static_cast<int>(query.shape[0]), S = static_cast<int>(query.shape[1]);
  const int N = A.num_heads, kvN = A.kv_num_heads;
  require(N % kvN == 0, "num_heads must be a multiple of kv_num_heads");
  const bool packed = key.value == nullptr;
  const int H = static_cast<int>(past_key.shape[3]);
  const int64_t width = query.shape[2];
  require(packed ? width == static_cast<int64_t>(N + 2 * kvN) * H : width == static_cast<int64_t>(N) * H,
          "query width does not match the heads");
  require(past_key.shape[0] == B && past_key.shape[1] == kvN, "past key/value batch or heads do not match");
  require(seqlens.value != nullptr && static_cast<int>(seqlens.shape.empty() ? 1 : seqlens.shape[0]) == B,
          "seqlens_k must be [batch]");
  const int32_t* seqlens_k = static_cast<const int32_t*>(seqlens.data);
  const int total_sequence = *static_cast<const int32_t*>(total_len.data);
  const int past_len = static_cast<int>(past_key.shape[2]);
  const int capacity = std::max(past_len, total_sequence);
  for (int b = 0; b < B; ++b) {
    require(seqlens_k[b] + 1 >= S && seqlens_k[b] + 1 <= capacity, "seqlens_k out of range");
  }
  int rotary_dim = 0;
  if (A.do_rotary) {
    require(cos.value != nullptr && sin.value != nullptr && cos.shape.size() == 2, "rotary needs cos/sin caches");
    rotary_dim = static_cast<int>(cos.shape[1]) * 2;
    require(rotary_dim <= H, "rotary dimension exceeds the head size");
  }

  std::vector<int64_t> out_shape = {B, S, static_cast<int64_t>(N) * H};
  std::vector<int64_t> kv_shape = {B, kvN, capacity, H};
  float* out = output(context, 0, out_shape);
  const bool half = kernel.half_cache;
  const size_t item = half ? sizeof(uint16_t) : sizeof(float);  // bytes a cached value
  char* present_key = static_cast<char*>(output_data(context, 1, kv_shape));
  char* present_value = static_cast<char*>(output_data(context, 2, kv_shape));
  const char* pk = static_cast<const char*>(past_key.data);
  const char* pv = static_cast<const char*>(past_value.data);
  const bool shared = pk == present_key && pv == present_value;
  if (!shared) {  // ORT's layout: zeros, then the past positions, then the new ones
    const size_t plane = static_cast<size_t>(capacity) * H;
    std::memset(present_key, 0, item * B * kvN * plane);
    std::memset(present_value, 0, item * B * kvN * plane);
    for (int b = 0; b < B; ++b) {
      const int past = seqlens_k[b] + 1 - S;
      for (int g = 0; g < kvN; ++g) {
        const size_t src = (static_cast<size_t>(b) * kvN + g) * past_len * H;
        const size_t dst = (static_cast<size_t>(b) * kvN + g) * plane;
        std::memcpy(present_key + dst * item, pk + src * item, item * past * H);
        std::memcpy(present_value + dst * item, pv + src * item, item * past * H);
      }
    }
  }
  // a new key or value row into the cache (rounded to float16 there before any row reads it)
  std::vector<float> rotated(A.do_rotary ? H : 0);
  auto store = [&](char* cache, size_t slot, const float* row) {
    if (half)
      float_to_half(row, reinterpret_cast<uint16_t*>(cache) + slot, H);
    else
      std::memcpy(reinterpret_cast<float*>(cache) + slot, row, sizeof(float) * H);
  };

  // rotated queries [B, N, S, H]; rotated keys and raw values go straight into the cache
  const float* qdata = static_cast<const float*>(query.data);
  const float* kdata = packed ? qdata + static_cast<size_t>(N) * H : static_cast<const float*>(key.data);
  const float* vdata = packed ? qdata + static_cast<size_t>(N + kvN) * H : static_cast<const float*>(value.data);
  const size_t q_stride = static_cast<size_t>(width), kv_stride = packed ? width : static_cast<size_t>(kvN) * H;
  std::vector<float> q(static_cast<size_t>(B) * N * S * H);
  const int64_t* pos_ids = static_cast<const int64_t*>(position_ids.data);
  const float* cos_data = static_cast<const float*>(cos.data);
  const float* sin_data = static_cast<const float*>(sin.data);
  const int64_t table_rows = A.do_rotary ? cos.shape[0] : 0;
  for (int b = 0; b < B; ++b) {
    const int past = seqlens_k[b] + 1 - S;
    for (int s = 0; s < S; ++s) {
      const size_t row = static_cast<size_t>(b) * S + s;
      const float* cs = nullptr;
      const float* sn = nullptr;
      if (A.do_rotary) {
        const int64_t pos = pos_ids != nullptr ? pos_ids[row] : past + s;
        require(pos >= 0 && pos < table_rows, "rotary position beyond the cos/sin caches");
        cs = cos_data + pos * (rotary_dim / 2);
        sn = sin_data + pos * (rotary_dim / 2);
      }
      for (int n = 0; n < N; ++n) {
        const float* src = qdata + row * q_stride + static_cast<size_t>(n) * H;
        float* dst = q.data() + ((static_cast<size_t>(b) * N + n) * S + s) * H;
        if (A.do_rotary)
          rotate(src, dst, H, rotary_dim, cs, sn, A.rotary_interleaved);
        else
          std::memcpy(dst, src, sizeof(float) * H);
      }
      for (int g = 0; g < kvN; ++g) {
        const size_t slot = ((static_cast<size_t>(b) * kvN + g) * capacity + past + s) * H;
        const float* ksrc = kdata + row * kv_stride + static_cast<size_t>(g) * H;
        const float* vsrc = vdata + row * kv_stride + static_cast<size_t>(g) * H;
        if (A.do_rotary) rotate(ksrc, rotated.data(), H, rotary_dim, cs, sn, A.rotary_interleaved);
        store(present_key, slot, A.do_rotary ? rotated.data() : ksrc);
        store(present_value, slot, vsrc);
      }
    }
  }

  Pass P{};
  P.attrs = &A;
  P.batch = B;
  P.rows = S;
  P.head = H;
  P.group = N / kvN;
  P.capacity = capacity;
  P.alpha = A.scale == 0.f ? 1.f / std::sqrt(static_cast<float>(H)) : A.scale;
  P.q = q.data();
  if (half) {
    P.half_keys = reinterpret_cast<const uint16_t*>(present_key);
    P.half_values = reinterpret_cast<const uint16_t*>(present_value);
  } else {
    P.keys = reinterpret_cast<const float*>(present_key);
    P.values = reinterpret_cast<const float*>(present_value);
  }
  P.seqlens = seqlens_k;
  P.out = out;
  P.avx = g_use_avx2 && H % 8 == 0;
  P.avx512 = P.avx && g_use_avx512;
  if (bias.value != nullptr) {
    require(bias.shape.size() == 4 && bias.shape[2] == S, "attention_bias must be [B or 1, N or 1, S, T]");
    P.bias = static_cast<const float*>(bias.data);
    P.bias_b = bias.shape[0];
    P.bias_n = bias.shape[1];
    P.bias_t = bias.shape[3];
    for (int b = 0; b < B; ++b) require(P.bias_t == 1 || P.bias_t >= seqlens_k[b] + 1, "attention_bias too short");
  }
#ifdef ES_X86
  if (kernel.bf16_products && !half && g_use_amx && H % 64 == 0 && H <= 128 && A.softcap == 0.f && A.local_window <= 0) {
    int longest = 0;
    for (int b = 0; b < B; ++b) longest = std::max(longest, seqlens_k[b] + 1);
    PromptPass R{};
    R.pass = &P;
    R.tiles = (longest + kKeyTileBf16 - 1) / kKeyTileBf16;
    R.pairs = R.tiles * kKeyTileBf16 / 2;
    const size_t heads = static_cast<size_t>(B) * kvN;
    std::vector<uint32_t> kpack(heads * R.tiles * (H / 2) * kKeyTileBf16);
    std::vector<uint16_t> vpack(heads * R.pairs * H * 2);
    R.kpack = kpack.data();
    R.vpack = vpack.data();
    check(g_api->KernelContext_ParallelFor(context, run_pack, heads, 0, &R));
    R.row_block = 16;  // rows per work item: their query vectors go 16 at a time
    R.blocks_per_head = (S + R.row_block - 1) / R.row_block;
    check(g_api->KernelContext_ParallelFor(context, run_item_amx, heads * R.blocks_per_head, 0, &R));
    return;
  }
#endif
  // work items: (batch, kv head, block of rows); a row's result does not depend on its block.  Every block
  // streams its heads' keys and values once: a few items for the threads of a verify pass, large blocks
  // for a prefill chunk (its queries stay in L2 while each key is read).
  P.row_block = S <= 2 ? S : (S <= kFewRows ? 4 : 32);
  if (half && S <= kFewRows && kernel.threads > 0) {
    // a float16 cache is read back tile by tile in every block of rows: as few blocks as keep the threads busy
    const int per_head = std::max(1, (kernel.threads + B * kvN - 1) / (B * kvN));
    P.row_block = std::max(1, (S + per_head - 1) / per_head);
  }
  P.blocks_per_head = (S + P.row_block - 1) / P.row_block;
  const size_t items = static_cast<size_t>(B) * kvN * P.blocks_per_head;
  if (items == 1) {
    attend(P, 0);
  } else {
    check(g_api->KernelContext_ParallelFor(context, run_item, items, 0, &P));
  }
}

// ---------------------------------------------------------------------------------------------------
// registration

constexpr const char* kDomain = "ai.edge_spec";
constexpr size_t kInputs = 12;
constexpr size_t kOutputs = 3;

ONNXTensorElementDataType input_type(size_t index) {
  switch (index) {
    case 5:
    case 6:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case 9:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    default:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}

OrtStatusPtr ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  return edge_spec::guarded(g_api, [&] {
    auto* kernel = new Kernel();
    Attrs& a = kernel->attrs;
    a.num_heads = static_cast<int>(attr_int(info, "num_heads", 0));
    a.kv_num_heads = static_cast<int>(attr_int(info, "kv_num_heads", 0));
    a.scale = attr_float(info, "scale", 0.f);
    a.softcap = attr_float(info, "softcap", 0.f);
    a.do_rotary = attr_int(info, "do_rotary", 0) == 1;
    a.rotary_interleaved = attr_int(info, "rotary_interleaved", 0) == 1;
    a.local_window = static_cast<int>(attr_int(info, "local_window_size", -1));
    kernel->bf16_products = attr_int(info, "bf16_products", 0) == 1;
    kernel->threads = static_cast<int>(attr_int(info, "threads", 0));
    const bool smooth = attr_int(info, "smooth_softmax", 0) == 1;
    if (a.num_heads <= 0 || a.kv_num_heads <= 0 || smooth) {
      delete kernel;
      throw Error{"edge_spec.GroupQueryAttention: num_heads and kv_num_heads are required; smooth_softmax is not supported"};
    }
    *out = kernel;
  });
}

OrtStatusPtr ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* context) {
  return edge_spec::guarded(g_api, [&] { compute(*static_cast<Kernel*>(kernel), context); });
}

void ORT_API_CALL destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }
const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "GroupQueryAttention"; }
ONNXTensorElementDataType ORT_API_CALL op_input_type(const OrtCustomOp*, size_t index) { return input_type(index); }
size_t ORT_API_CALL op_input_count(const OrtCustomOp*) { return kInputs; }
ONNXTensorElementDataType ORT_API_CALL op_output_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
size_t ORT_API_CALL op_output_count(const OrtCustomOp*) { return kOutputs; }
OrtCustomOpInputOutputCharacteristic ORT_API_CALL op_input_kind(const OrtCustomOp*, size_t index) {
  const bool required = index == 0 || (index >= 3 && index <= 6);
  return required ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}
OrtCustomOpInputOutputCharacteristic ORT_API_CALL op_output_kind(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}

// the op over a float16 cache: past and present key and value in float16, everything else as above
ONNXTensorElementDataType ORT_API_CALL half_op_input_type(const OrtCustomOp*, size_t index) {
  return index == 3 || index == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : input_type(index);
}
ONNXTensorElementDataType ORT_API_CALL half_op_output_type(const OrtCustomOp*, size_t index) {
  return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}
OrtStatusPtr ORT_API_CALL create_half_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                             void** out) {
  OrtStatusPtr status = create_kernel(op, api, info, out);
  if (status == nullptr) {
    auto* kernel = static_cast<Kernel*>(*out);
    kernel->half_cache = true;
    if (kernel->bf16_products) {
      delete kernel;
      return g_api->CreateStatus(ORT_INVALID_ARGUMENT,
                                 "edge_spec.GroupQueryAttention: a float16 cache has no bfloat16 prompt path");
    }
  }
  return status;
}

OrtCustomOp make_op() {
  OrtCustomOp op = edge_spec::cpu_op_table(kApiVersion);
  op.GetName = op_name;
  op.GetInputType = op_input_type;
  op.GetInputTypeCount = op_input_count;
  op.GetOutputType = op_output_type;
  op.GetOutputTypeCount = op_output_count;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = op_input_kind;
  op.GetOutputCharacteristic = op_output_kind;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute_kernel;
  return op;
}

OrtCustomOp make_half_op() {
  OrtCustomOp op = make_op();
  op.GetInputType = half_op_input_type;
  op.GetOutputType = half_op_output_type;
  op.CreateKernelV2 = create_half_kernel;
  return op;
}

OrtCustomOp g_op = make_op();
OrtCustomOp g_half_op = make_half_op();
OrtCustomOpDomain* g_domain = nullptr;

bool cpu_has_avx2() {
#ifdef ES_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// the CPU features the AVX-512 kernels (the scores' and the value sums') need on top of the AVX2 ones
bool cpu_has_avx512() {
#ifdef ES_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// the kernels this CPU and the environment ask for
edge_spec::KernelPath attention_kernels() {
  return edge_spec::chosen_kernels(cpu_has_avx2(), cpu_has_avx512());
}

// the prompt path: AMX's bfloat16 tiles (with AVX-512 around them), unless EDGE_SPEC_NATIVE_SCALAR=1 or
// EDGE_SPEC_NATIVE_AMX=0 turn it off
bool prompt_path_here() {
#ifdef ES_X86
  using edge_spec::switch_is;
  if (switch_is("EDGE_SPEC_NATIVE_SCALAR", '1') || switch_is("EDGE_SPEC_NATIVE_AMX", '0')) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         edge_spec::amx_usable(edge_spec::AmxUnit::bf16);
#else
  return false;
#endif
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* api_base) {
  g_api = api_base->GetApi(kApiVersion);
  if (g_api == nullptr) return nullptr;  // too old a runtime: nothing to report through
  const edge_spec::KernelPath kernels = attention_kernels();
  g_use_avx2 = kernels != edge_spec::KernelPath::scalar;
  g_use_avx512 = kernels == edge_spec::KernelPath::avx512;
#ifdef ES_X86
  __builtin_cpu_init();
  g_use_f16c = g_use_avx2 && __builtin_cpu_supports("f16c");
#endif
#ifdef ES_X86
  g_use_amx = prompt_path_here();
#endif
  g_read_back_ahead = edge_spec::gguf_far_prefetch();
  if (g_domain == nullptr) {
    if (OrtStatus* status = g_api->CreateCustomOpDomain(kDomain, &g_domain)) return status;
    if (OrtStatus* status = g_api->CustomOpDomain_Add(g_domain, &g_op)) return status;
    if (OrtStatus* status = g_api->CustomOpDomain_Add(g_domain, &g_half_op)) return status;
    if (OrtStatus* status = g_api->CustomOpDomain_Add(g_domain, edge_spec::gguf_matmul_op(g_api))) return status;
  }
  return g_api->AddCustomOpDomain(options, g_domain);
}

// which kernels this process runs: "avx512" (its scores and value sums; the rest AVX2), "avx2" or "scalar" (for
// tests and reports)
__attribute__((visibility("default"))) const char* EdgeSpecAttentionPath() {
  return edge_spec::kernel_path_name(attention_kernels());
}

// which kernels MatMulGGUF runs here: "avx512", "avxvnni", "avx2" or "scalar"
__attribute__((visibility("default"))) const char* EdgeSpecGGUFMatMulPath() { return edge_spec::gguf_matmul_path(); }

// where MatMulGGUF's passes of many rows multiply here: "amx" (AMX's tiles) or ""
__attribute__((visibility("default"))) const char* EdgeSpecGGUFPromptPath() {
  return edge_spec::gguf_matmul_prompt_path();
}

// whether MatMulGGUF's one-row Q4_K passes ask for the next record ahead here: "ahead" or "none"
__attribute__((visibility("default"))) const char* EdgeSpecGGUFOneRowPrefetch() {
  return edge_spec::gguf_one_row_prefetch() ? "ahead" : "none";
}

// sets whether MatMulGGUF's one-row Q4_K passes ask ahead in this process, as measured on this machine: 1 or 0,
// or -1 for the vendor's rule again (EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH decides over it)
__attribute__((visibility("default"))) void EdgeSpecGGUFSetOneRowPrefetch(int choice) {
  edge_spec::gguf_set_one_row_prefetch(choice);
}

// sets the fewest rows of MatMulGGUF's passes that also ask far ahead in this process, as measured on this
// machine: N, or 0 for no pass, or -1 for the vendor's rule again (EDGE_SPEC_NATIVE_FAR_PREFETCH decides over it)
__attribute__((visibility("default"))) void EdgeSpecGGUFSetFarRows(int rows) { edge_spec::gguf_set_far_rows(rows); }

// which of MatMulGGUF's passes also ask far ahead, into the second level, now: "far" (every pass), "far from N
// rows" (passes of N rows and more) or "near" (none)
__attribute__((visibility("default"))) const char* EdgeSpecGGUFFarPrefetch() {
  return edge_spec::gguf_far_prefetch_words();
}

// a float16 cache's conversions, for tests: ``src`` rounded to float16 into ``dst`` and read back into ``back``,
// by the portable code (``portable``) or by F16C's instructions (where the CPU has them; else the portable code)
__attribute__((visibility("default"))) void EdgeSpecRoundToHalf(const float* src, uint16_t* dst, float* back, size_t n,
                                                                int portable) {
#ifdef ES_X86
  __builtin_cpu_init();
  if (!portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    float_to_half_f16c(src, dst, n);
    half_to_float_f16c(dst, back, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i) {
    dst[i] = float_to_half_scalar(src[i]);
    back[i] = edge_spec::half_bits_to_float(dst[i]);
  }
}

// whether a prompt graph's op (attribute bf16_products = 1) has its bfloat16 path here: "amx" or ""
__attribute__((visibility("default"))) const char* EdgeSpecPromptPath() { return prompt_path_here() ? "amx" : ""; }
}
