"""The staging copy's side of the engine's sampled check, digests against in-process readings, side by side
(issue 32: the check is the lever on the verified dense push).

The engine checks each push by reading 64 input columns of every matrix (and the embedding's sampled rows,
the tied head's columns, every vector) from the staging copy and from the kernels, and comparing the two.
Both sides are in the engine's process. This times the staging side both ways on a model's shapes with
random bf16 weights (no vLLM needed): SHA-256 digests (what the check did before, and what the trainer
side and ``/weight_checker`` still use) against :class:`Reading` values (the sampled bits kept and compared
directly), and the comparison of one side's readings with the other's against comparing two digests;
"before" gathers every column sample with ``index_select`` (evenly spaced samples now take a strided view).
The kernel side reads its columns through the kernels (no gather), so it saves only its hashing.

    python benchmarks/check_compare.py [--model qwen2.5-0.5b] [--threads 2] [--repeat 3]
"""
from __future__ import annotations

import argparse

import torch

from faircast_bench.builders import ARCHITECTURES, real_causal_lm
from timing import best


def staged(model: str) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """The model's served tensors (its own parameter names and shapes, random bf16 values) and whether it
    ties its LM head to the embedding."""
    shapes = real_causal_lm(model, device="meta")
    g = torch.Generator().manual_seed(0)
    return ([(name, (torch.randn(*p.shape, generator=g) * 0.02).to(torch.bfloat16))
             for name, p in shapes.named_parameters()], bool(shapes.config.tie_word_embeddings))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(ARCHITECTURES), default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--columns", type=int, default=64)
    args = ap.parse_args()
    from faircast_ds.vllm.transfer import checksums
    from faircast_ds.vllm.transfer.checksums import served_checksums

    torch.set_num_threads(args.threads)
    tensors, tied = staged(args.model)
    sample = (args.columns, 7)
    digests = served_checksums(tensors, prefix="", sample=sample, tied=tied)
    readings = served_checksums(tensors, prefix="", sample=sample, tied=tied, readings=True)
    other = served_checksums(tensors, prefix="", sample=sample, tied=tied, readings=True)
    other_digests = served_checksums(tensors, prefix="", sample=sample, tied=tied)
    assert set(digests) == set(readings) and all(readings[k] == other[k] for k in readings)
    elements = sum(r.bits.numel() for r in readings.values())
    strided = checksums.take_columns

    def gathered_by_index(t: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        return t.index_select(1, columns)

    def before() -> None:  # every column sample gathered by index_select, then hashed
        checksums.take_columns = gathered_by_index
        try:
            served_checksums(tensors, prefix="", sample=sample, tied=tied)
        finally:
            checksums.take_columns = strided

    rows = {
        "staged side, before": best(before, args.repeat),
        "staged side, SHA-256 digests": best(lambda: served_checksums(tensors, prefix="", sample=sample, tied=tied),
                                             args.repeat),
        "staged side, readings": best(lambda: served_checksums(tensors, prefix="", sample=sample, tied=tied,
                                                               readings=True), args.repeat),
        "compare: digests": best(lambda: [digests[k] == other_digests[k] for k in digests], args.repeat),
        "compare: readings": best(lambda: [readings[k] == other[k] for k in readings], args.repeat),
    }
    print(f"# {args.model} shapes, {sum(t.numel() for _, t in tensors) / 1e6:.1f}M parameters, "
          f"{'tied' if tied else 'own'} head, "
          f"{args.columns} columns per matrix: {len(readings)} readings of {elements / 1e6:.1f}M elements; "
          f"{args.threads} threads, best of {args.repeat}")
    for name, seconds in rows.items():
        print(f"{name:<32} {seconds:8.3f} s")
    digest_side = rows["staged side, SHA-256 digests"] + rows["compare: digests"]
    reading_side = rows["staged side, readings"] + rows["compare: readings"]
    was = rows["staged side, before"] + rows["compare: digests"]
    print(f"readings / digests (staged side and compare): {reading_side / digest_side:.2f}x "
          f"({reading_side:.3f} s against {digest_side:.3f} s)")
    print(f"now / before (index_select and SHA-256): {reading_side / was:.2f}x ({reading_side:.3f} s against "
          f"{was:.3f} s)")


if __name__ == "__main__":
    main()
