"""The data pipeline: sharding, reshuffling, batched and per-sample fetching, worker seeding."""

from __future__ import annotations

import collections
import contextlib
import pickle

import pytest
import torch
from torch.utils.data import Dataset

from {{ cookiecutter.package_name }}.data import (
    BatchFetcher,
    InMemoryDataset,
    InProcessLoader,
    ShardedBatchSampler,
    build_loader,
    move_to,
    place_on_device,
    validation_batches,
)
from {{ cookiecutter.package_name }}.failures import LostContact, RunFailure, UsageError
from {{ cookiecutter.package_name }}.runtime.prefetch import DevicePrefetcher, apply_to_tensors

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _indices(size, rank, world, epoch, batch_size=8, start_batch=0):
    sampler = ShardedBatchSampler(size, rank, world, batch_size, seed=0)
    sampler.set_epoch(epoch, start_batch)
    return [indices for _, indices in sampler]


def test_ranks_get_disjoint_shards_covering_the_data():
    shards = [torch.cat(_indices(100, r, 2, epoch=0)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 50
    assert set(shards[0].tolist()).isdisjoint(shards[1].tolist())
    assert set(torch.cat(shards).tolist()) == set(range(100))


def test_uneven_sizes_give_every_rank_the_same_batch_count_and_short_last_batch():
    counts = [len(_indices(101, r, 4, epoch=0, batch_size=5)) for r in range(4)]
    assert len(set(counts)) == 1
    sampler = ShardedBatchSampler(101, 0, 4, 5, seed=0)
    assert [sampler.batch_len(i) for i in range(sampler.batches_per_epoch())] == [5] * 5 + [1]


def test_set_epoch_reshuffles_the_same_way_on_every_call():
    e0, e1 = (torch.cat(_indices(64, 0, 2, epoch=e)) for e in (0, 1))
    assert not torch.equal(e0, e1)
    assert torch.equal(e0, torch.cat(_indices(64, 0, 2, epoch=0)))


def test_start_batch_skips_exactly_the_batches_done():
    full = _indices(64, 1, 2, epoch=2)
    rest = _indices(64, 1, 2, epoch=2, start_batch=3)
    assert len(rest) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(full[3:], rest, strict=True))


class PerSample(Dataset):
    """Items as dicts, one per call; counts the calls."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.calls += 1
        return {"x": torch.full((3,), float(i)), "noise": torch.rand(())}


def test_batched_data_sets_are_served_one_call_per_batch():
    data = InMemoryDataset(torch.arange(40.0)[:, None], torch.arange(40))
    sampler = ShardedBatchSampler(40, 0, 1, 16, seed=0)
    batches = list(build_loader(data, sampler, None, 0, CPU))
    assert [x.shape[0] for x, _ in batches] == [16, 16, 8]
    first = next(iter(sampler))[1]
    assert torch.equal(batches[0][1], first)


def test_per_sample_data_sets_are_collated_and_skipped_batches_never_loaded():
    data = PerSample(40)
    sampler = ShardedBatchSampler(40, 0, 1, 8, seed=0)
    sampler.set_epoch(0, start_batch=3)
    batches = list(build_loader(data, sampler, None, 0, CPU))
    assert data.calls == 16, "batches before the start batch must not be read"
    assert [b["x"].shape for b in batches] == [(8, 3), (8, 3)]


def test_getitems_returning_a_list_of_samples_is_collated():
    class ListBatches(PerSample):
        def __getitems__(self, indices):
            return [self[i] for i in indices.tolist()]

    fetcher = BatchFetcher(ListBatches(10), None)
    batch = fetcher.__getitems__((0, torch.tensor([1, 2, 3])))
    assert batch["x"].shape == (3, 3) and batch["x"][0, 0].item() == 1.0


class Unreadable(PerSample):
    """Every sample fails with `error` (a corrupt file: the task raises a UsageError)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(10)
        self.error = error

    def __getitem__(self, i: int) -> dict:
        raise self.error


@pytest.mark.parametrize("kind", [UsageError, RunFailure, LostContact])
def test_a_data_workers_error_reaches_the_training_process_with_its_class(monkeypatch, kind):
    # In a worker process the error is handed over as a batch (pickled to the training process)
    # and raised by move_to there: the same class and the same one line.
    monkeypatch.setattr("{{ cookiecutter.package_name }}.data.get_worker_info", lambda: object())
    fetcher = BatchFetcher(Unreadable(kind("--data: x.png cannot be decoded as an image")), None)
    with torch.random.fork_rng():  # a worker seeds its random state per batch
        batch = pickle.loads(pickle.dumps(fetcher.__getitems__((0, torch.tensor([3])))))
    with pytest.raises(kind) as raised:
        move_to(batch, CPU)
    assert type(raised.value) is kind
    assert str(raised.value) == "--data: x.png cannot be decoded as an image"


def test_worker_loader_equals_in_process_loader_and_its_randomness_is_per_batch():
    """Same batches with 0, 1 or 2 workers; random draws inside workers depend only on the batch,
    so a resumed run (start batch 2) sees exactly what an uninterrupted run saw."""
    data = PerSample(50)

    def run(workers, start):
        sampler = ShardedBatchSampler(50, 1, 2, 8, seed=5)
        sampler.set_epoch(3, start_batch=start)
        return list(build_loader(data, sampler, None, workers, CPU))

    base = run(0, 0)
    for workers in (1, 2):
        with_workers = run(workers, 0)
        assert [b["x"].tolist() for b in with_workers] == [b["x"].tolist() for b in base]
        resumed = run(workers, 2)
        assert [b["noise"].tolist() for b in resumed] == \
            [b["noise"].tolist() for b in with_workers[2:]]


def test_validation_batches_cover_each_sample_once_and_pad_to_equal_counts():
    for size in (10, 11, 13, 1):
        shards = [validation_batches(size, r, 4, batch_size=2, seed=0) for r in range(4)]
        assert len({len(s) for s in shards}) == 1, "every rank runs as many batches"
        real = [idx for s in shards for _, idx in list(s)[:s.real]]
        assert sorted(torch.cat(real).tolist()) == list(range(size))
        # A rank with no share runs only padding: no empty batch (collate cannot make one).
        assert all(len(idx) > 0 for s in shards for _, idx in s)


def test_move_to_handles_nested_batches():
    batch = {"a": (torch.zeros(2), [torch.ones(1)]), "b": "text"}
    moved = move_to(batch, torch.device("cpu"))
    assert moved["b"] == "text" and torch.equal(moved["a"][1][0], torch.ones(1))


class Output(collections.OrderedDict):
    """As transformers' ModelOutput: a dict whose fields are attributes too."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        setattr(self, key, value)


def test_a_models_output_keeps_its_own_type_through_the_hooks():
    # tensor_parallel's and model_parallel_2's output hooks map the output's tensors: a loss_fn
    # that reads `out.logits` (transformers' way) found a plain dict under tensor_parallel.
    output = Output()
    output["logits"] = torch.zeros(2, 3)
    pair = collections.namedtuple("Pair", "loss logits")(torch.ones(()), torch.zeros(2))
    mapped = apply_to_tensors({"out": output, "pair": pair, "list": [torch.ones(1)]},
                              lambda t: t + 1)
    assert type(mapped["out"]) is Output and torch.equal(mapped["out"].logits, torch.ones(2, 3))
    assert type(mapped["pair"]) is type(pair) and mapped["pair"].loss.item() == 2
    assert type(mapped["list"]) is list and torch.equal(output.logits, torch.zeros(2, 3))


def test_on_the_cpu_nothing_is_prefetched_or_moved():
    data = InMemoryDataset(torch.arange(40.0)[:, None])
    assert place_on_device([data, None], CPU, 0, "auto") == [data, None]
    loader = build_loader(data, ShardedBatchSampler(40, 0, 1, 8, seed=0), None, 0, CPU)
    assert type(loader) is InProcessLoader


# The GPU-only logic, run on a CPU: the placement decision on the meta device (any device but the
# CPU is placed alike), the prefetcher and the log step's copy with CUDA's streams and events faked.
META = torch.device("meta")


def test_in_memory_data_that_fits_in_a_quarter_of_free_memory_goes_to_the_device():
    train = InMemoryDataset(torch.zeros(100, 4), torch.zeros(100, dtype=torch.long))  # 2,400 B
    val, files = InMemoryDataset(torch.zeros(25, 4)), PerSample(10)  # 400 B; not in memory
    placed = place_on_device([train, val, files, None], META, 0, "auto", free_bytes=4 * 2800)
    assert [d.tensors[0].device for d in placed[:2]] == [META, META]
    assert placed[2] is files and placed[3] is None
    assert place_on_device([train, val], META, 0, "auto", free_bytes=4 * 2800 - 4) == [train, val]
    assert place_on_device([train], META, 2, "auto", free_bytes=10**9) == [train]  # workers
    assert place_on_device([train], META, 0, "never", free_bytes=10**9) == [train]


def test_data_on_the_device_is_cut_there_from_indices_copied_once_an_epoch():
    data = place_on_device([InMemoryDataset(torch.zeros(40, 2))], META, 0, "auto",
                           free_bytes=10**9)[0]
    sampler = ShardedBatchSampler(40, 1, 2, 8, seed=0)
    loader = build_loader(data, sampler, None, 0, META)
    assert type(loader) is InProcessLoader  # no prefetcher: there is nothing to copy
    assert all(indices.device == META for _, indices in sampler)
    assert [tuple(batch.shape) for batch in loader] == [(8, 2), (8, 2), (4, 2)]
    assert all(batch.device == META for batch in loader)


class FakeCuda:
    """CUDA's streams, events and pinned memory, recorded in `log` (tensors stay on the CPU)."""

    def __init__(self, monkeypatch) -> None:
        self.log: list[tuple] = []
        log, copies = self.log, []

        class Stream:
            def __init__(self, device=None, name: str = "copy") -> None:
                self.name = name

            def record_event(self):  # the copy stream's events, numbered
                copies.append(None)
                log.append(("copied", len(copies) - 1))
                return Event(len(copies) - 1)

            def wait_event(self, event) -> None:
                log.append(("wait", self.name, event.seq))

        class Event:
            def __init__(self, seq: int = -1) -> None:
                self.seq = seq

            def record(self) -> None:
                log.append(("event recorded",))

            def synchronize(self) -> None:
                log.append(("host waits for the event",))

        def on(stream):
            log.append(("on", stream.name))
            return contextlib.nullcontext()

        step = Stream(name="step")
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: step)
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: False)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: log.append(("pin",)) or t.clone())
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: log.append(("uses", s.name, t.tolist())))


