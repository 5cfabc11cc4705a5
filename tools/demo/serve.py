"""The demo: serve tiny GLM-4.5 with MTP through ``vllm serve``, query it.

    python -m tools.demo.serve [--model DIR] [--no-mtp] [--timeout S]

Starts ``vllm serve`` (our plugin picks the device: the CPU reference device
on a host without an NPU) on a free localhost port with the flags of the
reference serve command (DP 2 x TP 8 + EP, W8A8, graph capture sizes) that
make sense on one host, waits for /health, sends a completion and, when the
tokenizer has a chat template, a chat request, each non-streaming then
streaming, through the OpenAI client, prints the speculative-decoding
counters from /metrics and stops the server.

``ServeProcess`` is also what ``tests/server`` uses to run its servers.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "tiny-glm45"
SERVED_NAME = "glm45-tiny"
MTP_CONFIG = {"num_speculative_tokens": 1, "method": "glm4_moe_mtp"}
# A tiny model needs little KV cache; the CPU default (several GiB) would
# crowd a shared host.
KV_CACHE_BYTES = 64 * 2**20


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_args(model: Path, port: int, mtp: bool = True,
               max_model_len: int = 512) -> list[str]:
    """``vllm serve`` arguments: the reference serve command's flags that
    fit one CPU host (no DP/TP/EP, no graphs, no quantization)."""
    args = [
        "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME, "--seed", "1024",
        "--max-model-len", str(max_model_len),
        "--max-num-batched-tokens", "1024", "--max-num-seqs", "8",
        "--no-enable-prefix-caching", "--dtype", "float32",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--disable-uvicorn-access-log",
    ]
    if mtp:
        args += ["--speculative-config", json.dumps(MTP_CONFIG)]
    return args


def vllm_executable() -> str:
    exe = Path(sys.executable).with_name("vllm")
    if not exe.exists():
        raise FileNotFoundError(
            f"{exe} not found: run `make install` (or use the venv python "
            "that has vLLM installed).")
    return str(exe)


class ServeProcess:
    """One ``vllm serve`` process on localhost, in its own process group so
    that stopping it also stops its engine-core child."""

    def __init__(self, args: list[str], port: int,
                 env: Optional[dict[str, str]] = None,
                 log_path: Optional[Path] = None) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path or Path(
            tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115
        full_env = dict(os.environ, **(env or {}))
        full_env.setdefault("VLLM_ASCEND_DEVICE", "auto")
        self.proc = subprocess.Popen([vllm_executable(), *args],
                                     stdout=self._log,
                                     stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_healthy(
            self,
            timeout: float,
            failed: Optional[Callable[[str], Optional[str]]] = None) -> float:
        """Block until GET /health answers 200; return the seconds waited.

        ``failed`` reads the log every 20 s and names a failure that will
        never end by itself (a failed worker whose peers wait in a
        collective): the wait then stops at once."""
        start = time.monotonic()
        next_look = start + 20
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.proc.returncode} "
                    f"before it was healthy; log {self.log_path}:\n"
                    f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health",
                                            timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if failed is not None and time.monotonic() >= next_look:
                next_look += 20
                cause = failed(self.log_path.read_text(errors="replace"))
                if cause:
                    self.stop()
                    raise RuntimeError(f"a worker failed ({cause}); log "
                                       f"{self.log_path}")
            time.sleep(1)
        self.stop()
        raise TimeoutError(
            f"vllm serve was not healthy after {timeout:.0f} s; log "
            f"{self.log_path}:\n{self.log_tail()}")

    def get(self, path: str, timeout: float = 30) -> str:
        with urllib.request.urlopen(f"{self.base_url}{path}",
                                    timeout=timeout) as resp:
            return resp.read().decode()

    def stop(self, grace: float = 30) -> Optional[int]:
        """SIGINT (vLLM's clean shutdown), then SIGTERM, then SIGKILL."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10),
                              (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # The engine core may outlive the API server by a moment.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def spec_decode_metrics(metrics_text: str) -> dict[str, float]:
    """Sum the speculative-decoding counters of a Prometheus /metrics page
    over their labels, with the watchdog's gauge
    (``vllm:spec_decode_paused``)."""
    out: dict[str, float] = {}
    pattern = re.compile(r"^(vllm:spec_decode_[a-z_]+)(\{[^}]*\})? (\S+)$")
    for line in metrics_text.splitlines():
        match = pattern.match(line)
        if match and (match.group(1).endswith("_total")
                      or match.group(1) == "vllm:spec_decode_paused"):
            name = match.group(1)
            out[name] = out.get(name, 0.0) + float(match.group(3))
    return out


def has_chat_template(model: Path) -> bool:
    if (model / "chat_template.jinja").exists():
        return True
    config = model / "tokenizer_config.json"
    return config.exists() and "chat_template" in json.loads(
        config.read_text())


def _check_model(model: Path) -> None:
    if not (model / "config.json").exists():
        raise SystemExit(
            f"{model} has no config.json: build the tiny checkpoint with "
            "`python -m tests.fixtures.build_tiny_glm45 --out "
            "tests/fixtures/tiny-glm45` or pass --model DIR.")
    if not (model / "tokenizer.json").exists() and not (
            model / "tokenizer_config.json").exists():
        raise SystemExit(
            f"{model} has no tokenizer: the server needs one to turn text "
            "into tokens; use a checkpoint directory with its tokenizer.")


def _prompt(model: Path) -> str:
    """A held-out prompt of the tiny fixture, else a generic one."""
    heldout = model / "heldout_prompts.json"
    if heldout.exists():
        return json.loads(heldout.read_text())[1]["text"]
    return "The capital of France is"


def _query(server: ServeProcess, model: Path, max_tokens: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                    timeout=120)
    prompt = _prompt(model)
    print(f"[demo] completion prompt: {prompt!r}")
    t0 = time.monotonic()
    reply = client.completions.create(model=SERVED_NAME, prompt=prompt,
                                      max_tokens=max_tokens, temperature=0)
    print(f"[demo] answer ({time.monotonic() - t0:.1f} s, "
          f"{reply.usage.completion_tokens} tokens): "
          f"{reply.choices[0].text!r}")
    print("[demo] streamed: ", end="", flush=True)
    for chunk in client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens,
            temperature=0, stream=True):
        print(chunk.choices[0].text, end="", flush=True)
    print()
    if not has_chat_template(model):
        print("[demo] the tokenizer has no chat template: no chat request")
        return
    question = "what does the frog eat?"
    messages = [{"role": "user", "content": question}]
    print(f"[demo] chat: {question!r}")
    t0 = time.monotonic()
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=max_tokens,
        temperature=0)
    print(f"[demo] answer ({time.monotonic() - t0:.1f} s): "
          f"{chat.choices[0].message.content!r}")
    print("[demo] streamed: ", end="", flush=True)
    for chunk in client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=max_tokens,
            temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--no-mtp", action="store_true",
                        help="serve without speculative decoding")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds to wait for the server to be healthy")
    args = parser.parse_args()
    model = args.model.resolve()
    _check_model(model)

    port = free_port()
    cli = serve_args(model, port, mtp=not args.no_mtp)
    print("[demo] starting: vllm " + " ".join(
        f"'{a}'" if a.startswith("{") else a for a in cli), flush=True)
    server = ServeProcess(cli, port)
    print(f"[demo] server log: {server.log_path}", flush=True)
    try:
        waited = server.wait_healthy(args.timeout)
        print(f"[demo] healthy after {waited:.0f} s", flush=True)
        _query(server, model, args.max_tokens)
        counters = spec_decode_metrics(server.get("/metrics"))
        if args.no_mtp:
            print("[demo] speculative decoding off")
        else:
            drafts = counters.get(SPEC_COUNTERS[0], 0.0)
            drafted = counters.get(SPEC_COUNTERS[1], 0.0)
            accepted = counters.get(SPEC_COUNTERS[2], 0.0)
            rate = accepted / drafted if drafted else 0.0
            print(f"[demo] MTP: {drafts:.0f} drafts, {drafted:.0f} draft "
                  f"tokens, {accepted:.0f} accepted, acceptance rate "
                  f"{rate:.1%}")
            if drafts == 0:
                print("[demo] ERROR: no drafts reached the scheduler",
                      file=sys.stderr)
                return 1
    finally:
        code = server.stop()
        print(f"[demo] server stopped (exit code {code})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
