"""GPU paths (pytest -m gpu) that behave differently on CUDA than on the CPU, where the CPU suite cannot see a bug:
every tensor there is on one device, there are no host syncs to count, and no CUDA tensors reach a file. Tiny
models, a few steps each. (Found by a review of the CUDA-only paths, 27 Nov; the GradScaler path it found runs on
the CPU too: tests/test_faults.py.)
"""

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ddp_runtime as rt
import ddp_training
from ddp_training import CausalLM, DDPTrainer, evaluate_model, lm_loss
from conftest import REPO, clean_env, metrics
from test_gpu import GPU_LM, _dirs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
SYNC = "called a synchronizing CUDA operation"  # the warning of torch.cuda.set_sync_debug_mode("warn")


def _cfg(root: Path, **config) -> dict:
    return dict(GPU_LM, device=DEVICE, batch_size=8, **_dirs(root), **config)


def count_syncs(fn, *args, **kwargs):
    """(fn's result, how many host syncs CUDA's sync debug mode saw in it)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum(SYNC in str(w.message) for w in seen)


def tensors_in(obj) -> list:
    found = []
    rt.map_tensors(lambda t: found.append(t) or t, obj)
    return found


# ------------------------------------------------------------------------------------------------------------------
# 1. Host syncs in per-micro-step code (a GPU waits for every queued kernel at each)


class Points(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _mse(kind: str):
    """A regression loss whose count and extra come back as `kind`: device tensors (the control), Python
    numbers, or CPU tensors."""
    def loss_fn(model, batch):
        x, y = batch
        err = model(x) - y
        s, n, mae = (err ** 2).sum(), len(x), err.abs().sum()
        if kind == "device":
            return s, torch.full((), float(n), device=x.device), {"mae": mae}
        if kind == "numbers":
            return s, n, {"mae": 0.5, "ones": n}
        if kind == "cpu count":
            return s, torch.tensor(n), {"mae": mae}
        if kind == "cpu extras":
            return s, n, {"mae": mae, "ones": torch.tensor(float(n))}
        raise ValueError(kind)
    return loss_fn


def _syncs_in_accumulate(root: Path, kind: str, micro: int = 4) -> tuple:
    torch.manual_seed(0)
    trainer = DDPTrainer(rank=0, world_size=1, loss_fn=_mse(kind), model=nn.Linear(8, 1), train_dataset=Points(),
                         config=dict(batch_size=8, max_steps=2, val_interval=0, device=DEVICE, resume="none",
                                     **_dirs(root)))
    try:
        trainer.step_model.train()
        ds = Points()
        batch = tuple(t.to(DEVICE) for t in (ds.x[:8], ds.y[:8]))  # on the device already: no copy to count
        trainer._accumulate([batch])  # lazy initialisations, the gradients' first allocation
        trainer.optimizer.zero_grad(set_to_none=False)
        (tally, data_errors, fatal, oom), syncs = count_syncs(trainer._accumulate, [batch] * micro)
        assert (data_errors, fatal, oom) == (0, None, False), fatal  # a device mismatch in StepTally.add lands here
        packed = tally.packed([0.0], sorted(tally.extras))
        return syncs, packed.device.type
    finally:
        trainer.close()


def test_the_sync_counter_sees_a_sync():
    """The counter the tests below compare: it must see a sync where there is one, or they would pass as 0 == 0."""
    _, syncs = count_syncs(lambda: torch.ones((), device=DEVICE).item())
    assert syncs >= 1


def test_a_count_copied_to_the_host_without_waiting_is_taken_once_it_has_arrived(tmp_path, no_launch_env):
    """A count and an extra that loss_fn copies to the host with non_blocking=True land in pinned memory, perhaps
    after loss_fn returns: they go to the device in the stream's order, not read at once (a read of a pinned
    tensor still filling gives what was there before: a count of 0 would skip the step)."""
    def loss_fn(model, batch):
        x, y = batch
        err = model(x) - y
        n = torch.full((), float(len(x)), device=x.device)
        torch.cuda._sleep(20_000_000)  # the copies queue behind some milliseconds of GPU work
        return (err ** 2).sum(), n.to("cpu", non_blocking=True), {"n": n.to("cpu", non_blocking=True)}

    summary = DDPTrainer(rank=0, world_size=1, loss_fn=loss_fn, model=nn.Linear(8, 1), train_dataset=Points(),
                         val_dataset=Points(16), config=dict(batch_size=8, max_steps=4, val_interval=4, log_interval=1,
                                                             device=DEVICE, resume="none", **_dirs(tmp_path))).train()
    assert (summary["status"], summary["steps"], summary["skipped_steps"]) == ("completed", 4, 0)
    assert [r["n"] for r in metrics(tmp_path / "logs", "train")] == [1.0] * 4 and summary["final_val_n"] == 1.0


@pytest.mark.parametrize("kind", ["numbers", "cpu extras", "cpu count"])
def test_counts_and_extras_given_as_numbers_or_cpu_tensors_add_no_host_sync_per_micro_step(tmp_path, no_launch_env,
                                                                                           kind):
    """Extras and counts given as Python numbers or host tensors go to the GPU as kernel arguments (loss_terms):
    a copy of a number to the device was a blocking one, a host sync in every micro-step. Counted against
    device tensors over 4 micro-steps of _accumulate."""
    control, dev = _syncs_in_accumulate(tmp_path / "control", "device")
    got, dev_got = _syncs_in_accumulate(tmp_path / "got", kind)
    assert dev == dev_got == torch.device(DEVICE).type
    assert got == control, f"{kind}: {got} host syncs in 4 micro-steps, the control {control}"


def test_lm_loss_sample_normalisation_adds_no_host_sync(no_launch_env):
    """lm_loss with loss_normalization=sample syncs no more than with token: a boolean-mask index of the samples
    with targets made the host wait for the GPU in every micro-step (a sample without targets sums to 0 anyway)."""
    torch.manual_seed(0)
    model = CausalLM(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, seq_len=16).to(DEVICE)
    x = torch.randint(0, 64, (8, 16), device=DEVICE)
    y = torch.randint(0, 64, (8, 16), device=DEVICE)
    y[1] = ddp_training.IGNORE_INDEX
    lm_loss(model, (x, y), "sample")  # warm-up
    (s_tok, _), token = count_syncs(lm_loss, model, (x, y), "token")
    (s, c), sample = count_syncs(lm_loss, model, (x, y), "sample")
    assert int(c) == 7 and torch.isfinite(s)
    assert sample == token, f"lm_loss: {sample} host syncs with sample normalisation, {token} with token"


@pytest.mark.parametrize("kind", ["numbers", "device"])
def test_evaluation_adds_no_host_sync_per_batch(no_launch_env, kind):
    """An evaluation syncs once, at its all-reduce, not once per batch: a count given as a number (vj2_loss's is
    an int) was copied to the device with a blocking copy. Counted as the difference between 6 batches and 2
    ("device" is the control)."""
    ds = Points(48)
    model = nn.Linear(8, 1).to(DEVICE)
    batches = [tuple(t.to(DEVICE) for t in (ds.x[i:i + 8], ds.y[i:i + 8])) for i in range(0, 48, 8)]
    loss_fn = _mse(kind)
    evaluate_model(model, batches[:1], loss_fn, torch.device(DEVICE))  # warm-up
    two, syncs_two = count_syncs(evaluate_model, model, batches[:2], loss_fn, torch.device(DEVICE))
    six, syncs_six = count_syncs(evaluate_model, model, batches, loss_fn, torch.device(DEVICE))
    assert two["count"] == 16 and six["count"] == 48
    assert syncs_six == syncs_two, f"{kind}: {syncs_two} syncs for 2 batches, {syncs_six} for 6"


# ------------------------------------------------------------------------------------------------------------------
# 2. Checkpoint files written without the host snapshot hold CUDA tensors


@pytest.mark.parametrize("how", ["synchronous-writer", "last-good-weights"])
def test_every_checkpoint_file_holds_cpu_tensors(tmp_path, no_launch_env, how):
    """The synchronous writer (async_checkpoint=false) and the last good weights written after a failed
    collective hold host tensors, as the background writer's files do: they saved the live CUDA tensors, and
    torch.load(path, weights_only=True) without map_location failed on a machine without that GPU."""
    trainer = DDPTrainer(rank=0, world_size=1, config=_cfg(tmp_path, async_checkpoint=how != "synchronous-writer"))
    try:
        if how == "synchronous-writer":
            files = [trainer.save_checkpoint("final"), trainer.save_state()]
        else:
            trainer._save_weights_here()
            files = [trainer.checkpoint_path("interrupted")]
        trainer.writer.flush()
    finally:
        trainer.close()
    for path in files:
        held = tensors_in(torch.load(path, weights_only=True, map_location=None))
        on = {str(t.device) for t in held}
        assert held and on == {"cpu"}, f"{path.name} holds tensors on {sorted(on)}"


# ------------------------------------------------------------------------------------------------------------------
# 3. A loss computed on the CPU while the model trains on the GPU


def test_a_loss_summed_on_the_cpu_with_extras_trains_and_evaluates(tmp_path, no_launch_env):
    """A loss summed on the host (model(x).cpu(), a metric computed there) while the model trains on the GPU: the
    extras go to the trainer's device, not the loss's; the step's tally and the evaluation's totals packed host
    and CUDA tensors together ("Expected all tensors to be on the same device")."""
    def loss_fn(model, batch):
        x, y = batch
        err = model(x).cpu() - y.cpu()
        return (err ** 2).sum(), len(x), {"mae": err.abs().sum()}

    summary = DDPTrainer(rank=0, world_size=1, loss_fn=loss_fn, model=nn.Linear(8, 1), train_dataset=Points(),
                         val_dataset=Points(16),
                         config=dict(batch_size=8, max_steps=3, val_interval=3, device=DEVICE, resume="none",
                                     **_dirs(tmp_path))).train()
    assert summary["status"] == "completed" and summary["steps"] == 3 and "final_val_mae" in summary


# ------------------------------------------------------------------------------------------------------------------
# 4. Paths read as correct, checked on a GPU


def test_an_empty_validation_shard_on_the_gpu_packs_the_peers_extras_on_the_device(no_launch_env, monkeypatch):
    """A rank whose validation shard is empty (more ranks than samples) sums nothing, takes the
    extras' names from its peers and packs zeros for them: all on the device (total, zero), one process standing
    in for a rank of two (the peer's names and sums injected where the collectives would bring them)."""
    peer = torch.tensor([6.0, 4.0, 2.0], dtype=torch.float64)  # loss sum, count, mae sum of the other rank
    monkeypatch.setattr(rt, "gather_objects", lambda obj: [obj, (["mae"], None)])
    real_reduce = rt.all_reduce_tensor

    def reduce(values, *a, **k):
        assert values.device.type == torch.device(DEVICE).type, values.device
        return real_reduce(values, *a, **k) + peer
    monkeypatch.setattr(rt, "all_reduce_tensor", reduce)
    got = evaluate_model(nn.Linear(8, 1).to(DEVICE), [], _mse("device"), torch.device(DEVICE))
    assert got == {"loss": 1.5, "count": 4.0, "mae": 0.5}


CPU_RUN = textwrap.dedent("""
    import json, torch
    from ddp_training import DDPTrainer
    cfg = dict(hidden_size=32, num_layers=1, num_heads=2, seq_len=16, dataset_size=128, batch_size=8, max_steps=3,
               val_interval=3, save_every_iters=3, device="cpu", pin_memory=True, use_amp=True, resume="none",
               log_dir={root!r} + "/logs", checkpoint_dir={root!r} + "/ckpt")
    summary = DDPTrainer(rank=0, world_size=1, config=cfg).train()
    state = torch.load({root!r} + "/ckpt/model_state_step_3.pt", weights_only=True)
    print(json.dumps(dict(status=summary["status"], cuda_initialized=torch.cuda.is_initialized(),
                          cuda_rng=[k for r in state["rng"] for k in r if k == "cuda"],
                          fused=[g.get("fused") for g in state["optimizer"]["param_groups"]])))
""")


def test_a_cpu_run_on_a_gpu_machine_never_touches_cuda(tmp_path):
    """device="cpu" where CUDA is available (pin_memory and use_amp left on): no CUDA context
    in the process (no pinned batches or copies, no GradScaler, no CUDA RNG state, no NCCL), a CPU optimizer."""
    import json
    proc = subprocess.run([sys.executable, "-c", CPU_RUN.format(root=str(tmp_path))], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == dict(status="completed", cuda_initialized=False, cuda_rng=[], fused=[None, None]), got
