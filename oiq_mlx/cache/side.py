"""Storage of one side (keys or values) of one layer of an OIQ cache."""

from __future__ import annotations

import mlx.core as mx

from ..core import fp4
from ..core.codec import FP16_MAX, split_rows
from ..core.rotation import rotate, unrotate

class SideStorage:
    """Storage of one side (keys or values) of one layer: ``cache.k`` and ``cache.v``.

    Public for the modules that read a cache (attention, evaluation, benchmarks):
    ``bits``, ``dim`` / ``head_dim``, ``signs``, ``rotated``, ``mean`` (``m``,
    un-rotated, or None), ``lam`` (key scales or None), ``rows`` (packed segment,
    capacity-sized, ``codec.join_rows``) and its views ``codes`` / ``scales``,
    ``sink`` / ``recent`` (full precision,
    ``x - m``), and the domain maps :meth:`packed_to_window` /
    :meth:`window_to_packed`.  Only the cache writes them.
    """

    def __init__(self, bits: int, group_size: int, clip: bool, center: bool, scale_power: float = 0.0,
                 scale_cap: float = 0.0, *, storage: str = "int", which: int = 0):
        self.bits, self.group_size, self.clip, self.center = bits, group_size, clip, center
        # "int", or an fp4 mode: then ``rows`` are the joined key + value rows both sides view
        # (``core/fp4.py``) and ``which`` says which half is this side's (0 keys, 1 values)
        self.storage, self.which = storage, which
        self.scale_power, self.scale_cap = scale_power, scale_cap
        self.head_dim = self.dim = None
        self.signs = self.mean = self.lam = None
        self.rotated = True
        self.rows = None
        self.sink = None
        self.recent = None

    def init(self, x: mx.array, signs: mx.array, dim: int, rotated: bool):
        self.head_dim, self.dim, self.signs, self.rotated = x.shape[-1], dim, signs, rotated

    @property
    def fp4(self) -> bool:
        """The packed segment stores fp4 (MXFP4 / NVFP4) values, not integer codes."""
        return self.storage != "int"

    def split(self, rows: mx.array):
        """``(codes, scales)`` of this side in packed ``rows``, as views."""
        if self.fp4:
            return fp4.split_pair(rows, self.dim, self.storage, self.which)
        return split_rows(rows, self.dim, self.bits, self.group_size)

    @property
    def codes(self):
        """Packed codes ``(B, H, capacity, W)`` uint32: a view of :attr:`rows`, or None."""
        return None if self.rows is None else self.split(self.rows)[0]

    @property
    def scales(self):
        """Group scales ``(B, H, capacity, groups)``: float16 (uint8 for fp4), a view of
        :attr:`rows`, or None."""
        return None if self.rows is None else self.split(self.rows)[1]

    def rotate(self, x: mx.array) -> mx.array:
        return rotate(x, self.signs) if self.rotated else x.astype(mx.float32)

    def unrotate(self, y: mx.array) -> mx.array:
        return unrotate(y, self.signs) if self.rotated else y.astype(mx.float32)

    def packed_to_window(self, y: mx.array) -> mx.array:
        """Dequantized packed vectors (rotated domain, float32) in the window's domain
        (centered, un-rotated): ``unrotate(y) * lam``."""
        y = self.unrotate(y)
        return y if self.lam is None else y * self.lam

    def window_to_packed(self, x: mx.array) -> mx.array:
        """Window rows in the packed segment's domain (float32): ``rotate(x / lam)``."""
        x = x.astype(mx.float32)
        return self.rotate(x if self.lam is None else x / self.lam)

    @property
    def needs_statistics(self) -> bool:
        """True until the mean / key scales this side uses have been estimated."""
        return (self.center and self.mean is None) or (self.scale_power > 0 and self.lam is None)

    def estimate(self, x: mx.array, skip: int):
        """Estimate the statistics on the first chunk ``x`` ``(B, H, L, dim)``, from
        its tokens past the first ``skip`` (the sink tokens, kept in full precision
        anyway, whose outlying keys and values would pull the mean away from the
        tokens that get quantized)."""
        x = x.astype(mx.float32)
        self._estimate(x[:, :, skip:] if x.shape[2] > skip else x)

    def _estimate(self, ref: mx.array):
        """Mean and key scales of the rows (tokens) of ``ref`` ``(B, H, n, d)``.

        A token whose vector (in this head) holds a non-finite value or one
        beyond the float16 range is left out, so that one bad token cannot make
        the statistics of its head non-finite (or overflow the squares) and
        with them every stored vector of the head; a head with no usable token
        gets mean 0 and scale 1.  A head whose every token is used gets exactly
        the plain ``mx.mean`` of all of them, on every device.
        """
        ok = mx.all(mx.abs(ref) <= FP16_MAX, axis=-1, keepdims=True)
        every_row = mx.all(ok, axis=2, keepdims=True)
        inv_n = 1 / mx.maximum(mx.sum(ok, axis=2, keepdims=True).astype(mx.float32), 1.0)

        def mean(x):
            used = mx.sum(mx.where(ok, x, 0.0), axis=2, keepdims=True) * inv_n
            return mx.where(every_row, mx.mean(x, axis=2, keepdims=True), used)

        m = mean(ref) if self.center else None
        if self.scale_power > 0:
            rms = mx.sqrt(mean(mx.square(ref if m is None else ref - m)))
            # only channels louder than the head's median are shrunk: quiet
            # channels are never amplified, and magnitudes only decrease
            median = mx.sort(rms, axis=-1)[..., self.dim // 2 : self.dim // 2 + 1] + 1e-6
            loud = mx.maximum(rms, median) / median
            self.lam = mx.power(loud, self.scale_power)
            if self.scale_cap:
                # and none stays louder than scale_cap times the median
                self.lam = mx.maximum(self.lam, loud / self.scale_cap)
        self.mean = m

    def arrays(self) -> list:
        """Every array this side holds."""
        # fp4: both sides view one joined buffer, counted with the keys
        rows = None if self.fp4 and self.which else self.rows
        return [a for a in (rows, self.sink, self.recent, self.mean, self.signs, self.lam) if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

