"""Run an `mx.fast.metal_kernel` on the CPU by compiling MLX's own generated Metal text with g++.

`launch(kernel, **kwargs)` takes exactly the keyword arguments of calling the
kernel and returns what the kernel would: a list of mx arrays. The Metal source
is the text MLX prints with ``verbose=True`` while tracing the call inside
``mx.export_function`` (the CPU build cannot run it, but it can generate it).
"""

import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

SHIM_DIR = Path(__file__).resolve().parent / "include"
SHIM_HEADER = SHIM_DIR / "oiq_metal_shim.h"
MLX_INCLUDE = Path(mx.__file__).resolve().parent / "include"
CXX = os.environ.get("OIQ_EMU_CXX", "clang++")
# The build that runs: every load and store reports to the shim's bounds check.
CXXFLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-fno-strict-aliasing", "-fwrapv", "-w",
            "-fsanitize-coverage=func,inline-bool-flag,trace-loads,trace-stores"]
# The build that type-checks address spaces (device/constant/threadgroup distinct, as in
# Metal); at -O0 its stack frame also sizes the kernel's per-thread state.
CHECK_FLAGS = ["-O0", "-std=c++17", "-c", "-w", "-fstack-usage", "-DOIQ_EMU_ADDRESS_SPACES"]
ADDRESS_SPACES = {"1": "device", "2": "constant", "3": "threadgroup"}
ENTRY = "oiq_emu_run"

# Buffers of one launch sit in one arena, GUARD_BYTES apart; bytes that are no
# element of an array (guards, gaps of strided views) hold GUARD_FILL.
GUARD_BYTES = 256
GUARD_FILL = 0xA5
# Outputs without init_value start as NaN (float types) or 0xCD bytes (others)
# so a test sees any element the kernel did not write.
INT_POISON = 0xCD
MAX_THREADS_PER_THREADGROUP = 1024
SIMD_WIDTH = 32
# Execution orders each launch runs (results must agree): $OIQ_EMU_ORDERS, a comma list
# of forward, reverse, shuffle:SEED.
DEFAULT_ORDERS = "forward,reverse,shuffle:1"
# The error model of Metal's fast::exp (see FAST_EXP_MODES): $OIQ_EMU_FAST_EXP, MODE or
# MODE:SCALE (default hash:1, the documented bound with a sign hashed from the argument).
FAST_EXP_MODES = {"exact": 0, "hash": 1, "up": 2, "down": 3}


def _fast_exp_from_env():
    text = os.environ.get("OIQ_EMU_FAST_EXP", "hash")
    mode, _, scale = text.partition(":")
    if mode not in FAST_EXP_MODES:
        raise ValueError(f"unknown fast::exp model {text!r} in $OIQ_EMU_FAST_EXP "
                         f"({', '.join(FAST_EXP_MODES)}, optionally :SCALE)")
    return mode, float(scale or 1.0)


# (mode, scale) of fast::exp for the next launches: the result is off exp(x) by
# [k, k + 1) ulp, k = floor(scale * (3 + floor(|2x|))) (Metal's documented bound at scale 1),
# above ("up"), below ("down") or on a side hashed from x's bits ("hash"); "exact" is exp(x)
# rounded to float.  Results below FLT_MIN are flushed to zero.  Tests set it directly.
FAST_EXP = _fast_exp_from_env()
# Kernels that use these rely on full simdgroups of SIMD_WIDTH threads.
_SIMD_USE = re.compile(r"\bsimd_\w+\s*\(|\bsimdgroup_barrier\b|\bthread_index_in_simdgroup\b|"
                       r"\bsimdgroup_index_in_threadgroup\b")

_lock = threading.Lock()
_libs = {}


class MetalEmuError(RuntimeError):
    """A kernel misbehaved under the emulator (barrier misuse, out-of-bounds write...)."""


class MetalEmuUnsupported(MetalEmuError):
    """The kernel uses a Metal feature the emulator does not emulate."""


class MetalEmuCompileError(MetalEmuError):
    """g++ rejected the kernel text."""


