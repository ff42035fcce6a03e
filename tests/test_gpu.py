"""GPU correctness (pytest -m gpu): NCCL equivalence of 2 GPUs with 1, mixed precision against
fp32, and a real training run on one GPU. Every test is skipped without CUDA; the 2-GPU test also
without a second GPU. The comparisons follow tests/test_correctness.py, with GPU tolerances:

  GPU_RTOL         relative L2 error of gradients and losses, fp32 (cuBLAS picks kernels by batch
                   size, and embedding backward sums with atomics, so the order of sums differs)
  GPU_WEIGHT_RTOL  the same for weights after several AdamW steps (see WEIGHT_RTOL there)
  AMP_RTOL         how far one autocast step may be from fp32: bf16 keeps 8 mantissa bits
                   (unit roundoff 3.9e-3), fp16 11 bits (4.9e-4), both summed over many terms
"""

import functools
import os
import threading
from pathlib import Path

import pytest
import torch

import ddp_runtime as rt
from ddp_training import CausalLM, DDPTrainer, lm_loss, peak_bf16_flops
from conftest import metrics
from dist_helpers import free_ports, spawn
from test_correctness import (LM, MIN_BREAK, ONE_RANK_SPECS, TWO_RANK_SPECS, _run_trainer, _two_rank_runs,
                              final_weights, flat_state, rel, spawn_by_value, step_losses, to_numpy, to_torch)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_RTOL = 1e-5
GPU_WEIGHT_RTOL = 1e-4
AMP_RTOL = {"bf16": 5e-2, "fp16": 1e-2}
AMP_MIN = 1e-7   # below this, autocast did not run at all: the test would prove nothing

GPU_LM = dict(LM, device="cuda", use_amp=False, pin_memory=True)


def _spec(name: str, **config) -> dict:
    return dict(name=name, data="lm", config=dict(GPU_LM, **config))


@pytest.mark.multi
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_equal_one_gpu_with_twice_the_batch(tmp_path):
    two_spec = _spec("nccl_b4", batch_size=4, dist_backend="nccl")
    two = spawn_by_value(_two_rank_runs, 2, str(tmp_path), [two_spec], free_ports(0))
    one = to_torch(to_numpy(_run_trainer(0, 1, str(tmp_path), _spec("gpu_b8", batch_size=8))))
    rt.teardown_distributed()
    r0, r1 = two[0][0], two[1][0]
    assert r0["replica_errors"] == r1["replica_errors"] == [] and r0["digests"] == r1["digests"]
    assert len(r0["grads"]) == len(one["grads"]) == LM["max_steps"]
    for step, (g, ref) in enumerate(zip(r0["grads"], one["grads"])):
        assert rel(g, ref) < GPU_RTOL, f"step {step + 1}: {rel(g, ref):.2e}"
    a, b = (step_losses(Path(r["dir"]) / "logs") for r in (r0, one))
    assert all(abs(x - y) <= GPU_RTOL * abs(y) for x, y in zip(a, b)), (a, b)
    assert rel(final_weights(r0), final_weights(one)) < GPU_WEIGHT_RTOL
    for calls, lasts, buckets in r0["hook"]:
        assert calls == buckets and lasts == 1



# One GPU lent: two ranks can still share it, each bound to it as `srun --gpus-per-task=1` binds a task to its own
# (CUDA_VISIBLE_DEVICES of one GPU, seen as cuda:0, and the task's SLURM_LOCALID). gloo takes CUDA tensors, so
# DDP's reducer, no_sync and the trainer's collectives run on GPU tensors; NCCL refuses two ranks on one GPU.
SHARED = ("lm_b4", "lm_b2_accum2", "padded_b4")


def _one_gpu() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"


def _bound_to_one_gpu(rank: int, world_size: int, fn, *args):
    os.environ.update(SLURM_LOCALID=str(rank), CUDA_VISIBLE_DEVICES=_one_gpu())
    return fn(rank, world_size, *args)


