"""Filling ranks (`promote`): live warm spares first, then ones still warming, then workers
started on demand; and, with tensor parallelism, where they go: beside their tp group
(elastic/policies/placement.py), and where new spares start (`spare_homes`).

`Replacing` is a base of `SparePool` (elastic/group/spares.py), whose spares, suspect nodes and
workers it reads and starts (`ready_spares`, `_pending_spares`, `_waiting`, `_background`,
`vacated`, `suspect_nodes`, `add_spares`, `refresh_spares`, `_spare_alive`, `_assign`).
Mechanics only: the controller decides which ranks to fill and how long to wait.
"""
from __future__ import annotations

import time

from elastic.group.member import GroupError, Member
from elastic.group.prestart_claims import PrestartedClaims
from elastic.group.room import free_cpus_by_node
from elastic.policies.placement import regroup_nodes, replacement_homes, spare_homes, split_groups


class Replacing(PrestartedClaims):
    def promote(self, ranks: list[int], timeout_s: float, ping_timeout_s: float) -> dict[int, str]:
        """Fill `ranks` with spares: live warm ones first, then ones still warming (waited for), then
        freshly started workers. A spare that dies or goes silent before it gets its rank is
        replaced in turn, until `timeout_s` runs out. Returns {rank: how it was filled}.
        With tensor parallelism a rank whose tp group's node has room (a spare there, or a free
        slot) is filled there: by a spare on that node, else by a worker started there for it (a
        warm spare on another node would split the group). Other ranks take any spare, as before."""
        how: dict[int, str] = {}
        need = list(ranks)
        deadline = time.monotonic() + timeout_s
        self.lost_spares.extend(self.refresh_spares())
        homes = self._replacement_homes(need)

        def rank_for(m: Member) -> int | None:
            here = [r for r in need if homes.get(r) == m.node_id]
            free_to_go = [r for r in need if r not in homes or m.on_demand]  # started for this, or no home
            return (here or free_to_go or [None])[0]

        def take_ready(label_if_planned: str) -> None:
            for m in list(self.ready_spares):
                r = rank_for(m) if need else None
                if r is None or not self._spare_alive(m, ping_timeout_s):
                    continue
                need.remove(r)
                self._assign(r, m)
                how[r] = "pre-started" if m.prestarted else "started on demand" if m.on_demand else label_if_planned

        take_ready("warm spare")
        homed = [r for r in need if r in homes]
        if homed:  # started on their tp group's node, before the loop starts the rest anywhere
            self.add_spares(len(homed), on_demand=True, at=tuple(homes[r] for r in homed))
        if need:
            # A spare still warming at low priority is now wanted: it finishes at full priority
            # (the call runs once its constructor has, beside warm()).
            for ref in self._background:
                self._pending_spares[ref].restore_priority.remote()
        while need and time.monotonic() < deadline:
            # Keep one warming spare per missing rank: a replacement that died (its node was lost
            # too, or not yet known to be lost) is replaced in turn, never waited on forever.
            self._prefer_prestarted(len(need))
            self.add_spares(len(need) - len(self._pending_spares) - len(self._waiting), on_demand=True)
            self.probe_suspects()  # a node that answers again may hold the only free slot
            self.lost_spares.extend(self.refresh_spares(wait_s=min(0.5, max(0.0, deadline - time.monotonic()))))
            take_ready("spare, waited while it warmed")
        if need and timeout_s <= 0:
            raise GroupError(f"no warm spare for ranks {need}, and no wait for one", {r: "unavailable" for r in need})
        if need:
            raise GroupError(f"no worker could be started for ranks {need} within {timeout_s:.0f}s; is there a free "
                             f"slot ({self.job.scaling.cpus_per_worker} CPU) per worker?", {r: "unavailable" for r in need})
        for r in ranks:
            self.vacated.pop(r, None)
        return how

    def spare_homes(self, n: int) -> tuple[str, ...]:
        """With tensor parallelism, where `n` spares about to start belong (policies/placement.py):
        first the nodes where they would let a tp group split over nodes be gathered (room: a
        free slot Ray shows, or a killed member's that Ray may not show free yet), then a tp
        group's worth per node, topping up the nodes whose ready spares hold part of one. ()
        without tensor parallelism; shorter than `n` where nodes lack room."""
        tp = self.job.train.tp.size
        if tp == 1 or n <= 0:
            return ()
        nodes = {r: m.node_id for r, m in self.members.items()}
        cpus = self.job.scaling.cpus_per_worker
        free = self._free_cpus()
        first: list[str] = []
        if self.job.train.tp.regroup and split_groups(nodes, tp):
            gather = dict(free)
            for m in set(self.vacated.values()) & set(gather):
                gather[m] = max(gather[m], cpus)
            first = regroup_nodes(nodes, tp, gather, cpus)[:n]
        for m in first:
            free[m] = free.get(m, 0.0) - cpus
        return tuple(first) + tuple(spare_homes(n - len(first), tp, free, cpus,
                                                [s.node_id for s in self.ready_spares]))

    def _free_cpus(self) -> dict[str, float]:
        """Free CPUs of each node that is not suspect (Ray's view now)."""
        return {n: c for n, c in free_cpus_by_node().items() if n not in self.suspect_nodes}

    def _replacement_homes(self, ranks: list[int]) -> dict[int, str]:
        """With tensor parallelism, the node each of `ranks` belongs on (policies/placement.py):
        room is a ready spare, a free slot Ray shows, or the slot of the rank's own killed process
        on a node still up (Ray may not show it free yet)."""
        tp = self.job.train.tp.size
        if tp == 1 or not ranks:
            return {}
        cpus = self.job.scaling.cpus_per_worker
        free = self._free_cpus()
        for r in ranks:
            n = self.vacated.get(r)
            if n in free:
                free[n] = max(free[n], cpus * sum(1 for q in ranks if self.vacated.get(q) == n))
        return replacement_homes(ranks, tp, {r: m.node_id for r, m in self.members.items()},
                                 [m.node_id for m in self.ready_spares if m.node_id not in self.suspect_nodes],
                                 free, cpus)
