"""When to give up a rollout engine, and how many restarts a run may spend: the bookkeeping the managers share.

A manager (manager.py for Ray engines, server_client.py for servers) calls `EngineWatch` from its wait for finished
groups and does the calls itself. While it waits, each live engine is pinged every `check_interval_s` (a round trip
through the engine's processes); an engine is given up when
- its ping is not answered within `timeout_s` (wall seconds: a stopped or deadlocked process, a hung device), or
- with `stall_timeout_s` > 0, it holds requests but finished none for that many *watched* seconds while another
  engine finished a group meanwhile. Watched seconds pass only while the manager waits on the engines (at most
  `MAX_UNWATCHED_GAP_S` between two looks), so the trainer's update, during which nobody collects, never counts
  as a stall; an engine that is alone, or whose peers are stuck too, is left to the ping.
A weight push restarts the clocks and forgets the pings in flight (an engine loading weights answers late).
`RestartBudget` counts the restarts of each engine slot and of the run against `max_restarts_per_engine` and
`max_restarts`.
"""
from __future__ import annotations

import math

from megatron_cpo.rollout.config import EngineHealthConfig

MAX_UNWATCHED_GAP_S = 2.0  # the most one interval between two looks adds to the watched clock


class EngineWatch:
    """Pings and progress of `num_engines` engine slots. Times are `time.monotonic()` seconds given by the caller."""

    def __init__(self, config: EngineHealthConfig, num_engines: int) -> None:
        self.config = config
        self._watched = 0.0  # seconds spent watching (waiting on the engines)
        self._last_look: float | None = None
        self._since = [0.0] * num_engines  # watched time of each engine's last progress (or of getting work)
        self._finished_at = [-math.inf] * num_engines  # watched time each engine last finished a group
        self._ping_sent: dict[int, float] = {}  # engine -> wall time of its unanswered ping
        self._last_ping = [-math.inf] * num_engines  # wall time each engine was last pinged

    def look(self, now: float) -> None:
        """The manager looks at its engines (once per pass of its wait); advances the watched clock."""
        if self._last_look is not None:
            self._watched += min(max(now - self._last_look, 0.0), MAX_UNWATCHED_GAP_S)
        self._last_look = now

    # --- pings ------------------------------------------------------------------------------------------------
    def pings_due(self, now: float, live: list[int]) -> list[int]:
        """The live engines to ping now: none of theirs is out and the last was `check_interval_s` ago."""
        interval = self.config.check_interval_s
        return [i for i in live if i not in self._ping_sent and now - self._last_ping[i] >= interval]

    def ping_sent(self, index: int, now: float) -> None:
        self._ping_sent[index] = now
        self._last_ping[index] = now

    def ping_answered(self, index: int) -> None:
        self._ping_sent.pop(index, None)

    def unanswered(self, now: float) -> list[int]:
        """Engines whose ping has been out for more than `timeout_s`."""
        return sorted(i for i, sent in self._ping_sent.items() if now - sent > self.config.timeout_s)

    # --- progress ---------------------------------------------------------------------------------------------
    def given_work(self, index: int) -> None:
        """Engine `index` received a request while it held none: its stall clock starts now."""
        self._since[index] = self._watched

    def progressed(self, index: int) -> None:
        """Engine `index` finished a group."""
        self._since[index] = self._finished_at[index] = self._watched

    def stalled(self, busy: list[int], live: list[int]) -> list[int]:
        """Busy engines that finished nothing for `stall_timeout_s` watched seconds while another live engine
        finished a group after their last progress; [] when the stall timer is off."""
        limit = self.config.stall_timeout_s
        if limit <= 0:
            return []
        return [i for i in busy if self._watched - self._since[i] > limit
                and any(j != i and self._finished_at[j] > self._since[i] for j in live)]

    # --- resets -----------------------------------------------------------------------------------------------
    def restart_clocks(self) -> None:
        """A weight push: every engine was busy with it, so pings in flight and stall clocks start over."""
        self._ping_sent.clear()
        self._last_ping = [-math.inf] * len(self._last_ping)
        self._since = [self._watched] * len(self._since)

    def forget(self, index: int) -> None:
        """Engine slot `index` was given up (or holds a new engine): nothing of the old engine counts."""
        self._ping_sent.pop(index, None)
        self._last_ping[index] = -math.inf
        self._since[index] = self._watched
        self._finished_at[index] = -math.inf


class RestartBudget:
    """Restarts spent per engine slot and per run, against `EngineHealthConfig`'s limits."""

    def __init__(self, config: EngineHealthConfig, num_engines: int) -> None:
        self.config = config
        self.per_engine = [0] * num_engines
        self.total = 0

    def refusal(self, index: int) -> str | None:
        """Why engine slot `index` may not be restarted now (one clause naming the setting), None when it may."""
        prefix = "actor_rollout_ref.rollout.engine_health."
        if not self.config.restart:
            return f"restarts are off ({prefix}restart=false)"
        if self.per_engine[index] >= self.config.max_restarts_per_engine:
            return (f"engine {index} was restarted {self.per_engine[index]} times already "
                    f"({prefix}max_restarts_per_engine={self.config.max_restarts_per_engine})")
        if self.total >= self.config.max_restarts:
            return (f"the run restarted engines {self.total} times already "
                    f"({prefix}max_restarts={self.config.max_restarts})")
        return None

    def spend(self, index: int) -> int:
        """Count one restart of slot `index`; returns how many that slot has had."""
        self.per_engine[index] += 1
        self.total += 1
        return self.per_engine[index]
