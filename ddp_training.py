"""DDPTrainer: the one training loop of the kit, and a small causal transformer LM it
trains by default on a learnable synthetic source (a random Markov chain whose entropy
rate is the loss floor) or on a real corpus (`--data file.txt|tokens.npy`).

    python ddp_training.py --cpu --test                 # one process, seconds
    python ddp_training.py --cpu --nproc 2              # two gloo processes, no torchrun
    torchrun --standalone --nproc_per_node=2 ddp_training.py --cpu
    python -c "from ddp_training import DDPTrainer; DDPTrainer(rank=0, world_size=1, config={'max_steps': 50, 'run_name': 'api'}).train()"

Every control decision (skip a step, stop early, stop on a signal) is taken from an
all-reduced value, so all ranks take the same branch at the same step.
"""

from __future__ import annotations

import signal

import early_signals

# Run as a script, the stop signals that schedulers send are caught from here, before torch's import
# (seconds), and train_preemptible takes them over. __mp_main__: an --nproc rank (spawned) imports this file
# again; its parent tells of a Ctrl-C for all of them.
EARLY_STOPS: list = early_signals.catch_stops() if __name__ == "__main__" else []
if __name__ in ("__main__", "__mp_main__"):
    _SIGINT_AT_START = early_signals.quiet_ctrl_c(say=__name__ == "__main__")

import argparse
import collections.abc
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import io
import itertools
import json
import logging
import math
import numbers
import os
import random
import re
import secrets
import sys
import tempfile
import time
import traceback
import typing
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_runtime as rt
from training_logs import json_safe


# ----------------------------------------------------------------------------
# Configuration: every default written once, here
# ----------------------------------------------------------------------------

# The allowed values of the keys that take a word
CHOICES = {"lr_schedule": ("cosine", "wsd", "constant"), "loss_normalization": ("token", "sample"),
           "amp_dtype": ("auto", "bf16", "fp16"), "data_strategy": ("shard", "dispatch"),
           "device": ("auto", "cuda", "cpu"), "dist_backend": (None, "nccl", "gloo")}

# What every TrainConfig key means: its --help text
HELP = {
    "vocab_size": "token ids of the synthetic data (a --data file sets its own)",
    "hidden_size": "width of the LM", "num_layers": "transformer blocks", "num_heads": "attention heads",
    "dropout": "dropout probability", "seq_len": "tokens per training sequence",
    "data": "text file (byte tokens, vocab 256) or .npy of token ids (memory-mapped); unset: a synthetic Markov "
            "chain",
    "dataset_size": "synthetic training sequences", "markov_branching": "successors per token in the synthetic chain",
    "val_fraction": "share of the data held out for validation (synthetic data: at least 64 sequences); 0 = none",
    "test_fraction": "share held out for the test (as val_fraction)",
    "num_workers": "DataLoader workers per rank",
    "pin_memory": "page-locked host memory on CUDA (batches, checkpoint host copies)",
    "data_strategy": "shard: every rank reads its own part; dispatch: rank 0 reads global batches and sends each "
                     "rank its part (for streams)",
    "loader_timeout": "seconds a rank waits for a batch from its DataLoader workers before the run fails (a stuck "
                      "worker: a hung read, a deadlock); without workers, a read in the rank's own process fails "
                      "at 4x this or past dist_timeout, whichever is later",
    "batch_size": "samples per rank and micro-step", "grad_accum_steps": "micro-steps per optimizer step (no_sync)",
    "learning_rate": "peak AdamW learning rate",
    "weight_decay": "AdamW decay, on parameters of 2+ dimensions (not biases, norm gains)",
    "grad_clip": "clip the global gradient norm to this; 0 = off",
    "lr_schedule": "learning-rate shape after warm-up, counted in optimizer steps",
    "warmup_steps": "linear warm-up steps", "min_lr_ratio": "the schedule's floor as a share of the peak, in [0, 1]",
    "num_epochs": "passes over the training data", "max_steps": "optimizer steps; 0 = num_epochs worth",
    "loss_normalization": "token: global mean over all counted tokens; sample: mean of per-sample means",
    "use_amp": "mixed precision on CUDA (bf16 where supported, else fp16 with a GradScaler)",
    "amp_dtype": "autocast dtype; on the CPU only an explicit bf16 turns autocast on",
    "seed": "model init, data order and every rank's RNG streams",
    "device": "auto: cuda if available", "dist_backend": "unset: nccl with CUDA, else gloo",
    "dist_timeout": "seconds a collective may wait before it is an error on every rank",
    "first_step_timeout": "a longer wait for the first step (compilation, warm-up) when above dist_timeout",
    "find_unused_parameters": "DDP option for models whose loss leaves parameters without gradients",
    "bucket_cap_mb": "DDP gradient bucket size in MiB; unset: DDP's (25, the first one 1)",
    "static_graph": "DDP static_graph; unset: on for models that declare it, unless find_unused_parameters or "
                    "grad_accum_steps > 1",
    "compile": "torch.compile the model before the DDP wrap",
    "val_interval": "steps between validations; 0 = at the end of every epoch",
    "patience": "validations without an improvement by more than min_delta before stopping; 0 = off",
    "min_delta": "the improvement that resets patience", "target_loss": "stop once the validation loss is <= this",
    "run_name": "names the run dir, runs/<run_name>", "log_dir": "the run dir; unset: runs/<run_name>",
    "tensorboard": "also write the metrics as TensorBoard scalars (needs tensorboard)",
    "log_interval": "steps between periodic log lines (a progress bar instead on a terminal)",
    "debug": "DEBUG logs, console output from every rank",
    "memory_check_interval": "steps between memory readings",
    "cleanup_interval": "steps between gc.collect/empty_cache (a full gc costs ~0.2 s once torch is imported)",
    "max_memory_gb": "warn above this much CUDA reserved memory, or anonymous memory on the CPU",
    "checkpoint_dir": "unset: <log_dir>/checkpoints", "checkpoint_prefix": "<prefix>_step_N.pt, <prefix>_final.pt, ...",
    "save_interval": "epochs between <prefix>_epoch_N.pt and a resumable state; 0 = off",
    "save_every_iters": "steps between <prefix>_step_N.pt and a resumable state; 0 = off",
    "resume": "auto: the newest state in checkpoint_dir that loads | none | PATH of a state",
    "init_from": "a fresh run's weights from this file (fine-tuning: a weights file, or the model of a state); "
                 "a resumed run has its own",
    "keep_states": "resumable states kept, newest first; 0 = all",
    "keep_checkpoints": "<prefix>_step_N.pt files kept, newest first, and as many <prefix>_epoch_N.pt; 0 = all",
    "async_checkpoint": "rank 0 writes checkpoints on a background thread from a host copy",
    "max_errors_per_epoch": "batches that may fail to load per epoch before the run stops",
    "max_bad_steps": "the run stops at this many skipped steps in a row (non-finite, or nothing counted)",
}


@dataclass
class TrainConfig:
    """Every key of a run, with its default; HELP above says what each means."""
    # model (the default LM)
    vocab_size: int = 64
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    dropout: float = 0.0
    seq_len: int = 64
    # data
    data: Optional[str] = None
    dataset_size: int = 4096
    markov_branching: int = 4
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    num_workers: int = 0
    pin_memory: bool = True
    data_strategy: str = "shard"
    loader_timeout: float = 120.0
    # optimisation
    batch_size: int = 32
    grad_accum_steps: int = 1
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    lr_schedule: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    num_epochs: int = 3
    max_steps: int = 0
    loss_normalization: str = "token"
    use_amp: bool = True
    amp_dtype: str = "auto"
    seed: int = 1337
    # distributed
    device: str = "auto"
    dist_backend: Optional[str] = None
    dist_timeout: float = rt.DEFAULT_DIST_TIMEOUT_S
    first_step_timeout: float = 0.0
    find_unused_parameters: bool = False
    bucket_cap_mb: Optional[float] = None
    static_graph: Optional[bool] = None
    compile: bool = False
    # evaluation and stopping
    val_interval: int = 0
    patience: int = 0
    min_delta: float = 0.0
    target_loss: Optional[float] = None
    # logging, memory
    run_name: str = "lm"
    log_dir: Optional[str] = None
    tensorboard: bool = False
    log_interval: int = 10
    debug: bool = False
    memory_check_interval: int = 50
    cleanup_interval: int = 1000
    max_memory_gb: float = 16.0
    # checkpoints
    checkpoint_dir: Optional[str] = None
    checkpoint_prefix: str = "model"
    save_interval: int = 1
    save_every_iters: int = 0
    resume: str = "auto"
    init_from: Optional[str] = None
    keep_states: int = 2
    keep_checkpoints: int = 0
    async_checkpoint: bool = True
    # faults
    max_errors_per_epoch: int = 5
    max_bad_steps: int = 5

    @classmethod
    def from_dict(cls, cfg, builtin_lm: bool = True) -> "TrainConfig":
        """A config from a dict of keys to change from the defaults (or a TrainConfig), checked; the built-in
        LM's keys only where it is the model (`builtin_lm`): with the caller's model they change nothing."""
        cfg = dataclasses.asdict(cfg) if isinstance(cfg, TrainConfig) else dict(cfg or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in cfg:
            if key not in known:
                raise ValueError(f"unknown config key {key!r}{rt.name_hint(key, known)}; known keys: "
                                 f"{', '.join(sorted(known))}")
        hints = typing.get_type_hints(cls)
        out = cls(**{key: _typed(key, value, hints[key]) for key, value in cfg.items()})
        out.check(builtin_lm)
        out.log_dir = out.log_dir or str(Path("runs") / out.run_name)
        out.checkpoint_dir = out.checkpoint_dir or str(Path(out.log_dir) / "checkpoints")
        return out

    def check(self, builtin_lm: bool = True) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"config key {f.name!r} must be a finite number, got {value}")
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"config key {key!r} must be one of {allowed}, got {getattr(self, key)!r}")
        lm_keys = ("seq_len", "hidden_size", "num_layers", "num_heads", "vocab_size", "dataset_size",
                   "markov_branching")
        for key in ("batch_size", "grad_accum_steps", "log_interval", "max_bad_steps",
                    *(lm_keys if builtin_lm else ())):
            if getattr(self, key) < 1:
                raise ValueError(f"config key {key!r} must be >= 1, got {getattr(self, key)}")
        for key in ("num_epochs", "max_steps", "warmup_steps", "num_workers", "val_interval", "patience",
                    "save_interval", "save_every_iters", "keep_states", "keep_checkpoints", "memory_check_interval",
                    "cleanup_interval", "max_errors_per_epoch", "weight_decay", "grad_clip", "min_delta",
                    "first_step_timeout"):
            if getattr(self, key) < 0:
                raise ValueError(f"config key {key!r} must be >= 0, got {getattr(self, key)}")
        for key in ("learning_rate", "bucket_cap_mb", "loader_timeout"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ValueError(f"config key {key!r} must be > 0, got {getattr(self, key)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"config key 'min_lr_ratio' must be in [0, 1], got {self.min_lr_ratio}")
        for key in ("val_fraction", "test_fraction", "dropout") if builtin_lm else ():
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"config key {key!r} must be in [0, 1), got {getattr(self, key)}")
        if builtin_lm and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.num_epochs < 1 and self.max_steps < 1:
            raise ValueError("set num_epochs >= 1 or max_steps >= 1")
        # under a second, the rendezvous itself times out before the peers can meet
        if not 1 <= self.dist_timeout <= MAX_TIMEOUT_S or self.first_step_timeout > MAX_TIMEOUT_S:
            raise ValueError(f"dist_timeout must be at least 1 s and it and first_step_timeout at most "
                             f"{MAX_TIMEOUT_S:g}, got {self.dist_timeout} and {self.first_step_timeout}")
        if self.loader_timeout > MAX_TIMEOUT_S:  # Python's own waits overflow past about 1e10 s
            raise ValueError(f"config key 'loader_timeout' must be at most {MAX_TIMEOUT_S:g}, got {self.loader_timeout}")
        if not 0 <= self.seed < 2 ** 32:  # numpy's seeding range
            raise ValueError(f"config key 'seed' must be in [0, 2**32), got {self.seed}")
        # "$DATA" with DATA unset must not mean "the default"
        for key in ("data", "log_dir", "checkpoint_dir", "init_from"):
            if getattr(self, key) == "":
                raise ValueError(f"config key {key!r} must be a path (or none for the default), got an empty string")
        if (why := rt.bad_run_name(self.run_name)) is not None:
            raise ValueError(f"config key 'run_name' {why} (log_dir, checkpoint_dir)")
        # it names files in checkpoint_dir and is matched as a glob pattern there
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.checkpoint_prefix):
            raise ValueError(f"config key 'checkpoint_prefix' must be letters, digits, '.', '_' or '-' (not first), "
                             f"got {self.checkpoint_prefix!r}")


MAX_TIMEOUT_S = 1e7  # about 4 months; c10d holds timeouts in int64 ns, and 1e10 s already fails there
# Rank 0 waits for a background write this fraction of dist_timeout: the other ranks, waiting for rank 0 as long
# as dist_timeout from about the same moment, must not give up first and name a stuck rank instead of the write
WRITE_WAIT_FRACTION = 0.75


def _typed(key: str, value, tp):
    """A config value as its field's type, read the way the flag reads it: YAML gives '3e-4' as a string,
    and a wrong type would otherwise fail later, mid-run, far from the key."""
    if value is None:
        if type(None) not in typing.get_args(tp):
            raise ValueError(f"config key {key!r} must not be null")
        return None
    if isinstance(value, bool) and tp not in (bool, Optional[bool]):
        raise ValueError(f"config key {key!r} expects {_type_name(tp)}, got {value!r}")
    try:
        return _field_parser(tp, key)(str(value))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"config key {key!r} expects {_type_name(tp)}, got {value!r}") from exc


def _type_name(tp) -> str:
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    return f"{(inner or [tp])[0].__name__}{' or null' if inner else ''}"


# A quick run: tiny model, few steps, finishes in seconds on a CPU.
TEST_PRESET = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=32, dataset_size=1024,
                   batch_size=16, num_epochs=1, max_steps=60, learning_rate=1e-2, warmup_steps=5,
                   log_interval=10, val_interval=20, run_name="lm_test")  # not the default run's dir


# ----------------------------------------------------------------------------
# The default model: a small causal transformer LM (pre-LN, tied embeddings)
# ----------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CausalLM(nn.Module):
    static_graph = True  # every parameter takes part in every step: DDP may use static_graph

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                 seq_len: int, dropout: float = 0.0):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                           num_heads=num_heads, seq_len=seq_len, dropout=dropout)
        self.tok = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(seq_len, hidden_size)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden_size, num_heads, dropout) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward): 6 per parameter plus attention,
        as in the PaLM appendix; the tied embedding counts once."""
        c = self.config
        n = sum(p.numel() for p in self.parameters()) - self.pos.weight.numel()
        return 6 * n + 12 * c["num_layers"] * c["hidden_size"] * c["seq_len"]

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


IGNORE_INDEX = -100


def lm_loss(model: nn.Module, batch, normalization: str = "token"):
    """Sum of losses and how many items it sums, so the trainer can divide by the
    global count (all ranks, all micro-batches): `token` counts target tokens after
    the causal shift, `sample` averages within each sample and counts samples."""
    x, y = batch
    logits = model(x)
    per_token = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="none").view_as(y)
    mask = (y != IGNORE_INDEX)
    if normalization == "token":
        return per_token.sum(), mask.sum()
    # a sample without targets sums to 0: left in the sum (a boolean-mask index would make the host wait for the GPU)
    per_sample = per_token.sum(1) / mask.sum(1).clamp(min=1)
    return per_sample.sum(), mask.any(1).sum()


# ----------------------------------------------------------------------------
# Default data: a random Markov chain (known loss floor) or a real token file
# ----------------------------------------------------------------------------

class TokenSequences(torch.utils.data.Dataset):
    """Windows of seq_len+1 tokens from a 1-D token array (in memory or memory-mapped)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, starts: np.ndarray):
        self.tokens, self.seq_len, self.starts = tokens, seq_len, starts

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = int(self.starts[i])
        w = torch.from_numpy(np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64))
        return w[:-1], w[1:]


@dataclass
class LMData:
    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    vocab_size: int
    info: dict = field(default_factory=dict)   # loss_floor / unigram_entropy and a description


def markov_chain(vocab: int, branching: int, seed: int) -> np.ndarray:
    """A fixed random transition matrix: each token has `branching` likely successors."""
    rng = np.random.default_rng(seed)
    P = np.zeros((vocab, vocab))
    for i in range(vocab):
        succ = rng.choice(vocab, size=min(branching, vocab), replace=False)
        P[i, succ] = rng.dirichlet(np.ones(len(succ)))
    return P


def stationary(P: np.ndarray) -> np.ndarray:
    pi = np.full(len(P), 1.0 / len(P))
    for _ in range(10000):
        nxt = pi @ P
        if np.abs(nxt - pi).max() < 1e-13:
            break
        pi = nxt
    return pi / pi.sum()


def entropy_rate(P: np.ndarray) -> float:
    """Nats per token: the lowest expected cross-entropy any next-token predictor can reach."""
    with np.errstate(divide="ignore", invalid="ignore"):
        row_h = -np.where(P > 0, P * np.log(P), 0.0).sum(1)
    return float(stationary(P) @ row_h)


def sample_chain(P: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    cum = np.cumsum(P, axis=1)
    cum[:, -1] = 1.0
    out = np.empty((n, length), dtype=np.int64)
    out[:, 0] = rng.choice(len(P), size=n, p=stationary(P))
    for t in range(1, length):
        u = rng.random(n)
        out[:, t] = (u[:, None] > cum[out[:, t - 1]]).sum(1)
    return out


def synthetic_lm_data(cfg: TrainConfig) -> LMData:
    P = markov_chain(cfg.vocab_size, cfg.markov_branching, cfg.seed)
    def held_out(fraction):  # at least 64 sequences, so a small dataset_size still gets a meaningful loss; 0 = none
        return max(64, int(cfg.dataset_size * fraction)) if fraction > 0 else 0

    n_eval, n_test = held_out(cfg.val_fraction), held_out(cfg.test_fraction)
    width = cfg.seq_len + 1
    # a stream per split: the training set does not change with the held-out fractions (a resumed run with
    # another val_fraction trains on the same samples)
    seqs = np.concatenate([sample_chain(P, n, width, np.random.default_rng([cfg.seed + 1, split])).reshape(-1)
                           for split, n in enumerate((cfg.dataset_size, n_eval, n_test))])

    def part(first, count):
        return TokenSequences(seqs, cfg.seq_len, np.arange(first, first + count) * width) if count else None

    floor = entropy_rate(P)
    return LMData(part(0, cfg.dataset_size), part(cfg.dataset_size, n_eval),
                  part(cfg.dataset_size + n_eval, n_test), cfg.vocab_size,
                  dict(source=f"markov(vocab={cfg.vocab_size}, branching={cfg.markov_branching})",
                       loss_floor=round(floor, 5)))


# Larger than any tokenizer's vocabulary (the largest in use hold about 256k ids): a higher id is a corrupt
# file or numbers that are no token ids, and would otherwise surface as a failed allocation of the embedding.
MAX_VOCAB = 1 << 20
NPY_MAGIC, ZIP_MAGIC = b"\x93NUMPY", b"PK\x03\x04"


def load_tokens(path: Path) -> tuple[np.ndarray, int]:
    """Memory-mapped token ids and vocabulary size: a .npy array of ids (known by its contents, whatever its
    name), else a text file read as bytes (vocab 256)."""
    if path.is_dir():
        raise ValueError(f"--data {path}: is a directory; expected a .npy token file or a text file")
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    if path.stat().st_size == 0:  # a map of it fails, naming no file
        raise ValueError(f"--data {path}: the file is empty")
    with open(path, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if magic.startswith(ZIP_MAGIC):
        raise ValueError(f"--data {path}: a zip archive (.npz?); expected a .npy array of token ids (np.save) or "
                         f"a text file")
    if magic != NPY_MAGIC:
        if path.suffix.lower() == ".npy":
            raise ValueError(f"--data {path}: named .npy but not a NumPy array file (no .npy header)")
        return np.memmap(path, dtype=np.uint8, mode="r"), 256
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:  # a damaged header, or Python objects that cannot be mapped
        raise ValueError(f"--data {path}: cannot map it as a token array: {exc}") from exc
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"--data {path}: expected a 1-D integer array of token ids, "
                         f"got shape {tokens.shape} dtype {tokens.dtype}")
    top = low = 0
    for i in range(0, len(tokens), 1 << 24):  # chunks of the map: memory stays flat for any file size
        chunk = tokens[i:i + (1 << 24)]
        top, low = max(top, int(chunk.max())), min(low, int(chunk.min()))
    if low < 0:
        raise ValueError(f"--data {path}: token ids must be >= 0, found {low}")
    if top >= MAX_VOCAB:
        raise ValueError(f"--data {path}: token id {top} implies a vocabulary of {top + 1}; expected ids below "
                         f"{MAX_VOCAB} (a corrupt file, or numbers that are not token ids?)")
    return tokens, top + 1


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    counts = np.zeros(vocab, dtype=np.int64)
    for i in range(0, len(tokens), 1 << 24):
        counts += np.bincount(np.asarray(tokens[i:i + (1 << 24)]), minlength=vocab)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def file_lm_data(cfg: TrainConfig) -> LMData:
    path = Path(cfg.data)
    tokens, vocab = load_tokens(path)
    n = len(tokens)
    n_val, n_test = int(n * cfg.val_fraction), int(n * cfg.test_fraction)
    n_train = n - n_val - n_test
    width = cfg.seq_len + 1

    def windows(lo, hi):
        return np.arange(lo, hi - width + 1, cfg.seq_len)

    splits = [windows(0, n_train), windows(n_train, n_train + n_val), windows(n_train + n_val, n)]
    wanted = [True, cfg.val_fraction > 0, cfg.test_fraction > 0]  # a fraction of 0: no such split
    for name, s, want in zip(("training", "validation", "test"), splits, wanted):
        if want and len(s) == 0:
            raise ValueError(f"--data {path}: {n} tokens leave no {name} window of seq_len+1={width} tokens; "
                             f"use a bigger file, a smaller seq_len or other val/test fractions")
    ent = unigram_entropy(tokens[:n_train], vocab)
    return LMData(*(TokenSequences(tokens, cfg.seq_len, s) if want else None for s, want in zip(splits, wanted)),
                  vocab,
                  dict(source=f"{path} ({n} tokens)", unigram_entropy=round(ent, 5)))


# Token data up to this size is hashed whole (about a second); larger data by FINGERPRINT_WINDOWS windows
FINGERPRINT_FULL_BYTES = 1 << 28
FINGERPRINT_WINDOWS = 4096
USER_FINGERPRINT = "user:"  # DDPTrainer(data_fingerprint=...): compared as given
FINGERPRINT_VERSION = "2:"  # the first kind (before 26 Nov 2026): bare hex of the first and last window


def data_fingerprint(train: TokenSequences) -> str:
    """A short digest of the token data under the training windows and their count: every token when the
    data is at most FINGERPRINT_FULL_BYTES, else FINGERPRINT_WINDOWS windows spread evenly over the training
    windows (the first and last among them), so that an edit between those goes unseen."""
    sha = hashlib.sha256(f"{len(train.starts)} windows of {train.seq_len + 1}\n".encode())
    tokens = train.tokens
    if tokens.nbytes <= FINGERPRINT_FULL_BYTES:
        for i in range(0, len(tokens), 1 << 24):
            sha.update(np.ascontiguousarray(tokens[i:i + (1 << 24)]).tobytes())
    else:
        picks = np.unique(np.linspace(0, len(train.starts) - 1, FINGERPRINT_WINDOWS).round().astype(np.int64))
        for s in train.starts[picks]:
            sha.update(np.asarray(tokens[s:s + train.seq_len + 1]).tobytes())
    return FINGERPRINT_VERSION + sha.hexdigest()[:16]


def first_kind_fingerprint(train: TokenSequences) -> str:
    """The fingerprint of states written before 26 Nov 2026: the first and last windows and their count."""
    width = train.seq_len + 1
    first, last = (np.asarray(train.tokens[s:s + width]) for s in (train.starts[0], train.starts[-1]))
    return hashlib.sha256(first.tobytes() + last.tobytes() + str(len(train.starts)).encode()).hexdigest()[:16]


def build_lm_data(cfg: TrainConfig) -> LMData:
    return file_lm_data(cfg) if cfg.data else synthetic_lm_data(cfg)


# ----------------------------------------------------------------------------
# Optimiser and schedule
# ----------------------------------------------------------------------------

# The optimizer's implementation choices, which a loaded optimizer state would otherwise bring from the device
# that saved it
OPTIMIZER_KERNELS = ("fused", "foreach")


def parameter_groups(model: nn.Module, lr: float, weight_decay: float) -> list:
    """The trainable parameters in two groups: those of 2+ dimensions decay (matrices, embeddings), 1-D ones do
    not (biases, norm gains, any per-channel scale)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "lr": lr, "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "lr": lr, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device, make=None):
    """AdamW over parameter_groups, or what `make(groups)` returns (DDPTrainer's optimizer=), checked."""
    groups = parameter_groups(model, lr, weight_decay)
    if make is None:
        fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **fast)
    optimizer = make(groups)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= must return a torch.optim.Optimizer of the parameter groups it is given, got "
                        f"{type(optimizer).__name__}")
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":  # its state_dict() needs a consolidation first
        raise ValueError("optimizer= returned a ZeroRedundancyOptimizer, which shards its state over the ranks: "
                         "this trainer saves rank 0's whole optimizer state in every resumable state; pass a "
                         "plain optimizer")
    mine = {id(p) for g in groups for p in g["params"]}
    theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if theirs != mine:
        raise ValueError(f"optimizer= must optimize exactly the model's {len(mine)} trainable parameters (the groups "
                         f"it is given); its optimizer holds {len(theirs)}, {len(theirs - mine)} of them not among "
                         f"those, and leaves out {len(mine - theirs)}")
    return optimizer


