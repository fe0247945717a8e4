"""`hf-alibi serve --continuous-batching`: concurrent requests, batched on transformers' paged attention cache,
each get exactly the offline greedy text, streamed or not. A GPT-2 of the same shape is served by the same command
(any checkpoint `AutoModelForCausalLM` loads), which also shows that the test asks only what transformers' continuous
batching delivers (transformers' own GPT-2 passes it too). The ALiBi server runs with `--continuous-batching` alone:
its paged cache takes the stated defaults, not the machine's free memory, and its peak resident memory shows it."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import openai
import pytest

from server_process import group_peak_resident_kb, started
from tiny_checkpoint import MAX_TOKENS, Reference, checkpoint, save_tiny_checkpoint  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow
# A paged cache sized by flags (GPT-2), and by hf-alibi serve's defaults alone (ALiBi).
CB_FLAGS = {
    "gpt2": ("--continuous-batching", "--cb-num-blocks", "64", "--cb-block-size", "16", "--cb-max-batch-tokens", "256"),
    "alibi_gpt2": ("--continuous-batching",),
}
# The default cache of the tiny model is ~35 MB and its masks ~140 MB; torch, transformers and the server ~0.6 GB.
# Sized from free memory (transformers' own default) it took GBs: 14.7 GB on a 2-layer model.
PEAK_RESIDENT_LIMIT_GB = 2.0
PROMPTS = ["the quick", "hello world", "how are", "fox"]


@pytest.fixture(scope="module", params=["gpt2", "alibi_gpt2"])
def served(request, checkpoint, tmp_path_factory):
    """(folder, offline reference, openai client) of a continuous-batching server for each family."""
    if request.param == "alibi_gpt2":
        folder = checkpoint
    else:
        folder = save_tiny_checkpoint(tmp_path_factory.mktemp("gpt2") / "gpt2-tiny", family="gpt2")
    for server in started(folder, tmp_path_factory.mktemp("cb") / "server.log", *CB_FLAGS[request.param]):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=60, max_retries=0)
        yield folder, Reference(folder), client, server


def test_concurrent_requests_batched_continuously_each_get_the_offline_greedy_text(served):
    folder, reference, client, _ = served

    def ask(prompt: str, stream: bool) -> str:
        answer = client.completions.create(model=str(folder), prompt=prompt, max_tokens=MAX_TOKENS, stream=stream)
        return "".join(chunk.choices[0].text for chunk in answer if chunk.choices) if stream else answer.choices[0].text

    expected = {prompt: reference.completion(prompt) for prompt in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {pool.submit(ask, prompt, index % 2 == 1): prompt for index, prompt in enumerate(PROMPTS)}
        answers = {futures[future]: future.result() for future in as_completed(futures, timeout=120)}
    wrong = {prompt: (answers[prompt], expected[prompt]) for prompt in PROMPTS if answers[prompt] != expected[prompt]}
    assert not wrong, wrong


def test_paged_cache_is_bounded_whatever_the_machine_has_free(served):
    """Peak resident memory of each process of the server (the model's own process too, on transformers 5.25+), by
    the kernel's count, once a request has made it allocate its paged cache (on the first request, or at start)."""
    folder, reference, client, server = served
    assert client.completions.create(model=str(folder), prompt="fox", max_tokens=4).choices[0].text == (
        reference.completion("fox", 4)
    )
    if not Path(f"/proc/{server.process.pid}/status").exists():
        pytest.skip("needs Linux's /proc to read a process's peak resident memory")
    peaks_kb = group_peak_resident_kb(server.pgid)
    assert server.process.pid in peaks_kb, peaks_kb
    assert max(peaks_kb.values()) / 1e6 < PEAK_RESIDENT_LIMIT_GB, (peaks_kb, server.output())


def test_a_forward_that_fails_under_continuous_batching_answers_an_error_not_an_empty_completion(checkpoint, tmp_path):
    """transformers' continuous batching catches a forward's exception and marks its requests failed; the server
    answers them with an error. Here the config asks every forward for attention weights, which our forward refuses
    under continuous batching (a paged cache has no eager path)."""
    folder = Path(shutil.copytree(checkpoint, tmp_path / "weights-asked"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "output_attentions": True}))
    for server in started(folder, tmp_path / "server.log", *CB_FLAGS["alibi_gpt2"]):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=60, max_retries=0)
        with pytest.raises(openai.InternalServerError):  # a 500, where an empty completion would have been a 200
            client.completions.create(model=str(folder), prompt="fox", max_tokens=MAX_TOKENS)
    log = (tmp_path / "server.log").read_text()  # complete once the server has stopped
    assert "output_attentions is not available under continuous batching" in log, log[-3000:]
