"""GrowingIds: append-only token ids whose JSON text is built as they are appended."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rolloutd.daemon.inference.base import SamplingParams
from rolloutd.daemon.inference.growing_ids import GrowingIds
from rolloutd.daemon.inference.http_backend import _encode
from rolloutd.daemon.inference.sglang_http import generate_request as sglang_request
from rolloutd.daemon.inference.vllm_http import generate_request as vllm_request


def test_text_follows_every_way_of_growing() -> None:
    ids = GrowingIds()
    assert ids.json() == "[]" and ids == []
    ids.extend([5, 0, 151643])
    ids.extend([])
    ids.append(np.int32(7))
    ids += np.asarray([9, 10], dtype=np.int64)
    ids.extend(iter([2**31 - 1]))
    assert ids == [5, 0, 151643, 7, 9, 10, 2**31 - 1]
    assert all(type(t) is int for t in ids)
    assert json.loads(ids.json()) == list(ids)
    assert ids.json() == json.dumps(list(ids)).replace(" ", "")
    assert type(ids[2:]) is list and ids[-1] == 2**31 - 1


@pytest.mark.parametrize("rewrite", [
    lambda ids: ids.__setitem__(0, 1), lambda ids: ids.__setitem__(slice(0, 1), [1]),
    lambda ids: ids.__delitem__(0), lambda ids: ids.insert(0, 1), lambda ids: ids.pop(),
    lambda ids: ids.remove(2), lambda ids: ids.clear(), lambda ids: ids.sort(), lambda ids: ids.reverse(),
    lambda ids: ids.__imul__(2),
])
def test_earlier_ids_cannot_be_rewritten(rewrite) -> None:
    ids = GrowingIds([3, 2, 1])
    with pytest.raises(TypeError, match="only grows"):
        rewrite(ids)
    assert ids == [3, 2, 1] and ids.json() == "[3,2,1]"


@pytest.mark.parametrize("build,key", [
    (lambda p: vllm_request(p, SamplingParams(max_tokens=8, seed=3), "rid-1", "m"), "token_ids"),
    (lambda p: sglang_request(p, SamplingParams(max_tokens=8), "rid-2"), "input_ids"),
    (lambda p: {"prompt": p}, "prompt"),
])
def test_request_body_is_the_same_json(build, key: str) -> None:
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 150_000, 3000)]
    grown = GrowingIds(prompt[:1000])
    grown.extend(prompt[1000:])
    plain, spliced = json.loads(_encode(build(list(prompt)), key)), json.loads(_encode(build(grown), key))
    assert spliced == plain and spliced[key] == prompt
