"""MTP decoding in mlx-vlm for text, image and video prompts: greedy output identical to stock mlx-vlm.

Random tiny mlx-vlm models (with a tiny vision tower) of every family member, the head stored in
several forms; their random heads are rejected at the first draft, so every cycle exercises rollback.
The trained tiny checkpoint exercises acceptance through ``mlx_vlm.generate`` and the CLI.
"""

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.builders import build_head, build_model, config_for, png, save_checkpoint, trunk_weights
from mlx_vlm.utils import load_model
from mtp_plugin.adapters.mlx_vlm_decoding import CONTINUES_CACHED_POSITIONS
from mtp_plugin.adapters.patching import release

import mtp_plugin
from mtp_plugin.decoding.lookup import LookupSettings

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5"
SHORT = [3, 17, 42, 99, 7, 128, 5, 64]
LONG = [(7 * i) % 240 + 1 for i in range(150)]  # ids below the tiny models' image/video tokens (250, 251)
FORMS = {  # id: (head file, prefix)
    "shard-mtp": ("model.safetensors", "mtp."),
    "shard-language_model": ("model.safetensors", "language_model.mtp."),
    "sidecar": ("mtp.safetensors", "mtp."),
    "sidecar-dir-bare": ("mtp/weights.safetensors", ""),
}
CASES = [("qwen3_5", form) for form in FORMS] + [("qwen3_5_moe", "sidecar"), ("qwen3_next", "shard-mtp")]
TRAINED_PROMPT = 'def read_config(path):\n    """Read a JSON configuration file."""\n    with open(path) as f:\n'


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One random model per kind: (config, trunk weights, head weights), built on first use."""
    cache = {}

    def get(kind):
        if kind not in cache:
            config = config_for(kind, vision=True)
            model = build_model(config, "mlx_vlm")
            cache[kind] = (config, trunk_weights(model), build_head(model, config))
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def load(built, tmp_path_factory):
    """``load(kind, form)``: the kind's model saved with its head in ``form``, loaded by mlx-vlm."""

    def get(kind, form):
        config, trunk, head = built(kind)
        head_file, prefix = FORMS[form]
        path = save_checkpoint(tmp_path_factory.mktemp(f"{kind}-{form}"), config, trunk, head, head_file, prefix)
        model = load_model(path)
        assert model.mtp_head is not None
        return model

    return get


def generate_step(*args, **kwargs):
    """mlx-vlm's generate_step as patched now (looked up at call time)."""
    return importlib.import_module("mlx_vlm.generate").generate_step(*args, **kwargs)


def tokens(model, prompt, pixel_values=None, **kwargs):
    kwargs = {"max_tokens": 24, "temperature": 0.0, **kwargs}
    return [t for t, _ in generate_step(mx.array([prompt]), model, pixel_values, None, **kwargs)]


@pytest.mark.parametrize("kind,form", CASES)
def test_greedy_identical_to_plain(load, kind, form):
    model = load(kind, form)
    plain = tokens(model, SHORT, enable_mtp=False)
    assert model.mtp_head.stats is None
    mtp = tokens(model, SHORT, mtp_depth=2)
    assert mtp == plain
    stats = model.mtp_head.stats
    assert stats.drafted > 0 and stats.emitted + stats.lookup_emitted == len(mtp) - 1


@pytest.mark.parametrize("depth", [1, 3, 8])
@pytest.mark.parametrize("prompt,step", [([7], 64), (LONG, 64), (SHORT, 1)])
def test_depths_and_chunked_prefill(load, depth, prompt, step):
    model = load("qwen3_5", "sidecar")
    kwargs = dict(max_tokens=20, prefill_step_size=step)
    mtp = tokens(model, prompt, mtp_depth=depth, **kwargs)
    assert model.mtp_head.stats.depth == depth and model.mtp_head.stats.drafted > 0
    assert mtp == tokens(model, prompt, enable_mtp=False, **kwargs)


