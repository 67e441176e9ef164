"""One module per CLI verb: ``sweep`` (and ``check``), ``report``, ``recommend``, ``tune``."""
