"""The native op's prefetches (one-row passes asking ahead, passes of some sizes asking far ahead): timed by the
export on its machine, recorded in the manifest, set at load where the bundle runs on that machine; on another
machine timed at the first load there and remembered; the environment's switches over all of it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from edge_spec.export.bundle.build import ExportOptions, export_bundle  # noqa: E402
from edge_spec.manifest import read_manifest, write_manifest  # noqa: E402
from edge_spec.runtime import loaded  # noqa: E402
from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.model.kernel_choice import (  # noqa: E402
    AHEAD,
    FAR_ROWS,
    FAR_SWITCH,
    NO_PASS,
    NONE,
    ONE_ROW_SWITCH,
    decide,
    decide_far,
    far_rows_in_force,
    measure_kernels,
    set_far_rows,
    set_one_row_prefetch,
    this_machine,
)
from edge_spec.runtime.model.native_attention import gguf_matmul_asks_ahead  # noqa: E402
from edge_spec.runtime.schedule.cost_profile import kernels_key, recalled_record, remember_record  # noqa: E402
from tests import tiny_models  # noqa: E402
from tests.helpers import cli  # noqa: E402

PROMPT = "def is_prime(n):\n    return"


@pytest.fixture
def vendor_rule(native_library, monkeypatch):
    """The vendor's one-row choice on this machine (the switches unset), and the process left on the vendor's
    rules afterwards."""
    monkeypatch.delenv(ONE_ROW_SWITCH, raising=False)
    monkeypatch.delenv(FAR_SWITCH, raising=False)
    set_one_row_prefetch(native_library, None)
    set_far_rows(native_library, None)
    yield AHEAD if gguf_matmul_asks_ahead(native_library) else NONE
    set_one_row_prefetch(native_library, None)
    set_far_rows(native_library, None)


@pytest.fixture
def vendor_far(native_library, vendor_rule) -> int:
    """The vendor's far choice on this machine: the fewest rows of a pass that asks far ahead."""
    return far_rows_in_force(native_library)


@pytest.fixture(scope="module")
def native_bundle(tmp_path_factory, native_library):
    models, _ = tiny_models.carried_pair()
    out = tmp_path_factory.mktemp("kernels") / "bundle"
    options = ExportOptions(draft_vocab="full", context_length=256, gguf_layout="native")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(ONE_ROW_SWITCH, raising=False)
        patch.delenv(FAR_SWITCH, raising=False)
        export_bundle("tiny-target", "tiny-draft", out, options, loader=models.__getitem__)
    return out


def test_the_export_times_its_prefetches_and_records_its_choices_for_this_machine(
    native_bundle, native_library, vendor_rule, vendor_far
):
    record = read_manifest(native_bundle)["native_kernels"]
    assert record["machine"] == this_machine(native_library)
    ms = record["one_row_ms"]
    assert set(ms) == {AHEAD, NONE} and all(t > 0 for t in ms.values())
    assert (record["one_row_prefetch"], record["by"]) == decide(ms, vendor_rule)
    far = record["far_ms"]
    assert list(far) == [str(rows) for rows in FAR_ROWS]
    assert all(set(sides) == {"far", "near"} and min(sides.values()) > 0 for sides in far.values())
    assert (record["far_from_rows"], record["far_by"]) == decide_far(far, vendor_far)


def _far(*pairs: tuple[float, float]) -> dict[str, dict[str, float]]:
    return {str(rows): {"far": far, "near": near} for rows, (far, near) in zip(FAR_ROWS, pairs)}


