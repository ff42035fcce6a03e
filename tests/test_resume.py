"""Resumable state: a run stopped at any step and resumed ends with weights bit-identical
to a run that never stopped (compared tensor by tensor with torch.equal), on one rank and
on two, after SIGTERM, after SIGKILL under torchrun --max-restarts, and after corruption."""

import json
import os
import re
import random
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

import ddp_runtime as rt
from conftest import Augmented, background, clean_env, make_vj2_data, metrics, torchrun, torchrun_workers, wait_for_step
from dist_helpers import spawn
from ddp_training import CausalLM, DDPTrainer, TrainConfig, lm_loss, synthetic_lm_data

# 128 samples / 16 per batch = 8 steps per epoch; 20 steps cross two epoch boundaries.
# Dropout is on so the torch RNG streams must be restored too.
BASE = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=32, dataset_size=128, batch_size=16,
            max_steps=20, learning_rate=1e-2, warmup_steps=3, log_interval=100, val_interval=0,
            save_every_iters=5, save_interval=0, dropout=0.1, device="cpu")


class SignalAt:
    """A loss that sends SIGTERM to its own process during step `step` (a real signal, caught by
    the trainer's handler; the stop is agreed across ranks at the end of that step)."""

    def __init__(self, step: int, accum: int = 1):
        self.calls, self.at = 0, (step - 1) * accum + 1

    def __call__(self, model, batch):
        self.calls += model.training  # validation batches do not count
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return lm_loss(model, batch)


def cfg_for(root: Path, **extra) -> dict:
    return {**BASE, "log_dir": str(root / "logs"), "checkpoint_dir": str(root / "ckpt"), **extra}


def final_weights(root: Path) -> dict:
    return torch.load(root / "ckpt" / "model_final.pt", weights_only=True)["model"]


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ after resume: {different[:5]}"


def train_steps(root: Path) -> list:
    return [r["step"] for r in metrics(root / "logs", "train")]


# -- one process --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_1(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref1")
    DDPTrainer(config=cfg_for(root)).train()
    return final_weights(root)


def test_a_stop_at_an_epoch_end_save_point_does_not_wait_for_the_epochs_validation(tmp_path, no_launch_env,
                                                                                   reference_1):
    """An epoch's validation comes before a save point at its last step (the files are then written once, with
    the loss), but not at a stop: a scheduler's grace must not go to a validation, which the resume redoes."""
    unbroken = DDPTrainer(config=cfg_for(tmp_path / "unbroken", save_every_iters=8)).train()
    assert [r["step"] for r in metrics(tmp_path / "unbroken" / "logs", "val")] == [8, 16, 20]
    assert torch.load(tmp_path / "unbroken" / "ckpt" / "model_step_8.pt", weights_only=True)["val_loss"] == \
        pytest.approx([r["val_loss"] for r in metrics(tmp_path / "unbroken" / "logs", "val")][0])
    first = DDPTrainer(config=cfg_for(tmp_path, save_every_iters=8), loss_fn=SignalAt(8)).train()
    assert (first["status"], first["steps"]) == ("interrupted", 8) and metrics(tmp_path / "logs", "val") == []
    second = DDPTrainer(config=cfg_for(tmp_path, save_every_iters=8)).train()
    assert second["resumed_from"].endswith("model_state_step_8.pt")
    assert [r["step"] for r in metrics(tmp_path / "logs", "val")] == [8, 16, 20]
    assert_bit_identical(final_weights(tmp_path), reference_1)
    assert second["final_val_loss"] == unbroken["final_val_loss"]


def test_a_save_point_at_an_epochs_saving_end_writes_one_state(tmp_path, no_launch_env, reference_1):
    """A save point at an epoch's last step wrote the state, and the epoch's end (save_interval) wrote it again
    after the validation (from a review): one write, at the epoch's end. A stop at the next step resumes
    bit-exactly from it."""
    first = DDPTrainer(config=cfg_for(tmp_path, save_every_iters=8, save_interval=1), loss_fn=SignalAt(12)).train()
    assert first["status"] == "interrupted"
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert log.count("writing (in the background) resumable state") == 2, log  # steps 8 and 12
    assert log.count("model_state_step_8.pt (step 8, epoch 2, 0 steps into the epoch)") == 1, log
    DDPTrainer(config=cfg_for(tmp_path, save_every_iters=8, save_interval=1)).train()
    assert_bit_identical(final_weights(tmp_path), reference_1)


def test_a_state_without_its_sidecar_resumes_with_a_warning(tmp_path, no_launch_env, reference_1):
    """A kill between a state's rename and its sidecar's leaves a state that loads unchecked: a chaos test
    resumed from such a file with a flipped byte without a word. The resume says it is unchecked."""
    DDPTrainer(config=cfg_for(tmp_path), loss_fn=SignalAt(7)).train()
    Path(tmp_path / "ckpt" / "model_state_step_7.pt.sha256").unlink()
    summary = DDPTrainer(config=cfg_for(tmp_path)).train()
    assert summary["resumed_from"].endswith("model_state_step_7.pt")
    assert f"WARNING: {tmp_path / 'ckpt' / 'model_state_step_7.pt'} has no .sha256 sidecar: resumed from it " \
           "unchecked (corruption would go unseen)" in (tmp_path / "logs" / "rank_0.log").read_text()
    assert_bit_identical(final_weights(tmp_path), reference_1)


@pytest.mark.parametrize("stop_at", [3, 8, 6], ids=["mid-epoch", "epoch-boundary", "after-checkpoint"])
def test_stop_and_resume_is_bit_identical_one_process(tmp_path, no_launch_env, reference_1, stop_at):
    first = DDPTrainer(config=cfg_for(tmp_path), loss_fn=SignalAt(stop_at)).train()
    assert first["status"] == "interrupted" and first["steps"] == stop_at
    assert json.loads((tmp_path / "logs" / "PREEMPTED").read_text())["step"] == stop_at
    stopped = tmp_path / "ckpt" / "model_interrupted.pt"
    assert torch.load(stopped, weights_only=True)["global_step"] == stop_at
    second = DDPTrainer(config=cfg_for(tmp_path)).train()  # resume: auto, the default
    assert second["status"] == "completed" and second["resumed_from"].endswith(f"state_step_{stop_at}.pt")
    assert_bit_identical(final_weights(tmp_path), reference_1)
    assert train_steps(tmp_path) == list(range(1, 21))  # the resumed curve has no duplicates
    assert not (tmp_path / "logs" / "PREEMPTED").exists()
    # the stop's weights are not the run's last any more: only model_final.pt is left to take
    assert not stopped.exists() and not Path(f"{stopped}.sha256").exists()


def test_a_stop_at_the_last_step_of_the_last_epoch_resumes_into_that_epochs_end(tmp_path, no_launch_env):
    """The resumed run had no step left, so it skipped the epoch's end: no epoch checkpoint, "epochs": 0, and a
    step file of that step without the loss of the validation redone there."""
    cfg = cfg_for(tmp_path, max_steps=16, save_every_iters=8, save_interval=1)
    assert DDPTrainer(config=cfg, loss_fn=SignalAt(16)).train()["status"] == "interrupted"
    second = DDPTrainer(config=cfg).train()
    assert (second["status"], second["steps"], second["epochs"]) == ("completed", 16, 2)
    ckpt = {n: torch.load(tmp_path / "ckpt" / f"model_{n}.pt", weights_only=True) for n in ("epoch_2", "step_16")}
    assert ckpt["step_16"]["val_loss"] == ckpt["epoch_2"]["val_loss"] == second["final_val_loss"]
    assert [r["step"] for r in metrics(tmp_path / "logs", "val")] == [8, 16]


def augmented_run(root: Path, num_workers: int, loss_fn=None) -> dict:
    cfg = cfg_for(root, num_workers=num_workers, val_interval=10)
    data = synthetic_lm_data(TrainConfig.from_dict(cfg))
    torch.manual_seed(0)
    model = CausalLM(data.vocab_size, 32, 2, 2, 32, dropout=0.1)
    return DDPTrainer(config=cfg, model=model, train_dataset=Augmented(data.train, data.vocab_size),
                      val_dataset=Augmented(data.val, data.vocab_size), loss_fn=loss_fn).train()


def test_augmentation_in_workers_resumes_bit_identical_with_any_worker_count(tmp_path, no_launch_env):
    """With workers, each sample's random streams are seeded from (seed, epoch, index): an interrupted
    run repeats every draw of an unbroken one, and 1 or 2 workers read the same batches."""
    reference = augmented_run(tmp_path / "ref", num_workers=2)
    first = augmented_run(tmp_path / "run", num_workers=2, loss_fn=SignalAt(6))
    assert first["status"] == "interrupted" and first["steps"] == 6
    second = augmented_run(tmp_path / "run", num_workers=2)
    assert second["resumed_from"].endswith("state_step_6.pt")
    assert_bit_identical(final_weights(tmp_path / "run"), final_weights(tmp_path / "ref"))
    assert second["final_val_loss"] == reference["final_val_loss"]  # evaluation draws the same augmentation too
    augmented_run(tmp_path / "one", num_workers=1)
    assert_bit_identical(final_weights(tmp_path / "one"), final_weights(tmp_path / "ref"))


