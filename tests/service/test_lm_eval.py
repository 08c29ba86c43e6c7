"""EleutherAI's lm-evaluation-harness (`lm-eval`), unmodified, scoring a multiple-choice task
against a live `stepserve serve` on the default model through its `local-completions` model:
the harness asks for each choice's log-likelihood with `echo` and `logprobs` on
/v1/completions (the prompt's token ids, batched), and what it reads back (the per-choice
log-likelihood, whether the choice is the greedy continuation, the task's accuracy) equals
what `transformers` computes from the same GGUF file for exactly the token ids it sent.

The task (tests/service/data/lm_eval/) is a local YAML over a JSONL file of our own
questions; nothing is downloaded, and the tokenizer the harness splits context and
continuation with is stepserve's own, saved as a Hugging Face directory."""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TASK_DIR = Path(__file__).parent / "data" / "lm_eval"
TASK = "stepserve_qa"
# Both sides run the dequantized GGUF in float32, with different kernels and batches (the
# server's paged attention over batches of 8 prompts, transformers' sdpa over right-padded
# batches of 25): measured, the summed log-likelihoods differ by at most 3.2e-5 per scored
# token over the 100 choices. 2e-4 per token leaves room for other CPUs' matmul blocking and
# still fails on any real error: an off-by-one position or a lower precision anywhere moves
# a log-probability by 1e-2 or more.
PER_TOKEN_ATOL = 2e-4
BATCH_SIZE = 8  # prompts per request: the harness sends lists of token-id lists


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Hugging Face libraries kept off the network; returns a cache dir for `datasets`."""
    mp = pytest.MonkeyPatch()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(name, "1")
    mp.setenv("TOKENIZERS_PARALLELISM", "false")
    yield tmp_path_factory.mktemp("hf_datasets")
    mp.undo()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """stepserve's tokenizer (the server's) as an HF directory the harness loads offline."""
    out = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference_model(offline: Path) -> Any:
    """transformers' own forward over the default GGUF, dequantized to float32."""
    from transformers import AutoModelForCausalLM

    from common.model_files import resolve_model_path

    path = resolve_model_path(None)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def task_config(cache_dir: Path) -> dict[str, Any]:
    """The task's YAML with its data file made absolute (it is relative to the YAML's dir)
    and the `datasets` cache in the test's tmp dir."""
    config = yaml.safe_load((TASK_DIR / f"{TASK}.yaml").read_text())
    data_files = {split: str(TASK_DIR / name) for split, name in config["dataset_kwargs"]["data_files"].items()}
    config["dataset_kwargs"] = {"data_files": data_files, "cache_dir": str(cache_dir)}
    return config


