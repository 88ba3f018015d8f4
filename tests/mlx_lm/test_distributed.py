"""OIQ caches on a sharded model (oiq_mlx.mlx_lm.sharding).

In-process: a cache of a slice of the KV heads stores exactly that slice of
the unsharded cache; layouts, layer numbering and the errors of shard_model
(with a stand-in group object, since one process has no second rank).
Loopback: ``mlx.launch -n 2 --backend ring`` runs tests/distributed_worker.py
(tensor parallel llama and qwen3, pipeline qwen2, K8V8 and the 4bit preset)
and the oiq-generate command line; each launch takes a few seconds.
"""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import save_prompt_cache
from mlx_lm.utils import load_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helpers import tiny_gemma3, tiny_llama, tiny_qwen
from oiq_mlx import OIQConfig, OIQKVCache
from oiq_mlx.mlx_lm import sharding as distributed
from oiq_mlx.mlx_lm.caches import make_oiq_cache
from oiq_mlx.bench.server import ServerProcess, complete

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]  # tests/, where distributed_worker.py lives
LAUNCH_TIMEOUT_S = 120  # a launch takes 5-10 s here; the bound stops a hung ring

CONFIGS = {
    "k8v8": OIQConfig(k_bits=8, v_bits=8, sink_tokens=2, window=8),
    "4bit": OIQConfig.preset("4bit", sink_tokens=2, window=8),
    "3bit": OIQConfig.preset("3bit", sink_tokens=2, window=8),
    "2bit": OIQConfig.preset("2bit", sink_tokens=2, window=8),
}


class StandInGroup:
    """``rank()``/``size()`` of a group, for the parts of sharding that only count."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


# -- in process ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cache_of_a_head_slice_stores_exactly_the_unsharded_heads(name):
    """What a tensor-parallel rank does: its cache gets the same keys and values
    for its heads only.  Signs are per layer, mean / key scaling / group scales
    per head, so every stored array is the unsharded one's slice, bit for bit."""
    config = CONFIGS[name]
    mx.random.seed(5)
    # an outlier channel and an offset, so the mean and key scaling are not trivial
    keys = mx.random.normal((1, 4, 40, 64)) + 2.0 * (mx.arange(64) == 3)
    values = mx.random.normal((1, 4, 40, 64)) * 0.5 + 0.3
    full = OIQKVCache(config, layer_idx=3)
    full.update_and_fetch(keys, values)
    full.update_and_fetch(keys[:, :, :1] * 0.7, values[:, :, :1])
    for a, b in ((0, 2), (2, 4), (1, 2), (3, 4)):
        part = OIQKVCache(config, layer_idx=3)
        part.update_and_fetch(keys[:, a:b], values[:, a:b])
        part.update_and_fetch(keys[:, a:b, :1] * 0.7, values[:, a:b, :1])
        assert part.q_end == full.q_end > config.sink_tokens
        for side, ref in ((part.k, full.k), (part.v, full.v)):
            assert mx.array_equal(side.signs, ref.signs)
            for field in ("codes", "scales", "sink", "recent", "mean", "lam"):
                mine, theirs = getattr(side, field), getattr(ref, field)
                assert (mine is None) == (theirs is None), field
                if mine is not None:
                    assert mx.array_equal(mine, theirs[:, a:b]), (name, field, a, b)


def test_pipeline_layout_numbers_caches_with_global_layer_indices():
    """Rank 0 holds the last layers; its caches keep the global layer numbers
    (the sign seeds), and layer_bits applies to the same layers as unsharded."""
    config = OIQConfig(k_bits=8, v_bits=8, layer_bits="0:3:3,2:2:4")
    unsharded = make_oiq_cache(tiny_qwen(), config)
    expected = {c.layer_idx: (c.k.bits, c.v.bits) for c in unsharded}
    seen = {}
    for rank, layers, first in ((0, (1, 3), 1), (1, (0, 1), 0)):
        model = tiny_qwen()
        layout = distributed.shard_model(model, "pipeline", StandInGroup(rank, 2), name="tiny")
        assert (layout.layers, layout.first_cache, layout.kv_heads) == (layers, first, None)
        cache = distributed.make_cache(model, config, layout)
        assert [c.layer_idx for c in cache] == list(range(*layers))
        assert all(c.layout == layout.to_dict() for c in cache)
        seen.update({c.layer_idx: (c.k.bits, c.v.bits) for c in cache})
    assert seen == expected == {0: (3, 3), 1: (8, 8), 2: (2, 4)}


