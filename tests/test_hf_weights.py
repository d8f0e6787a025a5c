"""Hugging Face weights in and out: ``pipe.load_state_dict(hf_dir)``, ``pd.save_pretrained``,
``pd.consolidate(..., format="hf")`` and ``pd.detect`` (``_checkpoint/hf_*.py``).

One process: the index, detection, the errors (missing, unexpected, mis-shaped keys, a
shard the index lists that is missing, an ``out_dir`` that holds other files), and a
whole state dict written for ``from_pretrained``. Two ranks (pp2, a traced zoo Llama,
tied and untied head): a directory transformers wrote in several shards is loaded per
rank, counting every file each rank opens and every tensor and byte it reads (a
wrapped ``safe_open``: exactly its stages' share); 2 SGD steps equal the unsplit model
loaded by ``from_pretrained``; ``pd.save_pretrained`` of the trained pipeline loads
with ``from_pretrained`` to the pipeline's and the unsplit model's weights; a DCP
checkpoint consolidated with ``format="hf"`` loads the same. Runs under pytest, or:

    PDHFW_DIR=/tmp/w torchrun --standalone --nproc-per-node 2 tests/test_hf_weights.py
"""
from __future__ import annotations

import json
import os
import sys
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
from pipedream_ext._checkpoint import MANIFEST, hf_files, hf_load  # noqa: E402
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


def test_a_state_dict_written_for_from_pretrained(tmp_path: Any) -> None:
    """``consolidate(format="hf")``'s writer: shards, index, config; tied stored once."""
    from pipedream_ext._checkpoint import hf_save

    model = llama(tied=True, seed=3)
    weight_map = hf_save.write_state_dict(model.state_dict(), str(tmp_path / "out"), model.config,
                                          max_shard_bytes=20_000)
    assert "lm_head.weight" not in weight_map and len(set(weight_map.values())) > 1
    loaded = from_pretrained(str(tmp_path / "out"))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"mine holds files and no Hugging Face weights .* pass an empty"):
        hf_save.write_state_dict(model.state_dict(), str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["mine", "out"]  # no temporary directory left


def test_consolidate_arguments_are_checked(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"consolidate\(format='safetensors'\): use format=None"):
        pd.consolidate(tmp_path, format="safetensors", out_dir=tmp_path / "x")
    with pytest.raises(ValueError, match=r"out_dir=None with format='hf'; pass both"):
        pd.consolidate(tmp_path, format="hf")
