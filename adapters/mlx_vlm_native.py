"""mlx-vlm's own MTP drafter as a reference decoder for ``mtp-plugin bench`` (mlx-vlm ≥ 0.7: ``load_drafter``
with ``kind="mtp"``, the decoder behind ``--draft-kind mtp``), run on the same checkpoint.

Only read by the benchmark: nothing here patches mlx-vlm.
"""

from __future__ import annotations

from mtp_plugin.hookspecs import hookimpl
from mtp_plugin.stats import MTPStats

from .patching import release


class NativeMTP:
    """mlx-vlm's generation loop with its native MTP drafter (greedy)."""

    def __init__(self, model, drafter, generate_step, version: str):
        self.model, self.drafter, self.generate_step = model, drafter, generate_step
        self.name = f"mlx-vlm {version} native MTP"
        self.depth = None

    def stream(self, prompt, max_tokens, depth):
        """Greedy token ids; ``depth`` None: mlx-vlm's plain decoding, else blocks of ``depth`` drafts."""
        import mlx.core as mx

        self.depth = depth
        options = {} if depth is None else {"draft_model": self.drafter, "draft_kind": "mtp",
                                            "draft_block_size": depth + 1}
        steps = self.generate_step(mx.array([prompt]), self.model, None, None, max_tokens=max_tokens,
                                   temperature=0.0, **options)
        return (int(token) for token, _ in steps)

    def stats(self):
        """Counters of the last stream, from the drafter's per-round accepted counts."""
        if self.depth is None:
            return None
        stats = MTPStats(self.depth)
        drafted = getattr(self.drafter, "draft_lens", None) or [self.depth] * len(self.drafter.accept_lens)
        for accepted, depth in zip(self.drafter.accept_lens, drafted, strict=False):
            stats.record(int(accepted), int(accepted) + 1, int(depth))
        return stats


@hookimpl
def mtp_reference_decoders(model_dir, dtype):
    """mlx-vlm's native MTP decoder on ``model_dir``, or one line saying why it cannot run it; nothing when
    mlx-vlm is not installed."""
    try:
        import mlx_vlm
    except ImportError:
        return []
    version = ".".join(map(str, release("mlx-vlm")))
    try:
        from mlx_vlm.generate.ar import generate_step
        from mlx_vlm.speculative.drafters import load_drafter
    except ImportError:
        return [f"mlx-vlm {version}: no native MTP drafter in this version (it came with mlx-vlm 0.7)"]
    try:
        model, _ = mlx_vlm.load(str(model_dir))
        drafter, _ = load_drafter(str(model_dir), kind="mtp")
    except Exception as e:  # any failure of the other runtime is reported, never raised
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [f"mlx-vlm {version} native MTP cannot load {model_dir}: {reason}"]
    if dtype is not None:
        from mtp_plugin.bench import cast

        cast(model, dtype)
        cast(drafter, dtype)
    return [NativeMTP(model, drafter, generate_step, version)]
