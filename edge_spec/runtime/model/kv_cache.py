"""Where a decoder's KV cache lives: the storage strategy behind ``Decoder`` (the device seam).

Each layer's key and value live in one buffer of shape ``[1, kv_heads, capacity, head_dim]``,
allocated once and bound as both the ``past_key_values.*`` input and the ``present.*`` output of
every pass (GroupQueryAttention writes the new positions in place).  Rolling back is the decoder's
token count alone; only a tree pass needs slots moved (``move_slots``), to compact the accepted path.

* :class:`HostKV` -- numpy arrays wrapped without a copy: the CPU execution provider reads them in
  place and a tree's path is compacted in numpy.  On a GPU execution provider ORT would copy every
  buffer to the device and back on every pass, which :attr:`crosses_per_pass` reports.
* :class:`DeviceKV` -- ``OrtValue``s in the execution provider's device memory (CUDA, DirectML,
  WebGPU), so a pass never moves the cache over the bus; slots move on the device too
  (:mod:`device_ops`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnxruntime as ort

from edge_spec.runtime.model.device_ops import SlotMover, zeros_on_device

# execution providers whose device memory holds the cache, and the device name ORT's binding API uses;
# ORT's Python API allocates directly only in CUDA and DirectML memory, the others through their EP
DEVICE_OF_PROVIDER = {"cuda": "cuda", "directml": "dml", "webgpu": "webgpu"}
DIRECTLY_ALLOCATED = frozenset({"cpu", "cuda", "dml"})


class KVStorage(Protocol):
    device: str
    crosses_per_pass: int  # bytes a pass copies between host and device because of where the cache is
    last_move_bytes: int  # host bytes the last ``move_slots`` sent or fetched

    def bind(self, binding: ort.IOBinding, num_layers: int) -> None:
        """Bind layer l's buffers as ``past_key_values.l.*`` and ``present.l.*``."""

    def move_slots(self, dst: list[int], src: list[int]) -> None:
        """Copy the keys and values at slots ``src`` to slots ``dst`` in every layer."""


class HostKV:
    device = "cpu"
    last_move_bytes = 0

    def __init__(
        self, shape: tuple[int, int, int, int], buffers: int, on_device_ep: bool = False, dtype=np.float32
    ) -> None:
        # the OrtValues wrap these arrays without copying, so slots can be moved in numpy
        self.arrays = [np.zeros(shape, dtype) for _ in range(buffers)]
        self.values = [ort.OrtValue.ortvalue_from_numpy(array) for array in self.arrays]
        # a device EP reads every past buffer in and writes every present buffer back
        self.crosses_per_pass = 2 * sum(a.nbytes for a in self.arrays) if on_device_ep else 0

    def bind(self, binding: ort.IOBinding, num_layers: int) -> None:
        _bind(binding, num_layers, self.values)

    def move_slots(self, dst: list[int], src: list[int]) -> None:
        for array in self.arrays:
            array[:, :, dst] = array[:, :, src]


class DeviceKV:
    crosses_per_pass = 0

    def __init__(self, values: list[ort.OrtValue], device: str, mover: SlotMover) -> None:
        self.device = device
        self.values = values
        self.mover = mover
        self.last_move_bytes = 0

    def bind(self, binding: ort.IOBinding, num_layers: int) -> None:
        _bind(binding, num_layers, self.values)

    def move_slots(self, dst: list[int], src: list[int]) -> None:
        self.mover.move(self.values, dst, src)
        self.last_move_bytes = self.mover.host_bytes


def kv_storage(
    provider: str,
    shape: tuple[int, int, int, int],
    buffers: int,
    device: str | None = None,
    provider_options: dict[str, str] | None = None,
    half: bool = False,
) -> KVStorage:
    """The storage for a decoder on ``provider``: on its device where it has one, else host memory
    (``device`` overrides: "host" gives numpy buffers on any provider, "cpu" device-style OrtValues in
    host memory; both for tests and measurements).  ``half``: float16 buffers, for the native attention
    op's float16 cache (CPU, host memory)."""
    provider = provider.lower()
    device = device or DEVICE_OF_PROVIDER.get(provider)
    if half:
        if provider != "cpu" or device not in (None, "host"):
            raise ValueError("a float16 cache is the CPU's native attention op's, in host memory")
        return HostKV(shape, buffers, dtype=np.float16)
    if device in (None, "host"):
        return HostKV(shape, buffers, on_device_ep=provider != "cpu")
    ep = "cpu" if device == "cpu" else provider
    options = provider_options if ep == provider else None
    device_id = int((options or {}).get("device_id", 0))
    if device in DIRECTLY_ALLOCATED:
        values = [
            ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, device, device_id)
            for _ in range(buffers)
        ]
    else:
        values = zeros_on_device(ep, options, shape, buffers, device)
    return DeviceKV(values, device, SlotMover(ep, options, buffers, shape[1], shape[3]))


def _bind(binding: ort.IOBinding, num_layers: int, values: list[ort.OrtValue]) -> None:
    for layer in range(num_layers):
        for j, kind in enumerate(("key", "value")):
            value = values[2 * layer + j]
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", value)
