"""vla-train: a MolmoBot-architecture policy trained with the official flow-matching objective
(vla_node/model/training.py) on rosbag2 episodes: the node's input topics plus the demonstrator's
commands, one bag per episode (what `vla-sim record` writes).

    vla-train --bags out/demos --preset sim --params config/sim.yaml --out out/sim_policy --steps 20000
    vla-train ... --resume            # continue from out/sim_policy/train_state (several GPU runs)
    vla-train ... --causal-images     # the official variant whose image tokens attend causally

Windows come from the bag reader the offline replay uses (tools/bag_io.ObservationStream, the
node's window picker), so the policy trains on exactly the observations the node will hand it,
an episode's start (no history yet) included. The target of a window stamped t is the chunk of
the next `horizon` commands after t; past the episode's end it is padded and masked, as in the
official dataset. Frames are resized once, as the engine resizes them (rounded to uint8), and
kept on the device. The output folder is a checkpoint (config.json, model.safetensors in bf16,
tokenizer) that every engine mode loads; train_state/ holds fp32 weights and optimizer moments
(safetensors) and the step, so a run continues where the last one stopped (`--time-budget-s`
stops it cleanly before a limit).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..model import (
    TINY_TOKENIZER,
    build_model,
    get_preset,
    init_random_,
    load_checkpoint,
    load_tokenizer,
    save_checkpoint,
)
from ..model.policy import VLAPolicy
from ..model.sequence import PromptBuilder
from ..model.training import FlowTimeSampler, flow_matching_loss
from ..model.weights import read_config
from ..runtime.preprocess import resize_u8
from ..runtime.types import WindowLayout
from .bag_io import DEMO_COMMAND_TOPIC, Bag, ObservationStream, resolve_inputs, stamp_ns

STATE_DIR = "train_state"
SAVE_MARGIN_S = 30  # the final validation, save and plot
FLOW_TIMES = FlowTimeSampler()


@dataclass
class Samples:
    """Training windows of one number of frame times (all share one prompt layout)."""
    rows: list[list[int]] = field(default_factory=list)     # frame-store rows in slot order
    states: list[np.ndarray] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)   # [horizon, A]
    pads: list[np.ndarray] = field(default_factory=list)      # [horizon] bool


@dataclass
class EpisodeWindows:
    # [F, 3, S, S] uint8 resized as the engine resizes, in an .npy the worker wrote: through the
    # pool's pipe an episode's 120 MB crawl (~0.2 GB/s), a file in the page cache does not.
    frames: Path
    windows: list[tuple[list[int], np.ndarray, np.ndarray, np.ndarray]]  # (rows into frames, state, actions, pad)


def read_episode(job: tuple) -> EpisodeWindows:
    """One bag -> its resized frames (written to frames_path) and training windows (runs in a
    worker process)."""
    path, frames_path, layout, offset_s, joint_names, topics, size, horizon, camera_rate_hz = job
    with Bag(path) as bag:
        inputs = resolve_inputs(bag, layout.cameras, topics)
        commands = []
        for _, msgtype, _, raw in bag.messages([DEMO_COMMAND_TOPIC]):
            msg = bag.deserialize(raw, msgtype, DEMO_COMMAND_TOPIC)
            index = {n: i for i, n in enumerate(msg.name)}
            positions = np.asarray(msg.position, np.float32)[[index[n] for n in joint_names]]
            commands.append((stamp_ns(msg.header.stamp), positions))
        if not commands:
            raise ValueError(f"{path}: no demonstrator commands on {DEMO_COMMAND_TOPIC}")
        stamps = np.array([c[0] for c in commands], np.int64)
        targets = np.stack([c[1] for c in commands])
        frames: list[np.ndarray] = []
        row_of: dict = {}
        windows = []
        stream = ObservationStream(bag, inputs, layout, offset_s, joint_names=joint_names,
                                   max_camera_rate_hz=camera_rate_hz)
        for query in stream:
            obs = query.observation
            rows = []
            for fid, image in zip(obs.frame_ids, obs.images):
                if fid not in row_of:
                    row_of[fid] = len(frames)
                    frames.append(resize_u8(torch.from_numpy(image)[None], size)[0].numpy())
                rows.append(row_of[fid])
            # The chunk of a window stamped at tick d holds the commands of ticks d+1 ... d+horizon
            # (the recorder stamps a command with the tick it takes effect; the node executes a
            # chunk's action i at tick d + 1 + i).
            first = int(np.searchsorted(stamps, query.stamp_ns, side="right"))
            chunk = targets[first:first + horizon]
            pad = np.zeros(horizon, bool)
            pad[len(chunk):] = True
            if len(chunk) < horizon:  # past the end: the last command repeated, masked out of the loss
                chunk = np.concatenate([chunk, np.repeat(targets[-1:], horizon - len(chunk), 0)])
            windows.append((rows, obs.state.astype(np.float32), chunk, pad))
    np.save(frames_path, np.stack(frames))
    return EpisodeWindows(Path(frames_path), windows)


class Dataset:
    """Every window of every episode, frames on the device as uint8 [N, 3, S, S]."""

    def __init__(self, episodes: list[EpisodeWindows], cameras: int, device: torch.device):
        files = [np.load(ep.frames, mmap_mode="r") for ep in episodes]
        self.frames = torch.empty((sum(len(f) for f in files), *files[0].shape[1:]), dtype=torch.uint8, device=device)
        self.groups, base = {}, 0
        for ep, f in zip(episodes, files):
            self.frames[base:base + len(f)] = torch.from_numpy(np.array(f))  # a writable copy of the mapped file
            for rows, state, actions, pad in ep.windows:
                g = self.groups.setdefault(len(rows) // cameras, Samples())
                g.rows.append([base + r for r in rows])
                g.states.append(state)
                g.actions.append(actions)
                g.pads.append(pad)
            base += len(f)
        self.tensors = {k: (torch.tensor(g.rows, device=device), torch.from_numpy(np.stack(g.states)).to(device),
                            torch.from_numpy(np.stack(g.actions)).to(device),
                            torch.from_numpy(np.stack(g.pads)).to(device))
                        for k, g in self.groups.items()}
        self.sizes = {k: len(g.rows) for k, g in self.groups.items()}

    def __len__(self) -> int:
        return sum(self.sizes.values())

    def batch(self, size: int, generator: torch.Generator,
              group: Optional[int] = None) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(frame times, pixels [B * images, 3, S, S] in [-1, 1], state, actions, pad): one group
        (`group` frame times, or chosen with probability proportional to its windows)."""
        keys = sorted(self.sizes)
        weights = torch.tensor([self.sizes[k] for k in keys], dtype=torch.float)
        k = group or keys[int(torch.multinomial(weights, 1, generator=generator))]
        rows, states, actions, pads = self.tensors[k]
        pick = torch.randint(len(rows), (size,), generator=generator).to(rows.device)
        pixels = self.frames[rows[pick].reshape(-1)].float() / 255 * 2 - 1
        return k, pixels, states[pick], actions[pick], pads[pick]


