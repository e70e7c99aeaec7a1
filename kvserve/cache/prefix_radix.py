"""RadixPrefixIndex (SGLang-style): a token tree over whole pages, one subtree per namespace. A node
holds a run of pages (their tokens and page ids); its children are keyed by their first page's tokens.

    root["tenant-a"] ── [sys prompt: p1 p2 p3] ─┬─ [question 1: p4 p5]      one node per run;
                                                └─ [question 2: p9]        a child per first page

Matching is token-granular: a query that diverges inside a cached page still hits that page as a
partial page (the manager copies it). Using part of a run (a hit, or a commit that retraces cached
content) splits the node where the use ends, so the unused rest keeps its older access time.

Locks are the pool's ref counts. Whoever holds a tree page holds its whole path from the root (hits
start at the root; a commit that finds its content already cached swaps its own page for the cached
one, or stops indexing there while a fork shares its copy), so refs never grow going down a path:
a page in use locks its path up to the root, as SGLang's lock_ref does, and every cached idle page
becomes an evictable leaf page once the idle pages below it are gone. The pool asks `choose_victim` whenever it has no uncached free page: the
last page of the least recently used leaf whose last page is idle (a lazy heap).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from kvserve.cache.hashing import common_prefix_len
from kvserve.cache.pages import PagePool


@dataclass(slots=True, eq=False)
class _Node:
    key: tuple[int, ...]  # tokens of the first page; () for a namespace root
    token_ids: list[int]  # len(page_ids) * page_size tokens
    page_ids: list[int]
    parent: _Node | None  # None for a root and for a node that was evicted
    namespace: str
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_access: int = 0


class RadixPrefixIndex:
    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.page_size = page_size
        self._pool = pool
        self._roots: dict[str, _Node] = {}
        self._node_of_page: dict[int, _Node] = {}
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, tiebreak, leaf), lazily pruned
        self._clock = 0
        self._tiebreak = itertools.count()
        pool.listener = self

    def __len__(self) -> int:
        return len(self._node_of_page)

    # -- lookup --------------------------------------------------------------------------------
    def match(self, token_ids: list[int], namespace: str) -> tuple[list[int], int]:
        """Pages covering the longest cached prefix of `token_ids` and its length in tokens; when
        that length is not page-aligned the last page matches only in its first tokens."""
        ps, n = self.page_size, len(token_ids)
        node = self._roots.get(namespace)
        pages: list[int] = []
        pos = 0
        while node is not None:
            child = node.children.get(tuple(token_ids[pos:pos + ps])) if pos + ps <= n else None
            if child is None:  # the query ends or diverges inside the next page: best partial page
                best_page, best_len = 0, 0
                if ps > 1 and pos < n:
                    rest = token_ids[pos:pos + ps]
                    for other in node.children.values():
                        if other.key[0] == rest[0]:
                            length = common_prefix_len(other.key, rest)
                            if length > best_len:
                                best_page, best_len = other.page_ids[0], length
                if best_len:
                    pages.append(best_page)
                return pages, pos + best_len
            num_full = self._num_equal_pages(child, token_ids, pos, (n - pos) // ps)
            pages += child.page_ids[:num_full]
            pos += num_full * ps
            if num_full < len(child.page_ids):  # ends or diverges inside page num_full of the run
                length = common_prefix_len(child.token_ids[num_full * ps:(num_full + 1) * ps],
                                            token_ids[pos:pos + ps])
                if length:
                    pages.append(child.page_ids[num_full])
                return pages, pos + length
            node = child
        return pages, pos

    def _num_equal_pages(self, node: _Node, token_ids: list[int], pos: int, limit: int) -> int:
        """How many leading pages of node's run (at most `limit`) equal the pages of `token_ids`
        from `pos`. One slice comparison in the common all-equal case."""
        ps = self.page_size
        num = min(len(node.page_ids), limit)
        if node.token_ids[:num * ps] == token_ids[pos:pos + num * ps]:
            return num
        j = 0
        while node.token_ids[j * ps:(j + 1) * ps] == token_ids[pos + j * ps:pos + (j + 1) * ps]:
            j += 1
        return j

    def on_hit(self, token_ids: list[int], namespace: str, num_pages: int) -> None:
        """A sequence took the first `num_pages` full pages of a hit: split the node where they end and
        mark the path used now."""
        ps = self.page_size
        node = self._roots[namespace]
        i = 0
        while i < num_pages:
            child = node.children[tuple(token_ids[i * ps:(i + 1) * ps])]
            taken = min(len(child.page_ids), num_pages - i)
            i += taken
            if taken < len(child.page_ids):
                child = self._split(child, taken)
            self._touch(child)
            node = child

    # -- insert --------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], namespace: str, block_table: list[int],
               page_hashes: list[bytes], start_page: int, end_page: int) -> int:
        """Index pages start_page..end_page-1 of a sequence (pages before start_page are in the tree
        already). Where the tree already holds a page's content, the sequence's own copy is swapped
        for the cached page in `block_table` (same tokens, same positions: same KV) and released.
        Returns how many leading pages of the sequence are now in the tree: end_page, or less when
        an own copy to swap is shared with a fork (it stays private; a later commit retries)."""
        ps = self.page_size
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node((), [], [], None, namespace)
        i = 0
        while i < end_page:
            child = node.children.get(tuple(token_ids[i * ps:(i + 1) * ps]))
            if child is None:
                if node.parent is not None and not node.children:
                    self._extend_leaf(node, token_ids[i * ps:end_page * ps], block_table[i:end_page])
                else:
                    self._add_leaf(node, token_ids[i * ps:end_page * ps], block_table[i:end_page])
                return end_page
            num_equal = self._num_equal_pages(child, token_ids, i * ps, end_page - i)
            num = num_equal
            if block_table[i:i + num] != child.page_ids[:num]:
                num = self._swap_in_cached(child, block_table, i, num, start_page)
                if num == 0:
                    return i
            i += num
            if num < len(child.page_ids):  # the sequence ends or diverges inside the run:
                child = self._split(child, num)  # only the part it covers counts as used now
            self._touch(child)
            if num < num_equal:
                return i  # stopped before an own copy that a fork shares
            node = child
        return end_page

    def _swap_in_cached(self, node: _Node, block_table: list[int], first: int, num: int,
                        start_page: int) -> int:
        """The sequence computed the content of node's first `num` pages itself: use the cached
        pages instead. Stops before an own copy that a fork shares (it cannot be swapped for both);
        returns how many pages now match."""
        for k in range(first, first + num):
            cached, own = node.page_ids[k - first], block_table[k]
            if own == cached:
                continue
            assert k >= start_page, "a committed page left the tree while in use"
            assert not self._pool.is_cached(own)
            if self._pool.ref(own) > 1:
                return k - first
            self._pool.incref(cached)
            self._pool.decref(own)
            block_table[k] = cached
        return num

    def _extend_leaf(self, leaf: _Node, token_ids: list[int], page_ids: list[int]) -> None:
        """Append a sequence's next pages to the leaf it already ends in (decode grows one run,
        not a chain of one-page nodes)."""
        leaf.token_ids += token_ids
        leaf.page_ids += page_ids
        for page in page_ids:
            self._pool.mark_cached(page)
            self._node_of_page[page] = leaf
        self._touch(leaf)

    def _add_leaf(self, parent: _Node, token_ids: list[int], page_ids: list[int]) -> None:
        leaf = _Node(tuple(token_ids[:self.page_size]), list(token_ids), list(page_ids), parent,
                     parent.namespace)
        parent.children[leaf.key] = leaf
        for page in page_ids:
            self._pool.mark_cached(page)
            self._node_of_page[page] = leaf
        self._touch(leaf)

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut `node` after its first `num_pages` pages; returns the new upper node. `node` keeps the
        lower part (and its heap entries, its last page being unchanged)."""
        ps = self.page_size
        assert node.parent is not None and 0 < num_pages < len(node.page_ids)
        upper = _Node(node.key, node.token_ids[:num_pages * ps], node.page_ids[:num_pages],
                      node.parent, node.namespace, last_access=node.last_access)
        node.parent.children[node.key] = upper
        del node.token_ids[:num_pages * ps]
        del node.page_ids[:num_pages]
        node.key = tuple(node.token_ids[:ps])
        node.parent = upper
        upper.children[node.key] = node
        for page in upper.page_ids:
            self._node_of_page[page] = upper
        return upper

    # -- eviction (pool listener) --------------------------------------------------------------
    def _touch(self, node: _Node) -> None:
        self._clock += 1
        node.last_access = self._clock
        if not node.children:
            self._push(node)

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))
        if len(self._heap) > 2 * len(self._node_of_page) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        leaves = {id(n): n for n in self._node_of_page.values() if not n.children}
        self._heap = [(n.last_access, next(self._tiebreak), n) for n in leaves.values()]
        heapq.heapify(self._heap)

    def _is_evictable(self, node: _Node) -> bool:
        return (node.parent is not None and bool(node.page_ids) and not node.children
                and self._pool.ref(node.page_ids[-1]) == 0)

    def choose_victim(self) -> int | None:
        for attempt in range(2):
            while self._heap:
                access, _, node = self._heap[0]
                if access == node.last_access and self._is_evictable(node):
                    return node.page_ids[-1]
                heapq.heappop(self._heap)
            if attempt == 0:
                self._rebuild_heap()  # never needed if the heap is complete; cheap insurance
        raise AssertionError("the pool has cached idle pages but the tree has no evictable leaf")

    def choose_victim_among(self, wanted) -> int | None:
        """The least recently used evictable leaf page for which `wanted(page)` holds, or None.
        (A scan of the leaves: used only by fair-share eviction.)"""
        for access, _, node in sorted(self._heap, key=lambda item: item[:2]):
            if access == node.last_access and self._is_evictable(node) and wanted(node.page_ids[-1]):
                return node.page_ids[-1]
        return None

    def on_evict(self, page_id: int) -> None:
        node = self._node_of_page.pop(page_id)
        assert node.page_ids[-1] == page_id and not node.children, "evicting a page with cached pages below"
        node.page_ids.pop()
        del node.token_ids[-self.page_size:]
        if node.page_ids:
            return
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        node.parent = None
        if parent.parent is None:
            if not parent.children:
                del self._roots[parent.namespace]
        elif not parent.children:
            self._push(parent)  # a new leaf

    def on_idle(self, page_id: int) -> None:
        node = self._node_of_page.get(page_id)
        if node is not None and node.page_ids[-1] == page_id:
            self._touch(node)  # released now: the most recently used leaf

    # -- maintenance ---------------------------------------------------------------------------
    def page_tokens(self, page_id: int) -> tuple[int, ...] | None:
        node = self._node_of_page.get(page_id)
        if node is None:
            return None
        j = node.page_ids.index(page_id)
        return tuple(node.token_ids[j * self.page_size:(j + 1) * self.page_size])

    def clear(self) -> None:
        for page in self._node_of_page:
            self._pool.unmark_cached(page)
        self._roots.clear()
        self._node_of_page.clear()
        self._heap.clear()

    def check_invariants(self) -> None:
        ps = self.page_size
        heap_entries = {(id(n), access) for access, _, n in self._heap}
        num_pages = 0
        for namespace, root in self._roots.items():
            assert root.namespace == namespace and root.parent is None and not root.page_ids
            assert root.children, f"empty root for namespace {namespace!r}"
            stack = [(root, float("inf"))]
            while stack:
                node, parent_ref = stack.pop()
                for key, child in node.children.items():
                    assert child.parent is node and child.key == key and child.namespace == namespace
                    assert child.page_ids and len(child.token_ids) == len(child.page_ids) * ps
                    assert key == tuple(child.token_ids[:ps])
                    ref = parent_ref
                    for page in child.page_ids:
                        assert self._node_of_page.get(page) is child, f"page {page} map is stale"
                        assert self._pool.is_cached(page), f"tree page {page} is not marked cached"
                        assert self._pool.ref(page) <= ref, f"page {page} is held without its prefix"
                        ref = self._pool.ref(page)
                    num_pages += len(child.page_ids)
                    if self._is_evictable(child):
                        assert (id(child), child.last_access) in heap_entries, "evictable leaf not in heap"
                    stack.append((child, ref))
        assert num_pages == len(self._node_of_page) == self._pool.num_cached