def test_augmentation_in_the_main_process_resumes_bit_identical(tmp_path, no_launch_env):
    """Without workers the dataset draws from this process's torch, numpy and random streams: a resume must
    restore all three (restoring torch's alone passed every other resume test; from a mutation review)."""
    augmented_run(tmp_path / "ref", num_workers=0)
    assert augmented_run(tmp_path / "run", num_workers=0, loss_fn=SignalAt(6))["status"] == "interrupted"
    second = augmented_run(tmp_path / "run", num_workers=0)
    assert second["resumed_from"].endswith("state_step_6.pt")
    assert_bit_identical(final_weights(tmp_path / "run"), final_weights(tmp_path / "ref"))


def test_a_resume_in_the_middle_of_an_epoch_keeps_the_runs_own_epoch_files(tmp_path, no_launch_env):
    """Set aside are the epoch files past the state's epoch, not the one it has finished (from a mutation
    review: with >= for >, model_epoch_1.pt went into previous_states.*/ as "not this run's")."""
    cfg = cfg_for(tmp_path, save_interval=1)
    first = DDPTrainer(config=cfg, loss_fn=SignalAt(11)).train()
    assert first["status"] == "interrupted" and first["epochs"] == 1  # stopped in the second epoch
    epoch_1 = torch.load(tmp_path / "ckpt" / "model_epoch_1.pt", weights_only=True)
    assert DDPTrainer(config=cfg).train()["status"] == "completed"
    kept = torch.load(tmp_path / "ckpt" / "model_epoch_1.pt", weights_only=True)
    assert kept["global_step"] == epoch_1["global_step"] and not list((tmp_path / "ckpt").glob("previous_states.*"))


def test_resuming_with_workers_after_none_or_none_after_some_says_the_draws_differ(tmp_path, no_launch_env):
    augmented_run(tmp_path, num_workers=2, loss_fn=SignalAt(6))
    again = augmented_run(tmp_path, num_workers=0)
    assert again["resumed_from"].endswith("state_step_6.pt")
    assert ("model_state_step_6.pt was written with some loader workers, this run has none: a dataset that draws "
            "random numbers") in (tmp_path / "logs" / "rank_0.log").read_text()


def test_a_state_of_other_built_in_data_is_refused_and_one_without_a_fingerprint_warns(tmp_path, no_launch_env):
    cfg = cfg_for(tmp_path, max_steps=5)
    DDPTrainer(config=cfg).train()
    with pytest.raises(ValueError, match="model_state_step_5.pt was written while training on other data"):
        DDPTrainer(config={**cfg, "max_steps": 8, "markov_branching": 3}).train()  # another synthetic chain
    # a state from before fingerprints: resumed, with a warning
    path = tmp_path / "ckpt" / "model_state_step_5.pt"
    state = rt.load_checkpoint(path)
    del state["data_fingerprint"]
    rt.atomic_save(state, path)
    assert DDPTrainer(config={**cfg, "max_steps": 8}).train()["resumed_from"].endswith("model_state_step_5.pt")
    assert "model_state_step_5.pt predates the training data's fingerprint" in (
        tmp_path / "logs" / "rank_0.log").read_text()


def test_a_state_of_a_data_file_edited_in_the_middle_is_refused(tmp_path, no_launch_env):
    """Every token counts for data of moderate size, not just the first and last windows; a state of the
    first kind of fingerprint (those two windows) still resumes on the data it was made with."""
    import ddp_training
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(random.Random(0).choices(range(97, 123), k=20000)))
    cfg = {**cfg_for(tmp_path, max_steps=2), "data": str(text)}
    DDPTrainer(config=cfg).train()
    path = tmp_path / "ckpt" / "model_state_step_2.pt"
    state = rt.load_checkpoint(path)
    assert state["data_fingerprint"].startswith(ddp_training.FINGERPRINT_VERSION)
    first_kind = ddp_training.first_kind_fingerprint(ddp_training.file_lm_data(TrainConfig.from_dict(cfg)).train)
    edited = bytearray(text.read_bytes())
    edited[10000:10100] = b"z" * 100
    text.write_bytes(bytes(edited))
    with pytest.raises(ValueError, match="model_state_step_2.pt was written while training on other data"):
        DDPTrainer(config={**cfg, "max_steps": 4}).train()
    rt.atomic_save({**state, "data_fingerprint": first_kind}, path)  # the first kind misses a middle edit
    assert DDPTrainer(config={**cfg, "max_steps": 4}).train()["resumed_from"].endswith("model_state_step_2.pt")


def test_resume_none_starts_fresh_and_sets_the_old_states_aside(tmp_path, no_launch_env):
    DDPTrainer(config=cfg_for(tmp_path)).train()  # leaves states 15 and 20
    earlier = final_weights(tmp_path)
    s = DDPTrainer(config=cfg_for(tmp_path, resume="none", max_steps=14)).train()
    assert s["resumed_from"] is None and s["steps"] == 14
    assert train_steps(tmp_path) == list(range(1, 15))  # a new curve from step 1, not a continuation
    DDPTrainer(config=cfg_for(tmp_path / "fresh", max_steps=14)).train()
    assert_bit_identical(final_weights(tmp_path), final_weights(tmp_path / "fresh"))
    # the new run's states survive pruning (the old 15 and 20 are newer by step) and the old ones are kept aside
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("model_state_step_*.pt")) == ["model_state_step_10.pt",
                                                                          "model_state_step_14.pt"]
    (aside,) = ckpt.glob("previous_states.*")
    assert sorted(p.name for p in aside.glob("model_state_*.pt")) == ["model_state_step_15.pt",
                                                                      "model_state_step_20.pt"]
    assert f"weights file(s) (from before this fresh start) to {aside}" in (tmp_path / "logs" / "rank_0.log").read_text()
    # and so are its weights files, which the new run overwrote (final, step_10) or left beside its own (step_20)
    assert {p.name for p in aside.glob("*.pt")} - {p.name for p in aside.glob("model_state_*.pt")} == {
        "model_best.pt", "model_final.pt", *(f"model_step_{n}.pt" for n in (5, 10, 15, 20))}
    assert_bit_identical(torch.load(aside / "model_final.pt", weights_only=True)["model"], earlier)
    assert sorted(p.name for p in ckpt.glob("model_step_*.pt")) == ["model_step_10.pt", "model_step_5.pt"]
    longer = DDPTrainer(config=cfg_for(tmp_path, max_steps=16)).train()  # resume auto: this run, not the old one
    assert longer["resumed_from"].endswith("model_state_step_14.pt")


def test_a_state_past_a_shorter_max_steps_says_there_is_nothing_to_train(tmp_path, no_launch_env):
    DDPTrainer(config=cfg_for(tmp_path, max_steps=12, save_every_iters=6, dropout=0.0)).train()
    (tmp_path / "logs" / "COMPLETED").unlink()  # as if stopped at step 12: the state there is resumed
    s = DDPTrainer(config=cfg_for(tmp_path, max_steps=8, save_every_iters=6, dropout=0.0)).train()
    assert s["steps"] == 12 and s["resumed_from"].endswith("model_state_step_12.pt")
    assert "the state is past this run's length (8 steps: max_steps or num_epochs): nothing to train; the run " \
           "ends at step 12" in (tmp_path / "logs" / "rank_0.log").read_text()
    # the run's config stays the one that trained it (a user test found max_steps 8 there)
    assert yaml.safe_load((tmp_path / "logs" / "config.yaml").read_text())["max_steps"] == 12


def test_a_fresh_run_never_replaces_earlier_set_aside_curves(tmp_path, no_launch_env):
    cfg = cfg_for(tmp_path, max_steps=2, resume="none")
    DDPTrainer(config=cfg).train()
    now = int(time.time())
    taken = {tmp_path / "logs" / f"metrics.{t}.jsonl" for t in range(now, now + 30)}  # an earlier run's, this second
    for p in taken:
        p.write_text('{"earlier": true}\n')
    DDPTrainer(config=cfg).train()
    assert all(p.read_text() == '{"earlier": true}\n' for p in taken)
    (moved,) = set((tmp_path / "logs").glob("metrics.*.jsonl")) - taken
    assert [r["step"] for r in map(json.loads, moved.read_text().splitlines()) if r["type"] == "train"] == [1, 2]