def test_layer_bits_checked_against_the_whole_model_under_pipeline():
    model = tiny_qwen()
    layout = distributed.shard_model(model, "pipeline", StandInGroup(1, 2))
    with pytest.raises(ValueError, match=r"layer_bits names layers \[7\] that do not use OIQ in this model"):
        distributed.make_cache(model, OIQConfig(layer_bits="2:3:3,7:3:3"), layout)


def test_shard_errors_name_the_model():
    with pytest.raises(ValueError, match=r"smol \(llama\) has 6 query and 3 KV heads, which do not divide over 2 ranks"):
        distributed.shard_model(tiny_llama(n_heads=6, n_kv_heads=3), "auto", StandInGroup(0, 2), name="smol")
    with pytest.raises(ValueError, match=r"smol \(llama\) does not support pipeline parallelism in mlx-lm; it supports tensor"):
        distributed.shard_model(tiny_llama(), "pipeline", StandInGroup(0, 2), name="smol")
    with pytest.raises(ValueError, match=r"g3 \(gemma3_text\) supports neither tensor parallelism .* nor pipeline"):
        distributed.shard_model(tiny_gemma3(), "tensor", StandInGroup(0, 2), name="g3")
    with pytest.raises(ValueError, match=r"tiny \(qwen2\) has 1 query and 1 KV heads.*; use --sharding pipeline"):
        model = tiny_qwen()
        for layer in model.layers:
            layer.self_attn.n_heads = layer.self_attn.n_kv_heads = 1
        distributed.shard_model(model, "tensor", StandInGroup(0, 2), name="tiny")
    with pytest.raises(ValueError, match=r"tiny \(qwen2\) has 3 layers, fewer than the 4 pipeline ranks"):
        distributed.shard_model(tiny_qwen(), "pipeline", StandInGroup(0, 4), name="tiny")
    with pytest.raises(ValueError, match="sharding must be auto, tensor or pipeline"):
        distributed.shard_model(tiny_qwen(), "data", StandInGroup(0, 2))


def _fill(cache, n_tokens):
    mx.random.seed(1)
    for c in cache:
        c.update_and_fetch(mx.random.normal((1, 2, n_tokens, 64)), mx.random.normal((1, 2, n_tokens, 64)))


def test_saved_cache_loads_only_on_its_layout(tmp_path):
    model = tiny_qwen()
    layout = distributed.shard_model(model, "pipeline", StandInGroup(1, 2))
    cache = distributed.make_cache(model, OIQConfig(window=4, sink_tokens=2), layout)
    _fill(cache, 20)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), cache)
    loaded = distributed.load_prompt_cache(path, layout)
    assert [c.layout for c in loaded] == [layout.to_dict()] and loaded[0].offset == 20
    other = distributed.ShardLayout("pipeline", 0, 2, None, (1, 3))
    with pytest.raises(ValueError, match=r"saved rank 1 of 2, pipeline parallel, all KV heads, layers 0-0; this run "
                                         r"is rank 0 of 2, pipeline parallel, all KV heads, layers 1-2"):
        distributed.load_prompt_cache(path, other)
    with pytest.raises(ValueError, match="this run is unsharded"):
        distributed.load_prompt_cache(path, None)
    unsharded = make_oiq_cache(tiny_qwen(), OIQConfig())
    _fill(unsharded, 4)
    save_prompt_cache(str(path), unsharded)
    assert len(distributed.load_prompt_cache(path, None)) == 3
    with pytest.raises(ValueError, match="was saved unsharded"):
        distributed.load_prompt_cache(path, layout)


# -- loopback, 2 ranks -----------------------------------------------------------------


def _ring_unavailable():
    if shutil.which("mlx.launch") is None:
        return "mlx.launch is not on PATH"
    if not mx.distributed.is_available("ring"):
        return "this MLX build has no ring backend"
    return None


loopback = pytest.mark.skipif(_ring_unavailable() is not None, reason=str(_ring_unavailable()))


