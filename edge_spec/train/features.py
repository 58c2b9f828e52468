"""Training data for an EAGLE-3 head: the target's features, collected by teacher-forced target passes.

Sources (items):

* **prompts** - the target answers each prompt of a prompt set greedily (chat template, at most
  ``answer_tokens`` tokens), one token per pass with the plain :class:`Decoder`; every pass also
  gives the features of the row it fed, so the whole answer is collected as it is generated;
* **text** - files the user points at (code and prose), cut into windows of at most ``window``
  tokens, each read in one pass with logits for every row (label = the target's argmax).

Rows.  For a sequence ``s_0 .. s_{M-1}`` fed to the target, position ``p`` gives the features
``f_p`` (residual stream after the feature layers, ``[3H]``), the final-normed hidden state ``h_p``
and greedy choice ``g_p = argmax(logits_p)``.  Row ``t`` of an item stores ``f_t``, the next input
token ``x_{t+1} = s_{t+1}``, the label ``g_{t+1}`` (the target's greedy choice after ``x_{t+1}``:
what the head, reading ``f_t`` and the embedding of ``x_{t+1}``, must predict) and the teacher
hidden state ``h_{t+1}`` (the trainer turns it into the target's distribution over the draft
vocabulary through the target's LM-head rows).  Prompt rows of a chat item carry label -1: they
are attention context for the head (as at run time, where the head reads the prompt's features
too), not training targets; its labelled rows start at the last prompt position, the first one
the head drafts from at run time.

Storage: ``OUT/shards/NNNNN-<kind>.npz`` per item (``features`` fp16 ``[n, 3H]``, ``tokens``
int32 ``[n]``, ``labels`` int32 ``[n]``, ``hidden`` fp16 ``[n, H]``, zero where unlabelled), written
to a temporary name then renamed, and ``OUT/progress.json`` listing the finished items (key,
shard, split, rows): a killed run resumes after the last finished item.  Held-out split by item,
fixed: every ``held_out_every``-th prompt, and every window of every ``held_out_every``-th text file.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from edge_spec.errors import EdgeSpecError
from edge_spec.paths import PACKAGE_DATA
from edge_spec.prompts import as_messages, read_prompt_file
from edge_spec.train.settings import CollectOptions

PROGRESS = "progress.json"
SHARDS = "shards"
HIDDEN_OUTPUT = "hidden_states"
DEFAULT_PROMPTS = PACKAGE_DATA / "train" / "prompts.jsonl"
TEXT_SUFFIXES_SKIPPED = {
    ".pyc",
    ".so",
    ".png",
    ".jpg",
    ".jpeg",
    ".gif",
    ".ico",
    ".pdf",
    ".zip",
    ".whl",
    ".onnx",
    ".data",
    ".npz",
    ".npy",
    ".bin",
    ".safetensors",
    ".pt",
    ".tar",
    ".xz",
    ".bz2",
    ".woff",
    ".ttf",
    ".exe",
    ".dll",
    ".a",
    ".o",
}
FORMAT_VERSION = 1


@dataclass
class Item:
    key: str  # stable identity across runs: what progress.json records
    kind: str  # "prompt" or "text"
    held_out: bool
    messages: list | None = None  # prompt items: chat messages
    ids: list[int] | None = None  # text items: the window's tokens
    category: str = ""


# -- the target graph ----------------------------------------------------------------------------


def add_hidden_output(onnx_path) -> None:
    """Give a decoder graph the ``hidden_states`` output (final-normed hidden states of the last
    ``num_logits`` rows, the LM head's input), in place, graph file only."""
    from edge_spec.files import write_atomic

    path = Path(onnx_path)
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    if any(o.name == HIDDEN_OUTPUT for o in graph.output):
        return
    produced = {name for n in graph.node for name in n.output}
    if "last_hidden" not in produced:
        raise EdgeSpecError(f"{path} is not an edge-spec decoder graph (no last_hidden)")
    hidden = next(init.dims[0] for init in graph.initializer if init.name == "final_norm")
    graph.node.append(helper.make_node("Identity", ["last_hidden"], [HIDDEN_OUTPUT], name="hidden_states/Identity"))
    info = helper.make_tensor_value_info(HIDDEN_OUTPUT, TensorProto.FLOAT, [1, "num_logits", int(hidden)])
    position = next((i for i, o in enumerate(graph.output) if o.name.startswith("present.")), len(graph.output))
    graph.output.insert(position, info)
    write_atomic(path, lambda tmp: onnx.save_model(model, tmp))


def _link_data(source: Path, link: Path) -> None:
    """``link`` = the same file as ``source`` (hard link, else a copy), replaced when stale."""
    if not source.is_file():
        raise EdgeSpecError(f"target weights not found: {source}")
    if link.is_file() and not link.is_symlink():
        a, b = link.stat(), source.stat()
        if (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev) or (a.st_size == b.st_size and a.st_mtime >= b.st_mtime):
            return
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, link)


