"""The `loggers` section: where the run's curves go besides metrics.json (TensorBoard event
files, an MLflow run). Each is an optional extra; elastic/observability/loggers.py writes them."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from elastic.config.base import Strict


class LoggersConfig(Strict):
    """TensorBoard and MLflow, written by the controller on the head node, every step once."""

    tensorboard_dir: str | None = Field(
        None, description="A folder on the head node (a path or file://): TensorBoard event files "
                          "go to its subfolder named run.name, so `tensorboard --logdir` on the "
                          "folder shows each run by its name, and a resubmitted run continues its "
                          "curves. A relative path is made absolute where the job is started. "
                          "Needs `pip install 'elastic-trainer[tensorboard]'`.")
    mlflow_tracking_uri: str | None = Field(
        None, description="An MLflow tracking URI: a server (http://, https://, databricks) or a "
                          "local file store (a path or file://, made absolute where the job is "
                          "started). The MLflow run is named run.name and found again by its tag "
                          "`elastic.run_name` when the job is resubmitted. Needs `pip install "
                          "'elastic-trainer[mlflow]'` (mlflow-skinny; a sqlite:// store needs the "
                          "full `mlflow` package).")
    mlflow_experiment: str | None = Field(
        None, min_length=1, description="The MLflow experiment the run goes in, created if "
                                        "missing; unset: `elastic`.")

    @field_validator("tensorboard_dir")
    @classmethod
    def _local_folder(cls, path: str | None) -> str | None:
        if path is None:
            return None
        if not path.strip():
            raise ValueError("loggers.tensorboard_dir is empty: give a folder on the head node, or "
                             "leave it out")
        if "://" in path and not path.startswith("file://"):
            scheme = path.split("://", 1)[0]
            raise ValueError(f"loggers.tensorboard_dir={path!r}: TensorBoard files are written to "
                             f"a folder on the head node, not to {scheme}://; give a path (or "
                             f"file://) and copy it elsewhere from there if needed")
        return path

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _not_empty(cls, uri: str | None) -> str | None:
        if uri is not None and not uri.strip():
            raise ValueError("loggers.mlflow_tracking_uri is empty: give a tracking server or a "
                             "folder, or leave it out")
        return uri

    @model_validator(mode="after")
    def _experiment_needs_a_uri(self) -> "LoggersConfig":
        if self.mlflow_experiment is not None and self.mlflow_tracking_uri is None:
            raise ValueError("loggers.mlflow_experiment is set but loggers.mlflow_tracking_uri is "
                             "not: set the tracking URI (a server, or a folder for a local store), "
                             "or leave the experiment out")
        return self
