"""End-to-end training: the Python API, torchrun, --nproc, the launcher, real text data,
signals, and the CLI's errors. Every run takes real optimizer steps and checks that the
validation loss falls toward the known floor of the synthetic Markov source.

Also runs as a script:  python tests/test_training.py [--skip-multi] [--keep-data]
"""

import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.nn as nn
import yaml

from conftest import REPO, background, clean_env, make_vj2_data, metrics, run, torchrun, torchrun_workers, wait_for_step
from dist_helpers import free_ports, run_script_forked, spawn

import ddp_runtime as rt
from ddp_training import CausalLM, DDPTrainer, TrainConfig, build_arg_parser, config_from_args

# The quick configuration used everywhere here (the same as the scripts' --test preset).
QUICK = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=32, dataset_size=1024, batch_size=16,
             max_steps=60, learning_rate=1e-2, warmup_steps=5, log_interval=10, val_interval=20, device="cpu")
# Validation loss must close at least 65% of the gap between the untrained loss (ln vocab)
# and the Markov chain's entropy rate.
MAX_GAP_FRACTION = 0.35


def gap_fraction(val_loss: float, floor: float, vocab: int = 64) -> float:
    return (val_loss - floor) / (math.log(vocab) - floor)


def summary_of(log_dir: Path) -> dict:
    return metrics(log_dir, "summary")[-1]


def dirs(tmp_path) -> dict:
    return dict(log_dir=str(tmp_path / "logs"), checkpoint_dir=str(tmp_path / "ckpt"))


# -- the Python API, one process, no distributed environment ----------------------------

def test_api_single_process_trains_toward_the_floor(tmp_path, no_launch_env):
    summary = DDPTrainer(rank=0, world_size=1, config={**QUICK, **dirs(tmp_path)}).train()
    assert summary["status"] == "completed" and summary["steps"] == 60 and summary["world_size"] == 1
    assert gap_fraction(summary["final_val_loss"], summary["loss_floor"]) < MAX_GAP_FRACTION
    assert summary["test_loss"] < math.log(64) - 1.0

    records = metrics(tmp_path / "logs")
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 61))
    assert {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s"} <= set(train[0])
    assert train[-1]["loss"] < 0.6 * train[0]["loss"]
    assert [r["step"] for r in records if r["type"] == "val"] == [20, 40, 60]
    assert any("cpu_rss_gb" in r for r in train) and records[-1]["type"] == "summary"

    ckpt = torch.load(tmp_path / "ckpt" / "model_final.pt", weights_only=True)
    assert set(ckpt) == {"model", "global_step", "val_loss", "model_config"}
    assert ckpt["global_step"] == 60 and not any(k.startswith("module.") for k in ckpt["model"])
    model = CausalLM(**ckpt["model_config"])
    model.load_state_dict(ckpt["model"])
    # The saved weights reproduce the reported validation loss.
    t = DDPTrainer(config={**QUICK, **dirs(tmp_path / "again")}, model=model,
                   train_dataset=_markov(QUICK).train, val_dataset=_markov(QUICK).val)
    assert abs(t.evaluate()["loss"] - summary["final_val_loss"]) < 1e-5
    rt.teardown_distributed()


def _markov(cfg):
    from ddp_training import synthetic_lm_data
    return synthetic_lm_data(TrainConfig.from_dict(cfg))


def test_checkpoint_cadence_and_names(tmp_path, no_launch_env):
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 0, "num_epochs": 2, "dataset_size": 256,
           "save_every_iters": 6, "val_interval": 0, "checkpoint_prefix": "lm"}
    DDPTrainer(config=cfg).train()  # 256 / 16 = 16 steps per epoch
    names = sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt"))
    assert names == sorted(["lm_best.pt", "lm_epoch_1.pt", "lm_epoch_2.pt", "lm_final.pt",
                            "lm_step_6.pt", "lm_step_12.pt", "lm_step_18.pt", "lm_step_24.pt",
                            "lm_step_30.pt",
                            # the newest two resumable states (steps 30 and 32 = end of epoch 2)
                            "lm_state_step_30.pt", "lm_state_step_32.pt"])
    assert torch.load(tmp_path / "ckpt" / "lm_step_12.pt", weights_only=True)["global_step"] == 12
    # the log names a checkpoint's validation loss only where its weights were validated (the epoch ends)
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "lm_epoch_1.pt (step 16, val_loss " in log and "lm_step_18.pt (step 18)\n" in log
    assert not list((tmp_path / "ckpt").glob("*.tmp"))
    # a step file saved at the step of a later validation (an epoch's end, the run's end) has that loss too
    cfg = {**cfg, **dirs(tmp_path / "b"), "num_epochs": 1, "save_every_iters": 8}
    DDPTrainer(config=cfg).train()
    saved = {n: torch.load(tmp_path / "b" / "ckpt" / f"lm_{n}.pt", weights_only=True) for n in ("step_16", "epoch_1")}
    assert saved["step_16"]["val_loss"] == saved["epoch_1"]["val_loss"]
    assert "val_loss" not in torch.load(tmp_path / "b" / "ckpt" / "lm_step_8.pt", weights_only=True)
    # so does an epoch file saved at the run's last step, validated only at the run's end (found by a review)
    cfg = {**cfg, **dirs(tmp_path / "c"), "save_every_iters": 0, "val_interval": 100, "save_interval": 1}
    s = DDPTrainer(config=cfg).train()
    epoch = torch.load(tmp_path / "c" / "ckpt" / "lm_epoch_1.pt", weights_only=True)
    assert (epoch["global_step"], epoch["val_loss"]) == (16, s["final_val_loss"])


def test_target_loss_and_patience_stop_early(tmp_path, no_launch_env):
    s = DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 200, "val_interval": 10,
                           "target_loss": 2.5}).train()
    assert s["status"] == "early_stopped" and s["steps"] < 200 and s["final_val_loss"] <= 2.5
    s = DDPTrainer(config={**QUICK, **dirs(tmp_path / "p"), "max_steps": 200, "val_interval": 5,
                           "learning_rate": 1e-9, "warmup_steps": 0, "patience": 2, "min_delta": 0.1}).train()
    assert s["status"] == "early_stopped" and s["steps"] == 15  # validations at 5, 10, 15: none improves by 0.1


def _stop_early_on_two_ranks(rank, world_size, root):
    cfg = {**QUICK, **dirs(Path(root)), "max_steps": 200, "dataset_size": 256, "val_interval": 5,
           "learning_rate": 1e-9, "warmup_steps": 0, "patience": 1, "min_delta": 0.1}
    s = DDPTrainer(rank=rank, world_size=world_size, config=cfg).train()
    return s["status"], s["steps"]


@pytest.mark.multi
def test_every_rank_stops_early_at_the_same_step(tmp_path):
    # a rank that went on alone would wait in the next step's all-reduce until the timeout fails the test
    assert spawn(_stop_early_on_two_ranks, 2, str(tmp_path), timeout=120) == [("early_stopped", 10)] * 2
    assert [r["step"] for r in metrics(tmp_path / "logs", "val")] == [5, 10]
    # only rank 0 writes checkpoints, and only its log says so
    assert "model_best.pt (step 5, val_loss " in (tmp_path / "logs" / "rank_0.log").read_text()
    assert " checkpoint " not in (tmp_path / "logs" / "rank_1.log").read_text()


@pytest.mark.parametrize("data", ["synthetic", "file"])
def test_a_fraction_of_zero_holds_nothing_out(tmp_path, no_launch_env, data):
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 4, "val_fraction": 0.0, "test_fraction": 0.0}
    if data == "file":
        write_text_corpus(tmp_path / "c.txt", 20_000)
        cfg["data"] = str(tmp_path / "c.txt")
    trainer = DDPTrainer(config=cfg)
    assert trainer.val_loader is None and trainer.test_loader is None
    if data == "file":  # the tokens a validation set would hold train instead
        held = DDPTrainer(config={**cfg, "val_fraction": 0.1, **dirs(tmp_path / "held")})
        assert len(trainer.train_loader.dataset) > len(held.train_loader.dataset) + 0.9 * len(held.val_loader.dataset)
    s = trainer.train()
    assert s["status"] == "completed" and s["final_val_loss"] is None and s["test_loss"] is None
    assert s["test_count"] is None
    assert metrics(tmp_path / "logs", "val") == []
    with pytest.raises(ValueError, match="patience=2, target_loss=None: early stopping reads the validation loss"):
        DDPTrainer(config={**cfg, "patience": 2})


def test_the_synthetic_training_set_does_not_depend_on_the_held_out_fractions():
    base = _markov({**QUICK, "dataset_size": 256})
    other = _markov({**QUICK, "dataset_size": 256, "val_fraction": 0.5, "test_fraction": 0.0})
    assert all(torch.equal(base.train[i][0], other.train[i][0]) for i in range(256))
    assert len(other.val) == 128 and other.test is None
    assert not torch.equal(base.train[0][0], base.val[0][0])  # the splits are no copies of each other


def test_patience_counts_from_the_last_improvement_by_more_than_min_delta(tmp_path, no_launch_env):
    trainer = DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 10, "val_interval": 1, "patience": 3,
                                 "min_delta": 0.01})
    losses = iter([1.0 - 0.005 * k for k in range(20)])  # 0.005 better each time: 0.01 better every 2nd
    trainer.evaluate = lambda loader=None: {"loss": next(losses), "count": 1}
    s = trainer.train()
    # measured against the previous validation, no single one improves by 0.01: that stopped at step 4
    assert s["status"] == "completed" and s["steps"] == 10
    assert s["best_val_loss"] == pytest.approx(0.955)  # the best checkpoint follows every improvement


def test_a_plateau_runs_out_of_patience_and_a_target_reached_exactly_stops(tmp_path, no_launch_env):
    """Boundaries (from a mutation review): with min_delta 0 an equal loss is no improvement, or a plateau
    never stops; a loss equal to target_loss has reached it."""
    cfg = {**QUICK, "max_steps": 10, "val_interval": 1}
    trainer = DDPTrainer(config={**cfg, **dirs(tmp_path / "plateau"), "patience": 2, "min_delta": 0})
    trainer.evaluate = lambda loader=None: {"loss": 1.0, "count": 1}
    s = trainer.train()
    assert s["status"] == "early_stopped" and s["steps"] == 3  # 1: best; 2, 3: no better
    trainer = DDPTrainer(config={**cfg, **dirs(tmp_path / "target"), "target_loss": 0.5})
    losses = iter([1.0, 0.75, 0.5] + [0.25] * 20)
    trainer.evaluate = lambda loader=None: {"loss": next(losses), "count": 1}
    s = trainer.train()
    assert s["status"] == "early_stopped" and s["steps"] == 3


@pytest.mark.parametrize("val_interval", [0, "epoch"])
def test_an_early_stop_at_an_epochs_last_step_still_ends_the_epoch(tmp_path, no_launch_env, val_interval):
    """Stopped by patience at the end of epoch 2 (a validation every epoch, or every steps_per_epoch steps):
    the summary said epoch 1 or left out model_epoch_2.pt (from a review)."""
    cfg = {**QUICK, **dirs(tmp_path), "dataset_size": 256, "num_epochs": 5, "max_steps": 0, "save_interval": 1,
           "patience": 1, "min_delta": 100.0}
    probe = DDPTrainer(config=cfg)
    spe = probe.steps_per_epoch
    probe.close()
    trainer = DDPTrainer(config={**cfg, "val_interval": spe if val_interval == "epoch" else 0})
    s = trainer.train()
    assert s["status"] == "early_stopped" and s["steps"] == 2 * spe and s["epochs"] == 2, s
    saved = torch.load(tmp_path / "ckpt" / "model_epoch_2.pt", weights_only=True)
    assert saved["global_step"] == 2 * spe and "val_loss" in saved


def test_compiled_model_trains_like_the_eager_one(tmp_path, no_launch_env):
    # 1 layer: 5 s less to compile
    cfg = {**QUICK, "num_layers": 1, "max_steps": 8, "val_interval": 0, "resume": "none"}
    eager = DDPTrainer(config={**cfg, **dirs(tmp_path / "eager")}).train()
    trainer = DDPTrainer(config={**cfg, **dirs(tmp_path / "compiled"), "compile": True})
    assert isinstance(trainer.model, torch._dynamo.eval_frame.OptimizedModule)  # the loop runs the compiled one
    compiled = trainer.train()  # ~25 s, most of it inductor's compile on 2 cores
    assert abs(compiled["final_val_loss"] - eager["final_val_loss"]) < 1e-3
    weights = torch.load(tmp_path / "compiled" / "ckpt" / "model_final.pt", weights_only=True)["model"]
    assert not any("_orig_mod" in k for k in weights)  # saved without torch.compile's wrapper prefix


@pytest.mark.multi  # DataLoader worker processes
def test_dataloader_workers_are_stopped_when_train_returns(tmp_path, no_launch_env):
    """Persistent workers of the train, validation and test loaders end with the run. Left to the garbage
    collector with the trainer, each lingered and was killed only after a 5 s timeout."""
    import psutil
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cfg = dict(QUICK, max_steps=12, val_interval=6, num_workers=2, resume="none", log_dir=str(tmp_path / "logs"))
    trainer = DDPTrainer(rank=0, world_size=1, config=cfg)
    assert trainer.loader_backstop_s == 4 * 120  # workers: a backstop past their own timeout (test_faults)
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["steps"] == 12 and summary["test_loss"] is not None
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL  # the backstop's alarm is put back after each batch

    def left():
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
    assert left() == [], [(p.pid, p.cmdline()[:3]) for p in left()]
    assert all(getattr(ld, "_iterator", None) is None
               for ld in (trainer.train_loader, trainer.val_loader, trainer.test_loader))
    # evaluate() after train() starts the workers again, and stops them when it is done
    assert abs(trainer.evaluate()["loss"] - summary["final_val_loss"]) < 1e-6
    tested = trainer.evaluate(trainer.test_loader)
    assert abs(tested["loss"] - summary["test_loss"]) < 1e-6 and tested["count"] == summary["test_count"] > 0
    assert left() == [], [(p.pid, p.cmdline()[:3]) for p in left()]


def _evaluate_after_train(rank, world_size, root):
    trainer = DDPTrainer(rank=rank, world_size=world_size, config=dict(
        QUICK, max_steps=4, val_interval=0, resume="none", log_dir=str(Path(root) / "logs")))
    trainer.train()
    try:
        trainer.evaluate()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multi
def test_evaluate_after_train_on_two_ranks_is_refused(tmp_path):
    """train() leaves the process group: each rank would silently evaluate only its own shard."""
    for msg in spawn(_evaluate_after_train, 2, str(tmp_path), timeout=120):
        assert msg.startswith("evaluate() after train() on a multi-process trainer"), msg


