"""Prefix-aware replica choice for Ray Serve: a custom ``RequestRouter`` (Ray's own extension
point; no proxy of ours), used by the ingress's handle to the engine replicas.

Why: each replica has its own prefix cache. A request whose first KV blocks were prefilled on
replica A costs a full prefill anywhere else, so requests sharing a prompt prefix (a system
prompt, a few-shot header, an agent's growing transcript) should land where that prefix is.

How: the ingress tokenizes the prompt and sends the chained hashes of its first full KV blocks
(``prefix_key.prefix_hashes``: the engine prefix cache's block boundaries) as the ``prefix``
keyword of the call. The router keeps hash -> replicas that were sent that prefix. A request
goes to the least-loaded owner of its deepest known block hash, unless that owner has more than
``imbalance`` requests in flight beyond the least-loaded replica overall: then it goes to the
least-loaded one, which becomes an owner too (a hot prefix spreads instead of piling up). A
request with no known prefix goes to the least-loaded replica. Load is this router's own count
of requests sent and not completed per replica (exact for one ingress; with several ingress
replicas each counts its own).

A call with keyword ``rank=i`` is pinned to the i-th live replica in replica-id order: that is
how the ingress reads each replica's own counters (``/replicas``, ``/metrics``).
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)


class PrefixAffinityRouter(RequestRouter):
    """See the module docstring. ``initialize_state`` receives ``request_router_kwargs``."""

    def initialize_state(self, imbalance: int = 4, table_size: int = 1 << 16) -> None:
        self._imbalance = imbalance
        self._table_size = table_size
        # prefix hash -> replicas sent that prefix, oldest-used first (LRU bound)
        self._owners: OrderedDict[int, list[ReplicaID]] = OrderedDict()
        self._in_flight: dict[ReplicaID, int] = {}

    # ---- load bookkeeping (Ray calls these on the router's loop) ------------------------

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        n = self._in_flight.get(replica_id, 0)
        if n > 0:
            self._in_flight[replica_id] = n - 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
        for h, owners in list(self._owners.items()):
            if replica_id in owners:
                owners.remove(replica_id)
                if not owners:
                    del self._owners[h]

    def load(self, replica_id: ReplicaID) -> int:
        return self._in_flight.get(replica_id, 0)

    # ---- the choice ---------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        rank = kwargs.get("rank")
        if rank is not None:  # pinned: the i-th live replica in id order
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[rank]]] if rank < len(ordered) else []
        by_load = sorted(candidate_replicas, key=lambda r: self.load(r.replica_id))
        least = by_load[0]
        hashes: tuple[int, ...] = kwargs.get("prefix") or ()
        preferred = self._preferred(hashes, candidate_replicas)
        if preferred is None or (
                self.load(preferred.replica_id) - self.load(least.replica_id) > self._imbalance):
            chosen = least
        else:
            chosen = preferred
        self._remember(hashes, chosen.replica_id)
        # The first rank is the choice; the rest, least loaded first, only if it refuses.
        return [[chosen], [r for r in by_load if r is not chosen]]

    def _preferred(self, hashes: tuple[int, ...],
                   candidates: list[RunningReplica]) -> RunningReplica | None:
        """The least-loaded live owner of the deepest known prefix block."""
        live = {r.replica_id: r for r in candidates}
        for h in reversed(hashes):
            owners = [live[o] for o in self._owners.get(h, ()) if o in live]
            if owners:
                return min(owners, key=lambda r: self.load(r.replica_id))
        return None

    def _remember(self, hashes: tuple[int, ...], replica_id: ReplicaID) -> None:
        for h in hashes:
            owners = self._owners.pop(h, None) or []
            if replica_id not in owners:
                owners.append(replica_id)
            self._owners[h] = owners  # most recently used last
        while len(self._owners) > self._table_size:
            self._owners.popitem(last=False)
