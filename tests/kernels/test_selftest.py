"""The first-use self-test of the kernels (oiq_mlx/kernels/selftest.py), on the CPU Metal emulator:
real kernels pass and their verdicts are kept on disk; a kernel giving wrong values, or raising at
launch, gives one warning naming it and the reference path from then on (same output as
``OIQ_MLX_FORCE_REFERENCE=1``, no exception); ``OIQ_MLX_KERNELS`` picks either path.

Metal is pretended (``mx.metal.is_available`` and ``mx.default_device`` patched, as
test_kernels.py's dispatch tests do), so the real ``dispatch.kernels_enabled`` decides, and
launches go through the emulator.  Each test keeps its verdicts in its own tmp folder.
"""

import json
import warnings

import mlx.core as mx
import pytest

from metal_emu import use_emulator
from oiq_mlx.bench import metal_check
from oiq_mlx.cache import attention
from oiq_mlx.cache.sequence import OIQKVCache
from oiq_mlx.core import codec, rotation
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.kernels import decode_attention, dispatch, launcher, selftest, source

D = 64
CFG = OIQConfig(k_bits=4, v_bits=4, group_size=32, sink_tokens=4, window=16)


@pytest.fixture
def metal(monkeypatch, tmp_path):
    """Pretend Metal, run kernels on the emulator, keep verdicts in tmp_path; returns the list of
    kernels launched (each launch appends its kernel)."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setenv(selftest.DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv(selftest.MODE_VARIABLE, raising=False)
    monkeypatch.delenv("OIQ_MLX_FORCE_REFERENCE", raising=False)
    emulated = use_emulator(monkeypatch)
    launched = []

    def counting(kernel, **kwargs):
        launched.append(kernel)
        return emulated(kernel, **kwargs)

    monkeypatch.setattr(launcher, "launch", counting)
    selftest.clear()
    yield launched
    selftest.clear()


def _cache_and_queries(seed=0):
    """A cache of 40 tokens (4 sinks, packed rows, a window) after a prompt and one step, and a
    step's queries (two per KV head)."""
    cache = OIQKVCache(CFG)
    k = mx.random.normal((1, 2, 40, D), key=mx.random.key(seed)).astype(mx.float16)
    v = mx.random.normal((1, 2, 40, D), key=mx.random.key(seed + 1)).astype(mx.float16)
    cache.update_and_fetch(k[:, :, :39], v[:, :, :39])
    cache.end_prefill()
    cache.update_and_fetch(k[:, :, 39:], v[:, :, 39:])
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(seed + 2)).astype(mx.float16)
    return cache, q


def _step(seed=0):
    cache, q = _cache_and_queries(seed)
    out = attention.oiq_attention(q, cache, D ** -0.5)
    mx.eval(out)
    return out


def _reference_step(monkeypatch, seed=0):
    with monkeypatch.context() as m:
        m.setenv("OIQ_MLX_FORCE_REFERENCE", "1")
        return _step(seed)


def _selftest_warnings(records):
    return [str(r.message) for r in records if "self-test" in str(r.message)]


def test_real_kernels_pass_and_the_verdict_is_kept_on_disk(metal, monkeypatch):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        out = _step()
    assert _selftest_warnings(records) == []
    first = len(metal)
    assert decode_attention._merge_kernel() in metal  # the kernels served the step
    verdicts = json.loads(selftest.cache_path().read_text())["verdicts"]
    assert f"oiq_quantize[T=float16,D={D},ROWS=4]" in verdicts
    assert any(c.startswith(f"oiq_decode_attention[FT=float16,D={D},QB=2,TGP=4]+oiq_decode_merge[OutT=float16")
               for c in verdicts)
    assert all(why is None for why in verdicts.values())
    assert mx.allclose(out, _reference_step(monkeypatch), atol=1e-2)

    # a new process: the verdicts come from disk, nothing is launched to test again
    selftest.clear()
    metal.clear()
    again = _step()
    assert len(metal) < first and mx.array_equal(again, out)
    metal.clear()
    assert selftest.quantize_ok(mx.float16, D) and selftest.attention_ok(mx.float16, D, 2, mx.float16)
    assert metal == []


