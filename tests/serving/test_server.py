"""`hf-alibi serve` as a real process on 127.0.0.1, used by the real `openai` client: completions and chat, streamed
or not, are exactly the offline greedy text; 16 concurrent clients each get their own; bad requests are a 4xx
naming the field and the server keeps serving; a client leaving mid-stream disturbs nobody; SIGTERM ends the server
with no process left. One server for the module; every request is bounded in time."""

import http.client
import json
import signal
from concurrent.futures import ThreadPoolExecutor, as_completed

import openai
import pytest

from server_process import STOP_DEADLINE_S, ServerProcess, group_gone, request, started
from tiny_checkpoint import MAX_TOKENS, checkpoint, reference  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow
TIMEOUT_S = 30  # any one request; the tiny model answers in well under a second
MESSAGES = [{"role": "system", "content": "how are you"}, {"role": "user", "content": "hello world"}]
# A stream far longer than a test waits for (end of text ignored; transformers' own field), which the module's
# server allows: were it not cancelled when its client leaves, it would hold the one generation thread for minutes.
LIMIT = 100_000
ENDLESS = json.dumps({"do_sample": False, "max_new_tokens": LIMIT, "min_new_tokens": LIMIT})


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    yield from started(checkpoint, tmp_path_factory.mktemp("server") / "server.log", "--max-tokens-limit", str(LIMIT))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=TIMEOUT_S, max_retries=0)


def test_health_answers_200_and_models_lists_the_served_folder(server, checkpoint, client):
    assert request(server.port, "GET", "/health") == (200, {"status": "ok"})
    assert [model.id for model in client.models.list()] == [str(checkpoint)]


def test_completion_is_the_offline_greedy_text(client, checkpoint, reference):
    answer = client.completions.create(model=str(checkpoint), prompt="the quick", max_tokens=MAX_TOKENS)
    assert answer.choices[0].text == reference.completion("the quick")


def test_streamed_completion_chunks_join_to_the_offline_greedy_text(client, checkpoint, reference):
    stream = client.completions.create(model=str(checkpoint), prompt="hello world", max_tokens=MAX_TOKENS, stream=True)
    chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(chunks) > 1 and "".join(chunks) == reference.completion("hello world"), chunks


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_reply_is_the_offline_greedy_continuation_of_the_templated_messages(client, checkpoint, reference, stream):
    answer = client.chat.completions.create(
        model=str(checkpoint), messages=MESSAGES, max_tokens=MAX_TOKENS, stream=stream
    )
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    else:
        text = answer.choices[0].message.content
    assert text == reference.chat(MESSAGES)


def test_sixteen_concurrent_clients_each_get_their_own_prompts_completion(client, checkpoint, reference):
    words = ["the", "quick", "lazy", "dog", "fox", "hello", "world", "how"]
    prompts = [f"{first} {second}" for first in words[:4] for second in words[4:]]
    expected = {prompt: reference.completion(prompt) for prompt in prompts}
    assert len(set(expected.values())) > 8, "the prompts should continue differently"

    def ask(prompt: str) -> str:
        return client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=MAX_TOKENS).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = {pool.submit(ask, prompt): prompt for prompt in prompts}
        answers = {futures[future]: future.result() for future in as_completed(futures, timeout=120)}
    wrong = {prompt: (answers[prompt], expected[prompt]) for prompt in prompts if answers[prompt] != expected[prompt]}
    assert not wrong, wrong


