"""Evaluation (train.eval_dataset: elastic/runtime/evaluation.py and
elastic/controller/evaluations.py): the sharding of the evaluation set (each sample exactly once
at any world size, uneven sizes too), the exact reduction (the same bits whatever the world size
and order), real Workers (gloo, a process per rank, no Ray) under DDP and FSDP at world sizes 1
to 3, the controller's record (events, metrics.json, the loggers' rows, `elastic status`) on
plain records, and the config's refusals. The drill across a node kill is in
tests/test_chaos.py."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from elastic.config import JobConfig
from elastic.controller import evaluations
from elastic.controller.records import RunLog
from elastic.observability.loggers import rows_between
from elastic.observability.status import format_status, summarize
from elastic.protocol import EvalResult, PollReport, RankStatus
from elastic.runtime.evaluation import (batch_bounds, batch_sums, combine, forwards_per_rank,
                                        rank_batches)
from elastic.storage import Storage
from elastic.workload import IN_FEATURES, NUM_CLASSES
from tests.test_step_on_device import run_counted
from tests.test_training_features import mlp_job

pytestmark = pytest.mark.timeout(300)

HERE = "tests.test_evaluation:"
EVAL_SAMPLES, EVAL_BATCH = 37, 5  # 8 batches, the last of 2: uneven over 3 ranks (3, 3, 2)


class IndexedEval(torch.utils.data.Dataset):
    """A small evaluation set whose samples carry their index, so a metric can count them."""

    def __init__(self, n: int = EVAL_SAMPLES):
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(n, IN_FEATURES, generator=g)
        self.y = torch.randint(0, NUM_CLASSES, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def eval_set():
    return IndexedEval()


def plain_eval_set():
    """(x, y) samples, for the default metric (the training loss)."""
    ds = IndexedEval()
    return torch.utils.data.TensorDataset(ds.x, ds.y)


def eval_metrics(model: nn.Module, batch) -> dict:
    x, y, i = batch
    logits = model(x)
    i = i.double()
    return {"loss": nn.functional.cross_entropy(logits, y, reduction="sum"),
            "accuracy": (logits.argmax(1) == y).sum(), "index": i.sum(), "index_sq": (i * i).sum(),
            "per_class": ((y == 0).sum(), torch.tensor(1.0))}  # a pair: sum over the batches' count


def frozen_sgd(params):
    """lr 0: the weights stay the seed's init at any world size: evaluations compare exactly."""
    return torch.optim.SGD(params, lr=0.0)


# ---------------------------------------------------------------- sharding
@pytest.mark.parametrize("num_samples", [0, 1, 5, 37, 64, 101])
@pytest.mark.parametrize("batch", [1, 4, 5, 64])
def test_every_sample_is_in_exactly_one_rank_s_batches_at_world_sizes_1_to_4(num_samples, batch):
    bounds = batch_bounds(num_samples, batch)
    assert all(0 < hi - lo <= batch for lo, hi in bounds)
    for world in range(1, 5):
        seen = [j for r in range(world) for k in rank_batches(len(bounds), world, r)
                for j in range(*bounds[k])]
        assert sorted(seen) == list(range(num_samples)), (world, seen)  # once each, none left
        counts = [len(rank_batches(len(bounds), world, r)) for r in range(world)]
        assert max(counts) - min(counts) <= 1
        assert all(forwards_per_rank(len(bounds), world) >= max(1, c) for c in counts)


def test_batches_are_the_same_samples_at_every_world_size():
    """The batches are cut from the set, not from a rank's share: the same bits at any size."""
    bounds = batch_bounds(EVAL_SAMPLES, EVAL_BATCH)
    for world in range(1, 5):
        got = sorted(bounds[k] for r in range(world) for k in rank_batches(len(bounds), world, r))
        assert got == bounds


# ---------------------------------------------------------------- the reduction
def _table(num_batches: int, seed: int = 0) -> torch.Tensor:
    rnd = random.Random(seed)  # sums over many magnitudes: where a float sum's order shows
    t = torch.zeros(num_batches, 2, 2, dtype=torch.float64)
    for k in range(num_batches):
        t[k, 0] = torch.tensor([rnd.uniform(-1, 1) * 10 ** rnd.randint(-8, 8), 5.0])
        t[k, 1] = torch.tensor([float(rnd.randint(0, 5)), 5.0])
    return t