def optimizer_name(optimizer) -> str:
    """The optimizer's class as a state records it: a resume into another optimizer is refused."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def build_scheduler(optimizer, cfg: "TrainConfig", total_steps: int):
    """The LR schedule of cfg (lr_schedule, warmup_steps, min_lr_ratio) over `total_steps` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, total_steps, cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio))


def pins_host_memory(cfg: "TrainConfig", device: torch.device) -> bool:
    """Whether batches and checkpoint host copies go to page-locked memory: only copies to and from a CUDA
    device gain from it (non-blocking transfers)."""
    return cfg.pin_memory and device.type == "cuda"


def amp_dtype_for(cfg: "TrainConfig", device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype a run uses (use_amp, amp_dtype), or None for full precision."""
    if not cfg.use_amp:
        return None
    if device.type == "cuda":
        # not emulated bf16 (Volta, Turing: torch's default check counts it), which is slow: fp16 there
        if cfg.amp_dtype == "fp16" or (cfg.amp_dtype == "auto" and
                                       not torch.cuda.is_bf16_supported(including_emulation=False)):
            return torch.float16
        return torch.bfloat16
    if cfg.amp_dtype == "bf16":
        return torch.bfloat16
    return None  # fp16 autocast on the CPU is slow and unscaled: off unless bf16 is asked for


# Dense bf16 peak FLOP/s per GPU (datasheet figures), for the model FLOPs utilisation (MFU) metric;
# the first key contained in the device's name wins, so the PCIe and NVL parts come before "H100" and "H200".
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200 NVL": 835e12, "H200": 989e12,
                   "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_bf16_flops(device: torch.device) -> Optional[float]:
    """The datasheet peak of this GPU, or None (the CPU, an unknown GPU, a MIG slice: a share of the whole
    GPU's peak that its name does not give)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if " MIG " in f" {name} ":
        return None
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base LR after `step` optimizer steps."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    if schedule == "wsd":  # warmup, stable, then linear decay over the last 20%
        decay_start = warmup + int(0.8 * (total - warmup))
        if step < decay_start:
            return 1.0
        frac = min(1.0, (step - decay_start) / max(1, total - decay_start))
        return 1.0 - (1.0 - min_ratio) * frac
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


# ----------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------

LossFn = Callable[[nn.Module, Any], tuple]


# Names the train and val records (and evaluate()'s result) give their own fields: an extra of the loss named
# so would replace the loss that early stopping and the best checkpoint read, the step number or a memory
# reading. The validation record's fields start with VAL_PREFIX (val_loss, val_<extra>): a train extra named
# so would be read as them.
RECORD_FIELDS = frozenset({"type", "step", "epoch", "loss", "count", "mfu", "lr", "lrs", "grad_norm", "samples_per_s",
                           "skipped", "time", "steps_per_epoch", "loss_floor"}) | rt.MEMORY_FIELDS
VAL_PREFIX = "val_"


def check_extra_names(names, reserved, whose: str, prefix: Optional[str] = None) -> None:
    taken = sorted(n for n in names if n in reserved or (prefix and n.startswith(prefix)))
    if taken:
        also = f", and names starting with {prefix!r} are the validation record's" if prefix else ""
        raise ValueError(f"loss_fn returned the extras {taken}: {whose} has fields of these names already "
                         f"({', '.join(sorted(reserved))}){also}; rename them")


def check_plain(name: str, value, where: str) -> None:
    """A value that must compare with == and load with weights_only=True: None, bool, int, float, str, and
    lists, tuples and dicts of them (keys of the same plain kinds)."""
    if type(value) is float and math.isnan(value):
        raise TypeError(f"{where}: {name} is nan, which equals nothing, itself included: no resume would match it; "
                        f"expected a number, or None")
    if value is None or type(value) in (bool, int, float, str):
        return
    if type(value) in (list, tuple):
        for i, v in enumerate(value):
            check_plain(f"{name}[{i}]", v, where)
        return
    if type(value) is dict and all(k is None or type(k) in (bool, int, float, str) for k in value):
        for k, v in value.items():
            check_plain(f"{name}[{k!r}]", v, where)
        return
    raise TypeError(f"{where}: {name} is {type(value).__name__} {str(value):.80}; expected None, bool, int, float, str "
                    f"or lists and dicts of them (int(x), float(x), x.tolist() convert numpy and torch "
                    f"values)")


def check_loadable(extra: dict, where: str) -> None:
    """Each value of `extra` loads back with torch.load(weights_only=True), as every checkpoint is read."""
    for key, value in extra.items():
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)  # a function or a lock cannot even be saved (pickle's error)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as exc:  # noqa: BLE001 -- which error says what weights_only refuses; named below
            text = str(exc)
            why = (rt.weights_only_refusal(text) if text.startswith("Weights only load failed")
                   else (text.splitlines() or [type(exc).__name__])[0])
            raise TypeError(f"{where}: the value of {key!r} ({type(value).__name__}) would not save and load back with "
                            f"torch.load(weights_only=True), as checkpoints are read: {why}; "
                            f"give tensors, numbers, strings, or lists and dicts of them") from None


def loss_terms(out, device: Optional[torch.device] = None) -> tuple:
    """What loss_fn returned, checked: (loss_sum, count, extras), each of one element, the extras as float64
    tensors on `device` (default: the loss's); a mistake is a TypeError that names loss_fn and what it returned
    (not an error deep inside the step)."""
    def what(x):
        if torch.is_tensor(x):
            return f"a {'complex ' if x.is_complex() else ''}tensor of shape {tuple(x.shape)}"
        return type(x).__name__

    def number(x, role: str):
        if torch.is_tensor(x) and x.numel() == 1 and not x.is_complex():
            return x.reshape(())
        if isinstance(x, np.ndarray) and x.size == 1:
            x = x.item()
        if isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)):  # numpy's numbers too
            return float(x)
        raise TypeError(f"loss_fn's {role} must be a number or a tensor of one element, got {what(x)}")

    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise TypeError(f"loss_fn must return (loss_sum, count) or (loss_sum, count, {{name: sum}}), got "
                        f"{what(out) if not isinstance(out, (tuple, list)) else f'{len(out)} values'}")
    if not (torch.is_tensor(out[0]) and out[0].numel() == 1):
        raise TypeError(f"loss_fn's loss_sum must be a tensor of one element (the loss summed over the batch), "
                        f"got {what(out[0])}")
    extras = out[2] if len(out) == 3 else {}
    if not isinstance(extras, collections.abc.Mapping):
        raise TypeError(f"loss_fn's extras must be a dict {{name: sum}}, got {what(extras)}")
    device = out[0].device if device is None else torch.device(device)

    def here(x):
        """x on `device`, or a number. A pageable host tensor's value goes in as a kernel argument: a blocking
        copy of it to a GPU would wait for every queued kernel, in each micro-step. A pinned one (what a
        non_blocking copy from the GPU gives) may still be filling: it is copied in the stream's order."""
        if not torch.is_tensor(x) or x.device == device:
            return x
        if x.device.type == "cpu" and not x.is_pinned():
            return float(x.item())
        return x.to(device, non_blocking=device.type != "cpu")  # to the host: read at once, so waited for

    def extra(x) -> torch.Tensor:
        x = here(x)
        return x.double() if torch.is_tensor(x) else torch.full((), x, dtype=torch.float64, device=device)

    extras = {k: extra(number(v, f"extra {k!r}")) for k, v in extras.items()}
    return out[0].reshape(()), here(number(out[1], "count")), extras


def _size(dataset) -> Optional[int]:
    """len(dataset), or None for none or a stream."""
    try:
        return None if dataset is None else len(dataset)
    except TypeError:
        return None


def _by_value(every: list, key: str) -> str:
    """"key: ranks 0-2 A, rank 3 B" from every rank's dict; a long value shown by its two ends (where two
    fingerprints or paths tend to differ)."""
    ranks: dict = {}
    for r, e in enumerate(every):
        ranks.setdefault(repr(e[key]), []).append(r)
    show = lambda v: v if len(v) <= 48 else f"{v[:20]}...{v[-24:]}"  # noqa: E731
    return f"{key}: " + ", ".join(f"rank{'s' if len(rs) > 1 else ''} {_spans(rs)} {show(v)}"
                                  for v, rs in ranks.items())


def _spans(ranks: list) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


class RunDirInUse(ValueError):
    """The run dirs are locked by another run (or another trainer in this process)."""


class StateMismatch(ValueError):
    """A resumable state of a run with another world size, batch size, seed, ..."""


class DataMismatch(ValueError):
    """The ranks were given different data: other sizes, or other contents under one size."""


class StepFailed(rt.Failed):
    """A step failed on some rank; raised on every rank with every rank's error."""


COMPLETED_MARKER = "COMPLETED"  # in the run dir: the summary of a run that finished


def terminal_columns(stream) -> Optional[int]:
    """The width of the terminal `stream` writes to; None where it has no descriptor to ask."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None


# What a process of mp.spawn is told when nothing says its rank: it trains alone as rank 0 of 1, as each of its
# siblings (or they meet in one run dir, where the first turns the others away as if another run held it)
UNNAMED_RANK = ("if it is one of mp.spawn's ranks, pass rank= and world_size= (mp.spawn passes the rank first), "
                "or make the process group before the trainer")


def maybe_an_unnamed_rank() -> bool:
    """Started by multiprocessing with a rendezvous address set, and neither launcher variables nor a process
    group nor the caller name its rank: an mp.spawn rank given no rank, or a Pool worker of a sweep (legitimately
    alone, in a job that exports MASTER_ADDR), which cannot be told apart here."""
    import multiprocessing
    return multiprocessing.parent_process() is not None and ("MASTER_ADDR" in os.environ or
                                                             "MASTER_PORT" in os.environ)


class AboveTheBar(logging.StreamHandler):
    """The console under a progress bar: lines print above the bar (tqdm.write), and the periodic
    step lines, which the bar replaces, are left out."""

    def filter(self, record) -> bool:
        return not getattr(record, "periodic", False) and super().filter(record)

    def emit(self, record) -> None:
        from tqdm import tqdm
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class Diverged(rt.Failed, FloatingPointError):
    """max_bad_steps non-finite steps in a row: the weights saved are the last good ones."""


class StepAbandoned(rt.Failed):
    """This rank's step failed and could not be completed in step with the others (DDP had already
    started reducing): the run ends here, and the others learn why from this rank's FAILED marker."""


# Where other trainers' checkpoints keep the weights: PyTorch's tutorials' {"model_state_dict": ...}, Lightning's
OTHER_WEIGHTS_KEYS = ("model_state_dict", "state_dict")


def init_weights_in(ckpt, weights_key: str, extra: dict, must_match: dict, own_keys: frozenset = frozenset()) -> tuple:
    """(the weights, a note of where they come from) in a file given as init_from: this kit's weights file (its
    `weights_key`), a resumable state (its model), a bare state dict, or another trainer's (OTHER_WEIGHTS_KEYS).
    The model's settings that the file records must be this model's, dropout aside (a count of heads changes
    what the same shapes compute, an action layout what the same inputs mean): a weights file's dict and list
    entries among the trainer's checkpoint_extra (model_config; predictor_config, data_geometry), a state's
    must_match."""
    if not isinstance(ckpt, dict):
        raise ValueError(f"holds a {type(ckpt).__name__}; expected a checkpoint (a dict)")
    state = {"model", "optimizer", "counters"} <= set(ckpt) and isinstance(ckpt["model"], dict)
    other = next((ckpt[k] for k in OTHER_WEIGHTS_KEYS if isinstance(ckpt.get(k), dict)), None)
    if isinstance(ckpt.get(weights_key), dict):
        weights = ckpt[weights_key]
    elif state:
        weights = ckpt["model"]
    elif ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        weights = ckpt
    elif other is not None:
        weights = other
    else:
        raise ValueError(f"holds no weights under {weights_key!r} (its keys: {sorted(map(str, ckpt))[:8]}); "
                         f"expected a weights file of this model, a resumable state, a state dict, or one under "
                         f"{' or '.join(map(repr, OTHER_WEIGHTS_KEYS))}")
    if not all(isinstance(k, str) for k in weights):
        raise ValueError("its weights are not a state dict (keys that are not parameter names)")
    recorded, ours = (ckpt.get("must_match") or {}, must_match) if state else (ckpt, extra)
    for key, mine in ours.items():
        theirs = recorded.get(key)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            differ = sorted((k for k in mine.keys() | theirs.keys() if k != "dropout" and mine.get(k) != theirs.get(k)),
                            key=str)
            shown = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in differ)
        elif isinstance(mine, list) and isinstance(theirs, list):
            differ, shown = mine != theirs, f"{theirs} there, {mine} here"
        else:
            continue
        if differ:
            raise ValueError(f"its {key} differs from this model's ({shown})")
    for prefix in ("module.", "_orig_mod."):  # saved from a DDP or a compiled model, unless the model's own
        # names begin so (`own_keys`: a wrapper whose one child is named `module`, as an EMA wrapper's is)
        if weights and all(k.startswith(prefix) for k in weights) and not set(weights) <= own_keys:
            weights = {k[len(prefix):]: v for k, v in weights.items()}
    # one leading name on every key, as a LightningModule's attribute (`model.`): dropped where the rest is
    # exactly this model's names
    heads = {k.partition(".")[0] for k in weights}
    if own_keys and len(heads) == 1 and {k.partition(".")[2] for k in weights} == own_keys:
        weights = {k.partition(".")[2]: v for k, v in weights.items()}
    step = (ckpt.get("counters") or {}).get("global_step") if state else ckpt.get("global_step")
    return weights, (f" (step {step} of the run that saved it)" if isinstance(step, int) else "")


