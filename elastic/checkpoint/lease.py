"""One live run per run folder: a lease in storage, taken by the controller before any worker starts.

Two drivers on one run (a KubeRay retry while the first head is cut off rather than dead, a user
submitting the same job twice) would both train over the same checkpoints and fence. The lease
makes the second one stop before it starts anything.

Layout, beside the checkpoints, under `<run dir>/lease/`:

    000000003.json        who took lease 3: holder id, host, pid, when (written once, exclusively)
    000000003.renewed     the holder's last renewal, epoch seconds (rewritten every ttl/4)

Taking: the newest lease is read; if its holder renewed it within `ttl_s`, the run is held and
`take` raises `LeaseHeld` naming the holder and the lease's age. Otherwise (no lease, its holder
released it at the end of its run, or the holder is gone: no renewal for `ttl_s`) the next number
is created exclusively and read back. Ages compare the reader's clock with the holder's: ttl_s
must exceed the clocks' skew (NTP keeps it to milliseconds; the default is 30 s).

What is exclusive and what remains racy: creating the next number uses `Storage.create`, which is
exclusive on local disk, in memory and on S3 stores that honour `If-None-Match: *` (AWS S3 since
2024; s3fs's "xb" mode sends it). On a store that ignores the condition, two drivers that both
find the lease expired at the same moment may both write the same number; each reads it back
after writing and the one whose write did not survive steps aside, so the window is the store's
read-after-write lag, not the run. Renewals are plain overwrites by the holder alone.

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


class LeaseHeld(RuntimeError):
    """Another driver holds the run's lease."""


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

    # ---------------------------------------------------------------- reading
    def newest(self) -> LeaseInfo | None:
        """The newest lease taken on this run, or None. Raises StorageError when it cannot be read."""
        numbers = sorted(int(n.split(".")[0]) for n in self._names() if n.endswith(".json") and n[:9].isdigit())
        if not numbers:
            return None
        n = numbers[-1]
        body = json.loads(self.storage.read_bytes(join(self.dir, _name(n, "json"))).decode())
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
            raise LeaseHeld(f"run folder {self.dir.rsplit('/', 2)[0]} is in use: lease {cur.number} is held by "
                            f"{cur.holder} (host {cur.host}, pid {cur.pid}), renewed {cur.age_s(now):.1f} s ago "
                            f"(run.lease_ttl_s={self.ttl_s:g}). Stop that run first, wait until its lease is "
                            f"{self.ttl_s:g} s old (its driver is gone), or use another run.name")
        number = (cur.number if cur else 0) + 1
        body = {"holder": self.holder, "host": socket.gethostname(), "pid": os.getpid(), "taken_t": now,
                "after": cur.holder if cur else None}
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
        """One renewal: lost when a newer lease exists; raises StorageError when storage fails."""
        cur = self.newest()
        if cur is not None and cur.number != self.number:
            self.lost = (f"lease {self.number} was taken over: lease {cur.number} is held by {cur.holder} "
                         f"(host {cur.host}, pid {cur.pid}), who owns the run now")
            return
        self.storage.write_bytes(join(self.dir, _name(self.number, "renewed")), repr(self.wall()).encode())

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
                if self.lost is None:
                    self.renewed_t, self.last_error = self.wall(), None
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
            if self.newest().number == self.number:
                self.storage.write_bytes(join(self.dir, _name(self.number, "renewed")), RELEASED.encode())
        # Within ttl_s / 4: the run is over, and its end must not wait on storage that hangs.
        answered, _, error = call_within(mark_released, self.ttl_s / 4)
        if not answered or error is not None:  # best effort: the lease expires on its own after ttl_s
            log.warning("lease not released: %s", error or f"storage did not answer within {self.ttl_s / 4:g} s")