def _corrupting(kernel_to_break, monkeypatch):
    """Make ``kernel_to_break`` give wrong values (its first output plus one where it is float,
    a flipped low bit where it is uint32): a kernel the toolchain built wrong."""
    real = launcher.launch

    def broken(kernel, **kwargs):
        outs = real(kernel, **kwargs)
        if kernel is not kernel_to_break():
            return outs
        first = outs[0] ^ 1 if outs[0].dtype == mx.uint32 else outs[0] + 1
        return [first, *outs[1:]]

    monkeypatch.setattr(launcher, "launch", broken)


@pytest.mark.parametrize("kernel", ["merge", "quantize"])
def test_a_wrong_kernel_warns_once_and_the_reference_serves(metal, monkeypatch, kernel):
    from oiq_mlx.kernels import quantize as kernel_quantize

    want = _reference_step(monkeypatch)
    _corrupting({"merge": decode_attention._merge_kernel, "quantize": kernel_quantize._kernel}[kernel],
                monkeypatch)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        out = _step()
        _step(seed=5)  # later steps: no second warning
    said = _selftest_warnings(records)
    assert len(said) == 1, said
    assert {"merge": "oiq_decode_merge[OutT=float16", "quantize": "oiq_quantize[T=float16"}[kernel] in said[0]
    assert "reference path" in said[0] and "\n" not in said[0]
    assert mx.array_equal(out, want)  # the reference path's output, bit for bit

    # every kernel declines from then on: nothing launches
    metal.clear()
    x = mx.random.normal((3, D))
    assert mx.array_equal(dispatch.quantize(x, 4, 32)[0], codec.quantize(x, 4, 32)[0])
    assert metal == []

    # a new process reads the failure from disk: the same warning at once, nothing launched
    selftest.clear()
    with pytest.warns(RuntimeWarning, match="failed its self-test.*delete it to test again"):
        assert not selftest.dequantize_ok(mx.float32, D)
    assert metal == []


