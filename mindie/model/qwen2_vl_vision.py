"""Qwen2-VL and Qwen2.5-VL vision tower in torch: patch embedding, 2-D rotary attention (Qwen2.5-VL:
window attention on all but its `fullatt_block_indexes` blocks, RMSNorm and SwiGLU), patch merger.

Input is what `qwen2_vl_processor.preprocess` produces (patch rows in merge-block order, as the
Hugging Face image processor lays them out); output is one row per merged 2x2 patch, in the order of
the image's placeholder tokens.

It runs in the model's dtype, as transformers runs a checkpoint's tower. In bfloat16 the matrix
products, attention and activations are bfloat16 (on the AMX tiles: the float32 tower took three
quarters of a Qwen2.5-VL-3B image's time to first token), while the norms' statistics and the
rotary embedding are computed in float32 and rounded to bfloat16 where transformers rounds them;
the RMSNorm and the rotation are this package's one-pass kernels, equal in bfloat16 to
transformers' unfused ops. In float32 every step is transformers' float32 computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mindie import ops
from mindie.model.hf_dir import take_weight


@dataclass(frozen=True)
class VisionConfig:
    qwen25: bool  # Qwen2.5-VL's blocks (RMSNorm, SwiGLU, window attention) rather than Qwen2-VL's
    depth: int
    dim: int  # the tower's width (Qwen2-VL embed_dim, Qwen2.5-VL hidden_size)
    num_heads: int
    out_dim: int  # the language model's hidden size, what the merger outputs
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    hidden_act: str
    rope_theta: float
    window_size: int  # Qwen2.5-VL: window side in pixels
    fullatt_block_indexes: tuple[int, ...]

    @staticmethod
    def from_hf(cfg: dict[str, Any], qwen25: bool, text_hidden: int) -> VisionConfig:
        rope = cfg.get("rope_parameters") or {}
        return VisionConfig(
            qwen25=qwen25, depth=int(cfg["depth"]),
            dim=int(cfg["hidden_size"] if qwen25 else cfg.get("embed_dim", 1280)),
            num_heads=int(cfg["num_heads"]),
            out_dim=int(cfg.get("out_hidden_size", text_hidden) if qwen25 else cfg.get("hidden_size", text_hidden)),
            patch_size=int(cfg.get("patch_size", 14)), temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            merge_size=int(cfg.get("spatial_merge_size", 2)),
            in_channels=int(cfg.get("in_channels", cfg.get("in_chans", 3))),
            hidden_act=str(cfg.get("hidden_act", "silu" if qwen25 else "quick_gelu")),
            rope_theta=float(rope.get("rope_theta", 10000.0)), window_size=int(cfg.get("window_size", 112)),
            fullatt_block_indexes=tuple(cfg.get("fullatt_block_indexes", ())),
        )


_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu, "gelu": F.gelu}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """Attention within each run of `segments` rows (an image, a frame or a window), never across:
    q, k, v [rows, heads, head_dim] -> [rows, heads, head_dim]. Runs of one length go in one batched
    call (a 1344x896 image has 96 windows: one call per window cost more than the attention itself),
    unpadded, so each run's values are those of a call on that run alone, as transformers makes it."""
    rows, heads, head_dim = q.shape

    def attend(x: list[torch.Tensor], length: int) -> torch.Tensor:  # [runs * length, heads, head_dim] each
        runs = [t.view(-1, length, heads, head_dim).transpose(1, 2) for t in x]
        return F.scaled_dot_product_attention(*runs).transpose(1, 2).reshape(-1, heads, head_dim)

    if len(set(segments)) == 1:  # an image, or windows that all fill: the rows as they lie, no gather
        return attend([q, k, v], segments[0])
    out = q.new_empty(rows, heads, head_dim)
    lengths = torch.tensor(segments)
    starts = torch.cumsum(lengths, 0) - lengths
    for length in set(segments):
        index = (starts[lengths == length][:, None] + torch.arange(length)).flatten()
        out[index] = attend([q[index], k[index], v[index]], length)
    return out


