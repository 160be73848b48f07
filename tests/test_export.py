"""The model out (`elastic export`, elastic/checkpoint/export.py): a run's checkpoint, written in
any layout, as one plain state dict (weights only, the model's own names) that torch or
safetensors loads with nothing of elastic installed; and the way back in, another run's checkpoint
as `train.init_from`. Real gloo ranks forked without Ray (tests/spawn_ranks.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.cli import main
from tests.spawn_ranks import run_ranks
from tests.support.pretrained import file_hashes
from tests.test_init_from import PROBE, _union
from tests.test_tensor_parallel import gpt_job

# A process without elastic (its import refused) loads the file into the user's model, strictly.
LOAD_WITHOUT_ELASTIC = """
import sys
sys.modules["elastic"] = None  # any import of elastic now fails
import torch
from examples.gpt import build_model
path = sys.argv[1]
if path.endswith(".safetensors"):
    from safetensors.torch import load_file
    sd = load_file(path)
else:
    sd = torch.load(path, weights_only=True)
model = build_model()
model.load_state_dict(sd, strict=True)
print("loaded", len(sd))
"""


@pytest.mark.timeout(900)
def test_a_fsdp_x_tp_checkpoint_exports_whole_and_starts_a_ddp_run(tmp_path, capsys):
    job = gpt_job(tmp_path, "fsdp", workers=4, tp=2, steps=3, name="src")  # every_steps 3
    trained = _union(run_ranks(job, probe=PROBE), "probe")  # each gathered from its 2-D shards
    run = tmp_path / "src"
    st, pt = tmp_path / "out" / "model.safetensors", tmp_path / "model.pt"
    assert main(["export", str(run), "--to", str(st)]) == 0
    assert "from the checkpoint of step 3" in capsys.readouterr().out
    assert main(["export", f"file://{run}", "--step", "3", "--to", str(pt)]) == 0
    assert file_hashes(str(st)) == file_hashes(str(pt)) == trained  # weights only, bit for bit
    for path in (st, pt):
        done = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_ELASTIC, str(path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and f"loaded {len(trained)}" in done.stdout, done.stderr[-2000:]
    # The way back: the run folder as train.init_from (DCP: each rank reads the chunks it needs).
    ft = gpt_job(tmp_path, "ddp", workers=2, tp=1, steps=1, name="ft", init_from=str(run))
    out = run_ranks(ft, steps=0, start_probe=PROBE)
    assert _union(out, "start_probe") == trained


@pytest.mark.timeout(600)
def test_a_pipelines_stages_export_as_one_model(tmp_path):
    job = gpt_job(tmp_path, "pipeline", workers=2, tp=1, stages=2, steps=3, name="pp")
    out = run_ranks(job, pp=2, probe=PROBE)
    stages = [set(o[6]["probe"]["hashes"]) for o in out]
    assert stages[0] and stages[1] and not stages[0] & stages[1]  # each stage held its own part
    assert main(["export", str(tmp_path / "pp"), "--to", str(tmp_path / "m.safetensors")]) == 0
    assert file_hashes(str(tmp_path / "m.safetensors")) == _union(out, "probe")


def test_export_refusals_are_one_line(tmp_path, capsys):
    import re
    run_ranks(gpt_job(tmp_path, "ddp", workers=1, tp=1, steps=3, name="one"))
    run, to = str(tmp_path / "one"), str(tmp_path / "m.pt")
    cases = [([run, "--step", "2"], r"no committed checkpoint of step 2 .*committed: steps \[3\]"),
             ([run, "--to", f"{tmp_path}/model.txt"], r"--to .*model.txt: name a .safetensors"),
             ([f"{tmp_path}/none"], r"none holds no committed checkpoint")]
    for args, message in cases:
        assert main(["export", "--to", to, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "model.txt").exists()
