"""The drafter's LM heads besides the full one: VocabTrim (``vocabtrim``), SpecVocab (``specvocab``), and
the calibration text they are fit on, shipped for known targets (``calibration_store``).  The EAGLE-3
head and its LM heads are :mod:`edge_spec.export.eagle`'s."""
