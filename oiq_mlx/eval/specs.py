"""The one registry of KV cache configurations, shared by the evaluation
(``eval_quality.py``), the fidelity sweep (``fidelity_sweep.py``), the latency
benchmark (``bench_latency.py``) and the server benchmark (``bench_server.py``).

A configuration is named by text that :func:`parse_spec` reads:

* ``fp``: mlx-lm ``KVCache`` at the model's dtype;
* ``fp16``: mlx-lm ``KVCache`` holding keys and values rounded to float16 (what a
  float16 model's cache holds on a Mac), attention at the model's dtype: on a
  float32 model it measures what float16 storage alone changes;
* ``mlx:B`` / ``mlx:B:G``: mlx-lm's affine ``QuantizedKVCache``, B bits, group
  G (default 64, mlx-lm's);
* ``preset:NAME`` / ``preset:NAME[field=value,...]``: ``OIQConfig.preset(NAME)``
  with fields replaced;
* ``oiq[field=value,...]``: ``OIQConfig(field=value, ...)``;
* in either bracket, ``layer_bits=auto`` or ``layer_bits=auto:BUDGET``: per-layer
  bits calibrated on each prompt (:mod:`oiq_mlx.mlx_lm.calibrate`) within the config's
  own bytes per token or BUDGET; such a spec makes caches only after
  :meth:`CacheSpec.for_prompt`;
* the named entries of :func:`cache_registry` (``mlx-q4-g64``, ``oiq-4``,
  ``oiq-plain-3``, ``absmax-4``, ...), and ``mlx-qB`` / ``oiq-Nbit``, the
  names ``bench_latency.py`` has always printed (group 64; preset ``Nbit``).

A list of them on a command line is split by :func:`split_spec_list`; the numbers the scripts take
as lists (lengths, depths, bits) by :func:`parse_ints` and :func:`parse_floats`.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..core.config import PRESETS, OIQConfig
from ..mlx_lm.caches import make_oiq_cache

FP16_BYTES = 2
MLX_GROUP_SIZE = 64  # mlx-lm's QuantizedKVCache default


class Float16KVCache(KVCache):
    """mlx-lm's ``KVCache`` storing keys and values as float16 and returning them at the
    dtype they arrived in (the ``fp16`` configuration)."""

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
        return k.astype(keys.dtype), v.astype(values.dtype)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One cache configuration.

    ``kind`` is ``"fp"`` (mlx-lm ``KVCache`` at the model dtype), ``"fp16"``
    (:class:`Float16KVCache`), ``"mlx"``
    (mlx-lm ``QuantizedKVCache(group_size, bits)``, affine) or ``"oiq"``
    (:class:`OIQKVCache` with ``oiq``).

    ``calibrate``: the ``oiq`` config's ``layer_bits`` are to be chosen on the
    prompt (``layer_bits=auto``), within ``calibrate_budget`` bytes per token
    per KV head (None: the config's own); :meth:`for_prompt` does it, and
    :meth:`make_cache` refuses until then.
    """

    name: str
    kind: str
    bits: int = 16
    group_size: int = 0
    oiq: OIQConfig | None = None
    description: str = ""
    calibrate: bool = False
    calibrate_budget: float | None = None

    def for_prompt(self, model, tokens) -> "CacheSpec":
        """This spec with ``layer_bits`` calibrated on the prompt ``tokens``
        (:func:`oiq_mlx.mlx_lm.calibrate.calibrate_layer_bits`); itself when no
        calibration was asked for."""
        if not self.calibrate:
            return self
        from ..mlx_lm.calibrate import calibrate_layer_bits

        cfg = calibrate_layer_bits(model, tokens, self.oiq, budget=self.calibrate_budget)
        return dataclasses.replace(self, oiq=cfg, calibrate=False)

    def _check_calibrated(self, what: str):
        if self.calibrate:
            raise ValueError(f"cache {self.name!r} has layer_bits=auto: calibrate it on the prompt "
                             f"(CacheSpec.for_prompt) before {what}")

    def make_cache(self, model) -> list:
        """A fresh prompt cache for ``model``, quantized from token 0 for ``mlx``
        (as ``generate_step`` with ``quantized_kv_start=0``); layers other than
        plain ``KVCache`` (sliding-window, SSM) stay mlx-lm's own for every kind.
        ``ValueError`` for a ``layer_bits=auto`` spec not calibrated yet."""
        self._check_calibrated("making a cache")
        if self.kind == "fp":
            return make_prompt_cache(model)
        if self.kind == "fp16":
            return [Float16KVCache() if type(c) is KVCache else c for c in make_prompt_cache(model)]
        if self.kind == "mlx":
            return [
                c.to_quantized(group_size=self.group_size, bits=self.bits) if type(c) is KVCache else c
                for c in make_prompt_cache(model)
            ]
        if self.kind == "oiq":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return make_oiq_cache(model, self.oiq)
        raise ValueError(f"unknown cache kind {self.kind!r}")

    def bytes_per_token(self, head_dim: int, layers=None) -> float:
        """Bytes of quantized storage per token per KV head, keys and values together,
        counting every float as fp16 (2 bytes): what the cache costs per token once the
        context is long.  What a cache allocates at a given length (sinks, window,
        reserve, means, spare capacity) is measured, not computed: its ``nbytes``
        (:func:`oiq_mlx.eval.perplexity.allocated_bytes_per_token`).  ``layers``: the
        model's OIQ layer indices, needed (and averaged over) when the config has
        ``layer_bits``.  ``ValueError`` for a ``layer_bits=auto`` spec not
        calibrated yet (its bytes depend on the prompt).
        """
        self._check_calibrated("counting its bytes")
        if self.kind in ("fp", "fp16"):
            return 2 * head_dim * FP16_BYTES
        if self.kind == "mlx":
            groups = -(-head_dim // self.group_size)
            return 2 * (head_dim * self.bits / 8 + 2 * groups * FP16_BYTES)
        return self.oiq.bytes_per_token(head_dim, layers)

    def supports(self, head_dim: int) -> str | None:
        """None when this cache can hold heads of ``head_dim``, else why not."""
        if self.kind == "mlx" and head_dim % self.group_size:
            return f"group {self.group_size} does not divide head_dim {head_dim}"
        if self.kind == "oiq":
            try:
                self.oiq.storage_dim(head_dim)
            except ValueError as e:
                return str(e)
        return None

    def server_args(self) -> list[str]:
        """The ``oiq-server`` flags that serve this configuration: ``--no-oiq``
        (fp), ``--no-oiq --kv-bits B --kv-group-size G --quantized-kv-start 0``
        (mlx: quantized from the first token, not mlx-lm's default 5000), or
        every OIQ field as its flag."""
        self._check_calibrated("serving it")
        if self.kind == "fp16":
            raise ValueError(f"cache {self.name!r}: oiq-server has no flag for float16 storage under another "
                             "model dtype (serve the model in float16 with --no-oiq instead)")
        if self.kind == "fp":
            return ["--no-oiq"]
        if self.kind == "mlx":
            return ["--no-oiq", "--kv-bits", str(self.bits), "--kv-group-size", str(self.group_size),
                    "--quantized-kv-start", "0"]
        cfg, default = self.oiq, OIQConfig()
        for name in ("trim_reserve", "rotation"):
            if getattr(cfg, name) != getattr(default, name):
                raise ValueError(f"cache {self.name!r}: oiq-server has no flag for {name}")
        args = ["--k-bits", str(cfg.k_bits), "--v-bits", str(cfg.v_bits), "--group-size", str(cfg.group_size),
                "--rotation-seed", str(cfg.seed), "--sink-tokens", str(cfg.sink_tokens), "--window", str(cfg.window),
                "--quantize-after", str(cfg.quantize_after), "--key-scaling", str(cfg.key_scaling),
                "--key-scaling-cap", str(cfg.key_scaling_cap), "--exact-prefill", str(cfg.exact_prefill),
                "--key-alignment", str(cfg.key_alignment)]
        for name in ("clip", "align_scales", "center_keys", "center_values", "positional"):
            flag = name.replace("_", "-")
            args.append(f"--{flag}" if getattr(cfg, name) else f"--no-{flag}")
        if cfg.layer_bits:
            args += ["--layer-bits", ",".join(f"{i}:{k}:{v}" for i, k, v in cfg.layer_bits)]
        return args

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "bits": self.bits,
            "group_size": self.group_size,
            "oiq": None if self.oiq is None else dataclasses.asdict(self.oiq),
            "description": self.description,
            "calibrate": self.calibrate,
            "calibrate_budget": self.calibrate_budget,
        }