def _on_gpu(spec: dict, **config) -> dict:
    return dict(spec, config=dict(spec["config"], device="cuda", use_amp=False, pin_memory=True, **config))


@pytest.mark.multi
def test_two_ranks_bound_to_one_gpu_over_gloo_train_as_one_gpu_with_twice_the_batch(tmp_path):
    """The cuda_index binding of SLURM tasks (local rank 1 on a task's one visible GPU), and DDP on CUDA
    tensors: plain, accumulating with no_sync, and without static_graph, each against one GPU with the
    global batch (the CPU's equivalence tests, tests/test_correctness.py, with GPU tolerances)."""
    two_specs = [_on_gpu(s, dist_backend="gloo") for s in TWO_RANK_SPECS if s["name"] in SHARED]
    two = spawn_by_value(_bound_to_one_gpu, 2, _two_rank_runs, str(tmp_path), two_specs, free_ports(len(SHARED) - 1))
    refs = {s["name"]: to_torch(to_numpy(_run_trainer(0, 1, str(tmp_path), _on_gpu(s))))
            for s in ONE_RANK_SPECS if s["name"] in ("lm_b8", "padded_b8")}
    for i, (name, ref) in enumerate(zip(SHARED, ("lm_b8", "lm_b8", "padded_b8"))):
        r0, r1, one = two[0][i], two[1][i], refs[ref]
        log = (Path(r1["dir"]) / "logs" / "rank_1.log").read_text()
        assert "local_rank 1, device cuda:0, backend gloo" in log, log[:2000]
        assert r0["replica_errors"] == r1["replica_errors"] == [] and r0["digests"] == r1["digests"], name
        assert torch.equal(torch.stack(r0["grads"]), torch.stack(r1["grads"])), name
        assert len(r0["grads"]) == len(one["grads"]) > 1, name
        for step, (g, want) in enumerate(zip(r0["grads"], one["grads"])):
            tol = GPU_RTOL if step == 0 else GPU_WEIGHT_RTOL  # later steps start from weights that drifted apart
            assert rel(g, want) < tol, f"{name} step {step + 1}: {rel(g, want):.2e}"
        assert rel(final_weights(r0), final_weights(one)) < GPU_WEIGHT_RTOL, name
        assert rel(final_weights(r0), r0["init"]) > 10 * MIN_BREAK, name
        for calls, lasts, buckets in r0["hook"][1:]:  # one all-reduce per bucket and optimizer step
            assert calls == buckets and lasts == 1, (name, r0["hook"])


def _nccl_set_up(rank: int, world_size: int, root: str):
    try:
        DDPTrainer(rank=rank, world_size=world_size, config=dict(GPU_LM, dist_backend="nccl", **_dirs(Path(root))))
    except rt.SetUpFailed as exc:
        return str(exc)
    return "no error"


@pytest.mark.multi
def test_nccl_names_two_ranks_on_one_gpu_and_what_to_change(tmp_path):
    """Real NCCL's refusal (tests/test_runtime.py mocks its text): every rank ends set-up with its line."""
    said = spawn(_bound_to_one_gpu, 2, _nccl_set_up, str(tmp_path), timeout=180)
    for rank, text in enumerate(said):
        assert text.startswith(f"rank {rank}: set-up failed: NCCL found two ranks on one GPU (") and \
               "Duplicate GPU" in text and "--gpus-per-task=1" in text, text



def _bn_fault_on_the_gpu(rank: int, world_size: int, *args):
    """tests/test_faults.py's BatchNorm run with an error on rank 1, on the GPU over gloo."""
    import test_faults
    test_faults.CFG = dict(test_faults.CFG, device="cuda", dist_backend="gloo")
    return test_faults._bn_step_error(rank, world_size, *args)


