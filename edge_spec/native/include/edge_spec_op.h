// What every edge-spec custom op fills the same way in ORT's OrtCustomOp table: the CPU execution provider,
// default memory, no variadic inputs or outputs, every opset version.  Each op adds its name, its inputs and
// outputs and its kernel functions.
#pragma once

#include <cstring>
#include <limits>

#include "onnxruntime_c_api.h"

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

}  // namespace edge_spec