@pytest.mark.parametrize("step", [None, 4])
def test_second_turn_on_a_reused_cache(load, step):
    """A second prompt on the first one's cache, no position metadata passed: mlx-vlm runs it in one pass
    (``prefill_step_size=None``) or in chunks, and MTP does what stock does either way (in chunks, stock slices
    the prompt's own positions from the cache's offset and fails: MTP fails the same way)."""
    from mlx_vlm.models.cache import make_prompt_cache

    model = load("qwen3_5", "sidecar")
    turns = []
    for options in ({"enable_mtp": False}, {"mtp_depth": 2}):
        cache = make_prompt_cache(model.language_model)
        first = tokens(model, LONG[:20], max_tokens=8, prompt_cache=cache, prefill_step_size=step, **options)
        try:
            turns.append((first, tokens(model, SHORT, max_tokens=8, prompt_cache=cache, prefill_step_size=step,
                                        **options)))
        except ValueError as e:
            turns.append((first, type(e)))
    assert turns[0] == turns[1]
    assert (turns[0][1] is ValueError) == (step is not None)


def test_logits_processors_see_what_plain_sees(load):
    model = load("qwen3_5", "sidecar")
    for prompt in (SHORT, LONG):
        kwargs = dict(repetition_penalty=1.5, repetition_context_size=8, prefill_step_size=64)
        plain = tokens(model, prompt, enable_mtp=False, **kwargs)
        assert tokens(model, prompt, mtp_depth=3, **kwargs) == plain
        assert model.mtp_head.stats.drafted > 0


def test_reused_prompt_cache_with_text_positions(load):
    """A second turn on the first turn's cache, with the full prompt's mRoPE metadata passed explicitly (as
    ``stream_generate`` primes it for a reused ``PromptCacheState``): MTP, with mlx-vlm's own positions.
    mlx-vlm 0.6 restarts the positions of such a turn; MTP leaves it stock there."""
    from mlx_vlm.models.cache import make_prompt_cache

    model = load("qwen3_5", "sidecar")
    outputs = []
    for enable in (False, True):
        cache = make_prompt_cache(model.language_model)
        first = tokens(model, SHORT, max_tokens=6, prompt_cache=cache, enable_mtp=enable)
        full = mx.array([SHORT + first + [11, 12, 13]])
        position_ids, rope_deltas = model.language_model.get_rope_index(full)
        second = tokens(model, [11, 12, 13], max_tokens=10, prompt_cache=cache, enable_mtp=enable,
                        position_ids=position_ids, rope_deltas=rope_deltas)
        outputs.append((first, second))
    assert outputs[0] == outputs[1]
    assert (model.mtp_head.stats is not None) == CONTINUES_CACHED_POSITIONS
    shifted = dict(max_tokens=8, rope_deltas=mx.array([[-3]]))  # positions no text prompt has: still mlx-vlm's
    mtp = tokens(model, SHORT, mtp_depth=2, **shifted)
    assert model.mtp_head.stats.drafted > 0
    assert mtp == tokens(model, SHORT, enable_mtp=False, **shifted)


def image_inputs(config):
    """A one-image prompt for the tiny vision tower: 2x2 patches merged into one image token."""
    vision = config["vision_config"]
    patch = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    pixel_values = mx.random.normal((4, patch), key=mx.random.key(1))
    prompt = [3, 17, config["vision_start_token_id"], config["image_token_id"], 42, 99]
    return prompt, pixel_values, mx.array([[1, 2, 2]])


