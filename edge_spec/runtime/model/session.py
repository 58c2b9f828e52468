"""An ORT session for a small stateless graph (a drafter head, a feature projection)."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.model.providers import open_session


def small_session(model_path: Path, provider: str, threads: int, what: str = "drafter head",
                  provider_options: dict[str, str] | None = None) -> ort.InferenceSession:
    """Spinning off (see ``Decoder``): these graphs run between the target's and the drafter's passes."""
    if not Path(model_path).is_file():
        raise EdgeSpecError(f"{what} not found: {model_path}")
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return open_session(str(model_path), opts, provider, provider_options)
    except EdgeSpecError:
        raise
    except Exception as exc:  # ORT raises bare RuntimeError / Fail / InvalidProtobuf on a damaged graph
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EdgeSpecError(f"cannot load {what} {model_path}: {first[:300]}; the bundle is damaged: run "
                            f"edge-spec info {Path(model_path).parent.parent} --verify") from exc
