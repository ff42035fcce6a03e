"""Sharded vs dispatched data: the same global batches, so the same weights; a stream that
only rank 0 can read ends on every rank at the same step."""

import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import Augmented
from dist_helpers import spawn
from ddp_training import CausalLM, DDPTrainer, TrainConfig, synthetic_lm_data

pytestmark = pytest.mark.multi

CFG = dict(hidden_size=32, num_layers=1, num_heads=2, seq_len=16, dataset_size=200, batch_size=8, max_steps=14,
           learning_rate=1e-2, warmup_steps=2, log_interval=100, val_interval=0, save_interval=0,
           save_every_iters=5, resume="none", device="cpu")


def only_rank_0_reads():
    """Under dispatch no other rank may touch the data: prove it by failing if one does."""
    if dist.is_initialized() and dist.get_rank() != 0:
        raise RuntimeError(f"rank {dist.get_rank()} read the data set")


class Rank0Only(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        only_rank_0_reads()
        return self.base[i]


def _train(rank, world_size, root, strategy, augment=False):
    cfg = {**CFG, "data_strategy": strategy, "log_dir": str(Path(root) / "logs"),
           "checkpoint_dir": str(Path(root) / "ckpt"), "num_workers": int(augment)}
    data = synthetic_lm_data(TrainConfig.from_dict(CFG))
    train = Augmented(data.train, 64) if augment else data.train
    train = Rank0Only(train) if strategy == "dispatch" else train
    torch.manual_seed(0)
    s = DDPTrainer(rank=rank, world_size=world_size, config=cfg, model=CausalLM(64, 32, 1, 2, 16),
                   train_dataset=train, val_dataset=data.val).train()
    return s["steps"], s["epochs"]


def final(root):
    return torch.load(Path(root) / "ckpt" / "model_final.pt", weights_only=True)["model"]


@pytest.mark.parametrize("augment", [False, True], ids=["plain", "augmented-in-a-worker"])
def test_shard_and_dispatch_give_identical_weights(tmp_path, augment):
    # 200 samples, 2 ranks x 8 -> 12 steps per epoch; 14 steps cross an epoch boundary. Augmented: random draws in
    # __getitem__, read by one worker per rank (shard) or by rank 0's one worker (dispatch), seeded per sample.
    assert spawn(_train, 2, str(tmp_path / "shard"), "shard", augment) == [(14, 1)] * 2
    assert spawn(_train, 2, str(tmp_path / "dispatch"), "dispatch", augment) == [(14, 1)] * 2
    a, b = final(tmp_path / "shard"), final(tmp_path / "dispatch")
    # Dispatch hands each rank exactly the samples the sharded sampler would: equal bit for bit.
    assert all(torch.equal(a[k], b[k]) for k in a)


class Stream(torch.utils.data.IterableDataset):
    """A source with no length and no random access: only iteration."""

    def __init__(self, base, n):
        self.base, self.n = base, n

    def __iter__(self):
        only_rank_0_reads()
        for i in range(self.n):
            yield self.base[i]


def _stream(rank, world_size, root):
    data = synthetic_lm_data(TrainConfig.from_dict(CFG))
    cfg = {**CFG, "data_strategy": "dispatch", "max_steps": 10, "save_every_iters": 0,
           "log_dir": str(Path(root) / "logs"), "checkpoint_dir": str(Path(root) / "ckpt")}
    s = DDPTrainer(rank=rank, world_size=world_size, config=cfg, model=CausalLM(64, 32, 1, 2, 16),
                   train_dataset=Stream(data.train, 64), val_dataset=data.val).train()
    return s["status"], s["steps"], s["epochs"]


def test_a_stream_read_by_rank_0_ends_every_epoch_on_all_ranks_together(tmp_path):
    # 64 samples per pass, 16 per global batch: 4 steps per pass; 10 steps = passes of 4, 4, 2.
    assert spawn(_stream, 2, str(tmp_path)) == [("completed", 10, 2)] * 2


class SizedStream(Stream):
    def __len__(self):
        return self.n


@pytest.mark.parametrize("stream", [Stream, SizedStream])
def test_a_resumed_stream_says_it_starts_again_from_its_first_sample(tmp_path, no_launch_env, stream):
    data = synthetic_lm_data(TrainConfig.from_dict(CFG))
    cfg = {**CFG, "data_strategy": "dispatch", "save_every_iters": 2, "keep_states": 0, "resume": "auto",
           "log_dir": str(tmp_path)}
    for steps in (3, 5):
        s = DDPTrainer(config={**cfg, "max_steps": steps}, model=CausalLM(64, 32, 1, 2, 16),
                       train_dataset=stream(data.train, 160), val_dataset=data.val).train()
        # a stream not yet at its end: the run's last step ended no epoch (it was counted, with its epoch file)
        assert s["epochs"] == 0, s
        for f in (tmp_path / "checkpoints").glob("model_state_step_3.pt*"):
            f.unlink()  # the run resumes from its state of step 2, in the middle of the stream
    assert ("the training set is a stream, which cannot be read from a position: the resumed run reads it from "
            "its start, not from where step 2 left it") in (tmp_path / "rank_0.log").read_text()

    # at the end of an epoch too: with max_steps the stream's "epoch" ends there, and a longer run read it again
    # from its start without a word (a user's exploratory test)
    DDPTrainer(config={**cfg, "max_steps": 7}, model=CausalLM(64, 32, 1, 2, 16),
               train_dataset=stream(data.train, 160), val_dataset=data.val).train()
    assert ("reads it from its start, not from where step 5 left it") in (tmp_path / "rank_0.log").read_text()


class EstimatedStream(Stream):
    def __len__(self):
        return 2 * self.n  # an estimate, twice what it yields


def test_a_streams_length_is_an_estimate_whose_end_is_no_error(tmp_path, no_launch_env):
    """A stream that ended before its __len__ was taken for a bad sample at every later read, until
    max_errors_per_epoch stopped the run (from a review)."""
    data = synthetic_lm_data(TrainConfig.from_dict(CFG))
    cfg = {**CFG, "data_strategy": "dispatch", "max_steps": 12, "log_dir": str(tmp_path)}
    s = DDPTrainer(config=cfg, model=CausalLM(64, 32, 1, 2, 16), train_dataset=EstimatedStream(data.train, 40),
                   val_dataset=data.val).train()  # 5 steps a pass: the run reads it 3 times
    assert (s["status"], s["steps"], s["epochs"]) == ("completed", 12, 2)
    assert "failed to load" not in (tmp_path / "rank_0.log").read_text()


def test_an_iterable_training_set_needs_dispatch(tmp_path, no_launch_env):
    data = synthetic_lm_data(TrainConfig.from_dict(CFG))
    with pytest.raises(ValueError, match="data_strategy dispatch"):
        DDPTrainer(config={**CFG, "log_dir": str(tmp_path)}, model=CausalLM(64, 32, 1, 2, 16),
                   train_dataset=Stream(data.train, 64))
    # rank 0 reads a stream in its own process: workers asked for are not used, and the log says so
    cfg = {**CFG, "log_dir": str(tmp_path / "w"), "data_strategy": "dispatch", "max_steps": 2, "num_workers": 1}
    DDPTrainer(config=cfg, model=CausalLM(64, 32, 1, 2, 16), train_dataset=Stream(data.train, 64)).close()
    assert "num_workers=1 is not used for a stream" in (tmp_path / "w" / "rank_0.log").read_text()


def _too_small(rank, world_size, root):
    data = synthetic_lm_data(TrainConfig.from_dict(CFG))
    try:
        DDPTrainer(rank=rank, world_size=world_size, config={**CFG, "data_strategy": "dispatch", "batch_size": 4,
                                                             "log_dir": root},
                   model=CausalLM(64, 32, 1, 2, 16), train_dataset=torch.utils.data.Subset(data.train, range(6)))
    except ValueError as exc:
        return str(exc)


def test_dispatch_of_a_training_set_too_small_for_a_batch_per_rank_is_one_error_on_every_rank(tmp_path):
    # before: rank 0 gave the global numbers (6 per rank, batch_size=8), rank 1 gloo's "Connection closed by peer"
    assert spawn(_too_small, 2, str(tmp_path)) == ["training set of 6 samples gives 3 per rank, fewer than "
                                                   "batch_size=4: no full batch per epoch"] * 2


class StallsOnce(torch.utils.data.Dataset):
    """Rank 0's reads stall for longer than dist_timeout at the start of step 2."""

    def __init__(self, base, at):
        self.base, self.at, self.calls = base, at, 0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.calls += 1
        if self.calls == self.at:
            time.sleep(8)
        return self.base[i]


def _stalled(rank, world_size, root):
    cfg = {**CFG, "data_strategy": "dispatch", "dist_timeout": 3, "log_dir": str(Path(root) / "logs"),
           "checkpoint_dir": str(Path(root) / "ckpt")}
    data = synthetic_lm_data(TrainConfig.from_dict(cfg))
    torch.manual_seed(0)
    try:
        DDPTrainer(rank=rank, world_size=world_size, config=cfg, model=CausalLM(64, 32, 1, 2, 16),
                   train_dataset=StallsOnce(data.train, at=2 * CFG["batch_size"] + 1), val_dataset=data.val).train()
        return "completed"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_dispatch_with_a_stuck_rank_0_names_the_timeout_not_bad_data(tmp_path):
    # the other rank's scatter times out: a failed collective, never a data error replayed as its own failure
    _, other = spawn(_stalled, 2, str(tmp_path), timeout=90)
    assert other.startswith("StepFailed: step 2: a collective did not complete within dist_timeout=3s"), other


class BrokenStream(torch.utils.data.IterableDataset):
    """A source whose first read fails: no batch has loaded yet that could stand in for it."""

    def __init__(self, base):
        self.base = base  # never read

    def __iter__(self):
        raise ConnectionError("the bucket is gone")
        yield


def _stream_outcome(rank, world_size, root, stream_class):
    """How 3 dispatched steps over `stream_class(training windows)` end on this rank."""
    data = synthetic_lm_data(TrainConfig.from_dict(CFG))
    cfg = {**CFG, "data_strategy": "dispatch", "max_steps": 3, "log_dir": str(Path(root) / "logs"),
           "checkpoint_dir": str(Path(root) / "ckpt")}
    try:
        DDPTrainer(rank=rank, world_size=world_size, config=cfg, model=CausalLM(64, 32, 1, 2, 16),
                   train_dataset=stream_class(data.train), val_dataset=data.val).train()
        return "completed"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_stream_that_fails_at_its_first_read_fails_step_1_on_every_rank_naming_the_error(tmp_path):
    errors = spawn(_stream_outcome, 2, str(tmp_path), BrokenStream, timeout=90)
    for rank, error in enumerate(errors):
        assert error == (f"StepFailed: step 1: BatchLoadError: ConnectionError: the bucket is gone (read by rank 0 "
                         f"for rank {rank}, data_strategy dispatch); no batch of the stream has loaded yet to stand "
                         f"in for it (a stream cannot be read by index)"), errors


class OddSampleStream(torch.utils.data.IterableDataset):
    """Sample 1 (in rank 1's part of the first global batch) has another length: only that part fails to
    collate. A stream has no batch yet that either rank could replay in its place."""

    def __init__(self, base):
        self.base = base

    def __iter__(self):
        for i in range(len(self.base)):
            x, y = self.base[i]
            yield (x[:-1], y[:-1]) if i == 1 else (x, y)


def test_a_stream_part_that_fails_at_step_1_fails_every_rank_there_not_one_alone(tmp_path):
    # before: rank 1 raised alone and rank 0 died of a reset connection in the gradient all-reduce
    errors = spawn(_stream_outcome, 2, str(tmp_path), OddSampleStream, timeout=90)
    for rank, error in enumerate(errors):
        assert error.startswith("StepFailed: step 1: BatchLoadError: RuntimeError: stack expects each tensor to be "
                                "equal size"), errors
        assert f"(read by rank 0 for rank {rank}, data_strategy dispatch); no batch of the stream has loaded yet" \
            in error, errors
    assert "(in rank 1's part; a stream's parts load or fail together)" in errors[0], errors


class OddSamplesFail(Rank0Only):
    """Every odd sample fails: rank 1's part of the first global batch holds one, and rank 1 has no part yet to
    replay in its place."""

    def __getitem__(self, i):
        only_rank_0_reads()
        if i % 2:
            raise ValueError("corrupt record")
        return self.base[i]


def test_a_failed_first_part_names_why_no_batch_can_stand_in_for_it(tmp_path):
    """The rank that must read a stand-in itself under dispatch (where it reads nothing else) said only 'fewer
    than batch_size samples load', neither the bad sample nor why it could not read (from a user test)."""
    errors = spawn(_stream_outcome, 2, str(tmp_path), OddSamplesFail, timeout=90)
    assert re.fullmatch(r"RuntimeError: BatchLoadError: ValueError: corrupt record \(sample \d*[13579] of the training "
                        r"set\) \(read by rank 0 for rank 1, data_strategy dispatch\); no batch to replay in its place: "
                        r"fewer than batch_size=8 samples of the training set load on this rank \(data_strategy "
                        r"dispatch: before its first part, a rank reads its own\), the first error: RuntimeError: "
                        r"rank 1 read the data set \(sample 0\)", errors[1]), errors
    assert errors[0] == "StepFailed: step 1: rank 1 failed: " + errors[1], errors
