"""Block-quantized weights and the C++ CPU kernels (kernels/csrc): values against gguf's own
dequantization, products against float64, batch invariance bit for bit, and greedy speculation
identical to plain decoding under every quantization. The tuner that chooses among the kernels
is tested in test_tuner.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import quant_ext
from specserve.kernels.quant import BlockQuantLinear, BlockQuantWeight, from_gguf_blocks, quantize

ext = quant_ext.load()  # make test installs the compiler toolchain; a build failure fails here


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05 + 0.01 * torch.randn(n, 1, generator=g)


# ---- formats ----------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_like_gguf_bit_for_bit(type_name, tmp_path):
    """A GGUF written by the gguf package, read back: our planes dequantize to exactly what
    gguf.quants.dequantize (which transformers' GGUF loader calls) gives."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    w = _weights(64, 96, 0).numpy()
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raw = gguf.quants.quantize(w, qtype)
    writer.add_tensor("t", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    ours = from_gguf_blocks(type_name, tensor.data, (64, 96)).dequantize()
    ref = torch.from_numpy(gguf.quants.dequantize(tensor.data, qtype).reshape(64, 96))
    assert torch.equal(ours, ref)


@pytest.mark.slow
def test_default_model_blocks_equal_transformers_weights():
    """The built-in GGUF's Q4_1 projections (q/k un-permuted, fused) and its Q8_0 table, loaded
    natively, dequantize bit for bit to the float tensors transformers' GGUF loader produces."""
    from specserve.engine.models import default_model_path
    from specserve.target.loader import build_model, load_weights
    from specserve.target.quantize import gguf_block_weights

    path = default_model_path()
    cfg, model = build_model(path, torch.float32, "cpu")
    blocks = gguf_block_weights(path, model)
    _, hf = load_weights(path)
    # qkv, o, gate_up, down per layer; the head and the embedding lookup (one tied table)
    assert len(blocks) == 4 * cfg.num_layers + 2
    for i in (0, cfg.num_layers - 1):
        p = f"model.layers.{i}."
        qkv = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(blocks[f"layers.{i}.self_attn.qkv_proj"].dequantize(), qkv)
        gate_up = torch.cat([hf[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])
        assert torch.equal(blocks[f"layers.{i}.mlp.gate_up_proj"].dequantize(), gate_up)
        down = hf[p + "mlp.down_proj.weight"]
        assert torch.equal(blocks[f"layers.{i}.mlp.down_proj"].dequantize(), down)
    assert blocks["lm_head"].fmt == "q8_0"
    assert torch.equal(blocks["lm_head"].dequantize(), hf["model.embed_tokens.weight"])
    assert torch.equal(blocks["embed_tokens"].dequantize(), hf["model.embed_tokens.weight"])


# ---- kernels against float64 ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_block_linear_within_activation_rounding_of_float64(fmt, rows):
    """The kernel rounds activations to int8 per block of 32 (scale amax/127), like llama.cpp;
    the weights are exact. So |y - x @ W^T| <= sum over blocks of (amax_b / 254) * sum|w| in the
    block, plus float32 accumulation error. Stated per output, checked for every one."""
    w = _weights(96, 128, 1)
    qw = quantize(w, fmt)
    dense = qw.dequantize().double()  # [N, K]
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=g)
    bias = torch.randn(96, generator=g)
    y = BlockQuantLinear(qw, bias)(x).double()
    ref = x.double() @ dense.T + bias.double()
    step = x.abs().view(rows, -1, 32).amax(-1).double() / 254.0  # [M, KB] half a code
    bound = torch.einsum("mb,nbk->mn", step, dense.abs().view(96, -1, 32))
    bound += 1e-5 * (x.double().abs() @ dense.abs().T + 1.0)
    assert ((y - ref).abs() <= bound).all(), float(((y - ref).abs() - bound).max())
    # and the rounding is a real effect, not zero: the bound is not vacuous
    assert (y - ref).abs().max() > 0


def test_quantize_int4_and_int8_error_is_a_fraction_of_a_step():
    """Within half a step (q4_1) or a step (q8_0) of the block's float scale, plus what storing
    the scale and min as float16 (the file format's width) moves the largest code by."""
    w = _weights(64, 256, 2)
    blocks = w.view(64, -1, 32)
    lo, hi, amax = blocks.amin(-1), blocks.amax(-1), blocks.abs().amax(-1)
    for fmt in ("q4_1", "q8_0"):
        qw = quantize(w, fmt)
        assert torch.equal(qw.d.half().float(), qw.d)  # float16 values
        err = (qw.dequantize() - w).abs().view(64, -1, 32).amax(-1)
        if fmt == "q4_1":
            d = (hi - lo) / 15
            bound = 0.5 * d + 15 * (qw.d - d).abs() + (qw.m - lo).abs()
        else:
            d = amax / 127
            bound = 0.5 * d + 127 * (qw.d - d).abs()
        assert (err <= bound + 1e-6).all()
        assert (err > 0).any()


def test_fused_ops_match_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=g)
    w = torch.randn(96, generator=g)
    ref = (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()) * w.double()
    torch.testing.assert_close(ext.rms_norm(x, w, 1e-5).double(), ref, rtol=1e-5, atol=1e-6)
    r = torch.randn(7, 96, generator=g)
    r0 = r.clone()
    y = ext.add_rms_norm_(x, r, w, 1e-5)
    assert torch.equal(r, r0 + x)
    torch.testing.assert_close(y, ext.rms_norm(r, w, 1e-5), rtol=0, atol=0)
    gu = torch.randn(5, 2 * 40, generator=g)
    ref = F.silu(gu[:, :40].double()) * gu[:, 40:].double()
    torch.testing.assert_close(ext.silu_mul(gu).double(), ref, rtol=1e-5, atol=1e-6)


def test_fused_rotary_equals_reference_rotary():
    from specserve.kernels.rotary import apply_rotary

    g = torch.Generator().manual_seed(4)
    H, KVH, D, T = 4, 2, 16, 5
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    ang = torch.randn(T, D // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], -1)
    rq, rk = apply_rotary(q.reshape(T, H, D), k.reshape(T, KVH, D), cos[:, None], sin[:, None])
    out = qkv.clone()
    ext.rotary_qkv_(out, cos, sin, H, KVH, D)
    assert torch.equal(out[:, : H * D], rq.reshape(T, -1))  # the same sums in the same order
    assert torch.equal(out[:, H * D: (H + KVH) * D], rk.reshape(T, -1))
    assert torch.equal(out[:, (H + KVH) * D:], v)


# ---- batch invariance -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_block_linear_is_batch_invariant(fmt):
    """Row i of an M-row call equals the 1-row call bit for bit, M = 1..9 and the batch sizes
    the engine runs, whatever rows share each weight block and however threads split N."""
    lin = BlockQuantLinear(quantize(_weights(200, 96, 6), fmt), torch.randn(200))
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(7))
    single = torch.cat([lin.run(x[i: i + 1], 1) for i in range(64)])
    for rows in [*range(1, 10), 16, 32, 64]:
        for per_pass in (1, 2, 4):
            assert torch.equal(lin.run(x[:rows], per_pass), single[:rows]), (rows, per_pass)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin.run(x, 4), single)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("bias", [True, False])
