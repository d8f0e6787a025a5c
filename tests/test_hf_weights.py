"""Hugging Face weights in and out: ``pipe.load_state_dict(hf_dir)``, ``pd.save_pretrained``,
``pd.consolidate(..., format="hf")`` and ``pd.detect`` (``_checkpoint/hf_*.py``).

One process: the index, detection, the errors (missing, unexpected, mis-shaped keys, a
shard the index lists that is missing), a whole state dict written for
``from_pretrained``, and a save into the user's directory (docs/checkpoints.md, "Never
delete what we did not write"): the user's files kept, only stale shards removed, a
failed save changing nothing, a link written through, a file, a dangling link and a
``model.safetensors`` refused; on one rank ``save_pretrained(pipe, ".")`` in a project.
Two ranks (pp2, a traced zoo Llama, tied and untied head): a directory transformers
wrote in several shards is loaded per rank, counting every file each rank opens and
every tensor and byte it reads (a wrapped ``safe_open``: exactly its stages' share); 2
SGD steps equal the unsplit model loaded by ``from_pretrained``; ``pd.save_pretrained``
of the trained pipeline loads with ``from_pretrained`` to the pipeline's and the unsplit
model's weights; a DCP checkpoint consolidated with ``format="hf"`` loads the same; a
save whose rank 1 fails changes nothing in a directory holding the user's files. Four ranks (launch ``mesh``):
pp2 x dp2 FSDP and pp2 x tp2 ranks read only their slices (``get_slice``), FSDP over TP
its FSDP slices and the strided shards whole. Runs under pytest, or:

    PDHFW_DIR=/tmp/w torchrun --standalone --nproc-per-node 2 tests/test_hf_weights.py
    PIPEDREAM_TEST_LAUNCH=mesh PDHFW_DIR=/tmp/w torchrun --standalone --nproc-per-node 4 tests/test_hf_weights.py
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import CaseRef, Cases, FromEnv, Launch, parametrize_cases, worker_main  # noqa: E402
from _zoo import ZOO, reference_step  # noqa: E402

import pipedream_ext as pd  # noqa: E402
from pipedream_ext._checkpoint import MANIFEST  # noqa: E402
from pipedream_ext._checkpoint.hf import files as hf_files  # noqa: E402
from pipedream_ext._checkpoint.hf import load as hf_load  # noqa: E402
from pipedream_ext._checkpoint.view import PipelineView  # noqa: E402

HERE = os.path.abspath(__file__)
ZM = ZOO["llama"]
SHARD = "8KB"  # the 4-layer zoo Llama in 8 to 12 files


def llama(tied: bool, seed: int = 0, vocab: int = 64) -> nn.Module:
    """The zoo's Llama, its head tied to the embedding or not, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tied)).train()


def from_pretrained(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).train()


def whole_view(model: nn.Module) -> PipelineView:
    """A one-stage view of ``model`` (what split_hf reads), no process group."""
    return PipelineView(rank=0, world_size=1, group=None, timeout=10.0, device=torch.device("cpu"),
                        module=model, stages={0: model}, stage_layers={0: (0, 1)}, stage_ranks=((0,),),
                        model_shapes={k: tuple(v.shape) for k, v in model.state_dict().items()},
                        shared_parameters=(), split_points=("x",), schedule_name="1f1b",
                        microbatches=1, chunks=1, balance=(1,), replicas=(1,), asynchronous=False)


def split(model: nn.Module, path: str, strict: bool = True) -> Tuple[Any, List[str], List[str]]:
    reader = hf_files.ShareReader(hf_files.HfWeights(path))
    return hf_load.split_hf(whole_view(model), reader, strict)


# --------------------------------------------------------------------------- one process
def test_index_is_parsed_and_a_bad_one_named(tmp_path: Any) -> None:
    index = tmp_path / hf_files.INDEX
    index.write_text(json.dumps({"metadata": {"total_size": 8}, "weight_map": {"a": "model-1.safetensors"}}))
    assert hf_files.parse_index(str(index)) == {"a": "model-1.safetensors"}
    for text, why in [("{", "JSONDecodeError"), ("[]", "no 'weight_map'"),
                      (json.dumps({"weight_map": {"a": "../x.safetensors"}}), "'a' maps to '../x.safetensors'"),
                      (json.dumps({"weight_map": {"a": "/etc/x.safetensors"}}), "'a' maps to '/etc/x.safetensors'"),
                      (json.dumps({"weight_map": {"a": "x.bin"}}), "'a' maps to 'x.bin'")]:
        index.write_text(text)
        with pytest.raises(ValueError, match=rf"{index} is not a safetensors index \({why}.*save_pretrained"):
            hf_files.parse_index(str(index))


