"""A simulation of PyTorch's CUDA caching allocator: rounding, pools, segments, splitting, merging.

[Note: caching allocator] ``torch.cuda.max_memory_reserved`` counts the segments the caching
allocator of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x) took from the driver;
``max_memory_allocated`` the blocks it handed out. :class:`CachingAllocator` replays a sequence of
allocations and frees by the same rules, on one device and one stream per pool:

* a request is rounded up to a multiple of ``kMinBlockSize`` (512 B), or, with
  ``roundup_power2_divisions``, to the next of that many divisions of its power-of-2 interval;
* requests of at most ``kSmallSize`` (1 MiB) use the small pool, larger ones the large pool;
* a request is served by the smallest free block of its pool that fits (best fit; among equal
  sizes the lowest address); with ``max_split_size`` set, a block of at least that size serves only
  a request of at least that size and at most ``kLargeBuffer`` smaller;
* with no such block the allocator calls cudaMalloc for a new segment: ``kSmallBuffer`` (2 MiB) for
  a small request, ``kLargeBuffer`` (20 MiB) for a large one under ``kMinLargeAlloc`` (10 MiB), else
  the request rounded up to ``kRoundLarge`` (2 MiB);
* the block is split when what remains is at least 512 B (small pool) or more than ``kSmallSize``
  (large pool; and only for requests under ``max_split_size``); the whole block counts as
  allocated when it is not split;
* a freed block merges with its free neighbours in the segment; nothing goes back to the driver,
  except when cudaMalloc fails: then the allocator frees oversize cached blocks (with
  ``max_split_size``), then every cached block that is a whole segment, and tries again
  (``release_cached_blocks``); a second failure is an out-of-memory error.
* ``expandable_segments:True``: one segment per pool and stream whose address space is reserved
  up front and mapped in pages (2 MiB for the small pool, ``kLargeBuffer`` = 20 MiB for the large),
  grown at its lowest free address when no free block fits (a free block just before the unmapped
  range is extended); blocks split whenever 512 B or more remain; a release unmaps the whole
  pages inside free blocks.

Not simulated: several streams' blocks (``record_stream``, a block freed while another stream
uses it), CUDA graph pools, ``garbage_collection_threshold``, and memory the allocator never sees
(the CUDA context, cuDNN/cuBLAS handles, NCCL's buffers: [Note: memory reserve]).
"""

from __future__ import annotations

import bisect

from nowdl.profiler.alloc.sizes import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConfig,
    AllocatorOOM,
    allocation_size,
    round_size,
)

__all__ = ["CachingAllocator"]

_SPACE = 1 << 44  # address space of one expandable segment (far beyond any GPU's memory)


class _Seg:
    """An expandable segment: its base address and page size."""

    __slots__ = ("base", "page")

    def __init__(self, base: int, page: int) -> None:
        self.base, self.page = base, page


