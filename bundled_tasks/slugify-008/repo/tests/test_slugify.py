from slugs import slugify, unique_slug


def test_ascii_title():
    assert slugify("Hello, World! 2024 edition") == "hello-world-2024-edition"


def test_custom_separator_and_length():
    assert slugify("one two three four", sep="_", max_length=9) == "one_two"


def test_unique_suffix():
    assert unique_slug("My Post", {"my-post", "my-post-2"}) == "my-post-3"


def test_symbols_only_give_empty_slug():
    assert slugify("!!! ???") == ""
