"""Attention backend registry. Backends are imported lazily, so a CUDA-only backend can never
break a CPU import; `auto` picks the best one that imports on this device and says why."""

from __future__ import annotations

import importlib
import logging
from typing import Protocol

import torch

from kernels.metadata import AttentionMetadata
from specserve.errors import ConfigError

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...


# name -> (module, class, devices it runs on)
_BACKENDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "torch": ("kernels.torch_ref", "TorchPagedAttention", ("cpu", "cuda", "mps")),
}
# Preference order for `auto` on each device type.
_AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "triton", "sdpa", "torch"),
}


def available_backends() -> list[str]:
    return ["auto", *_BACKENDS]


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Returns an instance of the named backend (`auto`: the best available on `device`)."""
    device_type = torch.device(device).type
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device_type, ("torch",)):
            if candidate not in _BACKENDS:
                continue
            try:
                backend = _load(candidate, device_type)
            except ImportError as exc:
                log.info("attention backend %s unavailable (%s); trying the next", candidate, exc)
                continue
            log.info("attention backend: %s (auto, device %s)", candidate, device_type)
            return backend
        raise ConfigError(f"no attention backend runs on device {device_type!r}")
    if name not in _BACKENDS:
        raise ConfigError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_backends())}"
        )
    return _load(name, device_type)


def _load(name: str, device_type: str) -> AttentionBackend:
    module_name, class_name, devices = _BACKENDS[name]
    if device_type not in devices:
        raise ConfigError(
            f"attention backend {name!r} does not run on {device_type}; it supports "
            f"{', '.join(devices)}"
        )
    module = importlib.import_module(module_name)
    return getattr(module, class_name)()
