"""Config loading: TOML, overrides, and one clear message per bad input."""

from pathlib import Path

import pytest

from depthscale.config import ConfigError, load_config, parse_overrides, to_toml

CONFIGS = Path(__file__).parents[2] / "configs"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_shipped_configs_load():
    for path in CONFIGS.glob("*.toml"):
        cfg = load_config(path)
        assert cfg.model.dim > 0, path


def test_overrides_apply_with_types():
    cfg = load_config(
        None,
        [
            "--model.dim",
            "256",
            "--train.compile=true",
            "--optim.lr",
            "1e-3",
            "--model.residual",
            "block",
            "--data.max_bytes",
            "1_000",
        ],
    )
    assert cfg.model.dim == 256 and cfg.train.compile is True and cfg.optim.lr == 1e-3
    assert cfg.model.residual == "block" and cfg.data.max_bytes == 1000


def test_toml_round_trip(tmp_path):
    cfg = load_config(
        None, ["--model.dim", "96", "--model.n_heads", "3", "--train.name", 'a "quoted" name']
    )
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg


def test_lists_of_tables_load_round_trip_and_override(tmp_path):
    """`[[eval.tasks]]` tables in a file, an inline TOML array on the command line (replacing the
    file's list), written back as tables after the section's keys."""
    task = tmp_path / "t.jsonl"
    task.write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n')
    path = write(
        tmp_path,
        f'[eval]\n[[eval.tasks]]\npath = "{task}"\n[[eval.tasks]]\npath = "{task}"\n'
        'name = "two"\nlimit = 3\n',
    )
    cfg = load_config(path)
    assert [(t.path, t.label, t.limit) for t in cfg.eval.tasks] == [
        (str(task), "t", 0),
        (str(task), "two", 3),
    ]
    assert load_config(write(tmp_path, to_toml(cfg))) == cfg
    cli = load_config(path, ["--eval.tasks", f'[{{path = "{task}", name = "only"}}]'])
    assert [t.label for t in cli.eval.tasks] == ["only"]
    assert load_config(path, ["--eval.tasks", "[]"]).eval.tasks == []


@pytest.mark.parametrize(
    ("toml", "overrides", "message"),
    [
        ("[model]\ndimm = 64\n", [], r"unknown key in \[model\] 'dimm' \(did you mean 'dim'\?\)"),
        ("[modle]\ndim = 64\n", [], r"unknown config section 'modle' \(did you mean 'model'\?\)"),
        ('[model]\ndim = "big"\n', [], r"model.dim: expected an int, got 'big'"),
        ("", ["--model.dim", "abc"], r"model.dim: expected an int, got 'abc'"),
        ("", ["--model.n_heads", "5"], r"model.n_heads=5 must divide model.dim=128"),
        (
            "",
            ["--model.residual", "dense"],
            r"model.residual: 'dense' is not allowed; allowed: 'standard', 'full', 'block'",
        ),
        (
            "",
            ["--train.micro_batch_size", "5"],
            r"train.micro_batch_size=5 × data-parallel ranks \(1\) must divide train.batch_size=16",
        ),
        ("", ["--model.n_kv_heads", "3"], r"model.n_kv_heads=3 must divide model.n_heads=4"),
        ("", ["--parallel.cp_ulysses", "0"], r"parallel.cp_ulysses=0 must be >= 1"),
        (
            "",
            ["--parallel.cp", "4", "--parallel.cp_ulysses", "3"],
            r"parallel.cp_ulysses=3 must divide parallel.cp=4; allowed: a divisor of 4",
        ),
        (
            "",
            ["--parallel.cp", "8", "--parallel.cp_ulysses", "8", "--parallel.tp", "2"],
            r"parallel.cp_ulysses=8 must divide the query heads per tp rank \(model.n_heads=4 / "
            r"parallel.tp=2 = 2\)",
        ),
        (
            "",
            ["--model.dim", "96", "--model.n_heads", "12", "--model.n_kv_heads", "4"]
            + ["--parallel.cp", "3", "--parallel.cp_ulysses", "3"],
            r"parallel.cp_ulysses=3 and the KV heads per tp rank \(model.n_kv_heads=4 / "
            r"parallel.tp=1 = 4\) must divide one another",
        ),
        ("", ["--data.seq_len", "8192"], r"data.seq_len=8192 exceeds model.max_seq_len=4096"),
        (
            "",
            ["--train.compile", "maybe"],
            r"train.compile: expected a bool \(true/false\), got 'maybe'",
        ),
        (
            "",
            ["--optim.name", "sgd"],
            r"optim.name: 'sgd' is not allowed; allowed: 'adamw', 'lamb'",
        ),
        ("", ["--model.dim"], r"override --model.dim is missing its value"),
        ("", ["--dim", "3"], r"unexpected argument '--dim'"),
        (
            "",
            ["--model.residual", "block", "--model.attnres_n_blocks", "20"],
            r"model.attnres_n_blocks=20 must be in 1..8",
        ),
        ("", ["--parallel.tp", "0"], r"parallel.tp=0 must be >= 1"),
        (
            "",
            ["--train.offload_params", "true"],
            r"train.offload_params=true offloads FSDP2's sharded states, so it needs FSDP: "
            r"parallel.dp_shard × cp > 1 \(got dp_shard=1, cp=1\)",
        ),
        (
            "",
            ["--train.offload_params", "true", "--parallel.dp_shard", "2", "--parallel.pp", "2"],
            r"train.offload_params=true is for data and context parallelism \(ZeRO-3 / HSDP "
            r"over dp_shard × cp\), but parallel.tp=1, pp=2",
        ),
        (
            "",
            ["--train.recompute", "some"],
            r"train.recompute: 'some' is not allowed; allowed: 'none', 'selective', 'sublayer', 'full'",
        ),
        (
            "",
            ["--checkpoint.resume", "/no/such/dir"],
            r"checkpoint.resume='/no/such/dir' does not exist",
        ),
        (
            "",
            ["--parallel.pp", "4", "--train.batch_size", "6"],
            r"parallel.pp=4 with train.batch_size=6 over 1 data-parallel rank\(s\): the per-rank "
            r"batch 6 splits into neither 8 nor 4 micro-batches, so the pipeline would run 1 "
            r"micro-batch\(es\) per step and idle 75% of it; set train.batch_size to a multiple of "
            r"pp × dp = 4 \(e.g. 8\)",
        ),
        (
            "",
            ["--train.offload_activations", "true", "--train.recompute", "selective"],
            r"train.offload_activations=true with train.recompute='selective'.*allowed with "
            r"offload: recompute 'none', 'sublayer' or 'full'",
        ),
        (
            "",
            [
                "--model.ffn_chunk_size",
                "6",
                "--parallel.tp",
                "2",
                "--parallel.tp_overlap_chunks",
                "4",
            ],
            r"model.ffn_chunk_size=6 under tensor parallelism .* allowed: a multiple of 4, or 0",
        ),
        (
            "",
            [
                "--model.ffn_chunk_size",
                "6",
                "--parallel.tp",
                "2",
                "--parallel.tp_overlap_chunks",
                "0",
            ],
            r"parallel.tp_overlap_chunks=0 must be >= 1",
        ),
        ("[model\n", [], r"is not valid TOML"),
        ("model = 3\n", [], r"\[model\] must be a table of keys"),
    ],
)
def test_bad_input_names_key_and_allowed_values(tmp_path, toml, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, toml), overrides)


