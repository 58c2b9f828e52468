"""The parts :class:`~edge_spec.runtime.engine.Engine` is made of, one job each: loading a bundle into an
engine (:mod:`.loading`), taking turns and cancelling (:mod:`.turns`), building the prompt
(:mod:`.prompt`), choosing exact passes (:mod:`.passes`), following the prefill (:mod:`.prefill`), turning tokens into text (:mod:`.text_stream`)
and what an answer reports (:mod:`.stats`)."""
