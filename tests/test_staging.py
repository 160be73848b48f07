"""Staging folders: removed when their owner is done or dead, never while it lives."""
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from elastic.checkpoint import dcp_io, loading
from elastic.checkpoint import staging

pytestmark = pytest.mark.timeout(60)

# A process that takes a staging folder, writes a file into it, says where, and waits to be killed.
OWNER = textwrap.dedent("""
    import sys, time
    from elastic.checkpoint.staging import stage_folder
    with stage_folder(sys.argv[1]) as shards:
        open(shards + "/__0_0.distcp", "wb").write(b"x" * 1024)
        print(shards, flush=True)
        time.sleep(600)
""")


def start_owner(parent):
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(parent)], stdout=subprocess.PIPE, text=True)
    shards = p.stdout.readline().strip()
    assert shards, "the owner did not take a folder"
    return p, os.path.dirname(shards)


def stages(parent):
    return sorted(n for n in os.listdir(parent) if n.startswith(staging.PREFIX))


def test_a_folder_is_removed_when_its_owner_is_done(tmp_path):
    with staging.stage_folder(str(tmp_path)) as shards:
        open(os.path.join(shards, "a"), "wb").write(b"1")
        assert len(stages(tmp_path)) == 1
    assert stages(tmp_path) == []


def test_a_killed_owners_folder_is_removed_by_the_next_one_and_a_live_owners_is_kept(tmp_path):
    live, live_top = start_owner(tmp_path)
    dead, dead_top = start_owner(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)  # no finally runs: its folder stays behind
        dead.wait()
        assert os.path.isdir(dead_top)
        with staging.stage_folder(str(tmp_path)) as mine:
            assert not os.path.exists(dead_top)
            assert os.path.isdir(live_top) and os.listdir(os.path.join(live_top, "shards")) == ["__0_0.distcp"]
            # A sweep from the same process does not take its own folder for a dead one's.
            assert staging.sweep(str(tmp_path)) == []
            assert os.path.isdir(mine)
    finally:
        live.kill()
        live.wait()
    assert staging.sweep(str(tmp_path)) == [live_top]
    assert stages(tmp_path) == []


def test_a_folder_without_an_owner_file_is_removed_only_once_old(tmp_path):
    bare = tempfile.mkdtemp(prefix=staging.PREFIX, dir=tmp_path)  # the layout before this module
    other = tmp_path / "elastic-s3-data"  # not a staging folder
    other.mkdir()
    now = time.time()
    assert staging.sweep(str(tmp_path), now=now) == []
    assert staging.sweep(str(tmp_path), now=now + staging.UNOWNED_AFTER_S + 1) == [bare]
    assert other.is_dir()


def test_a_remote_save_stages_in_a_folder_it_removes(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = tempfile.mkdtemp(prefix=staging.PREFIX)  # as a killed worker's, long ago
    os.utime(left, (time.time() - 2 * staging.UNOWNED_AFTER_S,) * 2)
    seen = []
    real = staging.stage_folder

    def watching(*a, **kw):
        seen.append(stages(tmp_path))
        return real(*a, **kw)

    monkeypatch.setattr(dcp_io, "stage_folder", watching)
    state = {"w": torch.arange(6.0)}
    dcp_io.save_shards(state, "memory://staging-test/step_1", {}, None)
    assert seen == [[os.path.basename(left)]]
    assert stages(tmp_path) == []  # the left folder swept, this save's own removed
    out = {"w": torch.zeros(6)}
    loading.load_shards(out, "memory://staging-test/step_1", {}, None)
    assert torch.equal(out["w"], state["w"])
