"""``faircast-ds bench``: the casts' throughput (``casts``) and real architectures under DeepSpeed
(``model``, with its launched workers ``model_worker`` and ``push_worker``); ``table`` formats both."""
