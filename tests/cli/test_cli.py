"""oiq-generate, run as a user would (subprocess), and its helpers in-process."""

import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from helpers import demo_path_or_skip, write_tiny_gguf
from oiq_mlx import OIQConfig, OIQKVCache
from oiq_mlx.mlx_lm import models
from oiq_mlx.cli.options import memory_line, run

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, stdin=None):
    """Run oiq-generate; ``stdin`` may be bytes (passed through undecoded)."""
    if isinstance(stdin, str):
        stdin = stdin.encode("utf-8")
    r = subprocess.run(
        [sys.executable, "-m", "oiq_mlx.cli.generate", *args], capture_output=True, cwd=ROOT, input=stdin
    )
    r.stdout, r.stderr = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    return r


def _assert_usage_error(r, message):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "oiq-generate: error: " in r.stderr and message in r.stderr, r.stderr


def test_cli_help_lists_every_option():
    out = _cli("--help").stdout
    for opt in ("--model", "--prompt", "--preset", "--k-bits", "--v-bits", "--group-size", "--sink-tokens", "--window",
                "--quantize-after", "--clip", "--align-scales", "--no-align-scales", "--key-alignment", "--center-keys", "--no-center-keys", "--key-scaling", "--temp", "--seed",
                "--system-prompt", "--no-oiq", "--layer-bits"):
        assert opt in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--k-bits", "7"], "k_bits=7 is not supported"),
        (["--group-size", "48"], "group_size=48 is not supported"),
        (["--window", "-1"], "window must be >= 0"),
        (["--max-tokens", "0"], "argument --max-tokens/-m: must be >= 1, got 0"),
        (["--preset", "1bit"], "unknown OIQ preset '1bit'"),
        (["--layer-bits", "3:3"], "layer_bits entry '3:3' is not layer:k_bits:v_bits"),
        (["--layer-bits", "99:3:3"], "layer_bits names layers [99] that do not use OIQ in this model"),
        (["--model", "/nonexistent/model.gguf"], "GGUF file not found: /nonexistent/model.gguf"),
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["--temp", "-1"], "argument --temp: must be >= 0.0, got -1"),
        (["--temp", "nan"], "argument --temp: must be a finite number"),
        (["--top-p", "0"], "argument --top-p: must be > 0.0"),
        (["--top-p", "1.5"], "argument --top-p: must be <= 1.0"),
        (["--min-p", "-0.1"], "argument --min-p: must be >= 0.0"),
        (["--top-k", "-3"], "argument --top-k: must be >= 0"),
        (["--model", "gemma"], "unknown model 'gemma' (did you mean 'gemma3'?)"),
        (["--model", "nonexistent/deeper/path"], "model path not found: nonexistent/deeper/path"),
        (["--prompt-cache-file", "/nonexistent/cache.safetensors"],
         "prompt cache file not found: /nonexistent/cache.safetensors"),
    ],
)
def test_bad_options_fail_cleanly(args, message):
    _assert_usage_error(_cli(*args, "--prompt", "hi"), message)


def test_model_that_is_not_gguf_or_a_directory(tmp_path):
    path = tmp_path / "some.bin"
    path.write_bytes(b"\0" * 64)
    _assert_usage_error(_cli("--model", str(path), "-p", "hi"), f"{path} is a file but not a .gguf")


def test_directory_that_is_not_a_model(tmp_path):
    _assert_usage_error(_cli("--model", str(tmp_path), "-p", "hi"), "is a directory without config.json")


def test_gguf_with_truncated_header(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:20])
    _assert_usage_error(_cli("--model", str(path), "-p", "hi"), "GGUF header truncated or corrupt")


def test_gguf_one_byte_short(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:-1])
    _assert_usage_error(
        _cli("--model", str(path), "-p", "hi"), "tensor 'output_norm.weight' ends at byte"
    )


def test_stdin_that_is_not_utf8():
    _assert_usage_error(_cli("--prompt", "-", stdin=b"caf\xe9 \xff"), "standard input is not valid UTF-8 (byte 0xe9 at offset 3)")


