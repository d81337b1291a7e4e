"""Tiny configs of every architecture family the engine serves, each with the options that set
it apart turned on and small enough windows that test prompts cross them."""

from __future__ import annotations

from transformers import PretrainedConfig

from tests.helpers.tiny_models import tiny_config

WINDOW = 8  # sliding windows of the cases; the tests' prompts are longer


def _longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": 96,
    }


# case -> (architecture, config options): the options each family is tested with
_CASES: dict[str, tuple[str, dict]] = {
    # Gemma 2: sliding / global / sliding layers, both soft-caps small enough to bite, a query
    # scale unlike head_dim's
    "gemma2": ("gemma2", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0, final_logit_softcapping=3.0)),
    # Gemma 3: q/k norm, local rope base 10k and a global base 1M with linear scaling (as the
    # 4B+ checkpoints), layers from sliding_window_pattern 2
    "gemma3": ("gemma3", dict(
        head_dim=16, num_hidden_layers=3, sliding_window=WINDOW, sliding_window_pattern=2,
        query_pre_attn_scalar=16, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        })),
    # Phi-4-mini's shape: partial rotary (0.75) with longrope, tied embeddings
    "phi3_longrope": ("phi3", dict(
        pad_token_id=0, rope_parameters=_longrope(12), tie_word_embeddings=True,
        original_max_position_embeddings=96)),
    # Phi-3-mini's: every layer windowed
    "phi3_window": ("phi3", dict(pad_token_id=0, sliding_window=WINDOW)),
    "granite": ("granite", dict(
        embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.09,
        logits_scaling=2.5, tie_word_embeddings=True)),
    # Llama 3.2: tied head, llama3 rope scaling
    "llama32": ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
}
ARCH_CASES = tuple(_CASES)


def arch_config(case: str, **overrides) -> PretrainedConfig:
    """The case's config; ``overrides`` give the sizes (the case's own options win)."""
    arch, options = _CASES[case]
    return tiny_config(arch, **{**overrides, **options})
