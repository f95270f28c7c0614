"""What CUDA's caching allocator reserves for a sequence of allocations and frees.

A plan's budget bounds allocated bytes (``torch.cuda.max_memory_allocated``), but a device runs out when the
caching allocator cannot reserve a segment: it rounds each request up, carves requests out of segments of its own
sizes and keeps freed blocks cached for reuse, so it reserves more than is allocated. ``simulate_reserved`` replays
an allocation sequence through the allocator's rules (``c10/cuda/CUDACachingAllocator.cpp``, the default
configuration: no ``max_split_size_mb``, no ``roundup_power2_divisions``, one stream):

- a request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
- requests of at most 1 MiB (``kSmallSize``) come from the small pool, others from the large pool;
- a request no cached block can hold gets a new segment: 2 MiB for the small pool (``kSmallBuffer``), 20 MiB for
  requests under 10 MiB (``kLargeBuffer``, ``kMinLargeAlloc``), else the request rounded up to 2 MiB
  (``kRoundLarge``);
- a cached block is chosen best-fit (the smallest that holds the request, then the lowest address) and split when
  what remains is at least 512 bytes (small pool, or any pool with expandable segments) or more than 1 MiB (large
  pool); an unsplit block is allocated whole, which is what ``max_memory_allocated`` counts;
- a freed block merges with free neighbours of its segment.

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) each pool is one address range
that maps pages (2 MiB small, 20 MiB large) at its end as it grows: a request no free block holds extends the range
from its last free block, so the gaps between segments that waste memory without it do not arise.

Two readings: ``peak_bytes`` is what the allocator reserves on a device with room to spare (it never gives memory
back unprompted: ``max_memory_reserved``); ``needed_bytes`` is what it must reserve on a device at its limit, where
a failed reservation first returns every wholly free segment (or page) and tries again: the device memory the
sequence needs. Torch-free.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


class Pool(enum.Enum):
    SMALL = "small"
    LARGE = "large"


@dataclass(frozen=True, kw_only=True, slots=True)
class Reserved:
    """What the caching allocator does with one allocation sequence."""

    allocated_bytes: int
    """The most allocated at once, as the allocator counts it (blocks rounded, unsplit blocks whole):
    ``max_memory_allocated``."""
    peak_bytes: int
    """The most reserved at once with room to spare: ``max_memory_reserved``."""
    needed_bytes: int
    """The most reserved at once on a device at its limit (wholly free segments given back before each new one):
    the memory the sequence needs."""


def round_size(nbytes: int) -> int:
    """A request as the allocator rounds it."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def pool_of(size: int) -> Pool:
    return Pool.SMALL if size <= SMALL_SIZE else Pool.LARGE


