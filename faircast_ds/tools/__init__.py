"""The ``faircast-ds`` command (``cli``) and what it runs: ``predict``, ``inspect``, ``bench/``."""
