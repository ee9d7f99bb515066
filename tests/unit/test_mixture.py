"""Weighted mixtures (`data/mixture.py`): every source within one window of its share after every
step of every stage; a stage change continues every source where it was (no window served twice
inside an epoch); a small source repeats in a new epoch; the batches are a function of the state
(a resume at another data-parallel degree gives the same rows); max_epochs and a changed mixture
are refused naming the source; the config says all of it with one-line errors."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from depthscale.config import load_config, to_toml
from depthscale.data.mixture import MixedBatches, Stage, mixture_metrics
from depthscale.errors import ConfigError, DataError

SEQ = 4


def _streams(sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Source k's tokens are k·100000 + position: every window names its source and place."""
    return {
        name: (k * 100_000 + np.arange(n * SEQ + 1)).astype(np.int64)
        for k, (name, n) in enumerate(sizes.items())
    }


def _mixed(sizes, stages, batch=8, seed=0) -> MixedBatches:
    return MixedBatches(_streams(sizes), SEQ, batch, seed, stages)


def _source_and_window(row) -> tuple[int, int]:
    first = int(row[0])
    return first // 100_000, (first % 100_000) // SEQ


@pytest.mark.parametrize("seed", range(4))
def test_every_source_stays_within_one_window_of_its_share_in_every_stage(seed):
    rng = np.random.default_rng(seed)
    names = ["web", "code", "math"]
    w0, w1 = rng.dirichlet(np.ones(3)), rng.dirichlet(np.ones(3))
    stages = [Stage(0, dict(zip(names, w0))), Stage(7, dict(zip(names, w1)))]
    mixed = _mixed({n: 500 for n in names}, stages, batch=int(rng.integers(3, 12)))
    counts = {n: 0 for n in names}
    for step in range(15):
        if step == 7:
            counts = {n: 0 for n in names}
        inputs, _ = mixed.next_batch()
        for row in inputs:
            counts[names[_source_and_window(row)[0]]] += 1
        weights = w0 if step < 7 else w1
        total = sum(counts.values())
        for n, w in zip(names, weights):
            assert abs(counts[n] - w * total) < 1, (step, n, counts, w * total)


def test_a_stage_change_continues_every_source_and_a_small_source_repeats():
    stages = [Stage(0, {"big": 0.5, "small": 0.5}), Stage(3, {"big": 0.75, "small": 0.25})]
    mixed = _mixed({"big": 200, "small": 6}, stages, batch=4)
    seen = {0: [], 1: []}
    epochs = []
    for _ in range(12):
        inputs, labels = mixed.next_batch()
        assert (labels[:, :-1] == inputs[:, 1:]).all()
        for row in inputs:
            source, window = _source_and_window(row)
            seen[source].append(window)
        epochs.append(mixture_metrics(mixed.state_dict(), SEQ)["epoch/small"])
    big, small = seen[0], seen[1]
    assert len(set(big)) == len(big)  # the big source never repeats a window across the stages
    assert len(small) == 6 + 9 and epochs[0] == 0 and epochs[-1] == 2
    assert sorted(small[:6]) == sorted(small[6:12]) == list(range(6))  # whole epochs, each
    assert small[:6] != small[6:12]  # in an order of its own
    counts = mixture_metrics(mixed.state_dict(), SEQ)
    assert counts["tokens/big"] + counts["tokens/small"] == 12 * 4 * SEQ


def _digest(batch) -> str:
    return hashlib.sha256(batch[0].numpy().tobytes() + batch[1].numpy().tobytes()).hexdigest()


