"""ServerConfig: the HTTP/WebSocket front door's settings (the engine's are in ``EngineConfig``).

The ``serve`` CLI fills it flag for flag (``--max-queue-len`` -> ``max_queue_len``).
"""

from __future__ import annotations

import hashlib

import msgspec

from specserve.core.errors import ConfigError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ServerConfig(msgspec.Struct, kw_only=True):
    """Front-door settings.

    Admission: at most ``max_num_seqs + max_queue_len`` sequences are unfinished at once (running
    plus waiting for a slot); a request that would exceed that gets 429 instead of queueing
    without bound. ``api_key`` None disables authentication; several keys are several
    tenants (each key is its own tenant for the suffix decoding cache).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | list[str] | None = None  # clients send `Authorization: Bearer KEY`
    max_queue_len: int = 256  # sequences allowed to wait beyond max_num_seqs before 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    served_model_name: str | None = None  # None: the --model value, or the built-in name
    shutdown_timeout: float = 10.0  # seconds SIGTERM waits for aborted streams to flush
    warmup: bool = True  # run real short requests before /health says ready
    request_timeout: float | None = None  # seconds; a request's own `timeout` field wins

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535] (got {self.port})")
        if self.max_queue_len < 0:
            raise ConfigError(f"max-queue-len must be >= 0 (got {self.max_queue_len})")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max-body-bytes must be >= 1024 (got {self.max_body_bytes})")
        if self.api_key is not None and (not self.api_key or not all(self.keys)):
            raise ConfigError("api-key must not be empty (omit it to disable authentication)")
        if self.request_timeout is not None and not 0 < self.request_timeout <= 1e6:
            raise ConfigError("request-timeout must be in (0, 1e6] seconds (got "
                              f"{self.request_timeout}); omit it for no deadline")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown-timeout must be >= 0 (got {self.shutdown_timeout})")

    @property
    def keys(self) -> list[str]:
        if self.api_key is None:
            return []
        return [self.api_key] if isinstance(self.api_key, str) else list(self.api_key)

    @property
    def tenants(self) -> dict[str, str]:
        """API key -> its tenant id (a digest: caches never hold the key itself)."""
        return {k: hashlib.sha256(k.encode()).hexdigest()[:16] for k in self.keys}

    def model_name(self, model: str | None) -> str:
        """The name /v1/models reports and requests may ask for."""
        if self.served_model_name:
            return self.served_model_name
        if model is None or model == "default":
            return DEFAULT_MODEL_NAME
        return model
