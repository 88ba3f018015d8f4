"""GGUF architectures beyond the bundled models: qwen2, qwen3, mistral, phi3.

No such model ships offline, so each test builds a small random-weight mlx-lm
model, writes it as llama.cpp's ``convert_hf_to_gguf.py`` would (gguf-py's
tensor name map, llama.cpp's metadata keys, Q/K rows permuted for the
``llama`` architecture only, which is also what llama.cpp writes for Mistral),
loads it back through ``oiq_mlx.load`` and compares logits.  Every parameter is
random (norms included), so a swapped or unpermuted tensor changes the logits.
The tokenizers are tiny vocabularies written into the metadata.
"""

import importlib

import oiq_mlx  # noqa: F401  (preloads OpenBLAS before mlx is imported)

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from oiq_mlx.mlx_lm import models
from oiq_mlx.mlx_lm.gguf import GGUFError, GGUFFile, build_tokenizer
from oiq_mlx.mlx_lm.gguf import tokenizer as gguf_tokenizer

from helpers import write_tiny_gguf

# ---------------------------------------------------------------- reference: a llama.cpp-style writer


def _permute(w, n_head):
    """llama.cpp's LlamaModel.permute: per head, rotary halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bytes_to_unicode():
    """GPT-2's printable stand-ins for the 256 byte values (byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _bpe_vocab(writer, pre, add_bos=False):
    """A byte-level BPE vocabulary (Qwen-style): 256 byte symbols, a few merges, ChatML specials,
    and two words (" world", "Hello") that no merge builds; ``add_bos`` None leaves the key out."""
    byte_chars = _bytes_to_unicode()
    space = byte_chars[ord(" ")]
    tokens = [byte_chars[b] for b in range(256)]
    merges = [("1", "2"), ("h", "e"), ("l", "l"), ("he", "ll"), (space, "w"), ("o", "r")]
    tokens += ["".join(m) for m in merges] + [space + "world", "Hello"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)
    return tokens


