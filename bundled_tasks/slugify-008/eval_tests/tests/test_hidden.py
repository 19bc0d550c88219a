from slugs import slugify, unique_slug


def test_accents_become_base_letters():
    assert slugify("Crème Brûlée") == "creme-brulee"
    assert slugify("Ångström über naïve café") == "angstrom-uber-naive-cafe"


def test_compatibility_characters():
    assert slugify("ﬁle №5") == "file-no5"


def test_unique_slug_with_accents():
    assert unique_slug("Résumé", {"resume"}) == "resume-2"


def test_non_latin_letters_are_dropped():
    assert slugify("日本 guide") == "guide"
