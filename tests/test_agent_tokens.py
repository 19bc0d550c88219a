"""The token ledger with the real reference tokenizer and chat templates: the sequence it builds is
the template's tokenization of the transcript, and a template that is not append-only is reported
where it rewrote the history."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
from tokenizers import AddedToken
from agent_support import call, reference_tokenizer, tool_schemas
from rolloutd.daemon.agents.content_text import ContentText
from rolloutd.daemon.agents.codec import TokenCodec
from rolloutd.daemon.agents.tokens import ChatFraming, TokenLedger, framing_for
from rolloutd.daemon.inference.base import GenerateResult
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.policy.tokenizer import STRIP_THINK_TEMPLATE_PATH, load_tokenizer
from rolloutd.native_io.errors import AgentError, ConfigError

BASE = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Task id: t-1\nFix it."}]
TOOLS = tool_schemas(ipython=False)


def tokenizer_with(template: str) -> Any:
    tok = load_tokenizer()
    tok.chat_template = template
    return tok


def model_turn(ledger: TokenLedger, text: str, *, end: bool = True) -> GenerateResult:
    """A turn as a server returns it: the text's ids (+ end-of-turn) with the model's log-probs."""
    ids = ledger.codec.encode(text) + ([ledger.eot_id] if end else [])
    logprobs = default_model().token_logprobs(ledger.ids, ids)
    return GenerateResult(token_ids=np.array(ids, dtype=np.int32), logprobs=logprobs,
                          finish_reason="stop" if end else "length", weight_version="v7", server="test://one")


def ledger_for(tokenizer: Any = None, *, check: str = "every_turn", max_total: int = 100_000) -> TokenLedger:
    return TokenLedger(tokenizer or reference_tokenizer(), BASE, TOOLS, max_total_tokens=max_total, template_check=check)


def test_sequence_is_the_templates_tokenization_of_the_transcript() -> None:
    ledger = ledger_for()
    tok = reference_tokenizer()
    assert ledger.prompt_ids.tolist() == tok.encode(
        tok.apply_chat_template(BASE, tools=TOOLS, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    first = call("bash", "Look around.", command="ls -la")
    assert ledger.add_turn(model_turn(ledger, first)) == first
    assert ledger.add_message("tool", "total 0\n  drwx  .\n\ttabbed <odd> é ✓\n\n")
    ledger.add_turn(model_turn(ledger, "Hmm, thinking aloud."))
    assert ledger.add_message("user", "Call a tool.")
    ledger.add_turn(model_turn(ledger, call("submit")))
    outcome = ledger.outcome(finish_reason="completed", submitted=True)
    assert outcome.template_append_only and outcome.template_notes == [] and outcome.segments == [(0, len(outcome.response_ids))]
    rendered = tok.apply_chat_template(outcome.messages, tools=TOOLS, tokenize=False)
    # Token for token: what the template renders, encoded in one piece, minus the final "\n".
    whole = np.concatenate([outcome.prompt_ids, outcome.response_ids]).tolist()
    assert whole + tok.encode("\n", add_special_tokens=False) == tok.encode(rendered, add_special_tokens=False)
    assert [(t.start, t.end, t.weight_version, t.server) for t in outcome.turns] == \
        [(t.start, t.end, "v7", "test://one") for t in outcome.turns]
    for turn in outcome.turns:
        assert outcome.response_mask[turn.start:turn.end].all()
    assert outcome.response_mask.sum() == sum(t.end - t.start for t in outcome.turns)
    assert np.all(outcome.response_logprobs[outcome.response_mask == 0] == 0.0)


def test_a_cut_turn_is_closed_by_a_template_token() -> None:
    ledger = ledger_for()
    ledger.add_turn(model_turn(ledger, "I was saying something long and", end=False))
    cut_end = ledger.turns[-1].end
    assert ledger.add_message("tool", "Your reply was cut off.")
    ledger.add_turn(model_turn(ledger, call("submit")))
    outcome = ledger.outcome(finish_reason="completed", submitted=True)
    assert outcome.response_ids[cut_end] == ledger.eot_id and outcome.response_mask[cut_end] == 0
    assert outcome.template_append_only, outcome.template_notes
    assert outcome.turns[0].finish_reason == "length"


def test_an_unclosed_last_turn_passes_the_final_check() -> None:
    ledger = ledger_for(check="final")
    ledger.add_turn(model_turn(ledger, "Cut off at the context lim", end=False))
    outcome = ledger.outcome(finish_reason="max_tokens")
    assert outcome.template_append_only, outcome.template_notes
    assert outcome.response_ids[-1] != ledger.eot_id


def test_a_message_that_does_not_fit_is_not_appended() -> None:
    probe = ledger_for()
    ledger = ledger_for(max_total=len(probe.ids) + 40)
    ledger.add_turn(model_turn(ledger, "short"))
    before = list(ledger.ids)
    assert not ledger.add_message("tool", "x " * 200)
    assert ledger.ids == before and ledger.messages[-1]["role"] == "assistant"
    with pytest.raises(ConfigError, match="max_context_tokens"):
        ledger_for(max_total=len(probe.ids))


@pytest.mark.parametrize("check", ["every_turn", "final"])
def test_strip_think_template_is_reported_where_it_rewrote_history(check: str) -> None:
    ledger = ledger_for(tokenizer_with(STRIP_THINK_TEMPLATE_PATH.read_text()), check=check)
    ledger.add_turn(model_turn(ledger, "<think>\nLook first.\n</think>\n" + call("bash", "Listing.", command="ls")))
    ledger.add_message("tool", "a.py")
    ledger.add_turn(model_turn(ledger, "<think>\nNo idea.\n</think>\nI am stuck."))
    nudge_at = ledger.response_len
    ledger.add_message("user", "Call a tool.")
    ledger.add_turn(model_turn(ledger, call("submit")))
    outcome = ledger.outcome(finish_reason="completed", submitted=True)
    assert not outcome.template_append_only
    assert outcome.segments == [(0, nudge_at), (nudge_at, len(outcome.response_ids))]
    assert any("not append-only" in note for note in outcome.template_notes), outcome.template_notes
    # The tokens still hold what the model saw: both think blocks are there.
    text = reference_tokenizer().decode(outcome.response_ids.tolist(), skip_special_tokens=False)
    assert text.count("<think>") == 2


def test_strip_think_template_without_a_new_user_message_stays_append_only() -> None:
    ledger = ledger_for(tokenizer_with(STRIP_THINK_TEMPLATE_PATH.read_text()))
    ledger.add_turn(model_turn(ledger, "<think>\nLook.\n</think>\n" + call("bash", "Listing.", command="ls")))
    ledger.add_message("tool", "a.py")
    ledger.add_turn(model_turn(ledger, "<think>\nDone.\n</think>\n" + call("submit")))
    outcome = ledger.outcome(finish_reason="completed", submitted=True)
    assert outcome.template_append_only, outcome.template_notes


def default_template() -> str:
    return str(reference_tokenizer().chat_template)


def test_template_that_trims_content_is_rendered_per_observation() -> None:
    template = default_template().replace("'<|im_start|>user\\n<tool_response>\\n' + message.content",
                                          "'<|im_start|>user\\n<tool_response>\\n' + message.content | trim")
    assert template != default_template()
    ledger = ledger_for(tokenizer_with(template))
    ledger.add_turn(model_turn(ledger, call("bash", command="ls")))
    ledger.add_message("tool", "\n  padded output  \n")
    ledger.add_turn(model_turn(ledger, call("submit")))
    outcome = ledger.outcome(finish_reason="completed", submitted=True)
    assert outcome.template_append_only, outcome.template_notes
    text = reference_tokenizer().decode(outcome.response_ids.tolist(), skip_special_tokens=False)
    assert "<tool_response>\npadded output\n</tool_response>" in text


@pytest.mark.parametrize("check", ["every_turn", "final"])
def test_template_that_rewrites_content_is_caught_by_the_check(check: str) -> None:
    template = default_template().replace("'<|im_start|>user\\n<tool_response>\\n' + message.content",
                                          "'<|im_start|>user\\n<tool_response>\\n' + message.content | replace('secret', '***')")
    ledger = ledger_for(tokenizer_with(template), check=check)
    ledger.add_turn(model_turn(ledger, call("bash", command="cat key")))
    ledger.add_message("tool", "fine")
    ledger.add_turn(model_turn(ledger, call("bash", command="cat key2")))
    obs_at = ledger.response_len
    ledger.add_message("tool", "the secret is 42")
    ledger.add_turn(model_turn(ledger, call("submit")))
    outcome = ledger.outcome(finish_reason="completed", submitted=True)
    assert not outcome.template_append_only
    assert any("does not produce" in note and "***" in note for note in outcome.template_notes), outcome.template_notes
    assert outcome.segments == [(0, obs_at), (obs_at, len(outcome.response_ids))]


def test_template_without_special_end_of_turn_is_refused() -> None:
    plain = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ConfigError, match="end-of-turn"):
        ledger_for(tokenizer_with(plain))


def test_tools_reach_the_system_prompt() -> None:
    ledger = ledger_for()
    text = ledger.framing.prompt_text
    for schema in TOOLS:
        assert json.dumps(schema["function"]["name"]) in text


def _framing_facts(f: ChatFraming) -> tuple[object, ...]:
    return (f.prompt_text, f.base_text, f.generation_prompt, f.eot_id, f.separator,
            f.message_text("tool", "out\n"), f.message_text("user", "Go on."),
            f.messages_text([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]))


@pytest.mark.parametrize("template", ["reference", "user content trimmed"])
def test_framing_learned_on_markers_is_the_conversations_own(template: str) -> None:
    tok = load_tokenizer()
    if template != "reference":
        tok.chat_template = default_template().replace("'<|im_start|>user\\n' + message.content",
                                                       "'<|im_start|>user\\n' + message.content | trim")
    codec = TokenCodec(tok)
    for base in (BASE, [{"role": "system", "content": "Other rules {{ x }} é"}, {"role": "user", "content": "Task 2"}]):
        shared = framing_for(tok, base, TOOLS, codec)
        assert shared._shape is not shared, "the learned framing was not reused"
        assert _framing_facts(shared) == _framing_facts(ChatFraming(tok, base, TOOLS, codec))


def test_template_that_reads_the_base_contents_gets_its_own_framing() -> None:
    # Renders the user message differently when it mentions a task id: markers never do.
    tok = tokenizer_with(default_template().replace(
        "'<|im_start|>user\\n' + message.content", "'<|im_start|>user\\n' + ('[task] ' if 'Task id' in message.content else '') + message.content"))
    codec = TokenCodec(tok)
    framing = framing_for(tok, BASE, TOOLS, codec)
    assert framing._shape is framing
    assert "[task] Task id" in framing.prompt_text
    assert _framing_facts(framing) == _framing_facts(ChatFraming(tok, BASE, TOOLS, codec))


def _ledger(tok: Any, base: list[dict[str, str]], mode: str = "special") -> TokenLedger:
    return TokenLedger(tok, base, TOOLS, max_total_tokens=100_000, content=ContentText(tok, mode))


def _whole_prompt(tok: Any, base: list[dict[str, str]], mode: str = "special") -> list[int]:
    """The prompt encoded in one piece (``special``: as the tokenizer does; ``text``: the content
    escaped, then encoded in one call, with no shared framing or cached head)."""
    content = ContentText(tok, mode)
    text = tok.apply_chat_template(content.escape_messages(base), tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    return content.encode(text)


@pytest.mark.parametrize("mode", ["special", "text"])
def test_prompts_sharing_a_system_message_encode_as_a_whole(mode: str) -> None:
    tok = load_tokenizer()
    system = {"role": "system", "content": "Rules, shared by every rollout. é ✓  "}
    users = ["Task id: a\nFix it.", "  leading spaces, <|im_end|> inside, and <tool_call> too\n",
             "Task id: b\n" + "long issue text " * 200, ""]
    for content in users * 2:  # the second round takes the head from the cache
        base = [system, {"role": "user", "content": content}]
        ledger = _ledger(tok, base, mode)
        assert ledger.prompt_ids.tolist() == _whole_prompt(tok, base, mode), content[:40]
    heads = list(ledger.framing._shape._head_ids)
    assert len(heads) == 1 and system["content"] in heads[0], "the system message's ids were not kept"


@pytest.mark.parametrize("found_by", ["token flags", "comparison"])
def test_a_tokenizer_that_joins_across_end_of_turn_encodes_prompts_whole(found_by: str) -> None:
    # With rstrip, the end-of-turn token swallows the newline after it: encoding the text after
    # it alone would keep that newline as a token of its own.
    tok = load_tokenizer()
    tok.backend_tokenizer.add_special_tokens([AddedToken("<|im_end|>", rstrip=True, special=True, normalized=False)])
    base = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Task id: c"}]
    whole = _whole_prompt(tok, base)
    codec = TokenCodec(tok)
    head, _, rest = tok.apply_chat_template(base, tools=TOOLS, tokenize=False,
                                            add_generation_prompt=True).partition("<|im_end|>")
    assert whole != [*codec.encode(head), whole[len(codec.encode(head))], *codec.encode(rest)], \
        "the split would be exact: nothing to test"
    shape = framing_for(tok, base, TOOLS, codec)._shape
    assert shape._split_exact is False, "the rstrip flag was not seen"
    if found_by == "comparison":  # a tokenizer that does not expose its added tokens' flags
        shape._split_exact = True
    for _ in range(2):  # the second prompt must not use a split the first found inexact
        assert _ledger(tok, base).prompt_ids.tolist() == whole
    assert shape._split_exact is False and not shape._head_ids


@pytest.mark.parametrize("shape", [(1,), (0,), ("short",), ("long",)])
def test_a_turn_whose_logprobs_do_not_match_its_tokens_is_refused(shape: tuple[object]) -> None:
    """A log-probability array of another length would be broadcast (one value over every token)
    or cut: the ledger refuses it and keeps nothing of the turn."""
    ledger = ledger_for()
    good = model_turn(ledger, "hello there")
    n = len(good.token_ids)
    lengths = {(1,): 1, (0,): 0, ("short",): n - 1, ("long",): n + 1}
    bad = dataclasses.replace(good, logprobs=np.resize(good.logprobs, lengths[shape]).astype(np.float32))
    before = len(ledger.ids)
    with pytest.raises(AgentError, match="log-probabilities of shape"):
        ledger.add_turn(bad)
    assert len(ledger.ids) == before and ledger.turns == []
    ledger.add_turn(good)
    assert ledger.outcome(finish_reason="completed").response_logprobs.tolist() == good.logprobs.tolist()


def test_a_turns_versions_reach_its_record_and_survive_the_wire() -> None:
    """What the pool learnt of a turn's weights (sent under, per-token spans, straddled) is on its
    TurnRecord, and still there after the trajectory crossed the wire."""
    from rolloutd.native_io.trajectory import Trajectory
    from rolloutd.daemon.inference.base import VersionSpan

    ledger = ledger_for()
    turn = model_turn(ledger, "hello there")
    n = len(turn.token_ids)
    turn = dataclasses.replace(turn, weight_version="v2", sent_version="v1", straddled=True,
                               weight_spans=(VersionSpan("v1", 0, 2), VersionSpan("v2", 2, n)))
    ledger.add_turn(turn)
    out = ledger.outcome(finish_reason="completed")
    (record,) = out.turns
    assert (record.weight_version, record.sent_version, record.straddled) == ("v2", "v1", True)
    assert record.weight_spans == [("v1", 0, 2), ("v2", 2, n)]
    t = Trajectory(request_id="r", sample_index=0, task_id="t", prompt_ids=out.prompt_ids,
                   response_ids=out.response_ids, response_mask=out.response_mask,
                   response_logprobs=out.response_logprobs, reward=1.0, finish_reason="completed",
                   num_turns=1, turns=out.turns)
    back = Trajectory.from_parts(json.loads(json.dumps(t.scalar_fields())), t.arrays())
    assert back.turns == t.turns
