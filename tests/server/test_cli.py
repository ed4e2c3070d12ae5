"""`mindie serve` as a user runs it: a subprocess that prints where it listens, answers, and stops
cleanly on SIGTERM after finishing the request in flight."""

import signal
import subprocess
import sys
import threading
import time

import httpx
from helpers.server import free_port


def test_serve_answers_and_stops_on_sigterm(tiny_llama_dir):
    port, mport = free_port(), free_port()
    while mport == port:  # two free_port() calls can name one port: the planes would then share it
        mport = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "mindie", "serve", str(tiny_llama_dir), "--dtype", "float32", "--model-name",
         "tiny", "--host", "127.0.0.1", "--port", str(port), "--management-host", "127.0.0.1", "--management-port",
         str(mport), "--metrics-port", str(mport)],
        stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not any("serving tiny" in line for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert any(f"business plane listening on http://127.0.0.1:{port}" in line for line in lines)
        assert any(f"management+metrics plane listening on http://127.0.0.1:{mport}" in line for line in lines)
        assert httpx.get(f"http://127.0.0.1:{mport}/metrics").status_code == 200
        result = {}
        slow = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            f"http://127.0.0.1:{port}/generate", json={"prompt": "x", "max_tokens": 400, "ignore_eos": True},
            timeout=60)))
        slow.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        slow.join()
        assert result["r"].status_code == 200  # finished, not cut off
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_config_stops_start_up_with_the_key(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"ServerConfig": {"port": 80}}')
    proc = subprocess.run([sys.executable, "-P", "-m", "mindie", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ServerConfig.port" in proc.stderr and "[1024, 65535]" in proc.stderr
