"""Bad input gets a clear error naming the field, before any worker starts."""
import textwrap
from pathlib import Path

import pytest

from elastic.cli import main
from elastic.config import ConfigError, batch_plan, load_job, parse_job
from elastic.trainer import Trainer

TRAIN = {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
         "loss": "elastic.workload:loss_fn", "global_batch_size": 96}


def job(**over):
    base = {"run": {"name": "t", "num_steps": 10}, "scaling": {"num_workers": 3}, "train": dict(TRAIN)}
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return base


def test_valid_job_parses():
    cfg = parse_job(job())
    assert cfg.scaling.num_workers == 3 and cfg.train.global_batch_size == 96


@pytest.mark.parametrize("over, field", [
    ({"scaling": {"num_workers": -1}}, "scaling.num_workers"),
    ({"checkpoint": {"every_steps": 0}}, "checkpoint.every_steps"),
    ({"scaling": {"num_wrkers": 2}}, "scaling.num_wrkers"),
    ({"bogus": 1}, "bogus"),
    ({"run": {"name": "has space"}}, "run.name"),
    ({"chaos": [{"action": "kill_node", "rank": 1, "at_step": 2, "during_upload": "often"}]}, "chaos.0.during_upload"),
    ({"chaos": [{"action": "hold_gil", "rank": 1, "at_step": 2, "hold_s": -1}]}, "chaos.0.hold_s"),
    ({"failure": {"heartbeat": "maybe"}}, "failure.heartbeat"),
    ({"checkpoint": {"upload_timeout_s": 0}}, "checkpoint.upload_timeout_s"),
    ({"checkpoint": {"upload_min_mb_per_s": -1}}, "checkpoint.upload_min_mb_per_s"),
    ({"checkpoint": {"persist_timeout_s": 0}}, "checkpoint.persist_timeout_s"),
    ({"checkpoint": {"storage_options": {"config_kwargs": {"read_timeout": None}}}},
     "checkpoint.storage_options.config_kwargs.read_timeout"),
    ({"checkpoint": {"storage_options": {"config_kwargs": {"connect_timeout": 0}}}},
     "checkpoint.storage_options.config_kwargs.connect_timeout"),
])
def test_errors_name_the_field(over, field):
    with pytest.raises(ConfigError) as e:
        parse_job(job(**over))
    assert field in str(e.value)


def test_global_batch_not_divisible_by_world():
    with pytest.raises(ConfigError, match=r"global_batch_size=96 is not divisible by 5 workers"):
        parse_job(job(scaling={"num_workers": 5}))


def test_micro_batch_must_divide_the_per_rank_batch():
    with pytest.raises(ConfigError, match=r"micro_batch_size=5 does not divide the per-rank batch 32"):
        parse_job(job(train={**TRAIN, "micro_batch_size": 5}))
    assert batch_plan(96, 3, 8) == (8, 4)


def test_chaos_rank_must_exist():
    with pytest.raises(ConfigError, match=r"chaos\[0\].rank=3"):
        parse_job(job(chaos=[{"action": "kill_node", "rank": 3, "at_step": 2}]))


def test_module_function_that_does_not_import(tmp_path):
    with pytest.raises(ConfigError, match=r"train.model: cannot import module 'no_such_mod'"):
        Trainer(job(train={**TRAIN, "model": "no_such_mod:f"}, checkpoint={"storage_uri": str(tmp_path)}))
    with pytest.raises(ConfigError, match=r"train.loss: module 'elastic.workload' has no callable 'nope'"):
        Trainer(job(train={**TRAIN, "loss": "elastic.workload:nope"}, checkpoint={"storage_uri": str(tmp_path)}))
    with pytest.raises(ConfigError, match=r"train.dataset: expected 'module:function'"):
        Trainer(job(train={**TRAIN, "dataset": "justaname"}, checkpoint={"storage_uri": str(tmp_path)}))


def test_unwritable_storage_fails_fast_naming_the_uri(tmp_path):
    # A path below a regular file cannot be created, even by root (chmod would not stop root).
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"checkpoint.storage_uri: storage file://.*/file/sub is not writable"):
        Trainer(job(checkpoint={"storage_uri": f"file://{blocked}/sub"}))