# Patterns for MSL features the shim does not provide, checked before compiling.
_UNSUPPORTED = [
    (r"\bsimdgroup_(?:matrix|float8x8|half8x8|bfloat8x8|load|store|multiply|multiply_accumulate)\b",
     "simdgroup_matrix (simdgroup matrix multiply)"),
    (r"\b(?:texture[123]d|texture_buffer|sampler)\b", "textures/samplers"),
    (r"\batomic(?:_\w+)?\b", "atomics"),
    (r"\bquad_\w+\s*\(", "quad-group functions"),
    (r"\bsimd_(?:ballot|vote|active_threads_mask)\b", "simd_ballot/simd_vote"),
    (r"\.(?:[xyzw]{2,4})\b", "vector swizzles (.xy, .xyz, ...)"),
    (r"\bimageblock\b", "imageblocks"),
]

_NP_TYPES = {
    "float": np.float32,
    "float32_t": np.float32,
    "float16_t": np.float16,
    "half": np.float16,
    "bfloat16_t": np.uint16,  # carried as raw bits
    "bool": np.bool_,
    "int8_t": np.int8,
    "uint8_t": np.uint8,
    "int16_t": np.int16,
    "uint16_t": np.uint16,
    "int": np.int32,
    "int32_t": np.int32,
    "uint": np.uint32,
    "uint32_t": np.uint32,
    "int64_t": np.int64,
    "uint64_t": np.uint64,
}

_MX_TO_NP = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,
    mx.bool_: np.bool_,
    mx.int8: np.int8,
    mx.uint8: np.uint8,
    mx.int16: np.int16,
    mx.uint16: np.uint16,
    mx.int32: np.int32,
    mx.uint32: np.uint32,
    mx.int64: np.int64,
    mx.uint64: np.uint64,
}


