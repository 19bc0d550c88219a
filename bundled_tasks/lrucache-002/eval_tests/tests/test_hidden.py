from lrucache import LRUCache


def test_updating_existing_key_keeps_other_entries():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("b", 3)
    assert len(cache) == 2
    assert cache.get("a") == 1
    assert cache.get("b") == 3


def test_update_does_not_report_eviction():
    evicted = []
    cache = LRUCache(3, on_evict=lambda k, v: evicted.append(k))
    for key in "xyz":
        cache.put(key, 0)
    cache.put("y", 1)
    cache.put("z", 2)
    assert evicted == []
    assert list(cache.keys()) == ["x", "y", "z"]


def test_update_makes_key_most_recent():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 10)
    cache.put("c", 3)
    assert list(cache.keys()) == ["a", "c"]