COMPLETION = {"prompt": "the quick", "max_tokens": 4}
CHAT = {"messages": MESSAGES, "max_tokens": 4}
# (case, path, body with model=None standing for the served folder or raw bytes, text the answer names, who answers:
# transformers' own handlers and FastAPI, or hf_alibi's check_request, where transformers would give a 500 or hang)
BAD_REQUESTS = [
    ("malformed_json", "/v1/completions", b'{"model": "x", "prompt": ', "JSON decode error", "fastapi"),
    ("unknown_model", "/v1/completions", {**COMPLETION, "model": "no-such-model"}, "'no-such-model'", "transformers"),
    ("unknown_field", "/v1/completions", {**COMPLETION, "best_off": 2}, "best_off", "transformers"),
    (
        "prompt_not_a_string",
        "/v1/completions",
        {**COMPLETION, "prompt": 123},
        "prompt must be a string",
        "transformers",
    ),
    ("negative_max_tokens", "/v1/completions", {**COMPLETION, "max_tokens": -3}, "max_tokens", "hf_alibi"),
    (
        "negative_max_tokens_streamed",
        "/v1/completions",
        {**COMPLETION, "max_tokens": -3, "stream": True},
        "got -3",
        "hf_alibi",
    ),
    ("huge_max_tokens", "/v1/completions", {**COMPLETION, "max_tokens": 10**9}, "got 1000000000", "hf_alibi"),
    ("max_tokens_not_an_integer", "/v1/completions", {**COMPLETION, "max_tokens": "ten"}, "got 'ten'", "hf_alibi"),
    ("temperature_not_a_number", "/v1/completions", {**COMPLETION, "temperature": "hot"}, "got 'hot'", "hf_alibi"),
    (
        "huge_generation_config",
        "/v1/completions",
        {**COMPLETION, "generation_config": '{"max_new_tokens": 1000000}'},
        "got 1000000",
        "hf_alibi",
    ),
    ("chat_without_messages", "/v1/chat/completions", {"max_tokens": 4}, "messages is required", "hf_alibi"),
    ("chat_messages_not_a_list", "/v1/chat/completions", {**CHAT, "messages": "hello"}, "got 'hello'", "hf_alibi"),
    (
        "chat_message_without_role",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"content": "hi"}]},
        "role",
        "hf_alibi",
    ),
    ("chat_huge_max_tokens", "/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, "got 1000000000", "hf_alibi"),
]


@pytest.mark.parametrize(
    "path, body, names, who", [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request_is_a_4xx_naming_the_field_and_the_server_keeps_serving(
    server, checkpoint, client, reference, path, body, names, who
):
    if isinstance(body, dict):
        body = {"model": str(checkpoint)} | body
    status, answer = request(server.port, "POST", path, body, timeout=TIMEOUT_S)
    assert 400 <= status < 500 and names in json.dumps(answer), (status, answer)
    assert who != "hf_alibi" or status == 400, (status, answer)  # check_request's answers are 400s
    assert client.completions.create(model=str(checkpoint), prompt="fox", max_tokens=4).choices[0].text == (
        reference.completion("fox", 4)
    )


def open_stream(port: int, checkpoint) -> http.client.HTTPConnection:
    """An endless streamed completion whose first event has been read."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    body = {"model": str(checkpoint), "prompt": "the lazy", "stream": True, "generation_config": ENDLESS}
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    return connection


def test_client_leaving_mid_stream_does_not_disturb_another_clients_request(server, checkpoint, client, reference):
    """The other request waits for the one generation thread: it is answered in time only if the stream left behind
    was cancelled."""
    expected = reference.completion("how are")
    leaving = open_stream(server.port, checkpoint)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(
            lambda: (
                client.completions.create(model=str(checkpoint), prompt="how are", max_tokens=MAX_TOKENS)
                .choices[0]
                .text
            )
        )
        leaving.close()
        assert other.result(timeout=TIMEOUT_S) == expected
    assert request(server.port, "GET", "/health") == (200, {"status": "ok"})


def test_sigterm_ends_the_server_within_its_deadline_with_no_process_left(checkpoint, tmp_path):
    """Even with a client in the middle of an endless stream (uvicorn gives it 5 s, then closes it)."""
    server = ServerProcess(checkpoint, tmp_path / "server.log", "--max-tokens-limit", str(LIMIT))
    try:
        server.wait_until_healthy()
        stalled = open_stream(server.port, checkpoint)
        status, took = server.stop(deadline_s=STOP_DEADLINE_S)
        stalled.close()
        assert took < STOP_DEADLINE_S and status in (0, -signal.SIGTERM), (status, took, server.output())
        assert group_gone(server.pgid), server.output()
    finally:
        server.stop(deadline_s=1)
