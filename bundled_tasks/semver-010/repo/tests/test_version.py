import pytest

from semver_lite import InvalidVersion, Version, latest


def v(text):
    return Version.parse(text)


def test_core_numbers_compare_numerically():
    assert v("1.10.0") > v("1.9.3")
    assert v("2.0.0") > v("1.99.99")


def test_release_is_above_its_prereleases():
    assert v("1.0.0-alpha") < v("1.0.0")
    assert latest(["1.0.0-rc.1", "1.0.0"]) == "1.0.0"


def test_build_metadata_is_ignored():
    assert v("1.0.0+a") == v("1.0.0+b")
    assert str(v("1.2.3-beta.1+exp.sha.5114f85")) == "1.2.3-beta.1+exp.sha.5114f85"


def test_invalid_versions_are_rejected():
    for text in ("1.2", "01.2.3", "1.2.3-", "v1.2.3"):
        with pytest.raises(InvalidVersion):
            v(text)