@pytest.mark.parametrize("ahead", [False, True])
def test_the_prefetcher_copies_on_its_stream_and_the_step_waits_for_each_copy(monkeypatch,
                                                                                ahead):
    log = FakeCuda(monkeypatch).log
    prefetcher = DevicePrefetcher([torch.tensor([float(i)]) for i in range(3)], CPU, ahead=ahead)
    for batch in prefetcher:
        log.append(("step", int(batch.item())))
    for i in range(3):
        copy, step = log.index(("copied", i)), log.index(("step", i))
        assert log[copy - 2:copy] == [("pin",), ("on", "copy")]  # pinned, copied on its stream
        # the step's stream waits for that copy; the allocator learns the step uses the batch
        assert copy < step and log[step - 2:step] == [("wait", "step", i), ("uses", "step", [i])]
        if i < 2:  # ahead (DataLoader workers): the next copy starts before this step
            assert (log.index(("copied", i + 1)) < step) == ahead


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("queued", [False, True])
def test_the_log_step_reads_its_all_reduce_later_through_a_queued_copy(monkeypatch, queued,
                                                                       one_process_group):
    from {{ cookiecutter.package_name }}.meters import LogStats

    log = FakeCuda(monkeypatch).log
    stats = LogStats({"loss": torch.tensor(6.0), "part": torch.tensor(1.5)}, {"loss": 3, "part": 1},
                     None, {"step": 10}, CPU, CPU, queued=queued)
    # queued (NCCL on a GPU): the copy to the host is queued behind the all_reduce with an event,
    # and reading it waits for that event alone
    assert log == ([("event recorded",)] if queued else [])
    means, stop, peak, _ = stats.result()
    assert log == ([("event recorded",), ("host waits for the event",)] if queued else [])
    assert (means, stop, len(peak)) == ({"loss": 2.0, "part": 1.5}, False, 1) and peak[0] > 0


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_prefetched_batches_arrive_on_the_gpu_equal_and_in_order(workers):
    gpu = torch.device("cuda", 0)
    data = PerSample(50)

    def batches(device):
        sampler = ShardedBatchSampler(50, 0, 1, 8, seed=5)
        return list(build_loader(data, sampler, None, workers, device))

    on_cpu, on_gpu = batches(CPU), batches(gpu)
    assert all(b["x"].device == gpu for b in on_gpu)
    assert [b["x"].tolist() for b in on_gpu] == [b["x"].tolist() for b in on_cpu]


