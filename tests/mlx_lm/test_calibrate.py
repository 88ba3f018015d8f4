"""Per-layer bits calibrated on the prompt (oiq_mlx.mlx_lm.calibrate), the
``layer_bits=auto`` spec, the evaluation/sweep path and ``oiq-generate --layer-bits auto``."""

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import demo_path_or_skip, tiny_gemma3, tiny_llama

from oiq_mlx import OIQConfig
from oiq_mlx.eval import sweep as fidelity
from oiq_mlx.mlx_lm.calibrate import (
    allocate,
    calibrate_layer_bits,
    default_choices,
    layer_errors,
    min_tokens,
    parse_auto,
)
from oiq_mlx.eval.perplexity import perplexity_eval
from oiq_mlx.mlx_lm.caches import model_head_dim, oiq_layer_indices
from oiq_mlx.eval.specs import parse_spec

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(window=8, sink_tokens=2)  # min_tokens: 2 * (2 + 8 + 16) = 52
TOKENS = [(i * 37) % 128 for i in range(1, 120)]


def _model(layers=4, hard_layer=None):
    model = tiny_llama(layers=layers)
    if hard_layer is not None:
        # sharper scores on that layer only: the same relative key error moves its
        # attention much more, so at 2 bits it is by far the worst layer
        attn = model.model.layers[hard_layer].self_attn
        attn.k_proj.weight = attn.k_proj.weight * 100
        mx.eval(model.parameters())
    return model


# -- allocation -----------------------------------------------------------------------


def test_default_choices():
    assert default_choices(OIQConfig.preset("2bit")) == [(2, 2), (3, 3)]
    assert default_choices(OIQConfig.preset("3bit")) == [(2, 2), (3, 3), (4, 4)]
    assert default_choices(OIQConfig.preset("4bit")) == [(4, 2), (5, 3), (6, 4)]
    assert default_choices(OIQConfig(k_bits=4, v_bits=4)) == [(3, 3), (4, 4), (5, 5)]
    assert default_choices(OIQConfig(k_bits=2, v_bits=3)) == [(2, 3), (3, 4)]
    assert default_choices(OIQConfig(k_bits=6, v_bits=6)) == [(5, 5), (6, 6)]
    assert default_choices(OIQConfig.preset("1.5bit")) == [(2, 1), (3, 2)]  # a 1-bit side never steps down
    assert default_choices(OIQConfig(k_bits=1, v_bits=1)) == [(1, 1), (2, 2)]
    with pytest.raises(ValueError, match="K8V8; pass choices"):
        default_choices(OIQConfig(k_bits=8, v_bits=8))


def test_allocate_respects_the_budget_and_is_deterministic():
    rng = random.Random(0)
    costs = {(2, 2): 40.0, (3, 3): 56.0, (4, 4): 72.0}
    for trial in range(50):
        errors = {}
        for layer in range(rng.randint(1, 12)):
            e2 = rng.uniform(0.01, 1)
            e3 = e2 * rng.uniform(0.1, 1.1)  # sometimes worse than 2 bits: never chosen over it
            errors[layer] = {(2, 2): e2, (3, 3): e3, (4, 4): e3 * rng.uniform(0.1, 1)}
        budget = rng.uniform(40, 80)
        chosen = allocate(errors, costs, budget)
        assert chosen == allocate(dict(reversed(list(errors.items()))), costs, budget)
        n = len(errors)
        spent = sum(costs[b] for b in chosen.values())
        assert spent / n <= budget + 1e-9
        # nothing left that fits and helps
        for layer, bits in chosen.items():
            for other in costs:
                if costs[other] > costs[bits] and errors[layer][other] < errors[layer][bits]:
                    assert (spent + costs[other] - costs[bits]) / n > budget


def test_allocate_upgrades_the_best_gain_per_byte_first_ties_by_layer():
    costs = {(2, 2): 40.0, (3, 3): 56.0, (4, 4): 72.0}
    same = {(2, 2): 0.1, (3, 3): 0.05, (4, 4): 0.04}
    errors = {layer: dict(same) for layer in range(4)}
    # room for one step (16 bytes over 4 layers = 4 bytes of mean): the lowest index gets it
    assert allocate(errors, costs, 44) == {0: (3, 3), 1: (2, 2), 2: (2, 2), 3: (2, 2)}
    errors[2] = {(2, 2): 0.5, (3, 3): 0.1, (4, 4): 0.01}
    assert allocate(errors, costs, 44) == {0: (2, 2), 1: (2, 2), 2: (3, 3), 3: (2, 2)}
    # two steps: layer 2 again (0.09 removed for 16 bytes beats 0.05)
    assert allocate(errors, costs, 48) == {0: (2, 2), 1: (2, 2), 2: (4, 4), 3: (2, 2)}
    with pytest.raises(ValueError, match=r"budget 39 bytes per token is below the cheapest allocation \(40 "):
        allocate(errors, costs, 39)


