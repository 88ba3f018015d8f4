"""Long-document workflow: oiq-cache-prompt saves a document's cache, oiq-generate answers from it.

Run as a user would (subprocesses) with the demo model on a short document.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import demo_path_or_skip
from mlx_lm.models.cache import load_prompt_cache

from oiq_mlx import OIQConfig, OIQKVCache, install

ROOT = Path(__file__).resolve().parents[2]

# No trailing whitespace: the question's leading space then tokenizes the same
# whether it follows the document in one string or in a later call.
DOCUMENT = (
    "Notes from the harbour office.\n\n"
    "The lighthouse on Gull Rock was built in 1851 by the engineer Thomas Rowe. "
    "Its keeper, Martha Fenwick, kept the lamp burning for forty-two years and rescued "
    "the crew of the schooner Bright Hope in the storm of 1889. The light was automated in 1962."
)
QUESTION = " Question: who was the keeper of the lighthouse on Gull Rock?"


def _run(module, *args, stdin=None):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                          input=stdin)


@pytest.fixture(scope="module")
def demo():
    return demo_path_or_skip()


@pytest.mark.slow
def test_cached_document_answers_like_the_whole_prompt(demo, tmp_path):
    """Full-precision cache: the cached prefix + continued prompt equals one whole prompt."""
    path = tmp_path / "doc.safetensors"
    r = _run("oiq_mlx.cli.cache_prompt", "--no-oiq", "--prompt-cache-file", str(path), "--prompt", "-", stdin=DOCUMENT)
    assert r.returncode == 0, r.stderr
    cached = _run("oiq_mlx.cli.generate", "--prompt-cache-file", str(path), "-p", QUESTION, "-m", "12", "--no-oiq")
    whole = _run("oiq_mlx.cli.generate", "-p", DOCUMENT + QUESTION, "-m", "12", "--no-oiq")
    assert cached.returncode == 0 and whole.returncode == 0, cached.stderr + whole.stderr
    assert "Martha" in whole.stdout, whole.stdout
    assert cached.stdout == whole.stdout
    # the continued prompt is only the question and the turn's end, not the document again
    n_cached = int(cached.stderr.split("Prompt: ")[1].split(" tokens")[0])
    n_whole = int(whole.stderr.split("Prompt: ")[1].split(" tokens")[0])
    assert n_cached < 25 < n_whole


@pytest.mark.slow
def test_oiq_cache_file_keeps_its_config_and_answers(demo, tmp_path):
    path = tmp_path / "doc3.safetensors"
    r = _run("oiq_mlx.cli.cache_prompt", "--model", "demo", "--k-bits", "3", "--window", "16",
             "--prompt-cache-file", str(path), "--prompt", DOCUMENT)
    assert r.returncode == 0, r.stderr
    assert "KV cache (OIQ K3V3 g32): " in r.stderr
    install()  # registers OIQKVCache with mlx-lm's loader
    cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    assert metadata["model"] == "demo"
    assert all(isinstance(c, OIQKVCache) and c.config == OIQConfig(k_bits=3, window=16) for c in cache)
    # the document is held quantized (exact_prefill ended before saving)
    assert cache[0].q_end > cache[0].config.sink_tokens and not any(c.prefilling for c in cache)
    n_doc = cache[0].offset

    answer = _run("oiq_mlx.cli.generate", "--prompt-cache-file", str(path), "-p", QUESTION, "-m", "12")
    assert answer.returncode == 0, answer.stderr
    assert "Martha" in answer.stdout, answer.stdout
    n_question = int(answer.stderr.split("Prompt: ")[1].split(" tokens")[0])
    assert "KV cache (OIQ K3V3 g32): " in answer.stderr
    n_generated = int(answer.stderr.split("Generation: ")[1].split(" tokens")[0])
    # the document, the question and the generated tokens (mlx-lm feeds the last one too)
    assert f"at these {n_doc + n_question + n_generated} tokens" in answer.stderr

    # options that contradict the file are refused, as mlx_lm.generate refuses --kv-bits
    for args, message in (
        (["--k-bits", "4"], "do not match the cache loaded from --prompt-cache-file: k_bits 3 in the file, 4 asked"),
        (["--no-oiq"], "--no-oiq does not match the OIQ cache"),
        (["--model", "gemma3"], "is not the model the prompt cache was made with (demo)"),
    ):
        r = _run("oiq_mlx.cli.generate", "--prompt-cache-file", str(path), "-p", QUESTION, *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert message in r.stderr, r.stderr


def test_cache_prompt_bad_input_fails_cleanly(tmp_path):
    r = _run("oiq_mlx.cli.cache_prompt", "--prompt-cache-file", str(tmp_path / "x.npz"), "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "oiq-cache-prompt: error: --prompt-cache-file must end in .safetensors" in r.stderr
    r = _run("oiq_mlx.cli.cache_prompt", "--prompt-cache-file", str(tmp_path / "x.safetensors"), "--prompt", "hi",
             "--model", "gemma")
    assert r.returncode == 2 and "oiq-cache-prompt: error: unknown model 'gemma' (did you mean 'gemma3'?)" in r.stderr