def segment_size(size: int) -> int:
    """The segment a rounded request that no cached block holds gets."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def _splits(pool: Pool, remaining: int, expandable: bool) -> bool:
    return remaining >= MIN_BLOCK if pool is Pool.SMALL or expandable else remaining > SMALL_SIZE


@dataclass(eq=False, slots=True)
class _Block:
    pool: Pool
    segment: int
    start: int
    size: int
    free: bool = True
    mapped: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return self.size, self.segment, self.start


class CachingAllocator:
    """The allocator's segments as linked blocks, as the allocator keeps them, and each pool's cached blocks in
    (size, segment, address) order. ``expandable``: one growing range per pool, its unmapped address space a free
    block that is not cached; ``at_limit``: a device with no room to spare."""

    def __init__(self, *, expandable: bool = False, at_limit: bool = False) -> None:
        self.expandable = expandable
        self.at_limit = at_limit
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self._cached: dict[Pool, list[tuple[int, int, int]]] = {Pool.SMALL: [], Pool.LARGE: []}
        self._blocks: dict[tuple[int, int], _Block] = {}  # (segment, start) -> block, free blocks only
        self._heads: dict[int, _Block] = {}  # segment -> its first block
        self._live: dict[int, _Block] = {}
        self._made = 1  # segments made so far (expandable ranges are 0 and 1)

    def malloc(self, key: int, nbytes: int) -> None:
        size = round_size(nbytes)
        pool = pool_of(size)
        block = self._best_fit(pool, size)
        if block is None:
            if self.at_limit:
                self._release()
            block = self._map(pool, size) if self.expandable else self._segment(pool, size)
        if _splits(pool, block.size - size, self.expandable):
            rest = _Block(pool=pool, segment=block.segment, start=block.start + size, size=block.size - size,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._cache(rest)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for other in (block.next, block.prev):
            if other is not None and other.free and other.mapped:
                self._uncache(other)
                self._merge(block, other)
        self._cache(block)

    def _best_fit(self, pool: Pool, size: int) -> _Block | None:
        cached = self._cached[pool]
        i = bisect.bisect_left(cached, (size, -1, -1))
        if i == len(cached):
            return None
        _, segment, start = cached.pop(i)
        return self._blocks.pop((segment, start))

    def _segment(self, pool: Pool, size: int) -> _Block:
        nbytes = segment_size(size)
        self._made += 1
        block = _Block(pool=pool, segment=self._made, start=0, size=nbytes)
        self._heads[block.segment] = block
        self._reserve(nbytes)
        return block

    def _map(self, pool: Pool, size: int) -> _Block:
        """Expandable: the lowest free address space of the pool's range that holds ``size`` and takes in unmapped
        space (a free mapped block right before it included, as ``find_expandable_block`` does), its unmapped pages
        mapped as far as the request needs and joined into one free block."""
        segment = 0 if pool is Pool.SMALL else 1
        if segment not in self._heads:
            self._heads[segment] = _Block(pool=pool, segment=segment, start=0, size=1 << 62, mapped=False)
        block: _Block | None = self._heads[segment]
        span: list[_Block] = []
        while block is not None:
            if block.free and not block.mapped:
                first = block.prev if block.prev is not None and block.prev.free else block
                span, total = [], 0
                cursor: _Block | None = first
                while cursor is not None and cursor.free and total < size:
                    span.append(cursor)
                    total += cursor.size
                    cursor = cursor.next
                if total >= size:
                    break
            block = block.next
        assert span  # the range ends in unmapped space
        page, covered, mapped = _page(pool), 0, 0
        used: list[_Block] = []
        for piece in span:
            used.append(piece)
            if not piece.mapped:
                take = min(-(-(size - covered) // page) * page, piece.size)
                if take < piece.size:
                    rest = _Block(pool=pool, segment=segment, start=piece.start + take, size=piece.size - take,
                                  mapped=False, prev=piece, next=piece.next)
                    if piece.next is not None:
                        piece.next.prev = rest
                    piece.next, piece.size = rest, take
                piece.mapped = True
                mapped += piece.size
            else:
                self._uncache(piece)
            covered += piece.size
            if covered >= size:
                break
        joined = span[0]
        while joined.next is not None and joined.next in used:
            self._merge(joined, joined.next)
        self._reserve(mapped)
        return joined

    def _release(self) -> None:
        """A device at its limit: every wholly free segment is given back (expandable: every page wholly inside a
        free block is unmapped)."""
        for segment, head in list(self._heads.items()):
            if not self.expandable:
                if head.free and head.next is None:
                    self._uncache(head)
                    del self._heads[segment]
                    self.reserved -= head.size
                continue
            block: _Block | None = head
            while block is not None:
                following = block.next
                if block.free and block.mapped:
                    self._unmap(block)
                block = following

    def _unmap(self, block: _Block) -> None:
        page = _page(block.pool)
        first, last = -(-block.start // page) * page, (block.start + block.size) // page * page
        if last <= first:
            return
        self._uncache(block)
        pieces = [(block.start, first, True), (first, last, False), (last, block.start + block.size, True)]
        previous, following = block.prev, block.next
        made = [_Block(pool=block.pool, segment=block.segment, start=a, size=b - a, mapped=m)
                for a, b, m in pieces if b > a]
        for left, right in zip([previous, *made], [*made, following]):
            if left is not None:
                left.next = right
            if right is not None:
                right.prev = left
        if previous is None:
            self._heads[block.segment] = made[0]
        self.reserved -= last - first
        for piece in made:
            if piece.mapped:
                self._cache(piece)
            else:
                for other in (piece.next, piece.prev):
                    if other is not None and other.free and not other.mapped:
                        self._merge(piece, other)

    def _merge(self, block: _Block, other: _Block) -> None:
        """``other``, a free neighbour, joins ``block``."""
        if other is block.next:
            block.size += other.size
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        else:
            block.start, block.size = other.start, block.size + other.size
            block.prev = other.prev
            if other.prev is not None:
                other.prev.next = block
            else:
                self._heads[block.segment] = block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _cache(self, block: _Block) -> None:
        if block.mapped:
            bisect.insort(self._cached[block.pool], block.key())
            self._blocks[(block.segment, block.start)] = block

    def _uncache(self, block: _Block) -> None:
        if self._blocks.pop((block.segment, block.start), None) is not None:
            cached = self._cached[block.pool]
            cached.pop(bisect.bisect_left(cached, block.key()))


def _page(pool: Pool) -> int:
    """What an expandable range maps at a time."""
    return SMALL_BUFFER if pool is Pool.SMALL else LARGE_BUFFER


def simulate_reserved(events: Iterable[tuple[int, int]], *, expandable: bool = False) -> Reserved:
    """Replays ``events`` (``(key, bytes)`` for an allocation of a storage ``key``, ``(key, 0)`` for its free) through
    the caching allocator, with room to spare and at the device's limit."""
    events = list(events)
    roomy, tight = CachingAllocator(expandable=expandable), CachingAllocator(expandable=expandable, at_limit=True)
    for allocator in (roomy, tight):
        for key, nbytes in events:
            if nbytes:
                allocator.malloc(key, nbytes)
            else:
                allocator.free(key)
    return Reserved(allocated_bytes=roomy.peak_allocated, peak_bytes=roomy.peak_reserved,
                    needed_bytes=tight.peak_reserved)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReservedPeak:
    """What the CUDA caching allocator is predicted to reserve for a plan's step, on top of the plan's predicted
    peak: the allocator's own margin (rounding, whole blocks, segments) taken from a replay of the step's
    allocation sequence (``reserved_peak``)."""

    needed_bytes: int
    """Device memory the step needs with this process's allocator setting (``expandable``): at the device's
    limit, where the allocator gives back wholly free segments before it reserves a new one."""
    roomy_bytes: int
    """What it reserves with room to spare, where it never gives memory back (``max_memory_reserved``)."""
    expandable: bool
    """Whether the prediction is for expandable segments (``expandable_segments:True``, as this process runs)."""
    other_bytes: int
    """``needed_bytes`` with the other setting of expandable segments."""


def reserved_peak(events: Iterable[tuple[int, int]], *, live_peak_bytes: int, predicted_peak_bytes: int,
                  expandable: bool) -> ReservedPeak:
    """The reserve of a step whose predicted peak is ``predicted_peak_bytes``: the replay of ``events`` (the step's
    allocation sequence, whose own peak of live bytes is ``live_peak_bytes``) gives what the allocator reserves
    beyond the live bytes, which is added to the prediction (it counts what the replay does not: the training
    loop's optimizer state, workspaces)."""
    events = list(events)

    def added(reserved_bytes: int) -> int:
        return predicted_peak_bytes + max(0, reserved_bytes - live_peak_bytes)

    this, other = simulate_reserved(events, expandable=expandable), simulate_reserved(events, expandable=not expandable)
    return ReservedPeak(needed_bytes=added(this.needed_bytes), roomy_bytes=added(this.peak_bytes),
                        expandable=expandable, other_bytes=added(other.needed_bytes))
