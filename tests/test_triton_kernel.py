"""The Triton paged-attention kernel against a float64 dense reference, in Triton's CPU
interpreter.

``TRITON_INTERPRET=1`` only takes effect if it is set before ``@triton.jit`` runs, i.e. before
specserve.kernels.triton_paged is first imported, and another test in this process may already have
imported it. So the cases run in ONE subprocess started with the variable set (this module run
as ``python -m tests.test_triton_kernel``), which prints each case's error as JSON; the tests
here read that. Tiny shapes keep the interpreter's run to a few seconds per case.

The interpreter runs the kernels' arithmetic but not Triton's compiler, so a second subprocess
compiles them for sm_90 (Triton's own ptxas; no GPU needed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HANG_S = 1800  # the subprocesses take tens of seconds; only a hang runs past this


def _cases() -> dict[str, dict]:
    """name -> make_case kwargs plus kv_tile and dtype name."""
    from tests.helpers.attention_cases import CASES

    cases = {f"{n}-float32": dict(kw, kv_tile=16, dtype="float32") for n, kw in CASES.items()}
    for dtype in ("float16", "bfloat16"):
        cases[f"mixed_gqa_bs4-{dtype}"] = dict(CASES["mixed_gqa_bs4"], kv_tile=16, dtype=dtype)
    cases["window-bfloat16"] = dict(CASES["window"], kv_tile=16, dtype="bfloat16")
    # Default tile size, a context several tiles long, a verify next to a long decode.
    cases["long_ctx_tile64"] = dict(query_lens=[5, 1, 40], cached_lens=[150, 200, 0], H=4,
                                    KVH=2, D=64, block_size=16, kv_tile=64, dtype="float32")
    for seed in range(4):
        rng = random.Random(3000 + seed)
        B = rng.randint(1, 5)
        kvh = rng.choice([1, 2, 4])
        cases[f"random{seed}"] = dict(
            query_lens=[rng.choice([1, 1, 2, 5, rng.randint(1, 30)]) for _ in range(B)],
            cached_lens=[rng.randint(0, 40) for _ in range(B)],
            H=kvh * rng.choice([1, 2, 3]), KVH=kvh, D=rng.choice([8, 16, 24, 32]),
            block_size=rng.choice([1, 4, 16]),
            sliding_window=rng.choice([None, rng.randint(1, 20)]),
            kv_tile=rng.choice([16, 32]), dtype="float32",
        )
    return cases


def _run_all() -> dict[str, dict]:
    """Runs in the interpreter subprocess: every case, plus the padding-slot check."""
    from specserve.kernels.metadata import AttentionMetadata
    from specserve.kernels.triton_paged import _INTERPRETED, TritonPagedAttention
    from tests.helpers.attention_cases import make_case, run_backend

    assert _INTERPRETED, "TRITON_INTERPRET=1 was not in effect"
    results: dict[str, dict] = {}
    for name, spec in _cases().items():
        kw = dict(spec)
        backend = TritonPagedAttention(kv_tile=kw.pop("kv_tile"))
        dtype = DTYPES[kw.pop("dtype")]
        try:
            err, written = run_backend(backend, make_case(seed=7, dtype=dtype, **kw))
            results[name] = {"err": err, "written": written}
        except Exception as exc:  # reported per case, so one failure does not hide the rest
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    k_cache = torch.zeros(2, 4, 1, 16)
    v_cache = torch.zeros(2, 4, 1, 16)
    meta = AttentionMetadata.build([2], [2], [[1]], 4)
    meta.slot_mapping[1] = -1
    k = torch.ones(2, 1, 16)
    TritonPagedAttention().forward(torch.randn(2, 1, 16), k, k, k_cache, v_cache, meta, 1.0)
    results["padding_slot"] = {
        "written": bool(k_cache[1, 0].sum() == 16 and k_cache[1, 1].sum() == 0)
    }
    return results


@pytest.fixture(scope="module")
def interpreted_results():
    # triton is in the dev extra (`make test` installs it): its absence is a failure, not a skip.
    assert importlib.util.find_spec("triton") is not None, "pip install triton"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_triton_kernel"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(_cases()))
def test_triton_matches_dense_reference(interpreted_results, name):
    from tests.helpers.attention_cases import tolerance

    result = interpreted_results[name]
    assert "error" not in result, result["error"]
    assert result["written"], "new K/V not at their slots"
    assert result["err"] < tolerance(DTYPES[_cases()[name]["dtype"]]), result["err"]


def test_triton_skips_padding_slots(interpreted_results):
    assert interpreted_results["padding_slot"]["written"]


# (dtype, GROUP, head dim, BLOCK_M, sliding window, num_seqs == 1): GPU launch configurations
COMPILE_CONFIGS = {
    "decode_bf16": ("bf16", 4, 64, 16, False, False),
    "prefill_window_bf16": ("bf16", 4, 128, 64, True, True),
    "verify_fp16_group3": ("fp16", 3, 24, 32, False, False),
    "fp32_ieee": ("fp32", 4, 64, 16, False, False),
}


def _compile_all() -> dict[str, str]:
    """Compiles both kernels for sm_90 with the wheel's own ptxas (no GPU needed): catches what
    the interpreter never checks (loop-carried types, tl.dot shapes, shared-memory layout)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.kernels import triton_paged as tp

    def build(fn, types, consts):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig,
                        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

    results = {}
    try:
        ptr = "*bf16"
        build(tp._store_kv_kernel, dict(k_ptr=ptr, v_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr,
                                        slot_ptr="*i64"),
              dict(BLOCK_SIZE=16, KVH=8, HEAD_DIM=64, BLOCK_H=8, BLOCK_D=64))
        results["store_kv"] = "ok"
    except Exception as exc:
        results["store_kv"] = f"{type(exc).__name__}: {exc}"[:2000]
    for name, (dtype, group, dim, block_m, window, one_seq) in COMPILE_CONFIGS.items():
        ptr = f"*{dtype}"
        types = dict(out_ptr=ptr, q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr,
                     block_tables_ptr="*i32", cu_q_ptr="*i32", ctx_ptr="*i32",
                     scale_log2="fp32")
        consts = dict(BLOCK_SIZE=16, GROUP=group, HEAD_DIM=dim,
                      BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=block_m,
                      BLOCK_Q=block_m // group, BLOCK_N=64, USE_WINDOW=window,
                      DOT_PRECISION="ieee" if dtype == "fp32" else None, UPCAST_DOT=False)
        if one_seq:  # Triton specializes an int argument equal to 1 into a constant
            consts["num_seqs"] = 1
        try:
            build(tp._paged_attention_kernel, types, consts)
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"[:2000]
    return results


@pytest.fixture(scope="module")
def compiled_results():
    # triton is in the dev extra (`make test` installs it): its absence is a failure, not a skip.
    assert importlib.util.find_spec("triton") is not None, "pip install triton"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_triton_kernel", "compile"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["store_kv", *COMPILE_CONFIGS])
def test_kernel_compiles_for_sm90(compiled_results, name):
    assert compiled_results[name] == "ok", compiled_results[name]


if __name__ == "__main__":
    print(json.dumps(_compile_all() if sys.argv[1:] == ["compile"] else _run_all()))
