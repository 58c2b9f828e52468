// llama.cpp's logits for every position of a token sequence, teacher-forced in one decode from an empty cache,
// with llama.cpp's default context settings (the ones llama-server runs with: f16 KV cache, its flash
// attention choice, its batch sizes).  For layout_fidelity.py's llama.cpp row; built against the static
// libraries of the llama.cpp build that benchmarks/spec_peers.py --prepare makes.
//
//   llamacpp_logits MODEL.gguf IDS.i32 THREADS OUT.f32
//
// IDS.i32: the token ids as int32; OUT.f32: float32 logits, one row of n_vocab per id.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

static void quiet(enum ggml_log_level, const char*, void*) {}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MODEL.gguf IDS.i32 THREADS OUT.f32\n", argv[0]);
    return 2;
  }
  std::FILE* in = std::fopen(argv[2], "rb");
  if (in == nullptr) return std::perror(argv[2]), 1;
  std::vector<llama_token> ids;
  for (int32_t id; std::fread(&id, sizeof(id), 1, in) == 1;) ids.push_back(id);
  std::fclose(in);
  const int n = static_cast<int>(ids.size());

  llama_log_set(quiet, nullptr);
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (model == nullptr) return std::fprintf(stderr, "cannot load %s\n", argv[1]), 1;
  llama_context_params params = llama_context_default_params();
  params.n_ctx = static_cast<uint32_t>(n);
  params.n_batch = static_cast<uint32_t>(n);
  params.n_threads = params.n_threads_batch = std::atoi(argv[3]);
  llama_context* context = llama_init_from_model(model, params);
  if (context == nullptr) return std::fprintf(stderr, "cannot make a context of %d tokens\n", n), 1;

  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = ids[i];
    batch.pos[i] = i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = n;
  if (llama_decode(context, batch) != 0) return std::fprintf(stderr, "llama_decode failed\n"), 1;

  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::FILE* out = std::fopen(argv[4], "wb");
  if (out == nullptr) return std::perror(argv[4]), 1;
  for (int i = 0; i < n; ++i) std::fwrite(llama_get_logits_ith(context, i), sizeof(float), vocab, out);
  std::fclose(out);
  llama_batch_free(batch);
  llama_free(context);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
