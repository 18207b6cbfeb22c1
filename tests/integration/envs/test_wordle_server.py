"""The Wordle environment's real server over HTTP and WebSocket (rules and rewards: tests/unit/envs/test_wordle.py).

The servers run in this process, in a thread, on free loopback ports; one test starts the CLI
as a subprocess. Every network call has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from deltasync.examples.launcher import free_port
from deltasync.examples.wordle import (
    RewardComponents,
    WordleClient,
    WordleEnvClient,
    WordleObservation,
    WordleServerConfig,
    WordleServerError,
    answer_words,
    create_wordle_app,
    draw_secret,
    episode_rewards,
    score_guess,
)

TIMEOUT_S = 10.0


# --- a real server ---------------------------------------------------------------------------


@contextlib.contextmanager
def serving(config: WordleServerConfig) -> Iterator[str]:
    port = free_port()
    app = create_wordle_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws_max_size=1 << 20))
    thread = threading.Thread(target=server.run, name="wordle-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the Wordle server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(WordleServerConfig(max_sessions=300, max_http_episodes=64, max_message_bytes=4096, seed=0)) as base:
        yield base


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


async def exchange(url: str, frames: list[str | bytes]) -> list[dict]:
    """Send each frame on one WebSocket session and collect the reply to each."""
    async with ws_connect(ws_url(url), open_timeout=TIMEOUT_S) as ws:
        replies = []
        for frame in frames:
            await ws.send(frame)
            replies.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S)))
        return replies


def assert_healthy(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).json() == {"status": "healthy"}


def wrong_words(secret: str, n: int) -> list[str]:
    return [w for w in answer_words() if w != secret][:n]


def test_websocket_game_won(url: str) -> None:
    secret = draw_secret(11)
    with WordleClient(url) as env:
        first = env.reset(seed=11)
        assert (first.done, first.guesses_left, first.board) == (False, 6, [])
        wrong = wrong_words(secret, 1)[0]
        second = env.step(wrong)
        assert second.feedback == score_guess(secret, wrong) and second.valid and not second.done
        assert second.reward == pytest.approx(RewardComponents(**second.reward_components).total())
        last = env.step(f"I am sure now: [{secret}]")
        assert (last.won, last.done, last.reward, last.secret) == (True, True, 2.0, secret)
        assert [(row.guess, row.feedback) for row in last.board] == [(wrong, second.feedback), (secret, "GGGGG")]
        state = env.state()
        assert (state.won, state.done, state.step_count, state.secret) == (True, True, 2, secret)
        with pytest.raises(WordleServerError, match=r"is over \(won\)"):
            env.step("crane")
        again = env.reset(seed=11)  # the same session plays on
        assert again.guesses_left == 6 and again.episode_id != first.episode_id


def test_websocket_game_lost_after_six_guesses(url: str) -> None:
    secret = draw_secret(12)
    with WordleClient(url) as env:
        env.reset(seed=12)
        observations = [env.step(word) for word in wrong_words(secret, 6)]
    assert [obs.guesses_left for obs in observations] == [5, 4, 3, 2, 1, 0]
    assert [obs.done for obs in observations] == [False] * 5 + [True]
    assert not observations[-1].won and observations[-1].secret == secret
    assert observations[-1].message.endswith(f"No guesses left: the word was [{secret}].")
    assert episode_rewards(observations)["correct"] == 0.0


def test_invalid_and_repeated_guesses_cost_a_turn(url: str) -> None:
    with WordleClient(url) as env:
        env.reset(seed=13)
        word = wrong_words(draw_secret(13), 1)[0]
        first = env.step(word)
        repeated = env.step(f"[{word.upper()}]")
        assert repeated.valid and repeated.feedback == first.feedback and repeated.reward == -1.0
        assert repeated.reward_components == RewardComponents(repeated=1.0).as_dict()
        assert "again: you guessed it before" in repeated.message
        for text, error in [("[xqzvj]", "not in the word list"), ("[abc]", "has 3 letters"), ("pass", "pass")]:
            obs = env.step(text)
            assert not obs.valid and obs.feedback is None and obs.reward == -1.0 and error in obs.error
        assert obs.guesses_left == 1 and len(obs.board) == 2
        assert env.state().invalid_guesses == 3 and env.state().repeated_guesses == 1


def test_http_game_by_episode_id(url: str) -> None:
    secret = draw_secret(21)
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
        reset = http.post("/reset", json={"seed": 21})
        assert reset.status_code == 200
        episode_id = reset.json()["observation"]["episode_id"]
        wrong = wrong_words(secret, 1)[0]
        step = http.post("/step", json={"action": {"guess": f"[{wrong}]"}, "episode_id": episode_id}).json()
        assert step["done"] is False and step["observation"]["feedback"] == score_guess(secret, wrong)
        last = http.post("/step", json={"action": {"guess": secret}, "episode_id": episode_id}).json()
        assert (last["done"], last["reward"], last["observation"]["guesses_left"]) == (True, 2.0, 4)
        over = http.post("/step", json={"action": {"guess": secret}, "episode_id": episode_id})
        assert over.status_code == 409 and over.json()["code"] == "GAME_OVER"
        named = http.post("/reset", json={"seed": 21, "episode_id": "my-game"}).json()
        assert named["observation"]["episode_id"] == "my-game"


@pytest.mark.parametrize(
    ("path", "body", "status", "code_or_detail"),
    [
        ("/step", b"{not json", 422, "json_invalid"),
        ("/step", b"[1, 2]", 422, "model_attributes_type"),
        ("/step", {}, 422, "missing"),
        ("/step", {"action": {}}, 422, "missing"),
        ("/step", {"action": {"guess": 5}}, 422, "string_type"),
        ("/step", {"action": {"guess": ["crane"]}}, 422, "string_type"),
        ("/step", {"action": {"guess": "crane", "hint": True}}, 422, "extra_forbidden"),
        ("/step", {"action": {"guess": "crane"}}, 409, "NO_GAME"),
        ("/step", {"action": {"guess": "crane"}, "episode_id": "nope"}, 404, "UNKNOWN_EPISODE"),
        ("/step", {"action": {"guess": "crane"}, "episode_id": 7}, 400, "BAD_REQUEST"),
        ("/step", {"action": {"guess": "crane"}, "episode_id": "x", "speed": 2}, 400, "BAD_REQUEST"),
        ("/reset", {"seed": -1}, 422, "greater_than_equal"),
        ("/reset", {"seed": "seven"}, 422, "int_parsing"),
        ("/reset", {"level": 3}, 400, "BAD_REQUEST"),
        ("/reset", {"episode_id": "x" * 300}, 422, "string_too_long"),
        ("/step", {"action": {"guess": "x" * 5000}}, 413, "MESSAGE_TOO_LARGE"),
    ],
)
def test_http_rejects_bad_requests_clearly(url: str, path: str, body: object, status: int, code_or_detail: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    assert response.status_code == status, response.text
    payload = response.json()
    if isinstance(payload["detail"], list):
        assert code_or_detail in {error["type"] for error in payload["detail"]}, payload
    else:
        assert payload["code"] == code_or_detail and payload["detail"], payload
    assert_healthy(url)


def test_http_caps_bodies_without_a_declared_length(url: str) -> None:
    chunks = iter([b'{"action": {"guess": "', b"x" * 3000, b"x" * 3000, b'"}}'])
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{url}/step", content=chunks, headers=headers, timeout=TIMEOUT_S)
    assert response.status_code == 413
    assert response.json() == {
        "detail": "message of more than 4096 bytes is over this server's limit of 4096 (--max-message-bytes)",
        "code": "MESSAGE_TOO_LARGE",
    }
    assert_healthy(url)


def test_unknown_episode_names_the_id_and_the_fix(url: str) -> None:
    response = httpx.post(f"{url}/step", json={"action": {"guess": "crane"}, "episode_id": "nope"}, timeout=TIMEOUT_S)
    assert response.json() == {
        "detail": "unknown episode_id 'nope': no game has it, or it was among the least recently used beyond "
        "the 64 this server keeps; POST /reset starts a game",
        "code": "UNKNOWN_EPISODE",
    }


def test_old_http_episodes_are_forgotten_first(url: str) -> None:
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
        ids = [http.post("/reset", json={"seed": i}).json()["observation"]["episode_id"] for i in range(65)]
        assert http.post("/step", json={"action": {"guess": "crane"}, "episode_id": ids[0]}).status_code == 404
        assert http.post("/step", json={"action": {"guess": "crane"}, "episode_id": ids[-1]}).status_code == 200


def test_websocket_rejects_bad_frames_and_keeps_the_session(url: str) -> None:
    frames: list[str | bytes] = [
        "{not json",
        "[1, 2]",
        '"reset"',
        b"\x00\x01",
        json.dumps({"type": "step", "data": {"guess": "crane"}}),  # before any reset
        json.dumps({"type": "dance"}),
        json.dumps({"type": "step"}),
        json.dumps({"type": "reset", "data": {"seed": "seven"}}),
        json.dumps({"type": "reset", "data": {"seed": 1}}),
        json.dumps({"type": "step", "data": {"guess": 5}}),
        json.dumps({"type": "step", "data": {"guess": "crane", "hint": True}}),
        json.dumps({"type": "step", "data": {"guess": "x" * 5000}}),
        json.dumps({"type": "step", "data": {"guess": "[crane]"}}),
    ]
    replies = asyncio.run(exchange(url, frames))
    codes = [reply["data"].get("code") if reply["type"] == "error" else reply["type"] for reply in replies]
    assert codes == [
        "INVALID_JSON",
        "VALIDATION_ERROR",
        "VALIDATION_ERROR",
        "VALIDATION_ERROR",
        "EXECUTION_ERROR",
        "UNKNOWN_TYPE",
        "VALIDATION_ERROR",
        "EXECUTION_ERROR",
        "observation",
        "VALIDATION_ERROR",
        "VALIDATION_ERROR",
        "MESSAGE_TOO_LARGE",
        "observation",
    ]
    assert replies[1]["data"]["message"] == 'a message is a JSON object such as {"type": "reset"}, not a list'
    assert replies[4]["data"]["message"].startswith("no game to step")
    assert replies[7]["data"]["message"].startswith("seed='seven': a seed is an integer >= 0")
    size = len(frames[11])
    assert replies[11]["data"]["message"] == (
        f"message of {size} bytes is over this server's limit of 4096 (--max-message-bytes)"
    )
    assert replies[-1]["data"]["observation"]["guesses_left"] == 5
    assert_healthy(url)


def test_256_sessions_play_at_once(url: str) -> None:
    async def play(seed: int) -> list[WordleObservation]:
        secret = draw_secret(seed)
        guesses = wrong_words(secret, 6) if seed % 2 else [*wrong_words(secret, 2), secret]
        async with WordleEnvClient(url, message_timeout_s=TIMEOUT_S) as env:
            observations = [(await env.reset(seed=seed)).observation]
            for guess in guesses:
                observations.append((await env.step(guess)).observation)
        return observations

    async def play_all() -> list[list[WordleObservation]]:
        return await asyncio.wait_for(asyncio.gather(*(play(seed) for seed in range(256))), 60)

    started = time.monotonic()
    games = asyncio.run(play_all())
    elapsed = time.monotonic() - started
    for seed, observations in enumerate(games):
        last = observations[-1]
        assert last.done and last.secret == draw_secret(seed)
        assert last.won == (seed % 2 == 0)
        assert len({obs.episode_id for obs in observations}) == 1
    assert len({games[seed][0].episode_id for seed in range(256)}) == 256
    assert elapsed < 30, f"256 games took {elapsed:.1f} s"
    assert_healthy(url)


def test_sessions_beyond_max_sessions_are_refused() -> None:
    async def scenario(base: str) -> None:
        async with WordleEnvClient(base) as first, WordleEnvClient(base) as second:
            await first.reset(seed=1)
            await second.reset(seed=2)
            # A refused session is told at once, unasked, and closed.
            async with ws_connect(ws_url(base), open_timeout=TIMEOUT_S) as ws:
                refused = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
            assert refused["type"] == "error" and refused["data"]["code"] == "CAPACITY_REACHED"
            assert "2/2 sessions active" in refused["data"]["message"]
        for _ in range(100):  # the server frees the slots once the sockets are closed
            try:
                async with WordleEnvClient(base, message_timeout_s=TIMEOUT_S) as again:
                    await again.reset(seed=4)
                return
            except (WordleServerError, ConnectionClosed):
                await asyncio.sleep(0.05)
        raise AssertionError("no slot came free after two sessions closed")

    with serving(WordleServerConfig(max_sessions=2)) as base:
        asyncio.run(scenario(base))
        assert_healthy(base)


# --- the command line ------------------------------------------------------------------------


def test_cli_serves() -> None:
    port = free_port()
    command = [sys.executable, "-m", "deltasync.examples.wordle", "--port", str(port), "--max-sessions", "4"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            assert time.monotonic() < deadline, "the CLI server did not answer /health in 60 s"
            try:
                assert_healthy(f"http://127.0.0.1:{port}")
                break
            except httpx.TransportError:
                time.sleep(0.2)
        with WordleClient(f"http://127.0.0.1:{port}") as env:
            obs = env.reset(seed=5)
            assert obs.max_guesses == 6 and obs.prompt
        metadata = httpx.get(f"http://127.0.0.1:{port}/metadata", timeout=TIMEOUT_S).json()
        assert metadata["name"] == "wordle"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
