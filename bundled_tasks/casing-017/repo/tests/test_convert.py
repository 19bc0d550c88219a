from casing import to_camel, to_kebab, to_snake


def test_camel_to_snake():
    assert to_snake("parseJsonData") == "parse_json_data"
    assert to_snake("userId2") == "user_id2"


def test_already_separated_names():
    assert to_snake("max-retry count") == "max_retry_count"
    assert to_kebab("__private_name__") == "private-name"


def test_to_camel():
    assert to_camel("parse_json_data") == "parseJsonData"
    assert to_camel("parse-json-data", upper_first=True) == "ParseJsonData"
    assert to_camel("") == ""
