"""User settings: pydantic models for every knob, YAML in, clear errors out.

Every model forbids unknown keys, so a typo in `job.yaml` is an error that
names the key instead of a silently ignored setting. Cross-field checks that
need the whole job (batch plan vs. world size) live in `JobConfig`.

The names below are the package's public API; the modules hold one concern each:
`sections` (run, scaling, failure, checkpoint, stragglers), `chaos` (injected
faults), `train` (what to train), `loggers` (TensorBoard, MLflow), `job` (the whole
job and its batch plans), `loading` (YAML and errors) and `reference`
(docs/configuration.md).
"""
from elastic.config.chaos import ChaosFault
from elastic.config.job import JobConfig, batch_plan, pipeline_plan
from elastic.config.loading import ConfigError, format_validation_error, load_job, parse_job
from elastic.config.sections import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, StragglerConfig
from elastic.config.train import DTYPES, SCHEDULES, DataSpec, FsdpSpec, PipelineSpec, TrainSpec

__all__ = [
    "ChaosFault", "CheckpointConfig", "ConfigError", "DTYPES", "DataSpec", "FailureConfig", "FsdpSpec", "JobConfig",
    "PipelineSpec", "RunConfig", "SCHEDULES", "ScalingConfig", "StragglerConfig", "TrainSpec", "batch_plan",
    "format_validation_error", "load_job", "parse_job", "pipeline_plan",
]
