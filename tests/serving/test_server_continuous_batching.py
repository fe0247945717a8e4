"""`hf-alibi serve --continuous-batching`: concurrent requests, batched on transformers' paged attention cache,
each get exactly the offline greedy text, streamed or not. A GPT-2 of the same shape is served by the same command
(any checkpoint `AutoModelForCausalLM` loads), which also shows that the test asks only what transformers' continuous
batching delivers (transformers' own GPT-2 passes it too)."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import openai
import pytest
from server_process import started
from tiny_checkpoint import MAX_TOKENS, Reference, checkpoint, save_tiny_checkpoint  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow
# Small paged cache: transformers' defaults size it from the device memory, which takes long on a CPU.
CB_FLAGS = ("--continuous-batching", "--cb-num-blocks", "64", "--cb-block-size", "16", "--cb-max-batch-tokens", "256")
PROMPTS = ["the quick", "hello world", "how are", "fox"]


@pytest.fixture(scope="module", params=["gpt2", "alibi_gpt2"])
def served(request, checkpoint, tmp_path_factory):
    """(folder, offline reference, openai client) of a continuous-batching server for each family."""
    if request.param == "alibi_gpt2":
        folder = checkpoint
    else:
        folder = save_tiny_checkpoint(tmp_path_factory.mktemp("gpt2") / "gpt2-tiny", family="gpt2")
    for server in started(folder, tmp_path_factory.mktemp("cb") / "server.log", *CB_FLAGS):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=60, max_retries=0)
        yield folder, Reference(folder), client


def test_concurrent_requests_batched_continuously_each_get_the_offline_greedy_text(served):
    folder, reference, client = served

    def ask(prompt: str, stream: bool) -> str:
        answer = client.completions.create(model=str(folder), prompt=prompt, max_tokens=MAX_TOKENS, stream=stream)
        return "".join(chunk.choices[0].text for chunk in answer if chunk.choices) if stream else answer.choices[0].text

    expected = {prompt: reference.completion(prompt) for prompt in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {pool.submit(ask, prompt, index % 2 == 1): prompt for index, prompt in enumerate(PROMPTS)}
        answers = {futures[future]: future.result() for future in as_completed(futures, timeout=120)}
    wrong = {prompt: (answers[prompt], expected[prompt]) for prompt in PROMPTS if answers[prompt] != expected[prompt]}
    assert not wrong, wrong


def test_a_forward_that_fails_under_continuous_batching_answers_an_error_not_an_empty_completion(checkpoint, tmp_path):
    """transformers' continuous batching catches a forward's exception and marks its requests failed; the server
    answers them with an error. Here the config asks every forward for attention weights, which our forward refuses
    under continuous batching (a paged cache has no eager path)."""
    folder = Path(shutil.copytree(checkpoint, tmp_path / "weights-asked"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "output_attentions": True}))
    for server in started(folder, tmp_path / "server.log", *CB_FLAGS):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=60, max_retries=0)
        with pytest.raises(openai.InternalServerError):  # a 500, where an empty completion would have been a 200
            client.completions.create(model=str(folder), prompt="fox", max_tokens=MAX_TOKENS)
    log = (tmp_path / "server.log").read_text()  # complete once the server has stopped
    assert "output_attentions is not available under continuous batching" in log, log[-3000:]
