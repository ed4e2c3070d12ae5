"""Qwen2-Audio through the engine against transformers on the same tiny random weights and clips:
the features against WhisperFeatureExtractor, the encoder and projector, greedy tokens and their
log-probabilities for several clip lengths and two clips in one prompt, a batch mixing audio and
text requests under chunked prefill, the quantized step, the prefix cache (a hit on the same clip,
never on another), decoding WAV / MP3 / FLAC with PyAV, and the offline API's audio inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.media_engine import NEW, assert_same, assert_same_until_a_near_tie, run, run_one_after_another
from helpers.tiny_audio import IDS, RATE, encode, hf_features, hf_generate, hf_model, tone

from mindie.engine.request import MediaInputs, SamplingParams
from mindie.media.audio import decode_audio
from mindie.media.fetch import MediaError
from mindie.model.llama_quant import QuantizedLlamaModel
from mindie.model.loader import LoadedModel, load_model
from mindie.model.qwen2_audio_processor import AudioFeatures, AudioSpec
from mindie.model.qwen2_vl import MediaRefused


@pytest.fixture(scope="module")
def family(tiny_qwen2_audio_dir):
    path = tiny_qwen2_audio_dir
    return path, load_model(str(path), dtype=torch.float32), hf_model(path)


def prompt(loaded: LoadedModel, clips: list, text: str = "What is that sound?"
           ) -> tuple[list[int], MediaInputs | None]:
    content = [{"type": "audio"} for _ in clips] + [{"type": "text", "text": text}]
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    if not clips:
        return ids, None
    return loaded.model.prepare_prompt(ids, audios=clips)


@pytest.mark.parametrize("seconds", [0.05, 1.0, 3.37, 30.0])
def test_features_equal_whisper_feature_extractor(seconds):
    clip = tone(seconds, seed=int(seconds * 100))
    want = hf_features([clip])
    ours = AudioFeatures(AudioSpec())(clip)
    frames = int(want["feature_attention_mask"].sum())
    assert ours.num_tokens == (((frames - 1) // 2 + 1) - 2) // 2 + 1  # Qwen2AudioProcessor's count
    kept = ours.features.shape[1]
    assert kept == min(2 * ours.num_positions + 1, 3000)
    np.testing.assert_array_equal(ours.features, want["input_features"][0, :, :kept].numpy())


def test_clips_beyond_the_window_or_below_one_token_are_refused():
    features = AudioFeatures(AudioSpec())
    with pytest.raises(ValueError, match="30.00 s long; the model reads at most 30 s"):
        features(np.zeros(30 * RATE + 1, np.float32))
    with pytest.raises(ValueError, match=r"too short for one audio token \(it needs more than 20 ms\)"):
        features(np.zeros(320, np.float32))
    assert features(np.zeros(321, np.float32)).num_tokens == 1


def hf_encoder(hf, clip: np.ndarray) -> torch.Tensor:
    """transformers' encoder and projector over the clip's 30 s window, the padding masked out of
    attention, at the clip's tokens."""
    from transformers.masking_utils import create_bidirectional_mask

    feats = hf_features([clip])
    lengths = feats["feature_attention_mask"].sum(-1)
    positions, tokens = hf.model.audio_tower._get_feat_extract_output_lengths(lengths)
    mask = (torch.arange(1500)[None] < positions[:, None]).long()
    attn = create_bidirectional_mask(config=hf.model.audio_tower.config, inputs_embeds=torch.zeros(1, 1500, 1,
                                     dtype=hf.dtype), attention_mask=mask)
    with torch.no_grad():
        out = hf.model.audio_tower(feats["input_features"], attention_mask=attn).last_hidden_state
        return hf.model.multi_modal_projector(out)[0, : int(tokens)]


