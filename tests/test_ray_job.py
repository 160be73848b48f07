"""A submitted job's run never lands in the copy of its working directory that Ray unpacks: the
rule on its own (no Ray), as `check_storage_location` sees a job. The real `ray job submit` is in
tests/test_job_submit.py."""
from __future__ import annotations

import pytest

from elastic.config import ConfigError
from elastic.ray_job import SUBMITTED_JOB_ENV, check_storage_location, session_folder

SESSION = "/tmp/ray/session_2026-12-07_18-44-01_123456_789"
UNPACKED = f"{SESSION}/runtime_resources/working_dir_files/_ray_pkg_0123abcd"
SUBMITTED = {SUBMITTED_JOB_ENV: '{"runtime_env": {"working_dir": "gcs://_ray_pkg_0123abcd.zip"}}'}


@pytest.mark.parametrize("uri", ["file://./runs", "runs", "file://runs/deeper",
                                 f"file://{UNPACKED}/runs", f"{SESSION}/runtime_resources/elsewhere"])
def test_a_submitted_job_may_not_keep_its_run_in_the_unpacked_working_directory(uri):
    with pytest.raises(ConfigError) as e:
        check_storage_location(uri, environ=SUBMITTED, cwd=UNPACKED)
    text = str(e.value)
    assert text.startswith("checkpoint.storage_uri: ") and "\n" not in text
    assert SESSION in text and "s3://bucket/prefix" in text and "file:///mnt/shared/runs" in text


@pytest.mark.parametrize("uri, environ, cwd", [
    ("file:///mnt/shared/runs", SUBMITTED, UNPACKED),        # absolute, outside Ray's folders
    ("s3://bucket/runs", SUBMITTED, UNPACKED),               # not a path on this node
    ("memory://runs", SUBMITTED, UNPACKED),
    ("file://./runs", SUBMITTED, "/home/me/project"),        # a job run where the user started it
    ("file://./runs", {}, UNPACKED),                         # not a submitted job
])
def test_storage_that_outlives_the_job_is_taken(uri, environ, cwd):
    check_storage_location(uri, environ=environ, cwd=cwd)


def test_the_session_folder_is_found_only_above_runtime_resources():
    assert session_folder(f"{UNPACKED}/runs") == SESSION
    assert session_folder(f"{SESSION}/logs/runs") is None
    assert session_folder("/data/session_notes/runtime_resources_x/runs") is None
