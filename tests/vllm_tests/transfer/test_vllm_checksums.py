"""The trainer side of /weight_checker's sampled checks (faircast_ds.vllm.transfer.checksums), against an
oracle written from the docstrings: SHA-256 of the canonical bf16 bits of the chosen input columns of
each matrix, the columns every (width // k)-th from an offset hashed from "<version>:<name>". No vLLM
needed; the engine side's agreement is what the `vllm serve` tests check (a sampled delta push that
the engine's read-back disagreed with would raise there)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from faircast_ds.vllm.transfer.checksums import ChecksumCollector, sample_columns, served_checksums

PREFIX = "dp0:pp0:pcp0:tp0:"


def oracle_columns(name: str, width: int, k: int, version: int) -> list[int]:
    stride = width // k
    offset = int.from_bytes(hashlib.sha256(f"{version}:{name}".encode()).digest()[:8], "little") % stride
    return [offset + i * stride for i in range(k)]


def oracle_digest(matrix: torch.Tensor, cols: list[int]) -> str:
    bits = matrix.contiguous().view(torch.int16).numpy()[:, cols].copy()
    exp_zero = (bits.astype("int32") & 0x7F80) == 0  # ±0 and subnormals count as +0
    bits[exp_zero] = 0
    return hashlib.sha256(bits.tobytes()).hexdigest()


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    return {"model.embed_tokens.weight": w(50, 16),
            "model.layers.0.self_attn.q_proj.weight": w(16, 16), "model.layers.0.self_attn.k_proj.weight": w(8, 16),
            "model.layers.0.self_attn.v_proj.weight": w(8, 16), "model.layers.0.self_attn.o_proj.weight": w(16, 16),
            "model.layers.0.mlp.down_proj.weight": w(16, 48), "model.layers.0.input_layernorm.weight": w(16)}


def test_columns_are_evenly_spaced_inside_the_matrix_and_move_with_the_version():
    for width, k in ((1024, 64), (3072, 64), (100, 7), (5, 64)):
        cols = sample_columns("model.layers.3.mlp.down_proj.weight", width, k, version=11).tolist()
        kk = min(k, width)
        assert cols == oracle_columns("model.layers.3.mlp.down_proj.weight", width, kk, 11)
        assert len(cols) == kk and 0 <= min(cols) and max(cols) < width
    moves = {tuple(sample_columns("x.o_proj.weight", 1024, 64, v).tolist()) for v in range(20)}
    assert len(moves) > 10  # 16 possible offsets: the columns move from update to update


def test_sampled_digests_match_the_oracle_fused_layers_included():
    w = weights()
    w["model.layers.0.self_attn.o_proj.weight"][0, 3] = -0.0  # canonical: counts as +0
    got = served_checksums(w.items(), sample=(4, 7))
    qkv = torch.cat([w[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    key = "model.layers.0.self_attn.qkv_proj.weight"
    assert got[PREFIX + key] == "cols4@v7:" + oracle_digest(qkv, oracle_columns(key, 16, 4, 7))
    key = "model.layers.0.mlp.down_proj.weight"
    assert got[PREFIX + key] == "cols4@v7:" + oracle_digest(w[key], oracle_columns(key, 48, 4, 7))
    # the embedding by rows: 4 columns of 16 are a quarter, so ceil(50 / 4) = 13 of its 50 rows
    key = "model.embed_tokens.weight"
    rows = oracle_columns(key, 50, 13, 7)
    assert got[PREFIX + key] == "rows13@v7:" + oracle_digest(w[key][rows], list(range(16)))
    # vectors stay whole
    key = "model.layers.0.input_layernorm.weight"
    assert got[PREFIX + key] == oracle_digest(w[key].reshape(1, -1), list(range(16)))
    # no head served: the engine's logits come from the embedding, read as a matrix by columns
    assert got[PREFIX + "lm_head.weight"] == "cols4@v7:" + oracle_digest(
        w["model.embed_tokens.weight"], oracle_columns("lm_head.weight", 16, 4, 7))
    assert len(got) == 6


def test_an_embedding_row_is_seen_only_when_sampled():
    w = weights()
    key = "model.embed_tokens.weight"
    rows = oracle_columns(key, 50, 13, 7)
    base = served_checksums(w.items(), sample=(4, 7))[PREFIX + key]
    for row, seen in ((rows[3], True), (next(r for r in range(50) if r not in rows), False)):
        changed = dict(w)
        changed[key] = w[key].clone()
        changed[key][row, 5] += 0.25
        assert (served_checksums(changed.items(), sample=(4, 7))[PREFIX + key] != base) == seen
        assert served_checksums(changed.items())[PREFIX + key] != served_checksums(w.items())[PREFIX + key]


def test_a_collector_gives_whole_and_sampled_checksums_from_one_walk():
    w = weights()
    c = ChecksumCollector(sample=(4, 3))
    for name, t in w.items():  # each tensor handed over once, as a ZeRO-3 walk would
        c.add(name, t.clone())
    c.done()
    assert c.full == served_checksums(w.items()) and c.sampled == served_checksums(w.items(), sample=(4, 3))
    assert all(not v.startswith("cols") for v in c.full.values())


def test_a_changed_column_is_seen_only_when_sampled_and_a_wrong_version_never_matches():
    w = weights()
    key = "model.layers.0.self_attn.o_proj.weight"
    base = served_checksums(w.items(), sample=(4, 7))
    cols = oracle_columns(key, 16, 4, 7)
    hit, miss = dict(w), dict(w)
    hit[key] = w[key].clone()
    hit[key][5, cols[1]] += 0.25
    miss[key] = w[key].clone()
    miss[key][5, next(c for c in range(16) if c not in cols)] += 0.25
    assert served_checksums(hit.items(), sample=(4, 7))[PREFIX + key] != base[PREFIX + key]
    assert served_checksums(miss.items(), sample=(4, 7))[PREFIX + key] == base[PREFIX + key]  # what sampling gives up
    assert served_checksums(miss.items())[PREFIX + key] != served_checksums(w.items())[PREFIX + key]
    other = served_checksums(w.items(), sample=(4, 8))
    assert other[PREFIX + key] != base[PREFIX + key]


def test_a_missing_fused_part_is_an_error():
    w = weights()
    del w["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match="missing parts"):
        served_checksums(w.items(), sample=(4, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_chunked_checksum_is_sha256_of_the_canonical_bits(dtype, monkeypatch):
    from faircast_ds.vllm.transfer import checksums

    monkeypatch.setattr(checksums, "_HASH_CHUNK", 1000)  # several chunks, a partial last one
    x = torch.randn(300, 37, generator=torch.Generator().manual_seed(3)).to(dtype)
    tiny = torch.finfo(dtype).tiny
    special = [0.0, -0.0, tiny / 4, -tiny / 2, tiny, float("nan"), float("-inf"), 3.0]
    x.view(-1)[:len(special)] = torch.tensor(special, dtype=torch.float64).to(dtype)
    itype = {2: torch.int16, 4: torch.int32}[x.element_size()]
    ints = x.t().contiguous().view(itype).numpy().copy()
    exponent = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}[dtype]
    ints[(ints.astype("int64") & exponent) == 0] = 0  # ±0 and subnormals hash as +0, NaN kept
    assert checksums.checksum(x.t()) == hashlib.sha256(ints.tobytes()).hexdigest()


def test_touched_columns_and_rows_join_the_sample_bounded_like_it():
    """Issue 32 item 5: the columns (embedding rows) an update changed are read with the sample — a fused
    layer's parts' together, up to k per matrix and the embedding's sampled-row count, the rest chosen
    evenly — and a change in an unsampled column is then seen."""
    from faircast_ds.vllm.transfer.checksums import touched_lines

    w = weights()
    t = lambda *v: torch.tensor(v)  # noqa: E731
    touched = {"model.layers.0.self_attn.q_proj.weight": (t(0, 1), t(2, 9)),
               "model.layers.0.self_attn.v_proj.weight": (t(3,), t(9, 11)),
               "model.layers.0.mlp.down_proj.weight": (t(0,), torch.arange(0, 48, 2)),  # 24 columns > k = 4
               "model.embed_tokens.weight": (t(7, 40), t(0, 1, 2)),
               "model.layers.0.input_layernorm.weight": (t(0,), t(0,))}  # not a matrix: nothing
    lines = touched_lines(w.items(), touched, 4, 7)
    assert set(lines) == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.down_proj.weight",
                          "model.embed_tokens.weight"}
    # a tied head computes with the embedding: its touched columns are the head's too
    assert touched_lines(w.items(), touched, 4, 7, tied=True)["lm_head.weight"].tolist() == [0, 1, 2]
    assert lines["model.layers.0.self_attn.qkv_proj.weight"].tolist() == [2, 9, 11]
    assert lines["model.embed_tokens.weight"].tolist() == [7, 40]  # rows, for the embedding
    down = lines["model.layers.0.mlp.down_proj.weight"].tolist()
    assert len(down) == 4 and set(down) <= set(range(0, 48, 2)) and len({b - a for a, b in zip(down, down[1:])}) == 1

    key = "model.layers.0.self_attn.o_proj.weight"
    cols = oracle_columns(key, 16, 4, 7)
    miss = next(c for c in range(16) if c not in cols)
    changed = dict(w)
    changed[key] = w[key].clone()
    changed[key][5, miss] += 0.25
    extra = {key: torch.tensor([miss])}
    base = served_checksums(w.items(), sample=(4, 7), extra=extra)[PREFIX + key]
    assert base == "cols4@v7:" + oracle_digest(w[key], sorted(cols + [miss]))
    assert served_checksums(changed.items(), sample=(4, 7), extra=extra)[PREFIX + key] != base
    assert served_checksums(changed.items(), sample=(4, 7))[PREFIX + key] == \
        served_checksums(w.items(), sample=(4, 7))[PREFIX + key]  # without it the sample misses the change
    key = "model.embed_tokens.weight"
    rows = oracle_columns(key, 50, 13, 7)
    row = next(r for r in range(50) if r not in rows)
    got = served_checksums(w.items(), sample=(4, 7), extra={key: torch.tensor([row])})[PREFIX + key]
    assert got == "rows14@v7:" + oracle_digest(w[key][sorted(rows + [row])], list(range(16)))


def test_a_tied_head_is_checked_as_the_embedding_read_by_columns_and_an_own_head_as_itself():
    """The engine reports a tied LM head under ``lm_head.weight``, read through the head's kernel (its
    logits; on CPU a packed copy of the embedding). The trainer side counts the embedding there when no
    head of its own is served (or when told the engine ties), and the served head otherwise."""
    w = weights()
    emb = w["model.embed_tokens.weight"]
    whole = served_checksums(w.items())
    assert whole[PREFIX + "lm_head.weight"] == oracle_digest(emb, list(range(16)))  # every column
    assert served_checksums(w.items(), tied=False).get(PREFIX + "lm_head.weight") is None

    head = (torch.randn(50, 16, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    own = dict(w, **{"lm_head.weight": head})
    cols = oracle_columns("lm_head.weight", 16, 4, 7)
    assert served_checksums(own.items(), sample=(4, 7))[PREFIX + "lm_head.weight"] == \
        "cols4@v7:" + oracle_digest(head, cols)
    for tied in (True, None):  # told: the served head is not what the engine computes with
        got = served_checksums(own.items(), sample=(4, 7), tied=tied)[PREFIX + "lm_head.weight"]
        assert (got == "cols4@v7:" + oracle_digest(emb, cols)) == (tied is True)
    # the head is read with the columns an update touched, when given
    miss = next(c for c in range(16) if c not in cols)
    got = served_checksums(w.items(), sample=(4, 7), extra={"lm_head.weight": torch.tensor([miss])})
    assert got[PREFIX + "lm_head.weight"] == "cols4@v7:" + oracle_digest(emb, sorted(cols + [miss]))


def oracle_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Canonical-bit equality written from the module docstring with numpy: ±0 and subnormals count as +0."""
    exponent = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}[a.dtype]
    itype = {2: "int16", 4: "int32"}[a.element_size()]
    x = a.contiguous().view(getattr(torch, itype)).numpy().astype("int64")
    y = b.contiguous().view(getattr(torch, itype)).numpy().astype("int64")
    x[(x & exponent) == 0] = 0
    y[(y & exponent) == 0] = 0
    return x.shape == y.shape and bool((x == y).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_reading_is_equal_exactly_when_the_canonical_bits_are(dtype):
    from faircast_ds.vllm.transfer.checksums import Reading

    g = torch.Generator().manual_seed(5)
    tiny = torch.finfo(dtype).tiny
    base = torch.randn(40, 7, generator=g).to(dtype)
    base.view(-1)[:4] = torch.tensor([float("nan"), 1.0, tiny, -3.0], dtype=torch.float64).to(dtype)
    cases = []
    for flat, value in ((5, -0.0), (6, tiny / 4), (7, -tiny / 2)):  # flushed: counts as +0 against a +0
        a, b = base.clone(), base.clone()
        a.view(-1)[flat], b.view(-1)[flat] = 0.0, value
        cases.append((a, b))
    ints = {2: torch.int16, 4: torch.int32}[base.element_size()]
    one = base.clone()
    one.view(-1)[100:101].view(ints).add_(1)  # one element, its last mantissa bit
    cases += [(base, base.clone()), (base, one)]
    nan2 = base.clone()  # another NaN payload is another value
    nan2.view(-1)[0:1].view(ints).add_(1)
    cases.append((base, nan2))
    seen = []
    for a, b in cases:
        got = Reading("cols4@v7", a) == Reading("cols4@v7", b)
        assert got == oracle_equal(a, b)
        seen.append(got)
    assert seen == [True, True, True, True, False, False]  # the cases cover both answers
    assert Reading("cols4@v7", base) != Reading("cols4@v8", base.clone())  # another sample is never equal
    assert Reading("whole", base) != Reading("whole", base[:39].clone())
    assert Reading("whole", base) != "whole"  # never equal to a digest


def test_readings_agree_with_the_digests_on_every_name():
    """The engine compares readings in process; the trainer side and /weight_checker use digests. The two must
    say the same thing about the same pair of weight sets, changed and unchanged names alike."""
    w = weights()
    cols = oracle_columns("model.layers.0.self_attn.o_proj.weight", 16, 4, 7)
    changed = {k: v.clone() for k, v in w.items()}
    changed["model.layers.0.self_attn.o_proj.weight"][3, cols[2]] += 0.5     # sampled: seen
    down = "model.layers.0.mlp.down_proj.weight"
    at = oracle_columns(down, 48, 4, 7)[0]                       # a sampled column
    w[down][1, at], changed[down][1, at] = 0.0, -0.0                          # -0 counts as +0: unchanged
    changed["model.layers.0.input_layernorm.weight"][2] += 1.0                # vector: always seen
    changed["model.layers.0.self_attn.k_proj.weight"][0, :] += 1.0            # a fused part: seen in qkv
    for kw in ({"sample": (4, 7)}, {"sample": (4, 7), "extra": {"model.embed_tokens.weight": torch.tensor([3])}}):
        digests = [served_checksums(x.items(), **kw) for x in (w, changed)]
        readings = [served_checksums(x.items(), readings=True, **kw) for x in (w, changed)]
        assert set(digests[0]) == set(readings[0]) == set(readings[1])
        verdict = {k: digests[0][k] == digests[1][k] for k in digests[0]}
        assert verdict == {k: readings[0][k] == readings[1][k] for k in readings[0]}
        assert sorted(k for k, same in verdict.items() if not same) == sorted(
            PREFIX + k for k in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight",
                                 "model.layers.0.self_attn.qkv_proj.weight"))


