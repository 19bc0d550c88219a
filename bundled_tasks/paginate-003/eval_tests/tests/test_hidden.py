import pytest

from paginate import PageNotFound, Paginator


def test_exact_multiple_has_no_trailing_empty_page():
    pager = Paginator(list(range(20)), per_page=10)
    assert pager.num_pages == 2
    assert not pager.page(2).has_next
    with pytest.raises(PageNotFound):
        pager.page(3)


def test_iteration_yields_only_non_empty_pages():
    pager = Paginator("abcdef", per_page=3)
    assert [p.items for p in pager] == ["abc", "def"]


def test_single_item_per_page():
    pager = Paginator([1, 2, 3], per_page=1)
    assert pager.num_pages == 3
    assert pager.page(3).end_index == 3
