"""faircast_jobs.rollouts.is_figures: what TRL's vLLM importance-sampling correction would see of a step's
trainer-engine gap, checked against numbers worked out by hand (math.exp on plain floats)."""
import math

import torch

from faircast_jobs.rollouts import is_figures


def test_figures_on_a_hand_worked_batch():
    # two sequences of three tokens; the mask keeps the first two tokens of sequence 0 and all of sequence 1
    gap = [[0.1, -0.3, 5.0], [0.0, 0.5, 0.7]]  # trainer - engine; 5.0 is masked out: it must not count
    engine = torch.full((2, 3), -2.0, dtype=torch.float64)
    trainer = engine + torch.tensor(gap, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    f = is_figures(trainer, engine, mask)
    kept = [0.1, -0.3, 0.0, 0.5, 0.7]
    ratios = [math.exp(x) for x in kept]
    seqs = [math.exp(0.1 - 0.3), math.exp(0.0 + 0.5 + 0.7)]  # 0.819, 3.32
    assert math.isclose(f["is_token_min"], min(ratios), rel_tol=1e-12)
    assert math.isclose(f["is_token_max"], max(ratios), rel_tol=1e-12)
    assert math.isclose(f["is_token_mean"], sum(ratios) / 5, rel_tol=1e-12)
    assert math.isclose(f["is_seq_min"], min(seqs), rel_tol=1e-12)
    assert math.isclose(f["is_seq_max"], max(seqs), rel_tol=1e-12)
    assert math.isclose(f["is_seq_mean"], sum(seqs) / 2, rel_tol=1e-12)
    assert f["is_seq_masked"] == 0.5  # TRL's default sequence_mask drops a ratio above 3: sequence 1
    # outside [0.8, 1.2]: exp(-0.3)=0.741, exp(0.5)=1.65, exp(0.7)=2.01; inside: exp(0.1)=1.105, exp(0)=1
    assert f["phantom_clip_tokens"] == 3 / 5


def test_without_a_mask_every_token_counts_and_equal_logprobs_give_ratio_one():
    x = torch.randn(4, 6, dtype=torch.float32)
    f = is_figures(x, x.clone(), None)
    assert f["is_token_min"] == f["is_token_max"] == f["is_seq_mean"] == 1.0
    assert f["is_seq_masked"] == 0.0 and f["phantom_clip_tokens"] == 0.0
    g = is_figures(x + 0.05, x, None)  # ratio exp(0.05) per token, exp(0.3) per sequence of 6
    assert math.isclose(g["is_token_mean"], math.exp(0.05), rel_tol=1e-6)
    assert math.isclose(g["is_seq_max"], math.exp(0.3), rel_tol=1e-5)
