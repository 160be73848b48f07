"""Real Workers without Ray, for the probes: the controller's part of forming generation 1 (the
fence in storage, a rendezvous store in this process), then each rank's join and fresh start, as
tests/spawn_ranks.py does for the tests."""
from __future__ import annotations


def prepare(job: dict):
    """(job JSON, checkpoints root, rendezvous store) for `job`; keep the store alive while the
    ranks run."""
    from elastic.checkpoint.fencing import write_fence
    from elastic.checkpoint.layout import checkpoints_root
    from elastic.config import JobConfig
    from elastic.group.rendezvous import Rendezvous
    from elastic.storage import Storage
    jc = JobConfig.model_validate(job)
    root = checkpoints_root(jc.checkpoint.storage_uri, jc.run.name)
    write_fence(Storage(jc.checkpoint.storage_uri, jc.checkpoint.storage_options), root, 1)
    return jc.model_dump_json(), root, Rendezvous("127.0.0.1", timeout_s=120)


def start_rank(job_json: str, root: str, port: int, rank: int = 0, world: int = 1):
    """One rank's Worker, joined to generation 1 (store at 127.0.0.1:`port`), not restored yet."""
    from elastic.runtime.actor import import_worker
    w = import_worker()(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1)
    return w