def test_encoder_and_projector_equal_transformers(family):
    path, loaded, hf = family
    clips = [tone(2.3, 300, seed=1), tone(0.7, 900, seed=2)]
    ids, media = prompt(loaded, clips)
    for clip, item in zip(clips, media.items):
        torch.testing.assert_close(loaded.model.encode_media(item), hf_encoder(hf, clip), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seconds", [0.4, 2.0, 7.5])
def test_one_clip_matches_transformers(family, seconds):
    path, loaded, hf = family
    clip = tone(seconds, 200 + 100 * seconds, seed=3)
    ids, media = prompt(loaded, [clip])
    assert ids.count(IDS["<|AUDIO|>"]) == media.items[0].num_tokens
    assert_same(run(loaded, [(ids, media)])[0], hf_generate(hf, ids, [clip], NEW))


def test_two_clips_in_one_prompt(family):
    path, loaded, hf = family
    clips = [tone(1.2, 500, seed=4), tone(0.6, 700, seed=5)]
    ids, media = prompt(loaded, clips, "Which is higher?")
    assert len(media.items) == 2
    assert_same(run(loaded, [(ids, media)])[0], hf_generate(hf, ids, clips, NEW))


def test_batch_mixes_audio_and_text_requests_with_chunked_prefill(family):
    path, loaded, hf = family
    clip = tone(1.5, 350, seed=6)
    with_audio, text_only = prompt(loaded, [clip]), prompt(loaded, [], "Tell me a story.")
    together = run(loaded, [with_audio, text_only, with_audio], max_prefill_tokens=16)
    assert_same(together[0], hf_generate(hf, with_audio[0], [clip], NEW))
    assert_same(together[1], hf_generate(hf, text_only[0], [], NEW))
    assert together[2][0] == together[0][0]


def test_prefix_cache_hits_the_same_clip_and_never_another(family):
    path, loaded, hf = family
    first, other = tone(1.0, 400, seed=7), tone(1.0, 410, seed=8)
    a, b = prompt(loaded, [first]), prompt(loaded, [other])
    assert a[0] == b[0]  # the same placeholder tokens ...
    (a1, _), (a2, a2_cached), (b_tokens, b_cached) = run_one_after_another(loaded, [a, a, b])
    assert a2_cached >= len(a[0]) - 4 and a2 == a1
    # ... another clip behind them: only the blocks before its first audio token are shared
    assert b_cached <= a[1].items[0].offset
    assert b_tokens == hf_generate(hf, b[0], [other], NEW)[0]


def test_quantized_step_reads_audio(family):
    path, loaded, hf = family
    quant = load_model(str(path), dtype=torch.float32, quantization="q8_0")
    assert isinstance(quant.model, QuantizedLlamaModel)
    clip, other = tone(1.1, 450, seed=9), tone(1.1, 650, seed=10)
    got = run(quant, [prompt(quant, [clip]), prompt(quant, [], "Hi."), prompt(quant, [other])], max_prefill_tokens=16)
    want = run(loaded, [prompt(loaded, [clip]), prompt(loaded, [], "Hi."), prompt(loaded, [other])],
               max_prefill_tokens=16)
    for g, w in zip(got, want):
        # 8-bit weights may flip a near tie (the tiny model's audio turns are flat): the first
        # token's probability is close either way, and the tokens agree up to a flip
        assert abs(g[1][0] - w[1][0]) < 0.1
        same = next((i for i, (x, y) in enumerate(zip(g[0], w[0])) if x != y), NEW)
        assert all(abs(x - y) < 0.1 for x, y in zip(g[1][:same], w[1][:same]))
    assert got[1][0] == want[1][0]
    assert got[0][1] != got[2][1]  # the clip is read
    assert run(quant, [prompt(quant, [clip])])[0][:2] == got[0][:2]  # bit for bit, alone or beside others


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac"])
def test_decoded_formats_resample_to_the_extractor_rate(fmt):
    clip = tone(1.0, 440)
    data = encode(clip, fmt, file_rate=22050 if fmt != "wav" else RATE)
    audio = decode_audio(data, "part", RATE, 30.0)
    assert audio.sampling_rate == RATE and audio.samples.dtype == np.float32
    assert abs(audio.seconds - 1.0) < 0.1  # MP3 adds its encoder delay and padding
    if fmt == "wav":  # 16-bit PCM at the same rate: the samples come back to 1/32768
        np.testing.assert_allclose(audio.samples, clip, atol=1 / 32768 + 1e-7)


def test_decoding_refuses_other_formats_and_overlong_audio():
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    with pytest.raises(MediaError, match="^part is a png_pipe file; the audio formats read are wav, mp3 and flac"):
        decode_audio(buf.getvalue(), "part", RATE, 30.0)
    with pytest.raises(MediaError, match="^part is longer than 2 s"):
        decode_audio(encode(tone(3.0), "flac"), "part", RATE, 2.0)


@pytest.fixture(scope="module")
def bf16_family(family):
    """The model and transformers' loaded in bfloat16: each runs its encoder in bfloat16."""
    path = family[0]
    return path, load_model(str(path), dtype=torch.bfloat16), hf_model(path, torch.bfloat16)


def test_bfloat16_encoder_and_projector_match_transformers_bfloat16(bf16_family):
    """Within two bfloat16 steps of each row's largest value, most elements equal: transformers
    attends over the whole 30 s window with the padding masked, the same keys summed in other blocks
    of its attention kernel, so a sum now and then rounds the other way (ours runs the clip alone)."""
    path, loaded, hf = bf16_family
    clips = [tone(2.3, 300, seed=1), tone(0.7, 900, seed=2), tone(0.4, 240, seed=3)]
    ids, media = prompt(loaded, clips)
    for clip, item in zip(clips, media.items):
        ours, want = loaded.model.encode_media(item), hf_encoder(hf, clip)
        assert ours.dtype == want.dtype == torch.bfloat16
        ours, want = ours.float(), want.float()
        assert ((ours - want).abs() <= 2**-6 * want.abs().amax(-1, keepdim=True)).all()
        assert (ours == want).float().mean() > 0.5


@pytest.mark.parametrize("seconds", [0.4, 2.0, 7.5])
def test_bfloat16_matches_transformers_bfloat16(bf16_family, seconds):
    path, loaded, hf = bf16_family
    clip = tone(seconds, 200 + 100 * seconds, seed=3)
    ids, media = prompt(loaded, [clip])
    assert_same_until_a_near_tie(run(loaded, [(ids, media)])[0], hf_generate(hf, ids, [clip], NEW))


def test_prepare_prompt_names_the_refused_clip(family):
    path, loaded, hf = family
    ids, _ = prompt(loaded, [])
    rendered = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "audio"}]}], add_generation_prompt=True)
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    with pytest.raises(MediaRefused) as refused:
        loaded.model.prepare_prompt(ids, audios=[tone(1.0), np.zeros(31 * RATE, np.float32)])
    assert (refused.value.kind, refused.value.index) == ("audio", 1)


