"""A worker that fails to start says why (issue 50): the cluster's start error names the worker
and its constructor's own exception (type and message), without Ray's colour codes and without
Ray's wrapper sentence "The actor died because of an error raised in its creation task"."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from coordinator.cluster import ClusterBackend, ClusterConfig  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_a_worker_whose_constructor_raises_is_reported_with_that_exception(ray_local, tmp_path):
    fake = tmp_path / "fake.gguf"  # past the CLI's own checks (deploy.preflight), as a node's copy could be
    fake.write_bytes(b"this is not a GGUF file at all")
    backend = ClusterBackend(ClusterConfig(prefill=1, decode=1, num_blocks=32, model=str(fake)))
    with pytest.raises(RuntimeError) as e:
        asyncio.run(backend.start())
    msg = str(e.value)
    assert msg.startswith("a worker failed to start: ") and "\n" not in msg
    assert "prefill-0: " in msg or "decode-0: " in msg
    assert f"gguf.GGUFError: {fake} is not a readable GGUF file: no GGUF magic" in msg  # the type, qualified
    assert "\x1b[" not in msg and "The actor died" not in msg
    assert backend.workers == {}


class _Text(Exception):
    """An error whose text is given, as Ray's are."""


def test_the_error_text_of_a_system_failure_keeps_its_sentences_without_the_tabbed_fields():
    from coordinator.workers import actor_error_text

    text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: DecodeWorker\n"
            "\tactor_id: 00ff\n\tpid: 12\nThe actor is dead because its worker process has died.")
    assert actor_error_text(_Text(text)) == ("_Text: The actor died unexpectedly before finishing this task. "
                                             "The actor is dead because its worker process has died.")
