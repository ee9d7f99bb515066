"""lm-evaluation-harness on a depthscale run: the `LM` that `--model depthscale` names.

    depthscale lm-eval --model depthscale --model_args run=runs/tiny --tasks my_task \\
        --include_path tasks/

(`pip install 'depthscale[lm-eval]'`). The harness has no plugin discovery for models, so the
`depthscale lm-eval` command registers this class and then runs the harness's own command line
with the arguments as given; from Python, importing this module registers it for
`lm_eval.simple_evaluate(model="depthscale", ...)`.

Scores are depthscale's own (`multiple_choice.continuation_scores`): the same tokenization as
`depthscale eval` (the harness's context/continuation split, the EOS training puts before every
document), so a multiple-choice task reports the same acc and acc_norm either way.
`loglikelihood_rolling` scores a whole text in windows of the model's context (the harness's own
windowing); `generate_until` decodes with the KV cache (`model/generate.py`), greedy unless the
task asks for sampling.

model_args: run (a run directory, required), checkpoint (one of its checkpoints; default the
newest that verifies); the harness's --batch_size and --device apply.
"""

from __future__ import annotations

from pathlib import Path

import torch

from depthscale.errors import CheckpointError, ConfigError, DataError, DepthscaleError

try:
    # the harness fills its registry with its own models only while the registry is empty:
    # they go in first, or `--model hf` would be unknown beside `--model depthscale`
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as err:  # named at import: `depthscale lm-eval` turns it into one line
    raise ImportError(
        "lm-evaluation-harness is not installed; pip install 'depthscale[lm-eval]'"
    ) from err

from depthscale.evaluation.multiple_choice import continuation_scores, encode_pair
from depthscale.model.generate import generate


@register_model("depthscale")
class DepthscaleLM(LM):
    def __init__(
        self,
        run: str | None = None,
        checkpoint: str | None = None,
        batch_size: int | str = 16,
        device: str | None = None,
        **_ignored,
    ) -> None:
        super().__init__()
        from depthscale.interop.run_dir import load_run

        if not run:
            raise ConfigError("--model_args run=DIR is required (a depthscale run directory)")
        self.model, self.tokenizer = load_run(Path(run), checkpoint)
        if self.tokenizer is None:
            raise CheckpointError(f"{run} has no tokenizer/ directory; evaluation needs one")
        self._device = _device(device)
        self.model.to(self._device)
        self.batch_size = _batch_size(batch_size)

    # ------------------------------------------------------------------ the harness's requests

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.tokenizer, *r.args) for r in requests]
        return continuation_scores(self.model, pairs, self.batch_size)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        eos, limit = self.tokenizer.eos_id, self.model.cfg.max_seq_len
        out = []
        for r in requests:
            ids = self.tokenizer.encode(r.args[0])
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(ids, eos, limit, context_len=1)
            ]
            out.append(sum(ll for ll, _ in continuation_scores(self.model, windows, 1)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self._generate(*r.args) for r in requests]

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        new = int(gen_kwargs.get("max_gen_toks", 256))
        limit = self.model.cfg.max_seq_len
        new = min(new, limit - 1)
        ids = [self.tokenizer.eos_id, *self.tokenizer.encode(context)][-(limit - new) :]
        temperature = (
            float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0
        )
        prompt = torch.tensor([ids], dtype=torch.long, device=self._device)
        tokens = generate(self.model, prompt, new, temperature, eos_id=self.tokenizer.eos_id)
        text = self.tokenizer.decode(
            [t for t in tokens[0, len(ids) :].tolist() if t != self.tokenizer.eos_id]
        )
        for stop in until:
            text = text.split(stop, 1)[0]
        return text


def _device(asked: str | None) -> torch.device:
    """The harness's --device (its default is cuda:0); where there is no GPU, the CPU, as the
    harness's own HF model does, said in one line."""
    if asked in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(asked).startswith("cuda") and not torch.cuda.is_available():
        print(f"depthscale: --device {asked}: no CUDA device here; running on the CPU", flush=True)
        return torch.device("cpu")
    try:
        return torch.device(asked)
    except RuntimeError:
        raise ConfigError(f"--device {asked!r}: allowed: cpu, cuda, cuda:N") from None


def _batch_size(value: int | str) -> int:
    text = str(value)
    if text.startswith("auto"):
        return 16
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--batch_size {value!r}: allowed: a whole number >= 1, or auto")
    return int(text)


def main(argv: list[str]) -> int:
    """`depthscale lm-eval ARGS`: the harness's command line with `--model depthscale` known."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    except DepthscaleError:
        raise
    except ValueError as err:  # the harness's refusals of its arguments (a task not found, ...)
        raise DataError(f"lm-evaluation-harness: {err}") from None
    return 0


__all__ = ["DepthscaleLM", "main"]
