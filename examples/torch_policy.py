"""The reference policy's forward pass in torch: the trainer's copy of the weights.

It follows the numpy model in ``rolloutd.daemon.policy.model`` line for line (the docstring there
is the spec)::

    ctx(ids, i) = ids[i-C:i], left-padded with pad_id      x = concat(embed[ctx])      [C*D]
    h = tanh(x @ w1 + b1)                                  logits = h @ w2 + b2        [V]

Parameters are kept as float32 values (what the server loads from the ``.npz``) held in float64
tensors, and the arithmetic runs in float64 like the numpy model's, so the trainer's
log-probabilities equal the server's to float32 rounding. After each optimizer step
:meth:`round_to_float32` puts the weights back on float32 values, so the copy pushed to the
server and the copy the trainer keeps stay the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rolloutd.daemon.policy.model import PARAM_NAMES, ModelConfig, ReferenceModel


class TorchReferencePolicy(torch.nn.Module):
    def __init__(self, params: dict[str, np.ndarray], config: ModelConfig) -> None:
        super().__init__()
        ReferenceModel(params, config)  # the same shape checks as the server's model
        self.config = config
        self.weights = torch.nn.ParameterDict({
            name: torch.nn.Parameter(torch.from_numpy(np.asarray(params[name], dtype=np.float32).astype(np.float64)))
            for name in PARAM_NAMES})

    @classmethod
    def from_model(cls, model: ReferenceModel) -> TorchReferencePolicy:
        return cls(model.params, model.config)

    def contexts(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids)+1, C]``: row i holds the C tokens before ``ids[i]`` (as ``ReferenceModel.contexts``)."""
        pad = torch.full((self.config.context,), self.config.pad_id, dtype=torch.int64)
        return torch.cat([pad, ids.to(torch.int64)]).unfold(0, self.config.context, 1)

    def next_logprobs(self, contexts: torch.Tensor) -> torch.Tensor:
        """float64 ``[B, V]`` log-probabilities of the next token after each ``[B, C]`` context."""
        w = self.weights
        x = w["embed"][contexts].reshape(contexts.shape[0], -1)
        h = torch.tanh(x @ w["w1"] + w["b1"])
        return torch.log_softmax(h @ w["w2"] + w["b2"], dim=-1)

    def token_logprobs(self, prompt_ids: np.ndarray, response_ids: np.ndarray,
                       positions: np.ndarray | None = None) -> torch.Tensor:
        """float64 log p(response_ids[i] | everything before it) for ``i`` in ``positions``
        (default: every response token), differentiable in the weights."""
        ids = torch.from_numpy(np.concatenate([prompt_ids, response_ids]).astype(np.int64))
        at = torch.arange(len(response_ids)) if positions is None else torch.from_numpy(positions.astype(np.int64))
        ctx = self.contexts(ids)[len(prompt_ids) + at]
        target = ids[len(prompt_ids) + at]
        return self.next_logprobs(ctx).gather(1, target[:, None])[:, 0]

    @torch.no_grad()
    def round_to_float32(self) -> None:
        for p in self.weights.values():
            p.copy_(p.float().double())

    def numpy_params(self) -> dict[str, np.ndarray]:
        return {name: p.detach().float().numpy().copy() for name, p in self.weights.items()}

    def save(self, path: Path) -> None:
        """An ``.npz`` the policy server loads with ``/update_weights_from_disk``."""
        ReferenceModel(self.numpy_params(), self.config).save(path)
