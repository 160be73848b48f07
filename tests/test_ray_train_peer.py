"""The Ray Train peer of the recovery benchmark survives a node kill and reports sane figures.

Behaviour only: the figures themselves are the benchmark's business (no timed
assertions on a shared machine).
"""
from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks.ray_train_peer import run_ray_train_recovery
# Explicit, so this module runs whether or not conftest.py re-exports them.
from tests.ray_fixtures import cluster, ray_cluster  # noqa: F401

NUM_STEPS, FAULT_STEP, CKPT_EVERY = 30, 15, 10


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_ray_train_recovers_from_node_kill(cluster, tmp_path):  # noqa: F811
    result = run_ray_train_recovery(
        storage_dir=str(tmp_path), num_workers=3, num_steps=NUM_STEPS, fault_step=FAULT_STEP, ckpt_every=CKPT_EVERY,
    )

    assert result["bench"] == "recovery" and result["system"] == "ray-train"
    assert result["final_step"] == NUM_STEPS
    assert result["fault_step"] == FAULT_STEP
    # Ray Train resumes from a registered checkpoint (a multiple of CKPT_EVERY) or from scratch.
    assert 0 <= result["resumed_step"] <= FAULT_STEP and result["resumed_step"] % CKPT_EVERY == 0
    assert result["lost_steps"] == FAULT_STEP - result["resumed_step"] >= 0
    assert result["num_restarts"] >= 1
    assert all(
        isinstance(result[k], float) and math.isfinite(result[k]) and result[k] > 0
        for k in ("recover_s", "restart_s", "total_s")
    )
    assert result["detect_s"] is None or 0 <= result["detect_s"] <= result["restart_s"] <= result["recover_s"]
    json.dumps(result)  # one JSON line per result
    assert os.path.exists(result["timeline"])
