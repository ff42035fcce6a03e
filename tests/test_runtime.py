"""The shared runtime: launch environments, logging, memory, loaders, collectives, checkpoint I/O."""

import io
import logging
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddp_runtime as rt
from conftest import Indices
from dist_helpers import spawn


# -- launch environments ------------------------------------------------------

@pytest.mark.parametrize("nodelist,first", [("gpu07", "gpu07"), ("gpu[07-09,12]", "gpu07"),
                                            ("node[3,5],login1", "node3"), ("a-b[001-004]", "a-b001")])
def test_first_slurm_host(nodelist, first):
    assert rt.first_slurm_host(nodelist) == first


def test_detect_env_plain_torchrun_and_slurm(no_launch_env, monkeypatch):
    assert rt.detect_launch_env() == dict(rank=0, world_size=1, local_rank=0, launcher="none")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rt.detect_launch_env() == dict(rank=3, world_size=4, local_rank=1, launcher="torchrun")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[12-15]")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert rt.detect_launch_env() == dict(rank=5, world_size=8, local_rank=1, launcher="slurm")
    assert os.environ["MASTER_ADDR"] == "gpu12"
    assert os.environ["MASTER_PORT"] == str(20000 + 4242 % 20000)


def test_single_process_needs_no_rendezvous(no_launch_env):
    env = rt.setup_distributed(0, 1, device="cpu")
    assert env.backend is None and not dist.is_initialized()
    assert rt.any_rank(True) and not rt.all_ranks(False)


def test_multi_process_without_master_addr_is_a_clear_error(no_launch_env):
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        rt.setup_distributed(0, 2, device="cpu")


def test_nccl_on_cpu_is_refused(no_launch_env, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ValueError, match="gloo"):
        rt.setup_distributed(0, 2, backend="nccl", device="cpu")


# -- logging and memory -------------------------------------------------------

def test_logger_files_tags_and_console(tmp_path, capsys):
    for rank in (0, 1):
        log = rt.setup_logger(tmp_path, rank)
        log.info("hello from %d", rank)
        rt.close_logger(log)
    out = capsys.readouterr().out
    assert "[RANK 0] INFO: hello from 0" in out and "hello from 1" not in out
    assert "[RANK 1] INFO: hello from 1" in (tmp_path / "rank_1.log").read_text()
    log = rt.setup_logger(tmp_path, 1, debug=True)
    log.debug("debug line")
    rt.close_logger(log)
    assert "[RANK 1] DEBUG: debug line" in capsys.readouterr().out


