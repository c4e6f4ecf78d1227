"""The rollout tests: a package, so that the two-engine `manager` of its conftest is package-scoped (stopped before the
trainer tests start their own engines in the same Ray cluster)."""
