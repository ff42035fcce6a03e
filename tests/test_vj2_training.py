"""Tests of vj2ac_train_multi_gpu.py: the AC predictor, its loss, and real 2-rank gloo training through DDPTrainer
(validation loss, action conditioning, checkpoints, fail-fast input errors, the documented CPU command)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import REPO, background, clean_env, make_vj2_data, metrics, run, torchrun, wait_for_step

import create_synthetic_data as gen
import ddp_runtime as rt
import vj2ac_train_multi_gpu as vj2
from ddp_training import TrainConfig
from vj2_dataloader import Geometry, VJ2TrajectoryDataset

SCRIPT = "vj2ac_train_multi_gpu.py"
# small geometry: T=4 steps, P=16 patches, D=32, A=10 actions x C=3 channels
T, P, D, A, C = 4, 16, 32, 10, 3
# weights-only checkpoint names; the trainer may write other files (resumable states, .sha256 sidecars)
WEIGHTS_FILE = re.compile(r"^vjepa2_(best|final|interrupted|step_\d+|epoch_\d+)\.pt$")


def tiny_predictor(seed=0, depth=2):
    torch.manual_seed(seed)
    return vj2.ACPredictor(embed_dim=D, num_patches=P, action_dim=A * C, max_steps=T - 1, predictor_dim=32,
                           depth=depth, num_heads=2)


def random_batch(batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, T, P, D, generator=g), torch.rand(batch, T - 1, A * C, generator=g)


def script(*args):
    return [sys.executable, REPO / SCRIPT, *args]

# -----------------------------------------------------------------------------------------------------------------
# the predictor and its loss, in-process


def test_predictor_shapes_and_block_causal_mask():
    model = tiny_predictor().eval()
    z, actions = random_batch()
    out = model.predict(z[:, :-1], actions)
    assert out.shape == (3, T - 1, P, D)
    # outputs are layer-normed over D
    torch.testing.assert_close(out.mean(-1), torch.zeros(3, T - 1, P), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.std(-1, unbiased=False), torch.ones(3, T - 1, P), atol=1e-3, rtol=0)

    mask = model.block_causal_mask(3, 1 + P, z.device)
    step = torch.arange(3 * (1 + P)) // (1 + P)
    assert torch.equal(mask, step[None, :] <= step[:, None])
    # built once per (steps, tokens per step, device), then reused
    assert model.block_causal_mask(3, 1 + P, z.device) is mask
    assert set(model._masks) == {(3, 1 + P, z.device)}

    # a token of step t cannot see step t+1: perturbing step 2 (its patches and its action) leaves the outputs
    # of steps 0 and 1 exactly unchanged and changes step 2's
    z2, a2 = z[:, :-1].clone(), actions.clone()
    z2[:, 2] += torch.randn_like(z2[:, 2])
    a2[:, 2] = 1 - a2[:, 2]
    with torch.no_grad():
        before, after = model.predict(z[:, :-1], actions), model.predict(z2, a2)
    assert torch.equal(before[:, :2], after[:, :2])
    assert not torch.allclose(before[:, 2], after[:, 2])
    # and the action of step t reaches the prediction made at step t
    a3 = actions.clone()
    a3[:, 1] = 1 - a3[:, 1]
    with torch.no_grad():
        changed = model.predict(z[:, :-1], a3)
    assert torch.equal(changed[:, 0], before[:, 0]) and not torch.allclose(changed[:, 1], before[:, 1])


def manual_losses(model, emb, actions, horizon):
    """The loss written out step by step: teacher forcing, then a rollout that feeds its predictions back."""
    z = F.layer_norm(emb, (D,))
    jloss = (model.predict(z[:, :-1], actions) - z[:, 1:]).abs().mean((1, 2, 3))
    context, errors = z[:, :1], []
    for k in range(horizon):
        pred = model.predict(context, actions[:, :k + 1])[:, -1]
        errors.append((pred - z[:, k + 1]).abs().mean((1, 2)))
        context = torch.cat([context, pred[:, None]], 1)
    return jloss, torch.stack(errors, 1).mean(1)


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_loss_is_teacher_forcing_plus_a_rollout_of_horizon_steps(horizon):
    model = tiny_predictor()
    emb, actions = random_batch()
    emb.requires_grad_(True)
    jloss, sloss = model(emb, actions, horizon)
    ref_j, ref_s = manual_losses(model, emb, actions, horizon)
    torch.testing.assert_close(jloss, ref_j)
    torch.testing.assert_close(sloss, ref_s)
    # rollout step k is penalised against z_k: sloss reaches the targets z_1..z_h and no further
    inputs = [emb, *model.parameters()]
    grads = torch.autograd.grad(sloss.sum(), inputs)
    reached = grads[0].abs().sum((0, 2, 3)) > 0
    assert reached.tolist() == [True] + [k <= horizon for k in range(1, T)]
    # and its gradients flow back through every fed-back prediction, as in the step-by-step reference
    ref_grads = torch.autograd.grad(ref_s.sum(), inputs)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref)


def test_loss_layer_norms_targets_and_inputs_and_reads_float16():
    model = tiny_predictor()
    emb, actions = random_batch()
    # an affine change of each token (scale and offset over D) is invisible after layer norm
    shifted = 3.0 * emb + torch.randn(3, T, P, 1)
    for a, b in zip(model(emb, actions, 2), model(shifted, actions, 2)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # DDPTrainer's contract: sums over the batch, the batch size, and the parts as sums; float16 on disk is fine
    total, count, extras = vj2.vj2_loss(model, (emb.half(), actions), rollout_horizon=2)
    j, s = model(emb.half().float(), actions, 2)
    assert count == 3 and total.dtype == torch.float32
    torch.testing.assert_close(total, (j + s).sum())
    torch.testing.assert_close(extras["jloss"], j.sum())
    torch.testing.assert_close(extras["sloss"], s.sum())
    # an untrained predictor is about as far from the layer-normed targets as independent unit vectors
    assert 0.8 < (total / count / 2).item() < 1.5


def test_each_patch_is_predicted_from_its_own_token():
    """The output of step t's token j is the prediction for patch j (the action token's output is dropped),
    so a change to one input patch moves mostly that patch's prediction: through its token's residual path,
    while other tokens see it only through attention (small at init)."""
    model = tiny_predictor().eval()
    z, actions = random_batch()
    z2 = z.clone()
    z2[:, 0, 5] += 3 * torch.randn(D)
    with torch.no_grad():
        moved = (model.predict(z2[:, :-1], actions) - model.predict(z[:, :-1], actions))[:, 0].abs().mean((0, 2))
    assert moved.argmax().item() == 5 and moved[5] > 5 * moved[torch.arange(P) != 5].max(), moved


def test_a_predictor_refuses_longer_trajectories_than_it_was_built_for():
    """The predictor of T-step data has step positions for T-1 input steps: data with more steps is refused up
    front (its last step would meet an untrained position), shorter data fits."""
    geometry = Geometry(T, P, D, A, C)
    args = vj2.parse_args(["--processed_data_dir", "t", "--validation_data_dir", "v", "--preset", "tiny"])
    predictor = vj2.predictor_for(geometry, args)
    assert predictor.config["max_steps"] == T - 1
    vj2.check_fits(predictor, geometry._replace(steps=T - 1), "--validation_data_dir")
    with pytest.raises(vj2.BadInput, match=rf"--validation_data_dir: data geometry T={T + 1} .* does not fit the "
                                           rf"predictor .*max_steps=T-1<={T - 1}\)"):
        vj2.check_fits(predictor, geometry._replace(steps=T + 1), "--validation_data_dir")


def test_shuffled_actions_pair_every_trajectory_with_another():
    class Items:
        def __len__(self):
            return 7

        def __getitem__(self, i):
            return f"emb{i}", f"act{i}"

        def actions(self, i):
            return f"act{i}"
    shuffled = vj2.ShuffledActions(Items(), seed=0)
    partners = [int(shuffled[i][1][3:]) for i in range(7)]
    assert [shuffled[i][0] for i in range(7)] == [f"emb{i}" for i in range(7)]
    assert sorted(partners) == list(range(7)) and all(p != i for i, p in enumerate(partners))
    assert partners == [int(vj2.ShuffledActions(Items(), seed=0)[i][1][3:]) for i in range(7)]


def test_cli_presets_test_mode_and_trainer_config(no_launch_env):
    data = ["--processed_data_dir", "t", "--validation_data_dir", "v"]
    args = vj2.parse_args(data + ["--device", "cpu"])
    assert (args.preset, args.depth, args.predictor_dim, args.num_heads) == ("small", 2, 64, 4)
    assert args.lr == vj2.PRESET_LR["small"] and args.rollout_horizon == 2 and args.batch_size == 4
    args = vj2.parse_args(data + ["--preset", "vjepa2_ac", "--depth", "3", "--local-rank=1"])
    assert (args.depth, args.predictor_dim, args.num_heads) == (3, 1024, 16)
    args = vj2.parse_args(data + ["--test", "--max_steps", "7", "--batch-size", "3", "--local_rank", "0"])
    assert (args.max_steps, args.val_every_iters, args.preset, args.depth, args.batch_size) == (7, 10, "tiny", 1, 3)
    # an epochs flag is the run's length: --test's max_steps would end it first (or run it past them)
    args = vj2.parse_args(data + ["--test", "--num_epochs", "2"])
    assert (args.num_epochs, args.max_steps, args.run_config["max_steps"]) == (2, 0, 0)
    assert vj2.parse_args(data + ["--test", "--num_epochs", "2", "--max_steps", "5"]).max_steps == 5
    cfg = vj2.train_config(args)
    TrainConfig.from_dict(cfg)  # every key is one the trainer knows
    assert cfg["checkpoint_prefix"] == "vjepa2" and cfg["val_interval"] == 10 and cfg["save_interval"] == 0
    assert cfg["checkpoint_dir"] == "checkpoints/vj2ac_test" and cfg["log_dir"] == cfg["checkpoint_dir"]
    assert vj2.train_config(vj2.parse_args(data))["checkpoint_dir"] == "checkpoints/vj2ac"
    assert vj2.train_config(vj2.parse_args(data + ["--run-name", "b"]))["checkpoint_dir"] == "checkpoints/b"
    assert vj2.train_config(vj2.parse_args(data + ["--loader_timeout", "7"]))["loader_timeout"] == 7.0
    # DDPTrainer's own settings pass through as they are; unset, the trainer's defaults hold
    cfg = vj2.train_config(vj2.parse_args(data + ["--grad_clip", "0.5", "--lr_schedule", "constant", "--compile",
                                                  "--async_checkpoint", "false", "--static_graph", "auto"]))
    assert (cfg["grad_clip"], cfg["lr_schedule"], cfg["compile"], cfg["async_checkpoint"]) == (0.5, "constant", True,
                                                                                              False)
    assert not {"static_graph", "patience", "keep_checkpoints"} & set(cfg)


def test_presets_are_the_documented_sizes_and_flags_reach_the_trainer(no_launch_env):
    """vjepa2_ac is Meta's predictor (width 1024, depth 24, 16 heads); optimisation flags are passed on, not
    left at the trainer's defaults."""
    data = ["--processed_data_dir", "t", "--validation_data_dir", "v"]
    sizes = {name: (a.predictor_dim, a.depth, a.num_heads, a.lr) for name in ("tiny", "small", "vjepa2_ac")
             for a in [vj2.parse_args(data + ["--preset", name])]}
    assert sizes == {"tiny": (32, 1, 2, 1e-2), "small": (64, 2, 4, 5e-3), "vjepa2_ac": (1024, 24, 16, 4e-4)}
    cfg = vj2.train_config(vj2.parse_args(data + ["--no_amp", "--grad_accum_steps", "3", "--weight_decay", "0.1",
                                                  "--warmup_steps", "7", "--seed", "9"]))
    assert (cfg["use_amp"], cfg["grad_accum_steps"], cfg["weight_decay"], cfg["warmup_steps"], cfg["seed"]) == (
        False, 3, 0.1, 7, 9)
    assert vj2.train_config(vj2.parse_args(data))["use_amp"] is True


