"""Cancellation, timeouts, overload, API key, TLS and shutdown against real servers."""

import json
import shutil
import subprocess
import threading
import time
from dataclasses import replace

import httpx
import pytest
from helpers.server import RunningServer, local_settings

from mindie.server.config import TLSSettings

LONG = {"prompt": "hello", "max_tokens": 8000, "ignore_eos": True, "temperature": 0}  # vLLM /generate: seconds


def wait_idle(server, timeout=10.0):
    """Until nothing runs or waits and every KV block is back in the pool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(server.management_url + "/v1/status").json()["resource"]
        if r["runningRequestNum"] == 0 and r["waitingRequestNum"] == 0 and r["availBlockNum"] == r["totalNpuBlockNums"]:
            server.ctx.engine.engine.blocks.check_invariants()
            assert not server.ctx.in_flight
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy: {r}")


@pytest.fixture(scope="module")
def long_tiny_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with room for 8192 positions: its requests can take seconds."""
    path = tmp_path_factory.mktemp("long-tiny")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return path


@pytest.fixture(scope="module")
def slow_server(long_tiny_dir):
    """One request at a time and ignore_eos-long outputs, so requests can be caught mid-flight."""
    s = local_settings(str(long_tiny_dir), dtype="float32", model_name="tiny")
    server = RunningServer(replace(s, engine=replace(s.engine, max_batch_size=1, max_prefill_batch_size=1,
                                                     num_kv_blocks=600, max_seq_len=8192, max_iter_times=8000)))
    yield server
    server.close()


def test_stream_disconnect_aborts_and_frees_blocks(slow_server):
    with httpx.stream("POST", slow_server.url + "/generate", json={**LONG, "stream": True}) as r:
        next(r.iter_bytes())
    wait_idle(slow_server)


def test_non_stream_disconnect_aborts_running_and_queued(slow_server):
    def doomed():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(slow_server.url + "/generate", json=LONG, timeout=0.5)

    threads = [threading.Thread(target=doomed) for _ in range(3)]  # one runs, two wait in the queue
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_idle(slow_server)


def test_stop_infer_by_client_id(slow_server):
    result = {}

    def run():
        result["r"] = httpx.post(slow_server.url + "/v2/models/tiny/generate", timeout=30,
                                 json={"id": "job-7", "text_input": "hi", "parameters": {"max_new_tokens": 4000}})

    t = threading.Thread(target=run)
    t.start()
    for _ in range(100):
        if "job-7" in slow_server.ctx.in_flight.values():
            break
        time.sleep(0.02)
    stop = httpx.post(slow_server.url + "/v2/models/tiny/stopInfer", json={"id": "job-7"})
    assert stop.status_code == 200 and stop.json() == {"id": "job-7"}
    t.join()
    assert result["r"].status_code == 200
    wait_idle(slow_server)
    missing = httpx.post(slow_server.url + "/v2/models/tiny/stopInfer", json={"id": "job-7"})
    assert missing.status_code == 404 and "job-7" in missing.json()["error"]


def test_request_timeout_ends_with_the_spec_error(slow_server):
    slow = {"inputs": "hello", "parameters": {"max_new_tokens": 10, "timeout": 1}}
    t0 = time.monotonic()
    def block():
        try:  # gives up at 3 s unless it finished by then: either way the slot was taken
            httpx.post(slow_server.url + "/generate", json=LONG, timeout=3)
        except httpx.ReadTimeout:
            pass

    blocker = threading.Thread(target=block)
    blocker.start()  # occupies the only batch slot, so the next request can only wait (then gives up at 3 s)
    time.sleep(0.3)
    r = httpx.post(slow_server.url + "/infer", json=slow, timeout=30)
    assert r.status_code == 500
    assert r.json() == {"error": "Engine callback timeout: client timeout", "error_type": "Incomplete Generation"}
    assert time.monotonic() - t0 < 10
    blocker.join()
    wait_idle(slow_server)


def test_overload_is_refused_at_once(long_tiny_dir):
    s = local_settings(str(long_tiny_dir), dtype="float32", model_name="tiny", max_link_num=1)
    server = RunningServer(replace(s, engine=replace(s.engine, max_batch_size=1, num_kv_blocks=600, max_seq_len=8192,
                                                     max_iter_times=4000)))
    try:
        threads = [threading.Thread(target=lambda: httpx.post(server.url + "/generate", json=LONG, timeout=60))
                   for _ in range(3)]
        for t in threads:
            t.start()
        while len(server.ctx.in_flight) < 3:
            time.sleep(0.01)
        r = httpx.post(server.url + "/generate", json=LONG, timeout=5)
        assert r.status_code == 429 and r.headers["retry-after"]
        for rid in list(server.ctx.in_flight):
            server.ctx.stop(rid)
        for t in threads:
            t.join()
    finally:
        server.close()