def test_every_instruction_set_form_gives_the_avx2_bits(fmt, bias):
    """The VNNI forms (on CPUs that have them) compute the same integer dots and the same float
    ops per feature as AVX2: equal bit for bit at every row count and rows per pass, with an
    odd number of 8-feature groups (the AVX-512 form's pairs leave one over) and Q8_0 codes at
    both ends of int8."""
    w = quantize(_weights(200, 96, 16), fmt)
    if fmt == "q8_0":
        w.qs[0, :4] = -128  # a file may hold -128; quantize() never writes it
        w.qs[1, :4] = 127
    lin = BlockQuantLinear(w, torch.randn(200) if bias else None)
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(17))
    want = lin.run(x, quant_ext.kernel_code("avx2/1"))
    isas = quant_ext.supported_isas()
    assert isas[0] == "avx2"
    for isa in isas:
        for per_pass in quant_ext.ROWS_PER_PASS[isa]:
            code = quant_ext.kernel_code(f"{isa}/{per_pass}")
            for rows in (1, 2, 3, 5, 8, 13, 16, 17, 37):
                assert torch.equal(lin.run(x[:rows], code), want[:rows]), (isa, per_pass, rows)


def test_unknown_block_kernel_names_the_forms():
    with pytest.raises(ValueError, match="avx512vnni"):
        quant_ext.kernel_code("sse/4")
    with pytest.raises(ValueError, match=re.escape("avx2/<1|2|4|8>, avxvnni/<1|2|4|8>, "
                                                   "avx512vnni/<1|2|4|8|16>")):
        quant_ext.kernel_code("avx2/16")
    lin = BlockQuantLinear(quantize(_weights(8, 32, 1), "q4_1"))
    with pytest.raises(RuntimeError, match="instruction set"):
        lin.run(torch.randn(1, 32), 32 * 7 + 4)
    with pytest.raises(RuntimeError, match="16 for AVX-512 VNNI"):
        lin.run(torch.randn(1, 32), 32 * 0 + 16)


