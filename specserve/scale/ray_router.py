"""Prefix-aware replica choice for Ray Serve: a custom ``RequestRouter`` (Ray's own extension
point; no proxy of ours), used by the ingress's handle to the engine replicas.

Why: each replica has its own prefix cache. A request whose first KV blocks were prefilled on
replica A costs a full prefill anywhere else, so requests sharing a prompt prefix (a system
prompt, a few-shot header, an agent's growing transcript) should land where that prefix is.

How: the ingress tokenizes the prompt and sends the chained hashes of its first full KV blocks
(``prefix_key.prefix_hashes``: the engine prefix cache's block boundaries) as the ``prefix``
keyword of the call. ``prefix_key.AffinityTable`` keeps hash -> replicas sent that prefix and
picks: the least-loaded owner of the deepest known block, unless it is more than ``imbalance``
requests busier than the least-loaded replica (then that one, which becomes an owner too); a
request with no known prefix goes to the least-loaded replica. Load is this router's own count
of requests sent and not completed per replica (exact for one ingress; with several ingress
replicas each counts its own).

A call with keyword ``rank=i`` is pinned to the i-th live replica in replica-id order (modulo
their number): that is how the ingress reads each replica's own counters (``/replicas``,
``/metrics``); the ingress drops the duplicates while a replica is down.
"""

from __future__ import annotations

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from specserve.scale.prefix_key import AffinityTable


class PrefixAffinityRouter(RequestRouter):
    """See the module docstring. ``initialize_state`` receives ``request_router_kwargs``."""

    def initialize_state(self, imbalance: int = 4, table_size: int = 1 << 16) -> None:
        self._table = AffinityTable(imbalance, table_size)
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
        self._table.forget(replica_id)

    def _load(self, replica_id: ReplicaID) -> int:
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
        if rank is not None:  # pinned: the i-th live replica in id order, wrapping around
            # (never an empty answer: Ray would retry it in backoff until the caller gives up)
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[rank % len(ordered)]]]
        by_id = {r.replica_id: r for r in candidate_replicas}
        chosen = by_id[self._table.choose(kwargs.get("prefix") or (), list(by_id), self._load)]
        rest = sorted((r for r in candidate_replicas if r is not chosen),
                      key=lambda r: self._load(r.replica_id))
        # The first rank is the choice; the rest, least loaded first, only if it refuses.
        return [[chosen], rest]
