"""A tiny random Qwen2-Audio written as a Hugging Face directory (config, safetensors, a byte-level
tokenizer with Qwen2-Audio's special tokens and its processor's chat template), tones written as
WAV / MP3 / FLAC with PyAV, and transformers' greedy reference."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from helpers.media_engine import Greedy, hf_generate_greedy
from helpers.tiny_vl import write_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
IDS = {t: 256 + i for i, t in enumerate(SPECIALS)}
VOCAB = 264
RATE = 16000


def chat_template() -> str:
    """Qwen2AudioProcessor's default template (what Qwen2-Audio-7B-Instruct ships)."""
    from transformers import Qwen2AudioProcessor

    return Qwen2AudioProcessor.default_chat_template.fget(None)


def make_tiny_audio(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_theta=10000.0, eos_token_id=IDS["<|im_end|>"], bos_token_id=None,
                pad_token_id=IDS["<|endoftext|>"], tie_word_embeddings=False)
    # The real window (128 mel bins, 1500 positions: 30 s), a narrow and shallow encoder
    audio = dict(model_type="qwen2_audio_encoder", d_model=32, encoder_layers=2, encoder_attention_heads=2,
                 encoder_ffn_dim=48, num_mel_bins=128, max_source_positions=1500)
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=IDS["<|AUDIO|>"])
    model = Qwen2AudioForConditionalGeneration(config)
    # Larger-than-init weights make the logits decisive, so greedy ties are not a coin toss.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(1.0 if "audio_tower" in name else 16.0 if "lm_head" in name else 2.0)
    model.save_pretrained(path)
    write_tokenizer(path, specials=SPECIALS, template=chat_template())
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": RATE,
         "hop_length": 160, "chunk_length": 30, "n_fft": 400, "padding_value": 0.0, "return_attention_mask": True}))
    return path


def tone(seconds: float, freq: float = 440.0, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """A deterministic float32 clip: a tone with a sweep and a little noise, so features vary."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * (freq + 200 * t) * t) + 0.02 * noise).astype(np.float32)


def encode(samples: np.ndarray, fmt: str, file_rate: int = RATE) -> bytes:
    """`samples` (mono float32 at RATE) as a wav (PCM 16-bit), mp3 (LAME) or flac file sampled at `file_rate`."""
    import av

    codec = {"wav": "pcm_s16le", "mp3": "libmp3lame", "flac": "flac"}[fmt]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=file_rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None, :].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = RATE
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=file_rate)
        for f in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import Qwen2AudioForConditionalGeneration

    return Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()


def hf_features(clips: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """transformers' WhisperFeatureExtractor as Qwen2AudioProcessor calls it."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=RATE)
    out = fe(clips, sampling_rate=RATE, return_attention_mask=True, padding="max_length", return_tensors="pt")
    return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}


def hf_generate(model: Any, prompt_ids: list[int], clips: list[np.ndarray], new_tokens: int) -> Greedy:
    """transformers' greedy generate on the same prompt (<|AUDIO|> already expanded) and clips."""
    ids = torch.tensor([prompt_ids])
    kwargs = hf_features(clips) if clips else {}
    return hf_generate_greedy(model, ids, new_tokens, **kwargs)
