from querystr import build_query, parse_query


def test_encoded_ampersand_stays_in_value():
    assert parse_query("q=rock%26roll&page=2") == {"q": ["rock&roll"], "page": ["2"]}


def test_encoded_equals_sign_in_key_and_value():
    assert parse_query("a%3Db=c%3Dd") == {"a=b": ["c=d"]}


def test_round_trip_with_reserved_characters():
    params = {"filter": "price>=10&stock=yes", "note": "50% + more", "k&v": ["x=y", "1+1"]}
    assert parse_query(build_query(params)) == {
        "filter": ["price>=10&stock=yes"],
        "note": ["50% + more"],
        "k&v": ["x=y", "1+1"],
    }


def test_empty_query():
    assert parse_query("") == {}
    assert parse_query("?") == {}