def test_image_prompt_on_random_head_as_stock(built, load):
    """An image prompt whose every draft is rejected (random head): each cycle rolls back across the image's
    positions, and the output is stock mlx-vlm's; a text prompt after it is unchanged."""
    model = load("qwen3_5", "sidecar")
    prompt, pixel_values, grid = image_inputs(built("qwen3_5")[0])
    patched = tokens(model, prompt, pixel_values, image_grid_thw=grid, mtp_depth=2)
    assert model.mtp_head.stats.drafted > 0
    mtp_plugin.unpatch()
    stock = tokens(model, prompt, pixel_values, image_grid_thw=grid)
    text_stock = tokens(model, SHORT)
    mtp_plugin.patch()
    assert patched == stock
    assert tokens(model, SHORT) == text_stock  # the image generation left no stale position state behind


# (grid t, h, w; the prompt token that stands for the media; the keyword carrying its patches). The tiny vision
# tower merges 2x2 patches into one token: the image is 4 tokens, the video 2 frames of 4.
MEDIA = {"image": ((1, 4, 4), "image_token_id", "image_grid_thw", None),
         "video": ((2, 4, 4), "video_token_id", "video_grid_thw", "pixel_values_videos")}


@pytest.fixture(scope="module")
def trained_vlm_model(tmp_path_factory):
    """The trained tiny checkpoint with a random tiny vision tower (``examples/add_vision_tower.py``), loaded by
    mlx-vlm; its config and tokenizer."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    spec = importlib.util.spec_from_file_location("add_vision_tower", TINY.parent / "add_vision_tower.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    path = tmp_path_factory.mktemp("trained-vlm") / "model"
    config = example.add_vision_tower(TINY / "hf", path)
    return load_model(path), config, load_tokenizer(path), path


def media_prompt(config, tokenizer, media: str, text: str = TRAINED_PROMPT) -> tuple[list[int], mx.array, dict]:
    """``Look:`` + the media + ``text``: token ids, the media's patches (positional) and the keywords to pass."""
    (t, h, w), marker, grid_key, patches_key = MEDIA[media]
    vision = config["vision_config"]
    patch = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    patches = mx.random.normal((t * h * w, patch), key=mx.random.key(t))
    prompt = [*tokenizer.encode("Look:\n"), config["vision_start_token_id"],
              *[config[marker]] * (t * h * w // 4), config["vision_end_token_id"], *tokenizer.encode(text)]
    keywords = {grid_key: mx.array([[t, h, w]])}
    if patches_key is None:
        return prompt, patches, keywords
    return prompt, None, {**keywords, patches_key: patches}


@pytest.mark.parametrize("depth", [1, 2, 3, None])
@pytest.mark.parametrize("media", MEDIA)
def test_media_prompt_greedy_identical_to_stock(trained_vlm_model, media, depth):
    """Image and video prompts decode with MTP (mlx-vlm's own prompt pass, multimodal positions), token for token
    mlx-vlm's output, drafts accepted after the media at every depth and adaptive."""
    model, config, tokenizer, _ = trained_vlm_model
    prompt, pixel_values, keywords = media_prompt(config, tokenizer, media)
    plain = tokens(model, prompt, pixel_values, max_tokens=40, enable_mtp=False, **keywords)
    mtp = tokens(model, prompt, pixel_values, max_tokens=40, mtp_depth=depth, **keywords)
    assert mtp == plain
    stats = model.mtp_head.stats
    assert stats.depth == depth and stats.emitted + stats.plain + stats.lookup_emitted == len(mtp) - 1
    assert stats.accepted > 0 or depth is None  # the adaptive controller may park on this CPU's timings


def test_a_long_prompt_after_an_image_greedy_identical_to_stock(trained_vlm_model):
    """An image, then source text past the head's window (``drafter.window``): the head is fed the window's pairs
    through mlx-vlm's own prompt passes (multimodal positions), token for token mlx-vlm's output."""
    from mtp_plugin.decoding import drafter

    model, config, tokenizer, _ = trained_vlm_model
    text = Path(importlib.import_module("mlx_lm.generate").__file__).read_text()[:6000]
    prompt, pixel_values, keywords = media_prompt(config, tokenizer, "image", text)
    assert len(prompt) > drafter.window(len(prompt)) + 100
    plain = tokens(model, prompt, pixel_values, max_tokens=24, enable_mtp=False, **keywords)
    assert tokens(model, prompt, pixel_values, max_tokens=24, mtp_depth=2, mtp_lookup=False, **keywords) == plain
    assert model.mtp_head.stats.drafted > 0


@pytest.mark.parametrize("depth", [2, None])
def test_lookup_drafts_after_an_image_greedy_identical_to_stock(trained_vlm_model, depth):
    """Drafts from the context beside the head's after an image (the index holds the image's tokens too): mlx-vlm's
    output token for token, with lookup cycles and head cycles in one generation."""
    model, config, tokenizer, _ = trained_vlm_model
    text = "def read_config(path):\n    return json.load(open(path))\n\n\n" * 3 + "def read"
    prompt, pixel_values, keywords = media_prompt(config, tokenizer, "image", text)
    plain = tokens(model, prompt, pixel_values, max_tokens=40, enable_mtp=False, **keywords)
    forced = LookupSettings(slope=0.0, first_prior=0.99)
    assert tokens(model, prompt, pixel_values, max_tokens=40, mtp_depth=depth, mtp_lookup=forced, **keywords) == plain
    stats = model.mtp_head.stats
    assert stats.lookup_accepted > 0 and stats.emitted + stats.plain + stats.lookup_emitted == len(plain) - 1


def test_the_bundled_template_renders_mlx_vlms_list_of_parts():
    """``python -m mlx_vlm generate`` sends the prompt as a list of parts: the bundled conversion's chat template
    renders their text, as it renders a string (not the list's Python text)."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_config, load_processor

    processor = load_processor(TINY / "mlx-4bit")  # mlx-vlm 0.6 cannot load this text-only model itself
    prompt = apply_chat_template(processor, load_config(TINY / "mlx-4bit"), "def f(x):", num_images=0)
    assert prompt == "<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\n", prompt


@pytest.mark.parametrize("text", ["def read_config(path):\n", "class Parser:\n", "def parse(text):\n"])
def test_prompt_passes_split_as_mlx_vlms(trained_vlm_model, text):
    """The prompt runs in mlx-vlm's own passes: on 0.6 one pass when it is not chunked (its GatedDeltaNet scans a
    multi-token pass in chunks, whose bfloat16 rounding differs from a single-token step: all but the last token
    then the last gave another token on a near tie for these prompts), on 0.7 all but the last, then the last."""
    model, _, tokenizer, _ = trained_vlm_model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    plain = tokens(model, prompt, max_tokens=32, enable_mtp=False)
    for depth in (1, 2, 3):
        assert tokens(model, prompt, max_tokens=32, mtp_depth=depth) == plain, depth


def test_head_positions_are_the_trunks_after_an_image(trained_vlm_model, monkeypatch):
    """Every pair the head sees, in the prompt's image, after it and while drafting, carries the multimodal rotary
    position mlx-vlm's trunk gave the same token (the image compresses positions: they fall behind the token
    index after it), and the head's layer receives exactly those positions."""
    from mtp_plugin.decoding import trunk

    model, config, tokenizer, _ = trained_vlm_model
    prompt, pixel_values, keywords = media_prompt(config, tokenizer, "image", "def main():\n")
    text_model, head_layer = model.language_model.model, model.mtp_head.module.layers[0]
    trunk_at, head_pairs, head_layer_positions = {}, [], []

    def trunk_call(self, *args, cache=None, position_ids=None, **kwargs):
        offset = cache[self.fa_idx].offset
        positions = position_ids if position_ids.ndim == 3 else mx.broadcast_to(position_ids, (3, *position_ids.shape))
        trunk_at.update({offset + i: positions[:, 0, i].tolist() for i in range(positions.shape[-1])})
        return stock_call(self, *args, cache=cache, position_ids=position_ids, **kwargs)

    def head_inputs(self, pair_tokens, start):
        embeddings, positions = stock_head_inputs(self, pair_tokens, start)
        head_pairs.append((start, positions))
        return embeddings, positions

    def layer_call(self, *args, **kwargs):
        if self is head_layer:
            head_layer_positions.append(kwargs["position_ids"])
        return stock_layer(self, *args, **kwargs)

    stock_call, stock_head_inputs, stock_layer = type(text_model).__call__, trunk.StackTrunk.head_inputs, \
        type(head_layer).__call__
    monkeypatch.setattr(type(text_model), "__call__", trunk_call)
    monkeypatch.setattr(trunk.StackTrunk, "head_inputs", head_inputs)
    monkeypatch.setattr(type(head_layer), "__call__", layer_call)
    tokens(model, prompt, pixel_values, max_tokens=30, mtp_depth=3, **keywords)
    assert model.mtp_head.stats.drafted > 0 and len(head_pairs) == len(head_layer_positions) > 2
    assert trunk_at[len(prompt) - 1][0] < len(prompt) - 1  # the image compressed the positions after it
    for (start, positions), given in zip(head_pairs, head_layer_positions, strict=True):
        assert given is positions
        assert [positions[:, 0, i].tolist() for i in range(positions.shape[-1])] == \
            [trunk_at[start + i] for i in range(positions.shape[-1])], start
    assert head_pairs[0][0] == 0 and max(start for start, _ in head_pairs) >= len(prompt)


