"""GPT samples, document splits, blending and the index cache (megacore.data: documents, samples,
blend, dataset), on real tokens artifacts: written through the artifact writer, and through the
mega-tokenize CLI for the chat format's roles."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from datalib import S, lengths, make_tokens
from mega_tokenize.cli import app
from megacore.artifacts import open_artifact
from megacore.cli import run as cli_run
from megacore.data.blend import blend_index
from megacore.data.dataset import MARKER, Dataset, _save
from megacore.data.documents import Documents
from megacore.data.indexed import IndexedReader
from megacore.data.packing import PAD, PAD_ROLE, PackedIndex
from megacore.data.samples import SPLITS, SampleIndex, split_ranges
from megacore.errors import UserError
from tokenize_testlib import corpus, write_jsonl


def naive_sample(docs: list[list[int]], index: SampleIndex, i: int) -> list[int]:
    """Sample i rebuilt in plain Python from the documents and the index's permutations."""
    epoch, k = divmod(i, index.samples_per_epoch)
    concat: list[int] = []
    for pos in index.doc_order[epoch]:
        concat += docs[index.first_doc + int(pos)]
    start = int(index.sample_order[epoch][k]) * S
    return concat[start : start + S + 1]


def test_split_ranges_tile_all_documents():
    for n in (0, 1, 2, 7, 100, 1001):
        for fractions in ([1.0], [0.98, 0.02], [8, 1, 1], [0, 1], [0.5, 0.5, 0.0], [1, 1, 1]):
            ranges = split_ranges(n, fractions)
            assert len(ranges) == 3 and ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a <= b for a, b in ranges)
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(2))
            if n >= 100:  # each range is its fraction of the documents, to a document
                f = np.zeros(3)
                f[: len(fractions)] = fractions
                for (a, b), want in zip(ranges, f / f.sum() * n, strict=True):
                    assert abs((b - a) - want) <= 1
    assert split_ranges(100, [0.98, 0.02]) == [(0, 98), (98, 100), (100, 100)]
    with pytest.raises(ValueError):
        split_ranges(10, [0, 0])


def test_splits_are_disjoint_document_ranges(tmp_path: Path):
    path, m, _ = make_tokens(tmp_path / "t", [lengths(0, 30), lengths(1, 20)])
    docs = Documents(path, m)
    seen: list[int] = []
    for split_id, r in enumerate(split_ranges(len(docs), [6, 2, 2])):
        index = SampleIndex.build(docs, r, split_id=split_id, seq_length=S, num_samples=50, seed=3)
        for order in index.doc_order:
            assert sorted(int(p) + index.first_doc for p in order) == list(range(*r))
        seen += range(*r)
    assert seen == list(range(50))


def test_documents_span_shards(tmp_path: Path):
    path, m, want = make_tokens(tmp_path / "t", [[3, 5], [], [1, 4, 2]], roles=True)
    docs = Documents(path / "manifest.json", m)
    assert len(docs) == 5 and docs.lengths.tolist() == [3, 5, 1, 4, 2] and docs.lengths.dtype == np.int64
    for d, tokens in enumerate(want):
        assert docs.tokens(d).tolist() == tokens
        assert docs.roles(d).tolist() == [t % 5 for t in tokens]
    assert docs.tokens(3, 1, 2).tolist() == want[3][1:3]
    assert docs.roles(3, 1, 2).tolist() == [t % 5 for t in want[3][1:3]]
    plain = Documents(*make_tokens(tmp_path / "p", [[2]])[:2])
    assert plain.roles(0) is None
    with pytest.raises(IndexError):
        docs.tokens(5)


