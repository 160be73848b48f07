"""The controller: a Ray actor running the run's state machine."""
from elastic.controller.controller import Controller

__all__ = ["Controller"]
