"""Held-out and downstream evaluation every `train.eval_every` steps and at the last step."""

from __future__ import annotations

from depthscale.observe import spans
from depthscale.train import console
from depthscale.train.hooks import Hook, Run


class Evaluation(Hook):
    def after_step(self, run: Run) -> None:
        t = run.trainer
        every, steps = t.cfg.train.eval_every, t.cfg.train.steps
        if not every or (t.step % every != 0 and t.step != steps):
            return
        with spans.span("eval"):
            results = t.evaluator.run(t.model, t.forward, t.autocast)
        for prefix, values in results.items():
            run.logger.log(t.step, values, prefix=prefix)
        if results:
            console.write(run.bar, console.format_eval(t.step, results))
