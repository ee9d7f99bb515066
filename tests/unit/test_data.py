import json

import numpy as np
import pytest
import torch

from depthscale.config import DataConfig
from depthscale.data import loader
from depthscale.data.loader import (
    PackedBatches,
    build_data,
    split_stream,
    tokenize_corpus,
)
from depthscale.data.sources import iter_documents, stdlib_files
from depthscale.data.token_files import token_dtype, write_bin
from depthscale.data.tokenizer import ByteTokenizer, train_bpe
from depthscale.errors import DataError

DOCS = ["first document\n", "second: héllo 🙂\n", "", "fourth\tdoc " * 20]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHSCALE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def stream(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.uint32)


def batches(data: PackedBatches, n: int, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [data.next_batch(**kw) for _ in range(n)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))


# ------------------------------------------------------------------ sources


def test_text_jsonl_and_directory(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "b.txt").write_text(DOCS[1])
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"text": DOCS[0]}, {"text": DOCS[2], "id": 3}])
    (tmp_path / "corpus" / "notes.md").write_text("ignored")
    assert list(iter_documents(DataConfig(path=str(tmp_path / "corpus" / "b.txt")))) == [DOCS[1]]
    assert list(iter_documents(DataConfig(path=str(tmp_path / "corpus")))) == [
        DOCS[0],
        DOCS[2],
        DOCS[1],
    ]
    body = write_jsonl(tmp_path / "body.jsonl", [{"body": "x"}])
    assert list(iter_documents(DataConfig(path=str(body), jsonl_field="body"))) == ["x"]


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        list(iter_documents(DataConfig(path=str(bad))))
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"text": "ok"}, {"content": "x"}])
    with pytest.raises(DataError, match=r"missing\.jsonl:2: no field 'text' \(found: 'content'\)"):
        list(iter_documents(DataConfig(path=str(missing))))


@pytest.mark.parametrize("name", ["corpus.csv", "does-not-exist.txt", "empty-dir"])
def test_bad_paths(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".csv"):
        path.write_text("a,b\n")
    elif name == "empty-dir":
        path.mkdir()
    with pytest.raises(
        ValueError, match=rf"{name}.*allowed: 'stdlib'; text: a \.txt, \.jsonl, \.jsonl\.gz"
    ):
        iter_documents(DataConfig(path=str(path)))


def test_stdlib_source_and_max_bytes():
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f.parts for f in files)
    docs = list(iter_documents(DataConfig(path="stdlib", max_bytes=20_000)))
    assert len(docs) >= 1 and all(isinstance(d, str) for d in docs)
    assert sum(len(d.encode()) for d in docs) <= 20_000
    assert docs[0] == files[0].read_bytes().decode("utf-8", errors="replace")[:20_000]


def test_max_bytes_cuts_at_character_boundary(tmp_path):
    (tmp_path / "u.txt").write_text("aé🙂" * 10)  # 1 + 2 + 4 bytes per repeat
    docs = list(iter_documents(DataConfig(path=str(tmp_path / "u.txt"), max_bytes=12)))
    assert docs == ["aé🙂aé"]  # 10 bytes: the next emoji would end at byte 14
    docs = list(iter_documents(DataConfig(path=str(tmp_path / "u.txt"), max_bytes=9)))
    assert docs == ["aé🙂a"]  # 8 bytes: half an 'é' is dropped


TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(2000))


def test_binary_corpus_is_refused_naming_the_file_and_the_fraction(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "blob.txt").write_bytes(rng.integers(0, 256, 20_000, np.uint8).tobytes())
    with pytest.raises(DataError, match=r"blob.txt is not text: 5\d% of its [\d,]+ characters"):
        list(iter_documents(DataConfig(path=str(tmp_path))))
    # a small file alone is too short to judge by itself, but it is the whole corpus
    (tmp_path / "small.txt").write_bytes(rng.integers(0, 256, 2_000, np.uint8).tobytes())
    with pytest.raises(DataError, match=r"data.path='.*small.txt' is not text: .*most in"):
        list(iter_documents(DataConfig(path=str(tmp_path / "small.txt"))))