def test_a_fresh_run_with_fewer_ranks_sets_the_other_ranks_logs_aside(tmp_path, no_launch_env):
    """An earlier run of 4 ranks left rank_0..3.log; a fresh run of 1 appends to rank_0.log, launch after launch,
    and rank_1..3.log would pass for this run's."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for n in range(4):
        (logs / f"rank_{n}.log").write_text(f"the earlier run's rank {n}\n")
    (logs / "rank_2.1234.log").write_text("set aside before\n")
    DDPTrainer(config=cfg_for(tmp_path, max_steps=2)).train()
    assert sorted(p.name for p in logs.glob("rank_*.log") if p.name.count(".") == 1) == ["rank_0.log"]
    for n in (1, 2, 3):
        (aside,) = set(logs.glob(f"rank_{n}.*.log")) - {logs / "rank_2.1234.log"}
        assert aside.read_text() == f"the earlier run's rank {n}\n"
    assert (logs / "rank_2.1234.log").read_text() == "set aside before\n"
    assert (logs / "rank_0.log").read_text().startswith("the earlier run's rank 0\n")
    DDPTrainer(config=cfg_for(tmp_path, max_steps=4)).train()  # resumed: nothing to set aside
    assert len(list(logs.glob("rank_*.log"))) == 5


def test_a_validation_the_state_predates_is_logged_once(tmp_path, no_launch_env):
    cfg = cfg_for(tmp_path, max_steps=10, save_every_iters=8)  # 8 steps per epoch
    DDPTrainer(config=cfg).train()
    # as if killed after step 10, before the final state: the newest state is step 8's, which the epoch's
    # closing validation at step 8 came after
    (tmp_path / "logs" / "COMPLETED").unlink()
    (tmp_path / "ckpt" / "model_state_step_10.pt").unlink()
    again = DDPTrainer(config=cfg).train()
    assert again["resumed_from"].endswith("model_state_step_8.pt")
    assert [r["step"] for r in metrics(tmp_path / "logs", "val")] == [8, 10]


def test_relaunching_a_finished_run_changes_nothing(tmp_path, no_launch_env):
    first = DDPTrainer(config=cfg_for(tmp_path)).train()  # 20 steps, a state at step 20
    files = {p: p.read_bytes() for p in [*(tmp_path / "ckpt").glob("*.pt"), tmp_path / "logs" / "metrics.jsonl"]}
    again = DDPTrainer(config=cfg_for(tmp_path)).train()
    assert again == {**first, "already_complete": True}  # its summary, and its files untouched
    assert {p: p.read_bytes() for p in files} == files
    # a learning rate changed for a finished run trains nothing: the log said it applied "from here on"
    lr = cfg_for(tmp_path)["learning_rate"]
    assert DDPTrainer(config={**cfg_for(tmp_path), "learning_rate": lr / 2}).train()["already_complete"]
    log = (tmp_path / "logs" / "rank_0.log").read_text().split("rank 0/1, local_rank")[-1]
    assert "apply from here on" not in log and (f"nothing to do, and this run's (learning_rate, weight_decay) "
                                                f"[({lr / 2}, ") in log and "train no step; resume none" in log, log
    assert DDPTrainer(config={**cfg_for(tmp_path), "learning_rate": lr / 2, "max_steps": 22}).train()["steps"] == 22
    assert "apply from here on" in (tmp_path / "logs" / "rank_0.log").read_text().split("rank 0/1, local_rank")[-1]


def test_an_early_stopped_run_is_done_until_its_stop_is_lifted(tmp_path, no_launch_env):
    # an early stop at step 10 (patience 1 on an unchanging loss), with no periodic state
    cfg = cfg_for(tmp_path, val_interval=5, patience=1, min_delta=0.1, learning_rate=1e-9, warmup_steps=0,
                  save_every_iters=0)
    first = DDPTrainer(config=cfg).train()
    assert first["status"] == "early_stopped" and first["steps"] == 10
    files = {p: p.read_bytes() for p in [*(tmp_path / "ckpt").glob("*.pt"), tmp_path / "logs" / "metrics.jsonl"]}
    again = DDPTrainer(config=cfg).train()
    assert again["already_complete"] and again["status"] == "early_stopped" and again["steps"] == 10
    assert {p: p.read_bytes() for p in files} == files
    # killed after the stop was decided and saved, before COMPLETED: the relaunch stops again, training nothing
    (tmp_path / "logs" / "COMPLETED").unlink()
    again = DDPTrainer(config=cfg).train()
    assert again["status"] == "early_stopped" and again["steps"] == 10 and again["resumed_from"]
    assert train_steps(tmp_path) == list(range(1, 11))
    # the stop lifted (no patience), the same max_steps: it trains on from the run's final state
    lifted = DDPTrainer(config={**cfg, "patience": 0}).train()
    assert not lifted.get("already_complete") and lifted["status"] == "completed" and lifted["steps"] == 20
    assert lifted["resumed_from"].endswith("model_state_step_10.pt")
    assert train_steps(tmp_path) == list(range(1, 21))


def test_a_longer_max_steps_trains_on_from_where_the_finished_run_ended(tmp_path, no_launch_env):
    cfg = cfg_for(tmp_path, max_steps=6, save_every_iters=0)  # no periodic state: the final one
    DDPTrainer(config=cfg).train()
    longer = DDPTrainer(config={**cfg, "max_steps": 12}).train()
    assert longer["resumed_from"].endswith("model_state_step_6.pt") and longer["steps"] == 12
    assert train_steps(tmp_path) == list(range(1, 13))


def test_a_resumed_run_takes_its_curves_back_from_another_run_in_its_log_dir(tmp_path, no_launch_env):
    """Run a stops at step 6; run b (its own checkpoints, the same log dir) starts fresh, moves a's metrics.jsonl
    aside and finishes at step 10. When a resumes to 10 steps, its curves must not go on from b's records (a
    stitched curve), and b's COMPLETED marker must not stop it as 'already finished'."""
    a = cfg_for(tmp_path, max_steps=6, save_every_iters=0)
    b = {**a, "checkpoint_dir": str(tmp_path / "ckpt_b"), "max_steps": 10}
    logs = tmp_path / "logs"

    def steps_by_run(path):
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        starts = [r for r in recs if r["type"] == "start"]
        return {r["run_id"] for r in starts}, [r["step"] for r in recs if r["type"] == "train"], starts

    summary = DDPTrainer(config=a).train()
    (run_a,), _, (start,) = steps_by_run(logs / "metrics.jsonl")
    assert start["steps_per_epoch"] == summary["steps_per_epoch"] > 0  # for --x epoch before any validation
    DDPTrainer(config=b).train()
    (run_b,), b_steps, _ = steps_by_run(logs / "metrics.jsonl")
    assert run_b != run_a and b_steps == list(range(1, 11))
    resumed = DDPTrainer(config={**a, "max_steps": 10}).train()
    assert "already_complete" not in resumed and resumed["resumed_from"].endswith("model_state_step_6.pt")
    ids, steps, starts = steps_by_run(logs / "metrics.jsonl")
    assert ids == {run_a} and steps == list(range(1, 11))
    assert [(s["step"], s["resumed_from"] is not None) for s in starts] == [(0, False), (6, True)]
    (aside,) = logs.glob("metrics.*.jsonl")
    assert steps_by_run(aside)[:2] == ({run_b}, list(range(1, 11)))
    assert f"held the records of another run (one that started fresh in this log dir): moved them to {aside}; " \
           f"this run's records are back from" in (logs / "rank_0.log").read_text()
    # and b gets its own back in turn
    DDPTrainer(config={**b, "max_steps": 12}).train()
    assert steps_by_run(logs / "metrics.jsonl")[:2] == ({run_b}, list(range(1, 13)))
    assert sorted(steps_by_run(p)[:2] for p in logs.glob("metrics.*.jsonl")) == [({run_a}, list(range(1, 11)))]


def test_a_metrics_file_begun_before_run_ids_is_known_by_its_first_start_record(tmp_path):
    """A run begun before 27 Nov 2026 and resumed since has its start record after its first records."""
    from ddp_training import metrics_run_id
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "train", "step": 1}\n{"type": "train", "st\n'
                    '{"type": "start", "run_id": "ab12", "step": 1}\n{"type": "start", "run_id": "cd34", "step": 2}\n')
    assert metrics_run_id(path) == "ab12"
    path.write_text('{"type": "train", "step": 1}\n')
    assert metrics_run_id(path) is None and metrics_run_id(tmp_path / "absent.jsonl") is None


def test_the_last_validation_of_a_finished_run_survives_its_extension(tmp_path, no_launch_env):
    """The state at the last step is saved before the run's closing validation; the run saves it again after,
    or a longer run would drop that validation from its curve and its best loss."""
    cfg = cfg_for(tmp_path, max_steps=6, save_every_iters=2)  # validations at epoch ends (8 steps) and the end
    first = DDPTrainer(config=cfg).train()
    assert [r["step"] for r in metrics(tmp_path / "logs", "val")] == [6]
    longer = DDPTrainer(config={**cfg, "max_steps": 12}).train()
    vals = {r["step"]: r["val_loss"] for r in metrics(tmp_path / "logs", "val")}
    assert list(vals) == [6, 8, 12] and vals[6] == first["final_val_loss"]
    assert longer["best_val_loss"] == min(vals.values())


def _scripted_validation(trainer: DDPTrainer, losses: list) -> DDPTrainer:
    """Validations return the given losses in turn; the test set is evaluated for real."""
    it, real = iter(losses), trainer.evaluate
    trainer.evaluate = lambda loader=None: real(loader) if loader is not None else {"loss": next(it), "count": 1}
    return trainer


def test_a_resumed_run_keeps_the_best_validation_and_patience_of_its_first_part(tmp_path, no_launch_env):
    cfg = cfg_for(tmp_path, max_steps=6, val_interval=2, save_every_iters=2, patience=3, min_delta=0.0)
    _scripted_validation(DDPTrainer(config=cfg), [1.0, 0.5, 0.8]).train()  # best at step 4, one bad since
    # worse than step 4's, and the third validation in a row without improvement: patience 3 stops at step 10
    longer = _scripted_validation(DDPTrainer(config={**cfg, "max_steps": 20}), [0.7, 0.6, 0.55, 0.52]).train()
    assert longer["resumed_from"].endswith("model_state_step_6.pt")
    assert longer["status"] == "early_stopped" and longer["steps"] == 10
    assert longer["best_val_loss"] == 0.5
    assert torch.load(tmp_path / "ckpt" / "model_best.pt", weights_only=True)["global_step"] == 4


