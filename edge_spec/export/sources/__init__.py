"""Where an export's models come from: a source resolved into weights and a tokenizer (``resolve``: a
registry name, a GGUF file, a Hugging Face directory or hub id), a checkpoint's safetensors read lazily
(``checkpoint``), and the target/drafter pair checked before anything is built (``pair``).  GGUF files
are read by :mod:`edge_spec.export.gguf`."""
