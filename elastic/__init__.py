"""elastic: fault-tolerant, elastic PyTorch training on Ray.

    from elastic import Trainer
    result = Trainer("job.yaml").fit()
"""
from elastic.config import (
    ChaosFault, CheckpointConfig, ConfigError, FailureConfig, JobConfig, RunConfig, ScalingConfig, TrainSpec)
from elastic.trainer import Result, Trainer, TrainingFailed

__all__ = ["Trainer", "Result", "TrainingFailed", "JobConfig", "RunConfig", "ScalingConfig", "FailureConfig",
           "CheckpointConfig", "TrainSpec", "ChaosFault", "ConfigError"]
