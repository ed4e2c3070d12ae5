"""Time to first token of a one-image chat on a random Qwen2.5-VL, ours against transformers on the
same weights, in one run: preprocessing, the vision tower and the prefill.

    python benchmarks/vl_ttft.py [--shape tiny|3b] [--dtype float32|bfloat16] [--quantization none|q8_0]

`tiny` is the tests' model (seconds); `3b` has Qwen2.5-VL-3B's shapes with random weights (about
8 GB in bfloat16 for each of the two copies; minutes of CPU). Images are 448x448 and 1344x896,
preprocessed with max_pixels 1344 * 896 so both keep their size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.tiny_vl import IDS, draw, make_tiny_vl, write_tokenizer  # noqa: E402

from mindie.config import EngineConfig  # noqa: E402
from mindie.engine.engine import LLMEngine  # noqa: E402
from mindie.engine.request import EngineRequest, SamplingParams  # noqa: E402
from mindie.model.loader import load_model  # noqa: E402

MAX_PIXELS = 1344 * 896
SIZES = [(448, 448), (1344, 896)]


def make_3b(path: Path) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1000000.0)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=2048, num_heads=16,
                  window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IDS["<|image_pad|>"],
                              vision_start_token_id=IDS["<|vision_start|>"], vision_end_token_id=IDS["<|vision_end|>"])
    Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path)
    return path


def set_limits(path: Path) -> None:
    import json

    file = path / "preprocessor_config.json"
    pre = json.loads(file.read_text())
    pre["max_pixels"] = MAX_PIXELS
    file.write_text(json.dumps(pre))
    file = path / "config.json"  # room for 1344x896's 1536 image tokens in the tiny model too
    config = json.loads(file.read_text())
    config["text_config"]["max_position_embeddings"] = max(4096, config["text_config"]["max_position_embeddings"])
    file.write_text(json.dumps(config))


def ours(engine: LLMEngine, image) -> float:
    """From the decoded image to the first token: preprocessing, the tower, the prefill."""
    loaded = engine.loaded
    start = time.perf_counter()
    content = [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids, media = loaded.model.prepare_prompt(loaded.tokenizer.encode(text, add_special_tokens=False), [image])
    engine.add_request(EngineRequest(f"r{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1, temperature=0),
                                     media=media))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def theirs(model, processor, tokenizer, image) -> float:
    start = time.perf_counter()
    pre = processor(images=[image], return_tensors="pt")
    n = int(pre["image_grid_thw"].prod()) // 4
    text = (f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * n}<|vision_end|>Describe the picture."
            "<|im_end|>\n<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=pre["pixel_values"].to(model.dtype),
                       image_grid_thw=pre["image_grid_thw"], mm_token_type_ids=(ids == IDS["<|image_pad|>"]).int(),
                       max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=["tiny", "3b"], default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--quantization", choices=["none", "q8_0"], default="none")
    args = parser.parse_args()
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_3b(Path(tmp)) if args.shape == "3b" else make_tiny_vl(Path(tmp), qwen25=True)
        set_limits(path)
        loaded = load_model(str(path), dtype=dtype, quantization=args.quantization)
        engine = LLMEngine(loaded, EngineConfig(block_size=16, num_kv_blocks=256, max_prefill_tokens=8192,
                                                enable_prefix_caching=False))
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
        processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=MAX_PIXELS)
        print(f"Qwen2.5-VL {args.shape}, {args.dtype}, quantization {args.quantization}, "
              f"{torch.get_num_threads()} torch threads; time to first token, best of 3:")
        for w, h in SIZES:
            image = draw(w, h, seed=w)
            a = min(ours(engine, image) for _ in range(3))
            b = min(theirs(hf, processor, loaded.tokenizer, image) for _ in range(3))
            print(f"  {w}x{h}: ours {a * 1e3:8.1f} ms   transformers {b * 1e3:8.1f} ms   ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