def _spm_vocab(writer):
    """A SentencePiece (llama-style) vocabulary: specials, 256 byte-fallback pieces, scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = ["▁", "t", "h", "e", "a", "c", "s", "▁t", "he", "▁the", "at", "▁c", "▁cat", "▁s", "▁sat"]
    for i, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i) if len(piece) == 1 else float(len(piece)))
    tokens.append("[INST]")
    types.append(3)
    scores.append(0.0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    return tokens


def _random_model(model_type, vocab_size, **extra):
    module = importlib.import_module(f"mlx_lm.models.{'llama' if model_type == 'mistral' else model_type}")
    args = dict(
        model_type=model_type,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    args.update(extra)
    model = module.Model(module.ModelArgs.from_dict(args))
    mx.random.seed(0)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.2, model.parameters()))
    mx.eval(model.parameters())
    return model, args


def write_gguf(path, model, args, arch, vocab, quant=None):
    """``model`` as a GGUF the way llama.cpp's converter lays it out: F32 tensors, or the GGUF type
    ``quant(hf_name, w)`` names (gguf-py's numpy quantizer; None keeps F32)."""
    writer = gguf.GGUFWriter(str(path), arch)
    n_head, n_kv = args["num_attention_heads"], args["num_key_value_heads"]
    head_dim = args.get("head_dim") or args["hidden_size"] // n_head
    writer.add_context_length(args["max_position_embeddings"])
    writer.add_embedding_length(args["hidden_size"])
    writer.add_block_count(args["num_hidden_layers"])
    writer.add_feed_forward_length(args["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(args["rms_norm_eps"])
    writer.add_rope_freq_base(args["rope_theta"])
    if "head_dim" in args:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(int(head_dim * args.get("partial_rotary_factor", 1.0)))
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(args["original_max_position_embeddings"])
        writer.add_sliding_window(0)
    tokens = vocab(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], args["num_hidden_layers"])
    for hf_name, value in tree_flatten(model.parameters()):
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        w = np.array(value, dtype=np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, n_head if "q_proj" in hf_name else n_kv)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's RMSNorm scale as 1 + w
        kind = quant(hf_name, w) if quant else None
        if kind:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)
    rope = args.get("rope_scaling")
    if arch == "phi3" and rope:
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


# ---------------------------------------------------------------- the architectures


def _longrope(head_dim):
    rng = np.random.default_rng(1)
    return {
        "type": "longrope",
        "long_factor": (1 + rng.random(head_dim // 2) * 4).tolist(),
        "short_factor": (1 + rng.random(head_dim // 2)).tolist(),
    }


CASES = {
    # name: (mlx-lm model_type, GGUF arch, vocabulary writer, extra model args)
    "qwen2": ("qwen2", "qwen2", lambda w: _bpe_vocab(w, "qwen2"), {}),
    "qwen3": ("qwen3", "qwen3", lambda w: _bpe_vocab(w, "qwen2"), {"head_dim": 32}),
    "mistral": ("mistral", "llama", _spm_vocab, {"head_dim": 24, "rope_theta": 1e6}),
    "phi3": ("phi3", "phi3", _spm_vocab, {"original_max_position_embeddings": 1024}),
    "phi3-longrope": ("phi3", "phi3", _spm_vocab, {"original_max_position_embeddings": 1024,
                                                   "rope_scaling": _longrope(16)}),
}
VOCAB_SIZES = {"qwen2": 267, "qwen3": 267, "mistral": 275, "phi3": 275, "phi3-longrope": 275}


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    name = request.param
    model_type, arch, vocab, extra = CASES[name]
    model, args = _random_model(model_type, VOCAB_SIZES[name], **extra)
    path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    tokens = write_gguf(path, model, args, arch, vocab)
    assert len(tokens) == VOCAB_SIZES[name]
    return name, model, path


def test_loads_into_mlx_lm_class_with_equal_logits(converted):
    name, reference, path = converted
    loaded, tokenizer = models.load(path, dequantize=True)
    model_type = CASES[name][0]
    assert type(loaded).__module__ == f"mlx_lm.models.{'llama' if model_type == 'mistral' else model_type}"
    tokens = mx.array([[5, 17, 200, 3, 42, 99, 7, 64, 150, 11]])
    want, got = reference(tokens), loaded(tokens)
    # both fp32 with the same weights; only summation order may differ
    assert mx.abs(want - got).max().item() <= 1e-4 * max(1.0, mx.abs(want).max().item())
    assert mx.array_equal(mx.argmax(want, -1), mx.argmax(got, -1)).item()


def test_tokenizer_round_trips_and_chat_template(converted):
    name, _, path = converted
    _, tok = models.load(path, dequantize=True)
    if CASES[name][2] is _spm_vocab:
        text = "the cat sat\n on the mat: ünï 🙂 [INST]"
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.convert_ids_to_tokens(ids[1:4]) == ["▁the", "▁cat", "▁sat"]
        assert tok.decode(ids, skip_special_tokens=False).removeprefix("<s>").lstrip() == text
    else:
        text = "hello world 12 12345\n\tünïcödé 🙂 <|im_end|>"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.convert_ids_to_tokens(tok.encode("hello")) == ["hell", "o"]
        # qwen2's split takes digits one by one, so the merge "1 2" never applies
        assert tok.encode("12") == tok.encode("1") + tok.encode("2")
        assert tok.eos_token_ids >= {tok.convert_tokens_to_ids("<|im_end|>")}
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
        assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gpt2_pre_tokenizer_would_merge_the_digits(tmp_path):
    """The check above can fail: under GPT-2's split the merge "1 2" applies."""
    model, args = _random_model("qwen2", 267)
    path = tmp_path / "gpt2pre.gguf"
    write_gguf(path, model, args, "qwen2", lambda w: _bpe_vocab(w, "gpt2"))
    _, tok = models.load(path, dequantize=True)
    assert tok.convert_ids_to_tokens(tok.encode("12")) == ["12"]


def test_llama3_pre_tokenizer(tmp_path):
    """llama-bpe: digits in runs of up to three, and whole-vocabulary words taken without merges."""
    model, args = _random_model("qwen2", 267)
    path = tmp_path / "llama3pre.gguf"
    write_gguf(path, model, args, "qwen2", lambda w: _bpe_vocab(w, "llama-bpe"))
    _, llama3 = models.load(path, dequantize=True)
    assert llama3.convert_ids_to_tokens(llama3.encode("12")) == ["12"]
    assert llama3.convert_ids_to_tokens(llama3.encode(" world")) == ["Ġworld"]
    text = "hello world 12345\n\tünïcödé 🙂"
    assert llama3.decode(llama3.encode(text)) == text
    path = tmp_path / "qwen2pre.gguf"
    write_gguf(path, model, args, "qwen2", lambda w: _bpe_vocab(w, "qwen2"))
    _, qwen2 = models.load(path, dequantize=True)
    assert qwen2.convert_ids_to_tokens(qwen2.encode(" world")) == ["Ġw", "or", "l", "d"]


def test_tekken_pre_tokenizer(tmp_path):
    """Mistral's Tekken (e.g. Mistral Nemo, written as llama): case-change splits, whole words
    without merges, and BOS added when the file does not say."""
    model, args = _random_model("mistral", 267, head_dim=24)
    path = tmp_path / "tekken.gguf"
    write_gguf(path, model, args, "llama", lambda w: _bpe_vocab(w, "tekken", add_bos=None))
    loaded, tok = models.load(path, dequantize=True)
    ids = tok.encode("HelloWorld")
    assert ids[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(ids[1:]) == ["Hello", "W", "or", "l", "d"]
    text = "HelloWorld hello world 12345\n\tünïcödé 🙂"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    tokens = mx.array([ids])
    assert mx.abs(model(tokens) - loaded(tokens)).max().item() < 1e-4 * mx.abs(model(tokens)).max().item() + 1e-4


def test_missing_pre_tokenizer_warns(tmp_path):
    model, args = _random_model("qwen2", 267)
    path = tmp_path / "nopre.gguf"
    write_gguf(path, model, args, "qwen2", lambda w: _bpe_vocab(w, None))
    with pytest.warns(UserWarning, match="no tokenizer.ggml.pre: splitting text as GPT-2 does"):
        _, tok = models.load(path, dequantize=True)
    assert tok.convert_ids_to_tokens(tok.encode("12")) == ["12"]


def test_unknown_bpe_pre_tokenizer_is_refused(tmp_path):
    model, args = _random_model("qwen2", 267)
    path = tmp_path / "odd.gguf"
    write_gguf(path, model, args, "qwen2", lambda w: _bpe_vocab(w, "deepseek-coder"))
    with pytest.raises(GGUFError, match="pre-tokenizer 'deepseek-coder'"):
        models.load(path)


# ---------------------------------------------------------------- tokenizer cache


def _vocab_only_meta(path, vocab):
    return GGUFFile(write_tiny_gguf(path, vocab=vocab)).metadata


def _same_tokenizer(got, want, text):
    assert got._tokenizer.backend_tokenizer.to_str() == want._tokenizer.backend_tokenizer.to_str()
    assert got.encode(text) == want.encode(text)
    assert got.decode(got.encode(text)) == want.decode(want.encode(text))
    assert got.eos_token_ids == want.eos_token_ids
    assert (got.bos_token, got.eos_token, got.unk_token, got.pad_token) == \
        (want.bos_token, want.eos_token, want.unk_token, want.pad_token)
    assert got.chat_template == want.chat_template


@pytest.mark.parametrize("vocab", [_spm_vocab, lambda w: _bpe_vocab(w, "qwen2")], ids=["spm", "bpe"])
def test_tokenizer_cache_gives_the_same_tokenizer(tmp_path, monkeypatch, vocab):
    meta = _vocab_only_meta(tmp_path / "tok.gguf", vocab)
    text = "the cat sat\n on the mat: hello world 12 ünï 🙂 [INST] <|im_end|>"
    fresh = build_tokenizer(meta)
    cache = tmp_path / "cache"
    first = build_tokenizer(meta, cache=cache)
    (saved,) = cache.iterdir()
    assert saved.name.startswith(gguf_tokenizer.cache_key(meta) + "-")
    _same_tokenizer(first, fresh, text)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt although the cache holds this tokenizer")

    with monkeypatch.context() as m:
        m.setattr(gguf_tokenizer, "_backend", no_rebuild)
        _same_tokenizer(build_tokenizer(meta, cache=cache), fresh, text)

    # a file whose content is not what its name says (truncated, or edited to another
    # vocabulary) is rebuilt and replaced
    good = saved.read_text()
    other = build_tokenizer(_vocab_only_meta(tmp_path / "other.gguf", (lambda w: _bpe_vocab(w, "qwen2")) if vocab is _spm_vocab else _spm_vocab))
    for bad in (good[: len(good) // 2], other._tokenizer.backend_tokenizer.to_str()):
        saved.write_text(bad)
        _same_tokenizer(build_tokenizer(meta, cache=cache), fresh, text)
        assert [p.read_text() for p in cache.iterdir()] == [good]

    # a directory that cannot be made: nothing cached, the same tokenizer
    (tmp_path / "a_file").write_text("")
    _same_tokenizer(build_tokenizer(meta, cache=tmp_path / "a_file" / "cache"), fresh, text)


def test_tokenizer_cache_key_follows_the_metadata(tmp_path):
    meta = _vocab_only_meta(tmp_path / "tok.gguf", _spm_vocab)
    key = gguf_tokenizer.cache_key(meta)
    assert gguf_tokenizer.cache_key(dict(meta)) == key
    changed = dict(meta)
    changed["tokenizer.ggml.scores"] = np.asarray(meta["tokenizer.ggml.scores"]).copy()
    changed["tokenizer.ggml.scores"][-2] += 1
    assert gguf_tokenizer.cache_key(changed) != key
    # a nested array (no tokenizer has one; a hostile file may) still has a key
    assert gguf_tokenizer.cache_key({**meta, "tokenizer.ggml.odd": [np.arange(3), ["a"]]}) != key
    for name, value in (("tokenizer.ggml.add_bos_token", False), ("tokenizer.ggml.tokens",
                        meta["tokenizer.ggml.tokens"][:-1] + ["[INST2]"])):
        assert gguf_tokenizer.cache_key({**meta, name: value}) != key
    # what the backend does not read (the chat template, the architecture) keeps the key
    assert gguf_tokenizer.cache_key({**meta, "tokenizer.chat_template": "x", "general.architecture": "qwen2"}) == key


def test_gemma3_legacy_quants_compute_in_float32(tmp_path):
    """A Gemma 3 file of Q8_0 tensors (read by mx.load, whose scales are float16), kept quantized:
    its scales become float32, so the residual stream stays float32 as with Q4_K (repack)
    and as dense.  The real Gemma 3 270M written as Q8_0 moved its logits by 0.5-0.7 of their
    largest value with float16 scales, 3e-6 with float32."""
    # six layers: mlx-lm's Gemma 3 takes every sixth layer as global (sliding_window_pattern)
    model, args = _random_model("gemma3_text", 275, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16,
                                sliding_window=512, tie_word_embeddings=True)
    path = tmp_path / "gemma3_q8.gguf"
    write_gguf(path, model, args, "gemma3", _spm_vocab,
               quant=lambda name, w: "Q8_0" if w.ndim == 2 else None)
    dense, _ = models.load(path, dequantize=True)
    loaded, _ = models.load(path, dequantize=False)
    layer = loaded.model.layers[0].self_attn.o_proj
    assert (layer.bits, layer.scales.dtype, loaded.model.embed_tokens.scales.dtype) == (8, mx.float32, mx.float32)
    tokens = mx.array([[5, 17, 200, 3, 42, 99, 7, 64, 150, 11]])
    assert loaded.model.embed_tokens(tokens).dtype == mx.float32
    want, got = dense(tokens), loaded(tokens)
    assert got.dtype == mx.float32
    # the same Q8_0 values, dequantized or not: only summation order differs
    assert mx.abs(want - got).max().item() <= 1e-4 * mx.abs(want).max().item()
    # and the model is the one written, up to Q8_0's own error
    ref = model(tokens)
    assert mx.abs(ref - got).max().item() <= 0.05 * mx.abs(ref).max().item()


def test_quantized_weights_load_for_new_archs(tmp_path):
    """Q8_0 tensors (read by mx.load) keep their layout for qwen2's biased projections."""
    model, args = _random_model("qwen2", 267)
    path = tmp_path / "q8.gguf"
    write_gguf(path, model, args, "qwen2", lambda w: _bpe_vocab(w, "qwen2"),
               quant=lambda hf_name, w: "Q8_0" if w.ndim == 2 else None)
    dense, _ = models.load(path, dequantize=True)
    quant, _ = models.load(path, dequantize=False)
    tokens = mx.array([[5, 17, 200, 3, 42]])
    want = model(tokens)
    for loaded in (dense, quant):
        # Q8_0 rounding of every weight: a few percent of the logit range
        assert mx.abs(want - loaded(tokens)).max().item() < 0.05 * mx.abs(want).max().item()


LEGACY_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}


def test_legacy_quants_load_as_they_are(tmp_path):
    """A file ``mx.load`` refuses (Q5_0 and Q5_1 in it) is read one tensor at a time: each legacy
    tensor becomes a quantized layer at its own bits whose values are the file's, bit for bit (the
    llama arch's permuted Q/K rows too), and the model answers as the dense one does."""
    model_type, arch, vocab, extra = CASES["mistral"]
    model, args = _random_model(model_type, VOCAB_SIZES["mistral"], **extra)
    kinds = {}

    def quant(hf_name, w):
        if w.ndim != 2 or w.shape[-1] % 32:
            return None
        kinds[hf_name] = list(LEGACY_BITS)[len(kinds) % len(LEGACY_BITS)]
        return kinds[hf_name]

    path = tmp_path / "legacy.gguf"
    write_gguf(path, model, args, arch, vocab, quant=quant)
    assert set(kinds.values()) == set(LEGACY_BITS)
    dense, _ = models.load(path, dequantize=True)
    packed, _ = models.load(path, dequantize=False)
    want, got = dict(tree_flatten(dense.parameters())), dict(tree_flatten(packed.parameters()))
    for hf_name, kind in kinds.items():
        module = hf_name.removesuffix(".weight")
        w, s, b = got[hf_name], got[f"{module}.scales"], got[f"{module}.biases"]
        assert w.shape[-1] * 32 == want[hf_name].shape[-1] * LEGACY_BITS[kind], hf_name
        values = mx.dequantize(w, s, b, group_size=32, bits=LEGACY_BITS[kind])
        assert mx.array_equal(values, want[hf_name]).item(), (hf_name, kind)
    tokens = mx.array([[5, 17, 200, 3, 42, 99, 7, 64, 150, 11]])
    a, b = dense(tokens), packed(tokens)
    assert mx.abs(a - b).max().item() <= 1e-4 * max(1.0, mx.abs(a).max().item())