def test_a_count_below_one_is_logged_as_sum_over_count(tmp_path, no_launch_env):
    """A count may be a sum of weights: the logged loss was divided by at least 1 (a count of 0.5 logged half
    the loss), while the update and the validation loss used the true count (from a review)."""
    from ddp_training import lm_loss

    def scaled(k):
        def loss(model, batch):
            s, c = lm_loss(model, batch)
            return s * k, c * k, {"same": s.detach() * k}
        return loss
    for name, k in (("whole", 1.0), ("weighted", 1e-4)):  # 16 x 32 tokens: a count of 0.0512
        cfg = dict(QUICK, max_steps=3, val_interval=3, resume="none", log_dir=str(tmp_path / name))
        DDPTrainer(config=cfg, loss_fn=scaled(k)).train()
    for a, b in zip(metrics(tmp_path / "whole", "train"), metrics(tmp_path / "weighted", "train")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and b["same"] == pytest.approx(b["loss"], rel=1e-6)
    assert metrics(tmp_path / "weighted", "val")[0]["val_loss"] == pytest.approx(
        metrics(tmp_path / "whole", "val")[0]["val_loss"], rel=1e-4)


def test_every_module_trains_at_every_step_around_evaluations(tmp_path, no_launch_env):
    """The step sets train mode only at the first step and after an evaluation (a walk of every module costs
    ~0.2 ms): a submodule left in eval mode before training, and the eval mode of every validation, must still
    never reach a training step."""
    cfg = dict(QUICK, max_steps=12, val_interval=5, resume="none", log_dir=str(tmp_path / "logs"))
    trainer = DDPTrainer(rank=0, world_size=1, config=cfg)
    model = trainer.raw_model
    model.blocks[0].eval()
    seen = []  # (root in train mode, every module in train mode) at each forward
    model.register_forward_pre_hook(lambda m, args: seen.append((m.training, all(x.training for x in m.modules()))))
    assert trainer.train()["steps"] == 12
    training = [every for root, every in seen if root]
    assert len(training) == 12 and all(training)
    assert any(not root for root, _ in seen)  # the validations ran in eval mode in between


def test_flops_per_token_matches_a_measured_count():
    from torch.utils.flop_counter import FlopCounterMode
    m = CausalLM(vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, seq_len=64)
    x = torch.randint(0, 256, (2, 64))
    with FlopCounterMode(display=False) as counter:
        m(x).sum().backward()
    measured = counter.get_total_flops() / x.numel()
    # The estimate counts the embedding lookup as a matmul (the tied head is one): within 15%.
    assert abs(m.flops_per_token() - measured) < 0.15 * measured, (m.flops_per_token(), measured)


def test_gpu_precision_and_peak_are_read_off_the_gpu(monkeypatch):
    """CUDA stands in here: bf16 only where the GPU has it (torch's default check also counts the slow
    emulation of a V100 or T4), and the MFU peak of the GPU's name (none for a MIG slice, a share of it)."""
    from ddp_training import amp_dtype_for, peak_bf16_flops
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    gpu, auto = torch.device("cuda", 0), TrainConfig.from_dict({})
    assert amp_dtype_for(auto, gpu) == torch.float16  # a T4: emulated bf16 only
    assert amp_dtype_for(TrainConfig.from_dict({"amp_dtype": "bf16"}), gpu) == torch.bfloat16  # asked for
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert amp_dtype_for(auto, gpu) == torch.bfloat16  # Ampere, Hopper
    for name, peak in [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
                       ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                       ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("Tesla T4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_bf16_flops(gpu) == peak, name
    assert peak_bf16_flops(torch.device("cpu")) is None


# The rate each of 10 steps uses (warmup 2, min_lr_ratio 0.1), as multiples of the base rate, worked out
# by hand: warmup (k+1)/2; cosine 0.1 + 0.45 (1 + cos(pi (k-2)/8)); wsd flat until 2 + 0.8 * 8 = 8 steps
# are done, then linear toward 0.1 at step 10's end.
SCHEDULES = {
    "cosine": [0.5, 1.0, 1.0, 0.965746, 0.868198, 0.722208, 0.55, 0.377792, 0.231802, 0.134254],
    "wsd": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.55],
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_step_logs_the_learning_rate_of_its_schedule(tmp_path, no_launch_env, schedule):
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 10, "warmup_steps": 2, "min_lr_ratio": 0.1, "val_interval": 0,
           "dataset_size": 256, "lr_schedule": schedule}
    DDPTrainer(config=cfg).train()
    logged = [r["lr"] / QUICK["learning_rate"] for r in metrics(tmp_path / "logs", "train")]
    assert logged == pytest.approx(SCHEDULES[schedule], abs=1e-6)


def test_skipped_steps_move_the_schedule_on_too(tmp_path, no_launch_env):
    """A skipped step counts towards max_steps: the schedule counts it too, so step N's rate is the schedule's
    at N (the schedule lagged one step per skip, and the run ended short of its floor)."""
    from ddp_training import lm_loss
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += model.training
        s, c = lm_loss(model, batch)
        return (s * float("nan"), c) if model.training and calls["n"] in (1, 5) else (s, c)

    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 10, "warmup_steps": 2, "min_lr_ratio": 0.1, "val_interval": 0,
           "dataset_size": 256, "lr_schedule": "cosine"}
    DDPTrainer(config=cfg, loss_fn=poisoned).train()
    train = metrics(tmp_path / "logs", "train")
    assert [r["step"] for r in train if r["skipped"]] == [1, 5]
    assert [r["lr"] / QUICK["learning_rate"] for r in train] == pytest.approx(SCHEDULES["cosine"], abs=1e-6)


def test_the_schedules_end_at_min_lr_ratio_and_a_ratio_of_one_keeps_the_peak():
    """After the run's last step the cosine and wsd schedules sit at min_lr_ratio (the logged rates stop one step
    short of it); min_lr_ratio=1 is a valid setting that keeps the peak rate after the warm-up."""
    from ddp_training import lr_factor
    for schedule in ("cosine", "wsd"):
        assert lr_factor(10, 10, 2, schedule, 0.25) == pytest.approx(0.25, abs=1e-12)
        assert [lr_factor(s, 10, 2, schedule, 1.0) for s in range(11)] == pytest.approx([0.5] + [1.0] * 10)
    assert lr_factor(0, 10, 0, "cosine", 0.25) == 1.0  # no warm-up: the first step takes the peak rate
    cfg = TrainConfig.from_dict({"min_lr_ratio": 1.0, "lr_schedule": "wsd"})
    assert cfg.min_lr_ratio == 1.0


def test_the_summary_states_the_global_batch_of_ranks_micro_batches_and_accumulation(tmp_path, no_launch_env):
    """global_batch is the samples of one optimizer step: batch_size x grad_accum_steps x world_size."""
    s = DDPTrainer(config={**QUICK, **dirs(tmp_path), "batch_size": 4, "grad_accum_steps": 3, "max_steps": 2,
                           "val_interval": 0}).train()
    assert s["global_batch"] == 12 and s["steps"] == 2


class Recorded(torch.utils.data.Dataset):
    """Notes which samples were read, in order (no loader workers: they are read in this process)."""

    def __init__(self, base):
        self.base, self.read = base, []

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.read.append(i)
        return self.base[i]


def test_each_epoch_reads_every_sample_once_in_its_own_order(tmp_path, no_launch_env):
    data = _markov(QUICK)
    train = Recorded(torch.utils.data.Subset(data.train, range(32)))
    DDPTrainer(config={**QUICK, **dirs(tmp_path), "batch_size": 8, "max_steps": 0, "num_epochs": 3, "seed": 5,
                       "num_workers": 0}, model=CausalLM(64, 32, 2, 2, 32), train_dataset=train,
               val_dataset=data.val).train()
    assert len(train.read) == 3 * 32
    epochs = [train.read[k * 32:(k + 1) * 32] for k in range(3)]
    assert all(sorted(e) == list(range(32)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    # each the permutation of (seed, epoch), which a resumed run recomputes
    sampler = rt.ResumableDistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=5, drop_last=True)
    for k, order in enumerate(epochs):
        sampler.set_epoch(k)
        assert list(sampler) == order


def test_matrices_decay_and_biases_and_norm_gains_do_not(tmp_path, no_launch_env):
    trainer = DDPTrainer(config={**QUICK, **dirs(tmp_path), "weight_decay": 0.05})
    decay, no_decay = trainer.optimizer.param_groups
    named = dict(trainer.raw_model.named_parameters())
    name_of = {id(p): n for n, p in named.items()}
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert {name_of[id(p)] for p in decay["params"]} == {n for n, p in named.items() if p.dim() >= 2}
    assert {name_of[id(p)] for p in no_decay["params"]} == {n for n, p in named.items() if p.dim() < 2}
    assert {"ln_f.weight", "blocks.0.attn.qkv.bias"} <= {name_of[id(p)] for p in no_decay["params"]}
    assert decay["betas"] == no_decay["betas"] == (0.9, 0.95)  # the README's
    trainer.close()


def test_gradient_accumulation_and_sample_normalisation_train(tmp_path, no_launch_env):
    s = DDPTrainer(config={**QUICK, **dirs(tmp_path), "batch_size": 8, "grad_accum_steps": 2,
                           "loss_normalization": "sample"}).train()
    assert gap_fraction(s["final_val_loss"], s["loss_floor"]) < MAX_GAP_FRACTION
    # the loss counts samples here; the throughput still counts tokens (seq_len targets per window)
    for r in metrics(tmp_path / "logs", "train"):
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * QUICK["seq_len"], rel=1e-9)


def test_evaluate_without_a_validation_set_says_so(tmp_path, no_launch_env):
    trainer = DDPTrainer(config={**QUICK, **dirs(tmp_path), "val_fraction": 0})
    with pytest.raises(ValueError, match=r"evaluate\(\): this trainer has no validation set"):
        trainer.evaluate()
    assert trainer.evaluate(trainer.train_loader)["loss"] > 0


def test_evaluation_keeps_no_graph_and_takes_a_streams_length_for_an_estimate():
    """evaluate_model once lost its no_grad (a decorator on the wrong function): every batch's graph stayed alive
    until the mean, memory growing with the set (from a review). A loader over a stream whose __len__ is an
    estimate is read to its end, which is no early end."""
    from ddp_training import evaluate_model
    grad_seen = []

    def loss_fn(model, batch):
        grad_seen.append(torch.is_grad_enabled())
        return model(batch).sum(), len(batch)

    class Stream(torch.utils.data.IterableDataset):
        def __len__(self):
            return 10  # an estimate: it yields 6

        def __iter__(self):
            return iter(torch.ones(6, 2))
    result = evaluate_model(nn.Linear(2, 1), torch.utils.data.DataLoader(Stream(), batch_size=2), loss_fn,
                            torch.device("cpu"))
    assert result["count"] == 6 and grad_seen == [False] * 3
    # batches of no length at all (a generator)
    assert evaluate_model(nn.Linear(2, 1), (b for b in torch.ones(3, 2, 2)), loss_fn, torch.device("cpu"))["count"] == 6


def test_counts_and_extras_given_as_numbers_keep_float64_precision():
    """loss_terms gives the extras as float64 tensors, and an evaluation adds a count given as a number as it is:
    2**24 + 1 is no float32, and a float32 tensor of it (torch.as_tensor(number), torch.full with no dtype) lost
    the 1 (found by mutation testing of the kit's host-sync changes)."""
    from ddp_training import evaluate_model, loss_terms
    big = 2.0 ** 24 + 1
    _, count, extras = loss_terms((torch.zeros(()), big, {"n": big, "i": torch.tensor(3, dtype=torch.int32),
                                                           "f": torch.tensor(0.5)}), torch.device("cpu"))
    assert count == big and {k: (v.dtype, v.item()) for k, v in extras.items()} == {
        "n": (torch.float64, big), "i": (torch.float64, 3.0), "f": (torch.float64, 0.5)}
    result = evaluate_model(nn.Linear(2, 1), [torch.ones(1, 2)], lambda m, b: (m(b).sum() * 0, big, {"n": big}),
                            torch.device("cpu"))
    assert (result["count"], result["n"]) == (big, 1.0)


@pytest.mark.parametrize("returns, message", [
    (lambda s, c: (s, c, {"copy": s.item()}), None),  # a plain number is an extra like a tensor
    (lambda s, c: (s, torch.tensor([c])), None),  # so is a count of shape [1]
    (lambda s, c: (s, np.int64(c), types.MappingProxyType({"copy": s.detach()})), None),  # numpy's, a Mapping
    (lambda s, c: s, r"loss_fn must return \(loss_sum, count\) or \(loss_sum, count, \{name: sum\}\), got a tensor "
                     r"of shape \(\)"),
    (lambda s, c: (s.repeat(3), c), r"loss_fn's loss_sum must be a tensor of one element \(the loss summed over the "
                                    r"batch\), got a tensor of shape \(3,\)"),
    (lambda s, c: (s, c, {"e": s.repeat(2)}), r"loss_fn's extra 'e' must be a number or a tensor of one element, "
                                              r"got a tensor of shape \(2,\)"),
    (lambda s, c: (s, "many"), r"loss_fn's count must be a number or a tensor of one element, got str"),
    (lambda s, c: (s, c + 0j), r"loss_fn's count must be a number or a tensor of one element, got a complex tensor "
                               r"of shape \(\)"),
])
def test_what_loss_fn_returns_is_checked_and_named(tmp_path, no_launch_env, returns, message):
    """A mistake in loss_fn's return value surfaced as an error deep inside the step (a 0-d tensor indexed,
    a broadcast shape, 'float' has no attribute 'detach'), never naming loss_fn. One process has no peers to
    keep in step: the step fails as it is (a weight-zero replay met the same error: StepAbandoned)."""
    from ddp_training import StepFailed, lm_loss
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 2, "val_interval": 0}
    trainer = DDPTrainer(config=cfg, loss_fn=lambda model, batch: returns(*lm_loss(model, batch)))
    if message is None:
        assert trainer.train()["steps"] == 2
    else:
        with pytest.raises(StepFailed, match="^step 1 failed on rank 0: TypeError in forward: " + message):
            trainer.train()


def test_an_empty_or_streamed_evaluation_set_is_refused_at_set_up(tmp_path, no_launch_env):
    """Found at the first validation (an epoch lost, no weights saved) or after the test pass (a finished run
    without its summary, every relaunch again), and named as neither set: now refused before training."""
    data = _markov(QUICK)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data.val)
    empty = torch.utils.data.Subset(data.val, [])
    for kwargs, message in [({"val_dataset": empty}, r"val_dataset is empty \(0 samples\); pass None for no "
                                                     r"validation set"),
                            ({"test_dataset": empty}, r"test_dataset is empty \(0 samples\)"),
                            ({"val_dataset": Stream()}, r"val_dataset: evaluation shards a set by index over the "
                                                        r"ranks; a stream \(Stream\) cannot be")]:
        with pytest.raises(ValueError, match=message):
            DDPTrainer(config={**QUICK, **dirs(tmp_path)}, model=CausalLM(64, 32, 2, 2, 32),
                       train_dataset=data.train, **{"val_dataset": data.val, **kwargs})
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("*.pt"))


def test_a_second_trainer_in_a_run_dir_in_use_is_refused_until_the_first_is_done(tmp_path, no_launch_env):
    """Two runs in one dir would set each other's states aside; the lock is the kernel's, so it goes with
    the process that holds it, however that ends."""
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 3, "val_interval": 0}
    first = DDPTrainer(config=cfg)
    for other in ({"checkpoint_dir": str(tmp_path / "other")}, {"log_dir": str(tmp_path / "other")}):
        with pytest.raises(ValueError, match=rf"are in use by pid {os.getpid()} on .*: this process: another "
                                             rf"DDPTrainer on these dirs has not finished train\(\); call its close"):
            DDPTrainer(config={**cfg, **other})
    assert first.train()["steps"] == 3  # the refused trainers touched nothing of the first's
    second = DDPTrainer(config={**cfg, "max_steps": 6})  # the first let go
    second.close()  # so does one that will not train
    assert DDPTrainer(config={**cfg, "max_steps": 6}).train()["steps"] == 6  # resumed


def test_a_trainer_dropped_untrained_lets_go_of_its_run_dirs(tmp_path, no_launch_env):
    """The refusal says "call its close() or drop it": a dropped one held the lock until the process ended (a
    notebook had to be restarted to use that run name again)."""
    import gc
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 3, "val_interval": 0}
    gc.disable()  # the trainer is in reference cycles (hooks on its model): a collection is the refusal's to run
    try:
        DDPTrainer(config=cfg)  # built, never trained nor closed, and dropped
        assert DDPTrainer(config=cfg).train()["steps"] == 3
    finally:
        gc.enable()


class _Classifier(nn.Module):
    def __init__(self, act=nn.ReLU):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), act(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)

    def logits(self, x):
        return self.net(x)


def _classes(n=64):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x[:, :3].argmax(1))


def _forward_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y, reduction="sum"), len(y)


def _method_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model.logits(x), y, reduction="sum"), len(y)


def test_a_loss_fn_that_reaches_past_the_forward_fails_in_one_process_as_under_ddp(tmp_path, no_launch_env):
    """One process handed loss_fn the bare model, DDP the wrapper: model.logits(x) worked on one CPU and failed
    at scale-up ('DistributedDataParallel' object has no attribute 'logits'), and model.module.logits(x), the
    obvious way round, skipped the gradient all-reduce. Now one process fails the same way, saying why."""
    from ddp_training import StepFailed
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 2, "val_interval": 0, "resume": "none"}
    kwargs = dict(model=_Classifier(), train_dataset=_classes(), val_dataset=_classes(16))
    with pytest.raises(StepFailed, match=r"AttributeError in forward: 'WrappedLikeDDP' object has no attribute "
                                         r"'logits' \(loss_fn gets the model wrapped, as DistributedDataParallel "
                                         r"wraps it .*call it as model\(\.\.\.\) and compute the rest in its forward"):
        DDPTrainer(config=cfg, loss_fn=_method_loss, **kwargs).train()
    summary = DDPTrainer(config=cfg, loss_fn=_forward_loss, **kwargs).train()
    assert summary["steps"] == 2
    evaluating = DDPTrainer(config=cfg, loss_fn=_method_loss, **kwargs)
    assert evaluating.evaluate()["count"] == 16  # the bare model
    evaluating.close()


def test_the_lms_settings_with_a_model_of_ones_own_are_named_unused_and_not_recorded(tmp_path, no_launch_env):
    """hidden_size=... with model= changed nothing without a word, and the run's config.yaml listed the
    built-in LM's settings for a model that has none of them (a migrating user). Nor are they checked as the
    LM's: 3 heads for its 64 wide layers refused a model that has no heads (a README audit)."""
    cfg = {**dirs(tmp_path), "max_steps": 2, "val_interval": 0, "hidden_size": 64, "dataset_size": 128,
           "learning_rate": 3e-3, "device": "cpu"}
    DDPTrainer(config={**cfg, "num_heads": 3}, model=_Classifier(), loss_fn=_forward_loss, train_dataset=_classes(),
               val_dataset=_classes(16)).train()
    assert ("WARNING: config keys hidden_size, num_heads, dataset_size are the built-in LM's and its data's: with "
            "model= they change nothing") in (tmp_path / "logs" / "rank_0.log").read_text()
    lm_only = {"seq_len": 0, "vocab_size": 0, "val_fraction": 1.0, "dropout": 1.0, "hidden_size": 5}
    TrainConfig.from_dict(lm_only, builtin_lm=False)  # none of them is the caller's model's
    for key, value in lm_only.items():
        with pytest.raises(ValueError, match=key):
            TrainConfig.from_dict({key: value})
    saved = yaml.safe_load((tmp_path / "logs" / "config.yaml").read_text())
    assert saved["learning_rate"] == 3e-3 and saved["max_steps"] == 2
    assert not set(saved) & {"hidden_size", "vocab_size", "dataset_size", "seq_len", "data", "val_fraction"}
    # the LM's own run records them, and warns of nothing
    DDPTrainer(config={**cfg, **dirs(tmp_path / "lm")}).train()
    assert yaml.safe_load((tmp_path / "lm" / "logs" / "config.yaml").read_text())["hidden_size"] == 64
    assert "are the built-in LM's" not in (tmp_path / "lm" / "logs" / "rank_0.log").read_text()


def _frozen():
    model = _Classifier()
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("make, message", [
    # trained, then its replicas 'diverged', and its weights were saved as module.*
    (lambda: nn.DataParallel(_Classifier()), r"model is already wrapped in DataParallel: pass the bare module "
                                             r"\(model.module\)"),
    # compiled around the wrapper: its weights were saved as module.*
    (lambda: torch.compile(nn.DataParallel(_Classifier())), r"model is already wrapped in DataParallel"),
    # torch's own error at the optimizer's build, naming nothing of this trainer
    (lambda: nn.Sequential(nn.LazyLinear(3)), r"model has parameters not yet initialised \(lazy modules: 0.weight, "
                                              r"0.bias\): run one forward on a sample batch before passing it"),
    # a NotImplementedError from linalg_vector_norm in the first step
    (lambda: nn.Sequential(nn.Embedding(10, 3, sparse=True)), r"model has sparse-gradient embeddings \(0: "
                                                              r"sparse=True\)"),
    # a backward error at the first step
    (_frozen, r"model has no parameter that requires a gradient \(all frozen\?\): nothing to train"),
    (lambda: _Classifier().state_dict(), r"model must be a torch.nn.Module, got OrderedDict"),
])
def test_a_model_this_trainer_cannot_train_is_refused_at_set_up(tmp_path, no_launch_env, make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DDPTrainer(config={**QUICK, **dirs(tmp_path)}, model=make(), train_dataset=_classes(), loss_fn=_forward_loss)
    assert not list((tmp_path / "ckpt").glob("*.pt"))


class _FrozenSparseLookup(nn.Module):
    """A partly frozen model whose frozen part is a sparse embedding (no gradient: nothing sparse to step),
    and a trained submodule named `module`, as DDP names its own."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding.from_pretrained(torch.randn(8, 8), freeze=True, sparse=True)
        self.module = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.module(self.emb(x))))


def test_a_partly_frozen_model_trains_and_saves_every_module(tmp_path, no_launch_env):
    """A frozen sparse embedding was refused with the trainable ones; and a submodule named `module` was taken
    for DDP's wrapper, so one process saved only that submodule and the resume was refused."""
    x = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x % 3)
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 3, "val_interval": 0}
    model = _FrozenSparseLookup()
    frozen = model.emb.weight.clone()
    assert DDPTrainer(config=cfg, model=model, train_dataset=data, loss_fn=_forward_loss).train()["steps"] == 3
    saved = torch.load(tmp_path / "ckpt" / "model_final.pt", weights_only=True)["model"]
    assert sorted(saved) == sorted(model.state_dict())
    assert torch.equal(saved["emb.weight"], frozen) and not torch.equal(saved["head.weight"], _FrozenSparseLookup().head.weight)
    longer = DDPTrainer(config={**cfg, "max_steps": 5}, model=_FrozenSparseLookup(), train_dataset=data,
                        loss_fn=_forward_loss)
    assert longer.train()["steps"] == 5  # resumed from its state


class _EmaLike(nn.Module):
    """A wrapper whose one child is named `module`, as an EMA wrapper's is: its weights are all module.*."""

    def __init__(self):
        super().__init__()
        self.module = _Classifier()

    def forward(self, x):
        return self.module(x)


def test_init_from_keeps_a_module_prefix_that_is_the_models_own(tmp_path, no_launch_env):
    """init_from dropped a `module.` prefix common to every key as DDP's, and refused the model's own file."""
    data = dict(train_dataset=_classes(), loss_fn=_forward_loss)
    cfg = {**QUICK, "max_steps": 2, "val_interval": 0}
    DDPTrainer(config={**cfg, **dirs(tmp_path / "a")}, model=_EmaLike(), **data).train()
    final = tmp_path / "a" / "ckpt" / "model_final.pt"
    tuned = DDPTrainer(config={**cfg, **dirs(tmp_path / "b"), "init_from": str(final)}, model=_EmaLike(), **data)
    saved = torch.load(final, weights_only=True)["model"]
    assert all(torch.equal(saved[k], v) for k, v in tuned.raw_model.state_dict().items())
    tuned.close()


def test_a_model_the_caller_compiled_saves_bare_weights_and_resumes(tmp_path, no_launch_env):
    """Its weights were saved without torch.compile's _orig_mod. prefix, then loaded into the compiled module,
    which expects it: no resume, ever."""
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 2, "val_interval": 0}
    data = dict(train_dataset=_classes(), loss_fn=_forward_loss)
    assert DDPTrainer(config=cfg, model=torch.compile(_Classifier()), **data).train()["steps"] == 2
    saved = torch.load(tmp_path / "ckpt" / "model_final.pt", weights_only=True)["model"]
    assert sorted(saved) == sorted(_Classifier().state_dict())
    assert DDPTrainer(config={**cfg, "max_steps": 3}, model=torch.compile(_Classifier()), **data).train()["steps"] == 3


def test_a_train_config_object_and_a_bad_count_unit(tmp_path, no_launch_env):
    from ddp_training import TrainConfig
    cfg = TrainConfig(**{**QUICK, **dirs(tmp_path), "max_steps": 2, "val_interval": 0})
    assert DDPTrainer(config=cfg).train()["steps"] == 2  # was: 'TrainConfig' object is not iterable
    for unit in ("", "tokens per s", 3):
        with pytest.raises(ValueError, match=rf"count_unit {re.escape(repr(unit))}: expected a plain name"):
            DDPTrainer(config={**QUICK, **dirs(tmp_path / "u")}, model=_Classifier(), train_dataset=_classes(),
                       loss_fn=_forward_loss, count_unit=unit)


def test_a_resume_into_a_model_of_other_modules_is_refused(tmp_path, no_launch_env):
    """ReLU swapped for GELU keeps every weight's name and shape: the resume loaded the old weights, and a
    finished run handed back its old summary for the new model."""
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 3, "val_interval": 0}
    data = dict(train_dataset=_classes(), val_dataset=_classes(16), loss_fn=_forward_loss)
    assert DDPTrainer(config=cfg, model=_Classifier(), **data).train()["steps"] == 3
    assert DDPTrainer(config=cfg, model=_Classifier(), **data).train()["already_complete"] is True
    with pytest.raises(ValueError, match=r"holds another model: its module net.1 is ReLU, this run's is GELU; "
                                         r"resuming it is refused"):
        DDPTrainer(config=cfg, model=_Classifier(nn.GELU), **data)
    # a state written before the modules were recorded resumes as it did
    state = sorted((tmp_path / "ckpt").glob("*_state_step_*.pt"))[-1]
    saved = torch.load(state, weights_only=True)
    assert saved["modules"][:3] == [["", "_Classifier"], ["net", "Sequential"], ["net.0", "Linear"]]
    del saved["modules"]
    rt.atomic_save(saved, state)
    DDPTrainer(config=cfg, model=_Classifier(nn.GELU), **data).close()