def test_samples_are_slices_of_each_epochs_concatenation(tmp_path: Path):
    path, m, docs = make_tokens(tmp_path / "t", [lengths(2, 25), lengths(3, 15)], roles=True)
    index = SampleIndex.build(Documents(path, m), (0, 40), split_id=0, seq_length=S, num_samples=200, seed=7)
    total = sum(map(len, docs))
    spe = index.samples_per_epoch
    assert spe == (total - 1) // S and index.doc_order.shape[0] == -(-200 // spe)
    inputs = []
    firsts = {d[0] for d in docs if d}
    for i in range(200):
        tokens, roles, positions = index.sample(i)
        assert (
            tokens.dtype == np.int64 and roles.dtype == np.uint8 and tokens.shape == roles.shape == (S + 1,)
        )
        assert tokens.tolist() == naive_sample(docs, index, i)
        assert roles.tolist() == [t % 5 for t in tokens.tolist()]  # aligned with its tokens
        # Positions restart at the sample's start and at every document's first token.
        starts = [j == 0 or int(t) in firsts for j, t in enumerate(tokens)]
        assert [p == 0 for p in positions] == starts and all(
            positions[j] == positions[j - 1] + 1 for j in range(1, S + 1) if not starts[j]
        )
        if i < spe:
            inputs += tokens[:-1].tolist()
    # One epoch: every token but the last partial sample's is an input exactly once.
    assert len(inputs) == len(set(inputs)) == spe * S
    assert total - spe * S <= S
    # Samples are shuffled inside an epoch, and every epoch is a new document and sample order.
    assert index.sample_order[0].tolist() != list(range(spe))
    for e in range(1, index.doc_order.shape[0]):
        assert sorted(index.doc_order[e].tolist()) == list(range(40))
        assert sorted(index.sample_order[e].tolist()) == list(range(spe))
        assert index.doc_order[e].tolist() != index.doc_order[0].tolist()
        assert index.sample_order[e].tolist() != index.sample_order[0].tolist()
    with pytest.raises(IndexError):
        index.sample(200)


def test_sample_index_is_deterministic_and_prefix_stable(tmp_path: Path):
    path, m, _ = make_tokens(tmp_path / "t", [lengths(4, 30)])
    docs = Documents(path, m)

    def build(n: int, seed: int = 11, source_id: int = 0) -> SampleIndex:
        return SampleIndex.build(
            docs, (0, 30), split_id=0, seq_length=S, num_samples=n, seed=seed, source_id=source_id
        )

    short, long = build(5), build(400)
    assert long.doc_order.shape[0] > 2
    assert [short.sample(i)[0].tolist() for i in range(5)] == [long.sample(i)[0].tolist() for i in range(5)]
    again = build(400)
    for name, a in long.arrays().items():
        assert np.array_equal(a, again.arrays()[name]), name
    for other in (build(400, seed=12), build(400, source_id=1)):
        assert not np.array_equal(other.doc_order, long.doc_order)


def test_blend_proportions_at_every_prefix_and_prefix_stability():
    rng = np.random.default_rng(0)
    cases = [
        [0.5, 0.3, 0.2],
        [5, 3, 2],
        [1.0],
        [1, 1],
        [0.9, 0.1],
        *(list(rng.random(3) + 0.01) for _ in range(20)),
    ]
    for weights in cases:
        n = 1000
        ids, within = blend_index(weights, n)
        assert ids.dtype == np.int16 and within.dtype == np.int64 and len(ids) == len(within) == n
        w = np.asarray(weights) / sum(weights)
        counts = np.cumsum(np.eye(len(w), dtype=np.int64)[ids], axis=0)
        assert (np.abs(counts - np.arange(1, n + 1)[:, None] * w) <= 1).all(), weights
        for j in range(len(w)):  # each source's samples are taken in order, none skipped
            assert within[ids == j].tolist() == list(range(int((ids == j).sum())))
        for k in (0, 1, 17, 500):
            a, b = blend_index(weights, k)
            assert np.array_equal(a, ids[:k]) and np.array_equal(b, within[:k])


def test_small_source_runs_epochs_while_big_one_does_not(tmp_path: Path):
    small = make_tokens(tmp_path / "small", [[10, 12, 20]], roles=True)
    big = make_tokens(tmp_path / "big", [lengths(5, 400)], base=1000, roles=True)
    sources = [(small[0], small[1], 0.5), (big[0], big[1], 0.5)]
    ds = Dataset.build(sources, [1.0], "train", S, 300, seed=1)
    assert len(ds) == 300
    assert ds.sources[0].doc_order.shape[0] >= 40  # 2 samples an epoch, 150 samples
    assert ds.sources[1].doc_order.shape[0] == 1
    assert np.bincount(ds.source_ids).tolist() == [150, 150]
    for i in range(len(ds)):
        j, k = int(ds.source_ids[i]), int(ds.source_samples[i])
        tokens, roles, _ = ds[i]
        assert tokens.tolist() == naive_sample(small[2] if j == 0 else big[2], ds.sources[j], k)
        assert roles.tolist() == [t % 5 for t in tokens.tolist()]
    # Same inputs, same batches; the batch is the samples stacked.
    tokens, roles, positions, _ = ds.batch(10, 42)
    assert positions is None  # text, no doc_mask
    again = Dataset.build(sources, [1.0], "train", S, 300, seed=1).batch(10, 42)
    assert tokens.shape == roles.shape == (32, S + 1) and tokens.dtype == np.int64 and roles.dtype == np.uint8
    assert np.array_equal(tokens, again[0]) and np.array_equal(roles, again[1])
    assert np.array_equal(tokens[5], ds[15][0])
    # doc_mask: the same samples, with each document's positions counted from 0.
    masked = Dataset.build(sources, [1.0], "train", S, 300, seed=1, doc_mask=True).batch(10, 42)
    assert np.array_equal(masked.tokens, tokens)
    j, k = int(ds.source_ids[15]), int(ds.source_samples[15])
    assert np.array_equal(masked.positions[5], ds.sources[j].sample(k)[2])
    assert (masked.positions == 0).sum() > len(masked.positions)  # documents start inside samples
    # A longer run starts with the same samples.
    longer = Dataset.build(sources, [1.0], "train", S, 1000, seed=1)
    assert np.array_equal(longer.batch(0, 300)[0], ds.batch(0, 300)[0])
    with pytest.raises(IndexError):
        ds[300]


