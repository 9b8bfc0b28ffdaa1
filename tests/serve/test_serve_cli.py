"""`weir serve MODEL` starts a recording server that the openai client can use; Ctrl-C stops it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import openai
import pytest


@pytest.mark.slow  # a fresh interpreter loads torch and builds a model: ~15 s on a busy CPU
def test_weir_serve_command(tmp_path):
    env = {**os.environ, "WEIR_ADMIN_KEY": "admin-test-key", "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "weir.cli.main", "serve", "tiny:nano", "model.threads=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"serving (\S+) at (http://127\.0\.0\.1:\d+/v1)", line)
            if m:
                break
        assert m, "".join(lines)
        name, base_url = m.groups()
        assert name == "tiny:nano"
        admin = openai.OpenAI(base_url=base_url, api_key="admin-test-key", max_retries=0)
        assert [x.id for x in admin.models.list().data] == ["tiny:nano"]

        req = urllib.request.Request(
            base_url + "/sessions",
            data=json.dumps({"row": {"q": 1}}).encode(),
            headers={"Authorization": "Bearer admin-test-key", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            opened = json.loads(resp.read())
        client = openai.OpenAI(base_url=base_url, api_key=opened["api_key"], max_retries=0)
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True
        )
        req = urllib.request.Request(
            base_url + f"/sessions/{opened['id']}/trajectory",
            headers={"Authorization": f"Bearer {opened['api_key']}"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            (segment,) = json.loads(resp.read())["segments"]
        assert segment["rollout_logprobs"] == [x.logprob for x in r.choices[0].logprobs.content]
        assert len(segment["response_ids"]) == r.usage.completion_tokens
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
