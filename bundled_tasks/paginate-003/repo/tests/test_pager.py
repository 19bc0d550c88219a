import pytest

from paginate import PageNotFound, Paginator


def test_partial_last_page():
    pager = Paginator(list(range(25)), per_page=10)
    assert pager.num_pages == 3
    last = pager.page(3)
    assert last.items == [20, 21, 22, 23, 24]
    assert (last.start_index, last.end_index) == (21, 25)
    assert not last.has_next


def test_empty_sequence_has_one_empty_page():
    pager = Paginator([], per_page=5)
    assert pager.num_pages == 1
    assert pager.page(1).items == []
    assert pager.page(1).start_index == 0


def test_page_zero_is_rejected():
    with pytest.raises(PageNotFound):
        Paginator([1, 2], per_page=1).page(0)
