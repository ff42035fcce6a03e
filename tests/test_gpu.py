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
from pathlib import Path

import pytest
import torch

import ddp_runtime as rt
from ddp_training import CausalLM, DDPTrainer, lm_loss, peak_bf16_flops
from conftest import metrics
from dist_helpers import free_ports
from test_correctness import (LM, _run_trainer, _two_rank_runs, final_weights, rel, spawn_by_value, step_losses,
                              to_numpy, to_torch)

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
