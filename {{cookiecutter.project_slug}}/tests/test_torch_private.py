"""runtime/torch_private.py, in-process: each private torch API works on the installed torch, and
on a torch without it the fallback keeps the result (with a note) or one error line names the
feature and the torch version. (The runs that rely on them: test_custom_step, test_layouts, ...)"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from {{ cookiecutter.package_name }}.failures import UsageError
from {{ cookiecutter.package_name }}.runtime import torch_private as tp

MISSING = re.escape(f"which torch {torch.__version__} lacks")


@pytest.fixture
def group(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    dist.destroy_process_group()


def test_every_groups_timeout_changes_or_a_note_says_it_stays(group, monkeypatch, capsys):
    """A mesh's group, made with torch's 30 minutes, gets --timeout-s too (HSDP's and
    tensor_parallel's: a host cut off from a 2 x 2 run, in the tensor_parallel bake's tests)."""
    mesh = dist.new_group([0])._get_backend(torch.device("cpu"))
    assert mesh.options._timeout.total_seconds() == 30 * 60
    tp.set_group_timeout(7)
    assert group.options._timeout.total_seconds() == mesh.options._timeout.total_seconds() == 7
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
    tp.set_group_timeout(9)
    assert group.options._timeout.total_seconds() == 7
    assert "note: torch" in capsys.readouterr().err


def test_the_store_of_a_launchers_group_or_one_error_line_naming_the_launcher(group, monkeypatch):
    assert tp.default_store("a-launcher") is dist.distributed_c10d._get_default_store()
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(UsageError, match=f"a process group made by a-launcher needs .*{MISSING}"):
        tp.default_store("a-launcher")


def test_torchruns_agent_is_wrapped_and_stops_restarting_or_a_note_says_it_restarts(
        tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    handler = SimpleNamespace(get_backend=lambda: "static", get_run_id=lambda: "test")
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=handler, entrypoint="true")
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    monitor = vars(LocalElasticAgent)["_monitor_workers"]
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", monitor)  # put back afterwards
    seen = []
    tp.wrap_agent_monitor(lambda *args: seen.append(args) or tp.stop_restarts(agent))
    assert agent._monitor_workers("group") is True and agent._remaining_restarts == 0
    assert seen == [(monitor, agent, "group")]
    monkeypatch.delattr(LocalElasticAgent, "_monitor_workers")
    tp.wrap_agent_monitor(lambda *args: None)
    assert "_monitor_workers" not in vars(LocalElasticAgent)  # torchrun's own, unwrapped
    del agent._remaining_restarts
    assert tp.stop_restarts(agent) is False and not hasattr(agent, "_remaining_restarts")
    assert capsys.readouterr().err.count("a mistake is retried at each restart") == 2


def test_the_module_inside_torch_compile_or_one_error_line(monkeypatch):
    inner = nn.Linear(2, 2)
    compiled = torch.compile(inner)  # compiles at its first call only
    assert tp.uncompiled(compiled) is inner and tp.uncompiled(inner) is inner
    monkeypatch.delattr(compiled, "_orig_mod")
    with pytest.raises(UsageError, match=f"--compile needs OptimizedModule._orig_mod .*{MISSING}"):
        tp.uncompiled(compiled)


def test_whether_compile_is_supported_or_true_where_torch_cannot_say(monkeypatch):
    assert tp.compile_supported() is torch._dynamo.is_dynamo_supported()
    monkeypatch.delattr(torch._dynamo, "is_dynamo_supported")
    assert tp.compile_supported() is True


def test_a_compiled_recompute_with_batchnorm_runs_from_torch_29_or_one_error_line(monkeypatch):
    from torch.torch_version import TorchVersion

    if torch.__version__ >= "2.9":
        tp.compiled_recompute()
        monkeypatch.setattr(torch, "__version__", TorchVersion("2.8.0+cu128"))
    found = re.escape(torch.__version__)
    with pytest.raises(UsageError, match=f"--compile and BatchNorm needs .*which torch {found} "
                                         "lacks; install torch 2.9 or later"):
        tp.compiled_recompute()


def test_ddps_reducer_exchanges_gradients_of_a_forward_around_it_or_one_error_line(group,
                                                                                  monkeypatch):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def exchange(state, bucket):  # (DDP refuses annotations that are strings)
        exchanged.append(bucket.buffer().clone())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp, exchanged = DDP(nn.Linear(3, 1)), []
    ddp.register_comm_hook(None, exchange)
    ready = tp.ddp_backward(ddp)
    for _ in range(2):  # the second rebuilds the buckets
        loss = ddp.module(torch.ones(2, 3)).sum()  # not through DDP's forward
        ready(loss)
        loss.backward()  # without the reducer readied, no exchange
    assert [b.tolist() for b in exchanged] == [[2.0] * 3 + [2.0], [4.0] * 3 + [4.0]]
    monkeypatch.setattr(ddp, "reducer", SimpleNamespace())
    with pytest.raises(UsageError, match=f"a step under DDP needs .*{MISSING}"):
        tp.ddp_backward(ddp)


def test_a_sharded_layout_on_a_cpu_runs_or_one_error_line_naming_the_first_torch(monkeypatch):
    """Named without "fsdp": conftest skips such tests on the releases before 2.9, where this one
    checks the refusal."""
    from torch.torch_version import TorchVersion

    tp.fsdp_on(torch.device("meta"), "fsdp")  # (not a CPU: fsdp with NCCL on GPUs, from torch 2.6)
    if torch.__version__ >= "2.9":
        tp.fsdp_on(torch.device("cpu"), "fsdp")
        monkeypatch.setattr(torch, "__version__", TorchVersion("2.8.0+cu128"))
    found = re.escape(torch.__version__)
    for layout in ("fsdp", "tensor_parallel"):
        with pytest.raises(UsageError, match=f"--model-layout {layout} on a CPU needs .* which "
                                             f"torch {found} lacks; install torch 2.9 or later"):
            tp.fsdp_on(torch.device("cpu"), layout)


def test_a_stager_that_keeps_its_copy_or_none_where_torch_has_no_default_stager(monkeypatch):
    import torch.distributed.checkpoint.staging as staging

    if hasattr(staging, "DefaultStager"):
        assert isinstance(tp.reusable_stager(torch.device("cpu")), staging.DefaultStager)
        monkeypatch.delattr(staging, "DefaultStager")
    assert tp.reusable_stager(torch.device("cpu")) is None


@pytest.mark.skipif(torch.__version__ < "2.9", reason=f"fsdp on a CPU needs torch 2.9 or later, "
                    f"not {torch.__version__} (its one error line: the test above)")
def test_fsdp_units_keep_weights_for_a_graphs_backward_or_one_error_line(group, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    mesh = init_device_mesh("cpu", (1,))
    units = [fully_shard(model[0], mesh=mesh), fully_shard(model, mesh=mesh)]
    tp.fsdp_for_own_step(model, units)
    states = [unit._get_fsdp_state() for unit in units]
    groups = [g for s in states for g in (s._fsdp_param_groups if hasattr(s, "_fsdp_param_groups")
                                          else [s._fsdp_param_group])]  # torch 2.6 to 2.11
    assert len(groups) == 2 and all(g.post_backward.__name__ == "run" for g in groups)
    x = torch.ones(2, 4, requires_grad=True)
    (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)  # a gradient penalty
    grad.pow(2).sum().backward()  # its backward needs the weights still gathered
    assert model[0].weight.grad is not None and model[2].weight.grad is not None
    state = units[0]._get_fsdp_state()
    for name in ("_fsdp_param_groups", "_fsdp_param_group"):  # torch 2.12 on, torch 2.6 to 2.11
        if hasattr(state, name):
            monkeypatch.delattr(state, name)
    with pytest.raises(UsageError, match=f"under --model-layout fsdp needs FSDP2's .*{MISSING}"):
        tp.fsdp_for_own_step(model, units)


def test_the_moving_average_is_the_same_with_and_without_foreach(monkeypatch):
    averages, new = [torch.ones(3), torch.zeros(2)], [torch.full((3,), 3.0), torch.ones(2)]
    fast = [a.clone() for a in averages]
    tp.foreach_decay(fast, new, 0.9)
    for name in ("_foreach_mul_", "_foreach_add_"):
        monkeypatch.delattr(torch, name)
    tp.foreach_decay(averages, new, 0.9)
    for a, b in zip(fast, averages, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(averages[0], torch.ones(3).mul(0.9).add(new[0], alpha=0.1))
