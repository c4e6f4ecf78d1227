"""Scorers for reference reward servers started by the tests (``--scorer path/to/remote_scorers.py:fn``)."""
import time


def stalls(items):
    """A reward model far slower than any client timeout in the tests."""
    time.sleep(30)
    return [0.0 for _ in items]


def prompt_length(items):
    """A stand-in reward model that reads the prompt: its length in characters / 1000 (the protocol is under test)."""
    return [len(item["prompt"]) / 1000 for item in items]