# -- on a model ------------------------------------------------------------------------


def test_calibration_stays_within_the_budget_and_repeats():
    model = _model()
    head_dim, layers = model_head_dim(model), oiq_layer_indices(model)
    cfg = OIQConfig.preset("3bit", **SMALL)
    out = calibrate_layer_bits(model, TOKENS, cfg)
    assert out == calibrate_layer_bits(model, TOKENS, cfg)
    assert dataclasses.replace(out, layer_bits=()) == cfg
    assert out.bytes_per_token(head_dim, layers) <= cfg.bytes_per_token(head_dim)  # the preset's own 56
    assert all((k, v) != (3, 3) and (k, v) in default_choices(cfg) for _, k, v in out.layer_bits)
    # at 2 bits the preset's own budget leaves no room above K2V2
    assert calibrate_layer_bits(model, TOKENS, OIQConfig.preset("2bit", **SMALL)).layer_bits == ()
    for budget in (40, 45, 52.5, 60, 72):
        out = calibrate_layer_bits(model, TOKENS, OIQConfig.preset("2bit", **SMALL), budget=budget,
                                   choices=[(2, 2), (3, 3), (4, 4)])
        assert out.bytes_per_token(head_dim, layers) <= budget
    assert out.layer_bits == tuple((i, 4, 4) for i in layers)  # 72: everything fits


def test_the_hardest_layer_is_upgraded_first():
    cfg = OIQConfig.preset("2bit", **SMALL)
    plain = calibrate_layer_bits(_model(), TOKENS, cfg, budget=44)  # one K3V3 layer of 4
    assert len(plain.layer_bits) == 1 and plain.layer_bits[0][0] != 2
    model = _model(hard_layer=2)
    errors = layer_errors(model, TOKENS, cfg, [(2, 2), (3, 3)])
    assert max(errors, key=lambda i: errors[i][(2, 2)]) == 2
    assert calibrate_layer_bits(model, TOKENS, cfg, budget=44).layer_bits == ((2, 3, 3),)


def test_errors_name_the_numbers():
    model = _model()
    cfg = OIQConfig.preset("2bit", **SMALL)
    with pytest.raises(ValueError, match=r"budget 30 bytes per token is below the cheapest allocation \(40 bytes"):
        calibrate_layer_bits(model, TOKENS, cfg, budget=30)
    assert min_tokens(cfg) == 52
    with pytest.raises(ValueError, match=r"at least 52 tokens .*sink_tokens 2 \+ window 8 \+ 16\)\), got 51"):
        calibrate_layer_bits(model, TOKENS[:51], cfg)
    with pytest.raises(ValueError, match="no full-attention KVCache layers"):
        calibrate_layer_bits(tiny_gemma3(layers=2), TOKENS, cfg)
    with pytest.raises(ValueError, match="already has layer_bits"):
        calibrate_layer_bits(model, TOKENS, dataclasses.replace(cfg, layer_bits="1:3:3"))


# -- specs and the evaluation -------------------------------------------------------------


def test_parse_auto():
    assert parse_auto("auto") == (True, None)
    assert parse_auto("auto:39.5") == (True, 39.5)
    assert parse_auto("1:3:3") == (False, None)
    with pytest.raises(ValueError, match="budget 'x' is not a number"):
        parse_auto("auto:x")
    with pytest.raises(ValueError, match="positive"):
        parse_auto("auto:-1")


def test_auto_spec_round_trip_and_refusals():
    s = parse_spec("preset:2bit[group_size=64,layer_bits=auto:40]")
    assert (s.calibrate, s.calibrate_budget) == (True, 40.0)
    assert s.oiq == OIQConfig.preset("2bit", group_size=64)
    assert "within 40 bytes" in s.description
    assert parse_spec(s.name) == s
    s3 = parse_spec("preset:3bit[layer_bits=auto]")
    assert (s3.calibrate, s3.calibrate_budget, s3.oiq) == (True, None, OIQConfig.preset("3bit"))
    assert parse_spec("oiq[k_bits=3,v_bits=3,layer_bits=auto:50]").calibrate_budget == 50.0
    assert not parse_spec("preset:2bit[layer_bits=1:3:3]").calibrate
    with pytest.raises(ValueError, match=r"cache 'preset:2bit\[layer_bits=auto:x\]'.*not a number"):
        parse_spec("preset:2bit[layer_bits=auto:x]")
    model = _model()
    for call in (lambda: s.make_cache(model), lambda: s.bytes_per_token(64), s.server_args):
        with pytest.raises(ValueError, match=r"has layer_bits=auto: calibrate it on the prompt \(CacheSpec.for_prompt\)"):
            call()


