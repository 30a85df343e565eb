"""The grammars' caches (app/engine/bounded_cache.py): least recently used out first, bounded by entries and by size."""

from app.engine.bounded_cache import BoundedCache


def test_the_least_recently_used_goes_first_past_the_entries_or_the_size():
    cache = BoundedCache(entries=3, size=100)
    for key in "abc":
        cache.put(key, key.upper(), 10)
    assert cache.get("a") == "A"  # now the most recently used
    cache.put("d", "D", 10)
    assert [cache.get(k) for k in "abcd"] == ["A", None, "C", "D"]  # past 3 entries: b went
    cache.put("e", "E", 95)
    assert len(cache) == 1 and cache.get("e") == "E"  # past 100 in size: everything older went
    cache.put("huge", "H", 101)
    assert cache.get("huge") is None and cache.get("e") == "E"  # larger than the whole cache: not kept
    cache.put("e", "E2", 5)
    assert cache.get("e") == "E2" and len(cache) == 1  # replaced, its size counted once