def test_detect_names_each_format(tmp_path: Any) -> None:
    model = llama(tied=True)
    model.save_pretrained(tmp_path / "hf", max_shard_size=SHARD)
    model.save_pretrained(tmp_path / "one")
    assert pd.detect(tmp_path / "hf") == "hf" and pd.detect(tmp_path / "one") == "hf"
    assert pd.detect(tmp_path / "one" / hf_files.SINGLE) == "hf"
    torch.save(model.state_dict(), tmp_path / "model.pt")
    assert pd.detect(tmp_path / "model.pt") == "torch"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / MANIFEST).write_text(json.dumps({
        "format": pd._checkpoint.FORMAT, "version": 2, "storage": "dcp", "generation": 1, "step": None,
        "layers": [], "num_layers": 0, "stages": [],
        "dcp": {"directory": "g000001-dcp", "files": [], "tensors": {}}}))
    assert pd.detect(tmp_path / "ckpt") == "dcp"
    for bad, what in [(tmp_path / "nothing", "no such file or directory"),
                      (tmp_path / "ckpt" / MANIFEST, "not a format pipedream_ext reads")]:
        with pytest.raises(ValueError, match=rf"{bad}: {what}; pass a checkpoint directory"):
            pd.detect(bad)


def test_tied_head_is_read_under_the_embedding_name(tmp_path: Any) -> None:
    source = llama(tied=True, seed=1)
    source.save_pretrained(tmp_path, max_shard_size=SHARD)
    weight_map = json.loads((tmp_path / hf_files.INDEX).read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map  # transformers stores a tied weight once
    target = llama(tied=True)
    parts, missing, unexpected = split(target, str(tmp_path))
    assert missing == [] and unexpected == []
    assert torch.equal(parts[0]["lm_head.weight"], source.model.embed_tokens.weight)
    untied = llama(tied=False)
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of stage 0 \(layers 0-0\): 'lm_head.weight' "
                                         r"\(missing keys\); pass the weights of this model .*strict=False"):
        split(untied, str(tmp_path))
    _, missing, _ = split(untied, str(tmp_path), strict=False)
    assert missing == ["lm_head.weight"]


def test_unexpected_and_mis_shaped_keys_are_named(tmp_path: Any) -> None:
    llama(tied=False, vocab=80).save_pretrained(tmp_path / "wide", max_shard_size=SHARD)
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \[80, 32\] in "
                                         r"model-\d+-of-\d+.safetensors but this model's "
                                         r"'model.embed_tokens.weight' is \[64, 32\]; .*config.json"):
        split(llama(tied=False), str(tmp_path / "wide"))
    llama(tied=False).model.save_pretrained(tmp_path / "base")  # LlamaModel: no 'model.' prefix
    with pytest.raises(ValueError, match=r"holds 38 tensor\(s\) this model does not have: 'embed_tokens.weight'"
                                         r".* \(unexpected keys: .*strict=False to ignore them"):
        split(llama(tied=False), str(tmp_path / "base"))


def test_a_shard_the_index_lists_must_be_there(tmp_path: Any) -> None:
    llama(tied=False).save_pretrained(tmp_path, max_shard_size=SHARD)
    weight_map = json.loads((tmp_path / hf_files.INDEX).read_text())["weight_map"]
    os.remove(tmp_path / weight_map["model.norm.weight"])
    with pytest.raises(ValueError, match=rf"{weight_map['model.norm.weight']} is missing: .* lists it in "
                                         rf"{hf_files.INDEX} but it is not there"):
        split(llama(tied=False), str(tmp_path))


def _damage(path: Any, how: str) -> None:
    """Damages a safetensors file the way a download or a stranger does."""
    import struct

    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    if how == "truncated":
        path.write_bytes(data[:-10])
    elif how == "huge-header":
        path.write_bytes(struct.pack("<Q", 1 << 62) + data[8:])
    elif how == "overlapping-offsets":
        first, second = sorted((k for k in header if k != "__metadata__"),
                               key=lambda k: header[k]["data_offsets"][0])[:2]
        header[second]["data_offsets"] = header[first]["data_offsets"]
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size:])
    else:  # "pickle": a torch.save file renamed
        torch.save({"weight": torch.ones(2)}, path)


