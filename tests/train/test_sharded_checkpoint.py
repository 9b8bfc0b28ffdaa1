"""Sharded trainer checkpoints and the meta-device start, with two real gloo ranks (no Ray).

Two processes (tests/train/sharded_rank.py) train a ~21M-parameter Qwen3 (84 MB of fp32
weights, 250 MB with Adam's state) sharded by FSDP2. The figures a regression would move by a
model's size: each rank's start reads half the weights and its resident memory grows by less than
the whole model; writing a checkpoint allocates on rank 0 about one tensor, not the gathered model
and optimizer state; every rank writes and hashes its own shard file.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from tests.adam_compare import adam_denominators, assert_adamw_weights_agree
from tests.toy import toy_groups
from tests.train.launch import run_ranks
from tests.train.sharded_rank import KEYS, OPTS
from weir.config import build_config
from weir.tasks.tiny_model import build_tokenizer
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.checkpoint import MANIFEST, read_manifest, verify_checkpoint, write_checkpoint
from weir.train.distributed import free_port
from weir.train.export import export_model, find_model_dir
from weir.train.meta_init import driver_model
from weir.train.sharded_checkpoint import MODEL_DIR, TRAINER_DIR, load_shards, save_model_files

ROOT = Path(__file__).parents[2]
WORLD = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random-init Qwen3 of 21M parameters (untied head), saved as an HF directory."""
    config = Qwen3Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("qwen3-21m")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Run the two ranks once; (their work directory, what each reported)."""
    work = tmp_path_factory.mktemp("ranks")
    script = ROOT / "tests" / "train" / "sharded_rank.py"
    for code, o in run_ranks(script, [str(model_dir), str(work)], WORLD, timeout=300):
        assert code == 0, o[-3000:]
    return work, [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _model_mb(model_dir: Path) -> float:
    return sum(t.nbytes for t in load_file(model_dir / "model.safetensors").values()) / 2**20


@pytest.mark.slow
def test_meta_start_reads_and_holds_one_shard(ranks, model_dir):
    _, reports = ranks
    full = _model_mb(model_dir)
    for r in reports:
        start = r["start"]
        assert start["meta"] == 1.0
        assert start["read_mb"] == pytest.approx(full / WORLD, rel=0.02)  # its slices, no more
        assert start["shard_mb"] == pytest.approx(full / WORLD, rel=0.02)
        # a rank that loads the whole model grows by >= the model (fp32 copy); here half of it
        if start["peak_rss_mb"]:
            assert start["peak_rss_mb"] < 0.8 * full, start


@pytest.mark.slow
def test_auto_finds_the_exact_layouts_on_ranks_deciding_at_the_first_step(ranks):
    """`train.packing=auto` probes the sharded model when it first trains, not while it loads
    (the probe's forwards gather shards as training does): every rank finds `prefix` and `varlen`
    exact and takes the same one of them for the step."""
    _, reports = ranks
    assert [r["layout_at_start"] for r in reports] == [None] * WORLD
    assert [r["candidates"] for r in reports] == [["prefix", "varlen", "padded"]] * WORLD
    assert len({r["layout"] for r in reports}) == 1


@pytest.mark.slow
def test_each_rank_writes_its_shard_and_rank0_holds_no_gathered_copy(ranks, model_dir):
    work, reports = ranks
    full = _model_mb(model_dir)
    files = sorted(p.name for p in (work / "ckpt" / TRAINER_DIR).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for rank, r in enumerate(reports):
        # its own file, hashed where it was written
        assert list(r["entries"]) == [f"{TRAINER_DIR}/__{rank}_0.distcp"]
        entry = r["entries"][f"{TRAINER_DIR}/__{rank}_0.distcp"]
        assert entry["bytes"] == (work / "ckpt" / TRAINER_DIR / f"__{rank}_0.distcp").stat().st_size
        # weights + two Adam moments of one shard: a third of the model's 3x, per rank
        assert entry["bytes"] == pytest.approx(r["state_mb"] * 2**20, rel=0.02)
        assert r["state_mb"] == pytest.approx(3 * full / WORLD, rel=0.02)
    rank0 = reports[0]
    largest = 8192 * 512 * 4 / 2**20 / WORLD  # the largest shard of one tensor (embeddings)
    # gathering the model (84 MB) or the optimizer (250 MB) to rank 0 would show here
    assert rank0["save_alloc_mb"] < full / WORLD / 2, rank0
    assert rank0["save_alloc_mb"] <= 2 * largest + 1, rank0
    if rank0["save_rss_mb"]:
        assert rank0["save_rss_mb"] < full, rank0  # resident growth: far below a gathered copy


@pytest.mark.slow
def test_loaded_shards_continue_exactly(ranks):
    _, reports = ranks
    for r in reports:
        assert r["same_update"]
        for key, value in r["again"].items():
            assert r["repeat"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.slow
def test_two_ranks_shards_load_into_one_process(ranks, model_dir):
    """DCP reshards: the 2-rank checkpoint continues in one process (cluster.type=local) with the
    update the two ranks made from it."""
    work, reports = ranks
    # `auto` takes the ranks' layout, `prefix`, in one process too
    actor = Actor(
        AutoModelForCausalLM.from_pretrained(model_dir),
        ActorSettings.from_config(build_config({}, OPTS)),
    )
    assert actor.layout == "prefix"
    load_shards(actor, work / "ckpt" / TRAINER_DIR)
    assert actor.updates == 1
    stats = actor.train(make_batch(toy_groups(), version=0))
    for key in KEYS:
        assert stats[key] == pytest.approx(reports[0]["again"][key], rel=1e-4, abs=1e-7), key
    # the update needs the restored Adam moments: the ranks' weights after the same step, compared
    # where sqrt(v_hat) is well above Adam's eps (tests/adam_compare.py: one process and two ranks
    # sum the gradients in other orders)
    ranks_after = torch.load(work / "full.pt")
    named = dict(actor.model.named_parameters())
    assert set(named) <= set(ranks_after)
    params = list(named.values())
    assert_adamw_weights_agree(
        torch.cat([p.detach().reshape(-1) for p in params]),
        torch.cat([ranks_after[n].reshape(-1) for n in named]),
        adam_denominators(actor.optimizer, params),
        lr=1e-3,  # OPTS
        max_rest=0.3,  # 22% here: the untied head's rows of unseen tokens get gradients ~1e-6
    )


@pytest.mark.slow
def test_hf_weights_from_the_shards_and_offline_export(ranks, model_dir, tmp_path):
    work, reports = ranks
    full = torch.load(work / "full.pt")
    # rank 0 wrote safetensors files of ~8 MB from the shards (one tensor gathered at a time)
    hf_files = reports[0]["hf_files"]
    assert len(hf_files) > 2 and hf_files[-1] == "model.safetensors.index.json"
    assert reports[1]["hf_files"] == []
    index = json.loads((work / "hf" / "model.safetensors.index.json").read_text())
    written = {}
    for name in sorted(set(index["weight_map"].values())):
        written.update(load_file(work / "hf" / name))
    assert set(written) == set(full)
    assert all(torch.equal(written[k], full[k]) for k in full)
    # the sharded checkpoint -> an HF directory, offline, in this (non-distributed) process
    model, tokenizer = driver_model(str(model_dir), torch.float32)
    assert all(p.device.type == "meta" for p in model.parameters())  # the driver holds no weights
    entries = {k: v for r in reports for k, v in r["entries"].items()}

    def write(
        tmp: Path,
    ) -> dict:  # as a run checkpoint is written: the ranks' files, hashed by them
        shutil.copytree(work / "ckpt" / TRAINER_DIR, tmp / TRAINER_DIR)
        save_model_files(model, tokenizer, tmp / MODEL_DIR)
        return entries

    ckpt = write_checkpoint(tmp_path / "checkpoints", 1, write)
    assert verify_checkpoint(ckpt) is None
    assert (
        read_manifest(ckpt)["files"][f"{TRAINER_DIR}/__1_0.distcp"]
        == entries[f"{TRAINER_DIR}/__1_0.distcp"]
    )
    with pytest.raises(ValueError, match="weir export"):
        find_model_dir(ckpt)  # `weir eval` on it says how to convert it
    out = export_model(ckpt, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    # the checkpoint holds the weights of the first step (the load restored them before the
    # second); full.pt is one step later: compare with the checkpoint's own shards instead
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.empty_like(v) for k, v in full.items()}}
    dcp.load(state, checkpoint_id=str(ckpt / TRAINER_DIR), no_dist=True)
    assert all(torch.equal(exported[k], state["model"][k]) for k in full)
    assert not all(torch.equal(exported[k], full[k]) for k in full)
    assert json.loads((out / "weir_export.json").read_text())["source"]["sharded"] is True


def _checkpoint(root: Path, payload: bytes) -> Path:
    def write(tmp: Path) -> dict:
        (tmp / "big.bin").write_bytes(payload)
        (tmp / "small.json").write_text("{}")
        return {}

    return write_checkpoint(root, 1, write)


def test_sampled_verification_catches_truncation_not_every_flip(tmp_path):
    payload = bytes(range(256)) * 8192  # 2 MiB: sampled reads 16 blocks of 64 KiB of it
    path = _checkpoint(tmp_path, payload)
    manifest = json.loads((path / MANIFEST).read_text())
    assert set(manifest["files"]["big.bin"]) == {"bytes", "sha256", "sampled"}
    assert verify_checkpoint(path, "full") is None and verify_checkpoint(path, "sampled") is None
    data = bytearray(payload)
    data[100_000] ^= 1  # between the first two sampled blocks (0 and ~136 KiB)
    (path / "big.bin").write_bytes(bytes(data))
    assert verify_checkpoint(path, "full") == "big.bin does not match its checksum"
    assert verify_checkpoint(path, "sampled") is None  # the documented trade-off
    data[0] ^= 1  # inside a sampled block
    (path / "big.bin").write_bytes(bytes(data))
    assert verify_checkpoint(path, "sampled") == "big.bin does not match its checksum"
    (path / "big.bin").write_bytes(payload[:-1])
    assert "bytes, the manifest says" in verify_checkpoint(path, "sampled")


def test_prehashed_files_are_trusted_and_the_rest_hashed(tmp_path):
    def write(tmp: Path) -> dict:
        (tmp / "shard").mkdir()
        (tmp / "shard" / "a.bin").write_bytes(b"a" * 10)
        (tmp / "state.json").write_text("{}")
        from weir.train.checkpoint import file_entry

        return {"shard/a.bin": file_entry(tmp / "shard" / "a.bin")}

    path = write_checkpoint(tmp_path, 3, write)
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(files) == ["shard/a.bin", "state.json"]
    assert verify_checkpoint(path) is None


def test_a_model_whose_files_differ_is_loaded_whole_and_saved_by_transformers(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The fallback when disk names or shapes differ from the module's (weights converted on
    load): each rank loads the whole model, and the HF files are written by save_pretrained."""
    import weir.train.meta_init as meta_init
    from weir.train.distributed import RankSettings, TrainerRank

    monkeypatch.setattr(meta_init, "layout_mismatch", lambda model, layout: "converted on load")
    rank = TrainerRank(RankSettings.from_config(build_config({}, OPTS)), str(tiny_model_dir), 0, 1)
    try:
        rank.setup("127.0.0.1", free_port())
        assert rank.start_stats()["meta"] == 0.0
        rank.train(make_batch(toy_groups(), version=0))
        rank.save_hf(str(tmp_path / "hf"), bucket_mb=1.0)
        trained = rank.full_state()
    finally:
        rank.close()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(saved) == set(trained)
    assert all(torch.equal(saved[k], trained[k]) for k in trained)


def test_a_one_process_checkpoint_continues_on_sharded_ranks(tiny_model_dir, tmp_path):
    """cluster.type=local -> ray: each rank reads its slices of the checkpoint's HF weights and
    takes the one-process optimizer state (numbered parameters) by name; the next update is the
    one the single process makes."""
    from weir.train.distributed import RankSettings, TrainerRank
    from weir.train.model import save_model

    cfg = build_config({}, OPTS)
    local = Actor(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), ActorSettings.from_config(cfg)
    )
    first, second = make_batch(toy_groups(0), version=0), make_batch(toy_groups(1), version=1)
    local.train(first)
    save_model(local.model, build_tokenizer(), tmp_path / "model")
    state = copy.deepcopy(local.state_dict())  # as it arrives from trainer.pt: not shared
    rank = TrainerRank(RankSettings.from_config(cfg), str(tiny_model_dir), 0, 1)
    try:
        rank.setup("127.0.0.1", free_port())
        rank.load_hf(str(tmp_path / "model"))
        rank.load_trainer_state(state)
        got = rank.train(second)
        after = rank.full_state()
    finally:
        rank.close()
    want = local.train(second)
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
    # the update uses the one-process Adam moments (a fresh optimizer would step elsewhere)
    for name, p in local.model.state_dict().items():
        assert torch.allclose(after[name], p, atol=1e-6), name
