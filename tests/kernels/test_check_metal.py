"""scripts/check_metal.py's checks (oiq_mlx.bench.metal_check) on the CPU Metal emulator: a sample of
the reduced grid's kinds passes with the real kernels, asserting what each claims to exercise
(CI runs the whole grid through the script itself after the suite), and fails, a row per broken check
with a FAIL verdict, when a kernel packs rows wrong or ignores a mask."""

import mlx.core as mx
import pytest

from metal_emu import use_emulator
from oiq_mlx.bench import metal_check as check
from oiq_mlx.kernels import dispatch, launcher, selftest
from oiq_mlx.kernels import quantize as quantize_kernels
from oiq_mlx.kernels import decode_attention as attention_kernels


@pytest.fixture
def kernels(monkeypatch):
    """Kernels on the emulator, as on a Mac (check.reference_path switches them off)."""
    use_emulator(monkeypatch)
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: True)
    monkeypatch.setenv("OIQ_MLX_KERNELS", "kernels")


def _run(names=None):
    picked = [(n, fn) for n, fn in check.checks(check.QUICK) if names is None or n in names]
    assert names is None or len(picked) == len(names), [n for n, _ in picked]
    with selftest.trusted():
        return [check.isolated(n, fn) for n, fn in picked]


# a sample of the kinds (codec, both write paths, decode inside and past the window, sinks with a
# verify block, trim, a ragged batch); DECODE passes in test_a_kernel_that_ignores_the_mask_fails,
# and CI runs the whole --quick grid through the script itself after the suite
# (tests/check_metal_on_emulator.py, .ci/run)
SAMPLE = ["codec d=64 5b g32 float16", "write 4bit [preset] d=64 float16 T=200",
          "write 2bit [clip=False] d=64 float16 T=200", "decode 3bit d=64 T=40 B=2 float16",
          "decode 4bit d=64 T=200 after trim", "decode 4bit d=64 T=200 sinks, verify L=4",
          "ragged batch 4bit d=64 T=(25, 50, 100, 200)"]


def test_the_quick_grid_has_every_kind_of_check():
    names = [n for n, _ in check.checks(check.QUICK)]
    for kind in ("codec", "write", "decode", "verify L=4 causal", "bool mask", "additive mask", "sinks",
                 "after trim", "after save/load", "ragged batch"):
        assert any(kind in n for n in names), kind
    assert {p for p in check.PRESETS if any(n.startswith(f"write {p}") for n in names)} == set(check.PRESETS)


def test_the_quick_grid_passes_on_the_real_kernels(kernels):
    rows = _run(SAMPLE)
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    # packed rows exist where the context passes the window, and the kernels agree with the reference
    assert all(" 0 packed rows" not in r["detail"] for r in rows if "T=200" in r["check"])
    ok, line = check.verdict([], rows)
    assert ok and line == f"check_metal: PASS: {len(rows)} checks, 0 kernel instantiations compiled"


WRITE = "write 4bit [preset] d=64 float16 T=200"
DECODE = "decode 3bit d=64 T=200 B=1 bfloat16"
VERIFY = "decode 4bit d=64 T=200 verify L=4 causal"


def _wrap(monkeypatch, build, change):
    """Every launch of the kernel ``build()`` returns has its outputs passed through ``change``."""
    target, real = build(), launcher.launch

    def launch(kernel, **kwargs):
        if kernel is target:
            return change(real(kernel, **kwargs), kwargs)
        return real(kernel, **kwargs)

    monkeypatch.setattr(launcher, "launch", launch)


def test_a_kernel_that_packs_rows_wrong_fails(kernels, monkeypatch):
    # one bit of every packed row's first code word flipped
    _wrap(monkeypatch, quantize_kernels._kernel, lambda outs, _: [outs[0] ^ 1, *outs[1:]])
    rows = {r["check"]: r for r in _run([WRITE, DECODE])}
    assert not rows[WRITE]["ok"] and "stored values differ" in rows[WRITE]["detail"], rows[WRITE]
    # decode reads what was stored, through both paths alike: the write check is the one that sees it
    assert rows[DECODE]["ok"], rows[DECODE]
    ok, line = check.verdict([], list(rows.values()))
    assert not ok and line.startswith("check_metal: FAIL: 1 of 2 checks failed (first: write 4bit")


def test_a_kernel_that_ignores_the_mask_fails(kernels, monkeypatch):
    def no_mask(kwargs):
        params = kwargs["inputs"][-1]
        kwargs["inputs"][-1] = mx.concatenate([params[:11], mx.zeros((1,), mx.int32), params[12:]])  # mode: none
        return kwargs

    target, real = attention_kernels._attention_kernel(), launcher.launch
    monkeypatch.setattr(launcher, "launch",
                        lambda kernel, **kw: real(kernel, **(no_mask(kw) if kernel is target else kw)))
    rows = {r["check"]: r for r in _run([VERIFY, DECODE])}
    assert not rows[VERIFY]["ok"] and "vs reference" in rows[VERIFY]["detail"], rows[VERIFY]
    assert rows[DECODE]["ok"], rows[DECODE]  # one query row: no mask to ignore


def test_a_check_that_raises_is_a_row_and_the_report_goes_on(kernels, monkeypatch):
    def broken(kernel, **kwargs):
        raise RuntimeError("command buffer aborted")

    monkeypatch.setattr(launcher, "launch", broken)
    rows = _run([WRITE, DECODE])
    assert [r["ok"] for r in rows] == [False, False]
    assert all("RuntimeError: command buffer aborted" in r["detail"] for r in rows)
    text = check.report([], rows)
    assert text.splitlines()[0].startswith("check_metal: FAIL: 2 of 2 checks failed")
    assert text.count("| FAIL |") == 2


def test_a_check_that_falls_back_to_the_reference_fails(kernels, monkeypatch):
    """A check cannot pass on the reference path: a dispatch that declines the kernels fails it."""
    monkeypatch.setattr(dispatch, "kernels_enabled", lambda: False)
    (row,) = _run([DECODE])
    assert not row["ok"] and "the reference path served the call" in row["detail"], row


def test_the_full_grid_covers_what_users_run():
    names = [n for n, _ in check.checks(check.FULL)]
    assert any("T=65536" in n for n in names) and any("T=40 " in n for n in names)
    for d in (64, 128, 256):
        assert any(f"d={d}" in n and n.startswith("decode") for n in names)
    for preset in check.PRESETS:
        for opt in check.WRITE_OPTIONS:
            text = ", ".join(f"{k}={v}" for k, v in opt.items()) or "preset"
            assert any(n.startswith(f"write {preset} [{text}]") for n in names), (preset, text)
        assert any(n.startswith(f"ragged batch {preset}") for n in names)
    assert check.FULL.speed_contexts[0] == 1024 and check.FULL.speed_contexts[-1] == 65536
