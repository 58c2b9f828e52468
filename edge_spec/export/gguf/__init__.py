"""GGUF sources: carrying their quantized blocks into MatMulNBits, and a tokenizer that splits as llama.cpp does."""
