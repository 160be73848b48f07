"""Gradient compression settings (the job's `train.grad_compression`), and which strategies they
apply to. The compressors themselves are elastic/parallel/compression.py."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from elastic.config.base import Strict

MODES = ("none", "bf16", "powersgd", "topk")


class GradCompressionSpec(Strict):
    """How ddp's gradient all-reduce is compressed (docs/grad-compression.md). Given as a mode
    alone (`grad_compression: topk`) or as a mapping with its settings."""

    mode: Literal["none", "bf16", "powersgd", "topk"] = Field(
        "none", description="none: fp32 all-reduce; bf16: each bucket sent as bfloat16 (half the "
                            "bytes, no state); powersgd: low-rank factors P and Q of each matrix "
                            "(torch's PowerSGD, with error feedback); topk: each rank sends its "
                            "largest topk_ratio of each bucket's values with their indices, and "
                            "keeps the rest as error feedback. Only with train.strategy: ddp.")
    powersgd_rank: int = Field(1, ge=1, description="PowerSGD's matrix approximation rank (torch's "
                                                    "matrix_approximation_rank).")
    powersgd_start_step: int = Field(
        1000, ge=0, description="Steps of plain fp32 all-reduce before PowerSGD starts compressing "
                                "(torch's start_powerSGD_iter); the count is saved with the state.")
    topk_ratio: float = Field(0.01, gt=0, le=1, description="With topk: the share of each bucket's "
                                                            "values each rank sends per step.")

    @model_validator(mode="before")
    @classmethod
    def _mode_alone(cls, data: Any) -> Any:
        return {"mode": data} if isinstance(data, str) else data

    @property
    def error_feedback(self) -> bool:
        """Whether each rank keeps a residual of its own (rank-private state, see
        docs/grad-compression.md)."""
        return self.mode in ("powersgd", "topk")


def check_applies(spec: GradCompressionSpec, strategy: str, tp_size: int) -> None:
    """Refuse, naming the field, a compression the job's layout cannot use."""
    if spec.mode == "none":
        return
    if strategy != "ddp":
        why = {"fsdp": "fsdp reduce-scatters each gradient into shards; the compressors work on "
                       "whole replicated buckets",
               "pipeline": "a pipeline's stages reduce their gradients inside the schedule, "
                           "bucket by stage"}[strategy]
        raise ValueError(f"train.grad_compression={spec.mode} needs train.strategy: ddp ({why}). "
                         f"Set train.grad_compression: none, or train.strategy: ddp")
    if tp_size > 1:
        raise ValueError(f"train.grad_compression={spec.mode} with train.tp.size={tp_size}: a "
                         f"tensor-parallel slice's gradients are reduced over its dp group "
                         f"only, which "
                         f"the compressors do not support yet. Set train.tp.size: 1 or "
                         f"train.grad_compression: none")
