"""The KV cache layer, pure Python over integers: a page pool, two prefix indexes (hash, radix) and
the KVCacheManager the scheduler talks to. Nothing here imports torch."""

from kvserve.cache.hashing import page_hash, page_hashes
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.sequence import PrefixHit
from kvserve.cache.pages import NULL_PAGE, PagePool
from kvserve.cache.prefix_hash import HashPrefixIndex
from kvserve.cache.prefix_radix import RadixPrefixIndex

__all__ = ["KVCacheManager", "PrefixHit", "PagePool", "NULL_PAGE", "HashPrefixIndex",
           "RadixPrefixIndex", "page_hash", "page_hashes"]
