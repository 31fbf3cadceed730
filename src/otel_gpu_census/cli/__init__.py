"""The ``otel-gpu-census`` command: ``main`` (its subcommands), ``launcher`` (starting a program under
the census), ``doctor`` and ``argtypes``. ``python -m otel_gpu_census.cli`` runs it too."""
