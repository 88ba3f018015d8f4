"""Every kernel instantiation `dispatch` can request in production, and the launch parameters each
takes at run time.  The emulator tests check that each one ran (tests/kernels/test_kernels.py);
``scripts/check_metal.py`` compiles each one on a Mac before testing."""

from __future__ import annotations

import mlx.core as mx

from ..core import codec
from .source import SUPPORTED_DIMS
from .decode_attention import MAX_QUERY_ROWS, PARTS_PER_THREADGROUP, max_query_rows
from .quantize import ROWS_PER_THREADGROUP

# cache dtypes (fp segments, quantize input, dequantize output); Metal has no float64
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
QUERY_ROWS = tuple(1 << i for i in range(MAX_QUERY_ROWS.bit_length()))  # 1, 2, 4, 8
MASK_MODES = {0: "none", 1: "causal", 2: "bool array", 3: "additive array"}


def production_instantiations():
    """``(kernel name, ((template name, value), ...))`` for every instantiation dispatch can launch:
    quantize (T, D), dequantize (OutT, D), decode attention (FT, D, QB, TGP), merge (OutT, D): the
    merge writes the queries' dtype."""
    out = []
    for d in SUPPORTED_DIMS:
        for dt in DTYPES:
            out.append(("oiq_quantize", (("T", dt), ("D", d), ("ROWS", ROWS_PER_THREADGROUP))))
            out.append(("oiq_dequantize", (("OutT", dt), ("D", d))))
            for qb in (qb for qb in QUERY_ROWS if qb <= max_query_rows(d)):
                out.append(("oiq_decode_attention", (("FT", dt), ("D", d), ("QB", qb), ("TGP", PARTS_PER_THREADGROUP))))
            out.append(("oiq_decode_merge", (("OutT", dt), ("D", d))))
    return out


def codec_params(d: int):
    """The (bits, group size) pairs a head dimension d can be quantized with."""
    return [(b, g) for b in codec.SUPPORTED_BITS for g in codec.SUPPORTED_GROUP_SIZES if d % g == 0]
