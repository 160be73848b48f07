"""elastic: fault-tolerant, elastic PyTorch training on Ray.

    from elastic import Trainer
    result = Trainer("job.yaml").fit()
"""
from elastic.runtime import priority as _priority

# A spare started beside training drops to the lowest CPU priority before anything heavy is imported
# (see elastic/priority.py); a no-op everywhere else.
_priority.lower_if_asked()

from elastic.config import (  # noqa: E402 - after the priority, on purpose
    ChaosFault, CheckpointConfig, ConfigError, FailureConfig, JobConfig, RunConfig, ScalingConfig, TrainSpec)
from elastic.trainer import Result, Trainer, TrainingFailed  # noqa: E402

__all__ = ["Trainer", "Result", "TrainingFailed", "JobConfig", "RunConfig", "ScalingConfig", "FailureConfig",
           "CheckpointConfig", "TrainSpec", "ChaosFault", "ConfigError"]
