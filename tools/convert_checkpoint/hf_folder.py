"""A Hugging Face model folder as the importer reads it: `config.json` as the trainer's ModelShape,
and the safetensors weights (`model.safetensors`, or shards named by `model.safetensors.index.json`).

Everything is checked before anything is written, and every problem is reported in one
`HfFolderError`: an architecture other than Llama, Qwen3 or the Gemma3 form the exporter writes
(hf_mapping), and any feature the trainer's model cannot represent (sliding-window layers, biases,
tied embeddings unless untied on request, a rope scaling type, another activation, Gemma's logit
soft-capping or attention scale, quantized weights); the numbers against the ranges the trainer's
model shape declares (a rope_theta of 1e300 is one line, not an overflow in a spawned writer); then
every tensor's name, shape and dtype, and its values (finite: a NaN or infinite weight would train
to NaN from the first step, so it is refused by name).
Nothing here runs code from the folder: JSON is parsed by `json`, the configuration by its
transformers class (never `trust_remote_code`), once its sizes are known to be sane, tensors by the
safetensors library; pickled `pytorch_model.bin` files are refused, and every file is opened through
folder_files (regular files, links only within the folder or its hub cache, JSON read with a size cap).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from tools.convert_checkpoint.folder_files import HfFolderError, folder_file, has_entry, read_folder_text
from tools.convert_checkpoint.hf_mapping import (ARCHITECTURES, EMBEDDING, HEAD, MODEL_TYPES, config_class, hf_names,
                                                 megatron_names)
from trainer.model.presets import ROTARY_BASE_MAX, ModelShape
from muloco.core.typed_json import ConfigProblems

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_ARCH_OF_MODEL_TYPE = {model_type: arch for arch, model_type in MODEL_TYPES.items()}
_FLOAT_DTYPES = ("F32", "BF16", "F16")
# safetensors' dtype codes as torch names them, for the refusal of another dtype.
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
                "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
FINITE_CHECK_ELEMENTS = 1 << 24  # read per slice when checking a tensor's values (64 MB of fp32)
# Derived buffers older transformers versions saved; transformers itself ignores them on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
CONFIG_MAX_BYTES = 1 << 20
INDEX_MAX_BYTES = 64 << 20
# Beyond any model the trainer could hold; checked before transformers, which builds per-layer lists.
SIZE_LIMITS = {"num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096,
               "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "vocab_size": 1 << 24,
               "max_position_embeddings": 1 << 24}


@dataclass(frozen=True)
class HfModel:
    directory: Path
    config: PretrainedConfig
    shape: ModelShape
    vocab_size: int  # rows of the embedding (config.vocab_size)
    untied: bool  # tied embeddings, untied on request: the output layer starts as a copy of the embedding

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.shape.arch]


def read_hf_model(directory: str | Path, untie_embeddings: bool = False) -> HfModel:
    """The folder's configuration as the trainer's model shape, or one HfFolderError naming every problem."""
    directory = Path(directory)
    config = _read_config(directory)
    arch = _ARCH_OF_MODEL_TYPE[config.model_type]
    problems = _unsupported(config, arch)
    tied = bool(config.tie_word_embeddings)
    if tied and not untie_embeddings:
        problems.append("tie_word_embeddings is true: the trainer's output layer is its own matrix (--untie-embeddings "
                        "starts it as a copy of the embedding, trained separately from then on)")
    theta = _rope(config).get("rope_theta")
    # Bounded before int(): an infinite theta would raise, and a huge one overflow RoPE's int64 base.
    if not (type(theta) in (int, float) and 1 <= theta <= ROTARY_BASE_MAX and theta == int(theta)):
        problems.append(f"rope_theta {theta!r} is not a whole number in 1..{ROTARY_BASE_MAX:.0e} (the trainer's "
                        "rotary base is)")
    if problems:
        raise HfFolderError(f"{directory / 'config.json'}: cannot import this {config.model_type} model: "
                            + "; ".join(problems))
    try:
        shape = ModelShape(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                           num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.intermediate_size,
                           kv_channels=config.head_dim or config.hidden_size // config.num_attention_heads,
                           num_query_groups=config.num_key_value_heads or config.num_attention_heads, arch=arch,
                           rotary_base=int(theta), seq_length=config.max_position_embeddings,
                           init_std=config.initializer_range, norm_epsilon=config.rms_norm_eps)
    except ConfigProblems as err:  # named as config.json names them
        raise HfFolderError(f"{directory / 'config.json'}: {ConfigProblems(err.problems, _HF_KEYS)}") from None
    return HfModel(directory, config, shape, config.vocab_size, tied)


# The trainer's model-shape fields by the config.json keys they are read from.
_HF_KEYS = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size", "kv_channels": "head_dim",
            "num_query_groups": "num_key_value_heads", "rotary_base": "rope_theta",
            "seq_length": "max_position_embeddings", "init_std": "initializer_range", "norm_epsilon": "rms_norm_eps"}


def _read_config(directory: Path) -> PretrainedConfig:
    path = directory / "config.json"
    try:
        raw = json.loads(read_folder_text(directory, "config.json", CONFIG_MAX_BYTES))
    except (json.JSONDecodeError, RecursionError) as err:
        raise HfFolderError(f"{path}: cannot read a Hugging Face config ({err})") from None
    if not isinstance(raw, dict):
        raise HfFolderError(f"{path}: not a JSON object")
    sizes = [f"{key} {raw[key]!r} is not a whole number in 1..{limit}" for key, limit in SIZE_LIMITS.items()
             if key in raw and raw[key] is not None and not (type(raw[key]) is int and 1 <= raw[key] <= limit)]
    if sizes:
        raise HfFolderError(f"{path}: " + "; ".join(sizes))
    model_type = raw.get("model_type")
    if model_type not in _ARCH_OF_MODEL_TYPE:
        hint = " (a multimodal Gemma3: only the text model, gemma3_text, is imported)" if model_type == "gemma3" else ""
        raise HfFolderError(f"{path}: model_type {model_type!r} is not one the trainer imports "
                            f"({', '.join(sorted(_ARCH_OF_MODEL_TYPE))}){hint}")
    arch = _ARCH_OF_MODEL_TYPE[model_type]
    architectures = raw.get("architectures") or [ARCHITECTURES[arch]]
    if architectures != [ARCHITECTURES[arch]]:
        raise HfFolderError(f"{path}: architectures {architectures} is not [{ARCHITECTURES[arch]!r}] (a causal "
                            "language model with its lm_head)")
    if "quantization_config" in raw:
        raise HfFolderError(f"{path}: quantized weights (quantization_config) cannot be trained: import the "
                            "unquantized model")
    try:
        return config_class(arch).from_dict(raw)
    except Exception as err:  # noqa: BLE001 - transformers' validation raises several exception types
        detail = " ".join(str(err).split())  # transformers' validation errors span lines
        raise HfFolderError(f"{path}: not a valid {model_type} config ({type(err).__name__}: {detail})") from None


def _rope(config: PretrainedConfig) -> dict:
    """The full-attention layers' rope parameters (transformers >= 5 `rope_parameters`, nested per layer
    type for Gemma3; older versions' rope_theta and rope_scaling)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = {"rope_theta": getattr(config, "rope_theta", None), **(getattr(config, "rope_scaling", None) or {})}
    return dict(params.get("full_attention", params))


