"""The math, with no kernels and nothing of mlx-lm: rotation, the reference codec (the spec the
Metal kernels are held to), the validated configuration and presets, array metrics."""