def check_fit(weights: dict, own: dict) -> None:
    """The names and shapes of `weights` are the model's (`own`, its state dict), or a ValueError that says how not."""
    missing, unexpected = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    shapes = [f"{k}: {tuple(getattr(weights[k], 'shape', ()))} there, {tuple(own[k].shape)} here"
              for k in own.keys() & weights.keys() if getattr(weights[k], "shape", None) != own[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{what} {names[:4]}{' ...' if len(names) > 4 else ''}" for what, names in
                 (("missing", missing), ("not in this model", unexpected), ("other shapes", sorted(shapes))) if names]
        raise ValueError(f"its weights do not fit this model: {'; '.join(parts)}")


class EvaluationFailed(rt.Failed):
    """Evaluation raised on some rank; raised on every rank with every rank's error."""


@dataclass
class BatchError:
    """A batch that failed to load (the error text), kept in place of the batch. A dead
    DataLoader worker is fatal; a bad sample is a recoverable data error."""
    text: str
    fatal: bool = False
    counted: bool = True  # False where another error counts for it (see _split_micro_batches, _PartsCollate)


class BufferSnapshot:
    """A model's buffers as they were at take(), which put_back() restores: a skipped or failed step changes
    nothing, neither BatchNorm's running statistics nor a model's own (a running mean, an EMA of weights),
    whether its forward updated them in place, replaced them, or set one registered as None (lazily). A buffer
    is copied again only once its version counter or identity says it changed (a constant mask: once; under
    DDP, whose forward broadcasts every buffer in place, each step), and put back only where it changed;
    BatchNorm's, which its kernel updates without a version bump, every time."""

    def __init__(self, model: nn.Module):
        self.slots = [(m, name) for m in model.modules() for name in m._buffers]
        # BatchNorm's kernel updates its running statistics without a version bump: always copied
        self.unversioned = [isinstance(m, nn.modules.batchnorm._NormBase) for m, _ in self.slots]
        self.kept: list = [(None, None, None)] * len(self.slots)  # (tensor, its version, its copy)

    def take(self) -> "BufferSnapshot":
        kept, sources, copies = [], [], []
        for (m, name), (was, version, copy), always in zip(self.slots, self.kept, self.unversioned):
            t = m._buffers.get(name)
            if t is None:
                kept.append((None, None, None))
            elif t is was and t._version == version and not always:
                kept.append((t, version, copy))
            elif copy is not None and (copy.shape, copy.dtype, copy.device) == (t.shape, t.dtype, t.device):
                sources.append(t)
                copies.append(copy)
                kept.append((t, t._version, copy))
            else:
                kept.append((t, t._version, t.clone()))
        if sources:  # one multi-tensor copy, no host sync
            torch._foreach_copy_(copies, sources)
        self.kept = kept
        return self

    def put_back(self) -> None:
        for (m, name), (t, version, copy), always in zip(self.slots, self.kept, self.unversioned):
            if t is not None and (t._version != version or always):
                t.data.copy_(copy)  # not counted as an in-place change: a replay's backward may still need it
            m._buffers[name] = t


class StepTally:
    """What one rank's micro-steps of an optimizer step add up to (loss sum, sample count, whether a loss was
    non-finite, the loss function's extra metrics), packed with the step's flags for the all-reduce."""

    def __init__(self, device: torch.device):
        self.loss_sum, self.count, self.nonfinite, self.bad_grads = (
            torch.zeros((), device=device, dtype=torch.float64) for _ in range(4))
        self.extras: dict = {}
        self.missing: list = []  # names of the parameters without a gradient (DDPTrainer._gradients)

    def add(self, s: torch.Tensor, c, extras: dict) -> None:
        """`c` is a tensor or a Python number: a number is added as a kernel argument, without copying it to
        the device (on a GPU a blocking copy would wait for every queued kernel)."""
        if s.device != self.loss_sum.device:  # a loss summed on the host (model(x).cpu()): its sync is the user's
            s = s.to(self.loss_sum.device)
        # a non-finite count (a NaN weight) leaves the loss sum / count of the step non-finite too: skipped alike
        if torch.is_tensor(c):
            c = c.double()
            finite = torch.isfinite(s) & torch.isfinite(c)
            self.count += torch.where(finite, c, 0.0)
        else:  # times 0 or 1: not rounded, and no copy to the device
            finite = torch.isfinite(s) & math.isfinite(c)
            self.count += c * finite.double() if math.isfinite(c) else 0.0
        self.nonfinite = torch.maximum(self.nonfinite, (~finite).double())
        self.loss_sum += torch.where(finite, s.double(), 0.0)
        for name, v in extras.items():
            self.extras[name] = self.extras.get(name, 0.0) + torch.where(finite, v.double(), 0.0)

    @property
    def names(self) -> list:
        return sorted(self.extras)

    FIELDS = ("count", "loss", "nonfinite", "bad_grads")  # what packed() lays out first, under these names

    def packed(self, flags: list, names: list) -> torch.Tensor:
        """[*FIELDS (count, loss_sum, ...), *flags, *extras in the order of `names`] (a missing one as 0)"""
        dev = self.count.device  # from pinned memory the copy is queued, not waited for
        flags = torch.tensor(flags, dtype=torch.float64, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)
        extras = [self.extras.get(n, self.count * 0) for n in names]
        return torch.cat([torch.stack([self.count, self.loss_sum, self.nonfinite, self.bad_grads]), flags,
                          torch.stack(extras) if extras else flags[:0]])


# What close() logs for a trainer that never trained (built to evaluate, say); training_logs reads it
CLOSED_UNTRAINED = "closed without training"


def move_aside(path: Path) -> Path:
    """Renames metrics.jsonl to metrics.<time>.jsonl (rank_3.log to rank_3.<time>.log), numbered after the time
    where two fresh runs start in one second: an earlier run's file is never replaced."""
    stem, suffix = path.name.rsplit(".", 1)
    stamp, n = int(time.time()), 1
    aside = path.with_name(f"{stem}.{stamp}.{suffix}")
    while aside.exists():
        aside, n = path.with_name(f"{stem}.{stamp}.{n}.{suffix}"), n + 1
    os.replace(path, aside)
    return aside


def metrics_run_id(path: Path) -> Optional[str]:
    """The run a metrics file belongs to, as its first "start" record names it (a file a run began before runs
    named themselves has it after that run's first records); None for a file without one, or unreadable."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if b'"type": "start"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:  # JSON and UTF-8 errors alike: a line cut short
                    continue
                if isinstance(rec, dict) and rec.get("type") == "start":
                    return rec.get("run_id")
    except OSError:
        return None
    return None


def json_line(record: dict) -> str:
    """Strict JSON: a non-finite number (a NaN loss, a skipped step's grad norm) is written as null, never NaN."""
    return json.dumps(json_safe(record), allow_nan=False)


# Why a loader of known length ends early: a DataLoader takes a StopIteration from the dataset or the collate
# function for the end of its data (on this rank alone, under shard)
ENDED_EARLY = ("raised in the dataset's __getitem__ or in collate_fn (next() on an exhausted iterator?), a "
               "StopIteration ends a DataLoader's epoch as if its data were done")


def next_batch(batches, backstop_s: Optional[float] = None, length_known: bool = False) -> Any:
    """The next batch, or a BatchError for one that failed to load. StopIteration: a stream ran dry (under
    dispatch, on every rank at once); from a loader of known length, which is never read past its end, it is
    a bad sample's, counted as any other instead of one rank leaving its epoch alone."""
    try:
        with rt.backstop(backstop_s):
            return next(batches)
    except StopIteration as exc:
        if not length_known:
            raise
        # the iterator goes on to the next batch, as after any bad sample
        return BatchError(f"{rt.error_text(exc)}: {ENDED_EARLY}")
    except rt.CollectiveFailed:
        raise
    except Exception as exc:  # agreed on in the step, counted or fatal
        text = rt.error_text(exc)
        died = worker_death_note(text)
        stuck = "DataLoader timed out" in text  # every later batch would wait as long: no bad sample to skip
        if died:
            text += died
        if stuck:
            text += (" (a stuck read, in a worker or in this process's dataset or collate_fn: a hung read or a "
                     "deadlock; loader_timeout sets the wait)")
        return BatchError(text, fatal=bool(died) or stuck or getattr(exc, "fatal", False),
                          counted=getattr(exc, "counted", True))


def next_micro_batches(batches, n: int, backstop_s: Optional[float] = None, length_known: bool = False) -> list:
    """A step's n micro-batches. After a fatal loading error (a stuck or dead worker) the rest are that error:
    reading on would wait out loader_timeout again for each, while the other ranks wait in the step."""
    micro = []
    while len(micro) < n:
        if micro and isinstance(micro[-1], BatchError) and micro[-1].fatal:
            micro.append(micro[-1])
        else:
            micro.append(next_batch(batches, backstop_s, length_known))
    return micro


# What gloo says when a peer's end of the connection went away: it exited or was killed
PEER_LOST_TEXT = ("connection closed by peer", "connection reset by peer")
# What gloo's failures say (its source path, or the peer's end); gloo raises them as plain RuntimeErrors, NCCL's
# come as DistErrors. Matched only in a plain RuntimeError: a path or message of the run's own (an OSError
# naming runs/gloo_test/metrics.jsonl) is no peer's failure.
COLLECTIVE_ERROR_TEXT = ("third_party/gloo/", *PEER_LOST_TEXT, "pair closure")


def is_collective_error(exc: BaseException) -> bool:
    """A communication failure (a peer died or timed out) surfacing in a forward's or backward's collective."""
    if isinstance(exc, (dist.DistError, rt.CollectiveFailed)):
        return True
    text = str(exc).lower()
    return type(exc) is RuntimeError and any(t in text for t in COLLECTIVE_ERROR_TEXT)


# The keys only the built-in CausalLM and its data read: with a model of the caller's they change nothing
BUILTIN_LM_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_len", "dropout", "dataset_size",
                   "markov_branching", "data", "val_fraction", "test_fraction")


def worker_death_note(text: str) -> Optional[str]:
    """What to add to an error in torch's words for a DataLoader worker that exited or was killed (from the
    loader, or from its SIGCHLD handler in whatever ran then); None for any other error."""
    if not re.search(r"DataLoader worker \(pid.*(exited unexpectedly|killed by signal)", text):
        return None
    why = (" (the kernel's OOM killer sends SIGKILL: see dmesg)" if "Killed" in text else
           " (the kernel's OOM killer, see dmesg, or a crash in native code)" if "exited unexpectedly" in text else "")
    return (f" (a DataLoader worker process died{why}: fewer num_workers, a smaller batch or more memory; a "
            f"relaunch resumes from the newest state)")


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def to_device(batch, device: torch.device, non_blocking: bool):
    return rt.map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


_END = object()


def exact_length(loader) -> Optional[int]:
    """Batches a loader yields, or None where it does not say for sure: a stream (its __len__, where it has
    one, is an estimate)."""
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


@torch.no_grad()
def evaluate_model(model: nn.Module, loader, loss_fn: LossFn, device: torch.device,
                   autocast=contextlib.nullcontext, non_blocking: bool = False,
                   log: Optional[logging.Logger] = None, backstop_s: Optional[float] = None) -> dict:
    """Mean loss (and extras) over a sharded set: each rank runs its shard, sums and counts are
    all-reduced, so the result equals one process evaluating the whole set. Pass the bare model:
    a DDP forward here would make ranks with different shard lengths wait on each other. A loader with
    workers and a timeout gets the same backstop as a training loader (rt.backstop), unless `backstop_s` is
    given (a trainer's, for its own loaders)."""
    if backstop_s is None:
        backstop_s = rt.loader_backstop_s(getattr(loader, "num_workers", 0), getattr(loader, "timeout", None))
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    extras: dict = {}
    error, failure = None, None
    try:  # no collective inside the loop, so a rank may leave it early; the gather below tells the others
        batches, expected, read = iter(loader), exact_length(loader), 0
        while True:
            with rt.backstop(backstop_s):
                batch = next(batches, _END)
            if batch is _END:
                if expected is not None and read < expected:  # the agreed mean would leave this rank's rest out
                    error = f"the loader ended after {read} of its {expected} batches: {ENDED_EARLY}"
                break
            read += 1
            batch = to_device(batch, device, non_blocking)
            with autocast():
                out = loss_terms(loss_fn(model, batch), device)
            total[0] += out[0].double()
            total[1] += out[1].double() if torch.is_tensor(out[1]) else out[1]  # a number: no copy, no wait
            for name, v in out[2].items():
                extras[name] = extras.get(name, 0.0) + v.double()
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        error, failure = f"{rt.error_text(exc)} (at {Path(where.filename).name}:{where.lineno})", exc
        if log is not None:
            log.error("evaluation raised on this rank: %s", traceback.format_exc())
    finally:
        model.train(was_training)
    reports = rt.gather_objects((sorted(extras), error))
    failed = [f"rank {r}: {e}" for r, (_, e) in enumerate(reports) if e]
    if failed:
        raise EvaluationFailed("evaluation failed on " + "; ".join(failed), agreed=True) from failure
    # A rank whose shard is empty saw no extras; every rank must pack the same names.
    names = sorted(set().union(*(n for n, _ in reports)))
    try:  # the same names on every rank: all raise alike, and a trainer saves the weights first
        check_extra_names(names, ("loss", "count"), "evaluate()'s result")
    except ValueError as exc:
        raise EvaluationFailed(f"evaluation: {exc}", agreed=True) from exc
    zero = torch.zeros((), dtype=torch.float64, device=device)
    reduced = rt.all_reduce_tensor(torch.stack([total[0], total[1]] + [extras.get(n, zero) for n in names])
                                   ).tolist()
    n = reduced[1]
    if n == 0:  # the sets are checked not to be empty when a trainer is built
        raise EvaluationFailed("evaluation: loss_fn returned a count of 0 over the whole set (no samples, or no "
                               "item of theirs counted)", agreed=True)
    return {"loss": reduced[0] / n, "count": n, **{k: v / n for k, v in zip(names, reduced[2:])}}


def check_trainable(model) -> None:
    """Refuses at set-up a model this trainer would fail on at its first step, or train wrongly."""
    inner = getattr(model, "_orig_mod", model)  # a model the caller compiled: what it compiled
    if isinstance(inner, (DDP, nn.DataParallel)):
        raise ValueError(f"model is already wrapped in {type(inner).__name__}: pass the bare module "
                         f"(model.module); the trainer wraps it itself, and saves its weights without the "
                         f"wrapper's 'module.' prefix")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(f"model has parameters not yet initialised (lazy modules: {', '.join(lazy[:3])}): run one "
                         f"forward on a sample batch before passing it, so that every rank builds the same shapes "
                         f"and the optimizer sees them")
    sparse = [n for n, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise ValueError(f"model has sparse-gradient embeddings ({', '.join(sparse[:3])}: sparse=True): AdamW and "
                         f"the gradient-norm checks need dense gradients; build them with sparse=False")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no parameter that requires a gradient (all frozen?): nothing to train")


def module_structure(model: nn.Module) -> list:
    """[name, class] of every module of the model: what a resume checks beside the weights' names and shapes."""
    return [[name or "", type(m).__qualname__] for name, m in model.named_modules()]


class WrappedLikeDDP(nn.Module):
    """What loss_fn gets as the model in a one-process step: what DDP gives it on several ranks, a module whose
    forward is the model's, under `.module`. A loss_fn that reaches past the forward (model.logits(x)) then
    fails in one process as it would under DDP, where a method reached through model.module would also skip
    the gradient all-reduce and let the replicas drift apart."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def use_static_graph(model: nn.Module, cfg: TrainConfig) -> bool:
    """DDP static_graph as configured; by default on for a model that declares its graph never changes
    (`static_graph = True`), unless the config expects unused parameters or accumulates gradients.

    A static graph's first backward in each process must all-reduce, so with accumulation that step
    sums micro-steps across ranks in another order than later steps do: the first step after a resume
    then differs in the last bits from the uninterrupted run's step."""
    if cfg.static_graph is not None:
        return cfg.static_graph
    return (getattr(model, "static_graph", False) is True and not cfg.find_unused_parameters
            and cfg.grad_accum_steps == 1)


class DDPTrainer:
    """Trains any model whose `loss_fn(model, batch)` returns `(loss_sum, count)` or
    `(loss_sum, count, {name: sum})`; the logged and optimised loss is the global mean
    sum / count over all ranks and micro-batches of a step.

    Without `model=` it trains the default causal LM on `config['data']` or the
    synthetic Markov chain.
    """

    def __init__(self, rank: Optional[int] = None, world_size: Optional[int] = None, config: Optional[dict] = None, *,
                 local_rank: Optional[int] = None, model: Optional[nn.Module] = None,
                 train_dataset=None, val_dataset=None, test_dataset=None,
                 loss_fn: Optional[LossFn] = None, collate_fn=None,
                 checkpoint_extra: Optional[dict] = None, weights_key: str = "model",
                 count_unit: str = "tokens", describe: Optional[str] = None, data_fingerprint: Optional[str] = None,
                 resume_must_match: Optional[dict] = None, run_config: Optional[dict] = None,
                 optimizer: Optional[Callable[[list], torch.optim.Optimizer]] = None,
                 after_step: Optional[Callable[[nn.Module, int], None]] = None):
        self.cfg = TrainConfig.from_dict(config, builtin_lm=model is None)
        cfg = self.cfg
        self.make_optimizer = optimizer  # groups -> an optimizer; None: AdamW (build_optimizer)
        self.after_step = after_step  # (model, step) after each applied update
        # what the run dir's config.yaml holds: a script with flags of its own passes them (loadable by its
        # --config); by default the resolved TrainConfig
        self.run_config = run_config
        # a user's dataset may be costly or random to read: its owner says what identifies it, if anything
        if data_fingerprint is not None and not isinstance(data_fingerprint, str):
            raise TypeError(f"data_fingerprint must be a string (a hash or a version of the data), got "
                            f"{type(data_fingerprint).__name__} {data_fingerprint!r}")
        self.data_fingerprint = None if data_fingerprint is None else USER_FINGERPRINT + data_fingerprint
        # what else a resume must find unchanged, by name (the loss's definition, the validation set: the best
        # validation loss so far was measured with them)
        self.resume_must_match = dict(resume_must_match or {})
        for key, value in self.resume_must_match.items():  # compared with ==, saved in states read weights_only
            check_plain(repr(key), value, "resume_must_match")
        unnamed = False  # see maybe_an_unnamed_rank
        if rank is None and world_size is None:  # as the launcher (torchrun, SLURM) says; a plain process is 0 of 1
            launch = rt.detect_launch_env()
            if launch["world_size"] == 1 and dist.is_available() and dist.is_initialized():
                # a group the caller made (mp.spawn and a tcp:// address), where no launcher or a launcher of one
                # process (srun -n1, torchrun --nproc_per_node=1) says otherwise: the group's numbers (the local
                # rank, unless given: the rank, as one node's mp.spawn numbers them)
                rank, world_size = dist.get_rank(), dist.get_world_size()
            else:
                rank, world_size = launch["rank"], launch["world_size"]
                local_rank = launch["local_rank"] if local_rank is None else local_rank
                unnamed = launch["launcher"] == "none" and maybe_an_unnamed_rank()
        elif rank is None or world_size is None:
            raise ValueError(f"DDPTrainer: give rank and world_size together, or neither (taken from the "
                             f"launcher's environment); got rank={rank}, world_size={world_size}")
        self.maybe_unnamed_rank = unnamed
        try:
            self.env = rt.setup_distributed(rank, world_size, local_rank, cfg.dist_backend, cfg.device,
                                            max(cfg.dist_timeout, cfg.first_step_timeout))
        except rt.SetUpTimeout as exc:
            rt.log_set_up_failure(cfg.log_dir, rank, exc)
            raise
        try:
            self._build(model, train_dataset, val_dataset, test_dataset, loss_fn, collate_fn,
                        checkpoint_extra, weights_key, count_unit, describe)
        except BaseException as exc:
            # asked while the group stands: who did not answer
            together = (self._set_up_failed_together(exc)
                        if isinstance(exc, Exception) and is_collective_error(exc) else None)
            if hasattr(self, "run_lock"):
                self.run_lock.release()
            if hasattr(self, "log"):  # the traceback into rank_N.log; the console gets the error from the caller
                if isinstance(exc, KeyboardInterrupt):
                    rt.log_to_file(self.log, logging.WARNING, rt.CTRL_C_BEFORE_TRAINING)
                else:
                    rt.log_to_file(self.log, logging.ERROR, "trainer set-up failed", sys.exc_info())
                    if together is not None:
                        rt.log_to_file(self.log, logging.ERROR, str(together))
                    elif not isinstance(exc, SETUP_ERRORS):  # a failure of this rank's own: its peers, past set-up
                        # and waiting in the first step, name it instead of a peer lost 'without a word'
                        rt.write_failure_marker(cfg.log_dir, self.env.rank, 0, exc)
                rt.close_logger(self.log)
            rt.teardown_distributed()
            if together is not None:
                raise together from exc
            raise

    def _set_up_failed_together(self, exc: Exception) -> rt.SetUpFailed:
        """A collective of set-up, after the group formed, failed: gloo's words (a timeout of a send, a closed
        connection) in the ranks' terms. A rank still reading its data or building its model is the usual one."""
        timeout = max(self.cfg.dist_timeout, self.cfg.first_step_timeout)
        if rt.timed_out(exc):
            what = (f"a collective of set-up did not complete within {timeout:g}s ({rt.missing_ranks(5.0)}): a rank "
                    f"still reading its data or building its model, or stuck; give set-up longer with "
                    f"--first_step_timeout (or --dist_timeout)")
        else:
            what = ("a peer left during set-up (it failed, was killed, or gave up waiting for this rank: its "
                    "rank_N.log says which)")
        return rt.SetUpFailed(f"rank {self.env.rank}: set-up failed: {what}")

    # -- set-up ---------------------------------------------------------------

    def _build(self, model, train_dataset, val_dataset, test_dataset, loss_fn, collate_fn,
               checkpoint_extra, weights_key, count_unit, describe):
        cfg, env = self.cfg, self.env
        self._check_ranks_have_the_same_config()
        self._claim_run_dirs()
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank

        self.data_info: dict = {}
        builtin_data, user_extra = model is None, checkpoint_extra
        self.builtin_lm = builtin_data
        if builtin_data:
            model, train_dataset, val_dataset, test_dataset, checkpoint_extra, describe = self._take_builtin_lm(
                train_dataset, val_dataset, test_dataset, checkpoint_extra, describe)
        elif env.is_main:
            unused = [k for k in BUILTIN_LM_KEYS if getattr(cfg, k) != getattr(TrainConfig, k)]
            if unused:
                self.log.warning("config keys %s are the built-in LM's and its data's: with model= they change "
                                 "nothing", ", ".join(unused))
        if train_dataset is None:
            raise ValueError("a custom model needs train_dataset=")
        self.train_dataset = train_dataset  # the loader may wrap it (per-sample seeds in workers)
        self._check_ranks_have_the_same_data(train_dataset, val_dataset, test_dataset)
        self._set_loss(loss_fn, count_unit, builtin_data)
        self._check_checkpoint_extra(user_extra, weights_key, builtin_data)
        self.checkpoint_extra = checkpoint_extra or {}
        self.weights_key = weights_key

        check_trainable(model)
        self._wrap_model(model, describe)
        self._build_loaders(train_dataset, val_dataset, test_dataset, collate_fn)
        self._count_steps()
        self._build_optimizer()
        self._set_up_bookkeeping()
        self.log.info("%d steps (%d per epoch), global batch %d = %d per rank x %d accum x %d ranks",
                      self.total_steps, self.steps_per_epoch,
                      cfg.batch_size * cfg.grad_accum_steps * env.world_size,
                      cfg.batch_size, cfg.grad_accum_steps, env.world_size)
        self._log_precision_and_schedule()
        self.initialised_from: Optional[str] = None  # the init_from the run began with (a resume: its state's)
        self.resumed_from = self._resume()  # last: it restores the RNG streams set-up consumed
        if cfg.init_from and self.resumed_from is None:
            self._init_weights(cfg.init_from)
            self.initialised_from = cfg.init_from
        elif cfg.init_from and self.initialised_from != cfg.init_from:  # a fine-tuning meant to start afresh?
            self.log.warning("init_from %s not read: this run resumed from its own state %s, which began from %s; "
                             "another run_name (or resume none) starts from %s", cfg.init_from, self.resumed_from,
                             self.initialised_from or "its own initialisation", cfg.init_from)

    def _claim_run_dirs(self) -> None:
        """The run dirs' lock, then the logger, then a check that rank 0 can write there: a refused run writes
        nothing, and a dir no checkpoint can be written to stops the run before its first step."""
        cfg, env = self.cfg, self.env
        # released when train() ends (or by close()); before the logger, so that a refused run writes nothing
        self.run_lock = rt.RunDirLock(cfg.log_dir, cfg.checkpoint_dir)
        holder = rt.broadcast_object(self._take_run_lock() if env.is_main else None)
        if holder:
            whose = ("this process: another DDPTrainer on these dirs has not finished train(); call its close() "
                     "or drop it" if holder.startswith(rt.RunDirLock.this_process()) else
                     "another run (or the ranks of one whose launcher was killed); stop it, or give this run "
                     "another --run_name")
            launch = rt.detect_launch_env()
            if launch["world_size"] != env.world_size:
                whose += (f" (the launcher says this process is rank {launch['rank']} of {launch['world_size']}, "
                          f"but this trainer was given world_size={env.world_size}: leave rank and world_size "
                          f"out to take them from the launcher)")
            elif self.maybe_unnamed_rank and rt.started_by_my_parent(holder):
                whose = f"a process started beside this one, each as rank 0 of 1: {UNNAMED_RANK}"
            raise RunDirInUse(f"the run dirs (log_dir {cfg.log_dir}, checkpoint_dir {cfg.checkpoint_dir}) are in "
                              f"use by {holder}: {whose}")
        # one dir for both (the VJ2 script's default): an error names the setting the user gave
        one_dir = Path(cfg.log_dir).absolute() == Path(cfg.checkpoint_dir).absolute()
        self.log = rt.setup_logger(cfg.log_dir, env.rank, cfg.debug,
                                   named=f"checkpoint_dir {cfg.checkpoint_dir} (the log_dir too)" if one_dir else None)
        self._tb_writer = self._tensorboard_writer() if cfg.tensorboard else None
        self.log.info("rank %d/%d, local_rank %d, device %s, backend %s, timeout %.0fs, %d CPU threads",
                      env.rank, env.world_size, env.local_rank, env.device, env.backend or "none (1 process)",
                      cfg.dist_timeout, torch.get_num_threads())
        if env.is_main and rt.ctrl_c_ignored() and "TORCHELASTIC_RUN_ID" not in os.environ:  # (torchrun: its own)
            self.log.info("Ctrl-C is ignored in this process (started in the background by a shell script): "
                          "kill -TERM %d stops the run with a save", os.getpid())
        if self.maybe_unnamed_rank:
            self.log.warning("this process was started by multiprocessing with MASTER_ADDR or MASTER_PORT set, and "
                             "nothing names its rank: it trains alone, as rank 0 of 1; %s", UNNAMED_RANK)
        # Rank 0 writes every checkpoint and the run's files, so all ranks stop on its answer. The log dir too:
        # an existing rank_0.log opens for appending in a dir where no file can be created, and metrics.jsonl,
        # config.yaml and the markers would fail later, with a traceback.
        ckpt_problem, log_problem = rt.broadcast_object(
            (rt.unwritable_dir(cfg.checkpoint_dir), None if one_dir else rt.unwritable_dir(cfg.log_dir))
            if env.is_main else None)
        if ckpt_problem:
            raise ValueError(f"checkpoint_dir {cfg.checkpoint_dir}: cannot write or list checkpoints there "
                             f"({ckpt_problem}); a state elsewhere still resumes with resume=PATH")
        if log_problem:
            raise ValueError(f"log_dir {cfg.log_dir}: cannot create the run's files there ({log_problem})")

    def _take_run_lock(self) -> Optional[str]:
        """None, or who holds the run dirs. A trainer of this process that was dropped without close() sits in
        reference cycles (hooks on its model) until the cycle collector runs: a collection frees its lock."""
        holder = self.run_lock.acquire(rt.run_identity())
        if holder and holder.startswith(rt.RunDirLock.this_process()):
            gc.collect()
            holder = self.run_lock.acquire(rt.run_identity())
        return holder

    def _take_builtin_lm(self, train_dataset, val_dataset, test_dataset, checkpoint_extra, describe) -> tuple:
        """No model given: the built-in CausalLM and its data (model, the three datasets, checkpoint_extra and
        describe, each completed)."""
        given = [name for name, ds in (("train_dataset", train_dataset), ("val_dataset", val_dataset),
                                       ("test_dataset", test_dataset)) if ds is not None]
        if given:  # they would be dropped without a word
            raise ValueError(f"{', '.join(given)} given without a model: with no model the trainer trains its "
                             f"built-in CausalLM on its own data (synthetic, or the 'data' file); pass "
                             f"model= to train on these")
        model, (train_dataset, val_dataset, test_dataset) = self._builtin_lm()
        checkpoint_extra = {"model_config": model.config, **(checkpoint_extra or {})}
        describe = describe or f"CausalLM {model.config}"
        # settings that change what the weights compute without changing their shapes (num_heads); dropout
        # is a training choice, which a resume may change
        self.resume_must_match["model"] = {k: v for k, v in model.config.items() if k != "dropout"}
        return model, train_dataset, val_dataset, test_dataset, checkpoint_extra, describe

    def _check_checkpoint_extra(self, user_extra, weights_key, builtin_data: bool) -> None:
        if not isinstance(weights_key, str) or weights_key in ("global_step", "val_loss", "model_config"):
            raise ValueError(f"weights_key {weights_key!r}: a checkpoint's own fields are global_step, val_loss (and "
                             f"model_config for the built-in LM); expected another name (a string) for the weights")
        own = {weights_key, "global_step", "val_loss"} | ({"model_config"} if builtin_data else set())
        taken = sorted(own & set(user_extra or {}))
        if taken:
            raise ValueError(f"checkpoint_extra: the keys {taken} are the checkpoint's own ({sorted(own)}): the "
                             f"weights or the step would be replaced in every file; give them other names")
        check_loadable(user_extra or {}, "checkpoint_extra")

    def _set_up_bookkeeping(self) -> None:
        """The memory manager, the checkpoint writer and the loop's counters and flags, fresh."""
        cfg, env = self.cfg, self.env
        self.memory = rt.MemoryManager(env.device, self.log, cfg.memory_check_interval,
                                       cfg.cleanup_interval, cfg.max_memory_gb)
        self.metrics_path = Path(cfg.log_dir) / "metrics.jsonl"
        self.changed_rates = None  # a resume's (saved, configured) learning rates and weight decays, if they differ
        self._tb = None
        self._bar = None
        self.in_train = False
        self.let_go = False  # train() or close() has released the run dirs, the logger and the process group
        self.ckpt_dir = Path(cfg.checkpoint_dir)
        wait_s = WRITE_WAIT_FRACTION * cfg.dist_timeout if env.is_distributed else None
        self.writer = rt.CheckpointWriter(cfg.async_checkpoint, self.log, pin=self.non_blocking, wait_s=wait_s)
        self.mfu_per_unit = self._mfu_per_unit()
        self.stepped = False  # this process completed a step (DDP has seen a whole backward)
        self.updating = False  # in the optimizer's step or after_step: the weights are no step's whole ones
        self._metrics_file = None
        # why rank 0 could not append to metrics.jsonl, once it could not: every rank stops on it (see
        # _stop_for_the_metrics)
        self.metrics_failed: Optional[str] = None
        self.state_step: Optional[int] = None  # the step of the newest resumable state this run saved
        # (step, tags) of the step and epoch weights files saved at `step` before its validation, if any
        self.unvalidated_files: tuple = (None, [])
        self.weights_saved: set = set()  # (kind, N) of the step and epoch files saved (queued) by this session

        for name, value in self.FRESH_COUNTERS.items():
            setattr(self, name, value)
        # names this run's metrics file among others in a shared log dir; carried by its states (not drawn from
        # the seeded streams, which a resume must find untouched)
        self.run_id = secrets.token_hex(8)
        self.local_errors: list = []
        self.spare_batch = None
        self.extra_names = None  # see _extra_names
        self.micro_splits = 1
        self.loader_rng = {"epoch_start": self.train_loader.generator.get_state(),
                           "current": self.train_loader.generator.get_state()}

    def _log_precision_and_schedule(self) -> None:
        """What amp and the schedule settings come to here: amp_dtype fp16 on the CPU, say, is full precision."""
        cfg = self.cfg
        precision = {None: "fp32", torch.bfloat16: "bf16 autocast",
                     torch.float16: "fp16 autocast with a GradScaler"}[self.amp_dtype]
        if self.amp_dtype is None and cfg.use_amp and self.env.device.type == "cpu":
            precision += " (on the CPU only amp_dtype bf16 autocasts)"
        decay = "constant" if cfg.lr_schedule == "constant" else f"{cfg.lr_schedule} to {cfg.min_lr_ratio:g} x"
        self.log.info("precision: %s; learning rate %g, %d warm-up steps, then %s", precision, cfg.learning_rate,
                      cfg.warmup_steps, decay)
        if cfg.warmup_steps >= self.total_steps:
            self.log.warning("warmup_steps=%d is not below the run's %d steps: the learning rate never gets past its "
                             "warm-up", cfg.warmup_steps, self.total_steps)

    # Settings a rank (a node) may have of its own: its loader workers, how long it waits, its logs and memory
    # readings, its paths (each node's copy of the data, of the init_from file, its dirs: what they hold is
    # compared where it is read)
    OWN_SETTINGS = ("debug", "num_workers", "pin_memory", "loader_timeout", "dist_timeout", "first_step_timeout",
                    "log_interval", "tensorboard", "memory_check_interval", "cleanup_interval", "max_memory_gb",
                    "log_dir", "checkpoint_dir", "data", "init_from")

    def _check_ranks_have_the_same_config(self) -> None:
        """Every other setting must be the same on every rank: nodes launched with other flags (max_steps, say)
        took other schedules and step counts, and failed later on diverged replicas or a collective that timed
        out, neither naming the flag."""
        if not self.env.is_distributed:
            return
        mine = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k not in self.OWN_SETTINGS}
        every = rt.gather_objects(mine)
        differ = [k for k in mine if any(e.get(k) != every[0].get(k) for e in every)]
        if differ:
            shown = "; ".join(_by_value(every, k) for k in differ)
            raise ValueError(f"the ranks were given different settings: {shown}. Give every rank (every node's "
                             f"launcher) the same flags and config file")

    def _check_ranks_have_the_same_data(self, train_dataset, val_dataset, test_dataset) -> None:
        """Each rank reads its own copy of the data (a node-local copy, a file skipped as bad on one rank only,
        a copy still being written): ranks whose sets differ in size take other step and batch counts and wait
        in collectives the others never reach, and ranks whose contents differ train on other samples than the
        sampler meant. Refused here on every rank. Under dispatch rank 0 alone reads the training set."""
        if not self.env.is_distributed:
            return
        mine = {"validation samples": _size(val_dataset), "test samples": _size(test_dataset)}
        if self.cfg.data_strategy == "shard":
            mine = {"training samples": _size(train_dataset), **mine,
                    "training data fingerprint": self.data_fingerprint}
        mine.update(self.resume_must_match)  # what a resume checks (the VJ2 validation files' fingerprint)
        every = rt.gather_objects(mine)
        differ = [k for k in mine if any(e[k] != every[0][k] for e in every)]
        if differ:
            here = f" (this rank's: --data {self.cfg.data})" if self.cfg.data else ""
            raise DataMismatch(f"the ranks were given different data: {'; '.join(_by_value(every, k) for k in differ)}. "
                               f"Each rank reads its own copy{here}: give every rank the same files")

    def _builtin_lm(self) -> tuple:
        """The default: a CausalLM and its data (synthetic, or cfg.data); (model, (train, val, test))."""
        cfg = self.cfg
        data = build_lm_data(cfg)
        if data.vocab_size > cfg.vocab_size:
            self.log.info("vocab_size raised from %d to %d for %s", cfg.vocab_size, data.vocab_size,
                          data.info["source"])
        vocab = max(cfg.vocab_size, data.vocab_size)
        model = CausalLM(vocab, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.seq_len, cfg.dropout)
        self.data_info = data.info
        self.data_fingerprint = data_fingerprint(data.train)
        return model, (data.train, data.val, data.test)

    def _set_loss(self, loss_fn, count_unit: str, builtin_data: bool) -> None:
        """The loss (lm_loss by default) and what a step's throughput counts: the loss's own count, except
        where lm_loss normalises by sample and so counts samples (the built-in data's windows all have
        seq_len targets; a user's may not)."""
        self.tokens_per_sample = None
        if loss_fn is not None and self.cfg.loss_normalization != TrainConfig.loss_normalization:
            self.log.warning("loss_normalization=%s is the default loss's (lm_loss) setting: your loss_fn "
                             "normalises by the count it returns", self.cfg.loss_normalization)
        self.default_loss = loss_fn is None and not builtin_data  # a custom model trained with lm_loss
        if loss_fn is None:
            norm = self.cfg.loss_normalization
            loss_fn = lambda m, b: lm_loss(m, b, norm)  # noqa: E731
            if norm == "sample" and builtin_data:
                self.tokens_per_sample = self.cfg.seq_len
            elif norm == "sample":
                count_unit = "samples"
        if not (isinstance(count_unit, str) and count_unit.isidentifier()):
            raise ValueError(f"count_unit {count_unit!r}: expected a plain name such as 'tokens' or 'samples' (the "
                             f"records' rate field is <count_unit>_per_s)")
        self.loss_fn = loss_fn
        self.count_unit = count_unit

    def _wrap_model(self, model: nn.Module, describe: Optional[str]) -> None:
        """The model on its device (raw_model), compiled if asked, and in DDP on several ranks (model)."""
        cfg, env = self.cfg, self.env
        # a model the caller compiled: its inner model is the one whose weights are saved and loaded
        self.raw_model = getattr(model, "_orig_mod", model).to(env.device)
        # the step's gradient checks walk this list, not the module tree (~0.15 ms a step on a 12-layer model)
        self.named_params = list(self.raw_model.named_parameters())
        self.module_classes = module_structure(self.raw_model)  # what every state records, and a resume compares
        # what a training forward may move besides the weights: a skipped or failed step puts it back
        self.buffers_before_step = BufferSnapshot(self.raw_model)
        # buffers left out of the state dict (persistent=False): those training moves (a running statistic) go
        # into each resumable state with the digest of their value here, and a resume restores them only into a
        # model that starts them alike (a cache built from another configuration keeps its own)
        self.transient_buffers = [(f"{prefix}.{name}".lstrip("."), m, name) for prefix, m in
                                  self.raw_model.named_modules() for name in sorted(m._non_persistent_buffers_set)
                                  if m._buffers.get(name) is not None]
        self.transient_start = {full: rt.tensor_digest(m._buffers[name]) for full, m, name in self.transient_buffers}
        self.set_train_mode = True  # every module to train mode at the next step (evaluation leaves eval mode)
        # dropout, and a dataset's own draws (numpy's, python's) in the main process, differ per rank from here on
        torch.manual_seed(cfg.seed + 1000 * env.rank)
        np.random.seed(cfg.seed + 1000 * env.rank)
        random.seed(cfg.seed + 1000 * env.rank)
        n_params = sum(p.numel() for p in model.parameters())
        self.log.info("model: %s, %s parameters", describe or type(self.raw_model).__name__, f"{n_params:,}")
        if self.data_info:
            self.log.info("data: %s", self.data_info)
        compiled = model is not self.raw_model
        trained = torch.compile(model) if cfg.compile and not compiled else model  # shares the parameters of `model`
        # DDP's, where there is DDP; one process checks unused parameters by it too
        self.model, self.static_graph = trained, use_static_graph(model, cfg)
        if not env.is_distributed:
            self.step_model = WrappedLikeDDP(trained)
            return
        self.log.info("DDP static_graph=%s", self.static_graph)
        if self.static_graph and cfg.grad_accum_steps > 1:
            self.log.warning("static_graph with grad_accum_steps=%d: a resumed run matches an "
                             "uninterrupted one only to rounding, not bit for bit", cfg.grad_accum_steps)
        self.model = DDP(trained, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                         find_unused_parameters=cfg.find_unused_parameters, static_graph=self.static_graph,
                         gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_cap_mb)
        # DDP's forward may broadcast rank 0's buffers (BatchNorm's statistics) before it runs the module: a
        # replay after a forward that got that far must not broadcast again, or it meets the peers' gradient
        # all-reduce with a broadcast (see _accumulate)
        self.model.register_forward_pre_hook(self._note_ddp_forward)
        self.step_model = self.model
        # the reducer's own numbering of the parameters, which its errors use (those DDP ignores left out)
        names = {id(p): n for n, p in self.named_params}
        try:
            params = self.model._build_params_for_reducer()[0]
        except AttributeError:  # another torch: every parameter that requires a gradient, in module order
            params = [p for _, p in self.named_params if p.requires_grad]
        self.reducer_params = [(names.get(id(p), "?"), p) for p in params]

    def _note_ddp_forward(self, module, args) -> None:
        self.ddp_forward_entered = True

    def _build_loaders(self, train_dataset, val_dataset, test_dataset, collate_fn) -> None:
        cfg, env = self.cfg, self.env
        pin = pins_host_memory(cfg, env.device)
        loader = lambda ds, train: rt.build_dataloader(  # noqa: E731
            ds, cfg.batch_size, train=train, rank=env.rank, world_size=env.world_size, seed=cfg.seed,
            num_workers=cfg.num_workers, pin_memory=pin, collate_fn=collate_fn, timeout_s=cfg.loader_timeout,
            local_world_size=rt.local_world_size(env.world_size))
        if isinstance(train_dataset, torch.utils.data.IterableDataset) and cfg.data_strategy != "dispatch":
            raise ValueError("an iterable (streamed) training set cannot be sharded by index; "
                             "use data_strategy='dispatch' (--data_strategy dispatch)")
        if isinstance(train_dataset, torch.utils.data.IterableDataset) and cfg.num_workers and env.is_main:
            self.log.warning("num_workers=%d is not used for a stream: rank 0 reads it in its own process (each "
                             "worker would yield the whole stream unless the dataset splits itself)", cfg.num_workers)
        if cfg.data_strategy == "dispatch":
            self.train_loader = rt.DispatchLoader(train_dataset, cfg.batch_size, rank=env.rank,
                                                  world_size=env.world_size, seed=cfg.seed, collate_fn=collate_fn,
                                                  num_workers=cfg.num_workers, pin_memory=pin,
                                                  timeout_s=cfg.loader_timeout, peers_wait_s=self._peers_wait_s())
        else:
            self.train_loader = loader(train_dataset, True)
        for name, ds in (("val_dataset", val_dataset), ("test_dataset", test_dataset)):
            if isinstance(ds, torch.utils.data.IterableDataset) or (ds is not None and not hasattr(ds, "__len__")):
                raise ValueError(f"{name}: evaluation shards a set by index over the ranks; a stream "
                                 f"({type(ds).__name__}) cannot be, give a map-style dataset (__len__, __getitem__)")
            if ds is not None and len(ds) == 0:
                raise ValueError(f"{name} is empty (0 samples); pass None for no "
                                 f"{'validation' if name == 'val_dataset' else 'test'} set")
        self.val_loader = loader(val_dataset, False) if val_dataset is not None else None
        if self.val_loader is None and (cfg.patience or cfg.target_loss is not None):
            raise ValueError(f"patience={cfg.patience}, target_loss={cfg.target_loss}: early stopping reads the "
                             f"validation loss, and this run has no validation set (val_fraction 0, or no "
                             f"val_dataset)")
        self.test_loader = loader(test_dataset, False) if test_dataset is not None else None
        self.non_blocking = pin
        # dispatch: rank 0's reader has its own (rt.DispatchLoader), and the other ranks read nothing
        self.loader_backstop_s = self._backstop_s(self.train_loader) if cfg.data_strategy == "shard" else None

    def _backstop_s(self, loader) -> Optional[float]:
        """The backstop of a loader of this run's (rt.loader_backstop_s), for its workers or this process."""
        return rt.loader_backstop_s(loader.num_workers, self.cfg.loader_timeout, self._peers_wait_s())

    def _peers_wait_s(self) -> float:
        """The longest a rank waits for its peers in a collective."""
        return max(self.cfg.dist_timeout, self.cfg.first_step_timeout)

    def _count_steps(self) -> None:
        """Steps per epoch and in all; a stream's epoch lasts until it ends, its run until max_steps."""
        cfg = self.cfg
        stream = False
        try:
            batches_per_epoch = len(self.train_loader)
        except TypeError:
            stream = True
            if not cfg.max_steps:
                raise ValueError("a training set without a length (a stream) needs max_steps") from None
            batches_per_epoch = cfg.max_steps * cfg.grad_accum_steps
        self.steps_per_epoch = batches_per_epoch // cfg.grad_accum_steps
        # what the records state: a stream's epoch ends when the stream does, whatever steps that takes
        self.known_steps_per_epoch = None if stream else self.steps_per_epoch
        if self.steps_per_epoch < 1:
            raise ValueError(f"{batches_per_epoch} batch(es) per epoch, fewer than "
                             f"grad_accum_steps={cfg.grad_accum_steps}")
        self.total_steps = cfg.max_steps or cfg.num_epochs * self.steps_per_epoch

    def _build_optimizer(self) -> None:
        """AdamW, its LR schedule, and the precision (autocast dtype, a GradScaler for fp16)."""
        cfg, env = self.cfg, self.env
        self.optimizer = build_optimizer(self.raw_model, cfg.learning_rate, cfg.weight_decay, env.device,
                                         self.make_optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        # what a resumed state's optimizer is set back to (read here: a state that fails half-way may change them);
        # an optimizer of the caller's may have no weight decay, nor these kernel choices
        self.configured_rates = [(g["initial_lr"], g.get("weight_decay")) for g in self.optimizer.param_groups]
        self.configured_kernels = [{k: g[k] for k in OPTIMIZER_KERNELS if k in g} for g in self.optimizer.param_groups]
        rates = [lr for lr, _ in self.configured_rates]
        if self.make_optimizer is not None and cfg.learning_rate not in rates and env.is_main:
            # Adam(model.parameters()) in the factory: torch's default rate, where the log says learning_rate
            self.log.warning("optimizer=: its groups' learning rates %s are what the schedule scales, not "
                             "learning_rate %g (a factory that ignores the groups it is given sets its own)",
                             rates, cfg.learning_rate)
        self.amp_dtype = amp_dtype_for(cfg, env.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.env.device.type, dtype=self.amp_dtype)

    # -- one optimizer step -----------------------------------------------------

    def _forward_backward(self, batch, last: bool, weight: float):
        """One micro-step. Non-final micro-steps accumulate locally; only the last all-reduces. A replay (weight
        zero) leaves the RNG streams as they were: its draws (dropout) depend on the spare batch's shape, which
        differs in a resumed run (its first batch), and would make it differ from the uninterrupted one."""
        if weight != 0:
            return self._micro_step(batch, last, weight)
        streams = rt.rng_state(self.env.device)
        try:
            return self._micro_step(batch, last, weight)
        finally:
            rt.set_rng_state(streams, self.env.device)

    def _micro_step(self, batch, last: bool, weight: float):
        model = self.step_model
        batch = to_device(batch, self.env.device, self.non_blocking)
        # static_graph records the graph in DDP's first backward, which must all-reduce: that step syncs
        # every micro-step (averaging is linear, so the result is the same; it costs extra all-reduces once).
        local = self.env.is_distributed and not last and not (self.static_graph and not self.stepped)
        sync = model.no_sync() if local else contextlib.nullcontext()
        # a replay only completes the collectives: it must not move a buffer either (BatchNorm's running
        # statistics, a model's own), nor leave one that its forward replaced
        kept = BufferSnapshot(self.raw_model).take() if weight == 0 else None
        with sync:
            with self._autocast():
                out = loss_terms(self.loss_fn(model, batch), self.env.device)
            if kept is not None:
                kept.put_back()
            # Scaling by a constant that is equal on all ranks keeps DDP's average a plain
            # sum; the true 1/global_count is applied once all counts are known.
            scaled = out[0].float() * (weight / self.cfg.batch_size)
            try:
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            except Exception as exc:
                exc.ddp_phase = "backward"
                raise
        count = out[1].detach() if torch.is_tensor(out[1]) else out[1]  # loss_terms: a tensor or a float
        return out[0].detach() * weight, count * weight, {k: v.detach() * weight for k, v in out[2].items()}

    def _extra_names(self, mine: list) -> list:
        """The names of the loss's extras, agreed at this process's first step (one gather, once)."""
        if self.extra_names is None:
            seen = rt.gather_objects(mine)
            if any(names != seen[0] for names in seen):  # every rank knows it: fail together, nothing to save
                raise StepFailed("loss_fn returned different extras on different ranks at the first step: "
                                 + "; ".join(f"rank {r}: {names}" for r, names in enumerate(seen)))
            try:
                check_extra_names(mine, RECORD_FIELDS | {f"{self.count_unit}_per_s"}, "a metrics record", VAL_PREFIX)
            except ValueError as exc:
                raise StepFailed(f"step {self.global_step + 1}: {exc}") from None
            self.extra_names = mine
        return self.extra_names

    def _hint_for(self, exc: Exception) -> str:
        """What a step's error may mean in this trainer's terms ("" where nothing more is known)."""
        died = worker_death_note(str(exc))
        if died:
            return died
        if self.default_loss:
            return (" (no loss_fn= was given: the default is lm_loss, for (tokens, targets) batches of a causal "
                    "LM)")
        if isinstance(exc, AttributeError) and type(self.step_model).__name__ in str(exc):
            return (" (loss_fn gets the model wrapped, as DistributedDataParallel wraps it on several ranks; in "
                    "one process, WrappedLikeDDP: call it as model(...) and compute the rest in its forward; a "
                    "method called through model.module would skip DDP's gradient all-reduce)")
        return ""

    def _abandoned(self, fatal: Optional[str], exc: Exception) -> StepAbandoned:
        return StepAbandoned(f"step {self.global_step + 1} failed on rank {self.env.rank}: "
                             f"{fatal or 'out of memory in the forward'} (and the step could not be completed "
                             f"with the other ranks: {type(exc).__name__}: {rt.GLOO_ADVICE.split(str(exc))[0]})")

    def _train_step(self, micro_batches: list, stop_signal: rt.StopSignal) -> dict:
        """Forward/backward over the accumulation window, one small all-reduce of
        [count, loss, flags..., extras...], then a step that all ranks agree on.

        A rank whose batch failed to load, or whose forward or backward raised, replays a batch it
        loaded earlier with weight zero: its collectives still match the other ranks', it adds
        nothing to the gradient or the counts, and the error reaches every rank through the same
        all-reduce instead of leaving them waiting in a collective."""
        if self.set_train_mode:  # a walk of every module (~0.2 ms): at the first step and after evaluation only
            self.step_model.train()
            self.set_train_mode = False
        self.buffers_before_step.take()
        tally, data_errors, fatal, oom = self._accumulate(micro_batches)
        grads, raw_norm = self._gradients(tally)
        g, names, raw_norm_value = self._agree(tally, raw_norm, data_errors, fatal, oom, stop_signal)
        count = g["count"]
        if count < 0:  # the same sum on every rank: they stop together, before the update would minimise -loss
            self._stop_together(f"step {self.global_step + 1}: loss_fn's counts add up to {count:g} over the ranks; "
                                f"a count is a number of items or a sum of weights, never negative")
        # the rate this step uses (read before the scheduler moves it on), whether it is taken or skipped
        per = count or 1.0  # a count may be a sum of weights below 1; none (0) is a skipped step, below
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        result = {"count": count, "loss": g["loss"] / per, "stop": g["stop"] > 0,
                  "lr": lrs[0], "lrs": lrs if len(set(lrs)) > 1 else None, "write_failed": g["write_failed"] > 0,
                  "metrics_failed": g["metrics_failed"] > 0,
                  "extras": {n: v / per for n, v in zip(names, g["extras"])}}
        scaler_overflow = self.scaler is not None and g["bad_grads"] > 0  # with a GradScaler, its normal business
        nonfinite = (g["nonfinite"] > 0 or (g["bad_grads"] > 0 and self.scaler is None)) and not g["oom"]
        if g["oom"] or nonfinite or count == 0 or scaler_overflow:
            self.optimizer.zero_grad(set_to_none=True)
            if g["oom"] or nonfinite or count == 0:  # a NaN batch's statistics would poison every evaluation
                self._restore_buffers()
            if self.scaler and grads:  # unscaled above; without gradients the scaler has nothing to learn from
                # an attempt retried after out of memory is no step: its scale and growth count stay as they were
                self.scaler.update(self.scaler.get_scale() if g["oom"] else None)
            # nothing counted on any rank, though every batch loaded (failed loads are max_errors_per_epoch's)
            empty = count == 0 and not g["oom"] and not g["data_errors"]
            result.update(skipped=True, nonfinite=nonfinite, empty=empty, grad_norm=float("nan"),
                          retry=bool(g["oom"]))
            if g["nonfinite"] > 0 or count == 0:  # the tally left the non-finite losses out, or holds nothing
                result["loss"], result["extras"] = float("nan"), dict.fromkeys(names, float("nan"))
            if not g["oom"]:  # retried: not a step yet
                self._skip_in_schedule()
            return result
        norm = self._apply_update(grads, raw_norm_value, count)
        result.update(skipped=False, nonfinite=False, empty=False, grad_norm=norm)
        return result

    def _accumulate(self, micro_batches: list) -> tuple:
        """Forward and backward of every micro-batch into a StepTally; (tally, data errors, this rank's
        fatal error or None, out of memory). A failed micro-batch is replayed from a spare with weight zero."""
        tally = StepTally(self.env.device)
        data_errors, fatal, oom = 0, None, False
        for k, batch in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            weight = 1.0
            if isinstance(batch, BatchError):
                if batch.fatal:
                    fatal = fatal or f"data loading failed: {batch.text}"
                    if not self.env.is_distributed:  # no collectives to keep: the step fails as it is
                        break
                elif batch.counted:
                    data_errors += 1
                    self.local_errors.append(f"data error: {batch.text}")
                batch, weight = self._spare_micro_batch(batch.text), 0.0
            elif self.spare_batch is None:
                self.spare_batch = batch
            if fatal or oom:  # this step is lost: keep the collectives, skip the work
                try:
                    batch, weight = self._tiny_spare(fatal or "out of memory"), 0.0
                except StepFailed:
                    raise
                except Exception as spare_exc:  # not in place of the error that lost the step
                    raise self._abandoned(fatal, spare_exc) from spare_exc
            self.ddp_forward_entered = False
            try:
                tally.add(*self._forward_backward(batch, last, weight))
                continue
            except Exception as exc:
                if fatal is not None or oom:  # a replay failed
                    raise self._abandoned(fatal, exc) from exc
                if is_collective_error(exc):  # not this rank's failure: a peer is gone (see _explain_failure)
                    raise
                # torch raises a loader worker's death from its SIGCHLD handler, in whatever runs then
                phase = "the DataLoader" if worker_death_note(str(exc)) else getattr(exc, "ddp_phase", "forward")
                if is_out_of_memory(exc) and phase == "forward":
                    oom = True  # retried by every rank with smaller micro-batches
                    self.log.warning("out of memory in the forward of step %d", self.global_step + 1)
                else:
                    fatal = f"{type(exc).__name__} in {phase}: {exc}" + self._hint_for(exc)
                    self.log.error("step %d raised on this rank: %s", self.global_step + 1, traceback.format_exc())
                # the failed forward's activations live as long as the frames of its traceback
                traceback.clear_frames(exc.__traceback__)
            # one process keeps no collectives: no replay, which would only fail again (a bug in loss_fn), or
            # out of memory again where the spare cannot be cut smaller (the retry then names why)
            if (fatal or oom) and not self.env.is_distributed:
                break
            # replayed outside the except block, whose exception would keep them: out of memory, they are the
            # memory the replay needs
            if self.env.device.type == "cuda":
                torch.cuda.empty_cache()
            if self.ddp_forward_entered:  # its buffer broadcast, if this micro-step has one, is done
                self.model.require_forward_param_sync = False
            try:
                tally.add(*self._forward_backward(self._tiny_spare(fatal or "out of memory"), last, 0.0))
            except Exception as replay_exc:  # e.g. DDP had reduced part of a backward that died half-way
                raise self._abandoned(fatal, replay_exc) from replay_exc
        return tally, data_errors, fatal, oom

    def _gradients(self, tally: "StepTally") -> tuple:
        """This rank's gradients (unscaled) and their norm, not yet read on the host; whether it is finite
        goes into the tally, so that every rank learns it."""
        # each .grad read is a trip into C++: read them once (the same tensors until zero_grad)
        every = [p.grad for _, p in self.named_params]
        grads = [g for g in every if g is not None]
        if self.scaler and grads:  # none: one process's step lost before its backward, nothing scaled to undo
            self.scaler.unscale_(self.optimizer)
        # what one process checks for unused parameters (see _unused_parameters; DDP's reducer checks its own, and
        # a static graph may leave a fixed set unused): no walk of the list in the step otherwise
        if not self.env.is_distributed and not self.static_graph:
            tally.missing = [n for (n, p), g in zip(self.named_params, every) if g is None and p.requires_grad]
        # no gradients (one process's step lost before its backward): torch's norm of none is a CPU zero, which the
        # tally's device tensors could not be packed with
        raw_norm = (torch.nn.utils.get_total_norm(grads).double() if grads else
                    torch.zeros((), dtype=torch.float64, device=self.env.device))
        # agreed through the all-reduce, not read from each rank's norm: gradients DDP does not average
        # (parameters it ignores) may differ between ranks
        tally.bad_grads = (~torch.isfinite(raw_norm)).double()
        return grads, raw_norm

    def _agree(self, tally: "StepTally", raw_norm: torch.Tensor, data_errors: int, fatal: Optional[str],
               oom: bool, stop_signal: rt.StopSignal) -> tuple:
        """The step's one all-reduce: every rank's counts, flags and extras, summed. A failure on any rank
        raises on every rank here. Returns (the sums by name, StepTally.FIELDS and the flags', with `extras`;
        the extras' names; this rank's gradient norm), read on the host together."""
        # one process stops a lost step before its backward, and before some of its micro-batches (see
        # _accumulate): no gradients, or extras it did not reach, say nothing then
        lost = (fatal is not None or oom) and not self.env.is_distributed
        unused = [] if lost else self._unused_parameters(tally)
        if lost:
            names = tally.names if self.extra_names is None else self.extra_names
        else:
            names = self._extra_names(tally.names)
        if tally.names != names and fatal is None and not lost:  # the all-reduce packs `names`, alike on every rank
            fatal = (f"loss_fn returned the extras {tally.names} at step {self.global_step + 1}, but {names} at "
                     f"the first step; every rank and step must return the same names")
        flags = {"stop": stop_signal.received is not None, "data_errors": data_errors, "fatal": fatal is not None,
                 "unused": bool(unused), "oom": oom, "write_failed": self.writer.failed(),
                 "metrics_failed": self.metrics_failed is not None}
        reduced = rt.all_reduce_tensor(tally.packed(list(flags.values()), names), on_device=True)
        # the agreement and the norm come back together: with NCCL the step's one host sync (a GradScaler adds its own)
        *reduced, raw_norm_value = torch.cat([reduced, raw_norm.reshape(1).to(reduced.device)]).tolist()
        keys = (*StepTally.FIELDS, *flags)
        g = dict(zip(keys, reduced), extras=reduced[len(keys):])
        if g["fatal"] or g["unused"]:
            self._raise_collectively(fatal or (f"parameters without gradients: {', '.join(unused)}"
                                               if unused else None))
        if g["data_errors"]:
            self._count_data_errors(int(g["data_errors"]))
        return g, names, raw_norm_value

    def _restore_buffers(self) -> None:
        """The model's buffers (BatchNorm's running statistics, a model's own) as before this step's forwards."""
        self.buffers_before_step.put_back()

    def _apply_update(self, grads: list, raw_norm_value: float, count: float) -> float:
        """Scale the averaged gradients to the global mean and clip them; step. Returns the norm before
        clipping."""
        # DDP averaged the per-rank sums: grad = (1/W) sum S / B. Make it sum S / N.
        factor = self.env.world_size * self.cfg.batch_size / count
        norm = raw_norm_value * factor
        # clip * (1 / x), not clip / x: the rounding of the runs and states made before this code (bit-identical)
        coef = factor * (min(self.cfg.grad_clip * (1.0 / (norm + 1e-6)), 1.0) if self.cfg.grad_clip > 0 else 1.0)
        torch._foreach_mul_(grads, coef)
        self.updating = True  # until after_step returns (a failure in between leaves no step's weights)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.after_step is not None:  # an EMA of the weights, say: on every rank, after each applied update
            with torch.no_grad():
                self.after_step(self.raw_model, self.global_step + 1)
        self.updating = False
        return norm

    def _skip_in_schedule(self) -> None:
        """A skipped step counts towards max_steps, so the schedule moves on too: the rate of step N is the
        schedule's at N whatever was skipped before, and the run ends at its floor. (torch warns of a scheduler
        that steps before its optimizer has, which a skipped first step does on purpose.)"""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()

    def _tiny_spare(self, why: str):
        """Two samples of the spare batch: enough to complete this rank's collectives with weight zero (one
        is too few for BatchNorm in training mode), small enough to fit after an out-of-memory error."""
        spare = self._spare(why)
        try:
            return rt.split_batch(spare, 0, (rt.batch_len(spare) + 1) // 2)  # samples 0 and (n + 1) // 2
        except TypeError:  # NotSplittable, or no tensor to count samples by: with weight zero, the whole will do
            return spare

    def _spare_micro_batch(self, why: str):
        """The spare cut to this step's micro-batch size: after an out-of-memory retry the whole spare would not
        fit, and each retry would split the failed batch further while replaying it whole."""
        spare = self._spare(why)
        if self.micro_splits == 1:
            return spare
        try:
            return rt.split_batch(spare, 0, self.micro_splits)
        except TypeError:  # cannot be split: the step's retry stops at _split_micro_batches before this
            return spare

    def _split_micro_batches(self, micro: list, ways: int, retry: bool = False) -> list:
        """Each micro-batch in `ways` pieces. A failed batch stays one error (counted by its first piece), and
        none on a `retry`: the step's first attempt counted it."""
        if ways == 1:
            return micro
        # from what every rank knows alike (training batches are full): a rank whose batches all failed to
        # load must not go on into the step while the others stop
        if self.micro_splits > self.cfg.batch_size:
            raise self._cannot_retry("out of memory even with micro-batches of one sample")
        if all(isinstance(b, BatchError) for b in micro):  # nothing to split: the others' verdict, from the spare
            self._split_batch(self._spare("out of memory"), ways)
        out = []
        for b in micro:
            if isinstance(b, BatchError):
                out.extend(dataclasses.replace(b, counted=b.counted and not retry and k == 0) for k in range(ways))
            else:
                out.extend(self._split_batch(b, ways))
        return out

    def _split_batch(self, batch, ways: int) -> list:
        try:
            return [rt.split_batch(batch, k, ways) for k in range(ways)]
        except TypeError as exc:  # the same batch layout on every rank: every rank stops here
            raise self._cannot_retry(f"out of memory, and its micro-batches cannot be split to retry with fewer "
                                     f"samples: {exc}; lower batch_size, or give per-sample values (a count per "
                                     f"sample, not one for the batch)") from None

    def _cannot_retry(self, why: str) -> StepFailed:
        """The out-of-memory retry cannot go on. Each rank decides it from what it holds, without a collective,
        so rank 0 saves the last good weights (the failed step changed nothing) on its own."""
        self._save_weights_here()
        return StepFailed(f"step {self.global_step + 1}: {why}")

    def _spare(self, why: str):
        """A batch that loads, to replay with weight zero in place of one that failed (`why`); read by index,
        and with the RNG streams put back after, so that a dataset's own draws (augmentation) leave no trace
        in the run."""
        if self.spare_batch is None:
            ds, samples = self.train_dataset, []
            if isinstance(ds, torch.utils.data.IterableDataset):
                # Only under dispatch, where a stream's parts load or fail together (_PartsCollate): all raise here
                raise StepFailed(f"step {self.global_step + 1}: {why}; no batch of the stream has loaded yet "
                                 f"to stand in for it (a stream cannot be read by index)")
            streams, first_error = rt.rng_state(self.env.device), None
            try:
                for i in range(len(ds)):
                    try:
                        samples.append(ds[i])
                    except Exception as exc:  # a bad sample is exactly what we are working around
                        first_error = first_error or f"{rt.error_text(exc)} (sample {i})"
                        continue
                    if len(samples) == self.cfg.batch_size:
                        break
            finally:
                rt.set_rng_state(streams, self.env.device)
            if len(samples) < self.cfg.batch_size:
                # under dispatch a rank reads nothing else: one whose first part fails reads the set for this
                reader = " (data_strategy dispatch: before its first part, a rank reads its own)" \
                    if self.cfg.data_strategy == "dispatch" else ""
                raise RuntimeError(f"{why}; no batch to replay in its place: fewer than batch_size="
                                   f"{self.cfg.batch_size} samples of the training set load on this rank{reader}, "
                                   f"the first error: {first_error}")
            self.spare_batch = self.train_loader.collate_fn(samples)
        return self.spare_batch

    def _unused_parameters(self, tally: "StepTally") -> list:
        """Parameters that got no gradient in this step's synced backward on this rank. Under DDP without
        find_unused_parameters their bucket is left unreduced here while a peer that used them waits in its
        all-reduce: the next collective would meet it (gloo aborts the process, NCCL hangs). A zero gradient
        for each completes that all-reduce, so the step can fail on every rank at the agreement, named."""
        if self.cfg.find_unused_parameters:
            return []
        if not self.env.is_distributed:  # what DDP would refuse at scale-up, found on one process already
            return tally.missing  # (none gathered under a static graph, which may leave a fixed set unused)
        try:
            self.model._check_reducer_finalized()  # one C++ call: every bucket was reduced
            return []
        except RuntimeError as exc:
            reducer_error = str(exc)
        unready = self._unready_parameters(reducer_error)
        if not unready:
            raise StepAbandoned(f"step {self.global_step + 1}: DDP did not reduce every gradient on rank "
                                f"{self.env.rank}, and which parameters it waits for is unknown: {reducer_error}")
        try:
            torch.autograd.backward([p.sum() * 0.0 for _, p in unready])
        except RuntimeError as completion_exc:
            raise StepAbandoned(f"step {self.global_step + 1}: parameters without gradients on rank "
                                f"{self.env.rank} ({', '.join(n for n, _ in unready)}), and their all-reduce "
                                f"could not be completed: {completion_exc}") from completion_exc
        return [n for n, _ in unready]

    def _unready_parameters(self, reducer_error: str) -> list:
        """(name, parameter) of those DDP's reducer still waits for: its error lists their indices among its
        parameters; failing that, those without a gradient (exact without accumulation, whose gradients start the
        step as None)."""
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", reducer_error)
        indices = [int(i) for i in found.group(1).split()] if found else []
        if indices and max(indices) < len(self.reducer_params):
            return [self.reducer_params[i] for i in indices]
        return [(n, p) for n, p in self.reducer_params if p.grad is None]

    def _raise_collectively(self, mine: Optional[str]) -> None:
        """Every rank learns every rank's error, logs them, and raises the same error; the weights (untouched
        by the failed step) go to <prefix>_interrupted.pt first."""
        reports = rt.gather_objects(mine)
        lines = [f"rank {r}: {m}" for r, m in enumerate(reports) if m]
        text = f"step {self.global_step + 1} failed on " + "; ".join(lines)
        if any("parameters without gradients" in line for line in lines):
            text += (" -- the model's forward left these parameters unused; set find_unused_parameters=true "
                     "(--find_unused_parameters true) or make every parameter take part in the loss (under "
                     "torch.utils.checkpoint: use_reentrant=False, whose recomputation autograd sees; the "
                     "reentrant one leaves its parameters without gradients when its input needs none)")
        self._stop_together(text)

    def _stop_together(self, text: str) -> None:
        """A step failure every rank knows alike: the model as before the step (its buffers too) goes to
        <prefix>_interrupted.pt, then every rank raises the same StepFailed."""
        self.log.error(text)
        self._restore_buffers()
        try:  # a failed write reaches every rank alike (the writer's flush): all go on to raise the cause
            self._save_last_good()
        except Exception as exc:
            self.log.error("could not save the last good weights: %s: %s", type(exc).__name__, exc)
        raise StepFailed(text, agreed=True)

    def _explain_failure(self, exc: Exception, where: Optional[str] = None) -> StepFailed:
        """A collective failed (peer exited or timed out): name the rank and its error where
        it left a FAILED marker, or the rank that did not answer a monitored barrier. `where`: when it
        happened, the step under way by default."""
        where = where or f"step {self.global_step + 1}"
        peers = rt.read_failure_markers(self.cfg.log_dir, exclude=self.env.rank, wait_s=5.0,
                                        world_size=self.env.world_size)
        if peers:
            text = f"{where}: " + "; ".join(f"rank {p['rank']} failed: {p['error']}" for p in peers)
        elif rt.timed_out(exc):
            text = (f"{where}: a collective did not complete within dist_timeout={self.cfg.dist_timeout:g}s "
                    f"(a rank is stuck, dead or far slower); {rt.missing_ranks(5.0)}")
        elif any(t in str(exc).lower() for t in PEER_LOST_TEXT):
            text = (f"{where}: a peer was lost (it exited without a word or was killed: its exit status or "
                    f"the kernel's log says why): {type(exc).__name__}: {rt.GLOO_ADVICE.split(str(exc))[0]}")
        else:
            text = f"{where}: {type(exc).__name__}: {exc}"
        rt.log_to_file(self.log, logging.ERROR, text)  # the console gets it once, as the run's error
        return StepFailed(text)

    def _count_data_errors(self, n: int) -> None:
        """Recoverable batch-loading errors, counted per epoch on every rank alike. Every rank learns what failed
        where (one gather, on a step with errors only): rank 0's line, the console's, names a peer's too."""
        self.epoch_data_errors += n
        mine = self.local_errors[-1] if self.local_errors else None
        if self.epoch_data_errors > self.cfg.max_errors_per_epoch:
            self._raise_collectively(f"{mine} ({self.epoch_data_errors} data errors this epoch, "
                                     f"max_errors_per_epoch={self.cfg.max_errors_per_epoch})" if mine else None)
        where = "; ".join(f"rank {r}: {text}" for r, text in enumerate(rt.gather_objects(mine)) if text)
        self.log.warning("%d batch(es) failed to load at step %d (%d this epoch, max %d); the step uses the "
                         "other batches%s", n, self.global_step + 1, self.epoch_data_errors,
                         self.cfg.max_errors_per_epoch, f"; {where}" if where else "")
        self.local_errors.clear()

    # -- evaluation -------------------------------------------------------------

    def evaluate(self, loader=None) -> dict:
        """Mean loss over the whole set (the validation set by default), on all ranks, each over its shard: a
        loader given here must hold this rank's shard. Called outside train(), it stops the loader's workers
        when it is done, as train() does when it returns."""
        if self.env.is_distributed and not dist.is_initialized():
            raise RuntimeError("evaluate() after train() on a multi-process trainer: train() has left the process "
                               "group, so each rank would see only its own shard; evaluate within the run "
                               "(val_interval, test_dataset=) or load the saved weights into a new trainer")
        loader = self.val_loader if loader is None else loader  # not `or`: an empty shard's loader is falsy
        if loader is None:
            raise ValueError("evaluate(): this trainer has no validation set (val_dataset= not given, or "
                             "val_fraction=0); pass evaluate(loader)"
                             + (", a loader over this rank's shard (sums and counts are all-reduced over the ranks)"
                                if self.env.is_distributed else ""))
        self.set_train_mode = True
        rt.broadcast_buffers(self.raw_model)
        try:
            own = loader is self.val_loader or loader is self.test_loader
            return evaluate_model(self.raw_model, loader, self.loss_fn, self.env.device, self._autocast,
                                  self.non_blocking, self.log, self._backstop_s(loader) if own else None)
        finally:
            if not self.in_train:
                rt.stop_workers(loader)

    # -- checkpoints and metrics ------------------------------------------------

    def checkpoint_path(self, tag: str) -> Path:
        return self.ckpt_dir / f"{self.cfg.checkpoint_prefix}_{tag}.pt"

    def checkpoint_payload(self) -> dict:
        """Weights only (no `module.` prefix), step, the model config, and the val loss of these weights
        when they were validated (not an earlier step's)."""
        payload = {self.weights_key: rt.unwrap_state_dict(self.model), "global_step": self.global_step,
                   **self.checkpoint_extra}
        if self.last_val is not None and self.last_val_step == self.global_step:
            payload["val_loss"] = self.last_val
        return payload

    def save_checkpoint(self, tag: str, then=None) -> Path:
        """Rank 0 writes the checkpoint payload atomically, in the background unless async_checkpoint
        is off, then calls `then()`; a failed write is an error on every rank."""
        path, payload = self.checkpoint_path(tag), self.checkpoint_payload()
        self.writer.save(payload, path, group=self.global_step, then=then, again=True)
        if self.env.is_main:
            self.log.info("%s checkpoint %s (step %d%s)", self._saved(), path, self.global_step,
                          f", val_loss {payload['val_loss']:.6f}" if "val_loss" in payload else "")
        return path

    # -- resumable state ----------------------------------------------------------

    def _saved(self) -> str:
        """How a save is logged: with the background writer the file is not on disk yet when the loop goes on."""
        return "writing (in the background)" if self.writer.background else "saved"

    def weights_files(self, kind: str) -> list:
        """The <prefix>_<kind>_N.pt files (kind: step or epoch) in the checkpoint dir, oldest first."""
        return [p for _, p in self._numbered(kind)]

    def _still_kept(self, path: Path) -> bool:
        """Whether keep_checkpoints keeps this weights file beside the newer ones on disk or saved by this session
        (a failed step or epoch file they have pushed out is not written again: only to be pruned, on a disk
        that was just full)."""
        match = re.fullmatch(rf"{re.escape(self.cfg.checkpoint_prefix)}_(step|epoch)_(\d+)\.pt", path.name)
        if match is None or not self.cfg.keep_checkpoints:
            return True
        kind, n = match[1], int(match[2])
        newer = {m for m, _ in self._numbered(kind)} | {m for k, m in self.weights_saved if k == kind}
        return len([m for m in newer if m > n]) < self.cfg.keep_checkpoints

    def _numbered(self, kind: str) -> list:
        """(N, path) of every <prefix>_<kind>_N.pt in the checkpoint dir, by N."""
        found = []
        for p in self.ckpt_dir.glob(f"{self.cfg.checkpoint_prefix}_{kind}_*.pt"):
            tail = p.stem.rsplit("_", 1)[-1]
            if tail.isdigit():
                found.append((int(tail), p))
        return sorted(found)

    def state_path(self, step: int) -> Path:
        return self.ckpt_dir / f"{self.cfg.checkpoint_prefix}_state_step_{step}.pt"

    def state_files(self) -> list:
        """Resumable states in the checkpoint dir, oldest first."""
        return [p for _, p in self._states_by_step()]

    def _states_by_step(self) -> list:
        """(step, path) of every resumable state in the checkpoint dir, oldest first."""
        return self._numbered("state_step")

    def state_payload(self) -> dict:
        """Everything needed to continue bit-exactly: weights, optimizer, schedule, scaler,
        counters, position in the epoch, and every rank's RNG streams (gathered to rank 0).
        Collective: every rank calls it, and the replicas are checked to be identical first."""
        rt.check_replicas(self.raw_model)
        return self._state(rt.gather_objects(self._rng_streams()))

    def _rng_streams(self) -> dict:
        return {**rt.rng_state(self.env.device), "loader": dict(self.loader_rng)}

    def _state(self, per_rank_rng: list) -> dict:
        """The resumable state (live tensors, not copies) with the given RNG streams of every rank."""
        return {"model": rt.unwrap_state_dict(self.model), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "counters": {k: getattr(self, k) for k in self.STATE_COUNTERS},
                "rng": per_rank_rng, "run": self._run_signature(), "seeded_samples": self._seeded_samples(),
                "data_fingerprint": self.data_fingerprint, "must_match": self.resume_must_match,
                "modules": self.module_classes, "run_id": self.run_id,
                "init_from": self.initialised_from, "optimizer_class": optimizer_name(self.optimizer),
                "optimizer_groups": self._optimizer_groups(),
                "transient_buffers": self._moved_transient_buffers()}

    def _moved_transient_buffers(self) -> dict:
        """{name: {"start": digest at set-up, "value": tensor}} of the non-persistent buffers training moved."""
        moved = {}
        for full, m, name in self.transient_buffers:
            t = m._buffers.get(name)
            if t is not None and rt.tensor_digest(t) != self.transient_start[full]:
                moved[full] = {"start": self.transient_start[full], "value": t}
        return moved

    def _load_transient_buffers(self, saved: dict, path: Path, fresh: dict) -> None:
        """The moved non-persistent buffers of a state into the model, where it started them alike; the others
        as set-up made them (`fresh`: a state that failed half-way may have set some; states before 27 Nov
        2026, 14:00 hold none)."""
        for full, m, name in self.transient_buffers:
            entry, mine = saved.get(full), m._buffers.get(name)
            if mine is None:
                continue
            value = fresh[full]
            if isinstance(entry, dict) and entry.get("start") == self.transient_start[full] and \
                    (entry["value"].shape, entry["value"].dtype) == (mine.shape, mine.dtype):
                value = entry["value"]
            elif isinstance(entry, dict):
                self.log.warning("%s: its non-persistent buffer %s was moved by training, but this model starts it "
                                 "otherwise (another configuration?): it keeps its own", path, full)
            with torch.no_grad():
                mine.copy_(value)

    def _optimizer_groups(self) -> list:
        """The parameters of each optimizer group, by name: what its saved moments belong to."""
        names = {id(p): n for n, p in self.named_params}
        return [[names.get(id(p), "?") for p in g["params"]] for g in self.optimizer.param_groups]

    def _check_optimizer(self, state: dict, path: Path) -> None:
        """A state resumes only into an optimizer of its class and its groups of parameters: another class
        would drop its moments, other groups would fail to load (read as damage) or give each parameter
        another's moments."""
        carry = f"another run_name with init_from {path} starts a new run from these weights"
        # states before 27 Nov 2026, 13:30 name none: AdamW over the two groups, the only optimizer then
        was = state.get("optimizer_class", "torch.optim.adamw.AdamW")
        if was != optimizer_name(self.optimizer):
            raise StateMismatch(f"{path} was written with the optimizer {was}, this run has "
                                f"{optimizer_name(self.optimizer)}; resuming with another optimizer is refused "
                                f"(its state would not carry over: {carry}; or use the original optimizer)")
        groups, mine = state.get("optimizer_groups"), self._optimizer_groups()
        # recorded by name since 27 Nov 2026, 13:40 (before: the sizes); a saved optimizer whose groups differ
        # from its own record is damage, left to the load to fail
        sizes = ([len(g) for g in groups] if groups is not None else
                 [len(g["params"]) for g in state["optimizer"]["param_groups"]])
        differ = groups != mine if groups is not None else sizes != [len(g) for g in mine]
        if differ:
            raise StateMismatch(f"{path} was written with optimizer groups of {sizes} parameters, this run's "
                                f"have {[len(g) for g in mine]}" + (" (the same sizes, other parameters)"
                                                                      if sizes == [len(g) for g in mine] else "") +
                                f"; resuming with other groups is refused ({carry}; or group them as before)")

    def _check_modules(self, saved: Optional[list], path: Path) -> None:
        """A state resumes only into a model of the same modules: weights of the same names and shapes load
        into a model with another activation (ReLU for GELU) without a word, and a finished run would hand back
        its old summary. States before 27 Nov 2026 hold no list: not checked."""
        mine = self.module_classes
        if saved is None or saved == mine:
            return
        was, now = dict(map(tuple, saved)), dict(map(tuple, mine))
        name = next((n for n in [*was, *now] if was.get(n) != now.get(n)), None)
        if name is None:
            differs = "its modules come in another order"
        else:
            differs = (f"its {f'module {name}' if name else 'model class'} is {was.get(name, 'absent')}, this "
                       f"run's is {now.get(name, 'absent')}")
        raise StateMismatch(f"{path} holds another model: {differs}; resuming it is refused (--resume none or "
                            f"another --run_name starts fresh; or use the original model)")

    def _check_data_fingerprint(self, saved, path: Path) -> None:
        """The training data of a state must be this run's (the built-in data's, or what data_fingerprint= gave):
        another file, or synthetic data drawn otherwise (the streams changed on 25 Nov 2026), would go on
        unnoticed."""
        if self.data_fingerprint is None or saved is None:
            return
        if saved == "absent":
            self.log.warning("%s predates the training data's fingerprint: that it holds the same data as this run "
                             "cannot be checked (synthetic data is drawn otherwise since 25 Nov 2026)", path)
            return
        ours = self.data_fingerprint
        if not saved.startswith((FINGERPRINT_VERSION, USER_FINGERPRINT)) and not ours.startswith(USER_FINGERPRINT):
            # a state of the first kind: compared the way it was made
            ours = first_kind_fingerprint(self.train_dataset)
        if saved != ours:
            raise StateMismatch(f"{path} was written while training on other data (fingerprint {saved}, this run's "
                                f"{ours}); resuming it is refused (--resume none or another "
                                f"--run_name starts fresh; or use the original data settings)")

    def _seeded_samples(self) -> bool:
        """Whether loader workers read the samples, each under a seed of its own (see rt.build_dataloader)."""
        loader = getattr(self.train_loader, "reader", self.train_loader)
        return getattr(loader, "num_workers", 0) > 0

    def save_state(self) -> Path:
        """Rank 0 writes the resumable state like a checkpoint, then prunes to the newest keep_states."""
        path = self.state_path(self.global_step)
        # Older states go only once the new one is complete.
        self.writer.save(self.state_payload(), path, group=self.global_step,
                         then=lambda: rt.keep_newest(self.state_files(), self.cfg.keep_states))
        self.state_step = self.global_step
        if self.env.is_main:
            self.log.info("%s resumable state %s (step %d, epoch %d, %d steps into the epoch)", self._saved(),
                          path, self.global_step, self.epoch + 1, self.step_in_epoch)
        return path

    def _train_samples(self) -> int:
        ds = self.train_dataset
        return len(ds) if hasattr(ds, "__len__") else -1

    # What a resumable state holds of the loop's progress, as a fresh run starts it
    FRESH_COUNTERS = {"global_step": 0, "epoch": 0, "step_in_epoch": 0,
                      "best_val": math.inf, "patience_ref": math.inf,  # patience: the last improvement by min_delta
                      "bad_validations": 0, "epoch_data_errors": 0, "consecutive_bad_steps": 0, "skipped_steps": 0,
                      "last_val": None, "last_val_step": -1,
                      "last_val_extras": None,  # loss_fn's extras at the last validation, by name
                      "stopped_early": False}  # the last validation stopped the run
    STATE_COUNTERS = tuple(FRESH_COUNTERS)

    def _init_weights(self, path: str) -> None:
        """A fresh run's weights from `path` (fine-tuning). Every rank reads the file, so every rank must find the
        same weights there; a file that does not fit the model is refused on every rank, naming what differs."""
        # rank 0 alone sets the earlier run's files aside, in its own checkpoint dir (a node's local disk)
        aside = rt.broadcast_object(self._init_from_set_aside(path) if self.env.is_main else None)
        try:
            if aside:
                raise ValueError(aside)
            weights, note = init_weights_in(rt.load_checkpoint(path), self.weights_key, self.checkpoint_extra,
                                            self.resume_must_match, frozenset(self.raw_model.state_dict()))
            check_fit(weights, self.raw_model.state_dict())
            self.raw_model.load_state_dict(weights)
            error = None
        except (rt.CheckpointError, ValueError) as exc:
            error = f"init_from {path}: {exc}"
        everyone = rt.gather_objects(error)
        errors = {e for e in everyone if e}
        if errors:  # usually the same on every rank; otherwise say which rank saw what
            raise ValueError(errors.pop() if len(errors) == 1 else
                             "; ".join(f"rank {r}: {e}" for r, e in enumerate(everyone) if e))
        if len(set(map(tuple, rt.gather_objects(rt.parameter_digests(self.raw_model))))) > 1:
            raise ValueError(f"init_from {path}: the ranks read different weights from it: every rank reads the "
                             f"file itself, so on several nodes it must be the same file on each")
        self.log.info("weights initialised from %s%s", path, note)

    def _init_from_set_aside(self, path: str) -> Optional[str]:
        """Why `path` cannot be init_from, or None: an earlier run's file in this run's checkpoint dir is moved
        aside at the start and replaced by this run's own of that name, so the same command run again would
        start from this run's weights, not those."""
        if Path(path).resolve() in {p.resolve() for p in itertools.chain(*self._files_to_set_aside())}:
            return (f"it is an earlier run's file in this run's checkpoint_dir {self.ckpt_dir}, which a fresh start "
                    f"moves into a previous_states.* subdir and then writes its own files of the same names: the "
                    f"same command run again would start from those. Copy it out of {self.ckpt_dir} first, or "
                    f"give this run its own run_name or checkpoint_dir")
        return None

    def _resume(self) -> Optional[Path]:
        """Load the state `resume` points at (auto: the newest one that loads). Every rank must
        arrive at the same file, and an error on any rank is an error on all of them."""
        mode = self.cfg.resume
        if mode == "none":
            return None
        explicit = mode != "auto"
        candidates = [Path(mode)] if explicit else list(reversed(self.state_files()))
        # as set-up made them: put back before each state (_load_transient_buffers)
        fresh = {full: m._buffers[name].clone() for full, m, name in self.transient_buffers}
        # A state that fails half-way leaves a mix behind; the next one to load overwrites all of it, and
        # when none loads the run stops instead of starting fresh from the mix.
        chosen, error = None, None
        for path in candidates:
            try:
                # on the CPU: RNG states must be CPU tensors; load_state_dict moves the rest to the device
                self._apply_state(rt.load_checkpoint(path, map_location="cpu"), path, fresh)
                chosen = path
                break
            except StateMismatch as exc:  # a state of another run configuration: refused, never skipped
                error = ("refused", str(exc))
                break
            except (rt.CheckpointError, RuntimeError, KeyError, ValueError) as exc:
                if explicit:
                    error = ("unreadable", f"--resume {path}: {exc}")
                    break
                self.log.warning("cannot resume from %s (%s); trying the previous state", path, exc)
        if chosen is None and candidates and error is None:  # starting fresh would overwrite the run's weights
            error = ("unreadable", f"none of the {len(candidates)} resumable states in {self.ckpt_dir} loads (see "
                                   f"the warnings above); --resume none or another --run_name starts fresh")
        everyone = rt.gather_objects((None if chosen is None else str(chosen), error))
        distinct = {e for _, e in everyone if e}
        if distinct:  # usually the same error on every rank; otherwise say which rank saw what
            text = (next(iter(distinct))[1] if len(distinct) == 1 else
                    "; ".join(f"rank {r}: {e[1]}" for r, (_, e) in enumerate(everyone) if e))
            raise (ValueError if {kind for kind, _ in distinct} == {"refused"} else rt.CheckpointError)(text)
        if len({c for c, _ in everyone}) != 1:  # node-local checkpoint dirs, or copies that differ
            chosen_by = "; ".join(f"rank {r}: {c or 'none'}" for r, (c, _) in enumerate(everyone))
            raise rt.CheckpointError(f"ranks chose different states to resume from ({chosen_by}): every rank reads "
                                     f"{self.ckpt_dir} itself, so on several nodes it must be a shared file system "
                                     f"(or hold the same files on each)")
        if chosen is None:
            self.log.info("no resumable state in %s: starting fresh", self.ckpt_dir)
            return None
        if not chosen.with_name(chosen.name + ".sha256").exists():  # a stop between the two writes leaves one so
            self.log.warning("%s has no .sha256 sidecar: resumed from it unchecked (corruption would go unseen)",
                             chosen)
        self.state_step = self.global_step
        # a validation redone at this step writes its step and epoch files again (rank 0 sees them: saves are
        # collective); an epoch file is this step's when the state is at an epoch's end
        tags = [f"step_{self.global_step}"] + ([f"epoch_{self.epoch}"] if self.step_in_epoch == 0 else [])
        if self.env.is_main:
            tags = [t for t in tags if self.checkpoint_path(t).exists()]
        self.unvalidated_files = (self.global_step, rt.broadcast_object(tags if self.env.is_main else None))
        self.log.info("resumed from %s at step %d (epoch %d, %d steps into it)", chosen,
                      self.global_step, self.epoch + 1, self.step_in_epoch)
        if self.global_step > self.total_steps:
            self.log.warning("the state is past this run's length (%d steps: max_steps or num_epochs): nothing "
                             "to train; the run ends at step %d", self.total_steps, self.global_step)
        # at an epoch's end too: a stream's epoch may have been cut at max_steps, and a longer run reads on
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset) and self.global_step:
            self.log.warning("the training set is a stream, which cannot be read from a position: the resumed run "
                             "reads it from its start, not from where step %d left it (exact resume is for "
                             "map-style datasets)", self.global_step)
        return chosen

    def _run_signature(self) -> dict:
        """What the sample order depends on: a state resumes only into a run with the same values."""
        return {"world_size": self.env.world_size, "batch_size": self.cfg.batch_size,
                "grad_accum_steps": self.cfg.grad_accum_steps, "seed": self.cfg.seed,
                "train_samples": self._train_samples()}

    def _apply_state(self, state: dict, path: Path, fresh_buffers: dict) -> None:
        missing = {"run", "model", "optimizer", "scheduler", "scaler", "counters", "rng"} - set(state)
        if missing:
            raise rt.CheckpointError(f"not a resumable state (a weights-only file?): it lacks {sorted(missing)}; "
                                     f"the states are {self.cfg.checkpoint_prefix}_state_step_N.pt (a weights "
                                     f"file starts a new run with --init_from)")
        # Another configuration is refused, never taken for damage: falling back past it would start
        # fresh and overwrite the finished run's weights.
        checks = [(key, state["run"][key], value) for key, value in self._run_signature().items()]
        for key, value in self.resume_must_match.items():  # states before 25 Nov 2026, 17:00 hold no must_match,
            was = state.get("must_match", {}).get(key, value)  # and earlier ones no "model": not checked
            if isinstance(was, dict) and isinstance(value, dict):  # name the entries that differ
                checks += [(f"{key} {k}", was.get(k), value.get(k)) for k in sorted(was.keys() | value.keys(), key=repr)]
            else:
                checks.append((key, was, value))
        for key, was, value in checks:
            if was != value:
                # the sample order's settings: the weights fit this run (a model's setting: they do not)
                carry = (f"another --run_name with --init_from {path} starts a new run from these weights, "
                         if key in self._run_signature() else "")
                raise StateMismatch(f"{path} was written with {key}={was}, this run has {key}={value}; resuming "
                                    f"with a different {key} is refused ({carry}--resume none or another "
                                    f"--run_name starts fresh; or use the original setting)")
        self._check_data_fingerprint(state.get("data_fingerprint", "absent"), path)
        self._check_modules(state.get("modules"), path)
        self._check_optimizer(state, path)
        saved = state.get("seeded_samples")  # absent from states written before 25 Nov 2026
        if saved is not None and saved != self._seeded_samples() and self.env.is_main:
            self.log.warning("%s was written with %s loader workers, this run has %s: a dataset that draws random "
                             "numbers in __getitem__ (augmentation) draws others than an unbroken run would, so the "
                             "weights will not match one bit for bit (a dataset without randomness is unaffected)",
                             path, "some" if saved else "no", "some" if not saved else "none")
        try:
            self.raw_model.load_state_dict(state["model"])
        except RuntimeError as exc:
            if "Error(s) in loading state_dict" not in str(exc):  # not a mismatch (out of memory, a device)
                raise
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise StateMismatch(f"{path} holds another model ({lines[1] if len(lines) > 1 else lines[0]} ...); "
                                f"resuming it is refused (--resume none or another --run_name starts fresh; or use "
                                f"the original model settings)") from exc
        self._load_transient_buffers(state.get("transient_buffers", {}), path, fresh_buffers)
        # this device's kernels, not the saving one's (a CPU state resumed on a GPU runs fused); before the load,
        # which places each moment's step counter by them (a fused kernel takes them on the GPU)
        saved = state["optimizer"]
        self.optimizer.load_state_dict({**saved, "param_groups": [
            {**g, **kernels} for g, kernels in zip(saved["param_groups"], self.configured_kernels)]})
        self.scheduler.load_state_dict(state["scheduler"])
        step = state["counters"]["global_step"]
        if self.scheduler.last_epoch != step:  # a state from before skipped steps moved the schedule on
            self.log.warning("%s: its schedule is at step %d of %d (skipped steps did not count then); it goes on "
                             "from step %d", path, self.scheduler.last_epoch, step, step)
            self.scheduler.last_epoch = step
        self._apply_configured_rates(self.configured_rates)
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        counters = {"epoch_data_errors": 0, **state["counters"]}  # a state from before these were saved:
        counters.setdefault("patience_ref", counters["best_val"])    # best_val was the reference then
        counters.setdefault("stopped_early", False)
        for k, v in counters.items():
            setattr(self, k, v)
        self.run_id = state.get("run_id", self.run_id)  # states before 27 Nov 2026 hold none: named from here on
        self.initialised_from = state.get("init_from")
        mine = state["rng"][self.env.rank]
        self.loader_rng = dict(mine["loader"])
        rt.set_rng_state(mine, self.env.device)

    def _apply_configured_rates(self, configured: list) -> None:
        """The optimizer and scheduler states carry the learning rate and weight decay they were saved with;
        this run's config wins, and the rate of the next step follows this run's schedule (another max_steps
        changes it). Unchanged settings give exactly the saved rate, so a resumed run stays bit-identical."""
        groups = self.optimizer.param_groups
        saved = [(g["initial_lr"], g.get("weight_decay")) for g in groups]
        self.changed_rates = (saved, configured) if saved != configured else None  # said by train(): see there
        self.scheduler.base_lrs = [lr for lr, _ in configured]
        step = self.scheduler.last_epoch
        for g, (lr, wd), factor in zip(groups, configured, self.scheduler.lr_lambdas):
            g["initial_lr"], g["lr"] = lr, lr * factor(step)  # LambdaLR's own formula
            if wd is not None:
                g["weight_decay"] = wd
        was, self.scheduler._last_lr = self.scheduler._last_lr, [g["lr"] for g in groups]
        if saved == configured and was != self.scheduler._last_lr:  # a finished cosine re-warms when lengthened
            self.log.warning("the learning rate of the next step is %.3g, not the state's %.3g: this run's schedule "
                             "(another max_steps or schedule settings) reshapes the rest of it",
                             self.scheduler._last_lr[0], was[0])

    def write_metrics(self, record: dict) -> None:
        """Rank 0 appends `record` to metrics.jsonl. A write that fails (a full disk, a file size limit) is not
        raised here, where rank 0 alone would leave the loop: it is noted, the step's all-reduce tells every rank,
        and all stop together (_stop_for_the_metrics). No record is written after it: the file would have a hole."""
        if not self.env.is_main or self.metrics_failed:
            return
        data = (json_line(record) + "\n").encode()
        fd = self._metrics_file.fileno()
        whole = os.fstat(fd).st_size
        try:
            while data:  # unbuffered: a failed write leaves no bytes behind to be flushed at close
                data = data[self._metrics_file.write(data):]
        except OSError as exc:
            self.metrics_failed = (f"rank 0 could not write {self.metrics_path} (the {record['type']} record of "
                                   f"step {self.global_step}): {type(exc).__name__}: {exc}")
            self.log.error("%s; the other ranks learn of it, and the run stops", self.metrics_failed)
            try:  # a short write (a file size limit, a disk filling mid-write) left part of the record
                os.ftruncate(fd, whole)
            except OSError as cut:
                self.log.error("could not cut the part of that record off %s: %s", self.metrics_path, cut)
            return
        if self._tb is not None and record["type"] in ("train", "val"):
            for key, value in record.items():
                if (isinstance(value, (int, float)) and not isinstance(value, bool)
                        and key not in ("step", "type", "steps_per_epoch")):
                    self._tb.add_scalar(f"{record['type']}/{key}", value, record["step"])
            for group, lr in enumerate(record.get("lrs", ())):  # one curve per parameter group
                self._tb.add_scalar(f"{record['type']}/lr_group_{group}", lr, record["step"])

    @staticmethod
    def _tensorboard_writer():
        """The writer class, looked up at set-up: a missing package is bad input, not a failure mid-run."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
        return SummaryWriter

    def _link_checkpoints(self) -> None:
        """The run dir points at its checkpoints when they live elsewhere."""
        run, ckpt = Path(self.cfg.log_dir).resolve(), self.ckpt_dir.resolve()
        if ckpt in (run, run / "checkpoints") or (run / "checkpoints").exists() or (run / "checkpoints").is_symlink():
            return
        try:
            (run / "checkpoints").symlink_to(ckpt, target_is_directory=True)
        except OSError:  # a filesystem without symlinks: leave the path instead
            (run / "checkpoints.path").write_text(str(ckpt) + "\n")

    # -- validation and stopping -----------------------------------------------

    def _validate(self, save_point_follows: bool = False) -> bool:
        """Validate, save best, and return the (collective) decision to stop early. `save_point_follows`: an
        epoch's or the run's closing validation moved before this step's save point, whose files a failure here
        still writes (a resumed run redoes such a validation; it does not redo a val_interval one)."""
        if self.val_loader is None:
            return False
        self.log.debug("[DDP] Rank %d: Entering validation at epoch %d, iter %d", self.env.rank, self.epoch,
                       self.global_step)
        try:
            res = self.evaluate()
        except EvaluationFailed as exc:
            self.log.error("validation at step %d: %s", self.global_step, exc)
            self._save_last_good()  # the weights of the steps so far are fine
            if save_point_follows:
                self._save_weights_file(f"step_{self.global_step}")
                self.save_state()
                self.writer.flush()
            raise
        except Exception as exc:
            if not is_collective_error(exc):
                raise
            # a peer died or hung in it: no collective save is possible, rank 0 keeps step N's weights alone
            self._save_weights_here()
            raise self._explain_failure(exc, f"validation after step {self.global_step}") from exc
        self.log.debug("[DDP] Rank %d: Exiting validation at epoch %d, iter %d", self.env.rank, self.epoch,
                       self.global_step)
        self.last_val, self.last_val_step = res["loss"], self.global_step
        self.last_val_extras = {k: v for k, v in res.items() if k not in ("loss", "count")}
        if not math.isfinite(res["loss"]):
            self.log.warning("the validation loss at step %d is %s: the model diverged or the validation data hold "
                             "non-finite values; it counts as no improvement", self.global_step, res["loss"])
        if self.state_step == self.global_step:  # that state predates this validation: the run's end saves again
            self.state_step = None
        step, tags = self.unvalidated_files
        if step == self.global_step:  # written before this validation (the epoch's, the run's end)
            for tag in tags:
                self.save_checkpoint(tag)  # again, now with the loss of its weights
        self.unvalidated_files = (None, [])
        # Patience counts from the last improvement by more than min_delta, so many small steps do not
        # reset it (as in Keras and Lightning); the best checkpoint follows every improvement.
        if res["loss"] < self.patience_ref - self.cfg.min_delta:
            self.patience_ref, self.bad_validations = res["loss"], 0
        else:
            self.bad_validations += 1
        if res["loss"] < self.best_val:
            self.best_val = res["loss"]
            self.save_checkpoint("best")
        extra = {f"val_{k}": v for k, v in self.last_val_extras.items()}
        # the epoch its step ran in, as a train record's: at an epoch's end self.epoch has moved on already
        epoch = self.epoch - 1 if self.step_in_epoch == 0 and self.global_step > 0 else self.epoch
        self.write_metrics({"type": "val", "step": self.global_step, "epoch": epoch,
                            "steps_per_epoch": self.known_steps_per_epoch,
                            "val_loss": res["loss"], **extra, "time": time.monotonic() - self.t0,
                            **({"loss_floor": self.data_info["loss_floor"]} if "loss_floor" in self.data_info
                               else {})})
        floor = self.data_info.get("loss_floor", self.data_info.get("unigram_entropy"))
        self.log.info("validation at step %d: loss %.5f (best %.5f)%s", self.global_step, res["loss"],
                      self.best_val, "" if floor is None else
                      f" [{'loss floor' if 'loss_floor' in self.data_info else 'unigram entropy'} {floor:.5f}]")
        self.stopped_early = self._early_stop()  # saved with the state: a resumed run knows it stopped here
        return self.stopped_early

    def _early_stop(self) -> bool:
        """The verdict of the validation at this step, moot when no step is left. Every rank holds the same
        all-reduced loss, so the ranks agree without more talk."""
        if self.last_val_step != self.global_step or self.global_step >= self.total_steps:
            return False
        if self.cfg.target_loss is not None and self.last_val <= self.cfg.target_loss:
            self.log.info("target_loss %.5f reached: stopping", self.cfg.target_loss)
            return True
        if self.cfg.patience and self.bad_validations >= self.cfg.patience:
            self.log.info("no improvement in %d validations: early stop", self.bad_validations)
            return True
        return False

    # -- the loop ---------------------------------------------------------------

    def train(self, stop_signal: Optional[rt.StopSignal] = None) -> dict:
        """Run to max_steps/num_epochs, early stop, or an agreed stop signal; returns a summary.
        `stop_signal`: one installed before the trainer was built (a signal during set-up then stops the
        run at its first step, with a save and the PREEMPTED marker); the caller restores it."""
        if self.let_go:  # it would train without the run-dir lock, the log file or the process group
            raise RuntimeError("DDPTrainer.train() runs once, and not after close(): the trainer has let go of its "
                               "run dirs, log file and process group; build a new DDPTrainer to train again "
                               "(resume='auto' continues this run)")
        self.let_go = True
        self.in_train = True  # evaluate() keeps the loader workers for the next validation
        own_signal = stop_signal is None
        stop_signal = (stop_signal or rt.StopSignal()).install(rt.StopSignal.SIGNALS)
        rt.clear_failure_marker(self.cfg.log_dir, self.env.rank)
        clean = False
        try:
            finished = self._finished_run()
            if finished is not None:
                summary = self._nothing_to_do(finished)
            else:
                if self.changed_rates:  # not before: a finished run trains no step with them
                    self.log.warning("the state was saved with (learning_rate, weight_decay) %s per parameter "
                                     "group; this run's %s apply from here on", *self.changed_rates)
                rt.run_on_rank0(self._prepare_run_dir, what="preparing the run directory")
                summary = self._finish(self._loop(stop_signal))
            clean = True
        except BaseException as exc:
            if isinstance(exc, Exception) and not isinstance(exc, StepFailed) and is_collective_error(exc):
                # a peer failed outside a training step (a save, the test set's evaluation): name it, at the step
                # it came after, not the next one, which never began; that step's weights are whole, and a save
                # point's collective save is what failed: rank 0 keeps them alone, as after a failed step
                if self.stepped:
                    self._save_weights_here()
                explained = self._explain_failure(exc, f"after step {self.global_step}")
                rt.log_failure(self.log, f"training failed after step {self.global_step}: {explained}", exc)
                raise explained from exc
            rt.log_failure(self.log, f"training failed after step {self.global_step}: {type(exc).__name__}: {exc}",
                           exc)
            if not isinstance(exc, StepFailed):  # the original error: let the other ranks name it
                rt.write_failure_marker(self.cfg.log_dir, self.env.rank, self.global_step + 1, exc)
            raise
        finally:
            self.writer.close(self.cfg.dist_timeout)  # a failing run still completes the writes it started
            if own_signal:
                stop_signal.restore()
            self.in_train = False
            self._stop_loader_workers()
            if self._bar is not None:
                self._bar.close()
            if self._metrics_file is not None:
                self._metrics_file.close()
            if self._tb is not None:
                self._tb.close()
            rt.teardown_distributed(synchronize=clean)
            rt.close_logger(self.log)
            self.run_lock.release()
        return summary

    def close(self) -> None:
        """For a trainer that will not train (built to evaluate, say): stop its loader workers and let go of its
        run dirs, which train() does when it ends."""
        if self._metrics_file is None and self.env.is_main and not self.let_go:  # training_logs reads this line
            self.log.info(CLOSED_UNTRAINED)
        self.let_go = True
        self._stop_loader_workers()
        self.run_lock.release()

    def _stop_loader_workers(self) -> None:
        """In train()'s cleanup: a failure here is reported, never raised over the run's own outcome."""
        for loader in (self.train_loader, self.val_loader, self.test_loader):
            try:
                rt.stop_workers(loader)
            except Exception as exc:  # noqa: BLE001 -- the workers are daemons: they end with this process
                self.log.warning("could not stop the DataLoader workers: %s: %s", type(exc).__name__, exc)

    def _finished_run(self) -> Optional[dict]:
        """The summary of a run of this length that finished in this run dir (its COMPLETED marker, which
        _finish writes last and a run removes when it starts): relaunching it has nothing to do. Read on
        rank 0 and shared, so every rank takes the same branch. Only for --resume auto: none or a PATH
        asks for training."""
        if self.cfg.resume != "auto":
            return None
        return rt.gather_objects(self._read_completed() if self.env.is_main else None)[0]

    def _read_completed(self) -> Optional[dict]:
        path = Path(self.cfg.log_dir) / COMPLETED_MARKER
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self.log.warning("ignoring %s: %s", path, exc)
            return None
        if record.get("run_id", self.run_id) != self.run_id:  # markers before 27 Nov 2026 name no run
            return None  # another run's, which finished in this log dir (its own checkpoint dir or prefix)
        if record.get("total_steps") != self.total_steps:
            return None  # a longer run trains on
        summary = record.get("summary")
        if summary and summary.get("status") == "early_stopped" and record.get("stop") != self._stop_rule():
            return None  # the stop is lifted or changed: the resumed loop decides again
        return summary

    def _stop_rule(self) -> dict:
        return {key: getattr(self.cfg, key) for key in ("patience", "min_delta", "target_loss")}

    def _nothing_to_do(self, summary: dict) -> dict:
        changed = ("" if not self.changed_rates else f", and this run's (learning_rate, weight_decay) "
                   f"{self.changed_rates[1]}, not the state's {self.changed_rates[0]}, train no step")
        self.log.info("this run already finished (%s at step %d, see %s): nothing to do%s; resume none "
                      "(--resume none) or another run_name starts a new one",
                      summary["status"], summary["steps"], Path(self.cfg.log_dir) / COMPLETED_MARKER, changed)
        # rewritten with this launch's id (launch_training.sh): a stop that comes now finds the run complete
        rt.run_on_rank0(self._write_completed_marker, summary, what="writing the COMPLETED marker")
        return {**summary, "already_complete": True}

    def _complete_run_dir(self, summary: dict) -> None:
        """A resumed run that finished: the weights of the stop it resumed from are not the run's last any
        more (the final ones are), and a user who finds them beside the final ones cannot tell which to take.
        A fresh run has set any of them aside at its start (_set_aside_old_states)."""
        stale = self.checkpoint_path("interrupted")
        if self.resumed_from is not None and stale.exists():
            step = self._saved_step(stale)
            if step is not None and step <= self.global_step:
                rt.remove_with_sidecar(stale)
                self.log.info("removed %s (step %d, where the run was stopped): %s holds its end (step %d)",
                              stale, step, self.checkpoint_path("final"), self.global_step)
        self._write_completed_marker(summary)

    def _write_completed_marker(self, summary: dict) -> None:
        record = rt.with_launch_id({"total_steps": self.total_steps, "stop": self._stop_rule(), "summary": summary,
                                    "run_id": self.run_id})
        rt.atomic_write_text(Path(self.cfg.log_dir) / COMPLETED_MARKER, json_line(record) + "\n")

    def _prepare_run_dir(self) -> None:
        """Rank 0: the run dir, its resolved config and metrics file, before the first step."""
        Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.cfg.log_dir) / rt.PREEMPTED_MARKER).unlink(missing_ok=True)
        (Path(self.cfg.log_dir) / COMPLETED_MARKER).unlink(missing_ok=True)  # until this run finishes
        self._start_metrics_file()
        if self.resumed_from is None:
            self._set_aside_other_ranks_logs()
        self._set_aside_old_states()
        if self.global_step <= self.total_steps:  # a shorter relaunch trains nothing: the file keeps the run's length
            self._write_resolved_config()
        self._link_checkpoints()
        log_files = tuple(f"{name}." for name in (self.metrics_path.name, "config.yaml", COMPLETED_MARKER,
                                                  rt.PREEMPTED_MARKER))
        for p in (rt.remove_stale_temp_files(self.ckpt_dir, (f"{self.cfg.checkpoint_prefix}_",)) +
                  rt.remove_stale_temp_files(self.cfg.log_dir, log_files)):
            self.log.warning("removed %s, left by a write that was cut short", p)
        self._tb = self._tb_writer(log_dir=str(Path(self.cfg.log_dir) / "tensorboard")) if self._tb_writer else None
        self._metrics_file = open(self.metrics_path, "ab", buffering=0)
        # which run and session wrote the records that follow (a fresh run's file starts with it); with the
        # launcher's id, its proof that this launch began training
        self.write_metrics(rt.with_launch_id({"type": "start", "run_id": self.run_id, "step": self.global_step,
                           "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
                           "world_size": self.env.world_size, "steps_per_epoch": self.known_steps_per_epoch,
                           "started": round(time.time(), 3)}))

    def _loop(self, stop_signal: rt.StopSignal) -> str:
        self.t0 = time.monotonic()
        self.samples_seen = 0
        self._bar = self._progress_bar()
        self._log_window = (time.time(), 0)  # since the last periodic log line: (start, steps)
        # the run stopped early here, and this run's patience/target_loss still say so (else it trains on)
        if self.resumed_from is not None and self.stopped_early and self._early_stop():
            return "early_stopped"
        while self.global_step < self.total_steps:
            status, epoch_done = self._epoch(stop_signal)
            # an early stop at an epoch's last step still ends that epoch (its count, its checkpoint)
            if epoch_done or (status == "early_stopped" and self.step_in_epoch >= self.steps_per_epoch):
                status = self._end_epoch(validate=status is None) or status
            if status is not None:
                return status
        # resumed from a stop at an epoch's last step (a stream's last step is never one)
        if self.step_in_epoch >= self.steps_per_epoch > 0 and self.known_steps_per_epoch is not None:
            status = self._end_epoch()
            if status is not None:
                return status
        if self.last_val_step != self.global_step and self._validate():
            return "early_stopped"
        return "completed"

    def _epoch(self, stop_signal: rt.StopSignal) -> tuple:
        """The steps of this epoch from step_in_epoch on: (a status that ends the run, or None; whether the
        epoch ran to its end)."""
        cfg = self.cfg
        global_batch = self._global_batch()
        batches = self._epoch_batches()
        # a map-style set's loader is never read past its end; a stream's __len__, if it has one, is an estimate
        exact = not isinstance(self.train_dataset, torch.utils.data.IterableDataset)
        # a stream of no length ends its epoch when it runs dry: the run's last step ends none (its range is
        # max_steps)
        stream = self.known_steps_per_epoch is None
        for i in range(self.step_in_epoch, self.steps_per_epoch):
            try:
                micro = next_micro_batches(batches, cfg.grad_accum_steps, self.loader_backstop_s, exact)
            except StopIteration:  # a stream ran dry; dispatch tells every rank at once
                break
            except rt.CollectiveFailed as exc:  # dispatch: rank 0 is gone or stuck
                self._save_weights_here()
                raise self._explain_failure(exc) from exc
            step_t = time.time()
            r = self._step(micro, stop_signal)
            self.global_step += 1
            self.step_in_epoch = i + 1
            self.samples_seen += global_batch
            self._after_step(r, time.time() - step_t, global_batch)
            self._report(r, step_t, global_batch)
            status = self._step_boundary(r, stop_signal)
            if status is not None:
                return status, False
            if self.global_step >= self.total_steps and (i < self.steps_per_epoch - 1 or stream):
                return None, False
        if self.step_in_epoch == 0:
            raise ValueError(f"the training data yielded no full step in epoch {self.epoch + 1}")
        return None, True

    def _epoch_batches(self):
        """An iterator over this epoch's batches from step_in_epoch on. The epoch's batch order is re-created
        exactly: same permutation, same loader seed, skipping what this epoch already consumed."""
        cfg, gen = self.cfg, self.train_loader.generator
        start = self.step_in_epoch
        gen.set_state(self.loader_rng["epoch_start" if start else "current"])
        self.loader_rng["epoch_start"] = gen.get_state()
        self.train_loader.sampler.set_epoch(self.epoch)
        self.train_loader.sampler.set_start_index(start * cfg.batch_size * cfg.grad_accum_steps)
        batches = iter(self.train_loader)
        self.loader_rng["current"] = gen.get_state()
        return batches

    def _step(self, micro: list, stop_signal: rt.StopSignal) -> dict:
        """One optimizer step, retried by every rank with smaller micro-batches after an out-of-memory error
        on any; a failure leaves what its kind calls for (a marker, the weights) and raises."""
        cfg = self.cfg
        first = not self.stepped
        self.updating = False  # an earlier train() of this trainer may have failed in its update
        try:
            micro = self._split_micro_batches(micro, self.micro_splits)
            r = self._train_step(micro, stop_signal)
            while r.get("retry"):  # out of memory somewhere: all ranks halve their micro-batches
                self.micro_splits *= 2
                self.log.warning("out of memory on some rank: retrying step %d with micro-batches split "
                                 "%d ways (gradient accumulation x%d)", self.global_step + 1,
                                 self.micro_splits, self.micro_splits)
                micro = self._split_micro_batches(micro, 2, retry=True)
                r = self._train_step(micro, stop_signal)
            self.stepped = True
        except StepFailed:
            raise
        except StepAbandoned as exc:  # the marker first: the others wait for it while the weights are saved
            rt.write_failure_marker(cfg.log_dir, self.env.rank, self.global_step + 1, exc)
            self._restore_buffers()  # the failed step's forwards moved them
            self._save_weights_here()
            raise
        except Exception as exc:
            if is_collective_error(exc):  # a peer died or hung: say which and where, then fail
                if self.updating:  # in the optimizer's step or after_step: the last save point's files are it
                    self.log.error("step %d failed in its update: no last good weights to save",
                                   self.global_step + 1)
                else:
                    self._restore_buffers()
                    self._save_weights_here()
                raise self._explain_failure(exc) from exc
            # this rank's own error past the step's agreement (in optimizer.step, say): the marker names it
            # to the others, who meet it at their next collective; these weights may be half-updated
            rt.write_failure_marker(cfg.log_dir, self.env.rank, self.global_step + 1, exc)
            raise
        if first and cfg.first_step_timeout > cfg.dist_timeout:  # also the first step after a resume
            rt.set_collective_timeout(cfg.dist_timeout)
        return r

    def _report(self, r: dict, step_t: float, global_batch: int) -> None:
        """The progress bar, and every log_interval steps a log line with the rate since the last one."""
        bar = self._bar
        if bar is not None:  # the step's numbers first: update() draws them
            bar.set_postfix(epoch=self.epoch + 1, loss=f"{r['loss']:.4f}", lr=f"{r['lr']:.2e}",
                            samples_s=f"{global_batch / (time.time() - step_t):.0f}", refresh=False)
            bar.update(1)
        window_t, window_steps = self._log_window
        window_steps += 1
        if self.global_step % self.cfg.log_interval == 0 or self.global_step == 1:
            rate = window_steps * global_batch / (time.time() - window_t)
            # epochs counted from 1 here, as the epoch files name them (metrics records count from 0); a
            # stream's epochs end when it does: no count of them
            known = self.known_steps_per_epoch
            self.log.info("epoch %s step %d/%d loss %.5f lr %.2e grad_norm %.3f %.0f samples/s",
                          f"{self.epoch + 1}/{-(-self.total_steps // known)}" if known else self.epoch + 1,
                          self.global_step, self.total_steps, r["loss"],
                          r["lr"], r["grad_norm"], rate, extra={"periodic": True})
            window_t, window_steps = time.time(), 0
        self._log_window = (window_t, window_steps)

    def _step_boundary(self, r: dict, stop_signal: rt.StopSignal) -> Optional[str]:
        """Validation and saves due at this step, then a stop if one is agreed; the status that ends the
        run, or None. The boundary work comes before a stop, so a resumed run repeats none of it."""
        save_point = bool(self.cfg.save_every_iters) and self.global_step % self.cfg.save_every_iters == 0
        interval = bool(self.cfg.val_interval) and self.global_step % self.cfg.val_interval == 0
        # A save point that the epoch's or the run's closing validation would follow at this step comes after it:
        # its files and state are then written once, with the loss, instead of written and then again. Not at a
        # stop, which must not wait for a validation; the resumed run redoes it, as it redoes those.
        closing = save_point and not interval and not r["stop"] and self._closing_validation_follows()
        early = (interval or closing) and self._validate(save_point_follows=closing)
        if save_point:
            self._save_weights_file(f"step_{self.global_step}")
            if not self._epoch_save_follows():  # the epoch's end saves this step's state (and its own counters)
                self.save_state()
        if r["write_failed"] or self.writer.retry_pending:
            self._save_again_after_a_failed_write()
        if r["metrics_failed"]:
            self._stop_for_the_metrics()
        if early:
            return "early_stopped"
        if r["stop"]:
            return self._interrupt(stop_signal)
        return None

    def _epoch_save_follows(self) -> bool:
        """This step ends an epoch whose end saves (save_interval): its files and a state come after it."""
        interval = self.cfg.save_interval
        return bool(interval) and self.step_in_epoch >= self.steps_per_epoch and (self.epoch + 1) % interval == 0

    def _closing_validation_follows(self) -> bool:
        """The epoch's validation (val_interval 0) or the run's last one comes after this step."""
        epoch_ends = not self.cfg.val_interval and self.step_in_epoch >= self.steps_per_epoch
        return epoch_ends or self.global_step >= self.total_steps

    def _end_epoch(self, validate: bool = True) -> Optional[str]:
        """An epoch ran to its end: per-epoch validation (unless its last step's save point came after one)
        and checkpoint; "early_stopped" or None."""
        cfg = self.cfg
        self.epoch += 1
        self.epoch_data_errors = 0
        self.step_in_epoch = 0
        stop = validate and not cfg.val_interval and self.last_val_step != self.global_step and self._validate()
        if cfg.save_interval and self.epoch % cfg.save_interval == 0:  # an early stop keeps its epoch's file
            self._save_weights_file(f"epoch_{self.epoch}")
            self.save_state()
        return "early_stopped" if stop else None

    def _save_weights_file(self, tag: str) -> None:
        """A step or epoch file (`step_N`, `epoch_N`), then the oldest of its kind beyond keep_checkpoints go;
        noted, so that a validation later at this step writes it again with its loss."""
        kind = tag.split("_")[0]
        self.save_checkpoint(tag, then=lambda: rt.keep_newest(self.weights_files(kind), self.cfg.keep_checkpoints))
        self.weights_saved.add((kind, int(tag.split("_")[1])))
        step, tags = self.unvalidated_files
        self.unvalidated_files = (self.global_step, (tags if step == self.global_step else []) + [tag])

    def _progress_bar(self):
        """tqdm on rank 0 when stdout is a terminal: it replaces the periodic step lines on the console
        (they still go to rank_0.log), and the other lines (validation, checkpoints, the summary) are
        printed above it. Files and CI get plain periodic lines."""
        if not (self.env.is_main and sys.stdout.isatty()) or terminal_columns(sys.stdout) == 0:
            return None  # a terminal of no width (a pty nobody sized: some containers and CI) shows no bar
        from tqdm import tqdm
        for h in [h for h in self.log.handlers if type(h) is logging.StreamHandler]:
            above = AboveTheBar(h.stream)
            above.setFormatter(h.formatter)
            above.setLevel(h.level)
            self.log.removeHandler(h)
            self.log.addHandler(above)
        return tqdm(total=self.total_steps, initial=self.global_step, unit="step", file=sys.stdout)

    def _save_again_after_a_failed_write(self) -> None:
        """A background write failed: rank 0 said so in this step's all-reduce, or a save point of this step met
        the error. This step's state is written (unless a save point of this step wrote it already), a weights
        file whose write failed is written again from its copy (the best weights of an earlier step), and both
        are waited for: a passing failure (a disk that was full for a moment) costs no work, where waiting for
        the next save point would leave two intervals unsaved. If this write fails too, the run stops."""
        if self.state_step != self.global_step:
            self.save_state()  # its flush meets the failed write, if no save point of this step did
        self.writer.write_failed_again(self._still_kept)  # weights files no later save point writes (best, step_N)
        self.writer.flush()
        self.writer.retry_pending = False

    def _save_weights_here(self) -> None:
        """Rank 0 writes the weights without the others (they may be gone): a step that failed in a
        collective has not reached the optimizer, so these are the last good weights."""
        if not self.env.is_main:
            return
        # the writes this rank queued first (this failure's own interrupted save, say): two writers of one file race
        self.writer.close(self.cfg.dist_timeout)
        path = self.checkpoint_path("interrupted")
        try:
            rt.atomic_save(rt.on_the_host(self.checkpoint_payload()), path)
            self.log.info("saved the last good weights to %s", path)
        except Exception as exc:  # the step's failure is the error to raise; this one is only logged
            self.log.error("could not save the last good weights to %s: %s: %s", path, type(exc).__name__, exc)

    def _save_last_good(self) -> None:
        """The weights before a failed step, on disk before the run raises."""
        self.save_checkpoint("interrupted")
        self.writer.flush()

    def _stop_for_the_metrics(self) -> None:
        """Rank 0 could not append to metrics.jsonl, and every rank knows it (the step's all-reduce, or at the end
        of the run): all stop together, raising rank 0's error, which names the file. As at a stop signal, the
        weights and a resumable state of this step are saved first (the checkpoint dir may have room), so that a
        relaunch, once there is room, resumes here."""
        text = rt.broadcast_object(self.metrics_failed)
        try:
            self.save_checkpoint("interrupted")
            if self.state_step != self.global_step:
                self.save_state()
            self.writer.flush()
            saved = (f"step {self.global_step}'s weights are in {self.checkpoint_path('interrupted')} and its "
                     f"resumable state beside them: free space (or raise the file size limit) and relaunch to resume")
        except Exception as exc:  # the metrics' error is the one to raise; this one is logged
            self.log.error("could not save step %d's files: %s: %s", self.global_step, type(exc).__name__, exc)
            saved = f"step {self.global_step}'s files could not be saved either: a relaunch resumes from the newest state"
        text = f"{text}; the run stopped on every rank after step {self.global_step}; {saved}"
        self.log.error(text)
        raise StepFailed(text)

    def _interrupt(self, stop_signal: rt.StopSignal) -> str:
        self.log.warning("stop signal received (%s): saving and exiting at step %d",
                         f"{stop_signal.name} here" if stop_signal.name else "by another rank", self.global_step)
        self.save_checkpoint("interrupted")
        if self.state_step != self.global_step:
            self.save_state()
        self._flush_writing_again_once("interrupted")  # the marker promises files that are on disk
        rt.run_on_rank0(self._write_preempted_marker, what="writing PREEMPTED marker")
        return "interrupted"

    def _flush_writing_again_once(self, tag: str) -> None:
        """Waits for this last step's files. One that failed (a disk full for a moment: this step's state, whose
        save point saved it already, or the `tag` weights) is written once more, as during training (see
        _save_again_after_a_failed_write), so that a passing failure at a stop or at the end costs no work; if
        that fails too, or a write hangs, the run stops."""
        try:
            self.writer.flush()
        except (rt.CheckpointError, rt.Rank0Failed) as exc:
            if not rt.CheckpointWriter.worth_writing_again(exc):
                raise
            self.log.error("%s; writing step %d's files again", exc, self.global_step)
            self.save_checkpoint(tag)
            self.state_step = None  # its save point's state may be the write that failed
            self._save_again_after_a_failed_write()
            return
        if self.writer.retry_pending:  # a save point of this step met an earlier failure (the closing validation's)
            self._save_again_after_a_failed_write()

    def _after_step(self, r: dict, step_time: float, global_batch: int) -> None:
        cfg = self.cfg
        self.skipped_steps += r["skipped"]
        bad = r["nonfinite"] or r["empty"]
        self.consecutive_bad_steps = self.consecutive_bad_steps + 1 if bad else 0
        count = r["count"] if self.tokens_per_sample is None else global_batch * self.tokens_per_sample
        mfu = None if self.mfu_per_unit is None else self.mfu_per_unit * count / step_time
        record = {"type": "train", "step": self.global_step, "epoch": self.epoch, "loss": r["loss"],
                  **({"mfu": mfu} if mfu is not None else {}),
                  **r["extras"], "lr": r["lr"], **({"lrs": r["lrs"]} if r["lrs"] else {}),
                  "grad_norm": r["grad_norm"],
                  "samples_per_s": global_batch / step_time, f"{self.count_unit}_per_s": count / step_time,
                  "skipped": r["skipped"], "time": time.monotonic() - self.t0}
        mem = self.memory.on_step(self.global_step)
        if mem:
            record.update(mem)
        self.write_metrics(record)
        if not bad:
            return
        what = "non-finite loss or gradients" if r["nonfinite"] else \
            "no counted items (loss_fn returned a count of 0 on every rank)"
        self.log.warning("%s at step %d: step skipped on all ranks (%d in a row)", what, self.global_step,
                         self.consecutive_bad_steps)
        if self.consecutive_bad_steps >= cfg.max_bad_steps:
            # Skipped steps left the weights untouched: these are the last good ones.
            self._save_last_good()
            n = self.consecutive_bad_steps
            error, text = ((Diverged, f"{n} consecutive non-finite steps") if r["nonfinite"] else
                           (StepFailed, f"{n} consecutive skipped steps, the last with {what}"))
            raise error(f"{text} (max_bad_steps={cfg.max_bad_steps}) at step {self.global_step}; last good weights "
                        f"saved to {self.checkpoint_path('interrupted')}", agreed=True)

    def _write_resolved_config(self) -> None:
        import yaml
        rt.atomic_write_text(Path(self.cfg.log_dir) / "config.yaml",
                             yaml.safe_dump(self.run_config or self._resolved_config(), sort_keys=False))

    def _resolved_config(self) -> dict:
        """The config, loadable again with --config, so a run can be repeated exactly."""
        resolved = dataclasses.asdict(self.cfg)
        if not self.builtin_lm:  # a record of the settings that trained this model, not of the LM's unused ones
            resolved = {k: v for k, v in resolved.items() if k not in BUILTIN_LM_KEYS}
        # Dirs derived from run_name stay derived, so the file with another --run_name makes another run
        if resolved["checkpoint_dir"] == str(Path(self.cfg.log_dir) / "checkpoints"):
            resolved["checkpoint_dir"] = None
        if resolved["log_dir"] == str(Path("runs") / self.cfg.run_name):
            resolved["log_dir"] = None
        # how this launch began (fresh, from another state) is no property of the run: loaded again, the
        # file continues this run
        resolved["resume"] = TrainConfig.resume
        return resolved

    def _set_aside_old_states(self) -> None:
        """States past this run's starting step (another run's, when starting fresh; unloadable ones
        after a fallback) move into a subdir: pruning by step would otherwise delete this run's new states
        in favour of them, and a later --resume auto would continue from them. A fresh run moves an earlier
        run's weights files there too, which it would otherwise overwrite or leave mixed with its own; a
        resumed one, the step and epoch files past its state."""
        old, weights = self._files_to_set_aside()
        if not old and not weights:
            return
        aside = Path(tempfile.mkdtemp(prefix=f"previous_states.{int(time.time())}.", dir=self.ckpt_dir))
        for p in old + weights:
            for f in (p, Path(str(p) + ".sha256")):
                if f.exists():
                    os.replace(f, aside / f.name)
        why = "from before this fresh start" if self.resumed_from is None else "past the state this run resumes from"
        self.log.warning("moved %d resumable state(s) past step %d and %d weights file(s) (%s) to %s", len(old),
                         self.global_step, len(weights), why, aside)

    def _files_to_set_aside(self) -> tuple:
        """(states, weights files) that _set_aside_old_states moves."""
        old = [p for step, p in self._states_by_step() if step > self.global_step]
        # a resumed run: those past its state (keep_checkpoints would keep them over its own; a best of a future
        # it has not had); a fresh one: all
        fresh = self.resumed_from is None
        step, epoch = (-1, -1) if fresh else (self.global_step, self.epoch)
        weights = ([p for n, p in self._numbered("step") if n > step] +
                   [p for n, p in self._numbered("epoch") if n > epoch] +
                   [p for p in map(self.checkpoint_path, ("best", "final", "interrupted"))
                    if p.exists() and (fresh or (self._saved_step(p) or 0) > self.global_step)])
        return old, weights

    def _saved_step(self, path: Path) -> Optional[int]:
        """The global_step a weights file holds (memory-mapped: the weights are not read); None without one."""
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step")
        except Exception as exc:  # noqa: BLE001 -- a damaged file is left where it is, and said so
            self.log.warning("could not read the step of %s (%s: %s); left in place", path, type(exc).__name__, exc)
            return None

    def _start_metrics_file(self) -> None:
        """A fresh run moves old curves aside (metrics.<time>.jsonl); a resumed run continues its own curves
        (taken back from aside when another run used the log dir meanwhile), without the records past its
        resume step."""
        if self.resumed_from is not None:
            self._take_back_own_metrics()
        if not self.metrics_path.exists():
            return
        if self.resumed_from is None:  # a fresh run: keep the old curves, start a new file
            move_aside(self.metrics_path)
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the crash that made us resume
            if rec.get("type") != "summary" and self._before_resume(rec) and not self._redone(rec):
                kept.append(line)
        rt.atomic_write_text(self.metrics_path, "".join(k + "\n" for k in kept))

    def _set_aside_other_ranks_logs(self) -> None:
        """A fresh run with fewer ranks than an earlier one in this dir: the earlier run's rank_N.log of the ranks
        this one does not have would pass for this run's (the others' logs go on, launch after launch)."""
        for path in sorted(Path(self.cfg.log_dir).glob("rank_*.log")):
            n = path.stem.removeprefix("rank_")
            if n.isdigit() and int(n) >= self.env.world_size:
                aside = move_aside(path)
                self.log.info("moved %s aside to %s: this run has %d rank(s)", path, aside, self.env.world_size)

    def _before_resume(self, rec: dict) -> bool:
        """A record this run keeps on resuming: one of its steps up to the state (a session that started at the
        state's step is this one's)."""
        step = rec.get("step", 0)
        return step < self.global_step if rec.get("type") == "start" else step <= self.global_step

    def _take_back_own_metrics(self) -> None:
        """Another run that started fresh in this log dir (another checkpoint_dir or checkpoint_prefix) moved
        this run's metrics.jsonl aside: continuing the file it left would stitch the two curves together."""
        exists = self.metrics_path.exists()
        if exists and metrics_run_id(self.metrics_path) in (None, self.run_id):  # None: written before run ids
            return
        own = [p for p in self.metrics_path.parent.glob("metrics.*.jsonl") if metrics_run_id(p) == self.run_id]
        other = move_aside(self.metrics_path) if exists else None
        back = max(own, key=lambda p: p.stat().st_mtime) if own else None
        if back is not None:
            os.replace(back, self.metrics_path)
        if other is not None:
            self.log.warning("%s held the records of another run (one that started fresh in this log dir): moved "
                             "them to %s; %s", self.metrics_path, other,
                             f"this run's records are back from {back}" if back else
                             f"no metrics.*.jsonl here holds this run's records (run {self.run_id}): its curve "
                             f"starts again at step {self.global_step + 1}")
        elif back is not None:
            self.log.info("this run's records are back in %s from %s", self.metrics_path, back)

    def _redone(self, rec: dict) -> bool:
        """A validation at the resume step that the state predates (an epoch's closing validation comes
        after the state saved at its last step): the resumed run repeats it and writes it again."""
        return (rec.get("type") == "val" and rec.get("step") == self.global_step
                and self.last_val_step != self.global_step)

    def _mfu_per_unit(self) -> Optional[float]:
        """Model FLOPs utilisation of one GPU per global token per second, for models that count
        their FLOPs on a GPU whose peak we know; None otherwise."""
        peak = peak_bf16_flops(self.env.device)
        if peak is None or not hasattr(self.raw_model, "flops_per_token") or self.count_unit != "tokens":
            return None
        return self.raw_model.flops_per_token() / self.env.world_size / peak

    def _global_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum_steps * self.env.world_size

    def _write_preempted_marker(self) -> None:
        rt.write_preempted_marker(self.cfg.log_dir, {"step": self.global_step, "epoch": self.epoch,
                                                     "checkpoint": str(self.checkpoint_path("interrupted"))})

    def _finish(self, status: str) -> dict:
        if status != "interrupted":
            self.save_checkpoint("final")
            if self.state_step != self.global_step:  # a longer max_steps (or patience) then trains on from here
                self.save_state()
            self._flush_writing_again_once("final")  # (a stop's files: _interrupt waited for them)
        test = self.evaluate(self.test_loader) if self.test_loader is not None and status != "interrupted" else None
        wall = time.monotonic() - self.t0
        memory = self.memory.stats()
        summary = {"status": status, "steps": self.global_step,
                   "resumed_from": None if self.resumed_from is None else str(self.resumed_from), "epochs": self.epoch,
                   "final_val_loss": self.last_val,
                   **{f"final_val_{k}": v for k, v in (self.last_val_extras or {}).items()},
                   "best_val_loss": None if math.isinf(self.best_val) else self.best_val,
                   # the count says there was a test set: a loss that was not finite is written as null too
                   "test_loss": None if test is None else test["loss"],
                   "test_count": None if test is None else test["count"],
                   # loss_fn's extras on the test set, named as the val records name them on the validation set
                   **{f"test_{k}": v for k, v in (test or {}).items() if k not in ("loss", "count")},
                   "wall_time_s": round(wall, 3),
                   "samples_per_s": self.samples_seen / wall if wall > 0 else None,
                   "skipped_steps": self.skipped_steps, "world_size": self.env.world_size,
                   "steps_per_epoch": self.known_steps_per_epoch, "global_batch": self._global_batch(),
                   "peak_rss_gb": memory["cpu_peak_rss_gb"], "peak_anon_gb": memory["cpu_peak_anon_gb"],
                   **self.data_info}
        if self.env.device.type == "cuda":
            summary["cuda_peak_gb"] = memory["cuda_peak_gb"]
        self.write_metrics({"type": "summary", **summary})
        # no step's all-reduce is left to carry a failed write (the last step's, the closing validation's, this one)
        if status != "interrupted" and rt.broadcast_object(self.metrics_failed):
            self._stop_for_the_metrics()
        if status != "interrupted":  # last: a relaunch of this run then has nothing to do
            rt.run_on_rank0(self._complete_run_dir, summary, what="writing the COMPLETED marker")
        self.log.info("finished (%s): %s", status, json_line(summary))
        return summary