def test_a_resume_at_another_data_parallel_degree_gives_the_same_batches():
    stages = [Stage(0, {"a": 0.6, "b": 0.4}), Stage(4, {"a": 0.1, "b": 0.9})]
    straight = _mixed({"a": 30, "b": 20}, stages)
    reference = [_digest(straight.next_batch()) for _ in range(10)]
    first = _mixed({"a": 30, "b": 20}, stages)
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    ranks = [_mixed({"a": 30, "b": 20}, stages) for _ in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for step in range(3, 10):
        halves = [r.next_batch(rank, 2) for rank, r in enumerate(ranks)]
        whole = tuple(np.concatenate([h[i].numpy() for h in halves]) for i in range(2))
        assert (
            hashlib.sha256(whole[0].tobytes() + whole[1].tobytes()).hexdigest() == (reference[step])
        )


def test_evaluation_batches_are_the_first_ones_and_leave_the_state_alone():
    stages = [Stage(0, {"a": 0.6, "b": 0.4})]
    mixed = _mixed({"a": 30, "b": 20}, stages)
    first = [_digest(mixed.next_batch()) for _ in range(2)]
    state = mixed.state_dict()
    assert [_digest(b) for b in mixed.iter_eval(2)] == first
    assert mixed.state_dict() == state


def test_max_epochs_and_a_changed_mixture_are_refused_naming_the_source():
    mixed = _mixed({"a": 100, "b": 10}, [Stage(0, {"a": 0.5, "b": 0.5})])
    mixed.check_epochs(steps=2, max_epochs={"b": 2})  # 2·8·0.5 + 1 = 9 of 10 windows
    with pytest.raises(DataError, match=r"data source 'b': .* \(.*epochs\) .* max_epochs=2"):
        mixed.check_epochs(steps=10, max_epochs={"b": 2})
    state = mixed.state_dict()
    with pytest.raises(DataError, match="sources: saved \\['a', 'b'\\], now \\['a', 'c'\\]"):
        _mixed({"a": 100, "c": 10}, [Stage(0, {"a": 1})]).load_state_dict(state)
    with pytest.raises(DataError, match="source 'b' windows: saved 10, now 11"):
        _mixed({"a": 100, "b": 11}, [Stage(0, {"a": 1})]).load_state_dict(state)
    with pytest.raises(DataError, match="not a mixture's"):
        mixed.load_state_dict({"epoch": 0, "cursor": 0, "order": "feistel-6"})


def _write(tmp_path, text: str):
    (tmp_path / "corpus.jsonl").write_text('{"text": "x"}\n')
    path = tmp_path / "c.toml"
    path.write_text(text.replace("CORPUS", str(tmp_path / "corpus.jsonl")))
    return path


MIXTURE = """
[data]
[[data.sources]]
name = "web"
path = "CORPUS"
weight = 0.7
[[data.sources]]
name = "code"
path = "CORPUS"
weight = 0.3
max_epochs = 2
[[data.stages]]
at_step = 100
weights = {web = 0.2, code = 0.8}
"""


def test_the_mixture_config_loads_and_round_trips(tmp_path):
    cfg = load_config(_write(tmp_path, MIXTURE))
    assert [(s.name, s.weight, s.max_epochs) for s in cfg.data.sources] == [
        ("web", 0.7, 0.0),
        ("code", 0.3, 2.0),
    ]
    assert cfg.data.stages[0].weights == {"web": 0.2, "code": 0.8}
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("weight = 0.7", "weight = 0"), r"data.sources\[0\].weight=0.0 must be a finite number > 0"),
        (("weight = 0.3", "weight = -1"), r"data.sources\[1\].weight=-1.0 must be"),
        (("{web = 0.2,", "{wbe = 0.2,"), r"data.stages\[0\].weights names 'wbe', not a source; "
         "allowed: web, code"),
        (("at_step = 100", "at_step = 9000"), r"at_step=9000: allowed: .* at most train.steps"),
        (('name = "code"', 'name = "web"'), "a second source named 'web'"),
        (("path = \"CORPUS\"\nweight = 0.7", 'path = "/nope"\nweight = 0.7'), "does not exist"),
        (("{web = 0.2, code = 0.8}", "{web = 0, code = 0}"), "at least one > 0"),
        (("[data]", '[data]\npath = "CORPUS"'), "data.path=.* and data.sources are both set"),
        (("weights = {", 'weights = "x" #{'), r"data.stages\[0\].weights: expected a table"),
    ],
)  # fmt: skip
def test_a_bad_mixture_is_one_line_naming_the_entry(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, MIXTURE.replace(*change)))


def test_max_bytes_caps_each_text_source_and_start_up_says_what_it_leaves_out(tmp_path, capsys):
    """data.max_bytes caps each text source by itself and never a token source; start-up says,
    source by source, what is used where the cap leaves anything out, and nothing otherwise."""
    import json

    from depthscale.config import DataConfig, DataSource
    from depthscale.data.loader import build_data
    from depthscale.data.token_files import write_bin

    (tmp_path / "web.jsonl").write_text(json.dumps({"text": "w" * 3000}) + "\n")
    (tmp_path / "small.jsonl").write_text(json.dumps({"text": "s" * 500}) + "\n")
    write_bin(tmp_path / "code.bin", np.arange(2000) % 250, 258)
    paths = {n: str(tmp_path / f) for n, f in [("web", "web.jsonl"), ("small", "small.jsonl"),
                                               ("code", "code.bin")]}  # fmt: skip
    sources = [DataSource(name=n, path=p, weight=1.0) for n, p in paths.items()]
    cfg = DataConfig(sources=sources, seq_len=SEQ, max_bytes=1000, val_fraction=0,
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    capsys.readouterr()
    data = build_data(cfg, seed=0, batch_size=4)
    windows = {s.name: s.n_windows for s in data.train.sources}
    assert windows == {"web": 1000 // SEQ, "small": 501 // SEQ, "code": 1999 // SEQ}
    notes = capsys.readouterr().out.splitlines()
    assert len(notes) == 2, notes
    assert (
        f"data.max_bytes=1,000 (raw text) leaves part of '{paths['web']}' out: it uses 1"
        in (notes[0])
    )
    assert f"caps raw text only: '{paths['code']}' is tokens, all 2,000 of them used" in notes[1]


def test_a_bad_source_or_eval_set_path_is_named_by_its_entry(tmp_path):
    """A mixture source's or an eval set's path the readers refuse is named as the config names
    it (data.sources[1].path, eval.sets[0].path), not as a data.path the user never wrote."""
    import json

    from depthscale.config import DataConfig, DataSource, EvalSet
    from depthscale.data.eval_sets import attach_eval_sets
    from depthscale.data.loader import build_data

    (tmp_path / "web.jsonl").write_text(json.dumps({"text": "w" * 3000}) + "\n")
    (tmp_path / "rows.csv").write_text("id,text\n1,hello\n")
    good = DataSource(name="web", path=str(tmp_path / "web.jsonl"), weight=1.0)
    bad = DataSource(name="rows", path=str(tmp_path / "rows.csv"), weight=1.0)
    cfg = DataConfig(sources=[good, bad], seq_len=SEQ, tokenizer="byte", val_fraction=0,
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(DataError, match=r"^data\.sources\[1\]\.path='.*rows\.csv' has unsupported"):
        build_data(cfg, seed=0, batch_size=4)
    cfg.sources = [good]
    data = build_data(cfg, seed=0, batch_size=4)
    sets = [EvalSet(name="rows", path=str(tmp_path / "rows.csv"))]
    with pytest.raises(DataError, match=r"^eval\.sets\[0\]\.path='.*rows\.csv' has unsupported"):
        attach_eval_sets(data, cfg, sets, seed=0, batch_size=4, ranks=1)
