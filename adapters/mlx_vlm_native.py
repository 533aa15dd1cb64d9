"""mlx-vlm decoders for ``mtp-plugin bench``: mlx-vlm's own MTP drafter (``load_drafter(kind="mtp")``, behind
``--draft-kind mtp``; 0.6.8 and 0.7) and, on a checkpoint with a vision tower, image prompts decoded by this plugin's
loop and by that drafter. Read only by the benchmark: nothing here patches mlx-vlm."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mtp_plugin.decoding.stats import MTPStats
from mtp_plugin.hookspecs import hookimpl

from .patching import release

IMAGE_GRID = (1, 16, 16)  # temporal, height, width patches of the synthetic image (64 tokens after a 2x2 merge)


@dataclass
class ImagePrompt:
    """A synthetic image put before every prompt: ``prefix`` token ids (vision start, image tokens, vision end where
    the checkpoint has one), ``pixel_values`` (patches, channels * temporal * patch²) float32 seeded normal noise, and
    ``keywords`` for ``generate_step`` (``image_grid_thw`` (1, 3))."""

    prefix: list[int]
    pixel_values: mx.array
    keywords: dict = field(default_factory=dict)

    @classmethod
    def for_model(cls, model) -> ImagePrompt | None:
        """The image for ``model``'s vision tower (Qwen-VL patch layout), None without one."""
        config = getattr(model, "config", None)
        vision = getattr(config, "vision_config", None)
        if getattr(model, "vision_tower", None) is None or vision is None or config.image_token_id is None:
            return None
        t, h, w = IMAGE_GRID
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        tokens = t * h * w // vision.spatial_merge_size ** 2
        end = getattr(config, "vision_end_token_id", None)
        prefix = [config.vision_start_token_id, *[config.image_token_id] * tokens, *([end] if end is not None else [])]
        pixels = mx.random.normal((t * h * w, patch), key=mx.random.key(0))
        return cls(prefix, pixels, {"image_grid_thw": mx.array([IMAGE_GRID])})


class VLMDecoder:
    """mlx-vlm's generation loop (greedy) on one checkpoint: with its native MTP drafter (``drafter``) or with
    this plugin's head (``drafter`` None), optionally with ``image`` before every prompt."""

    def __init__(self, model, generate_step, name: str, drafter=None, image: ImagePrompt | None = None):
        self.model, self.generate_step, self.name = model, generate_step, name
        self.drafter, self.image, self.depth = drafter, image, None

    def stream(self, prompt, max_tokens, depth):
        """Greedy token ids; ``depth`` None: mlx-vlm's plain decoding, else blocks of ``depth`` drafts."""
        self.depth = depth
        if depth is None:
            options = {"enable_mtp": False}  # stock mlx-vlm (the plugin would decode with MTP by default)
        elif self.drafter is not None:
            options = {"draft_model": self.drafter, "draft_kind": "mtp", "draft_block_size": depth + 1}
        else:
            options = {"mtp_depth": depth}
        image = self.image
        ids = prompt if image is None else image.prefix + list(prompt)
        steps = self.generate_step(mx.array([ids]), self.model, None if image is None else image.pixel_values, None,
                                   max_tokens=max_tokens, temperature=0.0, **(image.keywords if image else {}),
                                   **options)
        return (int(token) for token, _ in steps)

    def stats(self):
        """Counters of the last stream: the plugin's own, or the native drafter's per-round accepted counts."""
        if self.depth is None:
            return None
        if self.drafter is None:
            return self.model.mtp_head.stats
        stats = MTPStats(self.depth)
        drafted = getattr(self.drafter, "draft_lens", None) or [self.depth] * len(self.drafter.accept_lens)
        for accepted, depth in zip(self.drafter.accept_lens, drafted, strict=False):
            stats.record(int(accepted), int(accepted) + 1, int(depth))
        return stats


def _reason(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@hookimpl
def mtp_reference_decoders(model_dir, dtype):
    """mlx-vlm's decoders on ``model_dir``: its native MTP on text prompts, and where the checkpoint has a vision
    tower, this plugin's decoding and the native MTP on image prompts; one line for what cannot run, and why;
    nothing when mlx-vlm is not installed."""
    try:
        import mlx_vlm
    except ImportError:
        return []
    from mlx_vlm.generate.ar import generate_step

    from mtp_plugin.commands.bench import cast

    version = ".".join(map(str, release("mlx-vlm")))
    try:
        from mlx_vlm.speculative.drafters import load_drafter
    except ImportError:
        load_drafter = None
    try:
        model, _ = mlx_vlm.load(str(model_dir))
    except Exception as e:  # any failure of the other runtime is reported, never raised
        return [f"mlx-vlm {version} cannot load {model_dir}: {_reason(e)}"]
    if dtype is not None:
        cast(model, dtype)
    drafter, decoders = None, []
    if load_drafter is None:
        decoders.append(f"mlx-vlm {version}: no native MTP drafter in this version")
    else:
        try:
            drafter, _ = load_drafter(str(model_dir), kind="mtp")
        except Exception as e:  # any failure of the other runtime is reported, never raised
            decoders.append(f"mlx-vlm {version} native MTP cannot load {model_dir}: {_reason(e)}")
        else:
            if dtype is not None:
                cast(drafter, dtype)
            decoders.append(VLMDecoder(model, generate_step, f"mlx-vlm {version} native MTP", drafter))
    image = ImagePrompt.for_model(model)
    if image is not None and getattr(model, "mtp_head", None) is not None:
        decoders.append(VLMDecoder(model, generate_step, f"mlx-vlm {version} + mtp_plugin, image prompts",
                                   image=image))
    if image is not None and drafter is not None:
        decoders.append(VLMDecoder(model, generate_step, f"mlx-vlm {version} native MTP, image prompts", drafter,
                                   image))
    return decoders
