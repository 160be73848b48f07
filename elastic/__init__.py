"""elastic: fault-tolerant, elastic PyTorch training on Ray.

    from elastic import Trainer
    result = Trainer("job.yaml").fit()

The names below load on first use (PEP 562): `elastic status`, `elastic config` and the
timeline read logs and settings without importing torch or Ray (seconds of CPU on a node that
trains).
"""
from elastic.runtime import priority as _priority

# A spare started beside training drops to the lowest CPU priority before anything heavy is imported
# (see elastic/runtime/priority.py); a no-op everywhere else.
_priority.lower_if_asked()

__version__ = "0.1.0"

_FROM = {
    **{name: "elastic.config" for name in ("ChaosFault", "CheckpointConfig", "ConfigError", "FailureConfig",
                                            "JobConfig", "RunConfig", "ScalingConfig", "TrainSpec")},
    **{name: "elastic.trainer" for name in ("Result", "Trainer", "TrainingFailed")},
}
__all__ = ["Trainer", "Result", "TrainingFailed", "JobConfig", "RunConfig", "ScalingConfig", "FailureConfig",
           "CheckpointConfig", "TrainSpec", "ChaosFault", "ConfigError", "__version__"]


def __getattr__(name: str):
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
