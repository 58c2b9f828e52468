"""A GGUF file's header read once per load, and fast.

transformers and the exporter open a GGUF file seven times a load (the file check, the config three
times, the tokenizer, the weights, the block carrier), and each opening walks the header: for a
151k-token vocabulary that is two arrays of 151k strings, each string two numpy views made through
``np.memmap``'s Python-level ``__getitem__`` and ``__array_finalize__`` (about 14 s a parse on a laptop
core).  transformers then converts the parsed fields into Python values four times (about 2 s each), and
builds gguf's tensor-name map once per module of the model (371 times for a 28-layer model, 37 ms each).

:func:`parsed_once` makes every one of those the same work done once, and the one parse about five
times cheaper: the reader takes its views from a plain ``ndarray`` over the same mapping (the memmap's
subclass machinery does nothing a reader needs) and walks arrays of strings with one integer read per
string.  The fields, their parts and their dtypes are exactly gguf's own (a test compares them); where
the file is not in this machine's byte order, gguf's own code reads it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

_U64 = np.dtype(np.uint64)
_NATIVE_ORDERS = ("=", "I")  # no byte swap: gguf's "I" (as in the file, which is in this machine's order)
_STRING, _ARRAY = 8, 9  # gguf's GGUFValueType.STRING and .ARRAY


class FastParsing:
    """A mixin for ``gguf.GGUFReader`` (or a subclass of it) that parses the same fields, faster."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:  # the same bytes as self.data (the mapping), without memmap's per-view hooks
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dtype = np.dtype(dtype)
        array = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return array if order in _NATIVE_ORDERS else array.view(dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != _ARRAY or self.byte_order not in _NATIVE_ORDERS or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        if item_type[0] != _STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        from gguf import GGUFValueType

        length = self._get(orig_offs + 4, np.uint64)
        parts: list[np.ndarray] = [item_type, length]
        plain, offset = self._plain, orig_offs + 12
        raw = memoryview(plain)
        for _ in range(int(length[0])):  # each string: its uint64 length, then its bytes (gguf's parts)
            size = int.from_bytes(raw[offset : offset + 8], "little")
            parts.append(plain[offset : offset + 8].view(_U64))
            parts.append(plain[offset + 8 : offset + 8 + size])
            offset += 8 + size
        data_indices = list(range(3, len(parts), 2))
        return offset - orig_offs, parts, data_indices, [GGUFValueType.ARRAY, GGUFValueType.STRING]


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within it, every ``gguf.GGUFReader`` of one file is the same (fast) reader, transformers' header
    conversion (``load_gguf_checkpoint`` without tensors) is done once a file, and gguf's tensor-name map
    once an architecture and depth.  Readers only read (a read-only mapping) and each caller gets its own
    copy of the converted header, so sharing changes nothing but the time."""
    try:
        import gguf
    except ImportError:
        yield
        return
    with ExitStack() as stack:
        original = gguf.GGUFReader
        fast = type("FastGGUFReader", (FastParsing, original), {})
        readers: dict[tuple[str, str], object] = {}

        def shared(path, mode: str = "r"):
            key = (str(Path(path).resolve()), mode)
            if key not in readers:
                readers[key] = fast(path, mode)
            return readers[key]

        stack.enter_context(_patched(gguf, "GGUFReader", shared))
        stack.enter_context(
            _patched(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        )
        _convert_headers_once(stack)
        yield


def _convert_headers_once(stack: ExitStack) -> None:
    """transformers' ``load_gguf_checkpoint(path)`` (the header's config and tokenizer as Python values),
    remembered per file wherever transformers has imported it by name."""
    try:  # the modules that import it by name (others import it from gguf_utils when they call it)
        from transformers import configuration_utils, tokenization_utils_fast
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.models.auto import tokenization_auto
    except ImportError:
        return
    original = gguf_utils.load_gguf_checkpoint
    converted: dict[str, dict] = {}

    @functools.wraps(original)
    def remembered(gguf_checkpoint_path, return_tensors=False, model_to_load=None):
        if return_tensors or model_to_load is not None:
            return original(gguf_checkpoint_path, return_tensors=return_tensors, model_to_load=model_to_load)
        key = str(Path(gguf_checkpoint_path).resolve())
        if key not in converted:
            converted[key] = original(gguf_checkpoint_path)
        return _copied(converted[key])  # callers pop and rewrite keys of what they get

    for module in (gguf_utils, configuration_utils, tokenization_utils_fast, tokenization_auto):
        if getattr(module, "load_gguf_checkpoint", None) is original:
            stack.enter_context(_patched(module, "load_gguf_checkpoint", remembered))


def _copied(value):
    """``value``'s dicts and lists anew, their strings and numbers shared (``copy.deepcopy`` of a 151k-entry
    vocabulary spends its time in its memo)."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) if isinstance(item, (dict, list)) else item for item in value]
    return value


@contextmanager
def _patched(owner, name: str, value) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)
