from semver_lite import Version, latest


def v(text):
    return Version.parse(text)


def test_numeric_prerelease_identifiers_compare_as_numbers():
    assert v("1.0.0-rc.2") < v("1.0.0-rc.10")
    assert latest(["2.0.0-beta.9", "2.0.0-beta.11", "2.0.0-beta.10"]) == "2.0.0-beta.11"


def test_spec_precedence_example():
    chain = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta",
             "1.0.0-beta.2", "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0"]
    shuffled = chain[3:] + chain[:3]
    assert [str(x) for x in sorted(v(t) for t in shuffled)] == chain


def test_numeric_identifier_ranks_below_alphanumeric():
    assert v("1.0.0-9") < v("1.0.0-10")
    assert v("1.0.0-999") < v("1.0.0-a")


def test_latest_without_prereleases():
    assert latest(["1.1.0-rc.1", "1.0.5"], include_prereleases=False) == "1.0.5"
