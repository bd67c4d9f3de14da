"""A byte-bounded LRU radix cache of prompt-prefix keys/values, shared across requests.

Prompts are cut into blocks of `BLOCK` tokens; a tree per adapter maps block after block to
the keys/values of those positions (every layer, one tensor per block), as SGLang's radix
cache does at block granularity. A new prompt walks its tree as far as its blocks match, copies
those keys/values in and prefills only the rest, so 16 requests sharing a 1,000-token system
prompt compute it once. Keys/values depend on the adapter (LoRA on k/v and every earlier
layer), so each adapter has its own tree; engine adapter names are never reused, and a
removed adapter's tree is dropped.

Eviction is least recently used, leaves first: a lookup refreshes the path from the leaf up,
so a parent is always fresher than its children and the oldest entry is a leaf. Entries are
copies, never views of a running batch, so evicting one changes no result, only speed.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

#: Tokens per cached block.
BLOCK = 16


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    tokens: tuple[int, ...]
    #: [layers, 2 (keys, values), kv_heads, BLOCK, head_dim]; None for a root.
    kv: torch.Tensor | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._roots: dict[str | None, _Node] = {}
        self._lru: collections.OrderedDict[_Node, None] = collections.OrderedDict()

    def match_into(self, adapter: str | None, prompt: tuple[int, ...], kv: torch.Tensor) -> int:
        """Copy the keys/values of the longest cached block prefix of prompt[:-1] (the last
        prompt token is always computed: its logits pick the first token) into kv [layers,
        2, kv_heads, >= its length, dim], one copy per block; return its length in tokens
        (0: no hit)."""
        path = self._path(adapter, prompt)
        for n, hit in enumerate(path):
            assert hit.kv is not None
            kv[:, :, :, n * BLOCK : (n + 1) * BLOCK] = hit.kv
        for hit in reversed(path):
            self._lru.move_to_end(hit)
        return len(path) * BLOCK

    def matched(self, adapter: str | None, prompt: tuple[int, ...]) -> int:
        """Tokens `match_into` would copy for prompt, without copying or refreshing anything."""
        return len(self._path(adapter, prompt)) * BLOCK

    def _path(self, adapter: str | None, prompt: tuple[int, ...]) -> list[_Node]:
        """The cached blocks of prompt[:-1], root first, as far as they match."""
        node = self._roots.get(adapter)
        path: list[_Node] = []
        for start in range(0, len(prompt) - BLOCK, BLOCK):
            node = None if node is None else node.children.get(prompt[start : start + BLOCK])
            if node is None:
                break
            path.append(node)
        return path

    def branch(self, adapter: str | None, prompt: tuple[int, ...], length: int) -> int:
        """Tokens of the longest block prefix of prompt[:length] after which cached prompts
        diverge (its last block has several cached continuations): the part a batch of
        requests sharing a system prompt has in common. 0 when there is none."""
        node = self._roots.get(adapter)
        found = 0
        for start in range(0, length, BLOCK):
            if node is None:
                break
            node = node.children.get(prompt[start : start + BLOCK])
            if node is not None and len(node.children) > 1:
                found = start + BLOCK
        return found

    def insert(self, adapter: str | None, prompt: tuple[int, ...], kv: torch.Tensor) -> None:
        """Cache the full blocks of prompt[:-1] from kv [layers, 2, kv_heads, >= len, dim]
        that are not cached yet, then evict down to the byte bound."""
        if self.max_bytes <= 0:
            return
        node = self._roots.setdefault(adapter, _Node(None, (), None))
        path: list[_Node] = []
        for start in range(0, len(prompt) - BLOCK, BLOCK):
            block = prompt[start : start + BLOCK]
            child = node.children.get(block)
            if child is None:
                copy = kv[:, :, :, start : start + BLOCK].clone(
                    memory_format=torch.contiguous_format
                )
                child = _Node(node, block, copy)
                node.children[block] = child
                self.bytes += copy.numel() * copy.element_size()
            path.append(child)
            node = child
        for entry in reversed(path):
            self._lru[entry] = None
            self._lru.move_to_end(entry)
        self._evict()

    def drop(self, adapter: str | None) -> None:
        """Forget an adapter's tree (it was unloaded)."""
        root = self._roots.pop(adapter, None)
        stack = [] if root is None else list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._forget(node)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._lru:
            node = next(iter(self._lru))
            if node.children:  # cannot happen (parents are fresher), but never orphan a subtree
                self._lru.move_to_end(node)
                continue
            if node.parent is not None:
                del node.parent.children[node.tokens]
            self._forget(node)

    def _forget(self, node: _Node) -> None:
        if node in self._lru:
            del self._lru[node]
            assert node.kv is not None
            self.bytes -= node.kv.numel() * node.kv.element_size()