def test_bench_decoders_for_image_prompts(trained_vlm_model):
    """``mtp-plugin bench`` on a checkpoint with a vision tower adds image-prompt rows: this plugin's decoding in
    mlx-vlm and, where mlx-vlm has one, its native MTP beside it; every "plain" row is stock mlx-vlm (no MTP)."""
    from mtp_plugin.adapters import mlx_vlm_native

    _, _, tokenizer, path = trained_vlm_model
    found = mlx_vlm_native.mtp_reference_decoders(model_dir=path, dtype=None)
    decoders = [d for d in found if not isinstance(d, str)]
    version = ".".join(map(str, release("mlx-vlm")))
    plugin = [f"mlx-vlm {version} + mtp_plugin, image prompts"]
    if importlib.util.find_spec("mlx_vlm.speculative") is not None:  # mlx-vlm's own drafters (0.6.8 has them)
        expected = [f"mlx-vlm {version} native MTP", *plugin, f"mlx-vlm {version} native MTP, image prompts"]
    else:
        expected = plugin
        assert found[0] == f"mlx-vlm {version}: no native MTP drafter in this version"
    assert [d.name for d in decoders] == expected
    prompt = tokenizer.encode(TRAINED_PROMPT)
    for decoder in decoders:
        plain = list(decoder.stream(prompt, 16, None))
        assert decoder.stats() is None and decoder.model.mtp_head.stats is None, decoder.name
        if decoder.drafter is None or release("mlx-vlm") >= (0, 7):  # 0.6.8's own MTP rounds fail (no reset)
            assert list(decoder.stream(prompt, 16, 2)) == plain, decoder.name
            assert decoder.stats().drafted > 0, decoder.name


