"""Where a job submitted with `ray job submit --working-dir` keeps its run: never inside the copy
of the working directory that Ray unpacks for it.

Ray unpacks a job's working directory under its session folder
(`/tmp/ray/session_<date>/runtime_resources/working_dir_files/_ray_pkg_<hash>/`) and runs the
entrypoint there. A relative `file://./runs` then lands in that copy: temporary (gone with the
session), on the head node only, not where the user looks; and since the copy is named by the
hash of the files, the next submission of the same files finds the run there and resumes it
without being asked. The driver refuses such a storage URI before any work, saying why and what
to give instead (elastic/trainer.py calls `check_storage_location`).
"""
from __future__ import annotations

import os

from elastic.config.loading import ConfigError

# Set by Ray's job supervisor in the environment of every entrypoint that `ray job submit` starts.
SUBMITTED_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
RESOURCES_DIR = "runtime_resources"


def session_folder(path: str) -> str | None:
    """The Ray session folder `path` lies in, if it lies in an unpacked runtime resource of one
    (`.../session_*/runtime_resources/...`); else None."""
    parts = os.path.abspath(path).split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part.startswith("session_") and parts[i + 1] == RESOURCES_DIR:
            return os.sep.join(parts[:i + 1]) or os.sep
    return None


def check_storage_location(uri: str, environ=os.environ, cwd: str | None = None) -> None:
    """ConfigError if this is a submitted Ray job and `uri` (as the job gives it) is a local path
    that resolves into the folder Ray unpacked the job's working directory into."""
    if SUBMITTED_JOB_ENV not in environ:
        return
    if "://" in uri and not uri.startswith("file://"):
        return  # s3://, memory://, ...: not a path on this node
    path = os.path.expanduser(uri.removeprefix("file://"))
    resolved = os.path.normpath(os.path.join(cwd or os.getcwd(), path))
    session = session_folder(resolved)
    if session is None:
        return
    raise ConfigError(
        f"checkpoint.storage_uri: {uri!r} resolves to {resolved}, inside the copy of the working "
        f"directory that Ray unpacked for this job under {session}: Ray deletes it with its "
        f"session, it is on this node only, and the next submission of the same files would "
        f"resume this run. "
        f"Give storage that outlives the job and every node reaches: an absolute path on a shared "
        f"filesystem (file:///mnt/shared/runs) or an object store (s3://bucket/prefix), e.g. "
        f"--set checkpoint.storage_uri=s3://bucket/prefix")