def prepare_target(bundle_dir, work_dir, layers=None) -> Path:
    """A working copy of the bundle's target graph with the ``features`` (``layers``, default
    SpecForge's) and ``hidden_states`` outputs: ``WORK/target/model.onnx``, its weights a hard
    link to the bundle's data file (ONNX Runtime refuses external data reached through a symlink
    leading out of the model's directory; a copy where a link is impossible).  The bundle itself
    is not touched."""
    from edge_spec.export.eagle.model import add_feature_output, default_feature_layers, feature_layers_of
    from edge_spec.manifest import read_manifest

    bundle_dir, work_dir = Path(bundle_dir), Path(work_dir)
    manifest = read_manifest(bundle_dir)
    source = bundle_dir / manifest["target"]["onnx"]
    layers = tuple(layers or default_feature_layers(int(manifest["target"]["config"]["num_layers"])))
    out_dir = work_dir / "target"
    out_dir.mkdir(parents=True, exist_ok=True)
    graph = out_dir / "model.onnx"
    data = out_dir / (source.name + ".data")
    source_data = source.parent / (source.name + ".data")
    _link_data(source_data, data)
    if not graph.is_file() or graph.stat().st_mtime < source.stat().st_mtime:
        tmp = graph.with_suffix(".onnx.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, graph)
    if feature_layers_of(graph) != layers:
        add_feature_output(graph, layers)
    add_hidden_output(graph)
    return graph


# -- items ---------------------------------------------------------------------------------------


def load_prompt_set(path) -> list[dict]:
    """The prompt set as ``{"category", "messages"}`` records (see :mod:`edge_spec.prompts`)."""
    return [{"category": item["category"], "messages": as_messages(item["prompt"])} for item in read_prompt_file(path)]


def _read_text(path: Path) -> str | None:
    """A file's text, or None for binary / undecodable files (``.gz`` files are decompressed)."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\0" in raw[:8192]:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def text_files(directories) -> list[Path]:
    """Regular text-looking files under ``directories`` (recursively, symlinks not followed), sorted."""
    files: set[Path] = set()
    for directory in directories:
        directory = Path(directory)
        if not directory.is_dir():
            raise EdgeSpecError(f"--text: not a directory: {directory}")
        for root, dirs, names in os.walk(directory):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for name in names:
                path = Path(root) / name
                if path.is_file() and not path.is_symlink() and path.suffix.lower() not in TEXT_SUFFIXES_SKIPPED:
                    files.add(path)
    return sorted(files)


def text_items(directories, tokenizer, options: CollectOptions) -> list[Item]:
    """Windows of the text files, ordered round-robin over the files (in a seeded order): window 0
    of every file, then window 1, ...; so a run cut short still saw many files."""
    files = text_files(directories)
    order = np.random.default_rng(options.seed).permutation(len(files))
    per_file: list[list[Item]] = []
    for rank, index in enumerate(order):
        path = files[index]
        text = _read_text(path)
        if text is None:
            continue
        ids = tokenizer.encode(text)
        held_out = rank % options.held_out_every == options.held_out_every - 1
        digest = hashlib.sha1(text.encode()).hexdigest()[:10]
        windows = []
        for number, start in enumerate(range(0, len(ids), options.window)):
            chunk = ids[start : start + options.window]
            if len(chunk) < 2 or (len(chunk) < options.min_window and start > 0):
                continue
            windows.append(
                Item(key=f"text:{digest}:{number}", kind="text", held_out=held_out, ids=chunk, category=str(path))
            )
        if windows:
            per_file.append(windows)
    items = []
    for depth in range(max((len(w) for w in per_file), default=0)):
        items += [windows[depth] for windows in per_file if depth < len(windows)]
    return items


def prompt_items(prompts: list[dict], options: CollectOptions) -> list[Item]:
    items = []
    for index, prompt in enumerate(prompts):
        digest = hashlib.sha1(json.dumps(prompt["messages"], sort_keys=True).encode()).hexdigest()[:10]
        items.append(
            Item(
                key=f"prompt:{digest}",
                kind="prompt",
                held_out=index % options.held_out_every == options.held_out_every - 1,
                messages=prompt["messages"],
                category=prompt["category"],
            )
        )
    return items


def interleave(*lists: list[Item]) -> list[Item]:
    """One item of each list in turn (the longer lists' tail last), so that a run stopped early
    collected from every source."""
    out = []
    for depth in range(max((len(items) for items in lists), default=0)):
        out += [items[depth] for items in lists if depth < len(items)]
    seen, unique = set(), []
    for item in out:  # a prompt listed twice, or two identical text files, is collected once
        if item.key not in seen:
            seen.add(item.key)
            unique.append(item)
    return unique


# -- progress ------------------------------------------------------------------------------------


@dataclass
class Progress:
    """``progress.json``: the settings the data was collected with and the finished items."""

    settings: dict
    items: dict[str, dict] = field(default_factory=dict)  # key -> {"shard", "split", "rows", "labelled", ...}
    seconds: float = 0.0  # collection wall time over all runs

    @classmethod
    def load(cls, out_dir: Path, settings: dict) -> Progress:
        path = out_dir / PROGRESS
        if not path.is_file():
            return cls(settings)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise EdgeSpecError(f"{path}: invalid JSON ({exc.msg}); delete it to start over") from exc
        if raw.get("settings") != settings:
            changed = sorted(
                k
                for k in set(settings) | set(raw.get("settings", {}))
                if settings.get(k) != raw.get("settings", {}).get(k)
            )
            raise EdgeSpecError(
                f"{out_dir} holds features collected with other settings ({', '.join(changed)}); "
                "use another --work directory"
            )
        return cls(raw["settings"], raw.get("items", {}), float(raw.get("seconds", 0.0)))

    def save(self, out_dir: Path) -> None:
        tmp = out_dir / (PROGRESS + ".tmp")
        tmp.write_text(
            json.dumps(
                {"version": FORMAT_VERSION, "settings": self.settings, "seconds": self.seconds, "items": self.items},
                indent=1,
            )
            + "\n"
        )
        os.replace(tmp, out_dir / PROGRESS)

    def totals(self) -> dict[str, int]:
        out = {"train": 0, "held_out": 0, "items": len(self.items)}
        for record in self.items.values():
            out[record["split"]] += record["labelled"]
        return out


def read_progress(out_dir) -> dict:
    """The raw ``progress.json`` of a collection directory (EdgeSpecError when there is none)."""
    path = Path(out_dir) / PROGRESS
    if not path.is_file():
        raise EdgeSpecError(f"no collected features in {out_dir} (no {PROGRESS}); run without --train-only first")
    return json.loads(path.read_text())


def _write_shard(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        np.savez(handle, **arrays)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _rows(
    features: np.ndarray, fed: list[int], greedy: np.ndarray, hidden: np.ndarray, first_labelled: int
) -> dict[str, np.ndarray]:
    """Shard arrays from one sequence: ``fed`` tokens s_0..s_{M-1}, their features f_0..f_{M-1};
    ``greedy`` / ``hidden`` hold g_p / h_p for p >= first_labelled + 1 (g / h of later positions)."""
    m = len(fed)
    n = m - 1
    labels = np.full(n, -1, np.int32)
    teacher = np.zeros((n, hidden.shape[-1]), np.float16)
    rows = np.arange(first_labelled, n)  # row t: label g_{t+1}
    labels[rows] = greedy
    teacher[rows] = hidden.astype(np.float16)
    return {
        "features": features[:n].astype(np.float16),
        "tokens": np.asarray(fed[1:], np.int32),
        "labels": labels,
        "hidden": teacher,
    }


def collect_prompt(decoder, tokenizer, item: Item, answer_tokens: int) -> tuple[dict[str, np.ndarray], list[int]]:
    """Greedy answer of the target to ``item``'s chat, collecting the features of every row fed.
    Returns the shard arrays and the generated tokens."""
    ids = tokenizer.encode(tokenizer.render_chat(item.messages))
    if len(ids) + answer_tokens + 1 > decoder.capacity:
        ids = ids[-(decoder.capacity - answer_tokens - 1) :]
    decoder.reset()
    out = decoder.prefill(ids, 1)
    features, greedy, hidden = [out["features"]], [], []
    generated = []
    while True:
        token = int(np.argmax(out["logits"][-1]))
        greedy.append(token)
        hidden.append(out["hidden_states"][-1])
        generated.append(token)
        if token in tokenizer.eos_token_ids or len(generated) >= answer_tokens:
            break
        out = decoder.forward([token], 1)
        features.append(out["features"])
    fed = ids + generated[:-1]
    # greedy[k] = g_{P-1+k}: row t = P-2+k has label g_{t+1}; the head drafts from row P-1 on
    arrays = _rows(np.concatenate(features), fed, np.asarray(greedy[1:], np.int32), np.stack(hidden[1:]), len(ids) - 1)
    return arrays, generated


def collect_text(decoder, item: Item) -> dict[str, np.ndarray]:
    """One teacher-forced pass over a text window, logits for every row (labels = argmax)."""
    decoder.reset()
    ids = item.ids
    out = decoder.forward(ids, len(ids))
    greedy = np.argmax(out["logits"], axis=-1).astype(np.int32)
    return _rows(out["features"], ids, greedy[1:], out[HIDDEN_OUTPUT][1:], 0)


Reporter = Callable[[dict], None]


def collect(
    bundle_dir,
    out_dir,
    *,
    prompts=None,
    text_dirs=(),
    options: CollectOptions = CollectOptions(),
    report: Reporter | None = None,
    layers=None,
    should_stop: Callable[[], bool] | None = None,
) -> dict:
    """Collect features for every item not collected yet (see module docstring); returns the
    progress record.  ``report`` gets a dict after each item (done, total, tokens, elapsed, eta).
    ``prompts``: a prompt file (None: the shipped set; "" or False: no prompts)."""
    from edge_spec.manifest import read_manifest
    from edge_spec.runtime.model.decoder import Decoder
    from edge_spec.runtime.text import TextTokenizer

    options.check()
    bundle_dir, out_dir = Path(bundle_dir), Path(out_dir)
    manifest = read_manifest(bundle_dir)
    graph = prepare_target(bundle_dir, out_dir, layers)
    from edge_spec.export.eagle.model import feature_layers_of

    capacity = int(manifest["context_length"])
    if options.window > capacity:  # a window is one pass: it must fit the target's context
        options = dataclasses.replace(options, window=capacity)
    if options.answer_tokens + 2 > capacity:
        raise EdgeSpecError(f"--max-tokens {options.answer_tokens} does not fit the target's context {capacity}")
    tokenizer = TextTokenizer(bundle_dir)
    prompt_list = [] if prompts is False or prompts == "" else load_prompt_set(prompts or DEFAULT_PROMPTS)
    items = interleave(prompt_items(prompt_list, options), text_items(text_dirs, tokenizer, options))
    if options.max_items is not None:
        items = items[: options.max_items]
    if not items:
        raise EdgeSpecError("nothing to collect: no prompts and no text files")
    settings = {
        "target": manifest["target"]["name"],
        "feature_layers": list(feature_layers_of(graph)),
        "hidden_size": int(manifest["target"]["config"]["hidden_size"]),
        "answer_tokens": options.answer_tokens,
        "window": options.window,
    }
    (out_dir / SHARDS).mkdir(parents=True, exist_ok=True)
    progress = Progress.load(out_dir, settings)
    todo = [item for item in items if item.key not in progress.items]
    decoder = Decoder(graph, threads=options.threads, capacity=capacity) if todo else None
    started = time.perf_counter()
    base_seconds = progress.seconds
    done_now, rows_now = 0, 0
    for item in todo:
        if options.time_budget is not None and time.perf_counter() - started >= options.time_budget:
            break
        if should_stop is not None and should_stop():
            break
        if item.kind == "prompt":
            arrays, _ = collect_prompt(decoder, tokenizer, item, options.answer_tokens)
        else:
            arrays = collect_text(decoder, item)
        labelled = _store(out_dir, progress, item, arrays)
        progress.seconds = base_seconds + time.perf_counter() - started
        progress.save(out_dir)
        done_now += 1
        rows_now += labelled
        if report is not None:
            elapsed = time.perf_counter() - started
            run = (done_now, len(todo) - done_now, rows_now, elapsed)
            report(_progress_line(progress, item, labelled, run, options.time_budget))
    return {
        "settings": progress.settings,
        "items": progress.items,
        "seconds": progress.seconds,
        "totals": progress.totals(),
        "pending": len(items) - sum(1 for i in items if i.key in progress.items),
    }


def _store(out_dir: Path, progress: Progress, item, arrays: dict[str, np.ndarray]) -> int:
    """Write one item's shard under a name no earlier shard has and record it; returns its labelled rows."""
    number = len(progress.items)
    name = f"{number:05d}-{item.kind}.npz"
    while (out_dir / SHARDS / name).exists():  # a shard a killed run wrote but never recorded
        number += 1
        name = f"{number:05d}-{item.kind}.npz"
    _write_shard(out_dir / SHARDS / name, arrays)
    labelled = int((arrays["labels"] >= 0).sum())
    progress.items[item.key] = {
        "shard": name,
        "split": "held_out" if item.held_out else "train",
        "kind": item.kind,
        "category": item.category,
        "rows": int(len(arrays["tokens"])),
        "labelled": labelled,
    }
    return labelled


def _progress_line(progress: Progress, item, labelled: int, run: tuple[int, int, int, float], budget) -> dict:
    """What ``collect``'s reporter gets after an item; ``run``: this run's items done and left, labelled rows
    and elapsed seconds; ``budget``: its time budget in seconds (None: none)."""
    done_now, remaining, rows_now, elapsed = run
    eta = elapsed / done_now * remaining
    if budget is not None:
        eta = min(eta, max(budget - elapsed, 0.0))
    return {
        "done": len(progress.items),
        "total": len(progress.items) + remaining,
        "item": item.key,
        "kind": item.kind,
        "labelled": labelled,
        "tokens": progress.totals(),
        "elapsed": elapsed,
        "eta": eta,
        "rate": rows_now / max(elapsed, 1e-9),
    }


def load_shards(out_dir, split: str | None = None) -> list[dict[str, np.ndarray]]:
    """The collected items (``split``: "train", "held_out" or None for both), in collection order."""
    out_dir = Path(out_dir)
    progress = read_progress(out_dir)
    records = sorted(progress["items"].values(), key=lambda r: r["shard"])
    result = []
    for record in records:
        if split is not None and record["split"] != split:
            continue
        with np.load(out_dir / SHARDS / record["shard"]) as data:
            arrays = {name: data[name] for name in data.files}
        arrays["split"] = record["split"]
        arrays["kind"] = record["kind"]
        result.append(arrays)
    return result


__all__ = [
    "CollectOptions",
    "Item",
    "add_hidden_output",
    "collect",
    "collect_prompt",
    "collect_text",
    "interleave",
    "load_prompt_set",
    "load_shards",
    "prepare_target",
    "prompt_items",
    "read_progress",
    "text_items",
]