def test_taking_columns_is_index_select_whether_evenly_spaced_or_not():
    from faircast_ds.vllm.transfer.checksums import take_columns

    t = torch.randn(9, 50, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for cols in ([3, 10, 17, 24], [0, 49], [7], [2, 3, 9], [5, 9, 13, 40], list(range(50)), [49, 30]):
        c = torch.tensor(cols)
        assert torch.equal(take_columns(t, c).view(torch.int16), t.view(torch.int16)[:, cols]), cols
        assert take_columns(t, c).is_contiguous()


def test_readings_of_a_walk_that_reuses_its_buffer_are_copies():
    """A ZeRO-3 walk hands each tensor in a buffer valid only until the next: a reading keeps its own bits."""
    w = weights()
    digests = served_checksums(w.items(), sample=(4, 7))

    def walk():
        buffer = torch.empty(10_000, dtype=torch.bfloat16)
        for name, t in w.items():
            view = buffer[:t.numel()].view(t.shape)
            view.copy_(t)
            yield name, view
            view.fill_(7.0)  # the next tensor overwrites the buffer

    readings = served_checksums(walk(), sample=(4, 7), readings=True)
    again = served_checksums(w.items(), sample=(4, 7), readings=True)
    assert set(readings) == set(digests) and all(readings[k] == again[k] for k in again)


def test_taking_columns_out_of_range_is_refused_as_index_select_refuses_it():
    from faircast_ds.vllm.transfer.checksums import take_columns

    t = torch.zeros(3, 16, dtype=torch.bfloat16)
    with pytest.raises((IndexError, RuntimeError)):
        take_columns(t, torch.tensor([8, 16]))


def test_the_engine_check_compares_in_process_and_names_every_difference():
    """staging_check on a module with vectors only (no vLLM kernel involved): ±0 passes, a changed element,
    a staged name the engine lacks and a whole (verify=full) check are each reported as the digests say."""
    from faircast_ds.vllm.transfer.checksums import staging_check

    class Norms(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.randn(32).to(torch.bfloat16))
            self.b = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))

    model = Norms()
    model.a.data[3] = 0.0
    staged = [("a", model.a.detach().clone()), ("b", model.b.detach().clone())]
    staged[0][1][3] = -0.0
    for columns in (64, 0):
        assert staging_check(model, torch.bfloat16, staged, columns, 5, tied=False) == []
    moved = [("a", staged[0][1].clone()), ("b", staged[1][1])]
    moved[0][1][7] += 1.0
    for columns in (64, 0):
        assert staging_check(model, torch.bfloat16, moved, columns, 5, tied=False) == ["a"]
        assert staging_check(model, torch.bfloat16, staged + [("c", torch.ones(4, dtype=torch.bfloat16))],
                             columns, 5, tied=False) == ["c"]
