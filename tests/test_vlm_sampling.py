"""Sampling with MTP in mlx-vlm draws from exactly the distribution of mlx-vlm's own sampler.

A small-vocabulary float32 mlx-vlm model with a random head (drafts accepted and rejected often): generated
tokens 2 and 3 under MTP and under stock mlx-vlm (``enable_mtp=False``, the sampler ``generate_step`` builds)
are compared by a two-sample chi-square test, with the filters of ``make_sampler``. The other sampler
``generate_step`` chooses from, the position-keyed sampler of a seeded request (temperature before the nucleus),
needs no statistics: its tokens are mlx-vlm's own at every depth, seed for seed.
"""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import build_head, build_model, config_for, save_checkpoint, trunk_weights
from mlx_vlm.utils import load_model
from mtp_plugin.adapters.patching import release
from scipy.stats import chi2_contingency

VOCAB = 24
PROMPT = [3, 9, 1, 17]
RUNS = 1000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = config_for("qwen3_5", vision=True)
    config.update(image_token_id=VOCAB - 3, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 1)
    config["text_config"]["vocab_size"] = VOCAB
    built = build_model(config, "mlx_vlm", seed=3)
    path = save_checkpoint(tmp_path_factory.mktemp("small-vlm"), config, trunk_weights(built),
                           build_head(built, config), "mtp.safetensors")
    return load_model(path)


def sample(model, options: dict, **mtp) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Tokens 2 and 3 of ``RUNS`` generations, and the drafts accepted and drafted over all of them."""
    generate_step = importlib.import_module("mlx_vlm.generate").generate_step
    mx.random.seed(1234)
    out, accepted, drafted = [], 0, 0
    for _ in range(RUNS):
        out.append([t for t, _ in generate_step(mx.array([PROMPT]), model, None, None, max_tokens=3,
                                                **options, **mtp)][1:])
        stats = model.mtp_head.stats
        accepted, drafted = accepted + (stats.accepted if stats else 0), drafted + (stats.drafted if stats else 0)
    return np.array(out)[:, 0], np.array(out)[:, 1], accepted, drafted


def same_distribution_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square p-value over token ids (ids seen fewer than 10 times in both pooled)."""
    counts = np.stack([np.bincount(a, minlength=VOCAB), np.bincount(b, minlength=VOCAB)])
    keep = counts.sum(0) >= 10
    table = np.concatenate([counts[:, keep], counts[:, ~keep].sum(1, keepdims=True)], axis=1)
    return chi2_contingency(table[:, table.sum(0) > 0]).pvalue


SAMPLERS = [({"temperature": 1.0}, 2), ({"temperature": 0.8, "top_p": 0.9, "min_p": 0.02, "top_k": 12}, 3)]


@pytest.mark.parametrize("options,depth", SAMPLERS)
def test_mtp_sampling_matches_mlx_vlm_sampler(model, options, depth):
    stock = sample(model, options, enable_mtp=False)
    mtp = sample(model, options, mtp_depth=depth)
    assert stock[2:] == (0, 0) and 0 < mtp[2] < mtp[3]  # both acceptance and the residual path were exercised
    assert same_distribution_p(stock[0], mtp[0]) > 1e-3
    assert same_distribution_p(stock[1], mtp[1]) > 1e-3


SEEDED = [{"temperature": 0.9}, {"temperature": 0.8, "top_p": 0.9}, {"temperature": 0.5, "top_p": 0.5},
          {"temperature": 0.9, "repetition_penalty": 1.3}] + \
    ([{"temperature": 0.8, "top_p": 0.9, "top_k": 10}] if release("mlx-vlm") >= (0, 7) else [])


def test_seeded_request_gets_mlx_vlms_own_tokens(model):
    """mlx-vlm keys a seeded request's draws by token position: with MTP the same seed gives mlx-vlm's own
    tokens, at every depth and adaptive (each emitted token is mlx-vlm's draw there; a draft is accepted iff it
    equals it), for every seeded sampler, also with a logits processor (the verify pass read position by position)."""
    generate_step = importlib.import_module("mlx_vlm.generate").generate_step
    accepted = 0
    for options in SEEDED:
        def run(options=options, **mtp):
            return [t for t, _ in generate_step(mx.array([PROMPT]), model, None, None, max_tokens=30, seed=11,
                                                **options, **mtp)]

        stock = run(enable_mtp=False)
        assert len(set(stock)) > 3, options  # sampled, not near-greedy
        for depth in (1, 3, None):
            assert run(mtp_depth=depth) == stock, (options, depth)
            accepted += model.mtp_head.stats.accepted
    assert accepted > 0  # some drafts matched mlx-vlm's draws: multi-token blocks were emitted