def test_the_reduction_is_exact_whatever_the_world_size_and_order():
    full = _table(200)
    want = combine(full, ["a", "b"])
    assert want["b"] == pytest.approx(float(full[:, 1, 0].sum() / full[:, 1, 1].sum()))
    rows = list(range(200))
    for world in range(1, 5):
        # Each rank's table holds its rows and zeros; the all-reduce sums the tables, in any order.
        tables = []
        for r in range(world):
            t = torch.zeros_like(full)
            for k in rank_batches(200, world, r):
                t[k] = full[k]
            tables.append(t)
        random.Random(world).shuffle(tables)
        summed = tables[0].clone()
        for t in tables[1:]:
            summed += t
        assert torch.equal(summed, full)  # a row meets only zeros: it arrives exactly
        assert combine(summed, ["a", "b"]) == want
    random.Random(5).shuffle(rows)
    assert combine(full[rows], ["a", "b"]) == want  # the rows' order does not matter either
    naive = float(full[rows, 0, 0].float().sum() / 1000)  # a float32 mean of means would differ
    assert naive != want["a"]


def test_a_batch_s_sums_are_float64_and_a_pair_carries_its_own_count():
    values = {"b": torch.tensor(3.0), "a": (torch.tensor(2.0), 4)}
    names, sums = batch_sums(values, 7, torch.device("cpu"))
    assert names == ["a", "b"] and sums.dtype == torch.float64
    assert sums.tolist() == [[2.0, 4.0], [3.0, 7.0]]


# ---------------------------------------------------------------- real ranks
def _eval_rank(rank, world, pp, job_json, root, port, steps, env, q):
    from elastic.runtime.actor import import_worker
    w = import_worker()(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1, pp=pp)
    w.restore([])
    got, statuses = [], []
    evaluate = w.evals.evaluate
    metrics_fn = w.fns["eval_metrics"] or w.fns["loss"]

    def watched(model, batch):
        statuses.append(w._progress["status"])
        return metrics_fn(model, batch)
    if w.fns["eval_metrics"]:
        w.fns["eval_metrics"] = watched

    def kept(*a):
        got.append(evaluate(*a))
        return got[-1]

    w.evals.evaluate = kept
    res = w.run(steps, [])
    with w._lock:
        reported = w.evals.take()
    q.put((rank, res.status if res.status != "user_error" else res.error,
           [(e.step, e.metrics, e.num_samples) for e in got], [e.step for e in reported],
           (w.model.training, sorted(set(statuses)), w._progress["status"])))
    w.leave()


def uninterrupted_evaluations(job: dict) -> dict[int, dict[str, float]]:
    """{step: metrics} of an uninterrupted run of `job`, its ranks forked here without Ray (the
    same Worker code as on a cluster: tests/spawn_ranks.py)."""
    out = run_counted({**job, "chaos": []}, target=_eval_rank)
    assert all(o[1] == "done" for o in out), out
    return {step: m for step, m, _ in out[0][2]}


def _job(tmp_path, workers, strategy, **train):
    t = {"eval_dataset": HERE + "eval_set", "eval_every_steps": 2, "eval_batch_size": EVAL_BATCH,
         "eval_metrics": HERE + "eval_metrics", "optimizer": HERE + "frozen_sgd",
         "global_batch_size": 12, **train}
    return mlp_job(tmp_path, workers=workers, steps=5, strategy=strategy, **t)


