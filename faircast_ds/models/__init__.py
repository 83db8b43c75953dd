"""Models the recipes load: published checkpoints by name (``pretrained``) and the fp32-summed bf16 GEMM for
CPUs without AVX-512 (``gemm``). The randomly initialised builders the tests, jobs and benchmarks share live
beside the package (``faircast_bench.builders``)."""