@pytest.mark.parametrize(
    "ms, vendor, want",
    [
        # a Zen 5 EPYC: the prefetcher keeps up with one and two rows, not with more
        (_far((21.0, 20.4), (23.0, 22.3), (24.0, 26.5), (27.0, 30.5)), 4, (4, "measured")),
        # an Intel Xeon: every pass gains
        (_far((40.0, 51.0), (41.0, 49.0), (45.0, 52.0), (50.0, 58.0)), 1, (1, "measured")),
        # no pass gains, against a vendor's rule that has every pass ask
        (_far((20.0, 19.0), (22.0, 21.0), (24.0, 23.0), (28.0, 27.0)), 1, (NO_PASS, "measured")),
        # a size within the noise counts as the vendor's rule has it: here asking from four rows on
        (_far((21.0, 21.1), (23.0, 23.1), (25.0, 25.1), (27.0, 30.0)), 4, (4, "measured")),
        (_far((21.0, 21.1), (23.0, 23.1), (25.0, 25.1), (27.0, 30.0)), NO_PASS, (8, "measured")),
        # a size that loses cuts off the smaller ones, whatever they do
        (_far((20.0, 25.0), (23.0, 22.0), (24.0, 27.0), (27.0, 30.0)), 1, (4, "measured")),
        # the largest size loses: no pass asks
        (_far((20.0, 25.0), (21.0, 25.0), (24.0, 27.0), (31.0, 30.0)), 4, (NO_PASS, "measured")),
        (
            _far((21.0, 21.1), (23.0, 22.9), (25.0, 25.2), (27.0, 27.1)),
            4,
            (4, "the vendor's rule (measured within 2%)"),
        ),
        (
            _far((0.2, 0.3), (0.3, 0.4), (0.4, 0.5), (0.5, 0.9)),
            4,
            (4, "the vendor's rule (passes under 2 ms read from the caches)"),
        ),
    ],
)
def test_passes_ask_far_ahead_from_the_size_on_which_every_size_timed_gains(ms, vendor, want):
    assert decide_far(ms, vendor) == want


@pytest.mark.parametrize(
    "ms, vendor, want",
    [
        ({AHEAD: 24.7, NONE: 26.3}, NONE, (AHEAD, "measured")),  # a Zen 5 EPYC
        ({AHEAD: 27.0, NONE: 25.9}, AHEAD, (NONE, "measured")),  # a Zen 4 EPYC
        ({AHEAD: 25.0, NONE: 25.3}, NONE, (NONE, "the vendor's rule (measured within 2%)")),
        ({AHEAD: 25.3, NONE: 25.0}, AHEAD, (AHEAD, "the vendor's rule (measured within 2%)")),
        ({AHEAD: 0.11, NONE: 0.14}, NONE, (NONE, "the vendor's rule (passes under 2 ms read from the caches)")),
    ],
)
def test_the_faster_side_wins_only_by_more_than_the_noise(ms, vendor, want):
    assert decide(ms, vendor) == want


@pytest.mark.parametrize("switch, want, far", [("1", AHEAD, 1), ("0", NONE, NO_PASS)])
def test_the_environments_switches_are_recorded_without_a_timing(
    native_bundle, native_library, vendor_rule, vendor_far, monkeypatch, switch, want, far
):
    manifest = read_manifest(native_bundle)
    target = native_bundle / manifest["target"]["onnx"]
    monkeypatch.setenv(ONE_ROW_SWITCH, switch)
    record = measure_kernels(target, native_library, threads=1, capacity=64)
    assert {k: record[k] for k in ("machine", "one_row_prefetch", "by")} == {
        "machine": this_machine(native_library),
        "one_row_prefetch": want,
        "by": ONE_ROW_SWITCH,
    }
    assert "one_row_ms" not in record and set(record["far_ms"]) == {str(rows) for rows in FAR_ROWS}
    assert (record["far_from_rows"], record["far_by"]) == decide_far(record["far_ms"], vendor_far)
    monkeypatch.setenv(FAR_SWITCH, switch)
    record = measure_kernels(target, native_library, threads=1, capacity=64)
    assert record == {
        "machine": this_machine(native_library),
        "one_row_prefetch": want,
        "by": ONE_ROW_SWITCH,
        "far_from_rows": far,
        "far_by": FAR_SWITCH,
    }


def _with_record(bundle, folder, record: dict):
    copy = folder / "copy"
    shutil.copytree(bundle, copy)
    manifest = read_manifest(copy)
    manifest["native_kernels"] = record
    write_manifest(copy, manifest)
    return copy


def _greedy(bundle, mode: str) -> list[int]:
    engine = Engine.from_bundle(bundle, threads=1, mode=mode)
    return engine.complete(PROMPT, max_new_tokens=12, temperature=0).token_ids


