"""Model memory moves onto 2 MiB pages without changing a byte (runtime/model/huge_pages.py).

Skipped where the kernel cannot do it on demand (not Linux, THP turned off, or no MADV_COLLAPSE, Linux
< 6.1); the negative control also needs THP in "madvise" mode, where memory nobody asked for stays on 4 KiB
pages.
"""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_spec.runtime.model import huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")

SIZE = 32 << 20


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def touched_private_mapping() -> mmap.mmap:
    """Anonymous private memory, written (as ONNX Runtime writes its weights), with a pattern to check."""
    memory = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(memory, dtype=np.uint32)
    view[:] = np.arange(view.size, dtype=np.uint32) * 2654435761
    del view
    return memory


def pattern_intact(memory: mmap.mmap) -> bool:
    view = np.frombuffer(memory, dtype=np.uint32)
    intact = bool(np.array_equal(view, np.arange(view.size, dtype=np.uint32) * 2654435761))
    del view
    return intact


def test_what_a_block_allocated_goes_to_huge_pages_unchanged(monkeypatch):
    if huge_pages.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"THP mode is {huge_pages.thp_mode()!r}: huge pages are off on this system")
    monkeypatch.delenv(huge_pages.ENV_SWITCH, raising=False)
    promotion = huge_pages.HugePagePromotion()
    memory = touched_private_mapping()
    before = anon_huge_kib()
    promotion.start()
    done = promotion.wait()
    if done.advised and not done.collapsed:
        pytest.skip("this kernel cannot collapse on demand (MADV_COLLAPSE needs Linux 6.1)")
    assert done.collapsed >= SIZE // 2  # the whole 2 MiB pages inside the mapping
    assert anon_huge_kib() - before >= (SIZE // 2) >> 10
    assert pattern_intact(memory)
    memory.close()


def test_memory_nobody_promotes_stays_on_small_pages(monkeypatch):
    """Negative control: the same allocation without a promotion gains no huge pages."""
    if huge_pages.thp_mode() != "madvise":
        pytest.skip(f"THP mode is {huge_pages.thp_mode()!r}: the kernel decides alone")
    before = anon_huge_kib()
    memory = touched_private_mapping()
    assert anon_huge_kib() - before < (SIZE // 4) >> 10
    memory.close()


def test_switched_off_it_does_nothing(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    promotion = huge_pages.HugePagePromotion()
    memory = touched_private_mapping()
    promotion.start()
    assert promotion.wait() == huge_pages.Promotion()
    memory.close()


def test_a_system_that_turned_huge_pages_off_is_respected(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", str(setting))
    monkeypatch.delenv(huge_pages.ENV_SWITCH, raising=False)
    assert huge_pages.thp_mode() == "never"
    promotion = huge_pages.HugePagePromotion()
    memory = touched_private_mapping()
    promotion.start()
    assert promotion.wait() == huge_pages.Promotion()
    memory.close()
    setting.write_text("[always] madvise never\n")
    assert huge_pages.thp_mode() == "always" and huge_pages.enabled()


def test_only_whole_huge_pages_inside_a_region_are_asked_for():
    page = huge_pages.HUGE_PAGE
    assert huge_pages.huge_aligned([(page + 4096, 3 * page + 8192)]) == [(2 * page, 3 * page)]
    assert huge_pages.huge_aligned([(4096, page)]) == []  # no whole page inside


def test_a_decoder_promotes_its_session_and_cache(target_path):
    """A decoder starts a promotion of what its session and KV cache allocated; waiting for it leaves
    the decoder's answers as they were."""
    from edge_spec.runtime.model.decoder import Decoder

    decoder = Decoder(target_path, capacity=64)
    before = decoder.forward([1, 2, 3], 3)["logits"].copy()
    huge_pages.wait_all()
    decoder.rewind(0)
    after = decoder.forward([1, 2, 3], 3)["logits"]
    assert np.array_equal(before, after)
    assert decoder.huge_pages.before is None  # started: the mappings it saw are no longer held