@pytest.mark.parametrize("how", ["truncated", "huge-header", "overlapping-offsets", "pickle"])
def test_a_damaged_safetensors_file_is_named_with_the_tensor(tmp_path: Any, how: str) -> None:
    """A damaged ``.safetensors`` file, given itself or as the shard of an index: a
    ValueError naming the file (and the tensor being read) and the fix, not safetensors'
    bare SafetensorError; a pickle is never unpickled."""
    from safetensors.torch import save_file

    model = nn.Linear(4, 3)
    single = tmp_path / "weights.safetensors"
    save_file(model.state_dict(), single)
    _damage(single, how)
    with pytest.raises(ValueError, match=rf"{single} is not a readable safetensors file: .*damaged, "
                                         r"incomplete .*download or copy it again"):
        hf_files.HfWeights(str(single))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file(model.state_dict(), sharded / "model-1.safetensors")
    (sharded / hf_files.INDEX).write_text(json.dumps(
        {"weight_map": {"weight": "model-1.safetensors", "bias": "model-1.safetensors"}}))
    _damage(sharded / "model-1.safetensors", how)
    with pytest.raises(ValueError, match=rf"{sharded / 'model-1.safetensors'} is not a readable safetensors "
                                         r"file \(reading tensor 'weight'\)"):
        split(model, str(sharded))


def test_model_safetensors_beside_an_index_is_read_as_from_pretrained_reads_it(tmp_path: Any) -> None:
    """A directory holding ``model.safetensors`` and an index of other shards: transformers'
    ``from_pretrained`` reads ``model.safetensors``; so does ``pipe.load_state_dict``."""
    llama(tied=False, seed=1).save_pretrained(tmp_path / "both")  # one model.safetensors
    llama(tied=False, seed=2).save_pretrained(tmp_path / "sharded", max_shard_size=SHARD)
    for name in os.listdir(tmp_path / "sharded"):
        if name != hf_files.SINGLE and name.endswith((".safetensors", ".json")) and name != "config.json":
            os.replace(tmp_path / "sharded" / name, tmp_path / "both" / name)
    assert {hf_files.SINGLE, hf_files.INDEX} <= set(os.listdir(tmp_path / "both"))
    expected = from_pretrained(str(tmp_path / "both")).state_dict()
    parts, missing, unexpected = split(llama(tied=False), str(tmp_path / "both"))
    assert missing == [] and unexpected == []
    for key, value in parts[0].items():
        assert torch.equal(value, expected[key]), f"{key}: not what from_pretrained loads"


def test_a_state_dict_written_for_from_pretrained(tmp_path: Any) -> None:
    """``consolidate(format="hf")``'s writer: shards, index, config; tied stored once."""
    from pipedream_ext._checkpoint.hf import save as hf_save

    model = llama(tied=True, seed=3)
    weight_map = hf_save.write_state_dict(model.state_dict(), str(tmp_path / "out"), model.config,
                                          max_shard_bytes=20_000)
    assert "lm_head.weight" not in weight_map and len(set(weight_map.values())) > 1
    loaded = from_pretrained(str(tmp_path / "out"))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert os.listdir(tmp_path) == ["out"]  # no staging directory left, inside or beside


# What a user keeps beside a model (and names a save must not take for its own shards).
USER_FILES = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
              "README.md": "# my model", "notes.txt": "keep me", "runs/x": "a run", "src/a.py": "x = 1",
              "data/d.csv": "1,2", "model-notes.txt": "mine", "pytorch_model-00001-of-00002.bin": "mine",
              "model.fp16-00001-of-00002.safetensors": "mine"}


def add_user_files(where: Any) -> None:
    for name, text in USER_FILES.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(text)


def files_of(where: Any) -> Dict[str, bytes]:
    """Every file under ``where`` (relative name -> bytes): what a failed save must keep."""
    found = {}
    for folder, _, names in os.walk(where):
        for name in names:
            full = os.path.join(folder, name)
            is_link = os.path.islink(full)
            found[os.path.relpath(full, where)] = (os.readlink(full).encode() if is_link
                                                   else open(full, "rb").read())
    return found


