"""One rank of a two-rank MTP run under ``mlx.launch`` (``tests/test_distributed.py``): the model loaded by mlx-lm's
``sharded_load`` (``pipeline`` or ``tensor``), decoded by ``stream_generate`` stock and with MTP, its results written
as ``rank{r}.json`` in the output folder.

Usage: ``mlx.launch --backend ring -n 2 -- python distributed_run.py MODEL_DIR {pipeline,tensor} OUT_DIR [hub]``

With ``hub``, MODEL_DIR is served as a Hub repository (``hub.py``) into a snapshot folder per rank, so each rank gets
the files ``sharded_load``'s download filter gives it (listed in its results).
"""

import json
import logging
import sys
from pathlib import Path

import hub
import huggingface_hub.constants
import mlx.core as mx
import mlx_lm.utils
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import sharded_load

import mtp_plugin.head.health
from mtp_plugin.decoding.lockstep import LockstepError
from mtp_plugin.decoding.lookup import LookupSettings

PROMPT = "def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"\n    with open(path) as f:\n"
MAX_TOKENS = 32
FORCED = LookupSettings(slope=0.0, first_prior=0.99)  # every match drafted: lookup cycles beside the head's
mtp_plugin.head.health.PROBE_DRAFTS = 0  # random heads keep drafting: every cycle is a verify pass to keep in lockstep


def main() -> None:
    model_dir, sharding, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    group = mx.distributed.init()
    source, files = str(model_dir), None
    if sys.argv[4:] == ["hub"]:
        huggingface_hub.constants.HF_HUB_OFFLINE = False  # the Hub is this local folder, whatever the environment
        snapshot = out / f"snapshot-rank{group.rank()}"
        mlx_lm.utils.snapshot_download = hub.snapshot_download(model_dir, snapshot)
        source = hub.REPO_ID
    model, tokenizer = sharded_load(source, group if sharding == "pipeline" else None,
                                    group if sharding == "tensor" else None)
    if source == hub.REPO_ID:
        files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    prompt = [t % vocab for t in tokenizer.encode(PROMPT)]  # the distilled next-n model has 256 tokens

    def run(max_tokens: int = MAX_TOKENS, prompt: list[int] = prompt, **options) -> dict:
        tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **options)]
        stats = model.mtp_head.stats if model.mtp_head is not None else None
        return {"tokens": tokens, "drafted": stats.drafted if stats is not None else 0,
                "looked": stats.lookup_drafted if stats is not None else 0}

    subset = model.mtp_head.draft_vocab.size if model.mtp_head and model.mtp_head.draft_vocab else None
    results = {"head": model.mtp_head is not None, "files": files, "draft vocabulary": subset,
               "stock": run(enable_mtp=False), "depth 1": run(mtp_depth=1), "depth 3": run(mtp_depth=3),
               "adaptive": run(), "lookup": run(mtp_depth=2, mtp_lookup=FORCED)}
    mx.random.seed(100 + group.rank())  # seeds that differ by rank: the plugin shares rank 0's
    results["sampled"] = run(mtp_depth=2, sampler=make_sampler(0.8))
    mx.random.seed(5)
    results["sampled, seed 5"] = run(mtp_depth=2, sampler=make_sampler(0.8))
    mx.random.seed(5)
    results["sampled, seed 5 again"] = run(mtp_depth=2, sampler=make_sampler(0.8))
    for name, options in {"disagreement": {"max_tokens": MAX_TOKENS - 4 * group.rank(), "mtp_lookup": False},
                          "lookup disagreement": {"max_tokens": MAX_TOKENS - 4 * group.rank(), "mtp_lookup": FORCED},
                          "prompt disagreement": {"prompt": prompt[group.rank():]}}.items():  # before the prefill
        try:
            run(mtp_depth=2, **options)
            results[name] = None
        except LockstepError as e:
            results[name] = str(e)
    warnings = []  # rank 1 without the draft vocabulary rank 0 has: every rank drops it, rank 0 says so
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("mtp_plugin").addHandler(handler)
    if group.rank() == 1 and model.mtp_head.draft_vocab is not None:
        model.mtp_head.draft_vocab = None
    results["one rank's draft vocabulary"] = {**run(mtp_depth=2), "warnings": warnings,
                                              "draft vocabulary": model.mtp_head.draft_vocab}
    (out / f"rank{group.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