def _own_group_then_one_process_trainer(rank, world_size, root):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        DDPTrainer(rank=0, world_size=1, config={**QUICK, "log_dir": str(Path(root) / f"r{rank}")})
    except RuntimeError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
    return "built"


def _draws_after_set_up(rank, world_size, root):
    trainer = DDPTrainer(rank=rank, world_size=world_size,
                         config={**QUICK, "resume": "none", "log_dir": str(Path(root) / "logs")})
    draws = (torch.rand(1).item(), int(np.random.randint(1 << 30)), random.random())
    trainer.close()
    return draws


@pytest.mark.multi
def test_every_rank_draws_its_own_random_numbers(tmp_path):
    """Only torch's stream was seeded per rank: numpy's and python's drew the same numbers on every rank, so a
    dataset's augmentation (in the main process) did the same to every rank's samples."""
    r0, r1 = spawn(_draws_after_set_up, 2, str(tmp_path), timeout=120)
    assert [a != b for a, b in zip(r0, r1)] == [True, True, True], (r0, r1)


def _own_group_then_a_trainer_of_it(rank, world_size, root, launcher_env=None):
    import torch.distributed as dist
    os.environ.update(launcher_env or {})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # no RANK or WORLD_SIZE in the environment
    try:
        summary = DDPTrainer(config={**QUICK, "max_steps": 2, "val_interval": 0, "resume": "none",
                                     "log_dir": str(Path(root) / "logs")}).train()
        return summary["world_size"], summary["steps"]
    finally:
        dist.destroy_process_group()


@pytest.mark.multi
def test_rank_and_world_size_of_one_are_refused_in_a_group_of_two(tmp_path):
    """The check that a given rank/world_size fits the caller's group came after the one-process shortcut: two
    ranks each building a 'world_size=1' trainer raced for one run dir, or trained and lost a peer. Left out,
    they come from the caller's group, which no launcher's variables describe (mp.spawn)."""
    for rank, msg in enumerate(spawn(_own_group_then_one_process_trainer, 2, str(tmp_path), timeout=120)):
        assert msg.startswith(f"a process group already exists as rank {rank}/2, not 0/1"), msg
    assert spawn(_own_group_then_a_trainer_of_it, 2, str(tmp_path), timeout=120) == [(2, 2), (2, 2)]
    # inside a launcher's step of one process (srun -n1): the group's numbers too
    one_task = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    assert spawn(_own_group_then_a_trainer_of_it, 2, str(tmp_path), one_task, timeout=120) == [(2, 2), (2, 2)]


def test_steps_that_count_nothing_are_skipped_and_stop_the_run_after_max_bad_steps(tmp_path, no_launch_env):
    """A loss_fn whose count is always 0 trained nothing, yet the run 'completed' with every step skipped and
    the loss sums logged as losses."""
    from ddp_training import StepFailed, lm_loss
    cfg = {**QUICK, **dirs(tmp_path), "max_bad_steps": 3, "val_interval": 0}
    with pytest.raises(StepFailed, match=r"3 consecutive skipped steps, the last with no counted items \(loss_fn "
                                         r"returned a count of 0 on every rank"):
        DDPTrainer(config=cfg, loss_fn=lambda model, batch: (lm_loss(model, batch)[0], 0)).train()
    train = metrics(tmp_path / "logs", "train")
    assert [(r["step"], r["skipped"], r["loss"]) for r in train] == [(1, True, None), (2, True, None), (3, True, None)]
    assert (tmp_path / "ckpt" / "model_interrupted.pt").exists()
    # steps whose batches all failed to load count nothing too: those are max_errors_per_epoch's to judge
    data = _markov(QUICK)

    class FailsInSteps2To5(torch.utils.data.Dataset):
        def __len__(self):
            return len(data.train)

        def __getitem__(self, i):
            if 1 <= trainer.global_step <= 4:
                raise OSError("unreadable")
            return data.train[i]
    trainer = DDPTrainer(config={**cfg, **dirs(tmp_path / "errors"), "max_steps": 6, "max_errors_per_epoch": 4},
                         model=CausalLM(64, 32, 2, 2, 32), train_dataset=FailsInSteps2To5(), val_dataset=data.val)
    summary = trainer.train()
    assert (summary["status"], summary["steps"], summary["skipped_steps"]) == ("completed", 6, 4)
    assert [r["loss"] for r in metrics(tmp_path / "errors" / "logs", "train") if r["skipped"]] == [None] * 4


def test_nonfinite_loss_skips_the_step_and_gives_up_after_max_bad_steps(tmp_path, no_launch_env):
    from ddp_training import lm_loss
    data = _markov(QUICK)
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        s, c = lm_loss(model, batch)
        return (s * float("nan"), c) if calls["n"] in (3, 4) or calls["n"] > 10 else (s, c)

    model = CausalLM(64, 32, 2, 2, 32)
    t = DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_bad_steps": 3}, model=model,
                   train_dataset=data.train, val_dataset=data.val, loss_fn=poisoned)
    with pytest.raises(FloatingPointError, match="3 consecutive non-finite steps"):
        t.train()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    train = metrics(tmp_path / "logs", "train")
    assert [r["step"] for r in train if r["skipped"]] == [3, 4, 11, 12, 13]
    # a skipped step's loss is no measurement: null (strict JSON), never the 0.0 the tally holds
    assert all((r["loss"] is None and r["grad_norm"] is None) == r["skipped"] for r in train)
    assert "NaN" not in (tmp_path / "logs" / "metrics.jsonl").read_text()
    saved = torch.load(tmp_path / "ckpt" / "model_interrupted.pt", weights_only=True)
    assert saved["global_step"] == 13 and all(torch.isfinite(v).all() for v in saved["model"].values())


@pytest.mark.parametrize("bad", ["nan tensor", "nan number", "inf tensor"])
def test_a_non_finite_count_skips_the_step_and_never_reaches_the_weights(tmp_path, no_launch_env, bad):
    """A NaN count (a sample weight that is NaN) was applied as a normal step: NaN weights from there on, and NaN
    in the "last good" file that max_bad_steps then wrote; an inf count trained on zero gradients (a user's
    exploratory test). It is a non-finite step like a NaN loss: skipped on every rank."""
    from ddp_training import lm_loss
    calls = {"n": 0}
    value = float(bad.split()[0])

    def poisoned(model, batch):
        s, c = lm_loss(model, batch)
        calls["n"] += model.training
        if model.training and calls["n"] == 3:
            return s, (torch.tensor(value) if bad.endswith("tensor") else value)
        return s, c

    data = _markov(QUICK)
    model = CausalLM(64, 32, 2, 2, 32)
    summary = DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 6}, model=model, train_dataset=data.train,
                         val_dataset=data.val, loss_fn=poisoned).train()
    assert (summary["status"], summary["skipped_steps"]) == ("completed", 1)
    assert [r["step"] for r in metrics(tmp_path / "logs", "train") if r["skipped"]] == [3]
    assert all(torch.isfinite(p).all() for p in model.parameters()) and math.isfinite(summary["final_val_loss"])


def test_one_process_names_what_ddp_would_refuse_at_scale_up(tmp_path, no_launch_env):
    """On one process a parameter the forward never used trained on, to fail only under DDP; a custom model
    left to the default loss failed deep in it without naming loss_fn (a user's exploratory test)."""
    from ddp_training import StepFailed
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen))

    class WithAux(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.aux = nn.Linear(8, 1), nn.Linear(8, 1)

        def forward(self, x):
            return self.body(x)

    def mse(model, batch):
        return ((model(batch[0]) - batch[1]) ** 2).sum(), len(batch[0])

    cfg = {**dirs(tmp_path), "batch_size": 8, "max_steps": 2, "val_interval": 0, "device": "cpu"}
    with pytest.raises(StepFailed, match=r"step 1 failed on rank 0: parameters without gradients: aux.weight, "
                                         r"aux.bias -- .* set find_unused_parameters=true"):
        DDPTrainer(config=cfg, model=WithAux(), train_dataset=data, val_dataset=data, loss_fn=mse).train()
    summary = DDPTrainer(config={**cfg, **dirs(tmp_path / "allowed"), "find_unused_parameters": True},
                         model=WithAux(), train_dataset=data, val_dataset=data, loss_fn=mse).train()
    assert summary["status"] == "completed"
    with pytest.raises(StepFailed, match=r"in forward: .*\(no loss_fn= was given: the default is lm_loss"):
        DDPTrainer(config={**cfg, **dirs(tmp_path / "lm_loss")}, model=nn.Linear(8, 1), train_dataset=data,
                   val_dataset=data).train()
    # what DDP does take at scale-up, one process takes too: a fixed set of unused parameters under a static graph
    class StaticWithAux(WithAux):
        static_graph = True
    summary = DDPTrainer(config={**cfg, **dirs(tmp_path / "static")}, model=StaticWithAux(), train_dataset=data,
                         val_dataset=data, loss_fn=mse).train()
    assert summary["status"] == "completed"

    # out of memory in the first step's first micro-batch, with extras: one process retries without a replay,
    # and the extras agreed at that lost step were none, which failed the retry (a review of this change)
    def mse_with_extras(model, batch):
        if model.training and len(batch[0]) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        s, n = mse(model, batch)
        return s, n, {"abs": (model(batch[0]) - batch[1]).abs().sum().detach()}
    summary = DDPTrainer(config={**cfg, **dirs(tmp_path / "oom")}, model=nn.Linear(8, 1), train_dataset=data,
                         val_dataset=data, loss_fn=mse_with_extras).train()
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert all("abs" in r for r in metrics(tmp_path / "oom" / "logs", "train"))
    with pytest.raises(TypeError, match=r"data_fingerprint must be a string .*, got int 123"):
        DDPTrainer(config={**cfg, **dirs(tmp_path / "fp")}, model=nn.Linear(8, 1), train_dataset=data,
                   val_dataset=data, loss_fn=mse, data_fingerprint=123)


def test_train_runs_once_per_trainer(tmp_path, no_launch_env):
    """A second train() (with resume none) ran without the run-dir lock, its log file or its process group, and
    moved the first run's files aside (a user's exploratory test)."""
    t = DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 2, "resume": "none"})
    assert t.train()["status"] == "completed"
    closed = DDPTrainer(config={**QUICK, **dirs(tmp_path / "closed"), "max_steps": 2})
    closed.close()
    for trainer in (t, closed):
        with pytest.raises(RuntimeError, match=r"train\(\) runs once, and not after close\(\)"):
            trainer.train()
    assert (tmp_path / "ckpt" / "model_final.pt").exists() and len(metrics(tmp_path / "logs", "train")) == 2


class _RunningMean(nn.Module):
    """Centres its input by a running mean of its own (a plain buffer, not BatchNorm's), updated in place or
    by assignment in the training forward."""

    def __init__(self, replace: bool, lazy: bool = False):
        super().__init__()
        self.replace = replace
        self.register_buffer("mean", None if lazy else torch.zeros(8))
        # a constant that is a view of one element (its put_back, copying into it, raised)
        self.register_buffer("scale", torch.ones(1).expand(8))
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                if self.mean is None:  # set by the first training forward
                    self.mean = torch.zeros(8)
                new = 0.9 * self.mean + 0.1 * x.mean(0)
                if self.replace:
                    self.mean = new
                else:
                    self.mean.copy_(new)
        return self.net((x - (0 if self.mean is None else self.mean)) * self.scale)


@pytest.mark.parametrize("kind", ["batchnorm", "own buffer in place", "own buffer replaced", "own buffer lazy"])
def test_a_skipped_step_leaves_the_models_buffers_as_they_were(tmp_path, no_launch_env, kind):
    """A sample with a NaN feature skipped its step, but the training forward had already moved BatchNorm's
    running statistics to NaN: every later validation was NaN, and the run still said completed (a user's
    exploratory test). A model's own buffer (a running mean, an EMA) was not put back at all: every later
    step was NaN, and the run ended Diverged with NaN in its 'last good' weights (another user test)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    y = x.sum(1, keepdim=True)
    x[5, 3] = float("nan")  # in the first epoch's batches: the sampler shuffles, so some step meets it
    train = torch.utils.data.TensorDataset(x, y)
    val = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=gen), torch.zeros(16, 1))
    model = (nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)) if kind == "batchnorm"
             else _RunningMean(replace=kind.endswith("replaced"), lazy=kind.endswith("lazy")))

    def mse(model, batch):
        inputs, targets = batch
        return ((model(inputs) - targets) ** 2).sum(), len(inputs)

    cfg = {**dirs(tmp_path), "batch_size": 8, "max_steps": 16, "val_interval": 4, "device": "cpu", "warmup_steps": 0}
    summary = DDPTrainer(config=cfg, model=model, train_dataset=train, val_dataset=val, loss_fn=mse).train()
    assert summary["status"] == "completed" and summary["skipped_steps"] == 2  # once in each of the 2 epochs
    assert all(torch.isfinite(b).all() for b in model.buffers())
    assert all(math.isfinite(r["val_loss"]) for r in metrics(tmp_path / "logs", "val"))
    final = torch.load(tmp_path / "ckpt" / "model_final.pt", weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in final.values())


def test_a_negative_count_or_a_validation_that_counts_nothing_stops_with_the_weights_saved(tmp_path, no_launch_env):
    """A negative count made the run minimise -loss; a validation whose loss_fn counted nothing raised a plain
    ValueError and saved nothing, losing the steps since the last save (a user's exploratory test)."""
    from ddp_training import EvaluationFailed, StepFailed, lm_loss
    data = _markov(QUICK)

    def negative_at_step_3(model, batch, calls={"n": 0}):
        s, c = lm_loss(model, batch)
        calls["n"] += model.training
        return (s, -c) if model.training and calls["n"] == 3 else (s, c)

    def counts_nothing_in_evaluation(model, batch):
        s, c = lm_loss(model, batch)
        return (s, c) if model.training else (s * 0, 0)

    for name, loss_fn, error, message, step in (
            ("neg", negative_at_step_3, StepFailed, r"step 3: loss_fn's counts add up to -\d+ over the ranks", 2),
            ("val", counts_nothing_in_evaluation, EvaluationFailed, r"loss_fn returned a count of 0 over the whole", 3)):
        t = DDPTrainer(config={**QUICK, **dirs(tmp_path / name), "max_steps": 6, "val_interval": 3},
                       model=CausalLM(64, 32, 2, 2, 32), train_dataset=data.train, val_dataset=data.val, loss_fn=loss_fn)
        with pytest.raises(error, match=message):
            t.train()
        saved = torch.load(tmp_path / name / "ckpt" / "model_interrupted.pt", weights_only=True)
        assert saved["global_step"] == step and all(torch.isfinite(v).all() for v in saved["model"].values())


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_diverged_script_run_ends_with_one_line_and_the_last_good_weights(tmp_path, nproc):
    """A run that diverges (here: a learning rate of 1e6) stops with Diverged, a FloatingPointError. The script
    printed it as a Python traceback through the trainer's frames, as if it were a bug (a user's exploratory
    test); it is one line now, the traceback in rank_0.log, and rank 0's alone where the ranks decided it
    together."""
    r = run([sys.executable, REPO / "ddp_training.py", "--cpu", "--test", "--lr", "1e6", "--grad_clip", "0",
             "--warmup_steps", "0", "--val_interval", "0", "--log_dir", "logs", "--checkpoint_dir", "ckpt",
             "--nproc", nproc], tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stdout, r.stdout[-3000:]
    errors = [line for line in r.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: Diverged: 5 consecutive non-finite steps "
                                                     "(max_bad_steps=5) at step "), r.stdout[-3000:]
    assert "Traceback (most recent call last)" in (tmp_path / "logs" / "rank_0.log").read_text()
    saved = torch.load(tmp_path / "ckpt" / "model_interrupted.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


def test_a_nan_validation_loss_is_null_in_strict_json_and_no_improvement(tmp_path, no_launch_env):
    from ddp_training import COMPLETED_MARKER, lm_loss

    def nan_when_validating(model, batch):
        s, c = lm_loss(model, batch)
        return (s * float("nan") if not model.training else s), c
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 6, "val_interval": 2, "patience": 2}
    s = DDPTrainer(config=cfg, loss_fn=nan_when_validating).train()
    assert s["status"] == "early_stopped" and s["steps"] == 4  # two validations without an improvement

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    for path in (tmp_path / "logs" / "metrics.jsonl", tmp_path / "logs" / COMPLETED_MARKER):
        records = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    assert [r["val_loss"] for r in metrics(tmp_path / "logs", "val")] == [None, None]
    assert records[0]["summary"]["final_val_loss"] is None
    assert "the validation loss at step 2 is nan" in (tmp_path / "logs" / "rank_0.log").read_text()


def test_a_peers_failure_is_told_from_this_ranks_own_by_gloos_words_not_by_a_path():
    from ddp_training import is_collective_error
    peer = ["[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:57505", "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
            "60000ms for recv operation to complete"]
    assert all(is_collective_error(RuntimeError(text)) for text in peer)
    assert is_collective_error(torch.distributed.DistBackendError("NCCL error: unhandled system error"))
    own = [OSError(28, "No space left on device", "runs/gloo_nccl/metrics.jsonl"),
           rt.CheckpointError("writing runs/nccl_bench/model_state_step_6.pt failed: OSError: Connection reset by peer"),
           RuntimeError("a background checkpoint write failed on rank 0: writing gloo_runs/x.pt failed")]
    assert not any(is_collective_error(exc) for exc in own)


# -- configuration and CLI errors ---------------------------------------------------

def test_unknown_config_key_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key 'batchsize' \(did you mean batch_size\?\)"):
        DDPTrainer(config={"batchsize": 4})
    with pytest.raises(ValueError, match=r"^unknown config key 'gradient_accumulation_steps' \(this kit's name for it: "
                                         r"grad_accum_steps\); known keys: amp_dtype, "):
        DDPTrainer(config={"gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match=r"give rank and world_size together, or neither .* got rank=1, world_size=None"):
        DDPTrainer(rank=1, config={"batch_size": 4})
    with pytest.raises(ValueError, match="'lr_schedule' must be one of"):
        TrainConfig.from_dict({"lr_schedule": "linear"})


def test_a_negative_grad_clip_is_refused_naming_the_key():
    """Only grad_clip > 0 clips, so a negative value would turn clipping off without a word: it is refused like
    the other keys that must not be negative, and 0 (off) is accepted."""
    with pytest.raises(ValueError, match=re.escape("config key 'grad_clip' must be >= 0, got -1.0")):
        TrainConfig.from_dict({"grad_clip": -1})
    assert TrainConfig.from_dict({"grad_clip": 0}).grad_clip == 0.0


def test_the_log_says_what_precision_and_schedule_a_run_gets(tmp_path, no_launch_env):
    """amp_dtype fp16 on the CPU trains in fp32 (documented, but nowhere to be seen), and a warm-up as long as
    the run never reaches the peak rate (from a README walk-through)."""
    trainer = DDPTrainer(config={**QUICK, **dirs(tmp_path), "amp_dtype": "fp16", "max_steps": 5, "warmup_steps": 5,
                                 "lr_schedule": "wsd"})
    trainer.close()
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "precision: fp32 (on the CPU only amp_dtype bf16 autocasts); learning rate 0.01, 5 warm-up steps, " \
           "then wsd to 0.1 x" in log, log
    assert "warmup_steps=5 is not below the run's 5 steps" in log
    trainer = DDPTrainer(config={**QUICK, **dirs(tmp_path / "b"), "amp_dtype": "bf16", "max_steps": 6})
    trainer.close()
    log = (tmp_path / "b" / "logs" / "rank_0.log").read_text()
    assert "precision: bf16 autocast; learning rate 0.01, 5 warm-up steps, then cosine to 0.1 x" in log
    assert "not below the run's" not in log


def test_log_lines_count_epochs_from_one_as_the_epoch_files_do(tmp_path, no_launch_env):
    """The records' epoch is the 0-based one the step ran in; the log's is 1-based, as model_epoch_N.pt is, with
    the run's number of epochs (a walk-through read "epoch 0 step 1/384" beside model_epoch_1.pt)."""
    cfg = {**QUICK, **dirs(tmp_path), "dataset_size": 128, "batch_size": 16, "max_steps": 12, "log_interval": 5,
           "save_interval": 1, "val_interval": 0}
    DDPTrainer(config=cfg).train()
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert re.findall(r"epoch (\S+) step (\d+)/12 ", log) == [("1/2", "1"), ("1/2", "5"), ("2/2", "10")]
    assert (tmp_path / "ckpt" / "model_epoch_1.pt").exists() and not (tmp_path / "ckpt" / "model_epoch_2.pt").exists()
    epochs = {r["step"]: r["epoch"] for r in metrics(tmp_path / "logs", "train")}
    assert (epochs[8], epochs[9]) == (0, 1)
    # a validation at an epoch's end too: its val record said the next epoch (a user's exploratory test)
    assert [(r["step"], r["epoch"]) for r in metrics(tmp_path / "logs", "val")] == [(8, 0), (12, 1)]
    assert "(step 12, epoch 2, 4 steps into the epoch)" in log


def test_the_readme_snippet_rebuilds_the_lm_from_its_final_weights(tmp_path, no_launch_env):
    text = (REPO / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "CausalLM(**" in block)
    DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 3}).train()
    final = tmp_path / "ckpt" / "model_final.pt"
    names = {"__name__": "readme"}
    exec(textwrap.dedent(snippet).replace("runs/lm/checkpoints/model_final.pt", str(final)), names)
    tokens = torch.randint(0, 64, (2, 8))  # the synthetic data's vocabulary
    trained = torch.load(final, weights_only=True)["model"]
    assert all(torch.equal(v, trained[k]) for k, v in names["model"].state_dict().items())
    assert names["model"](tokens).shape == (2, 8, 64)


@pytest.mark.multi
def test_the_readme_mp_spawn_example_trains_two_ranks(tmp_path):
    text = (REPO / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "mp.spawn(" in block)
    assert '"max_steps": 100' in snippet
    (tmp_path / "example.py").write_text(snippet.replace('"max_steps": 100', '"max_steps": 4'))
    r = run([sys.executable, "example.py"], tmp_path, timeout=240, env=clean_env(MASTER_PORT=free_ports(1)[0]))
    assert r.returncode == 0, r.stdout[-3000:]
    summary = metrics(tmp_path / "runs" / "api_2", "summary")[-1]
    assert (summary["status"], summary["steps"], summary["world_size"]) == ("completed", 4, 2)


def test_datasets_without_a_model_are_refused_not_dropped(tmp_path):
    """With no model the trainer builds its own LM and data: a dataset passed alone was silently not trained on."""
    data = _markov(QUICK)
    with pytest.raises(ValueError, match=r"train_dataset, test_dataset given without a model: .* pass model= to train"):
        DDPTrainer(config={**QUICK, **dirs(tmp_path)}, train_dataset=data.train, test_dataset=data.val)
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


def test_config_values_are_read_as_their_flags_are():
    """YAML reads 3e-4 as a string (no dot): it must still be a number, and a wrong type an error naming the key
    at set-up, not a TypeError mid-run."""
    cfg = TrainConfig.from_dict({"learning_rate": "3e-4", "target_loss": "1e-3", "batch_size": "8", "use_amp": "no"})
    assert (cfg.learning_rate, cfg.target_loss, cfg.batch_size, cfg.use_amp) == (3e-4, 1e-3, 8, False)
    for bad, message in [({"batch_size": 8.5}, "'batch_size' expects int, got 8.5"),
                         ({"learning_rate": "fast"}, "'learning_rate' expects float, got 'fast'"),
                         ({"use_amp": 2}, "'use_amp' expects bool, got 2"),
                         ({"max_steps": True}, "'max_steps' expects int, got True"),
                         ({"run_name": None}, "'run_name' must not be null"),
                         ({"min_delta": float("nan")}, "'min_delta' must be a finite number")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            TrainConfig.from_dict(bad)


def test_a_stop_verdict_at_the_last_step_is_still_a_completed_run(tmp_path, no_launch_env):
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 6, "val_interval": 3, "patience": 1, "min_delta": 10.0}
    summary = DDPTrainer(config=cfg).train()
    assert summary["status"] == "completed" and summary["steps"] == 6
    # so a longer run trains on from it (the verdict at step 6 stopped nothing), until its own early stop
    longer = DDPTrainer(config={**cfg, "max_steps": 12}).train()
    assert longer["resumed_from"].endswith("model_state_step_6.pt")
    assert longer["status"] == "early_stopped" and longer["steps"] == 9


def _empty_test_shard(rank, world_size, root):
    data = _markov(QUICK)
    test = torch.utils.data.Subset(data.test, [0])  # rank 1's shard of it is empty
    trainer = DDPTrainer(rank=rank, world_size=world_size, config={**QUICK, **dirs(Path(root)), "max_steps": 2,
                                                                    "val_interval": 0},
                         model=CausalLM(64, 32, 2, 2, 32), train_dataset=data.train, val_dataset=data.val,
                         test_dataset=test)
    return trainer.train()["test_loss"]


@pytest.mark.multi
def test_a_rank_with_an_empty_test_shard_adds_nothing_to_the_test_loss(tmp_path):
    from ddp_training import evaluate_model, lm_loss
    losses = spawn(_empty_test_shard, 2, str(tmp_path), timeout=120)
    model = CausalLM(64, 32, 2, 2, 32)
    model.load_state_dict(torch.load(tmp_path / "ckpt" / "model_final.pt", weights_only=True)["model"])
    sample = torch.utils.data.Subset(_markov(QUICK).test, [0])
    alone = evaluate_model(model, torch.utils.data.DataLoader(sample, batch_size=16), lm_loss, torch.device("cpu"))
    assert losses[0] == losses[1] == pytest.approx(alone["loss"], rel=1e-6)


def test_a_log_dir_where_no_file_can_be_created_is_refused_at_set_up(tmp_path, no_launch_env, monkeypatch):
    """An existing rank_0.log opens for appending in a dir made immutable (`chattr +i`, which binds root too),
    and the run failed later with a traceback (PermissionError on the PREEMPTED marker); only the checkpoint
    dir was probed. Here the probe is told the log dir is such a dir."""
    logs = tmp_path / "logs"
    real = rt.unwritable_dir
    monkeypatch.setattr(rt, "unwritable_dir", lambda d: "PermissionError: [Errno 1] Operation not permitted"
                        if Path(d) == logs else real(d))
    with pytest.raises(ValueError, match=f"log_dir {logs}: cannot create the run's files there "
                                         r"\(PermissionError: \[Errno 1\] Operation not permitted\)"):
        DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 1})
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