def test_cli_reports_yaml_errors_before_any_worker(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent("""
        run: {name: x, num_steps: 5}
        scaling: {num_workers: 2, gpus: 1}
        train:
          model: elastic.workload:build_model
          dataset: elastic.workload:build_dataset
          loss: elastic.workload:loss_fn
          global_batch_size: 8
    """))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "scaling.gpus" in err and "Extra inputs are not permitted" in err


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_job(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(str(bad))


def test_global_batch_must_split_for_every_allowed_world_size():
    cfg = parse_job(job(scaling={"num_workers": 3, "min_workers": 2, "max_workers": 4},
                        train={**TRAIN, "global_batch_size": 48}))
    assert (cfg.scaling.min_size, cfg.scaling.max_size) == (2, 4)
    with pytest.raises(ConfigError, match=r"cannot be split for world sizes \[4\]"):
        parse_job(job(scaling={"num_workers": 3, "min_workers": 2, "max_workers": 4},
                      train={**TRAIN, "global_batch_size": 54}))


def test_min_and_max_must_bracket_num_workers():
    with pytest.raises(ConfigError, match="min_workers <= num_workers <= max_workers"):
        parse_job(job(scaling={"num_workers": 3, "min_workers": 4}))


def test_fsdp_mixed_precision_needs_a_gpu():
    with pytest.raises(ConfigError, match=r"train.fsdp.param_dtype=bfloat16.*use_gpu"):
        parse_job(job(train={"strategy": "fsdp", "fsdp": {"param_dtype": "bfloat16"}}))
    parse_job(job(train={"strategy": "fsdp", "fsdp": {"param_dtype": "bfloat16"}}, scaling={"use_gpu": True}))


def test_fsdp_settings_without_the_fsdp_strategy_are_an_error():
    with pytest.raises(ConfigError, match=r"train.fsdp is set but train.strategy=ddp"):
        parse_job(job(train={"fsdp": {"reshard_after_forward": False}}))


def test_fsdp_blocks_default_and_unknown_class():
    from torch import nn

    from elastic.parallel.fsdp import select_blocks

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([Block(), Block()])

    net = Net()
    assert select_blocks(net, None) == list(net.layers)  # transformer-style: each block of the ModuleList
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert select_blocks(seq, None) == [seq[0], seq[2]]  # Sequential: each child with parameters
    assert select_blocks(net, ["Block"]) == list(net.layers)
    with pytest.raises(ValueError, match=r"train.fsdp.blocks=\['Blok'\].*Block"):
        select_blocks(net, ["Blok"])


def test_fsdp_blocks_are_checked_before_any_worker_starts(tmp_path):
    j = job(train={"strategy": "fsdp", "fsdp": {"blocks": ["TransformerBlock"]}},
            checkpoint={"storage_uri": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"train.fsdp.blocks=\['TransformerBlock'\].*Linear"):
        Trainer(j)


def test_hold_gil_needs_its_duration_and_nothing_else_takes_one():
    with pytest.raises(ConfigError, match="hold_gil needs hold_s"):
        parse_job(job(chaos=[{"action": "hold_gil", "rank": 1, "at_step": 2}]))
    with pytest.raises(ConfigError, match="hold_s is for hold_gil, not kill_node"):
        parse_job(job(chaos=[{"action": "kill_node", "rank": 1, "at_step": 2, "hold_s": 3}]))
    assert parse_job(job(chaos=[{"action": "hold_gil", "rank": 1, "at_step": 2, "hold_s": 3}])).chaos[0].hold_s == 3


def test_slow_copies_needs_its_delay_and_memory_sync_needs_copies():
    with pytest.raises(ConfigError, match="slow_copies needs delay_s"):
        parse_job(job(chaos=[{"action": "slow_copies", "rank": 1, "at_step": 2}]))
    with pytest.raises(ConfigError, match="delay_s is for slow_copies, not slow"):
        parse_job(job(chaos=[{"action": "slow", "rank": 1, "at_step": 2, "delay_s": 1}]))
    with pytest.raises(ConfigError, match="memory_sync=true.*memory_every_steps=0"):
        parse_job(job(checkpoint={"memory_every_steps": 0, "memory_sync": True}))
    assert parse_job(job(checkpoint={"memory_sync": True})).checkpoint.memory_sync


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parent.parent / "examples").glob("*.yaml")))
def test_every_example_job_passes_the_checks_before_any_worker(name):
    """What `elastic train examples/<name>` checks before starting anything: the schema, the
    cross-field rules and the strategy's plan on the meta device."""
    from elastic.parallel.strategies import STRATEGIES
    jc = load_job(str(Path(__file__).parent.parent / "examples" / name))
    STRATEGIES[jc.train.strategy].check_job(jc, jc.train.resolve()["model"])
