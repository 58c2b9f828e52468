// MatMul over GGUF's own K-quant blocks (Q4_K, Q6_K) for the CPU: y = x · Wᵀ with W's codes and scales as
// llama.cpp rounded them.
//
// ORT's MatMulNBits takes 4- or 8-bit blocks of 32 with a float32 scale each, so a carried Q4_K matrix reads
// 5 bits a weight plus the rows of its folded correction, and a Q6_K one 9 bits: a decode step of
// Qwen2.5-Coder-1.5B Q4_K_M streams 1123 MB of matmul weights where GGUF's blocks hold 4.5 and 6.56 bits
// a weight.  This op reads GGUF's bytes, rearranged so that 16 output rows share each record
// (edge_spec/export/gguf/interleaved.py): a vector lane is one output, each instruction adds four
// products to each of 16 outputs, and no horizontal sums remain.
//
// x is rounded per row to int8 in blocks of 256 (llama.cpp's Q8_K: one float scale, the sums of 16 and
// 32 codes kept for Q6_K's offset and Q4_K's minimums), and every dot product runs in integers within a
// block.  K, the input's width, need not fill whole blocks: the weights' rows are padded with zeros to the
// last block's end (a drafter's 896-wide rows: edge_spec/export/gguf/blocks.py, add_rounded_native) and x is
// read as if zeros followed it, which add nothing to any sum.  Where the last block holds at most 128 of a row's
// weights, its Q4_K records may keep the first four of their eight sub-blocks' code lines alone (the op's
// ``tail`` attribute, 4): an 896-wide row then reads 3.5 blocks, not 4, for the same sums.  Each row's result
// depends on that row alone and goes through the same operations in the same order whatever number of rows
// shares the pass, so verify passes stay batch-invariant.  The three paths (AVX-512 with VNNI, AVX2 (Q4_K's
// products on AVX-VNNI where the CPU has it), scalar; chosen once at load) give the same bits: the same integer
// sums, then per output the same float32 multiply and fused multiply-adds, block by block.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <array>
#include <atomic>
#include <utility>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define ES_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "edge_spec_op.h"
#include "onnxruntime_c_api.h"

namespace {

constexpr uint32_t kApiVersion = 17;
const OrtApi* g_api = nullptr;
bool g_use_avx2 = false;

constexpr int kQK = 256;             // weights per super-block
constexpr int64_t kTypeQ4K = 12;     // ggml's type numbers
constexpr int64_t kTypeQ6K = 14;

uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---------------------------------------------------------------------------------------------------
// activations: int8 blocks of 256 (llama.cpp's Q8_K)

struct Q8Row {
  int8_t* q = nullptr;          // K codes, in a pass's matrix of every row's codes (AMX's tiles read them as one)
  std::vector<float> d;         // one scale per block of 256
  std::vector<int32_t> sums16;  // the sum of each 16 codes (Q6_K's offset of 32)
  std::vector<int32_t> pairs16; // two of those sums as int16 halves, (sums16[2i], sums16[2i + 1]), for vpdpwssd
  std::vector<int32_t> sums32;  // the sum of each 32 codes (Q4_K's minimums)
  std::vector<int32_t> pairs32; // two of those sums as int16 halves, (sums32[2i], sums32[2i + 1]), for vpdpwssd
};

void quantize_block_scalar(const float* xb, float inverse, int8_t* qb, int32_t* sums16) {
  for (int s = 0; s < kQK / 16; ++s) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) {
      qb[16 * s + i] = static_cast<int8_t>(std::nearbyint(xb[16 * s + i] * inverse));
      sum += qb[16 * s + i];
    }
    sums16[s] = sum;
  }
}

#ifdef ES_X86
// the scalar loop's codes: a float32 product rounded to the nearest integer, ties to even (MXCSR's default,
// as nearbyint's), in lanes of eight
__attribute__((target("avx2,fma"))) void quantize_block_avx2(const float* xb, float inverse, int8_t* qb,
                                                             int32_t* sums16) {
  const __m256 scale = _mm256_set1_ps(inverse);
  for (int s = 0; s < kQK / 16; ++s) {
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * s), scale));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * s + 8), scale));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  // 16 int16 in order
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16 * s), bytes);
    const __m256i both = _mm256_add_epi32(q0, q1);
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
    sums16[s] = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1)));
  }
}
#endif

bool g_quantize_avx2 = false;

#ifdef ES_X86
// the largest |x| of a block, as the scalar loop's fmax gives it (max is exact in any order; a NaN is
// passed over: max_ps returns its second operand, the running maximum, when the first is NaN)
__attribute__((target("avx2,fma"))) float block_amax_avx2(const float* xb) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  for (int i = 0; i < kQK; i += 16) {
    m0 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + i), magnitude), m0);
    m1 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + i + 8), magnitude), m1);
  }
  __m256 m = _mm256_max_ps(m0, m1);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
#endif

// pairs[i] = (sums[2i], sums[2i + 1]) as the low and high int16 halves of one int32, for vpdpwssd (every sum fits an
// int16)
void pack_pairs(const int32_t* sums, int count, int32_t* pairs) {
  for (int i = 0; i < count; ++i) {
    const uint32_t low = static_cast<uint16_t>(sums[2 * i]), high = static_cast<uint16_t>(sums[2 * i + 1]);
    pairs[i] = static_cast<int32_t>(low | (high << 16));
  }
}

// a row's buffers, kept for the next pass as edge_spec::Scratch keeps a pass's
template <class T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

using edge_spec::Scratch;

void quantize_row(const float* x, int K, Q8Row& out) {
  const int blocks = K / kQK;
  grow(out.d, blocks);  // a row's buffers serve the next pass's row too (see Scratch)
  grow(out.sums16, K / 16);
  grow(out.pairs16, K / 32);
  grow(out.sums32, K / 32);
  grow(out.pairs32, K / 64);
  for (int b = 0; b < blocks; ++b) {
    const float* xb = x + b * kQK;
    float amax = 0.f;
#ifdef ES_X86
    if (g_quantize_avx2) {
      amax = block_amax_avx2(xb);
    } else
#endif
    {
      for (int i = 0; i < kQK; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    }
    int8_t* qb = out.q + b * kQK;
    int32_t* sums16 = out.sums16.data() + b * 16;
    if (amax == 0.f) {
      std::memset(qb, 0, kQK);
      std::memset(sums16, 0, 16 * sizeof(int32_t));
      out.d[b] = 0.f;
    } else {
      const float inverse = 127.f / amax;
#ifdef ES_X86
      if (g_quantize_avx2) {
        quantize_block_avx2(xb, inverse, qb, sums16);
      } else
#endif
      {
        quantize_block_scalar(xb, inverse, qb, sums16);
      }
      out.d[b] = amax / 127.f;
    }
    pack_pairs(sums16, kQK / 32, out.pairs16.data() + b * 8);  // |a sum of 16 codes| <= 16 * 127
    for (int s = 0; s < kQK / 32; ++s) out.sums32[b * 8 + s] = sums16[2 * s] + sums16[2 * s + 1];
    pack_pairs(out.sums32.data() + b * 8, kQK / 64, out.pairs32.data() + b * 4);  // |a sum of 32 codes| <= 32 * 127
  }
}

// ---------------------------------------------------------------------------------------------------
// records of 16 output rows (edge_spec/export/gguf/interleaved.py has the layout)

constexpr int kTile = 16;
constexpr int kQ4KRecord = 2368;  // d[16], dmin[16] fp16; scales[8][16], mins[8][16]; 32 lines of 64 bytes
constexpr int kQ4KHeader = 320;   // the record's d, dmin, scales and minimums; its code lines follow

// a Q4_K record of `subs` sub-blocks' code lines (8, or 4 in a short last block: the header whole, 16 lines)
constexpr size_t q4k_record_bytes(int subs) { return kQ4KHeader + static_cast<size_t>(subs) * 4 * 64; }
constexpr int kQ6KRecord = 3360;  // d[16] fp16; scales[16][16] int8; 32 lines of low nibbles; 16 of high bits
constexpr int kMaxRows = 8;       // rows looped inside, over codes decoded once

int32_t read_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// every path computes, per output, the same integer sums and then, block by block,
//   acc = fma(float(sum), d * dx, acc)   [Q4_K also: acc = fma(-float(mins), dmin * dx, acc)]
// so the three give the same bits
// LastSubs: the sub-blocks the last block's record holds (8, or 4 where the matrix's tail is short)
template <int LastSubs>
void tile_q4k_scalar(const uint8_t* rec, int blocks, const Q8Row* rows, int nrows, float* out) {
  for (int r = 0; r < nrows; ++r) {
    const Q8Row& x = rows[r];
    for (int o = 0; o < kTile; ++o) {
      float acc = 0.f;
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* R = rec + static_cast<size_t>(b) * kQ4KRecord;
        const float d = edge_spec::half_bits_to_float(read_u16(R + 2 * o));
        const float dmin = edge_spec::half_bits_to_float(read_u16(R + 32 + 2 * o));
        const uint8_t* lines = R + kQ4KHeader;
        const int8_t* q = x.q + b * kQK;
        int32_t total = 0, mins = 0;
        // a short record's missing sub-blocks meet only the zeros after x's last column: they add nothing
        const int subs = b + 1 == blocks ? LastSubs : 8;
        for (int s = 0; s < subs; ++s) {
          int32_t part = 0;
          for (int p = 4 * s; p < 4 * s + 4; ++p) {
            for (int t = 0; t < 4; ++t) {
              const uint8_t byte = lines[64 * p + 4 * o + t];
              part += (byte & 0xF) * q[8 * p + t] + (byte >> 4) * q[8 * p + 4 + t];
            }
          }
          total += part * R[64 + 16 * s + o];
          mins += R[192 + 16 * s + o] * x.sums32[b * 8 + s];
        }
        const float dx = x.d[b];
        acc = std::fma(static_cast<float>(total), d * dx, acc);
        acc = std::fma(-static_cast<float>(mins), dmin * dx, acc);
      }
      out[r * kTile + o] = acc;
    }
  }
}

