"""`RolloutEngines`: what the trainer may ask of the rollout engines, whichever `rollout.mode` runs them.

Implemented by the Ray `RolloutManager` (manager.py) and the HTTP `ServerRolloutManager` (server_client.py; the
colocated mode's `ColocatedRolloutManager` extends it). The trainer (controller, validation, weight push, run loop)
types every engine handle as `RolloutEngines`, so a new mode is one class that satisfies this protocol.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: this module stays a leaf that imports neither Ray nor the HTTP client
    import torch

    from megatron_cpo.rollout.http_client import ServerSenderSpec
    from megatron_cpo.rollout.scoring import ScoredGroup, ScoreRequest
    from megatron_cpo.rollout.types import RolloutGroup, SamplingParams
    from megatron_cpo.rollout.weight_sync import WeightSenderSpec


class RolloutEngines(Protocol):
    """A set of rollout engines behind one request book: prompts go to the least-loaded live engine, finished groups
    stream back, an engine that dies or hangs is given up and its prompts re-dispatched (health.py), and new weights
    are loaded in place between rounds. An engine started (or a server taken back) in a given-up one's place joins
    at the next weight push and serves requests only after it."""

    engines: list
    """One handle per engine slot (an actor handle or a server URL); given-up ones stay in the list."""
    last_engine_failure: str | None
    """Why the engines not serving now were given up, and whether they are restarted, the latest last (None while
    every engine serves)."""
    engine_restarts: int
    """Engines restarted (servers taken back) so far (`rollout/engine_restarts`)."""
    rejoined: tuple[int, ...]
    """The engines whose first weights after a restart came with the last push (the sync check must cover them)."""
    weight_version: int
    """Weight pushes completed (`finish_weight_sync` counts them); every sampled token carries the version that
    sampled it (`RolloutSample.policy_versions`)."""

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue one prompt for `params.n` samples."""

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait for one group, then return it with every other group already finished; [] when none is outstanding."""

    def completed(self, timeout: float | None = None) -> Iterator[RolloutGroup]:
        """Yield groups as they finish until nothing is outstanding."""

    def cancel_all(self) -> int:
        """Drop everything outstanding; returns how many groups were dropped."""

    def health(self) -> list[bool]:
        """Whether each engine answers a health check."""

    def check_engines(self) -> int:
        """Health-check the live engines, give up those that fail; returns how many engines the next push reaches
        (live, and restarting in place of given-up ones). 0: nothing can continue."""

    def num_engines_alive(self) -> int:
        """Engines serving requests (`rollout/engines_alive`)."""

    def num_engines_restarting(self) -> int:
        """Engines started in place of given-up ones that have not yet taken a push (the next push waits for them
        when no engine is alive)."""

    def sender_spec(self, transport: str | None = None) -> WeightSenderSpec | ServerSenderSpec:
        """What every sending trainer rank needs to push its layers to the live engines."""

    def begin_weight_sync(self, in_flight: str = "none") -> None:
        """Open an in-place reload on every live engine and on the restarted ones waiting to join. `in_flight`
        (types.IN_FLIGHT_POLICIES) says what happens to requests still outstanding: `none` (there may be none),
        `finish`, `partial` or `keep`. An engine lost during a push is left out of it, without an error."""

    def finish_weight_sync(self, resume: bool = True) -> dict[str, list[dict]]:
        """Close the reload: the engines serve the new weights, `weight_version` is one more. Returns each engine's
        workers' reload reports (tensors received, parameters nothing filled, names sent twice, whether the prefix
        cache was dropped). `resume=False`: the requests the push paused stay paused until `resume_generation`, so
        that the sync probe runs alone (in `keep` mode vLLM's scheduler, which the probe needs, lets them go on)."""

    def resume_generation(self) -> None:
        """Let the requests paused by a push finished with `resume=False` go on."""

    def sync_probe(self, prompts: list[list[int]], max_tokens: int) -> list[RolloutGroup]:
        """Greedy `max_tokens` tokens of each prompt on every live engine, with their log-probs (the sync check of
        rollout/sync_check.py); not outstanding requests: `finished()` never returns them and `cancel_all()` never
        aborts them, so they may run while training requests are in flight (asynchronous training: the trainer runs
        them between `finish_weight_sync(resume=False)` and `resume_generation`)."""

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], transport: str | None = None,
                     in_flight: str = "none", resume: bool = True) -> dict[str, float]:
        """Load HF-named full tensors, all from this process, into every live engine (`in_flight` as in
        `begin_weight_sync`, `resume` as in `finish_weight_sync`); returns transfer metrics."""

    def submit_score(self, request: ScoreRequest) -> None:
        """Score one group's responses as a distillation teacher (rollout/scoring.py) on the least-loaded live engine;
        not an outstanding generation request (`finished()` and `cancel_all()` never see it)."""

    def collect_scores(self, request_ids: Iterable[str] | None = None, timeout: float | None = None
                       ) -> dict[str, ScoredGroup]:
        """Wait for the submitted scoring requests `request_ids` (None: all) and return them by id; a dead engine's
        requests are scored again on the others."""

    def shutdown(self) -> None:
        """Release the engines (stop those this object started). Safe to call twice."""