# ----------------------------------------------------------------------------
# Command line: every config key as --key, YAML with --config, CLI > YAML > defaults
# ----------------------------------------------------------------------------

ALIASES = {"batch_size": ["--batch-size"], "num_epochs": ["--epochs"], "learning_rate": ["--lr"],
           "dist_backend": ["--dist-backend"], "dist_timeout": ["--dist-timeout"],
           "grad_accum_steps": ["--grad-accum-steps"], "save_every_iters": ["--save-every-iters"],
           "max_steps": ["--max-steps"], "log_dir": ["--log-dir"], "checkpoint_dir": ["--checkpoint-dir"],
           "run_name": ["--run-name"]}


def parse_bool(text: str) -> bool:
    low = str(text).lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


# Keys whose unset value (None) means "decide": their README default is "auto", which is accepted as well
AUTO_KEYS = ("dist_backend", "static_graph")


def _field_parser(tp, key=None):
    """argparse `type=` for a dataclass field annotation (Optional[X] accepts 'none', and 'auto' for
    AUTO_KEYS)."""
    none_words = ("none", "null", "auto") if key in AUTO_KEYS else ("none", "null")
    args = typing.get_args(tp)
    inner = next(a for a in args if a is not type(None)) if args else tp
    base = {bool: parse_bool, int: int, float: float, str: str}[inner]
    if not args:
        return base

    def optional(text):
        return None if str(text).lower() in none_words else base(text)
    optional.__name__ = f"{base.__name__} (or none)"  # argparse names it in "invalid ... value"
    return optional