void tile_q6k_scalar(const uint8_t* rec, int blocks, const Q8Row* rows, int nrows, float* out) {
  for (int r = 0; r < nrows; ++r) {
    const Q8Row& x = rows[r];
    for (int o = 0; o < kTile; ++o) {
      float acc = 0.f;
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* R = rec + static_cast<size_t>(b) * kQ6KRecord;
        const float d = edge_spec::half_bits_to_float(read_u16(R + 2 * o));
        const int8_t* sc = reinterpret_cast<const int8_t*>(R + 32);
        const uint8_t* lines = R + 288;
        const uint8_t* highs = R + 288 + 2048;
        const int8_t* q = x.q + b * kQK;
        int32_t total = 0;
        for (int s = 0; s < 16; ++s) {
          int32_t part = 0;
          for (int t = 0; t < 4; ++t) {
            const uint8_t h = highs[64 * s + 4 * o + t];
            const uint8_t l0 = lines[64 * (2 * s) + 4 * o + t];
            const uint8_t l1 = lines[64 * (2 * s + 1) + 4 * o + t];
            part += ((l0 & 0xF) | ((h & 3) << 4)) * q[16 * s + t];
            part += ((l0 >> 4) | (((h >> 2) & 3) << 4)) * q[16 * s + 4 + t];
            part += ((l1 & 0xF) | (((h >> 4) & 3) << 4)) * q[16 * s + 8 + t];
            part += ((l1 >> 4) | (((h >> 6) & 3) << 4)) * q[16 * s + 12 + t];
          }
          total += (part - 32 * x.sums16[b * 16 + s]) * sc[16 * s + o];
        }
        acc = std::fma(static_cast<float>(total), d * x.d[b], acc);
      }
      out[r * kTile + o] = acc;
    }
  }
}

// Passes of at least g_far_rows rows also ask for the record kFarRecords on, into the second level: the next
// record alone came too late for Intel's cores.  On an Intel Xeon (Sapphire Rapids) a one-row decode pass of the
// default target ran 1.15-1.16x faster with it and a two-row pass 1.18-1.20x (1.15-1.20x on the AVX2 kernels);
// asking for records 2 to 4 on into the first level instead gained 1.02-1.03x, into the second level 1.08-1.10x,
// and 8 records on beat 4 and 16 (benchmarks/native_ab.py).  On a Zen 5 EPYC the hardware prefetcher keeps up
// with passes of one and two rows (1.01-1.05x slower with it), not with verify passes of more: 4 to 16 rows ran
// 1.06-1.15x faster with it after 256 tokens and 1.09-1.13x after 2,800.  Other cores' prefetchers differ, so a
// bundle's export (or its first load on another machine) times passes of a few row counts both ways and sets
// the fewest rows that gain (EdgeSpecGGUFSetFarRows, edge_spec.runtime.model.kernel_choice); with no
// measurement, the vendor's rule: every pass on Intel's cores, passes of kFarRowsElsewhere rows and more on
// others.  EDGE_SPEC_NATIVE_FAR_PREFETCH decides over both (1: every pass, 0: none).  Prefetches change no bits.
constexpr int kFarEveryPass = 1;
constexpr int kFarRowsElsewhere = 4;
constexpr int kFarNever = 1 << 30;
std::atomic<int> g_far_rows{kFarNever};
// what a measurement on this machine chose: the fewest rows that ask far (kFarNever: none), 0 nothing measured
std::atomic<int> g_far_rows_measured{0};

#ifdef ES_X86
constexpr int kFarRecords = 8;

// the next record's cache lines [first, first + count) asked for while this record is worked on (a tile's
// records lie one after another; the last tile's last prefetch may reach past the weights, which a
// prefetch never faults on)
inline void prefetch_lines(const uint8_t* record, int first, int count) {
  for (int i = first; i < first + count; ++i) _mm_prefetch(reinterpret_cast<const char*>(record + 64 * i), _MM_HINT_T0);
}

// the cache lines [first, first + count) of the record kFarRecords after this one, into the second level
inline void prefetch_far(const uint8_t* record, size_t record_bytes, int first, int count) {
  const uint8_t* far = record + kFarRecords * record_bytes;
  for (int i = first; i < first + count; ++i) _mm_prefetch(reinterpret_cast<const char*>(far + 64 * i), _MM_HINT_T1);
}

// Whether a Q4_K kernel asks for the next record ahead (Ahead).  Passes of 2 and more rows always do.  A
// one-row pass streams its weights at the memory's pace, and whether software prefetches help it depends on
// the core's own prefetchers: on a Zen 4 EPYC a one-row decode pass of the default target ran 1.03-1.05x
// faster without them on the AVX-512 kernels and 1.11-1.15x on the AVX2 ones (they only took the miss
// buffers the demand loads need), on a Zen 5 EPYC 1.05-1.14x faster with them, and on an Intel Xeon
// (Sapphire Rapids) 1.28x faster with them (benchmarks/native_ab.py).  A vendor does not tell such cores
// apart, so the export times both on the target it builds and the runtime sets what it measured
// (EdgeSpecGGUFSetOneRowPrefetch, edge_spec.runtime.model.kernel_choice); with no measurement one-row passes
// ask ahead on Intel's cores only, and EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH=1 or 0 decides over both
// (g_one_row_ahead).  The Q6_K kernels ask ahead at every row count: without it a one-row Q6_K matrix streamed
// at half the rate on the AVX-512 kernels and 0.74-0.87x on AVX2
// (benchmarks/studies/kernels/gguf_stream_ab.py).  Prefetches change no bits.
std::atomic<bool> g_one_row_ahead{false};
// what a bundle's export measured on this machine: 1 ahead, 0 not, -1 nothing measured (the vendor's rule)
std::atomic<int> g_one_row_measured{-1};

// ---------------------------------------------------------------------------------------------------
// AVX-512 with VNNI: a lane per output, vpdpbusd adds four code x activation products a lane

#define ES_AVX512 "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"

// NR rows at once, their integer sums in registers (NR a constant, so the row loops unroll); the float32
// results accumulate in out, once a block, from zero in registers at the first block (zeroing out first
// stalled the first block's 64-byte loads behind the narrower stores of a memset).  A sub-block's 32 products are
// summed in two halves of 16 (each at most 16 * 15 * 128 = 30720 in size: an int16), and one vpdpwssd with the
// sub-block's scale in both halves of a lane adds scale x (first + last) to the total: the integer vpmulld would
// give, in an instruction the multiply pipes finish sooner (verify passes of 8 rows and prompt reads 3% faster
// on a Zen 4 EPYC).  The minimums' products go through vpdpwssd, two sub-blocks an instruction, after the
// codes' sums: the same integers as a product per sub-block.
// a Q4_K record's minimums as vpdpwssd takes them: pairs[i], lane o = (minimum[2i][o], minimum[2i + 1][o]) as int16
__attribute__((target(ES_AVX512), always_inline)) inline void q4k_minimum_pairs_avx512(const uint8_t* R,
                                                                                       __m512i pairs[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 192 + 32 * i));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 192 + 32 * i + 16));
    pairs[i] = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, c), _mm_unpacklo_epi8(a, c)));
  }
}

template <int NR, bool Ahead = true, int LastSubs = 8>
__attribute__((target(ES_AVX512))) void rows_q4k_avx512(const uint8_t* rec, int blocks, const Q8Row* rows, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const bool far = Ahead && NR >= g_far_rows.load(std::memory_order_relaxed);
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* R = rec + static_cast<size_t>(b) * kQ4KRecord;
    const uint8_t* lines = R + kQ4KHeader;
    const int subs = b + 1 == blocks ? LastSubs : 8;
    const uint8_t* next = R + q4k_record_bytes(subs);  // the next record, the next tile's first after the last
    const int ahead = 40 / subs;                        // its lines asked for a sub-block: all of them by the end
    __m512i total[NR];
    for (int r = 0; r < NR; ++r) total[r] = _mm512_setzero_si512();
    for (int s = 0; s < subs; ++s) {
      __m512i lo[4], hi[4];
      for (int p = 0; p < 4; ++p) {
        const __m512i w = _mm512_loadu_si512(lines + 64 * (4 * s + p));
        lo[p] = _mm512_and_si512(w, low4);
        hi[p] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      }
      if (Ahead) prefetch_lines(next, ahead * s, ahead);
      if (far) prefetch_far(R, kQ4KRecord, ahead * s, ahead);
      const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 64 + 16 * s)));
      const __m512i scale2 = _mm512_or_si512(scale, _mm512_slli_epi32(scale, 16));  // (sc, sc) a lane
      __m512i partA[NR], partB[NR];  // the sub-block's first and last 16 products
      for (int r = 0; r < NR; ++r) partA[r] = partB[r] = _mm512_setzero_si512();
      for (int p = 0; p < 2; ++p) {
        for (int r = 0; r < NR; ++r) {
          const int8_t* q = rows[r].q + b * kQK + 32 * s + 8 * p;
          partA[r] = _mm512_dpbusd_epi32(partA[r], lo[p], _mm512_set1_epi32(read_i32(q)));
          partA[r] = _mm512_dpbusd_epi32(partA[r], hi[p], _mm512_set1_epi32(read_i32(q + 4)));
          partB[r] = _mm512_dpbusd_epi32(partB[r], lo[p + 2], _mm512_set1_epi32(read_i32(q + 16)));
          partB[r] = _mm512_dpbusd_epi32(partB[r], hi[p + 2], _mm512_set1_epi32(read_i32(q + 20)));
        }
      }
      for (int r = 0; r < NR; ++r) {
        const __m512i halves = _mm512_mask_blend_epi16(0xAAAAAAAA, partA[r], _mm512_slli_epi32(partB[r], 16));
        total[r] = _mm512_dpwssd_epi32(total[r], halves, scale2);
      }
    }
    __m512i pairs[4];
    q4k_minimum_pairs_avx512(R, pairs);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(R)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(R + 32)));
    for (int r = 0; r < NR; ++r) {
      __m512i mins = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) mins = _mm512_dpwssd_epi32(mins, pairs[i], _mm512_set1_epi32(rows[r].pairs32[b * 4 + i]));
      const __m512 dx = _mm512_set1_ps(rows[r].d[b]);
      __m512 acc = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * kTile);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, dx), acc);
      acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, dx), acc);
      _mm512_storeu_ps(out + r * kTile, acc);
    }
  }
}

