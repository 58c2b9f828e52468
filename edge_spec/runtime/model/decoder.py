"""One ONNX decoder (target or drafter) with its KV cache: forward, rollback, nothing else.

KV-cache strategy: **pre-allocated shared past/present buffers bound through
IOBinding** (:mod:`kv_cache`: in host memory, or on the execution provider's
device).  Each layer's key and value live in one OrtValue of shape
``[1, kv_heads, capacity, head_dim]`` allocated once.  Every ``run`` binds that
same OrtValue as the ``past_key_values.*`` input *and* the ``present.*`` output;
GroupQueryAttention detects the shared pointer and writes the new positions in
place.  Nothing is concatenated or copied per step, and rolling the cache back
to an accepted prefix is just truncating ``self.tokens`` (stale slots beyond it
are overwritten by the next call and never attended to, because attention reads
``seqlens_k`` positions only).

Draft trees (multi-draft verification): a target exported with tree inputs
takes a whole :class:`~edge_spec.runtime.model.draft_tree.DraftTree` in one pass;
afterwards :meth:`Decoder.keep_path` moves the accepted path's keys and values
down to consecutive slots, in place -- a few KiB per layer, never the cache.

Batch-invariant numerics (``min_rows=2``): ONNX Runtime's CPU kernels (MLAS SGEMM and the int4/int8
``MatMulNBits`` kernels) have a special one-row path that rounds differently from their multi-row
path, while for two or more rows each row's result is bit-for-bit independent of how many rows share
the call (measured on the exported graphs: any chunking of a sequence into passes of >= 2 tokens gives
identical logits).  With int8 activations (accuracy level 4) that one-row difference grows through the
layers to a few tenths of a logit and flips near-tie argmaxes.  A decoder with ``min_rows=2`` pads every
one-token pass with one throw-away row (its slot lies beyond ``self.tokens``, so it is never attended
to and is overwritten by the next pass): then the logits of every position are a function of the token
sequence alone, whatever the draft lengths were, and greedy speculative decoding reproduces greedy
target-only decoding run the same way bit for bit.  Draft trees keep that only for the first branch:
the nodes of later branches sit at other cache slots than a chain would put them, so attention sums
their terms in another order.

Where only the attention has a one-row path (``MatMulNBits`` is row-invariant on some CPUs, e.g. with
AVX-512 VNNI), a target graph that pads its attention itself (``export.graph.attention_pad``: metadata
``edge_spec.attention_pad``) makes one-row passes exact at the price of one attention row instead of
one row through every matmul (edge-spec's native attention op has no one-query path: a graph whose attention
runs on it is loaded without the pad, which would only cost that row); whether this machine is such a CPU is measured, not assumed
(:mod:`row_invariance`), and exact target-only passes take ``min_rows`` 1 then (speculative ones keep
a second row for the free guess: ``LoadedBundle.pass_rows``).  Such a graph writes its pad row's keys one slot
past the sequence, so its cache has one spare slot.

Interrupting a pass (a cancelled answer): a multi-row pass of a real target takes half a second or more
on a laptop CPU, too long for Stop to wait for.  :meth:`Decoder.interrupt` sets the ``terminate`` flag of
the ``RunOptions`` the running pass was given; ONNX Runtime checks it between nodes and the pass raises
:class:`PassInterrupted`.  Nothing of the decoder changed then: ``self.tokens`` is extended only after a
pass returns, the rows it wrote in place lie past them (never attended to, overwritten by the next pass),
and a tree pass's slots move only in :meth:`Decoder.keep_path`, after it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from edge_spec.defaults import DEFAULT_CONTEXT_LENGTH, DEFAULT_PROVIDER, DEFAULT_THREADS
from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import ROLES
from edge_spec.runtime.latency_curve import latency_at
from edge_spec.runtime.model.attention_unpad import ATTENTION_PAD_KEY, has_attention_pad, strip_attention_pad
from edge_spec.runtime.model.bound_pass import bound_results, run_bound
from edge_spec.runtime.model.draft_tree import DraftTree
from edge_spec.runtime.model.huge_pages import HugePagePromotion
from edge_spec.runtime.model.kv_cache import kv_storage
from edge_spec.runtime.model.last_rows import cut_rows_early
from edge_spec.runtime.model.native_attention import (
    all_attention_native,
    native_library,
    native_matmul_route,
    prompt_path,
    use_half_cache,
    use_native_attention,
)
from edge_spec.runtime.model.providers import open_session
from edge_spec.runtime.model.session import set_spinning

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # tokens per prefill pass: bounds attention scratch, gives progress and a place to cancel
# outputs given for every row fed (not only the last ``num_logits``): the target's hidden states of chosen
# layers, which a feature-level drafter needs for every verified (and every prompt) position
ALL_ROW_OUTPUTS = frozenset({"features"})


class PassInterrupted(Exception):
    """A pass stopped part-way by :meth:`Decoder.interrupt`; the decoder is as it was before the pass."""


def damaged_weights_message(model_path: Path) -> str:
    """What to say when a model of a bundle computes NaN/inf logits (weights damaged past the size check)."""
    model_path = Path(model_path)
    role = model_path.parent.name
    what = f"the {role}" if role in ROLES else str(model_path)  # a bundle's model, by its directory
    return (
        f"{what} produced NaN/inf logits: the bundle's weights are damaged; "
        f"run edge-spec info {model_path.parent.parent} --verify"
    )


@dataclass
class Transfers:
    """Bytes copied between host and device memory by this decoder's bindings (none on the CPU EP).

    Counted from what is bound: host inputs a device EP must upload, outputs fetched to the host, the
    KV cache where it lives in host memory (read in and written back every pass), and slot moves.
    ORT's own copies around nodes that fall back to the CPU EP are not visible here."""

    host_to_device: int = 0
    device_to_host: int = 0
    kv: int = 0  # the part of both that is KV cache
    passes: int = 0

    def reset(self) -> None:
        self.host_to_device = self.device_to_host = self.kv = self.passes = 0