def test_memory_manager_warns_and_cleans(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(rt.gc, "collect", lambda: calls.append(1))
    log = logging.getLogger("memtest")
    mm = rt.MemoryManager(torch.device("cpu"), log, check_interval=5, cleanup_interval=3, max_memory_gb=1e-6)
    with caplog.at_level(logging.WARNING, logger="memtest"):
        readings = [mm.on_step(s) for s in range(1, 11)]
    assert [i + 1 for i, r in enumerate(readings) if r] == [5, 10]
    assert readings[4]["cpu_rss_gb"] > 0.01
    assert len(calls) == 3  # steps 3, 6, 9
    assert sum("exceeds max_memory_gb" in r.message for r in caplog.records) == 2


def test_memory_limit_counts_anonymous_memory_not_mapped_file_pages(tmp_path):
    """Reading memory-mapped data raises RSS by its size; the limit watches anonymous memory."""
    import numpy as np
    path = tmp_path / "data.npy"
    np.save(path, np.ones(64 * 2**20, dtype=np.uint8))
    mm = rt.MemoryManager(torch.device("cpu"), logging.getLogger("memtest"))
    before = mm.stats()
    data = np.load(path, mmap_mode="r", allow_pickle=False)
    assert int(data.sum(dtype=np.int64)) == 64 * 2**20  # every page read
    after = mm.stats()
    assert after["cpu_rss_gb"] - before["cpu_rss_gb"] > 48 / 1024
    assert abs(after["cpu_anon_gb"] - before["cpu_anon_gb"]) < 16 / 1024
    assert after["cpu_peak_anon_gb"] >= after["cpu_anon_gb"] and after["cpu_peak_rss_gb"] >= after["cpu_rss_gb"]


# -- data loaders ---------------------------------------------------------------

def test_loader_does_not_touch_global_rng_and_drops_last():
    state = torch.get_rng_state()
    loaders = [rt.build_dataloader(Indices(103), 5, train=True, rank=r, world_size=2, seed=3) for r in (0, 1)]
    assert torch.equal(state, torch.get_rng_state())
    batches = [[b.tolist() for b in ld] for ld in loaders]
    assert len(batches[0]) == len(batches[1]) == 51 // 5  # equal step counts on both ranks
    assert all(len(b) == 5 for bs in batches for b in bs)
    seen = [i for bs in batches for b in bs for i in b]
    assert len(seen) == len(set(seen))  # no sample twice in one epoch


def test_distributed_and_single_process_loaders_give_the_same_global_batches():
    two = [list(rt.build_dataloader(Indices(64), 4, train=True, rank=r, world_size=2, seed=7)) for r in (0, 1)]
    one = list(rt.build_dataloader(Indices(64), 8, train=True, rank=0, world_size=1, seed=7))
    assert len(one) == len(two[0]) == len(two[1]) == 8
    for step, big in enumerate(one):
        assert sorted(big.tolist()) == sorted(two[0][step].tolist() + two[1][step].tolist())


def test_eval_shards_cover_every_sample_once():
    loaders = [rt.build_dataloader(Indices(11), 4, train=False, rank=r, world_size=3, seed=0) for r in range(3)]
    seen = sorted(i for ld in loaders for b in ld for i in b.tolist())
    assert seen == list(range(11))


def test_workers_are_capped_and_configured():
    ld = rt.build_dataloader(Indices(40), 4, train=True, rank=0, world_size=1, seed=0, num_workers=64,
                             timeout_s=30)
    assert 1 <= ld.num_workers <= rt.cpu_count()
    assert ld.persistent_workers and ld.timeout == 30 and ld.prefetch_factor == 2
    assert sorted(i for b in ld for i in b.tolist()) == list(range(40))
    ld0 = rt.build_dataloader(Indices(40), 4, train=True, rank=0, world_size=1, seed=0, num_workers=0)
    assert ld0.timeout == 0 and not ld0.persistent_workers


def test_resumable_sampler_skips_the_consumed_part_once():
    s = rt.ResumableDistributedSampler(Indices(20), num_replicas=2, rank=1, shuffle=True, seed=1, drop_last=True)
    full = list(s)
    s.set_start_index(4)
    assert list(s) == full[4:] and list(s) == full


def test_too_small_training_set_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than batch_size"):
        rt.build_dataloader(Indices(6), 4, train=True, rank=0, world_size=2, seed=0)


# -- collectives on real processes ---------------------------------------------------

def _collectives(rank, world_size, root):
    rt.setup_distributed(rank, world_size, device="cpu", timeout_s=30)
    try:
        out = dict(any_true=rt.any_rank(rank == 1), any_false=rt.any_rank(False),
                   all_mixed=rt.all_ranks(rank == 0), all_true=rt.all_ranks(True),
                   bcast=rt.broadcast_object({"from": rank}), gathered=rt.gather_objects(rank * 10),
                   summed=rt.all_reduce_floats([rank, 1.0]))

        def failing():
            raise OSError("disk full")
        try:
            rt.run_on_rank0(failing, what="writing x")
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        # A background write that fails on rank 0 fails every rank at the next flush.
        (Path(root) / "a_file").write_text("not a directory")
        writer = rt.CheckpointWriter(background=True)
        writer.save({"w": torch.ones(2)}, Path(root) / "a_file" / "x.pt", group=1)
        try:
            writer.flush()
        except Exception as exc:
            out["background_error"] = f"{type(exc).__name__}: {exc}"
        writer.save({"w": torch.ones(2)}, Path(root) / "ok.pt", group=2)
        writer.flush()
        writer.close()
        return out
    finally:
        rt.teardown_distributed()


@pytest.mark.multi
def test_collective_decisions_agree_on_every_rank(tmp_path):
    r0, r1 = spawn(_collectives, 2, str(tmp_path))
    for r in (r0, r1):
        assert r["any_true"] and not r["any_false"] and not r["all_mixed"] and r["all_true"]
        assert r["bcast"] == {"from": 0} and r["gathered"] == [0, 10] and r["summed"] == [1.0, 2.0]
    assert r0["error"] == "OSError: disk full"
    assert r1["error"] == "RuntimeError: writing x failed on rank 0: OSError: disk full"
    assert r0["background_error"].startswith(f"CheckpointError: writing {tmp_path / 'a_file' / 'x.pt'} failed: ")
    assert r1["background_error"].startswith("RuntimeError: a background checkpoint write failed on rank 0: "
                                             "CheckpointError: writing ")
    assert torch.equal(rt.load_checkpoint(tmp_path / "ok.pt")["w"], torch.ones(2))


# -- signals ----------------------------------------------------------------------

def test_stop_signal_only_sets_a_flag():
    stop = rt.StopSignal().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and stop.name == "SIGUSR1"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


# -- checkpoint I/O -----------------------------------------------------------------

def test_atomic_save_roundtrip_and_hash(tmp_path):
    path = rt.atomic_save({"w": torch.arange(4.0), "step": 3}, tmp_path / "a.pt")
    assert (tmp_path / "a.pt.sha256").read_text().split()[0] == rt.sha256_file(path)
    loaded = rt.load_checkpoint(path)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["step"] == 3
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(rt.CheckpointError, match="SHA-256"):
        rt.load_checkpoint(path)


def test_background_writer_saves_the_values_of_the_moment_it_was_called(tmp_path, monkeypatch):
    release = threading.Event()
    real = rt.atomic_save
    monkeypatch.setattr(rt, "atomic_save", lambda obj, path: (release.wait(10), real(obj, path))[1])
    emb = torch.arange(6.0).reshape(2, 3)
    payload = {"emb": emb, "head": emb.detach(), "opt": {"state": {0: {"m": torch.ones(3)}}}, "step": 4}
    writer = rt.CheckpointWriter(background=True)
    order = []
    writer.save(payload, tmp_path / "a.pt", group=4, then=lambda: order.append("a"))
    writer.save({"head": payload["head"]}, tmp_path / "b.pt", group=4, then=lambda: order.append("b"))
    emb.add_(100.0)  # training goes on while the writes wait
    payload["opt"]["state"][0]["m"].zero_()
    assert not (tmp_path / "a.pt").exists()
    release.set()
    writer.flush()
    assert order == ["a", "b"]
    a = rt.load_checkpoint(tmp_path / "a.pt")
    assert torch.equal(a["emb"], torch.arange(6.0).reshape(2, 3)) and a["step"] == 4
    assert torch.equal(a["opt"]["state"][0]["m"], torch.ones(3))
    assert a["emb"].data_ptr() == a["head"].data_ptr()  # tied weights stay tied in the file
    assert torch.equal(rt.load_checkpoint(tmp_path / "b.pt")["head"], torch.arange(6.0).reshape(2, 3))
    assert writer.close() is None


def test_host_snapshot_copies_tensors_and_keeps_state_dict_versions():
    bn = torch.nn.BatchNorm1d(3)
    sd = bn.state_dict()
    snap = rt.host_snapshot(sd)
    assert snap._metadata == sd._metadata and list(snap) == list(sd)
    bn.running_mean.add_(1.0)
    assert torch.equal(snap["running_mean"], torch.zeros(3)) and not torch.equal(sd["running_mean"], torch.zeros(3))


def test_background_writer_gives_up_on_a_write_that_hangs(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(rt, "atomic_save", lambda obj, path: release.wait(30))
    writer = rt.CheckpointWriter(background=True)
    writer.save({"w": torch.ones(2)}, tmp_path / "a.pt", group=1)
    error = writer.close(timeout_s=0.5)
    release.set()
    assert isinstance(error, rt.CheckpointError) and str(error) == "a checkpoint write did not finish within 0.5 s"
    assert not (tmp_path / "a.pt").exists()


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = rt.atomic_save({"v": torch.ones(3)}, tmp_path / "c.pt")
    real_save = torch.save

    def half_then_fail(obj, f):
        real_save(obj, f)  # the bytes reach the temp file; the disk then "fills up"
        raise OSError("No space left on device")
    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        rt.atomic_save({"v": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(rt.load_checkpoint(path)["v"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "c.pt.sha256"]


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > boom.txt",))


def test_pickle_payload_is_refused_without_running(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    buf = io.BytesIO()
    torch.save({"model": Boom()}, buf)
    (tmp_path / "evil.pt").write_bytes(buf.getvalue())
    with pytest.raises(rt.CheckpointError, match="cannot be loaded safely"):
        rt.load_checkpoint(tmp_path / "evil.pt")
    assert not (tmp_path / "boom.txt").exists()
