"""Where a decoder's KV cache lives: the storage strategy behind ``Decoder`` (the device seam).

Each layer's key and value live in one buffer of shape ``[1, kv_heads, capacity, head_dim]``,
allocated once and bound as both the ``past_key_values.*`` input and the ``present.*`` output of
every pass (GroupQueryAttention writes the new positions in place).  Rolling back is the decoder's
token count alone; only a tree pass needs slots moved (``move_slots``), to compact the accepted path.

* :class:`HostKV` -- numpy arrays wrapped without a copy: the CPU execution provider reads them in
  place and a tree's path is compacted in numpy.
* :class:`DeviceKV` -- ``OrtValue``s allocated on the execution provider's device (CUDA, DirectML),
  so a GPU pass never copies the cache over the bus.  Python cannot index device memory, so
  ``move_slots`` round-trips one layer at a time through the host: tree rounds only, a few MiB.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnxruntime as ort

# execution providers whose device memory ORT's Python API can allocate an OrtValue in
DEVICE_OF_PROVIDER = {"cuda": "cuda", "directml": "dml"}


class KVStorage(Protocol):
    device: str

    def bind(self, binding: ort.IOBinding, num_layers: int) -> None:
        """Bind layer l's buffers as ``past_key_values.l.*`` and ``present.l.*``."""

    def move_slots(self, dst: list[int], src: list[int]) -> None:
        """Copy the keys and values at slots ``src`` to slots ``dst`` in every layer."""


class HostKV:
    device = "cpu"

    def __init__(self, shape: tuple[int, int, int, int], buffers: int) -> None:
        # the OrtValues wrap these arrays without copying, so slots can be moved in numpy
        self.arrays = [np.zeros(shape, np.float32) for _ in range(buffers)]
        self.values = [ort.OrtValue.ortvalue_from_numpy(array) for array in self.arrays]

    def bind(self, binding: ort.IOBinding, num_layers: int) -> None:
        _bind(binding, num_layers, self.values)

    def move_slots(self, dst: list[int], src: list[int]) -> None:
        for array in self.arrays:
            array[:, :, dst] = array[:, :, src]


class DeviceKV:
    def __init__(self, shape: tuple[int, int, int, int], buffers: int, device: str, device_id: int = 0) -> None:
        self.device = device
        self.values = [ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, device, device_id)
                       for _ in range(buffers)]

    def bind(self, binding: ort.IOBinding, num_layers: int) -> None:
        _bind(binding, num_layers, self.values)

    def move_slots(self, dst: list[int], src: list[int]) -> None:
        for value in self.values:
            array = value.numpy()
            array[:, :, dst] = array[:, :, src]
            value.update_inplace(array)


def kv_storage(provider: str, shape: tuple[int, int, int, int], buffers: int, device: str | None = None) -> KVStorage:
    """The storage for a decoder on ``provider``: on its device where ORT can allocate there, else host
    memory (``device`` overrides: "cpu" gives device-style OrtValues in host memory, for tests)."""
    device = device or DEVICE_OF_PROVIDER.get(provider.lower())
    return HostKV(shape, buffers) if device is None else DeviceKV(shape, buffers, device)


def _bind(binding: ort.IOBinding, num_layers: int, values: list[ort.OrtValue]) -> None:
    for layer in range(num_layers):
        for j, kind in enumerate(("key", "value")):
            value = values[2 * layer + j]
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", value)
