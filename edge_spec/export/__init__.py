"""The exporter: a target and a drafter into one bundle.  ``sources`` reads a model (``gguf`` its GGUF files)
into architecture-neutral weights, ``graph`` builds and quantizes the ONNX graphs, ``heads`` fits the drafter's
reduced LM heads and ``eagle`` the EAGLE-3 head, and ``bundle`` runs the export's stages and installs the
finished directory."""
