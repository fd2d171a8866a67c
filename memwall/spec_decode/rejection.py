"""Exact verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Position j of a verified sequence has the target's distribution p_j (its logits after banned
tokens, penalties, temperature, top-k, top-p and min-p, exactly as the plain sampler would
use them) and the draft token d_j, drawn from the drafter's distribution q_j:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), and go on to j + 1;
    at the first rejection, sample from the residual norm(max(0, p_j - q_j)) and stop;
    when every draft is accepted, sample one more token from p_k ("bonus").

Each emitted token is then distributed exactly as p (the proof: P(x) = min(p, q)(x) +
(1 - sum min(p, q)) * residual(x) = p(x)), so speculation changes speed, never the output
distribution. A drafter that proposes tokens without probabilities (n-gram lookup) is a q_j
that puts all its mass on d_j: accept with probability p_j(d_j), else sample p_j with d_j
removed. Greedy rows need no randomness: accept while d_j is the argmax, then take the argmax.

A seeded request's rows (``verify_seeded``) take the plain sampler's own draw at every
position instead, from that position's generator (sample/seeds.py), and keep a draft while it
is that draw: d_j is then accepted with probability p_j(d_j), as the rule above accepts a
drafter's token that came without probabilities, and every emitted token is the one decoding
without speculation draws at that position. So a seeded request gives the same tokens with
speculation on or off, whatever the draft lengths the adaptive policy picks from its timings.
"""

from __future__ import annotations

import torch

from memwall.sample.sampler import exponential_race


def verify_greedy(argmax: list[int], drafts: list[int]) -> tuple[int, int]:
    """argmax [k + 1] target tokens, drafts [k] -> (accepted drafts, the token after them)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return accepted, argmax[accepted]


def verify_random(probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                  generator: torch.Generator | None) -> tuple[int, int]:
    """probs [k + 1, V] target distributions, drafts [k], draft_probs [k, V] (None: each
    draft had probability 1) -> (accepted drafts, the token after them). ``generator``: where
    the uniforms and the final draw come from (None: the shared default generator); a seeded
    request goes through ``verify_seeded``, whose draws do not depend on k."""
    k = len(drafts)
    uniforms = torch.rand(k, generator=generator, device=_device(generator, probs)).tolist() if k else []
    for j, token in enumerate(drafts):
        p = float(probs[j, token])
        q = 1.0 if draft_probs is None else float(draft_probs[j, token])
        if q > 0 and uniforms[j] * q < p:
            continue  # accepted: u < p / q
        residual = probs[j].clone()  # [V]
        if draft_probs is None:
            residual[token] = 0.0
        else:
            residual = (residual - draft_probs[j].to(residual.device)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q where it matters: nothing is left over
            residual = probs[j]
        return j, _draw(residual / residual.sum(), generator)
    return k, _draw(probs[k], generator)


def verify_seeded(probs: torch.Tensor, drafts: list[int],
                  generators: list[torch.Generator]) -> tuple[int, int]:
    """probs [k + 1, V] target distributions, drafts [k] (each had probability 1), generators
    [k + 1]: position j's own (sample/seeds.py) -> (accepted drafts, the token after them).

    Position j's token is the plain sampler's race with generator j; a draft is kept while it
    equals that token. Positions after the first mismatch draw nothing."""
    for j, token in enumerate(drafts):
        drawn = _draw(probs[j], generators[j])
        if drawn != token:
            return j, drawn
    return len(drafts), _draw(probs[len(drafts)], generators[len(drafts)])


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(exponential_race(probs[None], [generator])[0])


def _device(generator: torch.Generator | None, probs: torch.Tensor) -> torch.device:
    return generator.device if generator is not None else probs.device