def shift_augment(pixels: torch.Tensor, max_px: int, generator: torch.Generator) -> torch.Tensor:
    """Each image translated by up to max_px pixels (edges repeated): small camera-pose noise."""
    if max_px <= 0:
        return pixels
    n, _, s, _ = pixels.shape
    shift = (torch.rand(n, 2, generator=generator) * 2 - 1).to(pixels.device) * (2 * max_px / s)
    theta = torch.zeros(n, 2, 3, device=pixels.device)
    theta[:, 0, 0] = theta[:, 1, 1] = 1
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)
    return F.grid_sample(pixels, grid, mode="bilinear", padding_mode="border", align_corners=False)


def loss_function(args, model: VLAPolicy, prompt_of: dict, cameras: int, autocast, device: torch.device):
    """flow_matching_loss, or with --compile its compiled form, the forward and backward of every
    window group (1 .. frames frame times) compiled before the step clock starts (a group first drawn
    mid-run, the rare one-frame windows of an episode's start, would stall the steps the schedule is
    fitted to). It needs only the batches' shapes, so main() runs it while the bags are being read."""
    if not args.compile:
        return flow_matching_loss
    compiled = torch.compile(flow_matching_loss, dynamic=False)
    cfg, b, size = model.cfg, args.batch, model.cfg.vision.image_size
    for k in sorted(prompt_of):
        pixels = torch.zeros((b * k * cameras, 3, size, size), device=device)
        target = torch.zeros((b, cfg.action.horizon, cfg.action.action_dim), device=device)
        with autocast:
            loss = compiled(model, pixels, prompt_of[k], torch.zeros((b, cfg.action.state_dim), device=device),
                            target, torch.zeros(target.shape[:2], dtype=torch.bool, device=device),
                            torch.full((b,), 0.5, device=device), torch.zeros_like(target))
        loss.backward()
    model.zero_grad(set_to_none=True)
    return compiled


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class WeightAverage:
    """An exponential moving average of the weights (fp32), what the checkpoint and the validation
    use when --ema-decay > 0: a flow policy's closed-loop success varies from one checkpoint to the
    next more than its loss shows, and the average of the last ~1/(1 - decay) steps smooths that.
    The decay ramps up as (1 + n) / (10 + n) so that a fresh run's average forgets its random start."""

    def __init__(self, model: VLAPolicy, decay: float):
        self.decay, self.updates = decay, 0
        self.params = [p.detach().float().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self, model: VLAPolicy) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.params, [p.detach() for p in model.parameters()], 1.0 - decay)


