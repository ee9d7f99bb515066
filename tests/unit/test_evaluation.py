"""Multiple-choice evaluation: batched, padded log-likelihoods equal each pair scored alone; acc
and acc_norm as lm-evaluation-harness counts them (a known model where length normalisation
changes the answer); the harness's context/continuation split; task files checked line by line."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from depthscale.config import ModelConfig
from depthscale.data.tokenizer import ByteTokenizer
from depthscale.errors import DataError
from depthscale.evaluation.multiple_choice import (
    Question,
    Task,
    encode_pair,
    loglikelihoods,
    read_task,
    score,
)
from depthscale.model.transformer import Transformer

BYTE = ByteTokenizer()


class Unigram(nn.Module):
    """log p(token) = -id - log Σ_v e^-v whatever the context: scores known in closed form."""

    def __init__(self, max_seq_len: int = 64) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len)
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = -torch.arange(BYTE.vocab_size, dtype=torch.float32) + self.weight
        return logits.expand(*tokens.shape, BYTE.vocab_size)


LSE = torch.logsumexp(-torch.arange(BYTE.vocab_size, dtype=torch.float64), 0).item()


def test_acc_norm_divides_by_characters_and_can_change_the_answer():
    """'~' (id 126) against 'AA' (65, 65): raw, '~' scores -126.46 and 'AA' -130.92, so '~'
    wins; per character 'AA' wins (-65.46). Gold 'AA': acc 0, acc_norm 1."""
    task = Task("t", (Question("Q:", ("~", "AA"), 1), Question("Q:", ("A", "~~"), 0)))
    pairs = [encode_pair(BYTE, q.context, c) for q in task.questions for c in q.choices]
    lls = loglikelihoods(Unigram(), pairs)
    assert lls == pytest.approx([-126 - LSE, -130 - 2 * LSE, -65 - LSE, -252 - 2 * LSE], abs=1e-4)
    assert score(Unigram(), BYTE, task) == {"task": "t", "n": 2, "acc": 0.5, "acc_norm": 1.0}


def test_the_context_split_is_the_harnesses():
    """A context's trailing space moves to the continuation; the context starts with the EOS
    training put before every document."""
    context, continuation = encode_pair(BYTE, "Q: 2+2= ", "4")
    assert context == [BYTE.eos_id, *b"Q: 2+2="] and continuation == list(b" 4")


def test_a_context_past_the_models_length_is_cut_from_the_left():
    long = [encode_pair(BYTE, "x" * 200, "AB")]
    assert loglikelihoods(Unigram(max_seq_len=8), long) == pytest.approx(
        [-65 - 66 - 2 * LSE], abs=1e-4
    )


def test_batched_padded_scores_equal_each_pair_alone():
    """Rows of different lengths padded on the right in batches of 3, against each pair run
    alone in float64: within twice the fp32 error of scoring alone (another evaluation order of
    the same sums errs no worse in kind)."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=BYTE.vocab_size, residual="block",
                      attnres_n_blocks=2, max_seq_len=64)  # fmt: skip
    model = Transformer(cfg).eval()
    texts = [("The cat ", "sat"), ("1 2 3", " 4 5"), ("def f(", "x):"), ("a", "bcdefgh"), ("", "x")]
    pairs = [encode_pair(BYTE, c, x) for c, x in texts]
    batched = loglikelihoods(model, pairs, batch_size=3)
    alone = [loglikelihoods(model, [p])[0] for p in pairs]
    exact = [loglikelihoods(copy.deepcopy(model).double(), [p])[0] for p in pairs]
    bound = 2 * max(abs(a - e) for a, e in zip(alone, exact, strict=True)) + 1e-6
    assert max(abs(b - e) for b, e in zip(batched, exact, strict=True)) <= bound


def _write(tmp_path, *lines) -> object:
    path = tmp_path / "task.jsonl"
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


GOOD = json.dumps({"context": "Q", "choices": ["a", "b"], "gold": 1})
BAD_TASKS = [
    (["{nope"], r"task.jsonl:1: not JSON"),
    ([GOOD, "[1, 2]"], r"task.jsonl:2: a JSON list, not an object"),
    ([json.dumps({"context": "Q", "choices": ["a"], "gold": 0})], r"'choices' must be a list of 2"),
    ([json.dumps({"context": "Q", "choices": ["a", ""], "gold": 0})], r"non-empty strings"),
    ([json.dumps({"context": "Q", "choices": ["a", "b"], "gold": 2})], r"'gold'=2 must index"),
    ([json.dumps({"context": "Q", "choices": ["a", "b"], "gold": True})], r"'gold'=True"),
    ([json.dumps({"choices": ["a", "b"], "gold": 0})], r"'context' must be a string"),
    ([""], r"holds no question"),
    ([b"\xff\xfe"], r"is not UTF-8 text"),
]


@pytest.mark.parametrize("lines, message", BAD_TASKS, ids=[m for _, m in BAD_TASKS])
def test_a_bad_task_file_is_named_by_file_and_line(tmp_path, lines, message):
    with pytest.raises(DataError, match=message):
        read_task(_write(tmp_path, *lines))


def test_task_files_read_every_question(tmp_path):
    task = read_task(_write(tmp_path, GOOD, "", GOOD))
    assert task.name == "task" and task.questions == (Question("Q", ("a", "b"), 1),) * 2
