import pytest

from safepath import UnsafePath, resolve_url_path, safe_join


def test_sibling_directory_with_same_prefix_is_refused():
    with pytest.raises(UnsafePath):
        safe_join("/srv/data", "../data-secret/key.pem")
    with pytest.raises(UnsafePath):
        safe_join("/srv/data/", "..", "database.sqlite")


def test_encoded_sibling_escape_in_url():
    with pytest.raises(UnsafePath):
        resolve_url_path("/srv/www", "/%2e%2e/www-private/token")


def test_root_itself_and_filesystem_root():
    assert safe_join("/srv/www", ".") == "/srv/www"
    assert safe_join("/", "etc", "hosts") == "/etc/hosts"
    assert safe_join("/srv/www", "sub", "..") == "/srv/www"