def test_a_bundle_sets_its_recorded_choice_on_the_machine_that_measured_it(
    native_bundle, native_library, vendor_rule, tmp_path
):
    other = NONE if vendor_rule == AHEAD else AHEAD
    answers = {}
    for choice, far in ((other, 1), (vendor_rule, NO_PASS), (other, 2)):
        record = {"machine": this_machine(native_library), "one_row_prefetch": choice, "far_from_rows": far}
        copy = _with_record(native_bundle, tmp_path / f"{choice}-{far}", record)
        answers[choice, far] = _greedy(copy, "ar")
        assert gguf_matmul_asks_ahead(native_library) == (choice == AHEAD)
        assert far_rows_in_force(native_library) == far
    assert len(set(map(tuple, answers.values()))) == 1  # prefetches change no bits


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A cache directory of this test's own: what loads remember about the machine starts empty."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _key(bundle, library) -> str:
    return kernels_key(read_manifest(bundle), this_machine(library))


def _remembered(bundle, library) -> dict | None:
    return recalled_record(_key(bundle, library))


def test_a_bundle_measured_elsewhere_times_this_machine_at_its_first_load_and_remembers(
    native_bundle, native_library, vendor_rule, vendor_far, own_cache, tmp_path, monkeypatch
):
    other = NONE if vendor_rule == AHEAD else AHEAD
    set_one_row_prefetch(native_library, other)  # as another bundle loaded before would leave it
    set_far_rows(native_library, 2)
    record = {"machine": "another CPU / avx2", "one_row_prefetch": other, "far_from_rows": 2, "by": "measured"}
    copy = _with_record(native_bundle, tmp_path, record)
    want = _greedy(copy, "ar")
    timed = _remembered(copy, native_library)
    assert timed is not None and timed["machine"] == this_machine(native_library)
    assert (timed["one_row_prefetch"], timed["by"]) == decide(timed["one_row_ms"], vendor_rule)
    assert (timed["far_from_rows"], timed["far_by"]) == decide_far(timed["far_ms"], vendor_far)
    assert gguf_matmul_asks_ahead(native_library) == (timed["one_row_prefetch"] == AHEAD)
    assert far_rows_in_force(native_library) == timed["far_from_rows"]

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    timing = loaded.time_kernels
    monkeypatch.setattr(loaded, "time_kernels", no_timing)
    set_one_row_prefetch(native_library, None)
    set_far_rows(native_library, None)
    assert _greedy(copy, "spec") == want  # the second load reads what the first one timed
    # a machine whose timing chose the other sides: a later load sets them, and the answers stay the same
    remember_record(_key(copy, native_library), {**timed, "one_row_prefetch": other, "far_from_rows": 8})
    assert _greedy(copy, "ar") == want
    assert gguf_matmul_asks_ahead(native_library) == (other == AHEAD)
    assert far_rows_in_force(native_library) == 8
    # what a load kept, damaged, or from before the far choice: timed again
    monkeypatch.setattr(loaded, "time_kernels", timing)
    key = _key(copy, native_library)
    without_far = {k: v for k, v in timed.items() if k != "far_from_rows"}
    for damaged in (
        "{not json",
        '["a list"]',
        json.dumps({**timed, "one_row_prefetch": "sideways"}),
        json.dumps({**timed, "far_from_rows": -3}),
        json.dumps({**timed, "far_from_rows": True}),
        json.dumps(without_far),
    ):
        (own_cache / "costs" / f"kernels-{key}.json").write_text(damaged)
        assert _greedy(copy, "ar") == want
        again = _remembered(copy, native_library)
        assert again == {**timed, "one_row_ms": again["one_row_ms"], "far_ms": again["far_ms"]}


def test_the_environments_switch_leaves_a_bundle_from_elsewhere_untimed(
    native_bundle, native_library, own_cache, tmp_path, monkeypatch
):
    copy = _with_record(native_bundle, tmp_path, {"machine": "another CPU / avx2", "one_row_prefetch": NONE})
    for switch, value in ((ONE_ROW_SWITCH, "1"), (FAR_SWITCH, "0")):
        with monkeypatch.context() as patch:
            patch.setenv(switch, value)
            _greedy(copy, "ar")
            assert _remembered(copy, native_library) is None
            if switch == ONE_ROW_SWITCH:
                assert gguf_matmul_asks_ahead(native_library)
            else:
                assert far_rows_in_force(native_library) == NO_PASS