def test_a_checkpoint_dir_whose_files_cannot_be_listed_is_refused_before_anything_moves(tmp_path, no_launch_env,
                                                                                        monkeypatch):
    """A dir of mode 300 (write, no read) took files but listed none: "no resumable state: starting fresh", and
    the fresh run set the earlier run's weights and metrics aside (from a chaos test; root lists any dir, so the
    listing is told to fail here)."""
    ckpt = tmp_path / "ckpt"
    DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 2, "save_every_iters": 2}).train()
    before = sorted(p.name for p in ckpt.iterdir())
    real = os.listdir

    def unlistable(path="."):
        if Path(path) == ckpt:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(os, "listdir", unlistable)
    with pytest.raises(ValueError, match=f"checkpoint_dir {ckpt}: cannot write or list checkpoints there "
                                         r"\(PermissionError: \[Errno 13\] Permission denied"):
        DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 4, "save_every_iters": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert [r["type"] for r in metrics(tmp_path / "logs")].count("start") == 1


def test_init_from_starts_a_fresh_run_from_another_runs_weights(tmp_path, no_launch_env):
    """Fine-tuning: a fresh run begins with the weights of a file (a weights file, a state's model, a bare state
    dict saved from DDP); its resume never reads the file again; a file of another model is refused, named."""
    first = DDPTrainer(config={**QUICK, **dirs(tmp_path / "a"), "max_steps": 6, "save_every_iters": 6}).train()
    weights = tmp_path / "a" / "ckpt" / "model_final.pt"
    tuned = {**QUICK, **dirs(tmp_path / "b"), "max_steps": 4, "init_from": str(weights)}
    trainer = DDPTrainer(config=tuned)
    assert trainer.evaluate()["loss"] == pytest.approx(first["final_val_loss"], rel=1e-6)  # the file's weights
    assert f"weights initialised from {weights} (step 6 of the run that saved it)" in \
        (tmp_path / "b" / "logs" / "rank_0.log").read_text()
    assert trainer.train()["steps"] == 4
    assert yaml.safe_load((tmp_path / "b" / "logs" / "config.yaml").read_text())["init_from"] == str(weights)
    # a longer run resumes from its own state, whatever became of the file
    moved = weights.rename(tmp_path / "moved.pt")
    assert DDPTrainer(config={**tuned, "max_steps": 6}).train()["resumed_from"].endswith("model_state_step_4.pt")
    # a resumable state's model, and a bare state dict from a DDP-wrapped model, load as well
    state = torch.load(tmp_path / "a" / "ckpt" / "model_state_step_6.pt", weights_only=True)
    torch.save({f"module.{k}": v for k, v in state["model"].items()}, tmp_path / "bare.pt")
    # and other trainers' layouts: PyTorch's tutorials' (a migrating user), Lightning's
    torch.save({"epoch": 3, "model_state_dict": state["model"], "optimizer_state_dict": {}}, tmp_path / "tut.pt")
    torch.save({"global_step": 6, "state_dict": {f"model.{k}": v for k, v in state["model"].items()}},
               tmp_path / "lightning.pt")  # a LightningModule holding the network as self.model
    for source in (tmp_path / "a" / "ckpt" / "model_state_step_6.pt", tmp_path / "bare.pt", tmp_path / "tut.pt",
                   tmp_path / "lightning.pt"):
        t = DDPTrainer(config={**tuned, **dirs(tmp_path / "c"), "resume": "none", "init_from": str(source)})
        assert t.evaluate()["loss"] == pytest.approx(first["final_val_loss"], rel=1e-6), source
        t.close()
    state_6 = str(tmp_path / "a" / "ckpt" / "model_state_step_6.pt")
    for change, message in ((dict(num_heads=4), "its model_config differs from this model's (num_heads: 2 there, "
                                                "4 here)"),
                            # a state keeps the model's settings apart, where they were not compared (a review)
                            (dict(num_heads=4, init_from=state_6), "its model differs from this model's "
                                                                   "(num_heads: 2 there, 4 here)"),
                            (dict(init_from=str(tmp_path / "nowhere.pt")), "nowhere.pt does not exist")):
        with pytest.raises(ValueError, match=re.escape(message)):
            DDPTrainer(config={**tuned, **dirs(tmp_path / "d"), "init_from": str(moved), **change})
    # a run dir that holds a run begun otherwise resumes it: the file is not read, and the log says so
    DDPTrainer(config={**QUICK, **dirs(tmp_path / "e"), "max_steps": 2}).train()
    DDPTrainer(config={**QUICK, **dirs(tmp_path / "e"), "max_steps": 3, "init_from": str(moved)}).close()
    assert f"WARNING: init_from {moved} not read: this run resumed from its own state " in \
        (tmp_path / "e" / "logs" / "rank_0.log").read_text()
    torch.save({"model": {"tok.weight": torch.zeros(3, 3)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=re.escape(f"init_from {tmp_path / 'other.pt'}: its weights do not fit this "
                                                   f"model: missing ['blocks.0.attn.proj.bias', ") + r".* \.\.\.; other "
                                                   r"shapes \['tok.weight: \(3, 3\) there, \(64, 32\) here'\]$"):
        DDPTrainer(config={**tuned, **dirs(tmp_path / "d"), "init_from": str(tmp_path / "other.pt")})


def test_init_from_an_earlier_runs_file_in_this_runs_checkpoint_dir_is_refused(tmp_path, no_launch_env):
    """A fresh start moves the earlier run's files aside and writes its own under the same names: init_from
    ckpt/model_final.pt trained, but the same command again started from the new run's final weights."""
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 2, "val_interval": 0}
    DDPTrainer(config=cfg).train()
    ckpt = tmp_path / "ckpt"
    (ckpt / "link.pt").symlink_to("model_final.pt")
    before = sorted(p.name for p in ckpt.iterdir())
    for name in ("model_final.pt", "model_state_step_2.pt", "link.pt"):
        with pytest.raises(ValueError, match=re.escape(f"init_from {ckpt / name}: it is an earlier run's file in "
                                                       f"this run's checkpoint_dir {ckpt}, which a fresh start ")):
            DDPTrainer(config={**cfg, "resume": "none", "init_from": str(ckpt / name)})
        assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing moved
    # a file of another name there is the user's own: it stays, and the run starts from it
    (ckpt / "pretrained.pt").write_bytes((ckpt / "model_final.pt").read_bytes())
    summary = DDPTrainer(config={**cfg, "resume": "none", "init_from": str(ckpt / "pretrained.pt")}).train()
    assert summary["status"] == "completed" and (ckpt / "pretrained.pt").exists()


def test_a_failed_validation_before_a_save_point_keeps_what_the_resume_needs(tmp_path, no_launch_env):
    """The run's closing validation comes before a save point at its last step: when it fails, the step's files
    and state are still written, and the relaunch redoes the validation there. A val_interval validation, which
    no resume redoes, leaves no state at its step: the relaunch trains up to it again (from a review)."""
    from ddp_training import EvaluationFailed, lm_loss
    failures = []

    def fails_once_in_evaluation(model, batch):
        if not model.training and not failures:
            failures.append(1)
            raise ValueError("injected in the evaluation")
        return lm_loss(model, batch)
    closing = {**QUICK, **dirs(tmp_path / "closing"), "max_steps": 6, "save_every_iters": 6, "val_interval": 0}
    with pytest.raises(EvaluationFailed, match="injected in the evaluation"):
        DDPTrainer(config=closing, loss_fn=fails_once_in_evaluation).train()
    ckpt = tmp_path / "closing" / "ckpt"
    assert {"model_step_6.pt", "model_state_step_6.pt", "model_interrupted.pt"} <= {p.name for p in ckpt.iterdir()}
    s = DDPTrainer(config=closing).train()
    assert s["resumed_from"].endswith("model_state_step_6.pt") and s["status"] == "completed"
    vals = metrics(tmp_path / "closing" / "logs", "val")
    assert [r["step"] for r in vals] == [6]
    assert torch.load(ckpt / "model_step_6.pt", weights_only=True)["val_loss"] == pytest.approx(vals[0]["val_loss"])

    failures.clear()
    interval = {**QUICK, **dirs(tmp_path / "interval"), "max_steps": 8, "save_every_iters": 4, "val_interval": 4}
    with pytest.raises(EvaluationFailed):
        DDPTrainer(config=interval, loss_fn=fails_once_in_evaluation).train()
    assert not list((tmp_path / "interval" / "ckpt").glob("model_state_step_*.pt"))
    assert DDPTrainer(config=interval).train()["status"] == "completed"
    assert [r["step"] for r in metrics(tmp_path / "interval" / "logs", "val")] == [4, 8]


def _other_settings_on_rank_1(rank, world_size, root):
    cfg = {**QUICK, **dirs(Path(root)), "max_steps": 40 if rank else 60, "grad_clip": 0.5 if rank else 1.0,
           "num_workers": rank}  # a node's own loader workers are its business
    try:
        return DDPTrainer(rank=rank, world_size=world_size, config=cfg).train()["status"]
    except ValueError as exc:
        return str(exc)


@pytest.mark.multi
def test_ranks_given_other_settings_are_refused_at_set_up_naming_them(tmp_path):
    """Two nodes launched with other max_steps failed at the first save with diverged replicas (other schedules),
    or waited out dist_timeout when one ran out of steps, naming neither flag (from a launcher test)."""
    assert spawn(_other_settings_on_rank_1, 2, str(tmp_path), timeout=120) == [
        "the ranks were given different settings: grad_clip: rank 0 1.0, rank 1 0.5; max_steps: rank 0 60, rank 1 40. "
        "Give every rank (every node's launcher) the same flags and config file"] * 2
    assert not (tmp_path / "logs").exists()  # refused before anything is written


class _Scaled(nn.Module):
    """A learnable 0-dim scale (as CLIP's logit scale) and a 0-dim non-persistent step counter."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("seen", torch.tensor(0), persistent=False)

    def forward(self, x):
        if self.training:
            self.seen += 1
        return self.net(x) * self.scale


def _scaled_run(rank, world_size, root):
    torch.manual_seed(0)
    return DDPTrainer(rank=rank, world_size=world_size, config={**dirs(Path(root)), "max_steps": 4, "batch_size": 8,
                                                                "save_every_iters": 2, "device": "cpu"},
                      model=_Scaled(), loss_fn=_forward_loss, train_dataset=_classes(), val_dataset=_classes(16)
                      ).train()["status"]


@pytest.mark.multi
def test_a_0_dim_parameter_and_buffer_pass_the_replica_check_and_init_from(tmp_path):
    """The bytes of a 0-dim tensor cannot be viewed as such: a model with a learnable scalar failed its first
    save point on 2 ranks (the replica check hashes every parameter), and init_from in any run."""
    assert spawn(_scaled_run, 2, str(tmp_path), timeout=120) == ["completed"] * 2
    state = torch.load(tmp_path / "ckpt" / "model_state_step_4.pt", weights_only=True)
    assert state["transient_buffers"]["seen"]["value"] == 4 and state["model"]["scale"].dim() == 0
    tuned = DDPTrainer(config={**dirs(tmp_path / "tuned"), "max_steps": 2, "batch_size": 8, "device": "cpu",
                               "init_from": str(tmp_path / "ckpt" / "model_final.pt")}, model=_Scaled(),
                       loss_fn=_forward_loss, train_dataset=_classes(), val_dataset=_classes(16))
    assert torch.equal(tuned.raw_model.scale, state["model"]["scale"])
    tuned.close()


def _init_from_per_rank(rank, world_size, root):
    """rank 1 is given another file: as on a node whose copy of the file differs"""
    name = "a" if rank == 0 else "b"
    cfg = {**QUICK, **dirs(Path(root) / "run"), "max_steps": 2, "init_from": str(Path(root) / f"{name}.pt")}
    try:
        trainer = DDPTrainer(rank=rank, world_size=world_size, config=cfg)
    except ValueError as exc:
        return str(exc)
    loaded = trainer.evaluate()["loss"]
    return trainer.train()["status"], loaded


def _no_rank_given(rank, world_size, root, shared):
    """Builds the trainer with no rank; in one run dir for both, the one that holds it waits for the other's
    refusal before it lets go."""
    try:
        trainer = DDPTrainer(config={**QUICK, **dirs(Path(root) / ("shared" if shared else str(rank))),
                                     "max_steps": 1})
    except ValueError as exc:
        Path(root, "refused").write_text(str(rank))
        return str(exc)
    deadline = time.time() + 60
    while shared and not Path(root, "refused").exists() and time.time() < deadline:
        time.sleep(0.05)
    trainer.close()
    return "built"


@pytest.mark.multi
def test_an_mp_spawn_rank_that_names_no_rank_is_told_how(tmp_path):
    """mp.spawn's processes with MASTER_ADDR/MASTER_PORT set, no launcher variables and no group, built
    DDPTrainer(config=...) as rank 0 of 1 each: two runs alone without a word, or one turned away from the run
    dir the other held "by another run" (a migrating user). A Pool worker of a sweep looks the same and is
    legitimately alone (a review): each is warned, and a sibling holding the run dir is named as one."""
    hint = ("if it is one of mp.spawn's ranks, pass rank= and world_size= (mp.spawn passes the rank first), or make "
            "the process group before the trainer")
    assert spawn(_no_rank_given, 2, str(tmp_path), False, timeout=120) == ["built"] * 2
    for rank in (0, 1):
        assert (f"WARNING: this process was started by multiprocessing with MASTER_ADDR or MASTER_PORT set, and "
                f"nothing names its rank: it trains alone, as rank 0 of 1; {hint}") in \
            (tmp_path / str(rank) / "logs" / "rank_0.log").read_text()
    (tmp_path / "one").mkdir()
    built, refused = sorted(spawn(_no_rank_given, 2, str(tmp_path / "one"), True, timeout=120))
    assert built == "built" and refused.endswith(f": a process started beside this one, each as rank 0 of 1: "
                                                 f"{hint}"), refused


@pytest.mark.multi
def test_init_from_on_two_ranks_must_read_the_same_weights(tmp_path):
    torch.manual_seed(0)
    for name in ("a", "b"):
        torch.save({"model": CausalLM(64, 32, 2, 2, 32).state_dict()}, tmp_path / f"{name}.pt")
    assert spawn(_init_from_per_rank, 2, str(tmp_path), timeout=120) == [
        f"init_from {tmp_path / 'a.pt' if r == 0 else tmp_path / 'b.pt'}: the ranks read different weights from it: "
        f"every rank reads the file itself, so on several nodes it must be the same file on each" for r in (0, 1)]
    (tmp_path / "b.pt").write_bytes((tmp_path / "a.pt").read_bytes())
    results = spawn(_init_from_per_rank, 2, str(tmp_path), timeout=120)
    one = DDPTrainer(config={**QUICK, **dirs(tmp_path / "one"), "init_from": str(tmp_path / "a.pt")})
    assert [status for status, _ in results] == ["completed"] * 2
    assert [loss for _, loss in results] == [pytest.approx(one.evaluate()["loss"], rel=1e-6)] * 2  # a.pt's weights
    one.close()
    state = torch.load(tmp_path / "run" / "ckpt" / "model_state_step_2.pt", weights_only=True)
    start = torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    assert all(not torch.equal(state["model"][k], start[k]) for k in ("tok.weight", "head.weight"))  # trained on


def test_the_loss_fns_extras_on_the_test_set_and_the_last_validation_reach_the_summary(tmp_path, no_launch_env):
    """The val records carried val_<extra>; the test set's extras were computed and dropped, and the summary
    had the last validation's loss without its extras (a user's wish)."""
    from ddp_training import lm_loss
    data = _markov({**QUICK, "test_fraction": 0.1})

    def with_accuracy(model, batch):
        s, c = lm_loss(model, batch)
        x, y = batch
        return s, c, {"accuracy": (model(x).argmax(-1) == y).float().sum() / c}
    trainer = DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 3}, model=CausalLM(64, 32, 2, 2, 32),
                         loss_fn=with_accuracy, train_dataset=data.train, val_dataset=data.val,
                         test_dataset=data.test)
    summary = trainer.train()
    assert summary["test_accuracy"] == pytest.approx(trainer.evaluate(trainer.test_loader)["accuracy"], rel=1e-6)
    assert 0 <= summary["test_accuracy"] <= 1 and metrics(tmp_path / "logs", "summary")[-1]["test_accuracy"] == \
        pytest.approx(summary["test_accuracy"])
    last_val = metrics(tmp_path / "logs", "val")[-1]
    assert last_val["step"] == 3 and summary["final_val_loss"] == last_val["val_loss"]
    assert 0 <= summary["final_val_accuracy"] == last_val["val_accuracy"] <= 1
    state = torch.load(tmp_path / "ckpt" / "model_state_step_3.pt", weights_only=True)
    assert state["counters"]["last_val_extras"] == {"accuracy": last_val["val_accuracy"]}  # a resume keeps them


def test_names_and_values_that_would_replace_or_lose_what_the_kit_saves_are_refused(tmp_path, no_launch_env):
    """Found by a user-journey review: checkpoint_extra={"model": ...} replaced the weights in every file, and
    an extra named "loss" the validation loss that early stopping and the best checkpoint read (both without
    a word); a numpy number in resume_must_match made every state fail to resume (weights_only), and a tensor
    there failed the comparison; a numpy array in checkpoint_extra made the weights files unloadable."""
    from ddp_training import EvaluationFailed, StepFailed, evaluate_model, lm_loss
    data = _markov(QUICK)
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 2, "val_interval": 0}
    custom = dict(model=CausalLM(64, 32, 2, 2, 32), train_dataset=data.train, val_dataset=data.val)
    # a weights_key that is a checkpoint's own field saved the step (or the val loss) in place of the weights
    for key in ("global_step", "val_loss"):
        with pytest.raises(ValueError, match=rf"weights_key '{key}': a checkpoint's own fields are global_step"):
            DDPTrainer(config=cfg, weights_key=key, **custom)
    # NaN equals nothing, itself included: every rank "differed" and no state resumed (a user's exploratory test)
    with pytest.raises(TypeError, match=r"resume_must_match: 'p' is nan, which equals nothing"):
        DDPTrainer(config=cfg, resume_must_match={"p": float("nan")}, **custom)
    with pytest.raises(ValueError, match=r"checkpoint_extra: the keys \['global_step', 'model'\] are the checkpoint's own"):
        DDPTrainer(config=cfg, checkpoint_extra={"model": "mlp-8-16-3", "global_step": "n/a", "arch": "mlp"}, **custom)
    with pytest.raises(TypeError, match=r"checkpoint_extra: the value of 'classes' \(ndarray\) would not save and load"):
        DDPTrainer(config=cfg, checkpoint_extra={"classes": np.arange(3)}, **custom)
    # one that cannot even be saved was pickle's own error, naming neither checkpoint_extra nor the key
    with pytest.raises(TypeError, match=r"checkpoint_extra: the value of 'make' \(function\) would not save and load"):
        DDPTrainer(config=cfg, checkpoint_extra={"make": lambda: 1}, **custom)
    for bad, named in (({"image_size": np.int64(32)}, r"'image_size' is int64 32"),
                       ({"weights": {"class": torch.tensor([1.0, 2.0])}}, r"'weights'\['class'\] is Tensor")):
        with pytest.raises(TypeError, match="resume_must_match: " + named):
            DDPTrainer(config=cfg, resume_must_match=bad, **custom)

    def with_extras(model, batch):
        s, c = lm_loss(model, batch)
        return s, c, {"loss": s.detach() * 0, "accuracy": c}
    trainer = DDPTrainer(config=cfg, loss_fn=with_extras, **custom)
    with pytest.raises(StepFailed, match=r"step 1: loss_fn returned the extras \['loss'\]: a metrics record has fields of these names"):
        trainer.train()

    def read_as_others(model, batch):  # the validation curve of training_logs.py, a memory reading
        s, c = lm_loss(model, batch)
        return s, c, {"val_loss": s.detach(), "cpu_rss_gb": c, "accuracy": c}
    with pytest.raises(StepFailed, match=r"extras \['cpu_rss_gb', 'val_loss'\]: a metrics record has fields of these "
                                         r"names already \(.*\), and names starting with 'val_' are the validation "
                                         r"record's; rename them"):
        DDPTrainer(config={**cfg, **dirs(tmp_path / "val")}, loss_fn=read_as_others, **custom).train()
    loader = torch.utils.data.DataLoader(data.val, batch_size=16)
    # every rank raises it alike, and a trainer's validation saves the last good weights first
    with pytest.raises(EvaluationFailed, match=r"evaluation: loss_fn returned the extras \['loss'\]: evaluate\(\)'s "
                                               r"result has fields of these names already \(count, loss\)"):
        evaluate_model(custom["model"], loader, with_extras, torch.device("cpu"))
    # what is allowed still saves and resumes: tensors in checkpoint_extra, plain values in resume_must_match
    run = {**cfg, **dirs(tmp_path / "ok")}
    fine = dict(checkpoint_extra={"classes": torch.arange(3), "arch": "lm"},
                resume_must_match={"size": [32, 32], "labels": {0: "negative", 1: "positive"}})
    DDPTrainer(config=run, **fine, **custom).train()
    saved = torch.load(tmp_path / "ok" / "ckpt" / "model_final.pt", weights_only=True)
    assert saved["classes"].tolist() == [0, 1, 2] and saved["arch"] == "lm" and "model" in saved
    assert DDPTrainer(config={**run, "max_steps": 3}, **fine, **custom).train()["resumed_from"] is not None


def test_resolved_config_and_example_configs_load(tmp_path, no_launch_env):
    import dataclasses
    from ddp_training import config_from_yaml
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 2, "val_interval": 0, "save_every_iters": 1, "resume": "none"}
    DDPTrainer(config=cfg).train()
    saved = config_from_yaml(str(tmp_path / "logs" / "config.yaml"))
    # how the launch began is no property of the run: loaded again with more steps, the file continues it
    assert saved == dataclasses.asdict(TrainConfig(**{**cfg, "resume": "auto"}))
    summary = DDPTrainer(config={**saved, "max_steps": 3}).train()
    assert summary["resumed_from"].endswith("state_step_2.pt") and summary["steps"] == 3


def test_example_configs_train_beside_the_default_run(tmp_path, no_launch_env, monkeypatch):
    """An example is a run of its own: run after the README's default command, it must not try to resume the
    default run's states (another model) under the default run name."""
    from ddp_training import main
    monkeypatch.chdir(tmp_path)
    quick = ["--cpu", "--max_steps", "2", "--val_interval", "0"]
    assert main(quick) == 0
    examples = sorted((REPO / "configs").glob("lm_*.yaml"))
    assert examples
    for example in examples:
        assert main(["--config", str(example), *quick]) == 0
        assert (tmp_path / "runs" / example.stem / "checkpoints" / "model_final.pt").exists()