def test_for_prompt_calibrates():
    model = _model()
    spec = parse_spec("preset:2bit[window=8,sink_tokens=2,layer_bits=auto:45]")
    cal = spec.for_prompt(model, TOKENS)
    assert not cal.calibrate and cal.name == spec.name
    assert cal.oiq == calibrate_layer_bits(model, TOKENS, spec.oiq, budget=45)
    assert cal.oiq.layer_bits  # 45 > 40 leaves room for one layer
    cache = cal.make_cache(model)
    assert [c.k.bits for c in cache] == [cal.oiq.bits_for_layer(i)[0] for i in range(4)]
    plain = parse_spec("preset:2bit")
    assert plain.for_prompt(model, TOKENS) is plain


def test_sweep_calibrates_each_window():
    model = _model()
    tokens = mx.random.randint(0, 128, (2 * 129,), key=mx.random.key(4)).tolist()
    specs = [parse_spec(s) for s in ("preset:2bit[window=8,sink_tokens=2]",
                                     "preset:2bit[window=8,sink_tokens=2,layer_bits=auto:46]")]
    res = perplexity_eval(model, tokens, [parse_spec("fp")] + specs, prompt_len=96, score_len=32, chunk=16,
                          windows=2)
    lbs = res[specs[1].name]["layer_bits"]
    assert len(lbs) == 2
    for w, lb in enumerate(lbs):
        prompt = tokens[w * 129: w * 129 + 96]
        assert [tuple(x) for x in lb] == list(calibrate_layer_bits(model, prompt, specs[1].oiq, budget=46).layer_bits)
    assert "layer_bits" not in res[specs[0].name]
    rows = fidelity.sweep(model, tokens, specs, prompt_len=96, score_len=32, chunk=16, windows=2)
    assert rows[1]["bytes_per_token"] == 40 and rows[1]["layer_bits"] == [[], []]
    expect = [dataclasses.replace(specs[1].oiq, layer_bits=lb).bytes_per_token(64, range(4)) for lb in lbs]
    assert rows[2]["layer_bits"] == lbs and rows[2]["bytes_per_token"] == pytest.approx(sum(expect) / 2)
    assert 40 < rows[2]["bytes_per_token"] <= 46
    # the calibrated layers hold more bytes than the uniform cache after the same calls
    assert rows[2]["bytes_allocated"] > rows[1]["bytes_allocated"]


# -- oiq-generate --layer-bits auto --------------------------------------------------------


def _cli(*args):
    r = subprocess.run([sys.executable, "-m", "oiq_mlx.cli.generate", *args], capture_output=True, cwd=ROOT)
    return r.returncode, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")


def test_cli_auto_refusals_before_loading_a_model():
    rc, _, err = _cli("--layer-bits", "auto", "--no-oiq", "-p", "hi")
    assert rc == 2 and "oiq-generate: error: --layer-bits auto does not apply with --no-oiq" in err, err
    rc, _, err = _cli("--layer-bits", "auto:zero", "-p", "hi")
    assert rc == 2 and "budget 'zero' is not a number" in err and "Traceback" not in err, err


def test_cli_config_keeps_auto_out_of_the_config():
    from oiq_mlx.cli.generate import build_parser
    from oiq_mlx.cli.options import config_from_args

    args = build_parser().parse_args(["--preset", "2bit", "--layer-bits", "auto:44"])
    assert parse_auto(args.layer_bits) == (True, 44.0)
    assert config_from_args(args, allow_auto=True) == OIQConfig.preset("2bit")
    with pytest.raises(ValueError, match="oiq-generate only, without --prompt-cache-file"):
        config_from_args(args)  # oiq-cache-prompt, and the check against a loaded cache file


@pytest.mark.slow
def test_cli_layer_bits_auto_end_to_end():
    demo_path_or_skip()
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle on the beach. " * 2
    rc, out, err = _cli("--preset", "2bit", "--window", "8", "--sink-tokens", "2", "--layer-bits", "auto:41",
                        "-m", "2", "-p", prompt)
    assert rc == 0, err
    line = [x for x in err.splitlines() if x.startswith("layer bits calibrated on the ")]
    assert len(line) == 1 and "(budget 41)" in line[0], err
    chosen = line[0].split(": ", 1)[1].split(";")[0]
    assert chosen != "none (uniform)" and chosen.count(":K3V3") >= 1, line
    assert (f"KV cache (OIQ K2V2 g32, layers {chosen}, preset 2bit with sink_tokens=2, window=8, "
            "layer_bits=auto:41)") in err, err
    rc, _, err = _cli("--preset", "2bit", "--layer-bits", "auto", "-m", "1", "-p", "hi")
    need = 2 * (4 + OIQConfig.preset("2bit").window + 16)
    assert rc == 2 and f"--layer-bits auto: calibrating layer_bits needs a prompt of at least {need} tokens" in err, err
