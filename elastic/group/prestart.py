"""Pre-started workers: worker processes kept on each node with Python, torch, the job's modules and
its dataset loaded, that hold no CPU until they take a rank. A rank lost on a node (a killed or
crashed process frees its slot there) or a free slot anywhere is then filled without a process
start: what is left is building the model, a state transfer and a group formation.

What a start costs that this saves: a Ray actor's scheduling and
Python start, then importing torch, DTensor and DCP, about 2.4 s of CPU on this project's machine,
4-6 s when three start at once on its 2 cores.

How they stay out of training's way and out of Ray's books:
* they are Ray actors with `num_cpus=0`, pinned to their node, started under SCHED_IDLE
  (elastic/runtime/priority.py), so their start runs only on CPU time training leaves idle;
* one takes a rank only where Ray shows a free slot (`cpus_per_worker`) on its node, and claims
  that slot with a one-bundle placement group pinned there: Ray's accounting stays exact, and no
  other actor is placed on the CPU it trains on. It is told to build its model (`warm`) only once
  the GCS shows the group created (elastic/group/spares.py, `_advance_claims`), so it never
  trains on a slot it does not hold;
* the placement group goes with the member (`Member.slot`): removed when the member is killed.

The pool is mechanics; `choose_node` (pure) says where one is taken. CPU workers only: a GPU must be
given to a process when Ray starts it (config refuses `prestarted_per_node` with `use_gpu`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from elastic.protocol import WorkerInfo


@dataclass
class Prestarted:
    handle: "ray.actor.ActorHandle"
    node_id: str
    ready: "ray.ObjectRef | None" = None  # its info() call: a ref until it answered
    info: WorkerInfo | None = None


def choose_node(ready_by_node: dict[str, int], free_cpus: dict[str, float], cpus: float,
                prefer: tuple[str, ...] = ()) -> str | None:
    """The node whose pre-started worker takes a rank: one with a ready worker and a free slot of
    `cpus`, the `prefer`red ones first (where the lost rank lived: its slot is the one freed), then
    the node with the most free CPU (name order breaks ties). None if there is none. Pure."""
    ok = [n for n, k in ready_by_node.items() if k > 0 and free_cpus.get(n, 0.0) >= cpus]
    if not ok:
        return None
    for n in prefer:
        if n in ok:
            return n
    return min(ok, key=lambda n: (-free_cpus[n], n))


@dataclass
class PrestartPool:
    """`per_node` pre-started workers on each node it is told of (`maintain`). `new_actor(node)`
    starts one there (num_cpus=0, hard affinity, low priority)."""
    per_node: int
    new_actor: object  # Callable[[str], ActorHandle]
    workers: list[Prestarted] = field(default_factory=list)
    started: int = 0  # counts, for the run's summary
    taken: int = 0
    newly_ready: list[tuple[str, int]] = field(default_factory=list)  # (node, pid) since the controller looked

    def maintain(self, nodes: set[str]) -> list[str]:
        """Drop the ones on nodes no longer listed (dead or suspect) or that died, start the missing
        ones. Returns why any were lost, for the event log."""
        lost = self.refresh()
        for w in [w for w in self.workers if w.node_id not in nodes]:
            self._kill(w)
        if self.per_node <= 0:
            return lost
        have: dict[str, int] = {}
        for w in self.workers:
            have[w.node_id] = have.get(w.node_id, 0) + 1
        for node in sorted(nodes):
            for _ in range(self.per_node - have.get(node, 0)):
                h = self.new_actor(node)
                self.workers.append(Prestarted(h, node, h.info.remote()))
                self.started += 1
        return lost

    def refresh(self, wait_s: float = 0.0) -> list[str]:
        """Note the ones whose start finished (waiting up to `wait_s` for all of them); drop (and
        say why) the ones that died starting."""
        pending = {w.ready: w for w in self.workers if w.info is None}
        if not pending:
            return []
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
        lost = []
        for ref in done:
            w = pending[ref]
            try:
                w.info = ray.get(ref)
                self.newly_ready.append((w.node_id[:12], w.info.pid))
            except Exception as e:  # noqa: BLE001 - one that died starting is just gone
                lost.append(f"pre-started worker on node {w.node_id[:12]} died starting: {type(e).__name__}")
                self._kill(w)
        return lost

    def all_ready(self) -> bool:
        return all(w.info is not None for w in self.workers)

    def ready_by_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.workers:
            if w.info is not None:
                out[w.node_id] = out.get(w.node_id, 0) + 1
        return out

    def take(self, free_cpus: dict[str, float], cpus: float, prefer: tuple[str, ...] = ()
             ) -> tuple[Prestarted, "ray.util.placement_group.PlacementGroup"] | None:
        """A ready pre-started worker on a node with a free slot, and the placement group that claims
        the slot (it may not be granted yet). None if none fits. The pool is refilled on
        that node at the next `maintain`."""
        self.refresh()
        node = choose_node(self.ready_by_node(), free_cpus, cpus, prefer)
        if node is None:
            return None
        w = next(w for w in self.workers if w.node_id == node and w.info is not None)
        self.workers.remove(w)
        self.taken += 1
        return w, claim_slot(node, cpus)

    def shutdown(self) -> None:
        for w in list(self.workers):
            self._kill(w)

    def _kill(self, w: Prestarted) -> None:
        self.workers.remove(w)
        ray.kill(w.handle, no_restart=True)


def claim_slot(node_id: str, cpus: float):
    """A placement group of one bundle of `cpus` CPUs on `node_id` (hard: by the node's id label)."""
    return placement_group([{"CPU": cpus}], strategy="STRICT_PACK",
                           bundle_label_selector=[{"ray.io/node-id": node_id}])


def release_slot(pg) -> None:
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed, or the cluster is going away
        pass
