"""Plain helpers shared by several test modules (fixtures live in ``conftest.py``, the tiny models and
tokenizer in ``tiny_models.py``): bundle export, the CLI in a subprocess, token loops, chi-square tests."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys

import numpy as np

from tests import tiny_models

# ---------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------

#: A tool as an OpenAI request declares it, for tests of tool schemas, calls and results in the chat template
#: and in a model's output format.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

#: The base URL the in-process server answers on (Starlette's TestClient never opens the port).
BASE = "http://127.0.0.1:8000"


@contextlib.contextmanager
def serving(engine, name: str = "tiny", **options):
    """The app on ``engine`` in process, serving the model as ``name`` (``options``: ``build_app``'s);
    yields an ``openai`` client talking to it and the raw HTTP client."""
    import openai
    from starlette.testclient import TestClient

    from edge_spec.server.serve import build_app

    app, _ = build_app(engine, name=name, **options)
    with TestClient(app, base_url=BASE) as http:
        yield openai.OpenAI(base_url=f"{BASE}/v1", api_key="any", http_client=http, max_retries=0), http


# ---------------------------------------------------------------------------
# bundles
# ---------------------------------------------------------------------------


def export_tiny(tmp_dir, tiny_pair, **options):
    """Export the tiny (tokenizer, target, drafter) triple through the real exporter path into ``tmp_dir``."""
    from edge_spec.export.bundle.build import ExportOptions, export_bundle

    tokenizer, target, draft = tiny_pair
    models = {
        "tiny-target": tiny_models.loaded("tiny-target", target, tokenizer),
        "tiny-draft": tiny_models.loaded("tiny-draft", draft, tokenizer),
    }
    options.setdefault("draft_vocab", "full")  # the tiny fixtures name the heads they need
    options.setdefault("context_length", 256)
    opts = ExportOptions(**options)
    export_bundle("tiny-target", "tiny-draft", tmp_dir, opts, loader=models.__getitem__)
    return tmp_dir


# ---------------------------------------------------------------------------
# the command line, in a subprocess
# ---------------------------------------------------------------------------


def cli(*args: str, timeout: int = 300, input_text: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess (stdin: ``input_text``, else nothing)."""
    return subprocess.run(
        [sys.executable, "-m", "edge_spec.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input_text,
        stdin=None if input_text is not None else subprocess.DEVNULL,
    )


def native_kernels(native_library, function: str, env: dict[str, str]) -> str:
    """Which kernels the native library's ``function`` (``EdgeSpecAttentionPath``, ``EdgeSpecGGUFMatMulPath``)
    says a process started with ``env`` runs: read in a child, since the library reads the switches at load."""
    code = (
        f"import ctypes, sys; f = ctypes.CDLL(sys.argv[1]).{function}; f.restype = ctypes.c_char_p; print(f().decode())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(native_library)], env={**os.environ, **env}, capture_output=True, text=True
    )
    return done.stdout.strip()


NATIVE_RUNNER = """
import sys, numpy as np, onnxruntime as ort
options = ort.SessionOptions(); options.intra_op_num_threads = 2
options.register_custom_ops_library(sys.argv[1])
s = ort.InferenceSession(open(sys.argv[2], "rb").read(), options, providers=["CPUExecutionProvider"])
np.save(sys.argv[4], s.run(None, dict(np.load(sys.argv[3])))[0])
"""


def native_first_output(native_library, model: bytes, feeds: dict, env: dict[str, str], folder) -> np.ndarray:
    """The model's first output on the native library, computed in a child started with ``env`` (the library
    picks its kernels from the switches at load, once a process)."""
    (folder / "model.onnx").write_bytes(model)
    np.savez(folder / "feeds.npz", **feeds)
    subprocess.run(
        [sys.executable, "-c", NATIVE_RUNNER, str(native_library), str(folder / "model.onnx"),
         str(folder / "feeds.npz"), str(folder / "output.npy")],
        env={**os.environ, **env},
        check=True,
    )  # fmt: skip
    return np.load(folder / "output.npy")


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0], lines[0]


# ---------------------------------------------------------------------------
# token loops on an engine's decoders
# ---------------------------------------------------------------------------

PROMPTS = ["def is_prime(n):", "The quick brown fox", "What is 12 * 7?", "Summarize: speculative decoding drafts"]


def chain(gamma: int, *, adaptive: bool = False, lookup: bool = False, drafter: str = "model", **settings):
    """A chain configuration as the loop tests want it: fixed γ, the drafter model (or ``drafter``) plus
    free guesses in batch-invariant passes, prompt lookup only when asked for."""
    from edge_spec.runtime.loops.config import ChainConfig

    proposers = (("lookup",) if lookup else ()) + (drafter, "guess")
    return ChainConfig(gamma=gamma, adaptive=adaptive, proposers=proposers, **settings)


def eagle(gamma: int, **settings):
    """``chain`` drafting with the EAGLE head."""
    return chain(gamma, drafter="eagle", **settings)


def guesses_only():
    """A chain that never runs the drafter: every round verifies a free guess in its spare row (exact mode)."""
    from edge_spec.runtime.loops.config import ChainConfig

    return ChainConfig(gamma=1, adaptive=False, proposers=("guess",))


def loop_tokens(config, target, context, prompt_ids, params, rng, n, stats=None, constraint=None):
    """The token stream of the loop ``config`` names for one request over ``target`` and the proposers
    of ``context`` (``constraint``: what the answer may contain)."""
    from edge_spec.runtime.loops import Request, generate_tokens, proposers_for

    proposers = proposers_for(config, context, constraint)
    return generate_tokens(config, Request(target, proposers, prompt_ids, params, rng, n, stats, constraint))


def run(engine, prompt_ids, params, n, config, seed=0):
    """``n`` tokens from target-only decoding (``config`` None) or from the speculative loop ``config``
    names (chain, tree or SSD) over the engine's target and drafter, plus the loop's stats."""
    from edge_spec.runtime.loops.config import ArConfig
    from edge_spec.runtime.loops.stats import SpecStats
    from edge_spec.runtime.propose.context import ProposerContext

    rng = np.random.default_rng(seed)
    stats = None if config is None else SpecStats()
    drafters = {} if config is None else {engine.drafter_name(config): engine.bundle.active_drafter(config)}
    context = ProposerContext(engine.bundle.target.vocab_size, drafters)
    tokens = list(loop_tokens(config or ArConfig(), engine.bundle.target, context, prompt_ids, params, rng, n, stats))
    return tokens, stats


def first_tokens(engine, ids, params, spec, n_samples, n_tokens=3, seed_offset=0):
    """Joint samples of the first n_tokens generated tokens (as tuples), one independent seed each."""
    out = []
    for seed in range(seed_offset, seed_offset + n_samples):
        tokens, _ = run(engine, ids, params, n_tokens, spec, seed=seed)
        out.append(tuple(tokens))
    return out


def logit_rows(result: dict) -> np.ndarray:
    """A pass's logits, one row per position it asked for."""
    return result["logits"].reshape(-1, result["logits"].shape[-1])


def greedy_drafts_kept_and_refused(engine, config, prompts=PROMPTS, n: int = 30) -> tuple[int, int]:
    """Assert that greedy decoding with ``config`` gives target-only decoding's tokens for every prompt, in the
    engine's passes as loaded; returns how many drafts were accepted and how many refused (a test of rollback
    wants both)."""
    from edge_spec.runtime.verify.sampling import SamplingParams

    accepted = refused = 0
    for prompt in prompts:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), n, None)
        got, stats = run(engine, ids, SamplingParams(), n, config)
        assert got == reference, (config, prompt)
        accepted += sum(stats.accepted)
        refused += sum(d - a for d, a in zip(stats.drafted, stats.accepted))
    return accepted, refused


