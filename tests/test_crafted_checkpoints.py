"""Crafted and damaged checkpoints, each with a meta.json whose SHA-256 matches the bad content, are
refused with one `checkpoint error:` line naming the file and the field: meta.json and `latest` by the
reader, a rank's tree by trainer/checkpoint/schema.py (the check resume makes before loading), and each
weight a weights start (--finetune, a weights-only checkpoint) takes alone.

The checkpoint crafted from is the suite's T=2 P=2 reference (tests/_ckpt_runs.py); "this run" is
the one that wrote it, so the good rank file's own form is the form expected of the crafted one.
Run with -s to see every line."""
from __future__ import annotations

import json
import math
import random
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from _ckpt_runs import reference_checkpoint

from trainer.checkpoint import CheckpointError, CheckpointReader
from trainer.checkpoint.format import rank_file, sha256_of
from muloco.core.rank_file import read_rank_file, to_plain, write_rank_file
from muloco.diloco.snapshot import CHECKPOINT, Form, Identity, Snapshot, SnapshotError
from trainer.checkpoint.schema import checked_rank_state

pytestmark = [pytest.mark.launch, pytest.mark.timeout(900)]  # every test here starts processes

STEP = 3
RANK = 1  # not rank 0: the finding was a damaged file on another rank
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
FC2 = "decoder.layers.0.mlp.linear_fc2.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return reference_checkpoint(tmp_path_factory.getbasetemp()) / "ckpt" / f"iter_{STEP:07d}"