@contextmanager
def averaged(model: VLAPolicy, average: Optional[WeightAverage]):
    """The weights the checkpoint and validation use: with --ema-decay the model holds the average
    (copied in place: compiled code holds the parameters) until the block ends, then its own again."""
    if average is None:
        yield model
        return
    params = [p.detach() for p in model.parameters()]
    own = [p.clone() for p in params]
    with torch.no_grad():
        torch._foreach_copy_(params, average.params)
    try:
        yield model
    finally:
        with torch.no_grad():
            torch._foreach_copy_(params, own)


def save_state(out: Path, model: VLAPolicy, optim: torch.optim.Optimizer, step: int, log: list[dict],
               meta: dict, average: Optional[WeightAverage] = None) -> None:
    """The checkpoint (bf16 weights, the node's format; the average with --ema-decay) and what
    resuming needs (fp32 weights, moments and the average)."""
    state_dir = out / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"param.{k}": v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for name, value in optim.state.get(p, {}).items():
            if torch.is_tensor(value):
                tensors[f"optim.{i}.{name}"] = value.detach().cpu().reshape(-1).contiguous() if value.dim() == 0 \
                    else value.detach().cpu().contiguous()
    if average is not None:
        tensors.update({f"ema.{i}": value.cpu().contiguous() for i, value in enumerate(average.params)})
        tensors["ema_updates"] = torch.tensor([average.updates])
    save_file(tensors, str(state_dir / "state.safetensors"))
    (state_dir / "state.json").write_text(json.dumps({"step": step, **meta}, indent=2) + "\n")
    bf16 = build_model(model.cfg, dtype=torch.bfloat16)
    with averaged(model, average):
        bf16.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    save_checkpoint(bf16, out, tokenizer_dir=TINY_TOKENIZER)
    (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))


def load_state(out: Path, model: VLAPolicy, optim: torch.optim.Optimizer,
               average: Optional[WeightAverage] = None) -> tuple[int, list[dict]]:
    """The weights, moments and step save_state wrote; the average too, where it holds one (a run
    saved without --ema-decay starts its average at the resumed weights)."""
    state_dir = out / STATE_DIR
    tensors = load_file(str(state_dir / "state.safetensors"))
    model.load_state_dict({k[len("param."):]: v for k, v in tensors.items() if k.startswith("param.")})
    params = list(model.parameters())
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, i, name = key.split(".", 2)
            p = params[int(i)]
            optim.state[p][name] = value.to(p.device) if name != "step" else value.reshape(()).to(p.device)
    if average is not None and "ema_updates" in tensors:
        average.params = [tensors[f"ema.{i}"].to(p.device) for i in range(len(params))]
        average.updates = int(tensors["ema_updates"])
    elif average is not None:
        average.params = [p.detach().float().clone() for p in params]
    log_path = out / "train_log.jsonl"
    log = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.is_file() else []
    return json.loads((state_dir / "state.json").read_text())["step"], log