@pytest.fixture(scope="module")
def evaluation(live_server: Any, tokenizer_dir: Path, offline: Path) -> tuple[dict[str, Any], Any, list[tuple[list[list[int]], Any]]]:
    """The harness's results (samples logged), its model object, and every (prompts, response
    body) it exchanged with the server."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(
        base_url=live_server.url + "/v1/completions", model=MODEL, tokenizer=str(tokenizer_dir),
        tokenizer_backend="huggingface", batch_size=BATCH_SIZE, num_concurrent=1, max_retries=1, timeout=120,
    )
    exchanged: list[tuple[list[list[int]], Any]] = []
    call = lm.model_call

    def recording_call(messages: Any, **kwargs: Any) -> Any:
        body = call(messages=messages, **kwargs)
        exchanged.append((messages, body))
        return body

    lm.model_call = recording_call  # type: ignore[method-assign]
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[task_config(offline)], task_manager=TaskManager(include_defaults=False),
        log_samples=True, bootstrap_iters=0, cache_requests=False,
    )
    assert results is not None
    return results, lm, exchanged


Scores = tuple[float, bool, float]  # log-likelihood, greedy, the top-two margin
Pair = tuple[tuple[int, ...], tuple[int, ...]]  # (context ids, continuation ids)


@pytest.fixture(scope="module")
def reference(evaluation: tuple[dict[str, Any], Any, list[Any]], reference_model: Any) -> dict[Pair, Scores]:
    """transformers' scores of every (context, continuation) the harness asked about, keyed
    by the token ids the harness's own split gives (`_encode_pair`, what it sent)."""
    results, lm, _ = evaluation
    pairs = [lm._encode_pair(ctx, cont) for sample in results["samples"][TASK] for ctx, cont in sample["arguments"]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on two shared cores, one thread runs these small matmuls far faster
    try:
        return reference_scores(reference_model, [(tuple(ctx), tuple(cont)) for ctx, cont in pairs])
    finally:
        torch.set_num_threads(threads)


def reference_scores(model: Any, pairs: list[Pair], batch: int = 25) -> dict[Pair, Scores]:
    """Per pair: (log-likelihood of the continuation after the context, whether it is the
    greedy continuation, the smallest gap between the top two log-probabilities at its
    positions), from right-padded batches (the padding is masked and comes after every
    scored position, so no scored position sees it)."""
    scores: dict[Pair, Scores] = {}
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        width = max(len(ctx) + len(cont) for ctx, cont in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (ctx, cont) in enumerate(chunk):
            ids[row, : len(ctx) + len(cont)] = torch.tensor(ctx + cont)
            mask[row, : len(ctx) + len(cont)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits
        for row, (ctx, cont) in enumerate(chunk):
            logprobs = torch.log_softmax(logits[row, len(ctx) - 1 : len(ctx) + len(cont) - 1].double(), dim=-1)
            want = torch.tensor(cont)
            top2 = logprobs.topk(2, dim=-1).values
            loglik = float(logprobs.gather(1, want[:, None]).sum())
            greedy = bool((logprobs.argmax(dim=-1) == want).all())
            scores[ctx, cont] = (loglik, greedy, float((top2[:, 0] - top2[:, 1]).min()))
    return scores


def test_requests_are_the_harness_log_likelihood_shape(evaluation: tuple[dict[str, Any], Any, list[Any]]) -> None:
    """Each request the harness sent was answered with one choice per prompt, echoing the
    prompt's tokens with their log-probabilities (None for the first) and one generated
    token, each position with its top-1 log-probability."""
    results, _, exchanged = evaluation
    num_requests = sum(len(s["arguments"]) for s in results["samples"][TASK])
    assert sum(len(prompts) for prompts, _ in exchanged) == num_requests
    assert all(len(prompts) <= BATCH_SIZE for prompts, _ in exchanged) and any(len(p) > 1 for p, _ in exchanged)
    for prompts, body in exchanged:
        assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
        for prompt, choice in zip(prompts, body["choices"], strict=True):
            logprobs = choice["logprobs"]
            assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(prompt) + 1
            assert logprobs["token_logprobs"][0] is None
            assert all(isinstance(lp, float) and lp <= 0.0 for lp in logprobs["token_logprobs"][1:])
            assert all(len(top) >= 1 for top in logprobs["top_logprobs"][1:])


def test_harness_tokenizes_as_the_server_does(evaluation: tuple[dict[str, Any], Any, list[Any]], live_server: Any) -> None:
    """What the harness sent for (context, continuation) is the server's own tokenization of
    their concatenation (/tokenize, no special tokens): the saved tokenizer is the server's."""
    results, _, exchanged = evaluation
    sent = {tuple(prompt) for prompts, _ in exchanged for prompt in prompts}
    for sample in results["samples"][TASK][:8]:
        for context, continuation in sample["arguments"]:
            body = json.dumps({"model": MODEL, "prompt": context + continuation, "add_special_tokens": False}).encode()
            req = urllib.request.Request(live_server.url + "/tokenize", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert tuple(json.loads(resp.read())["tokens"]) in sent, (context, continuation)


def test_log_likelihoods_match_transformers(evaluation: tuple[dict[str, Any], Any, list[Any]], reference: dict[Pair, Scores]) -> None:
    """Per choice: the harness's log-likelihood is transformers' within PER_TOKEN_ATOL per
    scored token, and its is_greedy flag is transformers' argmax check, for exactly the ids
    it sent."""
    results, lm, exchanged = evaluation
    sent = {tuple(prompt) for prompts, _ in exchanged for prompt in prompts}
    greedy = []
    for sample in results["samples"][TASK]:
        for (context, continuation), (loglik, is_greedy) in zip(sample["arguments"], sample["filtered_resps"], strict=True):
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            assert tuple(ctx_ids + cont_ids) in sent, (context, continuation)
            want, want_greedy, margin = reference[tuple(ctx_ids), tuple(cont_ids)]
            where = f"doc {sample['doc_id']}: {context!r} + {continuation!r}"
            assert math.isclose(loglik, want, rel_tol=0.0, abs_tol=PER_TOKEN_ATOL * len(cont_ids)), (where, loglik, want)
            if margin > PER_TOKEN_ATOL:  # an argmax closer than the tolerance may fall either way
                assert is_greedy == want_greedy, where
            greedy.append(want_greedy)
    assert any(greedy) and not all(greedy)  # the flag was checked both ways


def test_accuracy_matches_transformers(evaluation: tuple[dict[str, Any], Any, list[Any]], reference: dict[Pair, Scores]) -> None:
    """The accuracy the harness reports, and each item's, is what transformers' log-likelihoods give."""
    results, lm, _ = evaluation
    samples = results["samples"][TASK]
    assert len(samples) == len((TASK_DIR / "questions.jsonl").read_text().splitlines())
    correct = 0
    for sample in samples:
        pairs = [lm._encode_pair(ctx, cont) for ctx, cont in sample["arguments"]]
        scores = [reference[tuple(ctx), tuple(cont)][0] for ctx, cont in pairs]
        right = max(range(len(scores)), key=scores.__getitem__) == sample["target"]
        assert sample["acc"] == float(right), sample["doc_id"]
        correct += right
    assert results["results"][TASK]["acc,none"] == pytest.approx(correct / len(samples))
