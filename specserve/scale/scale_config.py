"""ScaleConfig: how `specserve serve --replicas N` lays replicas out on Ray Serve. Ray-free, so the
CLI validates flags without importing ray (an optional extra)."""

from __future__ import annotations

import msgspec

from specserve.core.errors import ConfigError

ROUTERS = ("prefix", "pow2")


class ScaleConfig(msgspec.Struct, kw_only=True):
    """Replica layout and routing (flags map 1:1: ``--replicas`` -> ``replicas``).

    Each replica owns one engine with its own KV cache, prefix cache and suffix cache; nothing
    is shared between replicas, hence the prefix-aware router (``ray_router.py``).
    """

    replicas: int = 1  # engine replicas; >1 (or --ray-address) serves through Ray Serve
    ray_address: str | None = None  # join this Ray cluster; None: start a local one
    replica_cpus: float = 1.0  # Ray CPUs reserved per replica (also its torch threads)
    replica_gpus: float = 0.0  # GPUs per replica (1 = one whole GPU each)
    request_router: str = "prefix"  # prefix (KV-block prefix affinity) | pow2 (Ray's default)
    prefix_routing_blocks: int = 4  # leading KV blocks hashed for affinity
    prefix_routing_imbalance: int = 4  # in-flight requests the preferred replica may exceed
    #                                    the least-loaded one by before the router spills over

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1 (got {self.replicas})")
        if self.replica_cpus <= 0:
            raise ConfigError(f"replica-cpus must be > 0 (got {self.replica_cpus})")
        if self.replica_gpus < 0:
            raise ConfigError(f"replica-gpus must be >= 0 (got {self.replica_gpus})")
        if self.request_router not in ROUTERS:
            raise ConfigError(f"request-router must be one of {', '.join(ROUTERS)} "
                              f"(got {self.request_router!r})")
        if self.prefix_routing_blocks < 1:
            raise ConfigError("prefix-routing-blocks must be >= 1 "
                              f"(got {self.prefix_routing_blocks})")
        if self.prefix_routing_imbalance < 0:
            raise ConfigError("prefix-routing-imbalance must be >= 0 "
                              f"(got {self.prefix_routing_imbalance})")

    @property
    def uses_ray(self) -> bool:
        return self.replicas > 1 or self.ray_address is not None
