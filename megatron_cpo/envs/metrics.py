"""The `multi_turn/*` metrics of a batch of episodes: turns, rewards per turn, tool calls and their failures by kind,
environment time and errors, refused non-finite rewards, observation tokens, why episodes stopped and what the
template check found."""
from __future__ import annotations

from collections import Counter

from megatron_cpo.envs.episode import STOP_REASONS
from megatron_cpo.rollout.types import EpisodeInfo

TEMPLATE_CHECKS = ("same", "retokenized", "differs")


def episode_metrics(episodes: list[EpisodeInfo], prefix: str = "multi_turn") -> dict[str, float]:
    """Means and maxima over the episodes, counts summed; {} without episodes."""
    if not episodes:
        return {}
    count = len(episodes)
    turns = [e.turns for e in episodes]
    rewards = [r for e in episodes for r in e.turn_rewards]
    metrics = {
        "turns_mean": sum(turns) / count, "turns_max": float(max(turns)),
        "observations_mean": sum(e.observations for e in episodes) / count,
        "observation_tokens_mean": sum(e.observation_tokens for e in episodes) / count,
        "turn_reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "env_reward_mean": sum(e.env_reward for e in episodes) / count,
        "env_seconds": sum(e.env_seconds for e in episodes),
        "env_errors": float(sum(e.env_errors for e in episodes)),
        "env_timeouts": float(sum(e.env_timeouts for e in episodes)),
        "non_finite_rewards": float(sum(len(e.non_finite_rewards) for e in episodes)),
    }
    stops = Counter(e.stop_reason for e in episodes)
    metrics.update({f"stop/{reason}": float(stops[reason]) for reason in STOP_REASONS})
    checks = Counter(e.template_check for e in episodes)
    metrics.update({f"template_{kind}": float(checks[kind]) for kind in TEMPLATE_CHECKS})
    calls = sum((Counter(e.tool_calls) for e in episodes), Counter())
    failures = sum((Counter(e.tool_failures) for e in episodes), Counter())
    metrics.update({f"tool_calls/{name}": float(n) for name, n in calls.items()})
    metrics.update({f"tool_failures/{key}": float(n) for key, n in failures.items()})
    if calls:
        metrics["tool_calls_total"] = float(sum(calls.values()))
        metrics["tool_failures_total"] = float(sum(failures.values()))
    return {f"{prefix}/{key}": value for key, value in metrics.items()}
