"""Time to first token of a one-image chat on a random Idefics3 with SmolVLM-256M-Instruct's shapes,
ours against transformers on the same weights, and what share of ours the vision encoder takes.

    python benchmarks/smolvlm_ttft.py [--dtype float32|bfloat16] [--repeats 3]

The model has SmolVLM-256M-Instruct's config (a SigLIP tower: hidden 768, 12 layers, 512 px tiles of
16 px patches; pixel shuffle by 4, so 64 tokens a tile; a SmolLM2-135M-like Llama: hidden 576, 30
layers, 9 heads, 3 KV heads, vocabulary 49280) and preprocessor (images resized to a longest edge
of 2048, then cut into 512 px tiles plus the global image) with random weights, saved in bfloat16;
the tokenizer is the tests' byte-level one with SmolVLM's special tokens and chat template. Each
figure is the best of `--repeats` runs from the decoded image to the first token: (a) ours, one
EngineRequest through LLMEngine (preprocessing, the encoder per tile, the prefill); (b)
transformers' processor and generate(max_new_tokens=1) on the same weights; (c) the time our
engine spent in its encoder calls (`encode_media`: the SigLIP tower and the connector, one call
per tile) within (a)'s best run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import cpu_summary  # noqa: E402
from helpers.tiny_idefics3 import IDS, hf_processor, preprocessor, write_tokenizer  # noqa: E402
from helpers.tiny_vl import draw  # noqa: E402
from vl_ttft import ours  # noqa: E402

from mindie.config import EngineConfig  # noqa: E402
from mindie.engine.engine import LLMEngine  # noqa: E402
from mindie.model.loader import load_model  # noqa: E402

TILE, LONGEST_EDGE, PATCH, SCALE = 512, 2048, 16, 4  # SmolVLM-256M-Instruct's
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE**2  # 64
SIZES = [(512, 512), (1536, 1024)]
PROMPT = [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]


def make_smolvlm_256m(path: Path) -> Path:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_theta=100000.0, hidden_act="silu", eos_token_id=IDS["<end_of_utterance>"],
                bos_token_id=None, pad_token_id=IDS["<|endoftext|>"], tie_word_embeddings=False)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=TILE, patch_size=PATCH)
    config = Idefics3Config(text_config=text, vision_config=vision, image_token_id=IDS["<image>"],
                            scale_factor=SCALE, tie_word_embeddings=False)
    Idefics3ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)
    write_tokenizer(path)
    pre = preprocessor() | {"max_image_size": {"longest_edge": TILE}, "size": {"longest_edge": LONGEST_EDGE}}
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return path


def theirs(model, processor, text: str, image) -> float:
    start = time.perf_counter()
    inputs = processor(text=[text], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       pixel_values=inputs["pixel_values"].to(model.dtype),
                       pixel_attention_mask=inputs["pixel_attention_mask"], max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForImageTextToText

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_smolvlm_256m(Path(tmp))
        loaded = load_model(str(path), dtype=dtype)
        engine = LLMEngine(loaded, EngineConfig(block_size=16, num_kv_blocks=256, max_prefill_tokens=8192,
                                                enable_prefix_caching=False))
        encoder_calls: list[float] = []
        encode = loaded.model.encode_media

        def timed_encode(item):
            start = time.perf_counter()
            out = encode(item)
            encoder_calls.append(time.perf_counter() - start)
            return out

        loaded.model.encode_media = timed_encode  # the engine's own calls, timed where it makes them
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
        processor = hf_processor(path)
        processor.image_seq_len = IMAGE_SEQ_LEN  # the tests' helper writes the tiny models' 4
        text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        print(f"SmolVLM-256M-Instruct shapes (random weights), {args.dtype}, {torch.get_num_threads()} torch "
              f"threads, {cpu_summary()}")
        print(f"time to first token of a one-image chat, best of {args.repeats}:")
        print(f"  {'image':>9} {'tiles':>5} {'prompt':>6}   {'ours':>9}  {'encoder':>9} {'share':>5}   "
              f"{'transformers':>12}  {'ratio':>5}")
        for w, h in SIZES:
            image = draw(w, h, seed=w)
            ids, media = loaded.model.prepare_prompt(loaded.tokenizer.encode(text, add_special_tokens=False), [image])
            theirs_ids = processor(text=[text], images=[[image]])["input_ids"][0]
            assert list(theirs_ids) == ids, "transformers' processor writes another prompt"
            runs = []
            for _ in range(args.repeats):
                encoder_calls.clear()
                runs.append((ours(engine, image), sum(encoder_calls), len(encoder_calls)))
            a, enc, calls = min(runs)
            assert calls == len(media.items)
            b = min(theirs(hf, processor, text, image) for _ in range(args.repeats))
            print(f"  {w:>4}x{h:<4} {calls:>5} {len(ids):>6}   {a * 1e3:7.0f}ms  {enc * 1e3:7.0f}ms {enc / a:5.0%}   "
                  f"{b * 1e3:10.0f}ms  {b / a:5.2f}x")


if __name__ == "__main__":
    main()
