"""HashPrefixIndex (vLLM-style): chained full-page hash -> page. Pages are indexed as they fill;
a lookup walks the chain of the query's full-page hashes from the first page and stops at the first miss.

Eviction is the pool's: a freed cached page goes to the LRU tail, allocation takes the head and tells
this index to forget it. Beside each hash the index keeps the page's tokens, its parent hash and (for
a first page) its namespace, and checks them on every hit, so a hash collision is a miss, never a
wrong page.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.cache.hashing import page_hash, page_hashes
from kvserve.cache.pages import PagePool


CHAIN_MEMO_SIZE = 256  # queries whose page hashes are remembered


@dataclass(slots=True)
class _Entry:
    page_hash: bytes
    parent: bytes | None
    namespace: str  # only for a first page (parent None); "" otherwise
    token_ids: tuple[int, ...]


class HashPrefixIndex:
    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.page_size = page_size
        self._pool = pool
        self._page_by_hash: dict[bytes, int] = {}
        self._entries: dict[int, _Entry] = {}
        # The scheduler looks up every waiting request each step: remember their hash chains.
        self._chains: OrderedDict[tuple, list[bytes]] = OrderedDict()
        pool.listener = self

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, token_ids: Sequence[int], namespace: str) -> tuple[list[int], int]:
        """Cached pages for the longest run of full pages of `token_ids`, and the tokens they hold."""
        ps = self.page_size
        pages: list[int] = []
        parent: bytes | None = None
        for i, h in enumerate(self._chain(token_ids, namespace)):
            tokens = tuple(token_ids[i * ps:(i + 1) * ps])
            page = self._page_by_hash.get(h)
            if page is None:
                break
            entry = self._entries[page]
            if (entry.token_ids != tokens or entry.parent != parent
                    or (parent is None and entry.namespace != namespace)):
                break  # a collision: treat as a miss
            pages.append(page)
            parent = h
        return pages, len(pages) * ps

    def _chain(self, token_ids: Sequence[int], namespace: str) -> list[bytes]:
        key = (namespace, tuple(token_ids[:len(token_ids) // self.page_size * self.page_size]))
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = page_hashes(key[1], self.page_size, namespace)
            if len(self._chains) > CHAIN_MEMO_SIZE:
                self._chains.popitem(last=False)
        else:
            self._chains.move_to_end(key)
        return chain

    def on_hit(self, token_ids: Sequence[int], namespace: str, num_pages: int) -> None:
        """Nothing to do: taking refs on the pages already took them off the pool's LRU."""

    def insert(self, token_ids: Sequence[int], namespace: str, block_table: list[int],
               page_hashes: list[bytes], start_page: int, end_page: int) -> int:
        """Index pages start_page..end_page-1 of a sequence (all full of computed tokens). A page whose
        content is already cached in another page stays private: the first copy wins. Returns
        end_page (all of them are committed)."""
        ps = self.page_size
        for i in range(start_page, end_page):
            page, h = block_table[i], page_hashes[i]
            if self._pool.is_cached(page):  # a hit page, or a fork sibling indexed it already
                assert self._entries[page].page_hash == h, f"page {page} is indexed with other content"
                continue
            if h in self._page_by_hash:
                continue
            parent = page_hashes[i - 1] if i else None
            self._page_by_hash[h] = page
            self._entries[page] = _Entry(h, parent, namespace if parent is None else "",
                                         tuple(token_ids[i * ps:(i + 1) * ps]))
            self._pool.mark_cached(page)
        return end_page

    def page_tokens(self, page_id: int) -> tuple[int, ...] | None:
        entry = self._entries.get(page_id)
        return None if entry is None else entry.token_ids

    def clear(self) -> None:
        for page in self._entries:
            self._pool.unmark_cached(page)
        self._entries.clear()
        self._page_by_hash.clear()

    # -- pool listener -------------------------------------------------------------------------
    def choose_victim(self) -> int | None:
        return None  # the pool's LRU head: least recently freed

    def choose_victim_among(self, wanted) -> int | None:
        """The least recently freed cached idle page for which `wanted(page)` holds, or None."""
        return next((page for page in self._pool.idle_pages() if wanted(page)), None)

    def on_evict(self, page_id: int) -> None:
        entry = self._entries.pop(page_id)
        del self._page_by_hash[entry.page_hash]

    def on_idle(self, page_id: int) -> None:
        pass

    def check_invariants(self) -> None:
        assert len(self._page_by_hash) == len(self._entries) == self._pool.num_cached
        for h, page in self._page_by_hash.items():
            entry = self._entries[page]
            assert entry.page_hash == h, f"page {page} is indexed under two hashes"
            assert len(entry.token_ids) == self.page_size
            assert page_hash(entry.parent, entry.token_ids, entry.namespace) == h, (
                f"page {page}: stored tokens do not hash to its key")
            assert self._pool.is_cached(page), f"indexed page {page} is not marked cached"