def _bound_logs(root: Path) -> None:
    for rank in (0, 1):
        log = (root / "logs" / f"rank_{rank}.log").read_text()
        assert f"local_rank {rank}, device cuda:0, backend gloo" in log, log[:2000]


@pytest.mark.multi
@pytest.mark.parametrize("where, at", [("inside", 3), ("after", 2)],
                         ids=["inside-the-first-micro-step", "after-the-last-micro-step"])
def test_out_of_memory_under_ddp_on_the_gpu_is_retried_on_every_rank(tmp_path, where, at):
    """The replay's switch of DDP's buffer broadcast, and the cache emptied before it, with CUDA tensors: out of
    memory on rank 1 in or after a BatchNorm model's forward (2 micro-steps a step) is retried by both ranks."""
    oom = torch.OutOfMemoryError("CUDA out of memory (simulated)")
    results = spawn(_bound_to_one_gpu, 2, _bn_fault_on_the_gpu, str(tmp_path), oom, where, 2, at, timeout=180)
    assert results == ["completed 4 steps"] * 2, results
    _bound_logs(tmp_path)
    for rank in (0, 1):
        assert f"retrying step {at - 1} with micro-batches split 2 ways" in \
            (tmp_path / "logs" / f"rank_{rank}.log").read_text()


@pytest.mark.multi
def test_a_step_error_under_ddp_on_the_gpu_fails_every_rank_alike(tmp_path):
    """An error after DDP's forward on one rank: the weight-zero replay completes its collectives, and the step
    fails on both ranks with that rank's error, leaving the interrupt checkpoint."""
    results = spawn(_bound_to_one_gpu, 2, _bn_fault_on_the_gpu, str(tmp_path), ValueError("injected"), "after",
                    timeout=180)
    assert all(r.startswith("StepFailed: step 2 failed on rank 1: ValueError in forward: injected") for r in results), \
        results
    _bound_logs(tmp_path)
    assert (tmp_path / "ckpt" / "model_interrupted.pt").exists()


def test_pinning_loader_workers_end_when_train_returns(tmp_path, no_launch_env):
    """pin_memory with workers on a GPU: the loaders' workers and their pinning threads run during the steps and
    end with train() (tests/test_training.py checks the workers on the CPU, where nothing is pinned)."""
    import psutil
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    during = []

    def loss_fn(model, batch):
        during.append(sorted(t.name for t in threading.enumerate() if "pin_memory" in t.name))
        return lm_loss(model, batch)

    cfg = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=32, dataset_size=1024, batch_size=16,
               max_steps=12, val_interval=6, num_workers=2, pin_memory=True, device="cuda", resume="none",
               **_dirs(tmp_path))
    trainer = DDPTrainer(rank=0, world_size=1, config=cfg, loss_fn=loss_fn)
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["steps"] == 12 and summary["test_loss"] is not None
    assert during and all(names for names in during), during[:3]

    def left():
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                 and p.status() != psutil.STATUS_ZOMBIE]
        return procs, [t.name for t in threading.enumerate() if "pin_memory" in t.name]
    assert left() == ([], []), left()
    assert abs(trainer.evaluate()["loss"] - summary["final_val_loss"]) < 1e-5
    assert left() == ([], []), left()


def _one_step_grads(tmp_path: Path, name: str, **config) -> dict:
    rec = _run_trainer(0, 1, str(tmp_path), _spec(name, batch_size=8, max_steps=1, **config))
    return to_torch(to_numpy(rec))


