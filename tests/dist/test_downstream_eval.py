"""Downstream tasks scored during training (`evaluation/downstream.py` through `plan.score_rows`)
equal one process's `multiple_choice.loglikelihoods` in every layout: data parallelism splits the
rows, pipeline stages pass them on, tensor parallelism shards the vocabulary of the logits, context
parallelism shards the rows' tokens.

fp32 tolerance (tests/tolerances.py): each log-likelihood is a sum of per-token losses of one
forward pass that the layout computes in another summation order, so it is bounded by
`fp32_model_bound` of the forward alone, relative to the value. acc and acc_norm must be equal
exactly where the reference's best choice leads the next by more than that bound (checked: the
fixture has no near-tie).
"""

import json

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh, small_config

from depthscale.data.tokenizer import ByteTokenizer
from depthscale.evaluation.downstream import DownstreamTasks
from depthscale.evaluation.multiple_choice import loglikelihoods, read_task, tally, task_pairs
from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import dp_rank_and_size, parallelize
from tolerances import check, fp32_model_bound

SEQ = 48  # the model's context; the rows are at most 32 tokens wide
QUESTIONS = 7  # 28 rows: batches that do not divide them evenly, and a short last one


def _write_task(path) -> None:
    g = torch.Generator().manual_seed(5)  # a draw with no near-tie (checked below)
    words = "the cat dog sat on a mat ran far away home tree".split()

    def text(lo: int, hi: int) -> str:
        n = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    with open(path, "w") as f:
        for _ in range(QUESTIONS):
            choices = [text(1, 3) for _ in range(4)]
            gold = int(torch.randint(0, 4, (1,), generator=g))
            f.write(json.dumps({"context": text(2, 6), "choices": choices, "gold": gold}) + "\n")


def _config(dims_kw: dict):
    cfg = small_config("block", dims_kw, batch=4, seq=SEQ, vocab=ByteTokenizer().vocab_size)
    cfg.model.vocab_size = 320  # a multiple of tp above the byte vocabulary
    cfg.model.n_layers = 2
    return cfg


def _scored(dims_kw: dict, task_file: str):
    dims = ParallelDims(**dims_kw).validate(dist.get_world_size())
    cfg = _config(dims_kw)
    task, tokenizer = read_task(task_file), ByteTokenizer()
    torch.manual_seed(0)
    ref = Transformer(cfg.model).eval()
    reference = loglikelihoods(ref, task_pairs(tokenizer, task), batch_size=5)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    plan = parallelize(model, cached_mesh(dims), dims, cfg)
    model.eval()
    dp_rank, dp_size = dp_rank_and_size(cached_mesh(dims), dims)
    tasks = DownstreamTasks(
        [task],
        tokenizer,
        cfg.model.max_seq_len,
        plan.sequence_multiple,
        rows_per_batch=cfg.micro_batch_size * cfg.grad_accum_steps,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )

    def summed(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    holders = dist.get_world_size() // dp_size
    lls = tasks.loglikelihoods(
        0, lambda x, y: plan.score_rows(model, x, y), summed, holders, torch.device("cpu")
    )
    return lls, reference, tally(task, lls), tally(task, reference)


@pytest.mark.parametrize(
    "dims_kw",
    [{"dp_shard": 2}, {"dp_replicate": 2}, {"pp": 2}, {"tp": 2}, {"cp": 2}],
    ids=["fsdp", "ddp", "pp", "tp", "cp"],
)
def test_task_scores_equal_one_process(dist_pool, tmp_path, dims_kw):
    task_file = tmp_path / "task.jsonl"
    _write_task(task_file)
    bound = fp32_model_bound(_config(dims_kw).model, SEQ, 4, backward=False)
    task = read_task(task_file)
    for lls, reference, result, expected in dist_pool(2).run(_scored, dims_kw, str(task_file)):
        assert len(lls) == len(reference) == 4 * QUESTIONS
        for i, (got, want) in enumerate(zip(lls, reference)):
            check(abs(got - want) / abs(want), bound, f"row {i} log-likelihood")
        it = iter(reference)
        for q in task.questions:  # no near-tie: equal acc is a fair demand
            scores = [next(it) for _ in q.choices]
            for ranked in (scores, [s / len(c) for s, c in zip(scores, q.choices)]):
                top = sorted(ranked, reverse=True)
                assert top[0] - top[1] > 4 * bound * abs(top[0]), "the fixture has a near-tie"
        assert result == expected
