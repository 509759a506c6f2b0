"""Reading a local Hugging Face Llama checkpoint: ``config.json`` and ``*.safetensors``.

``Checkpoint.open(path)`` finds the directory and reads its ``config.json`` once; the run then
asks that object for all it needs (the ``ModelConfig`` with its overrides, the eos ids, the
weights' names and shapes, the weights, which ``CausalLM.load_weights`` checks name by name and
shape by shape), and nothing looks for the folder or reads a file twice. ``from_pretrained`` in
every step is ``model_config`` and ``read_weights``. Nothing is downloaded: ``path`` is a
directory on disk, laid out the way ``save_pretrained`` (or a model hub download) leaves it.

Only what the engine computes is accepted. A checkpoint that asks for anything else (biases,
a sliding window, another RoPE scaling, another architecture) is refused with an error naming
the field: a model that loads but silently computes something different would be worse.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from .config import Llama3RopeScaling, ModelConfig, parse_dtype
from .errors import CheckpointError, MissingPackageError
from .weights import check_weights

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# config.json key -> ModelConfig field, for the fields that map one to one.
REQUIRED_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_attention_heads": "num_heads",
    "num_hidden_layers": "num_layers",
    "intermediate_size": "d_ff",
}


def require_safetensors() -> Any:
    """The ``safetensors.torch`` module, or an ImportError that says how to install it."""
    try:
        import safetensors.torch
    except ImportError as exc:
        raise MissingPackageError(
            "loading a checkpoint needs the 'safetensors' package: pip install -e '.[real]'"
        ) from exc
    return safetensors.torch


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of the checkpoint; a broken one is the checkpoint's problem, said in one
    line (not a ``JSONDecodeError`` traceback)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def read_optional_json(path: Path) -> dict[str, Any]:
    """``read_json``, or {} when the checkpoint has no such file (``generation_config.json``,
    the tokenizer's files)."""
    return read_json(path) if path.is_file() else {}


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a checkpoint directory, or a CheckpointError saying what is missing."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a directory; from_pretrained reads a local checkpoint "
            "directory (config.json + *.safetensors) and downloads nothing"
        )
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}")
    return folder


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A checkpoint directory, opened: found, and its ``config.json`` read. Everything else
    is read when first asked for, and once (the eos ids, the weights' headers)."""

    folder: Path
    hf: dict[str, Any]  # config.json, as stored

    @classmethod
    def open(cls, path: str | Path | Checkpoint) -> Checkpoint:
        """The checkpoint at ``path``, or a CheckpointError saying what is missing; one already
        open is taken as it is, so that a function may be handed either."""
        if isinstance(path, Checkpoint):
            return path
        folder = checkpoint_dir(path)
        return cls(folder, read_json(folder / CONFIG_FILE))

    def model_config(self, **overrides: Any) -> ModelConfig:
        """The ``ModelConfig``, with ``overrides`` (``config_from_hf``); no weight is read."""
        return config_from_hf(self.hf, **overrides)

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a generation: ``generation_config.json``'s ``eos_token_id`` if it
        has one, else ``config.json``'s (either may be one id or a list; Llama 3 chat models
        list several, ``<|eot_id|>`` among them). A request stops at the first it generates."""
        sources = {GENERATION_CONFIG_FILE: read_optional_json(self.folder / GENERATION_CONFIG_FILE)}
        for name, config in {**sources, CONFIG_FILE: self.hf}.items():
            eos = config.get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise CheckpointError(
                        f"{name}: eos_token_id must be a token id or a list of them, got {eos!r}"
                    )
                return list(ids)
        return []

    @cached_property
    def stored_shapes(self) -> dict[str, torch.Tensor]:
        """Every stored tensor's name and shape, from the files' headers only (milliseconds,
        however large the model), as shape-only tensors on the meta device."""
        require_safetensors()
        from safetensors import safe_open

        shapes: dict[str, torch.Tensor] = {}
        for file in safetensors_files(self.folder):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                        shapes[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
            except Exception as exc:  # safetensors' own error type: a truncated or foreign file
                raise CheckpointError(unreadable(file, exc)) from None
        return shapes

    def check_shapes(self, cfg: ModelConfig) -> None:
        """The weights' names and shapes against ``cfg`` before any weight is read: a
        checkpoint that does not fit is refused in a second, not after loading gigabytes. (A
        tied checkpoint's extra ``lm_head.weight`` is compared with the embedding at load.)"""
        shapes = {name: t for name, t in self.stored_shapes.items() if not derived(name)}
        if cfg.tie_word_embeddings:
            shapes.pop("lm_head.weight", None)
        check_weights(shapes, cfg)

    def read_weights(self, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """The weights for a model of ``cfg``: their names and shapes are checked from the
        files' headers first, and again by ``CausalLM.load_weights``.

        The weights are already in ``cfg.dtype`` on ``cfg.device``, cast one tensor at a time (a
        bfloat16 file is never held twice over in float32), so that several models built from
        one ``load_checkpoint`` (every step in ``python -m bench``) share the same tensors.
        """
        self.check_shapes(cfg)
        weights = read_safetensors(self.folder)
        _drop_redundant(weights, cfg)
        for name in weights:
            weights[name] = weights[name].to(device=cfg.device, dtype=cfg.dtype)
        return weights


# ---- config.json ----------------------------------------------------------------------------


def _refuse_unsupported(hf: Mapping[str, Any]) -> None:
    """Every field whose value asks for math this engine does not do, refused by name."""
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise CheckpointError(
            f"model_type={model_type!r}: only Llama-family ('llama') is supported"
        )
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if list(architectures) != ["LlamaForCausalLM"]:
        raise CheckpointError(f"architectures={architectures}: only LlamaForCausalLM is supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise CheckpointError(f"{flag}=true: the engine's projections have no biases")
    if hf.get("sliding_window") is not None or hf.get("use_sliding_window"):
        raise CheckpointError(
            f"sliding_window={hf.get('sliding_window')}: the engine attends over the whole "
            "context; sliding-window attention is not supported"
        )
    if hf.get("quantization_config"):
        raise CheckpointError("quantization_config: quantized checkpoints are not supported")


def _rope_fields(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """θ and the scaling, from either layout found on disk.

    Older checkpoints: top-level ``rope_theta`` plus ``rope_scaling`` (null, or a dict with
    ``rope_type`` or the even older ``type``). Current transformers writes one
    ``rope_parameters`` dict that holds ``rope_theta`` and the scaling fields together.
    """
    params = hf.get("rope_parameters")
    if params is not None:
        if any(isinstance(v, Mapping) for v in params.values()):
            raise CheckpointError("rope_parameters per layer type: not supported")
        theta, scaling, where = (
            params.get("rope_theta", hf.get("rope_theta")),
            params,
            "rope_parameters",
        )
    else:
        theta, scaling, where = hf.get("rope_theta"), hf.get("rope_scaling"), "rope_scaling"
    theta = 10000.0 if theta is None else float(theta)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:  # below 1: RoPE on only part of each head
        raise CheckpointError(f"partial_rotary_factor={partial}: only full rotary is supported")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(
            f"{where} rope_type={rope_type!r}: only 'default' and 'llama3' RoPE are supported"
        )
    return theta, llama3_scaling(scaling, where)


# Llama 3.1's values: what a ``llama3`` scaling means when a field is left out.
LLAMA31_SCALING = Llama3RopeScaling()


def llama3_scaling(scaling: Mapping[str, Any], where: str) -> Llama3RopeScaling:
    """The ``llama3`` fields; a field that is absent (or null) takes Llama 3.1's value."""

    def field(name: str) -> Any:
        value = scaling.get(name)
        return getattr(LLAMA31_SCALING, name) if value is None else value

    try:
        return Llama3RopeScaling(
            factor=float(field("factor")),
            low_freq_factor=float(field("low_freq_factor")),
            high_freq_factor=float(field("high_freq_factor")),
            original_max_position_embeddings=int(field("original_max_position_embeddings")),
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """A ``ModelConfig`` from a ``config.json`` dict, plus ``overrides`` (``block_size``,
    ``total_blocks``, ``dtype``, ``device``, ...). ``seed`` is None: the weights come from the
    checkpoint. The default dtype is float32, whatever the checkpoint stores (``dtype`` /
    ``torch_dtype`` say how the files are stored, not how to compute); ``dtype="auto"`` asks
    for the stored one, as in Hugging Face.

    A problem of the checkpoint is a ``CheckpointError`` that names ``config.json``; a bad
    override is a ``ValueError`` (or ``TypeError``) that names the argument, since the
    checkpoint is not at fault.
    """
    _refuse_unsupported(hf)
    missing = [key for key in REQUIRED_FIELDS if hf.get(key) is None]
    if missing:
        raise CheckpointError(f"{CONFIG_FILE} lacks {', '.join(missing)}")
    fields: dict[str, Any] = {ours: int(hf[theirs]) for theirs, ours in REQUIRED_FIELDS.items()}
    fields["num_kv_heads"] = hf.get("num_key_value_heads")  # absent or null: num_heads
    fields["head_dim"] = hf.get("head_dim")  # absent or null: hidden_size // heads
    # Absent means untied: transformers' LlamaConfig defaults to tie_word_embeddings=False.
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    fields["rope_theta"], fields["rope_scaling"] = _rope_fields(hf)
    fields["rms_norm_eps"] = float(hf.get("rms_norm_eps", 1e-6))
    fields["seed"] = None
    # The positions the model was trained on: a longer request is refused (max_model_len=
    # raises it, at the user's risk, as vLLM's --max-model-len does).
    fields["max_model_len"] = fields["max_position_embeddings"] = hf.get("max_position_embeddings")
    try:
        cfg = ModelConfig(**fields)
    except ValueError as exc:
        raise CheckpointError(f"{CONFIG_FILE}: {exc}") from exc
    return apply_overrides(cfg, hf, overrides)


def apply_overrides(
    cfg: ModelConfig, hf: Mapping[str, Any], overrides: dict[str, Any]
) -> ModelConfig:
    """``cfg`` with the caller's ``overrides``; an error names the argument that caused it."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(
            f"unknown argument {unknown[0]}={overrides[unknown[0]]!r}: the overrides are "
            f"ModelConfig fields ({', '.join(sorted(known))})"
        )
    overrides = dict(overrides)
    if overrides.get("dtype") == "auto":
        overrides["dtype"] = stored_dtype(hf)
    try:
        return cfg.replace(**overrides)
    except ValueError as exc:
        if any(str(exc).startswith(f"{name}=") for name in overrides):
            raise ValueError(str(exc)) from None  # it names the argument already
        named = [name for name in overrides if name in str(exc)] or list(overrides)
        given = ", ".join(f"{name}={overrides[name]!r}" for name in named)
        raise ValueError(f"{given}: {exc}") from None


def stored_dtype(hf: Mapping[str, Any]) -> torch.dtype:
    """The dtype the checkpoint's files are stored in (``dtype``, or ``torch_dtype`` in older
    configs); float32 when the config does not say."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    try:
        return parse_dtype(name, "the stored dtype")
    except ValueError as exc:
        raise CheckpointError(f"{CONFIG_FILE}: {exc}") from None


def checkpoint_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint directory, without reading any weights."""
    return Checkpoint.open(path).model_config(**overrides)


def eos_token_ids(path: str | Path) -> list[int]:
    """``Checkpoint.eos_token_ids``: the ids that end a generation."""
    return Checkpoint.open(path).eos_token_ids


def max_position_embeddings(path: str | Path) -> int | None:
    """``config.json``'s ``max_position_embeddings`` (None when absent), read without building
    a config: ``ModelConfig.max_position_embeddings`` holds the same, and ``max_model_len``
    starts from it."""
    value = Checkpoint.open(path).hf.get("max_position_embeddings")
    return int(value) if value is not None else None


# ---- *.safetensors --------------------------------------------------------------------------


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: the shards named by ``model.safetensors.index.json``, else
    ``model.safetensors``, else every ``*.safetensors`` in the directory."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [p.name for p in shards if not p.is_file()]
        if absent:
            raise CheckpointError(f"{SAFETENSORS_INDEX} names missing shards: {absent}")
        return shards
    if (folder / SAFETENSORS_FILE).is_file():
        return [folder / SAFETENSORS_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder} has no *.safetensors (pytorch_model.bin checkpoints are not read: "
            "they are pickles; convert them with save_pretrained(..., safe_serialization=True))"
        )
    return files


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every weight file, as stored (dtype unchanged; cast at load)."""
    load_file = require_safetensors().load_file
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        try:
            tensors = load_file(str(file))
        except Exception as exc:  # safetensors' own error type: a truncated or foreign file
            raise CheckpointError(unreadable(file, exc)) from None
        for name, tensor in tensors.items():
            if name in weights:
                raise CheckpointError(f"tensor {name} is stored twice ({file.name} and another)")
            weights[name] = tensor
    return weights


def unreadable(file: Path, exc: Exception) -> str:
    """Why a weight file cannot be read, and what to do: most often a download cut short."""
    return (
        f"{file} cannot be read as safetensors ({exc}): the file is damaged or incomplete, "
        "often a download cut short; fetch it again"
    )


def check_stored_shapes(path: str | Path, cfg: ModelConfig) -> None:
    """``Checkpoint.check_shapes``: the weights' names and shapes against ``cfg``."""
    Checkpoint.open(path).check_shapes(cfg)


def derived(name: str) -> bool:
    """A tensor some checkpoints store that is computed from the config instead:
    ``rotary_emb.inv_freq``, from θ (older conversions saved it as a buffer)."""
    return name.endswith("rotary_emb.inv_freq")


def _drop_redundant(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Remove tensors that some checkpoints store but that carry no information: the
    ``derived`` ones, and a tied checkpoint's ``lm_head.weight``, accepted only when it is the
    embedding matrix itself, since the tied model would ignore anything else."""
    for name in [n for n in weights if derived(n)]:
        del weights[name]
    if cfg.tie_word_embeddings and "lm_head.weight" in weights:
        embedding = weights.get("model.embed_tokens.weight")
        if embedding is None or not torch.equal(weights["lm_head.weight"], embedding):
            raise CheckpointError(
                "tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight: the checkpoint is not tied"
            )
        del weights["lm_head.weight"]


def load_checkpoint(
    path: str | Path, **overrides: Any
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``(cfg, weights)`` from a local checkpoint directory (``Checkpoint.read_weights``)."""
    checkpoint = Checkpoint.open(path)
    cfg = checkpoint.model_config(**overrides)
    return cfg, checkpoint.read_weights(cfg)


def read_weights(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``Checkpoint.read_weights``: the weights for a model of ``cfg``, checked and cast."""
    return Checkpoint.open(path).read_weights(cfg)
