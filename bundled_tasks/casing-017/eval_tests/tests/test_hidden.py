from casing import to_camel, to_kebab, to_snake, words


def test_acronym_followed_by_word():
    assert to_snake("parseHTTPResponse") == "parse_http_response"
    assert to_snake("HTTPServerError") == "http_server_error"


def test_acronym_round_trip_to_kebab_and_camel():
    assert to_kebab("XMLHttpRequest") == "xml-http-request"
    assert to_camel("IOError") == "ioError"
    assert words("getURLForID") == ["get", "url", "for", "id"]


def test_trailing_acronym_stays_together():
    assert to_snake("getID") == "get_id"
    assert to_snake("userAPI") == "user_api"
    assert to_snake("ID") == "id"