def test_every_config_key_is_explained_in_help(capsys):
    import dataclasses
    from ddp_training import HELP
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(HELP)
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--lr_schedule {cosine,wsd,constant}" in shown and "peak AdamW learning rate (default: 0.003)" in shown


def test_a_saved_config_with_another_run_name_makes_another_run(tmp_path, no_launch_env, monkeypatch):
    from ddp_training import config_from_yaml
    monkeypatch.chdir(tmp_path)
    DDPTrainer(config={**QUICK, "max_steps": 2, "val_interval": 0, "run_name": "a"}).train()
    saved = config_from_yaml("runs/a/config.yaml")
    assert saved["log_dir"] is None and saved["checkpoint_dir"] is None  # derived from run_name, so they follow it
    args = build_arg_parser().parse_args(["--config", "runs/a/config.yaml", "--run_name", "a2"])
    cfg = TrainConfig.from_dict(config_from_args(args))
    assert (cfg.log_dir, cfg.checkpoint_dir) == (str(Path("runs") / "a2"), str(Path("runs") / "a2" / "checkpoints"))
    # A file that names its dirs: --run_name still makes another run, unless the dirs are flags too
    Path("named.yaml").write_text("log_dir: runs/exp1\ncheckpoint_dir: /data/ckpt/exp1\n")
    cfg = TrainConfig.from_dict(config_from_args(build_arg_parser().parse_args(
        ["--config", "named.yaml", "--run_name", "exp2"])))
    assert (cfg.log_dir, cfg.checkpoint_dir) == (str(Path("runs") / "exp2"), str(Path("runs") / "exp2" / "checkpoints"))
    cfg = TrainConfig.from_dict(config_from_args(build_arg_parser().parse_args(
        ["--config", "named.yaml", "--run_name", "exp2", "--checkpoint_dir", "/data/ckpt/exp2"])))
    assert (cfg.log_dir, cfg.checkpoint_dir) == (str(Path("runs") / "exp2"), "/data/ckpt/exp2")
    cfg = TrainConfig.from_dict(config_from_args(build_arg_parser().parse_args(["--config", "named.yaml"])))
    assert (cfg.log_dir, cfg.checkpoint_dir) == ("runs/exp1", "/data/ckpt/exp1")
    cfg = TrainConfig.from_dict(config_from_args(build_arg_parser().parse_args(["--config", "named.yaml", "--test"])))
    assert cfg.log_dir == str(Path("runs") / "lm_test")  # a quick test never writes into the real run's dirs
    # the file's own run name again is the file's run, in its dirs
    Path("named.yaml").write_text("run_name: exp1\nlog_dir: /scratch/exp1\n")
    cfg = TrainConfig.from_dict(config_from_args(build_arg_parser().parse_args(
        ["--config", "named.yaml", "--run_name", "exp1"])))
    assert cfg.log_dir == "/scratch/exp1"


def test_an_epochs_flag_is_the_runs_length_over_the_max_steps_of_test_or_a_file(tmp_path, capsys, monkeypatch):
    """max_steps wins over num_epochs in the trainer, so --test's 60 steps (or a file's max_steps) made an
    explicit --num_epochs do nothing: `--test --num_epochs 1` ran 60 steps, about two epochs."""
    parse = build_arg_parser().parse_args
    cfg = config_from_args(parse(["--test", "--num_epochs", "1"]))
    assert (cfg["num_epochs"], cfg["max_steps"]) == (1, 0)
    assert "note: --num_epochs 1 replaces max_steps=60 of --test" in capsys.readouterr().err
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("max_steps: 500\n")
    assert config_from_args(parse(["--config", str(cfg_file), "--epochs", "2"]))["max_steps"] == 0
    assert f"replaces max_steps=500 of --config {cfg_file}" in capsys.readouterr().err
    # every rank of a torchrun launch parses the flags: the first one says it (an audit saw it twice)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert config_from_args(parse(["--test", "--num_epochs", "1"]))["max_steps"] == 0
    assert capsys.readouterr().err == ""
    # both flags: as given (max_steps wins, as always); no epochs flag: the preset's or the file's steps
    assert config_from_args(parse(["--test", "--num_epochs", "1", "--max_steps", "9"]))["max_steps"] == 9
    assert config_from_args(parse(["--test"]))["max_steps"] == 60
    assert config_from_args(parse(["--config", str(cfg_file)]))["max_steps"] == 500
    assert "note" not in capsys.readouterr().err