// a Q6_K record's sub-block s as four vectors of codes (c[j], lane o: output o's codes 16 s + 4 j .. + 3), its low
// nibbles from two lines and its high two bits from one
__attribute__((target(ES_AVX512), always_inline)) inline void q6k_codes_avx512(const uint8_t* lines,
                                                                               const uint8_t* highs, int s,
                                                                               __m512i c[4]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
  const __m512i h = _mm512_loadu_si512(highs + 64 * s);
  const __m512i w0 = _mm512_loadu_si512(lines + 64 * (2 * s));
  const __m512i w1 = _mm512_loadu_si512(lines + 64 * (2 * s + 1));
  c[0] = _mm512_or_si512(_mm512_and_si512(w0, low4), _mm512_slli_epi16(_mm512_and_si512(h, low2), 4));
  c[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w0, 4), low4),
                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2), low2), 4));
  c[2] = _mm512_or_si512(_mm512_and_si512(w1, low4),
                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 4), low2), 4));
  c[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w1, 4), low4),
                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 6), low2), 4));
}

template <int NR>
__attribute__((target(ES_AVX512))) void rows_q6k_avx512(const uint8_t* rec, int blocks, const Q8Row* rows, float* out) {
  const bool far = NR >= g_far_rows.load(std::memory_order_relaxed);
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* R = rec + static_cast<size_t>(b) * kQ6KRecord;
    const uint8_t* lines = R + 288;
    const uint8_t* highs = R + 288 + 2048;
    // total = sum_s sc_s * (dot_s - 32 * sums16_s), as exact integers (mod 2^32, the result fits): the dots run
    // on across sub-blocks (P_s, the sum of dots 0..s) and each is weighted by sc_s - sc_{s+1} (sc_16 = 0),
    // and the offsets' sum_s sc_s * sums16_s goes through vpdpwssd two sub-blocks at a time
    __m512i total[NR], part[NR];
    for (int r = 0; r < NR; ++r) total[r] = part[r] = _mm512_setzero_si512();
    __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 32)));
    for (int s = 0; s < 16; ++s) {
      __m512i c[4];
      q6k_codes_avx512(lines, highs, s, c);
      prefetch_lines(R + kQ6KRecord, 4 * s, 4);
      if (far) prefetch_far(R, kQ6KRecord, 4 * s, 4);
      __m512i weight = scale;
      if (s < 15) {
        const __m512i next =
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 32 + 16 * (s + 1))));
        weight = _mm512_sub_epi32(scale, next);
        scale = next;
      }
      for (int r = 0; r < NR; ++r) {
        const int8_t* q = rows[r].q + b * kQK + 16 * s;
        for (int j = 0; j < 4; ++j)
          part[r] = _mm512_dpbusd_epi32(part[r], c[j], _mm512_set1_epi32(read_i32(q + 4 * j)));
        total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(part[r], weight));
      }
    }
    __m512i pairs[8];  // lane o: (sc[2i][o], sc[2i + 1][o]) as int16
    for (int i = 0; i < 8; ++i) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 32 + 32 * i));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 32 + 32 * i + 16));
      pairs[i] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, c), _mm_unpacklo_epi8(a, c)));
    }
    for (int r = 0; r < NR; ++r) {
      __m512i offsets = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i)
        offsets = _mm512_dpwssd_epi32(offsets, pairs[i], _mm512_set1_epi32(rows[r].pairs16[b * 8 + i]));
      total[r] = _mm512_sub_epi32(total[r], _mm512_slli_epi32(offsets, 5));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(R)));
    for (int r = 0; r < NR; ++r) {
      __m512 acc = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * kTile);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, _mm512_set1_ps(rows[r].d[b])), acc);
      _mm512_storeu_ps(out + r * kTile, acc);
    }
  }
}

using RowsKernel = void (*)(const uint8_t*, int, const Q8Row*, float*);

template <int LastSubs, int... NR>
constexpr std::array<RowsKernel, sizeof...(NR)> avx512_q4k_table(std::integer_sequence<int, NR...>) {
  return {rows_q4k_avx512<NR + 1, true, LastSubs>...};
}

template <int... NR>
constexpr std::array<RowsKernel, sizeof...(NR)> avx512_q6k_table(std::integer_sequence<int, NR...>) {
  return {rows_q6k_avx512<NR + 1>...};
}

template <int LastSubs>
void tile_q4k_avx512(const uint8_t* rec, int blocks, const Q8Row* rows, int nrows, float* out) {
  static constexpr auto table = avx512_q4k_table<LastSubs>(std::make_integer_sequence<int, kMaxRows>{});
  if (nrows == 1 && !g_one_row_ahead.load(std::memory_order_relaxed))
    return rows_q4k_avx512<1, false, LastSubs>(rec, blocks, rows, out);
  table[nrows - 1](rec, blocks, rows, out);
}

void tile_q6k_avx512(const uint8_t* rec, int blocks, const Q8Row* rows, int nrows, float* out) {
  static constexpr auto table = avx512_q6k_table(std::make_integer_sequence<int, kMaxRows>{});
  table[nrows - 1](rec, blocks, rows, out);
}

// ---------------------------------------------------------------------------------------------------
// AVX2: two halves of eight lanes; maddubs gives pairs of vpdpbusd's products as int16, and one madd with a
// sub-block's scale in both halves of a lane turns summed pairs into scale x their sum, an int32 a lane

#define ES_AVX2 "avx2,fma,f16c"

// AVX-VNNI's intrinsics (GCC 11, Clang 12 and later)
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define ES_AVX_VNNI 1
#endif

// lane o of a half's eight outputs: (first[o], first[16 + o]) as int16, from a record's two consecutive 16-byte rows
// of per-output bytes (Q4_K's minimums, Q6_K's scales: two sub-blocks), sign-extended where Signed
template <bool Signed>
__attribute__((target(ES_AVX2))) inline __m256i byte_pairs_avx2(const uint8_t* first) {
  const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(first));
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(first + 16));
  const __m128i both = _mm_unpacklo_epi8(a, c);
  return Signed ? _mm256_cvtepi8_epi16(both) : _mm256_cvtepu8_epi16(both);
}

// a Q4_K record's sub-block s for one half's eight outputs (lines: the half's first line): lo[p] and hi[p] hold
// codes 8p .. 8p + 3 and 8p + 4 .. 8p + 7, four a lane, as vpdpbusd and maddubs take them.  The kernels ask for
// the records ahead themselves: GCC 12 compiled no prefetch at all from _mm_prefetch inlined through this helper.
__attribute__((target(ES_AVX2), always_inline)) inline void q4k_codes_avx2(const uint8_t* lines, int s, __m256i lo[4],
                                                                           __m256i hi[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < 4; ++p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 64 * (4 * s + p)));
    lo[p] = _mm256_and_si256(w, low4);
    hi[p] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
  }
}

// sub-block s's scale in both int16 halves of each of one half's eight lanes
__attribute__((target(ES_AVX2), always_inline)) inline __m256i q4k_scale_pairs_avx2(const uint8_t* R, int s, int half) {
  const __m256i scale32 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(R + 64 + 16 * s + 8 * half)));
  return _mm256_or_si256(scale32, _mm256_slli_epi32(scale32, 16));
}

// a half's block done: its minimums' products, then out += total x d x dx - minimums x dmin x dx per row
template <int NR>
__attribute__((target(ES_AVX2), always_inline)) inline void q4k_half_end_avx2(const uint8_t* R, int b, int half,
                                                                              const Q8Row* rows,
                                                                              const __m256i total[NR], float* out) {
  __m256i pairs[4];  // lane o: (minimum[2i][o], minimum[2i + 1][o]) as int16, for this half's outputs
  for (int i = 0; i < 4; ++i) pairs[i] = byte_pairs_avx2<false>(R + 192 + 32 * i + 8 * half);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 16 * half)));
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 32 + 16 * half)));
  for (int r = 0; r < NR; ++r) {
    __m256i mins = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i)
      mins = _mm256_add_epi32(mins, _mm256_madd_epi16(pairs[i], _mm256_set1_epi32(rows[r].pairs32[b * 4 + i])));
    const __m256 dx = _mm256_set1_ps(rows[r].d[b]);
    float* o = out + r * kTile + 8 * half;
    __m256 acc = _mm256_loadu_ps(o);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_mul_ps(d, dx), acc);
    acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc);
    _mm256_storeu_ps(o, acc);
  }
}

// NR rows at once, each half of a record's 16 outputs in turn.  A sub-block's eight maddubs results (pairs
// of products, each at most 2 * 15 * 128 in size) are summed as int16 (at most 30720: no saturation), and
// one madd with the sub-block's scale in both halves of a lane gives scale x the sub-block's sum: the
// integer the AVX-512 kernel forms, in a third of the instructions of one madd per step.
template <int NR, bool Ahead = true, int LastSubs = 8>
__attribute__((target(ES_AVX2))) void rows_q4k_avx2(const uint8_t* rec, int blocks, const Q8Row* rows, float* out) {
  const bool far = Ahead && NR >= g_far_rows.load(std::memory_order_relaxed);
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(out + r * kTile, _mm256_setzero_ps());
    _mm256_storeu_ps(out + r * kTile + 8, _mm256_setzero_ps());
  }
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* R = rec + static_cast<size_t>(b) * kQ4KRecord;
    const int subs = b + 1 == blocks ? LastSubs : 8;
    const uint8_t* next = R + q4k_record_bytes(subs);  // the next record, the next tile's first after the last
    const int ahead = 40 / subs;                        // its lines asked for a sub-block (in the first half)
    for (int half = 0; half < 2; ++half) {
      const uint8_t* lines = R + kQ4KHeader + 32 * half;
      __m256i total[NR];
      for (int r = 0; r < NR; ++r) total[r] = _mm256_setzero_si256();
      for (int s = 0; s < subs; ++s) {
        __m256i lo[4], hi[4];
        q4k_codes_avx2(lines, s, lo, hi);
        if (Ahead) prefetch_lines(next, ahead * s + 40 * half, ahead - ahead * half);
        if (far) prefetch_far(R, kQ4KRecord, ahead * s + 40 * half, ahead - ahead * half);
        const __m256i scale = q4k_scale_pairs_avx2(R, s, half);
        for (int r = 0; r < NR; ++r) {
          const int8_t* q = rows[r].q + b * kQK + 32 * s;
          __m256i sum16 = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(read_i32(q)));
          sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(read_i32(q + 4))));
          for (int p = 1; p < 4; ++p) {
            sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(lo[p], _mm256_set1_epi32(read_i32(q + 8 * p))));
            sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(hi[p], _mm256_set1_epi32(read_i32(q + 8 * p + 4))));
          }
          total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(sum16, scale));
        }
      }
      q4k_half_end_avx2<NR>(R, b, half, rows, total, out);
    }
  }
}

