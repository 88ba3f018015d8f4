"""The cache-file fuzz: every metadata key of a saved two-layer OIQ cache deleted, renamed,
retyped and set to a neighbouring legal value (config fields too, the digest left as saved
and recomputed); every array missing, given a neighbouring shape or dtype, NaN/Inf at each
row kind (sink, packed, window), a neighbouring legal value, truncated; format and digest
removed, swapped, recomputed; the class list and scalar list edited; the file truncated.

Each mutated file goes through the package's loader (``oiq_mlx.load_prompt_cache``).  Outcome:

* refused: a ``ValueError`` that names the field edited (or the digest, when the digest was
  left as saved and nothing else gives the edit away);
* loaded-equal: the loaded caches save exactly the state the file holds (the file is read as
  what it says, and the checks found it legal: a legal edit is a legal file) and decode to
  finite logits, or they decode bit for bit as the unmodified file does;
* loaded-different: anything else (read as another cache, NaN logits): must be 0.

``fuzz_table()`` returns the counts; the test prints them.
"""

import json
import os

import mlx.core as mx
from helpers import tiny_llama
from mlx_lm.models.cache import save_prompt_cache
from mlx.utils import tree_unflatten

import oiq_mlx
from oiq_mlx.cache.files import digest
from oiq_mlx.core.config import OIQConfig
from oiq_mlx.mlx_lm.caches import make_oiq_cache

# every array present but the values' key scales, both segments and their overlap, layer 1 at other bits
CFG = OIQConfig(k_bits=3, v_bits=4, sink_tokens=3, window=6, trim_reserve=4, center_values=True, clip=True,
                layer_bits="1:4:2")
ARRAYS = ("codes", "scales", "sink", "recent", "signs", "mean", "lam")
SIDES = ("keys", "values")


def _continue(model, cache):
    out = [model(mx.array([[40, 41, 42, 43, 44, 45, 46, 47, 48]]), cache=cache)]
    out += [model(mx.array([[t]]), cache=cache) for t in (50, 51)]
    mx.eval(out)
    return out


def _raw_states(arrays: dict, metadata: dict):
    """The per-layer states a file holds, read as save_prompt_cache wrote them (no checks)."""
    _, _, scalars = tree_unflatten(list(metadata.items()))
    arrays = dict(arrays)
    for pos, kind in scalars[1:]:
        a = arrays[pos]
        arrays[pos] = {"string": lambda: "".join(chr(int(c)) for c in a.tolist()), "scalar": a.item,
                       "none": lambda: None}[kind]()
    return tree_unflatten(list(arrays.items()))


def _same(a, b) -> bool:
    """States equal: arrays bit for bit, metadata as JSON of the same types, configs as the
    configs they read as (a config field a format-2 file leaves out reads as its default, and
    the saved state writes it out)."""
    if isinstance(a, str) and isinstance(b, str):
        ma, mb = json.loads(a), json.loads(b)
        if isinstance(ma, dict) and isinstance(mb, dict) and isinstance(ma.get("config"), str):
            ma["config"], mb["config"] = (OIQConfig.from_json(m.get("config", "null")) for m in (ma, mb))
            # the digest is of the config's text: recomputed when a left-out field is written out
            ma.pop("digest", None), mb.pop("digest", None)
        return ma == mb and json.dumps(ma, default=str) == json.dumps(mb, default=str)
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b, equal_nan=True).item()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is None and b is None