def assert_no_staging(root: Any) -> None:
    leftovers = [os.path.join(f, n) for f, dirs, names in os.walk(root) for n in dirs + names if ".tmp" in n]
    assert not leftovers, leftovers


def assert_loads(path: Any, model: nn.Module) -> None:
    loaded = from_pretrained(str(path)).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key


def test_a_save_adds_its_files_and_keeps_the_users(tmp_path: Any) -> None:
    """Into a model directory where the user added a tokenizer, notes and a project:
    they stay; a second save in fewer shards removes exactly the first save's stale
    shards (tests/test_hf_weights.py::test_save_pretrained_into_a_project_on_one_rank
    writes into a directory that held the user's files first)."""
    from pipedream_ext._checkpoint.hf import save as hf_save

    proj = tmp_path / "proj"
    first, second = llama(tied=False, seed=3), llama(tied=False, seed=4)
    weight_map = hf_save.write_state_dict(first.state_dict(), str(proj), first.config, max_shard_bytes=20_000)
    assert len(set(weight_map.values())) > 2
    assert_loads(proj, first)
    add_user_files(proj)
    crashed = proj / ".tmp-pipedream-0123456789ab"  # a killed save's staging directory
    crashed.mkdir()
    (crashed / "model-00001-of-00002.safetensors").write_text("partial")
    (proj / ".tmp-pipedream-fedcba987654").mkdir()  # named like one, holding the user's file
    (proj / ".tmp-pipedream-fedcba987654" / "x").write_text("mine")
    hf_save.write_state_dict(second.state_dict(), str(proj), second.config)
    for name, text in USER_FILES.items():
        assert (proj / name).read_text() == text, name
    assert not crashed.exists() and (proj / ".tmp-pipedream-fedcba987654" / "x").read_text() == "mine"
    shutil.rmtree(proj / ".tmp-pipedream-fedcba987654")  # (what assert_no_staging below looks for)
    assert sorted(n for n in os.listdir(proj) if n.endswith(".safetensors") and n not in USER_FILES) == \
        ["model-00001-of-00001.safetensors"]
    assert_loads(proj, second)
    assert os.listdir(tmp_path) == ["proj"]
    assert_no_staging(tmp_path)


