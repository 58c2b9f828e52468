"""Small ONNX graphs that act on KV buffers in device memory, run on the decoder's own execution provider.

Python cannot index device memory, and ORT's Python API can only allocate an ``OrtValue`` on the CUDA
and DirectML devices.  Both jobs are therefore done by the execution provider itself:

* :func:`zeros_on_device` -- an ``Expand`` graph whose output is bound to the device: the EP's allocator
  makes the buffer and fills it there, so nothing crosses the bus even to allocate (WebGPU).
* :class:`SlotMover` -- after a tree pass, the accepted path's keys and values must move down to
  consecutive slots.  A ``Gather`` of the source slots feeds a ``GroupQueryAttention`` node without rotary
  embedding whose past and present are the cache buffer itself: the same in-place write of new positions
  the decoder relies on every pass, so the move needs no second buffer and no host round trip.  Its
  attention output is discarded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edge_spec.runtime.model.providers import open_session

OPSET = 21
IR_VERSION = 10  # what every ORT >= 1.22 loads (onnxruntime-webgpu included)


def _session(model, provider: str, provider_options: dict[str, str] | None) -> ort.InferenceSession:
    model.ir_version = IR_VERSION
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return open_session(model.SerializeToString(), opts, provider, provider_options)


def zeros_on_device(
    provider: str, provider_options: dict[str, str] | None, shape: Sequence[int], count: int, device: str
) -> list[ort.OrtValue]:
    """``count`` float32 buffers of ``shape``, zeroed and allocated by ``provider`` on ``device``."""
    graph = helper.make_graph(
        [helper.make_node("Expand", ["zero", "shape"], ["zeros"])],
        "zeros",
        [],
        [helper.make_tensor_value_info("zeros", TensorProto.FLOAT, list(shape))],
        initializer=[
            numpy_helper.from_array(np.zeros(1, np.float32), "zero"),
            numpy_helper.from_array(np.asarray(shape, np.int64), "shape"),
        ],
    )
    session = _session(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), provider, provider_options
    )
    values = []
    for _ in range(count):
        binding = session.io_binding()  # a fresh binding each time, or ORT reuses its last output buffer
        binding.bind_output("zeros", device)
        session.run_with_iobinding(binding)
        values.append(binding.get_outputs()[0])
    return values


class SlotMover:
    """Moves slots of a layered KV cache (``[1, kv_heads, capacity, head_dim]`` buffers, key and value
    alternating) down to a consecutive range, on the device that holds them."""

    def __init__(
        self, provider: str, provider_options: dict[str, str] | None, num_buffers: int, kv_heads: int, head_dim: int
    ) -> None:
        self.num_layers = num_buffers // 2
        self.session = _session(self._model(kv_heads, head_dim), provider, provider_options)
        self.host_bytes = 0  # bytes of indices and lengths sent to the device by the last move

    def _model(self, kv_heads: int, head_dim: int):
        nodes, inputs, outputs = [], [], []
        kv_shape = [1, kv_heads, "capacity", head_dim]
        for name, elem, shape in (
            ("src", TensorProto.INT64, ["n"]),
            ("seqlens_k", TensorProto.INT32, [1]),
            ("total_sequence_length", TensorProto.INT32, []),
        ):
            inputs.append(helper.make_tensor_value_info(name, elem, shape))
        packed = numpy_helper.from_array(np.array([1, -1, kv_heads * head_dim], np.int64), "packed")
        for layer in range(self.num_layers):
            rows = {}
            for kind in ("key", "value"):
                past, present = f"past.{layer}.{kind}", f"present.{layer}.{kind}"
                inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, kv_shape))
                outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT, kv_shape))
                picked, bsnh, flat = (f"{layer}.{kind}.{s}" for s in ("picked", "bsnh", "flat"))
                nodes += [
                    helper.make_node("Gather", [past, "src"], [picked], axis=2),
                    helper.make_node("Transpose", [picked], [bsnh], perm=[0, 2, 1, 3]),
                    helper.make_node("Reshape", [bsnh, "packed"], [flat]),
                ]
                rows[kind] = flat
            nodes.append(
                helper.make_node(
                    "GroupQueryAttention",
                    [
                        rows["key"],
                        rows["key"],
                        rows["value"],
                        f"past.{layer}.key",
                        f"past.{layer}.value",
                        "seqlens_k",
                        "total_sequence_length",
                    ],
                    [f"{layer}.discarded", f"present.{layer}.key", f"present.{layer}.value"],
                    domain="com.microsoft",
                    num_heads=kv_heads,
                    kv_num_heads=kv_heads,
                    do_rotary=0,
                )
            )
        graph = helper.make_graph(nodes, "move_slots", inputs, outputs, initializer=[packed])
        return helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
        )

    def move(self, values: list[ort.OrtValue], dst: list[int], src: list[int]) -> None:
        """Copy slots ``src`` to slots ``dst`` (consecutive, ascending, each below its source) in place."""
        if not dst:
            return
        if dst != list(range(dst[0], dst[0] + len(dst))) or any(d > s for d, s in zip(dst, src)):
            raise ValueError(f"slots {src} cannot move to {dst}: a device move fills consecutive lower slots")
        binding = self.session.io_binding()
        feeds = {
            "src": np.asarray(src, np.int64),
            "seqlens_k": np.array([dst[-1]], np.int32),
            "total_sequence_length": np.array(dst[-1] + 1, np.int32),
        }
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        self.host_bytes = sum(a.nbytes for a in feeds.values())
        for layer in range(self.num_layers):
            for j, kind in enumerate(("key", "value")):
                binding.bind_ortvalue_input(f"past.{layer}.{kind}", values[2 * layer + j])
                binding.bind_ortvalue_output(f"present.{layer}.{kind}", values[2 * layer + j])
        self.session.run_with_iobinding(binding)
