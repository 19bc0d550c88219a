from ringbuf import RingBuffer


def test_iteration_after_wraparound():
    buf = RingBuffer(3)
    for x in range(5):
        buf.append(x)
    assert list(buf) == [2, 3, 4]


def test_latest_after_wraparound():
    buf = RingBuffer(4)
    for line in ["l1", "l2", "l3", "l4", "l5", "l6"]:
        buf.append(line)
    assert buf.latest(2) == ["l5", "l6"]


def test_iteration_after_popleft():
    buf = RingBuffer(3)
    for x in "xyz":
        buf.append(x)
    buf.popleft()
    assert list(buf) == ["y", "z"]


def test_latest_zero():
    buf = RingBuffer(2)
    buf.append(1)
    assert buf.latest(0) == []