def test_a_resumed_run_keeps_its_patience_reference_apart_from_its_best(tmp_path, no_launch_env):
    """With min_delta the patience count runs from the last improvement by min_delta, not from the best: a
    resume that took the best for that reference stopped 6 steps early."""
    cfg = cfg_for(tmp_path, max_steps=6, val_interval=2, save_every_iters=2, patience=3, min_delta=0.1)
    # reference 1.0 (step 2); 0.95 and 0.93 are better but not by min_delta: best 0.93, reference 1.0
    _scripted_validation(DDPTrainer(config=cfg), [1.0, 0.95, 0.93]).train()
    # 0.88 improves on the reference by more than 0.1 (not on the best): the count restarts, the stop is at 14
    longer = _scripted_validation(DDPTrainer(config={**cfg, "max_steps": 20}), [0.88, 0.87, 0.86, 0.85]).train()
    assert (longer["status"], longer["steps"]) == ("early_stopped", 14)


class NanAt:
    """lm_loss, NaN at the given training calls of this run (1-based); SIGTERM at `stop`."""

    def __init__(self, nan, stop=None):
        self.nan, self.stop, self.calls = nan, stop, 0

    def __call__(self, model, batch):
        self.calls += model.training
        s, c = lm_loss(model, batch)
        if model.training and self.calls == self.stop:
            os.kill(os.getpid(), signal.SIGTERM)
        return (s * float("nan"), c) if model.training and self.calls in self.nan else (s, c)


def test_a_bad_streak_and_the_skip_count_survive_a_resume(tmp_path, no_launch_env):
    """max_bad_steps counts non-finite steps in a row across a stop: a resume that reset the count would let a
    run that diverged go on for another max_bad_steps after each preemption."""
    cfg = cfg_for(tmp_path, max_bad_steps=3, dropout=0.0)
    first = DDPTrainer(config=cfg, loss_fn=NanAt(nan={2, 3}, stop=3)).train()
    assert (first["status"], first["skipped_steps"]) == ("interrupted", 2)
    with pytest.raises(FloatingPointError, match="3 consecutive non-finite steps"):
        DDPTrainer(config=cfg, loss_fn=NanAt(nan={1})).train()  # step 4: the third bad step in a row


def test_the_grad_scalers_state_survives_a_resume(tmp_path, no_launch_env, cpu_fp16):
    cpu_fp16(init_scale=2.0 ** 4, growth_interval=2)  # it grows every 2 steps
    cfg = dict(max_steps=12, save_every_iters=3, dropout=0.0)
    DDPTrainer(config=cfg_for(tmp_path / "ref", **cfg)).train()
    assert DDPTrainer(config=cfg_for(tmp_path / "run", **cfg), loss_fn=SignalAt(7)).train()["status"] == "interrupted"
    resumed = DDPTrainer(config=cfg_for(tmp_path / "run", **cfg))
    assert resumed.scaler is not None and resumed.scaler.get_scale() != 2.0 ** 4  # it grew before the stop
    resumed.train()
    assert_bit_identical(final_weights(tmp_path / "run"), final_weights(tmp_path / "ref"))


def test_an_explicit_resume_path_in_a_finished_run_trains_from_it(tmp_path, no_launch_env):
    """COMPLETED means "nothing to do" for --resume auto only: a finished run resumed from one of its states by
    path trains again from there (to the same end, bit-identical), it is not answered with the old summary."""
    DDPTrainer(config=cfg_for(tmp_path)).train()  # 20 steps, the newest states (15, 20) kept; COMPLETED
    first = final_weights(tmp_path)
    state = tmp_path / "ckpt" / "model_state_step_15.pt"
    again = DDPTrainer(config=cfg_for(tmp_path, resume=str(state))).train()
    assert "already_complete" not in again and again["steps"] == 20 and again["resumed_from"] == str(state)
    assert_bit_identical(final_weights(tmp_path), first)


def test_a_relaunch_of_a_finished_run_marks_it_complete_for_this_launch(tmp_path, no_launch_env, monkeypatch):
    """A relaunch with nothing to do rewrites COMPLETED with its launch id (launch_training.sh reads it: a stop
    that reaches torchrun now finds the run complete, exit 0, not 1)."""
    from ddp_training import COMPLETED_MARKER
    monkeypatch.setenv("DDP_KIT_LAUNCH_ID", "first")
    DDPTrainer(config=cfg_for(tmp_path)).train()
    marker = tmp_path / "logs" / COMPLETED_MARKER
    assert json.loads(marker.read_text())["launch_id"] == "first"
    monkeypatch.setenv("DDP_KIT_LAUNCH_ID", "second")
    assert DDPTrainer(config=cfg_for(tmp_path)).train()["already_complete"]
    record = json.loads(marker.read_text())
    assert record["launch_id"] == "second" and record["summary"]["steps"] == 20


def test_a_resumed_run_leaves_one_summary_in_its_metrics(tmp_path, no_launch_env):
    """The stopped session's summary is no end of the run: resuming drops it, and the file ends with the one
    summary of the run's end (metrics.jsonl continues on resume)."""
    assert DDPTrainer(config=cfg_for(tmp_path), loss_fn=SignalAt(6)).train()["status"] == "interrupted"
    assert [s["status"] for s in metrics(tmp_path / "logs", "summary")] == ["interrupted"]
    DDPTrainer(config=cfg_for(tmp_path)).train()
    assert [(s["status"], s["steps"]) for s in metrics(tmp_path / "logs", "summary")] == [("completed", 20)]


def test_a_changed_learning_rate_applies_after_resume(tmp_path, no_launch_env, caplog):
    """The optimizer state holds the rate it was saved with: the config's rate and schedule must win."""
    from ddp_training import lr_factor
    cfg = cfg_for(tmp_path, max_steps=6, learning_rate=1e-2, weight_decay=0.01)
    DDPTrainer(config=cfg).train()
    t = DDPTrainer(config={**cfg, "max_steps": 9, "learning_rate": 1e-3, "weight_decay": 0.05})
    assert [g["weight_decay"] for g in t.optimizer.param_groups] == [0.05, 0.0]
    # the first resumed step's rate: this run's, on this run's schedule
    first = 1e-3 * lr_factor(6, 9, BASE["warmup_steps"], "cosine", 0.1)
    assert [g["lr"] for g in t.optimizer.param_groups] == [pytest.approx(first, rel=1e-12)] * 2
    t.train()
    lr = {r["step"]: r["lr"] for r in metrics(tmp_path / "logs", "train")}
    assert lr[7] == pytest.approx(first, rel=1e-12)  # a step's record holds the rate it used
    assert lr[8] == pytest.approx(1e-3 * lr_factor(7, 9, BASE["warmup_steps"], "cosine", 0.1), rel=1e-12)
    assert "this run's [(0.001, 0.05), (0.001, 0.0)] apply" in (tmp_path / "logs" / "rank_0.log").read_text()


def test_a_lengthened_run_says_that_its_rate_jumps(tmp_path, no_launch_env):
    """A finished cosine run resumed with a longer max_steps climbs back up its new curve: documented, but a
    run that jumps from the floor to most of the peak says so; a plain resume does not."""
    cfg = cfg_for(tmp_path, max_steps=6)
    DDPTrainer(config=cfg, loss_fn=SignalAt(3)).train()
    DDPTrainer(config=cfg).train()
    told = "the learning rate of the next step is"
    assert told not in (tmp_path / "logs" / "rank_0.log").read_text()
    DDPTrainer(config={**cfg, "max_steps": 12}).train()
    from ddp_training import lr_factor
    rates = [BASE["learning_rate"] * lr_factor(6, n, BASE["warmup_steps"], "cosine", 0.1) for n in (12, 6)]
    assert f"{told} {rates[0]:.3g}, not the state's {rates[1]:.3g}: this run's schedule" in \
        (tmp_path / "logs" / "rank_0.log").read_text()


def test_a_state_whose_schedule_lags_its_steps_goes_on_from_its_step(tmp_path, no_launch_env):
    """Before 26 Nov 2026 a skipped step did not move the schedule: such a state's scheduler is behind its
    global_step, and resumed as it was the run stayed behind for good (the README says the rate of step N
    is the schedule's at N)."""
    cfg = cfg_for(tmp_path, max_steps=6)
    DDPTrainer(config=cfg).train()
    path = tmp_path / "ckpt" / "model_state_step_6.pt"
    state = rt.load_checkpoint(path)
    state["scheduler"]["last_epoch"] = 4  # two skipped steps, counted in global_step only
    rt.atomic_save(state, path)
    t = DDPTrainer(config={**cfg, "max_steps": 12})
    assert t.global_step == t.scheduler.last_epoch == 6
    from ddp_training import lr_factor
    expected = BASE["learning_rate"] * lr_factor(6, 12, BASE["warmup_steps"], "cosine", 0.1)
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    assert f"{path}: its schedule is at step 4 of 6 (skipped steps did not count then); it goes on from step 6" in \
        (tmp_path / "logs" / "rank_0.log").read_text()
    t.close()


