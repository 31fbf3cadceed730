"""What a run recorded, read back and told: ``render`` (the text and JSON report), ``explain``,
``diagnose``, ``timeline``, ``diff``, ``serving``, ``engine_requests``, ``request_log``, ``figures``
and ``cost`` (the census's own cost, estimated from measured prices)."""
