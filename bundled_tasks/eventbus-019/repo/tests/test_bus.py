from eventbus import EventBus


def test_handlers_called_in_order():
    bus = EventBus()
    seen = []
    bus.subscribe("e", lambda p: seen.append(("a", p)))
    bus.subscribe("e", lambda p: seen.append(("b", p)))
    assert bus.publish("e", 1) == 2
    assert seen == [("a", 1), ("b", 1)]


def test_unsubscribe_outside_dispatch():
    bus = EventBus()
    seen = []
    stop = bus.subscribe("e", seen.append)
    stop()
    stop()
    assert bus.publish("e", 1) == 0
    assert seen == []


def test_once_runs_a_single_time_when_alone():
    bus = EventBus()
    seen = []
    bus.once("e", seen.append)
    bus.publish("e", 1)
    bus.publish("e", 2)
    assert seen == [1]
    assert bus.handler_count("e") == 0