def _plain(bits: int, **kw) -> OIQConfig:
    return OIQConfig(k_bits=bits, v_bits=bits, sink_tokens=0, window=0, center_keys=False, key_scaling=0.0,
                     clip=False, align_scales=False, **kw)


def _mlx(bits: int, group: int, name: str | None = None) -> CacheSpec:
    return CacheSpec(name or f"mlx-q{bits}-g{group}", "mlx", bits, group,
                     description=f"mlx-lm QuantizedKVCache affine {bits}-bit group {group}")


def cache_registry() -> dict[str, CacheSpec]:
    """Every named cache, in report order."""
    specs = [CacheSpec("fp", "fp", description="mlx-lm KVCache at the model dtype (reference)"),
             CacheSpec("fp16", "fp16", description="mlx-lm KVCache holding float16 keys and values, attention at the model dtype")]
    for g in (64, 32):
        for b in (8, 4):
            specs.append(_mlx(b, g))
    specs.append(CacheSpec("absmax-4", "oiq", 4, 32, _plain(4, rotation="none"), "abs-max 4-bit g32, no rotation, no sinks/window/centering"))
    specs.append(CacheSpec("oiq-nosigns-4", "oiq", 4, 32, _plain(4, rotation="hadamard_nosigns"), "Hadamard without random signs, 4-bit g32, plain"))
    for b in (4, 3, 2):
        specs.append(CacheSpec(f"oiq-plain-{b}", "oiq", b, 32, _plain(b), f"OIQ {b}-bit g32, no sinks/window/centering"))
    for b in (4, 3, 2):
        cfg = OIQConfig.preset(f"{b}bit")
        extras = "".join(x for x, on in ((", value mean", cfg.center_values), (", clip", cfg.clip),
                                         (", aligned scales", cfg.align_scales)) if on)
        specs.append(CacheSpec(f"oiq-{b}", "oiq", b, 32, cfg,
                               f"OIQ preset '{b}bit' (K{cfg.k_bits}V{cfg.v_bits} g32, sinks {cfg.sink_tokens}, "
                               f"window {cfg.window}, key mean + scaling {cfg.key_scaling}"
                               f"{f' capped at {cfg.key_scaling_cap:g}x' if cfg.key_scaling_cap else ''}{extras})"))
    specs.append(CacheSpec("oiq-8", "oiq", 8, 32, OIQConfig(k_bits=8, v_bits=8), "OIQ 8-bit g32, defaults"))
    return {s.name: s for s in specs}


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _fields(text: str, inner: str) -> dict:
    fields = {f.name for f in dataclasses.fields(OIQConfig)}
    kw = {}
    for item in filter(None, inner.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"cache {text!r}: {item!r} is not field=value")
        if key not in fields:
            raise ValueError(f"cache {text!r}: {key!r} is not an OIQConfig field ({', '.join(sorted(fields))})")
        kw[key] = _value(value)
    return kw


