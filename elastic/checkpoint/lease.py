"""One live run per run folder: a lease in storage, taken by the controller before any worker starts.

Two drivers on one run (a KubeRay retry while the first head is cut off rather than dead, a user
submitting the same job twice) would both train over the same checkpoints and fence. The lease
makes the second one stop before it starts anything.

Layout, beside the checkpoints, under `<run dir>/lease/`:

    000000003.json        who took lease 3: holder id, host, pid, when (written once, exclusively)
    000000003.renewed     the holder's last renewal, epoch seconds (rewritten every ttl/4)

Taking: the newest lease is read; if its holder renewed it within `ttl_s`, the run is held and
`take` raises `LeaseHeld` naming the holder and the lease's age: at once when the holder renewed
within two renewal intervals (ttl_s / 2: it is alive), and with `wait_s` set when it has missed
more (its driver is likely gone: a whole cluster lost and KubeRay's retry started a new head), so
the new driver waits for the lease to expire and takes over instead of failing and using up the
retry; a renewal seen meanwhile refuses it. Otherwise (no lease, its holder
released it at the end of its run, or the holder is gone: no renewal for `ttl_s`) the next number
is created exclusively and read back. Ages compare the reader's clock with the holder's: ttl_s
must exceed the clocks' skew (NTP keeps it to milliseconds; the default is 30 s).

What is exclusive and what remains racy: creating the next number uses `Storage.create`, which is
exclusive on local disk, in memory and on S3 stores that honour `If-None-Match: *` (AWS S3 since
2024; s3fs's "xb" mode sends it). On a store that ignores the condition, two drivers that both
find the lease expired at the same moment may both write the same number; each reads it back
after writing and the one whose write did not survive steps aside, so the window is the store's
read-after-write lag, not the run. Renewals are plain overwrites by the holder alone.

A lease is its holder's, compared by holder identity, not only by number: a renewal that finds
its number's record naming another holder has lost the run. The newest lease is the highest
number among both records and renewals, so a recent `.renewed` whose `.json` is gone (a storage
lifecycle rule, a manual clean-up) still counts as held: no second driver takes the same number.
Storage lifecycle rules must leave `lease/` alone all the same (docs/deploying.md).

Fresh or not: the holder's own clock says how old its last landed renewal is (the wall time it
wrote, not when the write came back). `fresh()` holds within 3/4 of ttl_s, the margin for a
renewal in flight and clock skew; a driver that is not fresh (frozen, cut off from storage)
writes nothing into the run folder (fence, events, metrics) until a renewal lands again, and one
whose lease was taken over never does. `check_now()` renews at once, for a controller that finds
itself stale (its own loop was stalled) before it judges anyone else.

Generations come from the lease: a controller's groups are numbered from `generation_base()`
((lease number - 1) x GENERATION_STRIDE), so a newer lease's groups are above every group an older
holder can form (a run's first driver numbers them from 1), and two controllers never form the
same generation: the fence (fencing.py) then shuts an older holder's workers out.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from elastic.storage import Storage, StorageError, StorageTimeout, call_within, join

log = logging.getLogger(__name__)

LEASE_DIR = "lease"
RELEASED = "released"  # a `.renewed` that says so: the holder ended, the lease is free at once
GENERATION_STRIDE = 1_000_000  # group formations one lease may make before its generations reach the next's
UNKNOWN_HOLDER = "unknown (its record is gone)"  # a `.renewed` whose `.json` storage lost
FRESH_FRACTION = 0.75  # of ttl_s: how old the holder's own last renewal may be for it to write


class LeaseHeld(RuntimeError):
    """Another driver holds the run's lease. `wait_s`: set when its holder has missed renewals
    (it looks gone) but the lease has not expired yet: ask again after that long."""

    def __init__(self, message: str, wait_s: float | None = None):
        super().__init__(message)
        self.wait_s = wait_s


@dataclass(frozen=True)
class LeaseInfo:
    number: int
    holder: str
    host: str
    pid: int
    taken_t: float
    renewed_t: float  # the last renewal the holder wrote (taken_t if none yet)

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.renewed_t)


def _name(number: int, suffix: str) -> str:
    return f"{number:09d}.{suffix}"


class Lease:
    def __init__(self, storage: Storage, run_dir: str, ttl_s: float, wall: Callable[[], float] = time.time):
        self.storage, self.dir, self.ttl_s, self.wall = storage, join(run_dir, LEASE_DIR), ttl_s, wall
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.number: int | None = None
        self.lost: str | None = None  # why this holder lost the lease, once it has
        self.renewed_t: float | None = None  # wall time of the last renewal that landed (or the take)
        self.last_error: str | None = None  # why the last renewal did not land
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._body: dict = {}  # this holder's record, as taken (written again if storage loses it)

    # ---------------------------------------------------------------- reading
    def newest(self) -> LeaseInfo | None:
        """The newest lease taken on this run, or None. Raises StorageError when it cannot be read.
        Counted from records and renewals alike: a renewal whose record is gone still holds."""
        names = set(self._names())
        numbers = sorted({int(n[:9]) for n in names if n[:9].isdigit() and n[9:] in (".json", ".renewed")})
        if not numbers:
            return None
        n = numbers[-1]
        if _name(n, "json") in names:
            body = json.loads(self.storage.read_bytes(join(self.dir, _name(n, "json"))).decode())
        else:
            body = {"holder": UNKNOWN_HOLDER, "host": "?", "pid": -1, "taken_t": float("-inf")}
        renewed = body["taken_t"]
        try:
            text = self.storage.read_bytes(join(self.dir, _name(n, "renewed"))).decode()
            renewed = float("-inf") if text == RELEASED else max(renewed, float(text))
        except (StorageError, ValueError):
            pass  # not renewed yet, or a renewal being written: the take time stands
        return LeaseInfo(n, body["holder"], body["host"], body["pid"], body["taken_t"], renewed)

    def _names(self) -> list[str]:
        try:
            return [u.rstrip("/").rsplit("/", 1)[-1] for u in self.storage.list_dir(self.dir)]
        except StorageError:
            if not self.storage.exists(self.dir):
                return []
            raise

    # ---------------------------------------------------------------- taking and keeping
    def take(self) -> LeaseInfo:
        """Take the run's lease, or raise LeaseHeld (another driver renewed it within ttl_s)."""
        now = self.wall()
        cur = self.newest()
        if cur is not None and cur.holder == self.holder:  # an earlier call that timed out took it after all
            self.number, self.renewed_t = cur.number, now
            return cur
        if cur is not None and cur.age_s(now) < self.ttl_s:
            age = cur.age_s(now)
            # Alive within two renewal intervals: refused at once. Past that it looks gone: the
            # caller may wait out the rest of ttl_s, watching for a renewal.
            wait_s = None if age < self.ttl_s / 2 else self.ttl_s - age
            raise LeaseHeld(f"run folder {self.dir.rsplit('/', 2)[0]} is in use: lease {cur.number} is held by "
                            f"{cur.holder} (host {cur.host}, pid {cur.pid}), renewed {cur.age_s(now):.1f} s ago "
                            f"(run.lease_ttl_s={self.ttl_s:g}). Stop that run first, wait until its lease is "
                            f"{self.ttl_s:g} s old (its driver is gone), or use another run.name", wait_s)
        number = (cur.number if cur else 0) + 1
        body = self._body = {"holder": self.holder, "host": socket.gethostname(), "pid": os.getpid(),
                             "taken_t": now, "after": cur.holder if cur else None}
        created = self.storage.create(join(self.dir, _name(number, "json")), json.dumps(body).encode())
        back = json.loads(self.storage.read_bytes(join(self.dir, _name(number, "json"))).decode())
        if not created or back["holder"] != self.holder:
            raise LeaseHeld(f"run folder {self.dir.rsplit('/', 2)[0]}: another driver ({back['holder']}) took "
                            f"lease {number} at the same moment; it owns the run")
        self.number, self.renewed_t = number, now
        return LeaseInfo(number, self.holder, body["host"], body["pid"], now, now)

    def generation_base(self) -> int:
        """The generation a holder's groups are numbered above: lease 1's from 1 (a run's first
        driver), lease n's from (n - 1) x GENERATION_STRIDE."""
        assert self.number is not None, "take() first"
        return (self.number - 1) * GENERATION_STRIDE

    def start_renewing(self) -> None:
        """Renew every ttl_s / 4 on a daemon thread until `release()`. A newer lease taken by
        another driver loses it: `lost` says why. A renewal storage does not answer within
        ttl_s / 4 counts as failed (`StorageTimeout`); with no renewal landed for ttl_s the lease
        has lapsed (`lapsed_s`) and another driver may take the run. That alone does not end this
        one: a storage outage longer than ttl_s must not stop a run that needs no storage to
        train. What keeps two drivers apart meanwhile is the fence: a driver that took over has
        written a newer generation, so this one's workers commit nothing and its own writes are
        refused (`FenceWriter.holds`), and its next renewal that reaches storage finds the newer
        lease and stops it."""
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renewal", daemon=True)
        self._thread.start()

    def renew_once(self) -> None:
        """One renewal: lost when a newer lease exists or this number's record names another
        holder; raises StorageError when storage fails. A record of ours that storage lost is
        written again (exclusively: a driver that took the number meanwhile keeps it)."""
        cur = self.newest()
        if cur is not None and cur.holder == UNKNOWN_HOLDER and cur.number == self.number:
            self.storage.create(join(self.dir, _name(self.number, "json")), json.dumps(self._body).encode())
            cur = self.newest()
        if cur is not None and (cur.number != self.number or cur.holder != self.holder):
            self.lost = (f"lease {self.number} was taken over: lease {cur.number} is held by {cur.holder} "
                         f"(host {cur.host}, pid {cur.pid}), who owns the run now")
            return
        t = self.wall()
        self.storage.write_bytes(join(self.dir, _name(self.number, "renewed")), repr(t).encode())
        self._landed(t)

    def _landed(self, t: float) -> None:
        """A renewal written at wall time `t` landed: the lease is fresh from `t`, not from when
        the write came back (a takeover is judged by the time written)."""
        if self.lost is None:
            self.renewed_t, self.last_error = max(self.renewed_t or t, t), None

    def fresh(self) -> tuple[bool, str]:
        """(whether this holder may write into the run folder now, why not): it holds the lease,
        never lost it, and its last renewal landed within FRESH_FRACTION x ttl_s by its own
        clock (a driver that was frozen or cut off knows it is stale before anyone can have
        taken over)."""
        if self.number is None:
            return False, "this driver holds no lease on the run"
        if self.lost is not None:
            return False, f"this driver no longer owns the run: {self.lost}"
        age = self.wall() - (self.renewed_t if self.renewed_t is not None else float("-inf"))
        if age >= FRESH_FRACTION * self.ttl_s:
            return False, (f"lease {self.number} is stale: its last renewal landed {age:.1f} s ago "
                           f"(run.lease_ttl_s={self.ttl_s:g}); nothing is written until one lands again")
        return True, ""

    def check_now(self, timeout_s: float) -> bool:
        """Renew at once, within `timeout_s`: for a controller that finds itself stale (its own
        loop stalled) before it judges anyone else. True when a renewal landed; `lost` says
        when the lease was taken over meanwhile."""
        answered, _, error = call_within(self.renew_once, timeout_s)
        if not answered or error is not None:
            self.last_error = (f"{type(error).__name__}: {error}"[:300] if error is not None
                               else f"renewal not answered within {timeout_s:g} s")
            return False
        return self.lost is None

    def lapsed_s(self) -> float | None:
        """Seconds since the last renewal that landed, once that is ttl_s or more; else None."""
        if self.renewed_t is None:
            return None
        age = self.wall() - self.renewed_t
        return age if age >= self.ttl_s else None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4) and self.lost is None:
            try:
                # Each renewal within ttl_s / 4: one hung call (a store that never answers) would
                # stop the loop, and the lease would expire unnoticed while this driver trains on.
                answered, _, error = call_within(self.renew_once, self.ttl_s / 4)
                if not answered:
                    raise StorageTimeout(f"renewal of lease {self.number} in {self.dir} not answered within "
                                         f"{self.ttl_s / 4:g} s (run.lease_ttl_s / 4)")
                if error is not None:
                    raise error
            except Exception as e:  # noqa: BLE001 - storage trouble: retried every ttl_s / 4
                log.warning("lease renewal failed: %s", e)
                self.last_error = f"{type(e).__name__}: {e}"[:300]

    def release(self) -> None:
        """Stop renewing and mark the lease expired, so the next submission need not wait out ttl_s."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.number is None or self.lost is not None:
            return

        def mark_released() -> None:
            cur = self.newest()
            if cur is not None and cur.number == self.number and cur.holder == self.holder:
                self.storage.write_bytes(join(self.dir, _name(self.number, "renewed")), RELEASED.encode())
        # Within ttl_s / 4: the run is over, and its end must not wait on storage that hangs.
        answered, _, error = call_within(mark_released, self.ttl_s / 4)
        if not answered or error is not None:  # best effort: the lease expires on its own after ttl_s
            log.warning("lease not released: %s", error or f"storage did not answer within {self.ttl_s / 4:g} s")