def test_fused_ops_are_batch_invariant():
    g = torch.Generator().manual_seed(8)
    x, r, w = torch.randn(33, 64, generator=g), torch.randn(33, 64, generator=g), torch.randn(64)
    gu = torch.randn(33, 128, generator=g)
    for rows in [*range(1, 10), 16, 32]:
        assert torch.equal(ext.rms_norm(x[:rows], w, 1e-6), ext.rms_norm(x, w, 1e-6)[:rows])
        assert torch.equal(ext.silu_mul(gu[:rows]), ext.silu_mul(gu)[:rows])
        a, b = r[:rows].clone(), r.clone()
        assert torch.equal(ext.add_rms_norm_(x[:rows], a, w, 1e-6),
                           ext.add_rms_norm_(x, b, w, 1e-6)[:rows])


# ---- through the engine -----------------------------------------------------------------------


def _engine(model: str | None, quantization: str, method: str, max_model_len: int = 1024,
            kv_cache_dtype: str = "auto"):
    from specserve.core.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=model, quantization=quantization, speculative_method=method, draft_model="none",
        kv_cache_memory=128 << 20, max_model_len=max_model_len, adaptive_speculation=False,
        kv_cache_dtype=kv_cache_dtype,
    ))


REWRITE = ("Rewrite in the past tense: The new library opens on Monday. The new library has a "
           "cafe, a reading room and a children's corner. The new library is open from nine "
           "to six.")


@pytest.mark.parametrize("quantization, kv_cache_dtype", [
    ("auto", "auto"), ("int8", "auto"), ("int4", "auto"), ("auto", "float16"),
    ("auto", "bfloat16")])
@pytest.mark.slow
def test_greedy_ngram_speculation_equals_plain_on_default_model(quantization, kv_cache_dtype):
    """Under every quantization of the built-in model (auto: its own Q4_1/Q8_0 blocks), and with
    a float16 or bfloat16 KV cache, n-gram speculation with a fixed k=4 gives token-for-token
    the plain output: the verify pass is batch-invariant, so it scores each draft exactly as a
    one-row step would."""
    plain = _engine(None, quantization, "off", kv_cache_dtype=kv_cache_dtype)
    spec = _engine(None, quantization, "ngram", kv_cache_dtype=kv_cache_dtype)
    assert plain.quantization == ("gguf" if quantization == "auto" else quantization)
    from specserve.kernels.attention_form import has_bf16_products

    # auto: bfloat16 where the CPU has bfloat16 dot products (the C++ attention's fastest form)
    auto_kv = torch.bfloat16 if has_bf16_products(64) else torch.float32
    want_kv = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(kv_cache_dtype, auto_kv)
    assert plain.runner.kv_cache.dtype == spec.runner.kv_cache.dtype == want_kv
    questions = [REWRITE, "List three uses of a paperclip.", "Write a haiku about the sea."]
    prompts = [plain.encode(plain.render_chat([{"role": "user", "content": q}]))
               for q in questions]
    from specserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=48, temperature=0.0)
    a = plain.generate(prompts, params)
    b = spec.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
    assert b[0].timings.num_accepted > 0  # the rewrite copies from its prompt: drafts were used
    one_by_one = [plain.generate([p], params)[0].token_ids for p in prompts]
    assert one_by_one == [x.token_ids for x in a]  # batch of 3 == alone