def test_cli_precedence_defaults_yaml_flags(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("batch_size: 8\nlearning_rate: 0.002\nuse_amp: false\n")
    args = build_arg_parser().parse_args(["--config", str(cfg_file), "--batch-size", "12", "--cpu", "--test"])
    cfg = config_from_args(args)
    assert cfg["batch_size"] == 12 and cfg["use_amp"] is False and cfg["device"] == "cpu"
    assert cfg["learning_rate"] == 1e-2  # the --test preset sits above YAML, below flags
    args = build_arg_parser().parse_args(["--config", str(cfg_file), "--lr", "0.5", "--target_loss", "none"])
    cfg = config_from_args(args)
    assert cfg["learning_rate"] == 0.5 and cfg["target_loss"] is None and cfg["batch_size"] == 8
    assert TrainConfig.from_dict(cfg).bucket_cap_mb is None  # DDP's own bucketing unless asked
    cfg = config_from_args(build_arg_parser().parse_args(["--bucket_cap_mb", "4"]))
    assert cfg["bucket_cap_mb"] == 4.0
    # --cpu means gloo over a file's nccl; "auto" is the README's word for the keys that decide themselves
    cfg_file.write_text("dist_backend: nccl\nstatic_graph: true\n")
    cfg = config_from_args(build_arg_parser().parse_args(["--config", str(cfg_file), "--cpu"]))
    assert cfg["dist_backend"] is None and cfg["static_graph"] is True
    cfg = config_from_args(build_arg_parser().parse_args(["--config", str(cfg_file), "--static_graph", "auto",
                                                          "--dist_backend", "auto"]))
    assert cfg["static_graph"] is None and cfg["dist_backend"] is None
    assert config_from_args(build_arg_parser().parse_args(["--static_graph"]))["static_graph"] is True
    assert TrainConfig.from_dict({"static_graph": "auto"}).static_graph is None


# Run as real scripts: one refused by argparse, one by the config check, one by a rank's set-up under --nproc.
# The rest are forked from a server that has imported torch (the same main(), 2 s less each).
SCRIPT_RUN_CASES = (["--no_such_flag", "1"], ["--max_steps", "-3"], ["--cpu", "--nproc", "2", "--data", "missing.txt"])


@pytest.mark.parametrize("argv,message", [
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--batch_size", "abc"], "argument --batch_size/--batch-size: invalid"),
    (["--use_amp", "maybe"], "expected true/false"),
    (["--config", "{yaml}"], "unknown config key 'bogus_key'"),
    (["--lr_schedule", "linear"], "'lr_schedule' must be one of"),
    (["--max_steps", "-3"], "'max_steps' must be >= 0, got -3"),
    (["--lr", "0"], "'learning_rate' must be > 0, got 0.0"),
    (["--bucket_cap_mb", "0"], "'bucket_cap_mb' must be > 0, got 0.0"),
    (["--weight_decay", "nan"], "'weight_decay' must be a finite number, got nan"),
    (["--dist_timeout", "inf"], "'dist_timeout' must be a finite number, got inf"),
    (["--checkpoint_prefix", "../up"], "'checkpoint_prefix' must be letters, digits"),
    (["--checkpoint_prefix", "m[1]"], "'checkpoint_prefix' must be letters, digits"),
    (["--run_name", "/tmp/elsewhere"], "'run_name' must be names of letters, digits"),
    (["--run_name", "a/../../up"], "'run_name' must be names of letters, digits"),
    (["--vocab_size", "0"], "'vocab_size' must be >= 1, got 0"),
    (["--val_fraction", "1.5"], "'val_fraction' must be in [0, 1)"),
    (["--min_lr_ratio", "2"], "'min_lr_ratio' must be in [0, 1]"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--config", "missing.yaml"], "--config missing.yaml: [Errno 2] No such file"),
    (["--cpu", "--data", "missing.txt"], "error: FileNotFoundError: --data missing.txt: no such file"),
    (["--cpu", "--nproc", "2", "--data", "missing.txt"], "error: FileNotFoundError: --data missing.txt: no such"),
    # refused by each rank before they meet: rank 1 may exit first (see the next test)
    (["--cpu", "--nproc", "2", "--dist_backend", "nccl"], "error: ValueError: the nccl backend needs CUDA"),
    (["--cpu", "--data", "empty.txt"], "error: ValueError: --data empty.txt: the file is empty"),
    (["--cpu", "--data", "."], "error: ValueError: --data .: is a directory"),
    (["--device", "cuda"], "error: ValueError: --device cuda: CUDA is not available here"),  # CUDA hidden below
    (["--cpu", "--test", "--tensorboard"], "--tensorboard needs the tensorboard package"),
    # PyYAML's messages span lines: joined into one
    (["--config", "dup.yaml"], 'error: --config dup.yaml: the key(s) dropout appear more than once in "dup.yaml", '
                               'line 1, column 1'),
    (["--config", "syntax.yaml"], "error: --config syntax.yaml: while parsing a flow node expected the node content, "
                                  "but found '<stream end>' in \"syntax.yaml\", line 2, column 1"),
    (["--dropout", "1.5"], "config key 'dropout' must be in [0, 1), got 1.5"),
    # from a review of the CLI: each failed later, mid-run or with no flag named, or trained on the default
    (["--bucket_cap_mb", "abc"], "argument --bucket_cap_mb: invalid float (or none) value: 'abc'"),
    (["--loader_timeout", "1e10"], "config key 'loader_timeout' must be at most 1e+07, got 10000000000.0"),
    (["--dist_timeout", "0.001"], "dist_timeout must be at least 1 s"),
    (["--seed", "4294967296"], "config key 'seed' must be in [0, 2**32), got 4294967296"),
    (["--seed", "-1"], "config key 'seed' must be in [0, 2**32), got -1"),
    (["--data", ""], "config key 'data' must be a path (or none for the default), got an empty string"),
    (["--config", "latin1.yaml"], "--config latin1.yaml: 'utf-8' codec can't decode"),
    (["--save_every", "3"], "unrecognized arguments: --save_every"),  # no abbreviations
    # other trainers' names are told the kit's (a migrating user)
    (["--hidden-size", "16"], "unrecognized arguments: --hidden-size 16; --hidden-size (did you mean --hidden_size?)"),
    (["--gradient_accumulation_steps", "2"], "--gradient_accumulation_steps (this kit's name for it: --grad_accum_steps)"),
    (["--world_size", "2"], "--world_size (the number of processes is the launcher's: torchrun --nproc_per_node"),
    (["--config", "hf.yaml"], "unknown config key 'lr' (this kit's name for it: learning_rate); known keys: amp_dtype"),
    (["--config", "nested.yaml"], "unknown config key 'parallel' (a flat mapping: nested sections are not read)"),
    (["--cpu", "--log_dir", "empty.txt"],
     "error: ValueError: log_dir empty.txt: cannot write rank_0.log there (FileExistsError"),
    # found at set-up, not at the first save an epoch later
    (["--cpu", "--nproc", "2", "--checkpoint_dir", "empty.txt/ck"],
     "error: ValueError: checkpoint_dir empty.txt/ck: cannot write or list checkpoints there (NotADirectoryError"),
    # a link an earlier run left (its --checkpoint_dir) to where no dir can be made
    (["--cpu", "--run_name", "linked"], "error: ValueError: checkpoint_dir runs/linked/checkpoints: cannot write or "
                                        "list checkpoints there (NotADirectoryError"),
    (["--cpu", "--run_name", "linked"], "; runs/linked/checkpoints is a symlink to "),
])
def test_cli_bad_input_exits_2_with_a_clear_message(tmp_path, argv, message):
    (tmp_path / "bad.yaml").write_text("bogus_key: 1\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "dup.yaml").write_text("dropout: 0.1\nbatch_size: 8\ndropout: 0.2\n")
    (tmp_path / "syntax.yaml").write_text("batch_size: [\n")
    (tmp_path / "latin1.yaml").write_bytes("run_name: caf\u00e9\n".encode("latin-1"))
    (tmp_path / "hf.yaml").write_text("lr: 0.1\n")
    (tmp_path / "nested.yaml").write_text("parallel:\n  world_size: 2\n")
    (tmp_path / "runs" / "linked").mkdir(parents=True)
    (tmp_path / "runs" / "linked" / "checkpoints").symlink_to(tmp_path / "empty.txt" / "ck")
    argv = [a.replace("{yaml}", str(tmp_path / "bad.yaml")) for a in argv]
    if "--tensorboard" in argv and importlib.util.find_spec("tensorboard"):
        pytest.skip("tensorboard is installed here")
    env = clean_env(CUDA_VISIBLE_DEVICES="")
    if argv in SCRIPT_RUN_CASES:
        r = run([sys.executable, REPO / "ddp_training.py", *argv], cwd=tmp_path, timeout=60, env=env)
        code, out = r.returncode, r.stdout
    else:
        code, out = run_script_forked("ddp_training", argv, tmp_path, env)
    assert code == 2 and message in out, out
    assert not list(tmp_path.rglob("FAILED_rank_*")), "bad input is no failed run"
    assert "Traceback" not in out and out.count("error:") == 1, out  # one line, from rank 0


def test_nproc_inside_a_torchrun_worker_is_refused_even_for_one_worker(tmp_path):
    """`launch_training.sh --nproc 1 -- --nproc 2` trained two spawned ranks inside torchrun's one worker, out of
    reach of its restarts and stops (only a world size over 1 was refused). A one-task srun may use --nproc."""
    worker = dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_ports(1)[0],
                  TORCHELASTIC_RUN_ID="x")
    code, out = run_script_forked("ddp_training", ["--cpu", "--test", "--nproc", "2"], tmp_path, clean_env(**worker))
    assert code == 2 and out.strip() == ("error: --nproc 2 spawns its own processes inside a torchrun worker, beyond "
                                         "torchrun's restarts and stops; give torchrun --nproc_per_node=2 instead"), out
    assert not (tmp_path / "runs").exists()


def nproc_env(**extra) -> dict:
    """An --nproc run's environment, with a port of this test process's block (dist_helpers.free_ports): the
    kernel's free port, chosen seconds before the ranks bind it, could go to another test's connection."""
    return clean_env(MASTER_PORT=free_ports(1)[0], **extra)


def _says_its_port(rank, world_size, cfg, requested):
    """Writes the port it meets on, and whether its parent (spawn_local) was listening there before it met."""
    port = int(os.environ["MASTER_PORT"])
    held = any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(os.getppid()).net_connections(kind="tcp"))
    env = rt.setup_distributed(rank, world_size, device="cpu")
    torch.distributed.barrier()
    Path(cfg["out"], f"rank_{rank}").write_text(json.dumps([port, held, env.world_size]))
    rt.teardown_distributed(synchronize=True)
    rt.exit_process(0)


def test_nproc_exits_as_a_rank_whose_set_up_a_second_stop_ended():
    """A rank ended in set-up by a second SIGTERM exits 143 (rt.SetUpWatch); --nproc exits so too, as one
    process would, not 1; a plain failure stays 1 and a preemption 75."""
    import torch.multiprocessing as mp
    from ddp_training import _spawn_exit_status

    def died(code):
        return mp.ProcessExitedException("rank 1 exited", error_index=1, error_pid=4242, exit_code=code)
    term = [signal.SIGTERM, signal.SIGTERM]
    assert _spawn_exit_status(died(128 + signal.SIGTERM), None, term) == 128 + signal.SIGTERM
    assert _spawn_exit_status(died(rt.EXIT_PREEMPTED), None, term) == rt.EXIT_PREEMPTED
    assert _spawn_exit_status(died(1), None, term) == 1


def test_nproc_meets_on_master_port_where_it_is_set_and_puts_the_environment_back(tmp_path, monkeypatch):
    import ddp_training
    port = free_ports(1)[0]
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert ddp_training.spawn_local(2, {"out": str(tmp_path)}, worker=_says_its_port) == 0
    assert [json.loads((tmp_path / f"rank_{r}").read_text()) for r in (0, 1)] == [[port, True, 2]] * 2
    assert os.environ["MASTER_PORT"] == str(port) and "MASTER_ADDR" not in os.environ
    assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
    with socket.socket() as taken:  # another program listens there: one clear error, no rank started
        taken.bind(("127.0.0.1", port))
        taken.listen()
        code, out = run_script_forked("ddp_training", ["--cpu", "--nproc", "2"], tmp_path, dict(os.environ))
    assert code == 2 and f"error: MASTER_PORT={port}: cannot listen there for the ranks' rendezvous" in out, out
    assert "Traceback" not in out and not (tmp_path / "runs").exists(), out
    for bad in ("abc", "0", "70000"):
        monkeypatch.setenv("MASTER_PORT", bad)
        code, out = run_script_forked("ddp_training", ["--cpu", "--nproc", "2"], tmp_path, dict(os.environ))
        assert code == 2 and f"error: MASTER_PORT={bad!r} in the environment: expected a port number" in out, out


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@pytest.fixture
def stop_handlers():
    """This process's stop handlers as a test found them (yielded), put back after it."""
    before = {sig: signal.getsignal(sig) for sig in STOPS}
    yield before
    for sig, handler in before.items():
        signal.signal(sig, handler)


def stops_change_nothing(*sigs, after: str) -> None:
    """Each signal to this process is noted by a handler that stays: no KeyboardInterrupt, no death."""
    try:
        for sig in sigs:
            os.kill(os.getpid(), sig)
        time.sleep(0.1)
    except KeyboardInterrupt:
        pytest.fail(f"a Ctrl-C after {after} raised KeyboardInterrupt")


def test_nproc_keeps_passing_stops_on_until_it_exits(tmp_path, monkeypatch, stop_handlers):
    """As a rank's train_preemptible: a Ctrl-C to the --nproc parent after its ranks ended was a
    KeyboardInterrupt that printed "before any training step" over a finished run. Called in-process (a
    notebook, a test) it gives the caller's handlers back."""
    import ddp_training
    monkeypatch.setattr(rt, "_main_ends_the_process", True)  # as rt.run_script sets it
    assert ddp_training.spawn_local(2, {"out": str(tmp_path)}, worker=_says_its_port) == 0
    stops_change_nothing(signal.SIGINT, after="the ranks ended")
    for sig, handler in stop_handlers.items():
        signal.signal(sig, handler)
    monkeypatch.setattr(rt, "_main_ends_the_process", False)
    assert ddp_training.spawn_local(2, {"out": str(tmp_path)}, worker=_says_its_port) == 0
    assert {sig: signal.getsignal(sig) for sig in STOPS} == stop_handlers


def test_nproc_hosts_its_rendezvous_store_itself(tmp_path, monkeypatch):
    """Without MASTER_PORT, the port was one the kernel said was free, released, and bound by rank 0 seconds
    later: another program (a second --nproc run of a sweep) could take it in between. The launching process
    now holds it from before the ranks start, and they meet there."""
    import ddp_training
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert ddp_training.spawn_local(2, {"out": str(tmp_path)}, worker=_says_its_port) == 0
    (port, held, size), second = (json.loads((tmp_path / f"rank_{r}").read_text()) for r in (0, 1))
    assert held and size == 2 and second == [port, True, 2] and port > 0
    assert "MASTER_PORT" not in os.environ and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ


def _rank_1_refuses(rank, world_size, cfg, requested):
    if rank == 1:
        rt.exit_process(rt.refuse("ValueError: rank 1's shard is empty", show=False))
    time.sleep(60)  # rank 0 never gets to print it: torch ends it once rank 1 has exited
    rt.exit_process(0)


def test_a_rank_that_failed_before_the_parent_waits_is_not_waited_past():
    """The parent looked for a failed rank only after waiting on the live ones: a rank that had already failed
    (is_alive() reaps it) left the parent waiting for its peer, 60 s in the test below, 1 run in 10."""
    import threading
    from ddp_training import _a_rank_died_of_the_stop

    class Rank:
        def __init__(self, exitcode, sentinel=None):
            self.exitcode, self.sentinel = exitcode, sentinel

        def is_alive(self):
            return self.exitcode is None
    quiet_r, quiet_w = os.pipe()  # rank 0 goes on (a rendezvous, a sleep): its sentinel never becomes ready
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (_a_rank_died_of_the_stop([Rank(None, quiet_r), Rank(2)], []), done.set()),
                         daemon=True).start()
        assert done.wait(5)
    finally:
        os.close(quiet_r)
        os.close(quiet_w)


def _rank_1_is_killed(rank, world_size, cfg, requested):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a process
    time.sleep(60)  # torch ends rank 0 once rank 1 is gone


def _rank_1_freezes(rank, world_size, cfg, requested):
    if rank == 1:
        Path(cfg["out"], "ready_1").touch()
        os.kill(os.getpid(), signal.SIGSTOP)  # a rank frozen (a hung file system) when the stop comes
    signal.signal(signal.SIGTERM, lambda *_: None)  # the trainer's handler: the stop is read from `requested`
    Path(cfg["out"], "ready_0").touch()
    while not requested.value:
        time.sleep(0.01)
    rt.exit_process(rt.EXIT_PREEMPTED)  # rank 0 has saved


def test_a_stop_with_a_frozen_rank_ends_once_rank_0_has_saved(tmp_path, monkeypatch):
    """The parent waited torch's grace twice (the save's 300 s, then again after SIGTERM, which a stopped
    process does not act on) for a rank that had nothing to save: ten minutes. Once rank 0, which writes every
    checkpoint, is done, the others get PEER_GRACE_S, then SIGTERM, then as long again before SIGKILL."""
    import threading
    import ddp_training
    monkeypatch.setattr(ddp_training, "PEER_GRACE_S", 2)

    def stop_when_ready():
        deadline = time.time() + 60
        while not all((tmp_path / f"ready_{r}").exists() for r in (0, 1)) and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # spawn_local's handler passes it on
    threading.Thread(target=stop_when_ready, daemon=True).start()
    t0 = time.monotonic()
    assert ddp_training.spawn_local(2, {"out": str(tmp_path)}, worker=_rank_1_freezes) == rt.EXIT_PREEMPTED
    assert time.monotonic() - t0 < 60
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_nproc_names_a_rank_that_was_killed(capfd, caplog):
    """A rank killed from outside left its peers only a broken connection to report ("Connection closed by
    peer"), and torch a warning for each rank it then ended; the parent knows which rank died, and of what."""
    import ddp_training
    assert ddp_training.spawn_local(2, {}, worker=_rank_1_is_killed) == 1
    err = capfd.readouterr().err
    assert re.search(r"^error: rank 1 \(pid \d+\) was killed by SIGKILL \(the kernel's OOM killer sends SIGKILL", err,
                     re.M), err
    assert not [r for r in caplog.records if "Terminating process" in r.getMessage()]
    assert not logging.getLogger("torch.multiprocessing.spawn").filters  # the filter goes with the run


def test_nproc_prints_the_reason_of_a_rank_that_refused_before_rank_0(capfd):
    """Only rank 0 printed a refusal; when a peer refused first (a check that every rank makes before they
    meet), torch ended rank 0 before it printed, and the run exited 2 without a word."""
    import ddp_training
    t0 = time.monotonic()
    assert ddp_training.spawn_local(2, {}, worker=_rank_1_refuses) == 2
    assert time.monotonic() - t0 < 50
    assert capfd.readouterr().err.count("error: ValueError: rank 1's shard is empty\n") == 1
    assert "TORCHELASTIC_ERROR_FILE" not in os.environ


# -- real processes ----------------------------------------------------------------------

def check_two_rank_run(tmp_path, r):
    assert r.returncode == 0, r.stdout[-5000:]
    logs = tmp_path / "logs"
    for rank in (0, 1):
        text = (logs / f"rank_{rank}.log").read_text()
        assert f"[RANK {rank}]" in text and f"rank {rank}/2" in text
    s = summary_of(logs)
    assert s["world_size"] == 2 and s["steps"] == 60
    assert gap_fraction(s["final_val_loss"], s["loss_floor"]) < MAX_GAP_FRACTION
    ckpt = torch.load(tmp_path / "ckpt" / "model_final.pt", weights_only=True)
    assert ckpt["global_step"] == 60 and not any(k.startswith("module.") for k in ckpt["model"])


@pytest.mark.multi
def test_torchrun_two_ranks(tmp_path):
    r = run(torchrun(2, "ddp_training.py", "--cpu", "--test", "--log_dir", "logs", "--checkpoint_dir", "ckpt"),
            cwd=tmp_path, timeout=180)
    check_two_rank_run(tmp_path, r)


TRAINERS_IN_ONE_PROCESS = """
import os, sys
import torch, torch.distributed as dist
from ddp_training import DDPTrainer
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
cfg = dict(hidden_size=16, num_layers=1, num_heads=2, seq_len=16, dataset_size=256, batch_size=8, max_steps=3,
           val_interval=0, device="cpu", resume="none", dist_timeout=30)

def stage(name, *ranks):
    s = DDPTrainer(*ranks, config=dict(cfg, log_dir=name, checkpoint_dir=name)).train()
    print(f"rank {rank} {name}: {s['status']} {s['steps']} steps on {s['world_size']} ranks", flush=True)

stage("pretrain", rank, world)  # the kit makes its group and leaves it
stage("finetune")  # rank and world size from torchrun's variables; a second group of the kit's own, on
                   # torchrun's store that still holds the first one's keys
dist.init_process_group("gloo")  # the script's own group, on that store too: the trainers use it, leave it alone
stage("own-group", rank, world)
trainer = DDPTrainer(config=dict(cfg, log_dir="evaluated", checkpoint_dir="evaluated"))
summary = trainer.train()
print(f"rank {rank} evaluate after train: {abs(trainer.evaluate()['loss'] - summary['final_val_loss']) < 1e-6}")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {rank} all_reduce after train: {t.item():g}", flush=True)
dist.destroy_process_group()
import ddp_runtime
ddp_runtime.exit_process(0)  # as the README advises: gloo's destructors may abort a finished process (exit -6)
"""


@pytest.mark.multi
def test_trainers_one_after_another_and_a_group_of_the_scripts_own_under_torchrun(tmp_path):
    """Two trainers in one torchrun process hung in the second one's set-up (its group met the first one's keys
    on torchrun's store); a group the script made was destroyed by train(), so the script's own collectives
    and its destroy_process_group() after train() failed ('Default process group has not been initialized');
    a trainer built without rank and world_size was rank 0 of 1 on both processes, whatever torchrun said."""
    (tmp_path / "stages.py").write_text(TRAINERS_IN_ONE_PROCESS)
    r = run(torchrun(2, tmp_path / "stages.py"), cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    for rank in (0, 1):
        for name in ("pretrain", "finetune", "own-group"):
            assert f"rank {rank} {name}: completed 3 steps on 2 ranks" in r.stdout, r.stdout[-3000:]
        assert f"rank {rank} evaluate after train: True" in r.stdout
        assert f"rank {rank} all_reduce after train: 2" in r.stdout


@pytest.mark.multi
def test_nproc_spawns_two_ranks_without_torchrun(tmp_path):
    r = run([sys.executable, REPO / "ddp_training.py", "--cpu", "--test", "--nproc", "2",
             "--log_dir", "logs", "--checkpoint_dir", "ckpt"], cwd=tmp_path, timeout=180, env=nproc_env())
    check_two_rank_run(tmp_path, r)


@pytest.mark.multi
@pytest.mark.parametrize("to_group", [False, True], ids=["to-the-parent", "to-the-group-with-loader-workers"])
def test_sigterm_to_a_local_nproc_run_saves_and_exits_75(tmp_path, to_group):
    # --nproc runs without torchrun: its parent process must pass the signal on and wait for the save. Sent to
    # the process group (as torchrun, SLURM and Ctrl-C do), it reaches the DataLoader workers too, which must
    # not die of it and fail the rank's next batch.
    cmd = [sys.executable, REPO / "ddp_training.py", "--cpu", "--nproc", "2", "--test", "--max_steps", "100000",
           "--val_interval", "0", "--log_interval", "1", "--log_dir", "logs", "--checkpoint_dir", "ckpt",
           "--num_workers", "1" if to_group else "0"]
    with background(cmd, tmp_path, env=nproc_env()) as proc:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 3, timeout=90)
        if to_group:
            assert len(psutil.Process(proc.pid).children(recursive=True)) >= 4  # 2 ranks, a worker each
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out[-3000:]
    step = json.loads((tmp_path / "logs" / "PREEMPTED").read_text())["step"]
    assert step >= 3 and (tmp_path / "ckpt" / f"model_state_step_{step}.pt").exists()


def ranks_of(proc) -> list:
    """The ranks an --nproc run has started (not multiprocessing's resource tracker, also its child)."""
    children = []
    for child in psutil.Process(proc.pid).children():
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                children.append(child)
        except psutil.NoSuchProcess:
            pass
    return children


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


# What a stop in set-up leaves set-up to finish in (SETUP_STOP_GRACE_S, 20 s by default) for the tests that stop
# it there and expect a save at step 1: after the signal the ranks still import torch and dynamo and meet,
# 6-7 s here and up to 17 s with the CPU three times as busy (another test process beside it on a slow machine)
SLOW_SET_UP_GRACE = 90


@pytest.mark.multi
@pytest.mark.parametrize("how", ["ddp_training", "nproc", "vj2ac"])
def test_a_stop_while_the_script_imports_torch_stops_it_at_step_1_with_a_save(tmp_path, how):
    """What torchrun or srun start runs the script itself: a SIGTERM in its first seconds (torch's import) killed
    it (exit 143, no marker, so a SLURM job was not requeued). It is caught from the script's first lines."""
    if how == "vj2ac":
        data = make_vj2_data(tmp_path / "data", 1, 8, 4)
        cmd = [REPO / "vj2ac_train_multi_gpu.py", "--test", "--device", "cpu", "--processed_data_dir", data / "train",
               "--validation_data_dir", data / "val", "--checkpoint_dir", "logs"]
    else:
        cmd = [REPO / "ddp_training.py", "--cpu", "--test", "--log_dir", "logs", "--checkpoint_dir", "ckpt",
               *(["--nproc", "2"] if how == "nproc" else [])]
    env = nproc_env(SETUP_STOP_GRACE_S=SLOW_SET_UP_GRACE)
    with background([sys.executable, *cmd], tmp_path, env=env) as proc:
        deadline = time.time() + 30
        while not catches(proc.pid, signal.SIGTERM) and time.time() < deadline:
            time.sleep(0.005)
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()  # caught before torch loaded
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    assert json.loads((tmp_path / "logs" / "PREEMPTED").read_text())["step"] == 1, out[-3000:]


def wait_until_starting(proc, log_dir: Path, when: str) -> None:
    """Until an --nproc run's two ranks import torch ("while-the-ranks-import-torch": past their first lines,
    Python's start-up) or rank 1 has begun its set-up and opened its log ("during-their-set-up"); 60 s at most."""
    def importing():
        ranks = ranks_of(proc)
        return len(ranks) >= 2 and all(torch_is_loading(r.pid) for r in ranks)
    deadline = time.time() + 60
    while time.time() < deadline:
        if importing() if when.startswith("while") else (log_dir / "rank_1.log").exists():
            return
        time.sleep(0.01)
    pytest.fail(f"the --nproc run did not reach '{when}' within 60 s")


@pytest.mark.multi
@pytest.mark.parametrize("when", ["while-the-ranks-import-torch", "during-their-set-up"])
def test_a_stop_to_the_group_of_a_starting_nproc_run_stops_it_at_step_1_with_a_save(tmp_path, when):
    """The group gets one SIGTERM (`kill -TERM -PGID`) and the parent passes it on: the ranks must neither die
    of it before they have a handler nor take the two deliveries for the 'second signal' that ends set-up."""
    cmd = [sys.executable, REPO / "ddp_training.py", "--cpu", "--nproc", "2", "--test", "--log_dir", "logs",
           "--checkpoint_dir", "ckpt"]
    with background(cmd, tmp_path, env=nproc_env(SETUP_STOP_GRACE_S=SLOW_SET_UP_GRACE)) as proc:
        wait_until_starting(proc, tmp_path / "logs", when)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    if when.startswith("while"):  # a rank without a handler yet dies of it: nothing was trained, nothing lost
        assert "stopped by SIGTERM while the ranks were starting: nothing to save" in out
        assert not (tmp_path / "logs" / "metrics.jsonl").exists() or not metrics(tmp_path / "logs", "train")
    else:
        assert json.loads((tmp_path / "logs" / "PREEMPTED").read_text())["step"] == 1
        assert (tmp_path / "ckpt" / "model_state_step_1.pt").exists()


