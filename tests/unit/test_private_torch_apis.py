"""The private torch APIs depthscale relies on, pinned: an upgrade that moves or changes one fails
here, in CI, with its name — not in a training run. Each entry says where it is used. Checked
against torch 2.11 (the GPU image) and 2.13 (CI); `data_parallel.replicate_api` says why DDP's
composable replicate has no public replacement yet."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from depthscale.parallel.data_parallel import replicate_api


def test_composable_replicate_api():
    """parallel/data_parallel.apply_ddp: DDP's reducer installed on the module (plain parameters),
    called with exactly these arguments."""
    replicate = replicate_api()
    params = inspect.signature(replicate).parameters
    assert list(params)[:2] == ["module", "ignored_modules"]
    # the other keywords go to DistributedDataParallel (at the first forward): process_group=
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert "process_group" in inspect.signature(nn.parallel.DistributedDataParallel).parameters


def test_replicated_module_switches_gradient_sync():
    """parallel/step.py holds the gradient all-reduce back until a step's last micro-batch with
    `set_requires_gradient_sync`, which DDP's replicate mixes into the module's class (lazily: no
    process group is needed to check it)."""
    module = replicate_api()(nn.Linear(2, 2), ignored_modules=[])
    assert isinstance(module, nn.Linear)  # same module: names and state-dict keys unchanged
    module.set_requires_gradient_sync(False)
    module.set_requires_gradient_sync(True)


def test_device_mesh_flatten():
    """parallel/mesh.py: `DeviceMesh._flatten(name)` names the flattened dimensions dp_shard_cp
    and dp_cp (torchtitan does the same; no public equivalent in torch 2.11–2.13)."""
    params = inspect.signature(DeviceMesh._flatten).parameters
    assert list(params)[:2] == ["self", "mesh_dim_name"]


def test_accumulate_grad_node_type():
    """train/offload.py: activation offload recognises parameters (and their autocast casts) by
    their AccumulateGrad node."""
    accumulate = torch._C._functions.AccumulateGrad
    w = torch.nn.Parameter(torch.ones(2))
    assert isinstance(w.to(torch.bfloat16).grad_fn.next_functions[0][0], accumulate)


def test_assume_constant_result_is_a_marker_attribute():
    """model/kernel_dispatch.py marks `record` as torch.compile-constant by setting the attribute
    `torch.compiler.assume_constant_result` sets, so that importing the model does not import
    dynamo (and triton)."""
    from depthscale.model.kernel_dispatch import record

    def probe() -> bool:
        return True

    assert torch.compiler.assume_constant_result(probe) is probe
    assert probe._dynamo_marked_constant is True
    assert record._dynamo_marked_constant is True


def test_flight_recorder_dump_and_group_lookup():
    """observe/flight_recorder.py: hang dumps read torch's Flight Recorder through
    `_dump_fr_trace(includeCollectives, includeStackTraces, onlyActive)` (a pickled dict with
    "entries" and "pg_status") and map a group name back to its ranks with
    `distributed_c10d._resolve_process_group`. tests/dist/test_trace_spans.py reads a real one."""
    from torch.distributed import distributed_c10d

    dump = torch._C._distributed_c10d._dump_fr_trace
    assert "includeCollectives" in (dump.__doc__ or "") and "onlyActive" in (dump.__doc__ or "")
    assert callable(distributed_c10d._resolve_process_group)  # a pybind builtin: no signature


def test_live_group_timeout_can_be_changed(tmp_path):
    """parallel/mesh.shorten_timeout: after the first step the world group gets
    `parallel.timeout_s` through `_set_pg_timeout` (which sets each backend's default timeout), and
    so does the store; tests/faults/test_startup.py reads them back from 4 real ranks."""
    import datetime

    from torch.distributed import distributed_c10d

    assert list(inspect.signature(distributed_c10d._set_pg_timeout).parameters) == [
        "timeout",
        "group",
    ]
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    group = torch.distributed.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=9))
    assert group.options._timeout == datetime.timedelta(seconds=9)
    group._set_default_timeout(datetime.timedelta(seconds=4))  # what _set_pg_timeout calls
    assert group.options._timeout == datetime.timedelta(seconds=4)
    store.set_timeout(datetime.timedelta(seconds=3))
    assert store.timeout == datetime.timedelta(seconds=3)


def test_device_mesh_concatenate():
    """parallel/mesh.dp_mesh: HSDP's 2-D mesh is `DeviceMesh._concatenate([dp_replicate mesh,
    flattened shard mesh])` (slicing a flattened dimension from the root is deprecated);
    tests/dist/test_startup_groups.py runs it on 4 ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    assert list(inspect.signature(DeviceMesh._concatenate).parameters) == ["device_mesh_list"]


def test_group_creation_internals_the_sync_counter_patches():
    """parallel/startup.count_synchronizations counts by wrapping `distributed_c10d.barrier`,
    `_store_based_barrier(rank, store, group_name, rendezvous_count, timeout)` (torch's barrier
    after init and after each group, with TORCH_DIST_INIT_BARRIER=1), `_new_group_with_tag`
    (what `new_group` calls, `use_local_synchronization` by keyword) and `split_group`, which
    device_mesh imports by name; `leader_first` posts to `_get_default_store()`. own_group's name
    for a members-only group hashes the ranks with the count of groups made (`_hash_ranks_to_str`)."""
    from torch.distributed import device_mesh, distributed_c10d

    params = list(inspect.signature(distributed_c10d._store_based_barrier).parameters)
    assert params[:5] == ["rank", "store", "group_name", "rendezvous_count", "timeout"]
    params = inspect.signature(distributed_c10d._new_group_with_tag).parameters
    assert list(params)[0] == "ranks" and "use_local_synchronization" in params
    assert "use_local_synchronization" in inspect.signature(distributed_c10d.new_group).parameters
    assert device_mesh.split_group is distributed_c10d.split_group
    # own_group under NCCL: one split for all parts, by these keywords (public since 2.6)
    split = inspect.signature(distributed_c10d.split_group).parameters
    assert {"split_ranks", "group_desc"} <= split.keys()
    assert callable(distributed_c10d._get_default_store)
    assert "len(_world.pg_names)" in inspect.getsource(distributed_c10d._hash_ranks_to_str)


def test_autograd_graph_task_id_tells_backward_apart():
    """model/moe.py counts an MoE layer's load in training forwards but not in the forward that
    activation checkpointing recomputes inside backward: `torch._C._current_graph_task_id()` is
    -1 outside a backward pass and a task id inside one."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(torch._C._current_graph_task_id())
            return g

    assert torch._C._current_graph_task_id() == -1
    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen and seen[0] != -1


def test_grouped_mm_takes_offsets():
    """model/moe.py: `torch._grouped_mm(x, w, offs=...)`, the MoE experts' grouped GEMM on CUDA
    (its call is checked on the meta device in tests/unit/test_moe.py)."""
    schema = str(torch.ops.aten._grouped_mm.default._schema)
    assert schema.startswith("aten::_grouped_mm(Tensor self, Tensor mat2, Tensor? offs=None")
