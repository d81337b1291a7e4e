"""SuffixTrie: counts of every substring (up to ``max_depth`` tokens) of a set of token documents,
grown one token at a time, for suffix decoding (SuffixDecoding, arXiv 2411.04975).

A node stands for one substring ``s``: ``count`` is how many times ``s`` occurs (occurrences end
anywhere in any document), ``children[c]`` is the node of ``s + c``, ``total`` the sum of the
children's counts (the occurrences of ``s`` that have a next token), ``best`` the child with the
highest count (ties: the one that occurred last), ``doc``/``pos`` where the latest occurrence
ends. The draft for a context is the most frequent continuation of its longest suffix that occurs
in the trie (see ``walk``).

Compression (why memory stays near linear). Most substrings occur once; materializing all of
them would take ``len * max_depth`` nodes. Invariants instead:
    * every node counts every occurrence of its substring (it is never partial);
    * a node with ``count >= 2`` (or the root) has ALL its continuations as real children;
    * a node with ``count == 1`` has none until its substring occurs a second time (its one
      continuation is read from the document: ``docs[doc][pos + 1:]``).
When a node's count goes 1 -> 2 it materializes the child of its earlier occurrence, so the
invariants hold one step later. Worked example, appending ``a a a`` (depth 3):
    "a"   : root child, count 1 (no children: its continuation is virtual)
    "a a" : "a" -> 2 and materializes its earlier continuation "aa" (count 1, ending at 1)
    "aaa" : "aa" -> 2 (materializes "aaa", ending at 2); "a" -> 3. Counts: a 3, aa 2, aaa 1.

Growing a document keeps ``active[doc]``: the nodes of its suffixes of length 0, 1, .., m (all
real; a longer suffix occurs at most once and stays virtual). A new token ``t`` adds one
occurrence below each active node, deepest first (so a node's count read by a deeper level is
still the count before this token), then the next active list is ``active[d].children[t]``.
Cost per token: O(max_depth), independent of the document's length.

Removing a document (global-cache eviction) decrements the nodes of its substrings. Documents
are removed oldest first, so a surviving node's latest occurrence never points into a removed
document (if its newest occurrence were in the oldest document, all of them were).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class _Node:
    __slots__ = ("token", "depth", "count", "total", "children", "best", "doc", "pos")

    def __init__(self, token: int, depth: int, doc: int, pos: int) -> None:
        self.token = token
        self.depth = depth
        self.count = 0
        self.total = 0
        self.children: dict[int, _Node] = {}
        self.best: _Node | None = None
        self.doc = doc
        self.pos = pos


class SuffixTrie:
    """Substring counts over documents (token lists), depth-bounded and compressed."""

    def __init__(self, max_depth: int = 32) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (got {max_depth})")
        self.max_depth = max_depth
        self.root = _Node(-1, 0, -1, -1)
        self.docs: dict[int, list[int]] = {}
        self.base: dict[int, int] = {}  # doc -> its first token's stamp (recency order)
        self._active: dict[int, list[_Node]] = {}
        self._clock = 0
        self.num_tokens = 0  # tokens held over all documents
        self.num_nodes = 0

    # ---- building ---------------------------------------------------------------------------

    def extend(self, doc: int, tokens: Iterable[int]) -> None:
        """Appends tokens to document ``doc`` (created on first use)."""
        if doc not in self.docs:
            self.docs[doc] = []
            self.base[doc] = self._clock
            self._active[doc] = [self.root]
        for t in tokens:
            self._append(doc, int(t))

    def close(self, doc: int) -> None:
        """The document will not grow any more: drop its growth state (its counts stay)."""
        self._active.pop(doc, None)

    def _stamp(self, node: _Node) -> int:
        return self.base[node.doc] + node.pos

    def _append(self, doc: int, t: int) -> None:
        text = self.docs[doc]
        i = len(text)
        text.append(t)
        self._clock += 1
        self.num_tokens += 1
        active = self._active[doc]
        top = self.max_depth - 1
        for d in range(min(len(active) - 1, top), -1, -1):  # deepest first
            parent = active[d]
            if d and parent.count < 2:  # only occurrence: its continuation stays virtual
                continue
            child = parent.children.get(t)
            if child is None:
                child = parent.children[t] = _Node(t, d + 1, doc, i)
                self.num_nodes += 1
            elif child.count == 1 and not child.children and child.depth < self.max_depth:
                self._materialize(child)
            child.count += 1
            parent.total += 1
            child.doc, child.pos = doc, i
            # The child has the newest stamp, so it wins ties; an unknown best stays unknown
            # (recomputed when read) unless this is the only child.
            if parent.best is not None and child.count >= parent.best.count:
                parent.best = child
            elif parent.best is None and len(parent.children) == 1:
                parent.best = child
        nxt = [self.root]
        for d in range(min(len(active), self.max_depth)):
            node = active[d].children.get(t)
            if node is None:
                break
            nxt.append(node)
        self._active[doc] = nxt

    def _materialize(self, node: _Node) -> None:
        """``node`` is about to get its second occurrence: give its first one a real child."""
        text = self.docs[node.doc]
        if node.pos + 1 >= len(text):
            return  # the earlier occurrence ends its document: no continuation
        g = _Node(text[node.pos + 1], node.depth + 1, node.doc, node.pos + 1)
        g.count = 1
        node.children[g.token] = g
        node.total = 1
        node.best = g
        self.num_nodes += 1

    def remove(self, doc: int) -> None:
        """Forgets document ``doc`` (must be the oldest one still held)."""
        text = self.docs.pop(doc)
        self._active.pop(doc, None)
        for s in range(len(text)):
            node = self.root
            for d in range(min(self.max_depth, len(text) - s)):
                child = node.children.get(text[s + d])
                if child is None:
                    break
                child.count -= 1
                node.total -= 1
                if child.count == 0:
                    del node.children[child.token]
                    self.num_nodes -= 1 + _size(child)
                if node.best is child:
                    node.best = None  # recomputed when next read
                if child.count == 0:
                    break
                node = child
        self.base.pop(doc)
        self.num_tokens -= len(text)

    # ---- the interface shared with the C++ trie (draft/csrc/suffix_trie.cpp) ----------------

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    def doc_length(self, doc: int) -> int:
        return len(self.docs.get(doc, ()))

    def count_of(self, sub: list[int]) -> int:
        """Count of a substring's real node, or -1 when it has none."""
        node: _Node | None = self.root
        for t in sub:
            node = node.children.get(t) if node is not None else None
        return -1 if node is None else node.count

    def speculate_own(
        self, doc: int, k: int, factor: float, min_prob: float
    ) -> tuple[list[int], list[float], int]:
        """The best draft from a growing document's own earlier text: (tokens, probabilities,
        match length). Every suffix that occurred earlier with a next token is a candidate,
        longest first; each drafts at most ``max(1, min(k, floor(factor * length)))`` tokens
        (see ``walk``), and the highest score (expected accepted tokens, the sum of the
        probabilities) wins; a tie keeps the longer match. A candidate whose budget cannot beat
        the best score so far ends the search (shorter ones have smaller budgets)."""
        best: tuple[list[int], list[float], int] = ([], [], 0)
        best_score = 0.0
        for node in reversed(self._active[doc][1 : self.max_depth]):
            if node.total <= 0:
                continue
            budget = _budget(node.depth, k, factor)
            if budget <= best_score:
                break
            tokens, probs = self.walk(node, 0, budget, min_prob)
            score = _score(probs)
            if score > best_score:
                best, best_score = (tokens, probs, node.depth), score
        return best

    def speculate(
        self, context: list[int], longest: int, k: int, factor: float, min_prob: float
    ) -> tuple[list[int], list[float], int, int]:
        """The best draft for ``context`` from the held documents, candidates as in
        ``speculate_own`` (suffixes of at most ``longest`` and max_depth - 1 tokens that occur
        with a next token): (tokens, probabilities, winning match length, longest match)."""
        n = len(context)
        best: tuple[list[int], list[float], int] = ([], [], 0)
        best_score, longest_hit = 0.0, 0
        for length in range(min(longest, self.max_depth - 1, n), 0, -1):
            budget = _budget(length, k, factor)
            if budget <= best_score:
                break
            hit = self._descend(context, n - length)
            if hit is None:
                continue
            longest_hit = longest_hit or length
            tokens, probs = self.walk(hit[0], hit[1], budget, min_prob)
            score = _score(probs)
            if score > best_score:
                best, best_score = (tokens, probs, length), score
        return (*best, longest_hit)

    # ---- matching ---------------------------------------------------------------------------

    def _best(self, node: _Node) -> _Node:
        if node.best is None:
            node.best = max(node.children.values(), key=lambda c: (c.count, self._stamp(c)))
        return node.best

    def find(self, context: list[int], longest: int) -> tuple[_Node, int] | None:
        """The longest suffix of ``context`` (at most ``longest`` and max_depth - 1 tokens) that
        occurs with a next token: (the deepest real node on its path, tokens matched past it in
        that node's document), or None."""
        n = len(context)
        for length in range(min(longest, self.max_depth - 1, n), 0, -1):
            hit = self._descend(context, n - length)
            if hit is not None:
                return hit
        return None

    def _descend(self, context: list[int], start: int) -> tuple[_Node, int] | None:
        node = self.root
        i = start
        while i < len(context):
            child = node.children.get(context[i])
            if child is None:
                break
            node, i = child, i + 1
        extra = len(context) - i
        if extra:  # the rest must follow node's one (virtual) occurrence
            if node is self.root or node.count != 1 or node.children:
                return None
            text = self.docs[node.doc]
            if text[node.pos + 1 : node.pos + 1 + extra] != context[i:]:
                return None
        if node.total > 0:
            return node, 0
        if node.count == 1 or extra:  # one occurrence: does its document go on?
            if node.pos + extra + 1 < len(self.docs[node.doc]):
                return node, extra
        return None

    def walk(
        self, node: _Node, extra: int, budget: int, min_prob: float
    ) -> tuple[list[int], list[float]]:
        """The draft from a match: follow the most frequent child while the product of the
        choices' frequencies stays >= ``min_prob``; where the counts end (one occurrence, or the
        depth bound), copy what followed the latest occurrence. Returns tokens and the
        estimated probability of reaching each."""
        tokens: list[int] = []
        probs: list[float] = []
        p = 1.0
        while len(tokens) < budget:
            if extra == 0 and node.total > 0:
                best = self._best(node)
                p *= best.count / node.total
                if p < min_prob:
                    break
                tokens.append(best.token)
                probs.append(p)
                node = best
                continue
            text = self.docs[node.doc]
            start = node.pos + extra + 1
            tail = text[start : start + budget - len(tokens)]
            tokens.extend(tail)
            probs.extend([p] * len(tail))
            break
        return tokens, probs


def _budget(length: int, k: int, factor: float) -> int:
    """A match of ``length`` tokens earns at most ``factor * length`` draft tokens (and k)."""
    return max(1, min(k, math.floor(factor * length)))


def _score(probs: list[float]) -> float:
    total = 0.0
    for p in probs:  # left to right, as the C++ trie sums (the same float result)
        total += p
    return total


def _size(node: _Node) -> int:
    """Nodes below ``node`` (its subtree, itself excluded)."""
    stack, n = list(node.children.values()), 0
    while stack:
        c = stack.pop()
        n += 1
        stack.extend(c.children.values())
    return n