def test_offline_api_takes_audio_as_vllm_does(family, tmp_path):
    from mindie import LLM

    path, loaded, hf = family
    clip = tone(1.0, 520, seed=11)
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is that sound?"}]}],
        add_generation_prompt=True)
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    wav = encode(clip, "wav")
    (tmp_path / "a.wav").write_bytes(wav)
    ids, media = prompt(loaded, [decode_audio(wav, "a", RATE, 30.0).samples])
    want = run(loaded, [(ids, media)])[0][0]
    for given in ((clip, RATE), wav, str(tmp_path / "a.wav")):
        out = llm.generate({"prompt": text, "multi_modal_data": {"audio": given}}, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        # an (array, rate) clip skips the WAV's 16-bit rounding
        assert out.outputs[0].token_ids == (run(loaded, [prompt(loaded, [clip])])[0][0] if isinstance(given, tuple)
                                            else want)
    # at another rate the clip is resampled to the extractor's
    resampled = llm.generate({"prompt": text, "multi_modal_data": {"audio": (tone(1.0, 520, 8000, seed=11), 8000)}},
                             params, use_tqdm=False)[0]
    assert resampled.prompt_token_ids.count(IDS["<|AUDIO|>"]) == media.items[0].num_tokens


def test_a_config_with_qwen2_defaults_left_out_loads_as_transformers_reads_it(tiny_qwen2_audio_dir, tmp_path):
    """Qwen2-Audio-7B's config.json leaves hidden_size, the layer and head counts and the rotary base
    at Qwen2Config's defaults: they are read as transformers fills them in."""
    import json

    from transformers import AutoConfig

    from mindie.model.hf_dir import read_config

    raw = json.loads((tiny_qwen2_audio_dir / "config.json").read_text())
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k in (
        "bos_token_id", "eos_token_id", "intermediate_size", "max_position_embeddings", "model_type", "rms_norm_eps",
        "vocab_size")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, want = read_config(str(tmp_path)), AutoConfig.from_pretrained(tmp_path).text_config
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.rope_theta) == (
        want.hidden_size, want.num_hidden_layers, want.num_attention_heads, want.num_key_value_heads,
        want.rope_parameters["rope_theta"])
    assert ours.tie_word_embeddings is False