def greedy_matches_target_only(engine, config, prompts=PROMPTS, n: int = 40) -> int:
    """Assert that greedy decoding with ``config`` gives target-only decoding's tokens for every prompt (in
    the engine's exact passes), with drafts no longer than its γ; returns how many tokens were drafted."""
    from edge_spec.runtime.verify.sampling import SamplingParams

    engine.bundle.target.min_rows = 2  # the engine's exact passes, as generate sets them
    drafted = 0
    for prompt in prompts:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), n, None)
        got, stats = run(engine, ids, SamplingParams(), n, config)
        assert got == reference, (config, prompt)
        assert max(stats.drafted) <= config.gamma
        drafted += sum(stats.tally(name).drafted for name in config.proposers)
    return drafted


def sampled_matches_target(engine, config, prompt: str = "The quick", n: int = 1500) -> None:
    """Assert that the first tokens sampled (T=1) through ``config`` follow target-only sampling's joint law."""
    from edge_spec.runtime.verify.sampling import SamplingParams

    params = SamplingParams(temperature=1.0)
    ids = engine.bundle.tokenizer.encode(prompt)
    ar = first_tokens(engine, ids, params, None, n)
    spec = first_tokens(engine, ids, params, config, n, seed_offset=10**6)
    assert chi_square_same_distribution(ar, spec) > 1e-3