def config_from_yaml(path: str) -> dict:
    """TrainConfig keys from a YAML file (--config)."""
    data = load_yaml_mapping(path)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for key, value in data.items():
        if key not in known:
            nested = " (a flat mapping: nested sections are not read)" if isinstance(value, dict) else ""
            raise ValueError(f"--config {path}: unknown config key {key!r}{rt.name_hint(key, known) or nested}; "
                             f"known keys: {', '.join(sorted(known))}")
    return data


def load_yaml_mapping(path: str) -> dict:
    """The flat mapping a --config file holds; a repeated key, bad YAML or another shape is an error."""
    import yaml

    class NoRepeats(yaml.SafeLoader):  # PyYAML keeps the last of two equal keys without a word
        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)  # merge keys (<<: *anchor) first, as SafeLoader does
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
            if repeated := sorted({str(k) for k in keys if keys.count(k) > 1}):
                raise yaml.constructor.ConstructorError(None, None, f"the key(s) {', '.join(repeated)} appear more "
                                                        f"than once", node.start_mark)
            return super().construct_mapping(node, deep)
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=NoRepeats) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        # PyYAML's "in <file>, line L, column C" lines: one line, as every refusal
        raise ValueError(f"--config {path}: {' '.join(str(exc).split())}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a flat mapping of config keys, got {type(data).__name__}")
    return data