def test_a_config_file_is_read_like_the_flags_and_a_run_records_one(tmp_path, capsys):
    """Defaults < --config < --test < flags; a run's config.yaml (args.run_config) loads back to the same run
    (from a review: the VJ2 script had no --config, and its config.yaml held the LM's defaults)."""
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text("processed_data_dir: t\nvalidation_data_dir: v\nbatch_size: 8\nlr: 3e-4\nskip_bad_files: true\n"
                    "checkpoint_dir: ck/a\nrun_name: a\ncompile: true\npatience: null\nstatic_graph: auto\n")
    args = vj2.parse_args(["--config", str(path), "--batch_size", "6"])
    assert (args.batch_size, args.lr, args.skip_bad_files, args.checkpoint_dir) == (6, 3e-4, True, "ck/a")
    assert (args.compile, args.patience, args.static_graph) == (True, None, None)
    assert vj2.parse_args(["--config", str(path), "--test"]).max_steps == vj2.TEST_DEFAULTS["max_steps"]
    # what the run records loads back to the same flags; the launch's own (--resume none) are not kept
    args = vj2.parse_args(["--config", str(path), "--resume", "none", "--seed", "3"])
    assert args.run_config["resume"] == "auto" and args.run_config["device"] is None
    path.write_text(yaml.safe_dump(args.run_config))
    again = vj2.parse_args(["--config", str(path)])
    assert again.run_config == args.run_config and again.seed == 3 and again.depth == args.depth
    assert args.run_config["depth"] is None  # filled in by the preset at each load: another --preset wins
    assert vj2.parse_args(["--config", str(path), "--preset", "tiny"]).depth == vj2.config.PREDICTOR_PRESETS["tiny"][
        "depth"]
    # another run name is another run: the file's checkpoint dir is not reused
    assert vj2.parse_args(["--config", str(path), "--run_name", "b"]).checkpoint_dir is None
    assert "note: --run_name replaces checkpoint_dir=ck/a" in capsys.readouterr().err
    assert vj2.parse_args(["--config", str(path), "--run_name", "a"]).checkpoint_dir == "ck/a"
    for text, message in [("bogus: 1\n", "unknown key 'bogus'"),
                          ("learning_rate: 1\n", "unknown key 'learning_rate' (this kit's name for it: lr)"),
                          ("batch_size: 2.5\n", "key 'batch_size' expects int"),
                          ("skip_bad_files: 1\n", "key 'skip_bad_files' must be true or false, got 1"),
                          ("compile: 1\n", "key 'compile' must be true or false, got 1"),
                          ("compile: maybe\n", "key 'compile' must be true or false, got 'maybe'"),
                          ("batch_size: null\n", "key 'batch_size' must not be null"),
                          ("preset: huge\n", "key 'preset' must be one of"), ("depth: [1]\n", "a single value"),
                          ("evaluate: x.pt\n", "unknown key 'evaluate' (--evaluate is a flag of one launch, not a "
                                                "key of the run)"), ("- 1\n", "expected a flat mapping"),
                          ("app: vjepa\ndata:\n  batch_size: 4\n", "unknown key 'app' (a flat mapping: nested "
                                                                    "sections, as in V-JEPA 2's")]:
        path.write_text(text)
        with pytest.raises(SystemExit) as exc:
            vj2.parse_args(["--config", str(path), "--processed_data_dir", "t", "--validation_data_dir", "v"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"error: --config {path}: " in err and message in err, (text, err)


@pytest.mark.parametrize("argv,message", [
    (["--validation_data_dir", "v"], "--processed_data_dir and --validation_data_dir are required"),
    (["--evaluate", "x.pt"], "--evaluate needs --validation_data_dir"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--shuffle_actions"], "only applies to --evaluate"),
    # from a user test: these did nothing, and the result looked like the preset's or the data's
    (["--evaluate", "x.pt", "--validation_data_dir", "v", "--preset", "small", "--depth", "5", "--batch_size", "2",
      "--processed_data_dir", "t"], "error: --evaluate scores the checkpoint as it is: --preset --depth "
                                    "--processed_data_dir are training flags, which it does not read; leave them out"),
    (["--evaluate", "x.pt", "--validation_data_dir", "v", "--no_amp"], "--no_amp is a training flag"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--no_amp", "--amp_dtype", "bf16"],
     "--no_amp turns off the mixed precision that --amp_dtype bf16 asks for: give one"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--device", "cpu", "--dist-backend", "nccl"],
     "nccl needs CUDA"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--predictor_dim", "30", "--num_heads", "4"],
     "divisible"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--max_steps", "-3"], "--max_steps must be >= 0"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--lr", "-1"], "--lr must be > 0"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--loader_timeout", "0"],
     "--loader_timeout must be > 0"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--save_every_iters", "-1"],
     "--save_every_iters must be >= 0"),
    # c10d counts the timeout in int64 nanoseconds: 1e10 s already fails inside the process group
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--dist_timeout", "1e10"],
     "--dist_timeout must be from 1 to 1e+07 seconds"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--dist_timeout", "0.001"],
     "--dist_timeout must be from 1 to 1e+07 seconds"),
    # from a review of the CLI: these failed mid-run (an overflow at the first validation), in set-up with no flag
    # named, or trained with the default
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--loader_timeout", "1e300"],
     "--loader_timeout must be <= 1e+07 seconds"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--checkpoint_dir", ""],
     "--checkpoint_dir must be a path, got an empty string"),
    (["--processed_data_dir", "", "--validation_data_dir", "v"],
     "--processed_data_dir must be a path, got an empty string"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--save_every", "3"],
     "unrecognized arguments: --save_every"),
    # the LM script's --nproc is not this one's: the hint names only what this script and torchrun take
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--nproc", "2"],
     "--nproc (the number of processes is the launcher's: torchrun --nproc_per_node, srun -n)"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--run_name", "../up"],
     "--run_name must be names of letters, digits"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--keep_checkpoints", "-1"],
     "--keep_checkpoints must be >= 0, got -1"),
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--min_lr_ratio", "1.5"],
     "--min_lr_ratio must be in [0, 1], got 1.5"),
    # a horizon of 0 trained with a rollout loss of one step
    (["--processed_data_dir", "t", "--validation_data_dir", "v", "--rollout_horizon", "0"],
     "--rollout_horizon must be >= 1, got 0"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        vj2.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--lr", "--weight_decay", "--dist_timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_float_flags_must_be_finite(flag, value, capsys):
    # nan passes every `< 0` check, and --lr inf trained to NaN weights with exit 0
    with pytest.raises(SystemExit) as exc:
        vj2.parse_args(["--processed_data_dir", "t", "--validation_data_dir", "v", f"{flag}={value}"])
    assert exc.value.code == 2 and f"{flag} must be a finite number, got {value}" in capsys.readouterr().err

# -----------------------------------------------------------------------------------------------------------------
# real processes


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-rank gloo run: 600 training trajectories, 16 per rank per step, 10 epochs = 180 steps; the two newest
    step and epoch weights files kept (a DDPTrainer setting the script passes on)."""
    root = tmp_path_factory.mktemp("vj2_trained")
    make_vj2_data(root, 2, 300, 50)
    t0 = time.time()
    r = run(torchrun(2, SCRIPT, "--device", "cpu", "--dist-backend", "gloo", "--processed_data_dir", root / "train",
                     "--validation_data_dir", root / "val", "--num_epochs", "10", "--batch_size", "16",
                     "--save_every_iters", "50", "--val_every_iters", "25", "--save_every_epochs", "3",
                     "--keep_checkpoints", "2", "--checkpoint_dir", root / "ckpt", "--log_dir", root / "logs"),
            cwd=root, timeout=240)
    assert r.returncode == 0, r.stdout[-6000:]
    return dict(root=root, out=r.stdout, wall=time.time() - t0, records=metrics(root / "logs"))


def copy_baseline(val_dir, horizon=2):
    """The loss of predicting 'nothing changes' (z_{t+1} = z_t, every rollout step = z_0)."""
    ds = VJ2TrajectoryDataset(val_dir)
    z = F.layer_norm(torch.stack([ds[i][0] for i in range(len(ds))]).float(), (D,))
    return ((z[:, :-1] - z[:, 1:]).abs().mean() + (z[:, :1] - z[:, 1:horizon + 1]).abs().mean()).item()


@pytest.mark.multi
def test_two_rank_training_learns_the_dynamics(trained):
    records = trained["records"]
    train = [r for r in records if r["type"] == "train"]
    val = [r for r in records if r["type"] == "val"]
    summary = [r for r in records if r["type"] == "summary"][-1]
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 180
    assert [r["step"] for r in train] == list(range(1, 181)) and not any(r["skipped"] for r in train)
    assert {"jloss", "sloss"} <= set(train[0]) and {"val_jloss", "val_sloss"} <= set(val[0])
    assert [r["step"] for r in val] == [25, 50, 75, 100, 125, 150, 175, 180]
    untrained, first, final = train[0]["loss"], val[0]["val_loss"], val[-1]["val_loss"]
    # measured on 2 cores: untrained 2.27, first validation 1.08, final 0.90, copy baseline 1.06
    assert final < 0.5 * untrained, (untrained, final)
    assert final < 0.9 * first, (first, final)
    # the predictor beats "nothing changes", so it learned some of the dynamics, not just the layer norm
    assert final < 0.95 * copy_baseline(trained["root"] / "val"), final
    assert summary["final_val_loss"] == final
    out = trained["out"]
    assert "[DDP] Initializing with backend=gloo, device=cpu" in out
    assert "[DDP] Rank 0/2, local_rank=0, device=cpu" in out
    assert "[DDP] Dataloader created with 600 samples, batch_size=16" in out
    assert re.search(r"model: AC predictor, preset small \(depth 2, width 64, 4 heads\).*, [\d,]+ parameters", out)
    rank1 = (trained["root"] / "logs" / "rank_1.log").read_text()
    assert "[DDP] Rank 1/2, local_rank=1, device=cpu" in rank1 and "[RANK 1]" in rank1
    # the run dir's config.yaml holds this script's flags (not the trainer's LM defaults)
    saved = yaml.safe_load((trained["root"] / "logs" / "config.yaml").read_text())
    assert (saved["processed_data_dir"], saved["batch_size"], saved["val_every_iters"], saved["preset"]) == (
        str(trained["root"] / "train"), 16, 25, "small") and "vocab_size" not in saved
    assert saved["keep_checkpoints"] == 2 and saved["grad_clip"] is None  # unset: the trainer's default


@pytest.mark.multi
def test_actions_matter_shuffled_actions_lose(trained):
    root, ckpt = trained["root"], trained["root"] / "ckpt" / "vjepa2_final.pt"

    def evaluate(cmd):
        r = run(cmd, cwd=root, timeout=120)
        assert r.returncode == 0, r.stdout[-4000:]
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        assert len(lines) == 1, r.stdout  # one JSON line, from rank 0 only
        return json.loads(lines[0])

    args = ("--evaluate", ckpt, "--validation_data_dir", root / "val", "--device", "cpu")
    true = evaluate(torchrun(2, SCRIPT, *args))
    shuffled = evaluate(script(*args, "--shuffle_actions"))
    assert set(true) == {"loss", "jloss", "sloss", "samples"} and true["samples"] == shuffled["samples"] == 50
    # evaluation of the saved weights reproduces the trainer's last validation (2 ranks, sharded, all-reduced)
    final = [r for r in trained["records"] if r["type"] == "val"][-1]
    assert true["loss"] == pytest.approx(final["val_loss"], rel=1e-5)
    assert true["jloss"] + true["sloss"] == pytest.approx(true["loss"], rel=1e-6)
    # measured: 0.90 with the true actions, 1.15 with another trajectory's
    assert shuffled["loss"] > 1.15 * true["loss"], (true, shuffled)
    assert shuffled["jloss"] > 1.1 * true["jloss"] and shuffled["sloss"] > 1.1 * true["sloss"]


@pytest.mark.multi
def test_checkpoints_names_cadence_and_contents(trained):
    ckpt_dir = trained["root"] / "ckpt"
    names = {p.name for p in ckpt_dir.iterdir() if WEIGHTS_FILE.match(p.name)}
    # 18 steps per epoch (300 trajectories per rank // 16), 180 steps
    # steps 50 and epoch 3 were written, then pruned by --keep_checkpoints 2
    assert names == {"vjepa2_best.pt", "vjepa2_final.pt", "vjepa2_step_100.pt", "vjepa2_step_150.pt",
                     "vjepa2_epoch_6.pt", "vjepa2_epoch_9.pt"}
    log = (trained["root"] / "logs" / "rank_0.log").read_text()
    assert "vjepa2_step_50.pt (step 50" in log and "vjepa2_epoch_3.pt (step 54" in log
    vals = {r["step"]: r["val_loss"] for r in trained["records"] if r["type"] == "val"}
    best_step = min(vals, key=vals.get)
    steps = {"final": 180, "best": best_step, "step_100": 100, "step_150": 150, "epoch_6": 108, "epoch_9": 162}
    for tag, step in steps.items():
        ckpt = torch.load(ckpt_dir / f"vjepa2_{tag}.pt", weights_only=True)
        # weights, step, the predictor's shape and loss, and the val loss of these very weights (validations
        # every 25 steps: none at the epoch ends); no optimizer or scheduler state
        validated = {"val_loss"} if step in vals else set()
        assert set(ckpt) == {"predictor", "global_step", "predictor_config", "rollout_horizon", "data_geometry",
                             *validated}, tag
        assert ckpt["global_step"] == step and ckpt["rollout_horizon"] == 2, tag
        assert ckpt["data_geometry"] == [T, P, D, A, C], tag
        assert not any(k.startswith("module.") for k in ckpt["predictor"])
        if validated:
            assert ckpt["val_loss"] == pytest.approx(vals[step]), (tag, ckpt["val_loss"], vals[step])
    best = torch.load(ckpt_dir / "vjepa2_best.pt", weights_only=True)
    assert best["val_loss"] == pytest.approx(min(vals.values()))
    model = vj2.ACPredictor(**best["predictor_config"])
    model.load_state_dict(best["predictor"])
    assert best["predictor_config"] == dict(embed_dim=D, num_patches=P, action_dim=A * C, max_steps=T - 1,
                                            predictor_dim=64, depth=2, num_heads=4, mlp_ratio=4)


def test_evaluate_scores_the_loss_the_run_trained_with(tmp_path, no_launch_env, capsys):
    make_vj2_data(tmp_path, 1, 8, 8)
    data = ["--validation_data_dir", str(tmp_path / "val"), "--device", "cpu"]
    assert vj2.main([*data, "--processed_data_dir", str(tmp_path / "train"), "--checkpoint_dir", str(tmp_path / "ckpt"),
                     "--preset", "tiny", "--max_steps", "4", "--val_every_iters", "4", "--rollout_horizon", "1"]) == 0
    final = torch.load(tmp_path / "ckpt" / "vjepa2_final.pt", weights_only=True)
    assert final["rollout_horizon"] == 1 and final["global_step"] == 4

    def evaluate(*extra):
        capsys.readouterr()
        assert vj2.main(["--evaluate", str(tmp_path / "ckpt" / "vjepa2_final.pt"), *data, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]

    assert evaluate() == pytest.approx(final["val_loss"], rel=1e-5)  # the checkpoint's horizon, not the default 2
    assert evaluate("--rollout_horizon", "2") != pytest.approx(final["val_loss"], rel=1e-3)  # the flag wins
    # a resumable state beside it is no predictor checkpoint: the error says which file to take
    assert vj2.main(["--evaluate", str(tmp_path / "ckpt" / "vjepa2_state_step_4.pt"), *data]) == 2
    assert "a resumable training state, not a predictor checkpoint; evaluate a weights file" in capsys.readouterr().err


def test_evaluate_refuses_a_checkpoint_whose_rollout_horizon_is_not_positive(tmp_path, no_launch_env, capsys):
    """Unchecked, a horizon of -1 would score the rollout over no steps: a NaN loss and exit 0."""
    gen.generate(tmp_path / "val", num_files=1, trajectories_per_file=4)
    model = tiny_predictor()
    path = tmp_path / "p.pt"
    torch.save({"predictor": model.state_dict(), "global_step": 1, "predictor_config": model.config,
                "rollout_horizon": -1}, path)
    code = vj2.main(["--evaluate", str(path), "--validation_data_dir", str(tmp_path / "val"), "--device", "cpu"])
    assert code == 2 and capsys.readouterr().err == (f"error: --evaluate {path}: not a usable predictor checkpoint "
                                                     f"(ValueError: rollout_horizon must be an integer >= 1, got -1)\n")


def test_init_from_fine_tunes_a_predictor_from_a_weights_file(tmp_path, no_launch_env, capsys):
    """There was no way to start from a weights file (Meta's released predictor, say): --resume wants a state."""
    make_vj2_data(tmp_path, 1, 8, 8)
    data = ["--processed_data_dir", str(tmp_path / "train"), "--validation_data_dir", str(tmp_path / "val"),
            "--device", "cpu", "--preset", "tiny", "--rollout_horizon", "1"]
    assert vj2.main([*data, "--checkpoint_dir", str(tmp_path / "a"), "--max_steps", "4", "--val_every_iters", "4"]) == 0
    final = tmp_path / "a" / "vjepa2_final.pt"
    # a learning rate too small to move the weights: the first validation scores the file's weights
    assert vj2.main([*data, "--checkpoint_dir", str(tmp_path / "b"), "--max_steps", "1", "--val_every_iters", "1",
                     "--lr", "1e-12", "--init_from", str(final)]) == 0
    first_val = [r for r in metrics(tmp_path / "b", "val")][0]["val_loss"]
    assert first_val == pytest.approx(torch.load(final, weights_only=True)["val_loss"], rel=1e-5)
    assert f"weights initialised from {final} (step 4 of the run that saved it)" in \
        (tmp_path / "b" / "rank_0.log").read_text()
    capsys.readouterr()
    assert vj2.main([*data, "--checkpoint_dir", str(tmp_path / "c"), "--depth", "3", "--init_from", str(final)]) == 2
    assert f"error: init_from {final}: its predictor_config differs from this model's (depth: 1 there, 3 here)" \
        in capsys.readouterr().err
    # the same action_dim (A*C) of another layout would read the actions scrambled (from a review)
    other = torch.load(final, weights_only=True)
    T_, P_, D_, A_, C_ = other["data_geometry"]
    other["data_geometry"] = [T_, P_, D_, A_ * C_ // 2, 2]
    torch.save(other, tmp_path / "other_layout.pt")
    assert vj2.main([*data, "--checkpoint_dir", str(tmp_path / "d"), "--init_from", str(tmp_path / "other_layout.pt")]) == 2
    assert f"its data_geometry differs from this model's ({other['data_geometry']} there, [{T_}, {P_}, {D_}, {A_}, " \
           f"{C_}] here)" in capsys.readouterr().err


def test_test_mode_without_data_writes_its_own_into_the_run_dir(tmp_path, no_launch_env):
    """`--test` needed both data dirs, where the LM's runs alone (from a user test)."""
    ck = tmp_path / "ck"
    assert vj2.main(["--test", "--device", "cpu", "--checkpoint_dir", str(ck), "--max_steps", "4"]) == 0
    data = ck / "test_data"
    assert sorted(p.name for p in (data / "train").iterdir()) == ["train_00000.npz", "train_00001.npz"]
    assert sorted(p.name for p in (data / "val").iterdir()) == ["val_00000.npz"]
    assert [r["step"] for r in metrics(ck, "train")] == [1, 2, 3, 4]
    written = {p: p.stat().st_mtime_ns for p in data.rglob("*.npz")}
    recorded = yaml.safe_load((ck / "config.yaml").read_text())
    assert (recorded["processed_data_dir"], recorded["validation_data_dir"]) == (str(data / "train"), str(data / "val"))
    # a longer relaunch continues the run on the same files, not on new ones
    assert vj2.main(["--test", "--device", "cpu", "--checkpoint_dir", str(ck), "--max_steps", "6"]) == 0
    assert [r["step"] for r in metrics(ck, "train")] == [1, 2, 3, 4, 5, 6]
    assert {p: p.stat().st_mtime_ns for p in data.rglob("*.npz")} == written
    with pytest.raises(SystemExit):  # one data dir given: the other is still required
        vj2.parse_args(["--test", "--processed_data_dir", str(data / "train")])


def test_evaluate_names_a_checkpoint_of_the_language_model(tmp_path, no_launch_env, capsys):
    """It said `not a usable predictor checkpoint (KeyError: 'predictor_config')` (from a user test)."""
    gen.generate(tmp_path / "val", num_files=1, trajectories_per_file=4)
    path = tmp_path / "model_final.pt"
    torch.save({"model": {}, "global_step": 60, "model_config": {"vocab_size": 64}}, path)
    code = vj2.main(["--evaluate", str(path), "--validation_data_dir", str(tmp_path / "val"), "--device", "cpu"])
    assert code == 2 and capsys.readouterr().err == (
        f"error: --evaluate {path}: holds no predictor (ddp_training.py's language model): its keys are "
        f"['global_step', 'model', 'model_config']; expected a weights file of this script (keys 'predictor' and "
        f"'predictor_config')\n")


def test_a_failed_evaluation_is_one_line_and_debug_prints_its_traceback(tmp_path, no_launch_env, capsys, monkeypatch):
    """--evaluate has no run dir to log a traceback to: the error line says how to get it, and --debug prints it."""
    gen.generate(tmp_path / "val", num_files=1, trajectories_per_file=4)
    model = tiny_predictor()
    path = tmp_path / "p.pt"
    torch.save({"predictor": model.state_dict(), "global_step": 1, "predictor_config": model.config,
                "rollout_horizon": 1}, path)

    def broken_loss(model, batch, rollout_horizon):
        raise ValueError("injected in the loss")

    (tmp_path / "val" / "junk.npz").write_bytes(b"not a zip")  # skipped: a warning line, as training logs it
    command = ["--evaluate", str(path), "--validation_data_dir", str(tmp_path / "val"), "--device", "cpu",
               "--skip_bad_files"]
    assert vj2.main(command) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"WARNING: skipping bad data file: {tmp_path / 'val' / 'junk.npz'}") and \
        "UserWarning" not in err and err.count("\n") == 1, err
    monkeypatch.setattr(vj2, "vj2_loss", broken_loss)
    assert vj2.main(command) == 1
    err = capsys.readouterr().err.split("\n", 1)[1]  # after the skipped file's line
    assert err.startswith("error: rank 0: EvaluationFailed: evaluation failed on rank 0: ValueError: injected in the "
                          "loss (at test_vj2_training.py:") and err.endswith("; --debug prints its traceback\n"), err
    assert err.count("\n") == 1, err
    assert vj2.main([*command, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and ", in broken_loss\n" in err, err
    assert err.splitlines()[-1].startswith("error: rank 0: EvaluationFailed: evaluation failed on rank 0: ValueError")


def test_validation_data_of_another_geometry_is_refused_before_training(tmp_path, no_launch_env, capsys):
    make_vj2_data(tmp_path, 1, 8, 8)
    gen.generate(tmp_path / "wide", num_files=1, trajectories_per_file=4, seed=1, embed_dim=16)
    code = vj2.main(["--processed_data_dir", str(tmp_path / "train"), "--validation_data_dir", str(tmp_path / "wide"),
                     "--device", "cpu", "--preset", "tiny", "--checkpoint_dir", str(tmp_path / "ckpt"),
                     "--max_steps", "2"])
    err = capsys.readouterr().err
    assert code == 2 and (f"error: --validation_data_dir: geometry T={T} P={P} D=16 A={A} C={C} differs from the "
                          f"training data's T={T} P={P} D={D} A={A} C={C}") in err, err
    assert err.count("differs from the training data's") == 1, err  # not also as a log line on the console
    assert "ERROR: set-up failed: --validation_data_dir: geometry" in (tmp_path / "ckpt" / "rank_0.log").read_text()
    assert not (tmp_path / "ckpt" / "vjepa2_final.pt").exists()


def test_a_ctrl_c_while_the_data_is_checked_is_logged_as_a_stop_not_a_failure(tmp_path, no_launch_env, monkeypatch):
    """It was 'ERROR: set-up stopped: KeyboardInterrupt', which training_logs showed as a failed set-up."""
    import training_logs

    def interrupted(args):
        raise KeyboardInterrupt
    make_vj2_data(tmp_path, 1, 8, 8)
    monkeypatch.setattr(vj2, "check_disjoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        vj2.main(["--processed_data_dir", str(tmp_path / "train"), "--validation_data_dir", str(tmp_path / "val"),
                  "--device", "cpu", "--preset", "tiny", "--checkpoint_dir", str(tmp_path / "ckpt")])
    log = (tmp_path / "ckpt" / "rank_0.log").read_text()
    assert f"WARNING: {rt.CTRL_C_BEFORE_TRAINING}" in log and "ERROR" not in log, log
    row = training_logs.summarize(training_logs.load_runs([str(tmp_path / "ckpt")])[0])
    assert row["status"] == "stopped in set-up", row


def test_a_checkpoint_dir_that_is_a_file_is_refused_naming_that_flag(tmp_path, no_launch_env, capsys):
    """The logs go to the checkpoint dir unless --log_dir says otherwise: the error named log_dir, a flag the
    user never gave."""
    make_vj2_data(tmp_path, 1, 8, 8)
    taken = tmp_path / "afile"
    taken.write_text("mine")
    code = vj2.main(["--processed_data_dir", str(tmp_path / "train"), "--validation_data_dir", str(tmp_path / "val"),
                     "--device", "cpu", "--preset", "tiny", "--checkpoint_dir", str(taken), "--max_steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: checkpoint_dir {taken} (the log_dir too): cannot write rank_0.log there" in err, err
    assert taken.read_text() == "mine"


def test_a_rollout_horizon_longer_than_the_data_is_refused_naming_the_flag(tmp_path, no_launch_env, capsys):
    """In one process (the 2-rank case is a multi test): before training, not a predictor error mid-step."""
    make_vj2_data(tmp_path, 1, 8, 8)
    code = vj2.main(["--processed_data_dir", str(tmp_path / "train"), "--validation_data_dir", str(tmp_path / "val"),
                     "--device", "cpu", "--preset", "tiny", "--checkpoint_dir", str(tmp_path / "ckpt"),
                     "--max_steps", "2", "--rollout_horizon", str(T)])
    err = capsys.readouterr().err
    assert code == 2 and f"error: --processed_data_dir: {tmp_path / 'train'}: trajectories have T={T} steps, so at " \
        f"most T-1={T - 1} rollout steps, but rollout_horizon={T}" in err, err


def test_the_seed_fixes_the_predictors_initial_weights(tmp_path, no_launch_env):
    """Two runs of one seed train the same weights, whatever ran before them in the process; another seed
    starts elsewhere."""
    make_vj2_data(tmp_path, 1, 8, 8)

    def final_weights(name, seed):
        assert vj2.main(["--processed_data_dir", str(tmp_path / "train"), "--validation_data_dir",
                         str(tmp_path / "val"), "--device", "cpu", "--preset", "tiny", "--checkpoint_dir",
                         str(tmp_path / name), "--max_steps", "1", "--val_every_iters", "0", "--seed", seed]) == 0
        return torch.load(tmp_path / name / "vjepa2_final.pt", weights_only=True)["predictor"]
    a, b, other = final_weights("a", "3"), final_weights("b", "3"), final_weights("c", "4")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["patch_in.weight"], other["patch_in.weight"])


def test_resuming_on_other_data_is_refused(tmp_path, no_launch_env, capsys):
    """The states carry a fingerprint of the training files (names, member sizes and CRC-32s): a run dir
    resumed on another data set of the same size and geometry is refused, not trained on unnoticed."""
    make_vj2_data(tmp_path, 1, 8, 8)
    gen.generate(tmp_path / "other", num_files=1, trajectories_per_file=8, seed=5)
    common = ["--validation_data_dir", str(tmp_path / "val"), "--device", "cpu", "--preset", "tiny",
              "--checkpoint_dir", str(tmp_path / "ckpt"), "--val_every_iters", "0"]
    assert vj2.main([*common, "--processed_data_dir", str(tmp_path / "train"), "--max_steps", "2"]) == 0
    capsys.readouterr()
    assert vj2.main([*common, "--processed_data_dir", str(tmp_path / "other"), "--max_steps", "4"]) == 2
    assert "was written while training on other data" in capsys.readouterr().err
    # nor with another loss or validation set: the best validation loss so far was measured with the first
    train = ["--processed_data_dir", str(tmp_path / "train"), "--max_steps", "4"]
    assert vj2.main([*common, *train, "--rollout_horizon", "1"]) == 2
    assert "was written with rollout_horizon=2, this run has rollout_horizon=1; resuming with a different " \
        "rollout_horizon is refused" in capsys.readouterr().err
    assert vj2.main([*common, *train, "--num_heads", "4"]) == 2  # the weights' shapes alone would not tell
    assert "was written with predictor num_heads=2, this run has predictor num_heads=4" in capsys.readouterr().err
    other_val = [*common[2:], "--validation_data_dir", str(tmp_path / "other")]
    assert vj2.main([*other_val, *train]) == 2
    assert "was written with validation data (fingerprint)=" in capsys.readouterr().err
    assert vj2.main([*common, *train]) == 0  # its own
    assert torch.load(tmp_path / "ckpt" / "vjepa2_final.pt", weights_only=True)["global_step"] == 4


def test_evaluate_reports_each_loss_term_under_its_own_name(tmp_path, no_launch_env, capsys):
    """--evaluate of the final weights on the validation set the run used gives the jloss and sloss its last
    validation logged (val_jloss, val_sloss), each under its own name, not merely a right total."""
    make_vj2_data(tmp_path, 1, 8, 8)
    data = ["--validation_data_dir", str(tmp_path / "val"), "--device", "cpu"]
    assert vj2.main([*data, "--processed_data_dir", str(tmp_path / "train"), "--checkpoint_dir", str(tmp_path / "ckpt"),
                     "--preset", "tiny", "--max_steps", "4", "--val_every_iters", "4", "--rollout_horizon", "1"]) == 0
    (val,) = [r for r in metrics(tmp_path / "ckpt", "val") if r["step"] == 4]
    assert val["val_jloss"] != pytest.approx(val["val_sloss"], rel=1e-3)  # the terms can be told apart
    capsys.readouterr()
    assert vj2.main(["--evaluate", str(tmp_path / "ckpt" / "vjepa2_final.pt"), *data]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["jloss"] == pytest.approx(val["val_jloss"], rel=1e-5)
    assert out["sloss"] == pytest.approx(val["val_sloss"], rel=1e-5)


def test_a_run_refused_by_the_run_dir_lock_writes_nothing_there(tmp_path, no_launch_env, capsys):
    """The data checks log before the trainer takes the run dir's lock: their lines wait for it, so a run
    refused there leaves the holder's rank_0.log as it was; a run that gets the dir writes them first."""
    make_vj2_data(tmp_path, 1, 8, 8)
    ckpt = tmp_path / "ckpt"
    argv = ["--processed_data_dir", str(tmp_path / "train"), "--validation_data_dir", str(tmp_path / "val"),
            "--device", "cpu", "--preset", "tiny", "--checkpoint_dir", str(ckpt), "--max_steps", "1"]
    holder = rt.RunDirLock(ckpt)
    assert holder.acquire() is None
    try:
        assert vj2.main(argv) == 2
        assert "are in use by pid" in capsys.readouterr().err
        assert sorted(p.name for p in ckpt.iterdir()) == [".lock"]
    finally:
        holder.release()
    # bad data, while another process holds the dir: the lines of the refused set-up do not go there either
    holder = subprocess.Popen([sys.executable, "-c", f"import ddp_runtime as rt, sys, time\n"
                               f"lock = rt.RunDirLock({str(ckpt)!r})\nassert lock.acquire() is None\nprint('locked', flush=True)\n"
                               f"time.sleep(60)"], stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert vj2.main([*argv, "--rollout_horizon", "9"]) == 2
        assert f"is in use by pid {holder.pid} on " in capsys.readouterr().err
        assert sorted(p.name for p in ckpt.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    assert vj2.main(argv) == 0
    lines = (ckpt / "rank_0.log").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if "INFO: train: " in line)
    assert first < next(i for i, line in enumerate(lines) if "INFO: rank 0/1, local_rank 0" in line)
    assert sum("INFO: train: " in line for line in lines) == 1


def test_a_set_up_stopped_during_the_data_checks_still_logs_them(tmp_path):
    """The kept lines are written when set-up ends for any other reason than another run's lock: here a stop
    during a slow data check, which the set-up watch ends after its grace with a marker and exit 75."""
    make_vj2_data(tmp_path, 1, 8, 8)
    child = tmp_path / "stop_in_checks.py"
    child.write_text(f"""import os, signal, sys, threading, time
import vj2ac_train_multi_gpu as vj2
real = vj2.load_dataset
def slow(flag, path, args, logger=None):
    dataset = real(flag, path, args, logger)
    if flag == "--validation_data_dir":  # a data check over many files: the scheduler stops the job meanwhile
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        time.sleep(10)
    return dataset
vj2.load_dataset = slow
sys.exit(vj2.main(["--processed_data_dir", {str(tmp_path / 'train')!r}, "--validation_data_dir",
                   {str(tmp_path / 'val')!r}, "--device", "cpu", "--preset", "tiny", "--checkpoint_dir",
                   {str(tmp_path / 'ckpt')!r}, "--max_steps", "1"]))
""")
    r = run([sys.executable, child], cwd=tmp_path, timeout=60, env=clean_env(SETUP_STOP_GRACE_S="1"))
    assert r.returncode == rt.EXIT_PREEMPTED, r.stdout[-2000:]
    log = (tmp_path / "ckpt" / "rank_0.log").read_text()
    assert "INFO: [DDP] Initializing with backend=none (1 process), device=cpu" in log, log
    assert json.loads((tmp_path / "ckpt" / "PREEMPTED").read_text())["stopped_during"] == "set-up"


@pytest.mark.multi
def test_rollout_horizon_longer_than_the_data_fails_fast_on_both_ranks(tmp_path):
    gen.generate(tmp_path / "short", num_files=1, trajectories_per_file=8, steps=2)
    gen.generate(tmp_path / "short_val", num_files=1, trajectories_per_file=8, steps=2, seed=1)
    t0 = time.time()
    # a slow agent poll gives the second rank time to fail on its own before the agent stops the group
    r = run(torchrun(2, SCRIPT, "--device", "cpu", "--processed_data_dir", tmp_path / "short",
                     "--validation_data_dir", tmp_path / "short_val", "--rollout_horizon", "2", "--log_dir", "logs",
                     "--checkpoint_dir", "ckpt", extra=("--monitor-interval", "3")), cwd=tmp_path, timeout=120)
    assert r.returncode != 0 and time.time() - t0 < 120  # 10 s here: a refusal, not a hang until dist_timeout
    assert "error: --processed_data_dir" in r.stdout and "T=2" in r.stdout and "rollout_horizon=2" in r.stdout
    for rank in (0, 1):
        text = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
        assert "T=2" in text and "rollout_horizon=2" in text and "step 1/" not in text
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("val", ["train", "./train/", "train/train_00001.npz"])
def test_training_and_validation_data_sharing_a_file_is_refused(tmp_path, monkeypatch, no_launch_env, capsys, val):
    make_vj2_data(tmp_path, 2, 4, 4)
    monkeypatch.chdir(tmp_path)
    code = vj2.main(["--device", "cpu", "--processed_data_dir", "train", "--validation_data_dir", val,
                     "--checkpoint_dir", "ckpt"])
    err = capsys.readouterr().err
    assert code == 2, err
    shared = "train_00001.npz" if val.endswith(".npz") else "train_00000.npz"
    assert f"--processed_data_dir train and --validation_data_dir {val} share" in err
    assert f"(e.g. train/{shared})" in err and "expected disjoint training and validation" in err
    assert "rank_0.log" in {p.name for p in (tmp_path / "ckpt").iterdir()}  # logged, then stopped
    assert not (tmp_path / "ckpt" / "vjepa2_final.pt").exists()


@pytest.mark.parametrize("how, reason", [("hard link", "the same file (a hard link)"),
                                         ("symlink", "the same path"),  # named by the link, not by its target
                                         ("copy", "a copy (same CRC-32 and size of 'embeddings' and 'actions')")])
def test_a_training_file_under_another_name_is_refused_as_validation_data(tmp_path, monkeypatch, no_launch_env,
                                                                          capsys, how, reason):
    make_vj2_data(tmp_path, 2, 4, 4)
    monkeypatch.chdir(tmp_path)
    source, target = tmp_path / "train" / "train_00001.npz", tmp_path / "val" / "val_00001.npz"
    {"hard link": os.link, "symlink": lambda s, t: t.symlink_to(s), "copy": shutil.copyfile}[how](source, target)
    code = vj2.main(["--device", "cpu", "--processed_data_dir", "train", "--validation_data_dir", "val",
                     "--checkpoint_dir", "ckpt", "--max_steps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--processed_data_dir train and --validation_data_dir val share 1 .npz files" in err
    assert f"(e.g. train/train_00001.npz and val/val_00001.npz: {reason})" in err
    assert not (tmp_path / "ckpt" / "vjepa2_final.pt").exists()


def test_evaluate_refuses_data_whose_action_layout_differs_from_the_training_data(tmp_path, no_launch_env, capsys):
    """5 x 6 actions per step fill the predictor's A*C=30 inputs as 10 x 3 do: accepted, and scored on
    scrambled actions, before the checkpoint said what it trained on."""
    gen.generate(tmp_path / "val", num_files=1, trajectories_per_file=4, steps=T, patches=P, embed_dim=D,
                 actions_per_step=5, channels=6)
    model = tiny_predictor()
    path = tmp_path / "p.pt"
    saved = {"predictor": model.state_dict(), "global_step": 1, "predictor_config": model.config}
    data = ["--validation_data_dir", str(tmp_path / "val"), "--device", "cpu"]
    torch.save({**saved, "data_geometry": [T, P, D, A, C]}, path)
    assert vj2.main(["--evaluate", str(path), *data]) == 2
    assert capsys.readouterr().err == (f"error: --validation_data_dir: data geometry T={T} P={P} D={D} A=5 C=6 "
                                       f"differs from the training data's T={T} P={P} D={D} A={A} C={C} in A and "
                                       f"C\n")
    torch.save(saved, path)  # a checkpoint from before data_geometry: shapes only, as then
    assert vj2.main(["--evaluate", str(path), *data]) == 0
    torch.save({**saved, "data_geometry": [T, P, D, 5]}, path)
    assert vj2.main(["--evaluate", str(path), *data]) == 2
    assert "data_geometry must be a list of 5 integers (T, P, D, A, C), got [4, 16, 32, 5]" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (dict(num_heads=3), "predictor_dim=32 must be divisible by num_heads=3"),
    (dict(num_heads=0), "predictor_config num_heads must be an integer >= 1, got 0"),
    # divides 32, builds and loads, and failed only in the forward pass
    (dict(num_heads=-4), "predictor_config num_heads must be an integer >= 1, got -4"),
    # layer norm over one value is 0 for every token: a loss of 0, no gradient, and "completed"
    (dict(embed_dim=1), "predictor_config embed_dim must be >= 2"),
])
def test_evaluate_refuses_an_inconsistent_predictor_config(tmp_path, no_launch_env, capsys, change, message):
    gen.generate(tmp_path / "val", num_files=1, trajectories_per_file=4, steps=T, patches=P, embed_dim=D,
                 actions_per_step=A, channels=C)
    model = tiny_predictor()
    path = tmp_path / "bad.pt"
    torch.save({"predictor": model.state_dict(), "global_step": 1,
                "predictor_config": {**model.config, **change}}, path)
    code = vj2.main(["--evaluate", str(path), "--validation_data_dir", str(tmp_path / "val"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --evaluate {path}: not a usable predictor checkpoint"), err
    assert message in err


def test_corrupt_file_is_named_and_can_be_skipped(tmp_path, no_launch_env):
    make_vj2_data(tmp_path, 2, 8, 4)
    good = (tmp_path / "train" / "train_00000.npz").read_bytes()
    (tmp_path / "train" / "broken.npz").write_bytes(good[: len(good) // 2])
    common = ("--device", "cpu", "--processed_data_dir", tmp_path / "train", "--validation_data_dir",
              tmp_path / "val", "--batch_size", "4", "--checkpoint_dir", "ckpt")
    r = run(script(*common), cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "broken.npz" in r.stdout and "--processed_data_dir" in r.stdout, r.stdout
    assert not (tmp_path / "ckpt" / "vjepa2_final.pt").exists()
    r = run(script(*common, "--skip_bad_files", "--max_steps", "3"), cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "skipping bad data file" in r.stdout and "broken.npz" in r.stdout
    assert "16 trajectories, 1 skipped" in r.stdout
    assert torch.load(tmp_path / "ckpt" / "vjepa2_final.pt", weights_only=True)["global_step"] == 3


def test_interrupted_run_saves_its_weights_and_exits_preempted(tmp_path):
    make_vj2_data(tmp_path, 1, 64, 4)
    metrics_file = tmp_path / "ckpt" / "metrics.jsonl"
    cmd = script("--device", "cpu", "--processed_data_dir", tmp_path / "train", "--validation_data_dir",
                 tmp_path / "val", "--batch_size", "2", "--num_epochs", "50", "--val_every_iters", "0",
                 "--checkpoint_dir", "ckpt")
    with background(cmd, tmp_path) as proc:
        wait_for_step(metrics_file, 1, timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == rt.EXIT_PREEMPTED, out[-4000:]
    ckpt = torch.load(tmp_path / "ckpt" / "vjepa2_interrupted.pt", weights_only=True)
    assert ckpt["global_step"] >= 1
    # val_loss only if these weights were validated (no validation runs mid-epoch here)
    vals = [r for r in metrics(metrics_file.parent, "val") if r["step"] == ckpt["global_step"]]
    assert set(ckpt) == {"predictor", "global_step", "predictor_config", "rollout_horizon", "data_geometry"} | \
        ({"val_loss"} if vals else set())
    if vals:
        assert ckpt["val_loss"] == vals[-1]["val_loss"]
    assert not (tmp_path / "ckpt" / "vjepa2_final.pt").exists()


def documented_data(cwd):
    """The README's data command (its validation files named val_*, no longer train_* in val_data)."""
    run([sys.executable, REPO / "create_synthetic_data.py", "--output_dir", "./train_data", "--num_files", "3",
         "--trajectories_per_file", "10", "--val_fraction", "0.34", "--val_output_dir", "./val_data"],
        cwd=cwd, check=True, timeout=60)
    assert sorted(p.name for p in (cwd / "val_data").iterdir()) == ["val_00000.npz"]


@pytest.mark.multi
def test_documented_cpu_command(tmp_path):
    documented_data(tmp_path)
    # as documented, plus --standalone (a free rendezvous port, so parallel runs cannot collide on 29500)
    t0 = time.time()
    r = run(torchrun(2, SCRIPT, "--device", "cpu", "--dist-backend", "gloo", "--processed_data_dir", "./train_data",
                     "--validation_data_dir", "./val_data", "--num_epochs", "1", "--batch_size", "2",
                     "--save_every_iters", "100"), cwd=tmp_path, timeout=120, env=clean_env())
    wall = time.time() - t0
    assert r.returncode == 0, r.stdout[-6000:]
    assert wall < 120
    (run_dir,) = (tmp_path / "checkpoints").iterdir()  # checkpoints/<run_name>, shared by both ranks
    assert run_dir.name == "vj2ac"
    # 30 trajectories, 2 ranks, 2 per step: 7 steps, so no step_N (every 100) and no epoch_N (off by default)
    assert {p.name for p in run_dir.iterdir() if WEIGHTS_FILE.match(p.name)} == {"vjepa2_best.pt", "vjepa2_final.pt"}
    assert {"rank_0.log", "rank_1.log", "metrics.jsonl"} <= {p.name for p in run_dir.iterdir()}
    records = metrics(run_dir)
    first_loss = next(r["loss"] for r in records if r["type"] == "train")
    summary = records[-1]
    assert summary["type"] == "summary" and summary["steps"] == 7
    # even 7 steps learn something (measured: 2.25 untrained, 1.35 after)
    assert summary["final_val_loss"] < 0.75 * first_loss
    assert "[DDP] Dataloader created with 30 samples, batch_size=2" in r.stdout
    assert "preset small" in r.stdout


@pytest.mark.multi
def test_documented_shuffle_actions_check_shows_a_clear_rise(tmp_path):
    # After the documented 1-epoch run the predictor has barely learned to use the actions (1.34916 vs
    # 1.34962 shuffled), so the README's check trains longer on the same data.
    documented_data(tmp_path)
    r = run(torchrun(2, SCRIPT, "--device", "cpu", "--dist-backend", "gloo", "--processed_data_dir", "./train_data",
                     "--validation_data_dir", "./val_data", "--num_epochs", "30", "--batch_size", "2",
                     "--run_name", "vj2ac_30"), cwd=tmp_path, timeout=180, env=clean_env())
    assert r.returncode == 0, r.stdout[-6000:]
    losses = []
    for extra in ((), ("--shuffle_actions",)):
        r = run(script("--evaluate", "checkpoints/vj2ac_30/vjepa2_final.pt", "--validation_data_dir", "./val_data",
                       *extra), cwd=tmp_path, timeout=60, merge_stderr=False)
        assert r.returncode == 0, r.stderr[-4000:]
        losses.append(json.loads(r.stdout)["loss"])
    # measured on 2 cores: 1.117 with the true actions, 1.262 with another trajectory's (+13%)
    assert losses[1] > 1.1 * losses[0], losses
