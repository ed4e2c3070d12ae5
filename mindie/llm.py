"""Offline API in the shape vLLM users know: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, MediaInputs, RequestOutput, SamplingParams
from mindie.model.loader import load_model

# text, or {"prompt": text} / {"prompt_token_ids": [...]}, either with {"multi_modal_data": {"image": ...}}
Prompt = str | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None  # per token: {token_id: logprob} incl. the chosen one
    finish_reason: str | None


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    """Loads a model (a GGUF file, a Hugging Face directory, or the embedded SmolLM2 default when
    `model` is None) and generates offline. `dtype`, `quantization` and `activation_bits` are
    load_model's (auto: the CPU's fast path). `**config` takes MindIE engine keys
    (`cacheBlockSize`, `maxPrefillTokens`, `maxSeqLen`, ...; see mindie.config)."""

    def __init__(self, model: str | None = None, dtype: str = "auto", quantization: str = "auto",
                 activation_bits: int = 16, **config: Any) -> None:
        loaded = load_model(model, dtype, quantization, activation_bits)
        self.engine = LLMEngine(loaded, EngineConfig.from_mindie(config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} sampling params for {len(prompts)} prompts")
        results: dict[str, GenerationResult] = {}
        for prompt, p in zip(prompts, per_prompt):
            text, ids = self._tokenize(prompt)
            ids, media = self._media(prompt, ids)
            request_id = str(next(self._ids))
            self.engine.add_request(EngineRequest(request_id, ids, p, prompt_text=text, media=media))
            samples = [CompletionOutput(i, "", [], 0.0, None, None) for i in range(p.num_outputs)]
            results[request_id] = GenerationResult(request_id, text, ids, samples)
        self._run(results, dict(zip(results, per_prompt)), use_tqdm=use_tqdm)
        return list(results.values())

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        for c in conversations:
            for m in c:
                if isinstance(m.get("content"), list) and any(p.get("type") != "text" for p in m["content"]):
                    raise ValueError("LLM.chat reads text parts only; pass images to generate() as "
                                     '{"prompt": ..., "multi_modal_data": {"image": ...}}')
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _media(self, prompt: Prompt, ids: list[int]) -> tuple[list[int], MediaInputs | None]:
        """vLLM's {"multi_modal_data": {"image": ..., "video": ..., "audio": ...}}, each one or a
        list: images as Pillow images, videos as file paths, encoded bytes or
        mindie.media.video.VideoClip, audio as (samples, sampling rate), file paths or encoded
        bytes. The prompt holds one placeholder per medium (a chat template writes them), expanded here."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return ids, None
        if not set(data) <= {"image", "video", "audio"}:
            raise ValueError(f"multi_modal_data takes 'image', 'video' and 'audio', got {sorted(data)}")
        model = self.engine.loaded.model
        reads = model.media_tokens.pads if hasattr(model, "media_tokens") else {}
        unread = sorted(set(data) - set(reads))
        if unread:
            raise ValueError(f"the model ({self.engine.loaded.name}) reads no {' or '.join(unread)}")
        given = {kind: value if isinstance(value, list) else [value] for kind, value in data.items()}
        audios = [_audio(a, model.audio_spec) for a in given.get("audio", [])]
        return model.prepare_prompt(ids, given.get("image", []), [_video_clip(v) for v in given.get("video", [])],
                                    audios)

    def _run(self, results: dict[str, GenerationResult], params: dict[str, SamplingParams], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(results), desc="Generating", unit="req", dynamic_ncols=True)
        pending = set(results)
        while pending:
            for out in self.engine.step():
                if out.request_id in results:
                    result, p = results[out.request_id], params[out.request_id]
                    self._accumulate(result, out, p.logprobs)
                    if out.request_done:
                        if not p.use_beam_search and p.num_samples > p.n:  # best_of: the n most likely
                            best = sorted(result.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
                            result.outputs = best[: p.n]
                            for i, c in enumerate(result.outputs):
                                c.index = i
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        if bar is not None:
            bar.close()

    @staticmethod
    def _accumulate(result: GenerationResult, out: RequestOutput, want_logprobs: int | None) -> None:
        c = result.outputs[out.index]
        c.text += out.new_text
        c.token_ids += out.new_token_ids
        c.cumulative_logprob = out.cumulative_logprob
        if want_logprobs is not None:
            c.logprobs = c.logprobs or []
            for lp in out.new_logprobs:
                c.logprobs.append({lp.token_id: lp.logprob, **dict(lp.top)})
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason.value
        result.num_cached_tokens = out.num_cached_prompt_tokens


def _audio(audio: Any, spec: Any) -> Any:
    """Audio the offline API was given ((samples, rate), a file path or encoded bytes) as mono
    float32 samples at the model's feature extractor's rate (`spec`: an AudioSpec)."""
    from mindie.media.audio import decode_audio, resample

    if isinstance(audio, tuple) and len(audio) == 2:
        return resample(audio[0], int(audio[1]), spec.sampling_rate).samples
    if isinstance(audio, str):
        with open(audio, "rb") as f:
            audio, where = f.read(), audio
    else:
        where = "the audio"
    if isinstance(audio, (bytes, bytearray)):
        return decode_audio(bytes(audio), where, spec.sampling_rate, spec.chunk_length).samples
    raise ValueError(f"an audio clip is (samples, sampling rate), a file path or encoded bytes, got "
                     f"{type(audio).__name__}")


def _video_clip(video: Any) -> Any:
    """A video the offline API was given (a path, encoded bytes or a VideoClip), probed."""
    from mindie.media.video import VideoClip, probe_video

    if isinstance(video, VideoClip):
        return video
    if isinstance(video, str):
        with open(video, "rb") as f:
            return probe_video(f.read(), video)
    if isinstance(video, (bytes, bytearray)):
        return probe_video(bytes(video), "the video")
    raise ValueError(f"a video is a file path, encoded bytes or a VideoClip, got {type(video).__name__}")
