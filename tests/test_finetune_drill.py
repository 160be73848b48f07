"""The fine-tune drill on a real local multi-node Ray cluster (tests/ray_fixtures.py; run under
`flock /tmp/elastic-ray.lock`): a run trains under FSDP over 4 ranks, its model is exported
(`elastic export`), and a new run under DDP over 2 starts from the file with `train.init_from`.
Each of its ranks records its weights at its first loss call, before the first update: they are
the file's, bit for bit."""
from __future__ import annotations

import json
import os
import pathlib

import pytest

from elastic import Trainer
from elastic.cli import main
from tests.ray_fixtures import cluster, ray_cluster  # noqa: F401 - pytest fixtures
from tests.support.pretrained import file_hashes, tensor_hash

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]


class FirstWeights:
    """examples/gpt.py's loss that writes, on its first call in a worker, a hash of each tensor of
    the model it is given (DDP: the whole model) to `folder`/<pid>.json. Given to the Trainer as an
    object: it travels to the workers pickled, its folder with it."""

    def __init__(self, folder: str):
        self.folder, self.seen = folder, False

    def __call__(self, model, batch):
        from examples.gpt import loss_fn
        if not self.seen:
            self.seen = True
            hashes = {k: tensor_hash(v) for k, v in model.state_dict().items()}
            pathlib.Path(self.folder, f"{os.getpid()}.json").write_text(json.dumps(hashes))
        return loss_fn(model, batch)


def _job(tmp_path, name: str, strategy: str, workers: int, steps: int, **train) -> dict:
    return {"run": {"name": name, "num_steps": steps, "seed": 0},
            "scaling": {"num_workers": workers},
            "checkpoint": {"storage_uri": str(tmp_path / "runs"), "every_steps": steps},
            "train": {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
                      "loss": "examples.gpt:loss_fn", "global_batch_size": 16,
                      "strategy": strategy, **train}}


def test_a_fsdp_run_exported_starts_a_ddp_run_with_the_files_weights(
        cluster, tmp_path):  # noqa: F811
    src = Trainer(_job(tmp_path, "pretrain", "fsdp", 4, 6)).fit(progress=False)
    assert src.metrics["step"] == 6
    model = tmp_path / "model.safetensors"
    assert main(["export", src.run_dir, "--to", str(model)]) == 0
    want = file_hashes(str(model))
    seen = tmp_path / "first"
    seen.mkdir()
    ft = Trainer(_job(tmp_path, "finetune", "ddp", 2, 2, init_from=str(model),
                      loss=FirstWeights(str(seen))))
    result = ft.fit(progress=False)
    assert result.metrics["step"] == 2
    assert result.events_of("restored")[0]["source"] == "init"
    firsts = [json.loads(p.read_text()) for p in sorted(seen.glob("*.json"))]
    assert len(firsts) == 2 and all(f == want for f in firsts)  # both ranks, every tensor, exactly
    recorded = (tmp_path / "runs" / "finetune" / "config.yaml").read_text()
    assert f"init_from: file://{model}" in recorded
    assert "loss: <object tests.test_finetune_drill.FirstWeights instance>" in recorded
