"""Pre-started workers taking ranks' slots: the claims of `SparePool` (elastic/group/spares.py).

A pre-started worker (elastic/group/prestart.py) holds no CPU; to take a rank it claims a free
slot with a one-bundle placement group pinned to its node, and builds its model only once Ray has
granted that slot. This mixin is that part of the spare pool: it reads and writes the pool's
`prestart`, `_waiting`, `_pending_spares`, `_claims`, `_on_demand`, `_kept_off`, `agents` and
`suspect_nodes`, and starts workers with its `_new_actor`.
"""
from __future__ import annotations

import time

import ray

from elastic.group.prestart import release_slot
from elastic.group.room import free_cpus_by_node

CLAIM_S = 2.0  # the longest a pre-started worker waits for the slot it claimed before it is given up
CLAIM_POLL_S = 0.02  # how often a recovery looks whether a claimed slot was granted


class PrestartedClaims:
    def _new_prestarted(self, node: str):
        return self._new_actor(background=self.job.scaling.low_priority_refills, node=node, prestarted=True)

    def tend_prestarted(self) -> list[str]:
        """Keep the pre-started workers on every node with an agent that is not suspect; claims
        whose slot never came are given up. Returns why any were lost."""
        lost = self._advance_claims()
        if self.prestart.per_node <= 0:
            return lost
        # Nodes that joined since the start get their agent here (then their pre-started workers,
        # at a later call, once it is up): under churn the free slots are on fresh nodes.
        listed = ray.nodes()
        self.agents.start_where_workers_fit(self.job.scaling.cpus_per_worker, self.job.scaling.use_gpu,
                                            avoid=self.suspect_nodes, nodes=listed)
        alive = {n["NodeID"] for n in listed if n.get("Alive")}
        nodes = {n for n in self.agents.nodes() if n in alive} - self.suspect_nodes
        return lost + self.prestart.maintain(nodes)

    def prestarted_news(self) -> tuple[int, list[tuple[str, int]]]:
        """(pre-started workers ready now, [(node, pid)] of those that became ready since last asked)."""
        news, self.prestart.newly_ready = self.prestart.newly_ready, []
        return sum(self.prestart.ready_by_node().values()), news

    def wait_prestarted_ready(self, timeout_s: float) -> bool:
        """Start the pre-started workers now and wait until all have (drills and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        self.lost_spares.extend(self.tend_prestarted())
        while not self.prestart.all_ready() and time.monotonic() < deadline:
            self.lost_spares.extend(self.prestart.refresh(wait_s=min(0.5, max(0.0, deadline - time.monotonic()))))
        return self.prestart.all_ready()

    def _take_prestarted(self, n: int, near: tuple[str, ...] = ()) -> int:
        """Up to n pre-started workers take ranks' slots: on nodes where Ray shows one free, or on a
        `near` node (where a rank's process just died: its slot is being freed), those first. Each
        claims its slot, and builds its model once Ray has granted it (`_advance_claims`). Returns
        how many."""
        got = 0
        if n <= 0 or not self.prestart.workers:
            return got
        cpus = self.job.scaling.cpus_per_worker
        free = {k: v for k, v in free_cpus_by_node().items() if k not in self.suspect_nodes}
        for node in near:
            free[node] = max(free.get(node, 0.0), cpus)
        for _ in range(n):
            taken = self.prestart.take(free, cpus, near)
            if taken is None:
                break
            w, slot = taken
            free[w.node_id] -= cpus
            self._waiting.append((w.handle, slot, time.monotonic()))
            got += 1
        self.lost_spares.extend(self._advance_claims())
        return got

    def _prefer_prestarted(self, need: int) -> None:
        """Pre-started workers for the ranks still missing, in place of processes started on demand
        that are still starting (a slot may have been freed since they were asked for)."""
        claimed = len(self._waiting) + sum(1 for ref in self._pending_spares if ref in self._claims)
        got = self._take_prestarted(need - claimed)
        fresh = [ref for ref in self._pending_spares if ref in self._on_demand and ref not in self._claims]
        for ref in fresh[:got]:
            h = self._pending_spares.pop(ref)
            self._kept_off.pop(ref, None)
            self._on_demand.discard(ref)
            ray.kill(h, no_restart=True)

    def _advance_claims(self) -> list[str]:
        """Claimed slots that Ray has granted: their workers build their models now (a pending
        spare). Read from the GCS's placement group table, which needs no process on the node (a
        placement group's ready() runs a task there, and a fresh node may first have to start a
        Python process for it). A slot not granted within CLAIM_S (another actor took the CPU
        first) is given up, with its worker, so a recovery starts a worker elsewhere instead of
        waiting for ever. Returns why any were lost."""
        from ray.util.placement_group import placement_group_table
        lost, still = [], []
        for h, slot, since in self._waiting:
            if placement_group_table(slot).get("state") == "CREATED":
                ref = h.warm.remote(calibrate=False)
                self._pending_spares[ref] = h
                self._kept_off[ref] = frozenset(self.suspect_nodes)
                self._on_demand.add(ref)
                self._claims[ref] = slot
            elif time.monotonic() - since > CLAIM_S:
                release_slot(slot)
                ray.kill(h, no_restart=True)
                lost.append(f"pre-started worker's slot not free within {CLAIM_S:.0f}s")
            else:
                still.append((h, slot, since))
        self._waiting = still
        return lost

