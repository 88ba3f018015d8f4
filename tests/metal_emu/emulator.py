"""Run an `mx.fast.metal_kernel` on the CPU by compiling MLX's own generated Metal text with g++.

`launch(kernel, **kwargs)` takes exactly the keyword arguments of calling the
kernel and returns what the kernel would: a list of mx arrays. The Metal source
is the text MLX prints with ``verbose=True`` while tracing the call inside
``mx.export_function`` (the CPU build cannot run it, but it can generate it).
"""

import ctypes
import hashlib
import os
import re
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
CXX = os.environ.get("OIQ_EMU_CXX", "g++")
CXXFLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-fno-strict-aliasing", "-fwrapv", "-w"]
ENTRY = "oiq_emu_run"

# Guard bytes around every buffer: reads past the end see poison, writes past
# the end are reported after the run.
GUARD_BYTES = 4096
GUARD_FILL = 0xA5
# Outputs without init_value start as NaN (float types) or 0xCD bytes (others)
# so a test sees any element the kernel did not write.
INT_POISON = 0xCD

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


def generated_source(kernel, **kwargs):
    """The Metal text MLX generates for this call (header, signature, instantiation)."""
    kwargs = dict(kwargs, verbose=True)
    inputs = list(kwargs.pop("inputs"))
    arrays = [x for x in inputs if isinstance(x, mx.array)]

    def traced(*arrs):
        it = iter(arrs)
        ins = [next(it) if isinstance(x, mx.array) else x for x in inputs]
        return kernel(inputs=ins, **kwargs)

    with tempfile.TemporaryFile(mode="w+b") as tmp:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(tmp.fileno(), 1)
            mx.export_function(lambda *a, **k: None, traced, *arrays)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode()
    m = re.search(r"Generated source code for `[^`]*`:\n```\n(.*)\n```", text, re.S)
    if not m:
        raise MetalEmuError("MLX printed no generated source while tracing the kernel:\n" + text)
    return m.group(1)


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
        lambda m: f"static {m['type']} {m['name']}{m['dims']}; "
                  f"::oiq::tg_register(&{m['name']}, sizeof({m['name']}));", body)
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
        f'extern "C" int {ENTRY}(void** bufs, const uint32_t* grid, const uint32_t* tg,\n'
        "                       char* err, int errlen) {\n"
        "  auto body = [&](const oiq::ThreadInfo& ti) {\n"
        f"    {call};\n"
        "  };\n"
        "  return oiq::run_grid(grid, tg, body, err, errlen);\n"
        "}\n"
    )
    return cpp, params


