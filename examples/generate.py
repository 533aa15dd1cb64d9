"""Generate with MTP speculative decoding on the bundled tiny checkpoint, and check it is lossless.

    python examples/generate.py [--model DIR] [--depth N] [--max-tokens N]

Loads the 4-bit conversion (trunk) with its sidecar head through plain ``mlx_lm.load``, generates
greedily with the head drafting and the trunk verifying, prints mlx-lm's figures plus the MTP line,
then generates again without MTP and reports whether the texts are identical (exit 1 if not).
"""

import argparse
from pathlib import Path

import mtp_plugin

DEFAULT_MODEL = Path(__file__).resolve().parent / "tiny-qwen3_5" / "mlx-4bit"
PROMPT = 'def load_config(path):\n    """Read a JSON configuration file and return it as a dict."""\n'


def main() -> None:
    """Parse arguments, generate with and without MTP, compare."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    mtp_plugin.patch()  # already done by the post-import hook when installed; explicit is harmless
    from mlx_lm import generate, load

    model, tokenizer = load(str(args.model))
    if model.mtp_head is None:
        raise SystemExit(f"{args.model}: no usable MTP head; run `mtp-plugin inspect {args.model}`")
    text = generate(model, tokenizer, PROMPT, max_tokens=args.max_tokens, verbose=True, mtp_depth=args.depth)
    plain = generate(model, tokenizer, PROMPT, max_tokens=args.max_tokens, enable_mtp=False)
    print(f"lossless: MTP text {'==' if text == plain else '!='} plain decoding text")
    if text != plain:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
