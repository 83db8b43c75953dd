"""Beside the package, not installed: ``python3 -m faircast_bench`` (from the repository root) times the casts
(``casts``) and real architectures under DeepSpeed (``model``, with the workers it launches, ``model_worker``
and ``push_worker``; ``table`` formats both); ``builders`` (tiny and real-architecture models, randomly
initialised) and ``zero_init`` (those built under ``deepspeed.zero.Init``) are the models the tests, the jobs
and the benchmarks share."""