@pytest.mark.parametrize("amp_dtype", ["bf16", "fp16"])
def test_amp_step_is_close_to_fp32(tmp_path, no_launch_env, monkeypatch, amp_dtype):
    if amp_dtype == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no bf16")
    # GradScaler's default first scale, 2**16, overflows this model's first fp16 step, which is then skipped
    # (test_fp16_overflowing_first_steps_are_skipped_then_it_trains); a scale that fits compares the same step.
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 8))
    fp32 = _one_step_grads(tmp_path, "fp32")
    amp = _one_step_grads(tmp_path, amp_dtype, use_amp=True, amp_dtype=amp_dtype)
    g_err = rel(amp["grads"][0], fp32["grads"][0])
    l_amp, l_fp32 = (step_losses(Path(r["dir"]) / "logs")[0] for r in (amp, fp32))
    assert AMP_MIN < g_err < AMP_RTOL[amp_dtype], f"{amp_dtype} gradient {g_err:.2e} from fp32"
    assert abs(l_amp - l_fp32) < AMP_RTOL[amp_dtype] * l_fp32
    # fp16 needs the GradScaler: the recorded gradients are the unscaled ones the optimizer sees.
    assert amp["summary"]["skipped_steps"] == 0


def test_fp16_overflowing_first_steps_are_skipped_then_it_trains(tmp_path, no_launch_env):
    """With GradScaler's default first scale the scaled gradients overflow fp16: those steps are skipped (the
    weights untouched, the scale halved) without counting as bad steps, and training goes on. (The scaler
    may overflow again later, after it grew; on an H100 steps 1, 2, 3 and 7 were skipped.)"""
    cfg = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=32, dataset_size=1024, batch_size=16,
               max_steps=40, learning_rate=1e-2, warmup_steps=5, log_interval=10, val_interval=0, max_bad_steps=2,
               device="cuda", amp_dtype="fp16", resume="none", log_dir=str(tmp_path / "logs"),
               checkpoint_dir=str(tmp_path / "ckpt"))
    summary = DDPTrainer(rank=0, world_size=1, config=cfg).train()
    records = metrics(tmp_path / "logs", "train")
    skipped = [r["step"] for r in records if r["skipped"]]
    assert summary["status"] == "completed" and summary["steps"] == 40
    assert skipped[:1] == [1] and summary["skipped_steps"] == len(skipped) <= 10
    assert records[-1]["loss"] < 0.6 * records[0]["loss"]


def test_amp_direct_forward_backward_is_close_to_fp32():
    """Autocast itself, without the trainer: loss and gradient of one batch."""
    torch.manual_seed(0)
    model = CausalLM(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, seq_len=16).cuda()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 64, (8, 16), generator=g).cuda(), torch.randint(0, 64, (8, 16), generator=g).cuda())

    def loss_and_grad(dtype):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            s, c = lm_loss(model, batch)
        (s / c).backward()
        return (s / c).item(), torch.cat([p.grad.float().flatten() for p in model.parameters()]).cpu()

    ref_loss, ref_grad = loss_and_grad(None)
    dtypes = {"fp16": torch.float16}
    if torch.cuda.is_bf16_supported(including_emulation=False):
        dtypes["bf16"] = torch.bfloat16
    for name, dtype in dtypes.items():
        loss, grad = loss_and_grad(dtype)
        assert AMP_MIN < rel(grad, ref_grad) < AMP_RTOL[name], name
        assert abs(loss - ref_loss) < AMP_RTOL[name] * ref_loss, name


def test_single_gpu_training_run_loss_falls(tmp_path, no_launch_env):
    cfg = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=32, dataset_size=1024, batch_size=16,
               max_steps=60, learning_rate=1e-2, warmup_steps=5, log_interval=10, val_interval=20,
               device="cuda", resume="none", log_dir=str(tmp_path / "logs"), checkpoint_dir=str(tmp_path / "ckpt"))
    summary = DDPTrainer(rank=0, world_size=1, config=cfg).train()
    assert summary["status"] == "completed" and summary["steps"] == 60 and "cuda_peak_gb" in summary
    records = metrics(tmp_path / "logs", "train")
    train = [r["loss"] for r in records]
    assert train[-1] < 0.6 * train[0]
    assert summary["final_val_loss"] < 0.8 * train[0]
    if peak_bf16_flops(torch.device("cuda")):  # MFU is reported where the peak is known
        assert all(0 < r["mfu"] < 1 for r in records)


