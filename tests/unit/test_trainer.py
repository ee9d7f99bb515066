"""The single-process trainer: resume equality, accumulation, optimizers, checkpoints, bad input."""

import copy
import json

import pytest
import torch

from depthscale.config import load_config
from depthscale.errors import CheckpointError, ConfigError
from depthscale.train.manifest import list_checkpoints
from depthscale.train.trainer import Trainer
from tolerances import AdamWBound, check, fp32_model_bound, fp32_sum_bound, scaled_err


def make_cfg(tmp_path, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(
            "".join(
                f"line {i}: the quick brown fox jumps over the lazy dog {i * 7}\n"
                for i in range(400)
            )
        )
    base = [
        "--data.path",
        str(corpus),
        "--data.seq_len",
        "32",
        "--model.dim",
        "32",
        "--model.n_layers",
        "2",
        "--model.n_heads",
        "4",
        "--train.batch_size",
        "4",
        "--train.steps",
        "6",
        "--optim.warmup_steps",
        "2",
        "--train.eval_every",
        "3",
        "--train.eval_batches",
        "1",
        "--checkpoint.every",
        "3",
        "--logging.progress",
        "false",
        "--logging.log_every",
        "1",
        "--logging.tensorboard",
        "false",
        "--train.run_dir",
        str(tmp_path / "run"),
        "--logging.peak_tflops",
        "1",
    ]
    return load_config(None, base + list(overrides))


@pytest.mark.parametrize("residual", ["standard", "block"])
def test_stop_and_resume_gives_identical_losses(tmp_path, residual):
    args = ["--model.residual", residual, "--model.attnres_n_blocks", "2"]
    full = Trainer(make_cfg(tmp_path / "a", *args)).fit()
    crashed = Trainer(make_cfg(tmp_path / "b", *args)).fit(
        stop_at=4
    )  # checkpoint at 3, lost step 4
    resumed = Trainer(make_cfg(tmp_path / "b", *args))
    assert resumed.step == 3
    rest = resumed.fit()
    assert [m["loss"] for m in crashed[:3] + rest] == [m["loss"] for m in full]
    assert [m["grad_norm"] for m in rest] == [m["grad_norm"] for m in full[3:]]


def test_fit_in_rounds_on_one_trainer_equals_one_fit(tmp_path):
    """`fit(stop_at=)` then `fit()` on the same trainer (benchmarks train in rounds): the second
    call goes on from the batches consumed (the first closed its prefetcher) and ends where one
    uninterrupted fit does, bit for bit."""
    full = Trainer(make_cfg(tmp_path / "a")).fit()
    trainer = Trainer(make_cfg(tmp_path / "b"))
    rounds = trainer.fit(stop_at=2) + trainer.fit(stop_at=4) + trainer.fit()
    assert [m["loss"] for m in rounds] == [m["loss"] for m in full]


def test_grad_accumulation_matches_full_batch(tmp_path):
    """4 micro-batches of one row accumulate the gradient of one batch of 4: the same sums in another
    order. Every step of the accumulating run restarts from the full-batch run's parameters and
    optimizer state (tests/tolerances.py: free-running fp32 runs drift apart step by step), and is
    compared at one step's fp32 bound: the loss, the gradients the optimizer sees (clipped) and the
    parameters after AdamW (elementwise, `AdamWBound`)."""
    a = Trainer(make_cfg(tmp_path / "a", "--train.steps", "2"))
    b = Trainer(make_cfg(tmp_path / "b", "--train.steps", "2", "--train.micro_batch_size", "1"))
    bound = fp32_model_bound(a.cfg.model, 32, 4)
    delta_rel = bound + fp32_sum_bound(10**6, pairwise=True, block=16)  # + the clipping norm's sum
    params_a, params_b = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    record: list[dict] = []

    def snapshot(params):
        return {n: p.detach().clone() for n, p in params.items()}

    a.optimizer.register_step_pre_hook(
        lambda opt, *_: record.append(
            {"grads": {n: p.grad.clone() for n, p in params_a.items() if p.grad is not None}}
        )
    )

    def after_a(opt, *_):
        record[-1]["params"] = snapshot(params_a)
        record[-1]["state"] = {
            n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params_a.items()
        }
        record[-1]["optim"] = copy.deepcopy(opt.state_dict())  # a's next step changes it in place
        record[-1]["lr"] = opt.param_groups[0]["lr"]

    a.optimizer.register_step_post_hook(after_a)
    hist_a = a.fit()

    errors: dict[str, float] = {"grad": 0.0, "param": 0.0}
    step = [0]

    def before_b(opt, *_):
        for n, g in record[step[0]]["grads"].items():
            errors["grad"] = max(errors["grad"], scaled_err(params_b[n].grad, g))

    def after_b(opt, *_):
        ref = record[step[0]]
        adam = AdamWBound(ref["lr"], (b.cfg.optim.beta1, b.cfg.optim.beta2), b.cfg.optim.eps)
        for n, p in params_b.items():
            g = ref["grads"][n]
            delta = delta_rel * g.abs().max().item()
            limit = adam.after_step(n, g, delta, ref["state"][n], ref["params"][n])
            ratio = ((p.detach().double() - ref["params"][n].double()).abs() / limit).max().item()
            errors["param"] = max(errors["param"], ratio)
        with torch.no_grad():  # the next step starts from a's parameters and optimizer state
            for n, p in params_b.items():
                p.copy_(ref["params"][n])
        opt.load_state_dict(ref["optim"])
        step[0] += 1

    b.optimizer.register_step_pre_hook(before_b)
    b.optimizer.register_step_post_hook(after_b)
    hist_b = b.fit()
    assert step[0] == len(record) == 2
    for x, y in zip(hist_a, hist_b):
        check(abs(x["loss"] - y["loss"]) / x["loss"], bound, "loss")
    check(errors["grad"], bound, "worst gradient")
    check(errors["param"], 1.0, "AdamW parameters / their elementwise bound")


@pytest.mark.parametrize(
    "extra",
    [
        ["--optim.name", "lamb", "--optim.lr", "1e-1"],
        ["--train.dtype", "bfloat16"],
        ["--optim.schedule", "wsd"],
        ["--model.parallel_block", "true", "--model.sliding_window", "8"],
    ],
)
def test_loss_falls(tmp_path, extra):
    hist = Trainer(
        make_cfg(
            tmp_path, "--train.steps", "30", "--optim.lr", "1e-2", "--checkpoint.every", "0", *extra
        )
    ).fit()  # later --optim.lr wins
    assert hist[-1]["loss"] < hist[0]["loss"] - 1.0


def test_run_directory_contents(tmp_path):
    cfg = make_cfg(tmp_path, "--logging.tensorboard", "true", "--checkpoint.keep", "1")
    Trainer(cfg).fit()
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {m["split"] for m in lines} == {"train", "val", "checkpoint"}  # a save's blocking time
    assert {"loss", "tokens_per_s", "mfu", "grad_norm", "lr"} <= set(lines[0])
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000006"]
    assert (run / "config.toml").is_file() and (run / "tokenizer").is_dir()


def test_resume_none_refuses_to_overwrite(tmp_path):
    Trainer(make_cfg(tmp_path, "--train.steps", "3")).fit()
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        Trainer(make_cfg(tmp_path, "--checkpoint.resume", "none"))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_resume_with_different_model_names_the_key(tmp_path):
    Trainer(make_cfg(tmp_path, "--train.steps", "3")).fit()
    with pytest.raises(CheckpointError, match=r"model.dim: checkpoint has 32, config has 64"):
        Trainer(make_cfg(tmp_path, "--model.dim", "64"))


def test_vocab_smaller_than_tokenizer_is_rejected(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"model.vocab_size=100 is smaller than the tokenizer's vocabulary \(258\)",
    ):
        Trainer(make_cfg(tmp_path, "--model.vocab_size", "100"))


def test_async_checkpoint_equals_sync(tmp_path):
    sync = Trainer(make_cfg(tmp_path / "s", "--train.steps", "3"))
    sync.fit()
    asyn = Trainer(
        make_cfg(tmp_path / "a", "--train.steps", "3", "--checkpoint.async_save", "true")
    )
    asyn.fit()
    a = Trainer(make_cfg(tmp_path / "s", "--train.steps", "3"))
    b = Trainer(make_cfg(tmp_path / "a", "--train.steps", "3"))
    for p, q in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(p, q)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)


