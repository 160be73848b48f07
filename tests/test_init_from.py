"""Fine-tuning from pretrained weights (train.init_from, elastic/checkpoint/pretrained.py): a
safetensors file, a torch state dict or another run's checkpoint, loaded at a fresh start into
any layout, each rank reading its part; names checked before any worker starts; parameters with
requires_grad=False kept as loaded and out of the optimizer under every strategy. Real gloo
ranks forked without Ray (tests/spawn_ranks.py)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from elastic import Trainer
from elastic.checkpoint import pretrained
from elastic.config import ConfigError
from tests.spawn_ranks import run_ranks
from tests.support.pretrained import build_frozen_gpt, file_hashes, tensor_hash
from tests.test_tensor_parallel import gpt_job

PROBE = "tests.support.pretrained:state_probe"
FROZEN = ("0.", "1.")  # build_frozen_gpt's embedding and first block
FROZEN_GPT = "tests.support.pretrained:build_frozen_gpt"


def _pretrained(tmp_path, name: str, seed: int = 123, drop=(), extra=None) -> str:
    """Weights of another training (another seed), as a fine-tune starts from, in a file."""
    torch.manual_seed(seed)
    sd = {k: v.clone() for k, v in build_frozen_gpt().state_dict().items() if k not in drop}
    sd.update(extra or {})
    path = tmp_path / name
    save_file(sd, str(path)) if name.endswith(".safetensors") else torch.save(sd, path)
    return str(path)


def _union(out, key: str) -> dict[str, str]:
    """Every rank's {name: hash} merged (a pipeline stage holds its own names), checked to agree."""
    merged: dict[str, str] = {}
    for o in out:
        for k, h in o[6][key]["hashes"].items():
            assert merged.setdefault(k, h) == h, f"ranks disagree on {k}"
    return merged


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy, workers, tp, stages, meta, file", [
    ("ddp", 2, 1, None, False, "w.pt"),
    ("fsdp", 4, 2, None, True, "w.safetensors"),  # each rank reads its 2-D slices of the file
    ("pipeline", 2, 1, 2, False, "w.pt"),
])
def test_init_from_loads_the_file_bit_for_bit_and_frozen_parameters_stay(
        tmp_path, strategy, workers, tp, stages, meta, file):
    path = _pretrained(tmp_path, file)
    want = file_hashes(path)
    job = gpt_job(tmp_path, strategy, workers=workers, tp=tp, stages=stages, steps=2, name="ft",
                  meta_init=meta, model=FROZEN_GPT, init_from=path)
    out = run_ranks(job, pp=stages or 1, probe=PROBE, start_probe=PROBE)
    assert {o[4] for o in out} == {"init"}
    assert _union(out, "start_probe") == want  # every tensor as the file has it, before an update
    after = _union(out, "probe")
    frozen = [k for k in want if k.startswith(FROZEN)]
    trained = [k for k in want if not k.startswith(FROZEN)]
    assert frozen and trained
    assert all(after[k] == want[k] for k in frozen)  # requires_grad=False: never updated
    assert all(after[k] != want[k] for k in trained)
    assert all(not trains for o in out for n, trains in o[6]["probe"]["trains"].items()
               if n.startswith(FROZEN))
    assert [o[6]["frozen_in_optim"] for o in out] == [0] * workers  # no param group, no state


@pytest.mark.timeout(600)
def test_missing_and_unexpected_names_refuse_the_run_unless_allowed_and_the_rest_loads(tmp_path):
    path = _pretrained(tmp_path, "w.safetensors", drop=("0.pos.weight",),
                       extra={"adapter.weight": torch.ones(2)})
    job = gpt_job(tmp_path, "ddp", workers=2, tp=2, steps=1, name="ns", model=FROZEN_GPT,
                  init_from=path)
    names = (r"train.init_from: .* does not match the model's names \(missing from the file: "
             r"0.pos.weight; not in the model: adapter.weight\); set train.init_strict: false")
    with pytest.raises(ConfigError, match=names):
        Trainer(job)
    bad = _pretrained(tmp_path, "b.pt", extra={"1.qkv.weight": torch.zeros(3, 3)})
    with pytest.raises(ConfigError, match=r"other shapes than the model's: 1.qkv.weight: \(3, 3\) "
                                          r"in the file, \(192, 64\) in the model"):
        Trainer({**job, "train": {**job["train"], "init_from": bad}})
    job["train"]["init_strict"] = False
    assert Trainer(job).job.train.init_from == f"file://{path}"  # checked, resolved, let through
    out = run_ranks(job, steps=0, start_probe=PROBE)  # ddp x tp: each rank its tp slices
    got, want = _union(out, "start_probe"), file_hashes(path)
    torch.manual_seed(0)  # the run's seed: what the missing one keeps (rank 0's eager init)
    init = tensor_hash(build_frozen_gpt().state_dict()["0.pos.weight"])
    assert got == {**{k: v for k, v in want.items() if k != "adapter.weight"}, "0.pos.weight": init}


def test_a_run_folder_resolves_to_its_newest_committed_checkpoint(tmp_path):
    job = gpt_job(tmp_path, "fsdp", workers=2, tp=1, steps=4, name="src")
    job["checkpoint"]["every_steps"] = 2
    run_ranks(job)
    newest = f"file://{tmp_path}/src/checkpoints/step_000000004"
    assert pretrained.resolve(str(tmp_path / "src"), {}) == newest
    assert pretrained.resolve(f"file://{tmp_path}/src/checkpoints", {}) == newest
    older = f"file://{tmp_path}/src/checkpoints/step_000000002"
    assert pretrained.resolve(older, {}) == older
    with pytest.raises(pretrained.PretrainedError, match="neither a file"):
        pretrained.resolve(str(tmp_path / "nothing"), {})
