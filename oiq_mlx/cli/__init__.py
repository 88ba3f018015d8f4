"""The console scripts: ``oiq-generate``, ``oiq-cache-prompt`` and ``oiq-server``, one module each,
over the options they share (:mod:`oiq_mlx.cli.options`)."""
