from wordwrap import fill, wrap


def test_long_first_word_has_no_blank_line():
    assert wrap("abcdefghij klm", 4) == ["abcd", "efgh", "ij", "klm"]


def test_unbroken_long_first_word():
    assert wrap("extraordinary day", 5, break_long_words=False) == ["extraordinary", "day"]


def test_fill_with_long_word_first():
    assert fill("xxxxxxxx y", 4) == "xxxx\nxxxx\ny"


def test_long_word_in_middle_still_flushes_line():
    assert wrap("hi abcdefgh yo", 4) == ["hi", "abcd", "efgh", "yo"]