def build_arg_parser() -> argparse.ArgumentParser:
    p = rt.ArgumentParser(description="Robust DDP training of a small causal transformer LM.",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="YAML file with a flat mapping of config keys")
    p.add_argument("--cpu", action="store_true", help="train on the CPU with gloo")
    p.add_argument("--test", action="store_true", help="quick run: tiny model, 60 steps, in runs/lm_test")
    p.add_argument("--nproc", type=int, default=1, help="spawn N local processes (no torchrun needed)")
    rt.add_local_rank_flag(p)
    add_config_flags(p, [f.name for f in dataclasses.fields(TrainConfig)], argparse.SUPPRESS)
    return p


def add_config_flags(parser: argparse.ArgumentParser, keys: list, unset) -> None:
    """A flag --<key> for each TrainConfig key, read as the key is typed; `unset` is the value of a flag not
    given (argparse.SUPPRESS: absent from the namespace)."""
    hints, defaults = typing.get_type_hints(TrainConfig), {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for key in keys:
        # a bare --debug means true
        switch = dict(nargs="?", const=True) if hints[key] in (bool, Optional[bool]) else {}
        choices = [c for c in CHOICES.get(key, ()) if c is not None] or None
        parser.add_argument(f"--{key}", *ALIASES.get(key, []), dest=key, type=_field_parser(hints[key], key),
                            default=unset, metavar="{" + ",".join(choices) + "}" if choices else key.upper(),
                            help=f"{HELP[key]} (default: {'auto' if key in AUTO_KEYS else defaults[key]})", **switch)


def epochs_rule(epochs, max_steps, source: str) -> None:
    """A --num_epochs flag is the run's length: the max_steps of a preset or a file below it would end the run
    first, or run it past those epochs (max_steps wins over num_epochs), and the flag would do nothing."""
    rt.note(f"--num_epochs {epochs} replaces max_steps={max_steps} of {source} (a --max_steps flag keeps one)")


def config_from_args(args: argparse.Namespace) -> dict:
    """Defaults < YAML < --test preset < explicit flags."""
    cfg = config_from_yaml(args.config) if args.config else {}
    file_run_name = cfg.get("run_name", TrainConfig.run_name)
    if args.test:
        cfg.update(TEST_PRESET)
    if args.cpu:
        cfg["device"] = "cpu"
        cfg["dist_backend"] = None  # gloo, over a file's nccl; a --dist_backend flag still wins (below)
    # Another run name (a flag, or --test's) is another run: the file's run dirs would mix their files
    renamed = "--run_name" if hasattr(args, "run_name") else "--test" if args.test else None
    if getattr(args, "run_name", cfg.get("run_name")) == file_run_name:
        renamed = None  # the file's own run: its dirs are this run's
    for key in ("log_dir", "checkpoint_dir") if renamed else ():
        if cfg.get(key) is not None and not hasattr(args, key):
            rt.note(f"{renamed} replaces {key}={cfg[key]} of --config {args.config}")
            cfg[key] = None
    for f in dataclasses.fields(TrainConfig):
        if hasattr(args, f.name):  # given on the command line (flags default to "absent")
            cfg[f.name] = getattr(args, f.name)
    if hasattr(args, "num_epochs") and not hasattr(args, "max_steps") and cfg.get("max_steps"):
        epochs_rule(args.num_epochs, cfg["max_steps"], "--test" if args.test else f"--config {args.config}")
        cfg["max_steps"] = 0
    TrainConfig.from_dict(cfg)  # fail here, before any process starts
    return cfg


def nproc_port() -> int:
    """The rendezvous port of an --nproc run: MASTER_PORT where it is set (a port a firewall leaves open),
    else 0: any port the kernel gives the store (see rendezvous_store)."""
    text = os.environ.get("MASTER_PORT", "").strip()
    if not text:
        return 0
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"MASTER_PORT={text!r} in the environment: expected a port number from 1 to 65535 "
                         f"(or unset, for a free one)")
    return int(text)