def _failing_after(calls: int, real: Any, last: str = "") -> Any:
    """``real``, raising ``OSError`` from its ``calls + 1``-th call on (a disk full, a crash),
    or with ``last`` from its first call whose last argument ends with ``last``."""
    count = [0]

    def call(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if (str(args[-1]).endswith(last) if last else count[0] > calls):
            raise OSError(28, "No space left on device (injected)")
        return real(*args, **kwargs)
    return call


def test_a_failed_save_leaves_the_previous_one(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure between two shard writes, or between two moves into place, leaves
    every file as it was, the previous save loadable and no staged file; when the new
    shards take the old ones' names, a failure among the moves leaves no index (a
    load fails) rather than the old index over a mixture of old and new shards."""
    from pipedream_ext._checkpoint.hf import save as hf_save

    proj = tmp_path / "proj"
    old, new = llama(tied=False, seed=3), llama(tied=False, seed=4)
    hf_save.write_state_dict(old.state_dict(), str(proj), old.config, max_shard_bytes=20_000)
    add_user_files(proj)
    before = files_of(proj)
    # The second shard's write, its move into place, the index's move (after the shards'
    # and config.json's): the stale shards must still be there.
    for module, names, last in ((hf_save, ("save_file",), ""), (os, ("replace", "rename"), ""),
                                (os, ("replace", "rename"), hf_files.INDEX)):
        with monkeypatch.context() as patch:
            for name in names:
                patch.setattr(module, name, _failing_after(1, getattr(module, name), last))
            with pytest.raises(OSError, match="injected"):
                hf_save.write_state_dict(new.state_dict(), str(proj), new.config, max_shard_bytes=40_000)
        assert files_of(proj) == before, (names, last)
        assert_loads(proj, old)
        assert_no_staging(tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", _failing_after(1, os.replace))
        with pytest.raises(OSError, match="injected"):
            hf_save.write_state_dict(new.state_dict(), str(proj), new.config, max_shard_bytes=20_000)
    assert not (proj / hf_files.INDEX).exists()
    with pytest.raises(ValueError, match="not a format pipedream_ext reads"):
        pd.detect(proj)
    for name, text in USER_FILES.items():
        assert (proj / name).read_text() == text, name
    assert_no_staging(tmp_path)
    hf_save.write_state_dict(new.state_dict(), str(proj), new.config, max_shard_bytes=20_000)
    assert_loads(proj, new)


def test_out_dir_through_a_link_and_the_refusals(tmp_path: Any) -> None:
    """A symbolic link to a directory is written through (it stays a link); a file, a
    link to nothing and a directory holding ``model.safetensors`` (which from_pretrained
    would load instead) are refused, nothing changed."""
    from pipedream_ext._checkpoint.hf import save as hf_save

    model = llama(tied=True, seed=3)
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    hf_save.write_state_dict(model.state_dict(), str(tmp_path / "link"), model.config, max_shard_bytes=20_000)
    assert os.path.islink(tmp_path / "link") and hf_files.INDEX in os.listdir(tmp_path / "target")
    assert_loads(tmp_path / "link", model)
    assert sorted(os.listdir(tmp_path)) == ["link", "target"]
    assert_no_staging(tmp_path)
    (tmp_path / "file").write_text("mine")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    model.save_pretrained(tmp_path / "single")
    add_user_files(tmp_path / "single")
    before = files_of(tmp_path)
    for bad, why in [("file", "exists and is not a directory; pass a directory"),
                     ("dangling", f"is a symbolic link to {tmp_path / 'gone'}, which does not exist"),
                     ("single", f"holds {hf_files.SINGLE} .* which from_pretrained would load instead")]:
        with pytest.raises(ValueError, match=rf"consolidate: {tmp_path / bad} {why}"):
            hf_save.write_state_dict(model.state_dict(), str(tmp_path / bad))
    assert files_of(tmp_path) == before and not os.path.lexists(tmp_path / "gone")


def test_save_pretrained_into_a_project_on_one_rank(tmp_path: Any, group: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_pretrained(pipe, ".")`` and ``consolidate(ckpt, format="hf", out_dir=".")``
    in a project: its files stay, the shard holds the pipeline's weights; a failed
    write raises and changes nothing."""
    from safetensors.torch import load_file

    from pipedream_ext._checkpoint.hf import save as hf_save

    project = tmp_path / "project"
    project.mkdir()
    add_user_files(project)
    monkeypatch.chdir(project)
    torch.manual_seed(0)
    pipe = pd.PipeDream(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                        nn.functional.cross_entropy, schedule="1f1b", microbatches=1)
    shard = "model-00001-of-00001.safetensors"
    assert set(pd.save_pretrained(pipe, ".").values()) == {shard}
    saved = load_file(project / shard)
    assert saved.keys() == pipe.state_dict().keys()
    for key, value in pipe.state_dict().items():
        assert torch.equal(saved[key], value), key
    pd.save_checkpoint(tmp_path / "ckpt", pipe)
    assert set(pd.consolidate(tmp_path / "ckpt", format="hf", out_dir=".")) == set(saved)
    before = files_of(project)
    with monkeypatch.context() as patch:
        patch.setattr(hf_save, "save_file", _failing_after(0, hf_save.save_file))
        with pytest.raises(pd.CheckpointError, match="save_pretrained .* failed on rank 0: .*injected"):
            pd.save_pretrained(pipe, ".")
    assert files_of(project) == before
    for name, text in USER_FILES.items():
        assert (project / name).read_text() == text, name
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "project"]
    assert_no_staging(project)


def test_consolidate_arguments_are_checked(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"consolidate\(format='safetensors'\): use format=None"):
        pd.consolidate(tmp_path, format="safetensors", out_dir=tmp_path / "x")
    with pytest.raises(ValueError, match=r"out_dir=None with format='hf'; pass both"):
        pd.consolidate(tmp_path, format="hf")


# --------------------------------------------------------------------------- two ranks
class _Reads:
    """What a wrapped ``safe_open`` saw: files opened, tensors (or slices) read, bytes."""

    def __init__(self) -> None:
        self.files: List[str] = []
        self.tensors: List[str] = []
        self.bytes = 0

    def took(self, key: str, value: torch.Tensor) -> torch.Tensor:
        self.tensors.append(key)
        self.bytes += value.numel() * value.element_size()
        return value


