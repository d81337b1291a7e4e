"""Paged KV block manager: one pool of block ids for the target and the draft caches.

Both models' caches are indexed by the same block ids, so one ``seq.block_table`` serves both and
one prefix-cache hit reuses both, with one caveat: a block filled by a request that did not run
the draft (speculation off, n-gram) holds target KV only. Each block therefore records whether
its draft KV is written too (``Block.draft_kv``, set once the sequence's draft KV tokens cover
it, cleared when the block is handed out again); a hit restores the sequence's draft KV tokens
to the leading run of such blocks, so the draft recomputes only the rest. The per-sequence
draft-KV record (how many leading tokens of draft KV are valid; whether hits must stop at the
first block without it) is kept here and reached through ``DraftKVLedger``
(specserve/core/draft_kv.py). Token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Lifecycle of a sequence, as the scheduler and engine drive it::

    hit = bm.allocate_prefix(seq)           # empty table only: reuse cached leading blocks
    ok = bm.allocate_slots(seq, n, k)       # cover num_computed_tokens + n + k tokens, or nothing
    if not ok: bm.free(seq)                 # roll back the hits too (counters back to 0)
    ... forward pass; engine advances seq.num_computed_tokens (minus rejected drafts) ...
    bm.truncate(seq, seq.num_tokens)        # optional: drop blocks wholly past the new end
    bm.commit_computed(seq)                 # full computed blocks enter the prefix cache
    bm.free(seq)                            # finished or preempted (before reset_for_recompute)

Prefix cache. A full block ``i`` is keyed by the chained hash
``h_i = hash((h_{i-1}, tokens of block i))`` (``h_{-1} = None``), so equal keys mean equal whole
prefixes. The hash is only an index: every cached block also keeps its own tokens and the
``cache_id`` of the cached block it was chained to, and a hit needs both to match exactly. So even
a colliding hash (or a constant one) can never hand out wrong KV; it only costs hits.

Worked example (block_size 4). A commits ``[1 2 3 4 | 5 6 7 8 | 9]``: block 0 (tokens 1-4) and
block 1 (5-8) are cached. B arrives with ``[1 2 3 4 | 5 6 7 8]`` (8 tokens): at most
``(8 - 1) // 4 = 1`` block may hit, because the model must still run B's last prompt token to get
its logits; so B gets A's block 0, ``num_computed_tokens = num_cached_tokens = 4``.

Free blocks sit in an LRU queue. A freed block that still carries a hash stays findable until it
is handed out again (then its cache entry is evicted). Cached blocks are freed to the tail, tail
blocks of a sequence first, so a sequence's end is evicted before its start; blocks without a
hash are freed to the head, because they are worth nothing to keep.

Invariants (``check_invariants``): ``ref_count >= 0``; a block is in the free queue iff its
``ref_count == 0``; ``hash_to_block[b.hash] == b.block_id`` for every block with a hash; a block
shared by several tables (``ref_count > 1``) is always a committed, cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from specserve.core.errors import ConfigError
from specserve.core.sequence import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block. Deterministic within a process (int tuples are not salted
    by PYTHONHASHSEED); exactness does not depend on it (see the module docstring)."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    """One KV block. ``hash``/``token_ids``/``cache_id``/``parent_cache_id`` are set only while
    the block is a prefix-cache entry; ``cache_id`` is unique per registration, so a cache entry
    that was evicted and registered again never matches a stale child."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    cache_id: int | None = None
    parent_cache_id: int | None = None
    draft_kv: bool = False  # the draft model's KV for this block's tokens is written too

    def clear_cache_entry(self) -> None:
        self.hash = self.token_ids = self.cache_id = self.parent_cache_id = None


# Per committed block of a sequence: (chained hash, cache_id of the cached block holding the same
# content, or None if a hash collision broke the chain so later blocks cannot be cached).
_Committed = tuple[int, int | None]


