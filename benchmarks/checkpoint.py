"""What a checkpoint costs training, and what a restore reads.

    python benchmarks/checkpoint.py [--dim 256 --layers 4 --rounds 3 --out benchmarks/results/checkpoint_cpu.json]

A real `Trainer` (real data, AdamW, gloo processes with parallel.dp_replicate = world) measures:

- blocking: what training waits for per save, sync (the whole write) vs async (the two-stage
  default of multi-process runs: staging into host memory, then a background write), with each
  background writer (`checkpoint.async_writer`: a writer process, the default, or a thread), as a
  fraction of the median step time (goal ≤ 10 %);
- throughput loss: blocks of 30 steps, with async saves after steps 10 and 20 (the second one's
  write finishing within the block) by each writer, or without saves, the order rotating per
  round; the loss is the median over rounds of the block time with saves over the same round's
  block without (goal ≤ 2 %), with its range over rounds. With 2
  ranks on 2 cores the writer competes with training for the cores; `_spare_core`: 1 rank of one
  thread, a core left to the writer (as a GPU run leaves the host's cores). A writer thread also
  takes the training process's GIL for its Python work (DCP serialises each of the ~570 items of
  this state dict on its own); a writer process does not;
- restore reads at dp = 1, 2, 4: storage bytes of the tensor files read by all ranks together,
  as a multiple of those files' size, loading once per replica group (the default) and with
  every rank reading (MegaScale's load-once-and-broadcast, `train/restore.py`). DCP's torch.load
  re-reads each item's zip headers, so even one process reads a little over 1.0×; the ratio to
  what one process reads is reported too (1.00 means no extra reads for replicas). Verification
  (rank 0 hashes every file of the checkpoint once, before choosing it) is reported separately.

Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info, run_ranks  # noqa: E402

TIMED = (1, 2)
"""World sizes whose steps and saves are timed: 2 ranks on the 2 cores (training saturates them:
the background writer competes), and 1 rank of one thread (a core left to the writer, as the host
cores are beside GPU training). 4 ranks on 2 cores only count restore bytes."""


WRITERS = ("process", "thread")
"""The two background writers (`checkpoint.async_writer`)."""
SAVES = ("sync", *WRITERS)


def _set_mode(ckpt, mode: str) -> None:
    ckpt.cfg.async_save = mode in WRITERS
    if mode in WRITERS:
        ckpt.cfg.async_writer = mode


def _config(args: argparse.Namespace, work: Path, world: int, name: str):
    from depthscale.config import load_config

    corpus = work / "corpus.txt"
    overrides = f"""--data.path {corpus} --data.seq_len 128 --model.dim {args.dim}
        --model.n_layers {args.layers} --model.n_heads 4 --train.batch_size {4 * world}
        --train.steps 1000 --optim.warmup_steps 1 --logging.progress false
        --logging.tensorboard false --logging.peak_tflops 1 --checkpoint.every 0
        --checkpoint.keep 2 --parallel.dp_replicate {world} --train.run_dir {work / name}"""
    return load_config(None, overrides.split())


def _worker(rank: int, world: int, args: argparse.Namespace, work: Path, port: int, queue) -> None:
    import os

    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from depthscale.train.manifest import list_checkpoints
    from depthscale.train.restore import restore
    from depthscale.train.trainer import Trainer

    trainer = Trainer(_config(args, work, world, f"dp{world}"))
    ckpt = trainer.checkpointer
    out: dict = {"rank": rank}
    steps = []
    for _ in range(3):  # warm-up
        trainer.train_step()
    if world in TIMED:
        blocking: dict[str, list[float]] = {mode: [] for mode in SAVES}
        for _ in range(args.rounds):
            for mode in SAVES:
                t0 = time.perf_counter()
                trainer.train_step()
                steps.append(time.perf_counter() - t0)
                _set_mode(ckpt, mode)
                trainer.save_checkpoint()
                blocking[mode].append(ckpt.last_blocking_s)
                ckpt.wait(final=True)
        blocks = ("no_save", *WRITERS)
        rounds: dict[str, list[float]] = {mode: [] for mode in blocks}
        for r in range(args.rounds):
            for mode in blocks[r % 3 :] + blocks[: r % 3]:  # rotate which block goes first
                _set_mode(ckpt, mode)
                t0 = time.perf_counter()
                for i in range(1, 31):
                    s0 = time.perf_counter()
                    trainer.train_step()
                    steps.append(time.perf_counter() - s0)
                    if mode != "no_save" and i in (10, 20):
                        trainer.save_checkpoint()
                ckpt.wait()  # the last write overlapped steps 21-30: what is left is its cost
                rounds[mode].append(time.perf_counter() - t0)
        ckpt.wait(final=True)
        out |= {"steps": steps, "blocking": blocking, "rounds": rounds}
    else:
        trainer.save_checkpoint()
        ckpt.wait(final=True)
    path = list_checkpoints(ckpt.root)[-1]
    for load_once in (True, False):
        _, stats = restore(path, trainer.model, trainer.optimizer, trainer.layout.mesh, load_once)
        out[f"restore_once={load_once}"] = stats
    out["files"] = {f.name: f.stat().st_size for f in path.iterdir()}
    trainer.batches.close()
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    queue.put(out)


def _restore_summary(results: list[dict], alone_bytes: int | None) -> dict:
    from depthscale.train.restore import distinct_bytes

    files = results[0]["files"]
    shard_size = sum(n for name, n in files.items() if name.endswith(".distcp"))
    row = {
        "checkpoint_mb": round(sum(files.values()) / 1e6, 2),
        "tensor_files_mb": shard_size / 1e6,
    }
    for once in (True, False):
        stats = [r[f"restore_once={once}"] for r in results]
        read = sum(s.shard_bytes for s in stats)
        key = "load_once" if once else "every_rank_reads"
        row[key] = {
            "tensor_bytes_read_x_size": round(read / shard_size, 3),
            "distinct_bytes_x_size": round(distinct_bytes(stats) / shard_size, 3),
            "other_bytes_read_mb": round(sum(s.other_bytes for s in stats) / 1e6, 3),
            "restore_s": round(max(s.seconds for s in stats), 3),
        }
        if alone_bytes:
            row[key]["x_one_process_read"] = round(read / alone_bytes, 3)
    row["verification_bytes_rank0_x_size"] = 1.0  # verify() hashes every file once on rank 0
    return row


def _rounds(results: list[dict], n: int) -> dict[str, float]:
    """Median over rounds of the slowest rank's block time, per mode."""
    return {
        m: statistics.median(max(r["rounds"][m][i] for r in results) for i in range(n))
        for m in ("no_save", *WRITERS)
    }


