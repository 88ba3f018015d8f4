"""OIQ cache configuration: one validated dataclass."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from . import fp4
from .codec import ALIGNMENTS, bytes_per_token, check_bits, check_group_size
from .rotation import hadamard_block_size


ROTATIONS = ("hadamard", "hadamard_nosigns", "none")

# Upper bound of the token counts (sink_tokens, window, trim_reserve): past any
# model's context, low enough that a typo (10**9) is an error, not an allocation.
MAX_TOKENS = 1 << 24

# Chosen by measurement (oiq_mlx.eval.sweep, scripts/fidelity_sweep.py; docs/configuration.md):
# perplexity and KL against the full-precision cache on SmolLM2-135M and Gemma 3 270M at equal bytes per token.  The 3bit and 2bit key scaling
# (0.75) and the 2bit window (128) were chosen on three scored windows of Northanger Abbey,
# Pride and Prejudice and a Qwen-style key-bias stand-in (768-token prompt, 256 tokens
# scored one per call); Sense and Sensibility is the text held out from that choice.
# The 3bit aligned scales (align_scales) came from the 16k Gemma 3 needle and the 4k
# needles 3bit lost, and were kept on lower KL on all four texts (docs/results.md).  With them the
# clip search also helps 4bit: lower KL on every text and both models, and the 4k needle
# K5V3 lost is found again.  3bit's key scaling became 0.5 capped at 2x (key_scaling_cap)
# on the 2k and 4k needle plans, where 0.75 lost two needles to its keys, and on KL:
# lower than 0.75's on SmolLM2 and no higher on Gemma 3, whose loud key channels (15-20x
# the median) the cap brings down as far as 0.75 did (docs/results.md).  1.5bit is 2bit with
# 1-bit values (32 bytes per token and KV head at d = 64).  Of K2V1 with aligned scales (+7%
# perplexity on Northanger Abbey), keys half way (key_alignment 0.5, +4.3-4.9%) and least-squares
# scales (+3.4-3.8%), whose passkeys at 2k go the other way (13, 11, 10 of 18), keys half way are
# the most aligned within +5% in both protocols on both models; K1V2 cost +77%.  Held out at
# seed 0 +2.0-2.1%; seeds 1-4 +4.9-6.5% (docs/results.md).  2bit-ppl is 2bit with keys half way,
# chosen on Northanger Abbey (KL a third lower over seeds 0-4) and kept under a new name because it
# retrieves fewer passkeys than 2bit; held out on nine windows, +1.1-1.5% against 2bit's +2.7-3.3%
# (seeds 1-4 +1.5-2.5%).
_2BIT = dict(k_bits=2, v_bits=2, group_size=32, sink_tokens=4, window=128, center_keys=True, key_scaling=0.75,
             clip=True, center_values=True, exact_prefill=16384)
PRESETS = {
    "4bit": dict(k_bits=5, v_bits=3, group_size=32, sink_tokens=4, window=64, center_keys=True, key_scaling=0.5,
                 clip=True, align_scales=True, exact_prefill=16384),
    "3bit": dict(k_bits=3, v_bits=3, group_size=32, sink_tokens=4, window=64, center_keys=True, key_scaling=0.5,
                 key_scaling_cap=2.0,
                 clip=True, align_scales=True, exact_prefill=16384),
    "2bit": _2BIT,
    "2bit-ppl": dict(_2BIT, key_alignment=0.5),
    "1.5bit": dict(_2BIT, v_bits=1, key_alignment=0.5),
}


def _parse_layer_bits(value) -> tuple:
    """``layer_bits`` as a sorted tuple of ``(layer, k_bits, v_bits)`` int triples,
    from such triples or from the text ``"layer:k:v;layer:k:v"`` (``,`` also separates)."""
    if isinstance(value, str):
        items = [t for t in value.replace(",", ";").split(";") if t.strip()]
        triples = []
        for t in items:
            parts = t.strip().split(":")
            if len(parts) != 3:
                raise ValueError(f"layer_bits entry {t.strip()!r} is not layer:k_bits:v_bits")
            try:
                triples.append(tuple(int(x) for x in parts))
            except ValueError:
                raise ValueError(f"layer_bits entry {t.strip()!r} is not layer:k_bits:v_bits") from None
        value = triples
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"layer_bits must be (layer, k_bits, v_bits) triples, got {value!r}")
    out = []
    for entry in value:
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise ValueError(f"layer_bits entry {entry!r} is not (layer, k_bits, v_bits)")
        layer = _check_int("layer_bits layer", entry[0])
        out.append((layer, check_bits(entry[1], f"layer {layer} k_bits"), check_bits(entry[2], f"layer {layer} v_bits")))
    layers = [t[0] for t in out]
    if len(set(layers)) != len(layers):
        raise ValueError(f"layer_bits names a layer twice: {sorted(layers)}")
    return tuple(sorted(out))


def layer_bits_text(layer_bits) -> str:
    """``layer_bits`` triples as ``"3:K3V3,8:K4V4"`` ("" for none)."""
    return ",".join(f"{i}:K{k}V{v}" for i, k, v in layer_bits)


def _check_int(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class OIQConfig:
    """How an OIQ cache stores keys and values.

    The defaults are the measured ``"4bit"`` preset (see :meth:`preset` and
    docs/configuration.md): keys at 5 bits and values at 3 (K5V3, 4 bits per
    coordinate on average, the bytes of K4V4), group 32, codes from the clip
    search with aligned scales, 4 sink tokens and a 64-token window in full
    precision, key mean removed, key scaling 0.5.

    Attributes:
        k_bits, v_bits: bits per key / value coordinate: 1, 2, 3, 4, 5, 6 or 8.
        group_size: coordinates sharing one float16 scale: 32, 64 or 128.
        seed: seed of the random sign vectors (one per layer, stored with the cache).
        sink_tokens: the first S tokens of the sequence are kept in full precision.
        window: at least the most recent W tokens are kept in full precision;
            older tokens are packed in blocks of ``min(16, W)`` as they leave the
            window, so it holds W to W + 15 tokens (DESIGN.md section 5).
        quantize_after: nothing is quantized until the cache holds more than
            this many tokens (mlx-lm's ``quantized_kv_start``).
        clip: choose each group's scale by a per-group MSE search instead of
            abs-max (every preset clips; at 4 bits only together with
            ``align_scales``, see below).  With ``storage="mxfp4"``, the search
            over each group's E8M0 exponent (``storage`` below).
        align_scales: keep the codes so chosen but store for each group the
            scale ``sum(y*y) / sum(y*u)`` (``u``: the codes centred), so that
            the stored group has the length the rotated vector has along itself
            (``codec.quantize(align=True)``).  The MSE-chosen scale shrinks
            groups, which lowers most the score of the key that best matches a
            query: retrieval loses its needle first (docs/configuration.md).
        key_alignment: with ``align_scales``, how far the keys' scales go to the
            aligned one: 1 all the way, 0.5 the mean of the aligned scale and
            the one the codes were chosen with (``codec.quantize(align=0.5)``),
            0 not at all (values aligned only).  Values take the aligned scale.
            The aligned key keeps the score of the query it matches best, and
            errs more off its own direction, which every other score reads.
        center_keys, center_values: subtract a per-head, per-channel mean
            (estimated on the first chunk written to the cache, usually the
            prompt) before quantizing.  Exact for attention: a key shift changes
            every score of a query by the same amount, a value shift is added
            back to the output.
        rotation: ``"hadamard"`` (OIQ), ``"hadamard_nosigns"`` (the
            transform without random signs) or ``"none"`` (plain abs-max
            group quantization); the last two exist as evaluation baselines.
        key_scaling: exponent ``a`` of an exact per-channel key scaling: key
            channels louder than the head's median channel (RMS ``r_c``
            against median ``r_med``, estimated with the mean) are divided by
            ``lam_c = (r_c / r_med) ** a`` and the query is multiplied by it,
            which leaves every score unchanged while shrinking outlier
            channels before the rotation.  0 disables it.
        key_scaling_cap: with ``key_scaling``, also bring every key channel
            to at most this many times the median's RMS: ``lam_c =
            max((r_c / r_med) ** a, (r_c / r_med) / cap)``.  The square root
            (``a = 0.5``) suits keys whose loud channels are a few times the
            median (SmolLM2: at most 2-4x); keys with channels 15-20x the
            median (Gemma 3's, after its key norm) need those brought further
            down, and the cap does that without shrinking the milder channels
            more (docs/results.md).  0: no cap.  Without key
            scaling (``key_scaling=0``) nothing is scaled, capped or not.
        trim_reserve: full-precision copies of this many tokens beyond the
            window are kept so that ``trim`` (speculative decoding) restores
            the exact never-generated state.
        positional: what each query attends to depends on its position alone.  A
            query reads every row as the cache holds it right after that query's own
            token was written: rows that have left the window by then packed, the rest
            in full precision, and the statistics (mean, key scales) come from the
            rows between the sinks and the first packed block, estimated when that
            block is packed.  What a sequence stores and attends to is then the same
            however its tokens were split into calls (one prompt, chunks, one token
            per call), so a prompt cache can reuse any exactly trimmable prefix and
            get what a fresh cache gets (``oiq-server`` turns it on).  Off (the
            default), a call attends the window it found and its own rows in full
            precision even when it packs them, and the statistics come from the
            first call: a prompt is attended exactly, and the first call decides
            the statistics (DESIGN.md section 11).
        exact_prefill: keep up to this many prompt tokens in full precision
            while the prompt is prefilled (calls of more than one token before the
            first one-token call), and pack them, with statistics estimated on all
            of them, when the first one-token call comes (the step that computes
            the first generated token) or a call would take the cache past this
            many tokens.  A prompt prefilled in chunks (mlx-lm's
            ``prefill_step_size``, 2048) is then stored and read as a prompt
            written in one call is: each chunk attends the earlier ones exactly,
            and everything after the prompt reads what one call would have left
            packed.  Without it (0), later chunks read earlier ones packed, which
            loses needles a one-call prompt keeps (docs/results.md).  The price is the full-precision keys and values of up
            to this many tokens until the prompt is done, as mlx-lm's own cache
            holds them (every preset keeps up to 16384).  No effect with
            ``positional``, which stores the same however a prompt is split
            (as ``key_scaling_cap`` has none without key scaling).
        layer_bits: per-layer bit allocation: ``((layer, k_bits, v_bits), ...)``
            (or the text ``"layer:k:v;layer:k:v"``); those layers store keys and
            values at these bits instead of ``k_bits``/``v_bits``.  ``layer`` is
            the index in the model's cache list (the decoder layer).  Use it to
            give the layers whose attention suffers most more bits.
        storage: how the packed segment stores the rotated coordinates: ``"int"`` (the
            default: ``k_bits`` / ``v_bits`` integer codes, one float16 scale per group),
            ``"mxfp4"`` (E2M1 values, one E8M0 power-of-two scale per 32: group_size 32) or
            ``"nvfp4"`` (E2M1, one E4M3 scale per 16: group_size 16), both through MLX's own fp4
            quantize and quantized matmul (``oiq_mlx.core.fp4``).  fp4 needs
            ``k_bits = v_bits = 4``, ``align_scales`` off and no ``layer_bits``; keys and values
            of one token share one packed row (68 bytes per token and KV head at d = 64 for
            MXFP4).  With MXFP4, ``clip`` searches each group's power-of-two exponent: MLX's
            and its two neighbours, the one of least squared error (``fp4.quantize``); off, MLX
            picks it.  NVFP4 takes MLX's scales (``clip`` off).
    """

    k_bits: int = 5
    v_bits: int = 3
    group_size: int = 32
    seed: int = 0
    sink_tokens: int = 4
    window: int = 64
    quantize_after: int = 0
    clip: bool = True
    align_scales: bool = True
    key_alignment: float = 1.0
    center_keys: bool = True
    center_values: bool = False
    trim_reserve: int = 16
    rotation: str = "hadamard"
    key_scaling: float = 0.5
    key_scaling_cap: float = 0.0
    layer_bits: tuple = ()
    positional: bool = False
    exact_prefill: int = 16384
    storage: str = "int"

    def __post_init__(self):
        check_bits(self.k_bits, "k_bits")
        check_bits(self.v_bits, "v_bits")
        if not isinstance(self.storage, str) or self.storage not in fp4.STORAGES:
            raise ValueError(f"storage={self.storage!r} is not one of {fp4.STORAGES}")
        if self.storage == "int":
            check_group_size(self.group_size)
        else:
            self._check_fp4()
        for name in ("seed", "quantize_after"):
            _check_int(name, getattr(self, name))
        for name in ("sink_tokens", "window", "trim_reserve", "exact_prefill"):
            _check_int(name, getattr(self, name), 0, MAX_TOKENS)
        if isinstance(self.key_scaling, bool) or not isinstance(self.key_scaling, (int, float)) or not 0 <= self.key_scaling <= 1:
            raise ValueError(f"key_scaling must be a number in [0, 1], got {self.key_scaling!r}")
        cap = self.key_scaling_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap == 0 or 1 <= cap < float("inf")):
            raise ValueError(f"key_scaling_cap must be 0 (no cap) or a number >= 1, got {cap!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation={self.rotation!r} is not one of {ROTATIONS}")
        for name in ("clip", "align_scales", "center_keys", "center_values", "positional"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.key_alignment, bool) or self.key_alignment not in ALIGNMENTS:
            raise ValueError(f"key_alignment must be 0, 0.5 or 1, got {self.key_alignment!r}")
        object.__setattr__(self, "key_alignment", float(self.key_alignment))
        if self.key_alignment != 1.0 and not self.align_scales:
            raise ValueError(f"key_alignment={self.key_alignment} sets how far aligned key scales go: it needs "
                             "align_scales=True (to turn aligned scales off for keys and values, set "
                             "key_alignment=1 too)")
        object.__setattr__(self, "layer_bits", _parse_layer_bits(self.layer_bits))

    def _check_fp4(self):
        name, g = self.storage, fp4.FP4_GROUP[self.storage]
        if isinstance(self.group_size, bool) or self.group_size != g:
            raise ValueError(f"storage={name!r} has one scale per {g} values: group_size must be {g}, "
                             f"got {self.group_size!r}")
        if (self.k_bits, self.v_bits) != (4, 4):
            raise ValueError(f"storage={name!r} stores 4-bit E2M1 values: k_bits and v_bits must be 4, got "
                             f"{self.k_bits} and {self.v_bits}")
        if self.align_scales:
            raise ValueError(f"storage={name!r} stores E8M0 / E4M3 scale bytes, no aligned scales: align_scales "
                             "must be False")
        if self.clip and name != "mxfp4":
            raise ValueError(f"storage={name!r} takes MLX's E4M3 scales: clip must be False (clip=True is "
                             "the exponent search of storage='mxfp4')")
        if self.layer_bits:
            raise ValueError(f"storage={name!r} stores every layer at 4 bits: layer_bits must be empty")

    @property
    def scale_alignment(self) -> tuple[float, float]:
        """``(keys, values)``: the ``align`` of ``codec.quantize`` for each side."""
        return (self.key_alignment, 1.0) if self.align_scales else (0.0, 0.0)

    def bits_for_layer(self, layer: int) -> tuple[int, int]:
        """``(k_bits, v_bits)`` of cache layer ``layer`` (``layer_bits`` applied)."""
        for idx, kb, vb in self.layer_bits:
            if idx == layer:
                return kb, vb
        return self.k_bits, self.v_bits

    @classmethod
    def preset(cls, name: str, **overrides) -> "OIQConfig":
        """A named configuration, fields in ``overrides`` replaced.

        Quantized storage per token per KV head, keys and values together
        (packed codes + float16 group scales).  A fixed cost per KV head and
        layer comes on top: the full-precision rows, at most 4 sinks + the
        window (64; 128 for the 2-bit and 1.5-bit presets) + the 16-token trim reserve + one pending
        block of 16 (25.6 KB at d = 64 in float16; 42.0 KB for the 2-bit and 1.5-bit presets), and
        the float32 mean / key-scale vectors:

        ============  =======  ========  ====================================================================
        name          d = 64   d = 128   what
        ============  =======  ========  ====================================================================
        ``4bit``      72       144       K5 V3 g32, clipped codes with aligned scales, key mean, key scaling 0.5
        ``3bit``      56       112       K3 V3 g32, as 4bit but key scaling 0.5 capped at 2x
        ``2bit``      40       80        K2 V2 g32, clipped codes with aligned scales, value mean, window 128
        ``2bit-ppl``  40       80        as 2bit with keys' scales aligned half way: less perplexity and KL,
                                         fewer passkeys retrieved
        ``1.5bit``    32       64        K2 V1 g32, as 2bit with keys' scales aligned half way
        ============  =======  ========  ====================================================================

        (fp16 is 256 / 512.)  Raises ``ValueError`` for an unknown name.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown OIQ preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def storage_dim(self, head_dim: int) -> int:
        """Length of the stored (rotated) vectors for a head of ``head_dim``.

        Heads whose dimension is not a multiple of ``group_size`` (80 and 112
        at group 32) are zero-padded to the next multiple before rotation;
        padding changes no dot product and costs the extra coordinates.
        Raises ``ValueError`` when no rotation serves the padded size.
        """
        _check_int("head_dim", head_dim, 1)
        dim = -(-head_dim // self.group_size) * self.group_size
        if self.rotation != "none":
            hadamard_block_size(dim)
        return dim

    def bytes_per_token(self, head_dim: int, layers=None) -> float:
        """Bytes of quantized storage per token per KV head, keys and values together,
        as the cache stores them: packed rows of whole 32-bit words
        (:func:`oiq_mlx.core.codec.bytes_per_token`), so an odd number of float16 group
        scales costs a whole word (group 64 at d = 64 stores as much as group 32).

        With ``layer_bits``, the mean over ``layers`` (the cache indices of the
        layers that use OIQ), which must then be given.
        """
        d = self.storage_dim(head_dim)
        if self.storage != "int":
            return fp4.pair_bytes_per_token(d, self.storage)

        def row(k_bits, v_bits):
            return bytes_per_token(d, k_bits, self.group_size) + bytes_per_token(d, v_bits, self.group_size)

        if not self.layer_bits:
            return row(self.k_bits, self.v_bits)
        if not layers:
            raise ValueError("with layer_bits, bytes_per_token needs the OIQ layer indices (layers=...)")
        layers = list(layers)
        return sum(row(*self.bits_for_layer(i)) for i in layers) / len(layers)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "OIQConfig":
        """The config :meth:`to_json` wrote; ``ValueError`` naming the problem otherwise."""
        try:
            fields = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"config is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"config must be a JSON object, got {type(fields).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        # configs written before the field existed stored what positional=False does
        fields.setdefault("positional", False)
        fields.setdefault("align_scales", False)  # likewise: scales as the codes' search chose them
        fields.setdefault("key_scaling_cap", 0.0)  # likewise: no cap
        fields.setdefault("exact_prefill", 0)  # likewise: chunks read earlier chunks packed
        fields.setdefault("storage", "int")  # likewise: integer codes and float16 scales
        fields.setdefault("key_alignment", 1.0)  # likewise: keys' scales aligned all the way
        unknown, missing = sorted(set(fields) - known), sorted(known - set(fields))
        if unknown or missing:
            # a default filled in for a missing field could silently change how the cache stores
            raise ValueError(f"config fields do not match OIQConfig: unknown {unknown}, missing {missing}")
        return cls(**fields)