def _auto(text: str, kw: dict) -> dict:
    """``CacheSpec`` fields of a ``layer_bits=auto[:BUDGET]`` request (removed from ``kw``)."""
    from ..mlx_lm.calibrate import parse_auto

    try:
        auto, budget = parse_auto(kw.get("layer_bits"))
    except ValueError as e:
        raise ValueError(f"cache {text!r}: {e}") from None
    if not auto:
        return {}
    del kw["layer_bits"]
    return {"calibrate": True, "calibrate_budget": budget}


def parse_spec(text: str) -> CacheSpec:
    """The configuration a name stands for (module docstring); ``ValueError``
    naming the problem for anything else."""
    name = text.replace(" ", "")
    reg = cache_registry()
    if name in reg:
        return reg[name]
    m = re.fullmatch(r"mlx:(\d+)(?::(\d+))?", name)
    if m:
        return _mlx(int(m.group(1)), int(m.group(2) or MLX_GROUP_SIZE))
    m = re.fullmatch(r"mlx-q(\d+)", name)
    if m:
        return _mlx(int(m.group(1)), MLX_GROUP_SIZE, name)
    m = re.fullmatch(r"oiq-(\d)bit", name)
    if m:
        b = int(m.group(1))
        cfg = OIQConfig.preset(f"{b}bit") if f"{b}bit" in PRESETS else OIQConfig(k_bits=b, v_bits=b)
        return CacheSpec(name, "oiq", b, cfg.group_size, cfg, f"OIQ {b}-bit ({'preset' if f'{b}bit' in PRESETS else 'defaults'})")
    m = re.fullmatch(r"preset:([^\[\]]+)(?:\[(.*)\])?", name)
    if m:
        kw = _fields(text, m.group(2) or "")
        auto = _auto(text, kw)
        return _oiq_spec(name, OIQConfig.preset(m.group(1), **kw), f"OIQConfig.preset({m.group(1)!r}) {kw or ''}".strip(),
                         auto)
    m = re.fullmatch(r"oiq\[(.*)\]", name)
    if m:
        kw = _fields(text, m.group(1))
        auto = _auto(text, kw)
        return _oiq_spec(name, OIQConfig(**kw), f"custom OIQ {kw}", auto)
    raise ValueError(
        f"unknown cache {text!r}; use fp, fp16, mlx:B[:G], preset:NAME[field=value,...], oiq[field=value,...] "
        f"or one of {', '.join(reg)}"
    )