def test_headless_checkpoint_decodes_stock(built, tmp_path, caplog):
    """No head: the wrapped step is stock mlx-vlm, the MTP keywords notwithstanding; an explicit depth says once
    why."""
    config, trunk, _ = built("qwen3_5")
    model = load_model(save_checkpoint(tmp_path, config, trunk))
    assert model.mtp_head is None
    patched = tokens(model, SHORT, mtp_depth=3)
    assert tokens(model, SHORT, mtp_depth=3) == patched
    assert caplog.text.count("depth 3 was asked, but this model has no usable MTP head") == 1
    mtp_plugin.unpatch()
    assert tokens(model, SHORT) == patched


@pytest.mark.parametrize("depth", ["3", 2.5, True, 9])
def test_bad_depth_is_refused_with_its_name(load, depth):
    with pytest.raises(ValueError, match="mtp_depth"):
        tokens(load("qwen3_5", "sidecar"), SHORT, mtp_depth=depth)


def test_custom_sampler_decodes_stock(load, caplog, monkeypatch):
    """A sampler object of the caller's own has no known distribution: stock decoding, with a warning."""
    from mtp_plugin.adapters import mlx_vlm_decoding

    monkeypatch.setattr(mlx_vlm_decoding, "_warned", set())
    model = load("qwen3_5", "sidecar")
    mx.random.seed(5)
    mtp = tokens(model, SHORT, max_tokens=6, sampler=lambda logprobs: mx.argmax(logprobs, axis=-1) % 7)
    assert model.mtp_head.stats is None and "custom sampler" in caplog.text
    assert mtp == tokens(model, SHORT, max_tokens=6, enable_mtp=False,
                         sampler=lambda logprobs: mx.argmax(logprobs, axis=-1) % 7)