def test_too_small_split_is_a_user_error_naming_source_and_split(tmp_path: Path):
    ok = make_tokens(tmp_path / "ok", [lengths(6, 50)])
    tiny = make_tokens(tmp_path / "tiny", [[20] * 10 + [7, 30]], base=5000)
    sources = [(ok[0], ok[1], 1.0), (tiny[0], tiny[1], 1.0)]
    with pytest.raises(UserError) as e:
        Dataset.build(sources, [0.8, 0.2], "valid", 128, 10, seed=0)
    assert str(e.value) == (
        f"$.data.sources[1]: the valid split of {tmp_path / 'tiny'} holds 37 tokens, "
        "fewer than seq_length + 1 = 129"
    )
    with pytest.raises(UserError, match=r"^\$\.data\.sources\[0\]: the test split of .* holds no documents"):
        Dataset.build(sources, [0.8, 0.2], "test", S, 10, seed=0)


def test_index_cache_reused_rebuilt_on_change_and_stale_dirs_removed(tmp_path: Path):
    a = make_tokens(tmp_path / "a", [lengths(7, 40)])
    b = make_tokens(tmp_path / "b", [lengths(8, 30)], base=3000)
    cache = tmp_path / "cache"
    foreign = [cache / "train-0123456789abcdef", cache / "notes", cache / "valid-0123456789abcdeg"]
    for d in foreign:
        d.mkdir(parents=True)
    (cache / "train-fedcba9876543210").write_text("a file, not ours")

    def build(sources, seed: int = 1, which: str = "train", n: int = 120) -> Dataset:
        return Dataset.build([(p, m, w) for (p, m, _), w in sources], [0.9, 0.1], which, S, n, seed, cache)

    def ours(which: str = "train") -> list[Path]:
        return sorted(d for d in cache.iterdir() if d.name.startswith(f"{which}-") and (d / MARKER).is_file())

    first = build([(a, 0.7), (b, 0.3)])
    [d] = ours()
    files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in d.iterdir()}
    assert {"blend_source_ids.npy", "source1_sample_order.npy", MARKER} <= set(files)
    valid = build([(a, 0.7), (b, 0.3)], which="valid", n=8)
    second = build([(a, 0.7), (b, 0.3)])
    assert ours() == [d] and {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in d.iterdir()} == files
    assert isinstance(second.source_ids, np.memmap) and isinstance(second.sources[1].offsets, np.memmap)
    assert np.array_equal(first.batch(0, 120)[0], second.batch(0, 120)[0])

    for change in (
        lambda: build([(a, 0.7), (b, 0.3)], seed=2),
        lambda: build([(a, 0.6), (b, 0.3)]),
        lambda: build([(a, 0.7), (b, 0.3)], n=121),
        lambda: build([(a, 0.7), (make_tokens(tmp_path / "b", [lengths(9, 30)], force=True), 0.3)]),
    ):
        old = ours()
        change()
        assert len(ours()) == 1 and ours() != old  # rebuilt under a new key, the stale one removed
    assert len(ours("valid")) == 1 and valid.sources[0].num_samples + valid.sources[1].num_samples == 8
    for d in foreign:
        assert d.is_dir()
    assert (cache / "train-fedcba9876543210").is_file()
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]


