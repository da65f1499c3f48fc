"""Trie over chained block hashes: finds the longest cached prefix of a prompt.

Each node is one cached block; its parent is the block before it. A lookup walks the
trie by block hash (one dict probe per full block) and then, below the deepest full
match, looks for a child block whose first tokens equal the prompt's remaining tokens:
KV of a token depends only on the tokens before it, so the first k tokens of a cached
block serve any prompt that shares those k tokens. That is how a prompt shorter than
every stored prompt, or one that diverges inside a block, still gets a hit.

What must hold: a node's parent is in the trie (prefixes are closed under truncation),
so only leaves may be removed; `remove_subtree` removes a node with its descendants.
Not thread-safe: the owner (PrefixCache) serializes access.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lamina.kvstore.block_hash import ROOT_HASH, chain_hash


@dataclass(frozen=True)
class PrefixMatch:
    """Result of a lookup: the blocks that hold the prompt's cached prefix.

    `block_hashes` lists the full blocks, then (if `num_partial_tokens` > 0) the block
    whose first `num_partial_tokens` tokens extend the match.
    """

    block_hashes: tuple[str, ...]
    num_tokens: int
    num_partial_tokens: int

    @property
    def is_hit(self) -> bool:
        return self.num_tokens > 0

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_hashes) - (1 if self.num_partial_tokens else 0)


MISS = PrefixMatch((), 0, 0)


@dataclass
class _Node:
    block_hash: str
    parent_hash: str
    tokens: tuple[int, ...]
    # child hash -> node, and first token -> child hashes (narrows the partial scan).
    children: dict[str, _Node] = field(default_factory=dict)
    by_first_token: dict[int, set[str]] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._root = _Node(ROOT_HASH, "", ())
        self._nodes: dict[str, _Node] = {ROOT_HASH: self._root}

    def __len__(self) -> int:
        return len(self._nodes) - 1

    def __contains__(self, block_hash: str) -> bool:
        return block_hash != ROOT_HASH and block_hash in self._nodes

    def insert(self, parent_hash: str, tokens: Sequence[int]) -> str | None:
        """Adds the block after `parent_hash`; returns its hash, or None when the parent
        is not cached (the block would be unreachable)."""
        if len(tokens) != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {len(tokens)}")
        parent = self._nodes.get(parent_hash)
        if parent is None:
            return None
        block_hash = chain_hash(parent_hash, tokens)
        if block_hash not in self._nodes:
            node = _Node(block_hash, parent_hash, tuple(tokens))
            self._nodes[block_hash] = node
            parent.children[block_hash] = node
            parent.by_first_token.setdefault(node.tokens[0], set()).add(block_hash)
        return block_hash

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of `tokens`, at token granularity."""
        bs = self.block_size
        node = self._root
        hashes: list[str] = []
        pos = 0
        while pos + bs <= len(tokens):
            h = chain_hash(node.block_hash, tokens[pos:pos + bs])
            child = node.children.get(h)
            if child is None:
                break
            hashes.append(h)
            node = child
            pos += bs
        rest = tokens[pos:pos + bs]
        best_hash, best_len = None, 0
        if rest:
            for h in sorted(node.by_first_token.get(rest[0], ())):
                child_tokens = node.children[h].tokens
                n = _common_prefix_len(child_tokens, rest)
                # n < bs here: a full-block match was already taken by the hash walk.
                if n > best_len:
                    best_hash, best_len = h, n
        if best_hash is not None:
            hashes.append(best_hash)
        if not hashes:
            return MISS
        return PrefixMatch(tuple(hashes), pos + best_len, best_len)

    def parent_of(self, block_hash: str) -> str:
        return self._nodes[block_hash].parent_hash

    def tokens_of(self, block_hash: str) -> tuple[int, ...]:
        return self._nodes[block_hash].tokens

    def is_leaf(self, block_hash: str) -> bool:
        return not self._nodes[block_hash].children

    def children_of(self, block_hash: str) -> list[str]:
        return list(self._nodes[block_hash].children)

    def remove(self, block_hash: str) -> None:
        """Removes a leaf block."""
        node = self._nodes[block_hash]
        if node.children:
            raise ValueError(f"block {block_hash} has cached children; remove_subtree it")
        del self._nodes[block_hash]
        parent = self._nodes[node.parent_hash]
        del parent.children[block_hash]
        siblings = parent.by_first_token[node.tokens[0]]
        siblings.discard(block_hash)
        if not siblings:
            del parent.by_first_token[node.tokens[0]]

    def remove_subtree(self, block_hash: str) -> list[str]:
        """Removes a block and all its descendants; returns them, leaves first."""
        order: list[str] = []
        stack = [block_hash]
        while stack:
            h = stack.pop()
            order.append(h)
            stack.extend(self._nodes[h].children)
        removed = list(reversed(order))  # every child comes before its parent
        for h in removed:
            self.remove(h)
        return removed


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