class Fuzz:
    def __init__(self, tmp):
        self.model = tiny_llama(layers=2)
        cache = make_oiq_cache(self.model, CFG)
        self.model(mx.array([list(range(1, 31))]), cache=cache)
        for t in (31, 32):
            self.model(mx.array([[t]]), cache=cache)
        self.path = os.path.join(tmp, "base.safetensors")
        save_prompt_cache(self.path, cache, {"model": "tiny"})
        self.arrays, self.metadata = mx.load(self.path, return_metadata=True)
        self.reference = _continue(self.model, oiq_mlx.load_prompt_cache(self.path))
        self.out = os.path.join(tmp, "mutated.safetensors")
        self.rows = []  # (case, outcome, message)

    # -- one mutated file -----------------------------------------------------

    def run(self, case: str, arrays: dict, metadata: dict, names, raw: bytes | None = None):
        if raw is None:
            mx.save_safetensors(self.out, arrays, metadata)
        else:
            with open(self.out, "wb") as f:
                f.write(raw)
        try:
            cache = oiq_mlx.load_prompt_cache(self.out)
        except ValueError as e:
            msg = str(e)
            named = any(n in msg for n in names)
            self.rows.append((case, "refused" if named else "refused-unnamed", msg))
            return
        got = _continue(self.model, [c for c in cache])
        finite = all(mx.all(mx.isfinite(x)).item() for x in got)
        exact = raw is None and _same([c.state for c in oiq_mlx.load_prompt_cache(self.out)],
                                      _raw_states(arrays, metadata))
        same = all(mx.array_equal(a, b).item() for a, b in zip(got, self.reference))
        ok = (exact and finite) or same
        self.rows.append((case, "loaded-equal" if ok else "loaded-different", ""))

    def meta(self, layer: int) -> dict:
        return json.loads("".join(chr(c) for c in self.arrays[f"{layer}.14"].tolist()))

    def with_meta(self, layer: int, meta, text: str | None = None) -> dict:
        text = json.dumps(meta) if text is None else text
        return {**self.arrays, f"{layer}.14": mx.array([ord(c) for c in text], mx.int32)}

    def run_meta(self, layer, case, meta, names, recompute=True):
        """``meta`` as the layer's metadata, with the digest as saved and (``recompute``) recomputed."""
        if meta == self.meta(layer):
            return  # not a mutation
        self.run(f"L{layer} {case} (digest as saved)", self.with_meta(layer, meta), self.metadata,
                 [*names, "digest"])
        if recompute and isinstance(meta, dict) and "digest" in meta:
            fresh = {**meta, "digest": digest(meta)}
            if fresh != meta:
                self.run(f"L{layer} {case} (digest recomputed)", self.with_meta(layer, fresh), self.metadata, names)


def _retyped(v):
    out = []
    if not isinstance(v, str):
        out.append(json.dumps(v))
    if v is not None:
        out += [[v], None]
    if isinstance(v, bool):
        out.append(int(v))
    elif isinstance(v, int):
        out += [float(v), True]
    elif isinstance(v, str):
        out.append(0)
    elif isinstance(v, list):
        out.append({"0": v[0] if v else None})
    return out