def test_single_gpu_stop_and_resume_continues_the_run(tmp_path, no_launch_env):
    # The state's RNG streams must reach torch/CUDA as CPU tensors whatever device the weights train on;
    # bit-identity is a CPU promise (GPU kernels may sum in another order), continuity is checked here.
    from test_resume import SignalAt
    cfg = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=32, dataset_size=256, batch_size=16,
               max_steps=12, learning_rate=1e-2, warmup_steps=2, log_interval=100, val_interval=0,
               save_every_iters=5, device="cuda", log_dir=str(tmp_path / "logs"),
               checkpoint_dir=str(tmp_path / "ckpt"))
    first = DDPTrainer(rank=0, world_size=1, config=cfg, loss_fn=SignalAt(7)).train()
    assert first["status"] == "interrupted" and first["steps"] == 7
    second = DDPTrainer(rank=0, world_size=1, config=cfg).train()
    assert second["status"] == "completed" and second["resumed_from"].endswith("model_state_step_7.pt")
    assert [r["step"] for r in metrics(tmp_path / "logs", "train")] == list(range(1, 13))
    state = torch.load(tmp_path / "ckpt" / "model_state_step_10.pt", weights_only=True)
    assert "cuda" in state["rng"][0] and state["rng"][0]["torch"].device.type == "cpu"


class OutOfMemoryAbove:
    """lm_loss whose forward also asks the caching allocator for `per_row` bytes per sample of the micro-batch:
    a real CUDA out-of-memory error (the CPU tests raise torch.OutOfMemoryError themselves)."""

    def __init__(self, per_row: int):
        self.per_row, self.ooms = per_row, 0

    def __call__(self, model, batch):
        s, c = lm_loss(model, batch)
        if model.training:
            try:  # allocated and freed at once: the request is the point
                torch.empty(len(batch[0]) * self.per_row, dtype=torch.uint8, device=batch[0].device)
            except torch.OutOfMemoryError:
                self.ooms += 1
                raise
        return s, c


def _lm_run(root: Path, loss_fn=None, **config) -> dict:
    cfg = dict(GPU_LM, log_dir=str(root / "logs"), checkpoint_dir=str(root / "ckpt"), **config)
    return DDPTrainer(rank=0, world_size=1, config=cfg, loss_fn=loss_fn).train()


def test_a_real_cuda_out_of_memory_is_retried_with_halved_micro_batches(tmp_path, no_launch_env):
    """16 samples ask for 1.12 times the card's memory, 8 for 0.56 times: the first step runs out of memory,
    is retried in two micro-batches of 8 (which fit once the failed attempt's memory is released), and the
    run trains as one without the error does, up to the order of sums."""
    per_row = int(0.07 * torch.cuda.get_device_properties(0).total_memory)
    ref = _lm_run(tmp_path / "ref", batch_size=16)
    oom = OutOfMemoryAbove(per_row)
    got = _lm_run(tmp_path / "oom", oom, batch_size=16)
    assert ref["status"] == got["status"] == "completed" and got["steps"] == LM["max_steps"]
    assert oom.ooms == 1 and got["skipped_steps"] == 0
    assert "retrying step 1 with micro-batches split 2 ways" in (tmp_path / "oom" / "logs" / "rank_0.log").read_text()
    a, b = (step_losses(tmp_path / d / "logs") for d in ("oom", "ref"))
    assert len(a) == len(b) == LM["max_steps"] and all(abs(x - y) <= GPU_RTOL * y for x, y in zip(a, b)), (a, b)
    # without the attention's qkv bias, whose key third has a zero gradient that AdamW turns from rounding
    # noise into lr-sized steps (see tests/test_faults.py)
    w = [flat_state({k: v for k, v in torch.load(tmp_path / d / "ckpt" / "model_final.pt", weights_only=True)
                     ["model"].items() if not k.endswith("qkv.bias")}) for d in ("oom", "ref")]
    assert rel(*w) < GPU_WEIGHT_RTOL


