"""Multiple-choice evaluation by log-likelihood, scored as lm-evaluation-harness scores it.

A task is a JSONL file, one question a line: `{"context": "...", "choices": ["...", ...],
"gold": 0}`. Each choice is scored by the log-likelihood of its tokens after the context's; `acc`
counts the questions whose gold choice scores highest, `acc_norm` those whose gold choice scores
highest per character of its text (the length normalisation of lm-evaluation-harness, which keeps
long answers from losing for their length alone).

The text is tokenized as the harness does (`encode_pair`): a context's trailing spaces move to the
continuation, the continuation's tokens are those of `context + continuation` after the
context's, so a BPE merge across the boundary is scored the way the model would see it. The
context starts with the EOS that training puts before every document (as `depthscale generate`
does). Sequences longer than the model's context are cut from the left, keeping every scored token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from depthscale.data.tokenizer import Tokenizer
from depthscale.errors import DataError

IGNORE_INDEX = -100  # F.cross_entropy's default, as in training

_FORM = 'allowed: one JSON object a line, {"context": str, "choices": [str, ...], "gold": index}'


@dataclass(frozen=True)
class Question:
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    name: str
    questions: tuple[Question, ...]


def read_task(path: Path, name: str = "", limit: int = 0) -> Task:
    """A task file, every line checked; a bad one is named by file and line. `name`: what it is
    reported as ("" = the file's stem); `limit` > 0 keeps only the first so many questions."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"task file {path} does not exist; {_FORM}")
    questions = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason}); {_FORM}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}:{n}: not JSON ({err}); {_FORM}") from None
        questions.append(_question(q, f"{path}:{n}"))
    if not questions:
        raise DataError(f"{path} holds no question; {_FORM}")
    return Task(name or path.stem, tuple(questions[:limit] if limit else questions))


def _question(q: object, where: str) -> Question:
    if not isinstance(q, dict):
        raise DataError(f"{where}: a JSON {type(q).__name__}, not an object; {_FORM}")
    context, choices, gold = q.get("context"), q.get("choices"), q.get("gold")
    if not isinstance(context, str):
        raise DataError(f"{where}: 'context' must be a string; {_FORM}")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise DataError(
            f"{where}: 'choices' must be a list of 2 or more non-empty strings; {_FORM}"
        )
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise DataError(
            f"{where}: 'gold'={gold!r} must index 'choices' (0..{len(choices) - 1}); {_FORM}"
        )
    return Question(context, tuple(choices), gold)


def encode_pair(
    tokenizer: Tokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """(context ids with the leading EOS, continuation ids), split as lm-evaluation-harness does."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return [tokenizer.eos_id, *context_ids], whole[len(context_ids) :]


def scored_rows(
    pairs: list[tuple[list[int], list[int]]], limit: int
) -> list[tuple[list[int], int]]:
    """(token ids, continuation length) of each pair, cut from the left to `limit` + 1 tokens
    (inputs of at most `limit`) so that every scored token is kept."""
    rows = []
    for context, continuation in pairs:
        if not continuation:
            raise DataError("a choice that encodes to no token cannot be scored")
        rows.append(((context + continuation)[-(limit + 1) :], len(continuation)))
    return rows


def padded_batch(rows: list[tuple[list[int], int]], width: int) -> tuple[Tensor, Tensor]:
    """Inputs and labels [len(rows), width], padded on the right (causal: padding after a token
    never changes its logits); a label is IGNORE_INDEX except at the continuation's targets."""
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, n) in enumerate(rows):
        inputs[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        labels[i, len(ids) - 1 - n : len(ids) - 1] = torch.tensor(ids[-n:])
    return inputs, labels


def task_pairs(tokenizer: Tokenizer, task: Task) -> list[tuple[list[int], list[int]]]:
    """Every (question, choice) of `task` encoded, question by question."""
    return [encode_pair(tokenizer, q.context, c) for q in task.questions for c in q.choices]


def loglikelihoods(
    model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16
) -> list[float]:
    """Σ log p(continuation | context) for each (context, continuation) pair, in batches padded
    on the right, on one process (`evaluation/downstream.py` scores them in any layout)."""
    return [ll for ll, _ in continuation_scores(model, pairs, batch_size)]


@torch.no_grad()
def continuation_scores(
    model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16
) -> list[tuple[float, bool]]:
    """(Σ log p(continuation | context), whether every continuation token is the model's most
    likely next token) for each pair: what lm-evaluation-harness's `loglikelihood` returns."""
    rows = scored_rows(pairs, model.cfg.max_seq_len)
    device = next(model.parameters()).device
    out: list[tuple[float, bool]] = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        inputs, labels = padded_batch(batch, max(len(ids) - 1 for ids, _ in batch))
        logits = model(inputs.to(device)).float()
        labels = labels.to(device)
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(
            labels.shape
        )  # ignored labels give 0
        scored = labels != IGNORE_INDEX
        greedy = ((logits.argmax(-1) == labels) | ~scored).all(dim=1)
        sums = -per_token.double().sum(dim=1)
        out += zip(sums.tolist(), greedy.tolist(), strict=True)
    return out


def score(
    model: torch.nn.Module, tokenizer: Tokenizer, task: Task, batch_size: int = 16
) -> dict[str, float | int | str]:
    """acc and acc_norm of `model` on `task` (and its question count)."""
    return tally(task, loglikelihoods(model, task_pairs(tokenizer, task), batch_size))


def tally(task: Task, lls: list[float]) -> dict[str, float | int | str]:
    """acc and acc_norm from the log-likelihood of every choice, question by question."""
    scores = iter(lls)
    right = right_norm = 0
    for q in task.questions:
        lls = [next(scores) for _ in q.choices]
        right += _argmax(lls) == q.gold
        right_norm += _argmax([ll / len(c) for ll, c in zip(lls, q.choices, strict=True)]) == q.gold
    n = len(task.questions)
    return {"task": task.name, "n": n, "acc": right / n, "acc_norm": right_norm / n}


def _argmax(values: list[float]) -> int:
    """The index of the largest value, the first of equal ones (as numpy's argmax)."""
    return max(range(len(values)), key=values.__getitem__)


def as_table(results: list[dict]) -> str:
    lines = [f"{'task':<24} {'questions':>9} {'acc':>7} {'acc_norm':>8}"]
    for r in results:
        lines.append(f"{r['task']:<24} {r['n']:>9} {r['acc']:>7.4f} {r['acc_norm']:>8.4f}")
    return "\n".join(lines)


__all__ = [
    "Question",
    "Task",
    "as_table",
    "continuation_scores",
    "encode_pair",
    "loglikelihoods",
    "padded_batch",
    "read_task",
    "score",
    "scored_rows",
    "tally",
    "task_pairs",
]
