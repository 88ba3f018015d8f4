"""Array metrics shared by calibration and evaluation: log-probabilities, KL divergence, cosine
similarity, relative error, and outlier statistics of key channels."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def kl_divergence(logp_ref: mx.array, logp: mx.array) -> mx.array:
    """KL(ref || q) in nats along the last axis, from log-probabilities."""
    return mx.sum(mx.exp(logp_ref) * (logp_ref - logp), axis=-1)


def cosine_rows(a: mx.array, b: mx.array) -> mx.array:
    """Cosine similarity of matching vectors along the last axis (0 vs 0 counts as 1)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    na, nb = mx.linalg.norm(a, axis=-1), mx.linalg.norm(b, axis=-1)
    dot = mx.sum(a * b, axis=-1)
    both_zero = (na == 0) & (nb == 0)
    return mx.where(both_zero, 1.0, dot / mx.maximum(na * nb, 1e-30))


def relative_error(approx: mx.array, exact: mx.array) -> float:
    """``||approx - exact||_F / ||exact||_F``."""
    exact = exact.astype(mx.float32)
    num = mx.linalg.norm((approx.astype(mx.float32) - exact).reshape(-1))
    den = mx.linalg.norm(exact.reshape(-1))
    return float(num / mx.maximum(den, 1e-30))


def gini(x) -> float:
    """Gini coefficient of non-negative values: 0 for all equal, (n-1)/n for one non-zero."""
    v = np.sort(np.asarray(x, dtype=np.float64).reshape(-1))
    n, total = v.size, v.sum()
    if n == 0 or total <= 0:
        return 0.0
    ranks = np.arange(1, n + 1)
    return float(2 * np.sum(ranks * v) / (n * total) - (n + 1) / n)


def kurtosis(x) -> float:
    """Pearson kurtosis ``E[(x-mu)^4] / var^2`` (3 for a Gaussian)."""
    v = np.asarray(x, dtype=np.float64).reshape(-1)
    c = v - v.mean()
    var = np.mean(c * c)
    return float(np.mean(c**4) / var**2) if var > 0 else 0.0


def channel_stats(x) -> dict:
    """Outlier statistics of vectors ``x`` of shape ``(..., tokens, channels)``
    averaged over the leading axes (heads): kurtosis of the entries, max/median
    of per-channel mean magnitude, Gini of per-channel energies."""
    a = np.asarray(x, dtype=np.float64)
    a = a.reshape(-1, a.shape[-2], a.shape[-1])
    kurt, ratio, gin = [], [], []
    for h in a:
        mag = np.mean(np.abs(h), axis=0)
        kurt.append(kurtosis(h))
        med = np.median(mag)
        ratio.append(float(mag.max() / med) if med > 0 else float("inf"))
        gin.append(gini(np.sum(h * h, axis=0)))
    return {"kurtosis": float(np.mean(kurt)), "max_median": float(np.mean(ratio)), "gini": float(np.mean(gin))}
