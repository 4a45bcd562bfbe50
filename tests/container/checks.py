"""What a user of the running image sees: answers through the sidecar, the shipped rate limits,
Prometheus's scrape, who the processes run as, and a stream that outlives SIGTERM."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.parse
import urllib.request

import grpc

from common import REPO, check, get, run, wait_for

sys.path.insert(0, str(REPO))
from worker.gen.cyllm.inference.v1 import inference_pb2 as pb  # noqa: E402
from worker.gen.cyllm.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402

QUESTION = "What is the capital of France?"
OPENAI_CHAT = (
    "from openai import OpenAI; import sys; c = OpenAI(base_url=sys.argv[1], api_key='unused'); "
    "m = c.models.list().data[0].id; "
    "r = c.chat.completions.create(model=m, temperature=0, messages=[{'role': 'user', 'content': sys.argv[2]}]); "
    "print(r.choices[0].message.content)")


def chat_request(max_tokens: int = 32, ignore_eos: bool = False) -> pb.PredictRequest:
    request = pb.PredictRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    request.chat.messages.add(role="user", content=QUESTION)
    return request


def answers(grpc_port: int, http_port: int, where: str) -> None:
    """The embedded model answers through the sidecar: a gRPC client, then the openai SDK."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        replies = list(pb_grpc.InferenceServiceStub(channel).StreamPredict(chat_request(), timeout=120))
    text = "".join(r.text for r in replies)
    check("Paris" in text, f"{where}: gRPC through the sidecar: {text!r}")
    answer = run(sys.executable, "-c", OPENAI_CHAT, f"http://127.0.0.1:{http_port}/v1", QUESTION,
                 capture=True).stdout.strip()
    check("Paris" in answer, f"{where}: OpenAI SDK through the sidecar: {answer!r}")


def rate_limits_shipped(http_port: int, where: str) -> None:
    """The sidecar runs under deploy/k8s/base/limits/rate-limits.json, as mounted by the stack: an
    answer carries OpenAI's x-ratelimit headers with the file's default limits."""
    limits = json.loads((REPO / "deploy" / "k8s" / "base" / "limits" / "rate-limits.json").read_text())["default"]
    model = json.loads(get(f"http://127.0.0.1:{http_port}/v1/models")[1])["data"][0]["id"]
    body = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}]})
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", body.encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        headers = response.headers
    check(headers.get("x-ratelimit-limit-requests") == str(int(limits["requests_per_s"]))
          and headers.get("x-ratelimit-limit-tokens") == str(int(limits["tokens_per_min"])),
          f"{where}: the shipped rate limits apply: {[(k, v) for k, v in headers.items() if k.startswith('x-ratelimit')]}")


def prometheus_scraped(port: int) -> None:
    def query(expr: str):
        status, body = get(f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        return json.loads(body)["data"]["result"] if status == 200 else []

    wait_for("Prometheus to scrape the sidecar",
             lambda: any(r["value"][1] == "1" for r in query('up{job="cy-llm-sidecar"}')), 60)
    sidecar = wait_for("the requests in Prometheus", lambda: query('cyllm_sidecar_requests_total{status="OK"}'), 60)
    worker = wait_for("the worker's metrics in Prometheus", lambda: query("cyllm_requests_total"), 60)
    check(bool(sidecar and worker), f"Prometheus scraped the sidecar: {len(sidecar)} sidecar request series, "
                                    f"{len(worker)} worker request series")
    pod = wait_for("the pod's signals in Prometheus", lambda: query("cyllm_pod_requests_running"), 60)
    check(bool(pod), "Prometheus scraped the pod's signals (cyllm_pod_requests_running)")
    status, body = get(f"http://127.0.0.1:{port}/api/v1/rules")
    groups = json.loads(body)["data"]["groups"] if status == 200 else []
    rules = [rule for group in groups for rule in group["rules"]]
    check(len(rules) >= 11 and all(rule["health"] != "err" for rule in rules),
          f"Prometheus loaded deploy/prometheus/rules.yml: {len(rules)} rules in {[g['name'] for g in groups]}")


def non_root(containers: dict[str, str]) -> None:
    for name, cid in containers.items():
        users = _process_users(cid)
        check(bool(users) and all(u in ("cyllm", "10001") for u in users),
              f"{name}'s processes run as {sorted(set(users))}")


def _process_users(cid: str, attempts: int = 5) -> list[str]:
    """`podman top` reads every process's /proc entry; a healthcheck's exec that exits between the
    listing and the read fails it with "no such process", so that one error is retried."""
    for _ in range(attempts - 1):
        result = run("podman", "top", cid, "user", capture=True, check=False)
        if result.returncode == 0:
            return result.stdout.split()[1:]
        if "no such process" not in result.stderr:
            break
        time.sleep(0.5)
    return run("podman", "top", cid, "user", capture=True).stdout.split()[1:]


def worker_socket_only(worker: str) -> None:
    """The worker's container (a network namespace of its own under compose) listens on no TCP port,
    and its socket is 0660 in a 0750 folder, both its user's."""
    modes = run("podman", "exec", worker, "stat", "-c", "%a %U", "/run/cy-llm", "/run/cy-llm/worker.sock",
                capture=True).stdout.split("\n")
    check(modes[:2] == ["750 cyllm", "660 cyllm"], f"worker socket folder and socket: {modes[:2]}")
    tables = run("podman", "exec", worker, "cat", "/proc/net/tcp", "/proc/net/tcp6", capture=True).stdout
    listening = [line for line in tables.splitlines()[1:] if line.split()[3:4] == ["0A"]]  # state 0A: LISTEN
    check(not listening, f"the worker listens on no TCP port ({len(listening)} listeners)")


def stream_outlives_sigterm(grpc_port: int, stop, containers: dict[str, str], grace_s: float, where: str) -> None:
    """`stop()` sends SIGTERM during a stream: the stream still ends OK with every token, the stop
    returns within the grace period, and the worker and the sidecar exit 0 (they drained)."""
    replies: list[pb.PredictResponse] = []
    first = threading.Event()
    outcome: dict[str, object] = {}

    def stream() -> None:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                for reply in pb_grpc.InferenceServiceStub(channel).StreamPredict(chat_request(48, True), timeout=120):
                    replies.append(reply)
                    first.set()
            outcome["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()
        first.set()

    thread = threading.Thread(target=stream)
    thread.start()
    check(first.wait(120) and bool(replies), f"{where}: a stream started")
    started = time.monotonic()
    stop()
    stopped = time.monotonic() - started
    thread.join(30)
    tokens = replies[-1].usage.completion_tokens if replies else 0
    finish = replies[-1].finish_reason if replies else None
    check(outcome.get("code") == grpc.StatusCode.OK and tokens == 48 and finish == pb.FINISH_REASON_LENGTH,
          f"{where}: the stream finished after SIGTERM: {outcome.get('code')}, {tokens} tokens")
    check(stopped < grace_s, f"{where}: stopped in {stopped:.1f} s (grace {grace_s:g} s)")
    for name, cid in containers.items():
        code = run("podman", "inspect", "--format", "{{.State.ExitCode}}", cid, capture=True).stdout.strip()
        check(code == "0", f"{where}: {name} exited {code} after draining")
