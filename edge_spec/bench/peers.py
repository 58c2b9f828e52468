"""How ``benchmarks/spec_peers.py`` counts and tables every engine's answers, ours and the peers' alike.

A tokens/s on 3-15 token answers moves by a token's worth when one engine's count includes its EOS or
its first streamed tokens and another's does not, which can decide a category.  So every engine's answer
goes through :func:`result`: the answer ends before any EOS (onnxruntime-genai leaves the EOS out of its
sequence yet takes one more ``generate_next_token`` call for it; ours and OpenVINO keep it), and the
decode tokens are those after the ones known when the decode clock started (OpenVINO streams its first
tokens in one write).  Saved runs are re-tabled through the same rule (:func:`report`).

Standard library only: the peers' worker processes import :func:`result` inside their own virtual
environments, where edge-spec's dependencies are not installed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def result(
    ids: list[int], eos: set[int], first_tokens: int, decode_seconds: float, prefill_seconds: float, **extra
) -> dict:
    """One generation's record.  ``first_tokens``: how many answer tokens were known when the decode
    clock started (1: the token picked from the prefill's logits).  The answer ends before any EOS,
    whether or not the engine put the EOS in its sequence (as in our engine)."""
    answer = ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]
    record = {
        "new_tokens": len(answer),
        "first_tokens": first_tokens,
        "ids": answer,
        "decode_seconds": decode_seconds,
        "prefill_seconds": prefill_seconds,
        **extra,
    }
    return {**record, "decode_tokens": decode_tokens(record)}


def decode_tokens(record: dict) -> int:
    """The answer's tokens after the first ones, the numerator of every tokens/s here.  Records written
    before ``first_tokens`` existed: OpenVINO's first write, else one token (ours, onnxruntime-genai),
    which also corrects onnxruntime-genai's old counts (one call per token, the EOS's included)."""
    first = record.get("first_tokens", record.get("first_write_tokens", 1))
    return max(record["new_tokens"] - first, 0)


def first_token_seconds(record: dict) -> float | None:
    """A record's time to its first token: ours as ``first_token_seconds`` (from the request to the first
    token, the target's and the drafter's prompt reading included), a peer's worker as ``prefill_seconds``
    (from handing over the prompt ids to the first token known); None in runs saved before either."""
    value = record.get("first_token_seconds", record.get("prefill_seconds"))
    return float(value) if isinstance(value, (int, float)) else None


def peer_record(peer: str, k: int, answer: dict, ar_ids: list[int] | None) -> dict:
    """A peer's answer (a worker's :func:`result`) as a table record: its engine label (``genai ar``,
    ``openvino K8``), its tokens/s by :func:`decode_tokens`, and at K > 0 whether it equals the peer's own
    ar answer ``ar_ids`` (the check that its speculative mode is lossless)."""
    record = {key: value for key, value in answer.items() if key != "ids"}
    record.update(
        engine=f"{peer} {'K' + str(k) if k else 'ar'}",
        peer=peer,
        k=k,
        tokens_per_second=decode_tokens(answer) / answer["decode_seconds"] if answer["decode_seconds"] > 0 else 0.0,
    )
    if k:
        record["identical_to_ar"] = answer["ids"] == ar_ids
    return record


PEER_NAMES = {"genai": "onnxruntime-genai", "openvino": "OpenVINO GenAI", "llamacpp": "llama.cpp"}


def peer_label(engine: str) -> str:
    """``genai K4`` -> ``onnxruntime-genai K=4``, ``openvino ar`` -> ``OpenVINO GenAI plain``,
    ``llamacpp draft`` -> ``llama.cpp draft``."""
    peer, _, mode = engine.partition(" ")
    if mode == "ar":
        mode = "plain"
    elif mode[:1] == "K" and mode[1:].isdigit():
        mode = "K=" + mode[1:]
    return f"{PEER_NAMES.get(peer, peer)} {mode}"


def summarize(records: list[dict], engines: list[str]) -> list[dict]:
    """Per (category, engine) and overall: pooled (new tokens - 1) / decode seconds, its ratio to the same
    engine family's ar and to ours, and the mean time to the first token (ms; None where none was kept)."""
    groups = defaultdict(list)
    for r in records:
        for category in (r["category"], "overall"):
            groups[(category, r["engine"])].append(r)
    speed = {
        key: sum(decode_tokens(r) for r in rows) / max(sum(r["decode_seconds"] for r in rows), 1e-9)
        for key, rows in groups.items()
    }
    categories = sorted({c for c, _ in groups if c != "overall"}) + ["overall"]
    rows = []
    for category in categories:
        for engine in engines:
            if (category, engine) not in groups:
                continue
            family = engine.split()[0]
            own_ar, ours_ar = speed.get((category, f"{family} ar")), speed.get((category, "ours ar"))
            tps = speed[(category, engine)]
            members = groups[(category, engine)]
            flags = [r.get("identical_to_ar") for r in members]  # ours: None (no ar-exact run), see the legend
            flags = [flag if flag is not None else r.get("identical_to_one_row_ar") for flag, r in zip(flags, members)]
            identical = [flag for flag in flags if flag is not None]
            firsts = [t for t in map(first_token_seconds, members) if t is not None]
            rows.append(
                {
                    "category": category,
                    "engine": engine,
                    "prompts": len(members),
                    "tokens_per_second": tps,
                    "vs_own_ar": tps / own_ar if own_ar else None,
                    "vs_ours_ar": tps / ours_ar if ours_ar else None,
                    "identical_to_ar": f"{sum(identical)}/{len(identical)}" if identical else "",
                    "mean_new_tokens": sum(r["new_tokens"] for r in members) / len(members),
                    "first_token_ms": 1000 * sum(firsts) / len(firsts) if firsts else None,
                }
            )
    return rows


def ratio_cell(value: float | None) -> str:
    """A summary row's ratio as a table shows it: ``1.23x``, or ``-`` where there is none."""
    return f"{value:.2f}x" if value else "-"


def ms_cell(value: float | None) -> str:
    """A summary row's time in ms as a table shows it (``first_token_ms``), or ``-`` where none was kept."""
    return f"{value:.0f}" if value is not None else "-"


def format_rows(rows: list[dict]) -> str:
    """:func:`summarize`'s rows as the printed table, a blank line between categories."""
    header = (
        f"{'category':<15} {'engine':<22} {'n':>3} {'tok/s':>7} {'vs own ar':>9} {'vs ours ar':>10} {'= ar':>6} "
        f"{'tokens':>6} {'TTFT ms':>8}"
    )
    lines, previous = [header, "-" * len(header)], None
    for r in rows:
        if previous and r["category"] != previous:
            lines.append("")
        previous = r["category"]
        lines.append(
            f"{r['category']:<15} {r['engine']:<22} {r['prompts']:>3} {r['tokens_per_second']:7.2f} "
            f"{ratio_cell(r['vs_own_ar']):>9} {ratio_cell(r['vs_ours_ar']):>10} {r['identical_to_ar']:>6} "
            f"{r['mean_new_tokens']:6.1f} {ms_cell(r.get('first_token_ms')):>8}"
        )
    return "\n".join(lines)


def report(path: Path) -> str:
    """A saved run's tables, recomputed from its records (so a counting fix reaches old runs too); a
    ``ValueError`` names a file that is not such a run."""
    try:
        saved = json.loads(path.read_text())
        records = saved["records"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a spec_peers result ({error})") from None
    return format_rows(summarize(records, list(dict.fromkeys(r["engine"] for r in records))))
