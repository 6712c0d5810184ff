"""Official MolmoBot checkpoints -> project checkpoints.

An official folder holds `config.yaml` (the training config; its `model` section describes the
network, the prompt layout and the robot statistics) and the weights: `model.pt` (a state dict
saved with torch.save, read with `torch.load(weights_only=True)`: nothing in it can run) or the
sharded `model_and_optim/` form (torch.distributed.checkpoint: its `.metadata` is a pickle, read
here with an unpickler that builds only the checkpoint's own metadata records). Every value of the
project config comes from config.yaml; settings this implementation does not reproduce are refused
by name. The tokenizer is the LLM's (a hub id in config.yaml): it must be a local folder or in the
local Hugging Face cache; the image special tokens are added as the official code adds them.

Official deployment settings that config.yaml does not hold (the control rate of the training data
and the real-robot post-processing) come from `deployment` (defaults: the official DROID setup).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .config import DROID_ROBOT, ActionExpertConfig, LLMConfig, ModelConfig, PromptConfig, RobotConfig, VisionConfig
from .tokenizer import extend_tokenizer
from .weights import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, build_model, save_tensors

OFFICIAL_CONFIG = "config.yaml"
OFFICIAL_WEIGHTS = "model.pt"
OFFICIAL_SHARDED = "model_and_optim"
UNUSED_KEYS = ("transformer.ln_f.weight", "transformer.ff_out.weight")  # the LM head: the policy reads hidden states
CACHE_ENV = "VLA_NODE_CACHE"


def is_official(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / OFFICIAL_CONFIG).is_file() and not (folder / CONFIG_FILE).is_file()


class Refused(CheckpointError):
    pass


def _need(section: str, cfg: dict, key: str, allowed) -> Any:
    value = cfg.get(key)
    ok = value in allowed if isinstance(allowed, (tuple, list, set)) else value == allowed
    if not ok:
        raise Refused(f"config.yaml: {section}.{key}={value!r} is not supported (supported: {allowed!r})")
    return value


def read_official_config(folder: str | Path) -> dict:
    import yaml

    path = Path(folder) / OFFICIAL_CONFIG
    if not path.is_file():
        raise CheckpointError(f"no {OFFICIAL_CONFIG} in {folder}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a MolmoBot config")
    model = data.get("model", data)
    if model.get("model_name") not in ("molmobot", None) or "action_expert" not in model:
        raise CheckpointError(f"{path}: not a MolmoBot config (model_name={model.get('model_name')!r}, "
                              f"no action_expert section)" if "action_expert" not in model else
                              f"{path}: model_name={model.get('model_name')!r} is not molmobot")
    return model


def _instruction_prefix(fmt: dict) -> str:
    """The system-prompt prefix the official formatter gives the 'demo' style."""
    prompt = fmt.get("system_prompt")
    if prompt in ("demo_or_style_v2", "style"):
        return "demo: "
    if prompt in ("demo_or_style", "none", None):
        return ""
    raise Refused(f"config.yaml: data_formatter.system_prompt={prompt!r} is not supported "
                  f"(supported: demo_or_style_v2, style, demo_or_style, none)")


def _stats(section: dict, repo: str, key_names: list[str], mode: str) -> list[list[float]]:
    """[2][dim] statistics of one feature for the normalisation mode, found as the official code finds them."""
    by_repo = section.get("stats_by_repo") or {}
    stats = by_repo.get(repo)
    if stats is None:
        stats = by_repo.get(section.get("default_repo_id"))
    if stats is None and len(by_repo) == 1:
        stats = next(iter(by_repo.values()))
    if stats is None:
        raise CheckpointError(f"config.yaml: no normalisation statistics for repo {repo!r} (have {sorted(by_repo)})")
    feature = None
    for name in key_names:  # the official code keeps the last state key present
        feature = stats.get(name, feature)
    names = {"min_max": ("min", "max"), "quantiles": ("q01", "q99"), "quantile10": ("q10", "q90"),
             "mean_std": ("mean", "std")}.get(mode)
    if names is None:
        raise Refused(f"config.yaml: normalisation mode {mode!r} is not supported")
    if feature is None or any(n not in feature for n in names):
        raise CheckpointError(f"config.yaml: statistics {key_names} lack {names} for mode {mode!r}")
    return [list(map(float, feature[n])) for n in names]


def _check_supported(m: dict, fmt: dict, image: dict) -> None:
    """Refused for an official `model` section whose architecture this project does not implement."""
    llm, vb = m["llm"], m["vision_backbone"]
    vit = vb["vit"]
    for key, allowed in (("block_type", "sequential"), ("activation_type", "swiglu"), ("layer_norm_type", "rms"),
                         ("attention_layer_norm", True), ("attention_layer_norm_type", "qwen3"), ("rope", True),
                         ("rope_type", "default"), ("include_bias", False), ("qkv_bias", False), ("clip_qkv", None),
                         ("norm_after", False), ("normalize_input_embeds", False), ("layer_norm_with_affine", True),
                         ("attention_layer_norm_with_affine", True)):
        _need("llm", llm, key, allowed)
    for key, allowed in (("image_model_type", "siglip"), ("image_mlp_activations", "gelu_pytorch_tanh"),
                         ("resize_mode", "siglip"), ("normalize", "siglip")):
        _need("vision_backbone.vit", vit, key, allowed)
    for key, allowed in (("image_pooling_2d", "attention_meanq"), ("pooling_attention_mask", True),
                         ("image_projector", "mlp"), ("image_padding_embed", None), ("use_deepstack", False),
                         ("pool_size_embeds", None)):
        _need("vision_backbone", vb, key, allowed)
    _need("model", m, "action_expert_layer_mode", "per_layer")
    _need("model", m, "states_mode", "cross_attn")
    _need("model", m, "bi_directional_attn", (None, "image_tokens"))
    _need("data_formatter", fmt, "message_format", "qwen3")
    _need("data_formatter", fmt, "prompt_templates", ("uber_model_v2", "uber_model", "none"))
    _need("mm_preprocessor.image", image, "crop_mode", "resize")
    col_tokens = image.get("use_single_crop_col_tokens")
    if (image.get("use_col_tokens", True) if col_tokens is None else col_tokens):
        raise Refused("config.yaml: column tokens after each row of image patches (mm_preprocessor.image."
                      "use_single_crop_col_tokens) are not supported")


def _vision_config(vb: dict, image: dict) -> VisionConfig:
    """The ViT and its pooling, from the official vision_backbone and mm_preprocessor.image."""
    vit = vb["vit"]
    windows = {(image.get("pooling_w", 2), image.get("pooling_h", 2))}
    if image.get("max_images") is not None:
        windows.add((image.get("multi_image_pooling_w", 2), image.get("multi_image_pooling_h", 2)))
    if len(windows) != 1 or len({*next(iter(windows))}) != 1:
        raise Refused(f"config.yaml: image pooling windows {sorted(windows)} (w, h) must be one square window")
    size = vit["image_default_input_size"]
    if len(set(size)) != 1:
        raise Refused(f"config.yaml: non-square ViT input {size} is not supported")
    width, heads = vit["image_emb_dim"], vit["image_num_heads"]
    if (vit.get("image_num_key_value_heads", heads) != heads
            or vit.get("image_head_dim", width // heads) * heads != width):
        raise Refused("config.yaml: ViT with grouped or non-standard attention heads is not supported")
    layers = vit["image_num_layers"]
    vision = VisionConfig(image_size=size[0], patch_size=vit["image_patch_size"], width=width, heads=heads,
                          mlp=vit["image_mlp_dim"], layers=layers,
                          feature_layers=tuple(l if l >= 0 else layers + l for l in vb["vit_layers"]),
                          norm_eps=vit["image_norm_eps"], pool_window=next(iter(windows))[0])
    if vit.get("image_num_pos", vision.grid ** 2) != vision.grid ** 2:
        raise Refused(f"config.yaml: {vit['image_num_pos']} ViT positions for a {vision.grid}x{vision.grid} grid "
                      f"(position interpolation) is not supported")
    return vision


def model_config_from_official(m: dict, name: str, norm_repo: str = "synthmanip",
                               deployment: RobotConfig = DROID_ROBOT) -> tuple[ModelConfig, dict]:
    """The project config for an official `model` section, and the normalisation statistics
    ({"action": [2][A], "state": [2][S]})."""
    llm, vb = m["llm"], m["vision_backbone"]
    fmt = m.get("data_formatter") or {}
    image = (m.get("mm_preprocessor") or {}).get("image") or {}
    _check_supported(m, fmt, image)
    vision = _vision_config(vb, image)

    d_model, n_heads = llm["d_model"], llm["n_heads"]
    hidden = llm.get("mlp_hidden_size") or llm["mlp_ratio"] * d_model
    llm_cfg = LLMConfig(vocab_size=llm.get("embedding_size") or llm["vocab_size"],
                        extra_vocab=llm.get("additional_vocab_size") or 0, dim=d_model, layers=llm["n_layers"],
                        heads=n_heads, kv_heads=llm.get("n_kv_heads") or n_heads,
                        head_dim=llm.get("head_dim") or d_model // n_heads, mlp=hidden // 2,
                        norm_eps=llm["layer_norm_eps"], rope_theta=float(llm["rope_theta"]),
                        max_seq_len=llm.get("max_sequence_length") or 4096)

    ae = m["action_expert"]
    if ae["num_layers"] != llm_cfg.layers:
        raise CheckpointError(f"config.yaml: action expert depth {ae['num_layers']} != LLM layers {llm_cfg.layers}")
    pre = m.get("robot_preprocessor") or {}
    post = m.get("robot_postprocessor") or pre
    if not pre or not post:
        raise CheckpointError("config.yaml: no robot_preprocessor / robot_postprocessor statistics")
    action_mode, state_mode = post.get("action_norm_mode", "min_max"), pre.get("state_norm_mode", "min_max")
    stats = {"action": _stats(post, norm_repo, [post.get("action_key", "action")], action_mode),
             "state": _stats(pre, norm_repo, list(pre.get("state_keys") or ["observation.state"]), state_mode)}
    action_dim, horizon = m["action_dim"], m["action_horizon"]
    if len(stats["action"][0]) != action_dim:
        raise CheckpointError(f"config.yaml: action statistics have {len(stats['action'][0])} values, "
                              f"action_dim {action_dim}")
    hidden_size = ae["hidden_size"]
    action = ActionExpertConfig(width=hidden_size, heads=ae["num_heads"], mlp=int(hidden_size * ae["mlp_ratio"]),
                                action_dim=action_dim, state_dim=len(stats["state"][0]), horizon=horizon,
                                max_horizon=max(ae.get("max_horizon", horizon), horizon),
                                flow_steps=m.get("flow_matching_num_steps", 10),
                                time_embed_dim=ae["timestep_embed_dim"],
                                context_norm=ae.get("context_layer_norm", True))
    prompt = PromptConfig(max_images=image.get("max_images") or 1, single_frame=image.get("single_frame", True),
                          bidirectional_images=m.get("bi_directional_attn") == "image_tokens",
                          chat_template="<|im_start|>user\n" + _instruction_prefix(fmt)
                          + "{instruction}<|im_end|>\n<|im_start|>assistant\n")
    if any(d >= action_dim for d in deployment.gripper_dims) or len(deployment.max_joint_delta) > action_dim:
        deployment = RobotConfig()  # the DROID post-processing does not fit this robot's actions
    robot = dataclasses.replace(deployment, frames=m.get("n_obs_steps", 1), obs_step_delta=m.get("obs_step_delta", 8),
                                executed_steps=m.get("n_action_steps", 8), action_norm=action_mode,
                                state_norm=state_mode)
    cfg = ModelConfig(name=name, vision=vision, llm=llm_cfg, action=action, prompt=prompt, robot=robot,
                      projector_hidden=hidden // 2)
    return cfg, stats


class _Keys:
    """The official state dict being taken apart into this project's (`out`)."""

    def __init__(self, official: dict[str, torch.Tensor]):
        self.src = dict(official)
        self.out: dict[str, torch.Tensor] = {}

    def take(self, key: str) -> torch.Tensor:
        try:
            return self.src.pop(key)
        except KeyError:
            raise CheckpointError(f"official checkpoint lacks {key!r}") from None

    def linear(self, ours: str, theirs: str, bias: bool = True) -> None:
        self.out[f"{ours}.weight"] = self.take(f"{theirs}.weight")
        if bias:
            self.out[f"{ours}.bias"] = self.take(f"{theirs}.bias")

    def split(self, ours: list[str], theirs: str, sizes: list[int], bias: bool) -> None:
        for part in ("weight", "bias") if bias else ("weight",):
            for name, chunk in zip(ours, self.take(f"{theirs}.{part}").split(sizes)):
                self.out[f"{name}.{part}"] = chunk