# ---------------------------------------------------------------------------
# chi-square tests
# ---------------------------------------------------------------------------


def chi2_sf(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution, closed form for integer dof.

    Exact (Abramowitz & Stegun 26.4.4/26.4.5) and dependency-free, so the
    goodness-of-fit tests do not pay ~1.3 s for importing scipy.stats;
    cross-checked against scipy in test_sampling.
    """
    half = stat / 2.0
    if dof % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, dof // 2):
            term *= half / i
            total += term
        return math.exp(-half) * total
    total = math.erfc(math.sqrt(half))
    term = math.sqrt(half) / math.gamma(1.5)
    for i in range(dof // 2):
        total += math.exp(-half) * term
        term *= half / (i + 1.5)
    return total


def chi_square_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Pearson goodness-of-fit p-value of counts against a distribution.

    Cells with zero expected probability are left out of the statistic; a
    count in one of them is impossible under ``probs``, so the p-value is
    then exactly 0.  Expected counts should be >= 5 per cell for validity.
    """
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert observed.shape == probs.shape
    forbidden = probs == 0.0
    if observed[forbidden].sum() > 0:
        return 0.0
    obs, p = observed[~forbidden], probs[~forbidden] / probs[~forbidden].sum()
    expected = obs.sum() * p
    stat = float(((obs - expected) ** 2 / expected).sum())
    return chi2_sf(stat, obs.size - 1)


def chi_square_same_distribution(a: list, b: list) -> float:
    """Two-sample chi-square homogeneity test on categorical samples; returns the p-value."""
    from scipy import stats as scistats

    categories = sorted(set(a) | set(b))
    counts = np.array([[a.count(c) for c in categories], [b.count(c) for c in categories]], dtype=float)
    # pool rare categories so that expected counts are >= 5
    expected_share = counts.sum(0)
    keep = expected_share >= 10
    pooled = np.concatenate([counts[:, keep], counts[:, ~keep].sum(1, keepdims=True)], axis=1)
    pooled = pooled[:, pooled.sum(0) > 0]
    return float(scistats.chi2_contingency(pooled)[1])


class FixedUniform:
    """Stands in for np.random.Generator: random() returns preset values."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self, size: int | None = None) -> float | np.ndarray:
        if size is None:
            return self.values.pop(0)
        return np.array([self.values.pop(0) for _ in range(size)])


# ---------------------------------------------------------------------------
# EAGLE heads
# ---------------------------------------------------------------------------


def tiny_head_config(**changes):
    """An EAGLE-3 head configuration for the tiny target (vocab 384, hidden 64)."""
    import dataclasses

    from edge_spec.export.eagle.model import Eagle3Config

    config = Eagle3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=384,
        draft_vocab_size=96,
        feature_layers=(0, 2, 3),
        max_position_embeddings=512,
    )
    return dataclasses.replace(config, **changes)


def random_head(seed: int = 0, config=None):
    """A head with every weight random (norm gains too) and a non-trivial vocabulary map."""
    import torch

    from edge_spec.export.eagle.model import Eagle3Head

    config = config or tiny_head_config()
    torch.manual_seed(seed)
    head = Eagle3Head(config).eval()
    with torch.no_grad():
        for param in head.parameters():
            if param.ndim == 1:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / np.sqrt(param.shape[1]))
        draft_ids = torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values
        head.d2t.copy_(draft_ids - torch.arange(config.draft_vocab_size))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    return head


def decoder_greedy(decoder, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from a bare decoder: prefill ``prompt``, then one token per pass."""
    logits = decoder.prefill(prompt)["logits"][-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = decoder.forward([out[-1]])["logits"][-1]
    return out


# ---------------------------------------------------------------------------
# a real server
# ---------------------------------------------------------------------------


class LiveServer:
    """``serve``'s app under uvicorn in a thread, on a free loopback port, with ``serve``'s connection
    settings (``settings`` override them, e.g. short deadlines)."""

    def __init__(self, app, **settings) -> None:
        import threading
        import time

        import uvicorn

        from edge_spec.server.serve import listen, server_config

        self.sock = listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", self.port, log_config=None, **settings))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
