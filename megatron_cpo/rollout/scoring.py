"""Scoring sampled responses on a vLLM engine: the teacher side of on-policy distillation.

One vLLM request per response: `prompt + response` as the prompt, one generated token (`max_tokens=1`), temperature
1, and `prompt_logprobs=k` (0: the sampled tokens only). vLLM's prompt log-probs are the plain log-softmax of the
engine's logits at every position (its `logprobs_mode` does not touch them), each position's dict holding the actual
next token and the top-k. `extract_scores` keeps the response's positions: each response token's own log-prob, and
the k best ids with their log-probs in order (verl's `extract_prompt_logprobs` does the same for the whole sequence).
Plain lists, so a result crosses Ray and HTTP as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScoreRequest:
    """The responses of one prompt to score (`request_id`: the group's), with the teacher's top-k (0: none)."""
    request_id: str
    prompt_token_ids: list[int]
    responses: list[list[int]]
    topk: int = 0


@dataclass
class ScoredResponse:
    """One response's scores: `log_probs` of its tokens; with top-k, `topk_ids` / `topk_log_probs` per token."""
    log_probs: list[float]
    topk_ids: list[list[int]] | None = None
    topk_log_probs: list[list[float]] | None = None


@dataclass
class ScoredGroup:
    """A `ScoreRequest`'s answer: one `ScoredResponse` per response, in order."""
    request_id: str
    responses: list[ScoredResponse] = field(default_factory=list)


def score_params(topk: int):
    """vLLM's sampling parameters of a scoring request."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=topk, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def extract_scores(prompt_logprobs: list, sequence: list[int], first: int, topk: int) -> ScoredResponse:
    """The scores of `sequence[first:]` from vLLM's `prompt_logprobs` of `sequence` (position i: a dict token id ->
    Logprob of p(. | sequence[:i]), None at 0)."""
    log_probs: list[float] = []
    ids: list[list[int]] = []
    top: list[list[float]] = []
    for position in range(first, len(sequence)):
        entries = prompt_logprobs[position]
        log_probs.append(float(entries[sequence[position]].logprob))
        if topk:
            best = sorted(entries.items(), key=lambda item: item[1].rank)[:topk]
            ids.append([int(token) for token, _ in best])
            top.append([float(entry.logprob) for _, entry in best])
    return ScoredResponse(log_probs, ids if topk else None, top if topk else None)