// Rows a pass of rows_q4k_avx2 (and rows_q4k_avxvnni) takes: five, a verify pass of four drafts, in one pass over
// the weights.  Four rows' sums stay in the 16 ymm registers and a fifth's spill to the first level, yet on an
// Intel Xeon's AVX2 kernels a five-row pass of the default target ran 1.16-1.19x faster than as four rows and
// one, and passes of other row counts as fast as before (benchmarks/native_ab.py).
constexpr int kAvx2Rows = 5;

// a tile's rows, kAvx2Rows at a time (table[n - 1] takes n rows); a lone row without asking ahead where that pays
// (g_one_row_ahead)
void rows_in_groups(const RowsKernel* table, RowsKernel lone_row, const uint8_t* rec, int blocks, const Q8Row* rows,
                    int nrows, float* out) {
  if (nrows == 1 && !g_one_row_ahead.load(std::memory_order_relaxed)) return lone_row(rec, blocks, rows, out);
  for (int r0 = 0; r0 < nrows; r0 += kAvx2Rows) {
    table[std::min(kAvx2Rows, nrows - r0) - 1](rec, blocks, rows + r0, out + r0 * kTile);
  }
}

template <int LastSubs, int... NR>
constexpr std::array<RowsKernel, sizeof...(NR)> avx2_table(std::integer_sequence<int, NR...>) {
  return {rows_q4k_avx2<NR + 1, true, LastSubs>...};
}

template <int LastSubs>
void tile_q4k_avx2(const uint8_t* rec, int blocks, const Q8Row* rows, int nrows, float* out) {
  static constexpr auto table = avx2_table<LastSubs>(std::make_integer_sequence<int, kAvx2Rows>{});
  rows_in_groups(table.data(), rows_q4k_avx2<1, false, LastSubs>, rec, blocks, rows, nrows, out);
}

#ifdef ES_AVX_VNNI
// AVX-VNNI (Intel's cores since Alder Lake, without AVX-512): the AVX2 kernels' lanes, with vpdpbusd adding four
// products a lane in one instruction where maddubs and an add took two.  A sub-block's first and last 16 products
// are summed apart (each at most 16 * 15 * 128 = 30720: an int16) and one vpdpwssd with the scale in both halves of
// a lane adds scale x (first + last), as the AVX-512 kernel does: the same integers as the AVX2 kernel's.  On an
// Intel Xeon's cores (Alder Lake's performance cores' design) with the AVX-512 kernels off, passes of 8 and 16 rows
// of the default target ran 1.10x and 1.20x faster, a 2,048-token prompt 1.12x, one- and two-row passes as fast
// (benchmarks/native_ab.py).  Q6_K keeps the AVX2 kernel: a sub-block's 16 products outgrow an int16, so scaling
// them would take a vpmulld a row.  The loops are rows_q4k_avx2's, written again: a function compiled for AVX-VNNI
// may get its instructions where the code asks for none (a compiler may fuse vpmaddwd and vpaddd into vpdpwssd), so
// the AVX2 kernel, which AVX2-only CPUs run, cannot share a body compiled for both.
template <int NR, bool Ahead = true, int LastSubs = 8>
__attribute__((target(ES_AVX2 ",avxvnni"))) void rows_q4k_avxvnni(const uint8_t* rec, int blocks, const Q8Row* rows,
                                                                  float* out) {
  const bool far = Ahead && NR >= g_far_rows.load(std::memory_order_relaxed);
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(out + r * kTile, _mm256_setzero_ps());
    _mm256_storeu_ps(out + r * kTile + 8, _mm256_setzero_ps());
  }
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* R = rec + static_cast<size_t>(b) * kQ4KRecord;
    const int subs = b + 1 == blocks ? LastSubs : 8;
    const uint8_t* next = R + q4k_record_bytes(subs);  // the next record, the next tile's first after the last
    const int ahead = 40 / subs;                        // its lines asked for a sub-block (in the first half)
    for (int half = 0; half < 2; ++half) {
      const uint8_t* lines = R + kQ4KHeader + 32 * half;
      __m256i total[NR];
      for (int r = 0; r < NR; ++r) total[r] = _mm256_setzero_si256();
      for (int s = 0; s < subs; ++s) {
        __m256i lo[4], hi[4];
        q4k_codes_avx2(lines, s, lo, hi);
        if (Ahead) prefetch_lines(next, ahead * s + 40 * half, ahead - ahead * half);
        if (far) prefetch_far(R, kQ4KRecord, ahead * s + 40 * half, ahead - ahead * half);
        const __m256i scale = q4k_scale_pairs_avx2(R, s, half);
        for (int r = 0; r < NR; ++r) {
          const int8_t* q = rows[r].q + b * kQK + 32 * s;
          __m256i first = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo[0], _mm256_set1_epi32(read_i32(q)));
          first = _mm256_dpbusd_avx_epi32(first, hi[0], _mm256_set1_epi32(read_i32(q + 4)));
          first = _mm256_dpbusd_avx_epi32(first, lo[1], _mm256_set1_epi32(read_i32(q + 8)));
          first = _mm256_dpbusd_avx_epi32(first, hi[1], _mm256_set1_epi32(read_i32(q + 12)));
          __m256i last = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo[2], _mm256_set1_epi32(read_i32(q + 16)));
          last = _mm256_dpbusd_avx_epi32(last, hi[2], _mm256_set1_epi32(read_i32(q + 20)));
          last = _mm256_dpbusd_avx_epi32(last, lo[3], _mm256_set1_epi32(read_i32(q + 24)));
          last = _mm256_dpbusd_avx_epi32(last, hi[3], _mm256_set1_epi32(read_i32(q + 28)));
          const __m256i halves = _mm256_blend_epi16(first, _mm256_slli_epi32(last, 16), 0xAA);
          total[r] = _mm256_dpwssd_avx_epi32(total[r], halves, scale);
        }
      }
      q4k_half_end_avx2<NR>(R, b, half, rows, total, out);
    }
  }
}

template <int LastSubs, int... NR>
constexpr std::array<RowsKernel, sizeof...(NR)> avxvnni_table(std::integer_sequence<int, NR...>) {
  return {rows_q4k_avxvnni<NR + 1, true, LastSubs>...};
}

template <int LastSubs>
void tile_q4k_avxvnni(const uint8_t* rec, int blocks, const Q8Row* rows, int nrows, float* out) {
  static constexpr auto table = avxvnni_table<LastSubs>(std::make_integer_sequence<int, kAvx2Rows>{});
  rows_in_groups(table.data(), rows_q4k_avxvnni<1, false, LastSubs>, rec, blocks, rows, nrows, out);
}
#endif

// Q6_K: a sub-block's 16 products as two sums of two maddubs results (each at most 2 * 2 * 63 * 128 = 32256 in
// size: an int16), each madd-ed with the sub-block's scale; the offset of 32 is taken off once a block, as
// sum_s sc_s * sums16_s two sub-blocks a madd, shifted by 5 (the AVX-512 kernel's integers, without a vpmulld
// a sub-block)
__attribute__((target(ES_AVX2))) void tile_q6k_avx2(const uint8_t* rec, int blocks, const Q8Row* rows, int nrows,
                                                     float* out) {
  __m256 acc[kMaxRows][2];
  __m256i total[kMaxRows][2];
  for (int r = 0; r < nrows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i low2 = _mm256_set1_epi8(0x03);
  const bool far = nrows >= g_far_rows.load(std::memory_order_relaxed);
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* R = rec + static_cast<size_t>(b) * kQ6KRecord;
    for (int r = 0; r < nrows; ++r) total[r][0] = total[r][1] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const uint8_t* lines = R + 288 + 32 * half;
      const uint8_t* highs = R + 288 + 2048 + 32 * half;
      for (int s = 0; s < 16; ++s) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(highs + 64 * s));
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 64 * (2 * s)));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 64 * (2 * s + 1)));
        __m256i c[4];
        c[0] = _mm256_or_si256(_mm256_and_si256(w0, low4), _mm256_slli_epi16(_mm256_and_si256(h, low2), 4));
        c[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w0, 4), low4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), low2), 4));
        c[2] = _mm256_or_si256(_mm256_and_si256(w1, low4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), low2), 4));
        c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w1, 4), low4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), low2), 4));
        prefetch_lines(R + kQ6KRecord, 4 * s, 4 - 4 * half);
        if (far) prefetch_far(R, kQ6KRecord, 4 * s, 4 - 4 * half);
        const __m256i scale32 =
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(R + 32 + 16 * s + 8 * half)));
        const __m256i scale = _mm256_or_si256(_mm256_and_si256(scale32, _mm256_set1_epi32(0xFFFF)),
                                              _mm256_slli_epi32(scale32, 16));  // (sc, sc) a lane, as int16
        for (int r = 0; r < nrows; ++r) {
          const int8_t* q = rows[r].q + b * kQK + 16 * s;
          const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], _mm256_set1_epi32(read_i32(q))),
                                                 _mm256_maddubs_epi16(c[1], _mm256_set1_epi32(read_i32(q + 4))));
          const __m256i last = _mm256_add_epi16(_mm256_maddubs_epi16(c[2], _mm256_set1_epi32(read_i32(q + 8))),
                                                _mm256_maddubs_epi16(c[3], _mm256_set1_epi32(read_i32(q + 12))));
          total[r][half] = _mm256_add_epi32(total[r][half], _mm256_add_epi32(_mm256_madd_epi16(first, scale),
                                                                             _mm256_madd_epi16(last, scale)));
        }
      }
      // the offsets' sum_s sc_s * sums16_s, two sub-blocks a madd (lane o: (sc[2i][o], sc[2i + 1][o]) as int16)
      __m256i pairs[8];
      for (int i = 0; i < 8; ++i) pairs[i] = byte_pairs_avx2<true>(R + 32 + 32 * i + 8 * half);
      for (int r = 0; r < nrows; ++r) {
        __m256i offsets = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i)
          offsets = _mm256_add_epi32(offsets, _mm256_madd_epi16(pairs[i], _mm256_set1_epi32(rows[r].pairs16[b * 8 + i])));
        total[r][half] = _mm256_sub_epi32(total[r][half], _mm256_slli_epi32(offsets, 5));
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 16 * half)));
      for (int r = 0; r < nrows; ++r) {
        acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r][half]), _mm256_mul_ps(d, _mm256_set1_ps(rows[r].d[b])),
                                       acc[r][half]);
      }
    }
  }
  for (int r = 0; r < nrows; ++r) {
    _mm256_storeu_ps(out + r * kTile, acc[r][0]);
    _mm256_storeu_ps(out + r * kTile + 8, acc[r][1]);
  }
}
#endif

