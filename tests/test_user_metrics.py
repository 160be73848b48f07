"""The user's own metrics (elastic/runtime/user_metrics.py): a loss function that returns
`(loss, {name: tensor})` has each value averaged over the global batch inside the step's one
all-reduce of its statistics, with no host read added to the step, and logged per step beside the
loss. Unit tests of the check and the weighting; real Workers (gloo, a process per rank, no Ray)
at world sizes 1 and 2 under DDP and FSDP; the controller's side (metrics.json, the loggers'
rows, `elastic status`, the Prometheus gauge) on plain records."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from elastic.runtime.step_stats import StepStats, StepTensors
from elastic.runtime.user_metrics import LossReturnError, UserMetrics, refuse_metrics
from tests.test_step_on_device import count_reads, run_counted
from tests.test_training_features import mlp_job

pytestmark = pytest.mark.timeout(300)


def loss_with_metrics(model: nn.Module, batch):
    """Cross-entropy, its own copy (reduced as the loss is, it must equal the loss), and the
    accuracy: per-sample means over the micro-batch."""
    x, y = batch
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    return loss, {"loss_copy": loss.detach(), "accuracy": (logits.argmax(1) == y).float().mean()}


def still_adamw(params):
    """Fused (the update decided on the device, the statistics read a step late), and at a
    learning rate of 0: the weights stay the same at every world size, so each step's numbers
    differ only by how the sums are grouped."""
    return torch.optim.AdamW(params, lr=0.0, fused=True)


def _loss(model, batch):
    return torch.tensor(1.0, requires_grad=True)


def _returning(*outs):
    """A loss function whose i-th call returns `outs[i]` (the last one after that)."""
    calls = []

    def fn(model, batch):
        calls.append(1)
        return outs[min(len(calls), len(outs)) - 1]
    return fn


# ---------------------------------------------------------------- the check
ONE = torch.tensor(0.5)
BAD = {
    "not a dict": ((ONE, [ONE]), "where the second item must be a dict"),
    "a float": ((ONE, {"acc": 0.5}), "returned metric 'acc' as float, not a tensor"),
    "a vector": ((ONE, {"acc": torch.ones(3)}), "shape (3,), not one real value"),
    "the loss's name": ((ONE, {"loss": ONE}), "a metric named 'loss', which the run already"),
    "a bad name": ((ONE, {"1st acc": ONE}), "the metric name '1st acc'"),
    "three items": ((ONE, {}, ONE), "returned a tuple of 3 items"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_return_names_the_loss_function_and_what_to_return(case):
    out, why = BAD[case]
    um = UserMetrics()
    fn = um.wrap(_returning(out))
    with pytest.raises(LossReturnError) as e:
        fn(None, None)
    msg = str(e.value)
    assert why in msg, msg
    assert "tests.test_user_metrics:_returning.<locals>.fn" in msg  # which function
    assert "return the loss tensor alone, or (loss, {name: tensor})" in msg  # what to do


@pytest.mark.parametrize("first, then, why", [
    ({"acc": ONE}, {"acc": ONE, "f1": ONE}, "the metrics ['acc', 'f1'] at this step and ['acc']"),
    ({"acc": ONE}, None, "returned the metrics [] at this step and ['acc'] at the first"),
    (None, {"acc": ONE}, "returned the metrics ['acc'] at this step and [] at the first"),
])
def test_names_that_change_after_the_first_step_are_refused(first, then, why):
    um = UserMetrics()
    fn = um.wrap(_returning((ONE, first) if first is not None else ONE,
                            (ONE, then) if then is not None else ONE))
    fn(None, None)
    um.vector([4], torch.device("cpu"))
    fn = um.wrap(fn)
    with pytest.raises(LossReturnError, match=None) as e:
        fn(None, None)
    assert why in str(e.value), str(e.value)


def test_a_pipeline_stage_loss_that_returns_metrics_is_refused_naming_the_field():
    fn = refuse_metrics(_returning((ONE, {"acc": ONE})), "train.pipeline.loss", "not taken here")
    with pytest.raises(LossReturnError, match=r"\(train.pipeline.loss\) returned a tuple: not"):
        fn(None, None)
    assert refuse_metrics(_returning(ONE), "train.pipeline.loss", "-")(None, None) is ONE


# ---------------------------------------------------------------- the weighting and the slots
def test_micro_batches_are_weighted_by_their_samples_as_the_loss_is():
    """Micro-batches of 3 and 1 samples, each value a mean over its own: the rank's value is the
    mean over its 4 samples, and a loss alone gives no vector."""
    um = UserMetrics()
    fn = um.wrap(_returning((torch.tensor(2.0), {"b": torch.tensor(1.0), "a": torch.tensor(0.0)}),
                            (torch.tensor(6.0), {"b": torch.tensor(5.0), "a": torch.tensor(1.0)})))
    assert fn(None, None).item() == 2.0 and fn(None, None).item() == 6.0  # the loss alone
    assert um.names == ("a", "b")
    assert um.vector([3, 1], torch.device("cpu")).tolist() == [0.25, 2.0]  # (3*0+1)/4, (3*1+5)/4
    plain = UserMetrics()
    plain.wrap(_loss)(None, None)
    assert plain.vector([4], torch.device("cpu")) is None


def test_the_metrics_ride_in_the_statistics_and_a_non_finite_one_masks_no_update():
    t = StepTensors()
    flags = t.flags(torch.tensor(1.5), False, False, False, False)
    stats = t.with_sumsq(t.with_user(flags, torch.tensor([0.25, float("nan")])), torch.tensor(4.0))
    assert stats.numel() == StepStats.USER + 2
    read = StepStats.read(stats)
    assert read.loss_sum == 1.5 and read.grad_sumsq == 4.0 and read.user[0] == 0.25
    assert math.isnan(read.user[1]) and not read.bad_loss and not read.bad_grads
    assert t.found(stats).item() == 0.0  # the user's NaN: the update goes ahead
    stats[StepStats.GRAD_SUMSQ] = float("inf")
    assert t.found(stats).item() == 1.0  # the gradients' inf still masks it
    # Without a gradient check the slot stays, at 0.0: the metrics keep their place.
    plain = t.with_user(t.flags(torch.tensor(1.5), False, False, False, False), torch.tensor([3.0]))
    assert StepStats.read(plain).user == (3.0,) and StepStats.read(plain).grad_sumsq == 0.0


# ---------------------------------------------------------------- real Workers
def _rank(rank, world, pp, job_json, root, port, steps, env, q):
    from elastic.runtime.actor import import_worker
    w = import_worker()(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1, pp=pp)
    w.restore([])
    reads = count_reads(w)
    res = w.run(steps, [])
    q.put((rank, res.status, [(r.step, r.loss, r.metrics) for r in w.runner.compute_log], reads,
           res.error))
    w.leave()


def _curves(tmp_path, strategy: str, workers: int, **train):
    job = mlp_job(tmp_path, workers=workers, steps=6, strategy=strategy,
                  loss="tests.test_user_metrics:loss_with_metrics",
                  optimizer="tests.test_user_metrics:still_adamw", micro_batch_size=4, **train)
    out = run_counted(job, target=_rank)
    assert all(o[1] == "done" for o in out), out
    assert all(o[2] == out[0][2] for o in out)  # every rank reads the same
    # Each step's statistics are read a step late, and the last at the run's end: no step read
    # the device on the way, with metrics on.
    assert all(set(o[3][1:]) == {0} for o in out), [o[3] for o in out]
    return out[0][2]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_metrics_are_the_global_batch_mean_at_world_sizes_1_and_2(tmp_path, strategy):
    """16 samples a step in micro-batches of 4: one rank reads 4 micro-batches, two ranks 2 each.
    Every step's metrics are the same at both sizes (the sums' grouping apart), the accuracy is a
    count over all 16 samples, and the loss's copy equals the loss."""
    one = _curves(tmp_path / "one", strategy, 1)
    two = _curves(tmp_path / "two", strategy, 2)
    assert [s for s, _, _ in one] == [s for s, _, _ in two] == list(range(1, 7))
    for (_, loss1, m1), (_, loss2, m2) in zip(one, two):
        assert set(m1) == set(m2) == {"accuracy", "loss_copy"}
        assert m1["loss_copy"] == pytest.approx(loss1, rel=1e-6)
        assert m2["loss_copy"] == pytest.approx(loss2, rel=1e-6)
        assert m2["loss_copy"] == pytest.approx(m1["loss_copy"], rel=1e-5)
        assert m1["accuracy"] * 16 == round(m1["accuracy"] * 16)  # a mean over all 16 samples
        assert m2["accuracy"] == m1["accuracy"]
    # Each step read other samples: the numbers are not one step's repeated.
    assert len({round(m["loss_copy"], 6) for _, _, m in one}) == 6


