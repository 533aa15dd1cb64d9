"""Give a text-only Qwen3.5 checkpoint a tiny random vision tower, so that mlx-vlm runs image and video prompts on it.

The language model and the MTP head are the source's (trained), the vision tower is mlx-vlm's own class with
random weights (one block, 32 wide, 16-pixel patches, 2x2 merge): its features carry no meaning, but every path
an image takes through mlx-vlm is the real one (vision features merged into the prompt, Qwen's multimodal rotary
positions jumping across the image). The vocabulary's four last ids stand for the image, the video, the vision
start and the vision end. The copy is written as a converted mlx-vlm checkpoint (``model.safetensors``, the head in an
``mtp.safetensors`` sidecar, the source's tokenizer files); the source is only read.

Reading the text-only source, mlx-vlm warns that it has no vision weights; the copy has them.

Example::

    python examples/add_vision_tower.py examples/tiny-qwen3_5/hf build/tiny-qwen3_5-vl
    mtp-plugin bench build/tiny-qwen3_5-vl     # adds mlx-vlm image-prompt rows
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

VISION = dict(model_type="qwen3_5", depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# Qwen's chat template, reduced to the roles and the media placeholders its processor expands
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen's image processor at the tower's patch geometry, with few pixels so that an image is a few tokens
PROCESSOR = dict(image_processor_type="Qwen2VLImageProcessor", patch_size=16, merge_size=2, temporal_patch_size=2,
                 min_pixels=32 * 32, max_pixels=64 * 64, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def add_vision_tower(source: Path, out: Path, seed: int = 0) -> dict:
    """Write ``source`` (a Qwen3.5 checkpoint with an MTP head that mlx-vlm loads) with a random tiny vision
    tower to ``out`` (created; must not exist); returns the written config.

    Raises:
        FileExistsError: ``out`` exists.
        ValueError: ``source`` has no loadable MTP head.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm import load
    from mlx_vlm.utils import get_model_and_args

    config = json.loads((source / "config.json").read_text())
    text = config.get("text_config", config)
    vocab = text["vocab_size"]
    config.update(vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
                  image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
                  vision_end_token_id=vocab - 1)
    trained, _ = load(str(source), strict=False)
    if getattr(trained, "mtp_head", None) is None:
        raise ValueError(f"{source}: no loadable MTP head (is mtp_plugin installed, and the head in the checkpoint?)")
    mx.random.seed(seed)
    arch = get_model_and_args(config)[0]
    model_config = arch.ModelConfig.from_dict(config)
    model_config.text_config = arch.TextConfig.from_dict(text)
    model_config.vision_config = arch.VisionConfig.from_dict(config["vision_config"])
    model = arch.Model(model_config)
    model.language_model.update(trained.language_model.parameters())
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    head = {f"mtp.{k}": v for k, v in tree_flatten(trained.mtp_head.module.parameters())}
    mx.save_safetensors(str(out / "mtp.safetensors"), head, metadata={"format": "mlx"})
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    _add_vision_tokens(out, vocab)
    return config


def _add_vision_tokens(out: Path, vocab: int) -> None:
    """Make the vocabulary's four last ids the special tokens Qwen's processor inserts for media (the BPE entries
    there, and the merges that build or use them, give way), and give the chat template media placeholders, so
    that mlx-vlm's processor and server take real image and video files."""
    path = out / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    ids = {token: vocab - 4 + i for i, token in enumerate(VISION_TOKENS)}
    model = tokenizer["model"]
    by_id = {i: text for text, i in model["vocab"].items()}
    replaced = {by_id[i] for i in ids.values() if i in by_id}
    model["vocab"] = {text: i for text, i in model["vocab"].items() if text not in replaced} | ids
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    model["merges"] = [m for m, (a, b) in zip(model["merges"], pairs, strict=True)
                       if not {a, b, a + b} & replaced]
    tokenizer["added_tokens"] += [dict(id=i, content=token, single_word=False, lstrip=False, rstrip=False,
                                       normalized=False, special=True) for token, i in ids.items()]
    path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    settings_path = out / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["chat_template"] = CHAT_TEMPLATE
    settings_path.write_text(json.dumps(settings, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="checkpoint with an MTP head (e.g. examples/tiny-qwen3_5/hf)")
    parser.add_argument("out", type=Path, help="new directory to write")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} exists; name a new directory")
    try:
        add_vision_tower(args.source, args.out)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
