"""What a failed checkpoint save or load means: whether a checkpoint is still owed, how long
before it is saved again, whether a peer was lost, and one readable line for the error.
"""
from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

PEER_LOST = ("connection closed", "connection reset", "broken pipe", "by peer", "not registered")


RETRY_WAIT_MAX_S = 60.0  # the longest a failed checkpoint waits before it is saved again


def owes_retry(error: str) -> bool:
    """Whether a persist that failed with `error` leaves a checkpoint owed, to be saved again once
    storage answers: a storage failure. Not a persist given up with its group (`abandoned:`: the
    next group's restore decides), one fenced off (`fenced:`: a newer generation writes) or one
    skipped for an earlier group's upload (`skipped:`: the next checkpoint step saves)."""
    return not error.startswith(("abandoned", "fenced", "skipped"))


def retry_wait_s(backoff_s: float, failed_retries: int) -> float:
    """How long after a failed persist the checkpoint is saved again: checkpoint.persist_retry_
    backoff_s, doubled by each retry that failed too, at most RETRY_WAIT_MAX_S. (A persist has
    already spent its own retries before it fails: this paces the saves, each a snapshot.)"""
    return min(RETRY_WAIT_MAX_S, backoff_s * 2 ** failed_retries)


def describe_failure(e: BaseException, limit: int = 300) -> str:
    """One line for an error of a save or load. DCP's CheckpointException prints every rank's
    whole traceback, with the cause last, past any sensible cut: name each failed rank's own
    exception instead, ranks with the same one together."""
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    if not failures:
        return f"{type(e).__name__}: {e}"[:limit]
    causes = {}
    for rank, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        causes.setdefault(f"{type(exc).__name__}: {exc}".strip(), []).append(rank)
    text = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {c}" for c, r in causes.items())
    return text[:limit]


def is_peer_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return any(s in text for s in PEER_LOST)
