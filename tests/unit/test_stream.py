"""The one stream contract (`data/stream.py`), kept alike by one token stream and a mixture: the
batch, excluded positions passed over as if consumed, a state that resumes exactly (through
JSON, as a checkpoint stores it), evaluation batches that leave the state alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from depthscale.data.loader import PackedBatches
from depthscale.data.mixture import MixedBatches, Stage
from depthscale.data.stream import Batch, BatchStream


def _packed() -> PackedBatches:
    return PackedBatches(np.arange(2000) % 250, 8, 4, seed=1)


def _mixed() -> MixedBatches:
    streams = {"a": np.arange(900) % 250, "b": (np.arange(700) + 7) % 250}
    return MixedBatches(streams, 8, 4, seed=1, stages=[Stage(0, {"a": 0.75, "b": 0.25})])


@pytest.mark.parametrize("make", [_packed, _mixed], ids=["one stream", "mixture"])
def test_every_stream_keeps_the_contract(make):
    stream = make()
    assert isinstance(stream, BatchStream)
    batches, positions = [], []
    for _ in range(4):
        batches.append(stream.next_batch())
        positions.append(stream.position)
    assert all(isinstance(b, Batch) and b.inputs.shape == (4, 8) for b in batches)
    assert all(np.array_equal(b.inputs[:, 1:], b.labels[:, :-1]) for b in batches)

    skipping = make()
    skipping.exclude([positions[1]])
    got = [skipping.next_batch() for _ in range(3)]
    for a, b in zip(got, [batches[0], batches[2], batches[3]]):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert skipping.position == positions[3]

    resumed, at_two = make(), make()
    for _ in range(2):
        at_two.next_batch()
    state = json.loads(json.dumps(at_two.state_dict()))
    resumed.load_state_dict(state)
    before = resumed.state_dict()
    list(resumed.iter_eval(2))
    assert resumed.state_dict() == before
    assert np.array_equal(resumed.next_batch().inputs, batches[2].inputs)
    assert isinstance(resumed.metrics(resumed.state_dict()), dict)