#ifdef ES_X86
// ---------------------------------------------------------------------------------------------------
// AMX (Intel Xeon since Sapphire Rapids): passes of many rows, 16 rows x 16 outputs per tile product
//
// A prompt's pass is bound by arithmetic, and AMX's tile unit multiplies 16 x 64 int8 activations by 64 x 16
// bytes in one instruction, many times what vpdpbusd's lanes do.  Its products are exact integers like
// theirs, so these kernels compute the very integer sums the AVX-512 kernels do, and then the same float32
// steps: the same bits (and every row's result still depends on that row alone).
//
// A sub-block's weight is its scale times a code: Q4_K's 6-bit scale times a 4-bit code reaches 945, Q6_K's
// int8 scale times (a 6-bit code - 32) reaches 4096, past a byte either way.  So each record is unpacked into
// two byte matrices of the weights' high and low parts, w = 2^shift x high + low (Q4_K: the scale's high and
// low three bits times the code, at most 105 each, shift 3; Q6_K: w >> 6, in [-64, 64], and w & 63, shift 6),
// and a block's
//   total = 2^shift x (activations . high) + (activations . low)
// is the sum over its sub-blocks of scale x (codes . activations) (Q6_K: less 32 x the activations' sums),
// exactly.  Q4_K's minimums stay on vpdpwssd as in the AVX-512 kernel.  A weight tile is unpacked once a pass
// (8 KB a block of 256) and read by every 16 rows of it.

#define ES_AMX "amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"

constexpr int kAmxRows = 16;           // rows of an activation tile
constexpr int kAmxBlockBytes = 8192;   // one block of 256 unpacked: high then low, 4 tiles of 16 x 64 bytes each
constexpr int kAmxSums = kAmxRows * kTile;  // int32 sums in a tile

// one weight tile's Q4_K records (blocks of them) as AMX's B tiles: block b's high part at pack + b * 8 KB, its
// low part 4 KB on; tile j of a part is its codes 64 j .. 64 j + 63, a row per four codes, a 4-byte lane per
// output (the interleaved lines' own order: line p holds codes 8p .. 8p + 3 in its low nibbles, 8p + 4 .. 8p + 7
// in its high ones, so line p's two rows land at 128 p)
__attribute__((target(ES_AMX))) void unpack_q4k_amx(const uint8_t* rec, int blocks, uint8_t* pack) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i low3 = _mm512_set1_epi32(7);
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* R = rec + static_cast<size_t>(b) * kQ4KRecord;
    uint8_t* high = pack + static_cast<size_t>(b) * kAmxBlockBytes;
    uint8_t* low = high + kAmxBlockBytes / 2;
    for (int s = 0; s < 8; ++s) {
      const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 64 + 16 * s)));
      const __m512i h = _mm512_srli_epi32(scale, 3), l = _mm512_and_si512(scale, low3);
      // a byte x a lane's factor: products below 256 keep to their bytes in a 16-bit multiply
      const __m512i h2 = _mm512_or_si512(h, _mm512_slli_epi32(h, 16)), l2 = _mm512_or_si512(l, _mm512_slli_epi32(l, 16));
      for (int p = 4 * s; p < 4 * s + 4; ++p) {
        const __m512i w = _mm512_loadu_si512(R + 320 + 64 * p);
        const __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        _mm512_storeu_si512(high + 128 * p, _mm512_mullo_epi16(lo, h2));
        _mm512_storeu_si512(high + 128 * p + 64, _mm512_mullo_epi16(hi, h2));
        _mm512_storeu_si512(low + 128 * p, _mm512_mullo_epi16(lo, l2));
        _mm512_storeu_si512(low + 128 * p + 64, _mm512_mullo_epi16(hi, l2));
      }
    }
  }
}

// one weight tile's Q6_K records the same way: sub-block s's four rows of codes (16 s + 4 j .. + 3, the AVX-512
// kernel's c[j]) at 256 s; each byte's w = scale x (code - 32) worked out in 16-bit halves, even bytes and odd
__attribute__((target(ES_AMX))) void unpack_q6k_amx(const uint8_t* rec, int blocks, uint8_t* pack) {
  const __m512i even = _mm512_set1_epi16(0x00FF), six = _mm512_set1_epi16(63), offset = _mm512_set1_epi16(32);
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* R = rec + static_cast<size_t>(b) * kQ6KRecord;
    const uint8_t* lines = R + 288;
    const uint8_t* highs = R + 288 + 2048;
    uint8_t* high = pack + static_cast<size_t>(b) * kAmxBlockBytes;
    uint8_t* low = high + kAmxBlockBytes / 2;
    for (int s = 0; s < 16; ++s) {
      const __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(R + 32 + 16 * s)));
      const __m512i scale2 = _mm512_or_si512(_mm512_and_si512(scale, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(scale, 16));
      __m512i c[4];
      q6k_codes_avx512(lines, highs, s, c);
      for (int j = 0; j < 4; ++j) {
        const __m512i we = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(c[j], even), offset), scale2);
        const __m512i wo = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_srli_epi16(c[j], 8), offset), scale2);
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(we, 6), even),
                                           _mm512_slli_epi16(_mm512_srai_epi16(wo, 6), 8));
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(we, six), _mm512_slli_epi16(_mm512_and_si512(wo, six), 8));
        _mm512_storeu_si512(high + 64 * (4 * s + j), hi);
        _mm512_storeu_si512(low + 64 * (4 * s + j), lo);
      }
    }
  }
}

// two row tiles' (or one's) products with one block of one weight tile: tiles 0-3 their sums (high and low of
// each), 4-5 their activations, 6-7 the unpacked weights, so that each tile loaded serves two products (a load
// serving one left the tile unit waiting on the first level's bandwidth); the sums go to memory
__attribute__((target(ES_AMX))) inline void products_amx(const uint8_t* unpacked, const int8_t* codes, bool two,
                                                         int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int j = 0; j < 4; ++j) {
    _tile_loadd(6, unpacked + 1024 * j, 64);
    _tile_loadd(7, unpacked + kAmxBlockBytes / 2 + 1024 * j, 64);
    _tile_loadd(4, codes + 1024 * j, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if (two) {
      _tile_loadd(5, codes + 4096 + 1024 * j, 64);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + kAmxSums, 64);
  if (two) {
    _tile_stored(2, sums + 2 * kAmxSums, 64);
    _tile_stored(3, sums + 3 * kAmxSums, 64);
  }
}

struct BlockFactors {  // one record's per-output factors, for every row tile of its block
  __m512 d, dmin;
  __m512i pairs[4];    // Q4_K's minimum pairs (q4k_minimum_pairs_avx512)
};

// 16 rows' float32 steps after their block's integer sums (high, then low, a tile each), as the AVX-512 kernels
// take them
template <bool Q4K>
__attribute__((target(ES_AMX))) inline void finish_amx(const BlockFactors& F, const int32_t* sums, bool first_block,
                                                       const float* scales, const int32_t* pairs32, float* out,
                                                       int64_t ld, __mmask16 mask) {
  constexpr int shift = Q4K ? 3 : 6;
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums + kTile * r), shift),
                                           _mm512_load_si512(sums + kAmxSums + kTile * r));
    const __m512 dx = _mm512_set1_ps(scales[r]);
    float* y = out + r * ld;
    __m512 acc = first_block ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(F.d, dx), acc);
    if constexpr (Q4K) {
      __m512i mins = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) mins = _mm512_dpwssd_epi32(mins, F.pairs[k], _mm512_set1_epi32(pairs32[4 * r + k]));
      acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(F.dmin, dx), acc);
    }
    _mm512_mask_storeu_ps(y, mask, acc);
  }
}

// one weight tile's block for the two (or one) row tiles of a group: its record (the float steps' factors), its
// 8 KB unpacked, and where its sums go (out[r * ld + o] for the outputs the mask keeps)
struct AmxTarget {
  const uint8_t* record;
  const uint8_t* unpacked;
  float* out;
  int64_t ld;
  __mmask16 mask;
};

// the float32 steps of one target's sums for the group's `tiles` row tiles (scales, pairs32: their Q8_K scales and
// minimum pairs), added to the rows' sums from zero at the first block
template <bool Q4K>
__attribute__((target(ES_AMX))) void finish_target(const AmxTarget& T, const int32_t* sums, bool first_block,
                                                   const float* scales, const int32_t* pairs32, int tiles) {
  BlockFactors F;
  F.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(T.record)));
  if constexpr (Q4K) {
    F.dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(T.record + 32)));
    q4k_minimum_pairs_avx512(T.record, F.pairs);
  }
  for (int t = 0; t < tiles; ++t)
    finish_amx<Q4K>(F, sums + t * 2 * kAmxSums, first_block, scales + kAmxRows * t, pairs32 + 4 * kAmxRows * t,
                    T.out + kAmxRows * t * T.ld, T.ld, T.mask);
}

