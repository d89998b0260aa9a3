"""HuggingFace GPT-2 (``GPT2LMHeadModel``) import and export, without importing transformers.

Name map (HF keys may or may not carry the ``transformer.`` prefix)::

    transformer.wte.weight             embedding.word_embeddings.weight  (+ zero padding rows)
    transformer.wpe.weight             embedding.position_embeddings.weight
    transformer.h.{i}.ln_1.*           layers.{i}.input_layernorm.*
    transformer.h.{i}.attn.c_attn.*    layers.{i}.self_attention.query_key_value.*
    transformer.h.{i}.attn.c_proj.*    layers.{i}.self_attention.dense.*
    transformer.h.{i}.ln_2.*           layers.{i}.post_attention_layernorm.*
    transformer.h.{i}.mlp.c_fc.*       layers.{i}.mlp.dense_h_to_4h.*
    transformer.h.{i}.mlp.c_proj.*     layers.{i}.mlp.dense_4h_to_h.*
    transformer.ln_f.*                 final_layernorm.*
    lm_head.weight                     (tied to wte: checked on import, omitted on export)

HF's ``Conv1D`` stores weights as ``[in, out]`` (transposed ``nn.Linear``), and ``c_attn`` orders
its output rows ``[(q, k, v), heads, head_dim]`` where ours are ``[heads, (q, k, v), head_dim]``.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch

from zerotron.checkpoint.state import refuse_non_finite
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError
from zerotron.fileio import (
    atomic_write_text,
    check_free_space,
    commit,
    disk_full_is_clear,
    temp_path,
)
from zerotron.models.gpt import GPTConfig

# Per-layer modules: ours -> HF (under h.{i}.), and whether the weight is a Conv1D.
_LAYER_MAP = {
    "input_layernorm": ("ln_1", False),
    "self_attention.query_key_value": ("attn.c_attn", True),
    "self_attention.dense": ("attn.c_proj", True),
    "post_attention_layernorm": ("ln_2", False),
    "mlp.dense_h_to_4h": ("mlp.c_fc", True),
    "mlp.dense_4h_to_h": ("mlp.c_proj", True),
}
# Buffers that older transformers versions saved with the weights; not parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # the same function, two names

StateDict = dict[str, torch.Tensor]


def gpt_config_from_hf(hf_config: Mapping, padded_vocab_size: int | None = None) -> GPTConfig:
    """Our config for an HF ``GPT2Config`` dict (``config.json``); refuses variants we lack."""

    def unsupported(key: str, fix: str) -> UnsupportedError:
        return UnsupportedError(
            f"HF GPT-2 option {key}={hf_config.get(key)!r} is not supported",
            where=f"config.json:{key}",
            fix=fix,
        )

    if hf_config.get("model_type", "gpt2") != "gpt2":
        raise unsupported("model_type", "only GPT-2 (GPT2LMHeadModel) checkpoints can be imported")
    if hf_config.get("activation_function", "gelu_new") not in _TANH_GELUS:
        raise unsupported("activation_function", "GPT-2 uses gelu_new (GELU, tanh approximation)")
    for key, expected in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
        ("tie_word_embeddings", True),
    ):
        if hf_config.get(key, expected) != expected:
            raise unsupported(key, f"only {key}={expected} (the GPT-2 default) is supported")
    try:
        vocab = int(hf_config["vocab_size"])
        positions = int(hf_config.get("n_positions", hf_config.get("n_ctx", 1024)))
        return GPTConfig(
            num_layers=int(hf_config["n_layer"]),
            hidden_size=int(hf_config["n_embd"]),
            num_attention_heads=int(hf_config["n_head"]),
            ffn_hidden_size=hf_config.get("n_inner"),
            seq_length=positions,
            max_position_embeddings=positions,
            vocab_size=padded_vocab_size or vocab,
            orig_vocab_size=vocab,
            layernorm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-5)),
            init_method_std=float(hf_config.get("initializer_range", 0.02)),
            hidden_dropout=float(hf_config.get("resid_pdrop", 0.1)),
            attention_dropout=float(hf_config.get("attn_pdrop", 0.1)),
        )
    except KeyError as e:
        raise CheckpointError(
            f"HF config lacks {e.args[0]!r}", where="config.json", fix="is this a GPT-2 config?"
        ) from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"HF config has a value of the wrong type: {e}",
            where="config.json",
            fix="correct config.json (n_layer, n_embd, n_head... are integers)",
        ) from None
    except ConfigError as e:
        raise CheckpointError(f"HF config does not describe a usable model: {e}") from e


def hf_config_from_gpt_config(config: GPTConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of a ``GPT2LMHeadModel`` with our model's shape."""
    if not config.bias:
        raise UnsupportedError(
            "HF GPT-2 always has biases; this model was built with bias=False",
            where="model config: bias",
            fix="only models with biases can be exported to GPT2LMHeadModel",
        )
    ffn = config.ffn_hidden_size
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.orig_vocab_size,
        "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": None if ffn == 4 * config.hidden_size else ffn,
        "activation_function": "gelu_new",
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": True,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _qkv_hf_to_ours(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [(q, k, v), heads, d] -> [heads, (q, k, v), d] (dim 0; weight already [out, in])."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()