# Metal source edits that break decode attention (from test_kernels.py's MUTATIONS): a wrong
# result at two query positions, a kernel reading the padding of a stacked batch, a sink logit not
# following the centered keys, and a kernel that does not compile when the placeholders of a
# cache without packed rows are bound ``constant`` (the emulator's address spaces, as Metal's)
MUTATIONS = {
    "causal mask off by one": ("decode_attention.metal", "s = tj <= T - L + qpos[i] ? s : -INFINITY;",
                               "s = tj < T - L + qpos[i] ? s : -INFINITY;"),
    "batch ranges ignored": ("decode_attention.metal", "if (params[16] != 0) {", "if (false) {"),
    "sink logit moved the wrong way": ("decode_merge.metal", "sink -= part_shift[z * qb + i];",
                                       "sink += part_shift[z * qb + i];"),
    "device pointer in oiq_unpack": ("oiq_common.h", "template <int E, typename P>\nMETAL_FUNC void oiq_unpack(P words",
                                     "template <int E>\nMETAL_FUNC void oiq_unpack(const device uint32_t* words"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_mutated_kernel_source_fails_its_self_test(metal, monkeypatch, mutation):
    """A kernel built from other (broken) sources is tested afresh, its verdict kept apart from
    the real sources' pass, and fails with one warning naming it."""
    file, old, new = MUTATIONS[mutation]
    assert selftest.attention_ok(mx.float16, D, 2, mx.float16)  # the real sources pass
    passed = selftest.cache_path()
    original = source.metal_source
    assert original(file).count(old) == 1, f"{mutation}: the mutated text is not in {file}"
    monkeypatch.setattr(source, "metal_source", lambda name: original(name).replace(old, new) if name == file
                        else original(name))
    source.build_kernel.cache_clear()
    try:
        selftest.clear()
        assert selftest.cache_path() != passed  # other sources, other verdicts
        with pytest.warns(RuntimeWarning, match=r"oiq_decode_attention\[FT=float16,D=64,QB=2,TGP=4\]\+oiq_decode_merge"
                                                r"\[OutT=float16,D=64\] failed its self-test"):
            assert not selftest.attention_ok(mx.float16, D, 2, mx.float16)
    finally:
        source.build_kernel.cache_clear()


def test_a_kernel_raising_at_launch_warns_and_the_reference_serves(metal, monkeypatch):
    def failing(kernel, **kwargs):
        raise RuntimeError("[metal::Device] Unable to build metal library from source\nerror: ...")

    monkeypatch.setattr(launcher, "launch", failing)
    x = mx.random.normal((2, 3, D)).astype(mx.bfloat16)
    signs = rotation.random_signs(seed=1, dim=D)
    with pytest.warns(RuntimeWarning, match=r"oiq_quantize\[T=bfloat16,D=64,ROWS=4\] failed its self-test: "
                                            r"RuntimeError: \[metal::Device\] Unable to build"):
        codes, scales = dispatch.quantize(x, 4, 32, signs=signs)
    want = codec.quantize(rotation.rotate(x, signs), 4, 32)
    assert mx.array_equal(codes, want[0]) and mx.array_equal(scales, want[1])


def test_the_environment_variable_picks_the_path(metal, monkeypatch):
    monkeypatch.setenv(selftest.MODE_VARIABLE, "reference")
    assert not dispatch.kernels_enabled()
    x = mx.random.normal((3, D))
    dispatch.quantize(x, 4, 32)
    assert metal == [] and not selftest.cache_path().exists()

    # kernels: no self-test, the call's launch only
    monkeypatch.setenv(selftest.MODE_VARIABLE, "kernels")
    assert dispatch.kernels_enabled()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        codes, _ = dispatch.quantize(x, 4, 32)
    assert _selftest_warnings(records) == [] and len(metal) == 1 and not selftest.cache_path().exists()
    assert mx.array_equal(codes, codec.quantize(x, 4, 32)[0])

    # auto (and an unknown value, which says so): the self-test runs and its verdict is kept
    monkeypatch.setenv(selftest.MODE_VARIABLE, "fast")
    with pytest.warns(RuntimeWarning, match="OIQ_MLX_KERNELS='fast' is not one of auto, reference, kernels"):
        assert selftest.mode() == "auto"
    monkeypatch.setenv(selftest.MODE_VARIABLE, "auto")
    metal.clear()
    dispatch.quantize(x, 4, 32)
    assert len(metal) > 1  # the self-test's launches, then the call's
    metal.clear()
    dispatch.quantize(x, 4, 32)
    assert len(metal) == 1
    assert json.loads(selftest.cache_path().read_text())["verdicts"] == {f"oiq_quantize[T=float32,D={D},ROWS=4]": None}


def test_trusted_skips_the_self_test(metal, monkeypatch):
    """What bench.trace runs in: its launcher returns placeholders, which a self-test would reject."""
    monkeypatch.setattr(launcher, "launch", lambda kernel, **kwargs: pytest.fail("nothing should launch"))
    with selftest.trusted():
        assert selftest.quantize_ok(mx.float16, D) and selftest.attention_ok(mx.float16, D, 1, mx.float16)
    assert not selftest.cache_path().exists()


def test_a_first_use_while_tracing_tests_as_usual(metal, tmp_path):
    """A first use inside ``mx.compile`` or ``mx.export_function`` (a traced decode step): the
    self-test evaluates only its own arrays, which tracing allows, and the trace completes."""
    verdicts = []

    def step(x):
        verdicts.append(selftest.quantize_ok(mx.float16, D))
        return x * 2

    assert mx.compile(step)(mx.array(1.0)).item() == 2.0
    selftest.clear()
    selftest.cache_path().unlink()
    mx.export_function(str(tmp_path / "step.mlxfn"), step, mx.array(1.0))
    assert verdicts == [True, True] and len(metal) > 2  # tested twice: once per trace


def test_check_metal_reports_the_self_test(metal, monkeypatch):
    """scripts/check_metal.py runs each instantiation's self-test afresh (nothing read or kept)
    and reports failures by name: on a Mac, the check of the self-test itself."""
    picks = [("oiq_quantize", (("T", mx.float16), ("D", D), ("ROWS", 4))),
             ("oiq_decode_merge", (("OutT", mx.bfloat16), ("D", D)))]
    rows = metal_check.check_selftest(picks)
    assert rows == [{"instantiation": f"oiq_quantize[T=float16,D={D},ROWS=4]", "error": None},
                    {"instantiation": f"oiq_decode_attention[FT=bfloat16,D={D},QB=1,TGP=4]+oiq_decode_merge"
                                      f"[OutT=bfloat16,D={D}]", "error": None}]
    _corrupting(decode_attention._merge_kernel, monkeypatch)
    broken = metal_check.check_selftest(picks)
    assert broken[0]["error"] is None and "attention output off the reference" in broken[1]["error"]
    text = metal_check.report([], [], selftests=broken)
    assert "first-use self-test: 1 of 2 passed" in text and "- oiq_decode_attention[FT=bfloat16" in text
    assert not selftest.cache_path().exists()