class BadInput(Exception):
    """A user error found at set-up (a flag, a data file, a refused state): one `error:` line, exit 2."""


# What set-up raises for bad input (a data file, a refused or unreadable state)
SETUP_ERRORS = (ValueError, FileNotFoundError, rt.CheckpointError)
EXIT_BAD_INPUT = rt.EXIT_BAD_INPUT


def train_preemptible(build: Callable[[], "DDPTrainer"], log_dir, requested=None) -> int:
    """`build()` a trainer and train it; the exit status: 0, or EXIT_PREEMPTED for a stop by a signal.

    A scheduler's signal is caught from before set-up (seconds to minutes: rendezvous, data checks, a
    resume): it then stops the run at its first step with a save and the PREEMPTED marker, instead of killing
    a rank there that its peers would wait for. A second one, or a set-up still running
    rt.SETUP_STOP_GRACE_S after the first, ends the process (see rt.SetUpWatch). `requested`: spawn_local's
    note of a stop it passed on, which this process may not have seen. The handlers are restored at the end,
    except in a script's process (rt.main_ends_the_process), which keeps them to its exit."""
    stop_signal = rt.StopSignal(rt.StopSignal.PREEMPT_SIGNALS).install()
    try:
        if isinstance(requested, rt.FirstSignal):
            requested.hand_over(stop_signal.previous)
        if requested is not None and requested.value and stop_signal.received is None:
            if requested.value == signal.SIGINT:  # Ctrl-C before this process had its handler: stop at once
                raise KeyboardInterrupt("SIGINT passed on before set-up")
            stop_signal.received = requested.value
        trainer = None
        try:
            with rt.SetUpWatch(log_dir=log_dir, received=stop_signal.received):
                trainer = build()
        except KeyboardInterrupt:  # a Ctrl-C the watch saw, after the trainer was built: it lets go of it all
            if trainer is not None:
                trainer.close()
                rt.log_to_file(trainer.log, logging.WARNING, rt.CTRL_C_BEFORE_TRAINING)
                rt.close_logger(trainer.log)
                rt.teardown_distributed()
            raise
        summary = trainer.train(stop_signal)
    finally:
        if not rt.main_ends_the_process():
            stop_signal.restore()
    return rt.EXIT_PREEMPTED if summary["status"] == "interrupted" else 0