def test_concurrent_builds_agree_and_the_loser_discards_its_copy(tmp_path: Path):
    a = make_tokens(tmp_path / "a", [lengths(10, 60)])
    cache = tmp_path / "cache"
    results: list[Dataset] = []

    def build() -> None:
        results.append(Dataset.build([(a[0], a[1], 1.0)], [1.0], "train", S, 500, 3, cache))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    [d] = cache.iterdir()
    for r in results[1:]:
        assert np.array_equal(r.batch(0, 64)[0], results[0].batch(0, 64)[0])
    # A process that finishes second keeps the first one's directory and leaves nothing behind.
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    _save(d, "key", results[0].arrays())
    assert [p.name for p in cache.iterdir()] == [d.name]
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    # A build that fails half way leaves no directory that looks complete, and no temporary one.

    class Unsaveable:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        _save(cache / "train-00000000000000ff", "key", {"a": np.zeros(3), "b": Unsaveable()})  # type: ignore[dict-item]
    assert [p.name for p in cache.iterdir()] == [d.name]


CONVS = [
    {
        "messages": [
            {"role": "user", "content": f"Question {i}: " + c},
            {"role": "assistant", "content": c[::-1]},
        ]
    }
    for i, c in enumerate(corpus(40))
]


def test_through_mega_tokenize_chat_roles_and_text(tmp_path: Path, sp_model: Path, capsys):
    chat_src = write_jsonl(tmp_path / "chat.jsonl", CONVS)
    text_src = write_jsonl(tmp_path / "text.jsonl", [{"text": d} for d in corpus(60)])
    special = ["--add-special-tokens", "<|im_start|>,<|im_end|>"]
    for args in ([chat_src, tmp_path / "chat", "--format", "chat", *special], [text_src, tmp_path / "text"]):
        code = cli_run(app, "mega-tokenize", [*map(str, args), "-t", str(sp_model), "--no-progress"])
        assert code == 0, capsys.readouterr().err
    chat_m, text_m = open_artifact(tmp_path / "chat", "tokens"), open_artifact(tmp_path / "text", "tokens")
    assert chat_m.roles["assistant"] == 3 and not text_m.shards[0].sidecars

    ds = Dataset.build([(tmp_path / "chat", chat_m, 1.0)], [0.9, 0.1], "train", 32, 100, seed=5)
    ids = IndexedReader(tmp_path / "chat" / chat_m.shards[0].prefix)
    roles = IndexedReader(tmp_path / "chat" / chat_m.shards[0].sidecars["roles"])
    index = ds.sources[0]  # chat: whole conversations per sample (packing.py)
    assert isinstance(index, PackedIndex) and index.first_doc == 0 and len(index.order) % 36 == 0  # 90% of 40
    for i in range(100):
        got_ids, got_roles, positions = ds[i]
        docs = [int(p) for p in index.order[index.starts[i] : index.starts[i + 1]]]
        want_ids = [t for p in docs for t in ids[p].tolist()[:33]]
        want_roles = [r for p in docs for r in roles[p].tolist()[:33]]
        n = len(want_ids)
        assert got_ids[:n].tolist() == want_ids and (got_ids[n:] == PAD).all()
        assert got_roles[:n].tolist() == want_roles and (got_roles[n:] == PAD_ROLE).all()
        assert (positions == 0).sum() == len(docs) + (n < 33)
    assert set(np.unique(ds.batch(0, 100)[1]).tolist()) <= set(chat_m.roles.values())
    assert (ds.batch(0, 100)[1] == chat_m.roles["assistant"]).any()

    # Mixed with a text source (no roles), the batches carry no roles at all.
    mixed = Dataset.build(
        [(tmp_path / "chat", chat_m, 1.0), (tmp_path / "text", text_m, 2.0)], [1.0], "train", 32, 60, seed=5
    )
    tokens, no_roles, positions, _ = mixed.batch(0, 60)
    assert no_roles is None and tokens.shape == (60, 33) and mixed[0][1] is None
    text_rows = mixed.source_ids[:60] == 1
    assert (positions[text_rows] == np.arange(33)).all()  # one sequence each: no doc_mask
    tokens = np.where(tokens == PAD, 0, tokens)
    assert int(tokens.max()) < chat_m.tokenizer.vocab_size
    eos = text_m.tokenizer.eos_id
    assert (tokens[mixed.source_ids[:60] == 1] == eos).any()  # documents end with EOS, as tokenized
    assert SPLITS == ("train", "valid", "test")
