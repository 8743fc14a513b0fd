"""`pdserve bench fuzz` against a live receiver in a child process: a few hundred seeded cases of
every mutation family (manifest bytes sealed and re-sealed, manifest fields, headers, handshakes,
dedupe queries, chunks, message order, the bulk link, abandoned transfers) and valid transfers
mixed in. No crash, no hang, no leak, no valid transfer refused or landed wrong; every family
was exercised and refused with the receiver's typed error codes."""

import json

from bench.fuzz_mutators import FAMILIES
from pdserve_cli.main import main
from transfer.errors import ERROR_CLASSES

VALID = {"valid_zmq", "valid_stream", "valid_dedupe"}


def test_fuzz_finds_no_crash_hang_leak_or_false_positive(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    rc = main(["bench", "fuzz", "--cases", "600", "--batch", "200", "--seed", "3", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["examples"] == [], report["examples"]
    assert rc == 0
    assert report["cases"] == 600 and report["leak_checks"] == 3
    for key in ("crashes", "hangs", "leaks", "false_positives"):
        assert report[key] == 0, key
    by = report["by_mutation"]
    assert set(by) == set(FAMILIES)
    typed = set(ERROR_CLASSES)
    for name, fam in by.items():
        codes = fam["refused_by_code"]
        assert fam["cases"] > 0, name
        if name in VALID:
            assert codes.get("accepted") == fam["cases"], (name, codes)
        else:
            assert typed & set(codes), (name, codes)
            assert not {c for c in codes if c.startswith("reply:") or c == "unparsable_reply"}, (name, codes)
    # the seal refuses raw damage; re-sealed damage reaches the parser and the schema
    assert set(by["manifest_bytes"]["refused_by_code"]) <= {"checksum", "malformed"}
    assert {"malformed", "limits"} & set(by["manifest_fields"]["refused_by_code"])
    assert "cases 600, crashes 0, hangs 0, leaks 0, false positives 0" in capsys.readouterr().out
