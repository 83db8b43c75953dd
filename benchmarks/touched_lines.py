"""What the engine's receiver pays to note the rows and columns a delta touched (issue 32 item 5), at
Qwen3-0.6B's embedding shape (151,936 x 1,024 bf16, its largest tensor): ``delta.touched_lines`` beside
the apply it precedes (``delta.apply`` / ``delta.apply_bitmap`` of the same payload), for a change list
(1% of the elements changed) and a bitmap (10%, what one RL step under dither changes). Prints both
times and their ratio, measured side by side in one run (best of 3).

    python benchmarks/touched_lines.py
"""
from __future__ import annotations


import torch

from faircast_ds.export import delta
from timing import best

ROWS, COLS = 151936, 1024


def main() -> None:
    g = torch.Generator().manual_seed(0)
    target = (torch.randn(ROWS, COLS, generator=g) * 0.02).to(torch.bfloat16)
    numel = target.numel()
    for share, encoding in ((0.01, delta.COO), (0.10, delta.BITMAP)):
        mask = torch.rand(numel, generator=g) < share
        index = mask.nonzero().view(-1)
        values = delta.bits_view(target)[index] + 1
        first = index.to(torch.int32) if encoding == delta.COO else delta.mask_to_bitmap(mask)
        assert delta.choose(numel, index.numel(), 2) == encoding
        apply = (lambda: delta.apply(target, first, values)) if encoding == delta.COO else \
            (lambda: delta.apply_bitmap(target, first, values))
        t_apply = best(apply)
        t_lines = best(lambda: delta.touched_lines(target.shape, encoding, first))
        rows, cols = delta.touched_lines(target.shape, encoding, first)
        print(f"{delta.ENCODINGS[encoding]:6s} {share:4.0%} changed ({index.numel():,} elements): apply "
              f"{t_apply * 1e3:7.1f} ms, touched_lines {t_lines * 1e3:7.1f} ms, ratio {t_lines / t_apply:.2f} "
              f"({rows.numel():,} rows, {cols.numel():,} columns touched)")


if __name__ == "__main__":
    main()