def _evaluate(tmp_path, workers, strategy, **train):
    j = _job(tmp_path / f"{strategy}{workers}", workers, strategy, **train)
    out = run_counted(j, target=_eval_rank)
    assert all(o[1] == "done" for o in out), out
    assert all(o[2] == out[0][2] for o in out), out  # every rank holds the same numbers
    assert out[0][3] == [2, 4, 5] and all(o[3] == [] for o in out[1:])  # rank 0 reports them
    assert all(o[4][0] and o[4][2] == "done" for o in out)  # back in train mode
    if "eval_metrics" not in train:  # in every forward a rank says it is evaluating
        assert all(o[4][1] == ["evaluating"] for o in out), out
    return out[0][2]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_evaluations_are_the_same_bits_at_world_sizes_1_2_and_3(tmp_path, strategy):
    one = _evaluate(tmp_path, 1, strategy)
    assert [s for s, _, _ in one] == [2, 4, 5]  # every eval_every_steps, and the last step
    for step, m, n in one:
        assert n == EVAL_SAMPLES
        assert m["index"] == (EVAL_SAMPLES - 1) / 2  # each sample once: the mean index
        assert m["index_sq"] == (EVAL_SAMPLES - 1) * (2 * EVAL_SAMPLES - 1) / 6  # and its square
        assert 0 <= m["accuracy"] <= 1 and m["loss"] > 0
        assert m["per_class"] == pytest.approx(float((IndexedEval().y == 0).sum()) / 8)  # 8 batches
    assert _evaluate(tmp_path, 2, strategy) == one
    assert _evaluate(tmp_path, 3, strategy) == one  # uneven: 3, 3 and 2 batches


def test_without_eval_metrics_the_training_loss_is_evaluated(tmp_path):
    plain = {"eval_metrics": None, "eval_dataset": HERE + "plain_eval_set"}
    one = _evaluate(tmp_path, 1, "ddp", **plain)
    two = _evaluate(tmp_path, 2, "ddp", **plain)
    assert one == two and set(one[0][1]) == {"loss"}
    assert one[0][1]["loss"] > 0 and one[0][2] == EVAL_SAMPLES


# ---------------------------------------------------------------- the controller's record
def _ev(step, loss=0.5):
    return EvalResult(step=step, metrics={"loss": loss, "accuracy": 0.25}, num_samples=37,
                      seconds=0.1)


def _report(*evs):
    return PollReport(rank=0, generation=1, status=RankStatus.RUNNING, step=4,
                      evaluations=tuple(evs))


def _ctl(every=2, num_steps=6, eras=((0, 2),)):
    events = []
    log = RunLog()
    log.eras = list(eras)
    job = SimpleNamespace(train=SimpleNamespace(eval_dataset="x:y", eval_every_steps=every),
                          run=SimpleNamespace(num_steps=num_steps))
    emit = lambda kind, **f: events.append({"kind": kind, **f})  # noqa: E731
    ctl = SimpleNamespace(run_log=log, job=job, events=SimpleNamespace(emit=emit))
    return ctl, events


def test_each_evaluation_is_recorded_and_said_once():
    ctl, events = _ctl()
    evaluations.absorb(ctl, {0: _report(_ev(2)), 1: _report(_ev(2))})
    evaluations.absorb(ctl, {0: _report(_ev(2), _ev(4))})  # step 2 again: a redone evaluation
    assert [(e["kind"], e["step"]) for e in events] == [("evaluated", 2), ("evaluated", 4)]
    assert events[0]["metrics"] == {"loss": 0.5, "accuracy": 0.25}
    assert events[0]["num_samples"] == 37
    assert sorted(ctl.run_log.evaluations) == [2, 4]


def test_the_loggers_wait_for_an_evaluation_step_s_evaluation():
    ctl, _ = _ctl()
    assert evaluations.logged_through(ctl, 1) == 1
    assert evaluations.logged_through(ctl, 3) == 1  # step 2 is due and has not arrived
    ctl.run_log.evaluations[2] = _ev(2)
    assert evaluations.logged_through(ctl, 3) == 3
    assert evaluations.logged_through(ctl, 6) == 3  # steps 4 and 6 (the last)
    resumed, _ = _ctl(eras=((4, 2),))  # resubmitted, from step 4: earlier steps hold nothing back
    assert evaluations.logged_through(resumed, 5) == 3  # step 4 is evaluated again at the resume
    resumed.run_log.evaluations[4] = _ev(4)
    assert evaluations.logged_through(resumed, 5) == 5