def test_a_resumed_optimizer_keeps_this_devices_kernels(tmp_path, no_launch_env):
    """An optimizer state carries the fused/foreach choice of the device that saved it, and torch's
    load_state_dict takes it: a state from a GPU (fused) resumed on the CPU runs foreach, as configured here."""
    cfg = cfg_for(tmp_path, max_steps=6)
    DDPTrainer(config=cfg).train()
    path = tmp_path / "ckpt" / "model_state_step_6.pt"
    state = rt.load_checkpoint(path)
    for group in state["optimizer"]["param_groups"]:
        group.update(fused=True, foreach=None)  # as build_optimizer sets them on CUDA
    rt.atomic_save(state, path)
    t = DDPTrainer(config={**cfg, "max_steps": 8})
    assert t.global_step == 6 and [(g["fused"], g["foreach"]) for g in t.optimizer.param_groups] == [(None, True)] * 2
    assert t.train()["steps"] == 8


def numbered(root: Path, kind: str) -> list:
    return sorted(int(p.stem.rsplit("_", 1)[1]) for p in (root / "ckpt").glob(f"model_{kind}_*.pt"))


@pytest.mark.parametrize("keep,kept", [(1, [20]), (2, [15, 20]), (0, [5, 10, 15, 20])])  # 0: all of them
def test_only_the_newest_states_and_weights_files_are_kept(tmp_path, no_launch_env, keep, kept):
    """keep_states for the resumable states; keep_checkpoints for the step and the epoch weights files, which
    at 1.2 GB each (the VJ2 preset, every 500 steps by default) filled a disk over a long run."""
    DDPTrainer(config=cfg_for(tmp_path, keep_states=keep, keep_checkpoints=keep, save_interval=1)).train()
    states = sorted(kept + [8, 16])  # the ends of the epochs (8 steps each) save a state too
    assert numbered(tmp_path, "state_step") == states[-keep:] and numbered(tmp_path, "step") == kept
    assert numbered(tmp_path, "epoch") == [1, 2][-keep:]
    assert all((tmp_path / "ckpt" / f"model_state_step_{s}.pt.sha256").exists() for s in states[-keep:])
    assert (tmp_path / "ckpt" / "model_best.pt").exists() and (tmp_path / "ckpt" / "model_final.pt").exists()


def test_resuming_an_earlier_state_sets_the_later_weights_files_aside(tmp_path, no_launch_env):
    """The step files past the resumed state are another future's: keep_checkpoints kept them, by step, over the
    resumed run's own, which it deleted as soon as they were written (from a review)."""
    DDPTrainer(config=cfg_for(tmp_path, keep_states=0, val_interval=5)).train()
    assert torch.load(tmp_path / "ckpt" / "model_best.pt", weights_only=True)["global_step"] == 20
    s = DDPTrainer(config=cfg_for(tmp_path, resume=str(tmp_path / "ckpt" / "model_state_step_5.pt"), max_steps=15,
                                  keep_checkpoints=2, val_interval=5, learning_rate=5.0)).train()
    assert numbered(tmp_path, "step") == [10, 15]
    # the best weights of the abandoned future went too: this run, whose rate is made to diverge, never beats
    # step 5's loss and has none (the first run overwrote step 5's), where the first run's step 20 stood for it
    assert s["status"] == "completed" and s["best_val_loss"] is not None
    assert not (tmp_path / "ckpt" / "model_best.pt").exists()
    (aside,) = (tmp_path / "ckpt").glob("previous_states.*")
    assert {"model_best.pt", "model_final.pt"} <= {p.name for p in aside.iterdir()}
    steps = lambda pattern: sorted(int(p.stem.rsplit("_", 1)[1]) for p in aside.glob(pattern))  # noqa: E731
    assert steps("model_step_*.pt") == steps("model_state_step_*.pt") == [10, 15, 20]  # the first run's
    # this run's own past (a torchrun restart's is too): not "not this run's", as the line said of every one
    assert f"weights file(s) (past the state this run resumes from) to {aside}" in \
        (tmp_path / "logs" / "rank_0.log").read_text()