// one block of a group's rows (codes: their codes of the block, as products_amx reads them) against `count`
// weight tiles: the tile unit multiplies weight tile w while the vector units finish w - 1, their sums in memory
// in turns (finishing each product before the next left the tile unit idle)
template <bool Q4K>
__attribute__((target(ES_AMX))) void targets_amx(const AmxTarget* targets, int count, bool first_block,
                                                 const int8_t* codes, const float* scales, const int32_t* pairs32,
                                                 int tiles) {
  alignas(64) int32_t sums[2][4 * kAmxSums];
  products_amx(targets[0].unpacked, codes, tiles > 1, sums[0]);
  for (int w = 1; w <= count; ++w) {
    if (w < count) products_amx(targets[w].unpacked, codes, tiles > 1, sums[w % 2]);
    finish_target<Q4K>(targets[w - 1], sums[(w - 1) % 2], first_block, scales, pairs32, tiles);
  }
}

void amx_begin() {
  const edge_spec::TileConfig config = edge_spec::full_tiles();
  edge_spec::load_tile_config(config);
}

__attribute__((target(ES_AMX))) void amx_end() { _tile_release(); }
#endif

// ---------------------------------------------------------------------------------------------------
// SwiGLU: silu(gate) * up over one tile of 16 outputs, for an op that multiplies the gate and up rows at once
//
// silu(x) = x / (1 + exp(-x)), exp by Cephes' polynomial: 2^n * e^r with n = round(t * log2 e) and |r| <= ln 2 / 2.
// The two paths run the same float32 operations in the same order (explicit fused multiply-adds, a correctly
// rounded division), so they give the same bits, and each output depends on its own gate and up alone.  The
// AVX-512 kernels use the AVX2 routine: 16 outputs after two tiles' products over all of K, it costs next to
// nothing at either width.
// t is held to [-86, 88] so that 2^n stays a normal float; past it exp's value no longer moves silu's.

constexpr float kExpLow = -86.0f, kExpHigh = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

float silu_scalar(float x) {
  const float t = std::min(std::max(-x, kExpLow), kExpHigh);
  const float n = std::nearbyint(t * kLog2e);
  float r = std::fma(n, -kLn2High, t);
  r = std::fma(n, -kLn2Low, r);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
  float e = std::fma(p, r * r, r) + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &e, sizeof(bits));
  bits += static_cast<uint32_t>(static_cast<int32_t>(n)) << 23;
  std::memcpy(&e, &bits, sizeof(e));
  return x / (1.0f + e);
}

void swiglu_scalar(const float* gate, const float* up, float* out) {
  for (int j = 0; j < 16; ++j) out[j] = silu_scalar(gate[j]) * up[j];
}

#ifdef ES_X86
__attribute__((target("avx2,fma"))) void swiglu_avx2(const float* gate, const float* up, float* out) {
  for (int h = 0; h < 16; h += 8) {
    const __m256 x = _mm256_loadu_ps(gate + h);
    const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(kExpLow)),
                                   _mm256_set1_ps(kExpHigh));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2High), t);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Low), r);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
    __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    e = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(e), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(out + h, _mm256_mul_ps(silu, _mm256_loadu_ps(up + h)));
  }
}
#endif

// ---------------------------------------------------------------------------------------------------
// the op

struct Kernel {
  int64_t K = 0, N = 0, type = 0;  // K: the input's width; the weights cover it in whole blocks of 256
  bool glu = false;  // the N rows are gate rows then as many up rows; the output is silu(gate) * up, N / 2 wide
  int tail = 8;      // the sub-blocks of 32 the last block's Q4_K records hold (8; 4 where K ends a half block in)
  int64_t width() const { return glu ? N / 2 : N; }
  int64_t blocks() const { return (K + kQK - 1) / kQK; }
  int64_t padded() const { return blocks() * kQK; }  // a row's codes: K, then zeros to the last block's end
  // one tile's records of 16 rows, one block after another
  size_t tile_bytes() const {
    if (type != kTypeQ4K) return static_cast<size_t>(blocks()) * kQ6KRecord;
    return static_cast<size_t>(blocks() - 1) * kQ4KRecord + q4k_record_bytes(tail);
  }
};

// the rows AMX multiplies (whole tiles of 16), laid out once a pass as its tiles read them: block by block, row
// tile by row tile, the tile's four 16 x 64 codes (4 KB), and their Q8_K scales and minimum pairs beside
struct AmxRows {
  int rows = 0;
  int8_t* codes = nullptr;    // [block][row tile][4][16][64]
  float* scales = nullptr;    // [block][row]
  int32_t* pairs = nullptr;   // [block][row][4]; Q4_K's only (Q6_K has no minimums)
};

struct Pass {
  const Kernel* kernel;
  const uint8_t* weights;
  const Q8Row* rows;
  int nrows;
  float* y;
  int64_t tiles_per_item;
  const AmxRows* amx = nullptr;  // the rows AMX multiplies, if any
};

using TileKernel = void (*)(const uint8_t*, int, const Q8Row*, int, float*);
TileKernel g_q4k = tile_q4k_scalar<8>;
TileKernel g_q4k_short = tile_q4k_scalar<4>;  // matrices whose last block's records hold four sub-blocks
TileKernel g_q6k = tile_q6k_scalar;
using GluKernel = void (*)(const float*, const float*, float*);
GluKernel g_swiglu = swiglu_scalar;

bool g_amx = false;  // passes of many rows (kAmxMinRows*) multiply on AMX's tiles (gguf_amx_here)
// the fewest rows a pass multiplies on AMX: below them unpacking every weight costs more than the tiles save
// (the op alone on an Intel Xeon with AMX, against the AVX-512 kernels: the Q4_K SwiGLU pass of 1536 x 17920
// 1.3x faster at 32 rows, 1.7x at 64 and 96; the Q6_K down projection 1.4x at 32; a lone row tile, 16 to 31
// rows, 1.05-1.2x slower)
constexpr int kAmxMinRowsQ4K = 32, kAmxMinRowsQ6K = 32;
constexpr int kAmxTilesPerItem = 4;  // weight tiles a work item unpacks (with glu, as many up tiles beside)

#ifdef ES_X86
// the pass's AMX rows (P.amx) against the item's weight tiles [first, last).  A tile product wants both its
// operands in the first level of the cache, and a prompt pass's activations (512 rows of 8960 codes: 4.5 MB)
// outgrow the second.  So the item's weight tiles (with glu, their gate and up rows) are unpacked kAmxChunk
// blocks at a time (held by the second level), and then, kAmxGroupRows rows at a time, each block's codes of
// those rows (8 KB, laid out as the tiles read them) are multiplied by every weight tile.  Every output still
// adds its blocks' products in order, block 0 first.
//
// Picked by the op alone on an Intel Xeon with AMX, 512-row passes, one process, its buffers on 2 MiB pages:
// groups of 32 rows against 128, SwiGLU items of 4 tiles against 8, and each weight tile's products overlapping
// the last one's float steps, the SwiGLU pass of 1536 x 17920 ran 1.18x faster, the Q4_K down projection 1.10x,
// a 1536 x 2048 projection 1.18x, the Q6_K down projection 1.06x (groups of 64 and 256 rows were slower).
constexpr int kAmxChunk = 4;       // blocks of 256 a chunk
constexpr int kAmxGroupRows = 32;  // rows of a group: the two row tiles of one products_amx

void run_item_amx(const Pass& P, int64_t first, int64_t last) {
  const Kernel& k = *P.kernel;
  const AmxRows& A = *P.amx;
  const bool q4k = k.type == kTypeQ4K;
  const size_t record = q4k ? kQ4KRecord : kQ6KRecord;
  const int blocks = static_cast<int>(k.blocks());
  const int64_t width = k.width();
  const int64_t tiles = (width + kTile - 1) / kTile;
  const size_t tile_bytes = k.tile_bytes();  // whole records: AMX takes no short tail
  const int chunk = k.glu ? blocks : std::min(blocks, kAmxChunk);  // SwiGLU wants the gate's and up's whole sums
  const int outputs_here = static_cast<int>(last - first);
  const int weights = outputs_here * (k.glu ? 2 : 1);  // weight tiles: the item's, then (glu) their up tiles
  thread_local Scratch<uint8_t> unpacked_scratch;
  uint8_t* unpacked = unpacked_scratch.get(static_cast<size_t>(weights) * chunk * kAmxBlockBytes);
  thread_local Scratch<float> up_scratch;  // with glu: the up rows' sums, [row][item tile][16]
  float* up = k.glu ? up_scratch.get(static_cast<size_t>(A.rows) * outputs_here * kTile) : nullptr;
  thread_local std::vector<AmxTarget> target_scratch;
  grow(target_scratch, static_cast<size_t>(weights));
  AmxTarget* targets = target_scratch.data();
  amx_begin();
  for (int c0 = 0; c0 < blocks; c0 += chunk) {
    const int c1 = std::min(blocks, c0 + chunk);
    for (int w = 0; w < weights; ++w) {
      const int64_t t = w < outputs_here ? first + w : first + (w - outputs_here) + tiles;
      const uint8_t* records = P.weights + t * tile_bytes + static_cast<size_t>(c0) * record;
      uint8_t* into = unpacked + static_cast<size_t>(w) * chunk * kAmxBlockBytes;
      if (q4k) {
        unpack_q4k_amx(records, c1 - c0, into);
      } else {
        unpack_q6k_amx(records, c1 - c0, into);
      }
    }
    for (int g0 = 0; g0 < A.rows; g0 += kAmxGroupRows) {
      const int g = std::min(A.rows - g0, kAmxGroupRows);
      for (int b = c0; b < c1; ++b) {
        const int8_t* codes = A.codes + (static_cast<size_t>(b) * A.rows + g0) * kQK;
        const float* scales = A.scales + static_cast<size_t>(b) * A.rows + g0;
        const int32_t* pairs = q4k ? A.pairs + (static_cast<size_t>(b) * A.rows + g0) * 4 : nullptr;
        for (int w = 0; w < weights; ++w) {
          const bool is_up = w >= outputs_here;
          const int64_t t = is_up ? first + (w - outputs_here) + tiles : first + w;
          AmxTarget& T = targets[w];
          T.record = P.weights + t * tile_bytes + static_cast<size_t>(b) * record;
          T.unpacked = unpacked + (static_cast<size_t>(w) * chunk + (b - c0)) * kAmxBlockBytes;
          T.out = is_up ? up + static_cast<size_t>(g0) * outputs_here * kTile + (w - outputs_here) * kTile
                        : P.y + g0 * width + t * kTile;
          T.ld = is_up ? outputs_here * kTile : width;
          const int64_t outputs = is_up ? kTile : std::min<int64_t>(kTile, width - t * kTile);
          T.mask = static_cast<__mmask16>((1u << outputs) - 1u);
        }
        if (q4k) {
          targets_amx<true>(targets, weights, b == 0, codes, scales, pairs, g / kAmxRows);
        } else {
          targets_amx<false>(targets, weights, b == 0, codes, scales, pairs, g / kAmxRows);
        }
      }
    }
  }
  amx_end();
  if (k.glu) {
    for (int r = 0; r < A.rows; ++r) {
      for (int w = 0; w < outputs_here; ++w) {
        float* y = P.y + r * width + (first + w) * kTile;
        g_swiglu(y, up + (static_cast<size_t>(r) * outputs_here + w) * kTile, y);
      }
    }
  }
}
#endif