@pytest.mark.slow
def test_16_bit_kv_caches_need_the_cpp_attention():
    """float16 / bfloat16 caches only where the C++ attention reads them; ``auto`` keeps the
    model's dtype elsewhere (the dense float32 path stays the transformers-exact reference)."""
    from specserve.core.config import EngineConfig
    from specserve.core.errors import ConfigError

    with pytest.raises(ConfigError,
                       match="kv-cache-dtype must be auto, float32, float16 or bfloat16"):
        EngineConfig(kv_cache_dtype="fp8")
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(ConfigError, match="needs the C[+][+] CPU attention"):
            _engine(None, "none", "off", kv_cache_dtype=dtype)
    dense = _engine(None, "none", "off")
    assert dense.attn_backend.name != "cpu_paged"
    assert dense.runner.kv_cache.dtype == torch.float32


@pytest.mark.slow
def test_quantized_hf_folder_speculation_equals_plain(text_model):
    """An HF folder quantized at load (int4 and int8): greedy n-gram output equals plain."""
    from specserve.core.sampling_params import SamplingParams

    for quantization in ("int4", "int8"):
        plain = _engine(text_model, quantization, "off", 512)
        spec = _engine(text_model, quantization, "ngram", 512)
        ids = plain.encode("one two three one two three one two")
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        assert (plain.generate([ids], params)[0].token_ids
                == spec.generate([ids], params)[0].token_ids)


def test_quantization_flag_errors():
    from specserve.core.config import EngineConfig
    from specserve.core.errors import ConfigError
    from specserve.engine.resolve import resolve_dtype

    with pytest.raises(ConfigError, match="quantization must be"):
        EngineConfig(quantization="int3")
    with pytest.raises(ConfigError, match="compute in float32"):
        resolve_dtype("bfloat16", torch.device("cpu"), quantized=True)
    assert resolve_dtype("auto", torch.device("cpu"), quantized=True) == torch.float32


def test_gguf_tensor_shape_errors_name_the_fix():
    with pytest.raises(ValueError, match="divisible by 32"):
        from_gguf_blocks("Q8_0", np.zeros((2, 34), np.uint8), (2, 40))
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q8_0"):
        from_gguf_blocks("Q2_K", np.zeros((2, 84), np.uint8), (2, 256))
    with pytest.raises(ValueError, match="divisible by 256"):
        from_gguf_blocks("Q6_K", np.zeros((2, 210), np.uint8), (2, 32))


def _prefill_decode_verify(cfg, model) -> torch.Tensor:
    """Logits of two sequences' prefill, decode and verify steps through a fresh runner."""
    from specserve.kernels.cpu_paged import CpuPagedAttention
    from specserve.kernels.metadata import AttentionMetadata, token_positions
    from specserve.target.model_runner import ModelRunner

    runner = ModelRunner(cfg, model, num_blocks=8, block_size=4, dtype=torch.float32,
                         device="cpu", attn_backend=CpuPagedAttention())
    outs = []
    for q_lens, ctx in (([6, 3], [6, 3]), ([1, 2], [7, 5]), ([3, 1], [8, 6])):
        meta = AttentionMetadata.build(q_lens, ctx, [[0, 1], [2, 3]], 4)
        ids = torch.arange(sum(q_lens)) + 5
        outs.append(runner.forward(ids, token_positions(q_lens, ctx), meta)[0])
    return torch.cat(outs)