def test_corrupt_newest_state_falls_back_to_the_previous(tmp_path, no_launch_env, reference_1, caplog):
    DDPTrainer(config=cfg_for(tmp_path, keep_states=3), loss_fn=SignalAt(12)).train()
    newest = tmp_path / "ckpt" / "model_state_step_12.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    middle = tmp_path / "ckpt" / "model_state_step_10.pt"
    raw = bytearray(middle.read_bytes())
    raw[len(raw) // 3] ^= 0x01  # one flipped bit
    middle.write_bytes(bytes(raw))
    s = DDPTrainer(config=cfg_for(tmp_path, keep_states=3)).train()
    assert s["resumed_from"].endswith("model_state_step_5.pt")
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "cannot resume from" in log and "model_state_step_12.pt" in log and "SHA-256" in log
    assert_bit_identical(final_weights(tmp_path), reference_1)


def test_explicit_resume_path_that_fails_is_an_error(tmp_path, no_launch_env):
    DDPTrainer(config=cfg_for(tmp_path), loss_fn=SignalAt(6)).train()
    state = tmp_path / "ckpt" / "model_state_step_6.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(rt.CheckpointError, match="--resume .*model_state_step_6.pt"):
        DDPTrainer(config=cfg_for(tmp_path, resume=str(state)))
    with pytest.raises(rt.CheckpointError, match="does not exist"):
        DDPTrainer(config=cfg_for(tmp_path, resume=str(tmp_path / "nope.pt")))
    weights = tmp_path / "ckpt" / "model_interrupted.pt"  # a weights file: said so plainly (no KeyError quotes)
    with pytest.raises(rt.CheckpointError) as refused:
        DDPTrainer(config=cfg_for(tmp_path, resume=str(weights)))
    assert str(refused.value) == (f"--resume {weights}: not a resumable state (a weights-only file?): it lacks "
                                  f"['counters', 'optimizer', 'rng', 'run', 'scaler', 'scheduler']; the states are "
                                  f"model_state_step_N.pt (a weights file starts a new run with --init_from)")


def _break_optimizer(state):
    state["optimizer"]["param_groups"] = []  # AdamW refuses it, after the model has loaded


def _break_rng(state):
    state["rng"][0]["torch"] = torch.zeros(3, dtype=torch.uint8)  # refused last, after counters and schedule


@pytest.mark.parametrize("damage", [_break_optimizer, _break_rng], ids=["optimizer", "rng"])
def test_a_state_that_fails_half_way_leaves_no_trace(tmp_path, no_launch_env, damage):
    """The newest state loads part of itself, then fails: the run continues from the previous state exactly
    (weights, optimizer, schedule, counters and RNG streams), not from a mix of the two."""
    ckpt = tmp_path / "ckpt"
    DDPTrainer(config=cfg_for(tmp_path, max_steps=10)).train()  # states 5 and 10
    state = rt.load_checkpoint(ckpt / "model_state_step_10.pt")
    damage(state)
    rt.atomic_save(state, ckpt / "model_state_step_10.pt")
    resumed = DDPTrainer(config=cfg_for(tmp_path / "again", checkpoint_dir=str(ckpt), max_steps=10))
    rng_resumed = torch.get_rng_state()
    direct = DDPTrainer(config=cfg_for(tmp_path / "direct", resume=str(ckpt / "model_state_step_5.pt"), max_steps=10))
    assert torch.equal(rng_resumed, torch.get_rng_state())
    assert resumed.resumed_from.name == "model_state_step_5.pt" and resumed.global_step == 5
    assert "cannot resume from" in (tmp_path / "again" / "logs" / "rank_0.log").read_text()
    assert_bit_identical(resumed.raw_model.state_dict(), direct.raw_model.state_dict())
    assert resumed.optimizer.state_dict().keys() == direct.optimizer.state_dict().keys()
    assert_bit_identical(resumed.optimizer.state_dict()["state"][0], direct.optimizer.state_dict()["state"][0])
    assert resumed.scheduler.state_dict() == direct.scheduler.state_dict()
    assert all(getattr(resumed, k) == getattr(direct, k) for k in DDPTrainer.STATE_COUNTERS)
    assert resumed.loader_rng["current"].equal(direct.loader_rng["current"])


@pytest.mark.parametrize("change,message", [
    ({"batch_size": 8}, "batch_size=16, this run has batch_size=8"),
    ({"grad_accum_steps": 2}, "grad_accum_steps=1, this run has grad_accum_steps=2"),
    ({"seed": 7}, "seed=1337, this run has seed=7"),
    ({"dataset_size": 256}, r"train_samples=\d+, this run has train_samples=\d+"),
    # weights of the same shapes computing something else: resumed silently before
    ({"num_heads": 4}, "model num_heads=2, this run has model num_heads=4"),
])
def test_a_setting_the_sample_order_depends_on_is_refused_clearly(tmp_path, no_launch_env, change, message):
    DDPTrainer(config=cfg_for(tmp_path), loss_fn=SignalAt(6)).train()
    with pytest.raises(ValueError, match=message + "; resuming with a different"):
        DDPTrainer(config=cfg_for(tmp_path, **change))


def test_another_dropout_resumes(tmp_path, no_launch_env):
    """Dropout is a training choice, not the model's function: a resume may change it."""
    DDPTrainer(config=cfg_for(tmp_path), loss_fn=SignalAt(6)).train()
    assert DDPTrainer(config=cfg_for(tmp_path, dropout=0.2)).train()["resumed_from"] is not None


def test_another_model_is_refused_and_nothing_is_overwritten(tmp_path, no_launch_env):
    DDPTrainer(config=cfg_for(tmp_path)).train()
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").glob("*.pt")}
    with pytest.raises(ValueError, match="model_state_step_20.pt was written with model hidden_size=32, this run "
                                         "has model hidden_size=64; resuming with a different model hidden_size "
                                         r"is refused \(--resume none or another --run_name starts fresh; or use"):
        DDPTrainer(config=cfg_for(tmp_path, hidden_size=64))
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").glob("*.pt")} == before
    # a state that names no model settings (a user's model, or written before they were) is refused by its weights
    for path in (tmp_path / "ckpt").glob("model_state_step_*.pt"):
        state = rt.load_checkpoint(path)
        del state["must_match"]["model"]
        rt.atomic_save(state, path)
    with pytest.raises(ValueError, match="model_state_step_20.pt holds another model .size mismatch for .*resuming it is refused"):
        DDPTrainer(config=cfg_for(tmp_path, hidden_size=64))


def test_no_loadable_state_is_an_error_not_a_fresh_start(tmp_path, no_launch_env):
    DDPTrainer(config=cfg_for(tmp_path)).train()
    for p in (tmp_path / "ckpt").glob("model_state_step_*.pt"):
        p.write_bytes(p.read_bytes()[:1000])
    final = (tmp_path / "ckpt" / "model_final.pt").read_bytes()
    with pytest.raises(rt.CheckpointError, match="none of the 2 resumable states in .* loads"):
        DDPTrainer(config=cfg_for(tmp_path))
    assert (tmp_path / "ckpt" / "model_final.pt").read_bytes() == final


def test_pickle_payload_state_is_refused_without_running(tmp_path, no_launch_env):
    DDPTrainer(config=cfg_for(tmp_path), loss_fn=SignalAt(6)).train()
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    torch.save({"model": Evil()}, tmp_path / "ckpt" / "model_state_step_99.pt")
    s = DDPTrainer(config=cfg_for(tmp_path)).train()
    assert s["resumed_from"].endswith("model_state_step_6.pt") and not marker.exists()


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_a_failed_state_write_keeps_the_previous_one(tmp_path, no_launch_env, monkeypatch, background):
    real = rt.atomic_save

    def fail_on_step_10(obj, path):
        if "state_step_10" in str(path):
            raise OSError("No space left on device")
        return real(obj, path)
    monkeypatch.setattr(rt, "atomic_save", fail_on_step_10)
    # A synchronous write fails the run at once, naming the file; a background one is saved again after the
    # step that learns of it (test_faults has it on two ranks)
    if background:
        def known_in_step_11(model, batch, calls=[0]):
            # the writer, a thread behind step 10's weights file, took 3 steps to fail on a busy machine: step
            # 11 waits for it, so that step's agreement carries the failure and the state is written again then
            calls[0] += model.training
            deadline = time.time() + 30
            while calls[0] == 11 and model.training and not trainer.writer.failed() and time.time() < deadline:
                time.sleep(0.01)
            return lm_loss(model, batch)
        trainer = DDPTrainer(config=cfg_for(tmp_path, keep_states=5), loss_fn=known_in_step_11)
        assert trainer.train()["status"] == "completed"
        assert "model_state_step_10.pt failed: OSError: No space left" in (tmp_path / "logs" / "rank_0.log").read_text()
        states = {int(p.stem.rsplit("_", 1)[1]) for p in (tmp_path / "ckpt").glob("model_state_step_*.pt")}
        assert states == {5, 11, 15, 20}, states  # saved again once known, not only at the next save point
    else:
        with pytest.raises(rt.CheckpointError, match=r"model_state_step_10\.pt failed: OSError: No space left"):
            DDPTrainer(config=cfg_for(tmp_path, async_checkpoint=False)).train()
    monkeypatch.undo()
    assert rt.load_checkpoint(tmp_path / "ckpt" / "model_state_step_5.pt")["counters"]["global_step"] == 5
    assert not list((tmp_path / "ckpt").glob(".*tmp"))


def test_temp_files_of_a_killed_write_are_removed_and_ignored(tmp_path, no_launch_env):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stale = [ckpt / ".model_state_step_15.pt.4242.tmp", ckpt / ".model_state_step_15.pt.sha256.4242.tmp"]
    (tmp_path / "logs").mkdir()  # and in the log dir, the metrics, config and markers' (from a review)
    stale += [tmp_path / "logs" / f".{name}.host.4242.tmp" for name in ("metrics.jsonl", "config.yaml", "COMPLETED",
                                                                         "PREEMPTED")]
    for p in stale:
        p.write_bytes(b"cut short")
    other = ckpt / ".notes.tmp"  # not ours: left alone
    other.write_text("x")
    summary = DDPTrainer(config=cfg_for(tmp_path, max_steps=5)).train()
    assert summary["resumed_from"] is None and summary["steps"] == 5
    assert not any(p.exists() for p in stale) and other.exists()
    assert "model_state_step_15.pt.4242.tmp, left by a write that was cut short" in (
        tmp_path / "logs" / "rank_0.log").read_text()


# -- two processes -----------------------------------------------------------------------

def _two_rank_run(rank, world_size, root, stop_rank, stop_at, extra):
    loss = SignalAt(stop_at, extra.get("grad_accum_steps", 1)) if rank == stop_rank else None
    summary = DDPTrainer(rank=rank, world_size=world_size, config=cfg_for(Path(root), **extra),
                         loss_fn=loss).train()
    return summary["status"], summary["steps"]


TWO_RANK = dict(batch_size=8, grad_accum_steps=1)  # 128 / 2 ranks / 8 = 8 steps per epoch


@pytest.fixture(scope="module")
def reference_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref2")
    spawn(_two_rank_run, 2, str(root), -1, 0, TWO_RANK)
    return final_weights(root)


@pytest.mark.multi
@pytest.mark.parametrize("stop_at", [3, 8, 6], ids=["mid-epoch", "epoch-boundary", "after-checkpoint"])
def test_signal_on_one_rank_then_resume_is_bit_identical_two_ranks(tmp_path, reference_2, stop_at):
    # Only rank 1 receives the signal; both ranks must stop at the same step.
    assert spawn(_two_rank_run, 2, str(tmp_path), 1, stop_at, TWO_RANK) == [("interrupted", stop_at)] * 2
    assert spawn(_two_rank_run, 2, str(tmp_path), -1, 0, TWO_RANK) == [("completed", 20)] * 2
    assert_bit_identical(final_weights(tmp_path), reference_2)


@pytest.mark.multi
def test_a_state_of_two_ranks_is_refused_by_one(tmp_path, no_launch_env):
    spawn(_two_rank_run, 2, str(tmp_path), -1, 0, dict(TWO_RANK, max_steps=5))
    state = tmp_path / "ckpt" / "model_state_step_5.pt"
    with pytest.raises(ValueError, match=re.escape(f"world_size=2, this run has world_size=1; resuming with a "
                                                   f"different world_size is refused (another --run_name with "
                                                   f"--init_from {state} starts a new run from these weights, "
                                                   f"--resume none or another --run_name starts fresh; ")):
        DDPTrainer(config=cfg_for(tmp_path, **TWO_RANK))
    # as it says: the two ranks' weights go on in one process
    one = DDPTrainer(config=cfg_for(tmp_path / "one", **TWO_RANK, max_steps=2, init_from=str(state)))
    assert one.evaluate()["loss"] == pytest.approx(metrics(tmp_path / "logs", "val")[-1]["val_loss"], rel=1e-5)
    assert one.train()["status"] == "completed"


@pytest.mark.multi
def test_resume_with_accumulation_is_bit_identical_two_ranks(tmp_path):
    # The first step of a process must not reduce micro-steps the way later steps do not (DDP static_graph)
    accum = dict(batch_size=4, grad_accum_steps=2)
    spawn(_two_rank_run, 2, str(tmp_path / "ref"), -1, 0, accum)
    assert spawn(_two_rank_run, 2, str(tmp_path), 0, 3, accum) == [("interrupted", 3)] * 2
    assert spawn(_two_rank_run, 2, str(tmp_path), -1, 0, accum) == [("completed", 20)] * 2
    assert_bit_identical(final_weights(tmp_path), final_weights(tmp_path / "ref"))


# -- torchrun: SIGKILL with --max-restarts, SIGTERM to the agent ------------------------------

LONG = ["--cpu", "--test", "--max_steps", "150", "--val_interval", "50", "--save_every_iters", "25",
        "--log_dir", "logs", "--checkpoint_dir", "ckpt"]


def start(cmd, cwd, restarts=False):
    """The command in the background (see conftest.background); with `restarts`, on the TCP store of its own
    that a restarted gloo group needs (README). Without it the workers share the agent's store, which holds
    its port from the start: a port the agent picks for a store of their own is free only when picked, and
    another test's connections may take it first."""
    return background(cmd, cwd, env=clean_env(**({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": 1} if restarts else {})))


def run_to_end(cmd, cwd, timeout: float) -> str:
    with start(cmd, cwd) as proc:
        return proc.communicate(timeout=timeout)[0]


@pytest.fixture(scope="module")
def reference_torchrun(tmp_path_factory):
    root = tmp_path_factory.mktemp("reft")
    out = run_to_end(torchrun(2, "ddp_training.py", *LONG), root, 180)
    assert (root / "ckpt" / "model_final.pt").exists(), out[-3000:]
    return final_weights(root)


@pytest.mark.multi
def test_sigkill_a_worker_under_max_restarts_finishes_bit_identical(tmp_path, reference_torchrun):
    # a restart to spare: the workers' own store takes the port the agent found free, seconds later, and another
    # test's connection may have taken it meanwhile (EADDRINUSE, a failed start torchrun restarts)
    with start(torchrun(2, "ddp_training.py", *LONG, extra=["--max-restarts=2"]), tmp_path, restarts=True) as agent:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 35)
        torchrun_workers(agent)[1].kill()  # SIGKILL: no handler runs, no checkpoint is written
        out, _ = agent.communicate(timeout=180)
    assert agent.returncode == 0, out[-4000:]
    log = (tmp_path / "logs" / "rank_1.log").read_text()
    assert "resumed from" in log and "model_state_step_" in log
    assert_bit_identical(final_weights(tmp_path), reference_torchrun)
    assert train_steps(tmp_path) == list(range(1, 151))


@pytest.mark.multi
def test_sigterm_to_the_agent_then_relaunch_is_bit_identical(tmp_path, reference_torchrun):
    cmd = torchrun(2, "ddp_training.py", *LONG)
    with start(cmd, tmp_path) as agent:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 30)
        procs = list(torchrun_workers(agent).values())
        t0 = time.time()
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=60)
        gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive and time.time() - t0 < 40
    marker = json.loads((tmp_path / "logs" / "PREEMPTED").read_text())
    assert (tmp_path / "ckpt" / f"model_state_step_{marker['step']}.pt").exists()
    assert (tmp_path / "ckpt" / "model_interrupted.pt").exists()
    out = run_to_end(cmd, tmp_path, 180)  # the same command again
    assert (tmp_path / "ckpt" / "model_final.pt").exists(), out[-3000:]
    assert_bit_identical(final_weights(tmp_path), reference_torchrun)


# -- the VJ2 trainer resumes bit-exactly too ------------------------------------------------------

@pytest.fixture(scope="module")
def vj2_root(tmp_path_factory):
    return make_vj2_data(tmp_path_factory.mktemp("vj2resume"), 1, 128, 8)


def vj2_cmd(root, run):
    return torchrun(2, "vj2ac_train_multi_gpu.py", "--device", "cpu", "--dist-backend", "gloo",
                    "--processed_data_dir", root / "train", "--validation_data_dir", root / "val",
                    "--batch_size", "4", "--max_steps", "80", "--val_every_iters", "30",
                    "--save_every_iters", "10", "--checkpoint_dir", run)


def vj2_final(run):
    return torch.load(run / "vjepa2_final.pt", weights_only=True)["predictor"]


@pytest.mark.multi
def test_vj2_sigterm_then_relaunch_is_bit_identical(tmp_path, vj2_root):
    ref = tmp_path / "ref"
    out = run_to_end(vj2_cmd(vj2_root, ref), tmp_path, 180)
    assert (ref / "vjepa2_final.pt").exists(), out[-3000:]
    run_dir = tmp_path / "run"
    cmd = vj2_cmd(vj2_root, run_dir)
    with start(cmd, tmp_path) as agent:
        wait_for_step(run_dir / "metrics.jsonl", 25, timeout=120)
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=60)
    step = json.loads((run_dir / "PREEMPTED").read_text())["step"]
    assert 25 <= step < 80
    assert (run_dir / "vjepa2_interrupted.pt").exists()
    out = run_to_end(cmd, tmp_path, 180)
    assert (run_dir / "vjepa2_final.pt").exists(), out[-3000:]
    assert_bit_identical(vj2_final(run_dir), vj2_final(ref))
    assert not (run_dir / "vjepa2_interrupted.pt").exists()


# -- an optimizer of the caller's ----------------------------------------------------------------------------

def sgd(groups):
    return torch.optim.SGD(groups, momentum=0.9, nesterov=True)


def test_an_optimizer_of_ones_own_follows_the_schedule_and_resumes_bit_identically(tmp_path, no_launch_env):
    """optimizer= takes the two parameter groups (decaying and not, learning_rate set) and returns an
    optimizer: the LR schedule drives its groups as AdamW's, the loss falls, and a stop and resume ends on
    the unbroken run's weights (its momentum buffers are in the state)."""
    adamw = DDPTrainer(config=cfg_for(tmp_path / "adamw")).train()
    unbroken = DDPTrainer(config=cfg_for(tmp_path / "sgd", learning_rate=0.3), optimizer=sgd).train()
    assert [r["lr"] / 0.3 for r in metrics(tmp_path / "sgd" / "logs", "train")] == pytest.approx(
        [r["lr"] / 1e-2 for r in metrics(tmp_path / "adamw" / "logs", "train")], rel=1e-9)
    losses = [r["loss"] for r in metrics(tmp_path / "sgd" / "logs", "train")]
    assert losses[-1] < 0.7 * losses[0] and unbroken["steps"] == adamw["steps"] == 20
    state = torch.load(tmp_path / "sgd" / "ckpt" / "model_state_step_20.pt", weights_only=True)
    assert state["optimizer_class"] == "torch.optim.sgd.SGD"
    assert all("momentum_buffer" in s for s in state["optimizer"]["state"].values())
    cfg = cfg_for(tmp_path / "stopped", learning_rate=0.3)
    assert DDPTrainer(config=cfg, optimizer=sgd, loss_fn=SignalAt(7)).train()["status"] == "interrupted"
    assert DDPTrainer(config=cfg, optimizer=sgd).train()["resumed_from"].endswith("model_state_step_7.pt")
    assert_bit_identical(final_weights(tmp_path / "stopped"), final_weights(tmp_path / "sgd"))



def test_groups_of_different_learning_rates_are_each_recorded(tmp_path, no_launch_env):
    """An optimizer whose groups train at different rates (a head at 10x, layer-wise decay): each step's record
    has them all (`lrs`, in the optimizer's group order) beside `lr`, group 0's; groups at one rate record `lr`
    alone."""
    def two_rates(groups):
        return torch.optim.AdamW([groups[0], dict(groups[1], lr=groups[1]["lr"] * 10)])
    DDPTrainer(config=cfg_for(tmp_path / "two", max_steps=6), optimizer=two_rates).train()
    records = metrics(tmp_path / "two" / "logs", "train")
    assert len(records) == 6 and all(r["lrs"][0] == r["lr"] and r["lrs"][1] == pytest.approx(10 * r["lr"], rel=1e-12)
                                     for r in records), records
    assert len({r["lr"] for r in records}) > 1  # the schedule moved both
    DDPTrainer(config=cfg_for(tmp_path / "one", max_steps=2)).train()
    assert all("lrs" not in r for r in metrics(tmp_path / "one" / "logs", "train"))


def test_a_state_resumes_only_into_its_own_optimizer(tmp_path, no_launch_env):
    """AdamW's moments loaded into SGD would be dropped without a word (and its momentum start from zero)."""
    DDPTrainer(config=cfg_for(tmp_path, max_steps=5)).train()
    state = tmp_path / "ckpt" / "model_state_step_5.pt"
    with pytest.raises(ValueError, match=re.escape(
            f"{state} was written with the optimizer torch.optim.adamw.AdamW, this run has torch.optim.sgd.SGD; "
            f"resuming with another optimizer is refused")):
        DDPTrainer(config=cfg_for(tmp_path, max_steps=8), optimizer=sgd)
    # a state from before the class, the groups and the transient buffers were recorded was AdamW's, over the
    # two groups, whose sizes are compared
    old = torch.load(state, weights_only=True)
    for key in ("optimizer_class", "optimizer_groups", "transient_buffers"):
        del old[key]
    rt.atomic_save(old, state)
    with pytest.raises(ValueError, match="written with the optimizer torch.optim.adamw.AdamW"):
        DDPTrainer(config=cfg_for(tmp_path, max_steps=8), optimizer=sgd)
    whole = lambda groups: torch.optim.AdamW([p for g in groups for p in g["params"]])  # noqa: E731
    with pytest.raises(ValueError, match=r"written with optimizer groups of \[\d+, \d+\] parameters, this run's have "
                                         r"\[\d+\]; resuming with other groups is refused"):
        DDPTrainer(config=cfg_for(tmp_path, max_steps=8), optimizer=whole)
    assert DDPTrainer(config=cfg_for(tmp_path, max_steps=8)).train()["steps"] == 8


def test_an_optimizer_factory_that_returns_the_wrong_thing_is_refused(tmp_path, no_launch_env):
    lm = CausalLM(64, 32, 2, 2, 32)  # the built-in LM of cfg_for's settings
    n, matrices = len(list(lm.parameters())), sum(p.dim() >= 2 for p in lm.parameters())
    cases = [(lambda groups: groups, TypeError, "optimizer= must return a torch.optim.Optimizer of the parameter "
                                                "groups it is given, got list"),
             (lambda groups: torch.optim.SGD(groups[:1], lr=0.1), ValueError,
              f"optimizer= must optimize exactly the model's {n} trainable parameters (the groups it is given); "
              f"its optimizer holds {matrices}, 0 of them not among those, and leaves out {n - matrices}"),
             (lambda groups: torch.optim.SGD(lm.parameters(), lr=0.1), ValueError,
              f"its optimizer holds {n}, {n} of them not among those")]
    for make, kind, message in cases:
        with pytest.raises(kind, match=re.escape(message)):
            DDPTrainer(config=cfg_for(tmp_path, max_steps=2), optimizer=make)
    # one that ignores the groups, and with them learning_rate: trained at torch's default rate without a word
    DDPTrainer(config=cfg_for(tmp_path / "adam", max_steps=2),
               optimizer=lambda groups: torch.optim.Adam([p for g in groups for p in g["params"]])).close()
    assert ("WARNING: optimizer=: its groups' learning rates [0.001] are what the schedule scales, not "
            "learning_rate 0.01") in (tmp_path / "adam" / "logs" / "rank_0.log").read_text()


def _zero(rank, world_size, root):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        DDPTrainer(config=cfg_for(Path(root), max_steps=2),
                   optimizer=lambda groups: ZeroRedundancyOptimizer(
                       [p for g in groups for p in g["params"]], optimizer_class=torch.optim.SGD, lr=0.1))
    except ValueError as exc:
        return str(exc)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.multi
def test_a_zero_redundancy_optimizer_is_refused_at_set_up(tmp_path):
    """Its state is sharded over the ranks: the first save point failed, after training up to it."""
    assert spawn(_zero, 2, str(tmp_path), timeout=120) == [
        "optimizer= returned a ZeroRedundancyOptimizer, which shards its state over the ranks: this trainer saves "
        "rank 0's whole optimizer state in every resumable state; pass a plain optimizer"] * 2


def test_a_state_resumes_only_into_its_own_optimizer_groups(tmp_path, no_launch_env):
    """A factory that groups the parameters otherwise (a user test): other group sizes failed the optimizer's
    load and were taken for damage ("none of the resumable states loads"); the same sizes over other
    parameters would have given each parameter another's moments."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def mse(model, batch):
        return ((model(batch[0]) - batch[1]) ** 2).sum(), len(batch[0])

    def run(optimizer, steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        return DDPTrainer(config=cfg_for(tmp_path, max_steps=steps, batch_size=8), model=model, loss_fn=mse,
                          train_dataset=data, val_dataset=data, optimizer=optimizer)

    run(sgd, 4).train()  # groups: the two weights, the two biases
    state = tmp_path / "ckpt" / "model_state_step_4.pt"
    swapped = lambda groups: sgd([{**groups[0], "params": groups[1]["params"]},  # noqa: E731
                                  {**groups[1], "params": groups[0]["params"]}])
    whole = lambda groups: sgd([{"params": [p for g in groups for p in g["params"]]}])  # noqa: E731
    for make, message in ((swapped, "written with optimizer groups of [2, 2] parameters, this run's have [2, 2] "
                                    "(the same sizes, other parameters); resuming with other groups is refused"),
                          (whole, "written with optimizer groups of [2, 2] parameters, this run's have [4]; "
                                  "resuming with other groups is refused")):
        with pytest.raises(ValueError, match=re.escape(f"{state} was {message}")):
            run(make, 6)
    assert run(sgd, 6).train()["resumed_from"] == str(state)


class _TransientMean(torch.nn.Module):
    """Centres its input by a running mean kept out of the state dict (persistent=False)."""

    def __init__(self, start=0.0):
        super().__init__()
        self.register_buffer("mean", torch.full((8,), start), persistent=False)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        return self.net(x - self.mean)


class _MseStopAt:
    def __init__(self, step=0):
        self.calls, self.step = 0, step

    def __call__(self, model, batch):
        self.calls += model.training
        if self.calls == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
        return ((model(batch[0]) - batch[1]) ** 2).sum(), len(batch[0])


def test_a_non_persistent_buffer_resumes_with_the_state(tmp_path, no_launch_env):
    """A buffer left out of the state dict that training moves (a user test): the resumed run started it afresh
    and ended about 1e-2 away from the unbroken run, without a word."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen) + 3.0
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def run(root, loss_fn, start=0.0, steps=12):
        torch.manual_seed(0)
        return DDPTrainer(config=cfg_for(root, max_steps=steps, batch_size=8), model=_TransientMean(start),
                          loss_fn=loss_fn, train_dataset=data, val_dataset=data).train()

    run(tmp_path / "unbroken", _MseStopAt())
    assert run(tmp_path / "stopped", _MseStopAt(5))["status"] == "interrupted"
    state = torch.load(tmp_path / "stopped" / "ckpt" / "model_state_step_5.pt", weights_only=True)
    assert set(state["transient_buffers"]) == {"mean"} and state["transient_buffers"]["mean"]["value"].abs().sum() > 0
    assert run(tmp_path / "stopped", _MseStopAt())["resumed_from"].endswith("model_state_step_5.pt")
    assert_bit_identical(final_weights(tmp_path / "stopped"), final_weights(tmp_path / "unbroken"))
    # a model that starts the buffer otherwise (another configuration, a code fix) keeps its own, and says so
    assert run(tmp_path / "stopped", _MseStopAt(), start=1.0, steps=14)["steps"] == 14
    assert ("model_state_step_12.pt: its non-persistent buffer mean was moved by training, but this model starts it "
            "otherwise (another configuration?): it keeps its own") in \
        (tmp_path / "stopped" / "logs" / "rank_0.log").read_text()


def test_a_constant_non_persistent_buffer_stays_out_of_the_state(tmp_path, no_launch_env):
    """A cache built from the configuration (a mask, RoPE's frequencies) is the model's own: saved, it made a
    longer context's resume fail on its shape, or a changed one be overwritten by the stale copy (a review)."""
    model = CausalLM(64, 32, 2, 2, 32)
    model.register_buffer("mask", torch.ones(32, 32).tril(), persistent=False)
    gen_data = synthetic_lm_data(TrainConfig.from_dict(cfg_for(tmp_path)))
    DDPTrainer(config=cfg_for(tmp_path, max_steps=5), model=model, train_dataset=gen_data.train,
               val_dataset=gen_data.val).train()
    assert torch.load(tmp_path / "ckpt" / "model_state_step_5.pt", weights_only=True)["transient_buffers"] == {}


class _WithEma(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.register_buffer("ema", self.net[0].weight.detach().clone())  # saved with the weights

    def forward(self, x):
        return self.net(x)


def test_after_step_runs_after_each_applied_update_and_what_it_keeps_resumes(tmp_path, no_launch_env):
    """An EMA of the weights had to be updated inside the forward (a user test): after_step(model, step) runs on
    every rank after each applied update, without grad, never for a skipped step; what it keeps in the model's
    buffers is saved and resumes bit-identically."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    y = x.sum(1, keepdim=True)
    x[5, 3] = float("nan")  # one skipped step in each epoch
    data = torch.utils.data.TensorDataset(x, y)
    calls = []

    def ema(model, step):
        calls.append((step, torch.is_grad_enabled()))
        model.ema.mul_(0.9).add_(0.1 * model.net[0].weight)

    def run(root, loss_fn):
        torch.manual_seed(0)
        return DDPTrainer(config=cfg_for(root, max_steps=16, batch_size=8), model=_WithEma(), loss_fn=loss_fn,
                          train_dataset=data, val_dataset=data, after_step=ema).train()

    assert run(tmp_path / "unbroken", _MseStopAt())["skipped_steps"] == 2
    skipped = {r["step"] for r in metrics(tmp_path / "unbroken" / "logs", "train") if r["skipped"]}
    assert len(skipped) == 2 and calls == [(s, False) for s in range(1, 17) if s not in skipped]
    unbroken = final_weights(tmp_path / "unbroken")
    assert not torch.equal(unbroken["ema"], unbroken["net.0.weight"])
    assert run(tmp_path / "stopped", _MseStopAt(5))["status"] == "interrupted"
    assert run(tmp_path / "stopped", _MseStopAt())["resumed_from"].endswith("model_state_step_5.pt")
    assert_bit_identical(final_weights(tmp_path / "stopped"), unbroken)

    def fails(model, step):
        if step == 3:
            raise ValueError("the EMA failed")
    with pytest.raises(ValueError, match="the EMA failed"):  # as an error in the optimizer's step: named, marked
        DDPTrainer(config=cfg_for(tmp_path / "fails", max_steps=5, batch_size=8), model=_WithEma(),
                   loss_fn=_MseStopAt(), train_dataset=data, val_dataset=data, after_step=fails).train()
    assert (tmp_path / "fails" / "logs" / "FAILED_rank_0").exists()