def _unsupported(config: PretrainedConfig, arch: str) -> list[str]:
    """What the trainer's model (SwiGLU, RoPE without scaling, global causal attention, no biases) lacks."""
    problems = []
    activation = config.hidden_activation if arch == "paper" else config.hidden_act
    if activation != "silu":
        name = "hidden_activation" if arch == "paper" else "hidden_act"
        problems.append(f"{name} {activation!r}: the trainer's MLP is SwiGLU (silu)")
    rope_type = _rope(config).get("rope_type", _rope(config).get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope scaling type {rope_type!r}: the trainer's RoPE has no scaling")
    # transformers >= 5 says per layer (from use_sliding_window and max_window_layers where not given).
    layer_types = getattr(config, "layer_types", None)
    sliding = [i for i, kind in enumerate(layer_types or []) if kind != "full_attention"]
    if sliding or (layer_types is None and getattr(config, "use_sliding_window", False)):
        problems.append(f"sliding-window attention (layers {sliding or 'from max_window_layers'}): the trainer's "
                        "attention is global")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias is true: the trainer's linears have no biases")
    if getattr(config, "mlp_bias", False):
        problems.append("mlp_bias is true: the trainer's linears have no biases")
    if arch == "paper":
        head_dim = config.head_dim
        if config.query_pre_attn_scalar != head_dim:
            problems.append(f"query_pre_attn_scalar {config.query_pre_attn_scalar} is not head_dim {head_dim}: the "
                            "trainer scales attention by head_dim^-0.5")
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, cap) is not None:
                problems.append(f"{cap} {getattr(config, cap)}: the trainer has no logit soft-capping")
        if getattr(config, "use_bidirectional_attention", False):
            problems.append("use_bidirectional_attention is true: the trainer's attention is causal")
    return problems


def special_token_ids(config: PretrainedConfig) -> dict[str, list[int]]:
    """bos/eos/pad ids config.json names (eos may be a list)."""
    found = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        ids = value if isinstance(value, list) else [value]
        found[key] = [i for i in ids if i is not None]
    return found


