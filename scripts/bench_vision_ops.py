"""The ViT stage's non-GEMM kernels one by one (issue 22, item 4: the vision stage within 1.5x its
floor): molmobot-4b's SigLIP (width 1152, 16 heads of 72, 729 patches an image) at DROID's 4 images
and the 8-image window, random bf16 inputs, each way 10 calls in one CUDA graph (us a call, median
of replays; scripts/bench_prefill_attention.timed), its error against fp32 beside it.

- attention: SDPA by each backend PyTorch has for head_dim 72 (cuDNN is what the engine gets), and
  with q/k/v zero-padded to head_dim 80 / 128 (the padding's copies not counted: what a layout the
  kernels like would buy);
- LayerNorm over [images * 729, 1152]: kernels/layer_norm, eager, compiled, and compiled with the
  residual add before it;
- one compiled ViT block as the engine runs it (fused q/k/v, the GELU epilogue), and its GEMMs alone.

    PYTHONPATH=$PWD python3 scripts/bench_vision_ops.py [--images 4,8] [--json F]
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from bench_prefill_attention import CUDA, timed
from torch.nn.attention import SDPBackend, sdpa_kernel

from vla_node.model import get_preset
from vla_node.model.vision import ViTBlock
from vla_node.runtime.fusion import fuse_projections, use_gelu_epilogues
from vla_node.runtime.kernels.layer_norm import TritonLayerNorm, layer_norm_into

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention_rows(images: int, dev, dtype) -> dict[str, float]:
    cfg = get_preset("molmobot-4b").vision
    t, hd = cfg.grid * cfg.grid, cfg.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(images, cfg.heads, t, hd, device=dev, dtype=dtype, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    rows = {}
    for pad in (hd, 80, 128):
        qp, kp, vp = (F.pad(x, (0, pad - hd)) for x in (q, k, v))
        for name, backend in {"default": None, **BACKENDS}.items():
            label = f"attention {name} head_dim {pad}"
            try:
                def call(qp=qp, kp=kp, vp=vp, backend=backend):
                    if backend is None:
                        return F.scaled_dot_product_attention(qp, kp, vp, scale=1 / math.sqrt(hd))
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qp, kp, vp, scale=1 / math.sqrt(hd))
                err = (call()[..., :hd].float() - ref).abs().max().item()
                rows[label] = (timed(call), err)
            except RuntimeError as e:
                rows[label] = (float("nan"), str(e).splitlines()[0][:80])
    return rows


def layer_norm_rows(images: int, dev, dtype) -> dict[str, float]:
    cfg = get_preset("molmobot-4b").vision
    x = torch.randn(images * cfg.grid * cfg.grid, cfg.width, device=dev, dtype=dtype)
    r = torch.randn_like(x)
    norm = torch.nn.LayerNorm(cfg.width, eps=cfg.norm_eps).to(dev, dtype)
    compiled = torch.compile(lambda a: norm(a), fullgraph=True, dynamic=False)
    add_norm = torch.compile(lambda a, b: (a + b, norm(a + b)), fullgraph=True, dynamic=False)
    with torch.no_grad():
        ref = F.layer_norm(x.float(), (cfg.width,), norm.weight.float(), norm.bias.float(), cfg.norm_eps)
        out = torch.empty_like(x)
        triton_norm = layer_norm_into(x, out, norm.weight, norm.bias, norm.eps)
        return {"layernorm triton (kernels/layer_norm)": (timed(lambda: layer_norm_into(x, out, norm.weight, norm.bias,
                                                                                        norm.eps)),
                                                           (triton_norm.float() - ref).abs().max().item()),
                "layernorm eager": (timed(lambda: norm(x)), (norm(x).float() - ref).abs().max().item()),
                "layernorm compiled": (timed(lambda: compiled(x)), (compiled(x).float() - ref).abs().max().item()),
                "add + layernorm compiled": (timed(lambda: add_norm(x, r)), float("nan"))}


def block_rows(images: int, dev, dtype) -> dict[str, float]:
    mc = get_preset("molmobot-4b")
    cfg = mc.vision
    block = ViTBlock(cfg).to(dev, dtype).eval()
    fuse_projections(block)
    x = torch.randn(images, cfg.grid * cfg.grid, cfg.width, device=dev, dtype=dtype)
    rows = {}
    with torch.no_grad():
        for label in ("block compiled, GELU pass", "block compiled, GELU epilogue",
                      "block compiled, GELU epilogue, Triton LayerNorms"):
            if "epilogue" in label:
                use_gelu_epilogues(block)
            if "Triton" in label:
                block.norm1, block.norm2 = TritonLayerNorm(block.norm1), TritonLayerNorm(block.norm2)
            fn = torch.compile(block, fullgraph=True, dynamic=False)
            rows[label] = (timed(lambda fn=fn: fn(x, x)), float("nan"))   # a middle block: an MLP output added in
        h = block.norm2(x)
        rows["qkv GEMM"] = (timed(lambda: block.attn.qkv(h)), float("nan"))
        rows["fc1 + GELU epilogue"] = (timed(lambda: block.fc1_gelu(h, block.fc1)), float("nan"))
        mid = block.fc1_gelu(h, block.fc1)
        rows["fc2 GEMM"] = (timed(lambda: block.fc2(mid)), float("nan"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", default="4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    table = {}
    for images in (int(n) for n in args.images.split(",")):
        for part in (attention_rows, layer_norm_rows, block_rows):
            for label, (us, err) in part(images, dev, dtype).items():
                table[f"{images} images: {label}"] = {"us": us, "max_abs_err": err}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    print(f"{'us':>9}  {'max|err|':>10}  way")
    for label, row in table.items():
        err = row["max_abs_err"]
        print(f"{row['us']:9.1f}  {err if isinstance(err, str) else f'{err:10.2e}'}  {label}")


if __name__ == "__main__":
    main()