def plot_curves(log: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in log if "loss" in r]
    ax.plot(steps, [r["loss"] for r in log if "loss" in r], lw=0.8, label="train (batch)")
    val = [r for r in log if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="held-out episodes")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vla-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bags", required=True, help="folder of episode bags (*.mcap or bag folders)")
    ap.add_argument("--params", required=True, help="the node's parameter file (cameras, topics, joints)")
    ap.add_argument("--preset", default="sim")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--ema-decay", type=float, default=0.0,
                    help="save (and validate) an exponential moving average of the weights with this decay "
                         "(e.g. 0.999; 0: the last step's weights)")
    ap.add_argument("--shift-px", type=int, default=6, help="random translation of each image (augmentation)")
    ap.add_argument("--val-episodes", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--val-batches", type=int, default=8, help="batches of --batch windows per validation")
    ap.add_argument("--save-every", type=int, default=2000)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="wall time of the whole run: after 50 steps the step count is fitted to it (so the "
                         "learning-rate schedule completes), and the run saves and stops before it ends")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=None, help="processes reading bags (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step's forward and "
                    "backward (fused normalisations and activations; each window group compiles first)")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/train_state (weights, moments, step)")
    ap.add_argument("--init", default=None, help="start from this checkpoint's weights and statistics (fresh "
                    "optimizer and schedule): continue a run whose train_state is gone")
    ap.add_argument("--causal-images", action="store_true", help="image tokens attend causally, not both ways "
                    "as in the preset (the official variant without bi_directional_attn); the checkpoint's "
                    "config.json carries it, and --init/--resume must match the checkpoint's attention")
    ap.add_argument("--init-other-attention", action="store_true", help="with --init: start from a checkpoint "
                    "trained with the other image attention, to fine-tune it to this run's (a causal policy "
                    "from a bidirectional one); the steps that follow are what make it a policy of that attention")
    return ap


def resuming(args) -> bool:
    """--resume with a train state in --out to continue (without one the run starts afresh)."""
    return args.resume and (Path(args.out) / STATE_DIR / "state.json").is_file()


def _model_config(args):
    """The preset, with --causal-images. A run that continues a checkpoint (--init, --resume) must
    train the attention it was trained with: weights fitted to one image attention and saved under
    the other would load as a different policy."""
    cfg = get_preset(args.preset)
    if args.causal_images:
        cfg = dataclasses.replace(cfg, prompt=dataclasses.replace(cfg.prompt, bidirectional_images=False))
    start = Path(args.init) if args.init else Path(args.out) if resuming(args) else None
    if start is None:
        return cfg
    folder = start.parent if start.is_file() else start   # --init names the folder or its model.safetensors
    both_ways = read_config(folder).prompt.bidirectional_images
    if both_ways != cfg.prompt.bidirectional_images and not (args.init and args.init_other_attention):
        fix = "without --causal-images" if args.causal_images else "with --causal-images"
        also = " (or fine-tune it to the other with --init ... --init-other-attention)" if args.init else ""
        raise SystemExit(f"vla-train: {start} was trained with {'bidirectional' if both_ways else 'causal'} image "
                         f"attention: run {fix}{also}")
    return cfg


def _inputs(args, ap: argparse.ArgumentParser):
    """The node's parameters, the preset, the window layout and the episode bags."""
    import yaml

    params = next(iter(yaml.safe_load(Path(args.params).read_text()).values()))["ros__parameters"]
    cfg = _model_config(args)
    layout = WindowLayout(tuple(params["camera_names"]), cfg.robot.frames, cfg.robot.obs_step_delta)
    bags = sorted(p for p in Path(args.bags).iterdir() if p.suffix == ".mcap" or (p / "metadata.yaml").is_file())
    if len(bags) <= args.val_episodes:
        ap.error(f"{len(bags)} episode bags in {args.bags}: need more than --val-episodes {args.val_episodes}")
    return params, cfg, layout, bags