def _oiq_spec(name: str, cfg: OIQConfig, desc: str, auto: dict) -> CacheSpec:
    """The spec of an OIQ config; ``auto``: the ``_auto`` fields of a ``layer_bits=auto`` request."""
    if auto:
        b = auto["calibrate_budget"]
        desc += ", layer_bits calibrated on the prompt" + ("" if b is None else f" within {b:g} bytes/token/KV head")
    return CacheSpec(name, "oiq", cfg.k_bits, cfg.group_size, cfg, desc, **auto)


def split_spec_list(text: str) -> list[str]:
    """Split a comma-separated list of names, keeping commas inside ``[...]``."""
    return [x.strip() for x in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text) if x.strip()]


def parse_ints(text: str, *, k: bool = False) -> tuple[int, ...]:
    """Comma-separated integers, ``"512,1024"`` -> ``(512, 1024)``; empty items are skipped.  With
    ``k``, an item may end in ``k`` for times 1024 (``"2k"`` -> 2048), as lengths in tokens are
    written.  Raises ``ValueError`` on anything else (argparse reports it when this is a ``type``)."""
    items = [x.strip() for x in text.split(",")]
    return tuple(int(x[:-1]) * 1024 if k and x.endswith("k") else int(x) for x in items if x)


def parse_floats(text: str) -> tuple[float, ...]:
    """Comma-separated numbers, ``"0,0.5,1"`` -> ``(0.0, 0.5, 1.0)``; empty items are skipped."""
    return tuple(float(x) for x in (x.strip() for x in text.split(",")) if x)
