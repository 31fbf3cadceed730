"""What the engine integrations (vLLM, SGLang) share: ``steps`` (requests from engine steps),
``settle_process``, ``final_flush`` and ``guard``."""