class _Slice:
    def __init__(self, part: Any, key: str, reads: _Reads) -> None:
        self._part, self._key, self._reads = part, key, reads

    def get_shape(self) -> List[int]:
        return self._part.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._reads.took(self._key, self._part[index])


class _Handle:
    def __init__(self, handle: Any, reads: _Reads) -> None:
        self._handle, self._reads = handle, reads

    def __enter__(self) -> "_Handle":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> List[str]:
        return list(self._handle.keys())

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._handle.get_slice(key), key, self._reads)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._reads.took(key, self._handle.get_tensor(key))


def load_counting(pipe: Any, path: str) -> _Reads:
    """``pipe.load_state_dict(path)`` with every ``safe_open`` of the loader counted."""
    reads = _Reads()
    real = hf_files.safe_open

    def counting(filename: str, framework: str, device: str = "cpu") -> _Handle:
        reads.files.append(os.path.basename(filename))
        return _Handle(real(filename, framework=framework, device=device), reads)

    hf_files.safe_open = counting
    try:
        pipe.load_state_dict(path)
    finally:
        hf_files.safe_open = real
    return reads


def check_share(pipe: Any, reads: _Reads, path: str, ref: nn.Module) -> None:
    """This rank opened exactly the shards holding its tensors, each once, and read each
    of its tensors once (a tied head: under the embedding's name), nothing else."""
    weight_map = json.loads(open(os.path.join(path, hf_files.INDEX)).read())["weight_map"]
    ties = {"lm_head.weight": "model.embed_tokens.weight"}
    mine = [k if k in weight_map else ties[k] for k in pipe.state_dict()]
    files = sorted({weight_map[k] for k in mine})
    assert sorted(reads.files) == files, (reads.files, files)  # each once, only these
    assert len(files) < len(set(weight_map.values())), "the share is not the whole model"
    assert sorted(reads.tensors) == sorted(mine), (reads.tensors, mine)
    state = ref.state_dict()
    assert reads.bytes == sum(state[k].numel() * state[k].element_size() for k in mine)


def build_pipe(tied: bool) -> Tuple[Any, nn.Module]:
    inputs, y = ZM.batch(8, 8, 100, False)
    model = llama(tied)  # seed 0: other weights than the files'
    pipe = pd.PipeDream(model, ZM.loss_fn, schedule="1f1b", microbatches=4, timeout=120,
                        split_points=ZM.splits[2], sample=(inputs, y), concrete_args=ZM.concrete_args)
    return pipe, model


def assert_state(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> None:
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {key}: {m}")


def check_round_trip(tied: bool, root: str) -> None:
    """Load per rank, train 2 steps against the unsplit model, save_pretrained,
    from_pretrained; a DCP checkpoint consolidated to a Hugging Face directory."""
    where = os.path.join(root, "tied" if tied else "untied")
    source = os.path.join(where, "source")
    if dist.get_rank() == 0:
        llama(tied, seed=1).save_pretrained(source, max_shard_size=SHARD)
    dist.barrier()
    pipe, _ = build_pipe(tied)
    reads = load_counting(pipe, source)
    ref = from_pretrained(source)
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) == tied
    check_share(pipe, reads, source, ref)
    assert_state(pipe.state_dict(), ref.state_dict(), "loaded")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        inputs, y = ZM.batch(8, 8, 10 + step, False)
        expected = reference_step(ZM, ref, inputs, y)
        loss = pipe.step(inputs, y)
        assert abs(loss - expected) <= 1e-5 * max(1.0, abs(expected)), (step, loss, expected)
        opt.step(); opt.zero_grad()
        ref_opt.step(); ref_opt.zero_grad()
    out = os.path.join(where, "out")
    weight_map = pd.save_pretrained(pipe, out)
    assert sorted(set(weight_map.values())) == ["model-00001-of-00002.safetensors",
                                                "model-00002-of-00002.safetensors"]
    assert ("lm_head.weight" in weight_map) != tied  # stored once, as transformers stores it
    assert {"config.json", "generation_config.json", hf_files.INDEX} <= set(os.listdir(out))
    saved = from_pretrained(out)
    assert_state(saved.state_dict(), ref.state_dict(), "saved vs unsplit")
    for key, value in pipe.state_dict().items():
        assert torch.equal(saved.state_dict()[key], value), key
    check_consolidated(pipe, ref, where)