def _free_ports():
    """A port p with p + 1 also free: the ring backend listens on one port per rank.  Drawn below
    Linux's ephemeral range (32768-60999), where no client socket and no server bound to port 0
    (the other tests' servers) can take it between this check and the ranks binding it."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def launch(*command, cwd=TESTS):
    """Run ``command`` on 2 ranks over loopback; (returncode, stdout, stderr).
    mlx.launch exits 0 even when a rank fails, so callers check what the ranks
    wrote.  A hung ring (a rank waiting on a send that never runs) is killed
    with its whole process group after LAUNCH_TIMEOUT_S."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(["mlx.launch", "-n", "2", "--backend", "ring", "--starting-port", str(_free_ports()),
                             sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the 2-rank launch of {command} did not finish in {LAUNCH_TIMEOUT_S} s\n{out}\n{err}")
    return proc.returncode, out, err


RUNS = "llama:tensor,qwen3:tensor,qwen2:pipeline"


@pytest.fixture(scope="module")
def worker_records(tmp_path_factory):
    """Both ranks' records of every run in RUNS: one launch (each costs seconds of start-up)."""
    out = tmp_path_factory.mktemp("ranks")
    rc, stdout, stderr = launch("distributed_worker.py", "--runs", RUNS, "--out", str(out))
    records = []
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote nothing (rc {rc})\n{stdout}\n{stderr}"
        records.append(json.loads(path.read_text()))
    return records


def run_records(worker_records, arch, sharding):
    return [{"rank": rec["rank"], **rec[f"{arch}:{sharding}"]} for rec in worker_records]


def _check_common(records, config):
    for rec in records:
        r = rec[config]
        assert r["tokens"] == r["ref_tokens"], (config, rec["rank"])
        assert len(set(r["ref_tokens"])) > 3  # the random model does not just repeat a token
        assert all(s["q_end"] == s["ref_q_end"] > 2 for s in r["storage"])  # tokens were quantized
        assert all(s["k_signs_equal"] and s["v_signs_equal"] for s in r["storage"])
        kv = r["kv_bytes"]
        assert kv == records[0][config]["kv_bytes"]  # every rank got the same all_gather
        assert kv["held"][rec["rank"]] == r["local_held"] and kv["held_total"] == sum(kv["held"])
        checks = r["layout_checks"]
        assert checks["same_layout_layers"] == [s["layer"] for s in r["storage"]]
        for other in ("other_rank", "other_sharding", "unsharded"):
            assert "a prompt cache loads only on the layout that saved it" in checks[other], other


@loopback
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tensor_parallel_two_ranks_matches_one_process(worker_records, arch):
    records = run_records(worker_records, arch, "tensor")
    assert [rec["k8v8"]["layout"]["kv_heads"] for rec in records] == [[0, 1], [1, 2]]
    for config in ("k8v8", "4bit"):
        _check_common(records, config)
        ref_held = records[0][config]["ref_held"]
        for rec in records:
            r = rec[config]
            # the sharded k/v/o projections and the all_sum of o_proj round differently
            # (~1e-7), which can flip a code sitting on a rounding boundary (seen: a few
            # 8-bit codes per layer); each flip moves a logit by up to ~1e-2
            assert r["logprob_maxdiff"] < 5e-2, config
            for s in r["storage"]:
                assert s["k_mean_maxdiff"] < 1e-5 and s["k_lam_maxdiff"] < 1e-5
                for side in "kv":
                    assert s[f"{side}_codes_mismatch"] <= 0.02 * s[f"{side}_codes_words"], (config, s)
                    assert s[f"{side}_dequantized_maxdiff"] <= s[f"{side}_step"] + 1e-5, (config, s)
            # each rank holds half of the heads, so half of the unsharded bytes, but
            # the whole per-layer sign vectors (float32, d = 64, keys and values): as stored,
            # and with keys and values of equal bits (k8v8) again, stacked for their one
            # quantize pass (4bit is K5V3: one pass per side, nothing stacked)
            copies = 2 if config == "k8v8" else 1
            assert 2 * r["local_held"] - ref_held == len(r["storage"]) * copies * (2 * 64 * 4), config


