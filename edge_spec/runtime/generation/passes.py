"""Whether an answer's target passes are batch-invariant (padded so that every pass takes the multi-row
kernels, see ``model.decoder``): the price of greedy output that is the same bit for bit in every mode."""

from __future__ import annotations

from edge_spec.defaults import DEFAULT_PROVIDER
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.loaded import LoadedBundle


def exact_passes(bundle: LoadedBundle, mode: str, wanted: bool | None, deterministic: bool = True) -> bool:
    """Whether a generation in ``mode`` runs batch-invariant target passes (``wanted`` None: the default).

    By default only deterministic speculative decoding does (greedy, or coupled sampling): there the
    padded passes make its answer bit-identical to ``ar --exact`` whatever the draft lengths.  A
    rejection-sampled answer already depends on the draft lengths through which random draws the
    verifier makes, so the pad row would buy no reproducibility, only cost: a draft-less round is
    then the one-row pass plain decoding runs.  Asked for where this device's kernels round a token's
    logits by how many tokens share the pass, it is refused in one line."""
    if wanted is None:  # padded until the device check finds a pad buys nothing here
        return mode != "ar" and deterministic and bundle.exact_available(check=False) is not False
    if wanted and not bundle.exact_available():
        provider = bundle.options.provider
        elsewhere = f" (the {DEFAULT_PROVIDER} provider is exact)" if provider != DEFAULT_PROVIDER else ""
        raise EdgeSpecError(
            f"exact decoding is not available on {provider} here: its kernels give a "
            "token's logits that depend on how many tokens share the pass (checked at the first "
            "request), so no padding makes passes batch-invariant; greedy output matches "
            f"target-only decoding up to that rounding{elsewhere}"
        )
    return wanted
