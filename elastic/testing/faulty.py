"""Training callables that misbehave on purpose, for tests of the error paths."""
from __future__ import annotations

from elastic.bench.workload import loss_fn as _loss_fn

_calls = 0


def loss_fails_on_fifth_call(model, batch):
    """A user bug that shows up after a few steps: a retry would hit it again."""
    global _calls
    _calls += 1
    if _calls == 5:
        raise ZeroDivisionError("bug in the user's loss on its 5th call")
    return _loss_fn(model, batch)
