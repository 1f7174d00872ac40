"""`voxtriton-client speak` when something is wrong before any audio: one line on stderr naming the
option or the server, a non-zero exit, and no output file that looks like a result."""

from __future__ import annotations

import os

from voxtriton_client import cli

from voxtriton.serving.launcher import free_port


def speak(*args: str) -> int:
    return cli.main(["speak", "Hello.", *args])


def test_an_output_directory_that_does_not_exist_is_named(tmp_path, capsys):
    assert speak("-o", str(tmp_path / "missing" / "out.wav")) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: -o/--output: no directory {str(tmp_path / 'missing')!r}\n"
    assert captured.out == ""


def test_an_unreadable_reference_is_named(tmp_path, capsys):
    out = tmp_path / "out.wav"
    assert speak("-o", str(out), "--reference-audio", str(tmp_path / "none.wav")) == 2
    assert capsys.readouterr().err.startswith("error: --reference-audio: cannot read")
    assert not out.exists()


def test_no_server_leaves_no_file_and_says_where_it_looked(tmp_path, capsys):
    out = tmp_path / "out.wav"
    address = f"127.0.0.1:{free_port()}"
    assert speak("-o", str(out), "--server", address) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: failed to connect")
    assert f"no Triton server answers at {address}" in captured.err
    assert captured.out == ""  # no chunk table for a stream that brought no chunk
    assert not out.exists()


def test_an_output_that_is_not_a_regular_file_is_refused_and_left_alone(tmp_path, capsys):
    """The WAV header is rewritten at the end and a failed synthesis removes its file: a directory or
    a pipe (a device such as /dev/null alike) is refused before anything is sent, and stays."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for output in (tmp_path, pipe):
        assert speak("-o", str(output), "--server", f"127.0.0.1:{free_port()}") == 2
        assert capsys.readouterr().err == f"error: -o/--output: {str(output)!r} is not a regular file\n"
        assert output.exists()


def test_a_server_address_with_a_scheme_is_refused_naming_the_option(tmp_path, capsys):
    out = tmp_path / "out.wav"
    assert speak("-o", str(out), "--server", "http://127.0.0.1:8001") == 2
    assert capsys.readouterr().err == (
        "error: --server: Triton's gRPC address as HOST:PORT, without a scheme, got 'http://127.0.0.1:8001'\n"
    )
    assert not out.exists()


def test_a_model_still_loading_is_told_apart_from_a_server_that_is_not_there():
    loading = cli.connection_hint("Request for unknown model: 'tts' has no available versions", "h:1")
    assert (
        loading
        == "\n(the server at h:1 has not loaded its tts model yet: wait for `voxtriton serve`'s ready)"
    )
    assert "gRPC port, 8001 by default" in cli.connection_hint("failed to connect to all addresses", "h:1")
    assert cli.connection_hint("text: must be a non-empty string", "h:1") == ""
