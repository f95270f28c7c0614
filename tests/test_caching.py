"""The caching allocator's simulation (``planner.memory.caching``) on sequences whose reservations follow from
``CUDACachingAllocator.cpp``'s rules by hand: rounding, the two pools and their segment sizes, best fit and
splitting, merging on free, giving back free segments at the device's limit, and expandable segments."""

from __future__ import annotations

from planner.memory.caching import LARGE_BUFFER, simulate_reserved

MiB = 1 << 20


def _alloc(*sizes: int) -> list[tuple[int, int]]:
    return [(key, size) for key, size in enumerate(sizes)]


def test_small_requests_are_rounded_to_512_bytes_in_2_mib_segments():
    reserved = simulate_reserved(_alloc(1, 513, 1000))
    assert reserved.allocated_bytes == 512 + 1024 + 1024
    assert reserved.peak_bytes == reserved.needed_bytes == 2 * MiB


def test_large_requests_under_10_mib_share_20_mib_segments_and_larger_ones_are_rounded_to_2_mib():
    assert simulate_reserved(_alloc(5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB)).peak_bytes == 20 * MiB
    assert simulate_reserved(_alloc(5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB, 1 * MiB + 1)).peak_bytes == 40 * MiB
    assert simulate_reserved(_alloc(11 * MiB)).peak_bytes == 12 * MiB
    assert simulate_reserved(_alloc(12 * MiB + 1)).peak_bytes == 14 * MiB


def test_an_unsplit_block_is_allocated_whole():
    """19.5 MiB from a 20 MiB segment leaves 0.5 MiB, under the large pool's 1 MiB split threshold: all 20 MiB are
    allocated, as max_memory_allocated counts them."""
    assert simulate_reserved(_alloc(39 * MiB // 2)).allocated_bytes == 20 * MiB


def test_a_freed_block_merges_and_serves_a_larger_request_best_fit():
    events = [(0, 4 * MiB), (1, 4 * MiB), (2, 4 * MiB), (0, 0), (1, 0), (3, 8 * MiB)]
    assert simulate_reserved(events).peak_bytes == 20 * MiB  # 0 and 1 merged into the 8 MiB that 3 takes
    events = [(0, 12 * MiB), (1, 16 * MiB), (0, 0), (2, 12 * MiB)]
    assert simulate_reserved(events).peak_bytes == 28 * MiB  # the cached 12 MiB segment fits 2 exactly


def test_at_the_limit_free_segments_are_given_back_before_a_new_one():
    """Segments of 12 and 12 MiB; the first freed; a 14 MiB request: with room the allocator holds all three
    (38 MiB), at the limit it gives the free one back first (26 MiB)."""
    reserved = simulate_reserved([(0, 12 * MiB), (1, 12 * MiB), (0, 0), (2, 14 * MiB)])
    assert reserved.peak_bytes == 38 * MiB and reserved.needed_bytes == 26 * MiB


def test_a_segment_partly_in_use_is_not_given_back():
    """A 20 MiB segment holding one live 2 MiB block cannot be given back: fragmentation the limit cannot undo."""
    reserved = simulate_reserved([(0, 2 * MiB), (1, 16 * MiB), (1, 0), (2, 22 * MiB)])
    assert reserved.peak_bytes == reserved.needed_bytes == 42 * MiB


def test_expandable_segments_grow_one_range_in_pages():
    """12, 12, free the first, 14: one range mapped in 20 MiB pages. The second 12 MiB does not fit the 8 MiB left
    of the first page and maps a second one after it; freed, the first 12 MiB merges with the rest of its page
    (20 MiB free), which holds the 14 MiB request."""
    reserved = simulate_reserved([(0, 12 * MiB), (1, 12 * MiB), (0, 0), (2, 14 * MiB)], expandable=True)
    assert reserved.peak_bytes == reserved.needed_bytes == 2 * LARGE_BUFFER


def test_expandable_segments_at_the_limit_unmap_free_pages():
    """Two pages in use, the first freed, then 30 MiB: the first page is unmapped at the limit and the 30 MiB maps
    two pages from the lowest address that holds it (after the second page in use)."""
    events = [(0, 20 * MiB), (1, 20 * MiB), (0, 0), (2, 30 * MiB)]
    roomy = simulate_reserved(events, expandable=True)
    assert roomy.peak_bytes == 80 * MiB and roomy.needed_bytes == 60 * MiB


def test_a_recorded_step_replays_at_its_live_peak_rounded():
    """The GPT example's step recorded at the dispatcher (``allocation_events``): the allocator's count of it is the
    live peak with each storage rounded up (measured +0.37%), and what it reserves holds it; at the limit it needs no
    more than with room to spare."""
    from conftest import load_example

    from planner.capture.inputs import as_inputs
    from planner.profiling.measure import allocation_events, measure_live_peak

    gpt = load_example("gpt")
    model, loss_fn = gpt["model"], gpt.get("loss_fn")
    example = as_inputs(model, gpt["inputs"])
    events = allocation_events(model, example, loss_fn)
    live = measure_live_peak(model, example, loss_fn)
    sizes = dict(events)
    assert sum(n for _, n in events) > live and len(sizes) < len(events)  # frees recorded, keys reused
    reserved = simulate_reserved(events)
    assert live <= reserved.allocated_bytes <= 1.01 * live  # rounded, and large blocks left whole under 1 MiB spare
    assert reserved.allocated_bytes <= reserved.needed_bytes <= reserved.peak_bytes
    expandable = simulate_reserved(events, expandable=True)
    assert expandable.allocated_bytes <= expandable.needed_bytes <= expandable.peak_bytes