@pytest.mark.multi
@pytest.mark.parametrize("when", ["while-the-ranks-import-torch", "during-their-set-up"])
def test_ctrl_c_during_the_set_up_of_an_nproc_run_is_no_success(tmp_path, when):
    """Ctrl-C (SIGINT to the group) in set-up stops the ranks at once, nothing to save, exit 130: torch's spawn
    wrapper turns a KeyboardInterrupt into exit 0, and the run exited 0 as if it had trained; one in a rank's
    imports was a traceback there and exit 1."""
    cmd = [sys.executable, REPO / "ddp_training.py", "--cpu", "--nproc", "2", "--test", "--log_dir", "logs",
           "--checkpoint_dir", "ckpt", "--dataset_size", "200000"]  # ~3 s of set-up: making and hashing the data
    with background(cmd, tmp_path, env=nproc_env()) as proc:
        wait_until_starting(proc, tmp_path / "logs", when)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert rt.CTRL_C_BEFORE_TRAINING in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]  # the ranks' import machinery's, twice (a README audit)
    assert not (tmp_path / "logs" / "COMPLETED").exists() and not (tmp_path / "ckpt" / "model_final.pt").exists()


CTRL_C_IN_ONE_RANKS_BOOTSTRAP = """
import signal, sys, time
sys.path.insert(0, {repo!r})
import ddp_training


def worker(rank, nproc, cfg, requested):
    # rank 0 dies of the Ctrl-C, as a rank still in the spawn's bootstrap does (a KeyboardInterrupt there);
    # rank 1 does not see it, as a rank blocked in its rendezvous (C++) waiting for rank 0 does not
    signal.signal(signal.SIGINT, signal.SIG_DFL if rank == 0 else signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    sys.exit(ddp_training.spawn_local(2, {{}}, worker=worker))
"""


def test_a_rank_dead_of_ctrl_c_in_its_bootstrap_ends_its_peers_at_once(tmp_path):
    """Under load a Ctrl-C killed one rank in the spawn's bootstrap (death by SIGINT, which was not taken for
    a death of the stop) while its peer waited for it in the rendezvous: 30 s of grace, then a SIGTERM that the
    peer took for a preemption, and 20 s later exit 75 with a PREEMPTED marker in a run that trained nothing
    (a README audit). Its peers are now ended at once, and the run exits 130."""
    script = tmp_path / "two_ranks.py"
    script.write_text(CTRL_C_IN_ONE_RANKS_BOOTSTRAP.format(repo=str(REPO)))
    with background([sys.executable, script], tmp_path, env=nproc_env()) as proc:
        ready = 0
        while ready < 2:  # other lines (a warning of an import) may come first
            line = proc.stdout.readline()
            assert line, "the ranks ended before they were ready"
            ready += line.strip() == "ready"
        start = time.time()
        proc.send_signal(signal.SIGINT)  # to the parent, which passes it on
        out, _ = proc.communicate(timeout=60)
        took = time.time() - start
    assert proc.returncode == 128 + signal.SIGINT and rt.CTRL_C_BEFORE_TRAINING in out, out[-3000:]
    assert took < 20, f"{took:.1f} s: the peer was given the 30 s grace"


def torch_is_loading(pid: int) -> bool:
    """Whether the process has begun to import torch (its shared library is mapped), so that it is past its
    first lines and the import has seconds left."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def wait_until(proc, ready, what: str) -> None:
    deadline = time.time() + 60
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"the run ended before {what}"


def in_set_up(log_dir: Path) -> bool:
    """The run's logger is attached (its first line is in rank_0.log): a Ctrl-C from here on is logged there.
    The file alone exists a moment before, and a Ctrl-C in that moment has no log to go to."""
    try:
        return "local_rank" in (log_dir / "rank_0.log").read_text()
    except OSError:
        return False


SLOW_SET_UP = ["--cpu", "--max_steps", "2", "--log_dir", "logs", "--checkpoint_dir", "ckpt", "--dataset_size", "400000"]


@pytest.mark.parametrize("script", ["ddp_training.py", "vj2ac_train_multi_gpu.py"])
def test_ctrl_c_while_torch_is_imported_is_one_line_and_death_by_sigint(tmp_path, script):
    """Ctrl-C in a script's first seconds (importing torch) printed the import machinery's traceback; it is
    one line now, and the process still dies of SIGINT as Python's own Ctrl-C exit does (a shell or launcher
    sees a Ctrl-C, not an error)."""
    with background([sys.executable, REPO / script, "--cpu", "--test"], tmp_path, stderr=subprocess.PIPE) as proc:
        wait_until(proc, lambda: torch_is_loading(proc.pid), "torch's import")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, err
    assert err == "stopped by Ctrl-C while starting: nothing ran\n" and not list(tmp_path.iterdir()), err


def test_ctrl_c_in_the_set_up_of_one_process_is_one_line_a_log_warning_and_a_stopped_run(tmp_path):
    """A Ctrl-C in set-up (making and hashing a large dataset) was a KeyboardInterrupt traceback on the console
    and 'trainer set-up failed' with it in rank_0.log, which training_logs read as a failure."""
    import training_logs
    with background([sys.executable, REPO / "ddp_training.py", *SLOW_SET_UP], tmp_path, stderr=subprocess.PIPE) as proc:
        wait_until(proc, lambda: in_set_up(tmp_path / "logs"), "its set-up")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, err
    assert err.splitlines()[-1] == rt.CTRL_C_BEFORE_TRAINING and "Traceback" not in err, err
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert f"WARNING: {rt.CTRL_C_BEFORE_TRAINING}" in log and "Traceback" not in log and "ERROR" not in log, log
    row = training_logs.summarize(training_logs.load_runs([str(tmp_path / "logs")])[0])
    assert row["status"] == "stopped in set-up" and not row.get("error"), row


@pytest.mark.parametrize("when", ["importing-torch", "in-set-up"])
def test_ctrl_c_with_stderr_gone_still_ends_the_process(tmp_path, when):
    """`python ddp_training.py 2>&1 | tee log`: the Ctrl-C ends tee too, and the line written before the death
    by SIGINT raised BrokenPipeError, which turned the death into exit 1 (a shell loop went on)."""
    with background([sys.executable, REPO / "ddp_training.py", *SLOW_SET_UP], tmp_path, stderr=subprocess.PIPE,
                    stdout=subprocess.DEVNULL) as proc:
        if when == "importing-torch":
            wait_until(proc, lambda: torch_is_loading(proc.pid), "torch's import")
        else:
            wait_until(proc, lambda: in_set_up(tmp_path / "logs"), "its set-up")
        proc.stderr.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGINT


def test_a_ctrl_c_the_shell_ignores_stays_ignored(tmp_path):
    """Bash starts a non-interactive script's background jobs with SIGINT ignored (a sweep's `cmd &`): a Ctrl-C
    to the terminal is then not theirs, in the imports, in set-up (as Python leaves it) and in training (the
    stop handler replaced it there, and the run stopped with exit 75)."""
    # it trains to the end: small validation and test sets (400000 x 0.1 each took a minute to evaluate)
    cmd = [sys.executable, REPO / "ddp_training.py", *SLOW_SET_UP, "--val_fraction", "0.001", "--test_fraction", "0.001",
           "--max_steps", "30"]
    with background(cmd, tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) as proc:
        wait_until(proc, lambda: torch_is_loading(proc.pid), "torch's import")
        proc.send_signal(signal.SIGINT)
        wait_until(proc, lambda: in_set_up(tmp_path / "logs"), "its set-up")
        proc.send_signal(signal.SIGINT)
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 2, timeout=120)
        proc.send_signal(signal.SIGINT)  # and in training (the stop handler took it over there)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and (tmp_path / "logs" / "COMPLETED").exists(), out[-3000:]
    assert "stop signal received" not in out, out[-3000:]
    # and it says so, with what stops it (a Ctrl-C that does nothing looks like a hang)
    assert f"Ctrl-C is ignored in this process (started in the background by a shell script): kill -TERM {proc.pid} " \
           f"stops the run with a save" in out, out[-3000:]


@pytest.mark.multi
def test_nproc_ranks_that_inherit_an_ignored_ctrl_c_still_stop_when_their_parent_dies(tmp_path):
    """torch's spawn has a rank's parent's death send it SIGINT; a rank that inherited SIGINT ignored (`cmd &`
    in a script) trained on as an orphan when its parent was killed (the OOM killer), holding the run dirs."""
    cmd = [sys.executable, REPO / "ddp_training.py", "--cpu", "--nproc", "2", "--test", "--max_steps", "100000",
           "--val_interval", "0", "--log_interval", "1", "--log_dir", "logs", "--checkpoint_dir", "ckpt"]
    with background(cmd, tmp_path, env=nproc_env(),
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) as proc:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 3, timeout=90)
        ranks = [p for p in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(ranks) == 2
        proc.kill()
        deadline = time.time() + 60
        while any(still_running(p) for p in ranks) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(still_running(p) for p in ranks), "the ranks train on without their parent"
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "stop signal received (SIGTERM" in log, log[-3000:]  # a stop: it saved


def still_running(p: psutil.Process) -> bool:
    """Still running: an orphan that ended may stay a zombie until whoever adopted it reaps it."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_ctrl_c_passed_on_before_a_rank_had_its_handler_stops_its_set_up_at_once(tmp_path):
    """spawn_local notes the signals it passes on, for a rank that lost them between its fork and its exec.
    A Ctrl-C noted there is a KeyboardInterrupt before set-up (exit 130), not a stop that trains a step."""
    import ddp_training
    built = []
    with pytest.raises(KeyboardInterrupt):
        ddp_training.train_preemptible(lambda: built.append(1), tmp_path, types.SimpleNamespace(value=signal.SIGINT))
    assert built == [] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


class _TrainsAtOnce:
    def train(self, stop_signal):  # as DDPTrainer.train: Ctrl-C is a stop too while it trains
        stop_signal.install(rt.StopSignal.SIGNALS)
        return {"status": "completed"}


def test_a_script_keeps_its_stop_handlers_from_the_end_of_training_until_it_exits(tmp_path, monkeypatch,
                                                                                   stop_handlers):
    """A Ctrl-C between train() returning and the process exiting was Python's KeyboardInterrupt again: an
    --nproc rank exited 130, and its parent said "before any training step" of a run that had finished.
    A script's process keeps its handlers: the stop is noted, the run's outcome stands."""
    import ddp_training
    monkeypatch.setattr(rt, "_main_ends_the_process", True)  # as rt.run_script and an --nproc rank set it
    assert ddp_training.train_preemptible(_TrainsAtOnce, tmp_path) == 0
    stops_change_nothing(signal.SIGINT, signal.SIGTERM, after="train() returned")  # SIGTERM: no death either
    for sig, handler in stop_handlers.items():
        signal.signal(sig, handler)
    # a caller that goes on (a notebook, a test calling a script's main()) gets its own handlers back
    monkeypatch.setattr(rt, "_main_ends_the_process", False)
    assert ddp_training.train_preemptible(_TrainsAtOnce, tmp_path) == 0
    assert {sig: signal.getsignal(sig) for sig in STOPS} == stop_handlers


_CTRL_C_DROPPED_IN_BUILD = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
import ddp_training
cfg = {{"max_steps": 2, "hidden_size": 16, "num_layers": 1, "dataset_size": 256, "device": "cpu",
       "log_dir": {log!r}, "checkpoint_dir": {ckpt!r}}}

def build():
    trainer = ddp_training.DDPTrainer(config=cfg)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        pass  # dropped, as Python drops one raised in a __del__
    return trainer

try:
    ddp_training.train_preemptible(build, cfg["log_dir"])
except KeyboardInterrupt:
    print("interrupted", flush=True)