def _qkv_ours_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()


def from_hf_state_dict(
    hf_sd: Mapping[str, torch.Tensor], hf_config: Mapping, padded_vocab_size: int | None = None
) -> tuple[GPTConfig, StateDict]:
    """Convert a ``GPT2LMHeadModel`` state dict; the word embedding gets zero padding rows."""
    config = gpt_config_from_hf(hf_config, padded_vocab_size)
    prefix = "transformer." if any(k.startswith("transformer.") for k in hf_sd) else ""
    remaining = {k for k in hf_sd if not k.endswith(_IGNORED_SUFFIXES)}

    def take(name: str) -> torch.Tensor:
        key = prefix + name
        if key not in hf_sd:
            raise CheckpointError(
                f"HF state dict lacks {key!r}",
                fix="is this a complete GPT2LMHeadModel checkpoint matching its config.json?",
            )
        remaining.discard(key)
        return hf_sd[key]

    wte = take("wte.weight")
    vocab, hidden = config.orig_vocab_size, config.hidden_size
    if tuple(wte.shape) != (vocab, hidden):
        raise CheckpointError(
            f"wte.weight has shape {tuple(wte.shape)}, config.json says ({vocab}, {hidden})"
        )
    word = wte.new_zeros(config.vocab_size, hidden)
    word[:vocab] = wte
    lm_head = hf_sd.get("lm_head.weight")
    if lm_head is not None:
        remaining.discard("lm_head.weight")
        if not torch.equal(lm_head, wte):
            raise UnsupportedError(
                "lm_head.weight differs from transformer.wte.weight (untied output layer)",
                fix="zerotron's GPT ties the input and output embeddings",
            )
    sd: StateDict = {
        "embedding.word_embeddings.weight": word,
        "embedding.position_embeddings.weight": take("wpe.weight"),
    }
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        for ours, (theirs, conv1d) in _LAYER_MAP.items():
            w = take(f"h.{i}.{theirs}.weight")
            b = take(f"h.{i}.{theirs}.bias")
            if conv1d:
                w = w.t()
            if ours.endswith("query_key_value"):
                w, b = _qkv_hf_to_ours(w, heads), _qkv_hf_to_ours(b, heads)
            sd[f"layers.{i}.{ours}.weight"] = w.contiguous()
            sd[f"layers.{i}.{ours}.bias"] = b
    sd["final_layernorm.weight"] = take("ln_f.weight")
    sd["final_layernorm.bias"] = take("ln_f.bias")
    if remaining:
        raise CheckpointError(
            f"HF state dict has tensors a GPT-2 of this config does not: {sorted(remaining)[:8]}",
            fix="check n_layer in config.json; other architectures are not supported",
        )
    return config, sd