struct AmxLayout {
  const Q8Row* rows;
  AmxRows* out;
  int blocks;
};

// row tile `tile`'s codes, scales and (Q4_K) minimum pairs into the AMX layout (one work item a row tile)
void lay_out_row_tile(void* data, size_t tile) {
  const AmxLayout& L = *static_cast<const AmxLayout*>(data);
  AmxRows& A = *L.out;
  for (int i = 0; i < kAmxRows; ++i) {
    const int r = static_cast<int>(tile) * kAmxRows + i;
    const Q8Row& x = L.rows[r];
    for (int b = 0; b < L.blocks; ++b) {
      int8_t* dst = A.codes + (static_cast<size_t>(b) * A.rows + tile * kAmxRows) * kQK + i * 64;
      for (int j = 0; j < 4; ++j) std::memcpy(dst + 1024 * j, x.q + b * kQK + 64 * j, 64);
      A.scales[static_cast<size_t>(b) * A.rows + r] = x.d[b];
      if (A.pairs != nullptr)
        std::memcpy(&A.pairs[(static_cast<size_t>(b) * A.rows + r) * 4], &x.pairs32[b * 4], 4 * sizeof(int32_t));
    }
  }
}

void run_item(void* data, size_t item) {
  const Pass& P = *static_cast<const Pass*>(data);
  const Kernel& k = *P.kernel;
  const int blocks = static_cast<int>(k.blocks());
  const TileKernel tile = k.type != kTypeQ4K ? g_q6k : k.tail == 8 ? g_q4k : g_q4k_short;
  const int64_t width = k.width();
  const int64_t tiles = (width + kTile - 1) / kTile;  // of the output (with glu: the gate rows')
  const int64_t first = static_cast<int64_t>(item) * P.tiles_per_item;
  const int64_t last = std::min<int64_t>(first + P.tiles_per_item, tiles);
  const int total_rows = P.nrows;
  const size_t tile_bytes = k.tile_bytes();
  alignas(64) float result[kMaxRows * kTile];
  alignas(64) float up[kMaxRows * kTile];
  const int amx_rows = P.amx != nullptr ? P.amx->rows : 0;  // done on AMX's tiles (whole tiles of 16); the rest below
#ifdef ES_X86
  if (amx_rows > 0) run_item_amx(P, first, last);
#endif
  // row groups outside, the item's tiles inside: a group's activations are read from memory once for all
  // the item's tiles, whose weights stay in cache from group to group (each output's sums are the same)
  for (int r0 = amx_rows; r0 < total_rows; r0 += kMaxRows) {
    const int nrows = std::min(kMaxRows, total_rows - r0);
    const Q8Row* rows = P.rows + r0;
    for (int64_t t = first; t < last; ++t) {
      const int64_t outputs = std::min<int64_t>(kTile, width - t * kTile);
      float* y = P.y + r0 * width + t * kTile;
      tile(P.weights + static_cast<size_t>(t) * tile_bytes, blocks, rows, nrows, result);
      for (int r = 0; r < nrows; ++r) std::memcpy(y + r * width, result + r * kTile, outputs * sizeof(float));
    }
    if (!k.glu) continue;
    // the same outputs' up rows, half the matrix further on, after all the item's gate rows, so that the
    // weights stream from one place at a time (a gate tile and an up tile in turn, 864 bytes each, kept the
    // hardware prefetcher from running ahead); SwiGLU then turns the gate sums in y into the outputs (widths
    // are whole tiles)
    for (int64_t t = first; t < last; ++t) {
      float* y = P.y + r0 * width + t * kTile;
      tile(P.weights + static_cast<size_t>(t + tiles) * tile_bytes, blocks, rows, nrows, up);
      for (int r = 0; r < nrows; ++r) g_swiglu(y + r * width, up + r * kTile, y + r * width);
    }
  }
}

struct Rounding {
  const float* x;
  int K;       // the input's width
  int padded;  // the weights' (whole blocks of 256)
  Q8Row* rows;
};

// a row rounded to Q8_K blocks; a width short of whole blocks is rounded as the row with zeros after it, which
// add nothing to any sum (the weights' padding is zeros too)
void round_rows(void* data, size_t row) {
  const Rounding& R = *static_cast<const Rounding*>(data);
  const float* x = R.x + row * R.K;
  if (R.padded == R.K) {
    quantize_row(x, R.K, R.rows[row]);
    return;
  }
  thread_local Scratch<float> padded_scratch;
  float* whole = padded_scratch.get(static_cast<size_t>(R.padded));
  std::memcpy(whole, x, static_cast<size_t>(R.K) * sizeof(float));
  std::memset(whole + R.K, 0, static_cast<size_t>(R.padded - R.K) * sizeof(float));
  quantize_row(whole, R.padded, R.rows[row]);
}

using Error = edge_spec::OpError;

void check(OrtStatus* status) { edge_spec::check_status(g_api, status); }

void compute(const Kernel& k, OrtKernelContext* context) {
  const OrtValue* x_value = nullptr;
  const OrtValue* w_value = nullptr;
  check(g_api->KernelContext_GetInput(context, 0, &x_value));
  check(g_api->KernelContext_GetInput(context, 1, &w_value));
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(g_api->GetTensorTypeAndShape(x_value, &info));
  size_t rank = 0;
  check(g_api->GetDimensionsCount(info, &rank));
  std::vector<int64_t> shape(rank);
  check(g_api->GetDimensions(info, shape.data(), rank));
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  if (rank == 0 || shape.back() != k.K) throw Error{"edge_spec.MatMulGGUF: the input's last dimension must be K"};
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < rank; ++i) rows *= shape[i];
  OrtTensorTypeAndShapeInfo* w_info = nullptr;
  check(g_api->GetTensorTypeAndShape(w_value, &w_info));
  size_t w_elements = 0;
  check(g_api->GetTensorShapeElementCount(w_info, &w_elements));
  g_api->ReleaseTensorTypeAndShapeInfo(w_info);
  const int64_t expected = (k.N + kTile - 1) / kTile * static_cast<int64_t>(k.tile_bytes());
  if (static_cast<int64_t>(w_elements) != expected) {
    throw Error{"edge_spec.MatMulGGUF: the weights must hold N rows of ceil(K / 256) blocks in records of 16 rows (" +
                std::to_string(expected) + " bytes), not " + std::to_string(w_elements)};
  }
  const float* x = nullptr;
  const uint8_t* w = nullptr;
  check(g_api->GetTensorData(x_value, reinterpret_cast<const void**>(&x)));
  check(g_api->GetTensorData(w_value, reinterpret_cast<const void**>(&w)));
  shape.back() = k.width();
  OrtValue* y_value = nullptr;
  check(g_api->KernelContext_GetOutput(context, 0, shape.data(), rank, &y_value));
  float* y = nullptr;
  check(g_api->GetTensorMutableData(y_value, reinterpret_cast<void**>(&y)));
  thread_local std::vector<Q8Row> quantized;  // kept for the next pass (see Scratch)
  grow(quantized, static_cast<size_t>(rows));
  thread_local Scratch<int8_t> code_scratch;  // every row's codes, one row after another
  const int64_t padded = k.padded();
  int8_t* codes = code_scratch.get(static_cast<size_t>(rows) * padded);
  for (int64_t r = 0; r < rows; ++r) quantized[r].q = codes + r * padded;
  Rounding rounding{x, static_cast<int>(k.K), static_cast<int>(padded), quantized.data()};
  if (rows == 1) {
    round_rows(&rounding, 0);
  } else {  // rows in parallel: rounding 512 rows of the down projection's 8960 inputs is a third of its matmul
    check(g_api->KernelContext_ParallelFor(context, round_rows, static_cast<size_t>(rows), 0, &rounding));
  }
  // a SwiGLU item reads its gate tiles and then its up tiles: 16 tiles make each run 14 KB of one stream
  // AMX's items unpack their weight tiles: a SwiGLU item kAmxTilesPerItem gate tiles and their up tiles, any other
  // about an eighth of the pass, kAmxTilesPerItem tiles at the least (a down projection's items: 12 tiles, 384 KB
  // unpacked a chunk of kAmxChunk blocks)
  const bool q4k = k.type == kTypeQ4K;
  // (AMX's unpacking reads whole records: a short tail keeps the vector kernels)
  const bool amx = g_amx && k.tail == 8 && rows >= (q4k ? kAmxMinRowsQ4K : kAmxMinRowsQ6K);
  const int64_t tiles = (k.width() + kTile - 1) / kTile;
  const int64_t amx_tiles = k.glu ? kAmxTilesPerItem : std::max<int64_t>(kAmxTilesPerItem, (tiles + 7) / 8);
  Pass P{&k, w, quantized.data(), static_cast<int>(rows), y, amx ? amx_tiles : k.glu ? 16 : 4};
  AmxRows amx_rows;
  if (amx) {
    thread_local Scratch<int8_t> amx_codes;
    thread_local Scratch<float> amx_scales;
    thread_local Scratch<int32_t> amx_pairs;
    amx_rows.rows = static_cast<int>(rows / kAmxRows * kAmxRows);
    const int blocks = static_cast<int>(k.blocks());
    amx_rows.codes = amx_codes.get(static_cast<size_t>(amx_rows.rows) * padded);
    amx_rows.scales = amx_scales.get(static_cast<size_t>(amx_rows.rows) * blocks);
    amx_rows.pairs = q4k ? amx_pairs.get(static_cast<size_t>(amx_rows.rows) * blocks * 4) : nullptr;
    AmxLayout layout{quantized.data(), &amx_rows, blocks};
    check(g_api->KernelContext_ParallelFor(context, lay_out_row_tile, amx_rows.rows / kAmxRows, 0, &layout));
    P.amx = &amx_rows;
  }
  const size_t items = static_cast<size_t>((tiles + P.tiles_per_item - 1) / P.tiles_per_item);
  check(g_api->KernelContext_ParallelFor(context, run_item, items, 0, &P));
}

