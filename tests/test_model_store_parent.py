"""The node's model cache refuses a parent folder someone else could change (issue 49): one that
group/other may write without the sticky bit (they could rename the cache away and put their own
in its place), or one owned by another user; a sticky shared folder such as /tmp is fine."""

from __future__ import annotations

import os

import pytest

from runtime import model_store as ms
from runtime.model_store import ModelStoreError


def test_a_world_writable_parent_without_the_sticky_bit_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ModelStoreError, match=rf"model cache .* lies in {shared} \(uid \d+, mode 0777\)"):
        ms.open_private_dir(str(shared / "models"))
    assert not (shared / "models").exists()  # refused before anything was made in it


def test_a_sticky_world_writable_parent_is_accepted(tmp_path):
    shared = tmp_path / "sticky"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    os.close(ms.open_private_dir(str(shared / "models")))
    assert (os.stat(shared / "models").st_mode & 0o777) == 0o700


def test_a_parent_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    parent = tmp_path / "theirs"
    parent.mkdir()
    os.chmod(parent, 0o755)
    if os.geteuid() == 0:
        os.chown(parent, 65534, 65534)  # nobody's
    else:  # the folder is ours: seen from another uid, it is someone else's
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(ModelStoreError, match=rf"lies in {parent} \(uid \d+, mode 0755\)"):
        ms.open_private_dir(str(parent / "models"))
