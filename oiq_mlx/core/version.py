"""The package version (also ``oiq_mlx.__version__``), recorded in evaluation and benchmark results."""

__version__ = "0.1.0"
