"""GPU transport pieces prepared for a push that does not exist yet, kept out of the installed library.

``buckets`` plans a rank's served slices into fixed-size buckets and packs/unpacks them; ``bucket_stream``
moves those buckets through two slots an engine lends (CUDA IPC on a GPU, a memfd stand-in on CPU) under
the same authenticated channel as the weight planes. No push path uses them: ``benchmarks/gpu_check.py
--ipc`` times them when a GPU is lent and ``tests/export/test_buckets.py`` checks them on CPU. They live
beside the package (like ``faircast_jobs``) and are not installed; import them from a checkout's root.
"""