def test_api_key_guards_every_business_route(tiny_llama_dir):
    from mindie.server.app import BUSINESS, ROUTES

    server = RunningServer(local_settings(str(tiny_llama_dir), dtype="float32", model_name="tiny", api_key="s3cret"))
    try:
        for spec in ROUTES:
            url = (server.url if spec.plane == BUSINESS else server.management_url) + spec.path.replace(
                "{model}", "tiny").replace("{seconds}", "5")
            if spec.path == "/stopService":
                continue
            r = httpx.request(spec.method, url, json={})
            if spec.public:  # the liveness probe load testers call on the API port, as vLLM's
                assert r.status_code == 200, spec.path
            elif spec.plane == BUSINESS:
                assert r.status_code == 401, spec.path
                ok = httpx.request(spec.method, url, json={}, headers={"Authorization": "Bearer s3cret"})
                assert ok.status_code != 401, spec.path
                wrong = httpx.request(spec.method, url, json={}, headers={"Authorization": "Bearer s3cre"})
                assert wrong.status_code == 401
            else:
                assert r.status_code != 401, spec.path
        # the raw path decides, not a Host header or a rewritten URL
        r = httpx.post(server.url + "/infer", json={"inputs": "x"}, headers={"Host": "localhost:1026"})
        assert r.status_code == 401
    finally:
        server.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_mutual_tls(tiny_llama_dir, tmp_path):
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-x509", "-newkey", "rsa:3072", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=test-ca")
    for name, cn in (("server", "127.0.0.1"), ("client", "client")):
        run("req", "-newkey", "rsa:3072", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
            f"/CN={cn}")
        ext = tmp_path / f"{name}.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n" if name == "server" else "extendedKeyUsage=clientAuth\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            f"{name}.pem", "-days", "1", "-extfile", str(ext))
    # a second client certificate, revoked in a CRL
    run("req", "-newkey", "rsa:3072", "-nodes", "-keyout", "revoked.key", "-out", "revoked.csr", "-subj", "/CN=gone")
    run("x509", "-req", "-in", "revoked.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "revoked.pem", "-days", "1", "-extfile", str(tmp_path / "client.ext"))
    (tmp_path / "index.txt").write_text("")
    (tmp_path / "crlnumber").write_text("01\n")
    (tmp_path / "ca.cnf").write_text("[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\ncrlnumber = crlnumber\n"
                                     "default_md = sha256\ndefault_crl_days = 1\n")
    run("ca", "-config", "ca.cnf", "-keyfile", "ca.key", "-cert", "ca.pem", "-revoke", "revoked.pem")
    run("ca", "-config", "ca.cnf", "-keyfile", "ca.key", "-cert", "ca.pem", "-gencrl", "-out", "crl.pem")
    tls = TLSSettings(str(tmp_path / "server.pem"), str(tmp_path / "server.key"), None, (str(tmp_path / "ca.pem"),),
                      (str(tmp_path / "crl.pem"),))
    server = RunningServer(local_settings(str(tiny_llama_dir), dtype="float32", model_name="tiny", tls=tls))
    try:
        import ssl

        def client(name: str | None) -> ssl.SSLContext:
            context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
            if name:
                context.load_cert_chain(str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key"))
            return context

        r = httpx.post(server.url + "/infer", json={"inputs": "x", "parameters": {"max_new_tokens": 2}},
                       verify=client("client"))
        assert r.status_code == 200
        for refused in (None, "revoked"):  # no certificate; a revoked one
            with pytest.raises(httpx.HTTPError):
                httpx.post(server.url + "/infer", json={"inputs": "x"}, verify=client(refused))
    finally:
        server.close()


def test_stop_service_drains_then_refuses(tiny_llama_dir, monkeypatch):
    import os
    import signal

    signals = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signals.append(sig))
    server = RunningServer(local_settings(str(tiny_llama_dir), dtype="float32", model_name="tiny"))
    try:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            server.url + "/infer", json={"inputs": "x", "parameters": {"max_new_tokens": 60}}, timeout=30)))
        t.start()
        while not server.ctx.in_flight:
            time.sleep(0.01)
        stop = httpx.get(server.management_url + "/stopService", timeout=30)
        assert stop.status_code == 200
        t.join()
        assert result["r"].status_code == 200  # the request in flight finished normally
        refused = httpx.post(server.url + "/infer", json={"inputs": "x"})
        assert refused.status_code == 503 and refused.json()["error"] == "The service has been stopped."
        assert httpx.get(server.management_url + "/health").status_code == 503
        assert httpx.get(server.management_url + "/stopService").status_code == 500
        time.sleep(0.4)
        assert signals == [signal.SIGTERM]
    finally:
        server.close()


def test_timeout_mid_stream_ends_with_an_error_event(slow_server):
    body = {"inputs": "hello", "stream": True, "parameters": {"max_new_tokens": 4000, "timeout": 1}}
    r = httpx.post(slow_server.url + "/infer", json=body, timeout=30)
    events = [json.loads(e[len("data: "):]) for e in r.text.strip().split("\n\n")]
    assert len(events) > 1 and "token" in events[0]
    assert events[-1] == {"error": "Engine callback timeout: client timeout", "error_type": "Incomplete Generation"}
    wait_idle(slow_server)


def test_full_text_mode_streams_cumulative_text(long_tiny_dir):
    server = RunningServer(local_settings(str(long_tiny_dir), dtype="float32", model_name="tiny", full_text=True))
    try:
        body = {"inputs": "hello", "stream": True, "parameters": {"max_new_tokens": 6, "do_sample": False}}
        r = httpx.post(server.url + "/infer", json=body, timeout=30)
        texts = [json.loads(e[len("data: "):])["token"]["text"] for e in r.text.strip().split("\n\n")][:-1]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    finally:
        server.close()


def test_engine_fault_fails_requests_in_flight_and_recovers(tiny_llama_dir, monkeypatch):
    server = RunningServer(local_settings(str(tiny_llama_dir), dtype="float32", model_name="tiny"))
    try:
        engine = server.ctx.engine.engine
        real_step, calls = engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("simulated kernel failure")
            return real_step()

        monkeypatch.setattr(engine, "step", failing_step)
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 20}}
        r = httpx.post(server.url + "/infer", json=body, timeout=30)
        assert r.status_code == 500 and "engine failed" in r.json()["error"]
        assert "simulated" not in r.text  # no internals
        assert httpx.get(server.management_url + "/health").status_code == 503
        assert httpx.post(server.url + "/infer", json=body, timeout=30).status_code == 200  # recovered
        assert httpx.get(server.management_url + "/health").status_code == 200
        engine.blocks.check_invariants()
    finally:
        server.close()