def test_each_evaluation_forward_is_progress_for_the_hang_bound():
    ctl, _ = _ctl()
    clock = [5.0]
    ctl.now = lambda: clock[0]
    ctl.training = SimpleNamespace(last_progress_at=0.0, eval_seen=None)

    def poll(status, batches, step=4):
        return {0: PollReport(rank=0, generation=1, status=status, step=step, eval_batches=batches)}
    evaluations.note_progress(ctl, poll(RankStatus.EVALUATING, 1))
    assert ctl.training.last_progress_at == 5.0
    clock[0] = 9.0
    evaluations.note_progress(ctl, poll(RankStatus.EVALUATING, 1))  # no forward since: no progress
    assert ctl.training.last_progress_at == 5.0
    evaluations.note_progress(ctl, poll(RankStatus.EVALUATING, 2))
    assert ctl.training.last_progress_at == 9.0
    clock[0] = 12.0
    evaluations.note_progress(ctl, poll(RankStatus.RUNNING, 0, step=5))  # training: not this one's
    assert ctl.training.last_progress_at == 9.0


def test_evaluations_reach_metrics_json_the_loggers_and_status(tmp_path):
    log = RunLog()
    log.loss_curve = {1: (2.0, 2), 2: (1.5, 2)}
    log.evaluations = {2: _ev(2, loss=0.75)}
    log.write_metrics(Storage(f"file://{tmp_path}"), f"file://{tmp_path}", lambda: (True, ""))
    body = json.loads((tmp_path / "metrics.json").read_text())
    assert body["2"]["eval"] == {"loss": 0.75, "accuracy": 0.25} and "eval" not in body["1"]
    rows = rows_between(log, 0, 2, lambda: 0.0)
    assert "eval/loss" not in rows[0].scalars
    assert rows[1].scalars["eval/loss"] == 0.75 and rows[1].scalars["eval/accuracy"] == 0.25
    events = [{"t": 1.0, "kind": "run_started", "run": "r", "num_steps": 6},
              {"t": 2.0, "kind": "evaluated", "step": 2,
               "metrics": {"loss": 0.75, "accuracy": 0.25}}]
    s = summarize(events)
    assert s["evaluation"] == {"step": 2, "metrics": {"loss": 0.75, "accuracy": 0.25}}
    assert "evaluation (step 2): accuracy 0.25" in format_status(s)


# ---------------------------------------------------------------- the config
def _check(tmp_path, **train):
    return JobConfig.model_validate(mlp_job(tmp_path, **train))


@pytest.mark.parametrize("train, message", [
    ({"eval_every_steps": 5}, "train.eval_every_steps is set but train.eval_dataset is not"),
    ({"eval_metrics": HERE + "eval_metrics"}, "train.eval_metrics is set but train.eval_dataset"),
    ({"eval_dataset": HERE + "eval_set", "tp": {"size": 2}},
     "train.eval_dataset is not supported with train.tp.size=2"),
    ({"eval_dataset": HERE + "eval_set", "eval_every_steps": 0}, "greater than or equal to 1"),
])
def test_an_evaluation_the_run_cannot_do_is_refused_naming_the_field(tmp_path, train, message):
    with pytest.raises(ValueError) as e:
        _check(tmp_path, **train)
    assert message in str(e.value)


def test_a_pipeline_with_an_evaluation_is_refused(tmp_path):
    j = mlp_job(tmp_path, strategy="pipeline", eval_dataset=HERE + "eval_set", loss=None,
                pipeline={"stages": 2, "microbatches": 2,
                          "loss": "tests.test_training_features:mlp_stage_loss"})
    with pytest.raises(ValueError, match="not supported with train.strategy=pipeline"):
        JobConfig.model_validate(j)


def test_an_evaluation_set_given_as_an_object_resolves_to_a_factory(tmp_path):
    from elastic.config import TrainSpec
    ds = IndexedEval(3)
    train = {**mlp_job(tmp_path)["train"], "eval_dataset": ds, "eval_metrics": eval_metrics}
    tr = TrainSpec.model_validate(train)
    fns = tr.resolve()
    assert fns["eval_dataset"]() is ds and fns["eval_metrics"] is eval_metrics


def test_during_eval_excludes_the_other_moments():
    from elastic.config import ChaosFault
    assert ChaosFault(action="kill_node", rank=1, at_step=4, during_eval=True).during_eval
    with pytest.raises(ValueError, match="during_eval fires inside an evaluation"):
        ChaosFault(action="kill_node", rank=1, at_step=4, during_eval=True, during_upload=True)