def test_info_says_what_the_export_chose_and_what_this_machine_runs(native_bundle, native_library, own_cache, tmp_path):
    record = read_manifest(native_bundle)["native_kernels"]
    said = "ask" if record["one_row_prefetch"] == AHEAD else "do not ask"

    def kernels_line(bundle) -> str:
        shown = cli("info", str(bundle))
        assert shown.returncode == 0, shown.stderr
        return next(line for line in shown.stdout.splitlines() if line.startswith("kernels "))

    line = kernels_line(native_bundle)
    assert f"one-row passes {said} for their records ahead on {this_machine(native_library)}" in line
    assert "differs" not in line
    elsewhere = _with_record(native_bundle, tmp_path, {**record, "machine": "another CPU / avx2"})
    assert "this machine differs and the next load times this machine's own" in kernels_line(elsewhere)
    older = _with_record(native_bundle, tmp_path / "older", {k: v for k, v in record.items() if k != "far_from_rows"})
    assert "the record is incomplete and the next load times this machine's own" in kernels_line(older)
    _greedy(elsewhere, "ar")
    timed = _remembered(elsewhere, native_library)
    said_here = "ask" if timed["one_row_prefetch"] == AHEAD else "do not ask"
    assert (
        f"this machine differs and a load timed this machine's own: one-row passes {said_here} for their records "
        "ahead here" in kernels_line(elsewhere)
    )


def test_the_first_load_on_another_machine_times_its_kernels_in_the_measuring_stage(
    native_bundle, native_library, vendor_rule, own_cache, tmp_path, monkeypatch
):
    record = {"machine": "another CPU / avx2", "one_row_prefetch": NONE, "by": "measured"}
    copy = _with_record(native_bundle, tmp_path, record)
    events: list[tuple[str, float | None]] = []
    timing = loaded.time_kernels

    def timed(*args, **kwargs):
        events.append(("timing", None))
        return timing(*args, **kwargs)

    monkeypatch.setattr(loaded, "time_kernels", timed)
    for first in (True, False):
        events.clear()
        engine = Engine.from_bundle(
            copy, threads=1, mode="ar", on_progress=lambda p: events.append((p.stage, p.fraction))
        )
        engine.close()
        if first:  # an ar load measures nothing else: the timing is the stage
            at = events.index(("timing", None))
            assert events[at - 1] == ("measuring", 0.0) and events[at + 1] == ("measuring", 1.0)
        else:  # timed once: the next load reads the record
            assert {stage for stage, _ in events} == {"reading", "verifying"}


def test_what_a_load_remembers_is_kept_apart_per_kernel_path(native_bundle):
    manifest = read_manifest(native_bundle)
    assert kernels_key(manifest, "AuthenticAMD 26 2 AMD EPYC / avx512") != kernels_key(
        manifest, "AuthenticAMD 26 2 AMD EPYC / avx2"
    )


@pytest.mark.parametrize(
    "script, options",
    [("benchmarks/verify_rows_profile.py", ["--rows", "1,2", "--context", "8"]), ("benchmarks/profile_step.py", [])],
)
def test_the_profiling_tools_time_the_passes_a_load_of_the_bundle_runs(
    script, options, native_bundle, native_library, vendor_rule, tmp_path
):
    """A tool that builds its own decoder over a bundle's target sets the bundle's prefetch choices for this
    machine first, as a load does: on the other side of the vendor's rule its passes would cost what the
    engine's do not."""
    other = NONE if vendor_rule == AHEAD else AHEAD
    record = {"machine": this_machine(native_library), "one_row_prefetch": other, "far_from_rows": 2}
    copy = _with_record(native_bundle, tmp_path, record)
    shown = subprocess.run(
        [sys.executable, script, "--bundle", str(copy), "--threads", "1", "--steps", "3", *options],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr
    said = "ask" if other == AHEAD else "do not ask"
    assert f"native op: one-row passes {said} ahead, passes of 2 rows and more ask far ahead" in shown.stdout
