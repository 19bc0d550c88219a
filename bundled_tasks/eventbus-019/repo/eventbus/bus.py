"""In-process publish/subscribe."""
from collections.abc import Callable
from typing import Any

Handler = Callable[[Any], None]


class EventBus:
    """Handlers run synchronously, in subscription order.

    Subscribing or unsubscribing from inside a handler is allowed; such
    changes take effect from the next publish() of that event.
    """

    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = {}

    def subscribe(self, event: str, handler: Handler) -> Callable[[], None]:
        """Register *handler*; returns a function that unregisters it."""
        self._handlers.setdefault(event, []).append(handler)

        def unsubscribe() -> None:
            handlers = self._handlers.get(event, [])
            if handler in handlers:
                handlers.remove(handler)

        return unsubscribe

    def once(self, event: str, handler: Handler) -> Callable[[], None]:
        """Like subscribe(), but the handler is removed after its first call."""

        def run_once(payload: Any) -> None:
            unsubscribe()
            handler(payload)

        unsubscribe = self.subscribe(event, run_once)
        return unsubscribe

    def publish(self, event: str, payload: Any = None) -> int:
        """Call every handler of *event*; returns how many were called."""
        called = 0
        for handler in self._handlers.get(event, []):
            handler(payload)
            called += 1
        return called

    def handler_count(self, event: str) -> int:
        return len(self._handlers.get(event, []))