# ---------------------------------------------------------------- memory line


def _filled(cache, tokens, heads=2, dim=64, dtype=mx.float32):
    x = mx.random.normal((1, heads, tokens, dim)).astype(dtype)
    cache.update_and_fetch(x, x)
    if hasattr(cache, "release_fresh"):
        cache.release_fresh()  # as attention does once it has read the prompt
    mx.eval(cache.state)
    return cache


def test_memory_line_counts_fp16_by_tokens_held():
    fp16_45 = 45 * 2 * (64 + 64) * 2  # tokens x heads x (k + v dims) x 2 bytes
    kv = _filled(KVCache(), 45)  # float32, 256 tokens allocated
    assert kv.nbytes == 256 * 2 * 128 * 4
    line = memory_line([kv], "full precision")
    assert line == (f"KV cache (full precision): {kv.nbytes / 2**20:.2f} MiB held, {fp16_45 / 2**20:.2f} MiB "
                    f"for fp16 at these 45 tokens, {kv.nbytes / fp16_45:.2f} times larger")
    # a sliding-window layer holds at most its window once decoding passes it
    rot = RotatingKVCache(max_size=16)
    for _ in range(45):
        _filled(rot, 1)
    assert f"{(fp16_45 + 16 * 2 * 128 * 2) / 2**20:.2f} MiB for fp16" in memory_line([kv, rot], "x")


def test_memory_line_says_why_a_short_prompt_is_larger():
    cache = _filled(OIQKVCache(OIQConfig.preset("4bit")), 45)
    cache.end_prefill()
    line = memory_line([cache], "OIQ")
    assert line.endswith(f"{cache.nbytes / (45 * 2 * 128 * 2):.2f} times larger (0 of 45 tokens packed: OIQ keeps "
                         "the first 4 tokens and the last 64 in full precision, float32 here, and packs the tokens "
                         "between)"), line
    longer = _filled(OIQKVCache(OIQConfig.preset("4bit", window=16)), 200)
    longer.end_prefill()
    assert memory_line([longer], "OIQ").endswith("times smaller")  # no explanation needed


def test_memory_line_says_smaller_for_a_compressed_cache():
    cache = _filled(OIQKVCache(OIQConfig(k_bits=2, v_bits=2, window=0, sink_tokens=0)), 2048)
    cache.end_prefill()  # generation has started: the prompt is packed
    held, fp16 = cache.nbytes, 2048 * 2 * 128 * 2
    assert held < fp16
    line = memory_line([cache], "OIQ")
    assert line.endswith(f"at these 2048 tokens, {fp16 / held:.2f} times smaller"), line


def test_warnings_print_as_one_plain_line(capsys):
    def body(argv):
        warnings.warn("oiq_mlx: 3 layers use OIQKVCache; kept in full precision: 15 x RotatingKVCache")
        return 0

    assert run("oiq-generate", body, []) == 0
    assert capsys.readouterr().err == (
        "warning: oiq_mlx: 3 layers use OIQKVCache; kept in full precision: 15 x RotatingKVCache\n"
    )


