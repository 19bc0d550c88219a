import pytest

from csvline import ParseError, read_records, split_line


def test_plain_fields():
    assert split_line("a,b,,d") == ["a", "b", "", "d"]


def test_quoted_field_keeps_delimiter():
    assert split_line('1,"Smith, John",3') == ["1", "Smith, John", "3"]


def test_unterminated_quote_is_an_error():
    with pytest.raises(ParseError):
        split_line('a,"open')


def test_records_use_header():
    text = "name;age\nada;36\n"
    assert read_records(text, delimiter=";") == [{"name": "ada", "age": "36"}]
