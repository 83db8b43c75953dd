"""The trainer side of a sampled weight check at Qwen3-0.6B's embedding shape: the whole embedding's digest
against its sampled rows' (issue 32 item 5). Prints both times and their ratio, measured side by side.

    python benchmarks/check_embedding.py
"""
import torch
from faircast_ds.vllm.transfer.checksums import checksum, sample_rows, sampled_digest
from timing import best
t = (torch.randn(151936, 1024) * 0.02).to(torch.bfloat16)
whole = best(lambda: checksum(t))
rows = best(lambda: sampled_digest(t.index_select(0, sample_rows("model.embed_tokens.weight", 151936, 1024, 64, 3)), 1, 3, "rows"))
n = len(sample_rows("model.embed_tokens.weight", 151936, 1024, 64, 3))
print(f"embedding 151936x1024 bf16: whole digest {whole*1e3:.0f} ms, sampled {n} rows {rows*1e3:.1f} ms, ratio {rows/whole:.3f}")