def to_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: GPTConfig
) -> tuple[StateDict, dict]:
    """Convert our state dict to ``GPT2LMHeadModel``'s (padding rows dropped, lm_head tied)."""
    word = state_dict["embedding.word_embeddings.weight"]
    hf_config = hf_config_from_gpt_config(config, word.dtype)
    hf_sd: StateDict = {
        "transformer.wte.weight": word[: config.orig_vocab_size].clone(),
        "transformer.wpe.weight": state_dict["embedding.position_embeddings.weight"],
    }
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        for ours, (theirs, conv1d) in _LAYER_MAP.items():
            w = state_dict[f"layers.{i}.{ours}.weight"]
            b = state_dict[f"layers.{i}.{ours}.bias"]
            if ours.endswith("query_key_value"):
                w, b = _qkv_ours_to_hf(w, heads), _qkv_ours_to_hf(b, heads)
            hf_sd[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if conv1d else w
            hf_sd[f"transformer.h.{i}.{theirs}.bias"] = b
    hf_sd["transformer.ln_f.weight"] = state_dict["final_layernorm.weight"]
    hf_sd["transformer.ln_f.bias"] = state_dict["final_layernorm.bias"]
    return hf_sd, hf_config


def load_hf_dir(path: str | os.PathLike) -> tuple[StateDict, dict]:
    """Read an HF model directory: ``config.json`` and the weights (safetensors preferred).

    Accepts ``model.safetensors``, ``pytorch_model.bin`` (loaded with ``weights_only=True``) and
    their sharded ``*.index.json`` forms. Returns ``(state_dict, config_dict)``.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            "not a directory" if path.exists() else "no such directory",
            where=str(path),
            fix="point --from-hf to a HuggingFace model directory (config.json and weights)",
        )
    hf_config = _read_json(path / "config.json", "config.json")
    if not isinstance(hf_config.get("vocab_size"), int):
        raise CheckpointError(
            f"config.json has no integer vocab_size (got {hf_config.get('vocab_size')!r})",
            where=str(path / "config.json"),
            fix="is this a GPT-2 config.json?",
        )
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return _load_weights(path / name), hf_config
        index = path / f"{name}.index.json"
        if index.is_file():
            sd: StateDict = {}
            for shard in _shards(path, index):
                sd.update(_load_weights(shard))
            return sd, hf_config
    raise CheckpointError(
        "no weights found",
        where=str(path),
        fix="expected model.safetensors or pytorch_model.bin (or their .index.json shards)",
    )


def _read_json(file: Path, name: str) -> dict:
    """A JSON object from ``file``, or a CheckpointError saying what is wrong with it."""
    if not file.is_file():
        raise CheckpointError(
            f"no {name}", where=str(file.parent), fix="point to a HuggingFace model directory"
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"{name} is not valid JSON: {str(e)[:200]}",
            where=str(file),
            fix="restore the file (download it again)",
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{name} is not a JSON object", where=str(file))
    return data


def _shards(path: Path, index: Path) -> list[Path]:
    """The shard files an ``*.index.json`` names: inside ``path``, each present.

    A shard path leading outside the model directory (``../x``, ``/etc/x``, a symlink out) is
    refused: a downloaded index must not make the loader read arbitrary files.
    """
    weight_map = _read_json(index, index.name).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            "weight_map is missing or not an object of tensor -> shard file names",
            where=str(index),
            fix="restore the index file (download it again)",
        )
    root = path.resolve()
    shards = []
    for name in sorted(set(weight_map.values())):
        shard = (path / name).resolve()
        if not shard.is_relative_to(root) or shard == root:
            raise CheckpointError(
                f"shard {name!r} lies outside the model directory",
                where=str(index),
                fix="a shard must be a file inside the model directory; this index is broken "
                "or malicious",
            )
        shards.append(path / name)
    return shards


def _load_weights(file: Path) -> StateDict:
    if not file.is_file():
        raise CheckpointError(
            "weights file is missing",
            where=str(file),
            fix="download the missing shard, or the whole model again",
        )
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(file, device="cpu")
        else:
            sd = torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointError(
            f"cannot read the weights file ({type(e).__name__}: {first})",
            where=str(file),
            fix="the file is truncated, corrupt or not of its kind: download it again",
        ) from None
    except Exception as e:  # safetensors raises its own SafetensorError
        if type(e).__name__ != "SafetensorError":
            raise
        raise CheckpointError(
            f"cannot read the weights file (safetensors: {str(e)[:200]})",
            where=str(file),
            fix="the file is truncated or corrupt: download it again",
        ) from None
    if not isinstance(sd, dict):
        raise CheckpointError(
            f"the weights file holds a {type(sd).__name__}, not a state dict", where=str(file)
        )
    refuse_non_finite(sd, str(file))
    return sd


def save_hf_dir(
    path: str | os.PathLike, hf_sd: Mapping[str, torch.Tensor], hf_config: dict
) -> None:
    """Write ``model.safetensors`` and then ``config.json`` into ``path``, each atomically.

    Other files in ``path`` (a tokenizer, say) are left alone.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = path / "model.safetensors"
    tmp = temp_path(weights)
    needed = sum(v.numel() * v.element_size() for v in hf_sd.values())
    check_free_space(path, needed, "model.safetensors")
    try:
        with disk_full_is_clear(weights):
            tensors = {k: v.detach().contiguous() for k, v in hf_sd.items()}
            save_file(tensors, tmp, metadata={"format": "pt"})
            commit(tmp, weights)
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write_text(path / "config.json", json.dumps(hf_config, indent=2) + "\n")
