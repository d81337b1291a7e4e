"""Attention backend registry. Backends are imported lazily, so a CUDA-only backend can never
break a CPU import; `auto` picks the best one that loads on this device and logs one line for
each one it skipped, saying why. The `auto` rule lives here and only here
(``resolve_attention_backend``): on CUDA the preference order below; on CPU the C++ attention
for a model whose projections are block-quantized (batch-invariant, like those projections),
else the torch reference."""

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
    needs_cpp: bool = False  # runs the C++ kernels (kernels/csrc), which must build here


_BACKENDS: dict[str, _Entry] = {
    "torch": _Entry("specserve.kernels.torch_ref", "TorchPagedAttention", ("cpu", "cuda", "mps")),
    "sdpa": _Entry("specserve.kernels.sdpa", "SdpaPagedAttention", ("cpu", "cuda", "mps")),
    # C++ (kernels/csrc/fused.cpp), float32, batch-invariant; auto picks it for quantized models
    "cpu_paged": _Entry("specserve.kernels.cpu_paged", "CpuPagedAttention", ("cpu",),
                        needs_cpp=True),
    # Triton's CPU interpreter (TRITON_INTERPRET=1) is for tests only: construct the class
    # directly there; the registry offers it on CUDA.
    "triton": _Entry("specserve.kernels.triton_paged", "TritonPagedAttention", ("cuda",), "triton"),
    "flash_attn": _Entry(
        "specserve.kernels.flash_attn_backend", "FlashAttnPagedAttention", ("cuda",), "flash-attn"
    ),
}
# Preference order for `auto` on each device type (see ``_auto_order``).
_AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "triton", "sdpa", "torch"),
}


def _auto_order(device_type: str, quantized: bool) -> tuple[str, ...]:
    if device_type == "cpu" and quantized:
        return ("cpu_paged", "torch")
    return _AUTO_ORDER.get(device_type, ("torch",))


class _Unavailable(Exception):
    """A backend cannot serve this device / block size; the message says why and the fix."""


def available_backends() -> list[str]:
    return ["auto", *_BACKENDS]


def resolve_attention_backend(
    name: str, device: torch.device | str, *, block_size: int | None = None,
    quantized: bool = False,
) -> str:
    """The backend `name` stands for on `device`: itself (checked to load there), or for `auto`
    the first of the device's preference order that loads (``quantized``: the model's
    projections are block-quantized).

    ``block_size`` (the KV cache's) lets `auto` skip backends that cannot serve it (flash-attn's
    paged KV needs a multiple of 256); without it `auto` never picks such a backend.
    """
    device_type = torch.device(device).type
    if name == "auto":
        for candidate in _auto_order(device_type, quantized):
            try:
                _load(candidate, device_type, block_size, auto=True)
            except _Unavailable as exc:
                log.info("attention backend %r skipped: %s", candidate, exc)
                continue
            log.info("attention backend: %s (auto, device %s)", candidate, device_type)
            return candidate
        raise ConfigError(f"no attention backend runs on device {device_type!r}")
    _load(_known(name), device_type, block_size, auto=False, check_only=True)
    return name


def get_attention_backend(
    name: str, device: torch.device | str, *, block_size: int | None = None,
    quantized: bool = False,
) -> AttentionBackend:
    """An instance of the named backend (`auto`: see ``resolve_attention_backend``)."""
    device_type = torch.device(device).type
    if name == "auto":
        name = resolve_attention_backend(name, device, block_size=block_size, quantized=quantized)
    return _load(_known(name), device_type, block_size, auto=False)


def _known(name: str) -> str:
    if name not in _BACKENDS:
        raise ConfigError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_backends())}"
        )
    return name


def _load(name: str, device_type: str, block_size: int | None, auto: bool,
          check_only: bool = False) -> AttentionBackend:
    """The backend's instance; raises ``_Unavailable`` (for `auto`) or ``ConfigError`` (a
    backend asked for by name) saying why it cannot serve this device / block size."""
    try:
        return _try_load(name, device_type, block_size, auto, check_only)
    except _Unavailable as exc:
        if auto:
            raise
        raise ConfigError(f"attention backend {name!r} {exc}") from exc


def _try_load(name: str, device_type: str, block_size: int | None, auto: bool,
              check_only: bool) -> AttentionBackend:
    entry = _BACKENDS[name]
    if device_type not in entry.devices:
        raise _Unavailable(
            f"does not run on {device_type}; it supports {', '.join(entry.devices)}"
        )
    if entry.needs_cpp:
        from specserve.kernels import quant_ext

        if not quant_ext.available():
            raise _Unavailable("needs the C++ kernels (kernels/csrc), which do not build on "
                               "this machine; use --attention-backend torch")
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
    return None if check_only else cls()  # type: ignore[return-value]
