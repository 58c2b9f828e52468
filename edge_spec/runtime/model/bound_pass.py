"""A pass over bound buffers, through ONNX Runtime's compiled binding rather than its Python wrapper.

The wrapper's ``InferenceSession.run_with_iobinding`` first looks up the run option ``gpu_graph_id`` for
WebGPU graph capture, which this package never enables; an unset key makes ONNX Runtime raise and catch
an exception, ~60 µs.  ``IOBinding.get_outputs`` wraps every bound output in a Python ``OrtValue``,
present key/value buffers included (56 for a 28-layer decoder), to return the two or three results a
pass is for: ~130 µs.  Together ~1% of a target pass and ~3% of a drafter step (Zen 5 EPYC, 2 threads).
Both calls here go to the same compiled methods the wrapper calls.  They do so only for ONNX Runtime's own
classes (a session or binding whose method something overrides, a test's or a profiler's, is called as
it is) and fall back to the wrapper where its internals (``_sess``, ``_iobinding``) are not there."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort


def run_bound(session: ort.InferenceSession, binding: ort.IOBinding, options: ort.RunOptions | None = None) -> None:
    """``session.run_with_iobinding(binding, options)``."""
    compiled_session, compiled_binding = getattr(session, "_sess", None), getattr(binding, "_iobinding", None)
    wrapped = type(session).run_with_iobinding is not ort.InferenceSession.run_with_iobinding
    if wrapped or compiled_session is None or compiled_binding is None:
        session.run_with_iobinding(binding, options)
        return
    compiled_session.run_with_iobinding(compiled_binding, options)


def bound_results(binding: ort.IOBinding, count: int) -> list[np.ndarray]:
    """The first ``count`` outputs of the last pass over ``binding``, as numpy arrays."""
    compiled = getattr(binding, "_iobinding", None)
    if compiled is None or type(binding).get_outputs is not ort.IOBinding.get_outputs:
        return [value.numpy() for value in binding.get_outputs()[:count]]
    values = compiled.get_outputs()
    return [values[i].numpy() for i in range(count)]