@pytest.mark.slow
def test_generates_from_stdin_and_reports_memory():
    demo_path_or_skip()
    r = _cli("--prompt", "-", "--max-tokens", "8", "--k-bits", "5", "--v-bits", "3", stdin="What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens-per-sec" in r.stderr
    assert "KV cache (OIQ K5V3 g32): " in r.stderr and "MiB for fp16 at these " in r.stderr


@pytest.mark.slow
def test_gemma3_gets_its_chat_template():
    try:
        models.gemma3_model_path(install=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    chat = _cli("--model", "gemma3", "-p", "What is the capital of France?", "-m", "1")
    assert chat.returncode == 0, chat.stderr
    # raw, the prompt is <bos> + 7 tokens (the count the issue saw with and without the template);
    # the template adds <start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n
    assert int(chat.stderr.split("Prompt: ")[1].split(" tokens")[0]) == 16
    # make_oiq_cache's warning about the sliding-window layers: one plain line, no source line
    warning = [line for line in chat.stderr.splitlines() if "kept in full precision" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: oiq_mlx: 3 layers use OIQKVCache"), warning
    assert "warnings.warn" not in chat.stderr and "UserWarning" not in chat.stderr


def test_options_build_the_config():
    from oiq_mlx import OIQConfig
    from oiq_mlx.cli.generate import build_parser
    from oiq_mlx.cli.options import config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse([])) == OIQConfig()
    assert config_from_args(parse(["--preset", "3bit"])) == OIQConfig.preset("3bit")
    cfg = config_from_args(parse(["--preset", "2bit", "--k-bits", "3", "--no-clip", "--window", "0"]))
    assert cfg == OIQConfig.preset("2bit", k_bits=3, clip=False, window=0)
    assert config_from_args(parse(["--preset", "3bit", "--no-align-scales"])) == OIQConfig.preset("3bit", align_scales=False)
    assert config_from_args(parse(["--align-scales"])) == OIQConfig(align_scales=True)
    assert config_from_args(parse(["--preset", "3bit", "--key-alignment", "0.5"])).scale_alignment == (0.5, 1.0)
    assert config_from_args(parse(["--preset", "2bit", "--key-alignment", "1"])).scale_alignment == (1.0, 1.0)
    with pytest.raises(SystemExit):
        parse(["--key-alignment", "0.3"])
    with pytest.raises(ValueError, match="needs align_scales=True"):
        config_from_args(parse(["--no-align-scales", "--key-alignment", "0.5"]))
    assert config_from_args(parse(["--no-center-keys", "--key-scaling", "0.5"])) == OIQConfig(center_keys=False, key_scaling=0.5)
    assert config_from_args(parse(["--preset", "3bit", "--key-scaling-cap", "0"])) == OIQConfig.preset("3bit", key_scaling_cap=0.0)
    cfg = config_from_args(parse(["--preset", "2bit", "--layer-bits", "4:3:3,8:4:3"]))
    assert cfg == OIQConfig.preset("2bit", layer_bits=((4, 3, 3), (8, 4, 3)))


def test_preset_label_names_what_the_options_set_on_top():
    from oiq_mlx.cli.generate import build_parser
    from oiq_mlx.cli.options import preset_label

    parse = build_parser().parse_args
    assert preset_label(parse([])) == ""
    assert preset_label(parse(["--window", "16"])) == ""  # no preset: cache_label says what it stores
    assert preset_label(parse(["--preset", "2bit-ppl"])) == ", preset 2bit-ppl"
    assert preset_label(parse(["--preset", "2bit-ppl", "--no-align-scales", "--key-alignment", "1"])) == \
        ", preset 2bit-ppl with align_scales=False, key_alignment=1.0"


def test_scripts_create_the_json_folder_before_running(tmp_path):
    target = tmp_path / "new" / "folder" / "out.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_metal.py"), "--json", str(target)],
                       capture_output=True, text=True, cwd=ROOT)
    assert target.parent.is_dir()
    if mx.metal.is_available():
        pytest.skip("Metal is available here: check_metal.py runs its checks instead of refusing")
    assert r.returncode != 0 and "Metal is not available" in r.stderr


def test_cache_label_names_bits_layers_and_positional():
    from oiq_mlx.cli.options import cache_label

    assert cache_label([KVCache()]) == "full precision"
    assert cache_label([OIQKVCache(OIQConfig.preset("3bit"))]) == "OIQ K3V3 g32"
    assert cache_label([OIQKVCache(OIQConfig(positional=True, layer_bits="1:8:8"))]) == \
        "OIQ K5V3 g32, layers 1:K8V8, positional"
    assert cache_label([OIQKVCache(OIQConfig(exact_prefill=0))]) == "OIQ K5V3 g32, exact prefill off"
    assert cache_label([OIQKVCache(OIQConfig(exact_prefill=4096))]) == "OIQ K5V3 g32, exact prefill 4096"
