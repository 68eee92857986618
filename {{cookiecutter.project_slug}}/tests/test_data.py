"""Sharding, reshuffling and batched indexing of the data pipeline."""

from __future__ import annotations

import torch

from {{ cookiecutter.package_name }}.data import (
    TensorPairDataset,
    build_datasets,
    build_loader,
    eval_shard,
    save_tensor_file,
    synthetic_regression,
)


def _epoch_indices(dataset, rank, world, epoch, batch_size=8, start_batch=0):
    loader = build_loader(dataset, rank, world, batch_size, seed=0)
    loader.sampler.set_epoch(epoch, start_batch)
    return [batch for batch in loader.sampler]


def test_synthetic_data_is_identical_on_every_rank():
    a, b = synthetic_regression(64, seed=3), synthetic_regression(64, seed=3)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert a.x.shape == (64, 20) and a.y.shape == (64, 1)


def test_ranks_get_disjoint_shards_covering_the_data():
    dataset = synthetic_regression(100, seed=0)
    shards = [torch.cat(_epoch_indices(dataset, r, 2, epoch=0)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 50
    assert set(shards[0].tolist()).isdisjoint(shards[1].tolist())
    assert set(torch.cat(shards).tolist()) == set(range(100))


def test_uneven_sizes_give_every_rank_the_same_batch_count():
    dataset = synthetic_regression(101, seed=0)
    counts = [len(_epoch_indices(dataset, r, 4, epoch=0, batch_size=5)) for r in range(4)]
    assert len(set(counts)) == 1


def test_set_epoch_reshuffles():
    dataset = synthetic_regression(64, seed=0)
    e0, e1 = (torch.cat(_epoch_indices(dataset, 0, 2, epoch=e)) for e in (0, 1))
    assert not torch.equal(e0, e1)
    assert torch.equal(e0, torch.cat(_epoch_indices(dataset, 0, 2, epoch=0)))


def test_start_batch_skips_exactly_the_batches_done():
    dataset = synthetic_regression(64, seed=0)
    full = _epoch_indices(dataset, 1, 2, epoch=2)
    rest = _epoch_indices(dataset, 1, 2, epoch=2, start_batch=3)
    assert len(rest) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(full[3:], rest, strict=True))


def test_loader_yields_whole_batches_by_tensor_indexing():
    dataset = synthetic_regression(40, seed=0)
    loader = build_loader(dataset, 0, 1, batch_size=16, seed=0)
    loader.sampler.set_epoch(0)
    batches = list(loader)
    assert [x.shape[0] for x, _ in batches] == [16, 16, 8]
    indices = list(loader.sampler)
    assert torch.equal(batches[0][0], dataset.x[indices[0]])


def test_in_process_loader_and_worker_loader_yield_the_same_batches():
    dataset = synthetic_regression(50, seed=0)
    for rank in (0, 1):
        batches = []
        for workers in (0, 1):  # InMemoryLoader, then a DataLoader with one worker process
            loader = build_loader(dataset, rank, 2, batch_size=8, seed=5, num_workers=workers)
            loader.sampler.set_epoch(3, start_batch=1)
            batches.append(list(loader))
        assert len(batches[0]) == len(batches[1]) == 3
        for (x0, y0), (x1, y1) in zip(*batches, strict=True):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_tensor_file_round_trip(tmp_path):
    x, y = torch.randn(10, 20), torch.randn(10)
    save_tensor_file(tmp_path / "d.pt", x, y)
    dataset, val = build_datasets(str(tmp_path / "d.pt"), dataset_size=0, seed=0)
    assert isinstance(dataset, TensorPairDataset) and val is None
    assert torch.equal(dataset.x, x) and dataset.y.shape == (10, 1)
    train, val = build_datasets(str(tmp_path / "d.pt"), dataset_size=0, seed=0, val_fraction=0.3)
    assert (len(train), len(val)) == (7, 3)
    assert sorted(torch.cat([train.x, val.x])[:, 0].tolist()) == sorted(x[:, 0].tolist())


def test_synthetic_validation_comes_on_top_of_the_training_size():
    train, val = build_datasets(None, dataset_size=100, seed=0, val_fraction=0.1)
    assert (len(train), len(val)) == (100, 10)


def test_eval_shards_cover_each_sample_once():
    for size in (10, 11, 13):
        shards = [eval_shard(size, r, 4) for r in range(4)]
        assert sorted(torch.cat(shards).tolist()) == list(range(size))
