from wordwrap import fill, wrap


def test_wraps_at_word_boundaries():
    assert wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]


def test_fill_joins_lines():
    assert fill("aa bb cc", 5) == "aa bb\ncc"


def test_empty_text_gives_no_lines():
    assert wrap("   ", 8) == []