@contextmanager
def _reading(args, params: dict, cfg, layout: WindowLayout, bags: list[Path], device: torch.device, t_start: float):
    """Starts reading the bags in worker processes and yields a function that waits for them and
    returns the training and held-out windows: the caller compiles meanwhile."""
    # The node's topics are relative (namespaces); a bag records them under the root namespace.
    topics = tuple("/" + t.lstrip("/") for t in params["camera_topics"])
    # Spawned, not forked: the caller has CUDA and compile threads running (a fork of such a process
    # once left a frame file unreadable on the H200, in a test process after other CUDA tests).
    with tempfile.TemporaryDirectory(prefix="vla-train-frames-") as spill, multiprocessing.get_context("spawn").Pool(
            args.workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        jobs = [(str(b), f"{spill}/{i}.npy", layout, cfg.robot.history_offset_s, tuple(params["joint_names"]),
                 topics, cfg.vision.image_size, cfg.action.horizon, cfg.robot.control_rate_hz)
                for i, b in enumerate(bags)]
        pending = pool.map_async(read_episode, jobs)

        def windows() -> tuple[Dataset, Dataset]:
            episodes = pending.get()
            t_read = time.perf_counter()
            train = Dataset(episodes[args.val_episodes:], len(layout.cameras), device)
            val = Dataset(episodes[:args.val_episodes], len(layout.cameras), device)
            print(f"vla-train: {len(bags)} episodes ({len(train)} training windows, {len(val)} held out), "
                  f"{len(train.frames)} frames on {device}, read{' and compiled' if args.compile else ''} in "
                  f"{time.perf_counter() - t_start:.0f}s "
                  f"({time.perf_counter() - t_read:.0f}s of it onto the device)", flush=True)
            return train, val

        yield windows


def fit_to_data(args, model: VLAPolicy, train: Dataset, device: torch.device) -> torch.optim.Optimizer:
    """The model normalised to the training data's statistics (or --init's weights), and AdamW."""
    # The statistics of the training data: min/max of states and actions (with a floor on the span).
    states = torch.cat([g[1] for g in train.tensors.values()])
    actions = torch.cat([g[2][~g[3]] for g in train.tensors.values()])
    for buf, x in ((model.state_stats, states), (model.action_stats, actions)):
        lo, hi = x.min(0).values, x.max(0).values
        mid, half = (lo + hi) / 2, ((hi - lo) / 2).clamp_min(1e-3)
        buf.copy_(torch.stack([mid - half, mid + half]))
    if args.init:
        model.load_state_dict(load_checkpoint(args.init, device).state_dict())   # in place: compiled code holds
        print(f"vla-train: initialised from {args.init}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n and "pos" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def training_step(args, model: VLAPolicy, optim: torch.optim.Optimizer, loss_fn, batch: tuple, prompt_of: dict,
                  gen: torch.Generator, autocast) -> torch.Tensor:
    """One AdamW step on a batch of windows (shifted images, fresh noise and flow times)."""
    k, pixels, state, target, pad = batch
    pixels = shift_augment(pixels, args.shift_px, gen)
    noise = torch.randn(target.shape, generator=gen).to(target.device)
    with autocast:
        loss = loss_fn(model, pixels, prompt_of[k], state, target, pad, FLOW_TIMES(args.batch, target.device), noise)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    return loss


def main(argv: Optional[list[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    out = Path(args.out)
    device = torch.device(args.device)
    if device.type == "cuda":
        # The 2x2 pooling attends over 4 keys per window, for batch x images x windows rows: at
        # batch 256 that is > 65535, where cuDNN's attention fails (seen on the H200, torch 2.11).
        torch.backends.cuda.enable_cudnn_sdp(False)

    params, cfg, layout, bags = _inputs(args, ap)
    model = init_random_(build_model(cfg, device), args.seed).train().requires_grad_(True)
    prompts = PromptBuilder(load_tokenizer(TINY_TOKENIZER), cfg)
    instruction = params.get("instruction") or _bag_instruction(bags[0])
    # Every window group a bag can hold: 1 (an episode's start) .. frames frame times.
    prompt_of = {k: prompts.build(len(layout.cameras), k, instruction) for k in range(1, cfg.robot.frames + 1)}
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    with _reading(args, params, cfg, layout, bags, device, t_start) as windows:
        loss_fn = loss_function(args, model, prompt_of, len(layout.cameras), autocast, device)
        train, val = windows()
    optim = fit_to_data(args, model, train, device)
    average = WeightAverage(model, args.ema_decay) if args.ema_decay > 0 else None
    step, log = 0, []
    if resuming(args):
        step, log = load_state(out, model, optim, average)
        print(f"vla-train: resumed at step {step}", flush=True)
    gen = torch.Generator().manual_seed(args.seed * 7919 + step)
    meta = {"preset": args.preset, "batch": args.batch, "lr": args.lr, "steps": args.steps, "seed": args.seed,
            "ema_decay": args.ema_decay, "bags": len(bags), "train_windows": len(train),
            "command": "vla-train " + " ".join(sys.argv[1:] if argv is None else argv)}
    t_loop, start_step = time.perf_counter(), step
    while step < args.steps:
        if args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s:
            print(f"vla-train: time budget reached at step {step}", flush=True)
            break
        for g in optim.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = training_step(args, model, optim, loss_fn, train.batch(args.batch, gen), prompt_of, gen, autocast)
        if average is not None:
            average.update(model)
        step += 1
        if step == start_step + 50:
            t_steady = time.perf_counter()   # after the first steps' compilation and allocator warm-up
        if args.time_budget_s and step == start_step + 100:  # fit the schedule to the time left
            per_step = (time.perf_counter() - t_steady) / 50
            left = args.time_budget_s - (time.perf_counter() - t_start) - SAVE_MARGIN_S
            args.steps = min(args.steps, step + max(0, int(left / per_step)))
            meta["steps"] = args.steps
            print(f"vla-train: {per_step:.3f} s/step; {args.steps} steps fit the time budget", flush=True)
        if step % 50 == 0 or step == 1:
            log.append({"step": step, "loss": float(loss.detach()), "lr": optim.param_groups[0]["lr"],
                        "elapsed_s": time.perf_counter() - t_loop})
        if step % args.eval_every == 0 or step == args.steps:
            with averaged(model, average):
                log.append({"step": step, "val_loss": validation_loss(model, val, prompt_of, autocast, device,
                                                                      args.batch, args.val_batches)})
            print(f"step {step}: loss {float(loss.detach()):.4f} val {log[-1]['val_loss']:.4f} "
                  f"({(time.perf_counter() - t_loop) / max(1, step):.3f} s/step)", flush=True)
        if step % args.save_every == 0:
            save_state(out, model, optim, step, log, meta, average)
    save_state(out, model, optim, step, log, meta, average)
    plot_curves(log, out / "train_curves.png")
    size_mb = (out / 'model.safetensors').stat().st_size / 1e6
    print(f"vla-train: step {step}/{args.steps}, checkpoint {out} ({size_mb:.1f} MB), "
          f"{time.perf_counter() - t_start:.0f}s", flush=True)
    load_checkpoint(out)  # the written checkpoint loads strictly
    return 0


def _bag_instruction(path: Path) -> str:
    from .bag_io import INSTRUCTION_TOPIC

    with Bag(path) as bag:
        msg = bag.first_message(INSTRUCTION_TOPIC)
    if msg is None:
        raise SystemExit(f"vla-train: no instruction in {path} and none in the parameter file")
    return msg.data


@torch.no_grad()
def validation_loss(model: VLAPolicy, data: Dataset, prompt_of: dict, autocast, device, size: int,
                    batches: int) -> float:
    """The loss on held-out episodes at fixed windows, noise and flow times (comparable across steps)."""
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        k, pixels, s, target, pad = data.batch(size, gen)
        noise = torch.randn(target.shape, generator=gen).to(device)
        t = torch.linspace(0.05, 0.95, len(s), device=device)
        with autocast:
            losses.append(float(flow_matching_loss(model, pixels, prompt_of[k], s, target, pad, t, noise)))
    return float(np.mean(losses))


if __name__ == "__main__":
    raise SystemExit(main())
