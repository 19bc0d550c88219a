from csvline import read_records, split_line


def test_doubled_quote_inside_quoted_field():
    assert split_line('x,"say ""hi""",y') == ["x", 'say "hi"', "y"]


def test_field_that_is_only_a_quote():
    assert split_line('"""",end') == ['"', "end"]


def test_records_with_escaped_quotes():
    text = 'id,title\n7,"The ""Best"" Of, Vol. 2"\n'
    assert read_records(text) == [{"id": "7", "title": 'The "Best" Of, Vol. 2'}]


def test_empty_quoted_field():
    assert split_line('a,"",b') == ["a", "", "b"]