def _neighbours(key, v):
    """Neighbouring legal values of a metadata or config field."""
    if key == "dtype":
        return [d for d in ("float16", "bfloat16", "float32") if d != v]
    if key == "rotation":
        return [r for r in ("hadamard", "hadamard_nosigns", "none") if r != v]
    if key == "layer_bits":
        return ["", "1:4:3", "0:4:2", "0:4:2;1:4:2", "1:3:4"]
    if key == "group_size":
        return [v // 2, v * 2]
    if key in ("head_dims", "dims"):
        return [[v[1], v[0]], [v[0] // 2, v[1]], [v[0], v[1] * 2]] if v[0] != v[1] else [[v[0] // 2, v[1]],
                                                                                         [v[0], v[1] * 2]]
    if isinstance(v, bool):
        return [not v]
    if isinstance(v, int):
        return [x for x in (v - 1, v + 1) if x >= 0]
    if isinstance(v, float):
        return [x for x in dict.fromkeys((v + 0.25, max(0.0, v - 0.25), v * 2)) if x != v]
    return []


def _meta_mutations(fz: Fuzz, layer: int):
    meta = fz.meta(layer)
    for k, v in meta.items():
        rest = {x: y for x, y in meta.items() if x != k}
        own = k != "digest"  # a digest edit is not recomputed away
        fz.run_meta(layer, f"meta {k} deleted", rest, [k], own)
        fz.run_meta(layer, f"meta {k} renamed", {**rest, k + "s": v}, [k], own)
        for t in _retyped(v):
            fz.run_meta(layer, f"meta {k} retyped {t!r}", {**meta, k: t}, [k], own)
        if k not in ("config", "digest", "format"):
            for n in _neighbours(k, v):
                fz.run_meta(layer, f"meta {k}={n!r}", {**meta, k: n}, [k])
    # format and digest: removed, swapped, recomputed
    other = fz.meta(1 - layer)
    no_format = {k: v for k, v in meta.items() if k != "format"}
    bare = {k: v for k, v in no_format.items() if k != "digest"}
    fz.run_meta(layer, "format and digest removed", bare, ["format"])
    fz.run_meta(layer, "format removed, digest recomputed", {**no_format, "digest": digest(bare)}, ["format"])
    for f in (1, 3, 0):
        fz.run_meta(layer, f"format={f}", {**meta, "format": f}, ["format"])
    fz.run_meta(layer, "digest of the other layer", {**meta, "digest": other["digest"]}, ["digest"], False)
    fz.run_meta(layer, "digest of format 1", {**meta, "digest": digest({**meta, "format": 1})}, ["digest"], False)
    fz.run_meta(layer, "format 1, digest recomputed", {**meta, "format": 1}, ["format"])
    fz.run_meta(layer, "format of the other layer swapped in with its digest",
                {**meta, "format": other["format"], "digest": other["digest"]}, ["digest"], False)
    for extra, val in (("layout", {}), ("prefilling", True), ("note", 1)):
        fz.run_meta(layer, f"meta {extra} added", {**meta, extra: val}, [extra])
    fz.run(f"L{layer} metadata not JSON", fz.with_meta(layer, None, "{" + json.dumps(meta)[1:-1]), fz.metadata,
           ["metadata"])
    fz.run(f"L{layer} metadata a list", fz.with_meta(layer, [meta]), fz.metadata, ["metadata"])
    # the config's own fields
    config = json.loads(meta["config"])
    for c, v in config.items():
        rest = {x: y for x, y in config.items() if x != c}
        names = [c, "config"]
        edits = [("deleted", rest), ("renamed", {**rest, c + "s": v})]
        edits += [(f"retyped {t!r}", {**config, c: t}) for t in _retyped(v)]
        edits += [(f"={n!r}", {**config, c: n}) for n in _neighbours(c, v)]
        for what, new in edits:
            fz.run_meta(layer, f"config {c} {what}", {**meta, "config": json.dumps(new, sort_keys=True)}, names)


def _set_row(a, row: int, value):
    """``a`` (B, H, rows, w) with element [0, 0, row, 0] set to ``value``."""
    flat = a.reshape(-1)
    i = row * a.shape[3]
    return mx.concatenate([flat[:i], mx.array([value]).astype(a.dtype), flat[i + 1:]]).reshape(a.shape)


def _array_mutations(a, name):
    out = [("zero-size", a[..., :0]), ("scalar", mx.array(1.0)), ("truncated", a.reshape(-1)[:-1]),
           ("flattened", a.reshape(-1))]
    if a.ndim == 4:
        out += [("rows-1", a[:, :, :-1]), ("rows+1", mx.concatenate([a, a[:, :, -1:]], 2)),
                ("width-1", a[..., :-1]), ("width+1", mx.concatenate([a, a[..., :1]], 3)),
                ("heads-1", a[:, :1]), ("heads+1", mx.concatenate([a, a[:, :1]], 1)),
                ("batch-2", mx.concatenate([a, a], 0)), ("axis-added", a[None])]
    else:
        out += [("longer", mx.concatenate([a, a[:1]])), ("shorter", a[:-1])]
    for dt in (mx.float16, mx.bfloat16, mx.float32, mx.int32, mx.uint32, mx.uint16):
        if dt != a.dtype:
            out.append((f"as-{dt}".replace("mlx.core.", ""), a.astype(dt)))
    if name in ("sink", "recent", "scales", "mean", "lam") and a.ndim == 4:
        kind = {"sink": "sink", "recent": "window", "scales": "packed"}.get(name, "statistic")
        for label, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", -float("inf"))):
            out += [(f"{label} at first {kind} row", _set_row(a, 0, value)),
                    (f"{label} at last {kind} row", _set_row(a, a.shape[2] - 1, value))]
    if name == "codes":
        # packed row kind: a code word changed (legal where its group has a scale)
        out.append(("packed word +1", _set_row(a, 0, a[0, 0, 0, 0].item() ^ 1)))
    if name in ("sink", "recent", "mean"):
        out.append(("neighbouring value", _set_row(a, 0, a[0, 0, 0, 0].item() + 0.5)))
    if name == "lam":
        out.append(("neighbouring value", _set_row(a, 0, a[0, 0, 0, 0].item() + 0.5)))
        out.append(("below 1", _set_row(a, 0, 0.5)))
    if name == "signs":
        out += [("one flipped", mx.concatenate([-a[:1], a[1:]])), ("nan", mx.concatenate([mx.array([mx.nan]), a[1:]]))]
    return out


def _array_mutations_all(fz: Fuzz, layer: int):
    for side in (0, 1):
        for j, name in enumerate(ARRAYS):
            key = f"{layer}.{7 * side + j}"
            a = fz.arrays[key]
            label = f"{SIDES[side]} {name}"
            names = [label] + ([f"{SIDES[side]} {'scales' if name == 'codes' else 'codes'}"]
                               if name in ("codes", "scales") else [])
            rest = {k: v for k, v in fz.arrays.items() if k != key}
            fz.run(f"L{layer} {label} missing", rest, fz.metadata, [*names, f"'{key}'"])
            if a.size == 0:  # stored None (the values have no key scales): an array appears
                fz.run(f"L{layer} {label} present", {**rest, key: mx.ones((1, 2, 1, 64))}, _without_none(fz, key),
                       names)
                continue
            for what, new in _array_mutations(a, name):
                if new.dtype == a.dtype and new.shape == a.shape and mx.array_equal(new, a).item():
                    continue  # not a mutation
                fz.run(f"L{layer} {label} {what}", {**rest, key: new}, fz.metadata, names)


def _without_none(fz, key):
    """The file metadata with ``key`` no longer listed as a None."""
    md = dict(fz.metadata)
    for k, v in fz.metadata.items():
        if v == key and k.endswith(".0") and md.get(k[:-1] + "1") == "none":
            md[k[:-1] + "1"] = "scalar"
    scalars = tree_unflatten(list(md.items()))[2]
    scalars = [s for s in scalars if s == "" or s[0] != key]
    keep = {k: v for k, v in md.items() if not k.startswith("2.")}
    keep.update({f"2.{i}" if s == "" else f"2.{i}.{j}": (s if s == "" else s[j])
                 for i, s in enumerate(scalars) for j in ((0,) if s == "" else (0, 1))})
    return keep


def _file_mutations(fz: Fuzz):
    md = fz.metadata
    classes = sorted(k for k in md if k.startswith("1."))
    for name in ("load_prompt_cache", "KVCache", "NoSuchCache", "BatchOIQKVCache", ""):
        fz.run(f"class {name!r}", fz.arrays, {**md, classes[0]: name}, ["class", name or "''"])
    fz.run("class list one short", fz.arrays, {k: v for k, v in md.items() if k != classes[-1]}, ["layers"])
    fz.run("class list one long", fz.arrays, {**md, "1.2": "OIQKVCache"}, ["layers"])
    fz.run("string stored as float32", {**fz.arrays, "0.14": fz.arrays["0.14"].astype(mx.float32)}, md,
           ["string 0.14"])
    fz.run("string with a code past unicode", {**fz.arrays, "0.14": mx.concatenate(
        [fz.arrays["0.14"], mx.array([0x110000], mx.int32)])}, md, ["string 0.14"])
    kinds = [k for k in md if k.startswith("2.") and k.endswith(".1")]
    for k in kinds:
        for kind in {"string": ("scalar", "none", "bogus"), "none": ("string", "scalar")}.get(md[k], ("none",)):
            fz.run(f"scalar list {k}={kind}", fz.arrays, {**md, k: kind}, [md[k[:-1] + "0"], kind, "state"])
    fz.run("scalar list entry removed", fz.arrays, {k: v for k, v in md.items() if not k.startswith(kinds[-1][:-1])},
           ["scalar list"])
    fz.run("user metadata key removed", fz.arrays, {k: v for k, v in md.items() if k != "0.model"}, ["-"])
    data = open(fz.path, "rb").read()
    for n in (len(data) - 1, len(data) * 3 // 4, len(data) // 2, 64, 7):
        fz.run(f"file truncated to {n} bytes", {}, {}, ["safetensors"], raw=data[:n])


def fuzz_table(tmp) -> tuple[dict, list]:
    fz = Fuzz(str(tmp))
    for layer in (0, 1):
        _meta_mutations(fz, layer)
        _array_mutations_all(fz, layer)
    _file_mutations(fz)
    counts = {"mutations": len(fz.rows)}
    for outcome in ("refused", "refused-unnamed", "loaded-equal", "loaded-different"):
        counts[outcome] = sum(r[1] == outcome for r in fz.rows)
    return counts, fz.rows


def test_file_fuzz(tmp_path):
    counts, rows = fuzz_table(tmp_path)
    print("\ncache-file fuzz:", " | ".join(f"{k} {v}" for k, v in counts.items()))
    bad = [r for r in rows if r[1] in ("loaded-different", "refused-unnamed")]
    assert counts["loaded-different"] == 0 and counts["refused-unnamed"] == 0, "\n".join(map(str, bad[:40]))
    assert counts["mutations"] > 1000 and counts["refused"] > 800


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        counts, rows = fuzz_table(d)
    for r in rows:
        if r[1] not in ("refused", "loaded-equal") or "-v" in __import__("sys").argv:
            print(r)
    print(counts)

