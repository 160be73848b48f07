"""Filling ranks (`promote`): live warm spares first, then ones still warming, then workers
started on demand; and, with tensor parallelism, where they go: beside their tp group
(elastic/policies/placement.py), and where new spares start (`spare_homes`).

`Replacing` is a base of `SparePool` (elastic/group/spares.py), whose spares, suspect nodes and
workers it reads and starts (`ready_spares`, `_pending_spares`, `_waiting`, `_background`,
`vacated`, `suspect_nodes`, `meant`, `misplaced`, `add_spares`, `refresh_spares`, `_spare_alive`,
`_assign`). With tp it also starts the spares that mend a tp group split over nodes
(`start_regroup_spares`) and says which spares a trim must keep for that (`regroup_guard`).
Mechanics only: the controller decides which ranks to fill and how long to wait.
"""
from __future__ import annotations

import time
from collections import Counter

from elastic.group.member import GroupError, SurvivorsLost
from elastic.group.prestart_claims import PrestartedClaims
from elastic.group.room import free_cpus_by_node, placing_node
from elastic.protocol import Watch
from elastic.policies.placement import (Replacements, homes_kept, regroup_nodes, replacement_homes, spare_homes,
                                        split_groups, take_rank)


class Replacing(PrestartedClaims):
    def promote(self, ranks: list[int], timeout_s: float, ping_timeout_s: float,
                watch: Watch | None = None) -> dict[int, str]:
        """Fill `ranks` with spares: live warm ones first, then ones still warming (waited for), then
        freshly started workers. A spare that dies or goes silent before it gets its rank is
        replaced in turn, until `timeout_s` runs out. Returns {rank: how it was filled}.
        With tensor parallelism each rank has a home where its tp group stays whole
        (`replacement_homes`): a worker takes a rank only on its home (`take_rank`), and one is
        started there for each rank no worker there covers. A home is given up only when its node
        is lost, a worker started there is placed elsewhere, or none comes up there within half of
        `timeout_s` (`homes_kept`); `split_reasons` says why each tp group that spans nodes does.
        `watch`: asked of the members at every turn of the wait (the heartbeat and the polls, as in
        training); a member it finds lost cuts the wait with `SurvivorsLost`, the workers started
        so far warming on as spares for the recovery that takes it in."""
        how: dict[int, str] = {}
        need = list(ranks)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        self.lost_spares.extend(self.refresh_spares())
        self.misplaced = set()
        plan = self._replacement_plan(need)
        homes = dict(plan.homes)
        self.split_reasons = dict(plan.split)
        tp = self.job.train.tp.size

        def take_ready(label_if_planned: str) -> None:
            for m in list(self.ready_spares):
                r = take_rank(need, homes, m.node_id) if need else None
                if r is None or not self._spare_alive(m, ping_timeout_s):
                    continue
                need.remove(r)
                self._assign(r, m)
                how[r] = "pre-started" if m.prestarted else "started on demand" if m.on_demand else label_if_planned

        take_ready("warm spare")
        if homes:  # on their tp group's node, before the loop starts the rest anywhere
            self._start_for(need, homes)
        if need:
            # A spare still warming at low priority is now wanted: it finishes at full priority
            # (the call runs once its constructor has, beside warm()).
            for ref in self._background:
                self._pending_spares[ref].restore_priority.remote()
        while need and time.monotonic() < deadline:
            # Keep one warming spare per missing rank: a replacement that died (its node was lost
            # too, or not yet known to be lost) is replaced in turn, never waited on forever.
            self._prefer_prestarted(len(need))
            if homes:
                homes, dropped = homes_kept(homes, need, self.suspect_nodes, self.misplaced,
                                            time.monotonic() - t0, timeout_s / 2)
                for r, why in dropped.items():
                    self.split_reasons[r // tp * tp] = f"rank {r}: {why}"
            self._start_for(need, homes)
            self.probe_suspects()  # a node that answers again may hold the only free slot
            self.lost_spares.extend(self.refresh_spares(wait_s=min(0.5, max(0.0, deadline - time.monotonic()))))
            take_ready("spare, waited while it warmed")
            lost = watch(set(self.members)) if watch is not None and need else {}
            if lost:
                raise SurvivorsLost(f"members {sorted(lost)} were lost while replacements for {need} started: "
                                    f"{lost}", lost)
        if need and timeout_s <= 0:
            raise GroupError(f"no warm spare for ranks {need}, and no wait for one", {r: "unavailable" for r in need})
        if need:
            raise GroupError(f"no worker could be started for ranks {need} within {timeout_s:.0f}s; is there a free "
                             f"slot ({self.job.scaling.cpus_per_worker} CPU) per worker?", {r: "unavailable" for r in need})
        for r in ranks:
            self.vacated.pop(r, None)
        return how

    def _start_for(self, need: list[int], homes: dict[int, str]) -> None:
        """One worker starting per missing rank: on its home for each homed rank that no worker
        starting there covers, anywhere for the rest (spares already warming count)."""
        there = Counter(self._pending_nodes().values()) if homes else Counter()
        at: list[str] = []
        for home, k in sorted(Counter(homes[r] for r in need if r in homes).items()):
            at += [home] * max(0, k - there[home])
        self.add_spares(max(len(at), len(need) - len(self._pending_spares) - len(self._waiting)), on_demand=True,
                        at=tuple(at))

    def _pending_nodes(self) -> dict[object, str | None]:
        """Each pending spare's node: the one it was started at, else where Ray places it (None
        while Ray cannot say)."""
        return {ref: self.meant.get(ref) or placing_node(h) for ref, h in self._pending_spares.items()}

    def start_regroup_spares(self) -> int:
        """With tensor parallelism and train.tp.regroup, spares started where they can gather a tp
        group split over nodes (`regroup_nodes`: a free slot on a node holding part of it, or a
        node with room for all of it, one that joined), beyond the pool's own: so a split is mended
        at the first chance even with `scaling.num_spares: 0`. A group with a spare, ready or
        starting, on one of its nodes (or a tp group's worth on another) gets none: a second one
        would race the first, and the group could be gathered on either node. Returns how many
        were started."""
        tp = self.job.train.tp.size
        if tp == 1 or not self.job.train.tp.regroup:
            return 0
        nodes = {r: m.node_id for r, m in self.members.items()}
        split = split_groups(nodes, tp)
        if not split:
            return 0
        have = Counter([m.node_id for m in self.ready_spares] + [n for n in self._pending_nodes().values() if n])
        unserved: dict[int, str] = {}
        for first in split:
            ranks = {r: nodes[r] for r in range(first, first + tp) if r in nodes}
            if not any(have[n] for n in ranks.values()) and not any(k >= len(ranks) for k in have.values()):
                unserved.update(ranks)
        at = regroup_nodes(unserved, tp, self._free_cpus(), self.job.scaling.cpus_per_worker,
                           prefer=set(self.vacated.values())) if unserved else []
        if at:
            self.add_spares(len(at), background=True, at=tuple(at))
        return len(at)

    def regroup_guard(self) -> set[int]:
        """ids of the spares (ready members, pending refs) that can gather a tp group split over
        nodes (`regroup_move`): on a node holding part of it, or a tp group's worth on one node.
        A trim keeps them beyond the pool's size: killed, the split would wait for new ones."""
        tp = self.job.train.tp.size
        nodes = {r: m.node_id for r, m in self.members.items()}
        split = split_groups(nodes, tp) if tp > 1 and self.job.train.tp.regroup else []
        if not split:
            return set()
        spares = [(id(m), m.node_id) for m in self.ready_spares]
        spares += [(id(ref), n) for ref, n in self._pending_nodes().items() if n]
        on = {nodes[r] for g in split for r in range(g, g + tp) if r in nodes}
        count = Counter(n for _, n in spares)
        return {i for i, n in spares if n in on or count[n] >= tp}

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
            first = regroup_nodes(nodes, tp, gather, cpus, prefer=set(self.vacated.values()))[:n]
        for m in first:
            free[m] = free.get(m, 0.0) - cpus
        return tuple(first) + tuple(spare_homes(n - len(first), tp, free, cpus,
                                                [s.node_id for s in self.ready_spares]))

    def _free_cpus(self) -> dict[str, float]:
        """Free CPUs of each node that is not suspect (Ray's view now)."""
        return {n: c for n, c in free_cpus_by_node().items() if n not in self.suspect_nodes}

    def _replacement_plan(self, ranks: list[int]) -> Replacements:
        """With tensor parallelism, where each of `ranks` belongs (`replacement_homes`): room is a
        free slot Ray shows, the slot of the rank's own killed process on a node still up (Ray may
        not show it free yet), and a spare there, ready or still starting."""
        tp = self.job.train.tp.size
        if tp == 1 or not ranks:
            return Replacements({})
        waiting = [m.node_id for m in self.ready_spares] + [n for n in self._pending_nodes().values() if n]
        return replacement_homes(ranks, tp, {r: m.node_id for r, m in self.members.items()},
                                 [n for n in waiting if n not in self.suspect_nodes], self._free_cpus(),
                                 self.job.scaling.cpus_per_worker,
                                 freed={r: self.vacated[r] for r in ranks if r in self.vacated})
