// What every edge-spec custom op fills the same way in ORT's OrtCustomOp table, how its code reports to ORT, the
// float16 decoding both ops' portable code shares, and the pass buffers both keep.
// The table: the CPU execution provider,
// default memory, no variadic inputs or outputs, every opset version.  Each op adds its name, its inputs and
// outputs and its kernel functions.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <string>

#include "onnxruntime_c_api.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define ES_AMX_X86 1
#include <cpuid.h>
#if defined(__linux__)
#define ES_AMX_LINUX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace edge_spec {

inline const char* ORT_API_CALL cpu_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
inline OrtMemType ORT_API_CALL default_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
inline int ORT_API_CALL zero(const OrtCustomOp*) { return 0; }
inline int ORT_API_CALL first_version(const OrtCustomOp*) { return 1; }
inline int ORT_API_CALL last_version(const OrtCustomOp*) { return std::numeric_limits<int>::max(); }

inline OrtCustomOp cpu_op_table(uint32_t api_version) {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = api_version;
  op.GetExecutionProviderType = cpu_provider;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = zero;
  op.GetVariadicInputHomogeneity = zero;
  op.GetVariadicOutputMinArity = zero;
  op.GetVariadicOutputHomogeneity = zero;
  op.GetStartVersion = first_version;
  op.GetEndVersion = last_version;
  return op;
}

// whether the environment variable ``name`` (an EDGE_SPEC_NATIVE_* switch) is set and begins with ``value``
inline bool switch_is(const char* name, char value) {
  const char* set = std::getenv(name);
  return set != nullptr && set[0] == value;
}

enum class KernelPath { scalar, avx2, avx512 };

// an op's kernels: what the CPU offers it (has_avx2, has_avx512: the features its kernels of each width need)
// less what the switches turn off (EDGE_SPEC_NATIVE_SCALAR=1, EDGE_SPEC_NATIVE_AVX512=0)
inline KernelPath chosen_kernels(bool has_avx2, bool has_avx512) {
  if (switch_is("EDGE_SPEC_NATIVE_SCALAR", '1') || !has_avx2) return KernelPath::scalar;
  return has_avx512 && !switch_is("EDGE_SPEC_NATIVE_AVX512", '0') ? KernelPath::avx512 : KernelPath::avx2;
}

inline const char* kernel_path_name(KernelPath path) {
  switch (path) {
    case KernelPath::avx512:
      return "avx512";
    case KernelPath::avx2:
      return "avx2";
    default:
      return "scalar";
  }
}

// A failed ORT call or a bad input inside an op: thrown, so that the op's code reads straight through, and
// turned back into ORT's status at the op's entry points (guarded)
struct OpError {
  std::string message;
};

inline OrtStatus* error_status(const OrtApi* api, const std::string& message) {
  return api->CreateStatus(ORT_RUNTIME_EXCEPTION, message.c_str());
}

inline void check_status(const OrtApi* api, OrtStatus* status) {
  if (status != nullptr) {
    std::string message = api->GetErrorMessage(status);
    api->ReleaseStatus(status);
    throw OpError{message};
  }
}

// body() as an ORT entry point: nullptr, or the status of what it threw
template <class Body>
OrtStatus* guarded(const OrtApi* api, Body&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const OpError& e) {
    return error_status(api, e.message);
  } catch (const std::exception& e) {
    return error_status(api, e.what());
  }
}

// an attribute of the node, or fallback where it has none (get: one of ORT's KernelInfoGetAttribute_*)
template <class T, class Getter>
T attribute_or(const OrtApi* api, Getter get, const OrtKernelInfo* info, const char* name, T fallback) {
  T value = fallback;
  if (OrtStatus* status = get(info, name, &value)) {
    api->ReleaseStatus(status);
    return fallback;
  }
  return value;
}

inline int64_t attribute_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  return attribute_or(api, api->KernelInfoGetAttribute_int64, info, name, fallback);
}

inline float attribute_float(const OrtApi* api, const OrtKernelInfo* info, const char* name, float fallback) {
  return attribute_or(api, api->KernelInfoGetAttribute_float, info, name, fallback);
}

// the float a float16's bits stand for (exact: every float16 is a float), for the portable paths: GGUF's block
// scales, a float16 cache's keys and values
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mantissa;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// AMX's tile unit, for the ops' prompt-sized passes: a tile configuration (palette 1: up to 8 tiles of 16 rows
// of 64 bytes), and whether this CPU has the tiles with one kind of products (CPUID leaf 7, EDX) and Linux lets
// this process use them (arch_prctl asks for the tile state once per process; asking again is harmless)
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows of 64 bytes, loaded with the whole configuration as the instruction's operand (GCC's
// _tile_loadconfig names only a pointer's 8 bytes as read, so stores to the rest may be dropped as dead)
inline TileConfig full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  return config;
}

#if defined(ES_AMX_X86)
inline void load_tile_config(const TileConfig& config) { __asm__ volatile("ldtilecfg %0" : : "m"(config)); }
#endif

enum class AmxUnit : unsigned { bf16 = 22, int8 = 25 };  // their CPUID bits

inline bool amx_usable(AmxUnit unit) {
#if !defined(ES_AMX_LINUX)
  (void)unit;
  return false;
#else
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, a, b, c, d);
  const bool tile = (d >> 24) & 1u, products = (d >> static_cast<unsigned>(unit)) & 1u;
  if (!tile || !products) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#endif
}

// A pass's buffers, kept for the next pass on the same thread and only grown: a prompt pass's are megabytes,
// and allocating them afresh each pass (zeroed, as a vector's resize does) cost every op page faults and
// memsets.  Every element is written before it is read.  A buffer of a megabyte or more lies on 2 MiB pages
// where Linux gives them (madvise: transparent huge pages in "madvise" or "always" mode).  A prompt pass's
// buffers (its rows' codes, the unpacked weights) fill most of the second-level cache, and on 4 KiB pages the
// cache sets they land in follow whichever physical pages they got: on an Intel Xeon with AMX, a 512-row
// SwiGLU pass of 1536 x 17920 took 28-32 ms from process to process on small pages, 16-21 ms on 2 MiB ones,
// and a Q6_K down projection 10.6-15.3 ms against 10.0-10.3.
template <class T>
class Scratch {
 public:
  T* get(size_t n) {
    if (n > size_) {
      constexpr size_t kLine = 64, kHuge = size_t{2} << 20, kHugeFrom = size_t{1} << 20;
      const size_t wanted = n * sizeof(T);
      const size_t align = wanted >= kHugeFrom ? kHuge : kLine;
      const size_t bytes = (wanted + align - 1) / align * align;
      void* p = std::aligned_alloc(align, bytes);  // not zeroed
      if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
      if (align == kHuge) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: refused, the pages stay small
#endif
      data_.reset(static_cast<T*>(p));
      size_ = bytes / sizeof(T);
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t size_ = 0;
};

}  // namespace edge_spec