def test_whole_layer_call_equals_the_per_op_path(text_model, monkeypatch):
    """``DecoderStack`` (every layer in one C++ call), ``decoder_layer_`` (one C++ call per
    layer) and the per-op fused path of target/model.py compute exactly the same logits, bit
    for bit, prefill, decode and verify rows."""
    from specserve.kernels.cpu_paged import CpuPagedAttention
    from specserve.target.loader import build_model
    from specserve.target.quantize import quantize_model

    cfg, model = build_model(text_model, torch.float32, "cpu")
    quantize_model(model, "int4", text_model)

    def run() -> torch.Tensor:
        return _prefill_decode_verify(cfg, model)

    stack = run()
    assert model._stack is not None and model._stack.num_layers() == len(model.layers)
    model.use_decoder_stack = False
    whole = run()
    assert torch.equal(stack, whole)
    monkeypatch.setattr(CpuPagedAttention, "kernel_plan", lambda self, meta: None)
    for layer in model.layers:
        layer._layer_args = None
    per_op = run()
    assert torch.equal(whole, per_op)


def test_five_bit_forms_in_the_whole_layer_calls_give_the_int8_bits(text_model):
    """Projections with Q5_0-range codes held five bits a weight too: the decoder stack and the
    per-layer C++ call run the five-bit planes where a layer's plan names ``avx2p5`` and give the
    int8 forms' logits bit for bit (prefill, decode and verify rows)."""
    from specserve.kernels.linear import RowPlan
    from specserve.target.loader import build_model
    from specserve.target.quantize import quantize_model

    cfg, model = build_model(text_model, torch.float32, "cpu")
    quantize_model(model, "int8", text_model)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, BlockQuantLinear)]
    for name, m in layers:  # Q5_0's range: every layer gets five-bit planes
        w = m.weight
        narrow = BlockQuantWeight("q8_0", w.qs.clamp(-16, 15), w.d, None)
        bias = None if m.bias is None else m.bias[: m.out_features]
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                BlockQuantLinear(narrow, bias, five_bit=True))

    def run(form: str, stack: bool) -> torch.Tensor:
        model.use_decoder_stack, model._stack = stack, None
        for layer in model.layers:
            layer._layer_args = None
        for m in model.modules():
            if isinstance(m, BlockQuantLinear):
                assert m.five_bit
                m.rows_plan = RowPlan(form)
        return _prefill_decode_verify(cfg, model)

    wide = run("avx2/4", stack=True)
    assert torch.equal(run(f"{quant_ext.FIVE_BIT}/4", stack=True), wide)
    assert torch.equal(run(f"{quant_ext.FIVE_BIT}/1", stack=False), wide)


@pytest.mark.e2e
@pytest.mark.slow
def test_default_model_native_4bit_speculation_same_text_over_http():
    """The built-in model with the server's defaults (its Q4_1/Q8_0 blocks, the shipped draft):
    per-request speculation off / ngram / draft gives the same greedy chat answer, over HTTP.
    The second and third requests of a prompt hit the prefix cache, so this also checks that a
    cached prefix changes no bits."""
    from specserve.core.config import EngineConfig
    from specserve.server.server_config import ServerConfig
    from tests.helpers.servers import KEY, NAME, ServerThread, http

    srv = ServerThread(
        EngineConfig(kv_cache_memory=128 << 20, max_model_len=1024, adaptive_speculation=False),
        ServerConfig(port=0, api_key=KEY, served_model_name=NAME),
    )
    try:
        assert srv.engine.engine.quantization == "gguf"
        questions = ["Rewrite in the past tense: The cat sits on the mat. The cat sleeps there.",
                     "List three uses of a paperclip.", "What is the capital of France?"]
        for q in questions:
            texts = {}
            for method in ("off", "ngram", "draft"):
                status, resp = http("POST", srv.url + "/v1/chat/completions", {
                    "model": NAME, "messages": [{"role": "user", "content": q}],
                    "max_tokens": 40, "temperature": 0,
                    "speculative": {"method": method, "num_tokens": 4},
                })
                assert status == 200, resp
                texts[method] = resp["choices"][0]["message"]["content"]
            assert texts["off"] == texts["ngram"] == texts["draft"], texts
            assert texts["off"]
    finally:
        srv.stop()
