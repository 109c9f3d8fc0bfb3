"""Fixed-size KV blocks: free list, reference counts, and prefix caching.

A full block's hash chains over (parent block's hash, its token ids), so equal hashes mean
equal prefixes up to that block; the tokens are still compared on a hit. A block enters the
prefix cache only once its K/V are computed (`mark_computed`), so a hit never reads a slot
that is still being filled. Freed blocks keep their hash and wait in LRU order: a later
request can revive them until the allocator needs them back.

    free (LRU → MRU):  [b7 (cached h3)] [b2] [b9 (cached h8)]     hash_to_block: {h3: 7, h8: 9}
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Python's tuple-of-ints hash is deterministic (no per-process seed for ints)."""
    return hash((parent, token_ids))


class BlockManager:
    """Owns every KV block; sequences hold block ids in their block tables."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0           # prompt tokens looked up
        self.prefix_hits = 0              # of which served from the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached free blocks count as free)."""
        return 1.0 - len(self.free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------- prefix hits
    def _hits(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((seq.num_tokens - 1) // bs):          # full blocks, never the last token
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, toks)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != toks:
                break
            hits.append(bid)
            parent = h
        return hits

    # -------------------------------------------------------------- allocation
    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._hits(seq)
        need_free = self.blocks_needed(seq.num_tokens) - sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return len(self.free) >= need_free

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        hits = self._hits(seq)
        parent = None
        for bid in hits:
            b = self.blocks[bid]
            if b.ref_count == 0:
                del self.free[bid]
            b.ref_count += 1
            seq.block_table.append(bid)
            parent = chain_hash(parent, b.token_ids)
            seq.block_hashes.append(parent)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_free().block_id)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_tokens

    def _take_free(self) -> Block:
        bid, _ = self.free.popitem(last=False)               # least recently freed first
        b = self.blocks[bid]
        if b.hash is not None and self.hash_to_block.get(b.hash) == bid:
            del self.hash_to_block[b.hash]                    # evicted from the prefix cache
        b.hash, b.token_ids, b.ref_count = None, (), 1
        return b

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Add blocks so the slots of the next `num_new_tokens` tokens exist."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free().block_id)

    def mark_computed(self, seq: Sequence) -> None:
        """Register newly computed full blocks in the prefix cache."""
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), full):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, toks)
            seq.block_hashes.append(h)
            if not self.enable_prefix_caching:
                continue
            b = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block:                   # first writer wins; duplicates stay private
                b.hash, b.token_ids = h, toks
                self.hash_to_block[h] = b.block_id

    def deallocate(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; tail blocks go first in LRU order so they are evicted first."""
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref_count -= 1
            assert b.ref_count >= 0
            if b.ref_count == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
