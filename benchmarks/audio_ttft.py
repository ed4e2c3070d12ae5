"""Time to first token of a one-clip chat on a random Qwen2-Audio whose audio encoder has
Qwen2-Audio-7B's shapes, ours against transformers on the same weights, and what share of ours the
encoder takes.

    python benchmarks/audio_ttft.py [--dtype float32|bfloat16] [--repeats 3] [--model-dir DIR]

The encoder is Qwen2-Audio-7B's (transformers' Qwen2AudioEncoderConfig defaults, Whisper-large-v3's
tower: d_model 1280, 32 layers, 20 heads, FFN 5120, 128 mel bins, 1500 positions = one 30 s window;
the projector to the language model's width); the language model is small, Qwen2-0.5B's layer
shape (hidden 896, 14 heads, 2 KV heads, FFN 4864, biased q/k/v) but 6 of its 24 layers and the
tests' 264-token byte-level vocabulary (with Qwen2-Audio's special tokens and chat template). Random
weights, saved in bfloat16 (in a temporary directory, or in --model-dir, reused when it holds one);
the preprocessor is Qwen2-Audio's WhisperFeatureExtractor settings. Clips are tests' tones (a sweep
and a little noise, mono float32 at 16 kHz) of 5 s and 30 s. Each figure is the best of `--repeats`
runs from the decoded samples to the first token, the three interleaved: (a) ours, one
EngineRequest through LLMEngine (the log-mel features, the encoder over the clip's own positions, the
prefill); (b) transformers' Qwen2AudioProcessor and generate(max_new_tokens=1) on the same weights
(its encoder runs the whole 30 s window, the padding masked out); (c) the time our engine spent in
its encoder call (`encode_media`: the audio tower and the projector) within (a)'s best run, and
transformers' time in its audio tower and projector within (b)'s best run. In float32 transformers'
audio tower uses our encoder's float32 tensors (the same values, the bfloat16 checkpoint widened), so
the run needs one 2.5 GB copy of the encoder, not two (about 4.7 GB at its peak).

Each side makes one untimed run on a 1 s clip first (thread pools, kernels' first-call setup). Values,
not only timings: the prompts must be the same token for token, and ours and transformers' first
tokens within the tests' bounds (float32: the same token, log-probabilities within 1e-3; bfloat16:
the same token unless transformers' top two logits are within 0.1, log-probabilities within 0.1), or
the run stops, so a broken path cannot post a time.
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
from helpers.tiny_audio import IDS, RATE, SPECIALS, VOCAB, chat_template, tone  # noqa: E402
from helpers.tiny_vl import write_tokenizer  # noqa: E402

from mindie.config import EngineConfig  # noqa: E402
from mindie.engine.engine import LLMEngine  # noqa: E402
from mindie.engine.request import EngineRequest, SamplingParams  # noqa: E402
from mindie.model.loader import load_model  # noqa: E402

SECONDS = [5.0, 30.0]
PROMPT = [{"type": "audio"}, {"type": "text", "text": "What is that sound?"}]
TEXT_LAYERS = 6  # of Qwen2-0.5B's 24


def make_qwen2_audio(path: Path) -> Path:
    from transformers import Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    text = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=896, intermediate_size=4864,
                num_hidden_layers=TEXT_LAYERS, num_attention_heads=14, num_key_value_heads=2,
                max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                eos_token_id=IDS["<|im_end|>"], bos_token_id=None, pad_token_id=IDS["<|endoftext|>"],
                tie_word_embeddings=False)
    audio = Qwen2AudioEncoderConfig().to_dict()  # Qwen2-Audio-7B's tower: 1280 wide, 32 layers, 20 heads
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=IDS["<|AUDIO|>"])
    model = Qwen2AudioForConditionalGeneration(config)
    with torch.no_grad():  # decisive logits (as the tests' tiny model), so greedy ties are not a coin toss
        model.lm_head.weight.mul_(16.0)
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    write_tokenizer(path, specials=SPECIALS, template=chat_template())
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": RATE,
         "hop_length": 160, "chunk_length": 30, "n_fft": 400, "padding_value": 0.0, "return_attention_mask": True}))
    return path


def hf_processor(path: Path):
    """transformers' Qwen2AudioProcessor: the directory's tokenizer, WhisperFeatureExtractor."""
    from transformers import PreTrainedTokenizerFast, Qwen2AudioProcessor, WhisperFeatureExtractor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    return Qwen2AudioProcessor(WhisperFeatureExtractor(feature_size=128, sampling_rate=RATE), tokenizer,
                               chat_template=chat_template())


def hf_model(path: Path, dtype: torch.dtype, loaded):
    """transformers' model on the same checkpoint in `dtype`. In float32 its audio tower takes our
    encoder's float32 tensors where it has them (the same values: the same bfloat16 checkpoint
    widened), so that the two 2.5 GB copies of the encoder are one and the run stays near 4 GB."""
    from transformers import Qwen2AudioForConditionalGeneration

    hf = Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
    if dtype != torch.bfloat16:
        ours_w = getattr(getattr(loaded.model, "audio", None), "w", {})
        for name, p in hf.model.audio_tower.named_parameters():
            w = ours_w.get(name)
            ok = w is not None and w.shape == p.shape and w.dtype == dtype
            p.data = w if ok else p.data.to(dtype)
        hf.to(dtype)  # the rest: the language model, the projector
    return hf


def ours(engine: LLMEngine, clip) -> tuple[float, int, float]:
    """From the decoded samples to the first token (features, the encoder, the prefill): seconds,
    the token, its log-probability."""
    loaded = engine.loaded
    start = time.perf_counter()
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids, media = loaded.model.prepare_prompt(loaded.tokenizer.encode(text, add_special_tokens=False), audios=[clip])
    engine.add_request(EngineRequest(f"r{time.monotonic_ns()}", ids,
                                     SamplingParams(max_tokens=1, temperature=0, logprobs=0), media=media))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.new_logprobs]
    seconds = time.perf_counter() - start
    return seconds, tokens[0], logprobs[0]


def theirs(model, processor, text: str, clip) -> tuple[float, int, float, float]:
    """The same for transformers: seconds, the token, its log-probability, the top-1 minus top-2 logit."""
    start = time.perf_counter()
    inputs = processor(text=[text], audio=[clip], sampling_rate=RATE, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                             input_features=inputs["input_features"].to(model.dtype),
                             feature_attention_mask=inputs["feature_attention_mask"], max_new_tokens=1,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    token = int(out.sequences[0, -1])
    logits = out.logits[0][0].float()
    top2 = logits.topk(2).values
    return seconds, token, float(logits.log_softmax(-1)[token]), float(top2[0] - top2[1])


def timed(fn, calls: list[float]):
    """`fn`, appending each call's seconds to `calls`."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        calls.append(time.perf_counter() - start)
        return out

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="write the random model here (or reuse the one there) instead of a temporary directory")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_qwen2_audio(args.model_dir or Path(tmp))
        loaded = load_model(str(path), dtype=dtype)
        engine = LLMEngine(loaded, EngineConfig(block_size=16, num_kv_blocks=256, max_prefill_tokens=8192,
                                                enable_prefix_caching=False))
        encoder_calls: list[float] = []
        loaded.model.encode_media = timed(loaded.model.encode_media, encoder_calls)  # where the engine calls it
        hf = hf_model(path, dtype, loaded)
        hf_encoder_calls: list[float] = []
        for module in (hf.model.audio_tower, hf.model.multi_modal_projector):  # timed the same way
            module.forward = timed(module.forward, hf_encoder_calls)
        processor = hf_processor(path)
        text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        print(f"Qwen2-Audio-7B's audio encoder, a {TEXT_LAYERS}-layer Qwen2-0.5B-shaped language model (random "
              f"weights), {args.dtype}, {torch.get_num_threads()} torch threads, {cpu_summary()}")
        print(f"time to first token of a one-clip chat, best of {args.repeats}:")
        print(f"  {'clip':>5} {'prompt':>6}   {'ours':>9}  {'encoder':>9} {'share':>5}   {'transformers':>12}  "
              f"{'encoder':>9} {'share':>5}  {'ratio':>5}   first token (ours / transformers, log-prob, top-2 margin)")
        warm = tone(1.0, seed=1)  # one untimed run each first: thread pools, kernels' first-call setup
        ours(engine, warm)
        theirs(hf, processor, text, warm)
        for seconds in SECONDS:
            clip = tone(seconds, 200 + 10 * seconds, seed=int(seconds))
            ids, media = loaded.model.prepare_prompt(loaded.tokenizer.encode(text, add_special_tokens=False),
                                                     audios=[clip])
            theirs_ids = processor(text=[text], audio=[clip], sampling_rate=RATE)["input_ids"][0]
            assert list(theirs_ids) == ids, "transformers' processor writes another prompt"
            runs, hf_runs = [], []
            for _ in range(args.repeats):  # interleaved, so that load from elsewhere falls on both
                encoder_calls.clear()
                hf_encoder_calls.clear()
                a, token, logprob = ours(engine, clip)
                assert len(encoder_calls) == 1
                runs.append((a, encoder_calls[0], token, logprob))
                b, hf_token, hf_logprob, margin = theirs(hf, processor, text, clip)
                assert len(hf_encoder_calls) == 2
                hf_runs.append((b, sum(hf_encoder_calls), hf_token, hf_logprob, margin))
            a, enc, token, logprob = min(runs)
            b, hf_enc, hf_token, hf_logprob, margin = min(hf_runs)
            # the tests' bounds: float32 the same token, log-probabilities within 1e-3; bfloat16 the same
            # token unless transformers' top two logits are within 0.1, log-probabilities within 0.1
            near_tie = dtype == torch.bfloat16 and margin < 0.1
            same = (token == hf_token or near_tie) and abs(logprob - hf_logprob) < (
                1e-3 if dtype == torch.float32 else 0.1)
            print(f"  {seconds:4.0f}s {len(ids):>6}   {a * 1e3:7.0f}ms  {enc * 1e3:7.0f}ms {enc / a:5.0%}   "
                  f"{b * 1e3:10.0f}ms  {hf_enc * 1e3:7.0f}ms {hf_enc / b:5.0%}  {b / a:5.2f}x   "
                  f"{token} / {hf_token}, {logprob:.4f} / {hf_logprob:.4f}, "
                  f"{margin:.2f}{'' if same else '  DIFFERENT'}", flush=True)
            assert same, f"first tokens differ: {token} {logprob} / {hf_token} {hf_logprob}"


if __name__ == "__main__":
    main()
