"""Credentials in URLs are never printed (issue 39 §4): ``user:password@`` and a presigned URL's signature.

A local HTTP range server (127.0.0.1) serves the files; the URLs given carry ``bob:hunter2@`` and presigned-style
query parameters (``X-Amz-Credential``, ``X-Amz-Signature``, ``X-Amz-Security-Token``, ``sig``, ``token``).  Every
output (inspect's header, scan's verdict line, ``--json`` path/source fields, convert's report, errors) shows
``***`` instead; the secret strings appear nowhere on stdout or stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from ckptfix.display import mask_secrets
from ckptfix.files.remote import file as rfile

from helpers import CkptFactory, run_cli
from rangeserver import serving

SECRETS = ("hunter2", "AKIAEXAMPLE", "S1GNATUREabc", "T0KENxyz", "SASsig99", "OAUTHc0de")


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_BACKOFF", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    rfile._PINS.clear()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("secret")
    f = CkptFactory(root)
    f.plain("model.pt")
    f.safetensors("model.safetensors")
    f.evil("evil.pt")
    with serving(str(root)) as srv:
        yield srv


def _urls(srv, name: str) -> list[str]:
    host = srv.url.split("://", 1)[1]
    return [
        f"http://bob:hunter2@{host}/{name}",
        f"{srv.url}/{name}?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20260101"
        "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
        "&X-Amz-Security-Token=T0KENxyz&X-Amz-Signature=S1GNATUREabc",
        f"{srv.url}/{name}?sv=2022-11-02&se=2030-01-01&sig=SASsig99&token=T0KENxyz",
        f"{srv.url}/{name}?state=xyz&code=OAUTHc0de",  # an OAuth authorization code
    ]


def _clean(*texts: str) -> None:
    for t in texts:
        for s in SECRETS:
            assert s not in t, (s, t[:2000])


@pytest.mark.parametrize("i", range(4))
def test_inspect_scan_and_json_never_print_a_secret(served, i: int) -> None:
    for name in ("model.pt", "model.safetensors", "evil.pt"):
        url = _urls(served, name)[i]
        for args in (("inspect", url), ("inspect", url, "--json"), ("scan", url), ("scan", url, "--json")):
            r = run_cli(*args)
            assert r.returncode in (0, 11), (args, r.stderr)
            _clean(r.stdout, r.stderr)
            assert "***" in r.stdout, args  # the URL is still shown, masked
        doc = json.loads(run_cli("scan", url, "--json").stdout)
        assert doc["path"] == mask_secrets(url)


@pytest.mark.parametrize("i", range(4))
def test_convert_report_and_errors_never_print_a_secret(served, tmp_path: Path, i: int) -> None:
    url = _urls(served, "model.pt")[i]
    out = tmp_path / "o.safetensors"
    r = run_cli("convert", url, "-o", str(out))
    assert r.returncode == 0, r.stderr
    _clean(r.stdout, r.stderr)
    r = run_cli("convert", url, "-o", str(tmp_path / "j.safetensors"), "--json")
    assert r.returncode == 0, r.stderr
    _clean(r.stdout, r.stderr)
    assert json.loads(r.stdout)["source"] == mask_secrets(url)
    r = run_cli("inspect", _urls(served, "missing.pt")[i])
    assert r.returncode == 40
    _clean(r.stdout, r.stderr)


def test_mask_secrets_keeps_what_is_not_secret() -> None:
    assert mask_secrets("hf://user/repo@v1/model.safetensors") == "hf://user/repo@v1/model.safetensors"
    assert mask_secrets("s3://b/k.pt") == "s3://b/k.pt"
    assert (
        mask_secrets("https://u:p@h/x?X-Amz-Date=1&X-Amz-Signature=ab")
        == "https://***@h/x?X-Amz-Date=1&X-Amz-Signature=***"
    )
    assert mask_secrets("/data/a@b/model.pt") == "/data/a@b/model.pt"


@pytest.mark.parametrize(
    "text,secret",
    [
        ("http://127.0.0.1:1/m.pt?X%2DAmz%2DSignature=SECRETPW", "SECRETPW"),  # percent-encoded name
        ("http://127.0.0.1:1/m.pt?Authorization=SECRETPW", "SECRETPW"),
        ("http://127.0.0.1:1/m.pt;token=SECRETPW", "SECRETPW"),
        ("http://127.0.0.1:1/m.pt#token=SECRETPW", "SECRETPW"),
        ('Invalid bucket name "AKIAUSER:SECRETPW@bkt"', "SECRETPW"),  # a driver quoting the userinfo back
        ("http://alice:SECRETPW@SECRETPW@host/clean.pt", "SECRETPW"),  # a raw '@' in the password
        ("http://127.0.0.1:1/m.pt?code=SECRETPW&state=1", "SECRETPW"),  # OAuth authorization code
        ("http://127.0.0.1:1/m.pt?session=SECRETPW", "SECRETPW"),
        ("http://127.0.0.1:1/m.pt?pwd=SECRETPW", "SECRETPW"),
        ("http://127.0.0.1:1/m.pt?jwt=SECRETPW", "SECRETPW"),
        ("http://127.0.0.1:1/m.pt?client_assertion=SECRETPW", "SECRETPW"),
        ("http://127.0.0.1:1/m.pt?refresh_token=SECRETPW&client_secret=SECRETPW&id_token=SECRETPW", "SECRETPW"),
    ],
)
def test_the_forms_an_outside_pass_found_are_masked(text, secret):
    from ckptfix.display import mask_secrets

    assert secret not in mask_secrets(text)


@pytest.mark.parametrize(
    "text",
    [
        "s3://AKIAUSER:SECRET PW@bucket/k.pt",  # a password with a space (a quoted URL)
        "http://bob:SECRET  PW@127.0.0.1:1/m.pt",
        "Error: cannot read https://bob:x SECRETPW y@host/m.pt: timed out",
    ],
)
def test_a_password_with_spaces_is_masked(text):
    masked = mask_secrets(text)
    assert "SECRET" not in masked and "***@" in masked, masked


def test_a_driver_quoting_the_userinfo_back_and_a_debug_traceback_are_masked(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    import os

    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="0")
    for url in ("hf://user:SECRETPW@org/repo/x.pt", "hf://user:SECRET PW@org/repo/x.pt"):
        for args in (("inspect", url), ("--debug", "inspect", url), ("scan", url, "--json")):
            r = run_cli(*args, env=env, isolated=True)
            assert r.returncode == 40, (args, r.stderr)
            assert "SECRET" not in r.stdout + r.stderr, (args, r.stderr[-2000:])
            if args[0] == "--debug":
                assert "Traceback" in r.stderr
