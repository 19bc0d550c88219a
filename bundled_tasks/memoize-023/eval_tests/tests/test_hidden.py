from memo import memoize


def test_keyword_values_are_part_of_the_key():
    @memoize()
    def area(side, scale=1):
        return side * side * scale

    assert area(2, scale=1) == 4
    assert area(2, scale=3) == 12
    assert area(2, scale=1) == 4


def test_positional_and_keyword_calls_with_different_values():
    seen = []

    @memoize()
    def fetch(url, timeout=5):
        seen.append(timeout)
        return (url, timeout)

    assert fetch("x", timeout=1) == ("x", 1)
    assert fetch("x", timeout=2) == ("x", 2)
    assert seen == [1, 2]
    assert fetch.cache_info().size == 2


def test_cache_clear_resets():
    @memoize()
    def ident(x):
        return x

    ident(1)
    ident.cache_clear()
    assert ident.cache_info().size == 0