OrtStatusPtr ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  return edge_spec::guarded(g_api, [&] {
    Kernel kernel;
    kernel.K = edge_spec::attribute_int(g_api, info, "K", 0);
    kernel.N = edge_spec::attribute_int(g_api, info, "N", 0);
    kernel.type = edge_spec::attribute_int(g_api, info, "type", 0);
    const int64_t glu = edge_spec::attribute_int(g_api, info, "glu", 0);
    const int64_t tail = edge_spec::attribute_int(g_api, info, "tail", 8);
    if (kernel.K <= 0 || kernel.N <= 0 || (kernel.type != kTypeQ4K && kernel.type != kTypeQ6K)) {
      throw Error{"edge_spec.MatMulGGUF: K, N and type (12: Q4_K, 14: Q6_K) are required"};
    }
    if (glu != 0 && (glu != 1 || kernel.N % (2 * kTile) != 0)) {
      throw Error{"edge_spec.MatMulGGUF: glu is 0 or 1 (SwiGLU over gate and up rows of whole records: N a multiple of 32)"};
    }
    kernel.glu = glu == 1;
    if (tail != 8 && (tail != 4 || kernel.type != kTypeQ4K || kernel.K > (kernel.blocks() - 1) * kQK + kQK / 2)) {
      throw Error{"edge_spec.MatMulGGUF: tail is 8, or 4 for Q4_K where K ends at most 128 columns into its last block"};
    }
    kernel.tail = static_cast<int>(tail);
    *out = new Kernel(kernel);
  });
}

OrtStatusPtr ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* context) {
  return edge_spec::guarded(g_api, [&] { compute(*static_cast<Kernel*>(kernel), context); });
}

void ORT_API_CALL destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }
const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "MatMulGGUF"; }
ONNXTensorElementDataType ORT_API_CALL op_input_type(const OrtCustomOp*, size_t index) {
  return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
}
size_t ORT_API_CALL op_input_count(const OrtCustomOp*) { return 2; }
ONNXTensorElementDataType ORT_API_CALL op_output_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
size_t ORT_API_CALL op_output_count(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic ORT_API_CALL op_required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}

OrtCustomOp make_op() {
  OrtCustomOp op = edge_spec::cpu_op_table(kApiVersion);
  op.GetName = op_name;
  op.GetInputType = op_input_type;
  op.GetInputTypeCount = op_input_count;
  op.GetOutputType = op_output_type;
  op.GetOutputTypeCount = op_output_count;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = op_required;
  op.GetOutputCharacteristic = op_required;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute_kernel;
  return op;
}

OrtCustomOp g_op = make_op();
bool cpu_has_avx2() {
#ifdef ES_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#ifdef ES_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

#ifdef ES_AVX_VNNI
// AVX-VNNI: CPUID leaf 7, sub-leaf 1, EAX bit 4 (the AVX2 kernels' other features are checked beside it)
bool cpu_has_avx_vnni() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return (eax >> 4) & 1u;
}
#endif

// whether this CPU's cores are Intel's (the prefetch choices above were measured per vendor)
bool intel_cores() {
#ifdef ES_X86
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

}  // namespace

namespace edge_spec {

// whether one-row Q4_K passes ask for the next record ahead: as EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH says, else
// as measured on this machine (gguf_set_one_row_prefetch), else on Intel's cores (see g_one_row_ahead)
bool gguf_one_row_prefetch() {
  if (switch_is("EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH", '1')) return true;
  if (switch_is("EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH", '0')) return false;
  const int measured = g_one_row_measured.load();
  return measured >= 0 ? measured == 1 : intel_cores();
}

// what a measurement chose for one-row passes (1 ahead, 0 not, -1 forget it: the vendor's rule), from now on
// for every session of this process; the environment's switch still decides over it.  Changes no bits.
void gguf_set_one_row_prefetch(int choice) {
  g_one_row_measured = choice < 0 ? -1 : (choice ? 1 : 0);
  g_one_row_ahead = gguf_one_row_prefetch();
}

// the vendor's rule for the fewest rows of a far-asking pass, unless EDGE_SPEC_NATIVE_FAR_PREFETCH says otherwise
int far_rows_by_rule() {
  if (switch_is("EDGE_SPEC_NATIVE_FAR_PREFETCH", '1')) return kFarEveryPass;
  if (switch_is("EDGE_SPEC_NATIVE_FAR_PREFETCH", '0')) return kFarNever;
  return intel_cores() ? kFarEveryPass : kFarRowsElsewhere;
}

// the fewest rows of a pass whose kernels also ask for records kFarRecords on (see g_far_rows): as
// EDGE_SPEC_NATIVE_FAR_PREFETCH says, else as measured on this machine (gguf_set_far_rows), else the vendor's rule
int gguf_far_rows() {
  const bool switched =
      switch_is("EDGE_SPEC_NATIVE_FAR_PREFETCH", '1') || switch_is("EDGE_SPEC_NATIVE_FAR_PREFETCH", '0');
  const int measured = g_far_rows_measured.load();
  return switched || measured == 0 ? far_rows_by_rule() : measured;
}

// what a measurement chose as the fewest rows of a far-asking pass (0: no pass; -1: forget it, the vendor's rule),
// from now on for every session of this process; the environment's switch still decides over it.  Changes no bits.
void gguf_set_far_rows(int rows) {
  g_far_rows_measured = rows < 0 ? 0 : (rows == 0 ? kFarNever : rows);
  g_far_rows = gguf_far_rows();
}

// whether the vendor's rule (or the switch) has every pass ask far ahead: on Intel's cores, where the attention's
// reads of a float16 cache ask far ahead too (measured there alone)
bool gguf_far_prefetch() { return far_rows_by_rule() == kFarEveryPass; }

// which passes ask far ahead now, in words: "far" (every pass), "far from N rows" or "near" (none)
const char* gguf_far_prefetch_words() {
  thread_local std::string words;
  const int rows = gguf_far_rows();
  words = rows == kFarEveryPass ? "far" : rows >= kFarNever ? "near" : "far from " + std::to_string(rows) + " rows";
  return words.c_str();
}

// the kernels this CPU and the environment ask for
KernelPath chosen_path() { return chosen_kernels(cpu_has_avx2(), cpu_has_avx512()); }

// whether the AVX2 kernels' Q4_K passes take AVX-VNNI's products: where they run and the CPU has them, unless
// EDGE_SPEC_NATIVE_AVX_VNNI=0 (the same bits either way)
bool gguf_avx_vnni_here() {
#ifdef ES_AVX_VNNI
  return chosen_path() == KernelPath::avx2 && cpu_has_avx_vnni() && !switch_is("EDGE_SPEC_NATIVE_AVX_VNNI", '0');
#else
  return false;
#endif
}

// whether passes of many rows multiply on AMX's tiles: on CPUs with AMX's int8 products whose AVX-512 kernels
// run (the tiles' sums meet theirs), unless EDGE_SPEC_NATIVE_AMX=0
bool gguf_amx_here() {
#ifdef ES_X86
  if (switch_is("EDGE_SPEC_NATIVE_AMX", '0') || chosen_path() != KernelPath::avx512) return false;
  return amx_usable(AmxUnit::int8);
#else
  return false;
#endif
}

// the op, for the library's RegisterCustomOps (attention.cc) to add to its domain, with its kernels picked
OrtCustomOp* gguf_matmul_op(const OrtApi* api) {
  g_api = api;
  const KernelPath path = chosen_path();
  g_use_avx2 = path != KernelPath::scalar;
  g_q4k = tile_q4k_scalar<8>;
  g_q4k_short = tile_q4k_scalar<4>;
  g_q6k = tile_q6k_scalar;
  g_quantize_avx2 = g_use_avx2;
  g_swiglu = swiglu_scalar;
  g_amx = false;
#ifdef ES_X86
  g_one_row_ahead = gguf_one_row_prefetch();
  g_far_rows = gguf_far_rows();
  g_amx = gguf_amx_here();
  if (path == KernelPath::avx512) {
    g_q4k = tile_q4k_avx512<8>;
    g_q4k_short = tile_q4k_avx512<4>;
    g_q6k = tile_q6k_avx512;
    g_swiglu = swiglu_avx2;
  } else if (g_use_avx2) {
    g_q4k = tile_q4k_avx2<8>;
    g_q4k_short = tile_q4k_avx2<4>;
#ifdef ES_AVX_VNNI
    if (gguf_avx_vnni_here()) {
      g_q4k = tile_q4k_avxvnni<8>;
      g_q4k_short = tile_q4k_avxvnni<4>;
    }
#endif
    g_q6k = tile_q6k_avx2;
    g_swiglu = swiglu_avx2;
  }
#endif
  return &g_op;
}

// which kernels MatMulGGUF runs here: "avx512", "avxvnni" (the AVX2 kernels, Q4_K's on AVX-VNNI), "avx2" or
// "scalar" (what gguf_matmul_op picks)
const char* gguf_matmul_path() { return gguf_avx_vnni_here() ? "avxvnni" : kernel_path_name(chosen_path()); }

// where passes of many rows multiply: "amx", or "" (the kernels above, as every pass)
const char* gguf_matmul_prompt_path() { return gguf_amx_here() ? "amx" : ""; }

}  // namespace edge_spec