class _Block:
    __slots__ = ("addr", "size", "pool", "prev", "next", "allocated", "mapped", "seg", "rel", "requested")

    def __init__(self, addr: int, size: int, pool: _Pool, seg: _Seg | None = None, mapped: bool = True) -> None:
        self.addr, self.size, self.pool, self.seg, self.mapped = addr, size, pool, seg, mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.rel = 0  # bytes a release would give back while the block is cached
        self.requested = 0

    def split(self, size: int, mapped: bool) -> _Block:
        """Keep the first ``size`` bytes; return the rest as a new free block linked after this one."""
        rest = _Block(self.addr + size, self.size - size, self.pool, self.seg, mapped=mapped)
        rest.prev, rest.next = self, self.next
        if self.next is not None:
            self.next.prev = rest
        self.next, self.size = rest, size
        return rest

    def releasable(self) -> int:
        if self.seg is None:
            return self.size if self.prev is None and self.next is None else 0
        page = self.seg.page
        begin = -(-(self.addr - self.seg.base) // page)
        end = (self.addr + self.size - self.seg.base) // page
        return max(0, end - begin) * page


class _Pool:
    """Free blocks of one pool, ordered by (size, address); unmapped ranges of its expandable segment."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.unmapped: list[tuple[int, _Block]] = []  # (address, block)


class CachingAllocator:
    """Replays ``malloc``/``free`` as the caching allocator does ([Note: caching allocator]).

    ``capacity`` (bytes) bounds the reserved memory as the device's free memory does: a segment
    past it fails, the cache is released and the request retried; None: unbounded.
    """

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.capacity = capacity
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.live: dict[int, _Block] = {}
        self._next_handle = 0
        self._next_addr = 1 << 40
        self.allocated = self.reserved = self.requested = self.releasable = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = self.peak_kept = 0
        self.segments = self.num_alloc_retries = self.num_ooms = 0

    # ---- the free sets -------------------------------------------------------------------------
    def _insert(self, b: _Block) -> None:
        key = (b.size, b.addr)
        bisect.insort(b.pool.keys, key)
        b.pool.blocks[key] = b
        b.rel = b.releasable()
        self.releasable += b.rel

    def _remove(self, b: _Block) -> None:
        key = (b.size, b.addr)
        keys = b.pool.keys
        del keys[bisect.bisect_left(keys, key)]
        del b.pool.blocks[key]
        self.releasable -= b.rel
        b.rel = 0

    def _unmapped_insert(self, b: _Block) -> None:
        bisect.insort(b.pool.unmapped, (b.addr, b), key=lambda e: e[0])

    def _unmapped_remove(self, b: _Block) -> None:
        um = b.pool.unmapped
        del um[bisect.bisect_left(um, b.addr, key=lambda e: e[0])]

    # ---- malloc --------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; a handle for :meth:`free`. Raises AllocatorOOM past the capacity."""
        cfg = self.config
        size = round_size(max(0, int(nbytes)), cfg.roundup_power2_divisions)
        pool = self.pools[size <= K_SMALL_SIZE]
        block = self._free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
            if block is None and self._release_oversize(pool, size):
                block = self._alloc_block(pool, size)
            if block is None:
                self._release_cached()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, size)
            if block is None:
                self.num_ooms += 1
                raise AllocatorOOM(f"simulated CUDA out of memory: {size} bytes requested with {self.reserved} of "
                                   f"{self.capacity} bytes reserved ({self.allocated} allocated)")
        remaining = block.size - size
        if pool.small or cfg.expandable_segments:
            split = remaining >= K_MIN_BLOCK
        else:
            split = (cfg.max_split_size is None or size < cfg.max_split_size) and remaining > K_SMALL_SIZE
        if split:
            self._insert(block.split(size, mapped=True))
        block.allocated = True
        block.requested = int(nbytes)
        handle = self._next_handle
        self._next_handle += 1
        self.live[handle] = block
        self.allocated += block.size
        self.requested += block.requested
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        self.peak_kept = max(self.peak_kept, self.reserved - self.releasable)
        return handle

    def _free_block(self, pool: _Pool, size: int) -> _Block | None:
        keys = pool.keys
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        block = pool.blocks[keys[i]]
        if block.seg is not None:  # an expandable block: fit by the size it can grow to
            def grows(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(keys) and grows(pool.blocks[keys[i + 1]]) < grows(block):
                i += 1
                block = pool.blocks[keys[i]]
        mss = self.config.max_split_size
        if mss is not None and ((size < mss <= block.size) or (size >= mss and block.size >= size + K_LARGE_BUFFER)):
            return None
        self._remove(block)
        return block

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        if self.config.expandable_segments:
            return self._expand(pool, size)
        alloc = allocation_size(size)
        if self.capacity is not None and self.reserved + alloc > self.capacity:
            return None
        block = _Block(self._next_addr, alloc, pool)
        self._next_addr += alloc + K_ROUND_LARGE
        self._grow(alloc)
        self.segments += 1
        return block

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    # ---- expandable segments -------------------------------------------------------------------
    def _expand(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address with room for ``size``."""
        cand = self._expandable_candidate(pool, size)
        if not cand.mapped and not self._map(cand, min(cand.size, size)):
            return None
        while cand.size < size:
            nxt = cand.next
            assert nxt is not None and not nxt.mapped
            if not self._map(nxt, min(size - cand.size, nxt.size)):
                return None
            cand = nxt
        self._remove(cand)
        return cand

    def _expandable_candidate(self, pool: _Pool, size: int) -> _Block:
        b: _Block | None
        for _, c in pool.unmapped:
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        seg = _Seg(self._next_addr, K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER)
        self._next_addr += _SPACE
        self.segments += 1
        whole = _Block(seg.base, _SPACE, pool, seg, mapped=False)
        self._unmapped_insert(whole)
        return whole

    def _map(self, b: _Block, size: int) -> bool:
        seg = b.seg
        assert seg is not None
        nbytes = min(b.size, -(-size // seg.page) * seg.page)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False
        self._unmapped_remove(b)
        b.mapped = True
        if nbytes < b.size:
            self._unmapped_insert(b.split(nbytes, mapped=False))
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._insert(b)
        self._grow(nbytes)
        return True

    # ---- free ----------------------------------------------------------------------------------
    def free(self, handle: int) -> None:
        """Return a block to its pool (``free_block``): merged with free neighbours, kept cached."""
        b = self.live.pop(handle)
        b.allocated = False
        self.allocated -= b.size
        self.requested -= b.requested
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._insert(b)

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: ``dst`` takes in its free neighbour ``src`` (same mapped state)."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove(src)
        else:
            self._unmapped_remove(src)
        if dst.prev is src:
            dst.addr, dst.prev = src.addr, src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    # ---- release -------------------------------------------------------------------------------
    def _release_oversize(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached blocks (only with max_split_size)."""
        mss = self.config.max_split_size
        if mss is None or self.config.expandable_segments:
            return False
        want = max(size, mss)
        keys = pool.keys
        i = bisect.bisect_left(keys, (want, -1))
        if i < len(keys):
            self._release_block(pool.blocks[keys[i]])
            return True
        freed = 0
        for key in reversed(list(keys)):
            if freed >= want or key[0] < mss:
                break
            freed += key[0]
            self._release_block(pool.blocks[key])
        return freed >= want

    def _release_block(self, b: _Block) -> None:
        self._remove(b)
        self.reserved -= b.size
        self.segments -= 1

    def _release_cached(self) -> None:
        """``release_cached_blocks``: every cached whole segment back to the driver, free pages unmapped."""
        for pool in self.pools.values():
            for key in list(pool.keys):
                b = pool.blocks.get(key)
                if b is None or b.allocated:
                    continue
                if b.seg is None:
                    if b.prev is None and b.next is None:
                        self._release_block(b)
                elif b.rel:
                    self._unmap(b)

    def _unmap(self, b: _Block) -> None:
        seg = b.seg
        assert seg is not None
        page = seg.page
        begin = seg.base + -(-(b.addr - seg.base) // page) * page
        end = seg.base + (b.addr + b.size - seg.base) // page * page
        self._remove(b)
        for lo, hi in ((b.addr, begin), (end, b.addr + b.size)):  # free mapped rests on either side
            if hi > lo:
                piece = _Block(lo, hi - lo, b.pool, seg)
                if lo < begin:
                    piece.prev, piece.next = b.prev, b
                    if b.prev is not None:
                        b.prev.next = piece
                    b.prev = piece
                else:
                    piece.prev, piece.next = b, b.next
                    if b.next is not None:
                        b.next.prev = piece
                    b.next = piece
                self._insert(piece)
        b.addr, b.size, b.mapped = begin, end - begin, False
        self.reserved -= end - begin
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._unmapped_insert(b)
        if b.prev is None and b.next is None:  # the whole segment unmapped: released
            self._unmapped_remove(b)
            self.segments -= 1

    # ---- figures -------------------------------------------------------------------------------
    def reset_peaks(self) -> None:
        """As ``torch.cuda.reset_peak_memory_stats``: every peak back to its current value."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.peak_requested, self.peak_kept = self.requested, self.reserved - self.releasable

    def stats(self) -> dict[str, int]:
        """Current and peak figures in bytes (``peak_kept``: the most reserved bytes no release could
        give back, segments holding a live block), segments, releases and out-of-memory errors."""
        return {"allocated": self.allocated, "reserved": self.reserved, "requested": self.requested,
                "peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
                "peak_requested": self.peak_requested, "peak_kept": self.peak_kept, "segments": self.segments,
                "num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms}