# ---------------------------------------------------------------- the controller's side
def test_metrics_json_the_loggers_rows_status_and_the_gauge_carry_them():
    from elastic.controller.records import RunLog
    from elastic.observability.loggers import LOSS, rows_between
    from elastic.observability.metrics import RunMetrics
    from elastic.observability.status import format_status, summarize
    from elastic.storage import Storage

    log = RunLog(loss_curve={1: (2.0, 2), 2: (1.5, 2)}, user_metrics={1: {"accuracy": 0.25},
                                                                      2: {"accuracy": 0.5}})
    storage = Storage("memory://user-metrics")
    log.write_metrics(storage, "memory://user-metrics/run", lambda: (True, ""))
    body = json.loads(storage.read_bytes("memory://user-metrics/run/metrics.json"))
    assert body == {"1": {"loss": 2.0, "world_size": 2, "accuracy": 0.25},
                    "2": {"loss": 1.5, "world_size": 2, "accuracy": 0.5}}
    rows = rows_between(log, 0, 2, lambda: 0.0)
    assert [(r.step, r.scalars[LOSS], r.scalars["train/accuracy"]) for r in rows] == [
        (1, 2.0, 0.25), (2, 1.5, 0.5)]
    commit = {"t": 1.0, "kind": "checkpoint_committed", "step": 2, "uri": "memory://x/step_2",
              "persist_s": 0.1, "attempts": 1, "loss": 1.5, "metrics": {"accuracy": 0.5}}
    s = summarize([{"t": 0.0, "kind": "run_started", "run": "r"}, commit])
    assert "  metrics (step 2): accuracy 0.5000" in format_status(s).splitlines()
    updates = RunMetrics("r").event(commit)
    gauge = [(u.value, dict(u.tags)) for u in updates if u.metric == "elastic_user_metric"]
    assert gauge == [(0.5, {"run": "r", "metric": "accuracy"})]


def test_where_the_metrics_are_not_wanted_the_loss_alone_is_taken():
    """An evaluation without train.eval_metrics evaluates train.loss: with metrics beside it too."""
    from elastic.runtime.evaluation import default_metrics
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    loss, _ = loss_with_metrics(model, batch)
    got = default_metrics(loss_with_metrics)(model, batch, 8)
    assert set(got) == {"loss"} and got["loss"].item() == pytest.approx(loss.item() * 8)
