"""Checkpoints: a folder with config.json, model.safetensors and the tokenizer files.

Loading is strict (every key present, no extra key, every shape equal; errors name the key)
and never unpickles. An official MolmoBot folder (config.yaml + model.pt) is converted once
into a cache folder (convert.py). Random-weight models are built directly on the target device
in the target dtype, so the 4B preset never exists in fp32 on the host.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig, get_preset
from .policy import VLAPolicy

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TINY_TOKENIZER = Path(__file__).parent / "assets" / "tiny_tokenizer"  # the tiny preset's vocabulary
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    pass


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> VLAPolicy:
    """An inference-mode model allocated on `device` in `dtype` (normalisation statistics stay fp32)."""
    with torch.device(device), _default_dtype(dtype):
        model = VLAPolicy(cfg)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random_(model: VLAPolicy, seed: int = 0) -> VLAPolicy:
    """Deterministic random weights, generated on the model's device in its dtype, one tensor
    at a time (seeded by the tensor's name, so the result does not depend on module order).

    Variance-preserving scales (matrices 1/sqrt(fan_in), embeddings O(1)) keep activations O(1)
    through every stage, so images, instruction and state all move the actions: deviations
    measured on random weights then mean something."""
    for name, p in model.named_parameters():
        device = p.device
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        noise = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype)
        if "norm" in name and name.endswith("weight"):
            noise = 1 + 0.02 * noise                   # norm gains near one
        elif p.dim() >= 2 and name.endswith("weight") and name != "llm.embed.weight":
            noise = noise * p[0].numel() ** -0.5       # linear / conv: 1 / sqrt(fan_in)
        elif p.dim() == 1:
            noise = 0.02 * noise                       # biases
        else:
            noise = 0.5 * noise                        # token and position embeddings
        p.copy_(noise)
    return model


def _check_not_pickle(path: Path) -> None:
    if path.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: pickle checkpoints are not loaded (unpickling can run code); "
                              f"convert it to safetensors")
    with open(path, "rb") as f:
        head = f.read(9)
    # safetensors: an 8-byte little-endian header length, then the JSON header. Checked first: a
    # header length can begin with any byte, including pickle's 0x80.
    if len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < path.stat().st_size:
        return
    if head[:1] == b"\x80" or head[:2] == b"PK":
        raise CheckpointError(f"{path}: this is a pickle / torch.save file, not safetensors; "
                              f"only safetensors checkpoints are loaded")
    raise CheckpointError(f"{path}: not a safetensors file (bad header)")


def _weights_path(folder: Path) -> Path:
    if folder.is_file():
        return folder
    path = folder / WEIGHTS_FILE
    if not path.exists():
        pickles = sorted(p.name for p in folder.glob("*") if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(f"{folder} holds only pickle weights {pickles}; only safetensors are loaded")
        raise CheckpointError(f"no {WEIGHTS_FILE} in {folder}")
    return path


def read_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in {folder}")
    return ModelConfig.from_dict(json.loads(path.read_text()))


@torch.no_grad()
def load_weights_(model: VLAPolicy, path: str | Path) -> VLAPolicy:
    """Copy a safetensors file into `model`, strictly: same keys, same shapes."""
    path = Path(path)
    _check_not_pickle(path)
    expected = model.state_dict()
    device = next(model.parameters()).device
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        keys = set(f.keys())
        missing = sorted(set(expected) - keys)
        if missing:
            raise CheckpointError(f"{path}: missing key {missing[0]!r}"
                                  + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        unexpected = sorted(keys - set(expected))
        if unexpected:
            raise CheckpointError(f"{path}: unexpected key {unexpected[0]!r}"
                                  + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
        for key, target in expected.items():
            shape = tuple(f.get_slice(key).get_shape())
            if shape != tuple(target.shape):
                raise CheckpointError(f"{path}: key {key!r} has shape {shape}, the model expects {tuple(target.shape)}")
        for key, target in expected.items():
            target.copy_(f.get_tensor(key))
    robot = model.cfg.robot
    for name, stats, mode in (("action", model.action_stats, robot.action_norm),
                              ("state", model.state_stats, robot.state_norm)):
        spread = stats[1] if mode == "mean_std" else stats[1] - stats[0]
        if not bool((spread > 0).all()) or not bool(torch.isfinite(stats).all()):
            raise CheckpointError(f"{path}: {name} statistics ({mode}) need a positive, finite spread in every "
                                  "dimension")
    return model


def load_checkpoint(folder: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> VLAPolicy:
    """A project checkpoint folder (or its model.safetensors); see `resolve_checkpoint` for official folders."""
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    weights = _weights_path(folder)
    cfg = read_config(weights.parent)
    return load_weights_(build_model(cfg, device, dtype), weights)


def save_checkpoint(model: VLAPolicy, folder: str | Path, tokenizer_dir: str | Path | None = TINY_TOKENIZER) -> Path:
    """Writes config.json, model.safetensors (the model's own keys, whatever runtime wrappers or
    fused views sit on it) and a copy of the tokenizer files."""
    return save_tensors(model.state_dict(), model.cfg, folder, tokenizer_dir)


def save_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, folder: str | Path,
                 tokenizer_dir: str | Path | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # clone(): fused projections make the separate weights views of one buffer, which
    # safetensors refuses as shared memory.
    tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt", "model": cfg.name})
    (folder / CONFIG_FILE).write_text(cfg.to_json() + "\n")
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                shutil.copy(f, folder / f.name)
    return folder


def create_random_checkpoint(preset: str, folder: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                             device: str = "cpu") -> Path:
    """A random-weight checkpoint of any preset, built in `dtype` (bf16 by default) directly."""
    model = init_random_(build_model(get_preset(preset), device, dtype), seed)
    return save_checkpoint(model, folder)