@pytest.mark.parametrize("residual", ["standard", "block"])
def test_recompute_and_offload_leave_training_bitwise_unchanged(tmp_path, residual):
    """Recomputation re-runs the same ops on the same inputs and offloading only moves saved
    tensors, so losses and gradient norms are bit-identical to the plain run; the offloaded bytes
    (what backward keeps) shrink with each recompute level, which shows the knob took effect."""
    base = ["--train.steps", "3", "--model.residual", residual, "--model.attnres_n_blocks", "2"]
    base += ["--train.micro_batch_size", "2"]
    plain = Trainer(make_cfg(tmp_path / "plain", *base)).fit()
    assert "offloaded_mb" not in plain[0]
    selective = Trainer(
        make_cfg(tmp_path / "selective", *base, "--train.recompute", "selective")
    ).fit()
    assert [(h["loss"], h["grad_norm"]) for h in selective] == [
        (h["loss"], h["grad_norm"]) for h in plain
    ]
    offloaded = {}
    for mode in ("none", "sublayer", "full"):
        hist = Trainer(
            make_cfg(
                tmp_path / mode,
                *base,
                "--train.recompute",
                mode,
                "--train.offload_activations",
                "true",
            )
        ).fit()
        assert [(h["loss"], h["grad_norm"]) for h in hist] == [
            (h["loss"], h["grad_norm"]) for h in plain
        ]
        offloaded[mode] = hist[-1]["offloaded_mb"]
    assert offloaded["none"] > offloaded["sublayer"] > offloaded["full"] > 0, offloaded


def test_document_mask_reaches_the_plan_and_changes_what_packed_rows_see(tmp_path):
    """`data.document_mask`: the trainer cuts every row at the tokenizer's EOS (with the EOS
    target mask when asked); short documents, so every row packs several and the loss differs
    from the unmasked run's from the first step (the parity itself: tests/unit/
    test_document_mask.py and tests/dist/test_document_mask_layouts.py)."""
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"doc {i}: fox {i * 7} dog"}) + "\n" for i in range(300))
    )
    short = ("--data.path", str(corpus), "--train.steps", "2", "--checkpoint.every", "0")
    plain = Trainer(make_cfg(tmp_path / "a", *short))
    masked = Trainer(
        make_cfg(
            tmp_path / "b", *short, "--data.document_mask", "true", "--data.mask_eos_target", "true"
        )
    )
    packing = masked.plan.sequence.packing
    assert packing is not None and packing.eos_id == masked.data.tokenizer.eos_id
    assert packing.mask_eos_target and plain.plan.sequence.packing is None
    assert masked.fit()[0]["loss"] != plain.fit()[0]["loss"]


def test_an_eos_target_mask_without_document_masking_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="data.mask_eos_target needs data.document_mask"):
        make_cfg(tmp_path, "--data.mask_eos_target", "true").validate()