@loopback
def test_pipeline_two_ranks_is_bit_exact(worker_records):
    """Pipeline stages run the unsharded arithmetic: tokens, logits and every stored array equal."""
    records = run_records(worker_records, "qwen2", "pipeline")
    assert [rec["k8v8"]["layout"]["layers"] for rec in records] == [[1, 3], [0, 1]]
    for config in ("k8v8", "4bit"):
        _check_common(records, config)
        layers = sorted(s["layer"] for rec in records for s in rec[config]["storage"])
        assert layers == [0, 1, 2]
        for rec in records:
            r = rec[config]
            assert r["logprob_maxdiff"] == 0.0
            for s in r["storage"]:
                assert all(s[f"{side}_{f}_equal"] for side in "kv" for f in ("codes", "scales")), s
                assert s["k_mean_maxdiff"] == s["k_lam_maxdiff"] == 0.0
        kv = records[0][config]["kv_bytes"]
        assert kv["held_total"] == records[0][config]["ref_held"]


# -- oiq-generate under mlx.launch -------------------------------------------------------


TEXT = "the keeper of the lighthouse walked down to the sea every morning and counted the boats. " * 20


def write_model_folder(folder: Path, model_type: str, n_kv_heads: int) -> Path:
    """A random-weight mlx-lm model folder: config.json, model.safetensors and a
    byte-level BPE tokenizer trained on TEXT with the ``tokenizers`` package."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}))
    n_heads = 2 * n_kv_heads
    config = {"model_type": model_type, "hidden_size": 64 * n_heads, "num_hidden_layers": 3, "intermediate_size": 128,
              "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
              "rms_norm_eps": 1e-5, "vocab_size": 320, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "max_position_embeddings": 1024, "eos_token_id": tok.token_to_id("<eos>")}
    (folder / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    model, _ = load_model(folder, lazy=True, strict=False)
    # doubled weights: the greedy text of a random model at the default init repeats one token
    weights = {k: 2 * v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("qwen2"), "qwen2", n_kv_heads=2)


CLI_ARGS = ["--prompt", TEXT[:300], "--max-tokens", "12", "--ignore-chat-template", "--preset", "4bit",
            "--window", "16", "--sink-tokens", "2"]


def _generated(stdout: str) -> str:
    return stdout.strip("\n")


@pytest.fixture(scope="module")
def one_process(qwen2_folder):
    """oiq-generate's run of CLI_ARGS in one process: the reference."""
    one = subprocess.run([sys.executable, "-m", "oiq_mlx.cli.generate", "--model", str(qwen2_folder), *CLI_ARGS],
                         capture_output=True, text=True, cwd=ROOT, timeout=LAUNCH_TIMEOUT_S)
    assert one.returncode == 0, one.stderr
    return one


@loopback
@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_oiq_generate_on_two_ranks_prints_the_single_process_text_once(qwen2_folder, one_process, sharding):
    one = one_process
    text = _generated(one.stdout)
    assert len(set(text)) > 3, text  # the random model does not repeat one token
    _, out, err = launch("-m", "oiq_mlx.cli.generate", "--model", str(qwen2_folder), "--sharding", sharding, *CLI_ARGS,
                         cwd=ROOT)
    assert _generated(out) == text, err  # rank 0 alone printed, and the same text
    assert err.count("Generation: 12 tokens") == 1, err
    line = next(x for x in err.splitlines() if x.startswith("KV cache per rank"))
    found = re.search(rf"\({sharding} parallel over 2 ranks\): rank 0 ([\d.]+) MiB, rank 1 ([\d.]+) MiB; "
                      r"total ([\d.]+) MiB held", line)
    assert found, line
    rank0, rank1, total = (float(x) for x in found.groups())
    one_process = float(re.search(r"KV cache \(OIQ[^)]*\): ([\d.]+) MiB held", one.stderr).group(1))
    # tensor: half the heads each; pipeline: rank 0 runs the last 2 of the 3 layers
    assert abs(rank0 - (rank1 if sharding == "tensor" else 2 * rank1)) <= 0.011, line
    assert abs(total - (rank0 + rank1)) <= 0.011 and abs(total - one_process) <= 0.011, (line, one_process)