def test_pipeline_micro_batches():
    """The default splits the per-rank batch into 2·pp (else pp) micro-batches; an explicit size
    with fewer micro-batches than stages is allowed, with a warning naming the bubble and the fix."""
    cfg = load_config(None, ["--parallel.pp", "2", "--train.batch_size", "8"])
    assert cfg.grad_accum_steps == 4
    cfg = load_config(None, ["--parallel.pp", "4", "--train.batch_size", "4"])
    assert cfg.grad_accum_steps == 4
    explicit = ["--parallel.pp", "4", "--train.batch_size", "8", "--train.micro_batch_size", "4"]
    with pytest.warns(
        UserWarning, match=r"idles 60% of each step; use train.micro_batch_size <= 2"
    ):
        assert load_config(None, explicit).grad_accum_steps == 2
    tiny_batch = ["--parallel.pp", "4", "--train.batch_size", "2", "--train.micro_batch_size", "1"]
    with pytest.warns(
        UserWarning,
        match=r"2 micro-batch\(es\) per step for 4 stages, so the pipeline idles 60% of each "
        r"step; set train.micro_batch_size=1 and train.batch_size >= 4 for at least 4",
    ):
        assert load_config(None, tiny_batch).grad_accum_steps == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (  # per rank 12 // 2 = 6: neither 8 nor 4 micro-batches
            ["--parallel.pp", "4", "--parallel.dp_shard", "2", "--train.batch_size", "12"],
            r"parallel.pp=4 with train.batch_size=12 over 2 data-parallel rank\(s\): the per-rank "
            r"batch 6 splits into neither 8 nor 4 .* idle 75% of it; set train.batch_size to a "
            r"multiple of pp × dp = 8 \(e.g. 16\)",
        ),
        (  # fewer sequences per rank than stages
            ["--parallel.pp", "4", "--train.batch_size", "2"],
            r"the per-rank batch 2 splits into neither 8 nor 4 .* multiple of pp × dp = 4 \(e.g. 4\)",
        ),
    ],
)
def test_default_split_that_would_starve_the_pipeline_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_pipeline_splits_that_fill_the_stages_pass_silently(recwarn):
    """What the shipped configs and the suite's pipeline layouts use: no error, no warning."""
    for overrides, micro in [
        (["--parallel.pp", "2", "--train.batch_size", "6"], 3),  # 2·pp fails, pp = 2 works
        (["--parallel.pp", "2", "--parallel.dp_shard", "2", "--train.batch_size", "4"], 1),
        (["--parallel.pp", "4", "--train.batch_size", "8", "--train.micro_batch_size", "2"], 2),
    ]:
        assert load_config(None, overrides).micro_batch_size == micro
    for path in CONFIGS.glob("*.toml"):
        load_config(path, ["--parallel.pp", "4"])
    assert not [w for w in recwarn if "micro-batch" in str(w.message)]


@pytest.mark.parametrize("key", ["dp_replicate", "dp_shard", "pp"])
def test_zero_parallel_size_is_a_config_error_not_a_division_by_zero(key):
    with pytest.raises(ConfigError, match=rf"parallel.{key}=0 must be >= 1"):
        load_config(None, [f"--parallel.{key}", "0"])


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such/config.toml")


def test_parse_overrides():
    assert parse_overrides(["--a.b", "1", "--c.d=x=y"]) == [("a.b", "1"), ("c.d", "x=y")]


def test_wandb_without_its_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"logging.wandb=true needs the wandb package.*depthscale\[wandb\]"
    ):
        load_config(None, ["--logging.wandb", "true"])
    load_config(None, ["--logging.wandb", "false"])  # off: the package is never asked for