@dataclass
class DecoderStats:
    """Time spent in ORT ``run`` calls, bucketed by number of new tokens (for cost models and reports)."""

    calls: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    recent: dict[int, float] = field(default_factory=dict)  # moving average, first (cold) call left out
    profile: dict[int, float] = field(default_factory=dict)  # latencies profiled at load (see seed)
    prefill_calls: dict[int, int] = field(default_factory=dict)  # the part of calls/seconds spent in prefill
    prefill_seconds: dict[int, float] = field(default_factory=dict)
    costed: dict[int, int] = field(default_factory=dict)  # the calls that are samples of this graph's cost

    def add(self, n_tokens: int, seconds: float, prefill: bool = False, costs: bool = True) -> None:
        """File one pass; ``costs`` False keeps it out of the recent latencies the cost model plans with
        (a pass of another graph: the prompt reader's)."""
        self.calls[n_tokens] = self.calls.get(n_tokens, 0) + 1
        self.seconds[n_tokens] = self.seconds.get(n_tokens, 0.0) + seconds
        if prefill:  # kept apart too, so that reports can leave prompt processing out exactly
            self.prefill_calls[n_tokens] = self.prefill_calls.get(n_tokens, 0) + 1
            self.prefill_seconds[n_tokens] = self.prefill_seconds.get(n_tokens, 0.0) + seconds
        if not costs:
            return
        self.costed[n_tokens] = self.costed.get(n_tokens, 0) + 1
        if self.costed[n_tokens] == 2:
            self.recent[n_tokens] = seconds  # the first (cold) call is left out; a profiled seed is replaced
        elif self.costed[n_tokens] > 2:
            self.recent[n_tokens] = 0.8 * self.recent[n_tokens] + 0.2 * seconds

    def seed(self, n_tokens: int, seconds: float) -> None:
        """Use a profiled latency until calls of this size have been measured."""
        self.recent[n_tokens] = self.profile[n_tokens] = seconds

    def _measured(self, n_tokens: int) -> bool:
        return self.costed.get(n_tokens, 0) >= 2

    def recent_seconds(self, max_tokens: int = 16) -> dict[int, float]:
        """Recent latency per number of new tokens (decode-sized calls seen at least twice).

        Profiled sizes not measured since follow the measured ones: when other load slows the machine
        down, a 2-row pass measured now and a 3-row pass profiled at load time must not be compared as
        they are, or longer drafts look cheap.  A size between two measured ones lies on the straight line
        between their live latencies; one past the largest measured size is scaled by how far the measured
        ones moved from their profile (median ratio), or, where that is less, priced at the largest
        measured size below it plus the profile's step between the two; one below every measured size is
        scaled so too, but never priced above the next measured size (after a long prompt a multi-row pass
        pays each row's attention, which a one-row pass pays once).  Erring high is the error live passes never
        correct: a size priced too dear is one the schedule stops drafting rounds for, so its passes
        never run and never show its price (a cost per pass the profile's passes did not pay made two
        and three rows 20% dearer live than profiled, scaled every larger size alike, and held rounds
        at two drafts); priced a little low, it is tried, and a couple of its passes set its price."""
        measured = {n: self.recent[n] for n, t in self.profile.items() if self._measured(n) and t > 0}
        ratios = sorted(measured[n] / self.profile[n] for n in measured)
        scale = ratios[len(ratios) // 2] if ratios else 1.0
        out = {}
        for n, t in self.recent.items():
            if n > max_tokens:
                continue
            if self._measured(n):
                out[n] = t
                continue
            below = max((m for m in measured if m < n), default=None)
            if below is not None and any(m > n for m in measured):
                out[n] = latency_at(measured, n)
            elif below is not None and n in self.profile:
                out[n] = min(t * scale, measured[below] + max(self.profile[n] - self.profile[below], 0.0))
            else:  # below every measured size: never dearer than the next one up, which reads the same weights
                out[n] = min([t * scale, *(measured[m] for m in measured if m > n)])
        return out


def _session_options(given: ort.SessionOptions | None, threads: int, takes_turns: bool) -> ort.SessionOptions:
    """``given`` (or new options) set up as every decoder session runs: all graph optimizations, ``threads``
    intra-op threads, spinning only where the decoder does not alternate with another on the same cores."""
    opts = given or ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    set_spinning(opts, takes_turns)  # target and drafter alternate on the same cores
    return opts


def _load_as_lean(graph: onnx.ModelProto, model_path: Path, why: str, opts: ort.SessionOptions) -> list[ort.OrtValue]:
    """Rewrite a ``native``-layout ``graph`` (in place) into the ``lean`` layout's form and hand ORT its new
    weights from memory; returns them, to be kept as long as the session.  The exporter's own layout code
    does it (:mod:`edge_spec.export.gguf.native_to_lean`), so the graph is the one ``--gguf-layout lean``
    exports; it is imported here only, as the one path from the runtime into the exporter."""
    from edge_spec.export.gguf.native_to_lean import rewrite_as_lean

    start = time.perf_counter()
    arrays = rewrite_as_lean(graph, model_path.parent)
    values = [ort.OrtValue.ortvalue_from_numpy(array) for array in arrays.values()]
    opts.add_external_initializers(list(arrays), values)
    log.warning(
        "%s: %s; GGUF's blocks were converted to ONNX Runtime's MatMulNBits in %.1f s (at each load: "
        "--gguf-layout lean exports that form)",
        model_path,
        why,
        time.perf_counter() - start,
    )
    return values


class Decoder:
    """An ORT session over a decoder exported by ``edge_spec.export`` plus its KV cache."""

    def __init__(
        self,
        model_path: Path,
        *,
        provider: str = DEFAULT_PROVIDER,
        threads: int = DEFAULT_THREADS,
        capacity: int = DEFAULT_CONTEXT_LENGTH,
        session_options: ort.SessionOptions | None = None,
        takes_turns: bool = False,
        min_rows: int = 1,
        provider_options: dict[str, str] | None = None,
        kv_device: str | None = None,
        attention_pad: bool | None = None,
        native_attention: bool = True,
        prompt_graph: Path | None = None,
        half_cache: bool | None = None,
    ) -> None:
        """``provider_options`` go to the execution provider as they are (e.g. ``device_id``);
        ``kv_device`` overrides where the KV cache lives (default: the provider's device when ORT can
        allocate there, else host memory; see :mod:`kv_cache`); ``attention_pad`` False loads a graph
        that pads its attention without that pad (:mod:`attention_unpad`), True keeps it, None (the default) keeps it
        only where ORT's attention op runs (the native op has no one-query path for it to avoid);
        ``native_attention`` False keeps ORT's own attention op where the native one would replace it
        (:mod:`native_attention`; ``EDGE_SPEC_NATIVE_ATTENTION=0`` does the same for every decoder);
        ``prompt_graph``: a graph that reads prompts (:meth:`prefill`) in this one's place, into the same
        cache (``export.graph.prompt_reader``: int8 matmuls, several times faster on long prompts);
        ``half_cache`` False keeps the key/value cache in float32 where the native attention op would keep it in
        float16 (:func:`native_attention.use_half_cache`; None, the default: float16 for a quantized graph whose
        every attention node runs on the native op, its cache in host memory and no prompt graph sharing it; a
        float32 export, the reference against transformers, keeps a float32 cache; ``EDGE_SPEC_HALF_CACHE=0``
        keeps float32 for every decoder)."""
        model_path = Path(model_path)
        self.model_path = model_path
        if not model_path.is_file():
            raise EdgeSpecError(f"model file not found: {model_path}")
        self.huge_pages = HugePagePromotion()  # what the session and the cache allocate goes to 2 MiB pages
        self._lean_weights: list[ort.OrtValue] = []  # what lean-form graphs read from memory (_load_as_lean)
        if half_cache is None:
            half_cache = (
                prompt_graph is None
                and kv_device in (None, "host")
                and os.environ.get("EDGE_SPEC_HALF_CACHE", "1") != "0"
            )
        self.session, self.attention_pad_removed, self.native_attention, self.half_cache = self._open(
            model_path,
            _session_options(session_options, threads, takes_turns),
            provider,
            provider_options,
            attention_pad,
            native_attention,
            half_cache=half_cache,
        )
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        kv_inputs = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.num_layers = len(kv_inputs) // 2
        _, kv_heads, _, head_dim = kv_inputs[0].shape
        self.capacity = capacity
        self.pads_attention = self.session.get_modelmeta().custom_metadata_map.get(ATTENTION_PAD_KEY) == "1"
        self.min_rows = min_rows  # 2: pad one-token passes so every pass takes the multi-row kernels
        # fewer rows a pass may have and stay exact, where min_rows is kept higher for another reason (a
        # speculative pass's spare row for the free guess); None: min_rows.  ``forward(lean=True)`` uses it.
        self.lean_rows: int | None = None
        self.prefill_chunk = PREFILL_CHUNK  # most tokens per prefill pass (see prefill)
        self.prefill_listener: Callable[[int, int], None] | None = None  # (tokens read, prompt tokens)
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.vocab_size = int(outputs["logits"].shape[-1]) if "logits" in outputs else 0
        self.tokens: list[int] = []  # ids whose keys/values are in the cache, in order
        self.stats = DecoderStats()
        self.transfers = Transfers()
        self.on_device = provider.lower() != "cpu"  # inputs bound from host memory cross the bus
        # the attention pad row's keys go one slot past the sequence (kept where the pad was stripped: a prompt
        # graph sharing the cache may still carry it)
        slots = capacity + int(self.pads_attention or self.attention_pad_removed)
        self.kv = kv_storage(
            provider, (1, kv_heads, slots, head_dim), 2 * self.num_layers, kv_device, provider_options, self.half_cache
        )
        self.supports_tree = {"position_ids", "attention_bias"} <= self.input_names
        self._binding = self.session.io_binding()
        # results are bound first so that get_outputs()[i] is result i (re-binding keeps the slot)
        self._result_names = [n for n in self.output_names if not n.startswith("present.")]
        for name in self._result_names:
            self._binding.bind_output(name, "cpu")
        self.kv.bind(self._binding, self.num_layers)
        # interrupting a running pass (see "interrupting a pass"): its run options, whether a pass runs now
        # (both under the lock, so that an interrupt arriving late cannot stop the next pass), and a check
        # that refuses a pass about to start (an interrupt that came just before it)
        self._run_options = ort.RunOptions()
        self._pass_lock = threading.Lock()
        self._running = False
        self.stop_requested: Callable[[], bool] | None = None
        self.huge_pages.start()
        # after the promotion started: a prompt pass is bound by arithmetic, not by page walks, and promoting
        # its weights too costs seconds of both cores while the first prompt is read.  Its attention is the
        # native op's prompt path where this CPU has one (bfloat16 products over each row's causal window),
        # else ORT's: over many rows that is faster than the native one-row kernels
        self.prompt_session: ort.InferenceSession | None = None
        self._prompt_binding: ort.IOBinding | None = None
        if prompt_graph is not None:
            self.prompt_session, _, _, _ = self._open(
                Path(prompt_graph),
                _session_options(None, threads, takes_turns),
                provider,
                provider_options,
                attention_pad,
                native_attention,
                prompt=True,
            )
            self._prompt_binding = self._prompt_reader_binding(self.prompt_session)

    def _open(
        self,
        model_path: Path,
        opts: ort.SessionOptions,
        provider: str,
        provider_options: dict[str, str] | None,
        attention_pad: bool | None,
        native_attention: bool,
        prompt: bool = False,
        half_cache: bool = False,
    ) -> tuple[ort.InferenceSession, bool, bool, bool]:
        """(the ORT session of ``model_path``, whether its attention pad was removed, whether all its attention
        runs on the native op, whether its cache is float16), its graph first rewritten where asked (attention
        pad removed, the native attention op in ORT's place; for a ``prompt`` graph only where the op has a
        prompt path here; the cache typed float16 where ``half_cache`` and the op allow it; the last layer's
        tail cut to the rows whose logits are asked where its matmuls are native: :mod:`last_rows`); a graph
        ORT cannot load is one line."""
        model: str | bytes = str(model_path)
        pad_removed = native = half = False
        library = native_library(provider) if native_attention else None
        if prompt and library is not None and not prompt_path(library):
            library = None
        try:
            graph = onnx.load(str(model_path), load_external_data=False)
        except Exception:  # noqa: BLE001  (a damaged graph: ORT's own load below says so in one line)
            graph = None
        if graph is not None:
            register, why_not_native = native_matmul_route(graph, provider)
            native_matmuls = register is not None
            if why_not_native:
                self._lean_weights.extend(_load_as_lean(graph, model_path, why_not_native, opts))
            if library is not None and use_native_attention(graph, bf16_products=prompt):
                register = library
            native = all_attention_native(graph)
            keep_pad = not native if attention_pad is None else attention_pad
            if not keep_pad and has_attention_pad(graph):
                strip_attention_pad(graph)
                pad_removed = True
            cut_early = native_matmuls and cut_rows_early(graph) > 0
            half = half_cache and native and use_half_cache(graph, opts.intra_op_num_threads or os.cpu_count() or 1)
            if register is not None:
                opts.register_custom_ops_library(str(register))
            if pad_removed or native or why_not_native or cut_early:
                model = graph.SerializeToString()
                # the weights stay in their file beside the graph, found from there
                opts.add_session_config_entry(
                    "session.model_external_initializers_file_folder_path", str(model_path.parent)
                )
        try:
            return open_session(model, opts, provider, provider_options), pad_removed, native, half
        except EdgeSpecError:
            raise
        except Exception as exc:  # ORT raises bare RuntimeError / Fail / InvalidProtobuf
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EdgeSpecError(f"cannot load {model_path}: {first[:300]}") from exc

    def _prompt_reader_binding(self, session: ort.InferenceSession) -> ort.IOBinding:
        """The prompt graph's binding: the same results and the same cache buffers as the decode graph's,
        refused unless its inputs and outputs are the decode graph's."""
        signature = ({i.name for i in session.get_inputs()}, [o.name for o in session.get_outputs()])
        if signature != (self.input_names, self.output_names):
            raise EdgeSpecError(
                f"{self.model_path.parent / 'prompt.onnx'} does not match {self.model_path.name}'s inputs and "
                "outputs: re-export the bundle"
            )
        binding = session.io_binding()
        for name in self._result_names:
            binding.bind_output(name, "cpu")
        self.kv.bind(binding, self.num_layers)
        return binding

    def __del__(self) -> None:
        """Free the cache's device buffers (and the binding that holds them) before the session: on WebGPU a
        buffer freed after its device's last session closed crashes the process, and attribute order would
        drop the session first."""
        self.__dict__.pop("_binding", None)
        self.__dict__.pop("_prompt_binding", None)
        self.__dict__.pop("kv", None)
        for session in ("session", "prompt_session"):  # before the weights a lean-form graph reads from memory
            self.__dict__.pop(session, None)

    @property
    def one_row_attention_exact(self) -> bool:
        """Whether a one-row pass's attention rounds as a multi-row pass's does: the graph pads its attention,
        or all of it runs on the native op, which has no one-query path, whether or not the graph had a pad
        (then only the matmuls decide whether one-row passes are exact: :mod:`row_invariance` checks)."""
        return self.pads_attention or self.native_attention

    @property
    def exact_rows(self) -> int:
        """The fewest rows of a pass that keeps the logits batch-invariant here."""
        return self.min_rows if self.lean_rows is None else min(self.lean_rows, self.min_rows)

    def forward(
        self,
        token_ids,
        num_logits: int = 1,
        tree: DraftTree | None = None,
        prefill: bool = False,
        inputs: dict[str, np.ndarray] | None = None,
        lean: bool = False,
    ) -> dict[str, np.ndarray]:
        """Append ``token_ids`` to the cache and return outputs for the last ``num_logits`` positions.

        With ``tree`` the tokens are that tree's nodes (``tree.tokens``), attended as a tree; call
        :meth:`keep_path` afterwards.  Returns a dict with ``logits`` [num_logits, V] and/or
        ``hidden_states`` [num_logits, H], and ``features`` [len(token_ids), F] (every row fed) when the
        graph has them.  ``prefill`` only files the pass's time under prompt processing in :attr:`stats`.
        ``inputs`` are further per-row graph inputs ([rows, ...] each, e.g. a drafter head's embeddings
        and hidden states, where ``token_ids`` only keep the cache's bookkeeping).  ``lean`` pads only to
        :attr:`exact_rows`.
        """
        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, -1)
        n = ids.shape[1]
        past = len(self.tokens)
        if past + n > self.capacity:
            raise EdgeSpecError(f"context full: {past + n} tokens exceed the context length {self.capacity}")
        least = self.exact_rows if lean else self.min_rows
        pad = max(least - n, 0) if tree is None and past + least <= self.capacity else 0
        if pad:  # throw-away rows repeating the last token: see "batch-invariant numerics" above
            ids = np.concatenate([ids, np.repeat(ids[:, -1:], pad, axis=1)], axis=1)
        rows = n + pad
        total = past + rows
        feeds: dict[str, np.ndarray] = {}
        if "input_ids" in self.input_names:
            feeds["input_ids"] = ids
        for name, rows_in in (inputs or {}).items():
            feeds[name] = np.ascontiguousarray(rows_in[None])
        feeds["seqlens_k"] = np.array([total - 1], np.int32)
        feeds["total_sequence_length"] = np.array(total, np.int32)
        wanted = min(num_logits, n)
        feeds["num_logits"] = np.array([wanted + pad], np.int64)
        if tree is not None and not self.supports_tree:
            raise EdgeSpecError(
                "this target graph has no tree-attention inputs (position_ids, attention_bias); "
                "re-export the bundle with this edge-spec version for multi-draft decoding"
            )
        if self.supports_tree:
            if tree is not None and tree.size != n:
                raise ValueError(f"tree has {tree.size} nodes but {n} tokens were fed")
            positions = tree.positions(past) if tree is not None else np.arange(past, total, dtype=np.int64)
            bias = tree.attention_bias(past) if tree is not None else np.zeros((rows, total), np.float32)
            feeds["position_ids"] = positions.reshape(1, rows)
            feeds["attention_bias"] = bias.reshape(1, 1, rows, total)
        by_reader = prefill and self.prompt_session is not None
        b = self._prompt_binding if by_reader else self._binding
        for name, array in feeds.items():
            b.bind_cpu_input(name, array)
        for name in self._result_names:
            b.bind_output(name, "cpu")
        start = time.perf_counter()
        self._run(b, self.prompt_session if by_reader else self.session)
        # no sample of what the schedule prices (a verify pass of this many rows): a prompt graph's pass costs
        # what another kernel costs, and a prompt pass returns one row's logits (``last_rows``: the last
        # layer's tail runs on that row alone), 3-13% cheaper over 5-16 rows (Zen 5 EPYC)
        self.stats.add(rows, time.perf_counter() - start, prefill, costs=not (by_reader or prefill))
        self.tokens.extend(int(t) for t in ids[0, :n])
        results = bound_results(b, len(self._result_names))  # bound first: the present buffers stay put
        if self.on_device:
            self._count(sum(a.nbytes for a in feeds.values()), sum(a.nbytes for a in results))
        return {
            name: results[i][0, : n if name in ALL_ROW_OUTPUTS else wanted] for i, name in enumerate(self._result_names)
        }

    def interrupt(self) -> None:
        """Cut the pass running now (from any thread): it raises :class:`PassInterrupted` within a node
        of the graph.  With no pass running this does nothing; a pass about to start is refused by
        :attr:`stop_requested` instead, which the caller sets before calling this."""
        with self._pass_lock:
            if self._running:
                self._run_options.terminate = True

    def _run(self, binding: ort.IOBinding, session: ort.InferenceSession) -> None:
        """One ONNX Runtime pass of ``session`` that :meth:`interrupt` can cut."""
        with self._pass_lock:
            if self.stop_requested is not None and self.stop_requested():
                raise PassInterrupted(f"pass of {self.model_path.parent.name} refused: stop requested")
            self._run_options.terminate = False
            self._running = True
        cut = False
        try:
            run_bound(session, binding, self._run_options)
        except Exception:  # ORT raises bare RuntimeError / Fail, an interrupted pass too
            cut = self._run_options.terminate
            if not cut:
                raise
        finally:
            with self._pass_lock:
                self._running = False
                self._run_options.terminate = False
        if cut:
            raise PassInterrupted(f"pass of {self.model_path.parent.name} interrupted")

    def _count(self, uploaded: int, fetched: int) -> None:
        """File one pass's host<->device copies in :attr:`transfers` (the cache's own, where it is on
        the host, in both directions)."""
        t, kv = self.transfers, self.kv.crosses_per_pass
        t.host_to_device += uploaded + kv // 2
        t.device_to_host += fetched + kv // 2
        t.kv += kv
        t.passes += 1

    def keep_path(self, start: int, nodes: list[int]) -> None:
        """After a tree pass whose nodes were appended at ``start``: keep only ``nodes`` (pass-order
        indices, ascending, root first), moved down to consecutive slots; forget the rest."""
        if any(b <= a for a, b in zip(nodes, nodes[1:])) or (
            nodes and not 0 <= nodes[0] <= nodes[-1] < self.length - start
        ):
            raise ValueError(f"cannot keep nodes {nodes} of the {self.length - start} fed at {start}")
        moved = [(start + d, start + n) for d, n in enumerate(nodes) if n != d]
        if moved:
            self.kv.move_slots(*(list(slots) for slots in zip(*moved)))
            if self.on_device:
                self.transfers.host_to_device += self.kv.last_move_bytes
        kept = [self.tokens[start + n] for n in nodes]
        del self.tokens[start:]
        self.tokens.extend(kept)

    def recent_seconds(self) -> dict[int, float]:
        """Recent latency per number of new tokens (the cost model of the γ policy); fewer tokens than
        :attr:`exact_rows` cost what the padded pass costs.  Between it and ``min_rows`` a pass runs
        lean (a round without drafts or guess), so those sizes keep their own price."""
        seconds = self.stats.recent_seconds()
        rows = self.exact_rows
        for n in range(1, rows):
            if rows in seconds:
                seconds[n] = seconds[rows]
        return seconds

    @property
    def length(self) -> int:
        return len(self.tokens)

    def rewind(self, length: int) -> None:
        """Forget every position from ``length`` on (O(1): see module docstring)."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot rewind to {length}; cache holds {len(self.tokens)}")
        del self.tokens[length:]

    def sync(self, ids: list[int]) -> list[int]:
        """Cut the cache to its longest common prefix with ``ids`` and return the suffix still to feed.

        At least one token is always left to feed, so that the next forward has logits to return.
        """
        common = self.reusable(ids)
        self.rewind(common)
        return ids[common:]

    def reusable(self, ids: list[int]) -> int:
        """How many of ``ids``' first tokens the cache holds and :meth:`sync` keeps (all but the last at most)."""
        if not ids:
            raise EdgeSpecError("empty prompt")
        limit = min(len(self.tokens), len(ids) - 1)
        if self.tokens[:limit] == ids[:limit]:  # the usual case, compared in C: the cache is a prefix
            return limit
        common = 0
        while self.tokens[common] == ids[common]:
            common += 1
        return common

    def prefill(self, prompt_ids: list[int], num_logits: int = 1) -> dict[str, np.ndarray]:
        """Make the cache hold exactly ``prompt_ids``, reusing the longest cached prefix
        (a chat turn re-sends the whole conversation; only the new suffix is computed).

        The suffix goes in passes of at most ``prefill_chunk`` tokens.  Attention's scratch grows with
        rows × context per head: a 4000-token prompt read in one pass by the 1.5B target peaks 0.85 GiB
        higher than in passes of 512 tokens, and is no faster (``benchmarks/long_prefill.py``).  Such
        a prompt also takes minutes on a laptop CPU, so it should report progress and be cancellable
        between passes: ``prefill_listener(done, total)`` is called after each pass when there are
        several, and an exception it raises stops the prefill with the cache holding what was read.
        Passes of two or more rows give the same logits bit for bit however they are cut (see
        "batch-invariant numerics"), so the last pass is never left with a lone token.
        """
        todo = self.sync(prompt_ids)
        last = max(self.prefill_chunk, num_logits)
        done = 0
        every_row: dict[str, list[np.ndarray]] = {}  # outputs of all rows, pass by pass
        while len(todo) - done > last + 1:
            result = self.forward(todo[done : done + self.prefill_chunk], 1, prefill=True)
            for name in ALL_ROW_OUTPUTS & result.keys():
                every_row.setdefault(name, []).append(result[name])
            done += self.prefill_chunk
            if self.prefill_listener is not None:
                self.prefill_listener(done, len(todo))
        result = self.forward(todo[done:], num_logits, prefill=True)
        if "logits" in result and not np.isfinite(result["logits"]).all():  # one cheap look per prompt
            raise EdgeSpecError(damaged_weights_message(self.model_path))
        for name, parts in every_row.items():  # rows of the positions computed now (a reused prefix has none)
            result[name] = np.concatenate(parts + [result[name]])
        if done and self.prefill_listener is not None:
            self.prefill_listener(len(todo), len(todo))
        return result

    def reset(self) -> None:
        self.tokens.clear()
