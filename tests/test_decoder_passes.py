"""A decoder's passes: through ONNX Runtime's compiled binding they give what its Python wrapper gives (a
session whose ``run_with_iobinding`` something overrides is still called through that override), and only
passes priced like a verify pass are samples of the schedule's costs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from edge_spec.runtime.model import bound_pass, decoder
from edge_spec.runtime.model.decoder import Decoder


def _public_run(session, binding, options=None):
    session.run_with_iobinding(binding, options)


def _public_results(binding, count):
    return [value.numpy() for value in binding.get_outputs()[:count]]


def test_compiled_calls_give_the_wrappers_results(target_path, monkeypatch):
    prompt = [3, 17, 5, 9, 12, 3, 17]
    answers = []
    for public in (True, False):
        if public:
            monkeypatch.setattr(decoder, "run_bound", _public_run)
            monkeypatch.setattr(decoder, "bound_results", _public_results)
        else:
            monkeypatch.setattr(decoder, "run_bound", bound_pass.run_bound)
            monkeypatch.setattr(decoder, "bound_results", bound_pass.bound_results)
        model = Decoder(target_path, threads=1, capacity=32)
        passes = [model.forward(prompt, num_logits=2)]
        passes += [model.forward([int(np.argmax(passes[-1]["logits"][-1]))]) for _ in range(3)]
        answers.append(passes)
    for public, compiled in zip(*answers):
        assert public.keys() == compiled.keys() and "logits" in compiled
        for name in public:
            assert np.array_equal(public[name], compiled[name]), name


def test_an_overridden_run_is_called_as_it_is(target_path):
    model = Decoder(target_path, threads=1, capacity=32)
    calls = []

    class Counting(ort.InferenceSession):
        def run_with_iobinding(self, binding, run_options=None):
            calls.append(1)
            return super().run_with_iobinding(binding, run_options)

    model.session.__class__ = Counting  # the session's own object, its method overridden
    model.forward([3, 17, 5])
    assert calls == [1]
    model.session.__class__ = ort.InferenceSession  # negative control: ORT's own class goes the compiled way
    model.forward([9])
    assert calls == [1]


def test_a_prompt_pass_is_no_sample_of_a_verify_pass_price(target_path):
    """A prompt pass returns one row's logits (the last layer's tail runs on that row alone), so it is
    cheaper than a verify pass of as many rows: only passes that return every row's logits are priced."""
    model = Decoder(target_path, threads=1, capacity=64)
    for _ in range(3):
        model.reset()
        model.prefill([3, 17, 5, 9, 12, 3, 17, 8, 4])  # nine rows, one row's logits
    assert model.stats.costed.get(9, 0) == 0 and model.stats.prefill_calls[9] == 3
    for _ in range(3):  # negative control: decode passes of nine rows are the samples
        model.reset()
        model.forward([3, 17, 5, 9, 12, 3, 17, 8, 4], num_logits=9)
    assert model.stats.costed[9] == 3 and 9 in model.recent_seconds()