def cache_dir():
    """Where compiled kernels live: $OIQ_EMU_CACHE, else ~/.cache/oiq_mlx/metal_emu."""
    d = os.environ.get("OIQ_EMU_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "oiq_mlx", "metal_emu")
    os.makedirs(d, exist_ok=True)
    return Path(d)


RESOURCES = {}  # host name of each instantiation launched -> its resource figures
# One record per launch: host name, template arguments, grid, threadgroup and the values of
# an input called `params` (coverage tests read it).
LAUNCHES = []


def generated_source(kernel, **kwargs):
    """The Metal text MLX generates for this call (header, signature, instantiation)."""
    return _trace(kernel, **kwargs)[0]


def _trace(kernel, **kwargs):
    """(Metal text MLX generates for this call, the kernel's ensure_row_contiguous)."""
    kwargs = dict(kwargs, verbose=True)
    inputs = list(kwargs.pop("inputs"))
    arrays = [x for x in inputs if isinstance(x, mx.array)]

    def traced(*arrs):
        it = iter(arrs)
        ins = [next(it) if isinstance(x, mx.array) else x for x in inputs]
        return kernel(inputs=ins, **kwargs)

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.mlxfn")
        with tempfile.TemporaryFile(mode="w+b") as tmp:
            sys.stdout.flush()
            saved = os.dup(1)
            try:
                os.dup2(tmp.fileno(), 1)
                mx.export_function(path, traced, *arrays)
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode()
        exported = Path(path).read_bytes()
    m = re.search(r"Generated source code for `[^`]*`:\n```\n(.*)\n```", text, re.S)
    if not m:
        raise MetalEmuError("MLX printed no generated source while tracing the kernel:\n" + text)
    src = m.group(1)
    return src, _row_contiguous(exported, src, len(inputs), kwargs["grid"], kwargs["threadgroup"])


def _row_contiguous(exported, src, n_inputs, grid, threadgroup):
    """ensure_row_contiguous as serialized in MLX's CustomKernel state: after the source,
    grid and threadgroup (3 int32 each), the count of per-input shape infos (uint64),
    3 bools per input, then the flag.  Checked against what we know before it is trusted."""
    i = exported.find(src.encode())
    if i < 0:
        raise MetalEmuError("cannot find the kernel source in MLX's exported function")
    state = exported[i + len(src.encode()):]
    dims = np.frombuffer(state[:24], np.int32).tolist()
    count = int(np.frombuffer(state[24:32], np.uint64)[0])
    flag = state[32 + 3 * count] if len(state) > 32 + 3 * count else None
    if dims != [int(g) for g in grid] + [int(t) for t in threadgroup] or count != n_inputs or flag not in (0, 1):
        raise MetalEmuError("cannot read ensure_row_contiguous from MLX's exported kernel state "
                            f"(unexpected layout for mlx {mx.__version__})")
    return bool(flag)


def _check_supported(src):
    for i, line in enumerate(src.splitlines(), 1):
        code = line.split("//")[0]
        for pat, feature in _UNSUPPORTED:
            if re.search(pat, code):
                raise MetalEmuUnsupported(
                    f"the Metal emulator does not support {feature}; "
                    f"line {i} of the generated source: {line.strip()}")


_PARAM = re.compile(r"^\s*(?P<type>.*?)\s*\b(?P<name>\w+)\s*\[\[\s*(?P<attr>\w+)(?:\((?P<idx>\d+)\))?\s*\]\]\s*$", re.S)


def _parse(src):
    """Split MLX's text into (body text, kernel name, template args, params)."""
    name = re.search(r"\[\[kernel\]\]\s*void\s+(\w+)", src).group(1)
    inst = re.search(r"^template \[\[host_name\(.*\)\]\] \[\[kernel\]\] decltype\(\w+(<.*>)\) .*;$",
                     src, re.M)
    if inst:
        targs = inst.group(1)
        body = src[: inst.start()] + src[inst.end():]
    else:  # no template arguments: a plain function
        targs, body = "", src
    sig = re.search(r"\[\[kernel\]\]\s*void\s+" + name + r"\s*\((.*?)\)\s*\{", body, re.S)
    if not sig:
        raise MetalEmuError(f"cannot find the signature of {name}")
    params = []
    for p in _split_params(sig.group(1)):
        m = _PARAM.match(p)
        if not m:
            raise MetalEmuError(f"cannot parse kernel parameter: {p.strip()}")
        params.append(m.groupdict())
    return body, name, targs, params


def _split_params(text):
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


_TG_DECL = re.compile(
    r"\bthreadgroup\s+(?P<type>[A-Za-z_][\w:<>,\s]*?)\s+(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\])*)\s*;")
_ATTR = re.compile(r"\[\[\s*[A-Za-z_][\w:]*\s*(?:\([^()]*\))?\s*\]\]")


def _to_cpp(src, kernel_file):
    body, name, targs, params = _parse(src)
    body = _TG_DECL.sub(
        lambda m: f"static threadgroup {m['type']} {m['name']}{m['dims']}; "
                  f"::oiq::tg_register((void*)&{m['name']}, sizeof({m['name']}));", body)
    body = _ATTR.sub("", body)
    args = []
    for p in params:
        t = p["type"]
        if p["idx"] is not None:
            k = int(p["idx"])
            if t.endswith("&"):
                args.append(f"*({t[:-1].strip()}*)bufs[{k}]")
            else:
                args.append(f"({t})bufs[{k}]")
        else:
            args.append(f"ti.{p['attr']}")
    call = f"{name}{targs}(\n      " + ",\n      ".join(args) + ")"
    cpp = (
        '#include "oiq_metal_shim.h"\n'
        f'#line 1 "{kernel_file}"\n'
        f"{body}\n"
        "#line 100000 \"oiq_emu_entry\"\n"
        f'extern "C" int {ENTRY}(void** bufs, const uint32_t* grid, const uint32_t* tg, int order,\n'
        "                       uintptr_t arena_lo, uintptr_t arena_size, const unsigned char* shadow,\n"
        "                       int64_t* fault, int64_t* stats, char* err, int errlen) {\n"
        "  ::oiq::arena() = ::oiq::Arena{arena_lo, arena_size, shadow, fault};\n"
        "  auto body = [&](const oiq::ThreadInfo& ti) {\n"
        f"    {call};\n"
        "  };\n"
        "  int rc = oiq::run_grid(grid, tg, order, stats, body, err, errlen);\n"
        "  ::oiq::arena() = ::oiq::Arena{};\n"
        "  return rc;\n"
        "}\n"
    )
    return cpp, name, params


def _compiler():
    if shutil.which(CXX) is None:
        raise MetalEmuError(f"the Metal emulator needs clang ({CXX!r} not found; "
                            "Debian/Ubuntu: apt-get install clang, or set $OIQ_EMU_CXX)")
    return CXX


def _compile(cpp, kernel_file, src, name):
    """(entry function, per-thread private bytes of the kernel at -O0), built once per text."""
    cxx = _compiler()
    flags = [f"-I{SHIM_DIR}", f"-I{MLX_INCLUDE}"]
    key = hashlib.sha256("\0".join(
        [cpp, SHIM_HEADER.read_text(), " ".join(CXXFLAGS + CHECK_FLAGS + flags), cxx]).encode()).hexdigest()[:24]
    d = cache_dir()
    so, info_path = d / f"{key}.so", d / f"{key}.json"
    if not (so.exists() and info_path.exists()):
        tag = f"{os.getpid()}.{threading.get_ident()}"
        cpp_path = d / f"{key}.{tag}.cpp"  # kept for reading compiler errors
        cpp_path.write_text(cpp)
        tmp_so, tmp_o = d / f"{key}.{tag}.tmp", d / f"{key}.{tag}.o"
        check = subprocess.Popen([cxx, *CHECK_FLAGS, *flags, str(cpp_path), "-o", str(tmp_o)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d)
        build = subprocess.Popen([cxx, *CXXFLAGS, *flags, str(cpp_path), "-o", str(tmp_so)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        check_err = check.communicate()[1]
        build_err = build.communicate()[1]
        su = tmp_o.with_suffix(".su")
        if check.returncode != 0:
            raise MetalEmuCompileError(_explain_compile_error(check_err, kernel_file, src))
        if build.returncode != 0:
            raise MetalEmuCompileError(_explain_compile_error(build_err, kernel_file, src))
        frames = [int(line.split("\t")[1]) for line in su.read_text().splitlines() if name in line]
        for f in (tmp_o, su):
            f.unlink(missing_ok=True)
        info_path.write_text(json.dumps({"private_bytes": max(frames) if frames else None}))
        os.replace(tmp_so, so)
        os.replace(cpp_path, d / f"{key}.cpp")
    lib = _libs.get(key)
    if lib is None:
        lib = ctypes.CDLL(str(so))
        setter = lib.oiq_emu_set_fast_exp
        setter.restype = None
        setter.argtypes = [ctypes.c_int, ctypes.c_double]
        fn = getattr(lib, ENTRY)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
                       ctypes.c_char_p, ctypes.c_int]
        _libs[key] = (lib, json.loads(info_path.read_text()))
    lib, info = _libs[key]
    mode, scale = FAST_EXP
    lib.oiq_emu_set_fast_exp(FAST_EXP_MODES[mode], float(scale))
    return getattr(lib, ENTRY), info


def _explain_compile_error(stderr, kernel_file, src):
    lines = src.splitlines()
    shown = []
    for e in stderr.splitlines():
        if "error" not in e and "note:" not in e:
            continue
        e = re.sub(r"address space '(\d)'", lambda m: f"address space '{m[1]}' "
                   f"({ADDRESS_SPACES.get(m[1], '?')})", e)
        shown.append(e)
        m = re.match(r"(?:.*/)?" + re.escape(kernel_file) + r":(\d+):", e)
        if m and 0 < int(m.group(1)) <= len(lines):
            shown.append(f"    > {lines[int(m.group(1)) - 1].strip()}")
        if len(shown) >= 16:
            break
    return ("clang could not compile the kernel (Metal would reject it too, or it uses a "
            "feature the emulator lacks):\n" + "\n".join(shown or stderr.splitlines()[:20]))


def _np_type(ctype):
    t = re.sub(r"\b(?:const|constant|device)\b|[*&]", " ", ctype).strip()
    if t not in _NP_TYPES:
        raise MetalEmuUnsupported(f"buffer element type {t!r} is not supported by the emulator")
    return np.dtype(_NP_TYPES[t])


def _orders():
    out = []
    for o in os.environ.get("OIQ_EMU_ORDERS", DEFAULT_ORDERS).split(","):
        o = o.strip()
        if o == "forward":
            out.append((o, 0))
        elif o == "reverse":
            out.append((o, 1))
        elif re.fullmatch(r"shuffle:\d+", o):
            out.append((o, 2 + int(o.split(":")[1])))
        else:
            raise MetalEmuError(f"unknown execution order {o!r} in $OIQ_EMU_ORDERS "
                                "(forward, reverse, shuffle:SEED)")
    return out


def _check_launch(name, src, grid, tg):
    """Refuse what Metal refuses: too many threads, partial simdgroups in a simd kernel."""
    if len(grid) != 3 or len(tg) != 3 or min(tg) < 1 or min(grid) < 0:
        raise MetalEmuError(f"grid and threadgroup must be 3 positive ints, got {grid}, {tg}")
    n = tg[0] * tg[1] * tg[2]
    if n > MAX_THREADS_PER_THREADGROUP:
        raise MetalEmuError(f"kernel {name}: threadgroup {tg} has {n} threads; Metal allows at most "
                            f"{MAX_THREADS_PER_THREADGROUP}")
    uses = _SIMD_USE.search(re.sub(r"//[^\n]*", "", src))
    if not uses:
        return
    sizes = [{t} | ({g % t} if g % t else set()) for g, t in zip(grid, tg)]
    for sx in sizes[0]:
        for sy in sizes[1]:
            for sz in sizes[2]:
                if (sx * sy * sz) % SIMD_WIDTH:
                    raise MetalEmuError(
                        f"kernel {name} uses {uses.group(0).rstrip('( ')}, which assumes simdgroups of "
                        f"{SIMD_WIDTH} threads, but grid {grid} with threadgroup {tg} makes a threadgroup "
                        f"of {sx}x{sy}x{sz} = {sx * sy * sz} threads (a partial simdgroup)")


def launch(kernel, *, inputs, grid, threadgroup, output_shapes, output_dtypes,
           template=None, init_value=None, verbose=False, stream=None):
    """Run `kernel` on the CPU with the arguments of calling it; returns its outputs.

    The kernel runs once per execution order of $OIQ_EMU_ORDERS; outputs that differ
    between orders (a race) raise MetalEmuError."""
    kwargs = dict(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
                  output_dtypes=output_dtypes, init_value=init_value)
    if template:
        kwargs["template"] = template
    src, row_contiguous = _trace(kernel, **kwargs)
    if verbose:
        print(src)
    _check_supported(src)
    name = re.search(r"\[\[kernel\]\]\s*void\s+(\w+)", src).group(1)
    kernel_file = f"{name}.metal"
    cpp, name, params = _to_cpp(src, kernel_file)
    grid = tuple(int(g) for g in grid)
    tg = tuple(int(t) for t in threadgroup)
    _check_launch(name, src, grid, tg)
    orders = _orders()

    with _lock:
        fn, info = _compile(cpp, kernel_file, src, name)
        arena = _Arena(params, list(inputs), output_shapes, output_dtypes, init_value, row_contiguous)
        ptrs = (ctypes.c_void_p * max(1, len(arena.buffers)))(*[arena.pointer(b) for b in arena.buffers])
        results = []
        tg_bytes = 0
        for order_name, order in orders:
            arena.reset_outputs()
            err = ctypes.create_string_buffer(2048)
            fault = (ctypes.c_int64 * 6)()
            stats = (ctypes.c_int64 * 2)()
            rc = fn(ptrs, (ctypes.c_uint32 * 3)(*grid), (ctypes.c_uint32 * 3)(*tg), order,
                    arena.base, arena.size, arena.shadow.ctypes.data, fault, stats, err, len(err))
            if rc != 0:
                raise MetalEmuError(f"kernel {name} ({order_name} order): " + (
                    arena.explain_fault(list(fault)) if fault[0] else err.value.decode()))
            results.append((order_name, arena.output_bytes()))
            tg_bytes = max(tg_bytes, int(stats[0]))
        _check_same_results(name, arena, results)
        params_in = next((b["src"] for b in arena.buffers if b["name"] == "params" and b["role"] == "input"), None)
        LAUNCHES.append({"host": name, "template": tuple((k, _tname(v)) for k, v in (template or [])),
                         "grid": grid, "threadgroup": tg,
                         "params": None if params_in is None else params_in.reshape(-1).tolist()})
        RESOURCES[name] = {
            "kernel": re.sub(r"^custom_kernel_", "", name).split("__")[0],
            "template": ", ".join(f"{k}={_tname(v)}" for k, v in (template or [])),
            "threads_per_threadgroup": tg[0] * tg[1] * tg[2],
            "threadgroup_bytes": tg_bytes,
            "private_bytes": info["private_bytes"],
        }
        return arena.outputs()


def resource_table(rows=None):
    """RESOURCES (or the given rows) as a Markdown table, one line per kernel and template
    (the largest figures over its launches)."""
    merged = {}
    for r in (RESOURCES.values() if rows is None else rows):
        m = merged.setdefault((r["kernel"], r["template"]), dict(r))
        for k in ("threads_per_threadgroup", "threadgroup_bytes", "private_bytes"):
            m[k] = max(m[k] or 0, r[k] or 0)
    lines = ["| kernel | template | threads/threadgroup | threadgroup memory (bytes) | "
             "per-thread state at -O0 (bytes, ~32-bit registers) |", "|---|---|---|---|---|"]
    for (kernel, template), r in sorted(merged.items()):
        p = r["private_bytes"]
        lines.append(f"| {kernel} | {template} | {r['threads_per_threadgroup']} | "
                     f"{r['threadgroup_bytes']} | {p} (~{-(-p // 4)}) |")
    return "\n".join(lines)


def _tname(v):
    return str(v).replace("mlx.core.", "") if isinstance(v, mx.Dtype) else str(v)


def _check_same_results(name, arena, results):
    first_name, first = results[0]
    for order_name, res in results[1:]:
        for b, x, y in zip(arena.outs, first, res):
            if not np.array_equal(x, y):
                diff = np.flatnonzero((x != y).reshape(-1, b["itemsize"]).any(1))
                raise MetalEmuError(
                    f"kernel {name}: results depend on the execution order (a race): output "
                    f"{b['name']!r} differs between {first_name} and {order_name} order at {len(diff)} of "
                    f"{len(x) // b['itemsize']} elements, first at flat index {int(diff[0])}")


def _strided(mem, dtype, shape, strides, offset):
    return np.ndarray(shape, dtype, buffer=mem, offset=offset, strides=strides)


class _Arena:
    """The launch's buffers as the GPU sees them, in one guard-separated byte arena with a shadow.

    Inputs keep their real strides and offsets (broadcasts stride 0, slices of larger
    buffers), unless the kernel asks for row-contiguous inputs and one is not, which MLX copies
    first; `_shape`/`_strides`/`_ndim` hold what MLX would bind.  Outputs are contiguous."""

    def __init__(self, params, inputs, output_shapes, output_dtypes, init_value, row_contiguous):
        self.buffers = []
        n_in = n_out = 0
        last = None
        for p in params:
            if p["idx"] is None:
                continue
            ptype, pname = p["type"], p["name"]
            suffix = next((s for s in ("_shape", "_strides", "_ndim")
                           if last is not None and pname == last["name"] + s), None)
            if suffix is not None:
                shape, strides = last["src"].shape, last["src"].strides
                item = last["src"].itemsize
                data = {"_shape": list(shape) or [0], "_strides": [s // item for s in strides] or [0],
                        "_ndim": len(shape)}[suffix]
                view = np.array(data).astype(_np_type(ptype))
                self._add(pname, "meta", view)
            elif n_in < len(inputs):
                view = _input_view(inputs[n_in], _np_type(ptype), pname, row_contiguous)
                n_in += 1
                last = self._add(pname, "input", view)
            else:
                dtype, shape = output_dtypes[n_out], tuple(output_shapes[n_out])
                n_out += 1
                init = np.empty(shape, _np_type(ptype))
                if init_value is not None:
                    if dtype == mx.bfloat16:
                        init[...] = np.array(mx.array(init_value, mx.bfloat16).view(mx.uint16))
                    else:
                        init[...] = init_value
                elif dtype in (mx.float32, mx.float16):
                    init[...] = np.nan
                elif dtype == mx.bfloat16:
                    init[...] = 0x7FC0
                else:
                    init.view(np.uint8)[...] = INT_POISON
                b = self._add(pname, "output", init)
                b["mx_dtype"], b["shape"] = dtype, shape
        if n_in != len(inputs) or n_out != len(output_shapes):
            raise MetalEmuError("kernel signature does not match the inputs/outputs passed")
        self._layout()

    def _add(self, name, role, view):
        b = {"name": name, "role": role, "src": view, "itemsize": view.itemsize}
        self.buffers.append(b)
        return b

    def _layout(self):
        off = 0
        for b in self.buffers:
            v = b["src"]
            lo = sum(min(0, s * (n - 1)) for s, n in zip(v.strides, v.shape)) if v.size else 0
            hi = sum(max(0, s * (n - 1)) for s, n in zip(v.strides, v.shape)) + v.itemsize if v.size else 0
            ptr = off + GUARD_BYTES - lo
            ptr += (-ptr) % 16
            b["ptr_off"], b["lo"], b["hi"] = ptr, ptr + lo, ptr + hi
            off = ptr + hi
        self.size = off + GUARD_BYTES
        self.store = np.full(self.size + 16, GUARD_FILL, np.uint8)
        start = (-self.store.ctypes.data) % 16
        self.mem = self.store[start: start + self.size]
        self.base = self.mem.ctypes.data
        self.shadow = np.zeros(self.size, np.uint8)
        for b in self.buffers:
            v = b["src"]
            if v.size == 0:
                b["view"] = v
                continue
            b["view"] = _strided(self.mem, v.dtype, v.shape, v.strides, b["ptr_off"])
            b["view"][...] = v
            _strided(self.shadow, np.uint8, v.shape + (v.itemsize,), v.strides + (1,),
                     b["ptr_off"])[...] = 2 if b["role"] == "output" else 1
        self.outs = [b for b in self.buffers if b["role"] == "output"]

    def pointer(self, b):
        return self.base + b["ptr_off"]

    def reset_outputs(self):
        for b in self.outs:
            b["view"][...] = b["src"]

    def output_bytes(self):
        return [np.frombuffer(b["view"].tobytes(), np.uint8) for b in self.outs]

    def outputs(self):
        outs = []
        for b in self.outs:
            a = mx.array(b["view"].copy())
            if b["mx_dtype"] == mx.bfloat16:
                a = a.view(mx.bfloat16)
            outs.append(a.reshape(b["shape"]))
        return outs

    def explain_fault(self, fault):
        kind, off, nbytes, x, y, z = fault
        what = "read" if kind == 1 else "wrote"
        near = min(self.buffers, key=lambda b: 0 if b["lo"] <= off < max(b["hi"], b["lo"] + 1)
                   else min(abs(off - b["lo"]), abs(off - b["hi"])))
        v = near["src"]
        rel = off - near["ptr_off"]
        where = ("inside the span of its elements but in a gap between them"
                 if near["lo"] <= off < near["hi"] else "outside the array")
        return (f"thread {(x, y, z)} {what} {nbytes} bytes at byte offset {rel} from the first element of "
                f"{near['role']} {near['name']!r} (shape {v.shape}, byte strides {v.strides}), {where}"
                + (" (a write to an input)" if kind == 2 and near["role"] != "output" and
                   near["lo"] <= off < near["hi"] else ""))


def _input_view(x, np_dtype, name, row_contiguous):
    """A numpy view of an input with the strides and offset MLX would bind."""
    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            x = x.view(mx.uint16)
        mx.eval(x)
        a = np.asarray(memoryview(x))
        if a.dtype != np_dtype:
            raise MetalEmuError(f"input {name!r} is {a.dtype}, the kernel declares {np_dtype}")
        if row_contiguous and not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)  # MLX copies such inputs before the launch
        return a
    return np.asarray(x, dtype=np_dtype)
