import pytest

from ringbuf import RingBuffer


def test_iterates_in_insertion_order_before_full():
    buf = RingBuffer(4)
    for x in "abc":
        buf.append(x)
    assert list(buf) == ["a", "b", "c"]
    assert len(buf) == 3


def test_indexing_after_overwrite():
    buf = RingBuffer(3)
    for x in range(5):
        buf.append(x)
    assert (buf[0], buf[1], buf[-1]) == (2, 3, 4)
    with pytest.raises(IndexError):
        buf[3]


def test_popleft_returns_oldest():
    buf = RingBuffer(2)
    buf.append(1)
    buf.append(2)
    buf.append(3)
    assert buf.popleft() == 2
    assert len(buf) == 1
