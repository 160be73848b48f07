"""Imported once by the forkserver that tests/spawn_ranks.py forks its ranks from: torch, DTensor,
DCP and the worker, as a Ray worker imports them (elastic.runtime.actor.import_worker). Each rank
is then a fork of a process that has them all, instead of a fresh interpreter that imports them
itself (about 3 s of CPU per rank on this project's machine)."""
from elastic.runtime.actor import import_worker

import_worker()