def test_some_binary_in_a_text_corpus_warns_once_with_the_fraction(tmp_path, capsys):
    rng = np.random.default_rng(1)
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_bytes(rng.integers(0, 256, 3_000, np.uint8).tobytes())
    cfg = DataConfig(path=str(tmp_path))
    docs = list(iter_documents(cfg))
    assert docs[0] == TEXT
    list(iter_documents(cfg))  # read again (BPE training, then tokenizing): no second warning
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("depthscale: warning: 1."), err
    assert "% of the corpus" in err[0] and "most in " + str(tmp_path / "b.txt") in err[0]
    # UTF-8 text with tabs, form feeds and non-ASCII letters is text: no warning
    (tmp_path / "b.txt").write_text("héllo\tworld\f🙂\r\n" * 500)
    list(iter_documents(cfg))
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ token stream


def test_byte_stream_and_cache(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])
    cfg = DataConfig(path=str(tmp_path / "c.jsonl"))
    tok = ByteTokenizer()
    tokens = tokenize_corpus(cfg, tok)
    expected = [t for d in DOCS for t in [*d.encode(), tok.eos_id]]
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected
    monkeypatch.setattr(loader, "iter_documents", lambda *a: pytest.fail("cache not used"))
    assert tokenize_corpus(cfg, tok).tolist() == expected


def test_tiny_toml_trains_on_every_window_of_shards_and_says_what_max_bytes_leaves_out(
    tmp_path, capsys
):
    """docs/data.md's example: shards from `depthscale tokenize`, trained with configs/tiny.toml,
    whose max_bytes caps raw text. Every window of the shards trains (the cap once cut token
    files too, silently: 45 % of a corpus); on the text itself, start-up says what it left out."""
    from depthscale.config import load_config
    from depthscale.data.shards import tokenize_to_shards

    (tmp_path / "corpus").mkdir()
    files = [
        write_jsonl(
            tmp_path / "corpus" / f"{i}.jsonl",
            [{"text": f"doc {i}.{j:02} " * 50} for j in range(20)],
        )
        for i in range(3)
    ]
    manifest = tokenize_to_shards(files, ByteTokenizer(), tmp_path / "shards")
    cap = manifest["tokens"] // 3  # tiny.toml's 8 MB beside a 22 MB corpus
    tiny = "configs/tiny.toml"
    overrides = ["--data.seq_len", "32", "--data.max_bytes", str(cap)]
    cfg = load_config(tiny, ["--data.path", str(tmp_path / "shards"), *overrides])
    capsys.readouterr()
    data = build_data(cfg.data, seed=0, batch_size=4)
    assert len(data.train.tokens) + len(data.val.tokens) == manifest["tokens"]
    assert data.train.n_windows == (len(data.train.tokens) - 1) // 32
    said = capsys.readouterr().out
    assert said == (
        f"depthscale: data.max_bytes caps raw text only: '{tmp_path / 'shards'}' is "
        f"tokens, all {manifest['tokens']:,} of them used\n"
    )
    text = load_config(tiny, ["--data.path", str(tmp_path / "corpus"), *overrides]).data
    for _ in ("tokenized", "cached"):  # every start says it
        tokens = tokenize_corpus(text, ByteTokenizer())
        said = capsys.readouterr().out
        assert len(tokens) == cap + 21 and said.count("\n") == 1, said  # 21 EOS: 2 files in
        corpus = tmp_path / "corpus"
        assert f"data.max_bytes={cap:,} (raw text) leaves part of '{corpus}' out: it uses" in said
        assert f" 21 documents, {cap + 21:,} tokens, {cap:,} bytes of text: its first 1 of" in said
        disk = sum(f.stat().st_size for f in files)
        assert f" 3 files whole (33% of its {disk:,} bytes on disk) and part of file 2 (" in said
    (usage,) = (tmp_path / "cache" / "tokens").glob("*.usage.json")
    usage.write_text('{"files_opened": 2}')  # another version's record: the entry is redone
    assert len(tokenize_corpus(text, ByteTokenizer())) == cap + 21
    assert "leaves part of" in capsys.readouterr().out
    text.max_bytes = 0
    assert len(tokenize_corpus(text, ByteTokenizer())) == manifest["tokens"]
    assert capsys.readouterr().out == ""  # nothing left out: nothing said


