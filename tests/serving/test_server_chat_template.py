"""`hf-alibi serve` on a base checkpoint (its tokenizer has no chat template, as every checkpoint the recipe trains):
chat requests are a 400 that names the cause and the way out, where transformers' handler answers a bare 500; the
same server answers completions as ever. Checked with the real `openai` client against a real server."""

import openai
import pytest

from server_process import request, started
from tiny_checkpoint import MAX_TOKENS, Reference, save_tiny_checkpoint

pytestmark = pytest.mark.slow
TIMEOUT_S = 30
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(folder, offline reference, openai client, server) for a base checkpoint."""
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("base") / "alibi-base", chat_template=False)
    for server in started(folder, tmp_path_factory.mktemp("server") / "server.log"):
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=TIMEOUT_S, max_retries=0
        )
        yield folder, Reference(folder), client, server


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_without_a_chat_template_is_a_400_naming_the_cause_and_the_completions_endpoint(served, stream):
    folder, reference, client, _ = served
    assert reference.tokenizer.chat_template is None
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=str(folder), messages=MESSAGES, max_tokens=MAX_TOKENS, stream=stream)
    assert raised.value.status_code == 400
    assert "no chat template" in str(raised.value) and "/v1/completions" in str(raised.value), raised.value


def test_responses_without_a_chat_template_is_the_same_400(served):
    folder, _, _, server = served
    status, answer = request(
        server.port, "POST", "/v1/responses", {"model": str(folder), "input": "hello"}, timeout=TIMEOUT_S
    )
    assert status == 400 and "no chat template" in str(answer), (status, answer)


def test_completions_of_a_base_checkpoint_are_the_offline_greedy_text(served):
    folder, reference, client, _ = served
    answer = client.completions.create(model=str(folder), prompt="the quick", max_tokens=MAX_TOKENS)
    assert answer.choices[0].text == reference.completion("the quick")
