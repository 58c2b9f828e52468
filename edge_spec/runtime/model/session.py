"""An ORT session for a small stateless graph (a drafter head, a feature projection), and numpy's own
thread pool kept out of ORT's way while a generation runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import onnxruntime as ort
from threadpoolctl import ThreadpoolController

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.model.providers import open_session


def set_spinning(opts: ort.SessionOptions, takes_turns: bool) -> None:
    """ORT's worker threads spin between a run's ops: waking a sleeping thread for every op costs a
    small graph (the drafter's layers, a head) a large share of its time.  A session that takes turns
    with others on the same cores (target, drafter, heads) also stops spinning the moment its run ends:
    threads spinning on after it would take the cores the next session's run needs.  A session alone
    (target-only decoding) spins on into its next run, which starts a few microseconds later."""
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
    opts.add_session_config_entry("session.force_spinning_stop", "1" if takes_turns else "0")


def small_session(
    model_path: Path,
    provider: str,
    threads: int,
    what: str = "drafter head",
    provider_options: dict[str, str] | None = None,
) -> ort.InferenceSession:
    """These graphs run between the target's and the drafter's passes: they take turns (``set_spinning``)."""
    if not Path(model_path).is_file():
        raise EdgeSpecError(f"{what} not found: {model_path}")
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    set_spinning(opts, takes_turns=True)
    try:
        return open_session(str(model_path), opts, provider, provider_options)
    except EdgeSpecError:
        raise
    except Exception as exc:  # ORT raises bare RuntimeError / Fail / InvalidProtobuf on a damaged graph
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EdgeSpecError(
            f"cannot load {what} {model_path}: {first[:300]}; the bundle is damaged: run "
            f"edge-spec info {Path(model_path).parent.parent} --verify"
        ) from exc


@contextmanager
def numpy_on_one_thread() -> Iterator[None]:
    """numpy's BLAS (OpenBLAS) runs a large enough product -- a SpecVocab head's thousand candidate
    rows -- on a pool of its own whose threads then spin-wait, on the very cores the target's next
    ORT pass needs: on two cores that pass took a fifth longer.  The runtime's numpy products are
    small, so one thread loses nothing; the limit holds only while the engine runs passes (a
    generation, a cost profile)."""
    with _thread_pools().limit(limits=1, user_api="blas"):
        yield


@cache
def _thread_pools() -> ThreadpoolController:
    """Found once: scanning the loaded libraries costs milliseconds (with torch loaded), the limit itself
    microseconds.  numpy's BLAS is loaded with numpy, long before the first call."""
    return ThreadpoolController()
