"""Server settings: flags beat LMSERVE_* variables beat defaults; bad values are clear errors."""

import argparse

import pytest

from lmserve.server.auth import read_tokens
from lmserve.server.config import ServerSettings, add_arguments, settings_from_args


def parse(argv, env=None):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return settings_from_args(p.parse_args(argv), environ=env or {})


def test_defaults_env_and_flag_precedence():
    assert parse([]) == ServerSettings()
    s = parse([], {"LMSERVE_PORT": "6000", "LMSERVE_MAX_BATCH": "8", "LMSERVE_KV_CACHE_GB": "1.5"})
    assert (s.port, s.engine.max_batch, s.engine.kv_cache_gb) == (6000, 8, 1.5)
    s = parse(["--port", "7000"], {"LMSERVE_PORT": "6000"})
    assert s.port == 7000


def test_bad_values_name_the_flag():
    with pytest.raises(ValueError, match="--max-batch / LMSERVE_MAX_BATCH: 'lots'"):
        parse(["--max-batch", "lots"])
    with pytest.raises(ValueError, match="tls-key"):
        parse(["--tls-cert", "cert.pem"])
    with pytest.raises(ValueError, match="mutual TLS"):
        parse(["--tls-client-ca", "ca.pem"])
    with pytest.raises(ValueError, match="ports"):
        parse(["--port", "70000"])
    with pytest.raises(ValueError, match="--max-batch / LMSERVE_MAX_BATCH: max_batch must be >= 1"):
        parse(["--max-batch", "0"])


@pytest.mark.parametrize("raw,expected", [("false", False), ("0", False), ("Off", False), ("yes", True), ("1", True)])
def test_boolean_settings_take_words_and_digits(raw, expected):
    assert ServerSettings().engine.cuda_graphs is True
    assert parse(["--cuda-graphs", raw]).engine.cuda_graphs is expected
    assert parse([], {"LMSERVE_CUDA_GRAPHS": raw}).engine.cuda_graphs is expected
    with pytest.raises(ValueError, match=r"--cuda-graphs / LMSERVE_CUDA_GRAPHS: 'maybe' is not a valid bool \(true or false\)"):
        parse(["--cuda-graphs", "maybe"])


@pytest.mark.parametrize("raw,expected", [("auto", None), ("AUTO", None), ("true", True), ("off", False)])
def test_automatic_boolean_settings_also_take_auto(raw, expected):
    assert ServerSettings().engine.overlap_steps is None
    assert parse(["--overlap-steps", raw]).engine.overlap_steps is expected
    assert parse([], {"LMSERVE_OVERLAP_STEPS": raw}).engine.overlap_steps is expected
    with pytest.raises(ValueError, match=r"--overlap-steps / LMSERVE_OVERLAP_STEPS: 'maybe' is not a valid bool "
                                         r"\(auto, true or false\)"):
        parse(["--overlap-steps", "maybe"])


def test_token_file_ignores_comments_and_rejects_empty(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("# ops team\n  alpha  \n\nbeta\n")
    assert read_tokens(f) == ("alpha", "beta")
    f.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no token"):
        read_tokens(f)