@pytest.mark.skipif(release("mlx-vlm") < (0, 7), reason="mlx-vlm 0.6 has no checkpoint sampling defaults")
def test_checkpoint_sampling_defaults_are_used(model, monkeypatch):
    """mlx-vlm 0.7 fills an unset temperature from the checkpoint's generation defaults: MTP samples then too."""
    ar = importlib.import_module("mlx_vlm.generate.ar")
    monkeypatch.setattr(ar, "resolve_sampling_defaults", lambda config, temperature, top_p, top_k: (0.9, top_p, top_k))
    generate_step = importlib.import_module("mlx_vlm.generate").generate_step
    runs = {tuple(t for t, _ in generate_step(mx.array([PROMPT]), model, None, None, max_tokens=12, mtp_depth=2))
            for _ in range(4)}
    assert len(runs) > 1 and model.mtp_head.stats.drafted > 0


def server_batch_tokens(model, wrapped: bool, args, batches: int, rows: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Tokens 2 and 3 of ``batches`` × ``rows`` generations of ``PROMPT``, ``rows`` at once, by the generator mlx-vlm's
    server builds for a request with ``args`` (``wrapped``: the plugin's, else mlx-vlm's own)."""
    from mlx_vlm.server.generation import ResponseGenerator
    from mlx_vlm.utils import StoppingCriteria

    generation = importlib.import_module("mlx_vlm.server.generation")
    factory = generation.BatchGenerator if wrapped else importlib.import_module("mlx_vlm.generate.ar").BatchGenerator
    server = type("Server", (), {"model": model})()
    processor = type("Processor", (), {"tokenizer": type("Tokenizer", (), {})()})()
    processor.tokenizer.stopping_criteria = StoppingCriteria([], None)  # a vocabulary of 24 ids: no end token
    fields = model.get_input_embeddings(mx.array([PROMPT]), None).to_dict()
    keywords = {k: v for k, v in fields.items() if v is not None}
    mx.random.seed(4321)
    out = []
    for _ in range(batches):  # the server's own calls: its sampler, then each request's processors carrying its options
        generator = factory(model.language_model, processor, sampler=ResponseGenerator._make_sampler(server, args),
                            compute_logprobs=False)
        tokens = {}
        for _ in range(rows):
            processors = ResponseGenerator._make_logits_processors(server, args)
            tokens.update({uid: [] for uid in generator.insert([PROMPT], max_tokens=3, prompt_kwargs=[keywords],
                                                               logits_processors=[processors])})
        while generator.has_work:
            for r in generator.next()[1]:
                tokens[r.uid].append(r.token)
        generator.close()
        out += [t[1:3] for t in tokens.values()]
    return np.array(out)[:, 0], np.array(out)[:, 1]


def test_server_batch_rows_sample_as_mlx_vlms_batch(model):
    """Rows of mlx-vlm's server batch sampled with ``make_sampler`` (typical-p: exact speculative sampling, drafting
    at depth 2, four rows a batch) draw tokens 2 and 3 from the distribution of mlx-vlm's own batch (chi-square)."""
    from mlx_vlm.server.generation import GenerationArguments
    from mtp_plugin.adapters.mlx_lm_server import MTPRequest

    args = GenerationArguments(temperature=1.0, typical_p=0.95, max_tokens=3)
    args.mtp = MTPRequest(None, 2)
    stock = server_batch_tokens(model, False, args, RUNS // 4)
    mtp = server_batch_tokens(model, True, args, RUNS // 4)
    ctx = model.language_model.mtp_state.batching
    assert not ctx.failed and 0 < ctx.accepted < ctx.drafted  # acceptance and the residual path were exercised
    assert same_distribution_p(stock[0], mtp[0]) > 1e-3
    assert same_distribution_p(stock[1], mtp[1]) > 1e-3
