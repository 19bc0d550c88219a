from jsonptr import make_pointer, resolve, split_pointer


def test_tilde_zero_one_decodes_to_tilde_one():
    assert split_pointer("/~01") == ["~1"]
    assert resolve({"~1": "tilde-one", "/": "slash"}, "/~01") == "tilde-one"


def test_round_trip_of_awkward_keys():
    for key in ["~1", "a~1b", "~0~1", "/~", "~~//"]:
        assert split_pointer(make_pointer([key])) == [key]


def test_plain_escapes_still_work():
    assert split_pointer("/a~1b/m~0n") == ["a/b", "m~n"]