def _copy(good: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(good, root / good.name)
    (root / "latest").write_text(f"{STEP}\n")
    return root


def _meta_file(root: Path) -> Path:
    return root / f"iter_{STEP:07d}" / "meta.json"


def _edit_meta(root: Path, edit: Callable[[dict], object]) -> None:
    meta = json.loads(_meta_file(root).read_text())
    edit(meta)
    _meta_file(root).write_text(json.dumps(meta))


def _reseal(root: Path, rank: int = RANK) -> None:
    """meta.json records the rank file's new SHA-256: the damage is not a checksum mismatch."""
    path = rank_file(root / f"iter_{STEP:07d}", rank)
    _edit_meta(root, lambda m: m["rank_files"].__setitem__(path.name, sha256_of(path)))


def _set(path: str, value) -> Callable[[dict], object]:
    def edit(tree: dict) -> None:
        *parents, last = path.split("/")
        node = tree
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
    return edit


def _delete(path: str) -> Callable[[dict], object]:
    *parents, last = path.split("/")
    return lambda tree: _walk(tree, parents).pop(last)


def _walk(tree, keys):
    for key in keys:
        tree = tree[key]
    return tree


# -- meta.json and latest: checked by the reader ------------------------------------------------------

def _meta_text(text: str):
    return lambda root: _meta_file(root).write_text(text)


def _meta(edit):
    return lambda root: _edit_meta(root, edit)


def _latest(text: str):
    return lambda root: (root / "latest").write_text(text)


META_CASES = {
    "meta not JSON": (_meta_text('{"step": 3,'), r"is not valid JSON: Expecting"),
    "meta a list": (_meta_text("[3]"), r"must hold a JSON object"),
    "pickle format": (_meta(_set("format_version", 1)), r"checkpoint format version 1 is not 2 \(version 1 rank files are "
                                                         r"pickles"),
    "step a string": (_meta(_set("step", "3")), r"step must be an integer, got '3'"),
    "step negative": (_meta(_set("step", -5)), r"step must be >= 0, got -5"),
    "step of another folder": (_meta(_set("step", 4)), r"step 4 is not its folder's \(3\)"),
    "tensor size 0": (_meta(_set("sizes/tensor", 0)), r"sizes\.tensor must be >= 1, got 0"),
    "sizes incomplete": (_meta(_delete("sizes/data")), r"sizes\.data is required"),
    "layers a string": (_meta(_set("model/num_layers", "x")), r"model\.num_layers must be an integer"),
    "vocab NaN": (_meta(_set("vocab_size", math.nan)), r"vocab_size must be an integer, got nan"),
    "padded below vocab": (_meta(_set("padded_vocab_size", 10)), r"padded_vocab_size \(10\) is below "
                                                                 r"vocab_size \(1000\)"),
    "ranks reordered": (_meta(lambda m: m["ranks"].reverse()), r"ranks must map each of the 4 ranks"),
    "a rank file unlisted": (_meta(_delete("rank_files/rank_00003.safetensors")),
                             r"rank_files must name rank_00000\.\.rank_00003\.safetensors"),
    "digest not hex": (_meta(_set("rank_files/rank_00001.safetensors", "z" * 64)),
                       r"rank_files\.rank_00001\.safetensors must be a SHA-256 in hex"),
    "unknown meta key": (_meta(_set("run_this", "rm -rf /")), r"run_this is not a known key"),
    "batch zero": (_meta(_set("config/batch/micro_batch_size", 0)),
                   r"config\.batch\.micro_batch_size must be >= 1, got 0"),
    "latest not a number": (_latest("three\n"), r"must hold a step number, got 'three'"),
    "latest names a missing step": (_latest("7\n"), r"names step 7, but .*/iter_0000007 does not exist"),
    "meta missing": (lambda root: _meta_file(root).unlink(), r"is missing"),
}


@pytest.mark.parametrize("case", META_CASES)
def test_a_crafted_meta_json_or_latest_is_refused_in_one_line(good, tmp_path, case):
    craft, message = META_CASES[case]
    root = _copy(good, tmp_path)
    craft(root)
    with pytest.raises(CheckpointError) as raised:
        CheckpointReader(root)
    _assert_one_line(raised.value, rf"{re.escape(str(root))}/(latest|iter_0000003/meta\.json):? {message}")


def test_a_tokenizer_path_out_of_the_folder_is_refused(good, tmp_path):
    root = _copy(good, tmp_path)
    _edit_meta(root, _set("tokenizer_model", "../../secret.key"))
    with pytest.raises(CheckpointError) as raised:
        CheckpointReader(root).tokenizer_path
    _assert_one_line(raised.value, r".*meta\.json: tokenizer_model '\.\./\.\./secret\.key' is not a file in the "
                                   r"checkpoint's folder")


# -- a rank's tree: checked against this run's form before anything is loaded --------------------------

def _bytes(edit: Callable[[bytes], bytes]):
    def craft(path: Path) -> None:
        path.write_bytes(edit(path.read_bytes()))
    return craft


def _header(edit: Callable[[dict], object]):
    """Rewrite the safetensors header (a JSON object after its 8-byte length)."""
    def rewrite(data: bytes) -> bytes:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
        edit(header)
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        return struct.pack("<Q", len(blob)) + blob + data[8 + size:]
    return _bytes(rewrite)


def _tree(edit: Callable[[dict], object]):
    """Rewrite the state tree as JSON (the header's muloco_state), tensors untouched."""
    def tree(header: dict) -> None:
        structure = json.loads(header["__metadata__"]["muloco_state"])
        edit(structure)
        header["__metadata__"]["muloco_state"] = json.dumps(structure)
    return _header(tree)


def _state(edit: Callable[[dict], object]):
    """Rewrite the state itself (decoded, changed, written again as a valid rank file)."""
    def craft(path: Path) -> None:
        state = to_plain(read_rank_file(path))  # views of the mapped file: write a new one, then rename
        edit(state)
        with open(path.with_name("crafted"), "wb") as f:
            write_rank_file(f, state)
        path.with_name("crafted").replace(path)
    return craft


def _scale(path: str, tensor_edit: Callable[[torch.Tensor], torch.Tensor]):
    def edit(state: dict) -> None:
        *parents, last = path.split("/")
        node = _walk(state, parents)
        node[last] = tensor_edit(node[last])
    return _state(edit)


RANK_CASES = {
    "truncated": (_bytes(lambda d: d[:len(d) // 2]), r"is not a checkpoint rank file in safetensors format \(Error "
                                                     r"while deserializing header: incomplete metadata, file not fully "
                                                     r"covered\)"),
    "header not JSON": (_bytes(lambda d: d[:8] + b"[[[[" + d[12:]), r"is not a checkpoint rank file in safetensors "
                                                                     r"format \(Error while deserializing header"),
    "no state tree": (_header(lambda h: h["__metadata__"].pop("muloco_state")),
                      r"is not a checkpoint rank file in safetensors format \('muloco_state'\)"),
    "tree a list": (_header(lambda h: h["__metadata__"].__setitem__("muloco_state", "[1, 2]")), r"holds no state tree"),
    "tensor the file lacks": (_tree(_set("model/" + EMBEDDING, {"__tensor__": "9999"})),
                              rf"model\.{EMBEDDING} names tensor '9999', which the file does not hold"),
    "unhashable key": (_tree(_set("extra", {"__items__": [[[1, 2], 3]]})),
                       r"extra item 0 has a key that cannot be a dict key: \[1, 2\]"),
    "object array": (_tree(lambda t: t["rng"]["numpy"]["__tuple__"][1].__setitem__("dtype", "|O")),
                     r"rng\.numpy\[1\] is not a numeric numpy array \(dtype '\|O'\)"),
    "malformed tuple": (_tree(_set("rng/python", {"__tuple__": 3})), r"rng\.python is a malformed __tuple__ entry"),
    "step a string": (_state(_set("step", "3")), r"step must be the iteration's, 3, got '3'"),
    "step negative": (_state(_set("step", -5)), r"step must be the iteration's, 3, got -5"),
    "step of another folder": (_state(_set("step", 5)), r"step must be the iteration's, 3, got 5"),
    "a (128,) tensor under a matrix": (_scale("model/" + EMBEDDING, lambda t: t[0].clone()),
                                       rf"model\.{EMBEDDING} must be a float32 tensor of shape \(512, 128\), got a "
                                       r"float32 tensor of shape \(128,\)"),
    "transposed": (_scale("model/" + FC2, lambda t: t.t().contiguous()), rf"model\.{FC2} must be a float32 tensor of "
                                                                         r"shape \(128, 176\), got a float32 tensor "
                                                                         r"of shape \(176, 128\)"),
    "half precision": (_scale("model/" + EMBEDDING, lambda t: t.half()),
                       rf"model\.{EMBEDDING} must be a float32 tensor of shape \(512, 128\), got a float16 tensor"),
    "NaN weight": (_scale("model/" + EMBEDDING, lambda t: t.index_fill(0, torch.tensor([3]), math.nan)),
                   rf"model\.{EMBEDDING} holds NaN or infinite values"),
    "a parameter missing": (_state(lambda s: s["model"].pop(EMBEDDING)), rf"model lacks this rank's parameters "
                                                                         rf"\['{EMBEDDING}'\]"),
    "a parameter added": (_state(_set("model/decoder.layers.9.mlp.weight", torch.zeros(2))),
                          r"model holds parameters this rank does not have: \['decoder\.layers\.9\.mlp\.weight'\]"),
    "momentum of another shape": (_scale(f"optimizer/state/{QKV}/momentum_buffer", lambda t: t[:, :7].clone()),
                                  rf"optimizer\.state\.{QKV}\.momentum_buffer must be a float32 tensor of shape "
                                  r"\(128, 128\)"),
    "state of no parameter": (_state(_set("optimizer/state/not.a.parameter", {"exp_avg": torch.zeros(3)})),
                              r"optimizer\.state\.not\.a\.parameter is not a parameter of this rank"),
    "another optimizer": (_state(_set("optimizer/param_groups/1/kind", "adamw")),
                          r"optimizer\.param_groups\[1\] must be a muon group \(a different inner optimizer\?\)"),
    "negative lr": (_state(_set("optimizer/param_groups/0/lr", -0.01)),
                    r"optimizer\.param_groups\[0\]\.lr must be >= 0, got -0\.01"),
    "infinite lr": (_state(_set("optimizer/param_groups/0/lr", math.inf)),
                    r"optimizer\.param_groups\[0\]\.lr must be a finite number, got inf"),
    "step count a string": (_state(_set(f"optimizer/state/{EMBEDDING}/step", "3")),
                            rf"optimizer\.state\.{EMBEDDING}\.step must be a tensor or a number >= 0, got '3'"),
    "python RNG of version 99": (_state(lambda s: s["rng"].__setitem__("python", (99, *s["rng"]["python"][1:]))),
                                 r"rng\.python is not a python generator state"),
    "numpy RNG named otherwise": (_state(lambda s: s["rng"].__setitem__("numpy", ("PCG64", *s["rng"]["numpy"][1:]))),
                                  r"rng\.numpy is not a numpy generator state"),
    "torch RNG cut short": (_scale("rng/torch", lambda t: t[:100].clone()),
                            r"rng\.torch must be a uint8 tensor of shape \(5056,\), got a uint8 tensor of shape "
                            r"\(100,\)"),
    "scheduler behind": (_state(_set("scheduler/last_epoch", 1)), r"scheduler\.last_epoch must be the step, 3, got 1"),
    "scheduler lrs short": (_state(lambda s: s["scheduler"]["base_lrs"].pop()),
                            r"scheduler\.base_lrs must hold 2 items, got 1"),
    "counter a string": (_state(_set("engine/global_steps", "x")), r"engine\.global_steps must be an integer, got 'x'"),
    "an unknown part": (_state(_set("code", "import os")), r"code is not a known part of a rank's state"),
    "no optimizer": (_state(lambda s: s.pop("optimizer")), r"optimizer is missing"),
}


@pytest.mark.parametrize("case", RANK_CASES)
def test_a_crafted_rank_file_with_a_matching_sha_is_refused_in_one_line(good, tmp_path, case):
    craft, message = RANK_CASES[case]
    root = _copy(good, tmp_path)
    expected = to_plain(read_rank_file(rank_file(good, RANK)))
    craft(rank_file(root / good.name, RANK))
    _reseal(root)
    with pytest.raises(CheckpointError) as raised:
        checked_rank_state(CheckpointReader(root), RANK, expected["model"], _own_form(expected))
    _assert_one_line(raised.value, rf"rank file {re.escape(str(rank_file(root / good.name, RANK)))}:? {message}")


class _OuterLoopForm:
    """The outer loop's check of its checkpointed state (muloco/diloco/snapshot.py), for a run whose
    outer loop owns the (128, 128) QKV weight alone."""
    FORM = Form({QKV: (torch.float32, (128, 128))}, {}, [[128 * 128]], None)

    def state_problems(self, tree) -> list[str]:
        try:
            Snapshot.from_tree(tree, self.FORM, "the outer loop's state")
        except SnapshotError as err:
            return [str(err)]
        return []


def _snapshot_tree(weights: torch.Tensor) -> dict:
    identity = Identity("", "", 0, RANK, (1, 1, 1, 1), "0" * 64)
    return Snapshot(CHECKPOINT, identity, 2, 2, 0, {QKV: weights}, {QKV: torch.zeros_like(weights)}, {}, [], {},
                    None).to_tree()


def test_an_extra_component_of_another_form_is_refused(good, tmp_path):
    """The outer loop's state has the form of this run's outer loop (names, shapes), checked by it."""
    root = _copy(good, tmp_path)
    expected = to_plain(read_rank_file(rank_file(good, RANK)))
    own = _own_form(expected)
    own["extra"] = {"muloco": _OuterLoopForm()}
    assert _OuterLoopForm().state_problems(_snapshot_tree(torch.zeros(128, 128))) == []
    _state(_set("extra/muloco", _snapshot_tree(torch.zeros(128))))(rank_file(root / good.name, RANK))
    _reseal(root)
    with pytest.raises(CheckpointError) as raised:
        checked_rank_state(CheckpointReader(root), RANK, expected["model"], own)
    _assert_one_line(raised.value, rf".*: extra\.muloco: the outer loop's state is not an outer-loop snapshot of this "
                                   rf"run: global_weights\[{QKV}\] is not a torch.float32 tensor of shape \(128, 128\)")


def test_the_good_rank_file_passes_and_nothing_else_moved(good, tmp_path):
    root = _copy(good, tmp_path)
    expected = to_plain(read_rank_file(rank_file(good, RANK)))
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    state = checked_rank_state(CheckpointReader(root), RANK, expected["model"], _own_form(expected))
    assert state["step"] == STEP
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2]), "checking an RNG state must not load it"


# -- a weights start (--finetune, a weights-only checkpoint) reads the weights alone -------------------

NORM = "decoder.final_layernorm.weight"  # replicated: only tensor rank 0's copy is read
INPUT_NORM = "decoder.layers.0.input_layernorm.weight"
WEIGHTS_CASES = {
    "NaN weight": (RANK, _scale("model/" + EMBEDDING, lambda t: t.index_fill(0, torch.tensor([3]), math.nan)),
                   rf"model\.{EMBEDDING} holds NaN or infinite values"),
    # copy_ would broadcast it over the whole norm
    "a (1,) norm weight": (2, _scale("model/" + NORM, lambda t: t[:1].clone()),
                           rf"model\.{NORM} must be a floating-point tensor of shape \(128,\) \(unsharded\), "
                           r"got a float32 tensor of shape \(1,\)"),
    "one shard short a row": (RANK, _scale("model/" + EMBEDDING, lambda t: t[1:].clone()),
                              rf"model\.{EMBEDDING} must be a floating-point tensor of shape \(1024, 128\)"),
    "shards that do not fit": (RANK, _scale("model/" + EMBEDDING, lambda t: t[0].clone()),
                               rf"the shards of model\.{EMBEDDING} do not fit together"),
    "integer weights": (0, _scale("model/" + INPUT_NORM, lambda t: t.long()),
                        rf"model\.{INPUT_NORM} must be a floating-point tensor of shape \(128,\) \(unsharded\), got a "
                        r"int64 tensor"),
}


def _start_from_weights(root: Path) -> torch.nn.Module:
    """A T=1 P=1 run of the checkpoint's model given --load ROOT --finetune, as the entry point starts it."""
    from megatron_world import megatron_world_of_one

    from trainer.checkpoint.checkpointer import start_from_weights
    from trainer.checkpoint.format import checkpoint_args
    from trainer.config import build_parser, resolve
    from trainer.model.builder import build_model

    args = build_parser().parse_args(["--ds_config", "ds_configs/cpu_tiny_muon.json", "--data-path", "x",
                                      "--load", str(root), "--finetune", "--use-checkpoint-args"])
    config = resolve(args, 1, checkpoint_args(args.load))
    padded = CheckpointReader(root).meta.padded_vocab_size
    with megatron_world_of_one():
        model = build_model(config.model, padded)
        assert "--finetune" in start_from_weights(config, model, padded)
    return model


def test_a_weights_start_takes_every_weight_of_the_good_checkpoint(good, tmp_path):
    from trainer.model.builder import canonical_names

    root = _copy(good, tmp_path)
    model = _start_from_weights(root)
    reader = CheckpointReader(root)
    stage_of = reader.stage_of(0, 0)
    for name, param in model.named_parameters():
        name = canonical_names(model)[name]
        assert torch.equal(param, reader.full_tensor(reader.stage_ranks(0, 0, stage_of[name]), name,
                                                     lambda s: s["model"][name])), name


def test_a_weights_start_recomputes_the_probe_and_refuses_swapped_tensors(good, tmp_path, capsys):
    """The embedding and the output layer have one shape: swapped (checksums recomputed), every tensor
    passes its own check, and only the recorded probe logits tell the difference."""
    root = _copy(good, tmp_path)
    reader = CheckpointReader(root)
    first, last = reader.stage_ranks(0, 0, 0), reader.stage_ranks(0, 0, reader.meta.sizes.pipeline - 1)
    for embedding_rank, output_rank in zip(first, last):
        embedding = to_plain(read_rank_file(rank_file(root / good.name, embedding_rank)))["model"][EMBEDDING].clone()
        output = to_plain(read_rank_file(rank_file(root / good.name, output_rank)))["model"][OUTPUT].clone()
        _state(lambda state, t=output: state["model"].__setitem__(EMBEDDING, t))(rank_file(root / good.name,
                                                                                           embedding_rank))
        _state(lambda state, t=embedding: state["model"].__setitem__(OUTPUT, t))(rank_file(root / good.name, output_rank))
        _reseal(root, embedding_rank)
        _reseal(root, output_rank)
    with pytest.raises(SystemExit):
        _start_from_weights(root)
    line = capsys.readouterr().err.strip()
    print(line)
    assert "\n" not in line and re.match(rf"checkpoint error: {re.escape(str(root / good.name))}: the weights of worker 0 "
                                         r"give logits up to \S+ away from the probe recorded when they were saved", line)


@pytest.mark.parametrize("case", WEIGHTS_CASES)
def test_a_weights_start_refuses_a_crafted_weight_in_one_line(good, tmp_path, capsys, case):
    rank, craft, message = WEIGHTS_CASES[case]
    root = _copy(good, tmp_path)
    craft(rank_file(root / good.name, rank))
    _reseal(root, rank)
    with pytest.raises(SystemExit):
        _start_from_weights(root)
    line = capsys.readouterr().err.strip()
    print(line)
    assert "\n" not in line and re.match(rf"checkpoint error: {re.escape(str(root / good.name))}: {message}", line), line


def _own_form(state: dict) -> dict:
    return {"optimizer_groups": state["optimizer"]["param_groups"], "scheduler": state["scheduler"],
            "engine": state["engine"], "rng": state["rng"], "extra": state["extra"]}


def _assert_one_line(error: Exception, message: str) -> None:
    line = f"checkpoint error: {error}"
    print(line)
    assert "\n" not in line and re.match(f"checkpoint error: {message}", line), line