@loopback
def test_oiq_generate_on_two_ranks_refuses_a_model_whose_heads_do_not_divide(tmp_path):
    folder = write_model_folder(tmp_path / "llama3kv", "llama", n_kv_heads=3)
    _, out, err = launch("-m", "oiq_mlx.cli.generate", "--model", str(folder), "--prompt", "hi", cwd=ROOT)
    message = f"oiq-generate: error: {folder} (llama) has 6 query and 3 KV heads, which do not divide over 2 ranks"
    assert err.count(message) == 1, err  # from rank 0 only
    assert "Traceback" not in err and out.strip() == ""


# -- scripts/bench_sharded.py ------------------------------------------------------------


@loopback
def test_bench_sharded_reports_each_sharding_beside_one_process(tmp_path):
    path = tmp_path / "bench.json"
    _, out, err = launch(str(ROOT / "scripts" / "bench_sharded.py"), "--shape", "3,256,4,2,256", "--contexts", "96",
                         "--decode-steps", "2", "--warmup", "0", "--oiq-bits", "4", "--json", str(path), cwd=ROOT)
    assert path.is_file(), err
    runs = {(r["sharding"], r["cache"]): r for r in json.loads(path.read_text())["runs"]}
    assert set(runs) == {(s, c) for s in ("none", "tensor", "pipeline") for c in ("fp", "oiq-4bit")}
    for cache in ("fp", "oiq-4bit"):
        one = runs["none", cache]["kv_bytes"]
        # pipeline: rank 0 runs the last 2 of the 3 layers, rank 1 the first; the same arrays as one process
        pipeline = runs["pipeline", cache]["kv_bytes_per_rank"]
        assert sum(pipeline) == one and pipeline[0] == 2 * pipeline[1], (cache, pipeline, one)
        tensor = runs["tensor", cache]["kv_bytes_per_rank"]
        # tensor: half the heads per rank; OIQ ranks also keep each layer's whole sign vectors,
        # as stored (4bit is K5V3: keys and values are quantized in a pass each, so no
        # stacked copy of the signs)
        signs = 0 if cache == "fp" else 3 * (2 * 64 * 4)
        assert tensor == [(one + signs) // 2] * 2, (cache, tensor, one)
    assert out.count("| context | cache | ms/token 1 process | ms/token tensor x2 | ms/token pipeline x2 |") == 1, out
    assert sum(line.startswith("| 96 | ") for line in out.splitlines()) == 2


# -- oiq-server under mlx.launch ---------------------------------------------------------


SERVER_ARGS = ["--preset", "4bit", "--window", "16", "--sink-tokens", "2"]


@loopback
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_oiq_server_on_two_ranks_answers_as_one_process(qwen2_folder, tmp_path, sharding):
    """An HTTP completion from oiq-server sharded over 2 ranks equals the one-process server's."""
    prompt, n = TEXT[:300], 12
    args = ["--model", str(qwen2_folder), *SERVER_ARGS]
    with ServerProcess(args, log_path=tmp_path / "one.log", start_timeout=LAUNCH_TIMEOUT_S) as one:
        expected = complete(one.port, prompt, n)
    assert len(set(expected.text)) > 3, expected.text  # the random model does not repeat one token
    launcher = ["mlx.launch", "-n", "2", "--backend", "ring", "--starting-port", str(_free_ports()), "--"]
    extra = ["--pipeline"] if sharding == "pipeline" else []
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with ServerProcess([*args, *extra], log_path=tmp_path / "two.log", start_timeout=LAUNCH_TIMEOUT_S, env=env,
                       launcher=launcher) as two:
        got = complete(two.port, prompt, n)
        log = two.log()
    assert got.text == expected.text, log
    assert f"{sharding} parallel" in log and "rank 1 of 2" in log, log
    per_rank = re.search(r"KV cache per rank \(\w+ parallel over 2 ranks\): rank 0 ([\d.]+) MiB, rank 1 ([\d.]+) MiB; "
                         r"total ([\d.]+) MiB held", log)
    assert per_rank and log.count("KV cache per rank") == 1, log  # reported once, by rank 0
    rank0, rank1, total = (float(x) for x in per_rank.groups())
    assert rank0 > 0 and rank1 > 0 and abs(total - rank0 - rank1) <= 0.011, per_rank.group(0)