class BlockManager:
    """Ref-counted block pool with an LRU free queue and a chained-hash prefix cache.

    Only ``seq.token_ids``, ``seq.block_table``, ``seq.num_computed_tokens`` and
    ``seq.num_cached_tokens`` are used; ``seq.seq_id`` must be unique among live sequences.
    Implements ``DraftKVLedger``: the speculator reports the draft's KV progress per sequence.
    """

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(
                f"num_blocks must be an integer >= 1 (got {num_blocks!r}); "
                "give the KV cache more memory (--kv-cache-memory) or use a smaller model"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(
                f"block_size must be an integer >= 1 (got {block_size!r}); 16 is the usual choice"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Head = next block handed out (least recently freed); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        # seq_id -> committed blocks; present iff the sequence holds at least one block.
        self._seq_committed: dict[int, list[_Committed]] = {}
        # seq_id -> leading blocks of its table already marked ``draft_kv`` (O(new blocks) a step)
        self._seq_draft_marked: dict[int, int] = {}
        # seq_id -> leading tokens whose draft KV is written; absent = 0
        self._draft_tokens: dict[int, int] = {}
        # sequences whose hits need written draft KV (require_draft_kv_hits), until forgotten
        self._draft_hits_only: set[int] = set()
        self._next_cache_id = 0
        # Prometheus-style counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.draft_prefix_hits = 0  # hit tokens whose draft KV was reused as well

    # ------------------------------------------------------------------ accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (some may still be cached and revivable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (referenced or free)."""
        return len(self._hash_to_block)

    def can_allocate(self, num_blocks_needed: int) -> bool:
        return num_blocks_needed <= len(self._free)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> int:
        """New blocks ``allocate_slots(seq, num_new_tokens, num_lookahead)`` would take."""
        if num_new_tokens < 0 or num_lookahead < 0:
            raise ValueError(
                f"num_new_tokens and num_lookahead must be >= 0 "
                f"(got {num_new_tokens}, {num_lookahead})"
            )
        total = seq.num_computed_tokens + num_new_tokens + num_lookahead
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def num_committed_tokens(self, seq: Sequence) -> int:
        """Tokens in blocks committed to the prefix cache; ``truncate`` cannot go below this."""
        return len(self._seq_committed.get(seq.seq_id, ())) * self.block_size

    # ------------------------------------------------------------------ prefix cache
    def _find_prefix_hits(self, seq: Sequence) -> list[tuple[int, _Committed]]:
        """Longest run of leading full blocks found in the cache, as (block_id, (hash, cache_id)).
        At most ``(num_tokens - 1) // block_size`` blocks, so at least one token is left to run.
        For a sequence under ``require_draft_kv_hits`` (an EAGLE head, which rebuilds its KV
        only from the target's hidden states) only blocks whose draft KV is written count: the
        target recomputes the rest and so hands the head their features."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[tuple[int, _Committed]] = []
        parent_hash: int | None = None
        parent_cid: int | None = None
        draft_kv_only = seq.seq_id in self._draft_hits_only
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(parent_hash, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            # The hash is only an index: demand the same tokens chained to the same parent entry.
            if block.token_ids != tokens or block.parent_cache_id != parent_cid:
                break
            if draft_kv_only and not block.draft_kv:
                break
            hits.append((block_id, (h, block.cache_id)))
            parent_hash, parent_cid = h, block.cache_id
        return hits

    def lookup_prefix(self, seq: Sequence) -> int:
        """Tokens ``allocate_prefix`` would reuse right now. No side effects, no counters."""
        return len(self._find_prefix_hits(seq)) * self.block_size

    def allocate_prefix(self, seq: Sequence) -> int:
        """Start an empty block table from prefix-cache hits; return the hit tokens.

        Sets ``num_computed_tokens = num_cached_tokens = hit tokens`` (0 with no hits or with
        caching off), so call it for every new or preempted sequence before ``allocate_slots``.
        Reviving a cached free block takes it off the free queue (``num_free_blocks`` drops).
        Does nothing and returns 0 if the table is not empty.
        """
        if seq.block_table:
            return 0
        assert seq.seq_id not in self._seq_committed, (
            f"sequence {seq.seq_id} lost its block table without free(); call "
            "BlockManager.free(seq) before Sequence.reset_for_recompute()"
        )
        hits = self._find_prefix_hits(seq)
        for block_id, _ in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = [block_id for block_id, _ in hits]
        if hits:
            self._seq_committed[seq.seq_id] = [entry for _, entry in hits]
        num_hit = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = num_hit
        # The draft's KV is reusable up to the first hit block that a non-draft request filled.
        num_draft = 0
        while num_draft < len(hits) and self.blocks[hits[num_draft][0]].draft_kv:
            num_draft += 1
        self._set_draft_tokens(seq.seq_id, num_draft * self.block_size)
        self._seq_draft_marked[seq.seq_id] = num_draft
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_hit
            self.draft_prefix_hits += num_draft * self.block_size
        return num_hit

    # ------------------------------------------------------------------ draft KV (DraftKVLedger)
    def draft_kv_tokens(self, seq_id: int) -> int:
        return self._draft_tokens.get(seq_id, 0)

    def set_draft_kv_tokens(self, seq_id: int, num_tokens: int) -> None:
        self._set_draft_tokens(seq_id, num_tokens)

    def require_draft_kv_hits(self, seq_id: int) -> None:
        self._draft_hits_only.add(seq_id)

    def forget_draft_kv(self, seq_id: int) -> None:
        self._draft_hits_only.discard(seq_id)
        self._draft_tokens.pop(seq_id, None)

    def _set_draft_tokens(self, seq_id: int, num_tokens: int) -> None:
        if num_tokens:
            self._draft_tokens[seq_id] = num_tokens
        else:
            self._draft_tokens.pop(seq_id, None)

    def commit_computed(self, seq: Sequence) -> None:
        """Register every full block whose tokens are all computed and not committed yet.

        Call after the engine has advanced ``num_computed_tokens`` and rolled back rejected
        drafts. If another block already caches the same content, that entry is kept and this
        sequence's copy simply stays unhashed (a duplicate, freed like any private block),
        unless the copy holds draft KV the cached block lacks (see ``_adopt_entry``).
        """
        committed = self._seq_committed.get(seq.seq_id)
        if not self.enable_prefix_caching or committed is None:
            return
        bs = self.block_size
        self._commit_full_blocks(seq, committed)
        # Full blocks the draft's KV now covers (it only ever writes past its draft KV tokens,
        # so a marked block stays valid until the block is handed out again).
        marked = self._seq_draft_marked.get(seq.seq_id, 0)
        draft_full = min(self.draft_kv_tokens(seq.seq_id) // bs, len(seq.block_table))
        for i in range(marked, draft_full):
            self.blocks[seq.block_table[i]].draft_kv = True
            if i < len(committed):
                self._adopt_entry(seq.block_table[i], committed[i])
        self._seq_draft_marked[seq.seq_id] = max(marked, draft_full)

    def _adopt_entry(self, block_id: int, entry: _Committed) -> None:
        """A sequence's uncached copy of a cached block now holds draft KV too, and the cached
        block does not (a plain request filled it): the copy takes over the cache entry (its
        hash and cache_id, so cached children still chain to it). Otherwise a sequence that
        needs the draft KV (``require_draft_kv_hits``) could never hit these tokens while the
        target-only copy stays cached. Only when no other sequence holds the cached block."""
        h, cid = entry
        block = self.blocks[block_id]
        twin_id = self._hash_to_block.get(h)
        if block.hash is not None or cid is None or twin_id is None or block.ref_count != 1:
            return
        twin = self.blocks[twin_id]
        if twin.cache_id != cid or twin.draft_kv or twin.ref_count > 1:
            return
        block.hash, block.token_ids = twin.hash, twin.token_ids
        block.cache_id, block.parent_cache_id = twin.cache_id, twin.parent_cache_id
        self._hash_to_block[h] = block_id
        twin.clear_cache_entry()
        if twin.ref_count == 0:
            self._free.move_to_end(twin_id, last=False)  # nothing cached: reuse it first

    def _commit_full_blocks(self, seq: Sequence, committed: list[_Committed]) -> None:
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        assert num_full <= len(seq.block_table), "num_computed_tokens exceeds the block table"
        for i in range(len(committed), num_full):
            parent_hash, parent_cid = committed[i - 1] if i else (None, None)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = hash_block_tokens(parent_hash, tokens)
            cid: int | None = None
            if i == 0 or parent_cid is not None:  # a broken chain cannot be cached past the break
                existing = self._hash_to_block.get(h)
                if existing is None:
                    block = self.blocks[seq.block_table[i]]
                    assert block.hash is None and block.ref_count == 1, "uncommitted block shared"
                    block.hash, block.token_ids = h, tokens
                    block.cache_id, block.parent_cache_id = self._next_cache_id, parent_cid
                    self._next_cache_id += 1
                    self._hash_to_block[h] = block.block_id
                    cid = block.cache_id
                else:
                    other = self.blocks[existing]
                    if other.token_ids == tokens and other.parent_cache_id == parent_cid:
                        cid = other.cache_id  # same content cached elsewhere: chain through it
            committed.append((h, cid))

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Grow the table to cover ``num_computed_tokens + num_new_tokens + num_lookahead``.

        All or nothing: returns False and changes nothing if too few blocks are free. Lookahead
        slots are for speculative tokens whose KV may be rolled back with ``truncate``.
        """
        assert seq.block_table or seq.num_computed_tokens == 0, (
            f"sequence {seq.seq_id} has no blocks but num_computed_tokens="
            f"{seq.num_computed_tokens}; call allocate_prefix(seq) first"
        )
        needed = self.num_blocks_needed(seq, num_new_tokens, num_lookahead)
        if needed > len(self._free):
            return False
        if needed:
            seq.block_table.extend(self._take_free_block() for _ in range(needed))
            self._seq_committed.setdefault(seq.seq_id, [])
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.draft_kv = False  # whoever takes it writes new KV
        if block.hash is not None:  # evict its prefix-cache entry now that its KV is overwritten
            assert self._hash_to_block[block.hash] == block_id
            del self._hash_to_block[block.hash]
            block.clear_cache_entry()
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed more often than allocated"
        if block.ref_count == 0:
            self._free[block_id] = None  # tail: reused last, stays findable in the cache longest
            if block.hash is None:
                self._free.move_to_end(block_id, last=False)  # nothing cached: reuse it first

    def free(self, seq: Sequence) -> None:
        """Drop every reference the sequence holds and clear its table. Safe to call twice.

        Its KV is gone, so ``num_computed_tokens``, ``num_cached_tokens`` and its draft KV
        tokens drop to 0 too (read ``num_cached_tokens`` first if a usage report needs it);
        whether its hits need draft KV is kept until ``forget_draft_kv``. Call it before
        ``Sequence.reset_for_recompute``, which clears the table without freeing it.
        """
        for block_id in reversed(seq.block_table):  # tail blocks enter the LRU queue first
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        self._draft_tokens.pop(seq.seq_id, None)
        self._seq_committed.pop(seq.seq_id, None)
        self._seq_draft_marked.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, new_len: int) -> None:
        """Speculative rollback: keep ``ceil(new_len / block_size)`` blocks, free the rest.

        Clamps ``num_computed_tokens`` to ``new_len`` (KV past it is no longer valid); does not
        touch ``seq.token_ids``. Raises ValueError if ``new_len`` cuts into committed blocks.
        """
        committed_tokens = self.num_committed_tokens(seq)
        if new_len < committed_tokens:
            raise ValueError(
                f"cannot truncate sequence {seq.seq_id} to {new_len} tokens: its first "
                f"{committed_tokens} tokens are in committed (cached or shared) blocks; roll back "
                "only tokens past num_computed_tokens at the last commit_computed()"
            )
        keep = -(-new_len // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            assert block.hash is None and block.ref_count == 1, "truncating a shared block"
            self._release(block_id)
        del seq.block_table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, new_len)
        if seq.seq_id in self._seq_draft_marked:
            self._seq_draft_marked[seq.seq_id] = min(self._seq_draft_marked[seq.seq_id], keep)
        if not seq.block_table:
            self._seq_committed.pop(seq.seq_id, None)
            self._seq_draft_marked.pop(seq.seq_id, None)

    # ------------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        """Assert the internal invariants (O(num_blocks); for tests and debugging)."""
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has a negative ref count"
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: ref_count {block.ref_count} but "
                f"{'in' if block.block_id in self._free else 'not in'} the free queue"
            )
            if block.hash is not None:
                assert self._hash_to_block.get(block.hash) == block.block_id
            if block.ref_count > 1:
                assert block.hash is not None, f"block {block.block_id} shared but not cached"
        for h, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].hash == h