print(ddp_training.DDPTrainer(config=cfg).train()["status"])
"""


def test_a_ctrl_c_seen_after_the_trainer_was_built_lets_go_of_its_run_dirs(tmp_path):
    """The set-up watch raises KeyboardInterrupt when set-up ends after a Ctrl-C that Python dropped; the
    trainer built by then held the run dirs' lock, and nothing closed it."""
    code = _CTRL_C_DROPPED_IN_BUILD.format(repo=str(REPO), log=str(tmp_path / "logs"), ckpt=str(tmp_path / "ckpt"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean_env())
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "interrupted" in lines and lines[-1] == "completed", r.stdout + r.stderr


@pytest.mark.multi
def test_launcher_cpu_test_end_to_end(tmp_path):
    env = clean_env(PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    t0 = time.time()
    r = run(["bash", REPO / "launch_training.sh", "--cpu", "--test", "--debug", "--script",
             REPO / "ddp_training.py", "-l", "logs", "-c", "ckpt"], cwd=tmp_path, timeout=120, env=env)
    assert time.time() - t0 < 120
    check_two_rank_run(tmp_path, r)
    assert "--nproc_per_node 2" in r.stdout
    assert "[RANK 1] DEBUG" in r.stdout  # --debug reached the script: every rank logs to the console


def test_launcher_syntax_help_and_errors(tmp_path):
    assert subprocess.run(["bash", "-n", REPO / "launch_training.sh"]).returncode == 0
    env = clean_env(PATH="/usr/bin:/bin")  # no nvidia-smi: zero GPUs
    launcher = ["bash", REPO / "launch_training.sh"]
    r = run(launcher + ["--help"], cwd=tmp_path, env=env)
    assert r.returncode == 0 and "--max-restarts" in r.stdout
    for argv, message in [(["--bogus"], "unknown option '--bogus' (see --help; the training script's flags go after --)"),
                          (["--gpus", "99"], "GPU 99 does not exist"),
                          (["--gpus", "x,0"], "'x' is not a GPU id"),
                          (["--cpu", "--nproc", "two"], "--nproc expects a non-negative integer"),
                          (["--cpu", "-b"], "option -b needs a value"),
                          (["--script", "missing.py"], "--script 'missing.py' does not exist"),
                          (["--nnodes", "2"], "needs --master-addr")]:
        r = run(launcher + argv, cwd=REPO, env=env)
        assert r.returncode == 2 and message in r.stdout, (argv, r.stdout)
    # a PYTHON without torch (a venv not activated): said before anything starts
    (tmp_path / "python").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "python").chmod(0o755)
    r = run(launcher + ["--cpu"], cwd=REPO, env={**env, "PYTHON": str(tmp_path / "python")})
    assert r.returncode == 2 and f"PYTHON={tmp_path / 'python'} cannot import torch" in r.stdout, r.stdout
    # PYTHON unset, no torchrun on PATH and a python3 without torch
    (tmp_path / "py3").mkdir()
    os.symlink(tmp_path / "python", tmp_path / "py3" / "python3")
    r = run(launcher + ["--cpu"], cwd=REPO, env={**env, "PATH": f"{tmp_path / 'py3'}:/usr/bin:/bin"})
    assert r.returncode == 2 and "no torchrun on PATH, and python3 cannot import torch" in r.stdout, r.stdout
    r = run(launcher + ["--gpus", "0"], cwd=REPO, env={**env, "PYTHON": str(tmp_path / "python")})
    assert r.returncode == 2 and f"no nvidia-smi, and {tmp_path / 'python'} cannot import torch to count the " \
                                 f"GPUs: none counted" in r.stdout and "GPU 0 does not exist" in r.stdout, r.stdout
    # Four GPUs on the node, two given to this job: --gpus counts within the two.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nprintf '0\\n1\\n2\\n3\\n'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = clean_env(PATH=f"{fake}:/usr/bin:/bin", CUDA_VISIBLE_DEVICES="2,3")
    r = run(launcher + ["--gpus", "0,2"], cwd=REPO, env=env)
    assert r.returncode == 2 and "GPU 2 does not exist (2 GPU(s) visible)" in r.stdout, r.stdout
    (tmp_path / "show.py").write_text("import os\nprint('visible:', os.environ['CUDA_VISIBLE_DEVICES'])\n")
    env["PATH"] = f"{fake}:{Path(sys.executable).parent}:/usr/bin:/bin"
    r = run(launcher + ["--gpus", "1", "--script", tmp_path / "show.py"], cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 0 and "visible: 3" in r.stdout, r.stdout


@pytest.mark.multi
def test_sigterm_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    cmd = torchrun(2, "ddp_training.py", "--cpu", "--test", "--max_steps", "100000", "--val_interval", "0",
                   "--log_dir", "logs", "--checkpoint_dir", "ckpt")
    with background(cmd, tmp_path) as agent:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 5)
        workers = torchrun_workers(agent)
        assert set(workers) == {0, 1}, "workers not found"
        workers[1].send_signal(signal.SIGTERM)  # only rank 1 sees the signal
        agent.communicate(timeout=60)
    marker = json.loads((tmp_path / "logs" / "PREEMPTED").read_text())
    saved = torch.load(tmp_path / "ckpt" / "model_interrupted.pt", weights_only=True)
    assert saved["global_step"] == marker["step"] > 5
    for rank in (0, 1):
        text = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
        assert f"saving and exiting at step {marker['step']}" in text
    assert agent.returncode != 0  # torchrun reports a stopped group as failed; the marker says why


def test_sigterm_on_a_plain_run_exits_with_the_preempted_code(tmp_path):
    cmd = [sys.executable, REPO / "ddp_training.py", "--cpu", "--test", "--max_steps", "100000",
           "--val_interval", "0", "--log_dir", "logs", "--checkpoint_dir", "ckpt"]
    with background(cmd, tmp_path, stdout=subprocess.DEVNULL) as proc:
        wait_for_step(tmp_path / "logs" / "metrics.jsonl", 3, timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == rt.EXIT_PREEMPTED
    step = json.loads((tmp_path / "logs" / "PREEMPTED").read_text())["step"]
    assert (tmp_path / "ckpt" / f"model_state_step_{step}.pt").exists()


def _wait_for_listener(port: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    pytest.fail(f"nothing listened on port {port} within {timeout}s")


@pytest.mark.multi
@pytest.mark.parametrize("script", ["ddp_training.py", "vj2ac_train_multi_gpu.py"])
def test_sigterm_during_set_up_stops_at_the_first_step_with_a_save(tmp_path, script):
    """Rank 0 gets SIGTERM while it waits in the rendezvous for rank 1 (set-up: no step yet). It must not
    die there: both ranks set up, agree on the stop at the first step, save, write the marker, exit 75."""
    port = free_ports(1)[0]
    if script == "ddp_training.py":
        args = ["--cpu", "--test", "--log_dir", "logs", "--checkpoint_dir", "ckpt"]
    else:
        data = make_vj2_data(tmp_path / "data", 1, 16, 4)
        args = ["--device", "cpu", "--dist-backend", "gloo", "--processed_data_dir", data / "train",
                "--validation_data_dir", data / "val", "--batch_size", "4", "--max_steps", "20",
                "--checkpoint_dir", "logs"]
    cmd = [sys.executable, REPO / script, *args, "--dist_timeout", "60"]
    ranks = [clean_env(RANK=r, WORLD_SIZE=2, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       SETUP_STOP_GRACE_S=SLOW_SET_UP_GRACE) for r in (0, 1)]
    with background(cmd, tmp_path, env=ranks[0]) as rank0:
        _wait_for_listener(port, 60)  # rank 0 holds the rendezvous store: it is inside set-up
        rank0.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert rank0.poll() is None, "rank 0 died of a signal during set-up"
        with background(cmd, tmp_path, env=ranks[1]) as rank1:
            out1, _ = rank1.communicate(timeout=120)
        out0, _ = rank0.communicate(timeout=60)
    assert (rank0.returncode, rank1.returncode) == (75, 75), (out0[-3000:], out1[-3000:])
    marker = json.loads((tmp_path / "logs" / "PREEMPTED").read_text())
    assert marker["step"] == 1
    for rank, who in ((0, "SIGTERM here"), (1, "by another rank")):
        text = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
        assert f"stop signal received ({who}): saving and exiting at step 1" in text
    ckpt = tmp_path / ("ckpt" if script == "ddp_training.py" else "logs")
    assert len(list(ckpt.glob("*_state_step_1.pt"))) == 1


@pytest.mark.multi
def test_a_stop_while_waiting_for_a_peer_that_never_comes_ends_set_up_after_the_grace(tmp_path):
    """Rank 1 died before it joined (killed while importing torch on a slow file system): rank 0 waits in
    the rendezvous, which no Python handler can interrupt, until dist_timeout. A stop signal must end that
    wait within the grace (SETUP_STOP_GRACE_S; 5 s here, through the variable), with exit 75 and a PREEMPTED
    marker that says nothing was trained. Both trainers at once (their own ports and dirs): one wait."""
    GRACE = 5
    data = make_vj2_data(tmp_path / "data", 1, 16, 4)
    commands = {"ddp_training.py": ["--cpu", "--test"],
                "vj2ac_train_multi_gpu.py": ["--device", "cpu", "--dist-backend", "gloo", "--processed_data_dir",
                                             data / "train", "--validation_data_dir", data / "val"]}
    ports = free_ports(len(commands))
    with contextlib.ExitStack() as stack:
        procs = {}
        for (script, args), port in zip(commands.items(), ports):
            run_dir = tmp_path / script
            dirs = (["--log_dir", run_dir, "--checkpoint_dir", run_dir / "ckpt"] if script == "ddp_training.py"
                    else ["--checkpoint_dir", run_dir])
            env = clean_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                            SETUP_STOP_GRACE_S=GRACE)
            procs[script] = stack.enter_context(background([sys.executable, REPO / script, *args, *dirs,
                                                            "--dist_timeout", "600"], tmp_path, env=env))
        for port in ports:
            _wait_for_listener(port, 90)  # in the rendezvous
        t0 = time.monotonic()
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        outs = {script: proc.communicate(timeout=GRACE + 60)[0] for script, proc in procs.items()}
        waited = time.monotonic() - t0
    for script, proc in procs.items():
        assert proc.returncode == rt.EXIT_PREEMPTED, outs[script][-3000:]
        assert f"SIGTERM {GRACE}s ago and set-up has not finished" in outs[script]
        marker = json.loads((tmp_path / script / "PREEMPTED").read_text())
        assert marker == {"step": None, "signal": "SIGTERM", "stopped_during": "set-up"}
        assert not list((tmp_path / script).rglob("*.pt"))
    assert GRACE <= waited < GRACE + 30


@pytest.mark.multi
def test_a_second_sigterm_ends_a_rank_stuck_in_set_up_at_once(tmp_path):
    """A rank blocked in C++ (here: a rendezvous whose peer never comes) runs no Python signal handler; the
    first SIGTERM is kept for the first step, a second one must end it now, not after dist_timeout."""
    port = free_ports(1)[0]
    env = clean_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    cmd = [sys.executable, REPO / "ddp_training.py", "--cpu", "--test", "--log_dir", "logs", "--dist_timeout", "120"]
    with background(cmd, tmp_path, env=env) as rank0:
        _wait_for_listener(port, 60)
        rank0.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert rank0.poll() is None, "the first SIGTERM must not end set-up"
        t0 = time.time()
        rank0.send_signal(signal.SIGTERM)
        out, _ = rank0.communicate(timeout=30)
    assert rank0.returncode == 128 + signal.SIGTERM and time.time() - t0 < 10, out[-2000:]
    assert "second SIGTERM during set-up: exiting at once" in out



@pytest.mark.multi
def test_a_rank_that_does_not_arrive_ends_set_up_with_one_error_line_naming_it(tmp_path):
    """A peer that never reached set-up ended the rank waiting for it with torch's DistStoreError traceback,
    which names a store key. Now: one `error:` line naming the missing rank, the timeout and its flag, exit 1
    (a failure, not bad input), and the detail in rank_N.log. On a launcher's store (torchrun's, --nproc's)
    rank 0 waits for rank 1, which comes after rank 0 gave up and says that it was the late one; with rank 0
    hosting the rendezvous itself (plain env://), rank 0 can only count who connected."""
    import ddp_training
    store = ddp_training.rendezvous_store(0)  # what an --nproc parent or torchrun's agent holds
    agent = dict(WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=store.port, TORCHELASTIC_USE_AGENT_STORE="True")
    hosted = dict(WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_ports(1)[0])
    said = {}
    for name, rank, launch in (("agent", 0, agent), ("agent", 1, agent), ("hosted", 0, hosted)):
        error_file = tmp_path / f"torchrun_error_{name}_{rank}.json"  # where torchrun's summary reads a reason
        env = clean_env(RANK=rank, LOCAL_RANK=rank, TORCHELASTIC_ERROR_FILE=error_file, **launch)
        code, out = run_script_forked("ddp_training", ["--cpu", "--test", "--dist_timeout", "2", "--log_dir",
                                                       tmp_path / name], tmp_path, env)
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert code == 1 and len(errors) == 1 and "Traceback" not in out, out
        said[name, rank] = errors[0][len("error: "):]
        assert said[name, rank].startswith(f"rank {rank}: set-up timed out after 2s: "), out
        assert "--dist_timeout" in said[name, rank], out
        log = (tmp_path / name / f"rank_{rank}.log").read_text()
        assert f"set-up failed: {said[name, rank]}" in log and "Traceback" in log, log
        reason = json.loads(error_file.read_text())["message"]  # a failure, not a refusal: the launcher keeps 1
        assert reason["message"] == errors[0] and "refused" not in reason["extraInfo"], reason
    assert "rank(s) 1 of 2 did not arrive" in said["agent", 0]
    assert "this rank arrived after rank(s) 0 gave up waiting for the others" in said["agent", 1]
    assert "only 1 of 2 ranks (this one included) connected to the rendezvous" in said["hosted", 0]


# -- a real corpus ----------------------------------------------------------------------------

def write_text_corpus(path: Path, n_bytes: int = 300_000, seed: int = 0) -> None:
    """English-like text: sentences over a small vocabulary, so bytes are predictable from context."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
             "every boxing match in distant northern towns before dinner").split()
    parts, size = [], 0
    while size < n_bytes:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + ". "
        parts.append(sentence)
        size += len(sentence)
    path.write_text("".join(parts))


def test_real_text_file_beats_its_unigram_entropy(tmp_path, no_launch_env):
    corpus = tmp_path / "corpus.txt"
    write_text_corpus(corpus)
    s = DDPTrainer(config={**QUICK, **dirs(tmp_path), "data": str(corpus), "seq_len": 64, "hidden_size": 64,
                           "num_heads": 4, "max_steps": 200, "val_interval": 100, "learning_rate": 3e-3,
                           "warmup_steps": 10}).train()
    assert s["unigram_entropy"] > 2.0
    # "Well below": at most 60% of the unigram entropy after 200 steps.
    assert s["final_val_loss"] < 0.6 * s["unigram_entropy"], s


def test_bad_data_file_is_a_clear_error(tmp_path, no_launch_env):
    import numpy as np
    np.save(tmp_path / "floats.npy", np.zeros(100, dtype=np.float32))
    with pytest.raises(ValueError, match="floats.npy: expected a 1-D integer array"):
        DDPTrainer(config={**QUICK, **dirs(tmp_path), "data": str(tmp_path / "floats.npy")})
    with pytest.raises(FileNotFoundError, match="no such file"):
        DDPTrainer(config={**QUICK, **dirs(tmp_path), "data": str(tmp_path / "missing.txt")})
    bad = {"ids.npz": "a zip archive \\(.npz\\?\\); expected a .npy array of token ids",
           "text.npy": "named .npy but not a NumPy array file",
           "objects.npy": "cannot map it as a token array",
           "huge.npy": f"token id 1000000000 implies a vocabulary of 1000000001; expected ids below {2 ** 20}",
           "folder": "is a directory; expected a .npy token file or a text file"}
    np.savez(tmp_path / "ids.npz", tokens=np.arange(100))
    (tmp_path / "text.npy").write_text("hello world " * 100)
    with open(tmp_path / "objects.npy", "wb") as f:  # a header declaring Python objects; no pickle written
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": (2,)})
        f.write(b"\0" * 16)
    np.save(tmp_path / "huge.npy", np.array([1, 10 ** 9, 3] * 100))
    (tmp_path / "folder").mkdir()
    for name, message in bad.items():
        with pytest.raises(ValueError, match=f"--data .*{name}: {message}"):
            DDPTrainer(config={**QUICK, **dirs(tmp_path), "data": str(tmp_path / name)})
    # a .npy array is known by its contents, not by the case of its name
    np.save(tmp_path / "upper.npy", np.arange(64 * 40) % 64)
    (tmp_path / "upper.npy").rename(tmp_path / "TOKENS.NPY")
    t = DDPTrainer(config={**QUICK, **dirs(tmp_path), "data": str(tmp_path / "TOKENS.NPY")})
    assert isinstance(t.train_loader.dataset.tokens, np.memmap) and t.raw_model.config["vocab_size"] == 64


def test_npy_token_file_is_memory_mapped_and_trains(tmp_path, no_launch_env):
    import numpy as np
    corpus = tmp_path / "c.txt"
    write_text_corpus(corpus, 100_000)
    np.save(tmp_path / "tokens.npy", np.frombuffer(corpus.read_bytes(), dtype=np.uint8).astype(np.int32))
    t = DDPTrainer(config={**QUICK, **dirs(tmp_path), "data": str(tmp_path / "tokens.npy"), "max_steps": 30})
    assert isinstance(t.train_loader.dataset.tokens, np.memmap)
    assert t.raw_model.config["vocab_size"] == max(64, int(np.frombuffer(corpus.read_bytes(), np.uint8).max()) + 1)
    s = t.train()
    assert s["final_val_loss"] < s["unigram_entropy"]


# -- the VJ2 (V-JEPA 2-AC) pipeline: data, 1 rank, 2 ranks ----------------------------------

@pytest.fixture(scope="module")
def vj2_data(tmp_path_factory):
    return make_vj2_data(tmp_path_factory.mktemp("vj2"), 2, 64, 16)


def vj2_args(root, run, *extra):
    return ["--device", "cpu", "--processed_data_dir", root / "train", "--validation_data_dir", root / "val",
            "--batch_size", "8", "--max_steps", "40", "--val_every_iters", "20", "--save_every_iters", "20",
            "--checkpoint_dir", run, *extra]


def check_vj2_run(run: Path, world_size: int):
    records = metrics(run)
    val = [r["val_loss"] for r in records if r["type"] == "val"]
    first = [r["loss"] for r in records if r["type"] == "train"][0]
    summary = records[-1]
    assert summary["type"] == "summary" and summary["world_size"] == world_size and summary["steps"] == 40
    assert val[-1] < 0.8 * first, (first, val)  # the predictor learns: loss down by over 20% in 40 steps
    ckpt = torch.load(run / "vjepa2_final.pt", weights_only=True)
    assert set(ckpt) == {"predictor", "global_step", "val_loss", "predictor_config", "rollout_horizon",
                         "data_geometry"}
    assert ckpt["global_step"] == 40 and not any(k.startswith("module.") for k in ckpt["predictor"])


def test_vj2_pipeline_one_rank(tmp_path, vj2_data):
    r = run([sys.executable, REPO / "vj2ac_train_multi_gpu.py", *vj2_args(vj2_data, tmp_path / "run")],
            cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout[-4000:]
    check_vj2_run(tmp_path / "run", 1)


@pytest.mark.multi
def test_vj2_pipeline_two_ranks(tmp_path, vj2_data):
    r = run(torchrun(2, "vj2ac_train_multi_gpu.py", *vj2_args(vj2_data, tmp_path / "run", "--dist-backend", "gloo")),
            cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout[-4000:]
    check_vj2_run(tmp_path / "run", 2)


# -- run directories, progress bar, TensorBoard -----------------------------------------

def test_default_run_dir_layout(tmp_path, no_launch_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    DDPTrainer(config={**QUICK, "max_steps": 4, "val_interval": 2, "run_name": "exp1"}).train()
    run_dir = tmp_path / "runs" / "exp1"
    assert {"config.yaml", "metrics.jsonl", "rank_0.log", "checkpoints"} <= {p.name for p in run_dir.iterdir()}
    assert (run_dir / "checkpoints" / "model_final.pt").exists()
    # checkpoints kept elsewhere are linked from the run dir
    DDPTrainer(config={**QUICK, "max_steps": 2, "run_name": "exp2", "checkpoint_dir": "elsewhere"}).train()
    link = tmp_path / "runs" / "exp2" / "checkpoints"
    assert link.is_symlink() and link.resolve() == (tmp_path / "elsewhere").resolve()


def run_on_a_terminal(args, cwd, columns) -> tuple:
    """(exit status, what it showed) of a command whose stdin, stdout and stderr are a pseudo-terminal `columns`
    wide (None: a pty nobody sized, 0 x 0)."""
    import fcntl
    import pty
    import struct
    import termios
    try:
        controller, worker = pty.openpty()
    except OSError as exc:
        pytest.skip(f"no pseudo-terminal here: {exc}")
    if columns is not None:
        fcntl.ioctl(worker, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(args, cwd=cwd, env=clean_env(), stdin=worker, stdout=worker, stderr=worker,
                            start_new_session=True)
    os.close(worker)
    chunks, deadline = [], time.time() + 120
    try:
        while time.time() < deadline:  # a hung child fails the test instead of blocking the read forever
            if not select.select([controller], [], [], 1.0)[0]:
                continue
            try:
                data = os.read(controller, 4096)
            except OSError:  # EIO: the child's side has closed
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(controller)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_progress_bar_only_on_a_terminal(tmp_path):
    args = [sys.executable, str(REPO / "ddp_training.py"), "--cpu", "--test", "--max_steps", "12",
            "--log_dir", "logs", "--checkpoint_dir", "ckpt", "--resume", "none"]
    plain = run(args, cwd=tmp_path, timeout=120)
    assert plain.returncode == 0 and "step/s" not in plain.stdout and "it/s" not in plain.stdout
    assert "step 10/12" in plain.stdout  # plain periodic lines instead
    code, shown = run_on_a_terminal(args, tmp_path, columns=160)
    assert code == 0 and "12/12" in shown and "loss=" in shown and "samples_s=" in shown
    assert "step 10/12" not in shown  # the bar replaces the periodic console lines...
    assert "step 10/12" in (tmp_path / "logs" / "rank_0.log").read_text()  # ...which still reach the log
    assert "validation at step 12" in shown and "loss floor" in shown and "finished (completed)" in shown


def test_tensorboard_writes_the_same_scalars(tmp_path, no_launch_env, monkeypatch):
    import types
    written = []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def close(self):
            written.append("closed")
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    def two_rates(groups):  # the groups' own rates (metrics' lrs) come as one curve each
        return torch.optim.AdamW([groups[0], dict(groups[1], lr=groups[1]["lr"] * 10)])
    DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 3, "tensorboard": True}, optimizer=two_rates).train()
    scalars = [w for w in written if w != "closed"]
    train = metrics(tmp_path / "logs", "train")
    assert [(s, v) for t, v, s in scalars if t == "train/loss"] == [(r["step"], r["loss"]) for r in train]
    for group in (0, 1):
        assert [(s, v) for t, v, s in scalars if t == f"train/lr_group_{group}"] == \
            [(r["step"], r["lrs"][group]) for r in train]
    assert written[-1] == "closed"


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-multi", action="store_true", help="skip tests that start several processes")
    parser.add_argument("--keep-data", action="store_true",
                        help="keep the generated data and run directories (printed at the end)")
    opts, rest = parser.parse_known_args()
    pytest_args = [__file__, "-q", "-p", "no:cacheprovider"] + rest
    if opts.skip_multi:
        pytest_args += ["-m", "not multi"]
    if opts.keep_data:
        pytest_args += ["--basetemp", str(Path("test_training_data").resolve())]
    code = pytest.main(pytest_args)
    if opts.keep_data:
        print(f"data and run directories kept under {Path('test_training_data').resolve()}")
    sys.exit(code)


# -- the console: a progress bar on a terminal, periodic lines elsewhere ------------------------------------

class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_bar_shows_the_numbers_of_the_step_it_counts(tmp_path, no_launch_env, monkeypatch):
    """The bar was drawn by update() before set_postfix() gave it the step's numbers: every drawing showed
    step N's count with step N-1's loss, learning rate and rate (a user's pty)."""
    import tqdm

    class EveryStep(tqdm.tqdm):  # draws at every update, as a slow step would
        def __init__(self, *args, **kwargs):
            super().__init__(*args, mininterval=0, miniters=1, **kwargs)
    monkeypatch.setattr(tqdm, "tqdm", EveryStep)
    monkeypatch.setattr(sys, "stdout", _Terminal())
    DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 6, "val_interval": 0}).train()
    frames = re.findall(r"(\d)/6 [^\r\n]*loss=([\d.]+), lr=([\d.e+-]+)", sys.stdout.getvalue())
    train = {r["step"]: r for r in metrics(tmp_path / "logs", "train")}
    assert {int(n) for n, _, _ in frames} == set(range(1, 7)), sys.stdout.getvalue()
    for n, loss, lr in frames:
        assert (loss, lr) == (f"{train[int(n)]['loss']:.4f}", f"{train[int(n)]['lr']:.2e}"), n


def test_a_terminal_of_no_width_gets_the_periodic_lines(tmp_path):
    """A pty whose size nobody set (some containers and CI runners) is 0 columns wide: the bar drew nothing
    there, and it had replaced the periodic step lines, so a run showed no progress at all."""
    cmd = [sys.executable, REPO / "ddp_training.py", "--cpu", "--max_steps", "4", "--log_interval", "2",
           "--hidden_size", "16", "--num_layers", "1", "--dataset_size", "256", "--log_dir", "logs",
           "--checkpoint_dir", "ckpt"]
    code, text = run_on_a_terminal(cmd, tmp_path, columns=None)
    assert code == 0, text
    assert re.search(r"step 2/4 loss [\d.]+", text) and re.search(r"step 4/4 loss [\d.]+", text), text


@pytest.mark.multi
def test_the_torch_distributed_launch_of_older_scripts_runs_the_lm(tmp_path):
    """`python -m torch.distributed.launch` (reference 001's option 3) passes --local-rank=N to each worker:
    the LM script refused it as an unknown argument, where the VJ2 script took it."""
    port = free_ports(1)[0]
    r = run([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2", f"--master_port={port}",
             REPO / "ddp_training.py", "--cpu", "--max_steps", "3", "--hidden_size", "16", "--num_layers", "1",
             "--dataset_size", "256", "--log_dir", "logs", "--checkpoint_dir", "ckpt"], tmp_path, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    summary = metrics(tmp_path / "logs", "summary")[-1]
    assert (summary["status"], summary["steps"], summary["world_size"]) == ("completed", 3, 2)


# -- found by mutation testing of 27 Nov ------------------------------------------------------------

def test_run_script_and_an_nproc_rank_say_their_main_ends_the_process(monkeypatch):
    """Both set the flag that keeps their stop handlers to the exit (found by mutation testing)."""
    import ddp_training
    monkeypatch.setattr(rt, "_main_ends_the_process", False)
    exits, seen = [], []
    monkeypatch.setattr(rt, "exit_process", exits.append)
    rt.run_script(lambda: seen.append(rt.main_ends_the_process()) or 3)
    monkeypatch.setattr(rt, "_main_ends_the_process", False)
    monkeypatch.setattr(ddp_training, "_train_and_exit_code",
                        lambda *a, **k: seen.append(rt.main_ends_the_process()) or 0)
    ddp_training._spawned_worker(0, 1, {})
    assert seen == [True, True] and exits == [3, 0]


def test_init_from_refuses_weights_under_two_leading_names(tmp_path, no_launch_env):
    cfg = {**QUICK, **dirs(tmp_path), "max_steps": 2}
    own = CausalLM(64, 32, 2, 2, 32).state_dict()  # QUICK's model
    mixed = {**{f"model.{k}": v for k, v in own.items()}, **{f"ema.{k}": torch.zeros_like(v) for k, v in own.items()}}
    torch.save({"state_dict": mixed}, tmp_path / "two.pt")
    with pytest.raises(ValueError, match="do not fit this model"):
        DDPTrainer(config={**cfg, "init_from": str(tmp_path / "two.pt")})


def test_a_hyphenated_flag_is_told_its_underscored_spelling(capsys):
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--warmup-steps", "5"])
    assert "--warmup-steps (did you mean --warmup_steps?)" in capsys.readouterr().err


def test_the_trainers_lock_note_names_its_pid_namespace(tmp_path, no_launch_env):
    trainer = DDPTrainer(config={**QUICK, **dirs(tmp_path), "max_steps": 1})
    try:
        import training_logs as tl
        note = (tmp_path / "logs" / ".lock").read_text().strip()
        assert note.startswith(f"pid {os.getpid()} on ") and note.endswith(f" [{tl.pid_namespace()}]"), note
    finally:
        trainer.close()


def _built_under_a_launcher(rank, world_size, root):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")  # as torchrun --nproc_per_node 1 sets them
    DDPTrainer(config={**QUICK, **dirs(Path(root)), "max_steps": 1}).close()
    return "started by multiprocessing" in (Path(root) / "logs" / "rank_0.log").read_text()


@pytest.mark.multi
def test_a_process_a_launcher_names_is_not_warned_as_an_unnamed_rank(tmp_path):
    assert spawn(_built_under_a_launcher, 1, str(tmp_path), timeout=120) == [False]

