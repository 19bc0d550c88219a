from eventbus import EventBus


def test_once_handler_does_not_hide_the_next_handler():
    bus = EventBus()
    seen = []
    bus.once("e", lambda p: seen.append(("once", p)))
    bus.subscribe("e", lambda p: seen.append(("always", p)))
    assert bus.publish("e", 1) == 2
    bus.publish("e", 2)
    assert seen == [("once", 1), ("always", 1), ("always", 2)]


def test_handler_unsubscribing_itself():
    bus = EventBus()
    seen = []
    stops = {}

    def first(p):
        seen.append("first")
        stops["first"]()

    stops["first"] = bus.subscribe("e", first)
    bus.subscribe("e", lambda p: seen.append("second"))
    bus.subscribe("e", lambda p: seen.append("third"))
    bus.publish("e")
    assert seen == ["first", "second", "third"]


def test_subscribing_during_publish_applies_next_time():
    bus = EventBus()
    seen = []

    def adder(p):
        seen.append("adder")
        bus.subscribe("e", lambda q: seen.append("late"))

    bus.subscribe("e", adder)
    assert bus.publish("e") == 1
    assert seen == ["adder"]
