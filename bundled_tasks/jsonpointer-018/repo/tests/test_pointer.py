import pytest

from jsonptr import PointerError, make_pointer, resolve, split_pointer

DOC = {"foo": ["bar", "baz"], "": 0, "a/b": 1, "m~n": 8, "k\"l": 6}


def test_rfc_examples():
    assert resolve(DOC, "") is DOC
    assert resolve(DOC, "/foo/0") == "bar"
    assert resolve(DOC, "/") == 0
    assert resolve(DOC, "/a~1b") == 1
    assert resolve(DOC, "/m~0n") == 8
    assert resolve(DOC, '/k"l') == 6


def test_bad_array_indices():
    for pointer in ("/foo/2", "/foo/01", "/foo/-", "/foo/x"):
        with pytest.raises(PointerError):
            resolve(DOC, pointer)


def test_make_pointer_escapes():
    assert make_pointer(["a/b", "m~n", 3]) == "/a~1b/m~0n/3"
    assert split_pointer("/x/y") == ["x", "y"]
