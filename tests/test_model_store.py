"""The node's model cache (runtime.model_store, issue 28 case 5) without Ray: the object store is a
dict handed in as `fetch`. A cache directory another user made, or one open to group/other, is
refused; a symlinked lock or model file is refused and the file it points at keeps its bytes; a
copy whose bytes differ from the published sha256 is never handed to the loader, whether it came
from the object store or sits in the cache already."""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile

import pytest

from runtime import model_store as ms
from runtime.model_store import ModelStoreError

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x01\x02" * 1000}


def _record(files: dict[str, bytes] = FILES, name: str = "") -> dict:
    sums = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    return {"digest": ms.content_digest(sums), "name": name, "files": sums, "ref": "ref-1"}


def _fetch(files: dict[str, bytes] = FILES):
    return lambda ref: dict(files)


def test_fetches_once_then_reuses_the_verified_copy_in_a_private_dir(tmp_path):
    root, rec = str(tmp_path / "cache" / "models"), _record()
    path, source = ms.resolve("/nowhere", rec, root=root, fetch=_fetch())
    assert source == "object_store" and path == os.path.join(root, rec["digest"])
    for name, data in FILES.items():
        assert open(os.path.join(path, name), "rb").read() == data
    for d in (root, path):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert not [n for n in os.listdir(path) if n.startswith(".tmp-")]
    path2, source2 = ms.resolve("/nowhere", rec, root=root, fetch=lambda ref: pytest.fail("refetched"))
    assert (path2, source2) == (path, "node_cache")


def test_a_single_file_model_resolves_to_its_file(tmp_path):
    files = {"m.gguf": b"GGUF" + b"\0" * 64}
    path, _ = ms.resolve("/nowhere", _record(files, "m.gguf"), root=str(tmp_path / "c"), fetch=_fetch(files))
    assert path.endswith("/m.gguf") and open(path, "rb").read() == files["m.gguf"]


def test_the_default_cache_is_per_user_not_the_shared_temp_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ms.default_root() == os.path.join(str(tmp_path), "pdserve", "models")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert not ms.default_root().startswith(os.path.join(tempfile.gettempdir(), "pdserve-models"))
    assert ms.default_root().startswith(os.path.expanduser("~"))


def test_a_cache_dir_open_to_others_is_refused(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    os.chmod(root, 0o777)  # another user could plant files here
    with pytest.raises(ModelStoreError, match="lets group/other in"):
        ms.resolve("/nowhere", _record(), root=str(root), fetch=_fetch())
    assert os.listdir(root) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another uid needs root")
def test_a_cache_dir_another_user_created_is_refused(tmp_path):
    root = tmp_path / "models"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, 4242)
    with pytest.raises(ModelStoreError, match="owned by uid 4242"):
        ms.resolve("/nowhere", _record(), root=str(root), fetch=_fetch())


def test_a_symlinked_cache_dir_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, tmp_path / "models")
    with pytest.raises(ModelStoreError, match="not a real directory"):
        ms.resolve("/nowhere", _record(), root=str(tmp_path / "models"), fetch=_fetch())
    assert os.listdir(elsewhere) == []


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    root, rec = tmp_path / "models", _record()
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    os.symlink(victim, root / f"{rec['digest']}.lock")
    with pytest.raises(ModelStoreError, match=r"\.lock safely"):
        ms.resolve("/nowhere", rec, root=str(root), fetch=_fetch())
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("complete", [False, True], ids=["while-fetching", "already-cached"])
def test_a_symlinked_model_file_is_refused_and_its_target_untouched(tmp_path, complete):
    root, rec = tmp_path / "models", _record()
    directory = root / rec["digest"]
    directory.mkdir(mode=0o700, parents=True)
    os.chmod(root, 0o700)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    os.symlink(victim, directory / "model.safetensors")
    if complete:
        (directory / "config.json").write_bytes(FILES["config.json"])
        (directory / ms.DONE).write_bytes(rec["digest"].encode())
    with pytest.raises(ModelStoreError, match="model.safetensors"):
        ms.resolve("/nowhere", rec, root=str(root), fetch=_fetch())
    assert victim.read_bytes() == b"precious"
    assert os.path.islink(directory / "model.safetensors")


def test_bytes_that_differ_from_the_published_digest_are_refused(tmp_path):
    root, rec = str(tmp_path / "models"), _record()
    tampered = {**FILES, "model.safetensors": b"\x09" * 2000}
    with pytest.raises(ModelStoreError, match="digest mismatch for 'model.safetensors'"):
        ms.resolve("/nowhere", rec, root=root, fetch=_fetch(tampered))
    assert not os.path.exists(os.path.join(root, rec["digest"], ms.DONE))


def test_a_cached_copy_that_no_longer_matches_is_refused(tmp_path):
    root, rec = str(tmp_path / "models"), _record()
    path, _ = ms.resolve("/nowhere", rec, root=root, fetch=_fetch())
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(ModelStoreError, match="digest mismatch for cached"):
        ms.resolve("/nowhere", rec, root=root, fetch=_fetch())


@pytest.mark.parametrize("bad", [{"digest": "x"}, {"files": {"../../etc/passwd": "0" * 64}},
                                 {"files": {"a": "0" * 64}}])
def test_a_record_without_a_consistent_digest_is_refused(tmp_path, bad):
    rec = {**_record(), **bad}
    if "digest" not in bad:  # a record whose digest matches its names: only the name is wrong
        rec["digest"] = ms.content_digest(rec["files"])
    with pytest.raises(ModelStoreError):
        ms.resolve("/nowhere", rec, root=str(tmp_path / "models"), fetch=_fetch())


def test_a_local_path_or_a_named_model_never_touches_the_cache(tmp_path):
    assert ms.resolve("tiny", None, root=str(tmp_path / "c")) == ("tiny", "local")
    model = tmp_path / "model"
    model.mkdir()
    for name, data in FILES.items():
        (model / name).write_bytes(data)
    assert ms.resolve(str(model), _record(), root=str(tmp_path / "c")) == (str(model), "local")
    assert not (tmp_path / "c").exists()


def test_an_empty_directory_at_the_path_is_not_the_model(tmp_path):
    """A mount point whose volume is missing (the path exists, the files do not): fetched."""
    empty = tmp_path / "mnt"
    empty.mkdir()
    path, source = ms.resolve(str(empty), _record(), root=str(tmp_path / "c"), fetch=_fetch())
    assert source == "object_store" and open(os.path.join(path, "config.json"), "rb").read() == FILES[
        "config.json"]
