"""A huge request costs its own session, not the node: the OpenAI proxy refuses a conversation
that cannot fit before rendering or encoding anything, and renders and encodes the rest in a
worker thread, off the event loop every session shares. (How long another session waits beside a
4 MB message is measured in bench/openai_proxy_isolation.py, not asserted here.)"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from openai_proxy_inprocess import conversation, proxy, turn
from rolloutd.daemon.openai_proxy.admission import COUNT_ABOVE_BYTES, longest_token_bytes
from rolloutd.daemon.policy.tokenizer import load_tokenizer


def spied_tokenizer() -> tuple[Any, list[bool]]:
    """A tokenizer that records, for each render, whether it ran on the event loop's thread."""
    tok = load_tokenizer()
    on_loop: list[bool] = []
    render = tok.apply_chat_template

    def spy(*args: Any, **kwargs: Any) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return render(*args, **kwargs)

    tok.apply_chat_template = spy
    return tok, on_loop


def with_message(text: str) -> list[dict[str, Any]]:
    messages = conversation()
    messages[1] = {**messages[1], "content": messages[1]["content"] + "\n" + text}
    return messages


async def test_requests_that_cannot_fit_are_refused_before_any_work(short_tmp: Path) -> None:
    tok, on_loop = spied_tokenizer()
    longest = longest_token_bytes(tok)
    huge = "word " * (800 * 1024)  # 4 MB
    # Over the bytes bound: refused on a length; and over the count's threshold with a context
    # the bytes allow: refused on the count. Neither renders or encodes the conversation.
    cases = [(32768, huge, "bytes of text"), (2 * COUNT_ABOVE_BYTES // longest, "word " * (COUNT_ABOVE_BYTES // 4),
                                                 "tokens, not below")]
    for max_context, text, why in cases:
        assert len(text.encode()) > COUNT_ABOVE_BYTES
        async with proxy(short_tmp, tokenizer=tok, max_context_tokens=max_context) as p:
            with pytest.raises(openai.BadRequestError) as e:
                await turn(p, with_message(text))
            assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
            assert why in e.value.message
            assert on_loop == [] and p.results == [] and p.session.stop_reason == "max_tokens"


async def test_rendering_and_encoding_run_off_the_event_loop(short_tmp: Path) -> None:
    tok, on_loop = spied_tokenizer()
    async with proxy(short_tmp, tokenizer=tok) as p:
        first = await turn(p, with_message("x" * 1000))
        assert first.message.content == "I will list the files."
    assert on_loop and not any(on_loop)
