"""The run's plumbing: what is checked before anything starts (preflight, the process layout), the run directory's
guards, checkpoints and resume, and the error a run stops with."""
