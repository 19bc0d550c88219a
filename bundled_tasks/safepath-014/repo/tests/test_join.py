import pytest

from safepath import UnsafePath, resolve_url_path, safe_join


def test_joins_inside_root():
    assert safe_join("/srv/www", "css", "site.css") == "/srv/www/css/site.css"
    assert safe_join("/srv/www/", "a/../b.txt") == "/srv/www/b.txt"


def test_parent_escape_is_refused():
    with pytest.raises(UnsafePath):
        safe_join("/srv/www", "../../etc/passwd")


def test_absolute_part_is_refused():
    with pytest.raises(UnsafePath):
        safe_join("/srv/www", "/etc/passwd")


def test_url_resolution():
    assert resolve_url_path("/srv/www", "/img/logo%20big.png?v=3") == "/srv/www/img/logo big.png"