@pytest.mark.parametrize("option", [{"max_kv_size": 64}, {"max_kv_size": 12},
                                    {"kv_bits": 8, "quantized_kv_start": 10**6}])
def test_kv_cache_options_decode_stock(load, option):
    """mlx-vlm's rotating / quantized KV caches decode as stock mlx-vlm does (one warning), never an error."""
    model = load("qwen3_5", "sidecar")
    mtp = tokens(model, SHORT, **option)
    assert model.mtp_head.stats is None
    assert mtp == tokens(model, SHORT, enable_mtp=False, **option)


def test_unpatch_restores_stock_generate_step():
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    mtp_plugin.unpatch()
    assert dispatch.generate_step.__module__ == "mlx_vlm.generate.ar"
    assert not hasattr(dispatch.generate_step, "__wrapped__")
    mtp_plugin.patch()
    assert dispatch.generate_step.__wrapped__.__module__ == "mlx_vlm.generate.ar"


@pytest.fixture(scope="module", params=["hf", "mlx-4bit"])
def trained(request):
    """The trained tiny checkpoint through ``mlx_vlm.load`` (no vision weights: not strict on mlx-vlm 0.6)."""
    from mlx_vlm import load

    return load(str(TINY / request.param), strict=False)


def test_trained_checkpoint_generate(trained, capsys):
    from mlx_vlm import generate

    model, processor = trained
    plain = generate(model, processor, TRAINED_PROMPT, max_tokens=40, temperature=0.0, enable_mtp=False)
    assert model.mtp_head.stats is None
    for depth in (1, 3):
        text = generate(model, processor, TRAINED_PROMPT, max_tokens=40, temperature=0.0, mtp_depth=depth)
        assert text.text == plain.text and text.generation_tokens == plain.generation_tokens
        assert model.mtp_head.stats.acceptance > 0.2
    capsys.readouterr()
    generate(model, processor, TRAINED_PROMPT, max_tokens=12, temperature=0.0, verbose=True)
    out = capsys.readouterr()
    assert "MTP on: head from" in out.err and "\nMTP: depth=auto drafted=" in out.out


CLI = [sys.executable, "-m", "mlx_vlm", "generate", "--model", str(TINY / "mlx-4bit"), "--prompt", TRAINED_PROMPT,
       "--max-tokens", "24", "--temperature", "0", "--verbose"]
NEW_CLI = pytest.mark.skipif(release("mlx-vlm") < (0, 7),
                             reason="the mlx-vlm 0.6 CLI loads strictly: no checkpoint without vision weights")


def run_cli(*flags: str, disable: str = "0") -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *flags], capture_output=True, text=True, timeout=300, check=True,
                          env={**os.environ, "MTP_PLUGIN_DISABLE": disable})


@pytest.fixture(scope="module")
def stock_cli():
    """What stock ``python -m mlx_vlm generate`` prints (``MTP_PLUGIN_DISABLE=1``)."""
    return run_cli(disable="1")