def check_consolidated(pipe: Any, ref: nn.Module, where: str) -> None:
    ckpt, out = os.path.join(where, "ckpt"), os.path.join(where, "consolidated")
    pd.save_checkpoint(ckpt, pipe, format="dcp")
    assert pd.detect(ckpt) == "dcp"
    if dist.get_rank() == 0:
        pd.consolidate(ckpt, format="hf", out_dir=out, config=ref.config)
        assert pd.detect(out) == "hf"
        assert_state(from_pretrained(out).state_dict(), ref.state_dict(), "consolidated")
    dist.barrier()


def check_errors_on_every_rank(root: str) -> None:
    """An untied model given a tied model's files: rank 1 lacks lm_head.weight; every
    rank raises, naming it, and no rank changed a weight."""
    source = os.path.join(root, "errors")
    if dist.get_rank() == 0:
        llama(True, seed=1).save_pretrained(source, max_shard_size=SHARD)
    dist.barrier()
    pipe, _ = build_pipe(tied=False)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises(ValueError, match=r"load_state_dict\(.*errors'\) failed on rank 1: .* lacks 1 "
                                         r"tensor\(s\) of stage 1 .*'lm_head.weight' \(missing keys\)"):
        pipe.load_state_dict(source)
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, before[key]), key
    with pytest.raises(ValueError, match=r"a 'dcp' checkpoint directory; restore it with "
                                         r"pd.load_checkpoint\(path, pipe\)"):
        pipe.load_state_dict(os.path.join(root, "untied", "ckpt"))
    torch_file = os.path.join(root, "model.pt")  # a torch.save file: memory-mapped, as a dict
    if dist.get_rank() == 0:
        torch.save(llama(False, seed=2).state_dict(), torch_file)
    dist.barrier()
    pipe.load_state_dict(torch_file)
    want = llama(False, seed=2).state_dict()
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, want[key]), key


def check_a_rank_failing_changes_nothing(root: str) -> None:
    """pp2: a save keeps the user's files beside the model; rank 1's shard write failing
    makes every rank raise, rank 0's staged shard is removed with the staging directory,
    and every file is as it was (the previous save loads)."""
    from pipedream_ext._checkpoint.hf import save as hf_save

    out = os.path.join(root, "failing")
    pipe, _ = build_pipe(tied=False)
    if dist.get_rank() == 0:
        os.makedirs(out)
        add_user_files(Path(out))
    dist.barrier()
    pd.save_pretrained(pipe, out)
    before = files_of(out)
    real = hf_save.save_file
    if dist.get_rank() == 1:
        hf_save.save_file = _failing_after(0, real)
    try:
        with pytest.raises(pd.CheckpointError, match=r"failed on rank 1: .*injected"):
            pd.save_pretrained(pipe, out)
    finally:
        hf_save.save_file = real
    dist.barrier()
    assert files_of(out) == before
    assert_no_staging(root)
    loaded = from_pretrained(out).state_dict()
    for key, value in pipe.state_dict().items():  # this rank's stage
        assert torch.equal(loaded[key], value), key


def weights_cases(world: int) -> Cases:
    cases = Cases()
    root = FromEnv("PDHFW_DIR", "/tmp/pdhfw")
    cases.add(check_round_trip, True, root, name="tied")
    cases.add(check_round_trip, False, root, name="untied")
    cases.add(check_errors_on_every_rank, root, name="errors")
    cases.add(check_a_rank_failing_changes_nothing, root, name="failed-save")
    return cases


