"""Attention backend registry. Backends are imported lazily, so a CUDA-only backend can never
break a CPU import; `auto` picks the best one that loads on this device and logs one line for
each one it skipped, saying why."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.core.errors import ConfigError
from specserve.kernels.metadata import AttentionMetadata

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


@dataclass(frozen=True)
class _Entry:
    module: str
    cls: str
    devices: tuple[str, ...]
    package: str | None = None  # what to pip-install when the import fails


_BACKENDS: dict[str, _Entry] = {
    "torch": _Entry("specserve.kernels.torch_ref", "TorchPagedAttention", ("cpu", "cuda", "mps")),
    "sdpa": _Entry("specserve.kernels.sdpa", "SdpaPagedAttention", ("cpu", "cuda", "mps")),
    # C++ (kernels/csrc/fused.cpp), float32, batch-invariant; auto picks it for quantized models
    "cpu_paged": _Entry("specserve.kernels.cpu_paged", "CpuPagedAttention", ("cpu",)),
    # Triton's CPU interpreter (TRITON_INTERPRET=1) is for tests only: construct the class
    # directly there; the registry offers it on CUDA.
    "triton": _Entry("specserve.kernels.triton_paged", "TritonPagedAttention", ("cuda",), "triton"),
    "flash_attn": _Entry(
        "specserve.kernels.flash_attn_backend", "FlashAttnPagedAttention", ("cuda",), "flash-attn"
    ),
}
# Preference order for `auto` on each device type.
_AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "triton", "sdpa", "torch"),
}


class _Unavailable(Exception):
    """A backend cannot serve this device / block size; the message says why and the fix."""


def available_backends() -> list[str]:
    return ["auto", *_BACKENDS]


def get_attention_backend(
    name: str, device: torch.device | str, *, block_size: int | None = None
) -> AttentionBackend:
    """Returns an instance of the named backend (`auto`: the best available on `device`).

    ``block_size`` (the KV cache's) lets `auto` skip backends that cannot serve it (flash-attn's
    paged KV needs a multiple of 256); without it `auto` never picks such a backend.
    """
    device_type = torch.device(device).type
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device_type, ("torch",)):
            try:
                backend = _load(candidate, device_type, block_size, auto=True)
            except _Unavailable as exc:
                log.info("attention backend %r skipped: %s", candidate, exc)
                continue
            log.info("attention backend: %s (auto, device %s)", candidate, device_type)
            return backend
        raise ConfigError(f"no attention backend runs on device {device_type!r}")
    if name not in _BACKENDS:
        raise ConfigError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_backends())}"
        )
    try:
        return _load(name, device_type, block_size, auto=False)
    except _Unavailable as exc:
        raise ConfigError(f"attention backend {name!r} {exc}") from exc


def _load(name: str, device_type: str, block_size: int | None, auto: bool) -> AttentionBackend:
    entry = _BACKENDS[name]
    if device_type not in entry.devices:
        raise _Unavailable(
            f"does not run on {device_type}; it supports {', '.join(entry.devices)}"
        )
    try:
        module = importlib.import_module(entry.module)
    except ImportError as exc:
        fix = f"pip install {entry.package}" if entry.package else "check the installation"
        if entry.package == "flash-attn":
            fix = "pip install 'specserve[cuda]' --no-build-isolation"
        raise _Unavailable(f"needs the {entry.package} package: {fix} ({exc})") from exc
    cls = getattr(module, entry.cls)
    check = getattr(cls, "unsupported_reason", None)
    if check is not None:
        if block_size is not None:
            reason = check(block_size)
            if reason:
                raise _Unavailable(reason)
        elif auto:
            raise _Unavailable("its block-size limits cannot be checked (no block_size given)")
    return cls()
