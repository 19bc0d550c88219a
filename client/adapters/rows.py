"""Rollout requests from trainer dataset rows: the one rule for what a row asks rolloutd for.

veRL's agent loops and SkyRL's generators get one dataset row per sample (the trainer repeats a
prompt for its group itself); the row carries a dict of ``RolloutRequest`` fields, and the
trainer's own sampling parameters fill the keys the request leaves out.
"""

from __future__ import annotations

from typing import Any

from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest
from rolloutd.native_io.errors import BadRequest
from rolloutd.native_io.trajectory import Trajectory

SAMPLING_FROM_TRAINER = ("temperature", "top_p", "top_k")


def row_request(fields: Any, sampling_params: dict[str, Any] | None) -> RolloutRequest:
    """One sample's request (``n`` = 1) from a row's dict of ``RolloutRequest`` fields."""
    if not isinstance(fields, dict):
        raise BadRequest(f"a row's rolloutd_request must be a dict of RolloutRequest fields, "
                         f"not {type(fields).__name__}")
    try:
        request = RolloutRequest(**{**fields, "n": 1})
    except TypeError as e:
        raise BadRequest(f"a row's rolloutd_request has a field RolloutRequest does not: {e}") from e
    params = sampling_params or {}
    # top_k -1 is the trainers' "off"; rolloutd leaves an absent key at the server's default.
    inherited = {k: params[k] for k in SAMPLING_FROM_TRAINER if k in params and not (k == "top_k" and params[k] == -1)}
    request.sampling = {**inherited, **request.sampling}
    return request


async def rollout_rows(address: str | None, requests: list[RolloutRequest], timeout_s: float) -> list[Trajectory]:
    """The trajectories of ``requests``, in request order (one connection for the batch); a
    request the daemon refused raises, since a trainer cannot leave a row out of its batch."""
    async with AsyncRolloutClient(address) as client:
        ids = await client.submit(requests)
        results = await client.results(ids, timeout_s=timeout_s)
        trajectories: list[Trajectory] = []
        for request_id in ids:
            trajectories += sorted((t.copy() for t in results[request_id].trajectories), key=lambda t: t.sample_index)
            await client.release(results[request_id])
    refused = [results[r].error for r in ids if results[r].error is not None]
    if refused:
        raise refused[0]
    return trajectories
