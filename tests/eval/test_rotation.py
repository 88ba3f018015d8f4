"""The calibrated-rotation probe (oiq_mlx.eval.rotation): Procrustes toward hypercube corners, the
exact fold of a value rotation into v_proj / o_proj, and the packed-row errors it reports."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from oiq_mlx.core import codec
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.eval import rotation
from oiq_mlx.eval.sweep import tiny_qwen2


def _random_orthogonal(d, rng):
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def test_procrustes_moves_rows_toward_the_corners_at_every_step():
    """Each alternation cannot raise ||X R - sign(X R)|| (normalized rows): the objective falls
    from the identity's, and R stays orthogonal."""
    rng = np.random.default_rng(0)
    d = 32
    corners = np.where(rng.standard_normal((400, d)) >= 0, 1.0, -1.0)
    x = corners @ _random_orthogonal(d, rng).T * rng.uniform(0.5, 2.0, (400, 1))
    xn = x / np.linalg.norm(x, axis=1, keepdims=True) * np.sqrt(d)

    def objective(r):
        y = xn @ r
        return float(np.sum((y - np.where(y >= 0, 1.0, -1.0)) ** 2))

    values = [objective(rotation.procrustes(x, iters=n)) for n in (0, 1, 2, 5, 20, 40)]
    assert all(b <= a + 1e-6 for a, b in zip(values, values[1:])), values
    assert values[-1] < 0.8 * values[0]
    r = rotation.procrustes(x)
    assert np.allclose(r @ r.T, np.eye(d), atol=1e-9)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_qwen2(layers=2, seed=3)
    tokens = mx.random.randint(0, 256, (160,), key=mx.random.key(5)).tolist()
    return model, tokens


def test_fold_keeps_the_model_and_moves_the_values_into_the_calibrated_domain(tiny):
    model, tokens = tiny
    cfg = OIQConfig.preset("2bit")
    ids = mx.array(tokens)[None]
    logits = model(ids)
    before = rotation.packed_rows(model, tokens, cfg)
    assert "bias" in model.model.layers[0].self_attn.v_proj  # qwen2: the bias is folded too
    saved = [(l.self_attn.v_proj.weight, l.self_attn.v_proj.bias, l.self_attn.o_proj.weight)
             for l in model.model.layers]
    try:
        assert rotation.fold_value_rotations(model, before) == 2
        after_logits = model(ids)
        assert mx.allclose(after_logits, logits, atol=2e-4, rtol=2e-4).item()
        after = rotation.packed_rows(model, tokens, cfg)
        for layer in range(2):
            x, _ = before[(layer, "v")]
            y, _ = after[(layer, "v")]
            for h in range(x.shape[0]):
                assert np.allclose(y[h], x[h] @ rotation.procrustes(x[h]), atol=2e-3)
            kx, _ = before[(layer, "k")]
            ky, _ = after[(layer, "k")]
            assert np.allclose(kx, ky, atol=1e-5)  # keys untouched
    finally:
        for l, (wv, bv, wo) in zip(model.model.layers, saved):
            l.self_attn.v_proj.weight, l.self_attn.v_proj.bias, l.self_attn.o_proj.weight = wv, bv, wo


def test_packed_errors_reports_every_side_and_rotation(tiny):
    model, tokens = tiny
    cfg = OIQConfig.preset("2bit")
    rows = rotation.packed_rows(model, tokens, cfg)
    result = rotation.packed_errors(rows, rows, cfg, eval_from=32, online=64)
    for key in ("errors", "block_errors"):
        assert set(result[key]) == {"keys", "values"}
        for side in result[key].values():
            assert set(side) == {"hadamard", "calibration text", "own first rows"}
            assert all(0 < e < (1 if key == "errors" else 64) for e in side.values())
    # learned on the very rows it is measured on (calibration text = the same text), R fits them
    assert result["errors"]["values"]["calibration text"] < result["errors"]["values"]["hadamard"]
    table = rotation.errors_table(result)
    assert table.count("\n") == 5 and "| values | error of 64-row means |" in table


def test_block_error_tells_independent_errors_from_shared_ones():
    rng = np.random.default_rng(1)
    cfg = OIQConfig.preset("2bit")
    _, independent = rotation.quant_error(rng.standard_normal((640, 64)), 2, cfg, "v")
    _, shared = rotation.quant_error(np.tile(rng.standard_normal((1, 64)), (640, 1)), 2, cfg, "v")
    assert 0.7 < independent < 1.4
    assert shared == pytest.approx(64.0)


def test_fold_refuses_quantized_projections():
    model = tiny_qwen2(layers=1, seed=4)
    nn.quantize(model, group_size=64, bits=4)
    rows = rotation.packed_rows(model, list(range(40)), OIQConfig.preset("2bit"))
    with pytest.raises(ValueError, match="dense v_proj"):
        rotation.fold_value_rotations(model, rows)


def test_quant_error_quantizes_each_side_as_the_cache_does():
    """Keys take the config's key alignment (half way in 2bit-ppl), values the aligned scale."""
    x = np.random.default_rng(2).standard_normal((64, 64))
    cfg = OIQConfig.preset("2bit-ppl")

    def error(align):
        codes, scales = codec.quantize(mx.array(x.astype(np.float32)), 2, 32, clip=True, align=align)
        return float(((x - np.array(codec.dequantize(codes, scales, bits=2, group_size=32))) ** 2).sum())

    assert rotation.quant_error(x, 2, cfg, "k")[0] == pytest.approx(error(0.5), rel=1e-6)
    assert rotation.quant_error(x, 2, cfg, "v")[0] == pytest.approx(error(1.0), rel=1e-6)
    assert error(0.5) != pytest.approx(error(1.0), rel=1e-3)
    with pytest.raises(ValueError, match="side"):
        rotation.quant_error(x, 2, cfg, "keys")