class VisionTower:
    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 prefix: str = "visual.") -> None:
        self.config = config
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            return take_weight(weights, prefix + name, dtype)

        self.take = take
        c = config
        # A Conv3d whose kernel equals its stride is one matrix product over each patch's pixels.
        self.patch = take("patch_embed.proj.weight").reshape(c.dim, -1)
        self.head_dim = c.dim // c.num_heads
        spatial = self.head_dim // 2
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.blocks = [self._block(i) for i in range(c.depth)]
        self.merger = {k: take("merger." + k) for k in ("ln_q.weight", "mlp.0.weight", "mlp.0.bias",
                                                        "mlp.2.weight", "mlp.2.bias")}
        if not c.qwen25:
            self.merger["ln_q.bias"] = take("merger.ln_q.bias")

    def _block(self, i: int) -> dict[str, torch.Tensor]:
        p = f"blocks.{i}."
        names = ["norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                 "attn.proj.bias"]
        if self.config.qwen25:
            names += [f"mlp.{n}_proj.{w}" for n in ("gate", "up", "down") for w in ("weight", "bias")]
        else:
            names += ["norm1.bias", "norm2.bias"] + [f"mlp.{n}.{w}" for n in ("fc1", "fc2") for w in ("weight", "bias")]
        return {n: self.take(p + n) for n in names}

    # --- pieces --------------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if not self.config.qwen25:  # LayerNorm (bfloat16: float32 inside, one rounding out, as nn.LayerNorm)
            return F.layer_norm(x, (x.shape[-1],), w, b, 1e-6)
        if x.dtype == torch.bfloat16:
            # transformers' RMSNorm rounds the normalised row to bfloat16, then multiplies by the
            # weight; the kernel does the same in one pass (a third of the tower's time went to the
            # unfused ops at 3B's shapes)
            return ops.rms_norm(x, w, 1e-6)
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # float32: transformers' op order

    def _rotary(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """float32 [patches, head_dim]: the cos of each of the head_dim / 2 frequencies, then their
        sin (h frequencies, then w), for each patch's (h, w) position, in merge-block order."""
        t, h, w = grid
        m = self.config.merge_size
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)
        pos = torch.stack([hpos.reshape(shape).transpose(1, 2).flatten(),
                           wpos.reshape(shape).transpose(1, 2).flatten()], dim=-1).repeat(t, 1)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [n, (h freqs, w freqs)]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def _rope(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [rows, heads, head_dim] rotated by their rows' `cos_sin` in float32, as transformers
        rotates them, then rounded to their dtype."""
        if q.dtype == torch.bfloat16:  # in place, one pass: float32 math, one rounding per element
            ops.rotary_embedding(torch.arange(q.shape[0]), q, k, cos_sin)
            return q, k
        half = cos_sin.shape[-1] // 2  # float32: transformers' op order, each frequency twice
        c, s = (part.repeat(1, 2).unsqueeze(-2) for part in (cos_sin[:, :half], cos_sin[:, half:]))
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    def _windows(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the order that groups merge units by window, and the windows' lengths in
        patches (transformers' get_vision_window_index)."""
        t, h, w = grid
        m = self.config.merge_size
        side = self.config.window_size // m // self.config.patch_size
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = side - gh % side, side - gw % side
        nh, nw = (gh + ph) // side, (gw + pw) // side
        padded = F.pad(index, (0, pw, 0, ph), "constant", -100).reshape(t, nh, side, nw, side)
        padded = padded.permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
        lengths = [int(n) * m * m for n in (padded != -100).sum(-1).flatten() if n > 0]
        flat = padded.flatten()
        return flat[flat != -100], lengths

    def _attention(self, x: torch.Tensor, blk: dict[str, torch.Tensor], cos_sin: torch.Tensor,
                   segments: list[int]) -> torch.Tensor:
        n, nh = x.shape[0], self.config.num_heads
        q, k, v = F.linear(x, blk["attn.qkv.weight"], blk["attn.qkv.bias"]).reshape(n, 3, nh, -1).unbind(1)
        q, k = self._rope(q, k, cos_sin)
        out = segment_attention(q, k, v, segments).reshape(n, -1)
        return F.linear(out, blk["attn.proj.weight"], blk["attn.proj.bias"])

    def _mlp(self, x: torch.Tensor, blk: dict[str, torch.Tensor]) -> torch.Tensor:
        act = _ACTS[self.config.hidden_act]
        if self.config.qwen25:
            gate = F.linear(x, blk["mlp.gate_proj.weight"], blk["mlp.gate_proj.bias"])
            up = F.linear(x, blk["mlp.up_proj.weight"], blk["mlp.up_proj.bias"])
            return F.linear(act(gate) * up, blk["mlp.down_proj.weight"], blk["mlp.down_proj.bias"])
        return F.linear(act(F.linear(x, blk["mlp.fc1.weight"], blk["mlp.fc1.bias"])),
                        blk["mlp.fc2.weight"], blk["mlp.fc2.bias"])

    # --- the tower -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image (or clip): patch rows [t*h*w, C*T*P*P] -> [t*h*w / merge^2, out_dim] in the tower's dtype."""
        c = self.config
        t, h, w = grid
        x = pixels.to(self.dtype) @ self.patch.T
        cos_sin = self._rotary(grid)
        frames = [h * w] * t
        unit = c.merge_size ** 2
        window_order = None
        if c.qwen25:
            window_order, windows = self._windows(grid)
            regroup = lambda a: a.reshape(-1, unit, a.shape[-1])[window_order].reshape(-1, a.shape[-1])  # noqa: E731
            x, cos_sin = regroup(x), regroup(cos_sin).contiguous()
        for i, blk in enumerate(self.blocks):
            segments = windows if c.qwen25 and i not in c.fullatt_block_indexes else frames
            b1, b2 = blk.get("norm1.bias"), blk.get("norm2.bias")
            x = x + self._attention(self._norm(x, blk["norm1.weight"], b1), blk, cos_sin, segments)
            x = x + self._mlp(self._norm(x, blk["norm2.weight"], b2), blk)
        g = self.merger
        merged = self._norm(x, g["ln_q.weight"], g.get("ln_q.bias")).reshape(-1, c.dim * unit)
        merged = F.linear(F.gelu(F.linear(merged, g["mlp.0.weight"], g["mlp.0.bias"])), g["mlp.2.weight"],
                          g["mlp.2.bias"])
        if window_order is not None:
            merged = merged[torch.argsort(window_order)]
        return merged
