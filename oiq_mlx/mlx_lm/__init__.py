"""Everything that touches mlx-lm: attention routing and the prompt-cache registry, OIQ prompt
caches for a model, model loading (GGUF included), per-layer bit calibration, sharding under
``mlx.launch``, and the hooks into ``mlx_lm.server``."""