@needs_cuda
def test_prefetched_in_memory_batches_are_the_sampled_ones():
    gpu = torch.device("cuda", 0)
    big = InMemoryDataset(torch.randn(64, 1024, 1024))  # 4 MiB a sample: copies take a while
    sampler = ShardedBatchSampler(64, 0, 1, 16, seed=0)
    prefetcher = build_loader(big, sampler, None, 0, gpu)
    assert isinstance(prefetcher, DevicePrefetcher)
    seen = []
    for batch in prefetcher:
        seen.append(batch.sum().item())
    expected = [big.tensors[0][idx].sum().item() for _, idx in sampler]
    assert seen == pytest.approx(expected, rel=1e-5)


@needs_cuda
def test_an_in_memory_data_set_that_fits_lives_on_the_gpu():
    gpu = torch.device("cuda", 0)
    data = InMemoryDataset(torch.arange(40.0)[:, None], torch.arange(40))
    placed = place_on_device([data], gpu, 0, "auto")[0]
    assert all(t.is_cuda for t in placed.tensors)
    x, y = placed.__getitems__(torch.tensor([3, 1]))
    assert x.is_cuda and y.tolist() == [3, 1]
    assert place_on_device([data], gpu, 2, "auto") == [data]  # workers read host memory
    assert place_on_device([data], gpu, 0, "never") == [data]