def test_a_worker_that_dies_is_named_with_its_job_at_once(tmp_path):
    """`depthscale tokenize`'s workers (`data/worker_pool.py`): results and errors come back as
    from multiprocessing.Pool, but a worker killed by a real SIGKILL (the out-of-memory killer's
    signal: Pool waits for its job forever) or exiting is named with its job within seconds,
    and the pool's other workers are stopped."""
    import gzip
    import multiprocessing
    import os
    import signal
    import time

    from depthscale.data.formats import check_stream
    from depthscale.data.worker_pool import WorkerDied, WorkerPool

    damaged = tmp_path / "d.jsonl.gz"
    damaged.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-9])
    spawn = multiprocessing.get_context("spawn")
    for job, fn, how in [
        (signal.SIGKILL, signal.raise_signal, r"was killed by SIGKILL \(what the out-of-memory"),
        (3, os._exit, "exited with code 3"),
    ]:
        with WorkerPool(spawn, 2) as pool:
            assert sorted(pool.map_unordered(abs, [-1, -2, 3, -4], str)) == [1, 2, 3, 4]
            with pytest.raises(DataError, match=f"{damaged}: the compressed stream is damaged"):
                list(pool.map_unordered(check_stream, [damaged], str))
            started = time.monotonic()
            with pytest.raises(WorkerDied, match=rf"worker pid \d+ {how}.* while doing {job}$"):
                list(pool.map_unordered(fn, [job], lambda j: f"doing {j}"))
            assert time.monotonic() - started < 10
        assert not any(process.is_alive() for process, _ in pool.workers)


def test_bpe_stream_matches_encode(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])
    tok = train_bpe(DOCS * 5, 300)
    tokens = tokenize_corpus(DataConfig(path=str(tmp_path / "c.jsonl")), tok)
    assert tokens.tolist() == [t for d in DOCS for t in [*tok.encode(d), tok.eos_id]]
    assert token_dtype(tok.vocab_size) == np.uint16 and token_dtype(70_000) == np.uint32


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_round_trip(tmp_path, dtype):
    ids = np.random.default_rng(0).integers(0, 258, 5000).astype(dtype)
    ids.tofile(tmp_path / "tokens.bin")
    cfg = DataConfig(
        path=str(tmp_path / "tokens.bin"), bin_dtype=dtype, val_fraction=0.1, seq_len=16
    )
    tokens = tokenize_corpus(cfg, ByteTokenizer())
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, ids)
    data = build_data(cfg, seed=0, batch_size=4)
    assert np.array_equal(np.concatenate([data.train.tokens, data.val.tokens]), ids)
    cfg.max_bytes = 1000  # raw text only: a token file is used whole
    assert np.array_equal(tokenize_corpus(cfg, ByteTokenizer()), ids)


@pytest.mark.parametrize("vocab, dtype", [(258, "uint16"), (70_000, "uint32")])
def test_bin_sidecar_records_the_dtype(tmp_path, vocab, dtype):
    ids = np.random.default_rng(0).integers(0, 258, 500)
    path = write_bin(tmp_path / "tokens.bin", ids, vocab)
    assert json.loads((tmp_path / "tokens.bin.json").read_text())["dtype"] == dtype
    got = tokenize_corpus(DataConfig(path=str(path)), ByteTokenizer())  # bin_dtype 'auto'
    assert got.dtype == np.dtype(dtype) and np.array_equal(got, ids)
    other = "uint16" if dtype == "uint32" else "uint32"
    with pytest.raises(DataError, match=f"says tokens.bin holds {dtype}"):
        tokenize_corpus(DataConfig(path=str(path), bin_dtype=other), ByteTokenizer())


def test_bin_errors(tmp_path):
    np.array([1, 2, 300], np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match="token id 300"):
        tokenize_corpus(
            DataConfig(path=str(tmp_path / "big.bin"), bin_dtype="uint16"), ByteTokenizer()
        )
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="not a whole number of uint16"):
        tokenize_corpus(
            DataConfig(path=str(tmp_path / "odd.bin"), bin_dtype="uint16"), ByteTokenizer()
        )
    with pytest.raises(DataError, match="no sidecar tokens.bin.json"):
        np.array([1, 2], np.uint16).tofile(tmp_path / "tokens.bin")
        tokenize_corpus(DataConfig(path=str(tmp_path / "tokens.bin")), ByteTokenizer())
    # uint32 ids read as uint16: every second token is 0
    np.random.default_rng(0).integers(1, 258, 500).astype(np.uint32).tofile(tmp_path / "wide.bin")
    with pytest.raises(DataError, match="looks like uint32"):
        tokenize_corpus(
            DataConfig(path=str(tmp_path / "wide.bin"), bin_dtype="uint16"), ByteTokenizer()
        )


