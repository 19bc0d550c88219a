from lrucache import LRUCache


def test_evicts_least_recently_used():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")
    cache.put("c", 3)
    assert "b" not in cache
    assert list(cache.keys()) == ["a", "c"]


def test_hit_and_miss_counters():
    cache = LRUCache(1)
    cache.put("x", 1)
    assert cache.get("x") == 1
    assert cache.get("y", "none") == "none"
    assert (cache.hits, cache.misses) == (1, 1)


def test_on_evict_receives_entry():
    evicted = []
    cache = LRUCache(1, on_evict=lambda k, v: evicted.append((k, v)))
    cache.put("a", 1)
    cache.put("b", 2)
    assert evicted == [("a", 1)]
