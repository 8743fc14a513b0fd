"""`pdserve generate --local`: the JSON body, stop strings, and one-line errors for bad arguments
(on the random `tiny` model, named explicitly: the command's default is SmolLM2, like `serve`)."""

import json
import subprocess
import sys

import pytest

from pdserve_cli.main import main


def _run(capsys, *argv):
    code = main(["generate", "--local", *([] if "--model" in argv else ["--model", "tiny"]), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_body_shape(capsys):
    code, out, _ = _run(capsys, "--prompt-ids", "256,72,105", "--max-tokens", "5", "--ignore-eos", "--json")
    assert code == 0
    body = json.loads(out)
    [choice] = body["choices"]
    assert set(choice) == {"index", "text", "token_ids", "finish_reason"}
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 5


def test_text_prompt_and_n(capsys):
    code, out, _ = _run(capsys, "hello", "--max-tokens", "4", "--n", "2", "--temperature", "1.0",
                        "--seed", "3", "--json")
    assert code == 0
    body = json.loads(out)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == len("hello") + 1  # BOS + bytes


def test_stop_string_cuts_text(capsys):
    code, out, _ = _run(capsys, "--prompt-ids", "256,72,105", "--max-tokens", "24", "--ignore-eos", "--json")
    full = json.loads(out)["choices"][0]
    text = full["text"]
    if len(text) < 4:
        pytest.skip("the random tiny model produced too little byte text to pick a stop string")
    stop = text[2:4]
    code, out, _ = _run(capsys, "--prompt-ids", "256,72,105", "--max-tokens", "24", "--ignore-eos",
                        "--stop", stop, "--json")
    cut = json.loads(out)["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[:text.find(stop)]
    assert len(cut["token_ids"]) < len(full["token_ids"])


@pytest.mark.parametrize("argv, message", [
    (["", "--max-tokens", "3"], "prompt is empty"),
    (["--prompt-ids", "1,2,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", ",".join(["1"] * 2100)], "context"),
    (["hi", "--prompt-ids", "1"], "exactly one"),
    (["hi", "--top-p", "2"], "top_p"),
    (["hi", "--model", "/nonexistent/dir"], "nonexistent"),
])
def test_bad_arguments_exit_nonzero_with_one_line(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code != 0
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "pdserve_cli.main", "generate", "--local", "--model", "tiny",
                        "--prompt-ids", "256,1,2", "--max-tokens", "3", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["choices"][0]["token_ids"]) >= 1