def check_fsdp_shards(root: str) -> None:
    """pp2 x dp2 FSDP: each rank reads only its slice of each of its stages' tensors
    (``get_slice``: the bytes of its local shards, less than its stages' whole tensors),
    the gathered weights equal the files', and save_pretrained gathers them back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    source = os.path.join(root, "fsdp-source")
    if dist.get_rank() == 0:
        llama(False, seed=1).save_pretrained(source, max_shard_size=SHARD)
    dist.barrier()
    inputs, y = ZM.batch(8, 8, 100, False)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pipe = pd.PipeDream(llama(False), ZM.loss_fn, schedule="1f1b", microbatches=4, timeout=120,
                        split_points=ZM.splits[2], sample=(inputs, y), concrete_args=ZM.concrete_args,
                        mesh=mesh, data_parallel="fsdp")
    reads = load_counting(pipe, source)
    want = from_pretrained(source).state_dict()
    local = whole = 0
    for key, value in pipe.state_dict().items():  # the same order on a stage's dp ranks
        assert isinstance(value, DTensor), key
        assert torch.equal(value.full_tensor(), want[key]), key
        local += value.to_local().numel() * value.element_size()
        whole += want[key].numel() * want[key].element_size()
    assert sorted(reads.tensors) == sorted(pipe.state_dict())
    assert reads.bytes == local < whole, (reads.bytes, local, whole)
    out = os.path.join(root, "fsdp-out")
    pd.save_pretrained(pipe, out)
    assert_state(from_pretrained(out).state_dict(), want, "fsdp saved")


def check_tp_shards(root: str) -> None:
    """A ``.safetensors`` file into tests/test_tensor_parallel.py's Llama on pp2 x tp2:
    each rank reads only its tp shards' slices; on pp1 x dp2 x tp2 (FSDP over TP) the
    tensors tensor parallelism splits are FSDP's strided shards, which it reads whole and
    cuts locally, the others (embedding, norms, head) their FSDP slices. Either way the
    gathered weights equal the file's, and save_pretrained (no config: an nn.Sequential)
    writes them back whole."""
    from safetensors.torch import load_file, save_file
    from test_tensor_parallel import BALANCE, lm_loss, mesh_of, plan
    from test_tensor_parallel import llama as sequential_llama
    from torch.distributed.tensor import DTensor

    path = os.path.join(root, "tp.safetensors")
    want = sequential_llama(3).state_dict()
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in want.items()}, path)
    dist.barrier()
    for shape, mode in (((2, 1, 2), "replicate"), ((1, 2, 2), "fsdp")):
        pp, dp, tp = shape
        pipe = pd.PipeDream(sequential_llama(0), lm_loss, schedule="1f1b", microbatches=2,
                            mesh=mesh_of(shape), data_parallel=mode, timeout=60,
                            balance=BALANCE if pp > 1 else None, tensor_parallel=plan())
        reads = load_counting(pipe, path)
        local = whole = 0
        for key, value in pipe.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            assert torch.equal(full, want[key]), (shape, key)
            part = value.to_local() if isinstance(value, DTensor) else value
            local += part.numel() * part.element_size()
            whole += full.numel() * full.element_size()
        assert sorted(reads.tensors) == sorted(pipe.state_dict())
        if mode == "replicate":
            assert reads.bytes == local < whole, (shape, reads.bytes, local, whole)
        else:  # the strided (FSDP over TP) tensors read whole, the others their slices
            assert local < reads.bytes < whole, (shape, reads.bytes, local, whole)
        out = os.path.join(root, f"tp-out-{mode}")  # tp shards gathered to each stage's leader
        weight_map = pd.save_pretrained(pipe, out)
        assert sorted(weight_map) == sorted(want) and os.listdir(out).count("config.json") == 0
        saved: Dict[str, torch.Tensor] = {}
        for name in sorted(set(weight_map.values())):
            saved.update(load_file(os.path.join(out, name)))
        for key, value in want.items():
            assert torch.equal(saved[key], value), (shape, key)
        pipe.close()


def mesh_cases(world: int) -> Cases:
    cases = Cases()
    cases.add(check_fsdp_shards, FromEnv("PDHFW_DIR", "/tmp/pdhfw"), name="fsdp")
    cases.add(check_tp_shards, FromEnv("PDHFW_DIR", "/tmp/pdhfw"), name="tp")
    return cases


LAUNCHES = [Launch(HERE, 2, weights_cases, dirs=("PDHFW_DIR",)),
            Launch(HERE, 4, mesh_cases, name="mesh", dirs=("PDHFW_DIR",))]


@parametrize_cases(*LAUNCHES)
def test_hf_weights_per_rank_and_back(case: CaseRef) -> None:
    """pp2 over a traced Llama (tied and untied head): per-rank reads, 2 steps exact,
    save_pretrained and consolidate(format="hf") loaded by from_pretrained; on 4 ranks
    FSDP and tensor parallel ranks reading their slices."""
    case.check()


if __name__ == "__main__":
    worker_main(LAUNCHES)