def test_a_state_saved_on_the_cpu_resumes_on_the_gpu_and_back(tmp_path, no_launch_env):
    """A run stopped on one device goes on on the other: the optimizer takes the new device's kernels (fused
    AdamW on CUDA, foreach on the CPU) and its moments move with the weights; the losses after the resume are
    those of a run that never stopped, to fp32 kernel differences."""
    from test_resume import SignalAt
    base = dict(GPU_LM, max_steps=10, save_every_iters=4, keep_states=0, batch_size=8, resume="auto")
    ref = step_losses(_lm_run_dir(tmp_path / "ref", base, "cpu"))
    for first, second in (("cpu", "cuda"), ("cuda", "cpu")):
        root = tmp_path / f"{first}_then_{second}"
        stopped = DDPTrainer(rank=0, world_size=1, loss_fn=SignalAt(6),
                             config=dict(base, device=first, **_dirs(root))).train()
        assert stopped["status"] == "interrupted" and stopped["steps"] == 6
        done = DDPTrainer(rank=0, world_size=1, config=dict(base, device=second, **_dirs(root))).train()
        assert done["status"] == "completed" and done["resumed_from"].endswith("model_state_step_6.pt")
        state = torch.load(root / "ckpt" / "model_state_step_8.pt", weights_only=True)
        groups = state["optimizer"]["param_groups"]
        assert all(bool(g["fused"]) == (second == "cuda") and bool(g["foreach"]) == (second == "cpu") for g in groups)
        losses = step_losses(root / "logs")
        assert len(losses) == len(ref) == 10
        assert all(abs(x - y) <= 1e-4 * y for x, y in zip(losses, ref)), (first, second, losses, ref)


def _dirs(root: Path) -> dict:
    return dict(log_dir=str(root / "logs"), checkpoint_dir=str(root / "ckpt"))


def _lm_run_dir(root: Path, config: dict, device: str) -> Path:
    DDPTrainer(rank=0, world_size=1, config=dict(config, device=device, **_dirs(root))).train()
    return root / "logs"


def test_mappings_and_dataclasses_of_pinned_tensors_reach_the_gpu(tmp_path, no_launch_env):
    """A user's batches as a mapping (HF's BatchEncoding is a UserDict) holding a dataclass: the loader pins
    them and the trainer copies every tensor in them to the GPU without blocking; the model trains there."""
    import collections
    import dataclasses

    @dataclasses.dataclass
    class Targets:
        y: torch.Tensor

    class Points(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(256, 8, generator=g)
            self.y = self.x @ torch.randn(8, 1, generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    def collate(samples):
        x, y = (torch.stack(v) for v in zip(*samples))
        return collections.UserDict({"x": x, "targets": Targets(y)})

    seen = []

    def loss_fn(model, batch):
        seen.append((type(batch).__name__, batch["x"].device.type, batch["targets"].y.device.type))
        err = model(batch["x"]) - batch["targets"].y
        return (err ** 2).sum(), torch.tensor(float(err.numel()), device=err.device)

    cfg = dict(batch_size=32, max_steps=40, learning_rate=1e-1, weight_decay=0.0, warmup_steps=0, val_interval=0, log_interval=1,
               device="cuda", pin_memory=True, resume="none", **_dirs(tmp_path))
    summary = DDPTrainer(rank=0, world_size=1, config=cfg, model=torch.nn.Linear(8, 1), train_dataset=Points(),
                         loss_fn=loss_fn, collate_fn=collate).train()
    assert summary["status"] == "completed" and summary["steps"] == 40
    assert set(seen) == {("UserDict", "cuda", "cuda")}
    losses = step_losses(tmp_path / "logs")
    assert sum(losses[-5:]) < 0.05 * sum(losses[:5])