def _losses(results: list[dict], n: int) -> dict[str, dict[str, float]]:
    """Per writer, the loss of each round: its block over the same round's block without saves
    (the slowest rank's each), paired so that drifts of the machine's speed cancel; the median
    and the range over rounds (the range is the noise to read the median against)."""
    out = {}
    for m in WRITERS:
        per_round = [
            max(r["rounds"][m][i] for r in results)
            / max(r["rounds"]["no_save"][i] for r in results)
            - 1
            for i in range(n)
        ]
        out[m] = {
            "median": round(statistics.median(per_round), 4),
            "min": round(min(per_round), 4),
            "max": round(max(per_round), 4),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "corpus.txt").write_text(
            "".join(
                f"line {i}: the quick brown fox jumps over the lazy dog {i * 7}\n"
                for i in range(4000)
            )
        )
        by_world = {w: run_ranks(_worker, w, w, args, work) for w in (1, 2, 4)}
    alone = by_world[1][0]["restore_once=True"].shard_bytes
    two = by_world[2]
    step = statistics.median(s for r in two for s in r["steps"])
    blocking = {m: statistics.median(b for r in two for b in r["blocking"][m]) for m in SAVES}
    rounds = _rounds(two, args.rounds)
    result = {
        **device_info(),
        "date": datetime.date.today().isoformat(),
        "config": {
            "model": f"dim {args.dim}, {args.layers} layers, seq 128, batch 4 per rank, AdamW fp32",
            "layout": "parallel.dp_replicate = world (gloo)",
            "rounds": args.rounds,
        },
        "step_s": round(step, 4),
        "blocking_s": {m: round(v, 4) for m, v in blocking.items()},
        "blocking_fraction_of_step": {m: round(v / step, 3) for m, v in blocking.items()},
        "blocking_async_vs_sync": {m: round(blocking[m] / blocking["sync"], 3) for m in WRITERS},
        "block_of_30_steps_s": {m: round(v, 4) for m, v in rounds.items()},
        "throughput_loss_save_every_10": _losses(two, args.rounds),
        "throughput_loss_save_every_10_spare_core": _losses(by_world[1], args.rounds),
        "restore": {f"dp{w}": _restore_summary(r, alone) for w, r in by_world.items()},
        "goals": {"blocking_fraction_async": 0.10, "throughput_loss": 0.02, "restore_x_size": 1.0},
        "wall_s": round(time.time() - started, 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
