"""The ``fair_cast`` section: its model and validation (``section``), where it comes from (``origin``:
the DeepSpeed config or ``FAIRCAST_DS_CONFIG``), and the key table generated from it (``keys``)."""