def _train_and_exit_code(rank: int, world_size: int, cfg: dict, local_rank: Optional[int] = None,
                         requested=None, show_refusal: bool = True) -> int:
    """Train; the exit status: 0, EXIT_PREEMPTED, or EXIT_BAD_INPUT for a set-up error (bad input), which
    rank 0 prints as one line (with `show_refusal`; spawn_local prints it itself)."""
    def bad_input(fn, *args, **kwargs):  # not around train(): a ValueError there is a failure with its traceback
        try:
            return fn(*args, **kwargs)
        except SETUP_ERRORS as exc:
            raise BadInput(f"{type(exc).__name__}: {exc}") from exc

    build = partial(bad_input, DDPTrainer, rank=rank, world_size=world_size, local_rank=local_rank, config=cfg)
    try:
        return train_preemptible(build, bad_input(TrainConfig.from_dict, cfg).log_dir, requested)
    except BadInput as exc:
        return rt.refuse(str(exc), show=show_refusal and rank == 0)
    except rt.Failed as exc:  # set-up's, or training's: its one line says what happened (the traceback: rank_N.log)
        return rt.failed(exc, rank)


def _spawned_worker(rank: int, world_size: int, cfg: dict, requested=None) -> None:
    if rt.ctrl_c_ignored():
        # torch's spawn makes a rank's parent's death send it SIGINT, which a rank that inherited an ignored
        # Ctrl-C ignores: it would train on as an orphan, holding the run dirs. SIGTERM is a stop: it saves.
        import torch.multiprocessing as mp
        mp._prctl_pr_set_pdeathsig(signal.SIGTERM)
    rt.main_ends_the_process(now=True)
    try:
        code = _train_and_exit_code(rank, world_size, cfg, requested=requested, show_refusal=False)
    except KeyboardInterrupt:  # Ctrl-C in set-up; torch's spawn wrapper would make it exit 0, a success
        code = 128 + signal.SIGINT
    rt.exit_process(code)


SAVE_GRACE_S = 300  # as launch_training.sh gives torchrun's workers
# What the other ranks get once rank 0, which writes every checkpoint, has exited or a rank has crashed: a
# rank frozen then (SIGSTOP, a hung file system) kept the parent waiting the save grace twice, ten minutes
PEER_GRACE_S = 30


def _join_grace(procs: list, forwarded: list) -> Optional[float]:
    """The grace torch's join gives the other ranks when one has exited with an error: after a stop passed
    on, the save's while rank 0 is still saving; a short one once it has exited (nothing is left to save) or
    a rank crashed; without a stop, torch's default (a crash ends the rest at once)."""
    if not forwarded:
        return None
    crashed = any(p.exitcode not in (None, 0, rt.EXIT_PREEMPTED) for p in procs)
    return SAVE_GRACE_S if procs[0].exitcode is None and not crashed else PEER_GRACE_S


# How a rank ends on a Ctrl-C before it trains: dead of SIGINT (a KeyboardInterrupt in the spawn's bootstrap, since
# Python 3.8), or exit 130 (its set-up stopped, rt.SetUpWatch)
CTRL_C_IN_SET_UP = (-signal.SIGINT, 128 + signal.SIGINT)


def _a_rank_died_of_the_stop(procs: list, forwarded: list) -> bool:
    """Wait until a rank exits with an error, or all exit; whether one died of a forwarded stop signal, or ended
    its set-up on Ctrl-C (exit 130; a KeyboardInterrupt in the spawn's bootstrap dies by SIGINT, since Python
    3.8). Not exit 1: a KeyboardInterrupt caught later, or a failure. Then torch's join takes over."""
    from multiprocessing.connection import wait
    while True:
        alive = [p.sentinel for p in procs if p.is_alive()]
        # after the list: a rank that ended before it (is_alive() reaps it) is not waited for, so its exit
        # code is read here; waiting for the others alone took until they ended (a peer in its rendezvous)
        if not alive or any(p.exitcode not in (None, 0) for p in procs):  # never wait([]): that waits forever
            break
        wait(alive)
    ctrl_c = CTRL_C_IN_SET_UP if forwarded[:1] == [signal.SIGINT] else ()
    return bool(forwarded) and any(p.exitcode == -forwarded[0] or p.exitcode in ctrl_c for p in procs)


# What an --nproc run sets for its ranks, and puts back when they are done
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def rendezvous_store(port: int):
    """The TCP store an --nproc run's ranks meet on, hosted by this process on `port` (0: one the kernel picks
    while binding it). A port picked free and then bound by rank 0 seconds later could be taken in between
    (a sweep of --nproc runs started together); the ranks connect to this one as clients, as under torchrun's
    agent (TORCHELASTIC_USE_AGENT_STORE)."""
    try:
        return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=60))
    except RuntimeError as exc:  # DistNetworkError: the port is taken
        where = f"MASTER_PORT={port}: cannot listen there" if port else "cannot listen on a free port"
        raise ValueError(f"{where} for the ranks' rendezvous ({str(exc).strip().splitlines()[-1]})"
                         + ("; unset MASTER_PORT for a free port" if port else "")) from None


def _spawn_exit_status(exc, refused: Optional[str], forwarded: list) -> int:
    """spawn_local's exit status for a rank that exited non-zero (`exc`), with the line that says why: the
    refusal a rank left (`refused`), else what the exit code and the stops passed on (`forwarded`) tell."""
    if refused is not None:  # whatever its peers did then, the input ended the run
        print(refused, file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    # Ctrl-C in the ranks' set-up (130), or while they import torch: Python's KeyboardInterrupt there is
    # exit 1, or death by SIGINT. Once they train, it is a stop like SIGTERM (75).
    if forwarded[:1] == [signal.SIGINT] and exc.exit_code in (1, *CTRL_C_IN_SET_UP):
        print(rt.CTRL_C_BEFORE_TRAINING, file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    if exc.exit_code in (rt.EXIT_PREEMPTED, EXIT_BAD_INPUT) or exc.exit_code > 128:
        return exc.exit_code
    if exc.exit_code < 0 and not forwarded:  # its peers can only report the connection it broke
        oom = " (the kernel's OOM killer sends SIGKILL: see dmesg)" if exc.exit_code == -signal.SIGKILL else ""
        print(f"error: rank {exc.error_index} (pid {exc.error_pid}) was killed by {exc.signal_name}{oom}",
              file=sys.stderr, flush=True)
    return 1


def spawn_local(nproc: int, cfg: dict, worker=_spawned_worker, early: Optional[rt.FirstSignal] = None) -> int:
    """Run `worker(rank, nproc, cfg, requested)` on `nproc` local processes (torch.multiprocessing, meeting on
    the store that rendezvous_store hosts here on nproc_port()), for users without torchrun. Returns the exit
    status: 0, EXIT_PREEMPTED, EXIT_BAD_INPUT (a bad or taken MASTER_PORT, too), 128 + a signal that ended a
    rank's set-up (Ctrl-C: 130; a second SIGTERM: 143), as a single process exits, or 1.

    A signal passed on to a rank between its fork and its exec is taken by the handler it inherited from
    this process and lost; `requested` (shared memory) holds the first stop, and each rank reads it once it
    has its own handler.

    A rank that refuses its input leaves the reason where torchrun would look for it (TORCHELASTIC_ERROR_FILE,
    here in a temporary dir), and this process prints it: rank 0 printing it could be ended by torch first,
    when a peer refused and exited before it. `early`: a stop this process caught before it got here. As
    train_preemptible, a script's process keeps its handler (passing stops on to ranks that have ended)."""
    from multiprocessing.connection import wait

    import torch.multiprocessing as mp
    try:
        store = rendezvous_store(nproc_port())
    except ValueError as exc:
        return rt.refuse(str(exc))
    rendezvous = {var: os.environ.get(var) for var in RENDEZVOUS_VARS}  # put back at the end
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    reasons = tempfile.TemporaryDirectory(prefix="ddp_training_nproc_")
    refusal = Path(reasons.name) / "error.json"  # ranks refusing for different reasons: one of them (see rt.failed)
    outer_error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    context, forwarded = None, []
    requested = mp.get_context("spawn").RawValue("i", 0)  # no lock: a signal handler writes it

    def forward(signum, frame):  # the ranks agree on it, save and exit 75; this process waits for them
        forwarded.append(signum)
        requested.value = requested.value or signum
        for p in context.processes if context is not None else ():
            if p.is_alive():
                os.kill(p.pid, signum)
    # before the start: a signal in between would kill this process and leave the ranks unattended. A Ctrl-C
    # the shell told this process to ignore stays ignored, and so in the ranks, which inherit it.
    previous = {sig: signal.signal(sig, forward) for sig in (getattr(signal, n) for n in rt.StopSignal.SIGNALS)
                if not (sig == signal.SIGINT and rt.ctrl_c_ignored())}
    if early is not None:
        early.hand_over(previous)
    stopped_early = early.value if early is not None else 0
    if stopped_early:  # the ranks read it once they have their handlers: a signal now would end their import
        forwarded.append(stopped_early)
        requested.value = stopped_early

    def not_ending_a_rank(record):  # torch names each rank it ends once another failed: noise above the line
        # that says why (below); after a stop it tells of a rank cut short in its save, and is kept
        return bool(forwarded) or not record.getMessage().startswith("Terminating process")
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    spawn_log.addFilter(not_ending_a_rank)
    try:
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(refusal)
        context = mp.start_processes(worker, args=(nproc, cfg, requested), nprocs=nproc, join=False,
                                     start_method="spawn")
        if forwarded and not stopped_early:
            forward(forwarded[0], None)
        if _a_rank_died_of_the_stop(context.processes, forwarded):
            # still importing torch, it had no handler yet: nothing was trained, and its peers wait in a
            # rendezvous that cannot complete, so they go too (a peer that took the stop as a deferred one would
            # wait out its set-up watch and leave a PREEMPTED marker); a preemption like any other (relaunch to
            # resume), or Ctrl-C's 130
            for p in context.processes:
                p.kill()
                p.join()
            if forwarded[0] == signal.SIGINT:
                print(rt.CTRL_C_BEFORE_TRAINING, file=sys.stderr, flush=True)
                return 128 + signal.SIGINT
            print(f"stopped by {signal.Signals(forwarded[0]).name} while the ranks were starting: nothing to save",
                  file=sys.stderr)
            return rt.EXIT_PREEMPTED
        # The grace is chosen after an exit is seen (wait), so that it knows which rank has gone
        while True:
            alive = [p.sentinel for p in context.processes if p.is_alive()]
            if alive:
                wait(alive, timeout=1.0)
            if context.join(timeout=0, grace_period=_join_grace(context.processes, forwarded)):
                break
    except mp.ProcessExitedException as exc:
        return _spawn_exit_status(exc, rt.refusal_in(refusal), forwarded)
    finally:
        spawn_log.removeFilter(not_ending_a_rank)
        for sig, handler in previous.items() if not rt.main_ends_the_process() else ():
            signal.signal(sig, handler)
        for var, value in {**rendezvous, "TORCHELASTIC_ERROR_FILE": outer_error_file}.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        reasons.cleanup()
    return 0


def main(argv: Optional[list] = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as exc:
        return rt.refuse(str(exc))
    if args.nproc < 1:
        return rt.refuse(f"--nproc must be >= 1, got {args.nproc}")
    try:
        launch = rt.detect_launch_env()
    except rt.LaunchEnvError as exc:  # every rank says it: each may have its own wrong number
        return rt.refuse(str(exc))
    if args.nproc > 1:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # even one worker: torchrun's restarts and stops would miss them
            launcher = ("give launch_training.sh --nproc {n} (before its --)" if os.environ.get("DDP_KIT_LAUNCH_ID")
                        else "give torchrun --nproc_per_node={n}")
            return rt.refuse(f"--nproc {args.nproc} spawns its own processes inside a torchrun worker, beyond "
                             f"torchrun's restarts and stops; {launcher.format(n=args.nproc)} instead")
        if launch["world_size"] > 1:
            return rt.refuse("--nproc spawns its own processes; do not combine it with torchrun/srun")
        return spawn_local(args.nproc, cfg, early=rt.FirstSignal(EARLY_STOPS))
    return _train_and_exit_code(launch["rank"], launch["world_size"], cfg, launch["local_rank"],
                                requested=rt.FirstSignal(EARLY_STOPS))


if __name__ in ("__main__", "__mp_main__"):  # a rank's set-up tells of a Ctrl-C itself (rank_N.log)
    signal.signal(signal.SIGINT, _SIGINT_AT_START)
if __name__ == "__main__":
    rt.run_script(main)