@NEW_CLI
@pytest.mark.parametrize("flags,depth", [((), "auto"), (("--mtp-depth", "2"), "2"), (("--no-mtp",), None)])
def test_cli_decodes_with_mtp(stock_cli, flags, depth):
    """The post-import hook (installed .pth) patches the real ``python -m mlx_vlm generate``, which gains
    ``--mtp-depth`` and ``--no-mtp``; the text is the one stock mlx-vlm prints."""
    mtp = run_cli(*flags)
    assert "MTP" not in stock_cli.stderr + stock_cli.stdout
    if depth is None:
        assert "MTP" not in mtp.stderr + mtp.stdout
    else:
        assert "MTP on: head from mtp.safetensors" in mtp.stderr
        summary = next(line for line in mtp.stdout.splitlines() if line.startswith(f"MTP: depth={depth} "))
        assert float(summary.split("acceptance=")[1].split()[0]) > 0
    assert mtp.stdout.split("==========")[1] == stock_cli.stdout.split("==========")[1]  # prompt and generated text


def test_cli_help_lists_the_mtp_flags():
    """On every mlx-vlm version, its own parser (built inside ``parse_arguments``) carries the flags."""
    out = subprocess.run([*CLI[:4], "--help"], capture_output=True, text=True, timeout=300, check=True).stdout
    assert "--mtp-depth N" in out and "--no-mtp" in out


@pytest.mark.parametrize("flags", [("--mtp-depth", "2"), ()], ids=["depth2", "auto"])
def test_cli_with_an_image_file(trained_vlm_model, tmp_path, flags):
    """``python -m mlx_vlm generate --image FILE``: mlx-vlm's processor reads the file and inserts the image
    tokens, MTP decodes, and the text is the one stock mlx-vlm prints for the checkpoint without its head."""
    path = trained_vlm_model[3]
    image, headless = tmp_path / "image.png", tmp_path / "headless"
    image.write_bytes(png(64, 48, 5))
    shutil.copytree(path, headless, ignore=shutil.ignore_patterns("mtp.safetensors"))
    command = [*CLI[:4], "--image", str(image), "--prompt", "def main():\n", "--max-tokens", "24",
               "--temperature", "0", "--verbose", "--model"]
    stock = subprocess.run([*command, str(headless)], capture_output=True, text=True, timeout=300, check=True,
                           env={**os.environ, "MTP_PLUGIN_DISABLE": "1"})
    mtp = subprocess.run([*command, str(path), *flags], capture_output=True, text=True, timeout=300, check=True)
    assert "MTP on: head from mtp.safetensors" in mtp.stderr and "\nMTP: depth=" in mtp.stdout
    text = mtp.stdout.split("==========")[1]
    assert text == stock.stdout.split("==========")[1] and "<|image_pad|>" in text  # prompt and generated text


PREFILL_BAR = re.compile(r"Prefill:\s+\d+%\|[^|]*\| (\d+)/(\d+) ")


def test_prefill_progress_bar_as_stock(trained, capsys):
    """mlx-vlm's own ``Prefill`` bar (verbose, chunked prefill) is shown while MTP decodes, ending where stock's
    ends; without ``verbose`` neither shows it."""
    from mlx_vlm import generate

    model, processor = trained
    bars = {}
    for mtp in (False, True):
        for verbose in (False, True):
            capsys.readouterr()
            generate(model, processor, TRAINED_PROMPT, max_tokens=4, temperature=0.0, verbose=verbose,
                     prefill_step_size=8, enable_mtp=mtp)
            bars[mtp, verbose] = PREFILL_BAR.findall(capsys.readouterr().err)
    assert bars[False, False] == bars[True, False] == []
    assert bars[False, True] and bars[True, True][-1] == bars[False, True][-1], bars
    assert model.mtp_head.stats is not None  # the last generation decoded with MTP