def _compile(cpp, kernel_file, src):
    flags = CXXFLAGS + [f"-I{SHIM_DIR}", f"-I{MLX_INCLUDE}"]
    key = hashlib.sha256(
        "\0".join([cpp, SHIM_HEADER.read_text(), " ".join(flags), CXX]).encode()).hexdigest()[:24]
    so = cache_dir() / f"{key}.so"
    if not so.exists():
        cpp_path = cache_dir() / f"{key}.{os.getpid()}.cpp"  # kept for reading g++ errors
        cpp_path.write_text(cpp)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run([CXX, *flags, str(cpp_path), "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise MetalEmuCompileError(_explain_compile_error(r.stderr, kernel_file, src))
        os.replace(tmp, so)
        os.replace(cpp_path, cache_dir() / f"{key}.cpp")
    lib = _libs.get(key)
    if lib is None:
        lib = ctypes.CDLL(str(so))
        fn = getattr(lib, ENTRY)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.c_char_p, ctypes.c_int]
        _libs[key] = lib
    return getattr(lib, ENTRY)


def _explain_compile_error(stderr, kernel_file, src):
    lines = src.splitlines()
    errors = [l for l in stderr.splitlines() if "error" in l]
    shown = []
    for e in errors[:8]:
        shown.append(e)
        m = re.match(re.escape(kernel_file) + r":(\d+):", e)
        if m and 0 < int(m.group(1)) <= len(lines):
            shown.append(f"    > {lines[int(m.group(1)) - 1].strip()}")
    return ("g++ could not compile the kernel (a Metal feature the emulator lacks, "
            "or a kernel bug):\n" + "\n".join(shown or stderr.splitlines()[:20]))


def _np_type(ctype):
    t = re.sub(r"\b(?:const|constant|device)\b|[*&]", " ", ctype).strip()
    if t not in _NP_TYPES:
        raise MetalEmuUnsupported(f"buffer element type {t!r} is not supported by the emulator")
    return np.dtype(_NP_TYPES[t])


def _padded(arr):
    """A copy of arr inside a guard-filled byte buffer; returns (storage, view)."""
    nbytes = arr.nbytes
    store = np.full(nbytes + 2 * GUARD_BYTES + 16, GUARD_FILL, np.uint8)
    off = GUARD_BYTES + (-store.ctypes.data - GUARD_BYTES) % 16
    view = store[off: off + nbytes].view(arr.dtype).reshape(arr.shape)
    view[...] = arr
    return store, off, view


def _to_numpy(x, np_dtype):
    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            x = x.view(mx.uint16)
        a = np.array(x, copy=True)
        return np.ascontiguousarray(a.astype(np_dtype, copy=False))
    return np.asarray(x, dtype=np_dtype)


def launch(kernel, *, inputs, grid, threadgroup, output_shapes, output_dtypes,
           template=None, init_value=None, verbose=False, stream=None):
    """Run `kernel` on the CPU with the arguments of calling it; returns its outputs."""
    kwargs = dict(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
                  output_dtypes=output_dtypes, init_value=init_value)
    if template:
        kwargs["template"] = template
    src = generated_source(kernel, **kwargs)
    if verbose:
        print(src)
    _check_supported(src)
    name = re.search(r"\[\[kernel\]\]\s*void\s+(\w+)", src).group(1)
    kernel_file = f"{name}.metal"
    cpp, params = _to_cpp(src, kernel_file)

    grid = tuple(int(g) for g in grid)
    tg = tuple(int(t) for t in threadgroup)
    if len(grid) != 3 or len(tg) != 3 or min(tg) < 1:
        raise MetalEmuError(f"grid and threadgroup must be 3 positive ints, got {grid}, {tg}")
    if tg[0] * tg[1] * tg[2] > 1024:
        raise MetalEmuError(f"threadgroup {tg} has more than 1024 threads")

    with _lock:
        fn = _compile(cpp, kernel_file, src)
        buffers = _buffers(params, list(inputs), output_shapes, output_dtypes, init_value)
        ptrs = (ctypes.c_void_p * max(1, len(buffers)))()
        for i, b in enumerate(buffers):
            ptrs[i] = b["store"].ctypes.data + b["off"]
        err = ctypes.create_string_buffer(2048)
        rc = fn(ptrs, (ctypes.c_uint32 * 3)(*grid), (ctypes.c_uint32 * 3)(*tg), err, len(err))
        if rc != 0:
            raise MetalEmuError(f"kernel {name}: {err.value.decode()}")
        for b in buffers:
            s, off, n = b["store"], b["off"], b["view"].nbytes
            if (s[:off] != GUARD_FILL).any() or (s[off + n:] != GUARD_FILL).any():
                raise MetalEmuError(f"kernel {name} wrote outside buffer {b['name']!r}")
        outs = []
        for b in buffers:
            if b["role"] != "output":
                continue
            a = mx.array(b["view"].copy())
            if b["dtype"] == mx.bfloat16:
                a = a.view(mx.bfloat16)
            outs.append(a.reshape(b["shape"]))
        return outs


def _buffers(params, inputs, output_shapes, output_dtypes, init_value):
    """numpy buffers in [[buffer(k)]] order, as MLX would bind them."""
    bufs = []
    n_in = 0
    n_out = 0
    last_input = None
    for p in params:
        if p["idx"] is None:
            continue
        ptype, pname = p["type"], p["name"]
        meta = None
        if last_input is not None:
            for suffix in ("_shape", "_strides", "_ndim"):
                if pname == last_input["name"] + suffix:
                    meta = suffix
        if meta is not None:
            arr_shape = last_input["shape"]
            if meta == "_shape":
                data = np.array(arr_shape if arr_shape else [0], np.int32)
            elif meta == "_strides":
                strides = [int(np.prod(arr_shape[i + 1:])) for i in range(len(arr_shape))]
                data = np.array(strides if strides else [0], np.int64)
            else:
                data = np.array(len(arr_shape), np.int32)
            data = data.astype(_np_type(ptype))
            role, dtype, shape = "meta", None, data.shape
        elif n_in < len(inputs):
            x = inputs[n_in]
            n_in += 1
            data = _to_numpy(x, _np_type(ptype))
            last_input = {"name": pname, "shape": tuple(x.shape) if isinstance(x, mx.array) else ()}
            role, dtype, shape = "input", None, data.shape
        else:
            dtype = output_dtypes[n_out]
            shape = tuple(output_shapes[n_out])
            n_out += 1
            np_dtype = _np_type(ptype)
            data = np.empty(shape, np_dtype)
            if init_value is not None:
                if dtype == mx.bfloat16:
                    data[...] = np.array(mx.array(init_value, mx.bfloat16).view(mx.uint16))
                else:
                    data[...] = init_value
            elif dtype in (mx.float32, mx.float16):
                data[...] = np.nan
            elif dtype == mx.bfloat16:
                data[...] = 0x7FC0
            else:
                data.view(np.uint8)[...] = INT_POISON
            role = "output"
        store, off, view = _padded(data)
        bufs.append({"name": pname, "role": role, "store": store, "off": off, "view": view,
                     "dtype": dtype, "shape": shape})
    if n_in != len(inputs) or n_out != len(output_shapes):
        raise MetalEmuError("kernel signature does not match the inputs/outputs passed")
    return bufs