def convert_state_dict(official: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Official keys -> this project's keys (fused projections split, embeddings joined). Every
    official key is used or named unused; anything else is an error naming the key."""
    keys = _Keys(official)
    _llm_keys(keys, cfg)
    _vision_keys(keys, cfg)
    _expert_keys(keys, cfg)
    src, vit = keys.src, "vision_backbone.image_vit"
    for key in UNUSED_KEYS:
        src.pop(key, None)
    for key in [k for k in src if k.startswith(f"{vit}.transformer.resblocks.")]:
        if int(key.split(".")[4]) >= cfg.vision.layers_run:  # layers past the deepest feature layer never run
            del src[key]
    if src:
        extra = sorted(src)
        raise CheckpointError(f"official checkpoint has key {extra[0]!r} this converter does not know"
                              + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))
    return keys.out


def _llm_keys(keys: _Keys, cfg: ModelConfig) -> None:
    llm, out, take, linear, split = cfg.llm, keys.out, keys.take, keys.linear, keys.split
    out["llm.embed.weight"] = torch.cat([take("transformer.wte.embedding"), take("transformer.wte.new_embedding")])
    q, kv = llm.heads * llm.head_dim, llm.kv_heads * llm.head_dim
    for i in range(llm.layers):
        o, t = f"llm.layers.{i}", f"transformer.blocks.{i}"
        split([f"{o}.attn.qkv.q", f"{o}.attn.qkv.k", f"{o}.attn.qkv.v"], f"{t}.att_proj", [q, kv, kv], bias=False)
        linear(f"{o}.attn.o", f"{t}.attn_out", bias=False)
        for ours, theirs in (("attn.q_norm", "q_norm"), ("attn.k_norm", "k_norm"), ("attn_norm", "attn_norm"),
                             ("mlp_norm", "ff_norm")):
            out[f"{o}.{ours}.weight"] = take(f"{t}.{theirs}.weight")
        # ff_proj holds [up; gate]: the official SwiGLU is silu(second half) * first half.
        split([f"{o}.mlp.gate_up.up", f"{o}.mlp.gate_up.gate"], f"{t}.ff_proj", [llm.mlp, llm.mlp], bias=False)
        linear(f"{o}.mlp.down", f"{t}.ff_out", bias=False)


def _vision_keys(keys: _Keys, cfg: ModelConfig) -> None:
    out, take, linear = keys.out, keys.take, keys.linear
    vit = "vision_backbone.image_vit"
    out["vision.encoder.pos_embed"] = take(f"{vit}.positional_embedding")
    linear("vision.encoder.patch_embed", f"{vit}.patch_embedding")
    for j in range(cfg.vision.layers_run):
        o, t = f"vision.encoder.blocks.{j}", f"{vit}.transformer.resblocks.{j}"
        for ours, theirs in (("attn.qkv.q", "attention.wq"), ("attn.qkv.k", "attention.wk"),
                             ("attn.qkv.v", "attention.wv"),
                             ("attn.out", "attention.wo"), ("fc1", "feed_forward.w1"), ("fc2", "feed_forward.w2"),
                             ("norm1", "attention_norm"), ("norm2", "ffn_norm")):
            linear(f"{o}.{ours}", f"{t}.{theirs}")
    pool = "vision_backbone.image_pooling_2d"
    for ours, theirs in (("q", "wq"), ("kv.k", "wk"), ("kv.v", "wv"), ("out", "wo")):
        linear(f"vision.pool.{ours}", f"{pool}.{theirs}")
    proj = "vision_backbone.image_projector"
    for ours, theirs in (("gate_up.gate", "w1"), ("gate_up.up", "w3"), ("down", "w2")):
        linear(f"vision.projector.{ours}", f"{proj}.{theirs}", bias=False)


def _expert_keys(keys: _Keys, cfg: ModelConfig) -> None:
    out, take, linear, split = keys.out, keys.take, keys.linear, keys.split
    ae, w = "action_expert", cfg.action.width
    out["expert.action_pos"] = take(f"{ae}.action_pos_embed")[0]
    for ours, theirs, bias in (("action_in", "action_embed", True), ("time_mlp.0", "time_embed.1", True),
                               ("time_mlp.2", "time_embed.3", True), ("ctx_proj", "context_proj", False),
                               ("state_enc", "state_encoder", True), ("action_out", "final_layer.linear", True),
                               ("final_ada", "final_layer.adaLN.1", True)):
        linear(f"expert.{ours}", f"{ae}.{theirs}", bias)
    for i in range(cfg.expert_depth):
        o, t = f"expert.blocks.{i}", f"{ae}.blocks.{i}"
        linear(f"{o}.self_qkv.q", f"{t}.attn1.q_proj")
        split([f"{o}.self_qkv.k", f"{o}.self_qkv.v"], f"{t}.attn1.kv_proj", [w, w], bias=True)
        linear(f"{o}.self_out", f"{t}.attn1.proj")
        linear(f"{o}.cross_q", f"{t}.attn2.q_proj")
        split([f"{o}.cross_kv.k", f"{o}.cross_kv.v"], f"{t}.attn2.kv_proj", [w, w], bias=True)
        linear(f"{o}.cross_out", f"{t}.attn2.proj")
        linear(f"{o}.fc1", f"{t}.mlp.fc1")
        linear(f"{o}.fc2", f"{t}.mlp.fc2")
        linear(f"{o}.ada", f"{t}.adaLN_modulation.1")


# -- reading the official weights ----------------------------------------------------------------
def _load_model_pt(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # weights_only refuses anything but tensors and plain containers
        raise CheckpointError(f"{path}: not a plain state dict that loads with torch.load(weights_only=True): "
                              f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors (a model state dict)")
    return state


_DCP_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.sharded_tensor.metadata")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only torch.distributed.checkpoint's metadata records, torch sizes/dtypes/layouts and
    paths: a checkpoint's .metadata cannot make it call anything else."""

    def find_class(self, module: str, name: str):
        if module.startswith(_DCP_MODULES) and not name.startswith("__"):
            return super().find_class(module, name)
        if (module, name) in (("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"sharded checkpoint metadata refers to {module}.{name}, which is not a "
                              f"checkpoint record; refusing to load it")


def _load_sharded(folder: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a torch.distributed.checkpoint folder, chunks assembled."""
    with open(folder / ".metadata", "rb") as f:
        meta = _MetadataUnpickler(f).load()
    chunks: dict[str, list] = {}
    for index, info in meta.storage_data.items():
        if not index.fqn.startswith("model."):
            continue
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{folder}: {index.fqn} is stored transformed {info.transform_descriptors}; "
                                  "not supported")
        chunks.setdefault(index.fqn, []).append((index.offset, info))
    state = {}
    for fqn, parts in chunks.items():
        md = meta.state_dict_metadata[fqn]
        if not hasattr(md, "chunks"):
            raise CheckpointError(f"{folder}: {fqn} is not a tensor")
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for offset, info in parts:
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                chunk = torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True)
            full[tuple(slice(o, o + s) for o, s in zip(offset, chunk.shape))].copy_(chunk)
        state[fqn[len("model."):]] = full
    return state


def load_official_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    if (folder / OFFICIAL_WEIGHTS).is_file():
        return _load_model_pt(folder / OFFICIAL_WEIGHTS)
    if (folder / OFFICIAL_SHARDED / ".metadata").is_file():
        return _load_sharded(folder / OFFICIAL_SHARDED)
    raise CheckpointError(f"{folder}: no {OFFICIAL_WEIGHTS} and no {OFFICIAL_SHARDED}/ (an official MolmoBot folder "
                          "has one)")


# -- the tokenizer ---------------------------------------------------------------------------------
def _tokenizer_source(official_dir: Path, m: dict, tokenizer: Optional[str | Path]) -> str:
    if tokenizer is not None:
        return str(tokenizer)
    ident = ((m.get("llm") or {}).get("tokenizer") or {}).get("identifier")
    if not ident:
        raise CheckpointError("config.yaml names no tokenizer (llm.tokenizer.identifier); pass --tokenizer DIR")
    for base in (Path.cwd(), official_dir, official_dir.parent):  # a local folder, as the config names it
        if (base / ident / "tokenizer_config.json").is_file() or (base / ident / "tokenizer.json").is_file():
            return str(base / ident)
    return ident  # a hub id: found only if it is already in the local Hugging Face cache


def convert(official_dir: str | Path, out_dir: str | Path, tokenizer: Optional[str | Path] = None,
            norm_repo: str = "synthmanip", deployment: RobotConfig = DROID_ROBOT,
            progress: Callable[[str], None] = lambda msg: None) -> Path:
    """Write a project checkpoint (config.json, model.safetensors, tokenizer) for an official folder."""
    official_dir, out_dir = Path(official_dir), Path(out_dir)
    m = read_official_config(official_dir)
    cfg, stats = model_config_from_official(m, name=official_dir.resolve().name, norm_repo=norm_repo,
                                            deployment=deployment)
    source = _tokenizer_source(official_dir, m, tokenizer)
    official = load_official_weights(official_dir)
    converted = convert_state_dict(official, cfg)
    dtype = converted["llm.embed.weight"].dtype
    model = build_model(cfg, device="meta", dtype=dtype)
    expected = {k: v for k, v in model.state_dict().items() if k not in ("action_stats", "state_stats")}
    for key, target in expected.items():
        if key not in converted:
            raise CheckpointError(f"conversion produced no {key!r}")
        if tuple(converted[key].shape) != tuple(target.shape):
            raise CheckpointError(f"official tensor for {key!r} has shape {tuple(converted[key].shape)}, "
                                  f"config.yaml implies {tuple(target.shape)}")
    converted["action_stats"] = torch.tensor(stats["action"], dtype=torch.float32)
    converted["state_stats"] = torch.tensor(stats["state"], dtype=torch.float32)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        extend_tokenizer(source, tmp, cfg.llm.vocab_size)
    except OSError as e:
        raise CheckpointError(f"tokenizer {source!r} is not available offline ({type(e).__name__}); download it "
                              f"into the Hugging Face cache or pass a local copy with --tokenizer DIR") from None
    save_tensors(converted, cfg, tmp)
    (tmp / "converted_from.json").write_text(json.dumps({"official": str(official_dir.resolve()),
                                                         "tokenizer": source, "norm_repo": norm_repo}, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    progress(f"converted official checkpoint {official_dir} -> {out_dir} ({len(converted)} tensors, {dtype})")
    return out_dir


def resolve_checkpoint(folder: str | Path, progress: Callable[[str], None] = lambda msg: None) -> Path:
    """A project checkpoint folder for `folder`: itself, or for an official folder its conversion
    in the cache ($VLA_NODE_CACHE or ~/.cache/vla_node), made once and reused while the official
    files are unchanged."""
    folder = Path(folder)
    if not is_official(folder):
        return folder
    h = hashlib.sha256((folder / OFFICIAL_CONFIG).read_bytes())
    for f in (folder / OFFICIAL_WEIGHTS, folder / OFFICIAL_SHARDED / ".metadata"):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vla_node") / "converted"
    out = cache / f"{folder.resolve().name}-{h.hexdigest()[:16]}"
    if (out / WEIGHTS_FILE).is_file():
        progress(f"using the conversion of official checkpoint {folder} cached in {out}")
        return out
    progress(f"converting official MolmoBot checkpoint {folder} into {out} (once)")
    return convert(folder, out, progress=progress)


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="vla-convert", description="Convert an official MolmoBot checkpoint folder "
                                "(config.yaml + model.pt or model_and_optim/) into a vla_node checkpoint.")
    p.add_argument("official_dir")
    p.add_argument("out_dir")
    p.add_argument("--tokenizer", help="local folder of the LLM's tokenizer (default: the id config.yaml names, "
                   "from a local folder or the local Hugging Face cache; nothing is downloaded)")
    p.add_argument("--norm-repo", default="synthmanip", help="which statistics of stats_by_repo to use "
                   "(the official inference wrapper's default: synthmanip)")
    p.add_argument("--control-rate-hz", type=float, default=DROID_ROBOT.control_rate_hz,
                   help="control rate of the training data (not in config.yaml; DROID: 15)")
    args = p.parse_args(argv)
    deployment = dataclasses.replace(DROID_ROBOT, control_rate_hz=args.control_rate_hz)
    try:
        convert(args.official_dir, args.out_dir, args.tokenizer, args.norm_repo, deployment, progress=print)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"vla-convert: {e}")
        return 1
    return 0