class HfWeights:
    """The folder's tensors by Hugging Face name, read on request from memory-mapped safetensors files.
    With untied embeddings the output layer reads the embedding."""

    def __init__(self, directory: Path, untied: bool):
        self.directory, self.untied = directory, untied
        self._file_of = _weight_files(directory)
        self._handles: dict[Path, object] = {}

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors reports a malformed file as several types
                raise HfFolderError(f"{path} is not a readable safetensors file ({err})") from None
        return self._handles[path]

    def check(self, expected: dict[str, tuple[int, ...]], arch: str) -> None:
        """Every tensor `expected` (name -> shape) is there, float, of that shape; nothing else is."""
        problems = []
        present = set(self._file_of)
        missing = sorted(set(expected) - present)
        if missing:
            problems.append(f"missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        unexpected = sorted(n for n in present - set(expected) if not n.endswith(_IGNORED_SUFFIXES)
                            and not (n == HEAD and self.untied))
        if unexpected:
            problems.append(f"tensors the trainer's {arch} model has no place for "
                            f"{unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
        for name in sorted(set(expected) & present):
            info = self._handle(self._file_of[name]).get_slice(name)
            shape, dtype = tuple(info.get_shape()), info.get_dtype()
            if shape != expected[name]:
                problems.append(f"{name} has shape {list(shape)}, config.json implies {list(expected[name])}")
            if dtype not in _FLOAT_DTYPES:
                named = f"{dtype} ({_DTYPE_NAMES[dtype]})" if dtype in _DTYPE_NAMES else dtype
                problems.append(f"{name} is {named}, expected {'/'.join(_FLOAT_DTYPES)}")
        if problems:
            raise HfFolderError(f"{self.directory}: " + "; ".join(problems))
        nonfinite = [name for name in sorted(expected) if not self._finite(name)]
        if nonfinite:
            problems.append(f"{', '.join(nonfinite[:6])}{' ...' if len(nonfinite) > 6 else ''} hold"
                            f"{'s' if len(nonfinite) == 1 else ''} NaN or infinite values")
        if problems:
            raise HfFolderError(f"{self.directory}: " + "; ".join(problems))

    def _finite(self, name: str) -> bool:
        """Whether every value of the tensor is finite, read a slice of rows at a time (memory stays bounded)."""
        info = self._handle(self._file_of[name]).get_slice(name)
        rows, *rest = info.get_shape()
        step = max(1, FINITE_CHECK_ELEMENTS // max(1, math.prod(rest)))
        return all(bool(torch.isfinite(info[start:start + step]).all()) for start in range(0, rows, step))

    def names(self) -> list[str]:
        """The model's tensors (without the derived buffers older transformers versions saved)."""
        return sorted(n for n in self._file_of if not n.endswith(_IGNORED_SUFFIXES))

    def get(self, name: str) -> torch.Tensor:
        """A tensor as stored."""
        if name == HEAD and self.untied:
            name = EMBEDDING
        try:
            return self._handle(self._file_of[name]).get_tensor(name)
        except KeyError:
            raise HfFolderError(f"{self._file_of[name]}: holds no tensor {name!r} (its index says it does)") from None


def checked_weights(model: HfModel) -> HfWeights:
    weights = HfWeights(model.directory, model.untied)
    weights.check(expected_hf_shapes(model), model.shape.arch)
    return weights


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index's weight_map, or the single file's names)."""
    index = directory / INDEX
    if has_entry(directory, INDEX):
        try:
            weight_map = json.loads(read_folder_text(directory, INDEX, INDEX_MAX_BYTES))["weight_map"]
        except (json.JSONDecodeError, RecursionError, KeyError, TypeError) as err:
            raise HfFolderError(f"{index}: not a safetensors index with a weight_map ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HfFolderError(f"{index}: weight_map is not an object of file names")
        files = {}
        for file in sorted(set(weight_map.values())):
            if Path(file).name != file or file in (".", ".."):
                raise HfFolderError(f"{index}: {file!r} is not a file in {directory}")
            files[file] = folder_file(directory, file)
        return {name: files[file] for name, file in weight_map.items()}
    if has_entry(directory, SINGLE):
        single = folder_file(directory, SINGLE)
        try:
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), single)
        except Exception as err:  # noqa: BLE001 - see HfWeights._handle
            raise HfFolderError(f"{single} is not a readable safetensors file ({err})") from None
    pickled = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
    raise HfFolderError(f"{directory} holds no {SINGLE} or {INDEX}"
                        + (f" ({pickled[0]} is a pickle, which is never loaded: unpickling can run code; save the "
                           "model with safetensors)" if pickled else ""))


def expected_hf_shapes(model: HfModel) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor the trainer's model takes, with the shape config.json implies."""
    s = model.shape
    h, hd, f = s.hidden_size, s.kv_channels, s.ffn_hidden_size
    by_suffix = {"q_proj.weight": (s.num_attention_heads * hd, h), "k_proj.weight": (s.query_groups * hd, h),
                 "v_proj.weight": (s.query_groups * hd, h), "o_proj.weight": (h, s.num_attention_heads * hd),
                 "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
                 "q_norm.weight": (hd,), "k_norm.weight": (hd,), "layernorm.weight": (h,),
                 "model.norm.weight": (h,), EMBEDDING: (model.vocab_size, h), HEAD: (model.vocab_size, h)}
    shapes = {}
    for name in megatron_names(s):
        for hf_name in hf_names(name, s).values():
            if hf_name == HEAD and model.untied:
                continue
            shapes[hf_name] = next(v for k, v in by_suffix.items() if hf_name.endswith(k))
    return shapes