def test_split_stream():
    tokens = stream(1000)
    train, val = split_stream(tokens, 0.1, seq_len=16)
    assert len(val) == 100 and np.array_equal(np.concatenate([train, val]), tokens)
    assert val[0] == 900  # the held-out part is the end of the stream
    assert len(split_stream(tokens, 0.001, seq_len=16)[1]) == 17  # at least one sequence + 1
    assert len(split_stream(tokens, 0.0, seq_len=16)[1]) == 0
    with pytest.raises(DataError, match="leaves nothing to train on"):
        split_stream(stream(10), 0.5, seq_len=16)


# ------------------------------------------------------------------ batches


def test_windows_and_shifted_labels():
    seq_len = 8
    data = PackedBatches(stream(8 * 12 + 1), seq_len, batch_size=4, seed=0)
    seen = []
    for x, y in batches(data, 3):  # one epoch: 12 windows, 3 batches
        assert x.shape == y.shape == (4, seq_len) and x.dtype == y.dtype == torch.long
        assert torch.equal(y, x + 1)  # labels are inputs shifted by one (stream is 0, 1, 2, ...)
        assert torch.all(x[:, 0] % seq_len == 0)  # windows start every seq_len tokens
        seen += (x[:, 0] // seq_len).tolist()
    assert sorted(seen) == list(range(12))  # an epoch visits every window exactly once


def test_determinism_and_seed():
    a, b = (PackedBatches(stream(2000), 16, 4, seed=1) for _ in range(2))
    c = PackedBatches(stream(2000), 16, 4, seed=2)
    first = batches(a, 5)
    assert same(first, batches(b, 5))
    assert not same(first, batches(c, 5))


def test_resume_across_epoch_boundary():
    tokens = stream(16 * 10 + 1)  # 10 windows, batch 3: 3 batches an epoch, 1 window skipped
    reference = PackedBatches(tokens, 16, 3, seed=7)
    expected = batches(reference, 10)
    for k in (0, 2, 3, 4, 7):
        data = PackedBatches(tokens, 16, 3, seed=7)
        batches(data, k)
        state = json.loads(json.dumps(data.state_dict()))
        fresh = PackedBatches(tokens, 16, 3, seed=7)
        fresh.load_state_dict(state)
        assert same(batches(fresh, 10 - k), expected[k:])
    assert reference.epochs.epoch == 3


def test_resume_refuses_a_different_stream():
    state = PackedBatches(stream(2000), 16, 4, seed=0).state_dict()
    with pytest.raises(DataError, match="n_windows"):
        PackedBatches(stream(3000), 16, 4, seed=0).load_state_dict(state)


def test_rank_slices_concatenate_to_global_batch():
    tokens = stream(5000)
    full = batches(PackedBatches(tokens, 16, 8, seed=3), 6)
    world = 4
    ranks = [
        batches(PackedBatches(tokens, 16, 8, seed=3), 6, rank=r, world=world) for r in range(world)
    ]
    for step, (x, y) in enumerate(full):
        assert torch.equal(torch.cat([ranks[r][step][0] for r in range(world)]), x)
        assert torch.equal(torch.cat([ranks[r][step][1] for r in range(world)]), y)
        assert torch.equal(ranks[1][step][0], x[2:4])  # contiguous rows
    with pytest.raises(ValueError, match="world=3"):
        PackedBatches(tokens, 16, 8).next_batch(rank=0, world=3)


def test_too_short_for_one_batch():
    with pytest.raises(DataError, match=r"100 tokens.*batch_size=8.*seq_len=16"):
        PackedBatches(stream(100), 16, 8)


def test_iter_eval_is_fixed_and_leaves_state():
    data = PackedBatches(stream(2000), 16, 4, seed=0)
    data.next_batch()
    state = data.state_dict()
    first = list(data.iter_eval(3))
    assert len(first) == 3 and same(first, list(data.iter_eval(3)))
    assert first[0][0][:, 0].tolist() == [0, 16, 32, 48]  # stream order from the start
    assert data.state_dict() == state
    assert len(list(data.iter_eval(10_000))) == data.batches_per_epoch


def test_build_data_end_to_end(tmp_path):
    (tmp_path / "corpus.txt").write_text("".join(f"line {i}: some text\n" for i in range(300)))
    cfg = DataConfig(path=str(tmp_path / "corpus.txt"), seq_len=32, val_fraction=0.1)
    data = build_data(cfg, seed=0, batch_size=4)
    full = tokenize_corpus(cfg, data.tokenizer)
    assert len(data.val.tokens) == int(len(full) * 0.1)
    # train is the head of the stream and val the tail: disjoint, nothing lost
    assert np.array_equal(np.concatenate([data.train.tokens, data.val.tokens]), full)
    assert data.train.n_windows * 32 + 1 <= len(data.train.tokens)  # train windows stay in train
    again = build_data(cfg, seed=0, batch_size=4)
    assert same(batches(data.train, 3), batches(again.train, 3))
    assert same(list(data.val.iter_eval(2)), list(again.val.iter_eval(2)))
    assert build_data(DataConfig(path=cfg.path, val_fraction=0.0), seed=0, batch_size=4).val is None


def test_build_data_bpe(tmp_path):
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    cfg = DataConfig(
        path=str(tmp_path / "corpus.txt"),
        tokenizer="bpe",
        bpe_vocab_size=300,
        seq_len=16,
        val_fraction=0.05,
    )
    data = build_data(cfg, seed=0, batch_size=2)
    assert 258 < data.tokenizer.vocab_size <= 300  # a repetitive corpus runs out of merges
    x, y = data.train.next_batch()
    assert int(torch.cat([x, y]).max()) < 300


def test_prefetcher_yields_the_same_batches_and_resumes_at_consumed_position():
    import numpy as np

    from depthscale.data.loader import PackedBatches
    from depthscale.data.prefetch import Prefetcher

    tokens = np.arange(2000, dtype=np.uint16) % 250
    plain = PackedBatches(tokens, 16, 4, seed=3)
    expected = [plain.next_batch(1, 2) for _ in range(12)]
    pre = Prefetcher(PackedBatches(tokens, 16, 4, seed=3), rank=1, world=2, depth=3)
    got = [pre.next_batch() for _ in range(5)]
    state = pre.state_dict()  # the thread has prefetched beyond batch 5; the state must not
    pre.close()
    resumed = Prefetcher(PackedBatches(tokens, 16, 4, seed=3), rank=1, world=2)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(7)]  # crosses an epoch boundary (7 batches/epoch)
    resumed.close()
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_a_closed_prefetcher_goes_on_from_the_position_consumed():
    """`Trainer.fit` closes its prefetcher when it returns; a later `fit` on the same trainer
    (`fit(stop_at=)` in rounds) must get the next batches, not wait forever on a stopped thread."""
    import numpy as np

    from depthscale.data.loader import PackedBatches
    from depthscale.data.prefetch import Prefetcher

    tokens = np.arange(2000, dtype=np.uint16) % 250
    plain = PackedBatches(tokens, 16, 4, seed=3)
    expected = [plain.next_batch() for _ in range(6)]
    pre = Prefetcher(PackedBatches(tokens, 16, 4, seed=3), depth=3)
    got = [pre.next_batch() for _ in range(3)]
    pre.close()  # with batches 4-6 prefetched and dropped
    got += [pre.next_batch() for _ in range(3)]
    pre.close()
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_the_prefetch_thread_makes_the_ranks_gpu_current_before_it_pins(monkeypatch):
    """Pinning touches CUDA; a new thread's current device is 0, so without `set_device` every
    rank's prefetch thread would open a context on GPU 0."""
    import threading

    import numpy as np

    from depthscale.data.loader import PackedBatches
    from depthscale.data.prefetch import Prefetcher

    calls = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: calls.append(("set_device", i, threading.get_ident()))
    )
    monkeypatch.setattr(
        torch.Tensor, "pin_memory", lambda t: calls.append(("pin", threading.get_ident())) or t
    )
    tokens = np.arange(2000, dtype=np.uint16) % 250
    pre = Prefetcher(PackedBatches(tokens, 16, 4, seed=3), pin=True, device_index=3)
    pre.next_batch()
    pre.close()
    assert calls[0][:2] == ("set_device", 3)
    assert calls[1][0] == "pin" and {c[-1] for c in calls} == {pre._thread.ident}


def test_tokenizing_reports_progress_a_piece_at_a_time(tmp_path):
    """`train` tokenizes small corpora itself; each piece is reported (a supervised worker's
    heartbeat counts it as progress, so a long first tokenization is not taken for a hang)."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join('{"text": "%s"}\n' % ("word " * 2000) for _ in range(600)))
    told: list[int] = []
    cfg = DataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache"), val_fraction=0.0)
    data = build_data(cfg, seed=0, batch_size=4, progress=told.append)
    assert len(told) > 1 and sum(told) == len(data.train.tokens)
    told.clear()
    build_data(cfg, seed=0, batch_size=4, progress=told.append)  # cached: nothing to tokenize
    assert told == []
