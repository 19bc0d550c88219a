from memo.cache import CacheInfo, memoize

__all__ = ["CacheInfo", "memoize"]
